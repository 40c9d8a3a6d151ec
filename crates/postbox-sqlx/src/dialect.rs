//! What one database adds to the engine: its statement set and the hooks
//! for the few operations that really differ between databases.
//!
//! A fourth database is one more [`Dialect`]: its statements (one named
//! constant each, with the index it relies on), its claim, its enqueue
//! insert, its archive lock and batch, and its plan reader.

use std::borrow::Cow;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::query::Query;
use sqlx::Database;

use postbox_core::store::{ClaimRequest, QueryPlan};
use postbox_core::{ClaimSource, ClaimedEvent, EventRecord, NewEvent, Result, TableName};

use crate::{Placeholders, SqlOutbox};

/// The arguments type of a query of `DB`.
pub type Args<'q, DB> = <DB as Database>::Arguments<'q>;

/// A query of `DB` ready to be bound.
pub type Q<'q, DB> = Query<'q, DB, Args<'q, DB>>;

/// One value bound to a statement, in placeholder order. The engine binds
/// only these, through [`Dialect::bind`], so the engine itself needs no
/// encoding bounds and a list travels the way each database takes one
/// (a PostgreSQL array, a SQLite JSON array read with `json_each`).
#[derive(Debug, Clone, Copy)]
pub enum Value<'a> {
    /// A text value or NULL.
    Text(Option<&'a str>),
    /// A 64-bit integer or NULL.
    Int(Option<i64>),
    /// A 32-bit integer (`retry_count`, `attempt`).
    Int32(i32),
    /// A list of row ids (`= ANY($n)`, `IN (SELECT value FROM json_each(?n))`).
    Ids(&'a [i64]),
    /// A list of texts (event ids, app_codes, table names).
    Texts(&'a [String]),
}

impl<'a> From<&'a str> for Value<'a> {
    fn from(s: &'a str) -> Self {
        Value::Text(Some(s))
    }
}

impl<'a> From<&'a String> for Value<'a> {
    fn from(s: &'a String) -> Self {
        Value::Text(Some(s))
    }
}

impl<'a> From<Option<&'a str>> for Value<'a> {
    fn from(s: Option<&'a str>) -> Self {
        Value::Text(s)
    }
}

impl From<i64> for Value<'_> {
    fn from(i: i64) -> Self {
        Value::Int(Some(i))
    }
}

impl From<Option<i64>> for Value<'_> {
    fn from(i: Option<i64>) -> Self {
        Value::Int(i)
    }
}

/// The statements every dialect writes, each with the index it relies on
/// documented beside its constant in the backend's `sql.rs`. `{table}` and
/// `{archive}` are rendered once per store ([`Statements::render`]). The
/// bind order of each statement is fixed by the engine and given here.
#[derive(Debug, Clone)]
pub struct Statements<S = &'static str> {
    /// The database clock in epoch ms; no binds.
    pub now_ms: S,
    /// `pending, delivering, retryable, failed, delivered` (the last
    /// capped, see [`count_open!`]); app_code.
    pub count_open: S,
    /// `oldest_pending_ms, retryable_due, now_ms`; app_code.
    pub backlog: S,
    /// `SELECT <columns> FROM {table}`, completed by [`crate::list_query`].
    pub list_select: S,
    /// The smallest app_code above the bind, or NULL (one column), as
    /// `… WHERE app_code > <bind>` (the engine's first probe reads it as
    /// `>=`).
    pub next_app_code: S,
    /// Archived rows of one event; app_codes (list), event_id.
    pub find_archived: S,
    /// `minute_ms, delivered`; app_code, since_ms.
    pub delivered_per_minute: S,
    /// Live rows of one event; app_codes (list), event_id.
    pub find: S,
    /// Fenced; ids (list), worker_id, lock_until_ms.
    pub mark_delivered: S,
    /// Fenced; status, retry_count, retry_after_ms, retry_jitter_ms (due at
    /// `now + after - id mod (jitter + 1)`), delivered_to, error, ids
    /// (list), worker_id, lock_until_ms.
    pub mark_failed: S,
    /// Fenced; ids (list), worker_id, lock_until_ms.
    pub release: S,
    /// Fenced, no attempt counted: `retryable`, due after a delay, with
    /// fanout progress; after_ms, delivered_to, reason, ids (list),
    /// worker_id, lock_until_ms.
    pub defer: S,
    /// Replay by event ids, returning the rows; event_ids (list), app_code.
    pub replay_ids: S,
    /// The rows [`Statements::replay_ids`] would touch; same binds.
    pub replay_ids_dry: S,
    /// Replay by filter, returning the rows; `{filters}` (after a `WHERE`
    /// clause) takes a predicate per given filter ([`crate::filter_query`]).
    pub replay_filter: S,
    /// The rows [`Statements::replay_filter`] would touch; same binds.
    pub replay_filter_dry: S,
    /// Brings archived rows back as pending, returning them; same binds.
    pub unarchive_filter: S,
    /// The rows [`Statements::unarchive_filter`] would bring back.
    pub unarchive_filter_dry: S,
    /// Removes brought-back rows from the archive; ids (list).
    pub delete_unarchived: S,
    /// Sets `delivered_to` of replayed rows; ids (list), delivered_to.
    pub replay_set_delivered_to: S,
    /// One failed attempt; id, kind, attempt, publisher, error.
    pub history_failed: S,
    /// Rows taken over after their lease expired; ids (list).
    pub history_lease_expired: S,
    /// Rows replayed; ids (list), origin, targets.
    pub history_replayed: S,
    /// Keeps the newest entries of each event of some rows; ids (list), limit.
    pub history_prune: S,
    /// `at_ms, kind, attempt, publisher, detail` of one event; event_id.
    pub history: S,
    /// Which event ids are archived (one column); app_code, event_ids (list).
    pub archived_event_ids: S,
    /// Every runtime control; no binds.
    pub control_select: S,
    /// Removes a control; app_code, event_type.
    pub control_delete: S,
    /// Stores a control; app_code, event_type, paused, delivery,
    /// max_retry_count, updated_by.
    pub control_insert: S,
    /// Logs a control change; actor, app_code, event_type, detail.
    pub control_log_insert: S,
    /// `at_ms, actor, app_code, event_type, detail`, newest first; limit.
    pub control_log_select: S,
    /// A relay's heartbeat; host, pid, app_codes, claimed, delivered,
    /// failed, per_minute, stopped, worker_id.
    pub relay_update: S,
    /// A relay's first heartbeat; same binds.
    pub relay_insert: S,
    /// Every relay (see `relay_statements!`); no binds.
    pub relay_select: S,
    /// Forgets relays not seen for a time; ms.
    pub relay_forget: S,
    /// Heads of aggregates held back; app_code, older_than_ms, limit.
    pub stuck_aggregates: S,
    /// The table's schema version (one column); table name.
    pub doctor_version: S,
    /// Names of tables and indexes (one column); no binds.
    pub doctor_objects: S,
    /// Creates the migrations ledger.
    pub create_migrations_table: S,
    /// Which of the given tables exist (one column); table names (list).
    pub existing_tables: S,
    /// Forgets a table's ledger rows; table name.
    pub forget_versions: S,
    /// Versions applied to a table (one column); table name.
    pub applied_versions: S,
    /// Records one version; table name, version, description.
    pub record_version: S,
}

macro_rules! render_all {
    ($self:ident, $t:ident, $($field:ident),* $(,)?) => {
        Statements { $($field: $t.render($self.$field),)* }
    };
}

impl Statements {
    /// Every statement with `{table}` and `{archive}` filled in.
    pub fn render(&self, t: &TableName) -> Statements<String> {
        render_all!(
            self,
            t,
            now_ms,
            count_open,
            backlog,
            list_select,
            next_app_code,
            find_archived,
            delivered_per_minute,
            find,
            mark_delivered,
            mark_failed,
            release,
            defer,
            replay_ids,
            replay_ids_dry,
            replay_filter,
            replay_filter_dry,
            unarchive_filter,
            unarchive_filter_dry,
            delete_unarchived,
            replay_set_delivered_to,
            history_failed,
            history_lease_expired,
            history_replayed,
            history_prune,
            history,
            archived_event_ids,
            control_select,
            control_delete,
            control_insert,
            control_log_insert,
            control_log_select,
            relay_update,
            relay_insert,
            relay_select,
            relay_forget,
            stuck_aggregates,
            doctor_version,
            doctor_objects,
            create_migrations_table,
            existing_tables,
            forget_versions,
            applied_versions,
            record_version,
        )
    }
}

/// The seven event columns every dialect's insert takes, in order:
/// app_code, event_id, event_type, aggregate_id, aggregate_version,
/// payload, headers (`headers` is [`NewEvent::headers_json`]).
pub fn insert_values<'a>(event: &'a NewEvent, headers: &'a Option<String>) -> [Value<'a>; 7] {
    [
        event.app_code.as_str().into(),
        event.event_id.as_str().into(),
        event.event_type.as_str().into(),
        event.aggregate_id.as_deref().into(),
        event.aggregate_version.into(),
        event.payload.as_str().into(),
        headers.as_deref().into(),
    ]
}

/// [`postbox_core::Error::DuplicateEvent`] of `event`: its `(app_code,
/// event_id)` is already in the table.
pub fn duplicate_event(event: &NewEvent) -> postbox_core::Error {
    postbox_core::Error::DuplicateEvent {
        app_code: event.app_code.clone(),
        event_id: event.event_id.clone(),
    }
}

/// The error of a failed enqueue insert of `event`: a unique violation
/// is [`duplicate_event`], anything else a database error.
pub fn enqueue_error(event: &NewEvent, e: sqlx::Error) -> postbox_core::Error {
    match e {
        sqlx::Error::Database(d) if d.kind() == sqlx::error::ErrorKind::UniqueViolation => {
            duplicate_event(event)
        }
        e => crate::db_error("enqueue", e),
    }
}

/// A dialect's five claim statements, rendered for one table.
#[derive(Debug, Clone)]
pub struct ClaimStatements {
    pending: String,
    due_retries: String,
    pending_ordered: String,
    due_retries_ordered: String,
    expired_leases: String,
}

impl ClaimStatements {
    /// Renders `[pending, due_retries, pending_ordered,
    /// due_retries_ordered, expired_leases]` for `t`.
    pub fn render(t: &TableName, [p, d, po, dor, e]: [&str; 5]) -> Self {
        ClaimStatements {
            pending: t.render(p),
            due_retries: t.render(d),
            pending_ordered: t.render(po),
            due_retries_ordered: t.render(dor),
            expired_leases: t.render(e),
        }
    }

    /// The statement of one claim query; `ordered` picks the per-aggregate
    /// variant (expired leases have one statement for both).
    pub fn of(&self, source: ClaimSource, ordered: bool) -> &str {
        use ClaimSource::*;
        match (source, ordered) {
            (Pending, false) => &self.pending,
            (Pending, true) => &self.pending_ordered,
            (DueRetry, false) => &self.due_retries,
            (DueRetry, true) => &self.due_retries_ordered,
            (ExpiredLease, _) => &self.expired_leases,
        }
    }
}

