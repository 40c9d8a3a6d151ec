//! The room service: HTTP commands, each one commit of command log, room
//! state and outbox row (the seed's `SaveMutation`). The request path never
//! calls IM or activity: the relay delivers the outbox rows after commit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use postbox::NewEvent;
use serde_json::{json, Value};

use crate::db::{is_unique_violation, Db};
use crate::room::{self, Command, Refusal, RoomState};
use crate::wallet::WalletClient;
use crate::{args, now_ms};

/// The room service's tables; the outbox table (`room_outbox`) is
/// postbox's, created by `postbox migrate` or [`Db::open`].
pub const TABLES: [&str; 3] = [
    // The idempotency record: one row per command that changed a room.
    "CREATE TABLE IF NOT EXISTS room_command_log (
        command_id VARCHAR(64) NOT NULL PRIMARY KEY,
        room_id VARCHAR(64) NOT NULL,
        command VARCHAR(16) NOT NULL,
        version BIGINT NOT NULL,
        response TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL)",
    // Room meta and state, with the version every command bumps.
    "CREATE TABLE IF NOT EXISTS room_meta (
        room_id VARCHAR(64) NOT NULL PRIMARY KEY,
        version BIGINT NOT NULL,
        state TEXT NOT NULL,
        updated_at_ms BIGINT NOT NULL)",
    // A snapshot every `snapshot_every_n` versions (the command log stays
    // the record to recover from).
    "CREATE TABLE IF NOT EXISTS room_snapshot (
        room_id VARCHAR(64) NOT NULL,
        version BIGINT NOT NULL,
        state TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL,
        PRIMARY KEY (room_id, version))",
];

/// What the service runs with.
#[derive(Clone)]
pub struct RoomService {
    db: Db,
    app_code: String,
    wallet: WalletClient,
    snapshot_every_n: i64,
    /// The Room Cells: one command at a time per room in this process. (The
    /// seed holds a Redis lease per room across instances; here the version
    /// check in `SaveMutation` is what keeps two instances from both
    /// writing the same version.)
    cells: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    /// The list / presence projection: members per room, best effort.
    presence: Arc<Mutex<HashMap<String, usize>>>,
}

/// How long each step of a command took, logged as `room_command_timing`.
#[derive(Debug, Default)]
struct Timing {
    idempotency_ms: f64,
    lease_ms: f64,
    wallet_debit_ms: f64,
    save_mutation_ms: f64,
    snapshot_ms: f64,
    projection_ms: f64,
}

