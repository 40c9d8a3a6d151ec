//! Runtime controls (SPEC §10): delivery changed while relays run, stored
//! in `<table>_controls` so that every relay on every host applies a change
//! within [`REFRESH`], without a restart; every change is logged in
//! `<table>_control_log` (who, when, what).
//!
//! A control is keyed by `(app_code, event_type)`, either of which may be
//! [`ANY`]. For an event, each field is taken from the most specific
//! control that sets it — `(app, type)`, `(app, *)`, `(*, type)`, `(*, *)` —
//! then from the config file (`[outbox_worker.event_types.<T>]`, then
//! `[outbox_worker]`). `paused` stops the relays claiming the key's rows:
//! they stay `pending`, the other app_codes and event types go on. A
//! paused app_code (`event_type = "*"`) is not claimed at all; a paused
//! event type is left out of the pending claims, and a due retry or an
//! expired lease of it that a claim takes is given back (the pause counts
//! no attempt). `sample_percent` delivers that share of the key's events
//! ([`sampled_in`]) and marks the others `dropped`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::Delivery;

/// "Any app_code" or "any event type" in a control's key.
pub const ANY: &str = "*";

/// How old the relay's copy of the controls may be when it claims.
pub const REFRESH: Duration = Duration::from_secs(1);

/// One control as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Control {
    /// The app_code, or [`ANY`].
    pub app_code: String,
    /// The event type, or [`ANY`].
    pub event_type: String,
    /// The relays claim none of the key's rows (they stay `pending`).
    #[serde(default)]
    pub paused: bool,
    /// Overrides the delivery guarantee.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Delivery>,
    /// Overrides `max_retry_count`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retry_count: Option<u32>,
    /// Delivers this percentage of the key's events (0–100) and marks the
    /// others `dropped`, with the reason: for high-rate types a later event
    /// supersedes anyway. Which events is decided by their event_id, the
    /// same on every relay; a replayed event is always delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_percent: Option<u8>,
    /// When it was last set, epoch ms (the database's clock).
    #[serde(default)]
    pub updated_at_ms: i64,
    /// Who set it (`cli <user>@<host>`, `api <token name>@<ip>`).
    #[serde(default)]
    pub updated_by: String,
}

impl Control {
    /// The control of `(app_code, event_type)` that sets nothing yet.
    pub fn new(app_code: &str, event_type: &str) -> Control {
        Control {
            app_code: app_code.to_owned(),
            event_type: event_type.to_owned(),
            paused: false,
            delivery: None,
            max_retry_count: None,
            sample_percent: None,
            updated_at_ms: 0,
            updated_by: String::new(),
        }
    }

    /// What the control sets, for the log: `paused`, `delivery=…`,
    /// `max_retry_count=…`, or `nothing`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.paused {
            parts.push("paused".to_owned());
        }
        if let Some(d) = self.delivery {
            parts.push(format!("delivery={}", delivery_name(d)));
        }
        if let Some(n) = self.max_retry_count {
            parts.push(format!("max_retry_count={n}"));
        }
        if let Some(p) = self.sample_percent {
            parts.push(format!("sample_percent={p}"));
        }
        if parts.is_empty() {
            "nothing".to_owned()
        } else {
            parts.join(" ")
        }
    }

    /// Checks the key and the fields.
    pub fn validate(&self) -> Result<(), String> {
        if self.app_code.is_empty() || self.event_type.is_empty() {
            return Err("app_code and event_type must be given (`*` for any)".to_owned());
        }
        if self.app_code.len() > 64 || self.event_type.len() > 128 {
            return Err("app_code is at most 64 bytes, event_type at most 128".to_owned());
        }
        if self.sample_percent.is_some_and(|p| p > 100) {
            return Err("sample_percent is a percentage: 0 to 100".to_owned());
        }
        Ok(())
    }
}

/// A change to the control of one key: each field given replaces the
/// stored one (`Some(None)`: back to the config's value).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControlChange {
    /// Pause or resume (`Some(false)`).
    pub paused: Option<bool>,
    /// The delivery guarantee, or `Some(None)` for the config's.
    pub delivery: Option<Option<Delivery>>,
    /// `max_retry_count`, or `Some(None)` for the config's.
    pub max_retry_count: Option<Option<u32>>,
    /// `sample_percent`, or `Some(None)` for every event.
    pub sample_percent: Option<Option<u8>>,
}

