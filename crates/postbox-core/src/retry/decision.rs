//! The state transition after an attempt (SPEC §3), decided without I/O.

use std::time::Duration;

use crate::config::Delivery;
use crate::Status;

/// What the publishers said about one row.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptResult {
    /// Failed attempts before this one (already including an expired lease).
    pub retry_count: i32,
    /// Publishers that had confirmed before this attempt.
    pub delivered_before: Vec<String>,
    /// Publishers that confirmed in this attempt.
    pub confirmed_now: Vec<String>,
    /// `(publisher, error)` for each that failed now.
    pub errors: Vec<(String, String)>,
}

/// Where the row goes next.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Every publisher confirmed.
    Delivered,
    /// Try again after `after`; `delivered_to` keeps fanout progress.
    Retry {
        /// New failed-attempt count.
        retry_count: i32,
        /// Backoff before the next attempt.
        after: Duration,
        /// Publishers that have confirmed so far.
        delivered_to: Vec<String>,
        /// Joined error text.
        error: String,
    },
    /// Dead letter.
    Failed {
        /// New failed-attempt count.
        retry_count: i32,
        /// Publishers that have confirmed so far.
        delivered_to: Vec<String>,
        /// Joined error text.
        error: String,
    },
}

impl Decision {
    /// The status this decision writes.
    pub fn status(&self) -> Status {
        match self {
            Decision::Delivered => Status::Delivered,
            Decision::Retry { .. } => Status::Retryable,
            Decision::Failed { .. } => Status::Failed,
        }
    }
}

/// Decides the next state. `backoff` maps the new attempt count to a delay.
pub fn decide(
    result: &AttemptResult,
    max_retry_count: u32,
    delivery: Delivery,
    backoff: impl FnOnce(u32) -> Duration,
) -> Decision {
    if result.errors.is_empty() {
        return Decision::Delivered;
    }
    let mut delivered_to = result.delivered_before.clone();
    for p in &result.confirmed_now {
        if !delivered_to.contains(p) {
            delivered_to.push(p.clone());
        }
    }
    let error = result
        .errors
        .iter()
        .map(|(p, e)| format!("{p}: {e}"))
        .collect::<Vec<_>>()
        .join("; ");
    let retry_count = result.retry_count.saturating_add(1);
    let out_of_attempts = retry_count as i64 >= max_retry_count as i64;
    if out_of_attempts || delivery == Delivery::AtMostOnce {
        Decision::Failed {
            retry_count,
            delivered_to,
            error,
        }
    } else {
        Decision::Retry {
            retry_count,
            after: backoff(retry_count as u32),
            delivered_to,
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failing(retry_count: i32) -> AttemptResult {
        AttemptResult {
            retry_count,
            delivered_before: vec![],
            confirmed_now: vec!["rabbit".into()],
            errors: vec![("hook".into(), "503".into())],
        }
    }

    fn secs(n: u32) -> Duration {
        Duration::from_secs(n as u64)
    }

    #[test]
    fn all_confirmed_is_delivered() {
        let r = AttemptResult {
            errors: vec![],
            ..failing(3)
        };
        assert_eq!(
            decide(&r, 10, Delivery::AtLeastOnce, secs),
            Decision::Delivered
        );
    }

    #[test]
    fn failure_retries_with_progress_kept() {
        match decide(&failing(0), 10, Delivery::AtLeastOnce, secs) {
            Decision::Retry {
                retry_count,
                after,
                delivered_to,
                error,
            } => {
                assert_eq!(retry_count, 1);
                assert_eq!(after, secs(1));
                assert_eq!(delivered_to, vec!["rabbit".to_string()]);
                assert_eq!(error, "hook: 503");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn last_attempt_dead_letters() {
        assert_eq!(
            decide(&failing(9), 10, Delivery::AtLeastOnce, secs).status(),
            Status::Failed
        );
        assert_eq!(
            decide(&failing(8), 10, Delivery::AtLeastOnce, secs).status(),
            Status::Retryable
        );
    }

    #[test]
    fn at_most_once_never_retries() {
        assert_eq!(
            decide(&failing(0), 10, Delivery::AtMostOnce, secs).status(),
            Status::Failed
        );
    }
}