/// One schema version: number, description, statements (`{table}` and
/// `{archive}` rendered when applied; every statement `IF NOT EXISTS`).
pub type Migration = (u32, &'static str, &'static [&'static str]);

/// The replay statement a [`Dialect::replay_rows`] hook is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayStep {
    /// [`Statements::replay_ids`] or [`Statements::replay_filter`]: live rows.
    Replay,
    /// [`Statements::unarchive_filter`]: archived rows brought back.
    Unarchive,
}

/// What the engine runs on a range-partitioned outbox table, where the
/// database has one (`{name}`, `{from}`, `{to}`: a partition and its
/// range; `$1`: the outbox table's name).
#[derive(Debug, Clone, Copy)]
pub struct PartitionSql {
    /// Version 1 for a new partitioned table, in place of the plain one.
    pub v1: &'static [&'static str],
    /// Run before partition DDL, on its connection (for the session: the
    /// DDL runs outside a transaction).
    pub lock_timeout: &'static str,
    /// Run after it, putting the connection back as it was.
    pub reset_lock_timeout: &'static str,
    /// Creates one partition's table, not yet attached (`attach` follows
    /// in the same transaction).
    pub create: &'static str,
    /// The attached partitions: name, bound expression, detach pending.
    pub attached: &'static str,
    /// Whether the table is partitioned.
    pub is_partitioned: &'static str,
    /// Detached partitions not yet archived or dropped, by name.
    pub detached: &'static str,
    /// Whether `{name}` holds a row that is not done.
    pub busy: &'static str,
    /// Detaches without blocking the table's readers and writers.
    pub detach: &'static str,
    /// Finishes a detach that was interrupted.
    pub finalize: &'static str,
    /// Attaches a detached partition back.
    pub attach: &'static str,
    /// Deletes the keys of `{name}`'s events.
    pub forget_keys: &'static str,
    /// Drops `{name}`.
    pub drop: &'static str,
    /// The aggregate index `{name}` on the parent alone (invalid until
    /// every partition's is attached).
    pub index_parent: &'static str,
    /// The aggregate index `{index}` on partition `{name}`, online.
    pub index_partition: &'static str,
    /// Attaches partition index `{index}` to `{parent}`.
    pub attach_index: &'static str,
    /// Drops the parent's index `{parent}` and with it the partitions'.
    pub drop_index: &'static str,
}

/// How [`Dialect::connect_pool`] connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connect {
    /// Create a database that does not exist (SQLite's file; a server
    /// database is never created).
    pub create: bool,
    /// Connect on first use instead of now (a server's pool): the
    /// archive's database, which the relay must not wait for.
    pub lazy: bool,
    /// The configuration key the URL comes from, for errors.
    pub key: &'static str,
}

impl Connect {
    /// `database.url`, connected now.
    pub fn now(create: bool) -> Self {
        Connect {
            create,
            lazy: false,
            key: "database.url",
        }
    }
}

/// A database: its statement set and the hooks for what differs.
#[async_trait]
pub trait Dialect: Sized + Send + Sync + 'static {
    /// The sqlx database.
    type DB: Database;
    /// Statements only this dialect's hooks run (its claims, its insert,
    /// its archive batch), rendered once per store.
    type Own: Send + Sync + std::fmt::Debug;

    /// `postgres`, `mysql` or `sqlite`.
    const BACKEND: &'static str;

    /// The database folds an unquoted table name to lower case (PostgreSQL):
    /// the store uses the name so folded, or its catalog reads (is the
    /// table there, which partitions does it have) find nothing of a
    /// `Room_Outbox`, and every `migrate` rebuilt its indexes.
    const FOLDS_NAMES: bool = false;
    /// How [`crate::list_query`] writes placeholders.
    const PLACEHOLDERS: Placeholders;
    /// The statement that starts a write transaction, when not the default
    /// `BEGIN` (SQLite: `BEGIN IMMEDIATE`, which takes the write lock up
    /// front so a transaction that reads first never fails half-way).
    const BEGIN_WRITE: Option<&'static str>;
    /// The shared statement set.
    const STATEMENTS: Statements;
    /// The schema versions, in order.
    const MIGRATIONS: &'static [Migration];
    /// Run after version 1 is applied to a new outbox table: continue the
    /// ids of an archive that was kept.
    const CONTINUE_IDS_AFTER_ARCHIVE: &'static [&'static str];
    /// Range partitioning on `created_at_ms`, where the database has it.
    const PARTITIONS: Option<PartitionSql> = None;
    /// `id` in a list of ids bound first (`id = ANY($1)`, `id IN ({ids})`,
    /// a JSON array on SQLite), for statements on either table.
    const ID_LIST: &'static str;
    /// How an insert leaves alone a row whose key is already there: the
    /// statement's head and its tail (`INSERT IGNORE INTO` on MySQL,
    /// `ON CONFLICT DO NOTHING` elsewhere).
    const INSERT_IGNORE: (&'static str, &'static str);
    /// The outbox table's own indexes (suffixes), which `doctor` expects
    /// besides [`postbox_core::store::EXPECTED_INDEXES`].
    const EXTRA_INDEXES: &'static [&'static str];
    /// Creates the optional aggregate index `{name}` on `{on}`
    /// (`(app_code, aggregate_id, id)`, [`postbox_core::store::AGGREGATE_INDEX`])
    /// without blocking the table's writes where the database can: each
    /// statement run alone, in order.
    const CREATE_AGGREGATE_INDEX: &'static [&'static str];
    /// Drops index `{name}` of `{on}`.
    const DROP_AGGREGATE_INDEX: &'static str;
    /// The index (suffix) replay of an app_code's `failed` rows reads
    /// (`doctor` checks it; [`SqlOutbox::replay_probes`]).
    const REPLAY_FAILED_INDEX: &'static str;
    /// How `postbox adopt` changes a live table; `None`: not on this
    /// database.
    const ADOPT: Option<crate::Adopt> = None;

    /// `app_code`'s delivered rows when there are more than
    /// [`DELIVERED_COUNT_CAP`]: an estimate read in constant time (the
    /// planner's statistics; `true`), or a count (`false`: SQLite, which
    /// has no statistics to read and serves one process). `None`: the
    /// capped count stands, reported as an estimate.
    async fn delivered_estimate(
        _outbox: &SqlOutbox<Self>,
        _app_code: &str,
    ) -> Option<Result<(i64, bool)>> {
        None
    }
    /// The database's statement statistics for statements naming
    /// `outbox`'s table ([`postbox_core::store::SchemaStore::statement_stats`]).
    /// SQLite keeps none.
    async fn statement_stats(
        _outbox: &SqlOutbox<Self>,
    ) -> Result<postbox_core::store::StatementStats> {
        Err(postbox_core::Error::Schema(
            "SQLite keeps no statement statistics: `doctor --scans` needs PostgreSQL (pg_stat_statements) or MariaDB/MySQL (performance_schema)".into(),
        ))
    }

    /// Run on the connection before every relay transaction (claims,
    /// marks, releases, failed attempts, replays), when the database's
    /// default isolation would make them wait for rows they do not name
    /// (MySQL: `READ COMMITTED`, no gap locks): sent with the `BEGIN` in
    /// one text query, or just before a single autocommit statement.
    /// `None`: the engine's usual `BEGIN`.
    const RELAY_ISOLATION: Option<&'static str> = None;

    /// The statements one logical statement runs as, each with its binds
    /// in placeholder order. The default runs it as written (placeholders
    /// numbered in the engine's bind order, lists bound whole). A database
    /// without list parameters or numbered placeholders (MySQL) renders
    /// its `?` in bind order and splits a long list into several
    /// statements; an empty list then runs nothing.
    fn expand<'s, 'q>(sql: &'s str, values: Vec<Value<'q>>) -> Vec<(Cow<'s, str>, Vec<Value<'q>>)> {
        vec![(Cow::Borrowed(sql), values)]
    }

    /// A replay step that changes rows (`step`'s statement with its
    /// binds), returning the rows as written. `None`: the statement is an
    /// `UPDATE … RETURNING` (or `INSERT … RETURNING`) the engine fetches.
    /// A database without `RETURNING` (MySQL) locks the rows with `sql`,
    /// updates them by primary key and reads them back.
    async fn replay_rows(
        _outbox: &SqlOutbox<Self>,
        _conn: &mut <Self::DB as Database>::Connection,
        _step: ReplayStep,
        _sql: &str,
        _values: Vec<Value<'_>>,
    ) -> Option<Result<Vec<EventRecord>>> {
        None
    }

    /// Keeps the newest [`postbox_core::store::HISTORY_LIMIT`] entries of
    /// the events of rows `ids`. `None`: the engine's one statement
    /// ([`Statements::history_prune`] over the ids). MySQL cannot read the
    /// table it deletes from in one statement: it finds the events over
    /// the limit, then prunes each.
    async fn prune_history(
        _outbox: &SqlOutbox<Self>,
        _conn: &mut <Self::DB as Database>::Connection,
        _ids: &[i64],
    ) -> Option<std::result::Result<(), sqlx::Error>> {
        None
    }

    /// Serialises concurrent `migrate` runs on the migration's connection,
    /// before its transaction, where the lock is the session's (MySQL's
    /// `GET_LOCK`: DDL commits implicitly, so no transaction can hold it).
    /// Nothing by default ([`Dialect::migration_lock`] locks instead).
    async fn migration_session_lock(
        _conn: &mut PoolConnection<Self::DB>,
        _table: &TableName,
    ) -> Result<()> {
        Ok(())
    }

    /// Releases [`Dialect::migration_session_lock`] after the migration.
    async fn migration_session_unlock(
        _conn: &mut PoolConnection<Self::DB>,
        _table: &TableName,
    ) -> std::result::Result<(), sqlx::Error> {
        Ok(())
    }

    /// Whether `stmt`, a migration statement that failed with `error`, had
    /// been applied already: a run cut short after the database committed
    /// the statement but before the ledger recorded its version (MySQL
    /// commits each `ALTER TABLE` on its own), so the table has what the
    /// statement makes.
    async fn applied_before(
        _conn: &mut <Self::DB as Database>::Connection,
        _stmt: &str,
        _error: &sqlx::Error,
    ) -> std::result::Result<bool, sqlx::Error> {
        Ok(false)
    }

    /// Run after version 1 created a new outbox table, besides
    /// [`Dialect::CONTINUE_IDS_AFTER_ARCHIVE`], where continuing a kept
    /// archive's ids needs a value no statement can compute (MySQL's
    /// `AUTO_INCREMENT = n`).
    async fn continue_ids(
        _conn: &mut <Self::DB as Database>::Connection,
        _table: &TableName,
    ) -> std::result::Result<(), sqlx::Error> {
        Ok(())
    }

    /// Renders [`Dialect::Own`] for `table`.
    fn own(table: &TableName) -> Self::Own;

    /// Connects a pool of `max_connections` to `url` as `how` says.
    async fn connect_pool(
        url: &str,
        max_connections: u32,
        how: Connect,
    ) -> Result<sqlx::Pool<Self::DB>>;

    /// A pool beside `pool` (its connect options, a connection for the
    /// claims and one for the marks, connected on first use) for the
    /// relay's bookkeeping writes, with the session settings they want:
    /// commits that do not wait for the log flush where `commit` asks for
    /// it and a session can choose that
    /// ([`postbox_core::config::RelayCommit`]), and
    /// [`Dialect::RELAY_ISOLATION`] set once per session rather than
    /// before every write. `None` (the default): the writes use `pool`.
    fn relay_pool(
        pool: &sqlx::Pool<Self::DB>,
        commit: postbox_core::config::RelayCommit,
    ) -> Option<sqlx::Pool<Self::DB>> {
        let _ = (pool, commit);
        None
    }

    /// Rows a statement changed (sqlx has no trait for it).
    fn rows_affected(done: &<Self::DB as Database>::QueryResult) -> u64;

    /// Binds one value.
    fn bind<'q>(q: Q<'q, Self::DB>, value: Value<'q>) -> Q<'q, Self::DB>;

    /// Writes one event on the caller's connection; its row id, or
    /// [`postbox_core::Error::DuplicateEvent`].
    async fn insert_event(
        outbox: &SqlOutbox<Self>,
        conn: &mut <Self::DB as Database>::Connection,
        event: &NewEvent,
    ) -> Result<i64>;

    /// Runs one claim query.
    async fn claim(
        outbox: &SqlOutbox<Self>,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>>;

    /// Whether the archive lock belongs to a session
    /// ([`Dialect::archive_lock`] on the connection every batch then runs
    /// on). `false` (SQLite, whose write lock each batch's `BEGIN
    /// IMMEDIATE` takes): no lock is taken and each batch takes a pooled
    /// connection of its own.
    const ARCHIVE_LOCK_IN_SESSION: bool = true;

    /// Takes the per-table archive lock on `conn`; false when another
    /// archiver holds it.
    async fn archive_lock(conn: &mut PoolConnection<Self::DB>, table: &TableName) -> Result<bool>;

    /// Releases the archive lock taken by [`Dialect::archive_lock`].
    async fn archive_unlock(
        conn: &mut PoolConnection<Self::DB>,
        table: &TableName,
    ) -> std::result::Result<(), sqlx::Error>;

    /// The statement that picks one archive batch's ids and locks them
    /// until the transaction ends, with its binds (`app_code`, rows
    /// updated before `before_ms`, at most `size`): the batch an archive
    /// kept in another database copies and then deletes.
    fn archive_pick_lock<'a>(
        outbox: &'a SqlOutbox<Self>,
        app_code: &'a str,
        before_ms: i64,
        size: u32,
    ) -> (&'a str, Vec<Value<'a>>);

    /// Moves one batch (see `ArchiveStore::archive`) on `conn`, which holds
    /// the archive lock; `(deleted, copied)`.
    async fn archive_batch(
        outbox: &SqlOutbox<Self>,
        conn: &mut PoolConnection<Self::DB>,
        app_code: &str,
        before_ms: i64,
        batch_size: u32,
    ) -> Result<(u64, u64)>;

    /// Serialises concurrent `migrate` runs inside the migration
    /// transaction (PostgreSQL's advisory lock; nothing where
    /// [`Dialect::BEGIN_WRITE`] already locks).
    async fn migration_lock(
        conn: &mut <Self::DB as Database>::Connection,
    ) -> std::result::Result<(), sqlx::Error>;

    /// Plans of the three claim queries.
    async fn explain_claims(
        outbox: &SqlOutbox<Self>,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<QueryPlan>>;

    /// Whether the claim and archive queries can use their indexes.
    async fn explain_index_use(outbox: &SqlOutbox<Self>, app_code: &str) -> Result<Vec<QueryPlan>>;

    /// The idle probe for `app_codes` (at least one): a statement and its
    /// binds returning, per app_code, `app_code`, `pending` (integer, 0 or
    /// 1: a pending row exists), `retry_in_ms` (earliest
    /// `next_retry_at_ms` of a retryable row minus the database clock,
    /// NULL when none) and `lease_in_ms` (likewise for `lock_until_ms` of a
    /// delivering row), each an index probe on the claim indexes. `None`:
    /// no probe (the relay runs every claim query).
    fn due_query<'q>(
        table: &TableName,
        app_codes: &'q [String],
    ) -> Option<(String, Vec<Value<'q>>)> {
        Self::DUE_BRANCH.map(|branch| crate::due_union(table, branch, app_codes))
    }

    /// The idle probe as one `UNION ALL` branch per app_code
    /// ([`crate::due_branch!`]), for a database without array parameters;
    /// the default [`Dialect::due_query`] uses it. `None`: no probe.
    const DUE_BRANCH: Option<&'static str> = None;

    /// The database's push wake-up: a future that signals `wake` on every
    /// notification of new rows until `shutdown` (PostgreSQL `LISTEN`).
    /// `None`: the database pushes nothing.
    fn listen(
        _outbox: &SqlOutbox<Self>,
        _wake: postbox_core::wake::Wake,
        _shutdown: postbox_core::relay::CancellationToken,
    ) -> Option<WakeFuture> {
        None
    }

    /// Tells listening relays, inside the transaction, that rows became
    /// pending by an UPDATE (replay), which no insert trigger sees.
    /// Nothing by default.
    async fn notify_pending(
        _outbox: &SqlOutbox<Self>,
        _conn: &mut <Self::DB as Database>::Connection,
    ) -> std::result::Result<(), sqlx::Error> {
        Ok(())
    }

    /// Triggers `migrate` creates (suffixes after the table name), which
    /// the schema report lists; [`Statements::doctor_objects`] must name
    /// them when present. None by default.
    fn triggers() -> &'static [&'static str] {
        &[]
    }
}

