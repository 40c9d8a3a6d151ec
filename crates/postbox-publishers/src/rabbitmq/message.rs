//! One outbox row as an AMQP message (SPEC §4): body, properties, headers
//! and routing key. Pure, so the mapping is tested without a broker.

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use postbox_core::publish::Delivery;
use postbox_core::template::Template;
use postbox_core::wire::{self, rabbitmq::PERSISTENT};

pub use postbox_core::wire::rabbitmq::POSTBOX_HEADERS;

/// A message ready for `basic.publish`, owning its data so the session task
/// can outlive the caller's borrow.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Outgoing {
    /// The event id, also the `message_id` property: how a returned
    /// (unroutable) message is matched to its event.
    pub event_id: String,
    pub routing_key: ShortString,
    pub properties: BasicProperties,
    pub body: Vec<u8>,
}

/// Builds the message for one delivery, or says why the event cannot be an
/// AMQP message (a field over the 255-byte limit of AMQP short strings).
pub(super) fn outgoing(d: &Delivery<'_>, routing_key: &Template) -> Result<Outgoing, String> {
    let r = d.record;
    let short = |what: &str, value: String| {
        ShortString::try_new(value).map_err(|e| {
            format!(
                "{what} of event {} cannot be sent over AMQP: {e}",
                r.event_id
            )
        })
    };
    let routing_key = short("routing key", routing_key.render(r))?;

    let mut headers = FieldTable::default();
    for (key, value) in d.headers() {
        headers.insert(short("header name", key)?, field_value(value));
    }
    if let Some(aggregate_id) = &r.aggregate_id {
        headers.insert(
            wire::AGGREGATE_ID.into(),
            AMQPValue::LongString(aggregate_id.as_str().into()),
        );
    }
    if let Some(version) = r.aggregate_version {
        headers.insert(
            wire::AGGREGATE_VERSION.into(),
            AMQPValue::LongLongInt(version),
        );
    }
    headers.insert(
        wire::CREATED_AT_MS.into(),
        AMQPValue::LongLongInt(r.created_at_ms),
    );
    headers.insert(wire::ATTEMPT.into(), AMQPValue::LongInt(d.attempt));
    if d.replayed {
        headers.insert(wire::REPLAYED.into(), AMQPValue::Boolean(true));
    }

    let properties = BasicProperties::default()
        .with_message_id(short("event_id", r.event_id.clone())?)
        .with_type(short("event_type", r.event_type.clone())?)
        .with_app_id(short("app_code", r.app_code.clone())?)
        .with_timestamp(u64::try_from(r.created_at_ms / 1000).unwrap_or(0))
        .with_content_type(wire::CONTENT_TYPE.into())
        .with_delivery_mode(PERSISTENT)
        .with_headers(headers);
    Ok(Outgoing {
        event_id: r.event_id.clone(),
        routing_key,
        properties,
        body: r.payload.as_bytes().to_vec(),
    })
}

/// A JSON header value as an AMQP field value: strings, integers, floats,
/// booleans and null map to their AMQP types; arrays and objects travel as
/// their JSON text.
pub fn field_value(value: serde_json::Value) -> AMQPValue {
    use serde_json::Value;
    match value {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, Some(f)) => AMQPValue::Double(f),
            (None, None) => AMQPValue::LongString(n.to_string().into()),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s)),
        other @ (Value::Array(_) | Value::Object(_)) => {
            AMQPValue::LongString(other.to_string().into())
        }
    }
}