impl ControlChange {
    /// The control of `(app_code, event_type)` after this change to
    /// `current` (the stored one, if any).
    pub fn apply(&self, app_code: &str, event_type: &str, current: Option<&Control>) -> Control {
        let mut c = current
            .cloned()
            .unwrap_or_else(|| Control::new(app_code, event_type));
        if let Some(p) = self.paused {
            c.paused = p;
        }
        if let Some(d) = self.delivery {
            c.delivery = d;
        }
        if let Some(n) = self.max_retry_count {
            c.max_retry_count = n;
        }
        if let Some(p) = self.sample_percent {
            c.sample_percent = p;
        }
        c
    }
}

/// A control that sets nothing is no control:
/// `change_control` (the store module) clears it instead.
pub fn sets_nothing(c: &Control) -> bool {
    !c.paused && c.delivery.is_none() && c.max_retry_count.is_none() && c.sample_percent.is_none()
}

/// Parses `at_least_once`, `at_most_once`, or `default` (`None`).
pub fn parse_delivery(s: &str) -> Result<Option<Delivery>, String> {
    match s {
        "at_least_once" => Ok(Some(Delivery::AtLeastOnce)),
        "at_most_once" => Ok(Some(Delivery::AtMostOnce)),
        "default" => Ok(None),
        other => Err(format!(
            "`{other}` is no delivery: at_least_once, at_most_once, or default (the config's)"
        )),
    }
}

/// Parses a number up to `max` (`max_retry_count`, `sample_percent`), or
/// `default` (`None`: back to the config's, or every event).
pub fn parse_number(s: &str, max: u32) -> Result<Option<u32>, String> {
    match s {
        "default" => Ok(None),
        n => n
            .parse::<u32>()
            .ok()
            .filter(|n| *n <= max)
            .map(Some)
            .ok_or_else(|| format!("`{n}` is neither a number up to {max} nor `default`")),
    }
}

/// `at_least_once` or `at_most_once`.
pub fn delivery_name(d: Delivery) -> &'static str {
    match d {
        Delivery::AtLeastOnce => "at_least_once",
        Delivery::AtMostOnce => "at_most_once",
    }
}

/// One entry of the control log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ControlLogEntry {
    /// When, epoch ms (the database's clock).
    pub at_ms: i64,
    /// Who.
    pub by: String,
    /// The control's app_code.
    pub app_code: String,
    /// The control's event type.
    pub event_type: String,
    /// What it sets now (`Control::describe`), or `cleared`.
    pub change: String,
}

/// The controls a relay applies: a snapshot of the table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Controls {
    all: Vec<Control>,
}

impl Controls {
    /// The snapshot of `all`.
    pub fn new(all: Vec<Control>) -> Controls {
        Controls { all }
    }

    /// Every control, as stored.
    pub fn all(&self) -> &[Control] {
        &self.all
    }

    /// Whether the relays claim none of `app_code`'s rows.
    pub fn paused(&self, app_code: &str) -> bool {
        self.all.iter().any(|c| {
            c.paused && c.event_type == ANY && (c.app_code == app_code || c.app_code == ANY)
        })
    }

    /// The event types paused for `app_code` (by controls keyed by a
    /// type; a whole app_code is [`Controls::paused`]), which its pending
    /// claims leave out.
    pub fn paused_types(&self, app_code: &str) -> Vec<String> {
        let mut types: Vec<String> = self
            .all
            .iter()
            .filter(|c| {
                c.paused && c.event_type != ANY && (c.app_code == app_code || c.app_code == ANY)
            })
            .map(|c| c.event_type.clone())
            .collect();
        types.sort_unstable();
        types.dedup();
        types
    }

    /// Whether any control pauses anything.
    pub fn any_paused(&self) -> bool {
        self.all.iter().any(|c| c.paused)
    }

    /// Whether a row of `event_type` in `app_code` may not be published
    /// now: its app_code or its type is paused.
    pub fn holds(&self, app_code: &str, event_type: &str) -> bool {
        self.all.iter().any(|c| {
            c.paused
                && (c.app_code == app_code || c.app_code == ANY)
                && (c.event_type == event_type || c.event_type == ANY)
        })
    }

    /// The most specific control's value of `field` for an event.
    fn pick<T>(
        &self,
        app_code: &str,
        event_type: &str,
        field: impl Fn(&Control) -> Option<T>,
    ) -> Option<T> {
        [
            (app_code, event_type),
            (app_code, ANY),
            (ANY, event_type),
            (ANY, ANY),
        ]
        .into_iter()
        .find_map(|(a, t)| {
            self.all
                .iter()
                .find(|c| c.app_code == a && c.event_type == t)
                .and_then(&field)
        })
    }

    /// `max_retry_count` for an event, when a control sets it.
    pub fn max_retry_count(&self, app_code: &str, event_type: &str) -> Option<u32> {
        self.pick(app_code, event_type, |c| c.max_retry_count)
    }

