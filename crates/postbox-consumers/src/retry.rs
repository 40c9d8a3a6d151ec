//! When a failed message is tried again, and when it is given up.

use std::time::Duration;

/// The consumer's retry schedule: `retry_delay × 2^(attempt-1)`, capped at
/// `max_retry_delay`; after `max_attempts` failed attempts the message is
/// dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first delivery included (≥ 1).
    pub max_attempts: u32,
    /// Delay after the first failure.
    pub retry_delay: Duration,
    /// Largest delay.
    pub max_retry_delay: Duration,
}

/// What to do with a message whose handler failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Deliver it again after `delay`, as attempt `next_attempt`.
    Retry {
        /// How long it waits.
        delay: Duration,
        /// The attempt number the copy carries.
        next_attempt: u32,
    },
    /// No attempts left: park it in the dead letters.
    Dead,
}

impl RetryPolicy {
    /// The policy of a `[[consumers]]` entry.
    pub fn of(config: &postbox_core::config::ConsumerConfig) -> Self {
        RetryPolicy {
            max_attempts: config.max_attempts,
            retry_delay: config.retry_delay.get(),
            max_retry_delay: config.max_retry_delay.get(),
        }
    }

    /// The decision after `attempt` (1-based) failed.
    pub fn decide(&self, attempt: u32) -> RetryDecision {
        if attempt >= self.max_attempts {
            return RetryDecision::Dead;
        }
        RetryDecision::Retry {
            delay: self.delay_after(attempt),
            next_attempt: attempt + 1,
        }
    }

    /// The delay after failed attempt `attempt` (1-based).
    pub fn delay_after(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(31);
        self.retry_delay
            .checked_mul(1u32 << exp)
            .unwrap_or(self.max_retry_delay)
            .min(self.max_retry_delay)
    }

    /// How long after its first delivery a message may still come back:
    /// the sum of every retry delay. An inbox must remember events at least
    /// this long, or a late redelivery is handled twice.
    pub fn redelivery_horizon(&self) -> Duration {
        (1..self.max_attempts).map(|a| self.delay_after(a)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(5),
        }
    }

    #[test]
    fn delays_double_up_to_the_cap() {
        let p = policy();
        let delays: Vec<u64> = (1..=5).map(|a| p.delay_after(a).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 5, 5]);
        assert_eq!(p.delay_after(200), Duration::from_secs(5));
    }

    #[test]
    fn dead_after_max_attempts() {
        let p = policy();
        assert_eq!(
            p.decide(1),
            RetryDecision::Retry {
                delay: Duration::from_secs(1),
                next_attempt: 2
            }
        );
        assert_eq!(p.decide(5), RetryDecision::Dead);
        assert_eq!(p.decide(9), RetryDecision::Dead);
        let once = RetryPolicy {
            max_attempts: 1,
            ..p
        };
        assert_eq!(once.decide(1), RetryDecision::Dead);
    }

    #[test]
    fn horizon_sums_the_retry_delays() {
        assert_eq!(
            policy().redelivery_horizon(),
            Duration::from_secs(1 + 2 + 4 + 5)
        );
    }
}
