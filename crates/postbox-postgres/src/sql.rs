//! Every statement the PostgreSQL backend runs. `{table}` is replaced by the
//! validated table name, `{archive}` by its archive twin, once per store.
//! The only other SQL assembled at run time is the predicates of `list`
//! (`postbox_sqlx::list_query`, one per given filter); values always travel
//! as parameters, id lists as one array (`= ANY($n)`). Each statement names
//! the index it relies on.

use postbox_sqlx::columns;
use postbox_sqlx::dialect::V3_LIST_INDEX;

/// The database clock in epoch milliseconds, fixed for one statement.
macro_rules! now_ms {
    () => {
        "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000)::BIGINT"
    };
}

/// Same columns, qualified by the alias `o`.
macro_rules! o_columns {
    () => {
        "o.id, o.app_code, o.event_id, o.event_type, o.aggregate_id, o.aggregate_version, o.payload, o.headers, \
         o.status, o.retry_count, o.next_retry_at_ms, o.lock_until_ms, o.worker_id, o.last_error, \
         o.delivered_to, o.replay_count, o.created_at_ms, o.updated_at_ms"
    };
}

pub(crate) const NOW_MS: &str = concat!("SELECT ", now_ms!());

/// Enqueue inside the caller's transaction. `ON CONFLICT DO NOTHING` keeps
/// the caller's transaction usable when the event id already exists; its
/// one arbiter is `{table}_event_uq` (not also the primary key, which a
/// generated id never meets).
pub(crate) const INSERT_EVENT: &str = "INSERT INTO {table} \
     (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers) \
     VALUES ($1, $2, $3, $4, $5, $6, $7) \
     ON CONFLICT (app_code, event_id) DO NOTHING \
     RETURNING id";

/// [`INSERT_EVENT`] on a partitioned table, whose `{table}_event_uq` is not
/// unique: the key trigger skips a duplicate (no row comes back either).
pub(crate) const INSERT_EVENT_PARTITIONED: &str = "INSERT INTO {table} \
     (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers) \
     VALUES ($1, $2, $3, $4, $5, $6, $7) \
     RETURNING id";

/// One claim: up to $2 rows of tenant $1 that `$pick` selects, in the
/// order `$order`, locked `FOR UPDATE SKIP LOCKED` (rows another relay
/// holds are skipped), get `$set` and the lease (worker $3, until now +
/// $4; `next_retry_at_ms` is set to the lease end too, which
/// `{table}_lease_idx` orders by) and come back. Pending and due rows
/// (`postbox_sqlx::claims_in_retry_order!`) become `delivering`. The
/// update finds the picked rows by primary key (`id = ANY(ARRAY(…))`):
/// joined `FROM picked`, the planner hashes the whole table instead when
/// it is small enough (40,000 rows: a sequential scan, 21 ms instead of
/// 3 ms per claim of 500).
macro_rules! claim {
    ($from:literal, $pick:expr, $order:literal) => {
        claim!($from, $pick, $order, "status = 'delivering', ")
    };
    ($from:literal, $pick:expr, $order:literal, $set:literal) => {
        concat!(
            "WITH picked AS (SELECT id FROM ",
            $from,
            " WHERE app_code = $1 AND ",
            $pick,
            " ORDER BY ",
            $order,
            " LIMIT $2 FOR UPDATE SKIP LOCKED) ",
            claim!(take: $set)
        )
    };
    (take: $set:literal) => {
        concat!(
            "UPDATE {table} o SET ",
            $set,
            "worker_id = $3, lock_until_ms = ",
            now_ms!(),
            " + $4, next_retry_at_ms = ",
            now_ms!(),
            " + $4, updated_at_ms = ",
            now_ms!(),
            " WHERE o.id = ANY(ARRAY(SELECT id FROM picked)) RETURNING ",
            o_columns!()
        )
    };
}

/// Claim new rows, dealt across event types (`postbox_sqlx::fair_pending!`):
/// how many rows of each type the batch takes (`share`), read index only,
/// then that many of each type's oldest, locked, skipping those another
/// relay holds (so a second relay takes each type's next rows). Index:
/// `{table}_pending_idx (app_code, event_type, next_retry_at_ms, id) WHERE
/// status = 'pending'` (schema version 8): one probe per pending type, at
/// most `$2` entries of each for the shares, then the rows taken. A type
/// alone costs what a plain `LIMIT $2 FOR UPDATE SKIP LOCKED` does, plus
/// an index-only read of the same entries.
pub(crate) const CLAIM_PENDING: &str = concat!(
    "WITH RECURSIVE ",
    postbox_sqlx::fair_pending!(app: "$1", limit: "$2", take: "$2", skip: " <> ALL($5::text[])", lateral),
    ", share (t, n) AS (SELECT t, count(*) FROM fair GROUP BY t), \
     picked AS (SELECT l.id FROM share CROSS JOIN LATERAL \
       (SELECT p.id FROM {table} p WHERE p.app_code = $1 AND p.status = 'pending' \
          AND p.event_type = share.t ORDER BY p.next_retry_at_ms, p.id \
          LIMIT share.n FOR UPDATE SKIP LOCKED) l) ",
    claim!(take: "status = 'delivering', ")
);

