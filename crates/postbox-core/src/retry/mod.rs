//! What happens after an attempt: the backoff schedule and the state
//! transition, as plain functions. [`decide`] is the only place that
//! knows when a row is retried, dead-lettered, or not published at all.

mod backoff;
mod decision;

pub use backoff::{Backoff, RetryDelay};
pub use decision::{
    decide, Attempt, AttemptResult, ClaimedRow, Decision, RetryPolicy, EXPIRED_ON_LAST_ATTEMPT,
};
