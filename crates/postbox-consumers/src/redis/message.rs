//! From a stream entry's fields to a [`Message`], and the fields of a dead
//! copy.

use std::collections::HashMap;

use postbox_core::envelope::Envelope;
use redis::Value;

use postbox_core::wire::redis::{
    AGGREGATE_ID, AGGREGATE_VERSION, APP_CODE, CONSUMER_GROUP, CREATED_AT_MS, EVENT_ID, EVENT_TYPE,
    FIELDS, HEADERS, PAYLOAD, SOURCE_ID,
};
use postbox_core::wire::{self, CONSUME_ATTEMPT, LAST_ERROR};

use crate::message::checked_event_id;
use crate::Message;

pub(crate) fn text(fields: &HashMap<String, Value>, name: &str) -> Option<String> {
    fields
        .get(name)
        .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
}

/// Reads the fields of the Redis publisher: `event_id`, `event_type`,
/// `app_code`, `aggregate_id` and `aggregate_version` (absent when the event
/// has none), `created_at_ms`, `headers` (a JSON object) and `payload`.
/// `deliveries` is the group's delivery count of the entry, which is the
/// consumer's attempt number.
///
/// An entry without an `event_id` cannot be deduplicated and is refused with
/// the reason (the consumer dead-letters it).
pub fn message_from_entry(
    fields: &HashMap<String, Value>,
    deliveries: u32,
) -> Result<Message, String> {
    let event_id = checked_event_id(
        text(fields, EVENT_ID),
        "event_id",
        "the entry has no event_id field (postbox's Redis publisher writes one)",
    )?;
    let aggregate_version = match text(fields, AGGREGATE_VERSION) {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<i64>()
                .map_err(|_| format!("field aggregate_version is not an integer: {v:?}"))?,
        ),
    };
    let headers = match text(fields, HEADERS) {
        None => serde_json::Map::new(),
        Some(h) => match serde_json::from_str::<serde_json::Value>(&h) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => return Err(format!("field headers is not a JSON object: {h:?}")),
        },
    };
    // Verbatim: never parsed into a value and serialized back.
    let payload = Envelope::payload_of(&text(fields, PAYLOAD).unwrap_or_default());
    let attempt = deliveries.max(1);
    Ok(Message {
        envelope: Envelope {
            event_id,
            app_code: text(fields, APP_CODE).unwrap_or_default(),
            event_type: text(fields, EVENT_TYPE).unwrap_or_default(),
            aggregate_id: text(fields, AGGREGATE_ID),
            aggregate_version,
            created_at_ms: text(fields, CREATED_AT_MS)
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0),
            headers,
            payload,
        },
        attempt,
        redelivered: attempt > 1,
    })
}

/// The field/value pairs of a dead copy: the entry's own fields unchanged,
/// except `headers`, which gains `x-consume-attempt`, `x-last-error` (at
/// most 1,000 characters) and `x-dead-at-ms`, plus `consumer_group` and `source_id` (the
/// original entry's id) for whoever inspects the dead stream.
pub fn dead_fields(
    fields: &HashMap<String, Value>,
    source_id: &str,
    group: &str,
    attempt: u32,
    last_error: &str,
) -> Vec<(String, Vec<u8>)> {
    let mut headers = headers_of(fields);
    headers.insert(CONSUME_ATTEMPT.to_owned(), attempt.into());
    headers.insert(LAST_ERROR.to_owned(), wire::last_error(last_error).into());
    headers.insert(
        wire::DEAD_AT_MS.to_owned(),
        postbox_core::time::now_ms().into(),
    );
    let mut out = fields_with(fields, headers);
    out.push((CONSUMER_GROUP.to_owned(), group.as_bytes().to_vec()));
    out.push((SOURCE_ID.to_owned(), source_id.as_bytes().to_vec()));
    out
}

