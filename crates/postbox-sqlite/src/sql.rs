//! Every statement the SQLite backend runs. `{table}` is replaced by the
//! validated table name, `{archive}` by its archive twin; nothing else is
//! assembled at run time: id lists travel as one JSON array parameter read
//! with `json_each`. Each claim names the index it relies on.
//!
//! Parameters are numbered (`?1`, `?2`, …) and every statement uses each
//! number from 1 up without gaps.

use postbox_sqlx::columns;
use postbox_sqlx::dialect::V3_LIST_INDEX;

/// The clock in epoch milliseconds. SQLite is embedded, so this is the
/// host's clock; `'now'` is fixed for one statement. `ROUND` undoes the
/// floating-point error of the Julian-day round trip.
macro_rules! now_ms {
    () => {
        "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)"
    };
}

pub(crate) const NOW_MS: &str = concat!("SELECT ", now_ms!());

/// Enqueue inside the caller's transaction. A duplicate `(app_code,
/// event_id)` fails this statement only (SQLite's default `ABORT`), so the
/// caller's transaction stays usable.
pub(crate) const INSERT_EVENT: &str = "INSERT INTO {table} \
     (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";

// The three claims run inside one `BEGIN IMMEDIATE` transaction each, which
// stands in for `FOR UPDATE SKIP LOCKED`. Parameters: ?1 app_code, ?2 limit,
// ?3 worker_id, ?4 lock_until_ms (the fence), ?5 now.

/// One claim: up to ?2 rows of tenant ?1 that `$pick` selects, in the
/// order `$order`, get `$set` and the lease (worker ?3, until ?4, at ?5)
/// and come back (`next_retry_at_ms` becomes the lease end too, which
/// `{table}_lease_idx` orders by). Pending and due rows
/// (`postbox_sqlx::claims_in_retry_order!`) become `delivering`.
macro_rules! claim {
    ($from:literal, $pick:expr, $order:literal) => {
        claim!($from, $pick, $order, "status = 'delivering', ")
    };
    ($from:literal, $pick:expr, $order:literal, $set:literal) => {
        claim!(
            set: $set,
            rows: concat!(
                "id IN (SELECT id FROM ",
                $from,
                " WHERE app_code = ?1 AND ",
                $pick,
                " ORDER BY ",
                $order,
                " LIMIT ?2)"
            )
        )
    };
    (set: $set:literal, rows: $rows:expr) => {
        concat!(
            "UPDATE {table} SET ",
            $set,
            "worker_id = ?3, lock_until_ms = ?4, next_retry_at_ms = ?4, updated_at_ms = ?5 WHERE ",
            $rows,
            " RETURNING ",
            columns!()
        )
    };
}

/// Claim new rows, dealt across event types (`postbox_sqlx::fair_pending!`):
/// the first ?2 in round-robin order (the claim's `BEGIN IMMEDIATE` keeps
/// other relays out), found by rowid. Index: `{table}_pending_idx
/// (app_code, event_type, next_retry_at_ms, id) WHERE status = 'pending'`
/// (schema version 8), one probe per pending type and at most ?2 entries
/// each; the deal sorts at most that many candidates.
pub(crate) const CLAIM_PENDING: &str = claim!(
    set: "status = 'delivering', ",
    rows: concat!(
        "id IN (WITH RECURSIVE ",
        postbox_sqlx::fair_pending!(app: "?1", limit: "?2", take: "?2", skip: " NOT IN (SELECT value FROM json_each(?6))", in_list),
        " SELECT fid FROM fair) AND +status = 'pending'"
    )
);

// Due retries through `{table}_retry_idx (app_code, next_retry_at_ms, id)
// WHERE status = 'retryable'` (`postbox_sqlx::v5_partial_indexes!`).
// Heads of aggregates through `{table}_head_idx` (schema version 7).
postbox_sqlx::claims_in_retry_order!(claim, now: "?5", app: "?1", limit: "?2", batch: "?7", skip: " NOT IN (SELECT value FROM json_each(?6))", head: partial, fair: in_list);

