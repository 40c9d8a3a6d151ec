//! How long to wait before the next connection attempt after failures.

use std::time::Duration;

/// The first retry comes after about this long.
const FIRST: Duration = Duration::from_millis(100);
/// Retries never wait longer than this, so a broker back from a restart is
/// found within seconds.
const CAP: Duration = Duration::from_secs(10);

/// Delay before the next attempt after `failures` consecutive failed
/// attempts (≥ 1): doubling from 100 ms up to 10 s, then scaled by `jitter`
/// in `[0, 1)` into the upper half of that range, so many relays that lost
/// the same broker do not reconnect in lockstep.
pub(super) fn reconnect_delay(failures: u32, jitter: f64) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    let full = FIRST.saturating_mul(1 << exp).min(CAP);
    full.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_a_tenth_of_a_second_up_to_ten_seconds() {
        assert_eq!(reconnect_delay(1, 1.0), Duration::from_millis(100));
        assert_eq!(reconnect_delay(2, 1.0), Duration::from_millis(200));
        assert_eq!(reconnect_delay(4, 1.0), Duration::from_millis(800));
        assert_eq!(reconnect_delay(8, 1.0), Duration::from_secs(10));
        assert_eq!(reconnect_delay(u32::MAX, 1.0), Duration::from_secs(10));
    }

    #[test]
    fn jitter_spreads_over_the_upper_half() {
        assert_eq!(reconnect_delay(3, 0.0), Duration::from_millis(200));
        assert_eq!(reconnect_delay(3, 0.5), Duration::from_millis(300));
        assert!(reconnect_delay(3, 0.999) < Duration::from_millis(400));
        assert_eq!(reconnect_delay(3, 7.0), Duration::from_millis(400));
    }
}