// Due retries through `{table}_retry_idx (app_code, next_retry_at_ms,
// id) WHERE status = 'retryable'`, read up to the clock. Partial indexes: a
// row is in the one index of its status, so each state change writes one
// claim-index entry, not one per index. Heads of aggregates through
// `{table}_head_idx` (schema version 7).
postbox_sqlx::claims_in_retry_order!(claim, now: now_ms!(), app: "$1", limit: "$2", batch: "$6", skip: " <> ALL($5::text[])", head: partial, fair: lateral);

/// Take over rows whose lease expired (`postbox_sqlx::expired_lease_pick!`);
/// the lost attempt is counted. Index: `{table}_lease_idx (app_code,
/// next_retry_at_ms, id) WHERE status = 'delivering'`.
pub(crate) const CLAIM_EXPIRED_LEASES: &str = claim!(
    "{table}",
    postbox_sqlx::expired_lease_pick!(now_ms!()),
    "next_retry_at_ms, id",
    "retry_count = o.retry_count + 1, \
     last_error = 'lease expired while held by ' || COALESCE(o.worker_id, '?'), "
);

/// A claim statement with its parameters: tenant, limit, worker, lease
/// length, and for the pending claims the paused event types
/// (`ClaimRequest::skip_types`, `$5`).
pub(crate) fn claim_query<'q>(
    sql: &'q str,
    source: postbox_core::ClaimSource,
    req: &postbox_core::store::ClaimRequest<'q>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let query = sqlx::query(sql)
        .bind(req.app_code)
        .bind(i64::from(req.limit))
        .bind(req.worker_id)
        .bind(req.lease_ms);
    match source {
        postbox_core::ClaimSource::Pending => query.bind(req.skip_types),
        postbox_core::ClaimSource::DueRetry | postbox_core::ClaimSource::ExpiredLease => query,
    }
}

/// The claims, in the order `ClaimStatements::render` takes them.
pub(crate) const CLAIMS: [&str; 5] = postbox_sqlx::claims!();

/// Fenced: only rows still leased by this claim. Primary key lookups.
/// `next_retry_at_ms` becomes the time of delivery (as for every terminal
/// row: see `postbox_sqlx::v5_partial_indexes!`).
///
/// Every fenced statement writes its status test as `(status =
/// 'delivering') IS TRUE` (the same rows: `status` is never NULL), which
/// the planner cannot match to `{table}_lease_idx`'s predicate. Written
/// plainly, statistics that see few delivering rows (any analysed table)
/// make it read that whole index, every row in flight, and filter by id:
/// with 20,000 rows leased, 11 ms per mark of 100 instead of 1.1 ms.
pub(crate) const MARK_DELIVERED: &str = concat!(
    "UPDATE {table} SET status = 'delivered', lock_until_ms = 0, last_error = NULL, \
       next_retry_at_ms = ",
    now_ms!(),
    ", updated_at_ms = ",
    now_ms!(),
    " \
     WHERE id = ANY($1) AND (status = 'delivering') IS TRUE AND worker_id = $2 AND lock_until_ms = $3"
);

/// Fenced failed attempt: `retryable` (due after a backoff) or `failed`.
pub(crate) const MARK_FAILED: &str = concat!(
    "UPDATE {table} SET status = $1, retry_count = $2, next_retry_at_ms = ",
    now_ms!(),
    " + $3 - id % ($4 + 1), \
       lock_until_ms = 0, delivered_to = $5, last_error = $6, updated_at_ms = ",
    now_ms!(),
    " \
     WHERE id = ANY($7) AND (status = 'delivering') IS TRUE AND worker_id = $8 AND lock_until_ms = $9"
);

/// Fenced release at shutdown: due again at once, no attempt counted.
pub(crate) const RELEASE: &str =
    concat!(
    "UPDATE {table} SET status = CASE WHEN retry_count = 0 THEN 'pending' ELSE 'retryable' END, \
       next_retry_at_ms = 0, lock_until_ms = 0, worker_id = NULL, updated_at_ms = ", now_ms!(), " \
     WHERE id = ANY($1) AND (status = 'delivering') IS TRUE AND worker_id = $2 AND lock_until_ms = $3"
);