/// Take over rows whose lease expired (`postbox_sqlx::expired_lease_pick!`);
/// the lost attempt is counted. Index: `{table}_lease_idx (app_code,
/// next_retry_at_ms, id) WHERE status = 'delivering'`.
pub(crate) const CLAIM_EXPIRED_LEASES: &str = claim!(
    "{table}",
    postbox_sqlx::expired_lease_pick!("?5"),
    "next_retry_at_ms, id",
    "retry_count = retry_count + 1, \
     last_error = 'lease expired while held by ' || COALESCE(worker_id, '?'), "
);

/// The claims, in the order `ClaimStatements::render` takes them.
pub(crate) const CLAIMS: [&str; 5] = postbox_sqlx::claims!();

/// The fence of a batch write: rows `?$ids` (a JSON array of ids) still
/// leased by the claim `(?$worker, ?$lock)`. Primary key lookups.
macro_rules! fenced_ids {
    ($ids:literal, $worker:literal, $lock:literal) => {
        concat!(
            " WHERE id IN (SELECT value FROM json_each(?",
            $ids,
            ")) AND status = 'delivering' AND worker_id = ?",
            $worker,
            " AND lock_until_ms = ?",
            $lock
        )
    };
}

/// Fenced: only rows still leased by this claim.
pub(crate) const MARK_DELIVERED: &str = concat!(
    "UPDATE {table} SET status = 'delivered', lock_until_ms = 0, last_error = NULL, \
       next_retry_at_ms = ",
    now_ms!(),
    ", updated_at_ms = ",
    now_ms!(),
    fenced_ids!("1", "2", "3")
);

/// The assignments of a row that waits for its next try: `$status`, due
/// `$after` (an expression in ms) from now, its lease ended,
/// `delivered_to` and `last_error` written.
macro_rules! waiting {
    ($status:literal, $after:literal, $delivered_to:literal, $error:literal) => {
        concat!(
            "status = ",
            $status,
            ", next_retry_at_ms = ",
            now_ms!(),
            " + ",
            $after,
            ", lock_until_ms = 0, delivered_to = ?",
            $delivered_to,
            ", last_error = ?",
            $error,
            ", updated_at_ms = ",
            now_ms!()
        )
    };
}

/// Fenced failed attempts of rows ?7 (JSON array): `retryable` (due after
/// a backoff, spread by id over its jitter) or `failed`.
pub(crate) const MARK_FAILED: &str = concat!(
    "UPDATE {table} SET retry_count = ?2, ",
    waiting!("?1", "?3 - id % (?4 + 1)", "5", "6"),
    fenced_ids!("7", "8", "9")
);

/// Fenced release at shutdown: due again at once, no attempt counted.
pub(crate) const RELEASE: &str = concat!(
    "UPDATE {table} SET status = CASE WHEN retry_count = 0 THEN 'pending' ELSE 'retryable' END, \
       next_retry_at_ms = 0, lock_until_ms = 0, worker_id = NULL, updated_at_ms = ",
    now_ms!(),
    fenced_ids!("1", "2", "3")
);

/// Fenced, no attempt counted: a publisher was behind, so the rows wait
/// for it as `retryable`, due after `?1` ms, keeping what the others
/// confirmed.
pub(crate) const DEFER: &str = concat!(
    "UPDATE {table} SET worker_id = NULL, ",
    waiting!("'retryable'", "?1", "2", "3"),
    fenced_ids!("4", "5", "6")
);

/// Counts of one tenant's rows by status, each through the partial index
/// of its status (`postbox_sqlx::count_open!`).
pub(crate) const COUNT_OPEN: &str = postbox_sqlx::count_open!("?1");

