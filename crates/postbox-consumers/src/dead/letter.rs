//! What `postbox dead` works on: one dead letter as read from a broker, the
//! filter that picks letters, and the report of a pass over them.

use postbox_core::envelope::Envelope;
use serde::Serialize;

/// One message in a consumer's dead letters, whatever the broker.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeadLetter {
    /// Where the broker holds it: the dead stream's sequence (NATS), the
    /// entry id (Redis), the message's place in `<queue>.dead` counted from
    /// 1 at the time of reading (RabbitMQ, which has no id of its own).
    pub position: String,
    /// `None` for a message that was dead-lettered because it had no usable
    /// event id.
    pub event_id: Option<String>,
    /// The event type (empty when unreadable).
    pub event_type: String,
    /// The app code (empty when unreadable).
    pub app_code: String,
    /// The aggregate, when the event has one.
    pub aggregate_id: Option<String>,
    /// Created, epoch ms (0 when unknown).
    pub created_at_ms: i64,
    /// When it was dead-lettered, epoch ms: the copy's `x-dead-at-ms`, else
    /// the broker's own time of the copy (NATS, Redis); `None` on a
    /// RabbitMQ copy made before postbox stamped the time.
    pub dead_at_ms: Option<i64>,
    /// The consumer's attempts before it gave up (`x-consume-attempt`).
    pub attempts: Option<u32>,
    /// The handler's last error, or why the message was unreadable.
    pub last_error: Option<String>,
    /// The message's headers as the broker holds them.
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// The body, as text (lossy for a body that is not UTF-8).
    pub payload: String,
}

impl DeadLetter {
    /// A letter from the fields every broker's mapping reads (`parsed`,
    /// or the reason it could not be read) and the copy's headers.
    pub(crate) fn of(
        position: String,
        parsed: Result<Envelope, String>,
        headers: serde_json::Map<String, serde_json::Value>,
        body: &[u8],
        broker_time_ms: Option<i64>,
    ) -> DeadLetter {
        use postbox_core::wire::{CONSUME_ATTEMPT, DEAD_AT_MS, LAST_ERROR};
        let int = |name: &str| {
            headers.get(name).and_then(|v| match v {
                serde_json::Value::Number(n) => n.as_i64(),
                serde_json::Value::String(s) => s.trim().parse().ok(),
                _ => None,
            })
        };
        let last_error = headers
            .get(LAST_ERROR)
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned));
        let attempts = int(CONSUME_ATTEMPT).and_then(|a| u32::try_from(a).ok());
        let dead_at_ms = int(DEAD_AT_MS).or(broker_time_ms);
        let payload = String::from_utf8_lossy(body).into_owned();
        match parsed {
            Ok(e) => DeadLetter {
                position,
                event_id: Some(e.event_id),
                event_type: e.event_type,
                app_code: e.app_code,
                aggregate_id: e.aggregate_id,
                created_at_ms: e.created_at_ms,
                dead_at_ms,
                attempts,
                last_error,
                headers,
                payload,
            },
            Err(unreadable) => DeadLetter {
                position,
                event_id: None,
                event_type: String::new(),
                app_code: String::new(),
                aggregate_id: None,
                created_at_ms: 0,
                dead_at_ms,
                attempts,
                last_error: last_error.or(Some(unreadable)),
                headers,
                payload,
            },
        }
    }
}

/// Which dead letters a pass takes; every given field must match.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeadFilter {
    /// The event id.
    pub event_id: Option<String>,
    /// The event type.
    pub event_type: Option<String>,
    /// Dead-lettered at or after (epoch ms); a letter without a time does
    /// not match a time filter.
    pub since_ms: Option<i64>,
    /// Dead-lettered before (epoch ms).
    pub until_ms: Option<i64>,
    /// Text the last error contains, compared without case.
    pub error: Option<String>,
}

impl DeadFilter {
    /// Whether it takes every letter (no field given): a replay or purge
    /// must then say `all`. An empty text is no filter (`--error
    /// "$UNSET"`): it would match every letter, and must not stand in for
    /// `all`.
    pub fn is_empty(&self) -> bool {
        given(&self.event_id).is_none()
            && given(&self.event_type).is_none()
            && given(&self.error).is_none()
            && self.since_ms.is_none()
            && self.until_ms.is_none()
    }

