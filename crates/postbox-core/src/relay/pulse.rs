//! Whether the relay's claim loop goes round: the liveness `/healthz`
//! reports. Every wait of a round is bounded (a claim at twice the lease,
//! a publish at `publish_timeout`, a result write at the lease and a few
//! seconds of retries, a pause at `poll_interval` or 30 s after errors),
//! so a loop that has not gone round for [`Pulse::stalled_after`] is
//! wedged by a defect, and a supervisor restarting the process is the
//! way out. A relay whose database or broker is down still goes round
//! (its claims fail and it pauses): that is not a stall, and restarting
//! would not help.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::WorkerConfig;

/// A handle on the claim loop's last round; clones share it.
#[derive(Clone, Debug)]
pub struct Pulse {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    origin: Instant,
    /// When the last round started, in ms after `origin`.
    last_ms: AtomicU64,
    stalled_after: Duration,
}

impl Pulse {
    /// A pulse that beat now and counts as stalled `stalled_after` after
    /// its last beat.
    pub fn new(stalled_after: Duration) -> Pulse {
        Pulse {
            inner: Arc::new(Inner {
                origin: Instant::now(),
                last_ms: AtomicU64::new(0),
                stalled_after,
            }),
        }
    }

    /// The pulse of a relay with `config`: stalled after five leases and a
    /// poll interval (2.5 min by default), past the longest round the
    /// bounds allow.
    pub(super) fn of(config: &WorkerConfig) -> Pulse {
        Pulse::new(5 * config.lease.get() + config.poll_interval.get())
    }

    /// A round starts.
    pub(super) fn beat(&self) {
        let ms = self.inner.origin.elapsed().as_millis() as u64;
        self.inner.last_ms.store(ms, Ordering::Relaxed);
    }

    /// How long since the last round started.
    pub fn since_last_round(&self) -> Duration {
        let last = Duration::from_millis(self.inner.last_ms.load(Ordering::Relaxed));
        self.inner.origin.elapsed().saturating_sub(last)
    }

    /// How long after its last round the loop counts as stalled.
    pub fn stalled_after(&self) -> Duration {
        self.inner.stalled_after
    }

    /// Whether the loop has not gone round for longer than
    /// [`Pulse::stalled_after`].
    pub fn is_stalled(&self) -> bool {
        self.since_last_round() > self.inner.stalled_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pulse_stalls_without_beats_and_recovers_with_one() {
        let pulse = Pulse::new(Duration::from_millis(30));
        assert!(!pulse.is_stalled());
        std::thread::sleep(Duration::from_millis(60));
        assert!(pulse.is_stalled());
        pulse.clone().beat();
        assert!(!pulse.is_stalled(), "clones share the beat");
    }

    #[test]
    fn the_default_config_stalls_after_two_and_a_half_minutes() {
        let pulse = Pulse::of(&WorkerConfig::default());
        assert_eq!(pulse.stalled_after(), Duration::from_secs(151));
    }
}
