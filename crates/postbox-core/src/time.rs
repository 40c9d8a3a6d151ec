//! Wall-clock helpers. Leases are judged on the database clock; these are
//! only for display and for values the caller supplies.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch on this host's clock.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Parses a time given on the command line: an RFC 3339 timestamp
/// (`2026-11-30T10:00:00Z`), epoch milliseconds, or a duration meaning "that
/// long ago" (`15m`, `2h`, `7d`). Returns epoch milliseconds.
pub fn parse_time_arg(s: &str, now_ms: i64) -> Result<i64, String> {
    let s = s.trim();
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    if let Ok(ts) = humantime::parse_rfc3339_weak(s) {
        return ts
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .map_err(|_| format!("`{s}` is before 1970"));
    }
    if let Ok(ago) = humantime::parse_duration(s) {
        return Ok(now_ms - ago.as_millis() as i64);
    }
    Err(format!(
        "`{s}` is not a time: use RFC 3339 (2026-11-30T10:00:00Z), epoch milliseconds, or a duration ago (15m, 7d)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms() {
        assert_eq!(
            parse_time_arg("1700000000000", 0).unwrap(),
            1_700_000_000_000
        );
        assert_eq!(parse_time_arg("1970-01-01T00:00:01Z", 0).unwrap(), 1000);
        assert_eq!(parse_time_arg("15m", 1_000_000).unwrap(), 100_000);
        assert!(parse_time_arg("yesterday", 0).is_err());
    }
}
