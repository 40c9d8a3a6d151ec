//! NATS JetStream: the dedupe key, the headers, stream and durable names,
//! subjects and the dead subject, for the publisher and the consumer alike.
//!
//! # `Nats-Msg-Id`
//!
//! The stream's dedupe key is [`msg_id`]: `<app_code>:<replay_count>:<event_id>`
//! (`%` and `:` in the app_code escaped as `%25` and `%3A`, so the key is
//! unambiguous). A re-send of the same delivery (a retry after a lost PubAck)
//! has the same key and the stream drops it inside its duplicate window; two
//! app_codes sharing an event_id do not collide; and an operator's replay,
//! which increments the row's `replay_count`, is a new key and is stored
//! again. So the key is not the event id: the event id travels in
//! [`EVENT_ID`](super::EVENT_ID), which is what consumers dedupe by.
//!
//! # Subjects
//!
//! Every placeholder of a subject template renders as exactly one subject
//! token ([`subject_token`]): in its value the characters `.`, `*`, `>`,
//! whitespace and control characters become `_` (an aggregate id `order.42`
//! is published on `….order_42`), and an empty value becomes `_`. So the
//! subjects a stream must capture ([`stream_subjects`]) are the template
//! with every token that holds a placeholder replaced by `*`:
//! `{app_code}.{event_type}` → `*.*`, `room.{aggregate_id}.events` →
//! `room.*.events`.
//!
//! # Names
//!
//! Stream and durable consumer names follow one rule, [`valid_name`].

use crate::template::Template;
use crate::EventRecord;

/// The stream's dedupe header (see the module docs).
pub const MSG_ID: &str = "Nats-Msg-Id";

/// On a dead copy: the subject the original was published on, where
/// `postbox dead replay` sends it back.
pub const SOURCE_SUBJECT: &str = "x-source-subject";

/// Headers whose name starts with this are the server's bookkeeping, not
/// the event's (compared in lower case).
pub const SERVER_HEADER_PREFIX: &str = "nats-";

/// What [`valid_name`] asks of a stream or durable consumer name, for error
/// messages.
pub const NAME_RULE: &str =
    "must be non-empty and contain no `.`, `*`, `>`, slashes, whitespace or control characters";

/// Whether `name` can name a JetStream stream or durable consumer.
///
/// Such names are subject tokens of the JetStream API and directory names
/// of its storage, so (per the NATS docs, "Naming Streams, Consumers, and
/// Accounts") they must be non-empty, without `.`, `*`, `>`, path
/// separators (`/`, `\`), whitespace (spaces, tabs, line breaks) or other
/// non-printable characters.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.chars().all(|c| {
            !matches!(c, '.' | '*' | '>' | '/' | '\\') && !c.is_whitespace() && !c.is_control()
        })
}

/// The `Nats-Msg-Id` of `record`: app_code, replay count and event id (see
/// the module docs).
pub fn msg_id(record: &EventRecord) -> String {
    let app_code = record.app_code.replace('%', "%25").replace(':', "%3A");
    format!("{app_code}:{}:{}", record.replay_count, record.event_id)
}

/// The `Nats-Msg-Id` of a dead copy: `<stream>:<stream_sequence>:dead:<durable>`,
/// where the original is stored. The same for every re-send of one copy, so
/// a copy re-sent after a lost PubAck is dropped by the dead stream's
/// duplicate window, and different for every stored original, so the dead
/// copies of a replayed event (same event id, another stream sequence), of
/// one event id under two app codes, and of two consumer groups are all
/// kept.
pub fn dead_msg_id(stream: &str, stream_sequence: u64, durable: &str) -> String {
    format!("{stream}:{stream_sequence}:dead:{durable}")
}

/// The subject of `record` under `template`: each placeholder value becomes
/// exactly one token (see the module docs).
pub fn subject_for(template: &Template, record: &EventRecord) -> String {
    template.render_escaped(record, subject_token)
}

