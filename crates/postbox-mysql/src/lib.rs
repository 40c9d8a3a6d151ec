//! The MySQL 8 / MariaDB 10.6+ backend of postbox.
//!
//! Services enqueue inside their own transaction:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::MySqlPool) -> postbox_core::Result<()> {
//! use postbox_core::NewEvent;
//! use postbox_mysql::MySqlOutbox;
//!
//! let outbox = MySqlOutbox::new(pool.clone(), "room_outbox")?;
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

mod doctor;
mod explain;
mod migrate;
mod sql;
mod store;

use sqlx::error::ErrorKind;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::MySqlConnection;

use postbox_core::redact::redact_url;
use postbox_core::{Error, NewEvent, Result, TableName};

/// SQL texts with the table name filled in once. Those containing `{ids}`
/// get their placeholder list from [`sql::in_list`] at run time.
#[derive(Debug)]
struct Statements {
    now_ms: String,
    insert_event: String,
    claim_pending: String,
    claim_due_retries: String,
    claim_pending_ordered: String,
    claim_due_retries_ordered: String,
    claim_expired_leases: String,
    claim_take: String,
    claim_take_expired: String,
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
    select_ids: String,
    replay_ids: String,
    replay_ids_dry: String,
    replay_ids_lock: String,
    replay_filter_dry: String,
    replay_filter_lock: String,
    unarchive_filter_dry: String,
    unarchive_filter_lock: String,
    unarchive_ids: String,
    delete_unarchived: String,
    history_failed: String,
    history_lease_expired: String,
    history_replayed: String,
    replay_set_delivered_to: String,
    history_over_limit: String,
    history_prune: String,
    history: String,
    archive_pick: String,
    archive_pick_lock: String,
    archive_copy: String,
    archive_delete: String,
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
            claim_take: t.render(sql::CLAIM_TAKE),
            claim_take_expired: t.render(sql::CLAIM_TAKE_EXPIRED),
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
            select_ids: t.render(sql::SELECT_IDS),
            replay_ids: t.render(sql::REPLAY_IDS),
            replay_ids_dry: t.render(sql::REPLAY_IDS_DRY),
            replay_ids_lock: t.render(sql::REPLAY_IDS_LOCK),
            replay_filter_dry: t.render(sql::REPLAY_FILTER_DRY),
            replay_filter_lock: t.render(sql::REPLAY_FILTER_LOCK),
            unarchive_filter_dry: t.render(sql::UNARCHIVE_FILTER_DRY),
            unarchive_filter_lock: t.render(sql::UNARCHIVE_FILTER_LOCK),
            unarchive_ids: t.render(sql::UNARCHIVE_IDS),
            delete_unarchived: t.render(sql::DELETE_UNARCHIVED),
            history_failed: t.render(sql::HISTORY_FAILED),
            history_lease_expired: t.render(sql::HISTORY_LEASE_EXPIRED),
            history_replayed: t.render(sql::HISTORY_REPLAYED),
            replay_set_delivered_to: t.render(sql::REPLAY_SET_DELIVERED_TO),
            history_over_limit: t.render(sql::HISTORY_OVER_LIMIT),
            history_prune: t.render(sql::HISTORY_PRUNE),
            history: t.render(sql::HISTORY),
            archive_pick: t.render(sql::ARCHIVE_PICK),
            archive_pick_lock: t.render(sql::ARCHIVE_PICK_LOCK),
            archive_copy: t.render(sql::ARCHIVE_COPY),
            archive_delete: t.render(sql::ARCHIVE_DELETE),
        }
    }
}

/// An outbox table in MySQL 8 or MariaDB 10.6+.
#[derive(Debug, Clone)]
pub struct MySqlOutbox {
    pool: MySqlPool,
    table: TableName,
    max_payload_bytes: usize,
    sql: std::sync::Arc<Statements>,
}

impl MySqlOutbox {
    /// Uses `pool` for the outbox table `table` (validated).
    pub fn new(pool: MySqlPool, table: &str) -> Result<Self> {
        let table = TableName::new(table)?;
        Ok(MySqlOutbox {
            pool,
            sql: std::sync::Arc::new(Statements::new(&table)),
            table,
            max_payload_bytes: 1024 * 1024,
        })
    }

    /// Connects a pool of `max_connections` to `url` (`mysql://…` or
    /// `mariadb://…`).
    pub async fn connect(url: &str, table: &str, max_connections: u32) -> Result<Self> {
        let normalized = match url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => url.to_owned(),
        };
        let opts: MySqlConnectOptions = normalized
            .parse()
            .map_err(|e| Error::config("database.url", format!("{}: {e}", redact_url(url))))?;
        let pool = MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(opts)
            .await
            .map_err(|e| crate::db_error("connecting to MySQL", e))?;
        Self::new(pool, table)
    }

    /// Sets the payload limit `enqueue` enforces (default 1 MiB).
    pub fn with_max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Writes `event` on the caller's connection or transaction (pass
    /// `&mut tx`), so it commits or rolls back with the caller's own rows.
    /// Returns the new row id.
    ///
    /// A duplicate `(app_code, event_id)` returns [`Error::DuplicateEvent`]
    /// and leaves the transaction usable (MySQL undoes only the failed
    /// statement); an oversized payload returns [`Error::PayloadTooLarge`]
    /// without touching the database.
    pub async fn enqueue(&self, conn: &mut MySqlConnection, event: &NewEvent) -> Result<i64> {
        event.validate(self.max_payload_bytes)?;
        let done = sqlx::query(&self.sql.insert_event)
            .bind(&event.app_code)
            .bind(&event.event_id)
            .bind(&event.event_type)
            .bind(&event.aggregate_id)
            .bind(event.aggregate_version)
            .bind(&event.payload)
            .bind(event.headers_json())
            .execute(conn)
            .await;
        match done {
            // The column is a signed BIGINT, so the id always fits.
            Ok(done) => Ok(done.last_insert_id() as i64),
            Err(sqlx::Error::Database(e)) if e.kind() == ErrorKind::UniqueViolation => {
                Err(Error::DuplicateEvent {
                    app_code: event.app_code.clone(),
                    event_id: event.event_id.clone(),
                })
            }
            Err(e) => Err(crate::db_error("enqueue", e)),
        }
    }
}

pub(crate) use postbox_sqlx::db_error;