/// One tenant's delivered rows, counted through `{table}_done_idx` (a
/// covering index read: SQLite keeps no statistics to estimate from).
pub(crate) const COUNT_DELIVERED: &str = "SELECT COUNT(*) FROM {table} \
     WHERE app_code = ?1 AND status IN ('delivered', 'published', 'dropped') AND status <> 'dropped'";

/// Oldest pending row and due retries (`postbox_sqlx::backlog!`).
pub(crate) const BACKLOG: &str =
    postbox_sqlx::backlog!("?1", now_ms!(), oldest: postbox_sqlx::oldest_pending!("?1"));

/// `list` without its predicates (`postbox_sqlx::list_select!`).
pub(crate) const LIST_SELECT: &str = postbox_sqlx::list_select!();

/// The smallest app_code above ?1, or NULL: one probe of
/// `{table}_event_uq (app_code, event_id)` (the engine lists every app_code
/// with one probe each, never reading their rows).
pub(crate) const NEXT_APP_CODE: &str = "SELECT MIN(app_code) FROM {table} WHERE app_code > ?1";

/// Archived rows of one event, in the app_codes of ?1 (a JSON array)
/// (`postbox_sqlx::find!`).
pub(crate) const FIND_ARCHIVED: &str = postbox_sqlx::find!(
    "{archive}",
    "app_code IN (SELECT value FROM json_each(?1))",
    "?2"
);

/// Rows delivered per minute since a time, for the dashboard's chart.
/// Index: `{table}_done_idx (app_code, updated_at_ms, id) WHERE status IN
/// ('delivered', 'published')`, a range read of the last hour's delivered
/// rows only.
pub(crate) const DELIVERED_PER_MINUTE: &str =
    "SELECT (updated_at_ms / 60000) * 60000 AS minute_ms, COUNT(*) AS delivered \
     FROM {table} WHERE app_code = ?1 AND status IN ('delivered', 'published', 'dropped') \
       AND status <> 'dropped' AND updated_at_ms >= ?2 \
     GROUP BY minute_ms ORDER BY minute_ms";

/// By event id, in the app_codes of ?1 (a JSON array) that have rows
/// (`postbox_sqlx::find!`).
pub(crate) const FIND: &str = postbox_sqlx::find!(
    "{table}",
    "app_code IN (SELECT value FROM json_each(?1))",
    "?2"
);

/// A replay that picked its targets: rows ?1 (a JSON array of ids) get
/// `delivered_to` ?2 (the publishers *not* targeted), in the replay's
/// transaction.
pub(crate) const REPLAY_SET_DELIVERED_TO: &str =
    "UPDATE {table} SET delivered_to = ?2 WHERE id IN (SELECT value FROM json_each(?1))";

/// Replay by ids: back to pending with retry_count 0, keeping event_id.
/// ?1 is a JSON array of event ids. Through `{table}_event_uq`, named:
/// SQLite cannot tell how many ids the array holds, and on a small
/// analysed table plans a scan of every row per id list.
pub(crate) const REPLAY_IDS: &str = concat!(
    postbox_sqlx::replay_pending!(now_ms!(), " INDEXED BY {table}_event_uq"),
    "WHERE event_id IN (SELECT value FROM json_each(?1)) AND app_code = ?2 \
       AND status <> 'delivering' \
     RETURNING ",
    columns!()
);

/// Rows a replay by ids would touch.
pub(crate) const REPLAY_IDS_DRY: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM {table} INDEXED BY {table}_event_uq \
     WHERE event_id IN (SELECT value FROM json_each(?1)) AND app_code = ?2 \
       AND status <> 'delivering' ORDER BY id"
);

/// Replay by filter (`postbox_sqlx::replay_filter!`).
pub(crate) const REPLAY_FILTER: &str = postbox_sqlx::replay_filter!(now_ms!());

/// Rows a replay by filter would touch.
pub(crate) const REPLAY_FILTER_DRY: &str = postbox_sqlx::replay_filter_dry!();

