//! The outbox engine: every store operation written once, generic over a
//! [`Dialect`]. Only the statement texts and the dialect's hooks differ
//! between PostgreSQL, MySQL and SQLite.
//!
//! Generic sqlx code needs its bounds spelled out: every `impl` block of
//! the engine carries the same `where` clause (executors, argument buffers,
//! and the column types rows are read with, by name). Values are bound only
//! through [`Dialect::bind`], so no encoding bound appears here.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;

use sqlx::{Database, Transaction};

use postbox_core::config::RelayCommit;
use postbox_core::event::Fence;
use postbox_core::partition::Partitioning;
use postbox_core::store::{
    check_ledger, AppStats, ArchiveReport, ArchiveRequest, DeferUpdate, EnqueueOutcome,
    EventFilter, FailureUpdate, HistoryEntry, MigrateReport, MinuteCount, ReplayPick,
    ReplayRequest, ReplaySelector, ReplayTargets, SchemaReport, StuckAggregate, AGGREGATE_INDEX,
    EXPECTED_TABLES, HISTORY_LIMIT, REPLAY_ARCHIVED_QUERY, REPLAY_BY_ID_QUERY, REPLAY_FAILED_QUERY,
};
use postbox_core::{EventRecord, NewEvent, OutboxStore, Result, Status, TableName};

use postbox_core::relay::CancellationToken;
use postbox_core::wake::{Due, Wake};

use crate::dialect::{Connect, Dialect, ReplayStep, Statements, Value, WakeFuture, Q};
use crate::{db_error, filter_query, history_entries, list_query, minute_counts, records, ListArg};
use elsewhere::Source;

/// An outbox table in the database of dialect `D`. `PgOutbox`,
/// `MySqlOutbox` and `SqliteOutbox` are this type.
pub struct SqlOutbox<D: Dialect> {
    pool: sqlx::Pool<D::DB>,
    /// The relay's bookkeeping writes (claims, marks, deferrals,
    /// releases): `pool`, or two connections of the relay's own with the
    /// session settings its writes want ([`Dialect::relay_pool`]: on
    /// PostgreSQL with `relay_commit = "async"`, commits that do not wait
    /// for the WAL flush; on MySQL, `READ COMMITTED`).
    bookkeeping: sqlx::Pool<D::DB>,
    /// Whether `bookkeeping`'s sessions already run at
    /// [`Dialect::RELAY_ISOLATION`], which then costs no statement per
    /// write.
    bookkeeping_isolated: bool,
    table: TableName,
    max_payload_bytes: usize,
    sql: Arc<Statements<String>>,
    own: Arc<D::Own>,
    /// Signalled after every `enqueue` (shared by clones).
    wake: postbox_core::wake::Wake,
    /// The store holding `<table>_archive` in another database
    /// (`[archive] url`); `None`: the archive is beside the table.
    elsewhere: Option<Arc<dyn OutboxStore>>,
    /// `[database] partitioning` (PostgreSQL).
    partitioning: Option<Partitioning>,
}

impl<D: Dialect> Clone for SqlOutbox<D> {
    fn clone(&self) -> Self {
        SqlOutbox {
            pool: self.pool.clone(),
            bookkeeping: self.bookkeeping.clone(),
            bookkeeping_isolated: self.bookkeeping_isolated,
            table: self.table.clone(),
            max_payload_bytes: self.max_payload_bytes,
            sql: self.sql.clone(),
            own: self.own.clone(),
            wake: self.wake.clone(),
            elsewhere: self.elsewhere.clone(),
            partitioning: self.partitioning,
        }
    }
}

impl<D: Dialect> std::fmt::Debug for SqlOutbox<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlOutbox")
            .field("backend", &D::BACKEND)
            .field("table", &self.table)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .finish_non_exhaustive()
    }
}

/// What [`SqlOutbox::open`] opens.
#[derive(Clone)]
pub struct OpenOptions<'a> {
    /// The database URL.
    pub url: &'a str,
    /// The outbox table, with its adopted names if any.
    pub table: &'a TableName,
    /// The pool's size.
    pub max_connections: u32,
    /// Create a missing database (SQLite's file), connect lazily.
    pub connect: Connect,
    /// The payload limit `enqueue` enforces.
    pub max_payload_bytes: usize,
    /// The store opened on the database that keeps `<table>_archive`
    /// (`[archive] url`), when not this one.
    pub archive: Option<Arc<dyn OutboxStore>>,
    /// A range-partitioned table (`[database] partitioning`).
    pub partitioning: Option<Partitioning>,
    /// How the relay's bookkeeping writes commit (`[database] relay_commit`).
    pub relay_commit: RelayCommit,
}

/// A store being opened by [`SqlOutbox::open`].
pub type Opened<'a> = postbox_core::BoxFuture<'a, Result<Arc<dyn OutboxStore>>>;

/// The binds of one statement, in placeholder order.
pub fn query<'q, D: Dialect>(
    sql: &'q str,
    values: impl IntoIterator<Item = Value<'q>>,
) -> Q<'q, D::DB> {
    values.into_iter().fold(sqlx::query(sql), D::bind)
}

impl<D: Dialect> SqlOutbox<D> {
    /// Uses `pool` for the outbox table `table` (validated).
    pub fn new(pool: sqlx::Pool<D::DB>, table: &str) -> Result<Self> {
        Ok(Self::named(pool, TableName::new(table)?))
    }

    /// Uses `pool` for `table`, an adopted table's names included.
    pub fn named(pool: sqlx::Pool<D::DB>, table: TableName) -> Self {
        let table = if D::FOLDS_NAMES {
            table.folded()
        } else {
            table
        };
        SqlOutbox {
            bookkeeping: pool.clone(),
            bookkeeping_isolated: false,
            pool,
            sql: Arc::new(D::STATEMENTS.render(&table)),
            own: Arc::new(D::own(&table)),
            table,
            max_payload_bytes: 1024 * 1024,
            wake: postbox_core::wake::Wake::new(),
            elsewhere: None,
            partitioning: None,
        }
    }

    /// Connects a pool of `max_connections` to `url` (the dialect's
    /// connect options; SQLite creates a missing database file). The
    /// relay's bookkeeping writes commit asynchronously where the database
    /// can ([`RelayCommit::Async`]).
    pub async fn connect(url: &str, table: &str, max_connections: u32) -> Result<Self> {
        Ok(Self::new(
            D::connect_pool(url, max_connections, Connect::now(true)).await?,
            table,
        )?
        .with_relay_commit(RelayCommit::Async))
    }

    /// Like [`SqlOutbox::connect`], but never creates the database: a
    /// missing SQLite file is an error naming it (for commands that only
    /// read or need the schema `postbox migrate` creates).
    pub async fn connect_existing(url: &str, table: &str, max_connections: u32) -> Result<Self> {
        Ok(Self::new(
            D::connect_pool(url, max_connections, Connect::now(false)).await?,
            table,
        )?
        .with_relay_commit(RelayCommit::Async))
    }

    /// Opens the store `options` describe as a `dyn OutboxStore`. Each
    /// backend crate's `open` calls this, so the engine is compiled there,
    /// once per database, and not again in every crate that opens a store
    /// from a URL (see [`postbox_core::BoxFuture`]).
    pub fn open(options: OpenOptions<'_>) -> Opened<'_>
    where
        Self: OutboxStore,
    {
        Box::pin(async move {
            let pool =
                D::connect_pool(options.url, options.max_connections, options.connect).await?;
            let mut store = Self::named(pool, options.table.clone())
                .with_max_payload_bytes(options.max_payload_bytes)
                .with_relay_commit(options.relay_commit);
            store.elsewhere = options.archive;
            store.partitioning = options.partitioning;
            Ok(Arc::new(store) as Arc<dyn OutboxStore>)
        })
    }

    /// How the relay's bookkeeping writes commit; they run on connections
    /// of their own where the dialect has them ([`Dialect::relay_pool`]).
    /// A store made with [`SqlOutbox::new`] runs them on the caller's pool
    /// (whose connections may carry settings of the caller's own) until
    /// this is called.
    pub fn with_relay_commit(mut self, commit: RelayCommit) -> Self {
        (self.bookkeeping, self.bookkeeping_isolated) = match D::relay_pool(&self.pool, commit) {
            Some(own) => (own, true),
            None => (self.pool.clone(), false),
        };
        self
    }

    /// The pool the relay's claims and marks run on (see
    /// [`SqlOutbox::with_relay_commit`]).
    pub fn bookkeeping_pool(&self) -> &sqlx::Pool<D::DB> {
        &self.bookkeeping
    }

    /// Sets the payload limit `enqueue` enforces (default 1 MiB).
    pub fn with_max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// Keeps `<table>_archive` in the database `archive` is opened on
    /// (a store for the same table there): archiving copies into it,
    /// reads and replays of archived rows read it, `migrate` migrates it.
    pub fn with_archive_elsewhere(mut self, archive: Arc<dyn OutboxStore>) -> Self {
        self.elsewhere = Some(archive);
        self
    }

    /// Creates and keeps the table range-partitioned on `created_at_ms`
    /// (PostgreSQL; see [`postbox_core::partition`]).
    pub fn with_partitioning(mut self, partitioning: Partitioning) -> Self {
        self.partitioning = Some(partitioning);
        self
    }

    /// How the table is partitioned, if it is.
    pub fn partitioning(&self) -> Option<Partitioning> {
        self.partitioning
    }

    /// The pool.
    pub fn pool(&self) -> &sqlx::Pool<D::DB> {
        &self.pool
    }

    /// The outbox table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The shared statements, rendered for this table.
    pub fn statements(&self) -> &Statements<String> {
        &self.sql
    }

    /// The dialect's own statements, rendered for this table.
    pub fn own(&self) -> &D::Own {
        &self.own
    }

    /// Writes `event` on the caller's connection or transaction (pass
    /// `&mut tx`), so it commits or rolls back with the caller's own rows.
    /// Returns the new row id.
    ///
    /// A duplicate `(app_code, event_id)` returns
    /// [`postbox_core::Error::DuplicateEvent`] and leaves the transaction
    /// usable; an oversized payload returns
    /// [`postbox_core::Error::PayloadTooLarge`] without touching the database.
    pub async fn enqueue(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        event: &NewEvent,
    ) -> Result<i64> {
        event.validate(self.max_payload_bytes)?;
        let id = D::insert_event(self, conn, event).await?;
        // A relay in this process wakes (and polls fast until the caller
        // commits).
        self.wake.signal();
        Ok(id)
    }

    /// `postgres`, `mysql` or `sqlite`.
    pub fn backend(&self) -> &'static str {
        D::BACKEND
    }