/// The future of a push wake-up ([`Dialect::listen`]).
pub type WakeFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>>;

/// A dialect's [`Statements`] from the constants of the module it is
/// invoked in, each named as its field in upper case (`now_ms: NOW_MS`,
/// …), so a dialect's `sql.rs` lists its statements once.
#[macro_export]
macro_rules! statements {
    () => {
        $crate::Statements {
            now_ms: NOW_MS,
            count_open: COUNT_OPEN,
            backlog: BACKLOG,
            list_select: LIST_SELECT,
            next_app_code: NEXT_APP_CODE,
            find_archived: FIND_ARCHIVED,
            delivered_per_minute: DELIVERED_PER_MINUTE,
            find: FIND,
            mark_delivered: MARK_DELIVERED,
            mark_failed: MARK_FAILED,
            release: RELEASE,
            defer: DEFER,
            replay_ids: REPLAY_IDS,
            replay_ids_dry: REPLAY_IDS_DRY,
            replay_filter: REPLAY_FILTER,
            replay_filter_dry: REPLAY_FILTER_DRY,
            unarchive_filter: UNARCHIVE_FILTER,
            unarchive_filter_dry: UNARCHIVE_FILTER_DRY,
            delete_unarchived: DELETE_UNARCHIVED,
            replay_set_delivered_to: REPLAY_SET_DELIVERED_TO,
            history_failed: HISTORY_FAILED,
            history_lease_expired: HISTORY_LEASE_EXPIRED,
            history_replayed: HISTORY_REPLAYED,
            history_prune: HISTORY_PRUNE,
            history: HISTORY,
            archived_event_ids: ARCHIVED_EVENT_IDS,
            control_select: CONTROL_SELECT,
            control_delete: CONTROL_DELETE,
            control_insert: CONTROL_INSERT,
            control_log_insert: CONTROL_LOG_INSERT,
            control_log_select: CONTROL_LOG_SELECT,
            relay_update: RELAY_UPDATE,
            relay_insert: RELAY_INSERT,
            relay_select: RELAY_SELECT,
            relay_forget: RELAY_FORGET,
            stuck_aggregates: STUCK_AGGREGATES,
            doctor_version: DOCTOR_VERSION,
            doctor_objects: DOCTOR_OBJECTS,
            create_migrations_table: CREATE_MIGRATIONS_TABLE,
            existing_tables: EXISTING_TABLES,
            forget_versions: FORGET_VERSIONS,
            applied_versions: APPLIED_VERSIONS,
            record_version: RECORD_VERSION,
        }
    };
}

/// A [`Dialect`]'s types and the constants every dialect takes from its
/// `sql` module under the same names (its statements, versions, indexes
/// and the aggregate index's DDL), invoked inside `impl Dialect for …`
/// of a crate whose `Own` struct holds its own rendered statements.
#[macro_export]
macro_rules! dialect_constants {
    (db: $db:ty, backend: $backend:literal, placeholders: $ph:ident, begin_write: $begin:expr) => {
        type DB = $db;
        type Own = Own;
        const BACKEND: &'static str = $backend;
        const PLACEHOLDERS: $crate::Placeholders = $crate::Placeholders::$ph;
        const BEGIN_WRITE: Option<&'static str> = $begin;
        const STATEMENTS: $crate::Statements = sql::STATEMENTS;
        const MIGRATIONS: &'static [$crate::Migration] = sql::MIGRATIONS;
        const EXTRA_INDEXES: &'static [&'static str] = sql::INDEXES;
        const CREATE_AGGREGATE_INDEX: &'static [&'static str] = sql::CREATE_AGGREGATE_INDEX;
        const DROP_AGGREGATE_INDEX: &'static str = sql::DROP_AGGREGATE_INDEX;
        const ID_LIST: &'static str = sql::ID_LIST;
        const INSERT_IGNORE: (&'static str, &'static str) = sql::INSERT_IGNORE;
    };
}

/// A dialect's claim statements in the order [`ClaimStatements::render`]
/// takes them, from the constants `CLAIM_PENDING`, `CLAIM_DUE_RETRIES`,
/// `CLAIM_PENDING_ORDERED`, `CLAIM_DUE_RETRIES_ORDERED` and
/// `CLAIM_EXPIRED_LEASES` of the module it is invoked in.
#[macro_export]
macro_rules! claims {
    () => {
        [
            CLAIM_PENDING,
            CLAIM_DUE_RETRIES,
            CLAIM_PENDING_ORDERED,
            CLAIM_DUE_RETRIES_ORDERED,
            CLAIM_EXPIRED_LEASES,
        ]
    };
}

