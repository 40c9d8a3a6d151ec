//! The SQLite backend of postbox: the embedded default, for one relay
//! process next to the service.
//!
//! Services enqueue inside their own transaction:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::SqlitePool) -> postbox_core::Result<()> {
//! use postbox_core::NewEvent;
//! use postbox_sqlite::SqliteOutbox;
//!
//! let outbox = SqliteOutbox::new(pool.clone(), "room_outbox")?;
//! // `BEGIN IMMEDIATE` takes the write lock up front, so a transaction that
//! // reads before it writes never fails with SQLITE_BUSY half-way.
//! let mut tx = pool
//!     .begin_with("BEGIN IMMEDIATE")
//!     .await
//!     .map_err(|e| postbox_core::Error::database("begin", e))?;
//! // ... the service's own writes on &mut *tx ...
//! outbox.enqueue(&mut tx, &NewEvent::new("room", "RoomCreated", r#"{"room_id":42}"#)).await?;
//! tx.commit().await.map_err(|e| postbox_core::Error::database("commit", e))?;
//! # Ok(()) }
//! ```
//!
//! The relay and the CLI use the same type through
//! [`OutboxStore`](postbox_core::OutboxStore).
//!
//! SQLite has no `FOR UPDATE SKIP LOCKED`; each claim is one
//! `BEGIN IMMEDIATE` write transaction instead, so concurrent claims are
//! serialised by the database's write lock and never hand out a row twice.
//! The database clock is this host's clock.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod doctor;
mod explain;
mod migrate;
mod sql;
mod store;

use std::str::FromStr;
use std::time::Duration;

use sqlx::error::ErrorKind;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, SqliteConnection, Transaction};

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
    archive_pick: String,
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
            archive_pick: t.render(sql::ARCHIVE_PICK),
            archive_copy: t.render(sql::ARCHIVE_COPY),
            archive_delete: t.render(sql::ARCHIVE_DELETE),
        }
    }
}

/// An outbox table in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    table: TableName,
    max_payload_bytes: usize,
    sql: std::sync::Arc<Statements>,
}

/// True when `url` names an in-memory database (`sqlite::memory:`,
/// `sqlite://:memory:`, `…?mode=memory`).
fn is_memory_url(url: &str) -> bool {
    let rest = url
        .trim_start_matches("sqlite://")
        .trim_start_matches("sqlite:");
    let (db, params) = rest.split_once('?').unwrap_or((rest, ""));
    db == ":memory:" || params.split('&').any(|p| p == "mode=memory")
}

impl SqliteOutbox {
    /// Uses `pool` for the outbox table `table` (validated).
    pub fn new(pool: SqlitePool, table: &str) -> Result<Self> {
        let table = TableName::new(table)?;
        Ok(SqliteOutbox {
            pool,
            sql: std::sync::Arc::new(Statements::new(&table)),
            table,
            max_payload_bytes: 1024 * 1024,
        })
    }

    /// Connects a pool of `max_connections` to `url` (`sqlite://path`,
    /// `sqlite:path` or `sqlite::memory:`), creating the file if missing,
    /// in WAL mode with `synchronous = NORMAL`, a 10 s busy timeout and
    /// foreign keys on. An in-memory database gets exactly one connection,
    /// kept open, so every user sees the same database.
    pub async fn connect(url: &str, table: &str, max_connections: u32) -> Result<Self> {
        Self::open(url, table, max_connections, true).await
    }

    /// Like [`SqliteOutbox::connect`], but never creates the database file:
    /// a missing file is an error naming it (for commands that only read or
    /// need the schema `postbox migrate` creates).
    pub async fn connect_existing(url: &str, table: &str, max_connections: u32) -> Result<Self> {
        Self::open(url, table, max_connections, false).await
    }

    async fn open(url: &str, table: &str, max_connections: u32, create: bool) -> Result<Self> {
        let memory = is_memory_url(url);
        let opts = SqliteConnectOptions::from_str(url)
            .map_err(|e| Error::config("database.url", format!("{}: {e}", redact_url(url))))?;
        if !create && !memory && !opts.get_filename().exists() {
            return Err(Error::Database {
                operation: "opening the SQLite database",
                source: format!(
                    "database file `{}` does not exist (database.url = `{}`): run `postbox migrate` to create it, or point database.url at the right file",
                    opts.get_filename().display(),
                    redact_url(url)
                )
                .into(),
            });
        }
        let mut opts = opts
            .create_if_missing(create)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        if !memory {
            // An in-memory database has no WAL; it keeps its `memory` journal.
            opts = opts.journal_mode(SqliteJournalMode::Wal);
        }
        let mut pool = SqlitePoolOptions::new().acquire_timeout(Duration::from_secs(10));
        pool = if memory {
            // The database lives as long as its last connection: keep one.
            pool.max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
        } else {
            pool.max_connections(max_connections.max(1))
        };
        let pool = pool.connect_with(opts).await.map_err(|e| Error::Database {
            operation: "opening the SQLite database",
            source: format!("{}: {e}", redact_url(url)).into(),
        })?;
        Self::new(pool, table)
    }

