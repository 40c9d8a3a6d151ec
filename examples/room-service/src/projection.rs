//! The consumers' side, as the seed's PHP workers see it: an HTTP handler
//! that `postbox consume` POSTs each message to (one unacked message per
//! process, `prefetch = 1`). It stands for activity-service (room events)
//! and notice-service (room and wallet events, from RabbitMQ only).
//!
//! A consumer must be idempotent: it dedupes by `event_id`, and applies an
//! aggregate's events by `aggregate_version`, so an older version arriving
//! after a newer one (parallel workers, a retried message) changes nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::{json, Value};

/// What the projection has seen.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Seen {
    /// Events applied (each event_id once).
    pub handled: u64,
    /// POSTs of an event_id already handled: the inbox of `postbox consume`
    /// keeps this at 0, the handler's own check would absorb them anyway.
    pub duplicates: u64,
    /// Events older than one already applied for their aggregate: not
    /// applied (the version rule).
    pub stale: u64,
    /// Events by type.
    pub by_type: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
struct Inner {
    seen: Seen,
    ids: HashSet<String>,
    /// (app_code, aggregate) → the newest version applied.
    versions: HashMap<(String, String), i64>,
    /// Commit → handled, per event (ms).
    lags: Vec<i64>,
}

/// A projection (activity, notice), shared by its handler and tests.
#[derive(Clone, Default)]
pub struct Projection(Arc<Mutex<Inner>>);

impl Projection {
    /// `POST /events` (the consumers' handler), `GET /stats`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/events", post(handle))
            .route("/stats", get(stats))
            .with_state(self.clone())
    }

    /// What it has seen so far.
    pub fn seen(&self) -> Seen {
        self.0.lock().unwrap().seen.clone()
    }

    /// Commit → handled of every event so far, in ms.
    pub fn lags(&self) -> Vec<i64> {
        self.0.lock().unwrap().lags.clone()
    }

    /// Whether `event_id` was applied.
    pub fn has(&self, event_id: &str) -> bool {
        self.0.lock().unwrap().ids.contains(event_id)
    }

    fn apply(&self, envelope: &Value) -> Result<(), String> {
        let event_id = envelope["event_id"].as_str().ok_or("no event_id")?;
        let mut i = self.0.lock().unwrap();
        if !i.ids.insert(event_id.to_owned()) {
            i.seen.duplicates += 1;
            return Ok(());
        }
        i.seen.handled += 1;
        let lag = crate::now_ms() - envelope["created_at_ms"].as_i64().unwrap_or(0);
        i.lags.push(lag);
        let event_type = envelope["event_type"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        *i.seen.by_type.entry(event_type).or_default() += 1;
        if let (Some(app), Some(agg), Some(v)) = (
            envelope["app_code"].as_str(),
            envelope["aggregate_id"].as_str(),
            envelope["aggregate_version"].as_i64(),
        ) {
            let newest = i
                .versions
                .entry((app.to_owned(), agg.to_owned()))
                .or_insert(0);
            if v < *newest {
                i.seen.stale += 1;
            } else {
                *newest = v;
            }
        }
        Ok(())
    }
}

async fn handle(
    State(p): State<Projection>,
    Json(envelope): Json<Value>,
) -> (StatusCode, Json<Value>) {
    match p.apply(&envelope) {
        Ok(()) => (StatusCode::OK, Json(json!({ "ok": true }))),
        Err(e) => (StatusCode::BAD_REQUEST, Json(json!({ "error": e }))),
    }
}

async fn stats(State(p): State<Projection>) -> Json<Seen> {
    Json(p.seen())
}
