//! The outbox row and the states it moves through (SPEC §2, §3).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{trace, Error};

/// Longest `app_code` and `event_id`, in bytes.
pub const MAX_ID_LEN: usize = 64;
/// Longest `event_type` and `aggregate_id`, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// The longest headers an event may carry, as JSON: the `headers` column
/// is a MySQL `TEXT` (65,535 bytes), which a session without strict mode
/// cuts short silently (the event then went out with no header at all),
/// less room for the trace context `enqueue` adds.
pub const MAX_HEADERS_BYTES: usize = 65_535 - 1_024;
/// Longest `last_error` stored, in bytes.
pub const MAX_ERROR_LEN: usize = 2000;

/// Where a row is in its life.
///
/// ```text
/// pending ──claim──▶ delivering ──all confirmed──▶ delivered
/// retryable ─due──▶ delivering ──failure────────▶ retryable | failed
///                   delivering ──lease expired──▶ delivering (attempt + 1) | failed
/// ```
/// The default is [`Status::Pending`], where every row starts.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Committed, not yet claimed.
    #[default]
    Pending,
    /// Claimed by a relay until `lock_until_ms`.
    Delivering,
    /// Every publisher confirmed. Legacy `published` rows read as this.
    Delivered,
    /// Failed, due again at `next_retry_at_ms`.
    Retryable,
    /// Dead letter: out of attempts; only a replay moves it again.
    Failed,
    /// Not delivered on purpose: a runtime control's sampling left it out
    /// (`last_error` says why). Terminal; a replay delivers it.
    Dropped,
}

impl Status {
    /// Every status, in life order.
    pub const ALL: [Status; 6] = [
        Status::Pending,
        Status::Delivering,
        Status::Delivered,
        Status::Retryable,
        Status::Failed,
        Status::Dropped,
    ];

    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Delivering => "delivering",
            Status::Delivered => "delivered",
            Status::Retryable => "retryable",
            Status::Failed => "failed",
            Status::Dropped => "dropped",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Status {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "pending" => Ok(Status::Pending),
            "delivering" => Ok(Status::Delivering),
            // Legacy rows written by the seed's older worker.
            "delivered" | "published" => Ok(Status::Delivered),
            "retryable" => Ok(Status::Retryable),
            "failed" => Ok(Status::Failed),
            "dropped" => Ok(Status::Dropped),
            other => Err(Error::InvalidEvent(format!(
                "unknown status `{other}`: expected pending, delivering, delivered, retryable, failed or dropped"
            ))),
        }
    }
}

/// An event to write into the outbox.
///
/// ```
/// use postbox_core::NewEvent;
/// let e = NewEvent::new("room", "RoomCreated", r#"{"room_id":42}"#)
///     .aggregate("room-42", 1);
/// assert_eq!(e.event_id.len(), 36); // a UUIDv7 unless you give one
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewEvent {
    /// Tenant / application.
    pub app_code: String,
    /// Globally unique id; UUIDv7 by default.
    pub event_id: String,
    /// Routing type, e.g. `RoomCreated`.
    pub event_type: String,
    /// Ordering scope.
    #[serde(default)]
    pub aggregate_id: Option<String>,
    /// Version within the aggregate.
    #[serde(default)]
    pub aggregate_version: Option<i64>,
    /// Message body (JSON by convention).
    pub payload: String,
    /// Extra headers, a JSON object.
    #[serde(default)]
    pub headers: Option<serde_json::Map<String, serde_json::Value>>,
}

impl NewEvent {
    /// A new event with a fresh UUIDv7 `event_id`.
    pub fn new(
        app_code: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Into<String>,
    ) -> Self {
        NewEvent {
            app_code: app_code.into(),
            event_id: new_event_id(),
            event_type: event_type.into(),
            aggregate_id: None,
            aggregate_version: None,
            payload: payload.into(),
            headers: None,
        }
    }

    /// Sets the event id (keep it when re-sending a known event).
    pub fn event_id(mut self, id: impl Into<String>) -> Self {
        self.event_id = id.into();
        self
    }