/// Time-range replay also brings archived rows back: copy them into the
/// live table as pending (keeping id and event_id) unless already there.
/// Archived rows are delivered ones, hence the status filter.
pub(crate) const UNARCHIVE_FILTER: &str = concat!(
    postbox_sqlx::unarchive_insert!(now_ms!()),
    " FROM {archive} a \
     WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE t.app_code = a.app_code AND t.event_id = a.event_id)\
       {filters} \
     ORDER BY id \
     ON CONFLICT DO NOTHING RETURNING ",
    columns!()
);

/// Archived rows a time-range replay would bring back.
pub(crate) const UNARCHIVE_FILTER_DRY: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM {archive} a \
     WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE t.app_code = a.app_code AND t.event_id = a.event_id)\
       {filters} \
     ORDER BY id"
);

/// Removes from the archive the rows a replay brought back; ?1 is a JSON
/// array of ids.
pub(crate) const DELETE_UNARCHIVED: &str =
    "DELETE FROM {archive} WHERE id IN (SELECT value FROM json_each(?1))";

// ---- attempt history (see `postbox_sqlx::history_writes!`) ----

postbox_sqlx::history_writes! {
    now_ms!(), rows: "id IN (SELECT value FROM json_each(?1))", origin: "?2", targets: "?3",
    failed: ", ?2, ?3, ?4, ?5 FROM {table} \
       WHERE id IN (SELECT value FROM json_each(?1)) AND worker_id = ?6 AND lock_until_ms = 0 AND retry_count = ?3"
}

/// Keeps the newest ?2 entries of each event of rows ?1 (JSON array).
/// Index: `{table}_history_event_idx (event_id, app_code, id)`, read backwards.
/// From the rows to their events' entries (a correlated `EXISTS` on the
/// history scanned all of it, in the write lock, at every failed attempt).
pub(crate) const HISTORY_PRUNE: &str = "DELETE FROM {table}_history WHERE id IN ( \
       SELECT d.id FROM {table} t JOIN {table}_history d \
         ON d.event_id = t.event_id AND d.app_code = t.app_code \
       WHERE t.id IN (SELECT value FROM json_each(?1)) \
         AND d.id < (SELECT h.id FROM {table}_history h \
           WHERE h.event_id = t.event_id AND h.app_code = t.app_code \
           ORDER BY h.id DESC LIMIT 1 OFFSET ?2 - 1))";

/// An event's history, oldest first. Index: `{table}_history_event_idx`.
pub(crate) const HISTORY: &str = "SELECT at_ms, kind, attempt, publisher, detail \
     FROM {table}_history WHERE event_id = ?1 ORDER BY id";

// ---- archive ----
// Each batch is one `BEGIN IMMEDIATE` transaction: SQLite's write lock
// keeps a second archiver (or anything else) out while it runs.

/// The rows one archive batch takes (?1 app_code, ?2 cut-off, ?3 batch
/// size): delivered (and legacy `published`) rows last updated before the
/// cut-off. Index: `{table}_done_idx (app_code, updated_at_ms, id) WHERE
/// status IN ('delivered', 'published')`, read in its order, which is
/// deterministic, so the copy and the delete see the same rows.
macro_rules! archive_pick {
    () => {
        "SELECT id FROM {table} WHERE app_code = ?1 AND status IN ('delivered', 'published', 'dropped') \
           AND updated_at_ms < ?2 AND NOT EXISTS (SELECT 1 FROM {archive} a WHERE a.id = {table}.id \
             AND (a.app_code <> {table}.app_code OR a.event_id <> {table}.event_id)) ORDER BY updated_at_ms, id LIMIT ?3"
    };
}

/// [`ARCHIVE_COPY`]'s selection, for `doctor`'s EXPLAIN.
pub(crate) const ARCHIVE_PICK: &str = archive_pick!();

/// Archive step 1: copy what the archive lacks (unique `id`).
pub(crate) const ARCHIVE_COPY: &str = concat!(
    "INSERT OR IGNORE INTO {archive} (",
    columns!(),
    ") SELECT ",
    columns!(),
    " FROM {table} WHERE id IN (",
    archive_pick!(),
    ")"
);

