//! How a lease is spent: the one rule that validation, `doctor` and the
//! relay share (SPEC §3: `publish_timeout` must leave the lease room to mark
//! the result; a config the relay cannot honour is refused).
//!
//! ```text
//!  claim ─┬─ wait behind the batch in flight ─┬─ publish ─┬─ mark ─┐ lease end
//!         │   (≤ publish_timeout)              │ (≤ p._t.) │ (≥ 1/5 lease)
//! ```

use std::time::Duration;

use super::WorkerConfig;
use crate::Error;

/// The relay's lease arithmetic for one `[outbox_worker]` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseBudget {
    /// `outbox_worker.lease`.
    pub lease: Duration,
    /// `outbox_worker.publish_timeout`: bound on every single publish.
    pub publish_timeout: Duration,
}

impl LeaseBudget {
    /// The budget of a worker config.
    pub fn of(worker: &WorkerConfig) -> Self {
        LeaseBudget {
            lease: worker.lease.get(),
            publish_timeout: worker.publish_timeout.get(),
        }
    }

    /// The end of the lease kept for writing the result: a fifth of it.
    pub fn mark_reserve(&self) -> Duration {
        self.lease / 5
    }

    /// Age of a claim by which every publish of its batch must have ended
    /// (the lease minus the mark reserve). Results not in by then count as
    /// timed out.
    pub fn publish_deadline(&self) -> Duration {
        self.lease.saturating_sub(self.mark_reserve())
    }

    /// True when a publish started at claim age `age` ends, even if it takes
    /// the whole `publish_timeout`, by the publish deadline. A batch that
    /// fails this is released unstarted.
    pub fn may_start_publish(&self, age: Duration) -> bool {
        age.saturating_add(self.publish_timeout) <= self.publish_deadline()
    }

    /// Ok when the relay can honour the pair: a batch claimed while the one
    /// before it publishes waits up to one `publish_timeout` and may still
    /// start, i.e. `2 × publish_timeout ≤ 4/5 × lease`. The error says what
    /// to change.
    pub fn check(&self) -> Result<(), String> {
        if self.may_start_publish(self.publish_timeout) {
            return Ok(());
        }
        let max_timeout = self.lease * 2 / 5;
        let min_lease = self.publish_timeout * 5 / 2;
        Err(format!(
            "{} leaves outbox_worker.lease ({}) no room to deliver: a batch waits up to one publish_timeout behind the batch in flight, publishes for up to publish_timeout, and a fifth of the lease is kept to mark the result; use publish_timeout ≤ {} or lease ≥ {}",
            humantime::format_duration(self.publish_timeout),
            humantime::format_duration(self.lease),
            humantime::format_duration(max_timeout),
            humantime::format_duration(min_lease),
        ))
    }

    /// [`LeaseBudget::check`] as the config error validation, the relay and
    /// `doctor` report: it names `outbox_worker.publish_timeout`.
    pub fn check_config(&self) -> Result<(), Error> {
        self.check()
            .map_err(|reason| Error::config("outbox_worker.publish_timeout", reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(lease_ms: u64, timeout_ms: u64) -> LeaseBudget {
        LeaseBudget {
            lease: Duration::from_millis(lease_ms),
            publish_timeout: Duration::from_millis(timeout_ms),
        }
    }

    #[test]
    fn the_defaults_fit() {
        let b = LeaseBudget::of(&WorkerConfig::default());
        assert!(b.check().is_ok());
        assert_eq!(b.mark_reserve(), Duration::from_secs(6));
        assert_eq!(b.publish_deadline(), Duration::from_secs(24));
    }

    /// Issue 9.2: validation accepted this pair, and the relay released
    /// every batch unstarted.
    #[test]
    fn a_pair_the_relay_cannot_honour_is_refused() {
        let b = budget(3_000, 2_500);
        assert!(!b.may_start_publish(Duration::ZERO));
        let e = b.check().unwrap_err();
        assert!(e.contains("publish_timeout ≤ 1s 200ms"), "{e}");
        assert!(e.contains("lease ≥ 6s 250ms"), "{e}");
    }

    #[test]
    fn accepted_pairs_can_publish_a_batch_that_waited_one_publish() {
        for (lease, timeout) in [(3_000, 1_200), (30_000, 3_000), (10_000, 4_000), (1, 0)] {
            let b = budget(lease, timeout);
            assert!(b.check().is_ok(), "{b:?}");
            assert!(b.may_start_publish(Duration::ZERO), "{b:?}");
            assert!(b.may_start_publish(b.publish_timeout), "{b:?}");
        }
        for (lease, timeout) in [(3_000, 1_201), (10_000, 4_001), (30_000, 30_000)] {
            assert!(budget(lease, timeout).check().is_err(), "{lease} {timeout}");
        }
    }

    #[test]
    fn a_batch_that_waited_too_long_is_not_started() {
        let b = budget(10_000, 2_000);
        assert!(b.may_start_publish(Duration::from_millis(6_000)));
        assert!(!b.may_start_publish(Duration::from_millis(6_001)));
    }
}