/// Fenced, no attempt counted: a publisher was behind, so the rows wait
/// for it as `retryable`, due after `$1` ms, keeping what the others
/// confirmed.
pub(crate) const DEFER: &str = concat!(
    "UPDATE {table} SET status = 'retryable', next_retry_at_ms = ",
    now_ms!(),
    " + $1, \
       lock_until_ms = 0, worker_id = NULL, delivered_to = $2, last_error = $3, updated_at_ms = ",
    now_ms!(),
    " \
     WHERE id = ANY($4) AND (status = 'delivering') IS TRUE AND worker_id = $5 AND lock_until_ms = $6"
);

/// Counts of one tenant's rows by status (`postbox_sqlx::count_open!`):
/// each through the partial index of its status; delivered rows counted
/// up to a cap, then estimated ([`DELIVERED_ESTIMATE`]).
pub(crate) const COUNT_OPEN: &str = postbox_sqlx::count_open!("$1");

/// The planner's estimate of one tenant's delivered rows: `EXPLAIN` of a
/// read through `{table}_done_idx`, whose scan's `Plan Rows` comes from
/// the table's statistics (`ANALYZE`, autovacuum), in about a millisecond
/// at any size. `LIMIT 1` keeps the plan's cost under `jit_above_cost`:
/// without it, at 10 M rows, JIT compiling the plan took 20–40 ms.
pub(crate) const DELIVERED_ESTIMATE: &str = "EXPLAIN (FORMAT JSON) SELECT 1 FROM {table} \
     WHERE app_code = $1 AND status IN ('delivered', 'published') LIMIT 1";

/// Oldest pending row and due retries (`postbox_sqlx::backlog!`).
pub(crate) const BACKLOG: &str =
    postbox_sqlx::backlog!("$1", now_ms!(), oldest: postbox_sqlx::oldest_pending!("$1"));

/// `list` without its predicates (`postbox_sqlx::list_select!`).
pub(crate) const LIST_SELECT: &str = postbox_sqlx::list_select!();

/// The smallest app_code above $1, or NULL: one probe of
/// `{table}_event_uq (app_code, event_id)` (the engine lists every app_code
/// with one probe each, never reading their rows).
pub(crate) const NEXT_APP_CODE: &str =
    "SELECT MIN(app_code)::TEXT FROM {table} WHERE app_code > $1";

/// Archived rows of one event, in the given app_codes ($1, an array)
/// (`postbox_sqlx::find!`).
pub(crate) const FIND_ARCHIVED: &str = postbox_sqlx::find!("{archive}", "app_code = ANY($1)", "$2");

/// Rows delivered per minute since a time, for the dashboard's chart.
/// Index: `{table}_done_idx (app_code, updated_at_ms, id) WHERE status IN
/// ('delivered', 'published')`, a range read of the last hour's delivered
/// rows only.
pub(crate) const DELIVERED_PER_MINUTE: &str =
    "SELECT (updated_at_ms / 60000) * 60000 AS minute_ms, COUNT(*) AS delivered \
     FROM {table} WHERE app_code = $1 AND status IN ('delivered', 'published') AND updated_at_ms >= $2 \
     GROUP BY minute_ms ORDER BY minute_ms";

/// By event id, in the app_codes ($1, an array) that have rows
/// (`postbox_sqlx::find!`).
pub(crate) const FIND: &str = postbox_sqlx::find!("{table}", "app_code = ANY($1)", "$2");

/// A replay that picked its targets: rows $1 get `delivered_to` $2 (the
/// publishers *not* targeted), in the replay's transaction.
pub(crate) const REPLAY_SET_DELIVERED_TO: &str =
    "UPDATE {table} SET delivered_to = $2 WHERE id = ANY($1)";

/// Replay by ids: back to pending with retry_count 0, keeping event_id.
pub(crate) const REPLAY_IDS: &str = concat!(
    postbox_sqlx::replay_pending!(now_ms!()),
    "WHERE event_id = ANY($1) AND app_code = $2 AND status <> 'delivering' \
     RETURNING ",
    columns!()
);

/// Rows a replay by ids would touch.
pub(crate) const REPLAY_IDS_DRY: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM {table} \
     WHERE event_id = ANY($1) AND app_code = $2 AND status <> 'delivering' ORDER BY id"
);

/// Replay by filter (`postbox_sqlx::replay_filter!`).
pub(crate) const REPLAY_FILTER: &str = postbox_sqlx::replay_filter!(now_ms!());

/// Rows a replay by filter would touch.
pub(crate) const REPLAY_FILTER_DRY: &str = postbox_sqlx::replay_filter_dry!();