/// Archive step 2: delete from the outbox only rows present in the
/// archive, or whose event the archive already holds under another id (an
/// event enqueued again after it was archived, and delivered again): the
/// archived copy is kept, the live duplicate goes, so such rows never stop
/// the archiver. Present means the same event: a row whose id the archive
/// holds for another event (ids reused after a reset) stays in the outbox.
pub(crate) const ARCHIVE_DELETE: &str = concat!(
    "DELETE FROM {table} WHERE id IN (",
    archive_pick!(),
    ") AND EXISTS (SELECT 1 FROM {archive} a \
         WHERE a.app_code = {table}.app_code AND a.event_id = {table}.event_id)"
);

/// `id` in the JSON array of ids bound as `?1`.
pub(crate) const ID_LIST: &str = "id IN (SELECT value FROM json_each(?1))";

/// An insert that leaves alone a row whose key is there.
pub(crate) const INSERT_IGNORE: (&str, &str) = ("INSERT INTO", " ON CONFLICT DO NOTHING");

/// Which of the event ids `?2` (a JSON array) of app_code `?1` are
/// archived. Index: `{archive}_event_uq (app_code, event_id)`.
pub(crate) const ARCHIVED_EVENT_IDS: &str = "SELECT event_id FROM {archive} \
     WHERE app_code = ?1 AND event_id IN (SELECT value FROM json_each(?2))";

postbox_sqlx::partial_stuck_aggregates!(now: now_ms!(), "?1", "?2", "?3");

// ---- doctor ----

/// The table's schema version.
pub(crate) const DOCTOR_VERSION: &str =
    "SELECT MAX(version) FROM postbox_schema_migrations WHERE table_name = ?1";

/// Tables and indexes, by name.
pub(crate) const DOCTOR_OBJECTS: &str =
    "SELECT name FROM sqlite_master WHERE type IN ('table', 'index')";

// ---- schema ----

postbox_sqlx::ledger_statements!(int: "INTEGER", options: "", now: now_ms!(), "?1", "?2", "?3");

/// Which of the given tables (?1, a JSON array) exist.
pub(crate) const EXISTING_TABLES: &str = "SELECT name FROM sqlite_master \
     WHERE type = 'table' AND name IN (SELECT value FROM json_each(?1))";

/// A recreated outbox table continues the ids of the archive it kept, so
/// that archiving never meets an id that is already there (AUTOINCREMENT
/// reads its next id from `sqlite_sequence`).
pub(crate) const CONTINUE_IDS_AFTER_ARCHIVE: &[&str] = &[
    "INSERT INTO sqlite_sequence (name, seq) SELECT '{table}', 0 \
     WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = '{table}')",
    "UPDATE sqlite_sequence SET seq = (SELECT MAX(id) FROM {archive}) \
     WHERE name = '{table}' AND seq < (SELECT MAX(id) FROM {archive})",
];

/// Version 1: the outbox table (`AUTOINCREMENT` ids, never reused), the
/// unique event index, the archive twin; claim indexes are version 5's
/// (see PostgreSQL's `V1_SCHEMA` for why).
pub(crate) const V1_SCHEMA: &[&str] = &[
    concat!(
        "CREATE TABLE IF NOT EXISTS {table} (id INTEGER PRIMARY KEY AUTOINCREMENT, ",
        postbox_sqlx::outbox_columns!(payload: "TEXT", now: now_ms!()),
        ")"
    ),
    "CREATE UNIQUE INDEX IF NOT EXISTS {table}_event_uq ON {table} (app_code, event_id)",
    // The archive keeps the live ids: a rowid primary key, no AUTOINCREMENT.
    concat!(
        "CREATE TABLE IF NOT EXISTS {archive} (id INTEGER PRIMARY KEY, ",
        postbox_sqlx::outbox_columns!(payload: "TEXT", now: now_ms!()),
        ")"
    ),
    "CREATE UNIQUE INDEX IF NOT EXISTS {archive}_event_uq ON {archive} (app_code, event_id)",
    "CREATE INDEX IF NOT EXISTS {archive}_created_idx ON {archive} (app_code, created_at_ms)",
];