/// The due claims of a dialect whose claim statement is
/// `$claim!(from, pick, order)`, whose clock is `$now` (due retries:
/// retryable rows whose `next_retry_at_ms` is past it), whose tenant and
/// limit parameters are `$app` and `$limit`, and whose head index is
/// `head: …` (see [`head_of_aggregate!`]): `CLAIM_DUE_RETRIES`, its
/// per-aggregate variant and, where the database has partial indexes, the
/// per-aggregate pending claim (`fair:` the dialect's form of
/// [`fair_pending!`]), defined in the module it is invoked in; `order` is
/// the order of the claim index (`next_retry_at_ms`, then id, except on
/// MySQL, whose one index has the event type in between). The plain
/// pending claim (`CLAIM_PENDING`) is each dialect's own: it deals the
/// batch across event types ([`fair_pending!`]). Every claim reads in the
/// order `next_retry_at_ms, id`: due retries by when they fell due, pending
/// rows of a type (whose `next_retry_at_ms` is always 0) in insertion
/// order. Ordering pending rows by `next_retry_at_ms` first is what keeps
/// PostgreSQL on the pending index: `ORDER BY id` alone is also the
/// primary key's order, and after `ANALYZE` of an all-pending backlog the
/// planner reads the primary key, filtering out every row delivered since
/// on each claim (57 ms instead of 0.6 ms per claim halfway through
/// 100,000 rows). The index each reads is named beside the dialect's
/// invocation.
#[macro_export]
macro_rules! claims_in_retry_order {
    ($claim:ident, now: $now:expr, app: $app:literal, limit: $limit:literal, batch: $batch:literal, skip: $skip:literal, head: partial, fair: $fair:ident) => {
        $crate::claims_in_retry_order!($claim, now: $now, head: partial, order: "next_retry_at_ms, id");

        /// [`CLAIM_PENDING`] for `ordering = "per_aggregate"`: only heads
        /// of aggregates, among the candidates of
        /// `postbox_sqlx::head_candidates!`, but for the paused types'
        /// (a paused head still holds its aggregate back).
        pub(crate) const CLAIM_PENDING_ORDERED: &str = $claim!(
            "{table} c",
            concat!(
                "status = 'pending' AND c.event_type", $skip, " AND ",
                $crate::id_among!(c, $fair, $crate::head_candidates!(app: $app, limit: $limit, skip: $skip, fair: $fair))
            ),
            "next_retry_at_ms, id"
        );

        /// [`CLAIM_PENDING_ORDERED`] once more, after it came back short
        /// (`$limit` the rows still wanted, `$batch` the batch size): from
        /// `postbox_sqlx::deep_candidates!`, reading past the followers of
        /// held aggregates.
        pub(crate) const CLAIM_PENDING_ORDERED_DEEP: &str = $claim!(
            "{table} c",
            concat!(
                "status = 'pending' AND c.event_type", $skip, " AND ",
                $crate::id_among!(c, $fair, $crate::deep_candidates!(app: $app, batch: $batch, take: $limit, skip: $skip, fair: $fair))
            ),
            "next_retry_at_ms, id"
        );
    };
    ($claim:ident, now: $now:expr, head: $head:tt, order: $order:literal) => {
        /// Claim retryable rows that are due.
        pub(crate) const CLAIM_DUE_RETRIES: &str = $claim!(
            "{table}",
            concat!("status = 'retryable' AND next_retry_at_ms <= ", $now),
            $order
        );

        /// [`CLAIM_DUE_RETRIES`] for `ordering = "per_aggregate"`: only
        /// heads of aggregates (a due retry nearly always is one: the
        /// retries due are few, and each is checked by one index probe).
        pub(crate) const CLAIM_DUE_RETRIES_ORDERED: &str = $claim!(
            "{table} c",
            concat!(
                "status = 'retryable' AND next_retry_at_ms <= ",
                $now,
                $crate::head_of_aggregate!(c, head: $head)
            ),
            $order
        );
    };
}

/// `$c.id` is one of the ids `$list` (a subquery) selects, for the
/// dialect whose [`fair_pending!`] form is given: on PostgreSQL
/// (`lateral`) as `= ANY(ARRAY(…))`, so each is found by primary key (as
/// `IN (…)` the planner hashes the candidates and scans the whole table
/// when its estimate of them is large); elsewhere `IN (…)`.
#[macro_export]
macro_rules! id_among {
    ($c:ident, lateral, $list:expr) => {
        concat!(stringify!($c), ".id = ANY(ARRAY(", $list, "))")
    };
    ($c:ident, in_list, $list:expr) => {
        concat!(stringify!($c), ".id IN (", $list, ")")
    };
}

/// The event types tenant `$app` has pending rows of, as the recursive
/// common table `types (t)` (its last row is NULL): a loose index scan
/// over `{table}_pending_idx (app_code, event_type, next_retry_at_ms, id)
/// WHERE status = 'pending'` ([`V8_PENDING_INDEX`]), one probe per type
/// however long each type's backlog.
#[macro_export]
macro_rules! pending_types {
    (app: $app:literal) => {
        concat!(
            "types (t) AS (SELECT (SELECT p.event_type FROM {table} p WHERE p.app_code = ",
            $app,
            " AND p.status = 'pending' ORDER BY p.event_type LIMIT 1) \
             UNION ALL SELECT (SELECT p.event_type FROM {table} p WHERE p.app_code = ",
            $app,
            " AND p.status = 'pending' AND p.event_type > types.t ORDER BY p.event_type LIMIT 1) \
             FROM types WHERE types.t IS NOT NULL)"
        )
    };
}

/// Fair claiming across event types (README: "Fair claiming"): the
/// pending rows a claim of tenant `$app` takes, as common tables ending in
/// `fair (fid, rn, t)` (for a `WITH RECURSIVE`): each pending type's oldest
/// `$limit` rows, `rn` their rank within the type and `t` the type, the
/// first `$take` by `(rn, id)`. So a batch is dealt round-robin: every
/// type with pending rows gets an equal
/// share, a type with fewer rows leaves the rest of its share to the
/// others, and a lone type gets the whole batch in insertion order. A
/// flood of one type therefore never holds back another type's fresh
/// event by more than one batch. Each type's rows are read through
/// `{table}_pending_idx` in its order (`next_retry_at_ms`, always 0 for a
/// pending row, then id): at most `$limit` entries per pending type,
/// whatever the backlog. `lateral` reads them with `LATERAL` (PostgreSQL);
/// `in_list` with a correlated `IN (… LIMIT)` (SQLite). `$skip` follows
/// the type in a predicate that is false for the event types paused by a
/// runtime control (`ClaimRequest::skip_types`, one parameter): their rows
/// are not dealt, and cost one probe of the type scan.
#[macro_export]
macro_rules! fair_pending {
    (app: $app:literal, limit: $limit:literal, take: $take:literal, skip: $skip:literal, lateral) => {
        $crate::fair_pending!(@lateral app: $app, take: $take, skip: $skip, rows: concat!(
            "(SELECT p.id, p.next_retry_at_ms FROM {table} p WHERE p.app_code = ", $app,
            " AND p.status = 'pending' AND p.event_type = types.t \
              ORDER BY p.next_retry_at_ms, p.id LIMIT ", $limit, ")"
        ))
    };
    (app: $app:literal, limit: $limit:literal, take: $take:literal, skip: $skip:literal, lateral, heads) => {
        $crate::fair_pending!(@lateral app: $app, take: $take, skip: $skip,
            rows: $crate::fair_pending!(@heads app: $app, limit: $limit, of: "types.t"))
    };
    (app: $app:literal, limit: $limit:literal, take: $take:literal, skip: $skip:literal, in_list) => {
        $crate::fair_pending!(@in_list app: $app, take: $take, skip: $skip, ids: concat!(
            "SELECT q.id FROM {table} q WHERE q.app_code = ", $app,
            " AND q.status = 'pending' AND q.event_type = types.t \
              ORDER BY q.next_retry_at_ms, q.id LIMIT ", $limit
        ))
    };
    (app: $app:literal, limit: $limit:literal, take: $take:literal, skip: $skip:literal, in_list, heads) => {
        $crate::fair_pending!(@in_list app: $app, take: $take, skip: $skip, ids: concat!(
            "SELECT s.id FROM ", $crate::fair_pending!(@heads app: $app, limit: $limit, of: "types.t"), " s"
        ))
    };
    // Deals `rows` (each type's rows, `id, next_retry_at_ms` in claim
    // order) read with `LATERAL`.
    (@lateral app: $app:literal, take: $take:literal, skip: $skip:literal, rows: $rows:expr) => {
        concat!(
            $crate::pending_types!(app: $app),
            ", fair (fid, rn, t) AS (SELECT k.id, k.rn, types.t FROM types CROSS JOIN LATERAL \
               (SELECT s.id, row_number() OVER (ORDER BY s.next_retry_at_ms, s.id) AS rn FROM ",
            $rows,
            " s) k \
             WHERE types.t IS NOT NULL AND types.t", $skip, " ORDER BY k.rn, k.id LIMIT ", $take, ")"
        )
    };
    // Deals `ids` (a select of each type's ids) read with `IN`.
    (@in_list app: $app:literal, take: $take:literal, skip: $skip:literal, ids: $ids:expr) => {
        concat!(
            $crate::pending_types!(app: $app),
            ", fair (fid, rn, t) AS (SELECT p.id, row_number() OVER \
               (PARTITION BY p.event_type ORDER BY p.next_retry_at_ms, p.id) AS r, p.event_type \
             FROM types JOIN {table} p ON p.id IN (",
            $ids,
            ") WHERE types.t IS NOT NULL AND types.t", $skip, " ORDER BY r, p.id LIMIT ", $take, ")"
        )
    };
    // One type's oldest `$limit` pending rows that are heads or have no
    // aggregate, among its oldest `follower_scan!()` × `$limit`.
    (@heads app: $app:literal, limit: $limit:literal, of: $type:literal) => {
        concat!(
            "(SELECT w.id, w.next_retry_at_ms FROM (SELECT q.id, q.next_retry_at_ms, q.aggregate_id \
               FROM {table} q WHERE q.app_code = ", $app, " AND q.status = 'pending' AND q.event_type = ", $type,
            " ORDER BY q.next_retry_at_ms, q.id LIMIT ", $crate::follower_scan!(), " * ", $limit, ") w \
             WHERE w.aggregate_id IS NULL OR w.id = ",
            $crate::first_open_of!($app, "w.aggregate_id", head: partial),
            " ORDER BY w.next_retry_at_ms, w.id LIMIT ", $limit, ")"
        )
    };
}

/// The head index where the database has partial and expression indexes
/// (PostgreSQL, SQLite): `{table}_head_idx (app_code, aggregate_id,
/// COALESCE(aggregate_version, 9223372036854775807), id)` over rows with an
/// aggregate that are pending, delivering or retryable ([`V7_HEAD_INDEX`]):
/// its key column (`key`), the predicate that restricts a probe `p` to the
/// index's rows (`open`), and the order of an aggregate's events (`seq`),
/// as literals (see [`head_of_aggregate!`]).
#[macro_export]
macro_rules! partial_head {
    (key) => {
        "aggregate_id"
    };
    (open) => {
        " AND p.status IN ('pending', 'delivering', 'retryable')"
    };
    (seq) => {
        "COALESCE(p.aggregate_version, 9223372036854775807)"
    };
}

/// The rows the expired-lease claim takes over, on the clock `$now`:
/// delivering rows whose lease ended. A claim sets `next_retry_at_ms` to
/// the lease end (what the index is ordered by); `lock_until_ms` (the
/// fence) is checked too, for rows claimed before schema version 5, whose
/// `next_retry_at_ms` is not their lease end.
#[macro_export]
macro_rules! expired_lease_pick {
    ($now:expr) => {
        concat!(
            "status = 'delivering' AND next_retry_at_ms <= ",
            $now,
            " AND lock_until_ms <= ",
            $now
        )
    };
}