/// Time-range replay also brings archived rows back: copy them into the
/// live table as pending (keeping id and event_id) unless already there.
pub(crate) const UNARCHIVE_FILTER: &str = concat!(
    postbox_sqlx::unarchive_insert!(now_ms!()),
    " FROM {archive} a \
     WHERE TRUE{filters} \
     ON CONFLICT DO NOTHING RETURNING ",
    columns!()
);

/// Archived rows a time-range replay would bring back.
pub(crate) const UNARCHIVE_FILTER_DRY: &str = concat!(
    "SELECT ", columns!(), " FROM {archive} a \
     WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE t.app_code = a.app_code AND t.event_id = a.event_id)\
       {filters} \
     ORDER BY id"
);

/// `id` in the id array bound as `$1`.
pub(crate) const ID_LIST: &str = "id = ANY($1)";

/// An insert that leaves alone a row whose key is there.
pub(crate) const INSERT_IGNORE: (&str, &str) = ("INSERT INTO", " ON CONFLICT DO NOTHING");

/// Removes from the archive the rows a replay brought back.
pub(crate) const DELETE_UNARCHIVED: &str = "DELETE FROM {archive} WHERE id = ANY($1)";

// ---- attempt history (see `postbox_sqlx::history_writes!`) ----

postbox_sqlx::history_writes! {
    now_ms!(), rows: "id = ANY($1)", origin: "$2", targets: "$3",
    failed: ", $2, $3, $4, $5 FROM {table} \
       WHERE id = ANY($1) AND worker_id = $6 AND lock_until_ms = 0 AND retry_count = $3"
}

/// Keeps the newest $2 entries of each event of rows $1. Index:
/// `{table}_history_event_idx (event_id, app_code, id)`, read backwards.
pub(crate) const HISTORY_PRUNE: &str = "DELETE FROM {table}_history d USING {table} t \
     WHERE t.id = ANY($1) AND d.event_id = t.event_id AND d.app_code = t.app_code \
       AND d.id < (SELECT h.id FROM {table}_history h \
         WHERE h.event_id = t.event_id AND h.app_code = t.app_code \
         ORDER BY h.id DESC OFFSET $2 - 1 LIMIT 1)";

/// An event's history, oldest first. Index: `{table}_history_event_idx`.
pub(crate) const HISTORY: &str = "SELECT at_ms, kind, attempt, publisher, detail \
     FROM {table}_history WHERE event_id = $1 ORDER BY id";

// ---- archive ----

/// One archiver per table: a session lock on the archiver's own connection
/// (released at the end, or when the session dies with its process).
pub(crate) const ARCHIVE_LOCK: &str =
    "SELECT pg_try_advisory_lock(hashtext('postbox_archive:' || $1))";

pub(crate) const ARCHIVE_UNLOCK: &str =
    "SELECT pg_advisory_unlock(hashtext('postbox_archive:' || $1))";

/// The rows one archive batch takes ($1 app_code, $2 cut-off, $3 batch
/// size): delivered (and legacy `published`) rows last updated before the
/// cut-off. Index: `{table}_done_idx (app_code, updated_at_ms, id) WHERE
/// status IN ('delivered', 'published')`, read in its order. A row whose
/// id the archive holds for another event (ids reused after a reset) is
/// left out: it is never archived, and as the oldest it would otherwise
/// fill every batch, which then moves nothing, and the run ends there.
macro_rules! archive_pick {
    () => {
        "SELECT id FROM {table} WHERE app_code = $1 AND status IN ('delivered', 'published', 'dropped') \
           AND updated_at_ms < $2 AND NOT EXISTS (SELECT 1 FROM {archive} a WHERE a.id = {table}.id \
             AND (a.app_code <> {table}.app_code OR a.event_id <> {table}.event_id)) ORDER BY updated_at_ms, id LIMIT $3"
    };
}

/// One archive batch, one statement: copy what the archive lacks (unique
/// `id`), then delete from the outbox only rows whose event the archive
/// holds: copied here, by an earlier run, or under another id (an event
/// enqueued again after it was archived, and delivered again: the archived
/// copy is kept, the live duplicate goes, so such rows never stop the
/// archiver). A row whose id the archive holds for another event (ids
/// reused after a reset) is neither copied nor deleted: it stays in the
/// outbox. Returns the rows deleted and copied.
pub(crate) const ARCHIVE_BATCH: &str = concat!(
    "WITH picked AS (",
    archive_pick!(),
    " FOR UPDATE), \
     copied AS (INSERT INTO {archive} (",
    columns!(),
    ") SELECT ",
    columns!(),
    " FROM {table} WHERE id IN (SELECT id FROM picked) ON CONFLICT DO NOTHING RETURNING id), \
     deleted AS (DELETE FROM {table} t WHERE t.id IN (SELECT id FROM picked) \
       AND (t.id IN (SELECT id FROM copied) \
         OR EXISTS (SELECT 1 FROM {archive} a WHERE a.app_code = t.app_code AND a.event_id = t.event_id)) \
       RETURNING t.id) \
     SELECT (SELECT COUNT(*) FROM deleted) AS deleted, (SELECT COUNT(*) FROM copied) AS copied"
);

