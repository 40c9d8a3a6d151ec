//! A range-partitioned outbox table (`[database] partitioning`): one
//! partition per UTC day or ISO week of `created_at_ms`, named by the day
//! it starts (`room_outbox_p20261204`), kept ahead of the clock, and
//! archived whole once every row in it is done.

use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

const DAY_MS: i64 = 86_400_000;

/// How the outbox table is partitioned on `created_at_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Partitioning {
    /// One partition per UTC day.
    Daily,
    /// One partition per week, Monday 00:00 UTC to Monday.
    Weekly,
}

/// `[database] partitioning`: `"none"` (a plain table), `"daily"` or
/// `"weekly"`.
pub fn deserialize_partitioning<'de, D>(d: D) -> Result<Option<Partitioning>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum Given {
        None,
        Daily,
        Weekly,
    }
    Ok(match Given::deserialize(d)? {
        Given::None => None,
        Given::Daily => Some(Partitioning::Daily),
        Given::Weekly => Some(Partitioning::Weekly),
    })
}

/// One partition's range of `created_at_ms`, `[from_ms, to_ms)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    /// First millisecond in it.
    pub from_ms: i64,
    /// First millisecond after it.
    pub to_ms: i64,
}

impl Partitioning {
    /// How many partitions `migrate` and the relay keep ready beyond the
    /// current one: two weeks of days, or six weeks.
    pub fn ahead(self) -> u32 {
        match self {
            Partitioning::Daily => 14,
            Partitioning::Weekly => 6,
        }
    }

    fn span_ms(self) -> i64 {
        match self {
            Partitioning::Daily => DAY_MS,
            Partitioning::Weekly => 7 * DAY_MS,
        }
    }

    /// The partition holding `ms`.
    pub fn range_of(self, ms: i64) -> Range {
        // 1970-01-01 was a Thursday: weeks start 3 days later (a Monday).
        let offset = match self {
            Partitioning::Daily => 0,
            Partitioning::Weekly => 4 * DAY_MS,
        };
        let from_ms = (ms - offset).div_euclid(self.span_ms()) * self.span_ms() + offset;
        Range {
            from_ms,
            to_ms: from_ms + self.span_ms(),
        }
    }

    /// The current partition and the [`Partitioning::ahead`] after it, for
    /// the clock `now_ms`.
    pub fn wanted(self, now_ms: i64) -> Vec<Range> {
        let first = self.range_of(now_ms).from_ms;
        (0..=i64::from(self.ahead()))
            .map(|i| Range {
                from_ms: first + i * self.span_ms(),
                to_ms: first + (i + 1) * self.span_ms(),
            })
            .collect()
    }
}

impl Partitioning {
    /// How `range` was partitioned: a UTC day, an ISO week, or neither.
    pub fn of_range(range: &Range) -> Option<Partitioning> {
        [Partitioning::Daily, Partitioning::Weekly]
            .into_iter()
            .find(|p| p.range_of(range.from_ms) == *range)
    }

    /// `daily` or `weekly`, as the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Partitioning::Daily => "daily",
            Partitioning::Weekly => "weekly",
        }
    }

    /// The range of the partition named `name` (`<table>_p<yyyymmdd>`).
    pub fn range_named(self, table: &str, name: &str) -> Option<Range> {
        let date = name.strip_prefix(table)?.strip_prefix("_p")?;
        if date.len() != 8 || !date.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let at = format!("{}-{}-{}T00:00:00Z", &date[..4], &date[4..6], &date[6..]);
        let start = humantime::parse_rfc3339(&at).ok()?;
        let ms = start.duration_since(UNIX_EPOCH).ok()?.as_millis() as i64;
        let range = self.range_of(ms);
        (range.from_ms == ms).then_some(range)
    }
}

impl Range {
    /// Whether `ms` falls in the range (`from_ms` included, `to_ms` not).
    pub fn contains(&self, ms: i64) -> bool {
        self.from_ms <= ms && ms < self.to_ms
    }

    /// The partition's table name: `<table>_p<yyyymmdd of its start>`.
    pub fn name(&self, table: &str) -> String {
        let start = UNIX_EPOCH + Duration::from_millis(self.from_ms.max(0) as u64);
        let date: String = humantime::format_rfc3339_seconds(start)
            .to_string()
            .chars()
            .take(10)
            .filter(|c| *c != '-')
            .collect();
        format!("{table}_p{date}")
    }
}

/// `doctor` fails with fewer partitions than this ready after the current
/// one.
pub const MINIMUM_AHEAD: u32 = 2;

/// How often a relay makes sure partitions are ready ahead.
pub const KEEP_EVERY: Duration = Duration::from_secs(600);

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-12-04T10:30:00Z, a Friday.
    const NOW: i64 = 1_796_380_200_000;

    #[test]
    fn days_and_weeks_start_at_utc_midnight_and_monday() {
        let day = Partitioning::Daily.range_of(NOW);
        assert_eq!(day.name("o"), "o_p20261204");
        assert_eq!(day.to_ms - day.from_ms, DAY_MS);
        assert!(day.from_ms <= NOW && NOW < day.to_ms);
        let week = Partitioning::Weekly.range_of(NOW);
        assert_eq!(week.name("o"), "o_p20261130", "the Monday before");
        assert!(week.from_ms <= NOW && NOW < week.to_ms);
        assert_eq!(Partitioning::Weekly.range_of(week.from_ms), week);
        assert_eq!(Partitioning::Weekly.range_of(week.to_ms - 1), week);
        assert_eq!(
            Partitioning::Daily.range_named("o", "o_p20261204"),
            Some(day)
        );
        assert_eq!(
            Partitioning::Weekly.range_named("o", "o_p20261130"),
            Some(week)
        );
        assert_eq!(
            Partitioning::Weekly.range_named("o", "o_p20261204"),
            None,
            "not a Monday"
        );
        assert_eq!(Partitioning::Daily.range_named("o", "o_archive"), None);
    }

    #[test]
    fn wanted_is_the_current_partition_and_those_ahead_back_to_back() {
        let wanted = Partitioning::Daily.wanted(NOW);
        assert_eq!(wanted.len(), 15);
        assert_eq!(wanted[0].name("o"), "o_p20261204");
        assert_eq!(wanted[14].name("o"), "o_p20261218");
        assert!(wanted.windows(2).all(|w| w[0].to_ms == w[1].from_ms));
        assert_eq!(Partitioning::Weekly.wanted(NOW).len(), 7);
    }
}