/// Columns read back into an `EventRecord` (by name), in the order every
/// dialect's statements list them.
#[macro_export]
macro_rules! columns {
    () => {
        "id, app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers, \
         status, retry_count, next_retry_at_ms, lock_until_ms, worker_id, last_error, \
         delivered_to, replay_count, created_at_ms, updated_at_ms"
    };
}

/// `$c` is the head of its aggregate: the first of the aggregate's events
/// that are still pending, delivering or retryable (`failed` ones do not
/// hold the aggregate back). First is in one total order, the same on
/// every backend: by `aggregate_version` with NULL placed after every
/// version, then by `id` (SPEC: ordering). It must be total: falling back
/// to `id` only when a version is NULL is not transitive, and an aggregate
/// mixing both could have no head at all.
///
/// The dialect's head index (`head: (key, open, seq, hint)`, or `head:
/// partial` for [`partial_head!`]'s) holds exactly
/// those events, keyed `(app_code, key, seq, id)` where `key` is the
/// aggregate (NULL for the others) and `seq` the version with NULL last;
/// `open` restricts a probe `p` to the index's rows and `hint` names it
/// where the planner would pick another. So the head is the first entry
/// under `(app_code, aggregate)`: one probe, however many events the
/// aggregate holds open and however long its delivered history (the check
/// it replaces read every earlier event of the aggregate through an index
/// over all rows, delivered ones included: 9.4 s per claim on MariaDB at
/// 26,000 pending rows in 100 rooms).
#[macro_export]
macro_rules! head_of_aggregate {
    ($c:ident, head: $head:tt) => {
        concat!(
            " AND (", stringify!($c), ".aggregate_id IS NULL OR ", stringify!($c), ".id = ",
            $crate::first_open_of!(concat!(stringify!($c), ".app_code"), concat!(stringify!($c), ".aggregate_id"),
                head: $head),
            ") "
        )
    };
}

/// The id of the head event of aggregate `$agg` of tenant `$app`, through
/// the head index (see [`head_of_aggregate!`]), as a scalar subquery.
#[macro_export]
macro_rules! first_open_of {
    ($app:expr, $agg:expr, head: partial) => {
        $crate::first_open_of!($app, $agg, head: (
            $crate::partial_head!(key), $crate::partial_head!(open), $crate::partial_head!(seq), ""
        ))
    };
    ($app:expr, $agg:expr, head: ($key:expr, $open:expr, $seq:expr, $hint:expr)) => {
        concat!(
            "(SELECT p.id FROM {table} p ", $hint, " WHERE p.app_code = ", $app, " AND p.", $key, " = ", $agg,
            $open, " ORDER BY ", $seq, ", p.id LIMIT 1)"
        )
    };
}

/// The ids a per-aggregate pending claim chooses from (the claim keeps
/// the pending ones, in claim order), as a subquery for tenant `$app` and
/// batch size `$limit`, where the database has partial indexes
/// (PostgreSQL, SQLite; MySQL's form is its `CLAIM_PENDING_ORDERED`):
///
/// 1. the heads of aggregates with open events, in key order, found by a
///    loose index scan over the head index (a recursive query: one probe
///    per aggregate to find the next, one to read its head, one to see
///    whether the head can be claimed), until 2 × `$limit` heads that can
///    be claimed (pending, of a type not paused) are found, or
///    [`held_scan!`] × `$limit` aggregates are passed;
/// 2. of the `$limit` pending rows a plain claim would take
///    ([`fair_pending!`], `$fair` its form), those that are heads (or have
///    no aggregate). When the claim comes back short, the dialect claims
///    again from [`deep_candidates!`], which reads past followers.
///
/// Neither reads the backlog behind an aggregate's head: a claim costs
/// about 3 × `$limit` index probes when heads can go, whatever the
/// backlog. The plain head check over the pending index read every pending
/// row when there were fewer aggregates than the batch (a room service:
/// 100 rooms), or when the heads were in flight (the next claim runs while
/// a batch publishes): 252 ms per claim that found nothing at 26,000
/// pending rows in 100 aggregates on PostgreSQL, 13 ms now. (1) passes
/// over aggregates whose head cannot go (in flight, waiting for a retry,
/// of a paused type): counting them toward its 2 × `$limit` made an
/// aggregate past the first 2 × `$limit` held ones wait as long as they
/// were held, however long a paused type stayed paused, when their
/// followers were also the oldest pending rows (2). (2) keeps the claim
/// in age order when there are many aggregates, each with a few events.
///
/// The scan's columns: `a` the aggregate, `h` the head of the one before
/// (found as the scan moves on), `n` aggregates passed, `k` heads that can
/// be claimed among those before `h`'s.
#[macro_export]
macro_rules! head_candidates {
    (app: $app:literal, limit: $limit:literal, skip: $skip:literal, fair: $fair:ident) => {
        concat!(
            "WITH RECURSIVE aggs (a, h, n, k) AS (SELECT (SELECT p.aggregate_id FROM {table} p \
               WHERE p.app_code = ", $app, " AND p.aggregate_id IS NOT NULL", $crate::partial_head!(open),
            " ORDER BY p.aggregate_id LIMIT 1), CAST(NULL AS BIGINT), 1, CAST(0 AS BIGINT) \
             UNION ALL SELECT (SELECT p.aggregate_id FROM {table} p \
               WHERE p.app_code = ", $app, " AND p.aggregate_id > aggs.a", $crate::partial_head!(open),
            " ORDER BY p.aggregate_id LIMIT 1), ",
            $crate::first_open_of!($app, "aggs.a", head: partial),
            ", aggs.n + 1, aggs.k + (SELECT COUNT(*) FROM {table} q WHERE q.id = aggs.h \
               AND q.status = 'pending' AND q.event_type", $skip, ") \
             FROM aggs WHERE aggs.a IS NOT NULL AND aggs.k < 2 * ", $limit,
            " AND aggs.n < ", $crate::held_scan!(), " * ", $limit, "), ",
            $crate::fair_pending!(app: $app, limit: $limit, take: $limit, skip: $skip, $fair),
            " SELECT aggs.h FROM aggs WHERE aggs.h IS NOT NULL \
             UNION ALL SELECT f.fid FROM fair f WHERE COALESCE(f.fid = ",
            $crate::first_open_of!($app, "(SELECT o.aggregate_id FROM {table} o WHERE o.id = f.fid)", head: partial),
            ", TRUE)"
        )
    };
}

/// How many batches' worth of each type's oldest pending rows a
/// per-aggregate claim that came back short reads for heads and events
/// without an aggregate ([`deep_candidates!`]; MySQL's `FOLLOWER_SCAN`).
/// Followers of held aggregates come first while their heads publish (the
/// next claim runs beside the batch in flight), retry or are paused: an
/// event without an aggregate behind more of them than this waits until
/// they move. Each row read costs a heap read and a head probe: at 20,000
/// pending rows in 100 aggregates whose heads are in flight, a batch of
/// 500 reads about 2,400 rows at 2 (8,400 at 8).
#[macro_export]
macro_rules! follower_scan {
    () => {
        "2"
    };
}

/// The ids a per-aggregate pending claim that came back short takes from
/// next (for tenant `$app`, batch size `$batch`, `$take` rows still
/// wanted, where the database has partial indexes): the `$take` pending
/// rows a plain claim would take,
/// counting only heads and events without an aggregate, read among each
/// type's oldest [`follower_scan!`] × `$batch` pending rows. When the
/// followers of held aggregates (heads in flight, retrying, of a paused
/// type) are a type's oldest rows, [`head_candidates!`] finds none of that
/// type to claim, and an event without an aggregate behind them waited as
/// long as they were held (the whole of a pause). Each row read costs a
/// heap read and a head probe, which is why this runs only after a claim
/// that came back short, never on one that filled its batch.
#[macro_export]
macro_rules! deep_candidates {
    (app: $app:literal, batch: $batch:literal, take: $take:literal, skip: $skip:literal, fair: $fair:ident) => {
        concat!(
            "WITH RECURSIVE ",
            $crate::fair_pending!(app: $app, limit: $batch, take: $take, skip: $skip, $fair, heads),
            " SELECT f.fid FROM fair f"
        )
    };
}

/// How many batches' worth of aggregates a per-aggregate claim passes
/// over looking for heads that can go ([`head_candidates!`]; MySQL's
/// `HELD_SCAN`): past 8 × the batch size of held aggregates in key order
/// (800 at the default batch of 100), those after them wait until some
/// move. Each one passed costs three index probes, on every claim while
/// they are held (2,400 at the default batch: a few ms).
#[macro_export]
macro_rules! held_scan {
    () => {
        "8"
    };
}

/// The start of a replay update. Fanout progress: a `delivered` row is
/// sent to every publisher again (backtracking), any other keeps the
/// publishers that confirmed it, so only the others get it. (First in the
/// SET list: it reads the old status.) `$hint`: what follows the table
/// name (SQLite's `INDEXED BY …`).
#[macro_export]
macro_rules! replay_set {
    () => {
        $crate::replay_set!("")
    };
    ($hint:expr) => {
        concat!(
            "UPDATE {table}",
            $hint,
            " SET delivered_to = CASE WHEN status IN ('delivered', 'published') \
               THEN NULL ELSE delivered_to END, "
        )
    };
}

/// The start of every history write (`INSERT … SELECT` from the outbox
/// row, so the entry is keyed by the row's `(app_code, event_id)`): the
/// dialect appends its clock, the entry's values and the rows
/// (`history_insert!(now_ms!(), ", 'kind', … FROM {table} WHERE …")`).
/// `{table}_history` is keyed by `(app_code, event_id)`, not by the outbox
/// row's id, so an event's history outlives archiving. Every write runs in
/// the transaction of the state change it records.
#[macro_export]
macro_rules! history_insert {
    () => {
        "INSERT INTO {table}_history (app_code, event_id, at_ms, kind, attempt, publisher, detail) \
     SELECT app_code, event_id, "
    };
    ($now:expr, $rest:literal) => {
        concat!($crate::history_insert!(), $now, $rest)
    };
}

/// Oldest pending row, due retries and the clock, for one tenant (`$p`,
/// read twice), as `oldest_pending_ms, retryable_due, now_ms`; `$now` is
/// the dialect's clock expression and `$oldest` the id of the tenant's
/// oldest pending row, as a scalar subquery (where the database has partial
/// indexes, [`oldest_pending!`]): one index entry per pending event type
/// however long the backlog. Due retries are counted over the retryable
/// rows' index range that is due.
#[macro_export]
macro_rules! backlog {
    ($p:literal, $now:expr, oldest: $oldest:expr) => {
        concat!(
            "SELECT (SELECT created_at_ms FROM {table} WHERE id = ",
            $oldest,
            ") AS oldest_pending_ms, \
               (SELECT COUNT(*) FROM {table} WHERE app_code = ",
            $p,
            " AND status = 'retryable' \
                  AND next_retry_at_ms <= ",
            $now,
            ") AS retryable_due, ",
            $now,
            " AS now_ms"
        )
    };
}

