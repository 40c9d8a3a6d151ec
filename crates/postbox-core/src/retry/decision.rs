//! Where a claimed row goes next (SPEC §3), decided without I/O: the one
//! place that knows the attempt threshold, the dead letter, and the refusal
//! to publish a row whose last allowed lease expired.

use std::time::Duration;

use super::RetryDelay;
use crate::config::Delivery;
use crate::Status;

/// The attempt budget of one row: its event type's `max_retry_count` and
/// `delivery`, after overrides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Failed attempts after which the row is dead-lettered.
    pub max_retry_count: u32,
    /// `at_most_once` rows get one try.
    pub delivery: Delivery,
}

impl RetryPolicy {
    /// True while a row with `failed_attempts` failed attempts may have
    /// another one: the one threshold behind every [`decide`] outcome.
    pub fn may_retry(&self, failed_attempts: i32) -> bool {
        self.delivery == Delivery::AtLeastOnce
            && (failed_attempts as i64) < self.max_retry_count as i64
    }
}

/// One claimed row at the moment a decision is asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempt {
    /// Just claimed: no publisher has seen it in this attempt yet.
    Claimed(ClaimedRow),
    /// Handed to the publishers that had not confirmed it; their answers.
    Published(AttemptResult),
}

/// What a claimed row brings to its attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedRow {
    /// Failed attempts so far. A row claimed from an expired lease already
    /// counts that lease (the claim raised `retry_count`).
    pub retry_count: i32,
    /// Claimed from an expired lease: its relay died or hung holding it.
    pub from_expired_lease: bool,
    /// Publishers that have confirmed it in earlier attempts.
    pub delivered_to: Vec<String>,
    /// Why no publisher could ever take it (e.g. a payload over
    /// `database.max_payload_bytes`, written by a plain INSERT that
    /// `enqueue`'s check never saw), if so.
    pub undeliverable: Option<String>,
}

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
    /// `(publisher, when it expects to have room)` for each that did not
    /// take the row this time because it is behind (its own queue is
    /// full): not an attempt.
    pub deferred: Vec<(String, Duration)>,
}

/// Where the row goes next.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Hand it to every publisher that has not confirmed it yet (only ever
    /// the answer for an [`Attempt::Claimed`]).
    Publish,
    /// Every publisher confirmed.
    Delivered,
    /// Try again after `after`; `delivered_to` keeps fanout progress.
    Retry {
        /// New failed-attempt count.
        retry_count: i32,
        /// Backoff before the next attempt.
        after: RetryDelay,
        /// Publishers that have confirmed so far.
        delivered_to: Vec<String>,
        /// Joined error text.
        error: String,
    },
    /// Not an attempt: the publishers that had room confirmed, and the
    /// ones still behind (`behind`) take the row after `after`, when they
    /// are expected to have room (SPEC §3, isolation). `retry_count` stays.
    Defer {
        /// When the publishers behind are expected to have room.
        after: Duration,
        /// Publishers that have confirmed so far.
        delivered_to: Vec<String>,
        /// The publishers that did not take the row.
        behind: Vec<String>,
    },
    /// Not published on purpose (a runtime control samples its type):
    /// `dropped`, terminal, with `reason`; no attempt counted.
    Dropped {
        /// Why, written as the row's `last_error`.
        reason: String,
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
    /// The status this decision leaves the row in.
    pub fn status(&self) -> Status {
        match self {
            Decision::Publish => Status::Delivering,
            Decision::Delivered => Status::Delivered,
            Decision::Retry { .. } | Decision::Defer { .. } => Status::Retryable,
            Decision::Failed { .. } => Status::Failed,
            Decision::Dropped { .. } => Status::Dropped,
        }
    }
}

/// The error recorded for a row not published because its last allowed
/// lease expired.
pub const EXPIRED_ON_LAST_ATTEMPT: &str =
    "lease expired on the last allowed attempt (the event may crash or hang its relay)";

/// The error recorded for a row claimed with no attempt left that was
/// not taken over from an expired lease right then.
pub const NO_ATTEMPT_LEFT: &str = "no attempt left (its last allowed attempt's lease expired before it was given back, or max_retry_count was lowered)";

/// Who a row refused before publishing is recorded as failing for.
const RELAY: &str = "relay";

