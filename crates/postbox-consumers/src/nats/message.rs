//! From a JetStream message to a [`Message`], and the headers of a dead copy.

use async_nats::HeaderMap;
use postbox_core::envelope::Envelope;

use postbox_core::wire::nats::{dead_msg_id, SERVER_HEADER_PREFIX};
use postbox_core::wire::{
    self, AGGREGATE_ID, AGGREGATE_VERSION, APP_CODE, CONSUME_ATTEMPT, CREATED_AT_MS, EVENT_TYPE,
    LAST_ERROR,
};

use crate::message::checked_event_id;
use crate::Message;

/// The stream's dedupe header. The publisher makes it of app_code, replay
/// count and event id (SPEC §4), so it is not the event id: consumers dedupe
/// by `x-event-id`.
pub const MSG_ID: &str = wire::nats::MSG_ID;
/// The event id, set by the publisher and kept on a dead copy (whose
/// `Nats-Msg-Id` is made of the original's stream sequence and the consumer
/// group, see [`dead_headers`]).
pub const EVENT_ID: &str = wire::EVENT_ID;

/// Reads the SPEC §4 mapping of the NATS publisher: `x-event-id` is the
/// event id (`Nats-Msg-Id` only on messages without it, as published before
/// postbox set `x-event-id`), `x-event-type`, `x-app-code`,
/// `x-aggregate-id`, `x-aggregate-version` and `x-created-at-ms` the envelope
/// fields of those names; every other header (`x-attempt`, `x-replayed`, the
/// service's own) stays in `envelope.headers` as a string. `delivered` is
/// JetStream's delivery count, which is the consumer's attempt number.
///
/// A message without an event id cannot be deduplicated and is refused with
/// the reason (the consumer dead-letters it).
pub fn message_from_nats(
    headers: Option<&HeaderMap>,
    subject: &str,
    payload: &[u8],
    delivered: u32,
) -> Result<Message, String> {
    let mut msg_id = None;
    let mut event_id = None;
    let mut event_type = None;
    let mut app_code = None;
    let mut aggregate_id = None;
    let mut aggregate_version = None;
    let mut created_at_ms = None;
    let mut extra = serde_json::Map::new();
    for (name, values) in headers.into_iter().flat_map(|h| h.iter()) {
        let Some(value) = values.last().map(|v| v.as_str().to_owned()) else {
            continue;
        };
        let key: &str = name.as_ref();
        match key.to_ascii_lowercase().as_str() {
            k if k.eq_ignore_ascii_case(MSG_ID) => msg_id = Some(value),
            EVENT_ID => event_id = Some(value),
            EVENT_TYPE => event_type = Some(value),
            APP_CODE => app_code = Some(value),
            AGGREGATE_ID => aggregate_id = Some(value),
            AGGREGATE_VERSION => {
                aggregate_version = Some(value.trim().parse::<i64>().map_err(|_| {
                    format!("header {AGGREGATE_VERSION} is not an integer: {value:?}")
                })?)
            }
            CREATED_AT_MS => created_at_ms = value.trim().parse::<i64>().ok(),
            // Server bookkeeping, not the event's.
            k if k.starts_with(SERVER_HEADER_PREFIX) => {}
            _ => {
                extra.insert(key.to_owned(), serde_json::Value::String(value));
            }
        }
    }
    let event_id = checked_event_id(
        event_id.or(msg_id),
        "the event id",
        "the message has no x-event-id (nor Nats-Msg-Id) header: postbox publishes the event_id in x-event-id",
    )?;
    // Verbatim: never parsed into a value and serialized back.
    let payload = Envelope::payload_of_bytes(payload);
    let attempt = delivered.max(1);
    Ok(Message {
        envelope: Envelope {
            event_id,
            app_code: app_code.unwrap_or_default(),
            event_type: event_type.unwrap_or_else(|| subject.to_owned()),
            aggregate_id,
            aggregate_version,
            created_at_ms: created_at_ms.unwrap_or(0),
            headers: extra,
            payload,
        },
        attempt,
        redelivered: attempt > 1,
    })
}

