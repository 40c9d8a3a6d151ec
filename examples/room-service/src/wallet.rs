//! The wallet: a second owner service, with its own database tables, its
//! own outbox (`wallet_outbox`) and its own relay. The room service asks it
//! for a debit before it commits a gift; every debit commits a
//! `WalletDebited` event with it. A gift the room refuses after its debit
//! (the first try's commit failed, and by the retry the receiver had left)
//! is refunded, once, with a `WalletRefunded` event.
//!
//! Nobody else reads `wallet_outbox` (seed 002): the wallet's relay
//! publishes it to RabbitMQ, and the notice side consumes it from there.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use postbox::NewEvent;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::db::{is_unique_violation, Db, Tx};
use crate::room::{Debit, Refusal};
use crate::{args, now_ms};

/// The wallet's tables; `wallet_outbox` is postbox's.
pub const TABLES: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS wallet_account (
        user_id VARCHAR(64) NOT NULL PRIMARY KEY,
        balance BIGINT NOT NULL,
        version BIGINT NOT NULL)",
    // One row per debit: the idempotency record, by the room's command_id.
    "CREATE TABLE IF NOT EXISTS wallet_debit (
        command_id VARCHAR(64) NOT NULL PRIMARY KEY,
        user_id VARCHAR(64) NOT NULL,
        amount BIGINT NOT NULL,
        balance_after BIGINT NOT NULL,
        created_at_ms BIGINT NOT NULL)",
    // One row per refund of a debit, by the same command_id.
    "CREATE TABLE IF NOT EXISTS wallet_refund (
        command_id VARCHAR(64) NOT NULL PRIMARY KEY,
        user_id VARCHAR(64) NOT NULL,
        amount BIGINT NOT NULL,
        balance_after BIGINT NOT NULL,
        created_at_ms BIGINT NOT NULL)",
];

/// The wallet service.
#[derive(Clone)]
pub struct WalletService {
    db: Db,
    app_code: String,
    /// What a user has the first time the wallet sees them.
    initial_balance: i64,
}

/// `POST /refund`.
#[derive(Debug, Deserialize)]
pub struct RefundRequest {
    /// The room command whose debit goes back.
    pub command_id: String,
}

/// `POST /debit`.
#[derive(Debug, Deserialize)]
pub struct DebitRequest {
    /// The room command paying: a second debit with it changes nothing.
    pub command_id: String,
    /// Who pays.
    pub user_id: String,
    /// How much (> 0).
    pub amount: i64,
}

type Reply = (StatusCode, Json<Value>);

fn reply(status: StatusCode, body: Value) -> Reply {
    (status, Json(body))
}

impl WalletService {
    /// A wallet on `db` (migrated), enqueuing under `app_code`.
    pub fn new(db: Db, app_code: &str, initial_balance: i64) -> Self {
        WalletService {
            db,
            app_code: app_code.to_owned(),
            initial_balance,
        }
    }

    /// `POST /debit`, `POST /refund`, `GET /accounts/{user_id}`.
    pub fn router(self) -> Router {
        Router::new()
            .route("/debit", post(debit))
            .route("/refund", post(refund))
            .route("/accounts/{user_id}", get(account))
            .with_state(self)
    }

