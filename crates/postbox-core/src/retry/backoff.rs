//! Exponential backoff with jitter.

use std::time::Duration;

use rand::Rng;

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

    /// The delay to wait after `attempt` failures, jittered into
    /// `[0.75 × base, base]`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let base = self.base_delay(attempt).as_millis() as u64;
        let spread = base / 4;
        let jitter = if spread == 0 {
            0
        } else {
            rng.random_range(0..=spread)
        };
        Duration::from_millis(base - jitter)
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
        fn jittered_delay_stays_in_bounds(attempt in 1u32..200, seed in any::<u64>()) {
            use rand::SeedableRng;
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let base = b().base_delay(attempt);
            let d = b().delay(attempt, &mut rng);
            prop_assert!(d <= base);
            prop_assert!(d >= base * 3 / 4);
            prop_assert!(d <= b().max);
        }

        #[test]
        fn base_never_decreases(attempt in 1u32..200) {
            prop_assert!(b().base_delay(attempt) <= b().base_delay(attempt + 1));
        }
    }
}