/// A placeholder value as one subject token (see the module docs).
pub fn subject_token(value: &str) -> String {
    if value.is_empty() {
        return "_".to_owned();
    }
    value
        .chars()
        .map(|c| {
            if matches!(c, '.' | '*' | '>') || c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// The subject filter a stream needs to capture every subject of
/// `template`: each token holding a placeholder becomes `*`.
pub fn stream_subjects(template: &Template) -> String {
    const MARK: &str = "\u{0}";
    template
        .with_placeholders_as(MARK)
        .split('.')
        .map(|token| if token.contains(MARK) { "*" } else { token })
        .collect::<Vec<_>>()
        .join(".")
}

/// Whether the subject filter `filter` (with `*` and `>`) matches `subject`.
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// The consumer's default dead subject: `<stream>.dead.<durable>`.
pub fn default_dead_subject(stream: &str, durable: &str) -> String {
    format!("{stream}.dead.{durable}")
}

/// The subjects of every default dead subject of `stream`:
/// `<stream>.dead.>`, what [`dead_stream`] captures.
pub fn default_dead_subjects(stream: &str) -> String {
    format!("{stream}.dead.>")
}

/// `<stream>_dead`: the stream `declare = true` creates for dead copies when
/// no stream captures the dead subject.
pub fn dead_stream(stream: &str) -> String {
    format!("{stream}_dead")
}

/// A NATS subject: non-empty dot-separated tokens without whitespace;
/// `*` tokens and a final `>` only when `wildcards`.
pub fn valid_subject(subject: &str, wildcards: bool) -> bool {
    let tokens: Vec<&str> = subject.split('.').collect();
    let last = tokens.len() - 1;
    !subject.is_empty()
        && tokens.iter().enumerate().all(|(i, t)| {
            !t.is_empty()
                && !t.chars().any(|c| c.is_whitespace() || c.is_control())
                && match *t {
                    "*" => wildcards,
                    ">" => wildcards && i == last,
                    t => !t.contains('*') && !t.contains('>'),
                }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_nats_naming_rules() {
        for ok in ["ORDERS", "orders_v2", "room-events", "ÉVÉNEMENTS", "a:b"] {
            assert!(valid_name(ok), "{ok:?}");
        }
        for bad in [
            "", "a.b", "a*", "a>", "a/b", "a\\b", "a b", "a\tb", "a\nb", "a\u{0}b", "a\u{7f}",
            "a\u{a0}b",
        ] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    /// Regression: the stream-name rule was written twice. The publisher's
    /// (`publishers.stream`) refused only `.`, `*`, `>`, a plain space and
    /// slashes, so it accepted `ORDERS\tV2` (a tab), `ORDERS\nV2` and a
    /// no-break space, which the consumer's rule (`consumers.queue`) and
    /// the NATS docs refuse. One rule now answers for both.
    #[test]
    fn whitespace_other_than_a_space_is_refused_for_publishers_too() {
        let publisher_rule_before = |s: &str| {
            !s.is_empty()
                && !s
                    .chars()
                    .any(|ch| matches!(ch, '.' | '*' | '>' | ' ' | '/' | '\\'))
        };
        for name in ["ORDERS\tV2", "ORDERS\nV2", "ORDERS\u{a0}V2", "ORDERS\u{1b}"] {
            assert!(publisher_rule_before(name), "{name:?}");
            assert!(!valid_name(name), "{name:?}");
        }
    }

    #[test]
    fn placeholders_are_single_tokens() {
        let t = Template::parse("{app_code}.{event_type}.{aggregate_id}").unwrap();
        assert_eq!(stream_subjects(&t), "*.*.*");
        let t = Template::parse("room.{app_code}-{event_type}.x").unwrap();
        assert_eq!(stream_subjects(&t), "room.*.x");
        assert_eq!(subject_token("order.42 a>*"), "order_42_a__");
        assert_eq!(subject_token(""), "_");
    }

    #[test]
    fn the_msg_id_names_app_code_replay_and_event() {
        let mut r = crate::template::tests::record();
        r.event_id = "e1".into();
        assert_eq!(msg_id(&r), "room:0:e1");
        r.replay_count = 2;
        assert_eq!(msg_id(&r), "room:2:e1");
        // An app_code with `:` cannot pose as another app_code's key.
        r.app_code = "a:0".into();
        r.event_id = "x".into();
        r.replay_count = 0;
        let colon = msg_id(&r);
        r.app_code = "a".into();
        r.event_id = "0:x".into();
        assert_ne!(colon, msg_id(&r));
        assert_eq!(colon, "a%3A0:0:x");
    }

    #[test]
    fn dead_names() {
        assert_eq!(dead_msg_id("ROOMS", 42, "billing"), "ROOMS:42:dead:billing");
        assert_eq!(
            default_dead_subject("ORDERS", "billing"),
            "ORDERS.dead.billing"
        );
        assert!(subject_matches(
            &default_dead_subjects("ORDERS"),
            &default_dead_subject("ORDERS", "billing")
        ));
        assert_eq!(dead_stream("ORDERS"), "ORDERS_dead");
    }

    #[test]
    fn filters_match_like_nats() {
        assert!(subject_matches(">", "a.b"));
        assert!(subject_matches("a.*", "a.b"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("*.*", "S.dead.group"));
    }
}
