//! Exponential backoff with jitter.

use std::time::Duration;

/// `initial × 2^(attempt-1)`, capped at `max`, then jittered down by up to a
/// quarter so that rows failing together do not come due together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Largest delay.
    pub max: Duration,
}

impl Backoff {
    /// The un-jittered delay after `attempt` failures (attempt ≥ 1).
    pub fn base_delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(62);
        let factor = 1u64 << exp;
        let ms = (self.initial.as_millis() as u64).saturating_mul(factor);
        Duration::from_millis(ms).min(self.max)
    }

    /// The delay to wait after `attempt` failures: the base delay, to be
    /// spread down by up to a quarter (`[0.75 × base, base]`).
    pub fn delay(&self, attempt: u32) -> RetryDelay {
        let after = self.base_delay(attempt);
        RetryDelay {
            after,
            jitter: after / 4,
        }
    }
}

/// When a failed row is due again: `after` from now, spread earlier by up
/// to `jitter`. The store spreads the rows of one write by their ids
/// (`after - id mod (jitter + 1)`), so that rows failing together, which
/// one statement marks, do not come due together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetryDelay {
    /// The latest the row is due, from now.
    pub after: Duration,
    /// How much earlier a row may be due.
    pub jitter: Duration,
}

impl RetryDelay {
    /// Never due before `asked` (a target's `Retry-After`): the delay grows
    /// to it, and the spread narrows so that no row is due sooner.
    pub fn not_before(self, asked: Duration) -> RetryDelay {
        let after = self.after.max(asked);
        RetryDelay {
            after,
            jitter: self.jitter.min(after - asked.min(after)),
        }
    }

    /// The earliest a row is due, from now.
    pub fn earliest(&self) -> Duration {
        self.after.saturating_sub(self.jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b() -> Backoff {
        Backoff {
            initial: Duration::from_secs(5),
            max: Duration::from_secs(300),
        }
    }

    #[test]
    fn doubles_from_initial_to_max() {
        let got: Vec<u64> = (1..=8).map(|n| b().base_delay(n).as_secs()).collect();
        assert_eq!(got, [5, 10, 20, 40, 80, 160, 300, 300]);
    }

    proptest! {
        #[test]
        fn jittered_delay_stays_in_bounds(attempt in 1u32..200) {
            let base = b().base_delay(attempt);
            let d = b().delay(attempt);
            prop_assert_eq!(d.after, base);
            prop_assert!(d.earliest() >= base * 3 / 4);
            prop_assert!(d.after <= b().max);
        }

        /// A target's Retry-After is honoured by every row of the write:
        /// none is due before it, and the backoff still applies when
        /// it is longer.
        #[test]
        fn no_row_is_due_before_the_asked_delay(attempt in 1u32..40, asked_ms in 0u64..1_000_000) {
            let asked = Duration::from_millis(asked_ms);
            let d = b().delay(attempt).not_before(asked);
            prop_assert!(d.earliest() >= asked);
            prop_assert!(d.earliest() >= b().delay(attempt).earliest());
            prop_assert!(d.after >= b().base_delay(attempt));
        }

        #[test]
        fn base_never_decreases(attempt in 1u32..200) {
            prop_assert!(b().base_delay(attempt) <= b().base_delay(attempt + 1));
        }
    }
}