    /// Sets the aggregate and its version.
    pub fn aggregate(mut self, id: impl Into<String>, version: i64) -> Self {
        self.aggregate_id = Some(id.into());
        self.aggregate_version = Some(version);
        self
    }

    /// Adds one header.
    pub fn header(mut self, key: impl Into<String>, value: impl Into<serde_json::Value>) -> Self {
        self.headers
            .get_or_insert_with(Default::default)
            .insert(key.into(), value.into());
        self
    }

    /// Checks lengths and the payload limit; called by every backend's
    /// `enqueue` before it touches the database.
    pub fn validate(&self, max_payload_bytes: usize) -> Result<(), Error> {
        let check = |field: &str, value: &str, max: usize| {
            if value.is_empty() {
                Err(Error::InvalidEvent(format!("{field} is empty")))
            } else if value.len() > max {
                Err(Error::InvalidEvent(format!(
                    "{field} is {} bytes, longer than {max}",
                    value.len()
                )))
            } else {
                Ok(())
            }
        };
        check("app_code", &self.app_code, MAX_ID_LEN)?;
        check("event_id", &self.event_id, MAX_ID_LEN)?;
        check("event_type", &self.event_type, MAX_NAME_LEN)?;
        if let Some(agg) = &self.aggregate_id {
            check("aggregate_id", agg, MAX_NAME_LEN)?;
        }
        if let Some(headers) = &self.headers {
            let size = serde_json::to_string(headers).map_or(0, |h| h.len());
            if size > MAX_HEADERS_BYTES {
                return Err(Error::InvalidEvent(format!(
                    "headers are {size} bytes as JSON, longer than {MAX_HEADERS_BYTES}"
                )));
            }
        }
        if self.payload.len() > max_payload_bytes {
            return Err(Error::PayloadTooLarge {
                event_id: self.event_id.clone(),
                size: self.payload.len(),
                limit: max_payload_bytes,
            });
        }
        Ok(())
    }

    /// The headers column value: the event's headers, plus the trace
    /// context current at `enqueue` (`traceparent`, `tracestate`; see
    /// [`crate::trace`]) unless the headers name one already. Every
    /// backend's `enqueue` writes this.
    pub fn headers_json(&self) -> Option<String> {
        let traced = (self.headers.as_ref()).is_some_and(|h| h.contains_key(trace::TRACEPARENT));
        if let Some(context) = (!traced).then(trace::current).flatten() {
            let mut headers = self.headers.clone().unwrap_or_default();
            trace::inject(&context, &mut headers);
            return Some(serde_json::Value::Object(headers).to_string());
        }
        (self.headers.as_ref()).map(|h| serde_json::to_string(h).unwrap_or_else(|_| "{}".into()))
    }
}

/// A fresh UUIDv7, the default `event_id`.
pub fn new_event_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// One outbox row as stored.
///
/// The default is an empty `pending` row: tests and custom publishers fill in
/// the fields they care about and take the rest with `..Default::default()`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    /// Insertion order.
    pub id: i64,
    /// Tenant.
    pub app_code: String,
    /// Dedupe key.
    pub event_id: String,
    /// Routing type.
    pub event_type: String,
    /// Ordering scope.
    pub aggregate_id: Option<String>,
    /// Version within the aggregate.
    pub aggregate_version: Option<i64>,
    /// Body.
    pub payload: String,
    /// Extra headers (JSON object text).
    pub headers: Option<String>,
    /// Current state.
    pub status: Status,
    /// Failed attempts so far.
    pub retry_count: i32,
    /// When a retryable row is due.
    pub next_retry_at_ms: i64,
    /// Lease end of a delivering row.
    pub lock_until_ms: i64,
    /// Relay holding the lease.
    pub worker_id: Option<String>,
    /// Last failure, truncated.
    pub last_error: Option<String>,
    /// Publishers that already confirmed this row (fanout progress).
    pub delivered_to: Vec<String>,
    /// How many times an operator replayed this row.
    pub replay_count: i32,
    /// Created, epoch ms (database clock).
    pub created_at_ms: i64,
    /// Last changed, epoch ms (database clock).
    pub updated_at_ms: i64,
}