/// Version 2: the bounded attempt history (`postbox_sqlx::v2_history!`).
pub(crate) const V2_HISTORY: &[&str] =
    postbox_sqlx::v2_history!("id INTEGER PRIMARY KEY AUTOINCREMENT", "INTEGER");

/// `(version, description, statements)`, applied in order. (Version 4 is
/// PostgreSQL's wake-up trigger; SQLite has none.)
pub(crate) const MIGRATIONS: &[postbox_sqlx::Migration] =
    postbox_sqlx::migrations!(partial_indexes;);

/// Version 9: the runtime controls (`postbox_sqlx::v9_controls!`).
pub(crate) const V9_CONTROLS: &[&str] =
    postbox_sqlx::v9_controls!("id INTEGER PRIMARY KEY AUTOINCREMENT");

/// Version 10: the relay registry (`postbox_sqlx::v10_relays!`).
pub(crate) const V10_RELAYS: &[&str] = postbox_sqlx::v10_relays!("");

/// Version 11: sampling (`postbox_sqlx::v11_sampling!`).
pub(crate) const V11_SAMPLING: &[&str] = postbox_sqlx::v11_sampling!("");

postbox_sqlx::control_plane_statements!(now: now_ms!(), "?1", "?2", "?3", "?4", "?5", "?6", "?7", "?8", "?9");

/// The outbox table's indexes (`postbox_sqlx::v5_partial_indexes!`).
pub(crate) const INDEXES: &[&str] = postbox_sqlx::partial_indexes!();

/// The index each claim query is written for.
pub(crate) const CLAIM_INDEXES: [postbox_sqlx::dialect::ClaimIndex; 4] =
    postbox_sqlx::PARTIAL_CLAIM_INDEXES;

/// The index [`ARCHIVE_PICK`] is written for.
pub(crate) const ARCHIVE_INDEX: &str = postbox_sqlx::PARTIAL_ARCHIVE_INDEX;

/// Version 5: one partial index per status (`postbox_sqlx::v5_partial_indexes!`),
/// then the indexes they replace are dropped (one per statement in SQLite).
pub(crate) const V5_INDEXES: &[&str] = postbox_sqlx::v5_partial_indexes!(
    "DROP INDEX IF EXISTS {table}_claim_retry_idx",
    "DROP INDEX IF EXISTS {table}_claim_lease_idx",
    "DROP INDEX IF EXISTS {table}_status_updated_idx",
    "DROP INDEX IF EXISTS {table}_event_id_idx",
    "DROP INDEX IF EXISTS {table}_aggregate_idx",
    "DROP INDEX IF EXISTS {table}_status_id_idx",
);

/// The statements the engine runs, by the name it knows them by (each
/// field of [`postbox_sqlx::Statements`] is the constant of that name here).
pub(crate) const STATEMENTS: postbox_sqlx::Statements = postbox_sqlx::statements!();

/// One app_code's branch of the idle probe (`RelayStore::due`; the
/// indexes each sub-query probes: `postbox_sqlx::due_branch!`).
pub(crate) const DUE_BRANCH: &str = postbox_sqlx::due_branch!("TEXT", now_ms!());

/// The optional aggregate index (`postbox migrate --aggregate-index`).
pub(crate) const CREATE_AGGREGATE_INDEX: &[&str] =
    &["CREATE INDEX IF NOT EXISTS {name} ON {on} (app_code, aggregate_id, id)"];

/// Drops it.
pub(crate) const DROP_AGGREGATE_INDEX: &str = "DROP INDEX IF EXISTS {name}";
