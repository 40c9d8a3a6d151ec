//! The PostgreSQL backend of postbox.
//!
//! Services enqueue inside their own transaction:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> postbox_core::Result<()> {
//! use postbox_core::NewEvent;
//! use postbox_postgres::PgOutbox;
//!
//! let outbox = PgOutbox::new(pool.clone(), "room_outbox")?;
//! let mut tx = pool.begin().await.map_err(|e| postbox_core::Error::database("begin", e))?;
//! // ... the service's own writes on &mut *tx ...
//! outbox.enqueue(&mut tx, &NewEvent::new("room", "RoomCreated", r#"{"room_id":42}"#)).await?;
//! tx.commit().await.map_err(|e| postbox_core::Error::database("commit", e))?;
//! # Ok(()) }
//! ```
//!
//! The relay and the CLI use the same type through
//! [`OutboxStore`](postbox_core::OutboxStore).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod archive;
mod doctor;
mod explain;
mod migrate;
mod sql;
mod store;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::PgConnection;

use postbox_core::redact::redact_url;
use postbox_core::{Error, NewEvent, Result, TableName};

/// SQL texts with the table name filled in once.
#[derive(Debug)]
struct Statements {
    now_ms: String,
    insert_event: String,
    claim_pending: String,
    claim_due_retries: String,
    claim_pending_ordered: String,
    claim_due_retries_ordered: String,
    claim_expired_leases: String,
    mark_delivered: String,
    mark_failed: String,
    release: String,
    count_by_status: String,
    backlog: String,
    list_select: String,
    present_app_codes: String,
    find_archived: String,
    delivered_per_minute: String,
    find: String,
    replay_ids: String,
    replay_ids_dry: String,
    replay_filter: String,
    replay_filter_dry: String,
    unarchive_filter: String,
    unarchive_filter_dry: String,
    delete_unarchived: String,
    history_failed: String,
    history_lease_expired: String,
    history_replayed: String,
    replay_set_delivered_to: String,
    history_prune: String,
    history: String,
    archive_batch: String,
    archive_pick: String,
}

impl Statements {
    /// The statement that selects (and locks) rows for one claim query;
    /// `ordered` picks the per-aggregate variant.
    fn claim_select(&self, source: postbox_core::ClaimSource, ordered: bool) -> &str {
        use postbox_core::ClaimSource::*;
        match (source, ordered) {
            (Pending, false) => &self.claim_pending,
            (Pending, true) => &self.claim_pending_ordered,
            (DueRetry, false) => &self.claim_due_retries,
            (DueRetry, true) => &self.claim_due_retries_ordered,
            (ExpiredLease, _) => &self.claim_expired_leases,
        }
    }

    fn new(t: &TableName) -> Self {
        Statements {
            now_ms: sql::NOW_MS.to_owned(),
            insert_event: t.render(sql::INSERT_EVENT),
            claim_pending: t.render(sql::CLAIM_PENDING),
            claim_due_retries: t.render(sql::CLAIM_DUE_RETRIES),
            claim_pending_ordered: t.render(sql::CLAIM_PENDING_ORDERED),
            claim_due_retries_ordered: t.render(sql::CLAIM_DUE_RETRIES_ORDERED),
            claim_expired_leases: t.render(sql::CLAIM_EXPIRED_LEASES),
            mark_delivered: t.render(sql::MARK_DELIVERED),
            mark_failed: t.render(sql::MARK_FAILED),
            release: t.render(sql::RELEASE),
            count_by_status: t.render(sql::COUNT_BY_STATUS),
            backlog: t.render(sql::BACKLOG),
            list_select: sql::LIST_SELECT.to_owned(),
            present_app_codes: t.render(sql::PRESENT_APP_CODES),
            find_archived: t.render(sql::FIND_ARCHIVED),
            delivered_per_minute: t.render(sql::DELIVERED_PER_MINUTE),
            find: t.render(sql::FIND),
            replay_ids: t.render(sql::REPLAY_IDS),
            replay_ids_dry: t.render(sql::REPLAY_IDS_DRY),
            replay_filter: t.render(sql::REPLAY_FILTER),
            replay_filter_dry: t.render(sql::REPLAY_FILTER_DRY),
            unarchive_filter: t.render(sql::UNARCHIVE_FILTER),
            unarchive_filter_dry: t.render(sql::UNARCHIVE_FILTER_DRY),
            delete_unarchived: t.render(sql::DELETE_UNARCHIVED),
            history_failed: t.render(sql::HISTORY_FAILED),
            history_lease_expired: t.render(sql::HISTORY_LEASE_EXPIRED),
            history_replayed: t.render(sql::HISTORY_REPLAYED),
            replay_set_delivered_to: t.render(sql::REPLAY_SET_DELIVERED_TO),
            history_prune: t.render(sql::HISTORY_PRUNE),
            history: t.render(sql::HISTORY),
            archive_batch: t.render(sql::ARCHIVE_BATCH),
            archive_pick: t.render(sql::ARCHIVE_PICK),
        }
    }
}

/// An outbox table in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgOutbox {
    pool: PgPool,
    table: TableName,
    max_payload_bytes: usize,
    sql: std::sync::Arc<Statements>,
}

impl PgOutbox {
    /// Uses `pool` for the outbox table `table` (validated).
    pub fn new(pool: PgPool, table: &str) -> Result<Self> {
        let table = TableName::new(table)?;
        Ok(PgOutbox {
            pool,
            sql: std::sync::Arc::new(Statements::new(&table)),
            table,
            max_payload_bytes: 1024 * 1024,
        })
    }

    /// Connects a pool of `max_connections` to `url`.
    pub async fn connect(url: &str, table: &str, max_connections: u32) -> Result<Self> {
        let opts: PgConnectOptions = url
            .parse()
            .map_err(|e| Error::config("database.url", format!("{}: {e}", redact_url(url))))?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(opts)
            .await
            .map_err(|e| crate::db_error("connecting to PostgreSQL", e))?;
        Self::new(pool, table)
    }

    /// Sets the payload limit `enqueue` enforces (default 1 MiB).
    pub fn with_max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Writes `event` on the caller's connection or transaction (pass
    /// `&mut tx`), so it commits or rolls back with the caller's own rows.
    ///
    /// A duplicate `(app_code, event_id)` returns [`Error::DuplicateEvent`]
    /// and leaves the transaction usable; an oversized payload returns
    /// [`Error::PayloadTooLarge`] without touching the database.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &NewEvent) -> Result<i64> {
        event.validate(self.max_payload_bytes)?;
        let id: Option<i64> = sqlx::query_scalar(&self.sql.insert_event)
            .bind(&event.app_code)
            .bind(&event.event_id)
            .bind(&event.event_type)
            .bind(&event.aggregate_id)
            .bind(event.aggregate_version)
            .bind(&event.payload)
            .bind(event.headers_json())
            .fetch_optional(conn)
            .await
            .map_err(|e| crate::db_error("enqueue", e))?;
        id.ok_or_else(|| Error::DuplicateEvent {
            app_code: event.app_code.clone(),
            event_id: event.event_id.clone(),
        })
    }
}

pub(crate) use postbox_sqlx::db_error;
