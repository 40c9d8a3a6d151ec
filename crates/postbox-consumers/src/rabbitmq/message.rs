//! From an AMQP delivery to a [`Message`], and back to the properties of a
//! retry or dead copy.

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation};
use postbox_core::envelope::Envelope;

use postbox_core::wire::rabbitmq::{is_death_header, DELIVERY_COUNT, PERSISTENT};
use postbox_core::wire::{self, AGGREGATE_ID, AGGREGATE_VERSION, CONSUME_ATTEMPT, CREATED_AT_MS};

use crate::message::checked_event_id;
use crate::ordering::Hold;
use crate::Message;

/// On a copy held back behind a lapsed hold (`ordering =
/// "per_aggregate"`): that hold as found, `{event_id}@{until_ms}`, so that
/// on its return the consumer can tell whether the held event came by
/// meanwhile ([`crate::ordering`]). Consumer bookkeeping: not in the
/// envelope's headers, and not carried over to any other copy.
pub(crate) const NOTED_HOLD: &str = "x-postbox-noted-hold";

/// The lapsed hold a copy noted when it was held back ([`NOTED_HOLD`]).
pub(crate) fn noted_hold(properties: &BasicProperties) -> Option<Hold> {
    let value = properties.headers().as_ref()?.inner().get(NOTED_HOLD)?;
    let (event_id, until_ms) = as_string(value)?
        .rsplit_once('@')
        .and_then(|(e, u)| Some((e.to_owned(), u.parse().ok()?)))?;
    Some(Hold { event_id, until_ms })
}

/// Reads the SPEC §4 mapping of the RabbitMQ publisher: `message_id` is the
/// event id, `type` the event type, `app_id` the app code, and the
/// `x-aggregate-id`, `x-aggregate-version`, `x-created-at-ms` headers the
/// envelope fields of those names. Every other header (`x-attempt`,
/// `x-replayed`, the service's own) stays in `envelope.headers`.
///
/// A message without a usable `message_id` cannot be deduplicated and is
/// refused with the reason (the consumer dead-letters it).
pub fn message_from_delivery(
    properties: &BasicProperties,
    routing_key: &str,
    body: &[u8],
    redelivered: bool,
) -> Result<Message, String> {
    let event_id = checked_event_id(
        short(properties.message_id()),
        "message_id",
        "the message has no message_id property (postbox publishes the event_id there)",
    )?;
    let mut headers = serde_json::Map::new();
    let mut aggregate_id = None;
    let mut aggregate_version = None;
    let mut created_at_ms = None;
    let mut attempt = 1;
    if let Some(table) = properties.headers() {
        for (key, value) in table {
            let key = key.as_str();
            match key {
                AGGREGATE_ID => aggregate_id = as_string(value),
                AGGREGATE_VERSION => {
                    aggregate_version = Some(as_i64(value).ok_or_else(|| {
                        format!("header {AGGREGATE_VERSION} is not an integer: {value:?}")
                    })?)
                }
                CREATED_AT_MS => created_at_ms = as_i64(value),
                CONSUME_ATTEMPT => {
                    attempt = as_i64(value)
                        .and_then(|a| u32::try_from(a).ok())
                        .filter(|a| *a >= 1)
                        .unwrap_or(1);
                    headers.insert(key.to_owned(), to_json(value));
                }
                // Broker bookkeeping of dead-lettering, and the consumer's
                // of ordering: not the event's.
                k if is_death_header(k) || k == NOTED_HOLD => {}
                _ => {
                    headers.insert(key.to_owned(), to_json(value));
                }
            }
        }
    }
    let created_at_ms = created_at_ms
        .or_else(|| {
            properties
                .timestamp()
                .map(|s| (s as i64).saturating_mul(1000))
        })
        .unwrap_or(0);
    // Verbatim: never parsed into a value and serialized back.
    let payload = Envelope::payload_of_bytes(body);
    Ok(Message {
        envelope: Envelope {
            event_id,
            app_code: short(properties.app_id()).unwrap_or_default(),
            event_type: short(properties.kind()).unwrap_or_else(|| routing_key.to_owned()),
            aggregate_id,
            aggregate_version,
            created_at_ms,
            headers,
            payload,
        },
        attempt,
        redelivered,
    })
}

