//! The JSON envelope of SPEC §4, used by the webhook and file publishers and
//! by the consumer bridge.

use serde::{Deserialize, Serialize};

use crate::EventRecord;

/// One event as the outside world sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// The body: embedded as JSON when it parses, else as a string.
    pub payload: serde_json::Value,
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
            payload: serde_json::from_str(&r.payload)
                .unwrap_or_else(|_| serde_json::Value::String(r.payload.clone())),
        }
    }
}