fn ms_since(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// A command's answer: status and body. The body of a command that
/// changed the room is kept in the command log and returned again for its
/// `command_id`.
pub struct Answer(StatusCode, Value);

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

fn refused(r: Refusal) -> Answer {
    let (status, error) = match r {
        Refusal::Invalid(m) => (StatusCode::BAD_REQUEST, m),
        Refusal::NoRoom => (StatusCode::NOT_FOUND, "no such room".to_owned()),
        Refusal::Conflict(m) => (StatusCode::CONFLICT, m),
        Refusal::InsufficientBalance => (
            StatusCode::PAYMENT_REQUIRED,
            "insufficient balance".to_owned(),
        ),
    };
    Answer(status, json!({ "error": error }))
}

fn failed(what: &str, e: impl std::fmt::Display) -> Answer {
    tracing::error!(error = %e, "{what}");
    Answer(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({ "error": format!("{what}: {e}") }),
    )
}

impl RoomService {
    /// A service on `db` (migrated), enqueuing under `app_code`.
    pub fn new(db: Db, app_code: &str, wallet: WalletClient, snapshot_every_n: i64) -> Self {
        RoomService {
            db,
            app_code: app_code.to_owned(),
            wallet,
            snapshot_every_n: snapshot_every_n.max(1),
            cells: Arc::default(),
            presence: Arc::default(),
        }
    }

    /// The HTTP API: `POST /rooms/{room_id}/{command}`, `GET /rooms/{room_id}`.
    pub fn router(self) -> Router {
        Router::new()
            .route("/rooms/{room_id}/{command}", post(command))
            .route("/rooms/{room_id}", get(show))
            .route("/healthz", get(|| async { "ok" }))
            .with_state(self)
    }

    fn cell(&self, room_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut cells = self.cells.lock().unwrap();
        cells.entry(room_id.to_owned()).or_default().clone()
    }

    async fn load(&self, room_id: &str) -> Result<Option<RoomState>, postbox::Error> {
        self.json_of("SELECT state FROM room_meta WHERE room_id = ?", room_id)
            .await
    }

    async fn recorded(&self, command_id: &str) -> Result<Option<Value>, postbox::Error> {
        self.json_of(
            "SELECT response FROM room_command_log WHERE command_id = ?",
            command_id,
        )
        .await
    }

    /// The JSON column `sql` reads for `key`, if there is a row.
    async fn json_of<T: serde::de::DeserializeOwned>(
        &self,
        sql: &str,
        key: &str,
    ) -> Result<Option<T>, postbox::Error> {
        let row: Option<(String,)> = self.db.fetch_optional(sql, args![key]).await?;
        row.map(|(text,)| {
            serde_json::from_str(&text).map_err(|e| {
                postbox::Error::Internal(format!("`{sql}` for {key}: not the service's JSON: {e}"))
            })
        })
        .transpose()
    }

    /// Runs one command; every step is timed and logged.
    pub async fn run(&self, name: &str, room_id: &str, cmd: Command) -> Answer {
        let started = Instant::now();
        let mut timing = Timing::default();
        let answer = self.steps(name, room_id, &cmd, &mut timing).await;
        let outbox = answer.0 == StatusCode::OK && answer.1.get("replayed").is_none();
        tracing::info!(
            target: "room_command_timing",
            command = name,
            room_id,
            command_id = %cmd.command_id,
            status = answer.0.as_u16(),
            idempotency_ms = timing.idempotency_ms,
            lease_ms = timing.lease_ms,
            wallet_debit_ms = timing.wallet_debit_ms,
            save_mutation_ms = timing.save_mutation_ms,
            snapshot_ms = timing.snapshot_ms,
            projection_ms = timing.projection_ms,
            // The request path never calls activity or IM: always 0.
            activity_ms = 0.0,
            tencent_im_ms = 0.0,
            // Every event goes to both, through the outbox.
            activity_async_outbox = outbox,
            tencent_im_async_outbox = outbox,
            total_ms = ms_since(started),
            "room_command_timing"
        );
        answer
    }

    /// The answer a command seen before got (or why the log cannot say);
    /// `None` for a new command.
    async fn answered_before(&self, command_id: &str) -> Option<Answer> {
        match self.recorded(command_id).await {
            Ok(Some(first)) => Some(replayed(first)),
            Ok(None) => None,
            Err(e) => Some(failed("command log", e)),
        }
    }

    async fn steps(&self, name: &str, room_id: &str, cmd: &Command, timing: &mut Timing) -> Answer {
        if !room::COMMANDS.contains(&name) {
            return refused(Refusal::Invalid(format!(
                "unknown command `{name}`, use one of {:?}",
                room::COMMANDS
            )));
        }
        if room_id.is_empty() || room_id.len() > 64 || cmd.command_id.len() > 64 {
            return refused(Refusal::Invalid(
                "room_id and command_id are 1 to 64 characters".into(),
            ));
        }
        // 1. The command log: a command seen before answers as it did then.
        let t = Instant::now();
        if let Some(before) = self.answered_before(&cmd.command_id).await {
            return before;
        }
        timing.idempotency_ms = ms_since(t);

        // 2. The room's cell, and its state.
        let t = Instant::now();
        let cell = self.cell(room_id);
        let _held = cell.lock().await;
        // Looked up again with the room held: a retry that overlapped its
        // first try waited here while that one committed, and deciding
        // again on the changed room answered 409 ("bob is in the room").
        if let Some(before) = self.answered_before(&cmd.command_id).await {
            return before;
        }
        let state = match self.load(room_id).await {
            Ok(s) => s,
            Err(e) => return failed("load room", e),
        };
        timing.lease_ms = ms_since(t);

        // 3. The change, on a copy; a refusal writes nothing. A gift may
        // have been paid for by an earlier try of this command whose commit
        // failed (409 or 503, "send it again"): refused now (the receiver
        // left meanwhile), its debit goes back. Without it the sender paid
        // for a gift nobody got. Idempotent; a command never debited has
        // nothing to give back. A refund that fails answers 503, so the
        // client's next try gives it back.
        let change = match room::decide(name, room_id, state.as_ref(), cmd) {
            Ok(c) => c,
            Err(r) => {
                if room::debit_of(name, cmd).is_some() {
                    if let Err(e) = self.wallet.refund(&cmd.command_id).await {
                        return failed("wallet refund", e);
                    }
                }
                return refused(r);
            }
        };

        // 4. A gift is paid for before the room commits it. The debit is
        // idempotent by command_id: a retried command is not charged twice.
        if let Some(debit) = room::debit_of(name, cmd) {
            let t = Instant::now();
            let paid = self.wallet.debit(&cmd.command_id, &debit).await;
            timing.wallet_debit_ms = ms_since(t);
            match paid {
                Ok(()) => {}
                Err(Ok(r)) => return refused(r),
                Err(Err(e)) => return failed("wallet debit", e),
            }
        }

        // 5. SaveMutation: command log + room meta + outbox, one commit.
        let t = Instant::now();
        let event = NewEvent::new(
            &self.app_code,
            change.event_type,
            change.payload.to_string(),
        )
        .aggregate(room_id, change.state.version);
        let response = json!({
            "room_id": room_id,
            "command_id": cmd.command_id,
            "version": change.state.version,
            "event_type": change.event_type,
            "event_id": event.event_id,
            "state": change.state,
        });
        match self
            .save_mutation(name, state.as_ref(), &change.state, &event, &response)
            .await
        {
            Ok(Saved::Done) => {}
            Ok(Saved::Raced) => {
                // Another request with this command_id committed first.
                return match self.recorded(&cmd.command_id).await {
                    Ok(Some(first)) => replayed(first),
                    Ok(None) => failed("command log", "a racing command vanished"),
                    Err(e) => failed("command log", e),
                };
            }
            Ok(Saved::Stale) => {
                return refused(Refusal::Conflict(
                    "the room changed under this command (another instance); send it again".into(),
                ))
            }
            Err(e) => return failed("save mutation", e),
        }
        timing.save_mutation_ms = ms_since(t);

        // 6. A snapshot every n versions; the command log is what recovery
        // relies on, so a failed snapshot is logged, not returned.
        if change.state.version % self.snapshot_every_n == 0 {
            let t = Instant::now();
            let snap = self
                .db
                .execute(
                    "INSERT INTO room_snapshot (room_id, version, state, created_at_ms) VALUES (?, ?, ?, ?)",
                    args![room_id, change.state.version, serde_json::to_string(&change.state).unwrap(), now_ms()],
                )
                .await;
            if let Err(e) = snap {
                tracing::warn!(room_id, error = %e, "snapshot not written");
            }
            timing.snapshot_ms = ms_since(t);
        }

        // 7. Projections (room list, presence): best effort, in memory here.
        let t = Instant::now();
        self.presence
            .lock()
            .unwrap()
            .insert(room_id.to_owned(), change.state.members.len());
        timing.projection_ms = ms_since(t);

        Answer(StatusCode::OK, response)
    }

    async fn save_mutation(
        &self,
        name: &str,
        before: Option<&RoomState>,
        after: &RoomState,
        event: &NewEvent,
        response: &Value,
    ) -> Result<Saved, postbox::Error> {
        let db_error = |e| postbox::Error::database("save mutation", e);
        let mut tx = self.db.begin().await?;
        let logged = tx
            .execute(
                "INSERT INTO room_command_log (command_id, room_id, command, version, response, created_at_ms) VALUES (?, ?, ?, ?, ?, ?)",
                args![
                    response["command_id"].as_str().unwrap(),
                    after.room_id.as_str(),
                    name,
                    after.version,
                    response.to_string(),
                    now_ms()
                ],
            )
            .await;
        match logged {
            Err(e) if is_unique_violation(&e) => return Ok(Saved::Raced),
            other => other.map_err(db_error)?,
        };
        let state = serde_json::to_string(after).unwrap();
        let wrote = match before {
            None => tx
                .execute(
                    "INSERT INTO room_meta (room_id, version, state, updated_at_ms) VALUES (?, ?, ?, ?)",
                    args![after.room_id.as_str(), after.version, state, now_ms()],
                )
                .await
                .or_else(|e| if is_unique_violation(&e) { Ok(0) } else { Err(e) }),
            Some(b) => {
                tx.execute(
                    "UPDATE room_meta SET version = ?, state = ?, updated_at_ms = ? WHERE room_id = ? AND version = ?",
                    args![after.version, state, now_ms(), after.room_id.as_str(), b.version],
                )
                .await
            }
        }
        .map_err(db_error)?;
        if wrote != 1 {
            return Ok(Saved::Stale); // dropped: rolls back
        }
        tx.enqueue(event).await?;
        tx.commit().await?;
        Ok(Saved::Done)
    }
}

enum Saved {
    Done,
    /// The command log already has this command_id.
    Raced,
    /// The room's version moved since it was read.
    Stale,
}

fn replayed(mut first: Value) -> Answer {
    first["replayed"] = true.into();
    Answer(StatusCode::OK, first)
}

async fn command(
    State(service): State<RoomService>,
    Path((room_id, name)): Path<(String, String)>,
    body: Result<Json<Command>, axum::extract::rejection::JsonRejection>,
) -> Answer {
    match body {
        Ok(Json(cmd)) => service.run(&name, &room_id, cmd).await,
        Err(e) => refused(Refusal::Invalid(e.body_text())),
    }
}

async fn show(State(service): State<RoomService>, Path(room_id): Path<String>) -> Answer {
    match service.load(&room_id).await {
        Ok(Some(state)) => Answer(StatusCode::OK, serde_json::to_value(state).unwrap()),
        Ok(None) => refused(Refusal::NoRoom),
        Err(e) => failed("load room", e),
    }
}
