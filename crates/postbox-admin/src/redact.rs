//! `[admin.redact]`: payload fields the API and the dashboard never show,
//! per event type (`UserSignedUp = ["email", "contact.phone"]`). A field is
//! replaced by `"***"` wherever the path reaches it; a payload of such a
//! type that is not a JSON object is shown as `"***"` whole (nothing of it
//! can be shown safely). The rows in the database are untouched.

use std::collections::BTreeMap;

use postbox_core::EventRecord;
use serde_json::Value;

/// What is shown in place of a redacted value.
pub(crate) const MASK: &str = "***";

/// The configured paths, split once.
#[derive(Debug, Default)]
pub(crate) struct Redaction {
    by_type: BTreeMap<String, Vec<Vec<String>>>,
}

impl Redaction {
    /// From `[admin.redact]`: event type → dotted field paths.
    pub(crate) fn new(config: BTreeMap<String, Vec<String>>) -> Self {
        let by_type = config
            .into_iter()
            .map(|(t, fields)| {
                let paths = fields
                    .iter()
                    .map(|f| f.split('.').map(str::to_owned).collect())
                    .collect();
                (t, paths)
            })
            .collect();
        Redaction { by_type }
    }

    /// Masks `record`'s payload as configured for its event type.
    pub(crate) fn apply(&self, record: &mut EventRecord) {
        self.apply_payload(&record.event_type, &mut record.payload);
    }

    /// Masks `payload` (JSON text) as configured for `event_type`.
    pub(crate) fn apply_payload(&self, event_type: &str, payload: &mut String) {
        let Some(paths) = postbox_core::config::of_event_type(&self.by_type, event_type) else {
            return;
        };
        *payload = match serde_json::from_str::<Value>(payload) {
            Ok(mut value @ Value::Object(_)) => {
                for path in paths {
                    mask(&mut value, path);
                }
                value.to_string()
            }
            _ => format!("\"{MASK}\""),
        };
    }
}

/// Masks what `path` reaches in `value`; an array on the way is gone
/// through element by element (`users.email` reaches the email of every
/// user of `{"users": [...]}`).
fn mask(value: &mut Value, path: &[String]) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    if let Value::Array(items) = value {
        for item in items {
            mask(item, path);
        }
        return;
    }
    let Some(inner) = value.as_object_mut().and_then(|o| o.get_mut(first)) else {
        return;
    };
    if rest.is_empty() {
        *inner = Value::String(MASK.to_owned());
    } else {
        mask(inner, rest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(event_type: &str, payload: &str) -> EventRecord {
        EventRecord {
            event_type: event_type.into(),
            payload: payload.into(),
            ..EventRecord::default()
        }
    }

    #[test]
    fn configured_fields_are_masked_for_their_type_only() {
        let r = Redaction::new(BTreeMap::from([(
            "UserSignedUp".to_owned(),
            vec![
                "email".to_owned(),
                "contact.phone".to_owned(),
                "absent.x".to_owned(),
            ],
        )]));
        let mut signed = record(
            "UserSignedUp",
            r#"{"email":"a@b.c","name":"Al","contact":{"phone":"123","city":"X"}}"#,
        );
        r.apply(&mut signed);
        let shown: Value = serde_json::from_str(&signed.payload).unwrap();
        assert_eq!(
            shown,
            serde_json::json!({"email":"***","name":"Al","contact":{"phone":"***","city":"X"}})
        );
        let mut listed = record(
            "UserSignedUp",
            r#"{"contact":[{"phone":"1"},{"phone":"2","city":"Y"}],"email":["a@b.c","d@e.f"]}"#,
        );
        r.apply(&mut listed);
        let shown: Value = serde_json::from_str(&listed.payload).unwrap();
        assert_eq!(
            shown,
            serde_json::json!({"contact":[{"phone":"***"},{"phone":"***","city":"Y"}],"email":"***"}),
            "arrays on the way are gone through; a field holding an array is masked whole"
        );
        let mut other = record("RoomCreated", r#"{"email":"a@b.c"}"#);
        r.apply(&mut other);
        assert_eq!(other.payload, r#"{"email":"a@b.c"}"#);
        let mut text = record("UserSignedUp", "email a@b.c");
        r.apply(&mut text);
        assert_eq!(text.payload, "\"***\"", "not an object: masked whole");
    }
}
