//! Durations written as `"250ms"`, `"5s"`, `"5m"`, `"30d"`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A `std::time::Duration` read from a humane string.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// From seconds.
    pub const fn secs(s: u64) -> Self {
        HumanDuration(Duration::from_secs(s))
    }

    /// From milliseconds.
    pub const fn millis(ms: u64) -> Self {
        HumanDuration(Duration::from_millis(ms))
    }

    /// The duration.
    pub fn get(self) -> Duration {
        self.0
    }

    /// Whole milliseconds, saturating.
    pub fn as_millis_i64(self) -> i64 {
        i64::try_from(self.0.as_millis()).unwrap_or(i64::MAX)
    }
}

impl fmt::Debug for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl std::str::FromStr for HumanDuration {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        humantime::parse_duration(s.trim())
            .map(HumanDuration)
            .map_err(|e| {
                format!(
                    "`{s}` is not a duration ({e}); write e.g. \"250ms\", \"5s\", \"5m\", \"30d\""
                )
            })
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_spec_examples() {
        for (s, ms) in [
            ("250ms", 250),
            ("5s", 5_000),
            ("5m", 300_000),
            ("30d", 2_592_000_000),
        ] {
            assert_eq!(
                s.parse::<HumanDuration>().unwrap().as_millis_i64(),
                ms,
                "{s}"
            );
        }
        assert!("5 parsecs".parse::<HumanDuration>().is_err());
        assert!("".parse::<HumanDuration>().is_err());
    }
}
