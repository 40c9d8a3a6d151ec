//! What happens after an attempt: the backoff schedule and the state
//! transition, as plain functions.

mod backoff;
mod decision;

pub use backoff::Backoff;
pub use decision::{decide, AttemptResult, Decision};
