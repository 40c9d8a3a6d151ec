//! A stand-in for the IM service (Tencent IM in the seed), the target of the
//! room relay's `webhook` publisher: `RoomCreated` makes sure the room's
//! group exists, every other room event becomes a group system message.
//!
//! It can be told to fail (`POST /control`): down (503 for everything), a
//! share of requests failing (500), or poison event types (400: a failed
//! attempt that retrying will not cure).

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// How the stand-in misbehaves.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Answer 503 to every push.
    pub down: bool,
    /// Answer 500 to this share of pushes (0.0 to 1.0).
    pub fail_rate: f64,
    /// Answer 400 to pushes of these event types.
    pub poison_event_types: Vec<String>,
}

/// One system message of a group.
#[derive(Debug, Clone, Serialize)]
pub struct GroupMessage {
    /// The outbox event.
    pub event_id: String,
    /// Its type.
    pub event_type: String,
    /// The room's version it carries.
    pub version: i64,
}

#[derive(Debug, Default)]
struct Inner {
    faults: Faults,
    /// Room id → messages, in arrival order.
    groups: BTreeMap<String, Vec<GroupMessage>>,
    seen: HashSet<String>,
    received: u64,
    duplicates: u64,
    refused: u64,
    /// Commit → shown, per message (ms, from the envelope's created_at_ms).
    lags: Vec<i64>,
}

/// The IM stand-in's state, shared by its handlers (and tests).
#[derive(Clone, Default)]
pub struct Im(Arc<Mutex<Inner>>);

impl Im {
    /// `POST /im` (the webhook target), `POST /control`, `GET /groups/{room_id}`, `GET /stats`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/im", post(push))
            .route("/control", post(control))
            .route("/groups/{room_id}", get(group))
            .route("/stats", get(stats))
            .with_state(self.clone())
    }

    /// Sets how it misbehaves.
    pub fn set_faults(&self, faults: Faults) {
        self.0.lock().unwrap().faults = faults;
    }

    /// A group's messages, `None` when the group does not exist.
    pub fn group(&self, room_id: &str) -> Option<Vec<GroupMessage>> {
        self.0.lock().unwrap().groups.get(room_id).cloned()
    }

    /// Pushes received, duplicates among them (by event_id), pushes refused.
    pub fn counts(&self) -> (u64, u64, u64) {
        let i = self.0.lock().unwrap();
        (i.received, i.duplicates, i.refused)
    }

    /// Commit → shown of every message so far, in ms.
    pub fn lags(&self) -> Vec<i64> {
        self.0.lock().unwrap().lags.clone()
    }

    fn take(&self, envelope: &Value) -> (StatusCode, Value) {
        let mut i = self.0.lock().unwrap();
        let event_type = envelope["event_type"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let refuse = if i.faults.down {
            Some((StatusCode::SERVICE_UNAVAILABLE, "IM is down"))
        } else if i.faults.poison_event_types.contains(&event_type) {
            Some((StatusCode::BAD_REQUEST, "IM refuses this message"))
        } else if i.faults.fail_rate > 0.0 && rand::random::<f64>() < i.faults.fail_rate {
            Some((StatusCode::INTERNAL_SERVER_ERROR, "IM failed"))
        } else {
            None
        };
        if let Some((status, error)) = refuse {
            i.refused += 1;
            return (status, json!({ "error": error }));
        }
        let (Some(event_id), Some(room_id)) = (
            envelope["event_id"].as_str(),
            envelope["aggregate_id"].as_str(),
        ) else {
            i.refused += 1;
            return (
                StatusCode::BAD_REQUEST,
                json!({ "error": "an event with event_id and aggregate_id (the room) is required" }),
            );
        };
        let (event_id, room_id) = (event_id.to_owned(), room_id.to_owned());
        let created = event_type == "RoomCreated";
        if !created && !i.groups.contains_key(&room_id) {
            // Never with `ordering = "per_aggregate"`: RoomCreated is
            // delivered first. Refused, so the relay retries it.
            i.refused += 1;
            return (
                StatusCode::CONFLICT,
                json!({ "error": format!("no group for room {room_id}") }),
            );
        }
        i.received += 1;
        // IM dedupes by event_id too: a redelivered push is acknowledged
        // and not shown twice.
        if !i.seen.insert(event_id.clone()) {
            i.duplicates += 1;
            return (StatusCode::OK, json!({ "duplicate": true }));
        }
        i.lags
            .push(crate::now_ms() - envelope["created_at_ms"].as_i64().unwrap_or(0));
        let message = GroupMessage {
            event_id,
            event_type,
            version: envelope["aggregate_version"].as_i64().unwrap_or(0),
        };
        // RoomCreated ensures the group; every other event is a message of it.
        i.groups.entry(room_id).or_default().push(message);
        let answer = if created {
            "group ensured"
        } else {
            "message sent"
        };
        (StatusCode::OK, json!({ "ok": answer }))
    }
}

async fn push(State(im): State<Im>, Json(envelope): Json<Value>) -> (StatusCode, Json<Value>) {
    let (status, body) = im.take(&envelope);
    (status, Json(body))
}

async fn control(State(im): State<Im>, Json(faults): Json<Faults>) -> Json<Faults> {
    im.set_faults(faults.clone());
    Json(faults)
}

async fn group(State(im): State<Im>, Path(room_id): Path<String>) -> (StatusCode, Json<Value>) {
    match im.group(&room_id) {
        Some(g) => (StatusCode::OK, Json(json!(g))),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": "no such group" })),
        ),
    }
}

async fn stats(State(im): State<Im>) -> Json<Value> {
    let (received, duplicates, refused) = im.counts();
    let groups = im.0.lock().unwrap().groups.len();
    Json(
        json!({ "received": received, "duplicates": duplicates, "refused": refused, "groups": groups }),
    )
}