/// Which of the event ids `$2` of app_code `$1` are archived. Index:
/// `{archive}_event_uq (app_code, event_id)`.
pub(crate) const ARCHIVED_EVENT_IDS: &str =
    "SELECT event_id FROM {archive} WHERE app_code = $1 AND event_id = ANY($2)";

/// The selecting part of [`ARCHIVE_BATCH`], for `doctor`'s EXPLAIN.
pub(crate) const ARCHIVE_PICK: &str = archive_pick!();

/// One archive batch's ids, locked (an archive in another database).
pub(crate) const ARCHIVE_PICK_LOCK: &str = concat!(archive_pick!(), " FOR UPDATE");

postbox_sqlx::partial_stuck_aggregates!(now: now_ms!(), "$1", "$2", "$3");

// ---- doctor ----

/// The table's schema version.
pub(crate) const DOCTOR_VERSION: &str =
    "SELECT MAX(version) FROM postbox_schema_migrations WHERE table_name = $1";

/// Tables and indexes of the current schema, by name.
pub(crate) const DOCTOR_OBJECTS: &str =
    "SELECT c.relname::TEXT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'i', 'I') \
       AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indexrelid = c.oid AND NOT i.indisvalid) \
     UNION ALL SELECT t.tgname::TEXT FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid \
       JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE n.nspname = current_schema() AND NOT t.tgisinternal";

// ---- schema ----

/// Serialises concurrent `migrate` runs, of any table: they share the
/// migrations table, whose `CREATE … IF NOT EXISTS` is not race-free.
pub(crate) const MIGRATION_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtext('postbox_migrate'))";

/// Set once the migration lock is held: a statement of the migration gives
/// up after waiting 5 s for a lock on the table, and the whole migration
/// rolls back. Its `DROP INDEX` and `CREATE INDEX` wait for every open
/// transaction that touched the table (a producer's, a report's), and
/// while they wait every statement on the table queues behind them,
/// producers' `INSERT`s included; without a limit, for as long as that
/// transaction stayed open.
pub(crate) const MIGRATION_LOCK_WAIT: &str = "SET LOCAL lock_timeout = '5s'";

postbox_sqlx::ledger_statements!(int: "INT", options: "", now: now_ms!(), "$1", "$2", "$3");

/// Which of the given tables exist in the current schema.
pub(crate) const EXISTING_TABLES: &str =
    "SELECT c.relname::TEXT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
     WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND c.relname = ANY($1)";

/// A recreated outbox table continues the ids of the archive it kept, so
/// that archiving never meets an id that is already there.
pub(crate) const CONTINUE_IDS_AFTER_ARCHIVE: &str =
    "SELECT setval(pg_get_serial_sequence('{table}', 'id'), m) \
     FROM (SELECT MAX(id) AS m FROM {archive}) a \
     WHERE m > COALESCE((SELECT MAX(id) FROM {table}), 0)";

/// Version 1 of a partitioned outbox table (`[database] partitioning`):
/// range-partitioned on `created_at_ms`, whose primary key must hold it
/// (`(id, created_at_ms)`). A unique index of a partitioned table must hold
/// the partition key too, so `(app_code, event_id)` is kept unique by
/// `{table}_keys` instead: a row trigger inserts each event's key before
/// its row and skips the row (`INSERT` returns no row, as `ON CONFLICT DO
/// NOTHING` does) when the key is there; deleting a row deletes its key.
/// `{table}_event_uq` is a plain index here, for lookups by event. The
/// archive is a plain table, as on a plain outbox.
pub(crate) const PARTITIONED_V1: &[&str] = &[
    concat!(
        "CREATE TABLE IF NOT EXISTS {table} ( \
           id BIGINT GENERATED BY DEFAULT AS IDENTITY, ",
        postbox_sqlx::outbox_columns!(
            payload: "TEXT",
            now: "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
        ),
        ", PRIMARY KEY (id, created_at_ms)) PARTITION BY RANGE (created_at_ms)"
    ),
    "CREATE INDEX IF NOT EXISTS {table}_event_uq ON {table} (app_code, event_id)",
    "CREATE TABLE IF NOT EXISTS {table}_keys ( \
       app_code VARCHAR(64) NOT NULL, event_id VARCHAR(64) NOT NULL, PRIMARY KEY (app_code, event_id))",
    "CREATE OR REPLACE FUNCTION {table}_key_in() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN \
       INSERT INTO {table}_keys (app_code, event_id) VALUES (NEW.app_code, NEW.event_id) ON CONFLICT DO NOTHING; \
       IF NOT FOUND THEN RETURN NULL; END IF; \
       RETURN NEW; \
     END $$",
    "CREATE OR REPLACE TRIGGER {table}_key_in BEFORE INSERT ON {table} \
       FOR EACH ROW EXECUTE FUNCTION {table}_key_in()",
    "CREATE OR REPLACE FUNCTION {table}_key_out() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN \
       DELETE FROM {table}_keys WHERE app_code = OLD.app_code AND event_id = OLD.event_id; \
       RETURN NULL; \
     END $$",
    "CREATE OR REPLACE TRIGGER {table}_key_out AFTER DELETE ON {table} \
       FOR EACH ROW EXECUTE FUNCTION {table}_key_out()",
    "CREATE TABLE IF NOT EXISTS {archive} (LIKE {table} INCLUDING DEFAULTS)",
    "CREATE UNIQUE INDEX IF NOT EXISTS {archive}_pk ON {archive} (id)",
    "CREATE UNIQUE INDEX IF NOT EXISTS {archive}_event_uq ON {archive} (app_code, event_id)",
    "CREATE INDEX IF NOT EXISTS {archive}_created_idx ON {archive} (app_code, created_at_ms)",
];