/// The id of tenant `$p`'s oldest pending row where the database has
/// partial indexes: the first of each pending type's entries in
/// `{table}_pending_idx` ([`pending_types!`]), the lowest of them.
#[macro_export]
macro_rules! oldest_pending {
    ($p:literal) => {
        concat!(
            "(WITH RECURSIVE ",
            $crate::pending_types!(app: $p),
            " SELECT MIN((SELECT p.id FROM {table} p WHERE p.app_code = ",
            $p,
            " AND p.status = 'pending' AND p.event_type = types.t \
               ORDER BY p.next_retry_at_ms, p.id LIMIT 1)) FROM types WHERE types.t IS NOT NULL)"
        )
    };
}

pub use postbox_core::store::DELIVERED_COUNT_CAP;

/// Counts of one tenant's rows (`$p`, read five times): `pending`,
/// `delivering`, `retryable`, `failed`, each through the index of that
/// status, and `delivered`, counted up to [`DELIVERED_COUNT_CAP`] + 1
/// (more means "estimate instead"). Never a read of all delivered rows.
#[macro_export]
macro_rules! count_open {
    ($p:literal) => {
        concat!(
            "SELECT ",
            $crate::count_open!(@ $p, "pending"),
            ", ",
            $crate::count_open!(@ $p, "delivering"),
            ", ",
            $crate::count_open!(@ $p, "retryable"),
            ", ",
            $crate::count_open!(@ $p, "failed"),
            ", (SELECT COUNT(*) FROM (SELECT 1 FROM {table} WHERE app_code = ",
            $p,
            " AND status IN ('delivered', 'published', 'dropped') AND status <> 'dropped' LIMIT 25001) d) AS delivered, \
             (SELECT COUNT(*) FROM (SELECT 1 FROM {table} WHERE app_code = ",
            $p,
            " AND status IN ('delivered', 'published', 'dropped') AND status = 'dropped' LIMIT 25001) x) AS dropped"
        )
    };
    (@ $p:literal, $status:literal) => {
        concat!(
            "(SELECT COUNT(*) FROM {table} WHERE app_code = ",
            $p,
            " AND status = '",
            $status,
            "') AS ",
            $status
        )
    };
}

/// The description of schema version 5 in every dialect's ledger.
pub const V5_DESCRIPTION: &str =
    "index per status (claims, archive, counts) in place of indexes over every row";

/// The description of schema version 6 in the ledger of every dialect
/// with partial indexes.
pub const V6_DESCRIPTION: &str =
    "pending index in the pending claim's order (app_code, next_retry_at_ms, id)";

/// Version 6 where the database has partial indexes (PostgreSQL, SQLite):
/// `_pending_idx` becomes `(app_code, next_retry_at_ms, id) WHERE status =
/// 'pending'`, the order every claim reads ([`claims_in_retry_order!`]).
/// With `(app_code, id)`, the pending claim's `ORDER BY id` was also the
/// primary key's order, and PostgreSQL read the primary key whenever its
/// statistics said most rows were pending (a backlog analysed before it
/// drained): each claim then filtered out every row delivered since. The
/// primary key cannot give `next_retry_at_ms, id`, so the plan stays on
/// this index whatever the statistics say. Pending rows all have
/// `next_retry_at_ms = 0`: the order is still insertion order.
pub const V6_PENDING_INDEX: &[&str] = &[
    "DROP INDEX IF EXISTS {table}_pending_idx",
    "CREATE INDEX {table}_pending_idx ON {table} (app_code, next_retry_at_ms, id) \
       WHERE status = 'pending'",
];

/// The description of schema version 8 in every dialect's ledger.
pub const V8_DESCRIPTION: &str =
    "pending rows indexed by event type, so a claim deals its batch across types";

/// Version 8 where the database has partial indexes (PostgreSQL, SQLite):
/// `_pending_idx` becomes `(app_code, event_type, next_retry_at_ms, id)
/// WHERE status = 'pending'`. The pending claim reads each pending type's
/// oldest rows ([`fair_pending!`]), so one type's flood cannot starve the
/// others; the index holds the same rows as before, one key column wider,
/// and costs the same writes. Within a type the order is still
/// `next_retry_at_ms` (0 for every pending row), then id, which the primary
/// key cannot give (see [`V6_PENDING_INDEX`]).
pub const V8_PENDING_INDEX: &[&str] = &[
    "DROP INDEX IF EXISTS {table}_pending_idx",
    "CREATE INDEX {table}_pending_idx ON {table} (app_code, event_type, next_retry_at_ms, id) \
       WHERE status = 'pending'",
];

/// The description of schema version 7 in the ledger of every dialect.
pub const V7_DESCRIPTION: &str =
    "head index: an aggregate's open events in its order (app_code, aggregate, version, id)";

/// Version 7 where the database has partial and expression indexes
/// (PostgreSQL, SQLite): `_open_aggregate_idx (app_code, aggregate_id, id)`
/// becomes `_head_idx`, keyed in the aggregate's order (the version, NULL
/// last, then id), so an aggregate's head is its first entry
/// ([`head_of_aggregate!`]). Same rows, same write cost.
pub const V7_HEAD_INDEX: &[&str] = &[
    "CREATE INDEX IF NOT EXISTS {table}_head_idx ON {table} \
       (app_code, aggregate_id, (COALESCE(aggregate_version, 9223372036854775807)), id) \
       WHERE aggregate_id IS NOT NULL AND status IN ('pending', 'delivering', 'retryable')",
    "DROP INDEX IF EXISTS {table}_open_aggregate_idx",
];

/// `list` without its predicates: [`crate::list_query`] appends only the
/// filters given, then `ORDER BY id DESC LIMIT`. Indexes: the primary key
/// (no filter, or a status most rows have), the per-status indexes of the
/// dialect for a tenant and a rare status (e.g. the dashboard's failed
/// list), the status written as a literal so that a partial index matches.
#[macro_export]
macro_rules! list_select {
    () => {
        concat!("SELECT ", $crate::columns!(), " FROM {table}")
    };
}

/// History of rows just taken over after their lease expired (the claim
/// already counted the attempt and wrote `last_error`); `$rows`: the
/// dialect's predicate on the ids it binds first.
#[macro_export]
macro_rules! history_lease_expired {
    ($now:expr, $rows:literal) => {
        concat!(
            $crate::history_insert!(),
            $now,
            ", 'lease_expired', retry_count, NULL, last_error FROM {table} WHERE ",
            $rows
        )
    };
}

/// History of rows just replayed: binds the ids (`$rows`, the dialect's
/// predicate on them), the origin (`$origin`, written as `detail`) and
/// the targets (`$to`, written as `publisher`).
#[macro_export]
macro_rules! history_replayed {
    ($now:expr, $to:literal, $origin:literal, $rows:literal) => {
        concat!(
            $crate::history_insert!(),
            $now,
            ", 'replayed', 0, ",
            $to,
            ", ",
            $origin,
            " FROM {table} WHERE ",
            $rows
        )
    };
}

/// A dialect's three history writes, defined in the module it is invoked
/// in, on its clock `$now`: `HISTORY_FAILED` (one failed attempt: the
/// values after `app_code, event_id, at_ms` and the row, `$failed`),
/// `HISTORY_LEASE_EXPIRED` ([`history_lease_expired!`]) and
/// `HISTORY_REPLAYED` ([`history_replayed!`]), both of the rows whose ids
/// `$rows` reads (bound first).
#[macro_export]
macro_rules! history_writes {
    (
        $now:expr, rows: $rows:literal, origin: $origin:literal, targets: $to:literal,
        failed: $failed:literal
    ) => {
        /// Failed attempts of the rows just marked: their ids (list), then
        /// kind (`failed` or `dead_lettered`), attempt, publisher, error,
        /// worker_id (the marked rows hold it, unleased, at that attempt).
        pub(crate) const HISTORY_FAILED: &str = $crate::history_insert!($now, $failed);

        /// Rows a claim took over after their lease expired.
        pub(crate) const HISTORY_LEASE_EXPIRED: &str = $crate::history_lease_expired!($now, $rows);

        /// Rows a replay put back: the ids, the origin, the targets.
        pub(crate) const HISTORY_REPLAYED: &str =
            $crate::history_replayed!($now, $to, $origin, $rows);
    };
}

/// Rows of one event in `$from` (`"{table}"` or `"{archive}"`; the engine
/// sorts them by id): those of the app_codes `$app_codes` selects (a list,
/// bound first: every app_code with rows) and the event id `$p`. Index:
/// `<from>_event_uq (app_code, event_id)`, one probe per app_code (no index
/// on `event_id` alone: it would be written with every row version and serve
/// only this lookup).
#[macro_export]
macro_rules! find {
    ($from:literal, $app_codes:literal, $p:literal) => {
        concat!(
            "SELECT ",
            $crate::columns!(),
            " FROM ",
            $from,
            " WHERE ",
            $app_codes,
            " AND event_id = ",
            $p
        )
    };
}

/// A replay update up to its `WHERE`: back to pending with retry_count 0,
/// keeping event_id ([`replay_set!`] first); `$now` is the dialect's clock,
/// `$hint` what follows the table name.
#[macro_export]
macro_rules! replay_pending {
    ($now:expr) => {
        $crate::replay_pending!($now, "")
    };
    ($now:expr, $hint:expr) => {
        concat!(
            $crate::replay_set!($hint),
            "status = 'pending', retry_count = 0, next_retry_at_ms = 0, lock_until_ms = 0, \
               worker_id = NULL, replay_count = replay_count + 1, \
               updated_at_ms = ",
            $now,
            " "
        )
    };
}

/// Replay by filter where the database has `UPDATE … RETURNING`, on the
/// clock `$now`. `{filters}`: a predicate per given filter
/// ([`crate::filter_query`]), so the plan uses the index those lead (the
/// status is written as a literal, so a partial index per status matches).
#[macro_export]
macro_rules! replay_filter {
    ($now:expr) => {
        concat!(
            $crate::replay_pending!($now),
            "WHERE status <> 'delivering'{filters} \
             RETURNING ",
            $crate::columns!()
        )
    };
}

/// Rows a replay by filter would touch. `{filters}`: a predicate per
/// given filter ([`crate::filter_query`]), so the plan uses the index
/// those lead.
#[macro_export]
macro_rules! replay_filter_dry {
    () => {
        concat!(
            "SELECT ",
            $crate::columns!(),
            " FROM {table} \
             WHERE status <> 'delivering'{filters} ORDER BY id"
        )
    };
}

/// Archived rows brought back into the live table as pending (keeping id
/// and event_id), up to the clock `$now`; the dialect appends
/// ` FROM {archive} …`.
#[macro_export]
macro_rules! unarchive_insert {
    ($now:expr) => {
        concat!(
            "INSERT INTO {table} (id, app_code, event_id, event_type, aggregate_id, aggregate_version, payload, \
               headers, status, retry_count, next_retry_at_ms, lock_until_ms, replay_count, created_at_ms, updated_at_ms) \
             SELECT id, app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers, \
               'pending', 0, 0, 0, replay_count + 1, created_at_ms, ",
            $now
        )
    };
}