/// Decides where a claimed row goes, before publishing and after.
///
/// Before ([`Attempt::Claimed`]): [`Decision::Publish`], or a dead letter
/// without publishing when no publisher could take the row, or when it was
/// claimed from an expired lease that was its last allowed attempt (the
/// event may be what crashes or hangs its relay; SPEC §3: it ends `failed`
/// instead of looping). Either way the refusal counts one more attempt.
///
/// After ([`Attempt::Published`]): one more failed attempt when any
/// publisher failed: retried after `backoff(new count)` while
/// [`RetryPolicy::may_retry`] allows, else dead-lettered. Without a
/// failure: deferred (no attempt counted) when a publisher was behind and
/// did not take it, else delivered. Never [`Decision::Publish`].
pub fn decide(
    attempt: &Attempt,
    policy: RetryPolicy,
    backoff: impl FnOnce(u32) -> RetryDelay,
) -> Decision {
    match attempt {
        Attempt::Claimed(row) => {
            let refusal = match &row.undeliverable {
                Some(why) => why.as_str(),
                None if row.from_expired_lease && !policy.may_retry(row.retry_count) => {
                    EXPIRED_ON_LAST_ATTEMPT
                }
                // Past its attempts however it was claimed: taken over on
                // its last allowed attempt, then given back (a stop, a
                // paused type, a batch that waited too long) before this
                // refusal, it came back as a due retry and went out once
                // more; or the limit was lowered since it failed.
                None if row.retry_count > 0 && !policy.may_retry(row.retry_count) => {
                    NO_ATTEMPT_LEFT
                }
                None => return Decision::Publish,
            };
            Decision::Failed {
                retry_count: row.retry_count.saturating_add(1),
                delivered_to: row.delivered_to.clone(),
                error: format!("{RELAY}: {refusal}"),
            }
        }
        Attempt::Published(result) => after_publish(result, policy, backoff),
    }
}