    /// The percentage of an event's type to deliver, when a control
    /// samples it.
    pub fn sample_percent(&self, app_code: &str, event_type: &str) -> Option<u8> {
        self.pick(app_code, event_type, |c| c.sample_percent)
    }

    /// The delivery guarantee for an event, when a control sets it.
    pub fn delivery(&self, app_code: &str, event_type: &str) -> Option<Delivery> {
        self.pick(app_code, event_type, |c| c.delivery)
    }
}

/// Whether sampling at `percent` delivers the event `event_id`: a hash of
/// the id (FNV-1a, the same on every host and release) below `percent` of
/// 100, so every relay, and a relay after a restart, decides alike.
pub fn sampled_in(event_id: &str, percent: u8) -> bool {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in event_id.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash % 100 < u64::from(percent)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sampling keeps about the share asked, the same events every time.
    #[test]
    fn sampling_keeps_about_the_share_asked_the_same_events_every_time() {
        let ids: Vec<String> = (0..10_000).map(|_| crate::event::new_event_id()).collect();
        let kept = ids.iter().filter(|id| sampled_in(id, 50)).count();
        assert!((4_500..5_500).contains(&kept), "{kept} of 10,000 at 50 %");
        assert!(ids
            .iter()
            .all(|id| sampled_in(id, 50) == sampled_in(id, 50)));
        assert!(ids
            .iter()
            .all(|id| sampled_in(id, 100) && !sampled_in(id, 0)));
        let at_10 = ids.iter().filter(|id| sampled_in(id, 10)).count();
        assert!((700..1_300).contains(&at_10), "{at_10} of 10,000 at 10 %");
    }

    #[test]
    fn a_number_is_up_to_its_maximum_or_default() {
        assert_eq!(parse_number("25", 100), Ok(Some(25)));
        assert_eq!(parse_number("default", 100), Ok(None));
        assert!(parse_number("150", 100).unwrap_err().contains("up to 100"));
        assert!(parse_number("lots", 100).is_err());
    }

    fn control(app: &str, ty: &str) -> Control {
        Control::new(app, ty)
    }

    impl Controls {
        fn validate_all(&self) -> bool {
            self.all.iter().all(|c| c.validate().is_ok())
        }
    }

    #[test]
    fn the_most_specific_control_that_sets_a_field_wins() {
        let c = Controls::new(vec![
            Control {
                max_retry_count: Some(9),
                ..control(ANY, ANY)
            },
            Control {
                max_retry_count: Some(0),
                ..control("room", "Tick")
            },
            Control {
                delivery: Some(Delivery::AtMostOnce),
                ..control(ANY, "Tick")
            },
            Control {
                paused: true,
                ..control("wallet", ANY)
            },
        ]);
        assert_eq!(c.max_retry_count("room", "Tick"), Some(0));
        assert_eq!(c.max_retry_count("room", "Other"), Some(9));
        assert_eq!(c.delivery("game", "Tick"), Some(Delivery::AtMostOnce));
        assert_eq!(c.delivery("game", "Other"), None);
        assert!(c.paused("wallet") && !c.paused("room"));
        let all = Controls::new(vec![Control {
            paused: true,
            ..control(ANY, ANY)
        }]);
        assert!(all.paused("room"));
    }

    #[test]
    fn a_pause_holds_its_app_code_or_its_type() {
        let c = Controls::new(vec![
            Control {
                paused: true,
                ..control("room", "Tick")
            },
            Control {
                paused: true,
                ..control(ANY, "Audit")
            },
            Control {
                paused: true,
                ..control("wallet", ANY)
            },
            Control {
                max_retry_count: Some(1),
                ..control("room", "Other")
            },
        ]);
        assert!(c.validate_all());
        assert_eq!(c.paused_types("room"), ["Audit", "Tick"]);
        assert_eq!(c.paused_types("game"), ["Audit"]);
        assert!(!c.paused("room"), "a type's pause is not its app_code's");
        assert!(c.any_paused() && !Controls::default().any_paused());
        assert!(c.holds("room", "Tick") && c.holds("game", "Audit") && c.holds("wallet", "X"));
        assert!(!c.holds("room", "Other") && !c.holds("game", "Tick"));
        assert!(control("", ANY).validate().is_err());
        assert_eq!(
            Control {
                max_retry_count: Some(0),
                delivery: Some(Delivery::AtMostOnce),
                ..control("a", "b")
            }
            .describe(),
            "delivery=at_most_once max_retry_count=0"
        );
    }
}
