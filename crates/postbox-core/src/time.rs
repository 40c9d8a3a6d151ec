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
/// (`2026-11-30T10:00:00Z`, `2026-11-30 18:00:00.5+08:00`; without an
/// offset it is UTC), a date (`2026-11-30`, its midnight UTC), epoch
/// milliseconds, or a duration meaning "that long ago" (`15m`, `2h`, `7d`).
/// Returns epoch milliseconds.
///
/// Epoch *seconds* (`date +%s`, 10 digits) are refused rather than read as
/// milliseconds of January 1970: a replay from then would send everything.
pub fn parse_time_arg(s: &str, now_ms: i64) -> Result<i64, String> {
    let s = s.trim();
    if let Ok(ms) = s.parse::<i64>() {
        if (SECONDS_LOOKALIKE).contains(&ms) {
            return Err(format!(
                "`{s}` looks like epoch seconds: give epoch milliseconds (`{s}000`) or RFC 3339"
            ));
        }
        return Ok(ms);
    }
    if let Some(parsed) = parse_timestamp(s) {
        return parsed;
    }
    if let Ok(ago) = humantime::parse_duration(s) {
        return Ok(now_ms - ago.as_millis() as i64);
    }
    Err(format!(
        "`{s}` is not a time: use RFC 3339 (2026-11-30T10:00:00Z), a date (2026-11-30), epoch milliseconds, or a duration ago (15m, 7d)"
    ))
}

/// Epoch values that are seconds from 2001 to 5138 and, read as
/// milliseconds, January 1970 (no outbox row is that old).
const SECONDS_LOOKALIKE: std::ops::Range<i64> = 1_000_000_000..100_000_000_000;

/// `s` as a date or an RFC 3339 timestamp in epoch milliseconds; `None`
/// when it does not start like a date (`YYYY-MM-DD`), so it may be
/// something else; an error naming what is wrong when it does.
fn parse_timestamp(s: &str) -> Option<Result<i64, String>> {
    use time::format_description::well_known::Rfc3339;
    let b = s.as_bytes();
    let date_like = b.len() >= 10
        && b[..10].iter().enumerate().all(|(i, c)| {
            if i == 4 || i == 7 {
                *c == b'-'
            } else {
                c.is_ascii_digit()
            }
        });
    if !date_like {
        return None;
    }
    let mut text = if b.len() == 10 {
        format!("{s}T00:00:00Z")
    } else {
        // RFC 3339 allows a space (or `t`) between date and time.
        let (date, rest) = s.split_at(10);
        let rest = rest.strip_prefix([' ', 't', 'T']).unwrap_or(rest);
        format!("{date}T{rest}")
    };
    // No offset after the time: UTC.
    let time = &text[11..];
    if !(time.ends_with(['Z', 'z']) || time.contains(['+', '-'])) {
        text.push('Z');
    }
    let parsed = time::OffsetDateTime::parse(&text, &Rfc3339)
        .map_err(|e| format!("`{s}` is not an RFC 3339 time ({e})"))
        .map(|t| (t.unix_timestamp_nanos() / 1_000_000) as i64);
    Some(parsed)
}

/// Refuses a time range that holds no time: `since` at or after `until`
/// (`--since 1h --until 2h`, the two swapped), which matched nothing and
/// said so as "0 events".
pub fn check_range(since_ms: Option<i64>, until_ms: Option<i64>) -> Result<(), String> {
    match (since_ms, until_ms) {
        (Some(since), Some(until)) if since >= until => {
            Err("since is not before until: the range holds no time (the two swapped?)".to_owned())
        }
        _ => Ok(()),
    }
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

    /// An offset is applied, with or without a fraction, after a `T` or a
    /// space (what `date --rfc-3339=ns` and Python's `isoformat()` print);
    /// the weak parser read `10:00:00.123+08:00` as 10:00 UTC.
    #[test]
    fn offsets_are_applied() {
        let utc = parse_time_arg("2026-11-30T02:00:00Z", 0).unwrap();
        for s in [
            "2026-11-30T10:00:00+08:00",
            "2026-11-30T10:00:00.000+08:00",
            "2026-11-30 10:00:00.000000000+08:00",
            "2026-11-29T21:00:00-05:00",
            "2026-11-30t02:00:00z",
            "2026-11-30T02:00:00",
            "2026-11-30 02:00:00",
        ] {
            assert_eq!(parse_time_arg(s, 0), Ok(utc), "{s}");
        }
        assert_eq!(
            parse_time_arg("2026-11-30T10:00:00.5+08:00", 0),
            Ok(utc + 500)
        );
    }

    #[test]
    fn a_date_is_its_midnight_utc() {
        assert_eq!(
            parse_time_arg("2026-11-30", 0),
            parse_time_arg("2026-11-30T00:00:00Z", 0)
        );
        let e = parse_time_arg("2026-13-01", 0).unwrap_err();
        assert!(e.contains("2026-13-01"), "{e}");
    }

    #[test]
    fn epoch_seconds_are_refused() {
        let e = parse_time_arg("1764460800", 0).unwrap_err();
        assert!(e.contains("epoch seconds"), "{e}");
        assert_eq!(parse_time_arg("1764460800000", 0), Ok(1_764_460_800_000));
        assert_eq!(parse_time_arg("0", 0), Ok(0));
    }
}