    /// Whether `letter` is one this filter takes.
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        let text =
            |want: &Option<String>, have: Option<&str>| given(want).is_none_or(|w| have == Some(w));
        let time = |bound: Option<i64>, ok: fn(i64, i64) -> bool| {
            bound.is_none_or(|b| letter.dead_at_ms.is_some_and(|t| ok(t, b)))
        };
        text(&self.event_id, letter.event_id.as_deref())
            && text(&self.event_type, Some(&letter.event_type))
            && time(self.since_ms, |t, b| t >= b)
            && time(self.until_ms, |t, b| t < b)
            && given(&self.error).is_none_or(|want| {
                letter
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.to_lowercase().contains(&want.to_lowercase()))
            })
    }
}

/// A text filter as given: `None` when absent or empty.
fn given(text: &Option<String>) -> Option<&str> {
    text.as_deref().filter(|t| !t.is_empty())
}

/// What a pass does with the letters its filter takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadAction {
    /// Read them; change nothing. At most this many are returned.
    List(usize),
    /// Send each back to the consumer's main queue (keeping its event id,
    /// marked `x-replayed`, its attempt count and last error cleared), then
    /// remove it from the dead letters.
    Replay,
    /// Remove them.
    Purge,
}

impl DeadAction {
    /// A replay or a purge: it must take a filter, or say it takes all.
    pub fn changes(self) -> bool {
        !matches!(self, DeadAction::List(_))
    }

    /// Whether the pass changes the broker (not a list, not a dry run).
    pub(crate) fn writes(self, dry_run: bool) -> bool {
        !dry_run && self.changes()
    }

    /// How many matching letters the report carries.
    pub(crate) fn keep(self) -> usize {
        match self {
            DeadAction::List(limit) => limit,
            // A replay or purge reports a sample of what it took.
            DeadAction::Replay | DeadAction::Purge => 20,
        }
    }
}

/// What a pass over a consumer's dead letters did.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct DeadReport {
    /// Where the letters are (`<queue>.dead`, the dead subject, `<stream>.dead`).
    pub dead_letters: String,
    /// Letters read.
    pub scanned: u64,
    /// Letters the filter took (of those read: a list stops reading once it
    /// has its limit, see `complete`).
    pub matched: u64,
    /// Whether the pass read every letter there was when it began (a list
    /// that reached its limit stops early).
    pub complete: bool,
    /// Letters replayed or purged (0 on a list or a dry run).
    pub done: u64,
    /// The first matching letters (all of a list up to its limit; a sample
    /// of a replay or purge).
    pub letters: Vec<DeadLetter>,
}

impl DeadReport {
    pub(crate) fn new(dead_letters: String) -> DeadReport {
        DeadReport {
            dead_letters,
            ..DeadReport::default()
        }
    }

    /// Whether a list has its limit of letters: the pass stops reading.
    pub(crate) fn full(&self, action: DeadAction) -> bool {
        matches!(action, DeadAction::List(limit) if self.letters.len() >= limit)
    }

    /// Counts `letter` as read and, when the filter took it, keeps it (up
    /// to what `action` keeps). Returns whether it matched.
    pub(crate) fn saw(
        &mut self,
        letter: &DeadLetter,
        filter: &DeadFilter,
        action: DeadAction,
    ) -> bool {
        self.scanned += 1;
        if !filter.matches(letter) {
            return false;
        }
        self.matched += 1;
        if self.letters.len() < action.keep() {
            self.letters.push(letter.clone());
        }
        true
    }
}

/// Called as a pass goes: letters read so far, letters replayed or purged.
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Send + Sync);

/// The headers a replay leaves out of a dead copy: the consumer's attempt
/// count (it starts afresh), last error and dead time.
pub const CLEARED_ON_REPLAY: [&str; 3] = [
    postbox_core::wire::CONSUME_ATTEMPT,
    postbox_core::wire::LAST_ERROR,
    postbox_core::wire::DEAD_AT_MS,
];

/// The headers a replayed copy carries: the dead copy's, without
/// [`CLEARED_ON_REPLAY`], marked replayed (NATS, Redis).
#[cfg_attr(not(any(feature = "nats", feature = "redis")), allow(dead_code))]
pub(crate) fn replay_headers(
    mut headers: serde_json::Map<String, serde_json::Value>,
) -> serde_json::Map<String, serde_json::Value> {
    for name in CLEARED_ON_REPLAY {
        headers.remove(name);
    }
    headers.insert(postbox_core::wire::REPLAYED.to_owned(), true.into());
    headers
}

/// A broker's failure: where the dead letters are, and what failed.
pub(crate) type Failed = (String, String);

