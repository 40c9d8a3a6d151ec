//! What happens after an attempt: the backoff schedule and the state
//! transition, as plain functions.

mod backoff;
mod decision;

pub use backoff::Backoff;
pub use decision::{
    decide, may_retry, publish_after_expired_lease, AttemptResult, Decision,
    EXPIRED_ON_LAST_ATTEMPT,
};