    /// Debits `req.amount` from `req.user_id` and commits `WalletDebited`
    /// with it, once per command_id.
    pub async fn debit(&self, req: &DebitRequest) -> Result<Reply, postbox::Error> {
        if req.amount <= 0 || req.command_id.is_empty() || req.user_id.is_empty() {
            return Ok(reply(
                StatusCode::BAD_REQUEST,
                json!({ "error": "command_id, user_id and a positive amount are required" }),
            ));
        }
        let db_error = |e| postbox::Error::database("debit", e);
        let mut tx = self.db.begin().await?;
        let done: Option<(i64,)> = tx
            .fetch_optional(
                "SELECT balance_after FROM wallet_debit WHERE command_id = ?",
                args![req.command_id.as_str()],
            )
            .await?;
        if let Some((balance,)) = done {
            // Refunded since (the room refused the command): answered
            // "paid", a retry the room then accepted sent the gift free.
            let refunded: Option<(i64,)> = tx
                .fetch_optional(
                    "SELECT amount FROM wallet_refund WHERE command_id = ?",
                    args![req.command_id.as_str()],
                )
                .await?;
            if refunded.is_some() {
                return Ok(reply(
                    StatusCode::CONFLICT,
                    json!({ "error": "this command's debit was refunded: send the gift again with a new command_id" }),
                ));
            }
            return Ok(reply(
                StatusCode::OK,
                json!({ "balance": balance, "replayed": true }),
            ));
        }
        let open = format!(
            "{} INTO wallet_account (user_id, balance, version) VALUES (?, ?, 0)",
            self.db.insert_ignore()
        );
        tx.execute(&open, args![req.user_id.as_str(), self.initial_balance])
            .await
            .map_err(db_error)?;
        let paid = tx
            .execute(
                "UPDATE wallet_account SET balance = balance - ?, version = version + 1 WHERE user_id = ? AND balance >= ?",
                args![req.amount, req.user_id.as_str(), req.amount],
            )
            .await
            .map_err(db_error)?;
        if paid == 0 {
            return Ok(reply(
                StatusCode::PAYMENT_REQUIRED,
                json!({ "error": "insufficient balance" }),
            ));
        }
        self.settle(tx, &DEBIT, &req.command_id, &req.user_id, req.amount)
            .await
    }

    /// Gives back the debit of `req.command_id` and commits
    /// `WalletRefunded` with it, once; a command never debited has
    /// nothing to give back (`"refunded": false`).
    pub async fn refund(&self, req: &RefundRequest) -> Result<Reply, postbox::Error> {
        let db_error = |e| postbox::Error::database("refund", e);
        let mut tx = self.db.begin().await?;
        let debited: Option<(String, i64)> = tx
            .fetch_optional(
                "SELECT user_id, amount FROM wallet_debit WHERE command_id = ?",
                args![req.command_id.as_str()],
            )
            .await?;
        let Some((user_id, amount)) = debited else {
            return Ok(reply(StatusCode::OK, json!({ "refunded": false })));
        };
        let done: Option<(i64,)> = tx
            .fetch_optional(
                "SELECT balance_after FROM wallet_refund WHERE command_id = ?",
                args![req.command_id.as_str()],
            )
            .await?;
        if let Some((balance,)) = done {
            return Ok(reply(
                StatusCode::OK,
                json!({ "refunded": true, "balance": balance, "replayed": true }),
            ));
        }
        tx.execute(
            "UPDATE wallet_account SET balance = balance + ?, version = version + 1 WHERE user_id = ?",
            args![amount, user_id.as_str()],
        )
        .await
        .map_err(db_error)?;
        self.settle(tx, &REFUND, &req.command_id, &user_id, amount)
            .await
    }

    /// The end of a balance change `tx` made for `command_id`: the row of
    /// `kind`'s log (once per command_id: a concurrent twin answers 409),
    /// its event with the account's new version, one commit.
    async fn settle(
        &self,
        mut tx: Tx,
        kind: &Kind,
        command_id: &str,
        user_id: &str,
        amount: i64,
    ) -> Result<Reply, postbox::Error> {
        let (balance, version): (i64, i64) = tx
            .fetch_optional(
                "SELECT balance, version FROM wallet_account WHERE user_id = ?",
                args![user_id],
            )
            .await?
            .expect("the account was just written");
        let logged = tx
            .execute(
                &format!(
                    "INSERT INTO {} (command_id, user_id, amount, balance_after, created_at_ms) VALUES (?, ?, ?, ?, ?)",
                    kind.log
                ),
                args![command_id, user_id, amount, balance, now_ms()],
            )
            .await;
        match logged {
            Err(e) if is_unique_violation(&e) => {
                return Ok(reply(
                    StatusCode::CONFLICT,
                    json!({ "error": format!("a {} with this command_id is being written; send it again", kind.name) }),
                ))
            }
            other => other.map_err(|e| postbox::Error::database(kind.name, e))?,
        };
        let payload = json!({
            "user_id": user_id, "amount": amount, "balance": balance, "command_id": command_id,
        });
        let event = NewEvent::new(&self.app_code, kind.event_type, payload.to_string())
            .aggregate(user_id, version);
        tx.enqueue(&event).await?;
        tx.commit().await?;
        let mut answer = json!({ "balance": balance, "event_id": event.event_id });
        if kind.refund {
            answer["refunded"] = true.into();
        }
        Ok(reply(StatusCode::OK, answer))
    }
}