/// `STUCK_AGGREGATES` where the database has partial indexes (PostgreSQL,
/// SQLite): heads of aggregates held back for long (see
/// `OutboxStore::stuck_aggregates`), with the dialect's clock `$now` and
/// placeholders for app_code, age cut-off in ms, limit. Heads through
/// `{table}_retry_idx` and `{table}_lease_idx` (the two statuses a held-back
/// head has), siblings through `{table}_head_idx`.
#[macro_export]
#[rustfmt::skip] // rustfmt does not settle on `head_of_aggregate!`'s arguments
macro_rules! partial_stuck_aggregates {
    (now: $now:expr, $p1:literal, $p2:literal, $p3:literal) => {
        /// Heads of aggregates held back for long (`postbox_sqlx::partial_stuck_aggregates!`).
        pub(crate) const STUCK_AGGREGATES: &str = concat!(
            "SELECT c.aggregate_id, c.event_id, c.status, c.retry_count, c.last_error, (",
            $now,
            " - c.created_at_ms) AS age_ms, \
               (SELECT COUNT(*) FROM {table} w WHERE w.app_code = c.app_code \
                  AND w.aggregate_id = c.aggregate_id AND w.id <> c.id \
                  AND w.status IN ('pending', 'delivering', 'retryable')) AS waiting \
             FROM {table} c \
             WHERE c.app_code = ",
            $p1,
            " AND c.status IN ('retryable', 'delivering') \
               AND c.aggregate_id IS NOT NULL AND c.created_at_ms < ",
            $now,
            " - ",
            $p2,
            $crate::head_of_aggregate!(c, head: partial),
            " AND EXISTS (SELECT 1 FROM {table} w WHERE w.app_code = c.app_code \
                  AND w.aggregate_id = c.aggregate_id AND w.id <> c.id \
                  AND w.status IN ('pending', 'delivering', 'retryable')) \
             ORDER BY c.created_at_ms LIMIT ",
            $p3
        );
    };
}

/// The statements of the migration ledger `postbox_schema_migrations`
/// (one row per table and applied version), with the dialect's integer
/// type `$int`, table options `$options`, clock `$now` and placeholders:
/// `CREATE_MIGRATIONS_TABLE`, `FORGET_VERSIONS` (table), `APPLIED_VERSIONS`
/// (table) and `RECORD_VERSION` (table, version, description).
#[macro_export]
macro_rules! ledger_statements {
    (int: $int:literal, options: $options:literal, now: $now:expr, $p1:literal, $p2:literal, $p3:literal) => {
        pub(crate) const CREATE_MIGRATIONS_TABLE: &str = concat!(
            "CREATE TABLE IF NOT EXISTS postbox_schema_migrations ( \
               table_name VARCHAR(64) NOT NULL, version ",
            $int,
            " NOT NULL, description TEXT NOT NULL, \
               applied_at_ms BIGINT NOT NULL, PRIMARY KEY (table_name, version))",
            $options
        );
        pub(crate) const FORGET_VERSIONS: &str = concat!(
            "DELETE FROM postbox_schema_migrations WHERE table_name = ",
            $p1
        );
        pub(crate) const APPLIED_VERSIONS: &str = concat!(
            "SELECT version FROM postbox_schema_migrations WHERE table_name = ",
            $p1,
            " ORDER BY version"
        );
        pub(crate) const RECORD_VERSION: &str = concat!(
            "INSERT INTO postbox_schema_migrations (table_name, version, description, applied_at_ms) \
             VALUES (", $p1, ", ", $p2, ", ", $p3, ", ", $now, ")"
        );
    };
}

/// Version 3 where the database takes `CREATE INDEX IF NOT EXISTS`: the
/// index the admin API's lists read newest first per tenant and status
/// (keyset pagination by id).
pub const V3_LIST_INDEX: &[&str] =
    &["CREATE INDEX IF NOT EXISTS {table}_status_id_idx ON {table} (app_code, status, id)"];

/// Every outbox column after `id`, with types and defaults, for version 1's
/// DDL of the live table and its archive twin (SPEC §2): `$payload` is the
/// dialect's payload type, `$now` its clock in epoch milliseconds. The
/// defaults let any language write a row with a plain `INSERT` of the seven
/// event columns.
#[macro_export]
macro_rules! outbox_columns {
    (payload: $payload:literal, now: $now:expr) => {
        concat!(
            "app_code VARCHAR(64) NOT NULL, \
             event_id VARCHAR(64) NOT NULL, \
             event_type VARCHAR(128) NOT NULL, \
             aggregate_id VARCHAR(128), \
             aggregate_version BIGINT, \
             payload ",
            $payload,
            " NOT NULL, \
             headers TEXT, \
             status VARCHAR(16) NOT NULL DEFAULT 'pending', \
             retry_count INT NOT NULL DEFAULT 0, \
             next_retry_at_ms BIGINT NOT NULL DEFAULT 0, \
             lock_until_ms BIGINT NOT NULL DEFAULT 0, \
             worker_id VARCHAR(128), \
             last_error TEXT, \
             delivered_to TEXT, \
             replay_count INT NOT NULL DEFAULT 0, \
             created_at_ms BIGINT NOT NULL DEFAULT (",
            $now,
            "), updated_at_ms BIGINT NOT NULL DEFAULT (",
            $now,
            ")"
        )
    };
}

/// Version 2's statements where the database takes `CREATE INDEX IF NOT
/// EXISTS`: the bounded attempt history, keyed by event id so that it
/// survives archiving of the outbox row; `$id` is the dialect's generated
/// `id` column, `$int` its 32-bit integer type. Index:
/// `{table}_history_event_idx (event_id, app_code, id)`.
#[macro_export]
macro_rules! v2_history {
    ($id:literal, $int:literal) => {
        &[
            concat!(
                "CREATE TABLE IF NOT EXISTS {table}_history ( ",
                $id,
                ", app_code VARCHAR(64) NOT NULL, event_id VARCHAR(64) NOT NULL, \
                 at_ms BIGINT NOT NULL, kind VARCHAR(16) NOT NULL, attempt ",
                $int,
                " NOT NULL, publisher VARCHAR(512), detail TEXT)"
            ),
            "CREATE INDEX IF NOT EXISTS {table}_history_event_idx ON {table}_history (event_id, app_code, id)",
        ]
    };
}

/// Version 9: the runtime controls ([`postbox_core::control`]):
/// `{table}_controls`, one row per `(app_code, event_type)` key (`*` for
/// any), and `{table}_control_log`, every change with who made it. `$id`
/// is the dialect's auto-increment primary key.
#[macro_export]
macro_rules! v9_controls {
    ($id:literal) => {
        &[
            "CREATE TABLE IF NOT EXISTS {table}_controls ( \
               app_code VARCHAR(64) NOT NULL, event_type VARCHAR(128) NOT NULL, \
               paused INT NOT NULL DEFAULT 0, delivery VARCHAR(16), max_retry_count INT, \
               updated_at_ms BIGINT NOT NULL, updated_by VARCHAR(256) NOT NULL, \
               PRIMARY KEY (app_code, event_type))",
            concat!(
                "CREATE TABLE IF NOT EXISTS {table}_control_log ( ",
                $id,
                ", at_ms BIGINT NOT NULL, actor VARCHAR(256) NOT NULL, \
                 app_code VARCHAR(64) NOT NULL, event_type VARCHAR(128) NOT NULL, detail TEXT NOT NULL)"
            ),
        ]
    };
}

/// Version 10: the relay registry, `{table}_relays`: one row per relay
/// (`worker_id`), written by its heartbeat ([`relay_statements!`]) and read
/// by `postbox relays`, `GET /api/relays` and the dashboard. `$options`
/// follows the definition (MySQL's engine and charset).
#[macro_export]
macro_rules! v10_relays {
    ($options:literal) => {
        &[concat!(
            "CREATE TABLE IF NOT EXISTS {table}_relays ( \
               worker_id VARCHAR(128) NOT NULL PRIMARY KEY, host VARCHAR(256) NOT NULL, \
               pid BIGINT NOT NULL, app_codes TEXT NOT NULL, \
               claimed BIGINT NOT NULL, delivered BIGINT NOT NULL, failed BIGINT NOT NULL, \
               per_minute BIGINT NOT NULL, stopped_at_ms BIGINT, \
               started_at_ms BIGINT NOT NULL, seen_at_ms BIGINT NOT NULL)",
            $options
        )]
    };
}

/// Version 11's description: sampling (`sample_percent`) and the
/// `dropped` status, archived with the delivered rows.
pub const V11_DESCRIPTION: &str =
    "sampling: <table>_controls.sample_percent, dropped rows archived like delivered ones";

/// Version 11 where the database has partial indexes (PostgreSQL, SQLite):
/// `$add_column` adds `sample_percent` to `{table}_controls`, and
/// `{table}_done_idx` takes `dropped` rows too, so that `archive` moves
/// them with the delivered ones.
#[macro_export]
macro_rules! v11_sampling {
    ($add_column:literal) => {
        &[
            concat!(
                "ALTER TABLE {table}_controls ADD COLUMN ",
                $add_column,
                "sample_percent INT"
            ),
            "DROP INDEX IF EXISTS {table}_done_idx",
            "CREATE INDEX IF NOT EXISTS {table}_done_idx ON {table} (app_code, updated_at_ms, id) \
               WHERE status IN ('delivered', 'published', 'dropped')",
        ]
    };
}

/// [`v10_relays!`]'s description.
pub const V10_DESCRIPTION: &str = "relay registry (<table>_relays)";

/// The statements of the control plane, from one list of placeholders:
/// [`control_statements!`] (the first seven) and [`relay_statements!`].
#[macro_export]
#[rustfmt::skip]
macro_rules! control_plane_statements {
    (now: $now:expr, $p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $p6:literal, $p7:literal, $p8:literal, $p9:literal) => {
        $crate::control_statements!(now: $now, $p1, $p2, $p3, $p4, $p5, $p6, $p7);
        $crate::relay_statements!(now: $now, $p1, $p2, $p3, $p4, $p5, $p6, $p7, $p8, $p9);
    };
}