    /// Runs one of the three claim queries (the dialect's hook).
    pub async fn claim(
        &self,
        source: postbox_core::ClaimSource,
        req: &postbox_core::store::ClaimRequest<'_>,
    ) -> Result<Vec<postbox_core::ClaimedEvent>> {
        D::claim(self, source, req).await
    }

    /// Plans of the three claim queries for `app_code`, taking up to
    /// `limit` rows; nothing is changed.
    pub async fn explain_claims(
        &self,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<postbox_core::store::QueryPlan>> {
        D::explain_claims(self, app_code, limit).await
    }

    /// Whether every claim and archive query can read through its index.
    pub async fn explain_index_use(
        &self,
        app_code: &str,
    ) -> Result<Vec<postbox_core::store::QueryPlan>> {
        D::explain_index_use(self, app_code).await
    }

    /// Starts a write transaction ([`Dialect::BEGIN_WRITE`]).
    pub async fn begin_write(
        &self,
    ) -> std::result::Result<Transaction<'static, D::DB>, sqlx::Error> {
        Self::begin_on(&self.pool, true).await
    }

    /// A transaction on `pool`: [`Dialect::BEGIN_WRITE`]'s for a `write`,
    /// else a plain one.
    async fn begin_on(
        pool: &sqlx::Pool<D::DB>,
        write: bool,
    ) -> std::result::Result<Transaction<'static, D::DB>, sqlx::Error> {
        match D::BEGIN_WRITE.filter(|_| write) {
            Some(begin) => pool.begin_with(begin).await,
            None => pool.begin().await,
        }
    }
}

/// The table where `migrate` records the versions it applied.
pub const MIGRATIONS_LEDGER: &str = "postbox_schema_migrations";