    /// Sets the payload limit `enqueue` enforces (default 1 MiB).
    pub fn with_max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Writes `event` on the caller's connection or transaction (pass
    /// `&mut tx`), so it commits or rolls back with the caller's own rows.
    /// Returns the new row id.
    ///
    /// A duplicate `(app_code, event_id)` returns [`Error::DuplicateEvent`]
    /// and leaves the transaction usable (SQLite undoes only the failed
    /// statement); an oversized payload returns [`Error::PayloadTooLarge`]
    /// without touching the database.
    pub async fn enqueue(&self, conn: &mut SqliteConnection, event: &NewEvent) -> Result<i64> {
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
            Ok(done) => Ok(done.last_insert_rowid()),
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

/// Ends a write transaction: `COMMIT` when `res` is `Ok`, otherwise an
/// explicit `ROLLBACK` before the connection goes back to the pool (a
/// transaction dropped mid-way, e.g. by a cancelled future, is rolled back
/// by sqlx before the connection's next use).
async fn finish<T>(
    tx: Transaction<'static, Sqlite>,
    res: Result<T>,
    operation: &'static str,
) -> Result<T> {
    match res {
        Ok(value) => {
            tx.commit()
                .await
                .map_err(|e| crate::db_error(operation, e))?;
            Ok(value)
        }
        Err(err) => {
            if let Err(rb) = tx.rollback().await {
                tracing::warn!(operation, error = %rb, "rollback after a failed statement failed");
            }
            Err(err)
        }
    }
}

pub(crate) use postbox_sqlx::db_error;

#[cfg(test)]
mod tests {
    use super::is_memory_url;
    use postbox_core::OutboxStore;

    /// The `detail` column of `EXPLAIN QUERY PLAN`, one line per step.
    async fn plan<'q>(
        q: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
        pool: &sqlx::SqlitePool,
    ) -> String {
        use sqlx::Row;
        q.fetch_all(pool)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<String, _>(3))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every claim and the backlog query is answered from the index its
    /// comment names, never by scanning the table.
    #[tokio::test]
    async fn claims_use_their_indexes() {
        let o = super::SqliteOutbox::connect("sqlite::memory:", "room_outbox", 1)
            .await
            .unwrap();
        o.migrate().await.unwrap();
        let cases = [
            (&o.sql.claim_pending, "room_outbox_claim_retry_idx"),
            (&o.sql.claim_due_retries, "room_outbox_claim_retry_idx"),
            (&o.sql.claim_expired_leases, "room_outbox_claim_lease_idx"),
            (&o.sql.backlog, "room_outbox_claim_retry_idx"),
            (&o.sql.find, "room_outbox_event_id_idx"),
        ];
        for (sql, index) in cases {
            let plan = plan(
                sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .bind("room")
                    .bind(10_i64)
                    .bind("w")
                    .bind(1_i64)
                    .bind(1_i64),
                o.pool(),
            )
            .await;
            assert!(plan.contains(index), "{sql}\n{plan}");
            assert!(!plan.contains("SCAN room_outbox"), "{sql}\n{plan}");
            assert!(!plan.contains("TEMP B-TREE"), "{sql}\n{plan}");
        }
        for (sql, what) in [
            (&o.sql.mark_delivered, "INTEGER PRIMARY KEY"),
            (&o.sql.release, "INTEGER PRIMARY KEY"),
        ] {
            let plan = plan(
                sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .bind("[1]")
                    .bind("w")
                    .bind(1_i64),
                o.pool(),
            )
            .await;
            assert!(plan.contains(what), "{sql}\n{plan}");
        }
    }

    #[test]
    fn recognises_memory_urls() {
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://?mode=memory",
            "sqlite://x?cache=shared&mode=memory",
        ] {
            assert!(is_memory_url(url), "{url}");
        }
        for url in [
            "sqlite://postbox.db",
            "sqlite:postbox.db",
            "sqlite:///tmp/a.db",
        ] {
            assert!(!is_memory_url(url), "{url}");
        }
    }
}