/// What the engine runs on a partitioned table (`postbox_sqlx::PartitionSql`).
pub(crate) const PARTITIONS: postbox_sqlx::PartitionSql = postbox_sqlx::PartitionSql {
    v1: PARTITIONED_V1,
    // Partitions are created and detached with a short lock timeout: such
    // DDL waits for transactions on the table, and everything queued
    // behind it would wait too.
    lock_timeout: "SET lock_timeout = '3s'",
    reset_lock_timeout: "RESET lock_timeout",
    // Attached with `attach` in the same transaction. The partition's
    // indexes, primary key and row triggers come with the attach; its `id`
    // is filled by the table's identity, as inserts go through the table.
    create: "CREATE TABLE IF NOT EXISTS {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)",
    attached: "SELECT c.relname::TEXT, pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending::INT \
       FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
       WHERE i.inhparent = to_regclass($1) ORDER BY c.relname",
    is_partitioned: "SELECT (EXISTS (SELECT 1 FROM pg_partitioned_table p WHERE p.partrelid = to_regclass($1)))::INT",
    detached: "SELECT c.relname::TEXT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
       WHERE n.nspname = current_schema() AND c.relkind = 'r' AND NOT c.relispartition \
         AND c.relname ~ ('^' || $1 || '_p[0-9]{8}$') ORDER BY c.relname",
    // One probe of each not-done status's partial index (a partition's
    // copies of `{table}_pending_idx`, `_retry_idx`, `_lease_idx`,
    // `_failed_idx`), never a scan of the partition.
    busy: "SELECT (EXISTS (SELECT 1 FROM {name} WHERE status = 'pending') \
       OR EXISTS (SELECT 1 FROM {name} WHERE status = 'retryable') \
       OR EXISTS (SELECT 1 FROM {name} WHERE status = 'delivering') \
       OR EXISTS (SELECT 1 FROM {name} WHERE status = 'failed'))::INT",
    detach: "ALTER TABLE {table} DETACH PARTITION {name} CONCURRENTLY",
    finalize: "ALTER TABLE {table} DETACH PARTITION {name} FINALIZE",
    attach: "ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({from}) TO ({to})",
    forget_keys: "DELETE FROM {table}_keys k USING {name} d WHERE k.app_code = d.app_code AND k.event_id = d.event_id",
    drop: "DROP TABLE {name}",
    index_parent: "CREATE INDEX IF NOT EXISTS {name} ON ONLY {table} (app_code, aggregate_id, id)",
    index_partition: "CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {name} (app_code, aggregate_id, id)",
    attach_index: "ALTER INDEX {parent} ATTACH PARTITION {index}",
    drop_index: "DROP INDEX IF EXISTS {parent}",
};