/// Headers of a dead copy: the original's, with `x-event-id`, the attempt
/// count, the last error (one line, at most 1,000 characters), the time
/// (`x-dead-at-ms`), the original's subject (`x-source-subject`) and a
/// `Nats-Msg-Id` of `<stream>:<stream_sequence>:dead:<durable>` (where the
/// original is stored; see [`dead_msg_id`] for why).
#[allow(clippy::too_many_arguments)]
pub fn dead_headers(
    original: Option<&HeaderMap>,
    event_id: Option<&str>,
    subject: &str,
    stream: &str,
    stream_sequence: u64,
    durable: &str,
    attempt: u32,
    last_error: &str,
) -> HeaderMap {
    let mut h = original.cloned().unwrap_or_default();
    // A header value is one line.
    let error = wire::last_error(last_error).replace(|c: char| c.is_control(), " ");
    h.insert(CONSUME_ATTEMPT, attempt.to_string().as_str());
    h.insert(LAST_ERROR, error.as_str());
    h.insert(
        wire::DEAD_AT_MS,
        postbox_core::time::now_ms().to_string().as_str(),
    );
    h.insert(wire::nats::SOURCE_SUBJECT, subject);
    if let Some(id) = event_id {
        h.insert(EVENT_ID, id);
    }
    h.insert(
        MSG_ID,
        dead_msg_id(stream, stream_sequence, durable).as_str(),
    );
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(MSG_ID, "room:1:ev-1");
        h.insert(EVENT_ID, "ev-1");
        h.insert(EVENT_TYPE, "RoomCreated");
        h.insert(APP_CODE, "room");
        h.insert(AGGREGATE_ID, "room-1");
        h.insert(AGGREGATE_VERSION, "7");
        h.insert(CREATED_AT_MS, "1700000000123");
        h.insert("x-attempt", "2");
        h.insert("tenant", "acme");
        h
    }

    #[test]
    fn maps_the_publisher_headers_to_the_envelope() {
        let m =
            message_from_nats(Some(&published()), "room.RoomCreated", br#"{"a":1}"#, 1).unwrap();
        let e = &m.envelope;
        crate::message::tests::assert_published(e, "2".into());
        assert_eq!(e.headers.len(), 2, "{:?}", e.headers);
        assert_eq!((m.attempt, m.redelivered), (1, false));
    }

    #[test]
    fn a_message_without_x_event_id_falls_back_to_the_msg_id() {
        let mut h: HeaderMap = published()
            .iter()
            .filter(|(name, _)| ![EVENT_ID, MSG_ID].contains(&AsRef::<str>::as_ref(*name)))
            .flat_map(|(name, values)| values.iter().map(move |v| (name.clone(), v.clone())))
            .collect();
        h.insert(MSG_ID, "ev-0");
        let m = message_from_nats(Some(&h), "s", b"{}", 1).unwrap();
        assert_eq!(m.envelope.event_id, "ev-0");
    }

    #[test]
    fn the_delivery_count_is_the_attempt() {
        let m = message_from_nats(Some(&published()), "s", b"x", 3).unwrap();
        assert_eq!((m.attempt, m.redelivered), (3, true));
        assert_eq!(m.envelope.payload.get(), r#""x""#);
    }

    #[test]
    fn a_dead_copy_keeps_the_event_and_says_why() {
        let h = dead_headers(
            Some(&published()),
            Some("ev-1"),
            "rooms.RoomCreated",
            "ROOMS",
            42,
            "billing",
            5,
            "boom\nline two",
        );
        assert_eq!(h.get(MSG_ID).unwrap().as_str(), "ROOMS:42:dead:billing");
        assert_eq!(h.get(LAST_ERROR).unwrap().as_str(), "boom line two");
        assert_eq!(
            h.get(wire::nats::SOURCE_SUBJECT).unwrap().as_str(),
            "rooms.RoomCreated"
        );
        assert!(
            h.get(wire::DEAD_AT_MS)
                .unwrap()
                .as_str()
                .parse::<i64>()
                .unwrap()
                > 0
        );
        let m = message_from_nats(Some(&h), "s", b"{}", 1).unwrap();
        assert_eq!(m.envelope.event_id, "ev-1");
        assert_eq!(m.envelope.headers[CONSUME_ATTEMPT], "5");
    }

    #[test]
    fn refuses_messages_without_an_event_id() {
        let err = message_from_nats(None, "s", b"{}", 1).unwrap_err();
        assert!(err.contains("x-event-id"), "{err}");
        let mut h = published();
        h.insert(AGGREGATE_VERSION, "seven");
        assert!(message_from_nats(Some(&h), "s", b"{}", 1).is_err());
    }
}