/// What one pass is asked to do, for the broker that runs it.
pub(crate) struct Pass<'a> {
    pub config: &'a postbox_core::config::ConsumerConfig,
    pub action: DeadAction,
    pub filter: &'a DeadFilter,
    pub dry_run: bool,
    pub progress: Progress<'a>,
}

/// A pass reports its progress every this many letters.
const PROGRESS_EVERY: u64 = 200;

impl Pass<'_> {
    /// Whether the pass changes the broker.
    pub fn writes(&self) -> bool {
        self.action.writes(self.dry_run)
    }

    /// After each letter: whether the pass stops here (a list that has its
    /// limit); reports progress every [`PROGRESS_EVERY`] letters and when
    /// it stops.
    pub fn stops_after(&self, report: &DeadReport) -> bool {
        let full = report.full(self.action);
        if full || report.scanned % PROGRESS_EVERY == 0 {
            (self.progress)(report.scanned, report.done);
        }
        full
    }

    /// The report of a pass that read every letter there was.
    pub fn finished(&self, mut report: DeadReport) -> DeadReport {
        report.complete = true;
        (self.progress)(report.scanned, report.done);
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter() -> DeadLetter {
        let mut headers = serde_json::Map::new();
        headers.insert("x-consume-attempt".into(), "5".into());
        headers.insert("x-last-error".into(), "HTTP 500: Boom".into());
        headers.insert("x-dead-at-ms".into(), 1_000.into());
        headers.insert("tenant".into(), "acme".into());
        let e = Envelope {
            event_id: "e1".into(),
            app_code: "room".into(),
            event_type: "RoomCreated".into(),
            aggregate_id: None,
            aggregate_version: None,
            created_at_ms: 7,
            headers: serde_json::Map::new(),
            payload: Envelope::payload_of("{}"),
        };
        DeadLetter::of("3".into(), Ok(e), headers, b"{}", Some(2_000))
    }

    /// `--error "$UNSET"`: an empty text filters nothing, so it needs
    /// `all` like no filter at all; it took every letter before.
    #[test]
    fn an_empty_text_is_no_filter() {
        let empty = DeadFilter {
            error: Some(String::new()),
            event_type: Some(String::new()),
            ..DeadFilter::default()
        };
        assert!(empty.is_empty());
        let some = DeadFilter {
            error: Some("timeout".into()),
            ..DeadFilter::default()
        };
        assert!(!some.is_empty());
        assert!(!some.matches(&letter()), "the letter's error is HTTP 500");
    }

    #[test]
    fn a_letter_reads_its_attempts_error_and_time_from_the_copy() {
        let l = letter();
        assert_eq!(l.attempts, Some(5));
        assert_eq!(l.last_error.as_deref(), Some("HTTP 500: Boom"));
        // The stamped time wins over the broker's.
        assert_eq!(l.dead_at_ms, Some(1_000));
        let unreadable = DeadLetter::of(
            "1".into(),
            Err("no id".into()),
            serde_json::Map::new(),
            b"\xff",
            Some(9),
        );
        assert_eq!(unreadable.event_id, None);
        assert_eq!(unreadable.last_error.as_deref(), Some("no id"));
        assert_eq!(unreadable.dead_at_ms, Some(9));
    }

    #[test]
    fn every_given_filter_field_must_match() {
        let l = letter();
        assert!(DeadFilter::default().matches(&l));
        // Whether the default filter with `set` applied takes the letter.
        let takes = |set: fn(&mut DeadFilter)| {
            let mut f = DeadFilter::default();
            set(&mut f);
            f.matches(&l)
        };
        assert!(takes(|f| f.event_type = Some("RoomCreated".into())));
        assert!(!takes(|f| f.event_type = Some("Other".into())));
        assert!(takes(|f| f.error = Some("boom".into())));
        assert!(!takes(|f| f.error = Some("timeout".into())));
        assert!(takes(|f| {
            f.since_ms = Some(1_000);
            f.until_ms = Some(1_001);
        }));
        assert!(!takes(|f| f.until_ms = Some(1_000)));
        assert!(takes(|f| f.event_id = Some("e1".into())));
        assert!(!takes(|f| f.event_id = Some("e2".into())));
    }

    #[test]
    fn a_replayed_copy_starts_its_attempts_afresh_and_says_it_is_a_replay() {
        let h = replay_headers(letter().headers);
        assert_eq!(h.get("x-replayed"), Some(&true.into()));
        assert!(!h.contains_key("x-consume-attempt"));
        assert!(!h.contains_key("x-last-error"));
        assert!(!h.contains_key("x-dead-at-ms"));
        assert_eq!(h["tenant"], "acme");
    }
}
