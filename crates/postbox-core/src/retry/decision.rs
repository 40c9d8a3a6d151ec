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
    /// The row can never be delivered (e.g. its payload is over
    /// `database.max_payload_bytes`): dead-lettered at once, whatever
    /// attempts are left.
    pub never_deliverable: bool,
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

/// True while a row with `failed_attempts` failed attempts may have another
/// one: the one threshold behind both the retry decision and the relay's
/// refusal to publish a row whose last allowed lease expired.
pub fn may_retry(failed_attempts: i32, max_retry_count: u32, delivery: Delivery) -> bool {
    delivery == Delivery::AtLeastOnce && (failed_attempts as i64) < max_retry_count as i64
}

/// Whether a row claimed from an expired lease is published again. The
/// expiry already counted as a failed attempt (the claim raised
/// `retry_count`); when that used up the row's attempts, or its type may be
/// tried only once, it is dead-lettered unpublished with
/// [`EXPIRED_ON_LAST_ATTEMPT`]: the event may be what crashes or hangs its
/// relay.
pub fn publish_after_expired_lease(
    retry_count: i32,
    max_retry_count: u32,
    delivery: Delivery,
) -> bool {
    may_retry(retry_count, max_retry_count, delivery)
}

/// The error recorded for a row not published because its last allowed
/// lease expired.
pub const EXPIRED_ON_LAST_ATTEMPT: &str =
    "lease expired on the last allowed attempt (the event may crash or hang its relay)";

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
    if result.never_deliverable || !may_retry(retry_count, max_retry_count, delivery) {
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
            never_deliverable: false,
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
    fn an_expired_last_lease_is_not_published_by_the_same_threshold() {
        // retry_count already includes the expiry.
        assert!(publish_after_expired_lease(9, 10, Delivery::AtLeastOnce));
        assert!(!publish_after_expired_lease(10, 10, Delivery::AtLeastOnce));
        assert!(!publish_after_expired_lease(1, 10, Delivery::AtMostOnce));
        // The same threshold as a failure's: 9 failed attempts leave one
        // more; a 10th makes the row failed.
        assert_eq!(
            decide(&failing(8), 10, Delivery::AtLeastOnce, secs).status(),
            Status::Retryable
        );
        assert_eq!(
            decide(&failing(9), 10, Delivery::AtLeastOnce, secs).status(),
            Status::Failed
        );
    }

    #[test]
    fn a_row_that_can_never_be_delivered_is_dead_lettered_at_once() {
        let r = AttemptResult {
            never_deliverable: true,
            confirmed_now: vec![],
            ..failing(0)
        };
        match decide(&r, 10, Delivery::AtLeastOnce, secs) {
            Decision::Failed { retry_count, .. } => assert_eq!(retry_count, 1),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn at_most_once_never_retries() {
        assert_eq!(
            decide(&failing(0), 10, Delivery::AtMostOnce, secs).status(),
            Status::Failed
        );
    }
}
