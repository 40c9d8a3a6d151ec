//! The JSON envelope of SPEC §4, used by the webhook and file publishers and
//! by the consumer bridge.
//!
//! The payload is text (SPEC §2) and is carried through unchanged: a payload
//! that is valid JSON is embedded as written (a [`RawValue`]: the same bytes,
//! so big integers, `19.990`, key order and spacing all survive); any other
//! payload is embedded as a JSON string holding its text. The envelope never
//! parses a payload into numbers or maps and serializes it back.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::publish::Delivery;
use crate::EventRecord;

/// One event as the outside world sees it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    /// Dedupe key.
    pub event_id: String,
    /// Tenant.
    pub app_code: String,
    /// Routing type.
    pub event_type: String,
    /// Ordering scope.
    pub aggregate_id: Option<String>,
    /// Version within the aggregate.
    pub aggregate_version: Option<i64>,
    /// Created, epoch ms.
    pub created_at_ms: i64,
    /// Extra headers.
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// The body, verbatim: its own text when it is valid JSON, else a JSON
    /// string holding it (see [`Envelope::payload_of`]). Read it with
    /// [`RawValue::get`] or parse it with `serde_json::from_str(payload.get())`.
    pub payload: Box<RawValue>,
}

/// Equal when every field is, the payload compared as text (the same bytes).
impl PartialEq for Envelope {
    fn eq(&self, other: &Self) -> bool {
        self.event_id == other.event_id
            && self.app_code == other.app_code
            && self.event_type == other.event_type
            && self.aggregate_id == other.aggregate_id
            && self.aggregate_version == other.aggregate_version
            && self.created_at_ms == other.created_at_ms
            && self.headers == other.headers
            && self.payload.get() == other.payload.get()
    }
}

impl Envelope {
    /// Builds the envelope of a stored row.
    pub fn from_record(r: &EventRecord) -> Self {
        Envelope {
            event_id: r.event_id.clone(),
            app_code: r.app_code.clone(),
            event_type: r.event_type.clone(),
            aggregate_id: r.aggregate_id.clone(),
            aggregate_version: r.aggregate_version,
            created_at_ms: r.created_at_ms,
            headers: r.headers_map(),
            payload: Self::payload_of(&r.payload),
        }
    }

    /// The envelope a publisher sends for `d`: the row's, its headers as
    /// the delivery sends them (the relay's trace context, when it records
    /// one) with `x-attempt` and `x-replayed`.
    pub fn of_delivery(d: &Delivery<'_>) -> Self {
        let mut env = Envelope::from_record(d.record);
        d.apply_trace(&mut env.headers);
        crate::wire::stamp_delivery(&mut env.headers, d.attempt, d.replayed);
        env
    }

    /// The envelope's `payload` for a payload text: the text itself when it
    /// is valid JSON (byte for byte; only whitespace around the value is
    /// dropped), else a JSON string holding the text. A payload that is
    /// itself a JSON string (`"abc"`) is therefore embedded as that string.
    pub fn payload_of(text: &str) -> Box<RawValue> {
        match RawValue::from_string(text.to_owned()) {
            Ok(raw) => raw,
            // Serializing a string cannot fail; `null` is only a fallback.
            Err(_) => {
                serde_json::value::to_raw_value(text).unwrap_or_else(|_| RawValue::NULL.to_owned())
            }
        }
    }

    /// [`Envelope::payload_of`] for a broker's message body: a body that is
    /// not UTF-8 is embedded as a JSON string of its lossy text.
    pub fn payload_of_bytes(body: &[u8]) -> Box<RawValue> {
        Self::payload_of(&String::from_utf8_lossy(body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(payload: &str) -> EventRecord {
        EventRecord {
            app_code: "wallet".into(),
            event_id: "ev-1".into(),
            event_type: "Credited".into(),
            aggregate_id: Some("acct-1".into()),
            aggregate_version: Some(3),
            payload: payload.into(),
            created_at_ms: 1_764_000_000_000,
            updated_at_ms: 1_764_000_000_000,
            ..crate::template::tests::record()
        }
    }

    /// The serialized envelope's `payload` text, as a reader of it sees it.
    fn payload_text(env: &Envelope) -> String {
        let text = serde_json::to_string(env).unwrap();
        let fields: std::collections::BTreeMap<String, &RawValue> =
            serde_json::from_str(&text).unwrap();
        fields["payload"].get().to_owned()
    }

    #[test]
    fn a_json_payload_is_embedded_byte_for_byte() {
        for payload in [
            r#"{"room_id":1,"n":12345678901234567890123,"f":1.10}"#,
            r#"{"amount":19.990,"id":18446744073709551617}"#,
            r#"{"z":1,"a":{"y":[1.0, 2.50E3],"b":null}, "m" : "房间 ✓\n"}"#,
            "12345678901234567890123",
            "[]",
        ] {
            let env = Envelope::from_record(&record(payload));
            assert_eq!(env.payload.get(), payload);
            assert_eq!(payload_text(&env), payload);
        }
    }

    #[test]
    fn a_payload_serde_json_would_not_parse_as_a_value_is_still_kept() {
        // `1e400` is valid JSON but overflows f64: kept as written, not
        // turned into a string.
        let payload = r#"{"x":1e400}"#;
        let env = Envelope::from_record(&record(payload));
        assert_eq!(payload_text(&env), payload);
    }

    #[test]
    fn a_non_json_payload_is_embedded_as_a_json_string() {
        for payload in ["not json", "{\"a\":", "", "a\"b\\c\n"] {
            let env = Envelope::from_record(&record(payload));
            let v: serde_json::Value = serde_json::from_str(env.payload.get()).unwrap();
            assert_eq!(v, serde_json::Value::String(payload.to_owned()));
        }
    }

    #[test]
    fn an_envelope_round_trips_with_its_payload_text() {
        let env = Envelope::from_record(&record(r#"{"b":1.10,"a":2}"#));
        let back: Envelope = serde_json::from_str(&serde_json::to_string(&env).unwrap()).unwrap();
        assert_eq!(back, env);
        assert_eq!(back.payload.get(), r#"{"b":1.10,"a":2}"#);
    }
}
