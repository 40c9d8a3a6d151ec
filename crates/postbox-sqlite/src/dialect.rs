//! SQLite as a dialect of the postbox engine: its statements, its claim
//! (one `BEGIN IMMEDIATE` write transaction in place of `FOR UPDATE SKIP
//! LOCKED`), its insert, its archive batch and its pool options.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, Sqlite, SqliteConnection, SqlitePool};

use postbox_core::redact::redact_url;
use postbox_core::store::{ClaimRequest, QueryPlan};
use postbox_core::{ClaimSource, ClaimedEvent, Error, NewEvent, Result, TableName};
use postbox_sqlx::dialect::{enqueue_error, insert_values, ClaimStatements, Q};
use postbox_sqlx::{claimed_records, db_error, finish, query, Connect, Dialect, SqlOutbox, Value};

use crate::sql;

/// The SQLite dialect.
#[derive(Debug, Clone, Copy)]
pub struct SqliteDialect;

/// Statements only SQLite's hooks run, rendered once per store.
#[derive(Debug)]
pub struct Own {
    pub(crate) insert_event: String,
    pub(crate) claims: ClaimStatements,
    claim_pending_ordered_deep: String,
    pub(crate) archive_pick: String,
    pub(crate) archive_copy: String,
    pub(crate) archive_delete: String,
    pub(crate) count_delivered: String,
}

/// An id or text list as the JSON array text `json_each` reads.
fn json_list<T: Clone + Into<serde_json::Value>>(items: &[T]) -> String {
    serde_json::Value::from(items.to_vec()).to_string()
}

/// True when `url` names an in-memory database (`sqlite::memory:`,
/// `sqlite://:memory:`, `…?mode=memory`).
pub(crate) fn is_memory_url(url: &str) -> bool {
    let rest = url
        .trim_start_matches("sqlite://")
        .trim_start_matches("sqlite:");
    let (db, params) = rest.split_once('?').unwrap_or((rest, ""));
    db == ":memory:" || params.split('&').any(|p| p == "mode=memory")
}