/// How often a quorum queue delivered this copy before (its
/// `x-delivery-count` header); 0 on classic queues, which only set the
/// `redelivered` flag.
pub(crate) fn delivery_count(properties: &BasicProperties) -> u32 {
    properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(DELIVERY_COUNT))
        .and_then(|v| u32::try_from(as_i64(v)?).ok())
        .unwrap_or(0)
}

/// Properties of a copy: the original's identity and headers, persistent,
/// with the next attempt number, and either a delay (`expiration`) or the
/// last error and the time it was dead-lettered; `noted`, the lapsed hold
/// a held-back copy goes round behind ([`NOTED_HOLD`]).
pub(crate) fn copy_properties(
    original: &BasicProperties,
    next_attempt: u32,
    expiration_ms: Option<u128>,
    last_error: Option<&str>,
    noted: Option<&Hold>,
) -> BasicProperties {
    // `x-delivery-count` counted deliveries of the original, not of this
    // copy; a hold the original noted was noted for its own round.
    let mut headers = headers_without(original, &[DELIVERY_COUNT, NOTED_HOLD]);
    headers.insert(
        CONSUME_ATTEMPT.into(),
        AMQPValue::LongLongInt(i64::from(next_attempt)),
    );
    if let Some(hold) = noted {
        headers.insert(
            NOTED_HOLD.into(),
            AMQPValue::LongString(format!("{}@{}", hold.event_id, hold.until_ms).into()),
        );
    }
    if let Some(e) = last_error {
        headers.insert(
            wire::LAST_ERROR.into(),
            AMQPValue::LongString(wire::last_error(e).into()),
        );
        headers.insert(
            wire::DEAD_AT_MS.into(),
            AMQPValue::LongLongInt(postbox_core::time::now_ms()),
        );
    }
    with_identity(original, headers, expiration_ms)
}

/// Properties of a dead copy sent back to its queue (`postbox dead
/// replay`): the copy's identity and headers without the consumer's attempt
/// count, last error and dead time, and the broker's dead-lettering
/// bookkeeping, marked `x-replayed`.
pub(crate) fn replay_properties(dead: &BasicProperties) -> BasicProperties {
    let mut headers = headers_without(dead, &crate::dead::letter::CLEARED_ON_REPLAY);
    headers.insert(wire::REPLAYED.into(), AMQPValue::Boolean(true));
    with_identity(dead, headers, None)
}

/// The headers of `original` but `dropped` (and the broker's
/// dead-lettering bookkeeping).
fn headers_without(original: &BasicProperties, dropped: &[&str]) -> FieldTable {
    original
        .headers()
        .as_ref()
        .map(|h| {
            h.into_iter()
                .filter(|(k, _)| {
                    let k = k.as_str();
                    !(dropped.contains(&k) || k == DELIVERY_COUNT || is_death_header(k))
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<std::collections::BTreeMap<_, _>>()
                .into()
        })
        .unwrap_or_default()
}

/// `headers` on a persistent message carrying `original`'s identity (and
/// a delay, `expiration_ms`, when given).
fn with_identity(
    original: &BasicProperties,
    headers: FieldTable,
    expiration_ms: Option<u128>,
) -> BasicProperties {
    let mut p = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_headers(headers);
    // The original's properties that are set, each by its getter and setter.
    macro_rules! keep {
        ($($get:ident => $set:ident),+) => {
            $(if let Some(v) = original.$get() {
                p = p.$set(v.to_owned());
            })+
        };
    }
    keep!(
        message_id => with_message_id,
        kind => with_type,
        app_id => with_app_id,
        timestamp => with_timestamp,
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        correlation_id => with_correlation_id
    );
    if let Some(ms) = expiration_ms {
        p = p.with_expiration(ShortString::from(ms.max(1).to_string()));
    }
    p
}

fn short(v: &Option<ShortString>) -> Option<String> {
    v.as_ref().map(|s| s.as_str().to_owned())
}

fn as_string(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::Void => None,
        other => as_i64(other).map(|i| i.to_string()),
    }
}

fn as_i64(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortShortUInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortUInt(i) => Some(i64::from(*i)),
        AMQPValue::LongInt(i) => Some(i64::from(*i)),
        AMQPValue::LongUInt(i) => Some(i64::from(*i)),
        AMQPValue::LongLongInt(i) => Some(*i),
        AMQPValue::Timestamp(i) => i64::try_from(*i).ok(),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.trim().parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().trim().parse().ok(),
        _ => None,
    }
}