/// The inverse of [`field_value`] for what a consumer reads back: AMQP field
/// values as JSON (strings as text, numbers, booleans, void as null).
pub fn json_value(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match value {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(i) => (*i).into(),
        AMQPValue::ShortShortUInt(i) => (*i).into(),
        AMQPValue::ShortInt(i) => (*i).into(),
        AMQPValue::ShortUInt(i) => (*i).into(),
        AMQPValue::LongInt(i) => (*i).into(),
        AMQPValue::LongUInt(i) => (*i).into(),
        AMQPValue::LongLongInt(i) => (*i).into(),
        AMQPValue::Float(f) => f64::from(*f).into(),
        AMQPValue::Double(f) => (*f).into(),
        AMQPValue::Timestamp(t) => (*t).into(),
        AMQPValue::ShortString(s) => s.as_str().into(),
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned().into(),
        AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()).into_owned().into(),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(json_value).collect()),
        AMQPValue::FieldTable(t) => Value::Object(
            t.into_iter()
                .map(|(k, v)| (k.to_string(), json_value(v)))
                .collect(),
        ),
        AMQPValue::DecimalValue(d) => (f64::from(d.value) / 10f64.powi(i32::from(d.scale))).into(),
        AMQPValue::Void => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postbox_core::EventRecord;

    fn record() -> EventRecord {
        EventRecord {
            event_id: "e-1".into(),
            aggregate_version: Some(7),
            headers: Some(r#"{"trace":"t","n":3,"ok":true,"f":1.5,"list":[1]}"#.into()),
            retry_count: 2,
            created_at_ms: 1_764_000_123_456,
            updated_at_ms: 0,
            ..postbox_testkit::records::room_created(1)
        }
    }

    fn header<'a>(m: &'a Outgoing, key: &str) -> Option<&'a AMQPValue> {
        m.properties.headers().as_ref().unwrap().inner().get(key)
    }

    #[test]
    fn maps_identity_metadata_and_headers() {
        let r = record();
        let t = Template::parse("{app_code}.{event_type}").unwrap();
        let m = outgoing(&Delivery::of(&r), &t).unwrap();
        assert_eq!(m.routing_key.as_str(), "room.RoomCreated");
        assert_eq!(m.body, br#"{"room":1}"#);
        let p = &m.properties;
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), "e-1");
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "RoomCreated");
        assert_eq!(p.app_id().as_ref().unwrap().as_str(), "room");
        assert_eq!(*p.timestamp(), Some(1_764_000_123));
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(
            header(&m, "x-aggregate-id"),
            Some(&AMQPValue::LongString("r1".into()))
        );
        assert_eq!(
            header(&m, "x-aggregate-version"),
            Some(&AMQPValue::LongLongInt(7))
        );
        assert_eq!(
            header(&m, "x-created-at-ms"),
            Some(&AMQPValue::LongLongInt(1_764_000_123_456))
        );
        assert_eq!(header(&m, "x-attempt"), Some(&AMQPValue::LongInt(3)));
        assert_eq!(header(&m, "x-replayed"), Some(&AMQPValue::Boolean(true)));
        assert_eq!(
            header(&m, "trace"),
            Some(&AMQPValue::LongString("t".into()))
        );
        assert_eq!(header(&m, "n"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(header(&m, "ok"), Some(&AMQPValue::Boolean(true)));
        assert_eq!(header(&m, "f"), Some(&AMQPValue::Double(1.5)));
        assert_eq!(
            header(&m, "list"),
            Some(&AMQPValue::LongString("[1]".into()))
        );
    }

    #[test]
    fn leaves_out_absent_aggregate_and_first_attempt_replay_flag() {
        let mut r = record();
        r.aggregate_id = None;
        r.aggregate_version = None;
        r.replay_count = 0;
        r.headers = None;
        let m = outgoing(&Delivery::of(&r), &Template::parse("{event_type}").unwrap()).unwrap();
        let keys: Vec<&str> = m
            .properties
            .headers()
            .as_ref()
            .unwrap()
            .into_iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys, ["x-attempt", "x-created-at-ms"]);
    }

    #[test]
    fn postbox_headers_win_over_event_headers_of_the_same_name() {
        let mut r = record();
        r.headers = Some(r#"{"x-attempt":"spoofed"}"#.into());
        let m = outgoing(&Delivery::of(&r), &Template::parse("{event_type}").unwrap()).unwrap();
        assert_eq!(header(&m, "x-attempt"), Some(&AMQPValue::LongInt(3)));
    }

    #[test]
    fn an_overlong_routing_key_fails_that_event_only() {
        let mut r = record();
        r.event_type = "T".repeat(300);
        let err =
            outgoing(&Delivery::of(&r), &Template::parse("{event_type}").unwrap()).unwrap_err();
        assert!(err.contains("routing key of event e-1"), "{err}");
    }

    #[test]
    fn field_values_round_trip_to_json() {
        for v in [
            serde_json::json!("北京"),
            serde_json::json!(42),
            serde_json::json!(-1.25),
            serde_json::json!(false),
            serde_json::Value::Null,
        ] {
            assert_eq!(json_value(&field_value(v.clone())), v);
        }
    }
}