/// A balance change's log table and event.
struct Kind {
    name: &'static str,
    log: &'static str,
    event_type: &'static str,
    /// Its answer says `"refunded": true`.
    refund: bool,
}

const DEBIT: Kind = Kind {
    name: "debit",
    log: "wallet_debit",
    event_type: "WalletDebited",
    refund: false,
};

const REFUND: Kind = Kind {
    name: "refund",
    log: "wallet_refund",
    event_type: "WalletRefunded",
    refund: true,
};

async fn refund(State(wallet): State<WalletService>, Json(req): Json<RefundRequest>) -> Reply {
    answered("refund", wallet.refund(&req).await)
}

async fn debit(State(wallet): State<WalletService>, Json(req): Json<DebitRequest>) -> Reply {
    answered("debit", wallet.debit(&req).await)
}

/// A change's reply, or 503 when the database failed it.
fn answered(what: &str, result: Result<Reply, postbox::Error>) -> Reply {
    result.unwrap_or_else(|e| {
        tracing::error!(error = %e, "{what} failed");
        reply(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({ "error": e.to_string() }),
        )
    })
}

async fn account(State(wallet): State<WalletService>, Path(user_id): Path<String>) -> Reply {
    let row: Result<Option<(i64,)>, _> = wallet
        .db
        .fetch_optional(
            "SELECT balance FROM wallet_account WHERE user_id = ?",
            args![user_id.as_str()],
        )
        .await;
    match row {
        Ok(Some((balance,))) => reply(
            StatusCode::OK,
            json!({ "user_id": user_id, "balance": balance }),
        ),
        Ok(None) => reply(
            StatusCode::OK,
            json!({ "user_id": user_id, "balance": wallet.initial_balance }),
        ),
        Err(e) => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({ "error": e.to_string() }),
        ),
    }
}

/// The room service's side: asks the wallet for debits over HTTP.
#[derive(Clone, Debug)]
pub struct WalletClient {
    http: reqwest::Client,
    base: String,
}

impl WalletClient {
    /// A client of the wallet at `base` (`http://127.0.0.1:8092`).
    pub fn new(base: &str) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(3))
            .build()
            .expect("an HTTP client");
        WalletClient {
            http,
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    /// Gives back the debit of `command_id`, if any (idempotent).
    pub async fn refund(&self, command_id: &str) -> Result<(), String> {
        let answer = self
            .http
            .post(format!("{}/refund", self.base))
            .json(&json!({ "command_id": command_id }))
            .send()
            .await
            .map_err(|e| format!("wallet unreachable: {e}"))?;
        match answer.status() {
            s if s.is_success() => Ok(()),
            s => Err(format!(
                "wallet answered {s}: {}",
                answer.text().await.unwrap_or_default()
            )),
        }
    }

    /// `Ok` when paid; `Err(Ok(refusal))` when the wallet said no;
    /// `Err(Err(why))` when it could not be asked.
    pub async fn debit(
        &self,
        command_id: &str,
        debit: &Debit,
    ) -> Result<(), Result<Refusal, String>> {
        let body =
            json!({ "command_id": command_id, "user_id": debit.user_id, "amount": debit.amount });
        let answer = self
            .http
            .post(format!("{}/debit", self.base))
            .json(&body)
            .send()
            .await
            .map_err(|e| Err(format!("wallet unreachable: {e}")))?;
        match answer.status() {
            s if s.is_success() => Ok(()),
            StatusCode::PAYMENT_REQUIRED => Err(Ok(Refusal::InsufficientBalance)),
            StatusCode::CONFLICT => Err(Ok(Refusal::Conflict(
                answer.text().await.unwrap_or_default(),
            ))),
            StatusCode::BAD_REQUEST => Err(Ok(Refusal::Invalid(
                answer.text().await.unwrap_or_default(),
            ))),
            s => Err(Err(format!(
                "wallet answered {s}: {}",
                answer.text().await.unwrap_or_default()
            ))),
        }
    }
}