impl EventRecord {
    /// The trace context the row was written with (its `traceparent`
    /// header); the headers are parsed only when they mention one.
    pub fn trace_parent(&self) -> Option<trace::SpanContext> {
        let headers = self.headers.as_deref()?;
        if !headers.contains(trace::TRACEPARENT) {
            return None;
        }
        trace::parent_of(&self.headers_map())
    }

    /// Parses the `headers` column into a JSON object (empty when absent or
    /// not an object).
    pub fn headers_map(&self) -> serde_json::Map<String, serde_json::Value> {
        match self
            .headers
            .as_deref()
            .map(serde_json::from_str::<serde_json::Value>)
        {
            Some(Ok(serde_json::Value::Object(m))) => m,
            _ => Default::default(),
        }
    }
}

/// Which claim query produced a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimSource {
    /// `status = 'pending'`.
    Pending,
    /// `status = 'retryable' AND next_retry_at_ms <= now`.
    DueRetry,
    /// `status = 'delivering' AND lock_until_ms <= now`: a relay died or hung;
    /// the claim already counted the lost attempt.
    ExpiredLease,
}

/// A row this relay holds a lease on.
#[derive(Debug, Clone)]
pub struct ClaimedEvent {
    /// The row, as of the claim (status `delivering`).
    pub record: EventRecord,
    /// The claim query that took it.
    pub source: ClaimSource,
}

impl ClaimedEvent {
    /// The fence of this claim: a result is written only while the row still
    /// carries this worker id and lease end.
    pub fn fence(&self) -> Fence {
        Fence {
            worker_id: self.record.worker_id.clone().unwrap_or_default(),
            lock_until_ms: self.record.lock_until_ms,
        }
    }
}

/// Identifies one claim (fencing token). Every row of one claim statement
/// shares it, because the lease end is computed once per statement (a
/// per-aggregate claim on PostgreSQL may run two, and hand out rows of
/// two fences: the marks group rows by fence).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fence {
    /// Claiming relay.
    pub worker_id: String,
    /// Lease end written by that claim.
    pub lock_until_ms: i64,
}

/// Truncates an error message to [`MAX_ERROR_LEN`] on a char boundary.
pub fn truncate_error(msg: &str) -> String {
    if msg.len() <= MAX_ERROR_LEN {
        return msg.to_owned();
    }
    let mut end = MAX_ERROR_LEN;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &msg[..end])
}

/// Splits the `delivered_to` column (comma separated names).
pub fn parse_delivered_to(col: Option<&str>) -> Vec<String> {
    col.unwrap_or("")
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_published_reads_as_delivered() {
        assert_eq!("published".parse::<Status>().unwrap(), Status::Delivered);
        for s in Status::ALL {
            assert_eq!(s.as_str().parse::<Status>().unwrap(), s);
        }
    }

    #[test]
    fn validate_names_the_field() {
        let e = NewEvent::new("", "T", "{}");
        assert!(e.validate(10).unwrap_err().to_string().contains("app_code"));
        let e = NewEvent::new("a", "T", "x".repeat(11));
        assert!(matches!(
            e.validate(10),
            Err(Error::PayloadTooLarge {
                size: 11,
                limit: 10,
                ..
            })
        ));
        let e = NewEvent::new("a", "T", "{}").event_id("x".repeat(65));
        assert!(e.validate(10).unwrap_err().to_string().contains("event_id"));
    }

    /// Headers longer than the column holds everywhere are refused at
    /// enqueue (MariaDB without strict mode stored them cut short: the
    /// event went out with no header at all).
    #[test]
    fn headers_longer_than_the_column_are_refused() {
        let big = NewEvent::new("a", "T", "{}").header("blob", "x".repeat(70_000));
        let err = big.validate(1 << 20).unwrap_err();
        assert!(err.to_string().contains("headers are 70"), "{err}");
        let fine = NewEvent::new("a", "T", "{}").header("k", "x".repeat(60_000));
        assert!(fine.validate(1 << 20).is_ok());
    }

    #[test]
    fn truncates_on_char_boundary() {
        let long = "é".repeat(MAX_ERROR_LEN);
        let t = truncate_error(&long);
        assert!(t.len() <= MAX_ERROR_LEN + '…'.len_utf8());
    }
}