fn to_json(v: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::Float(f) => {
            serde_json::Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number)
        }
        AMQPValue::Double(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            Value::String(as_string(v).unwrap_or_default())
        }
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(to_json).collect()),
        AMQPValue::FieldTable(t) => Value::Object(table_to_json(t)),
        AMQPValue::ByteArray(b) => {
            Value::String(String::from_utf8_lossy(b.as_slice()).into_owned())
        }
        AMQPValue::Void => Value::Null,
        AMQPValue::DecimalValue(d) => Value::String(format!("{d:?}")),
        other => as_i64(other).map_or(Value::Null, |i| Value::Number(i.into())),
    }
}

/// Whether the broker confirmed a copy published to `queue` with
/// `mandatory` set.
pub(crate) fn confirmed(confirm: Confirmation, queue: &str) -> Result<(), String> {
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(format!(
            "{queue} does not exist (the copy was returned unroutable): declare it, or set declare = true"
        )),
        Confirmation::Nack(_) => Err(format!("the broker refused the copy to {queue}")),
        Confirmation::NotRequested => Err("publisher confirms are off".to_owned()),
    }
}

/// Every header of a message, as JSON (the broker's dead-lettering
/// bookkeeping included).
pub(crate) fn headers_json(p: &BasicProperties) -> serde_json::Map<String, serde_json::Value> {
    p.headers().as_ref().map(table_to_json).unwrap_or_default()
}

fn table_to_json(t: &FieldTable) -> serde_json::Map<String, serde_json::Value> {
    t.into_iter()
        .map(|(k, v)| (k.as_str().to_owned(), to_json(v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props() -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert(AGGREGATE_ID.into(), AMQPValue::LongString("room-1".into()));
        h.insert(AGGREGATE_VERSION.into(), AMQPValue::LongLongInt(7));
        h.insert(
            CREATED_AT_MS.into(),
            AMQPValue::LongLongInt(1_700_000_000_123),
        );
        h.insert("x-attempt".into(), AMQPValue::LongInt(2));
        h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        BasicProperties::default()
            .with_message_id("ev-1".into())
            .with_type("RoomCreated".into())
            .with_app_id("room".into())
            .with_headers(h)
    }

    #[test]
    fn maps_the_publisher_headers_to_the_envelope() {
        let m = message_from_delivery(&props(), "rk", br#"{"a":1}"#, false).unwrap();
        let e = &m.envelope;
        crate::message::tests::assert_published(e, 2.into());
        assert!(!e.headers.contains_key(AGGREGATE_ID));
        assert_eq!(m.attempt, 1);
    }

    #[test]
    fn a_copy_carries_the_next_attempt_and_is_read_back() {
        let copy = copy_properties(&props(), 3, Some(2000), None, None);
        assert_eq!(copy.expiration().as_ref().unwrap().as_str(), "2000");
        assert_eq!(copy.delivery_mode(), &Some(2));
        let m = message_from_delivery(&copy, "rk", b"not json", true).unwrap();
        assert_eq!(m.attempt, 3);
        assert_eq!(m.envelope.event_id, "ev-1");
        assert_eq!(m.envelope.payload.get(), r#""not json""#);
        let dead = copy_properties(&copy, 4, None, Some("boom"), None);
        assert!(dead.expiration().is_none());
        let h = dead.headers().as_ref().unwrap();
        assert!(h.contains_key(wire::LAST_ERROR));
    }

    #[test]
    fn a_noted_hold_is_read_back_and_carried_by_no_other_copy() {
        let hold = Hold {
            event_id: "ev@0".into(),
            until_ms: 1_700_000_000_123,
        };
        let held = copy_properties(&props(), 2, Some(100), None, Some(&hold));
        assert_eq!(noted_hold(&held), Some(hold));
        let m = message_from_delivery(&held, "rk", b"{}", false).unwrap();
        assert!(!m.envelope.headers.contains_key(NOTED_HOLD));
        let retried = copy_properties(&held, 3, Some(100), None, None);
        assert_eq!(noted_hold(&retried), None);
        assert_eq!(noted_hold(&props()), None);
    }

    #[test]
    fn refuses_messages_without_an_event_id() {
        let err =
            message_from_delivery(&BasicProperties::default(), "rk", b"{}", false).unwrap_err();
        assert!(err.contains("message_id"), "{err}");
    }
}