fn after_publish(
    result: &AttemptResult,
    policy: RetryPolicy,
    backoff: impl FnOnce(u32) -> RetryDelay,
) -> Decision {
    let mut delivered_to = result.delivered_before.clone();
    for p in &result.confirmed_now {
        if !delivered_to.contains(p) {
            delivered_to.push(p.clone());
        }
    }
    if result.errors.is_empty() {
        return match result.deferred.iter().map(|(_, after)| *after).max() {
            None => Decision::Delivered,
            Some(after) => Decision::Defer {
                after,
                delivered_to,
                behind: result.deferred.iter().map(|(p, _)| p.clone()).collect(),
            },
        };
    }
    let error = result
        .errors
        .iter()
        .map(|(p, e)| format!("{p}: {e}"))
        .collect::<Vec<_>>()
        .join("; ");
    let retry_count = result.retry_count.saturating_add(1);
    if policy.may_retry(retry_count) {
        Decision::Retry {
            retry_count,
            after: backoff(retry_count as u32),
            delivered_to,
            error,
        }
    } else {
        Decision::Failed {
            retry_count,
            delivered_to,
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy(max_retry_count: u32) -> RetryPolicy {
        RetryPolicy {
            max_retry_count,
            delivery: Delivery::AtLeastOnce,
        }
    }

    fn failing(retry_count: i32) -> Attempt {
        Attempt::Published(AttemptResult {
            retry_count,
            delivered_before: vec![],
            confirmed_now: vec!["rabbit".into()],
            errors: vec![("hook".into(), "503".into())],
            deferred: vec![],
        })
    }

    fn claimed(retry_count: i32, from_expired_lease: bool) -> Attempt {
        Attempt::Claimed(ClaimedRow {
            retry_count,
            from_expired_lease,
            delivered_to: vec!["rabbit".into()],
            undeliverable: None,
        })
    }

    fn secs(n: u32) -> Duration {
        Duration::from_secs(n as u64)
    }

    fn delay(n: u32) -> RetryDelay {
        RetryDelay {
            after: secs(n),
            jitter: Duration::ZERO,
        }
    }

    #[test]
    fn all_confirmed_is_delivered() {
        let r = Attempt::Published(AttemptResult {
            retry_count: 3,
            delivered_before: vec![],
            confirmed_now: vec!["rabbit".into()],
            errors: vec![],
            deferred: vec![],
        });
        assert_eq!(decide(&r, policy(10), delay), Decision::Delivered);
    }

    #[test]
    fn failure_retries_with_progress_kept() {
        assert_eq!(
            decide(&failing(0), policy(10), delay),
            Decision::Retry {
                retry_count: 1,
                after: delay(1),
                delivered_to: vec!["rabbit".to_string()],
                error: "hook: 503".to_string(),
            }
        );
    }

    #[test]
    fn last_attempt_dead_letters() {
        assert_eq!(
            decide(&failing(9), policy(10), delay).status(),
            Status::Failed
        );
        assert_eq!(
            decide(&failing(8), policy(10), delay).status(),
            Status::Retryable
        );
    }

    #[test]
    fn a_claimed_row_is_published_unless_its_last_lease_expired() {
        // retry_count already includes the expiry.
        assert_eq!(
            decide(&claimed(9, true), policy(10), delay),
            Decision::Publish
        );
        assert_eq!(
            decide(&claimed(9, false), policy(10), delay),
            Decision::Publish
        );
        match decide(&claimed(10, true), policy(10), delay) {
            Decision::Failed {
                retry_count,
                delivered_to,
                error,
            } => {
                assert_eq!(retry_count, 11, "the refusal counts an attempt");
                assert_eq!(delivered_to, vec!["rabbit".to_string()]);
                assert_eq!(error, format!("relay: {EXPIRED_ON_LAST_ATTEMPT}"));
            }
            other => panic!("{other:?}"),
        }
        let once = RetryPolicy {
            delivery: Delivery::AtMostOnce,
            ..policy(10)
        };
        assert_eq!(
            decide(&claimed(1, true), once, delay).status(),
            Status::Failed
        );
        assert_eq!(decide(&claimed(0, false), once, delay), Decision::Publish);
    }

    #[test]
    fn a_row_that_can_never_be_delivered_is_dead_lettered_at_once() {
        let r = Attempt::Claimed(ClaimedRow {
            retry_count: 0,
            from_expired_lease: false,
            delivered_to: vec![],
            undeliverable: Some("payload too large".into()),
        });
        match decide(&r, policy(10), delay) {
            Decision::Failed {
                retry_count, error, ..
            } => {
                assert_eq!(retry_count, 1);
                assert_eq!(error, "relay: payload too large");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_publisher_behind_defers_the_row_without_counting_an_attempt() {
        let r = Attempt::Published(AttemptResult {
            retry_count: 2,
            delivered_before: vec!["file".into()],
            confirmed_now: vec!["rabbit".into()],
            errors: vec![],
            deferred: vec![("hook".into(), secs(3)), ("nats".into(), secs(1))],
        });
        assert_eq!(
            decide(&r, policy(3), delay),
            Decision::Defer {
                after: secs(3),
                delivered_to: vec!["file".to_string(), "rabbit".to_string()],
                behind: vec!["hook".to_string(), "nats".to_string()],
            }
        );
    }

    #[test]
    fn at_most_once_never_retries() {
        let once = RetryPolicy {
            delivery: Delivery::AtMostOnce,
            ..policy(10)
        };
        assert_eq!(decide(&failing(0), once, delay).status(), Status::Failed);
    }

    fn any_policy() -> impl Strategy<Value = RetryPolicy> {
        (0u32..20, any::<bool>()).prop_map(|(max_retry_count, once)| RetryPolicy {
            max_retry_count,
            delivery: if once {
                Delivery::AtMostOnce
            } else {
                Delivery::AtLeastOnce
            },
        })
    }

    proptest! {
        /// One threshold: a failure after `n` failed attempts is retried
        /// exactly when a row whose lease expired on attempt `n + 1` (the
        /// expiry counted by the claim) is published again.
        #[test]
        fn the_skip_and_the_retry_share_one_threshold(n in 0i32..30, p in any_policy()) {
            let retried = matches!(decide(&failing(n), p, delay), Decision::Retry { .. });
            let published = decide(&claimed(n + 1, true), p, delay) == Decision::Publish;
            prop_assert_eq!(retried, published);
        }

        /// After publishing the answer is never "publish"; the count grows
        /// by one on every failure and never passes the budget while
        /// retrying; fanout progress is kept.
        #[test]
        fn a_failure_counts_one_attempt_and_keeps_progress(
            n in 0i32..30,
            p in any_policy(),
            before in proptest::collection::vec("[a-c]", 0..3),
            now in proptest::collection::vec("[a-c]", 0..3),
        ) {
            let r = Attempt::Published(AttemptResult {
                retry_count: n,
                delivered_before: before.clone(),
                confirmed_now: now.clone(),
                errors: vec![("d".into(), "down".into())],
                deferred: vec![("e".into(), secs(1))],
            });
            match decide(&r, p, delay) {
                Decision::Retry { retry_count, delivered_to, .. } => {
                    prop_assert_eq!(retry_count, n + 1);
                    prop_assert!((retry_count as u32) < p.max_retry_count);
                    prop_assert!(before.iter().chain(&now).all(|x| delivered_to.contains(x)));
                }
                Decision::Failed { retry_count, delivered_to, .. } => {
                    prop_assert_eq!(retry_count, n + 1);
                    prop_assert!(before.iter().chain(&now).all(|x| delivered_to.contains(x)));
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }

        /// A row not taken over right now is published while it has an
        /// attempt left, by the one threshold; past it (taken over on its
        /// last attempt, then given back before the refusal; or the limit
        /// lowered) it is refused, counting one more, where it was
        /// published once more.
        #[test]
        fn a_row_not_from_an_expired_lease_is_published_while_it_may_be(n in 0i32..30, p in any_policy()) {
            match decide(&claimed(n, false), p, delay) {
                Decision::Publish => prop_assert!(n == 0 || p.may_retry(n)),
                Decision::Failed { retry_count, error, .. } => {
                    prop_assert!(n > 0 && !p.may_retry(n));
                    prop_assert_eq!(retry_count, n + 1);
                    prop_assert!(error.contains(NO_ATTEMPT_LEFT), "{}", error);
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }
    }
}