#[async_trait]
impl Dialect for SqliteDialect {
    postbox_sqlx::dialect_constants!(db: Sqlite, backend: "sqlite", placeholders: Question, begin_write: Some("BEGIN IMMEDIATE"));
    const CONTINUE_IDS_AFTER_ARCHIVE: &'static [&'static str] = sql::CONTINUE_IDS_AFTER_ARCHIVE;
    const REPLAY_FAILED_INDEX: &'static str = "_failed_idx";
    const DUE_BRANCH: Option<&'static str> = Some(sql::DUE_BRANCH);

    fn own(t: &TableName) -> Own {
        Own {
            insert_event: t.render(sql::INSERT_EVENT),
            claims: ClaimStatements::render(t, sql::CLAIMS),
            claim_pending_ordered_deep: t.render(sql::CLAIM_PENDING_ORDERED_DEEP),
            archive_pick: t.render(sql::ARCHIVE_PICK),
            archive_copy: t.render(sql::ARCHIVE_COPY),
            archive_delete: t.render(sql::ARCHIVE_DELETE),
            count_delivered: t.render(sql::COUNT_DELIVERED),
        }
    }

    /// Opens `url` (`sqlite://path`, `sqlite:path` or `sqlite::memory:`) in
    /// WAL mode with `synchronous = NORMAL`, a 10 s busy timeout and
    /// foreign keys on. An in-memory database gets exactly one connection,
    /// kept open, so every user sees the same database.
    /// A file's pool connects now (`how.lazy` is for servers).
    async fn connect_pool(url: &str, max_connections: u32, how: Connect) -> Result<SqlitePool> {
        let create = how.create;
        let memory = is_memory_url(url);
        let opts = SqliteConnectOptions::from_str(url)
            .map_err(|e| Error::config(how.key, format!("{}: {e}", redact_url(url))))?;
        if !create && !memory && !opts.get_filename().exists() {
            return Err(Error::Database {
                operation: "opening the SQLite database",
                source: format!(
                    "database file `{}` does not exist ({key} = `{}`): run `postbox migrate` to create it, or point {key} at the right file",
                    opts.get_filename().display(),
                    redact_url(url),
                    key = how.key,
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
        pool.connect_with(opts).await.map_err(|e| Error::Database {
            operation: "opening the SQLite database",
            source: format!("{}: {e}", redact_url(url)).into(),
        })
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    fn bind<'q>(q: Q<'q, Sqlite>, value: Value<'q>) -> Q<'q, Sqlite> {
        match value {
            Value::Text(v) => q.bind(v),
            Value::Int(v) => q.bind(v),
            Value::Int32(v) => q.bind(v),
            Value::Ids(ids) => q.bind(json_list(ids)),
            Value::Texts(texts) => q.bind(json_list(texts)),
        }
    }

    /// A duplicate `(app_code, event_id)` fails this statement only
    /// (SQLite undoes only the failed statement), so the transaction stays
    /// usable.
    async fn insert_event(
        outbox: &SqlOutbox<Self>,
        conn: &mut SqliteConnection,
        event: &NewEvent,
    ) -> Result<i64> {
        let headers = event.headers_json();
        query::<Self>(&outbox.own().insert_event, insert_values(event, &headers))
            .execute(conn)
            .await
            .map(|done| done.last_insert_rowid())
            .map_err(|e| enqueue_error(event, e))
    }

    async fn claim(
        outbox: &SqlOutbox<Self>,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>> {
        let db = |e| db_error("claim", e);
        let sql = outbox.own().claims.of(source, req.ordered);
        // SQLite is embedded: the host clock is the database clock. The lease
        // end is computed once, so every row of this claim shares one fence.
        let now = postbox_core::time::now_ms();
        let lock_until_ms = now + req.lease_ms;
        // One immediate write transaction per claim, in place of
        // `FOR UPDATE SKIP LOCKED`.
        let mut tx = outbox.begin_write().await.map_err(db)?;
        let res = async {
            macro_rules! run {
                ($sql:expr, $limit:expr) => {{
                    let rows = sqlx::query($sql)
                        .bind(req.app_code)
                        .bind(i64::from($limit))
                        .bind(req.worker_id)
                        .bind(lock_until_ms)
                        .bind(now);
                    // The pending claims leave the paused types out (`?6`).
                    match source {
                        ClaimSource::Pending => rows.bind(json_list(req.skip_types)),
                        ClaimSource::DueRetry | ClaimSource::ExpiredLease => rows,
                    }
                }};
            }
            let rows = run!(sql, req.limit).fetch_all(&mut *tx).await.map_err(db)?;
            let (mut claimed, mut unreadable) = claimed_records(rows, outbox.table().naming())?;
            // A per-aggregate claim that came back short claims once more,
            // reading past the followers of held aggregates
            // (`postbox_sqlx::deep_candidates!`).
            let taken = (claimed.len() + unreadable.len()) as u32;
            if source == ClaimSource::Pending && req.ordered && taken < req.limit {
                let deep = &outbox.own().claim_pending_ordered_deep;
                let rows = run!(deep, req.limit - taken)
                    .bind(i64::from(req.limit))
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db)?;
                let (more, more_unreadable) = claimed_records(rows, outbox.table().naming())?;
                claimed.extend(more);
                unreadable.extend(more_unreadable);
            }
            if source == ClaimSource::ExpiredLease && !claimed.is_empty() {
                // The takeover counted an attempt: record it with the claim.
                let ids: Vec<i64> = claimed.iter().map(|r| r.id).collect();
                outbox
                    .record_lease_expired(&mut tx, &ids)
                    .await
                    .map_err(db)?;
            }
            Ok((claimed, unreadable))
        }
        .await;
        let (mut claimed, unreadable) = finish(tx, res, "claim").await?;
        if !unreadable.is_empty() {
            outbox
                .fail_unreadable(req.app_code, &unreadable, req.worker_id, lock_until_ms)
                .await;
        }
        // RETURNING gives no order; hand rows out in claim order.
        // (An expired-lease claim now shares one lease end: creation order.)
        claimed.sort_by_key(|r| match source {
            ClaimSource::ExpiredLease => (0, r.created_at_ms, r.id),
            _ => (r.next_retry_at_ms, r.created_at_ms, r.id),
        });
        Ok(claimed
            .into_iter()
            .map(|record| ClaimedEvent { record, source })
            .collect())
    }

    /// No lock to take: each batch is one `BEGIN IMMEDIATE` transaction,
    /// and SQLite's write lock keeps a second archiver out while it runs.
    // Each archive batch is one `BEGIN IMMEDIATE` transaction: SQLite's
    // write lock serialises archivers, and no connection is held between
    // batches (a small pool is shared with the relay).
    const ARCHIVE_LOCK_IN_SESSION: bool = false;

    async fn archive_lock(_: &mut PoolConnection<Sqlite>, _: &TableName) -> Result<bool> {
        Ok(true)
    }

    async fn archive_unlock(
        _: &mut PoolConnection<Sqlite>,
        _: &TableName,
    ) -> std::result::Result<(), sqlx::Error> {
        Ok(())
    }

    /// The pick alone: the batch's `BEGIN IMMEDIATE` holds the write lock.
    fn archive_pick_lock<'a>(
        outbox: &'a SqlOutbox<Self>,
        app_code: &'a str,
        before_ms: i64,
        size: u32,
    ) -> (&'a str, Vec<Value<'a>>) {
        let binds = vec![app_code.into(), before_ms.into(), i64::from(size).into()];
        (&outbox.own().archive_pick, binds)
    }

    async fn archive_batch(
        outbox: &SqlOutbox<Self>,
        conn: &mut PoolConnection<Sqlite>,
        app_code: &str,
        before_ms: i64,
        batch_size: u32,
    ) -> Result<(u64, u64)> {
        let db = |e| db_error("archive", e);
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(db)?;
        let batch = |sql| {
            sqlx::query(sql)
                .bind(app_code)
                .bind(before_ms)
                .bind(i64::from(batch_size))
        };
        let copied = match batch(&outbox.own().archive_copy).execute(&mut *tx).await {
            Ok(done) => done.rows_affected(),
            Err(e) => return finish_err(tx, db(e)).await,
        };
        let deleted = match batch(&outbox.own().archive_delete).execute(&mut *tx).await {
            Ok(done) => done.rows_affected(),
            Err(e) => return finish_err(tx, db(e)).await,
        };
        tx.commit().await.map_err(|e| db_error("archive", e))?;
        Ok((deleted, copied))
    }

    /// A count through `{table}_done_idx`: SQLite has no statistics to
    /// estimate from, and one process serves it.
    async fn delivered_estimate(
        outbox: &SqlOutbox<Self>,
        app_code: &str,
    ) -> Option<Result<(i64, bool)>> {
        let n = sqlx::query_scalar(&outbox.own().count_delivered)
            .bind(app_code)
            .fetch_one(outbox.pool())
            .await
            .map_err(|e| db_error("count delivered rows", e));
        Some(n.map(|n| (n, false)))
    }

    /// `BEGIN IMMEDIATE` already serialises `migrate` runs.
    async fn migration_lock(_: &mut SqliteConnection) -> std::result::Result<(), sqlx::Error> {
        Ok(())
    }

    async fn explain_claims(
        outbox: &SqlOutbox<Self>,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<QueryPlan>> {
        crate::explain::claim_plans(outbox, app_code, limit).await
    }

    async fn explain_index_use(outbox: &SqlOutbox<Self>, app_code: &str) -> Result<Vec<QueryPlan>> {
        crate::explain::index_use(outbox, app_code).await
    }
}

/// Rolls back a batch whose statement failed, and returns its error.
async fn finish_err<T>(tx: sqlx::Transaction<'_, Sqlite>, err: Error) -> Result<T> {
    if let Err(rb) = tx.rollback().await {
        tracing::warn!(operation = "archive", error = %rb, "rollback after a failed statement failed");
    }
    Err(err)
}