/// Version 1: the outbox table (an identity `id`), its unique event index
/// and the archive twin. Its claim indexes now come with version 5 only
/// (`postbox_sqlx::v5_partial_indexes!`): version 1 runs again when the
/// archive was dropped by hand, and must not bring back what 5 dropped.
pub(crate) const V1_SCHEMA: &[&str] = &[
    concat!(
        "CREATE TABLE IF NOT EXISTS {table} ( \
           id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, ",
        // The time of the insert itself, not of the caller's statement.
        postbox_sqlx::outbox_columns!(
            payload: "TEXT",
            now: "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
        ),
        ")"
    ),
    "CREATE UNIQUE INDEX IF NOT EXISTS {table}_event_uq ON {table} (app_code, event_id)",
    "CREATE TABLE IF NOT EXISTS {archive} (LIKE {table} INCLUDING DEFAULTS)",
    "ALTER TABLE {archive} ALTER COLUMN id DROP IDENTITY IF EXISTS",
    "CREATE UNIQUE INDEX IF NOT EXISTS {archive}_pk ON {archive} (id)",
    "CREATE UNIQUE INDEX IF NOT EXISTS {archive}_event_uq ON {archive} (app_code, event_id)",
    "CREATE INDEX IF NOT EXISTS {archive}_created_idx ON {archive} (app_code, created_at_ms)",
];

/// Version 2: the bounded attempt history (`postbox_sqlx::v2_history!`).
pub(crate) const V2_HISTORY: &[&str] = postbox_sqlx::v2_history!(
    "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    "INT"
);

/// `(version, description, statements)`, applied in order.
pub(crate) const MIGRATIONS: &[postbox_sqlx::Migration] = postbox_sqlx::migrations!(
    partial_indexes;
    (
        4,
        "wake-up trigger (NOTIFY postbox_<table> once per INSERT statement)",
        V4_WAKE_TRIGGER
    ),
);

/// Version 9: the runtime controls (`postbox_sqlx::v9_controls!`).
pub(crate) const V9_CONTROLS: &[&str] =
    postbox_sqlx::v9_controls!("id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY");

/// Version 10: the relay registry (`postbox_sqlx::v10_relays!`).
pub(crate) const V10_RELAYS: &[&str] = postbox_sqlx::v10_relays!("");

/// Version 11: sampling (`postbox_sqlx::v11_sampling!`).
pub(crate) const V11_SAMPLING: &[&str] = postbox_sqlx::v11_sampling!("IF NOT EXISTS ");

postbox_sqlx::control_plane_statements!(now: now_ms!(), "$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8", "$9");

/// The outbox table's indexes (`postbox_sqlx::partial_indexes!`) and the
/// archive's primary key.
pub(crate) const INDEXES: &[&str] = postbox_sqlx::partial_indexes!("_archive_pk");

/// The index each claim query is written for.
pub(crate) const CLAIM_INDEXES: [postbox_sqlx::dialect::ClaimIndex; 4] =
    postbox_sqlx::PARTIAL_CLAIM_INDEXES;

/// The index [`ARCHIVE_PICK`] is written for.
pub(crate) const ARCHIVE_INDEX: &str = postbox_sqlx::PARTIAL_ARCHIVE_INDEX;

/// Version 5: one partial index per status (`postbox_sqlx::v5_partial_indexes!`),
/// then the indexes they replace are dropped.
pub(crate) const V5_INDEXES: &[&str] = postbox_sqlx::v5_partial_indexes!(
    "DROP INDEX IF EXISTS {table}_claim_retry_idx, {table}_claim_lease_idx, {table}_status_updated_idx, \
       {table}_event_id_idx, {table}_aggregate_idx, {table}_status_id_idx"
);

/// The statements the engine runs, by the name it knows them by (each
/// field of [`postbox_sqlx::Statements`] is the constant of that name here).
pub(crate) const STATEMENTS: postbox_sqlx::Statements = postbox_sqlx::statements!();

/// The idle probe (`RelayStore::due`) for every app_code at once (`$1`, a
/// text array): per app_code, whether a pending row exists and how long
/// until the earliest retryable row is due and the earliest lease ends.
/// Each sub-query reads the first entry of a partial index: `EXISTS` on
/// `{table}_pending_idx`, `MIN(next_retry_at_ms)` on `{table}_retry_idx`
/// and on `{table}_lease_idx` (a delivering row's `next_retry_at_ms` is
/// its lease end); never a scan (checked with `EXPLAIN ANALYZE`).
pub(crate) const DUE: &str = concat!(
    "SELECT a.app_code, \
       CASE WHEN EXISTS (SELECT 1 FROM {table} o \
         WHERE o.app_code = a.app_code AND o.status = 'pending') THEN 1 ELSE 0 END::BIGINT AS pending, \
       (SELECT MIN(o.next_retry_at_ms) FROM {table} o \
         WHERE o.app_code = a.app_code AND o.status = 'retryable') - ",
    now_ms!(),
    " AS retry_in_ms, \
       (SELECT MIN(o.next_retry_at_ms) FROM {table} o \
         WHERE o.app_code = a.app_code AND o.status = 'delivering') - ",
    now_ms!(),
    " AS lease_in_ms \
     FROM unnest($1::text[]) AS a(app_code)"
);