/// The entry's `headers` field as a JSON object (empty when absent or not
/// an object).
pub(crate) fn headers_of(
    fields: &HashMap<String, Value>,
) -> serde_json::Map<String, serde_json::Value> {
    text(fields, HEADERS)
        .and_then(|h| match serde_json::from_str(&h) {
            Ok(serde_json::Value::Object(map)) => Some(map),
            _ => None,
        })
        .unwrap_or_default()
}

/// The entry's fields in [`FIELDS`] order, `headers` replaced by `headers`,
/// then its other fields by name, without a dead copy's `consumer_group`
/// and `source_id`.
pub(crate) fn fields_with(
    fields: &HashMap<String, Value>,
    headers: serde_json::Map<String, serde_json::Value>,
) -> Vec<(String, Vec<u8>)> {
    let raw = |v: &Value| redis::from_redis_value_ref::<Vec<u8>>(v).unwrap_or_default();
    let mut out: Vec<(String, Vec<u8>)> = Vec::with_capacity(fields.len() + 3);
    let headers = serde_json::Value::Object(headers).to_string().into_bytes();
    for name in FIELDS {
        if name == HEADERS {
            out.push((name.to_owned(), headers.clone()));
        } else if let Some(v) = fields.get(name) {
            out.push((name.to_owned(), raw(v)));
        }
    }
    let mut others: Vec<_> = fields
        .iter()
        .filter(|(k, _)| {
            !FIELDS.contains(&k.as_str()) && ![CONSUMER_GROUP, SOURCE_ID].contains(&k.as_str())
        })
        .collect();
    others.sort_by(|a, b| a.0.cmp(b.0));
    out.extend(others.into_iter().map(|(k, v)| (k.clone(), raw(v))));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published() -> HashMap<String, Value> {
        [
            ("event_id", "ev-1"),
            ("event_type", "RoomCreated"),
            ("app_code", "room"),
            ("aggregate_id", "room-1"),
            ("aggregate_version", "7"),
            ("created_at_ms", "1700000000123"),
            ("headers", r#"{"tenant":"acme","x-attempt":2}"#),
            ("payload", r#"{"a":1}"#),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), Value::BulkString(v.as_bytes().to_vec())))
        .collect()
    }

    #[test]
    fn maps_the_publisher_fields_to_the_envelope() {
        let m = message_from_entry(&published(), 1).unwrap();
        let e = &m.envelope;
        crate::message::tests::assert_published(e, 2.into());
        assert_eq!((m.attempt, m.redelivered), (1, false));
        let m = message_from_entry(&published(), 4).unwrap();
        assert_eq!((m.attempt, m.redelivered), (4, true));
    }

    #[test]
    fn a_dead_copy_keeps_the_fields_and_says_why() {
        let dead = dead_fields(&published(), "1-0", "billing", 5, "boom");
        let map: HashMap<String, Value> = dead
            .into_iter()
            .map(|(k, v)| (k, Value::BulkString(v)))
            .collect();
        assert_eq!(text(&map, "source_id").as_deref(), Some("1-0"));
        assert_eq!(text(&map, "consumer_group").as_deref(), Some("billing"));
        let m = message_from_entry(&map, 1).unwrap();
        assert_eq!(m.envelope.event_id, "ev-1");
        assert_eq!(m.envelope.aggregate_version, Some(7));
        assert_eq!(m.envelope.headers[LAST_ERROR], "boom");
        assert_eq!(m.envelope.headers[CONSUME_ATTEMPT], 5);
        assert_eq!(m.envelope.headers["tenant"], "acme");
    }

    #[test]
    fn refuses_entries_without_an_event_id() {
        let mut f = published();
        f.remove("event_id");
        assert!(message_from_entry(&f, 1).unwrap_err().contains("event_id"));
        let mut f = published();
        f.insert("headers".into(), Value::BulkString(b"[1]".to_vec()));
        assert!(message_from_entry(&f, 1).is_err());
    }
}