/// Ends a transaction: `COMMIT` when `res` is `Ok`, otherwise an explicit
/// `ROLLBACK` before the connection goes back to the pool (a transaction
/// dropped mid-way, e.g. by a cancelled future, is rolled back by sqlx
/// before the connection's next use).
pub async fn finish<DB: Database, T>(
    tx: Transaction<'_, DB>,
    res: Result<T>,
    operation: &'static str,
) -> Result<T> {
    match res {
        Ok(value) => {
            tx.commit().await.map_err(|e| db_error(operation, e))?;
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

/// The bounds every generic engine block needs; see the module docs.
macro_rules! engine_impl {
    ($(#[$m:meta])* impl $tr:ident for $ty:ty { $($body:tt)* }) => {
        engine_impl!(@bounds $(#[$m])* [$tr for $ty] { $($body)* });
    };
    ($(#[$m:meta])* impl $ty:ty { $($body:tt)* }) => {
        engine_impl!(@bounds $(#[$m])* [$ty] { $($body)* });
    };
    (@bounds $(#[$m:meta])* [$($head:tt)*] { $($body:tt)* }) => {
        $(#[$m])*
        impl<D: Dialect> $($head)*
        where
            for<'c> &'c mut <D::DB as Database>::Connection: sqlx::Executor<'c, Database = D::DB>,
            for<'q> <D::DB as Database>::Arguments<'q>: sqlx::IntoArguments<'q, D::DB>,
            for<'r> i64: sqlx::Decode<'r, D::DB> + sqlx::Type<D::DB>,
            for<'r> i32: sqlx::Decode<'r, D::DB> + sqlx::Type<D::DB>,
            for<'r> String: sqlx::Decode<'r, D::DB> + sqlx::Type<D::DB>,
            for<'a> &'a str: sqlx::ColumnIndex<<D::DB as Database>::Row>,
            usize: sqlx::ColumnIndex<<D::DB as Database>::Row>,
        {
            $($body)*
        }
    };
}

mod elsewhere;
mod partitions;

engine_impl! {
impl SqlOutbox<D> {
    /// Deletes history beyond [`HISTORY_LIMIT`] entries for the events of rows `ids`.
    pub async fn prune_history(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        ids: &[i64],
    ) -> std::result::Result<(), sqlx::Error> {
        if let Some(done) = D::prune_history(self, &mut *conn, ids).await {
            return done;
        }
        let binds = vec![Value::Ids(ids), HISTORY_LIMIT.into()];
        self.execute_expanded(conn, &self.sql.history_prune, binds).await.map(|_| ())
    }

    /// Runs one logical statement (its [`Dialect::expand`]ed statements);
    /// the rows they changed.
    pub async fn execute_expanded(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        sql: &str,
        values: Vec<Value<'_>>,
    ) -> std::result::Result<u64, sqlx::Error> {
        let mut changed = 0;
        for (text, values) in D::expand(sql, values) {
            let done = query::<D>(&text, values).execute(&mut *conn).await?;
            changed += D::rows_affected(&done);
        }
        Ok(changed)
    }

    /// The rows of one logical statement (its [`Dialect::expand`]ed statements).
    pub async fn fetch_expanded(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        sql: &str,
        values: Vec<Value<'_>>,
    ) -> std::result::Result<Vec<<D::DB as Database>::Row>, sqlx::Error> {
        let mut rows = Vec::new();
        for (text, values) in D::expand(sql, values) {
            rows.extend(query::<D>(&text, values).fetch_all(&mut *conn).await?);
        }
        Ok(rows)
    }

    /// Starts a relay transaction: at [`Dialect::RELAY_ISOLATION`] when the
    /// dialect sets one, else a write transaction (`write`) or a plain one.
    /// The isolation and the `BEGIN` go in one round trip (two statements
    /// of one text query).
    pub async fn begin_relay(
        &self,
        write: bool,
    ) -> std::result::Result<Transaction<'static, D::DB>, sqlx::Error> {
        Self::begin_relay_on(&self.pool, write, D::RELAY_ISOLATION).await
    }

    /// [`SqlOutbox::begin_relay`] on the relay's bookkeeping connections
    /// ([`SqlOutbox::bookkeeping_pool`]), for claims and marks.
    pub async fn begin_bookkeeping(
        &self,
        write: bool,
    ) -> std::result::Result<Transaction<'static, D::DB>, sqlx::Error> {
        Self::begin_relay_on(&self.bookkeeping, write, self.bookkeeping_isolation()).await
    }

    /// The isolation statement a bookkeeping write must send first: none
    /// when the sessions already run at it.
    fn bookkeeping_isolation(&self) -> Option<&'static str> {
        D::RELAY_ISOLATION.filter(|_| !self.bookkeeping_isolated)
    }

    /// A transaction on `pool` at `isolation`, if any.
    async fn begin_relay_on(
        pool: &sqlx::Pool<D::DB>,
        write: bool,
        isolation: Option<&'static str>,
    ) -> std::result::Result<Transaction<'static, D::DB>, sqlx::Error> {
        match isolation {
            Some(isolation) => {
                let conn = pool.acquire().await?;
                let begin = D::BEGIN_WRITE.filter(|_| write).unwrap_or("BEGIN");
                let statement = format!("{isolation}; {begin}");
                Transaction::begin(conn, Some(statement.into())).await
            }
            None => Self::begin_on(pool, write).await,
        }
    }

    /// One replay step that changes rows ([`Dialect::replay_rows`], or
    /// `sql` fetched as an `UPDATE … RETURNING`).
    async fn replay_rows(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        step: ReplayStep,
        sql: &str,
        values: Vec<Value<'_>>,
        op: &'static str,
    ) -> Result<Vec<EventRecord>> {
        if let Some(rows) = D::replay_rows(self, &mut *conn, step, sql, values.clone()).await {
            return rows;
        }
        let rows = self.fetch_expanded(conn, sql, values).await.map_err(|e| db_error(op, e))?;
        records(rows, self.table.naming(), op)
    }

    /// Replay by filter of one app_code (`f.app_code` is set): live rows,
    /// then, for a time range, archived ones brought back, each in id
    /// order (a dry run only reads them).
    async fn replay_filtered(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        f: &EventFilter,
        dry_run: bool,
        forget: &mut Vec<i64>,
    ) -> Result<Vec<EventRecord>> {
        let db = |e| db_error("replay", e);
        let (live, archived) = if dry_run {
            (&self.sql.replay_filter_dry, &self.sql.unarchive_filter_dry)
        } else {
            (&self.sql.replay_filter, &self.sql.unarchive_filter)
        };
        let live = filter_query(live, f, "status", D::PLACEHOLDERS);
        let live_sql = self.table.render(&live.sql);
        let binds = list_values(&live.args).collect();
        let mut out = if dry_run {
            let rows = self.fetch_expanded(&mut *conn, &live_sql, binds).await.map_err(db)?;
            records(rows, self.table.naming(), "replay")?
        } else {
            self.replay_rows(&mut *conn, ReplayStep::Replay, &live_sql, binds, "replay").await?
        };
        out.sort_by_key(|r| r.id);
        if !f.reaches_archive() {
            return Ok(out);
        }
        // A time range, or an aggregate's events, also covers rows already
        // archived (delivered ones): here, and with `[archive] url` in the
        // archive database too, after those archived here before it was
        // set (they move over only as archive runs go).
        let archived = filter_query(archived, f, crate::list::ARCHIVED_STATUS, D::PLACEHOLDERS);
        let mut archived_sql = self.table.render(&archived.sql);
        if let (false, Some(when)) = (dry_run, self.created_when_back().await?) {
            // The statement keeps each row's `created_at_ms` (see
            // `unarchive_insert!`): not where its partition is gone.
            let keep = "replay_count + 1, created_at_ms, ";
            debug_assert!(archived_sql.contains(keep), "{archived_sql}");
            archived_sql = archived_sql.replacen(keep, &format!("replay_count + 1, {}, ", when.sql()), 1);
        }
        let binds = list_values(&archived.args).collect();
        let op = "replay from archive";
        let mut back = if dry_run {
            let rows = self.fetch_expanded(&mut *conn, &archived_sql, binds).await.map_err(db)?;
            records(rows, self.table.naming(), op)?
        } else {
            self.replay_rows(&mut *conn, ReplayStep::Unarchive, &archived_sql, binds, op).await?
        };
        back.sort_by_key(|r| r.id);
        if !dry_run && !back.is_empty() {
            let ids: Vec<i64> = back.iter().map(|r| r.id).collect();
            self.execute_expanded(&mut *conn, &self.sql.delete_unarchived, vec![Value::Ids(&ids)])
                .await
                .map_err(db)?;
        }
        out.extend(back);
        if let Some(to) = self.elsewhere() {
            // An event in both archives (a move cut short) comes back once.
            let remote = self.unarchive_elsewhere(to, conn, f, dry_run, forget).await?;
            let have: HashSet<i64> = out.iter().map(|r| r.id).collect();
            out.extend(remote.into_iter().filter(|r| !have.contains(&r.id)));
        }
        Ok(out)
    }

    /// The replay statements `doctor` explains for `app_code`, each as it
    /// runs (expanded, with its binds): by event id, of the `failed` rows,
    /// and a time range's archived rows.
    pub fn replay_probes<'a>(&self, args: &'a ReplayProbeArgs) -> Vec<ReplayProbe<'a>> {
        let t = self.table.as_str();
        let archive = self.table.archive();
        let failed = filter_query(&self.sql.replay_filter, &args.failed, "status", D::PLACEHOLDERS);
        let range = filter_query(&self.sql.unarchive_filter, &args.range, crate::list::ARCHIVED_STATUS, D::PLACEHOLDERS);
        let probes = [
            (
                REPLAY_BY_ID_QUERY,
                t.to_owned(),
                format!("{t}_event_uq"),
                self.sql.replay_ids.clone(),
                vec![Value::Texts(&args.event_ids), args.app_code().into()],
            ),
            (
                REPLAY_FAILED_QUERY,
                t.to_owned(),
                format!("{t}{}", D::REPLAY_FAILED_INDEX),
                self.table.render(&failed.sql),
                list_values(&failed.args).collect(),
            ),
            (
                REPLAY_ARCHIVED_QUERY,
                archive.clone(),
                format!("{archive}_created_idx"),
                self.table.render(&range.sql),
                list_values(&range.args).collect(),
            ),
        ];
        probes
            .into_iter()
            // An archive in another database is explained by its own store.
            .filter(|(query, ..)| *query != REPLAY_ARCHIVED_QUERY || self.elsewhere.is_none())
            .filter_map(|(query, table, expected_index, sql, values)| {
                let (sql, values) = D::expand(&sql, values).into_iter().next()?;
                Some(ReplayProbe {
                    query,
                    scanned_as: name_in(&sql, &table),
                    table,
                    expected_index,
                    sql: sql.into_owned(),
                    values,
                })
            })
            .collect()
    }

    /// Records that rows `ids` were taken over after their lease expired,
    /// in the claim's transaction.
    pub async fn record_lease_expired(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        ids: &[i64],
    ) -> std::result::Result<(), sqlx::Error> {
        self.execute_expanded(&mut *conn, &self.sql.history_lease_expired, vec![Value::Ids(ids)])
            .await?;
        self.prune_history(conn, ids).await
    }

    /// Marks rows `delivered`; returns how many still held `fence`.
    pub async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        self.fenced(&self.sql.mark_delivered, fence, ids, "mark delivered").await
    }

    /// Gives claimed rows back without an attempt (shutdown).
    pub async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        self.fenced(&self.sql.release, fence, ids, "release leases").await
    }

    /// Gives rows back as `retryable` without an attempt, keeping their
    /// fanout progress (a publisher was behind).
    pub async fn defer(&self, fence: &Fence, ids: &[i64], u: &DeferUpdate) -> Result<u64> {
        let delivered_to = Some(u.delivered_to.join(",")).filter(|s| !s.is_empty());
        let leading = vec![
            u.after_ms.into(),
            delivered_to.as_deref().into(),
            u.reason.as_str().into(),
        ];
        self.fenced_with(&self.sql.defer, leading, fence, ids, "defer rows").await
    }

    async fn fenced(&self, sql: &str, fence: &Fence, ids: &[i64], op: &'static str) -> Result<u64> {
        self.fenced_with(sql, Vec::new(), fence, ids, op).await
    }

    /// A fenced statement over `ids`; binds: `leading`, then ids (list),
    /// worker_id, lock_until_ms.
    async fn fenced_with(
        &self,
        sql: &str,
        leading: Vec<Value<'_>>,
        fence: &Fence,
        ids: &[i64],
        op: &'static str,
    ) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let db = |e| db_error(op, e);
        let mut binds = leading;
        binds.extend([Value::Ids(ids), fence.worker_id.as_str().into(), fence.lock_until_ms.into()]);
        let mut parts = D::expand(sql, binds.clone());
        if parts.len() == 1 {
            // One statement in autocommit: no BEGIN/COMMIT round trips on
            // the relay's hot path. The dialect's isolation, if the
            // session does not run at it, is set first on the same
            // connection: it applies to the next transaction, which an
            // autocommit statement is.
            let (text, values) = parts.remove(0);
            let mut conn = self.bookkeeping.acquire().await.map_err(db)?;
            if let Some(isolation) = self.bookkeeping_isolation() {
                sqlx::Executor::execute(&mut *conn, isolation).await.map_err(db)?;
            }
            let done = query::<D>(&text, values).execute(&mut *conn).await.map_err(db)?;
            return Ok(D::rows_affected(&done));
        }
        let mut tx = self.begin_bookkeeping(true).await.map_err(db)?;
        let res = self.execute_expanded(&mut tx, sql, binds).await.map_err(db);
        finish(tx, res, op).await
    }

    /// Fails the rows a claim took but could not read ([`crate::Unreadable`],
    /// leased by `worker_id` until their own lease end, or `lock_until_ms`
    /// where the claim did not read it back), as dead letters with what
    /// was wrong, so that the rest of the backlog goes on. A row this
    /// cannot write stays leased, and its lease expires.
    pub async fn fail_unreadable(
        &self,
        app_code: &str,
        rows: &[crate::Unreadable],
        worker_id: &str,
        lock_until_ms: i64,
    ) {
        for row in rows {
            let error = postbox_core::event::truncate_error(&format!(
                "unreadable row, not delivered: {}",
                row.reason
            ));
            tracing::error!(
                app_code,
                id = row.id,
                error = %error,
                "a claimed outbox row cannot be read; it is failed (dead-lettered), the others go on"
            );
            let fence = Fence {
                worker_id: worker_id.to_owned(),
                lock_until_ms: row.lock_until_ms.unwrap_or(lock_until_ms),
            };
            let update = FailureUpdate {
                status: Status::Failed,
                retry_count: row.retry_count,
                retry_after_ms: 0,
                retry_jitter_ms: 0,
                delivered_to: Vec::new(),
                error,
                publisher: None,
            };
            if let Err(e) = self.mark_failed(&fence, &[row.id], &update).await {
                tracing::warn!(app_code, id = row.id, error = %e, "could not fail an unreadable row; its lease will expire");
            }
        }
    }

    /// Records one failed attempt of each of `ids` (the same update) and a
    /// history entry for each row written, in one transaction; how many
    /// rows still held the fence.
    pub async fn mark_failed(&self, fence: &Fence, ids: &[i64], u: &FailureUpdate) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let db = |e| db_error("mark failed attempts", e);
        let mut tx = self.begin_bookkeeping(true).await.map_err(db)?;
        let res = async {
            let delivered_to = Some(u.delivered_to.join(",")).filter(|s| !s.is_empty());
            let binds = vec![
                u.status.as_str().into(),
                Value::Int32(u.retry_count),
                u.retry_after_ms.into(),
                u.retry_jitter_ms.max(0).into(),
                delivered_to.as_deref().into(),
                u.error.as_str().into(),
                Value::Ids(ids),
                fence.worker_id.as_str().into(),
                fence.lock_until_ms.into(),
            ];
            let written = self
                .execute_expanded(&mut tx, &self.sql.mark_failed, binds)
                .await
                .map_err(db)?;
            // Nothing written: nothing to record. Otherwise this try's
            // transaction wrote every row it marked (an earlier try that
            // committed would have left none to mark), and the history
            // entries go to exactly those rows: ours, no longer leased.
            if written > 0 {
                let binds = vec![
                    Value::Ids(ids),
                    u.history_kind().as_str().into(),
                    Value::Int32(u.retry_count),
                    u.publisher.as_deref().into(),
                    u.error.as_str().into(),
                    fence.worker_id.as_str().into(),
                ];
                self.execute_expanded(&mut tx, &self.sql.history_failed, binds)
                    .await
                    .map_err(db)?;
                self.prune_history(&mut tx, ids).await.map_err(db)?;
            }
            Ok(written)
        }
        .await;
        finish(tx, res, "mark failed attempts").await
    }

    /// Writes events in their own transaction, retried on a transient
    /// conflict (CLI and tools; services use `enqueue` in their own).
    pub async fn enqueue_batch(
        &self,
        events: &[NewEvent],
        max_payload_bytes: usize,
    ) -> Result<Vec<EnqueueOutcome>> {
        for e in events {
            e.validate(max_payload_bytes)?;
        }
        let this = self.clone().with_max_payload_bytes(max_payload_bytes);
        postbox_core::error::retry_transient(|| async {
            let mut tx = self.begin_write().await.map_err(|e| db_error("begin", e))?;
            let res = async {
                let mut out = Vec::with_capacity(events.len());
                for e in events {
                    out.push(EnqueueOutcome::from_insert(this.enqueue(&mut tx, e).await)?);
                }
                Ok(out)
            }
            .await;
            finish(tx, res, "commit").await
        })
        .await
    }

    /// Counts per tenant, each through the index of its status: never a
    /// read of every delivered row (see [`crate::dialect::DELIVERED_COUNT_CAP`]).
    pub async fn stats(&self, app_codes: &[String]) -> Result<Vec<AppStats>> {
        use sqlx::Row;
        let db = |e| db_error("status", e);
        let mut out = Vec::with_capacity(app_codes.len());
        for app_code in app_codes {
            let mut s = AppStats::new(app_code);
            let (counts, backlog) = {
                let mut conn = self.pool.acquire().await.map_err(db)?;
                let mut one = async |sql: &str| {
                    self.fetch_expanded(&mut conn, sql, vec![app_code.into()])
                        .await
                        .and_then(|rows| rows.into_iter().next().ok_or(sqlx::Error::RowNotFound))
                        .map_err(db)
                };
                (one(&self.sql.count_open).await?, one(&self.sql.backlog).await?)
            };
            let count = |column: &str| counts.try_get::<i64, _>(column).map_err(db);
            s.pending = count("pending")?;
            s.delivering = count("delivering")?;
            s.retryable = count("retryable")?;
            s.failed = count("failed")?;
            s.delivered = count("delivered")?;
            s.dropped = count("dropped")?;
            let oldest: Option<i64> = backlog.try_get("oldest_pending_ms").map_err(db)?;
            let due: i64 = backlog.try_get("retryable_due").map_err(db)?;
            let now: i64 = backlog.try_get("now_ms").map_err(db)?;
            s.backlog(oldest, due, now);
            // After the connection went back: the dialect reads on a pooled
            // one of its own, and a pool may hold just one (SQLite in memory).
            if s.delivered > crate::DELIVERED_COUNT_CAP {
                s.delivered_estimated = true;
                if let Some(estimate) = D::delivered_estimate(self, app_code).await {
                    let (n, estimated) = estimate?;
                    s.delivered = n.max(s.delivered);
                    s.delivered_estimated = estimated;
                }
            }
            out.push(s);
        }
        Ok(out)
    }

    /// Rows matching a filter, newest first.
    pub async fn list(&self, f: &EventFilter) -> Result<Vec<EventRecord>> {
        self.list_from(D::STATEMENTS.list_select, f, self.table.as_str()).await
    }

    /// Archived rows matching a filter, newest first.
    pub async fn list_archived(&self, f: &EventFilter) -> Result<Vec<EventRecord>> {
        if let Some(to) = self.elsewhere() {
            return to.list_archived(f).await;
        }
        let select = D::STATEMENTS.list_select.replace("{table}", "{archive}");
        self.list_from(&select, f, &self.table.archive()).await
    }

    /// `list` over `select` (`SELECT <columns> FROM {table}` or `{archive}`,
    /// the table `on`).
    async fn list_from(&self, select: &str, f: &EventFilter, on: &str) -> Result<Vec<EventRecord>> {
        if f.aggregate_id.is_some() {
            if f.app_code.is_none() {
                return Err(postbox_core::Error::InvalidInput {
                    operation: "list events",
                    source: "a search by aggregate needs an app_code (aggregate ids are a tenant's)".into(),
                });
            }
            self.require_aggregate_index(&[on]).await?;
        }
        let q = list_query(select, f, D::PLACEHOLDERS);
        let sql = self.table.render(&q.sql);
        let rows = query::<D>(&sql, list_values(&q.args))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("list events", e))?;
        records(rows, self.table.naming(), "list events")
    }

    /// Every app_code that has rows, sorted.
    /// One index probe per app_code ([`Statements::next_app_code`]),
    /// however many rows each has.
    pub async fn present_app_codes(&self) -> Result<Vec<String>> {
        self.app_codes_in("{table}").await
    }

    /// Every app_code with rows in `table` (`{table}` or `{archive}`, each
    /// led by an `(app_code, …)` index), sorted.
    pub async fn app_codes_in(&self, table: &str) -> Result<Vec<String>> {
        let next = self.table.render(&D::STATEMENTS.next_app_code.replace("{table}", table));
        // The first probe takes `>=` the empty string: a row a plain
        // INSERT wrote with an empty app_code is listed too.
        let app_code = self.table.column("app_code");
        let first = next.replacen(&format!("{app_code} > "), &format!("{app_code} >= "), 1);
        let mut codes: Vec<String> = Vec::new();
        loop {
            let (sql, after) = match codes.last() {
                None => (first.as_str(), ""),
                Some(last) => (next.as_str(), last.as_str()),
            };
            let next: Option<String> = query::<D>(sql, [after.into()])
                .try_map(|row: <D::DB as Database>::Row| sqlx::Row::try_get(&row, 0))
                .fetch_one(&self.pool)
                .await
                .map_err(|e| db_error("list app_codes", e))?;
            match next {
                Some(code) => codes.push(code),
                None => return Ok(codes),
            }
        }
    }

    /// Archived rows with this event id in one of `app_codes`.
    pub async fn find_archived(&self, event_id: &str, app_codes: &[String]) -> Result<Vec<EventRecord>> {
        if let Some(to) = self.elsewhere() {
            return to.find_archived(event_id, app_codes).await;
        }
        self.find_in(&self.sql.find_archived, event_id, app_codes, "find archived event").await
    }

    /// Rows `sql` (binding the app_codes, then the event id) finds, by id.
    async fn find_in(
        &self,
        sql: &str,
        event_id: &str,
        app_codes: &[String],
        op: &'static str,
    ) -> Result<Vec<EventRecord>> {
        if app_codes.is_empty() {
            return Ok(Vec::new());
        }
        let db = |e| db_error(op, e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let binds = vec![Value::Texts(app_codes), event_id.into()];
        let rows = self.fetch_expanded(&mut conn, sql, binds).await.map_err(db)?;
        // A long app_code list may run as several statements (MySQL).
        let mut found = records(rows, self.table.naming(), op)?;
        found.sort_by_key(|r| r.id);
        Ok(found)
    }

    /// Rows of `app_code` delivered per minute since `since_ms`.
    pub async fn delivered_per_minute(&self, app_code: &str, since_ms: i64) -> Result<Vec<MinuteCount>> {
        let rows = query::<D>(&self.sql.delivered_per_minute, [app_code.into(), since_ms.into()])
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("delivered per minute", e))?;
        minute_counts(rows)
    }

    /// Live rows with this event id.
    /// The unique `(app_code, event_id)` index is probed once per app_code
    /// with rows (found by a loose index scan), so no index on `event_id`
    /// alone is needed.
    pub async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>> {
        let app_codes = self.present_app_codes().await?;
        self.find_in(&self.sql.find, event_id, &app_codes, "find event").await
    }

    /// The runtime controls.
    pub async fn controls(&self) -> Result<Vec<postbox_core::control::Control>> {
        crate::controls_of(
            self.all_rows(&self.sql.control_select, "read controls").await?,
            self.table.naming(),
        )
    }

    /// Stores `control` in place of its key's and logs it, in one
    /// transaction.
    pub async fn set_control(
        &self,
        control: &postbox_core::control::Control,
        by: &str,
    ) -> Result<postbox_core::control::Control> {
        control
            .validate()
            .map_err(|e| postbox_core::Error::InvalidEvent(format!("control: {e}")))?;
        let op = "set a control";
        let mut tx = self.begin_write().await.map_err(|e| db_error(op, e))?;
        let delivery = control.delivery.map(postbox_core::control::delivery_name);
        let detail = control.describe();
        let res = async {
            let key = || [control.app_code.as_str().into(), control.event_type.as_str().into()];
            query::<D>(&self.sql.control_delete, key()).execute(&mut *tx).await?;
            let binds = [
                control.app_code.as_str().into(),
                control.event_type.as_str().into(),
                Value::Int32(i32::from(control.paused)),
                delivery.into(),
                Value::Int(control.max_retry_count.map(i64::from)),
                Value::Int(control.sample_percent.map(i64::from)),
                by.into(),
            ];
            query::<D>(&self.sql.control_insert, binds).execute(&mut *tx).await?;
            let log = [
                by.into(),
                control.app_code.as_str().into(),
                control.event_type.as_str().into(),
                detail.as_str().into(),
            ];
            query::<D>(&self.sql.control_log_insert, log).execute(&mut *tx).await?;
            Ok::<_, sqlx::Error>(())
        }
        .await
        .map_err(|e| db_error(op, e));
        finish(tx, res, op).await?;
        let stored = self.controls().await?;
        stored
            .into_iter()
            .find(|c| c.app_code == control.app_code && c.event_type == control.event_type)
            .ok_or_else(|| postbox_core::Error::Internal("a control set was not found".into()))
    }

    /// Removes the control of a key and logs it; false when there was none.
    pub async fn clear_control(&self, app_code: &str, event_type: &str, by: &str) -> Result<bool> {
        let op = "clear a control";
        let mut tx = self.begin_write().await.map_err(|e| db_error(op, e))?;
        let res = async {
            let done = query::<D>(&self.sql.control_delete, [app_code.into(), event_type.into()])
                .execute(&mut *tx)
                .await?;
            let gone = D::rows_affected(&done);
            if gone > 0 {
                let log = [by.into(), app_code.into(), event_type.into(), "cleared".into()];
                query::<D>(&self.sql.control_log_insert, log).execute(&mut *tx).await?;
            }
            Ok::<_, sqlx::Error>(gone > 0)
        }
        .await
        .map_err(|e| db_error(op, e));
        finish(tx, res, op).await
    }

    /// The newest `limit` control changes, newest first.
    pub async fn control_log(&self, limit: u32) -> Result<Vec<postbox_core::control::ControlLogEntry>> {
        let rows = query::<D>(&self.sql.control_log_select, [Value::Int(Some(i64::from(limit)))])
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("read the control log", e))?;
        crate::control_log_of(rows, self.table.naming())
    }

    /// Writes a relay's heartbeat: one update of its row, or, the first
    /// time, an insert, when relays long gone are forgotten too.
    pub async fn beat(&self, beat: &postbox_core::store::RelayBeat) -> Result<()> {
        let op = "write the relay heartbeat";
        let app_codes = beat.app_codes.join(",");
        let binds = || {
            [
                beat.host.as_str().into(),
                Value::Int(Some(i64::from(beat.pid))),
                app_codes.as_str().into(),
                Value::Int(Some(beat.claimed as i64)),
                Value::Int(Some(beat.delivered as i64)),
                Value::Int(Some(beat.failed as i64)),
                Value::Int(Some(beat.per_minute as i64)),
                Value::Int(Some(i64::from(beat.stopped))),
                beat.worker_id.as_str().into(),
            ]
        };
        let db = |e| db_error(op, e);
        let updated = query::<D>(&self.sql.relay_update, binds())
            .execute(&self.pool)
            .await
            .map_err(db)?;
        if D::rows_affected(&updated) == 0 {
            query::<D>(&self.sql.relay_insert, binds())
                .execute(&self.pool)
                .await
                .map_err(db)?;
            let forget = [Value::Int(Some(postbox_core::store::RELAY_FORGOTTEN_AFTER_MS))];
            query::<D>(&self.sql.relay_forget, forget)
                .execute(&self.pool)
                .await
                .map_err(db)?;
        }
        Ok(())
    }

    /// Every relay of the registry, the newest first.
    pub async fn relays(&self) -> Result<Vec<postbox_core::store::RelaySeen>> {
        crate::relays_of(
            self.all_rows(&self.sql.relay_select, "read the relays").await?,
            self.table.naming(),
        )
    }

    /// The attempt history of an event, oldest first.
    pub async fn history(&self, event_id: &str) -> Result<Vec<HistoryEntry>> {
        let rows = query::<D>(&self.sql.history, [event_id.into()])
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("read history", e))?;
        history_entries(rows)
    }

    /// Which of `event_ids` of `app_code` are archived.
    pub async fn archived_event_ids(&self, app_code: &str, event_ids: &[String]) -> Result<Vec<String>> {
        if event_ids.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(to) = self.elsewhere() {
            return to.archived_event_ids(app_code, event_ids).await;
        }
        let db = |e| db_error("look up archived events", e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let binds = vec![app_code.into(), Value::Texts(event_ids)];
        let mut found: Vec<String> = self
            .fetch_expanded(&mut conn, &self.sql.archived_event_ids, binds)
            .await
            .map_err(db)?
            .iter()
            .map(|r| sqlx::Row::try_get(r, self.table.column("event_id")))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| db_error("look up archived events", e))?;
        found.sort_unstable();
        found.dedup();
        Ok(found)
    }

    /// Aggregates of `app_code` whose head cannot move.
    pub async fn stuck_aggregates(&self, app_code: &str, older_than_ms: i64, limit: u32) -> Result<Vec<StuckAggregate>> {
        let binds = [app_code.into(), older_than_ms.into(), i64::from(limit).into()];
        let rows = query::<D>(&self.sql.stuck_aggregates, binds)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("find stuck aggregates", e))?;
        crate::stuck_aggregates(app_code, rows, self.table.naming())
    }

    /// The database clock, epoch ms.
    pub async fn now_ms(&self) -> Result<i64> {
        sqlx::query_scalar(&self.sql.now_ms)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_error("read database clock", e))
    }

    /// The app_codes a replay by `f` visits when it names none: those
    /// with rows and, where `f` reaches the archive, those with archived
    /// rows (here, or in the archive database): a tenant whose rows are
    /// all archived has none in the table, and its events would be left
    /// out of the replay without a word.
    async fn replay_app_codes(&self, f: &EventFilter) -> Result<Vec<String>> {
        let mut codes = self.present_app_codes().await?;
        if f.reaches_archive() {
            codes.extend(self.app_codes_in("{archive}").await?);
            if let Some(to) = self.elsewhere() {
                codes.extend(to.archived_app_codes().await?);
            }
            codes.sort();
            codes.dedup();
        }
        Ok(codes)
    }

    /// A paced replay's next batch ([`postbox_core::ReplayStore::replay_ids_after`]):
    /// per app_code, through the same indexes as the replay.
    pub async fn replay_ids_after(&self, f: &EventFilter, after_id: i64, size: u32) -> Result<Vec<i64>> {
        let f = EventFilter { after_id: Some(after_id), through_id: None, before_id: None, limit: size, ..f.clone() };
        if f.aggregate_id.is_some() {
            self.require_aggregate_index(&self.tables_read_with_archive()).await?;
        }
        let app_codes = match &f.app_code {
            Some(code) => vec![code.clone()],
            None => self.replay_app_codes(&f).await?,
        };
        let mut ids: Vec<i64> = Vec::new();
        for code in app_codes {
            let f = EventFilter { app_code: Some(code), ..f.clone() };
            let mut tables = vec![("{table}", "status")];
            if f.reaches_archive() {
                // Archived here (before `[archive] url` was set) and there.
                tables.push(("{archive}", crate::list::ARCHIVED_STATUS));
                if let Some(to) = self.elsewhere() {
                    ids.extend(to.archived_ids(&f).await?);
                }
            }
            for (table, status) in tables {
                let q = crate::ids_query(table, &f, status, D::PLACEHOLDERS);
                let sql = self.table.render(&q.sql);
                let rows = query::<D>(&sql, list_values(&q.args))
                    .fetch_all(&self.pool)
                    .await
                    .map_err(|e| db_error("find a replay's next batch", e))?;
                ids.extend(first_column::<i64, _>(rows).map_err(|e| db_error("find a replay's next batch", e))?);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids.truncate(size as usize);
        Ok(ids)
    }

    /// Puts rows back to `pending` for `targets`, with their history, in
    /// one write transaction (a dry run only reads).
    pub async fn replay_to(&self, request: ReplayRequest<'_>) -> Result<Vec<EventRecord>> {
        let ReplayRequest {
            selector,
            dry_run,
            origin,
            targets,
        } = request;
        let db = |e| db_error("replay", e);
        // Events by id are looked up per app_code, through the unique
        // `(app_code, event_id)` index (an `OR` that makes the app_code
        // optional would leave the planner no index: a whole-table scan).
        // Without one given, every app_code with rows, read before the
        // transaction (a pool may hold a single connection).
        // A filter without an app_code likewise runs once per app_code, so
        // that every replay statement reads an index its app_code leads.
        if let ReplaySelector::Filter(EventFilter { aggregate_id: Some(_), .. }) = &selector {
            self.require_aggregate_index(&self.tables_read_with_archive()).await?;
        }
        let app_codes = match &selector {
            ReplaySelector::EventIds { app_code: Some(code), .. } => vec![code.clone()],
            ReplaySelector::Filter(EventFilter { app_code: Some(code), .. }) => vec![code.clone()],
            ReplaySelector::Filter(f) => self.replay_app_codes(f).await?,
            ReplaySelector::EventIds { .. } => self.present_app_codes().await?,
        };
        // A dry run only reads (one consistent snapshot).
        let mut tx = self.begin_relay(!dry_run).await.map_err(db)?;
        // Rows brought back from an archive in another database, deleted
        // there once this transaction commits.
        let mut forget = Vec::new();
        let res = async {
            // Chosen publishers only: an event not delivered that one left
            // out has not confirmed would be marked delivered without it.
            // Checked here, in the transaction, for every caller (a paced
            // replay's batches, the API's bulk replay).
            // A dry run returns the rows, as they are, for the caller to
            // check (and to say which id is ambiguous first).
            let mut checked = None;
            if matches!(targets.pick, ReplayPick::Only(_)) && !dry_run {
                let before = self.replay_select(&mut tx, selector, &app_codes, true, &mut Vec::new()).await?;
                refuse_left_out(targets, &before)?;
                checked = Some(before.iter().map(|r| r.id).collect::<HashSet<i64>>());
            }
            let mut out = self.replay_select(&mut tx, selector, &app_codes, dry_run, &mut forget).await?;
            if let Some(checked) = checked {
                // A row the check did not see (being delivered then, marked
                // since by a relay) was not checked: the whole replay is
                // rolled back, to be run again.
                if out.iter().any(|r| !checked.contains(&r.id)) {
                    return Err(postbox_core::Error::Transient {
                        operation: "replay",
                        source: "a relay marked some of the rows between the replay's check and its write; run it again"
                            .into(),
                    });
                }
            }
            if !dry_run && !out.is_empty() {
                let ids: Vec<i64> = out.iter().map(|r| r.id).collect();
                if let Some(delivered_to) = targets.delivered_to_override() {
                    let binds = vec![Value::Ids(&ids), delivered_to.as_deref().into()];
                    self.execute_expanded(&mut tx, &self.sql.replay_set_delivered_to, binds)
                        .await
                        .map_err(db)?;
                    targets.apply(&mut out);
                }
                for (to, group) in targets.history_groups(&out) {
                    let binds = vec![Value::Ids(&group), origin.into(), to.as_deref().into()];
                    self.execute_expanded(&mut tx, &self.sql.history_replayed, binds)
                        .await
                        .map_err(db)?;
                }
                self.prune_history(&mut tx, &ids).await.map_err(db)?;
                // Rows are pending again: wake relays (in this transaction).
                D::notify_pending(self, &mut tx).await.map_err(db)?;
            }
            Ok(out)
        }
        .await;
        let out = finish(tx, res, "replay").await?;
        if let Some(to) = self.elsewhere() {
            self.forget_unarchived(to, &forget).await;
        }
        if !dry_run && !out.is_empty() {
            self.wake.signal();
        }
        Ok(out)
    }

    /// The rows `selector` replays in `app_codes`, replayed (or, for a dry
    /// run, read) in `tx`.
    async fn replay_select(
        &self,
        tx: &mut <D::DB as Database>::Connection,
        selector: &ReplaySelector,
        app_codes: &[String],
        dry_run: bool,
        forget: &mut Vec<i64>,
    ) -> Result<Vec<EventRecord>> {
        let db = |e| db_error("replay", e);
        let mut out = Vec::new();
        match selector {
            ReplaySelector::EventIds { event_ids, .. } => {
                for code in app_codes {
                    let binds = vec![Value::Texts(event_ids), code.as_str().into()];
                    if dry_run {
                        let rows = self.fetch_expanded(&mut *tx, &self.sql.replay_ids_dry, binds).await.map_err(db)?;
                        out.extend(records(rows, self.table.naming(), "replay")?);
                    } else {
                        out.extend(self.replay_rows(&mut *tx, ReplayStep::Replay, &self.sql.replay_ids, binds, "replay").await?);
                    }
                }
                out.sort_by_key(|r| r.id);
            }
            ReplaySelector::Filter(f) => {
                for code in app_codes {
                    let f = EventFilter { app_code: Some(code.clone()), ..f.clone() };
                    out.extend(self.replay_filtered(&mut *tx, &f, dry_run, forget).await?);
                }
            }
        }
        Ok(out)
    }

    /// Moves old delivered rows into the archive in batches, under the
    /// dialect's per-table archive lock.
    pub async fn archive(
        &self,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport> {
        let db = |e| db_error("archive", e);
        // A session lock (PostgreSQL, MySQL) keeps its connection for the
        // run; otherwise each batch takes a connection of its own, so the
        // archiver never holds one of the relay's between batches.
        let mut session = None;
        if D::ARCHIVE_LOCK_IN_SESSION {
            let mut conn = self.pool.acquire().await.map_err(db)?;
            if !D::archive_lock(&mut conn, &self.table).await? {
                return Ok(ArchiveReport {
                    locked_out: true,
                    ..Default::default()
                });
            }
            session = Some(conn);
        }
        let report = async {
            let mut report = ArchiveReport::default();
            let drop = req.partitions == postbox_core::config::PartitionArchive::Drop;
            // A partition that cannot be detached now (a long transaction
            // on it past the lock timeout, say) leaves its rows to the
            // row batches below: the whole run stopped there, and
            // delivered rows piled up in the outbox run after run.
            let (rows, partitions) = match self.archive_partitions(req.before_ms, drop, on_batch).await {
                Ok(done) => done,
                Err(e) => {
                    tracing::warn!(table = %self.table, error = %e, "archiving whole partitions failed; archiving their rows batch by batch this run");
                    (0, 0)
                }
            };
            report.moved += rows;
            report.batches += partitions;
            for app_code in &req.app_codes {
                loop {
                    if req.max_batches.is_some_and(|m| report.batches >= m) {
                        return Ok(report);
                    }
                    let (moved, copied) = match self.elsewhere() {
                        // Rows archived here before the archive moved go
                        // first, then the outbox's.
                        Some(to) => {
                            let (moved, copied) = self
                                .archive_batch_elsewhere(to, Source::LocalArchive, app_code, req.before_ms, req.batch_size)
                                .await?;
                            if moved > 0 {
                                (moved, copied)
                            } else {
                                self.archive_batch_elsewhere(to, Source::Outbox, app_code, req.before_ms, req.batch_size)
                                    .await?
                            }
                        }
                        None => {
                            let mut own;
                            let conn = match session.as_mut() {
                                Some(conn) => conn,
                                None => {
                                    own = self.pool.acquire().await.map_err(db)?;
                                    &mut own
                                }
                            };
                            D::archive_batch(self, conn, app_code, req.before_ms, req.batch_size).await?
                        }
                    };
                    postbox_core::archive::log_archived_duplicates(
                        self.table.as_str(),
                        moved as i64,
                        copied as i64,
                    );
                    if moved == 0 {
                        break;
                    }
                    report.moved += moved;
                    report.batches += 1;
                    on_batch(moved);
                }
            }
            report.complete = true;
            Ok(report)
        }
        .await;
        if let Some(mut conn) = session {
            if let Err(e) = D::archive_unlock(&mut conn, &self.table).await {
                // The lock dies with the session: make sure the session dies.
                tracing::warn!(error = %e, "could not release the archive lock; closing its connection");
                conn.close_on_drop();
            }
        }
        report
    }

    /// Creates or upgrades the tables; idempotent. The ledger
    /// (`postbox_schema_migrations`) is checked against the tables first,
    /// under the migration lock ([`check_ledger`]): an outbox table that is
    /// gone is created as new, and versions whose tables are gone run again.
    ///
    /// A table with its own names (`[database.columns]`,
    /// `[database.statuses]`) that postbox has not adopted yet is refused:
    /// `postbox adopt` adds what it lacks without blocking it.
    pub async fn migrate(&self) -> Result<MigrateReport> {
        if !self.table.naming().is_plain() && self.not_adopted_yet().await? {
            return Err(postbox_core::Error::Schema(format!(
                "table `{}` is a table of your own that postbox has not adopted yet: \
                 run `postbox adopt` (it lists what postbox adds) and `postbox adopt --apply`",
                self.table
            )));
        }
        self.refuse_unpartitioned().await?;
        let report = self.migrate_skipping(|_| false).await?;
        let created = self.keep_partitions().await?;
        if !created.is_empty() {
            tracing::info!(table = %self.table, partitions = created.len(), first = %created[0], "partitions created");
        }
        Ok(report)
    }

    /// The outbox table exists and the ledger has no version of it.
    async fn not_adopted_yet(&self) -> Result<bool> {
        let db = |e| db_error("migrate", e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let names = [self.table.as_str().to_owned()];
        let existing = self
            .fetch_expanded(&mut conn, &self.sql.existing_tables, vec![Value::Texts(&names)])
            .await
            .map_err(db)?;
        if existing.is_empty() {
            return Ok(false);
        }
        sqlx::query(&self.sql.create_migrations_table)
            .execute(&mut *conn)
            .await
            .map_err(db)?;
        let versions = query::<D>(&self.sql.applied_versions, [self.table.as_str().into()])
            .fetch_all(&mut *conn)
            .await
            .map_err(db)?;
        Ok(versions.is_empty())
    }

    /// [`SqlOutbox::migrate`], leaving out the statements `skip` picks
    /// (`adopt` has built the outbox table's indexes without blocking it).
    pub(crate) async fn migrate_skipping(&self, skip: impl Fn(&str) -> bool + Sync) -> Result<MigrateReport> {
        let db = |e| db_error("migrate", e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        D::migration_session_lock(&mut conn, &self.table).await?;
        let report = self.migrate_on(&mut conn, &skip).await;
        if let Err(e) = D::migration_session_unlock(&mut conn, &self.table).await {
            // The lock dies with the session: make sure the session dies.
            tracing::warn!(error = %e, "could not release the migration lock; closing its connection");
            conn.close_on_drop();
        }
        let mut report = report?;
        if let Some(to) = self.elsewhere() {
            let archive = to.migrate().await?;
            if !archive.applied.is_empty() {
                report.notes.push(format!(
                    "the archive database: versions {:?} applied (`{}` is kept there)",
                    archive.applied,
                    self.table.archive()
                ));
            }
            report.notes.extend(archive.notes.into_iter().map(|n| format!("the archive database: {n}")));
        }
        Ok(report)
    }

    /// [`SqlOutbox::migrate`] on `conn`, in one write transaction.
    async fn migrate_on(
        &self,
        conn: &mut <D::DB as Database>::Connection,
        skip: &(dyn Fn(&str) -> bool + Sync),
    ) -> Result<MigrateReport> {
        let db = |e| db_error("migrate", e);
        let mut tx = Transaction::<D::DB>::begin(conn, D::BEGIN_WRITE.map(Cow::Borrowed)).await.map_err(db)?;
        let res = async {
            D::migration_lock(&mut tx).await.map_err(db)?;
            sqlx::query(&self.sql.create_migrations_table)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
            let mut applied: Vec<i32> = query::<D>(&self.sql.applied_versions, [self.table.as_str().into()])
                .fetch_all(&mut *tx)
                .await
                .map_err(db)?
                .iter()
                .map(|r| sqlx::Row::try_get(r, "version"))
                .collect::<std::result::Result<_, _>>()
                .map_err(db)?;
            let names: Vec<String> = EXPECTED_TABLES.iter().map(|s| format!("{}{s}", self.table)).collect();
            let existing = first_column(
                self.fetch_expanded(&mut tx, &self.sql.existing_tables, vec![Value::Texts(&names)])
                    .await
                    .map_err(db)?,
            )
            .map_err(db)?;
            let recorded: Vec<u32> = applied.iter().map(|v| *v as u32).collect();
            let check = check_ledger(self.table.as_str(), &recorded, &existing);
            for note in &check.notes {
                tracing::warn!(table = %self.table, "migrate: {note}");
            }
            if check.forget_ledger {
                query::<D>(&self.sql.forget_versions, [self.table.as_str().into()])
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                applied.clear();
            }
            let mut report = MigrateReport {
                notes: check.notes,
                ..MigrateReport::default()
            };
            for (version, description, statements) in D::MIGRATIONS {
                let pending = !applied.contains(&(*version as i32));
                if !pending && !check.rerun.contains(version) {
                    continue;
                }
                let statements = match (version, self.partition_sql()) {
                    (1, Some((_, sql))) => sql.v1,
                    _ => statements,
                };
                for stmt in statements.iter().map(|st| self.table.render(st)) {
                    if skip(&stmt) {
                        continue;
                    }
                    match sqlx::query(&stmt).execute(&mut *tx).await {
                        Ok(_) => {}
                        // A column a kept table already has (its table was
                        // not dropped when the outbox was): applied.
                        Err(e) if adds_an_existing_column(&stmt, &e) => {}
                        Err(e) => {
                            if !D::applied_before(&mut tx, &stmt, &e).await.map_err(db)? {
                                return Err(db(e));
                            }
                            tracing::info!(table = %self.table, version, "migrate: the version's change was already made (a run cut short before recording it)");
                        }
                    }
                }
                if pending && *version == 1 {
                    // A (re)created outbox table continues a kept archive's ids.
                    for stmt in D::CONTINUE_IDS_AFTER_ARCHIVE {
                        sqlx::query(&self.table.render(stmt))
                            .execute(&mut *tx)
                            .await
                            .map_err(db)?;
                    }
                    D::continue_ids(&mut tx, &self.table).await.map_err(db)?;
                }
                if !pending {
                    continue;
                }
                let binds = [self.table.as_str().into(), Value::Int32(*version as i32), (*description).into()];
                query::<D>(&self.sql.record_version, binds)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                report.applied.push(*version);
            }
            Ok((applied, report))
        }
        .await;
        let (applied, mut report) = finish(tx, res, "migrate").await?;
        report.version = applied
            .iter()
            .map(|v| *v as u32)
            .chain(report.applied.iter().copied())
            .max()
            .unwrap_or(0);
        Ok(report)
    }

    /// The schema version and which expected tables and indexes exist.
    /// A database without the migrations ledger is at version 0; any
    /// failed read is an error, never "version 0".
    pub async fn inspect_schema(&self) -> Result<SchemaReport> {
        let db = |e| db_error("inspect schema", e);
        let t = self.table.as_str();
        let names = self.catalog_names("inspect schema").await?;
        let version: Option<i32> = if names.iter().any(|n| n == MIGRATIONS_LEDGER) {
            // One column, `MAX(version)`: NULL when nothing is recorded.
            query::<D>(&self.sql.doctor_version, [t.into()])
                .fetch_one(&self.pool)
                .await
                .and_then(|r| sqlx::Row::try_get(&r, 0))
                .map_err(db)?
        } else {
            None
        };
        let mut report = SchemaReport::from_catalog(
            t,
            version.unwrap_or(0) as u32,
            D::MIGRATIONS.last().map_or(0, |m| m.0),
            &names,
            D::EXTRA_INDEXES,
        );
        report.objects.extend(D::triggers().iter().map(|suffix| {
            let name = format!("{t}{suffix}");
            postbox_core::store::SchemaObject {
                kind: "trigger",
                present: names.contains(&name),
                name,
            }
        }));
        Ok(report)
    }
}
}

engine_impl! {
impl SqlOutbox<D> {
    /// Every row of `sql`, a statement without parameters.
    async fn all_rows(&self, sql: &str, op: &'static str) -> Result<Vec<<D::DB as Database>::Row>> {
        query::<D>(sql, []).fetch_all(&self.pool).await.map_err(|e| db_error(op, e))
    }

    /// The names of the tables, indexes and triggers in the catalog.
    pub(crate) async fn catalog_names(&self, op: &'static str) -> Result<Vec<String>> {
        let rows = self.all_rows(&self.sql.doctor_objects, op).await?;
        first_column(rows).map_err(|e| db_error(op, e))
    }

    /// Creates (`wanted`) or drops [`AGGREGATE_INDEX`] on the outbox table
    /// and its archive, each only where it is missing (or there).
    pub async fn aggregate_index(&self, wanted: bool) -> Result<Vec<String>> {
        let op = if wanted { "create the aggregate index" } else { "drop the aggregate index" };
        let names = self.catalog_names(op).await?;
        let mut changed = Vec::new();
        for on in [self.table.as_str().to_owned(), self.table.archive()] {
            let name = format!("{on}{AGGREGATE_INDEX}");
            if names.contains(&name) == wanted {
                continue;
            }
            if on == self.table.as_str() && self.partition_sql().is_some() {
                self.partitioned_aggregate_index(wanted, &name).await?;
                changed.push(name);
                continue;
            }
            let drop = [D::DROP_AGGREGATE_INDEX];
            let statements = if wanted { D::CREATE_AGGREGATE_INDEX } else { &drop[..] };
            for template in statements {
                let sql = self.table.render(&template.replace("{name}", &name)).replace("{on}", &on);
                query::<D>(&sql, []).execute(&self.pool).await.map_err(|e| db_error(op, e))?;
            }
            changed.push(name);
        }
        Ok(changed)
    }

    /// The database's statistics of the statements naming the table
    /// ([`Dialect::statement_stats`]).
    pub async fn statement_stats(&self) -> Result<postbox_core::store::StatementStats> {
        D::statement_stats(self).await
    }

    /// The tables of this database a replay reaching the archive reads:
    /// the outbox table, and its archive unless that is in another
    /// database (whose store checks its own).
    fn tables_read_with_archive(&self) -> Vec<String> {
        let mut tables = vec![self.table.as_str().to_owned()];
        if self.elsewhere.is_none() {
            tables.push(self.table.archive());
        }
        tables
    }

    /// A search by aggregate reads [`AGGREGATE_INDEX`] on each of `tables`;
    /// where it is missing the search is refused (never a scan of the
    /// table), naming the command that creates it.
    async fn require_aggregate_index(&self, tables: &[impl AsRef<str>]) -> Result<()> {
        let names = self.catalog_names("look for the aggregate index").await?;
        let missing: Vec<String> = tables
            .iter()
            .map(|on| format!("{}{AGGREGATE_INDEX}", on.as_ref()))
            .filter(|name| !names.contains(name))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(postbox_core::Error::Schema(format!(
            "searching by aggregate reads the index `{}`, which is not there: `postbox migrate --aggregate-index` creates it (it costs every event one more index entry per write)",
            missing.join("`, `")
        )))
    }

    /// The idle probe ([`postbox_core::RelayStore::due`]): one statement
    /// for every app_code ([`Dialect::due_query`]); a dialect without one
    /// answers "anything may be due" without a round trip.
    pub async fn due(&self, app_codes: &[String]) -> Result<Vec<Due>> {
        use sqlx::Row;
        if app_codes.is_empty() {
            return Ok(Vec::new());
        }
        let Some((sql, binds)) = D::due_query(&self.table, app_codes) else {
            return Ok(app_codes.iter().map(|a| Due::anything(a)).collect());
        };
        let db = |e| db_error("probe for due rows", e);
        let rows = query::<D>(&sql, binds)
            .fetch_all(&self.pool)
            .await
            .map_err(db)?;
        rows.iter()
            .map(|row| {
                Ok(Due {
                    app_code: row.try_get(self.table.column("app_code"))?,
                    pending: row.try_get::<i64, _>("pending")? != 0,
                    retry_in_ms: row.try_get("retry_in_ms")?,
                    lease_in_ms: row.try_get("lease_in_ms")?,
                })
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(db)
    }

    /// The handle `enqueue` signals after every insert; an embedded relay
    /// wakes on it.
    pub fn wake(&self) -> Option<Wake> {
        Some(self.wake.clone())
    }

    /// The database's push wake-up ([`Dialect::listen`]), signalling `wake`.
    pub fn listen(&self, wake: Wake, shutdown: CancellationToken) -> Option<WakeFuture> {
        D::listen(self, wake, shutdown)
    }
}
}

/// The first column of every row (ids, names of tables and indexes).
pub(crate) fn first_column<T, R>(rows: Vec<R>) -> std::result::Result<Vec<T>, sqlx::Error>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    rows.iter().map(|r| r.try_get(0)).collect()
}

/// Whether `stmt`, a lone `ADD COLUMN`, failed only because the column is
/// there: MySQL and MariaDB (42S21) and SQLite have no `ADD COLUMN IF NOT
/// EXISTS` to say so (MariaDB's is not MySQL's), PostgreSQL's statements
/// use theirs (42701 otherwise).
fn adds_an_existing_column(stmt: &str, e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(e) = e else {
        return false;
    };
    let lone_add = stmt.contains("ADD COLUMN") && !stmt.contains(',');
    let code = e.code();
    lone_add
        && (matches!(code.as_deref(), Some("42S21") | Some("42701"))
            || e.message().contains("duplicate column name"))
}

/// A replay statement as it runs, for `doctor` to explain
/// ([`SqlOutbox::replay_probes`]).
#[derive(Debug)]
pub struct ReplayProbe<'a> {
    /// `doctor`'s name for it.
    pub query: &'static str,
    /// The table whose reads are checked.
    pub table: String,
    /// The name the statement gives it (an alias such as `a`, else the
    /// table's own), which MySQL's and SQLite's plans show.
    pub scanned_as: String,
    /// The index it must read through.
    pub expected_index: String,
    /// The statement, placeholders as the dialect writes them.
    pub sql: String,
    /// Its binds, in placeholder order.
    pub values: Vec<Value<'a>>,
}

/// What the replay probes bind for one app_code: event ids that are not
/// there, the status `failed`, the last hour.
#[derive(Debug)]
pub struct ReplayProbeArgs {
    event_ids: Vec<String>,
    failed: EventFilter,
    range: EventFilter,
}

impl ReplayProbeArgs {
    /// The probes' values for `app_code`.
    pub fn new(app_code: &str) -> Self {
        let now_ms = postbox_core::time::now_ms();
        let scoped = EventFilter {
            app_code: Some(app_code.to_owned()),
            ..EventFilter::default()
        };
        ReplayProbeArgs {
            // Two ids: MySQL reads a single id of a unique key while it
            // plans, and explains a missing one as "Impossible WHERE".
            event_ids: vec!["postbox-doctor-1".to_owned(), "postbox-doctor-2".to_owned()],
            failed: EventFilter {
                status: Some(postbox_core::Status::Failed),
                ..scoped.clone()
            },
            range: EventFilter {
                since_ms: Some(now_ms - 3_600_000),
                until_ms: Some(now_ms),
                ..scoped
            },
        }
    }

    fn app_code(&self) -> &str {
        self.failed.app_code.as_deref().unwrap_or_default()
    }
}

/// [`postbox_core::Error::Refused`] when `rows` (as they were before the
/// replay) hold an event not delivered that a publisher `targets` leaves
/// out has not confirmed.
fn refuse_left_out(targets: &ReplayTargets, rows: &[EventRecord]) -> Result<()> {
    let left_out = targets.unconfirmed_left_out(rows);
    if left_out.is_empty() {
        return Ok(());
    }
    Err(postbox_core::Error::Refused(format!(
        "{}; replaying to the chosen publishers alone would mark it delivered without them: add them to the publishers, or leave the publishers out to send to every publisher that has not confirmed (none of these was replayed)",
        left_out.join("; ")
    )))
}

/// How `sql` names `table`: the alias after `FROM <table> ` (lower case,
/// as keywords are upper case in postbox's statements), else the table.
fn name_in(sql: &str, table: &str) -> String {
    let from = format!("FROM {table} ");
    sql.find(&from)
        .and_then(|i| sql[i + from.len()..].split_whitespace().next())
        .filter(|word| word.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .map_or_else(|| table.to_owned(), str::to_owned)
}

fn list_values<'a, 's>(args: &'s [ListArg<'a>]) -> impl Iterator<Item = Value<'a>> + use<'a, 's> {
    args.iter().map(|a| match *a {
        ListArg::Text(s) => s.into(),
        ListArg::Int(i) => i.into(),
    })
}