/// Version 4: push wake-up. After every `INSERT` statement into the outbox
/// table (the API's, or any producer's plain SQL), one `NOTIFY` on channel
/// `postbox_<table>` (the table name as PostgreSQL stores it, cut to 63
/// bytes: [`crate::wake::channel`]). Statement-level, and PostgreSQL folds
/// identical notifications of one transaction: a million-row insert costs
/// one notification, delivered at commit. Relays `LISTEN` on the channel.
pub(crate) const V4_WAKE_TRIGGER: &[&str] = &[
    "CREATE OR REPLACE FUNCTION {table}_wake() RETURNS trigger LANGUAGE plpgsql AS $$ \
     BEGIN PERFORM pg_notify(left('postbox_' || TG_TABLE_NAME, 63), ''); RETURN NULL; END $$",
    "DROP TRIGGER IF EXISTS {table}_wake ON {table}",
    "CREATE TRIGGER {table}_wake AFTER INSERT ON {table} \
     FOR EACH STATEMENT EXECUTE FUNCTION {table}_wake()",
];

/// Wakes listening relays inside a replay's transaction (rows set back to
/// pending by an UPDATE, which the insert trigger does not see); the
/// channel is bound.
pub(crate) const NOTIFY_PENDING: &str = "SELECT pg_notify($1, '')";

/// The optional aggregate index (`postbox migrate --aggregate-index`),
/// built `CONCURRENTLY`: the outbox's writers never wait for it (so each
/// statement runs alone, outside a transaction). A build that failed half
/// way leaves an invalid index of that name, which serves no query and
/// which [`DOCTOR_OBJECTS`] does not list: it is dropped first.
pub(crate) const CREATE_AGGREGATE_INDEX: &[&str] = &[
    "DROP INDEX CONCURRENTLY IF EXISTS {name}",
    "CREATE INDEX CONCURRENTLY {name} ON {on} (app_code, aggregate_id, id)",
];

/// Drops it.
pub(crate) const DROP_AGGREGATE_INDEX: &str = "DROP INDEX CONCURRENTLY IF EXISTS {name}";

/// `doctor --scans`: the statements of this database whose text names
/// the table (`$1`), from `pg_stat_statements`, the most time first.
pub(crate) const STATEMENT_STATS: &str =
    "SELECT query, calls, (total_exec_time * 1000)::BIGINT AS total_us, rows AS rows_returned, \
       NULL::BIGINT AS rows_examined, (shared_blks_hit + shared_blks_read)::BIGINT AS blocks \
     FROM pg_stat_statements \
     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
       AND strpos(lower(query), lower($1)) > 0 \
     ORDER BY total_exec_time DESC LIMIT 500";

/// `postbox adopt`: each column of a table: name, NULL allowed, default,
/// length in characters and bytes.
pub(crate) const ADOPT_COLUMNS: &str = "SELECT column_name::TEXT, (is_nullable = 'YES')::INT, \
       (column_default IS NOT NULL)::INT, character_maximum_length::BIGINT, character_octet_length::BIGINT \
     FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = lower($1)";

/// `postbox adopt`: indexes of the table a failed `CREATE INDEX
/// CONCURRENTLY` left invalid (never used, still written).
pub(crate) const ADOPT_INVALID_INDEXES: &str = "SELECT c.relname::TEXT FROM pg_index i \
     JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid \
     WHERE t.relname = lower($1) AND t.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid";

/// `postbox adopt`: the table's secondary indexes.
pub(crate) const ADOPT_INDEXES_OF: &str = "SELECT c.relname::TEXT FROM pg_index i \
     JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid \
     WHERE t.relname = lower($1) AND t.relnamespace = current_schema()::regnamespace AND NOT i.indisprimary \
     ORDER BY 1";

/// A migration's index, built without blocking the table's writes.
pub(crate) fn online_index(create: &str) -> String {
    create.replacen(
        " INDEX IF NOT EXISTS ",
        " INDEX CONCURRENTLY IF NOT EXISTS ",
        1,
    )
}

/// A missing column. A constant default costs no rewrite (PostgreSQL 11
/// stores it in the catalog); a default the clock computes would rewrite
/// every row under an exclusive lock, so existing rows take 0 and new ones
/// the clock.
pub(crate) fn add_column(table: &str, column: &str, definition: &str) -> Vec<String> {
    match definition.split_once(" DEFAULT (") {
        Some((head, clock)) => vec![
            format!("ALTER TABLE {table} ADD COLUMN {head} DEFAULT 0"),
            format!("ALTER TABLE {table} ALTER COLUMN {column} SET DEFAULT ({clock}"),
        ],
        None => vec![format!("ALTER TABLE {table} ADD COLUMN {definition}")],
    }
}