/// The statements of the relay registry ([`v10_relays!`]), with the
/// dialect's clock `$now` and placeholders `$p1` … `$p9`, each used once
/// and in that order: `RELAY_UPDATE` and `RELAY_INSERT` take host, pid,
/// app_codes, claimed, delivered, failed, per_minute, stopped (1 or 0),
/// worker_id (a heartbeat updates its row, and inserts it the first time);
/// `RELAY_SELECT` reads every row with the database clock; `RELAY_FORGET`
/// deletes rows not seen for `$p1` ms. The table holds a row per relay:
/// no index beyond its primary key.
#[macro_export]
macro_rules! relay_statements {
    (now: $now:expr, $p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $p6:literal, $p7:literal, $p8:literal, $p9:literal) => {
        /// One relay's heartbeat.
        pub(crate) const RELAY_UPDATE: &str = concat!(
            "UPDATE {table}_relays SET host = ", $p1, ", pid = ", $p2, ", app_codes = ", $p3,
            ", claimed = ", $p4, ", delivered = ", $p5, ", failed = ", $p6, ", per_minute = ", $p7,
            ", stopped_at_ms = CASE WHEN ", $p8, " = 1 THEN ", $now, " ELSE NULL END, seen_at_ms = ",
            $now, " WHERE worker_id = ", $p9
        );
        /// A relay's first heartbeat.
        pub(crate) const RELAY_INSERT: &str = concat!(
            "INSERT INTO {table}_relays (host, pid, app_codes, claimed, delivered, failed, per_minute, \
               stopped_at_ms, worker_id, started_at_ms, seen_at_ms) VALUES (",
            $p1, ", ", $p2, ", ", $p3, ", ", $p4, ", ", $p5, ", ", $p6, ", ", $p7,
            ", CASE WHEN ", $p8, " = 1 THEN ", $now, " ELSE NULL END, ", $p9, ", ", $now, ", ", $now, ")"
        );
        /// Every relay, the newest first, with the database clock.
        pub(crate) const RELAY_SELECT: &str = concat!(
            "SELECT worker_id, host, pid, app_codes, claimed, delivered, failed, per_minute, \
               stopped_at_ms, started_at_ms, seen_at_ms, ",
            $now,
            " AS now_ms FROM {table}_relays ORDER BY started_at_ms DESC, worker_id"
        );
        /// Forgets relays long gone.
        pub(crate) const RELAY_FORGET: &str = concat!(
            "DELETE FROM {table}_relays WHERE seen_at_ms < ", $now, " - ", $p1
        );
    };
}

/// [`v9_controls!`]'s description.
pub const V9_DESCRIPTION: &str =
    "runtime controls and their log (<table>_controls, <table>_control_log)";

/// The statements of the runtime controls, with the dialect's clock `$now`
/// and its placeholders (`$p1` … `$p7`): `CONTROL_SELECT` (every control),
/// `CONTROL_DELETE` (app_code, event_type), `CONTROL_INSERT` (app_code,
/// event_type, paused, delivery, max_retry_count, sample_percent,
/// updated_by),
/// `CONTROL_LOG_INSERT` (actor, app_code, event_type, detail) and
/// `CONTROL_LOG_SELECT` (limit; newest first). The tables are small: no
/// index beyond their primary keys.
#[macro_export]
macro_rules! control_statements {
    (now: $now:expr, $p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $p6:literal, $p7:literal) => {
        /// Every control.
        pub(crate) const CONTROL_SELECT: &str = "SELECT app_code, event_type, paused, delivery, \
            COALESCE(max_retry_count, -1) AS max_retry_count, \
            COALESCE(sample_percent, -1) AS sample_percent, updated_at_ms, updated_by \
            FROM {table}_controls ORDER BY app_code, event_type";
        /// Removes a control.
        pub(crate) const CONTROL_DELETE: &str = concat!(
            "DELETE FROM {table}_controls WHERE app_code = ", $p1, " AND event_type = ", $p2
        );
        /// Stores a control (after [`CONTROL_DELETE`], in one transaction).
        pub(crate) const CONTROL_INSERT: &str = concat!(
            "INSERT INTO {table}_controls (app_code, event_type, paused, delivery, max_retry_count, \
               sample_percent, updated_by, updated_at_ms) VALUES (", $p1, ", ", $p2, ", ", $p3, ", ", $p4,
            ", ", $p5, ", ", $p6, ", ", $p7, ", ", $now, ")"
        );
        /// Logs a change.
        pub(crate) const CONTROL_LOG_INSERT: &str = concat!(
            "INSERT INTO {table}_control_log (at_ms, actor, app_code, event_type, detail) VALUES (",
            $now, ", ", $p1, ", ", $p2, ", ", $p3, ", ", $p4, ")"
        );
        /// The newest changes.
        pub(crate) const CONTROL_LOG_SELECT: &str = concat!(
            "SELECT at_ms, actor, app_code, event_type, detail FROM {table}_control_log \
             ORDER BY id DESC LIMIT ", $p1
        );
    };
}

/// A dialect's [`Migration`]s from the constants `V1_SCHEMA`, `V2_HISTORY`
/// and `V3_LIST_INDEX` of the module it is invoked in: every database has
/// the same versions, each with its own DDL. Later versions follow as
/// `(version, description, statements)`; `partial_indexes;` lists those
/// PostgreSQL and SQLite share.
#[macro_export]
macro_rules! migrations {
    // PostgreSQL and SQLite: versions 5 to 10 with partial indexes, from
    // `V5_INDEXES`, `V9_CONTROLS` and `V10_RELAYS` of the invoking module; versions only
    // this database has, below 5, come first.
    (partial_indexes; $($before_v5:expr),* $(,)?) => {
        $crate::migrations!(
            $($before_v5,)*
            (5, $crate::V5_DESCRIPTION, V5_INDEXES),
            (6, $crate::V6_DESCRIPTION, $crate::V6_PENDING_INDEX),
            (7, $crate::V7_DESCRIPTION, $crate::V7_HEAD_INDEX),
            (8, $crate::V8_DESCRIPTION, $crate::V8_PENDING_INDEX),
            (9, $crate::V9_DESCRIPTION, V9_CONTROLS),
            (10, $crate::V10_DESCRIPTION, V10_RELAYS),
            (11, $crate::V11_DESCRIPTION, V11_SAMPLING),
        )
    };
    ($($more:expr),* $(,)?) => {
        &[
            (1, "outbox table, claim indexes, archive table", V1_SCHEMA),
            (2, "attempt history", V2_HISTORY),
            (3, "list index (app_code, status, id)", V3_LIST_INDEX),
            $($more,)*
        ]
    };
}

/// The claim queries and the index each is written for, where the
/// database has partial indexes ([`v5_partial_indexes!`]: PostgreSQL,
/// SQLite).
pub const PARTIAL_CLAIM_INDEXES: [ClaimIndex; 4] =
    claim_indexes(["_pending_idx", "_retry_idx", "_lease_idx", "_head_idx"]);

/// A claim query as `doctor` names it, what it claims, whether it is the
/// per-aggregate variant, and the index (suffix) it is written for.
pub type ClaimIndex = (&'static str, postbox_core::ClaimSource, bool, &'static str);

/// The claim queries as `doctor` names them, each with the index (suffix)
/// it is written for: `[pending, due retries, expired leases, per-aggregate
/// pending]`.
pub const fn claim_indexes([pending, due, lease, head]: [&'static str; 4]) -> [ClaimIndex; 4] {
    use postbox_core::ClaimSource::*;
    [
        ("claim_pending", Pending, false, pending),
        ("claim_due_retries", DueRetry, false, due),
        ("claim_expired_leases", ExpiredLease, false, lease),
        ("claim_pending_ordered", Pending, true, head),
    ]
}

/// The outbox table's index names (suffixes) of [`v5_partial_indexes!`],
/// then the dialect's own (`$more`).
#[macro_export]
macro_rules! partial_indexes {
    ($($more:literal),* $(,)?) => {
        &[
            "_pending_idx",
            "_retry_idx",
            "_lease_idx",
            "_failed_idx",
            "_done_idx",
            "_head_idx",
            $($more,)*
        ]
    };
}

/// The index the archive query reads where the database has partial
/// indexes.
pub const PARTIAL_ARCHIVE_INDEX: &str = "_done_idx";

/// Version 5 where the database has partial indexes (PostgreSQL, SQLite):
/// one index per status in place of the indexes over every row, followed
/// by the dialect's statements dropping those (`$drop`).
///
/// A row version is entered only into the indexes whose predicate it
/// meets, so each of the three writes an event costs (insert, claim,
/// mark) adds three index entries (primary key, `_event_uq`, the index of
/// its new status), as a table with a single claim index would, instead
/// of eight. On PostgreSQL, with `pg_current_wal_lsn()` around a drain of
/// 50,000 rows: 3,714 → 1,970 bytes of WAL per delivered event (a table
/// with only a primary key, a claim index and the unique event index:
/// 1,962).
///
/// `next_retry_at_ms` is the time a row is next looked at: a retryable
/// row's retry, a delivering row's lease end (the claim sets it with
/// `lock_until_ms`), and for a delivered or failed row the time it got
/// there. The indexes:
///
/// - `_pending_idx (app_code, id)` (`(app_code, next_retry_at_ms, id)`
///   since version 6, [`V6_PENDING_INDEX`]; `(app_code, event_type,
///   next_retry_at_ms, id)` since version 8, [`V8_PENDING_INDEX`]): the
///   pending claim, each type in insertion order; the idle probe; the
///   pending count;
/// - `_retry_idx (app_code, next_retry_at_ms, id)`: due retries;
/// - `_lease_idx (app_code, next_retry_at_ms, id)`: expired leases;
/// - `_failed_idx (app_code, id)`: the dead letters' list and count;
/// - `_done_idx (app_code, updated_at_ms, id)` over delivered (and legacy
///   `published`) rows: archive and the delivered-per-minute chart;
/// - `_open_aggregate_idx (app_code, aggregate_id, id)` over rows with an
///   aggregate not yet delivered: the per-aggregate head check (since
///   version 7 `_head_idx`, in the aggregate's order: [`V7_HEAD_INDEX`]).
///
/// Gone: `_claim_retry_idx`, `_claim_lease_idx`, `_status_updated_idx`,
/// `_aggregate_idx`, `_status_id_idx` (each replaced above) and
/// `_event_id_idx` (`events show` probes `_event_uq` once per app_code).
/// A statement's status is always a literal, so the planner can prove it
/// matches a partial index.
#[macro_export]
macro_rules! v5_partial_indexes {
    ($($drop:literal),* $(,)?) => {
        &[
            "CREATE INDEX IF NOT EXISTS {table}_pending_idx ON {table} (app_code, id) \
               WHERE status = 'pending'",
            "CREATE INDEX IF NOT EXISTS {table}_retry_idx ON {table} (app_code, next_retry_at_ms, id) \
               WHERE status = 'retryable'",
            "CREATE INDEX IF NOT EXISTS {table}_lease_idx ON {table} (app_code, next_retry_at_ms, id) \
               WHERE status = 'delivering'",
            "CREATE INDEX IF NOT EXISTS {table}_failed_idx ON {table} (app_code, id) \
               WHERE status = 'failed'",
            "CREATE INDEX IF NOT EXISTS {table}_done_idx ON {table} (app_code, updated_at_ms, id) \
               WHERE status IN ('delivered', 'published')",
            "CREATE INDEX IF NOT EXISTS {table}_open_aggregate_idx ON {table} (app_code, aggregate_id, id) \
               WHERE aggregate_id IS NOT NULL AND status IN ('pending', 'delivering', 'retryable')",
            $($drop,)*
        ]
    };
}

#[cfg(test)]
mod tests {
    /// `count_open!` counts delivered rows up to one past the cap, so the
    /// engine can tell "exactly the cap" from "more: estimate".
    #[test]
    fn count_open_reads_one_past_the_cap() {
        let sql = crate::count_open!("$1");
        let limit = format!("LIMIT {})", super::DELIVERED_COUNT_CAP + 1);
        assert!(sql.contains(&limit), "{sql}");
        // Each status is a literal, so a partial index for it matches.
        for status in ["'pending'", "'delivering'", "'retryable'", "'failed'"] {
            assert!(sql.contains(&format!("status = {status}")), "{sql}");
        }
    }
}
