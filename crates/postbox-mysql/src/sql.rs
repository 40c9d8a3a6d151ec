//! Every statement the MySQL / MariaDB backend runs. `{table}` is replaced by
//! the validated table name, `{archive}` by its archive twin, once per
//! store. The other pieces assembled at run time are `{ids}`, a list of
//! `?` placeholders rendered by [`in_list`] (MySQL has no array parameter),
//! and `{filters}`, the predicates of a replay's given filters
//! (`postbox_sqlx::filter_query`). Each claim names the index it relies on.
//!
//! The engine binds each shared statement's values in one order (see
//! `postbox_sqlx::Statements`); a plain `?` takes the next value that is
//! not the list, `{ids}` the list. Where MySQL's text reads them in
//! another order or twice, the placeholder is numbered (`?2`: the engine's
//! second value) and `MySqlDialect::expand` sends plain `?` in that order.

use postbox_sqlx::dialect::Migration;
use postbox_sqlx::{columns, head_of_aggregate, Statements};

/// The database clock in epoch milliseconds. `NOW(3)` is fixed for one
/// statement. sqlx sessions run with `time_zone = '+00:00'`, so the
/// local-time round trip through `UNIX_TIMESTAMP` has no DST ambiguity.
macro_rules! now_ms {
    () => {
        "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)"
    };
}

/// Most placeholders put into one `IN (…)` list; longer id lists are split
/// into several statements.
pub(crate) const MAX_IN_LIST: usize = 1024;

/// How many placeholders to render for `n` ids: the next power of two, so
/// that the few distinct statement texts stay in sqlx's prepared-statement
/// cache. The caller binds the last id again to fill the padding (a repeated
/// value in `IN (…)` changes nothing).
pub(crate) fn padded_len(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

/// Replaces `{ids}` in `sql` with `n` comma-separated `?` placeholders. This
/// and the table name are the only SQL built at run time; no value is ever
/// spliced in.
pub(crate) fn in_list(sql: &str, n: usize) -> String {
    debug_assert!(n > 0, "an empty IN list is a syntax error");
    let mut marks = String::with_capacity(n * 3);
    for i in 0..n {
        if i > 0 {
            marks.push_str(", ");
        }
        marks.push('?');
    }
    sql.replace("{ids}", &marks)
}

pub(crate) const NOW_MS: &str = concat!("SELECT ", now_ms!());

/// Enqueue inside the caller's transaction. A duplicate `(app_code,
/// event_id)` fails with error 1062; MySQL undoes only that statement, so the
/// caller's transaction stays usable.
pub(crate) const INSERT_EVENT: &str = "INSERT INTO {table} \
     (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers) \
     VALUES (?, ?, ?, ?, ?, ?, ?)";

/// Run before the claim transaction starts: read-committed locking reads
/// take no gap locks, so a claim never blocks producers' inserts.
pub(crate) const CLAIM_ISOLATION: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";
/// [`CLAIM_ISOLATION`] for every transaction of a session: the relay's own
/// connections.
pub(crate) const SESSION_ISOLATION: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// Claim step 1: lock up to `limit` rows of a tenant (bound in that
/// order: tenant, limit) that `$pick` selects, in the order `$order`,
/// skipping rows another relay holds, and read them with the database
/// clock (`db_now_ms`). Pending and due rows: `postbox_sqlx::claims_in_retry_order!`.
macro_rules! claim {
    ($from:literal, $pick:expr, $order:literal) => {
        concat!(
            "SELECT ",
            columns!(),
            ", ",
            now_ms!(),
            " AS db_now_ms FROM ",
            $from,
            " WHERE app_code = ? AND ",
            $pick,
            " ORDER BY ",
            $order,
            " LIMIT ? FOR UPDATE SKIP LOCKED"
        )
    };
}

// Every claim reads `{table}_due_idx (app_code, status, next_retry_at_ms,
// event_type, id)` (schema version 8, see `V8_DUE_INDEX`) in its order:
// due retries and expired leases by when they fell due.
//
// The per-aggregate claims find heads through `{table}_head_idx` (schema
// version 7, [`V7_HEAD_INDEX`]), named: MariaDB's planner otherwise may
// read an aggregate's events through `{table}_due_idx`, every open row of
// the app_code per candidate. Its key is the virtual column
// `open_aggregate_id` (the aggregate while the row is open, else NULL: a
// partial index), then `aggregate_seq` (the version, NULL last), then id.
postbox_sqlx::claims_in_retry_order!(claim, now: now_ms!(), head: (
    "open_aggregate_id", "", "p.aggregate_seq", "FORCE INDEX ({table}_head_idx)"
), order: "next_retry_at_ms, event_type, id");

/// Pending rows whose type compares to the one bound by `$op`, read in
/// `{table}_due_idx`'s order (see [`PENDING_FIRST`]).
macro_rules! pending_rows {
    ($op:literal) => {
        concat!(
            "SELECT id, event_type FROM {table} \
             WHERE app_code = ? AND status = 'pending' AND next_retry_at_ms = 0 AND event_type ",
            $op,
            " ? ORDER BY next_retry_at_ms, event_type, id LIMIT ?"
        )
    };
}

/// Fair claiming across event types (`postbox_sqlx::fair_pending!`), MySQL's
/// way. MySQL has no `LATERAL`, and it seeks a correlated bound only by
/// equality, so the one-statement form would read each type's whole
/// backlog. The claim reads the candidates first, without locking,
/// through `{table}_due_idx`, whose pending entries are ordered by type,
/// then id (pending rows have `next_retry_at_ms = 0`): [`PENDING_FIRST`]
/// and [`PENDING_AFTER`] read up to the batch size from the start of the
/// first type (after a given type), [`PENDING_OF_TYPE`] one type's oldest
/// rows. The engine deals them round-robin (`MySqlDialect::claim`), then
/// [`CLAIM_PENDING`] locks them in that order. Binds: tenant, type, limit.
pub(crate) const PENDING_FIRST: &str = pending_rows!(">=");

/// [`PENDING_FIRST`] for the types after the one bound.
pub(crate) const PENDING_AFTER: &str = pending_rows!(">");

/// Pending rows whose `next_retry_at_ms` a producer set (a plain `INSERT`
/// writing a "due at" time): the candidate reads seek the pending rows at
/// 0 only, so these were never claimed (PostgreSQL and SQLite order by the
/// column and take them). A claim that found no candidate sets up to 1,000
/// of them to 0 for the next; when there are none, one probe of
/// `{table}_due_idx` that finds nothing and writes nothing.
pub(crate) const PENDING_UNDUE: &str =
    "UPDATE {table} FORCE INDEX ({table}_due_idx) SET next_retry_at_ms = 0 \
     WHERE app_code = ? AND status = 'pending' AND next_retry_at_ms <> 0 LIMIT 1000";

/// The oldest pending rows of one type (see [`PENDING_FIRST`]).
pub(crate) const PENDING_OF_TYPE: &str = pending_rows!("=");

/// Claim step 1 for new rows: lock up to `limit` of the candidates (a JSON
/// array of ids, bound first, in the dealt order), skipping those another
/// relay holds. The candidates are read in the array's order (the join is
/// `STRAIGHT_JOIN`, and no `ORDER BY` makes MySQL read them all first), so
/// the limit keeps the first that are free. Primary key lookups.
pub(crate) const CLAIM_PENDING: &str = concat!(
    "SELECT ",
    columns!(),
    ", ",
    now_ms!(),
    " AS db_now_ms FROM JSON_TABLE(?, '$[*]' COLUMNS (fid BIGINT PATH '$')) k \
     STRAIGHT_JOIN {table} FORCE INDEX (PRIMARY) ON id = k.fid \
     WHERE app_code = ? AND status = 'pending' LIMIT ? FOR UPDATE SKIP LOCKED"
);

/// [`CLAIM_PENDING`] for `ordering = "per_aggregate"`: the pending heads
/// among the candidates `postbox_sqlx::head_candidates!` describes, found
/// in MariaDB's own way.
///
/// (1) Heads of aggregates with open events, in key order, passing over
/// those whose head cannot go (in flight, waiting for a retry, of a paused
/// type), up to [`HELD_SCAN`] × limit aggregates, until 2 × limit heads
/// that can go are found. MariaDB seeks a correlated bound only by
/// equality, so the recursive scan other databases use would read the
/// index from the app_code's start (every delivered row's NULL key) per
/// step; instead `GROUP BY` over the head index reads it in order, index
/// only, up to its limit (each aggregate's lowest `aggregate_seq`, then the
/// lowest id at it by one equality probe), and each head is checked by
/// primary key. Its cost is the open rows of those aggregates (26 ms at
/// 26,000 pending in 100 aggregates), not the delivered history: at 5,000
/// aggregates of 4 open events this part of the claim took 3–4 ms with
/// none held and 4–7 ms with 3,000 held (the higher figures measured
/// beside a CI run).
/// Counting the held aggregates among the first 2 × limit (0.7 ms) made a
/// free aggregate past them wait as long as they were held; an
/// early-stopping `HAVING` (2 ms) read every open row of the tenant when
/// few heads could go. `s0` carries a `LIMIT` of no effect so that MariaDB
/// materializes it: merged into the check that reads it, the prepared
/// statement fails from its second execution on ("Unknown column 'g.a'",
/// MariaDB 10.11). The check is a scalar subquery, one primary-key probe
/// per head: as `EXISTS` MariaDB may turn it into a semi-join that scans
/// the outbox (it did on an empty table, failing `doctor`'s plan check).
/// The `GROUP BY` names the outbox without an alias: `doctor` finds the
/// statement's read of the head index by the table's name.
///
/// (2) The pending rows a plain claim would take (dealt across types,
/// the paused ones read past: `MySqlDialect::claim`'s candidate reads,
/// bound as a JSON array), counting only heads and events without an
/// aggregate: the first 2 × limit of them in the dealt order (the join
/// stops at its limit). Read here in `{table}_due_idx`'s order (by type,
/// then id), a paused type that sorts first filled them all, and an event
/// without an aggregate of any other type waited as long as the pause.
/// When the claim comes back short it runs once more on candidates read
/// [`FOLLOWER_SCAN`] batches deep per type, all of them dealt: taking the
/// oldest batch of each type and keeping its heads, the followers of held
/// aggregates filled it, and an event without an aggregate behind them
/// waited as long as they were held.
///
/// The candidates are a derived table joined to the outbox by primary
/// key: as `c.id IN (…)` MariaDB ran the union once per pending row.
/// Reads inside it are not locking: a head another relay holds is
/// skipped by the outer `SKIP LOCKED` and never replaced by the event
/// after it. Binds in the order of [`PENDING_ORDERED_BINDS`].
pub(crate) const CLAIM_PENDING_ORDERED: &str = concat!(
    "SELECT ",
    columns!(),
    ", ",
    now_ms!(),
    " AS db_now_ms FROM (\
       SELECT s1.head_id FROM (SELECT s0.head_id FROM (\
         SELECT (SELECT MIN(h.id) FROM {table} h FORCE INDEX ({table}_head_idx) \
             WHERE h.app_code = ? AND h.open_aggregate_id = g.a AND h.aggregate_seq = g.s) AS head_id \
           FROM (SELECT open_aggregate_id AS a, MIN(aggregate_seq) AS s \
             FROM {table} FORCE INDEX ({table}_head_idx) \
             WHERE app_code = ? AND open_aggregate_id IS NOT NULL \
             GROUP BY open_aggregate_id LIMIT ?) g LIMIT 18446744073709551615) s0 \
         WHERE (SELECT COUNT(*) FROM {table} x WHERE x.id = s0.head_id AND x.status = 'pending' \
           AND NOT JSON_CONTAINS(?, JSON_QUOTE(x.event_type))) > 0 \
         LIMIT ?) s1 \
       UNION \
       SELECT s2.id FROM (SELECT o.id FROM JSON_TABLE(?, '$[*]' COLUMNS (fid BIGINT PATH '$')) d \
           STRAIGHT_JOIN {table} o FORCE INDEX (PRIMARY) ON o.id = d.fid \
         WHERE o.aggregate_id IS NULL OR o.id = (SELECT p.id FROM {table} p FORCE INDEX ({table}_head_idx) \
           WHERE p.app_code = o.app_code AND p.open_aggregate_id = o.aggregate_id \
           ORDER BY p.aggregate_seq, p.id LIMIT 1) \
         LIMIT ?) s2\
     ) k STRAIGHT_JOIN {table} c ON c.id = k.head_id \
     WHERE c.app_code = ? AND c.status = 'pending' \
       AND NOT JSON_CONTAINS(?, JSON_QUOTE(c.event_type)) \
     ORDER BY c.next_retry_at_ms, c.id LIMIT ? FOR UPDATE SKIP LOCKED"
);

/// How many batches' worth of aggregates the per-aggregate claim passes
/// over looking for heads that can go (`postbox_sqlx::held_scan!`).
const HELD_SCAN: i64 = 8;

/// How many batches' worth of each type's oldest pending rows the
/// per-aggregate claim that came back short reads for heads and events
/// without an aggregate (`postbox_sqlx::follower_scan!`).
pub(crate) const FOLLOWER_SCAN: i64 = 2;

/// What a `?` of a claim statement takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bind {
    /// The tenant.
    Tenant,
    /// `n` × the batch size.
    Limit(i64),
    /// The event types paused by a runtime control, as a JSON array.
    Skipped,
    /// The pending rows a plain claim would take, dealt across types
    /// (`MySqlDialect::claim`), as a JSON array of ids.
    Dealt,
}

/// What each `?` of [`CLAIM_PENDING_ORDERED`] takes, in order. A paused
/// type's head is left out, and still holds its aggregate back.
pub(crate) const PENDING_ORDERED_BINDS: [Bind; 10] = [
    Bind::Tenant,
    Bind::Tenant,
    Bind::Limit(HELD_SCAN),
    Bind::Skipped,
    Bind::Limit(2),
    Bind::Dealt,
    Bind::Limit(2),
    Bind::Tenant,
    Bind::Skipped,
    Bind::Limit(1),
];

/// What each `?` of a claim statement takes (see [`PENDING_ORDERED_BINDS`]):
/// every other claim binds the tenant, then the limit.
pub(crate) fn claim_binds(source: postbox_core::ClaimSource, ordered: bool) -> &'static [Bind] {
    if source == postbox_core::ClaimSource::Pending && ordered {
        &PENDING_ORDERED_BINDS
    } else {
        &[Bind::Tenant, Bind::Limit(1)]
    }
}

/// Take over rows whose lease expired (step 1;
/// `postbox_sqlx::expired_lease_pick!`). Index: `{table}_due_idx`.
pub(crate) const CLAIM_EXPIRED_LEASES: &str = claim!(
    "{table}",
    postbox_sqlx::expired_lease_pick!(now_ms!()),
    "next_retry_at_ms, event_type, id"
);

/// The claims, in the order `ClaimStatements::render` takes them.
pub(crate) const CLAIMS: [&str; 5] = postbox_sqlx::claims!();

/// Claim step 2 for pending and due rows, locked by step 1: the lease.
/// `lock_until_ms` is computed once per claim, so it is the batch's fence;
/// `next_retry_at_ms` takes the same value (MySQL assigns left to right),
/// which `{table}_due_idx` orders expired leases by.
/// Primary key lookups. Every `UPDATE … WHERE id …` names the primary key:
/// on a small table MariaDB would otherwise scan the whole table, reaching
/// rows a producer's open transaction holds (run at READ COMMITTED, the
/// scan skips them, but a range read never meets them at all).
pub(crate) const CLAIM_TAKE: &str =
    "UPDATE {table} FORCE INDEX (PRIMARY) SET status = 'delivering', worker_id = ?, \
       lock_until_ms = ?, next_retry_at_ms = lock_until_ms, updated_at_ms = ? \
     WHERE id IN ({ids})";

/// Claim step 2 for expired leases; the lost attempt is counted. MySQL
/// assigns left to right, so `last_error` reads the old `worker_id` before
/// it is overwritten. Primary key lookups.
pub(crate) const CLAIM_TAKE_EXPIRED: &str =
    "UPDATE {table} FORCE INDEX (PRIMARY) SET retry_count = retry_count + 1, \
       last_error = CONCAT('lease expired while held by ', COALESCE(worker_id, '?')), \
       status = 'delivering', worker_id = ?, lock_until_ms = ?, next_retry_at_ms = lock_until_ms, \
       updated_at_ms = ? \
     WHERE id IN ({ids})";

/// Fenced: only rows still leased by this claim. Primary key lookups.
/// `next_retry_at_ms` becomes the time of delivery, which archiving and
/// the chart read through `{table}_due_idx`.
pub(crate) const MARK_DELIVERED: &str = concat!(
    "UPDATE {table} FORCE INDEX (PRIMARY) SET status = 'delivered', lock_until_ms = 0, last_error = NULL, \
       next_retry_at_ms = ",
    now_ms!(),
    ", updated_at_ms = ",
    now_ms!(),
    " \
     WHERE id IN ({ids}) AND status = 'delivering' AND worker_id = ? AND lock_until_ms = ?"
);

/// Fenced failed attempt: `retryable` (due after a backoff) or `failed`.
pub(crate) const MARK_FAILED: &str = concat!(
    "UPDATE {table} FORCE INDEX (PRIMARY) SET status = ?, retry_count = ?, next_retry_at_ms = ",
    now_ms!(),
    " + ? - MOD(id, ? + 1), \
       lock_until_ms = 0, delivered_to = ?, last_error = ?, updated_at_ms = ",
    now_ms!(),
    " \
     WHERE id IN ({ids}) AND status = 'delivering' AND worker_id = ? AND lock_until_ms = ?"
);

/// Fenced release at shutdown: due again at once, no attempt counted.
pub(crate) const RELEASE: &str =
    concat!(
    "UPDATE {table} FORCE INDEX (PRIMARY) SET status = CASE WHEN retry_count = 0 THEN 'pending' ELSE 'retryable' END, \
       next_retry_at_ms = 0, lock_until_ms = 0, worker_id = NULL, updated_at_ms = ", now_ms!(), " \
     WHERE id IN ({ids}) AND status = 'delivering' AND worker_id = ? AND lock_until_ms = ?"
);

/// Fenced, no attempt counted: a publisher was behind, so the rows wait
/// for it as `retryable`, due after the first bind (ms), keeping what the
/// others confirmed.
pub(crate) const DEFER: &str = concat!(
    "UPDATE {table} FORCE INDEX (PRIMARY) SET status = 'retryable', next_retry_at_ms = ",
    now_ms!(),
    " + ?, \
       lock_until_ms = 0, worker_id = NULL, delivered_to = ?, last_error = ?, updated_at_ms = ",
    now_ms!(),
    " \
     WHERE id IN ({ids}) AND status = 'delivering' AND worker_id = ? AND lock_until_ms = ?"
);

/// Counts of one tenant's rows by status (`postbox_sqlx::count_open!`),
/// each a range of `{table}_due_idx`; delivered rows counted up to a cap,
/// then estimated ([`DELIVERED_ESTIMATE`]).
pub(crate) const COUNT_OPEN: &str = postbox_sqlx::count_open!("?1");

/// The optimizer's estimate of one tenant's delivered rows: `EXPLAIN` of a
/// range read of `{table}_due_idx`, whose `rows` InnoDB estimates by
/// diving into the index (a few page reads at any size).
pub(crate) const DELIVERED_ESTIMATE: &str = "EXPLAIN SELECT 1 FROM {table} \
     WHERE app_code = ? AND status IN ('delivered', 'published')";

/// Oldest pending row and due retries (`postbox_sqlx::backlog!`).
///
/// The oldest pending row is the lowest of each pending type's first
/// entry in `{table}_due_idx (app_code, status, next_retry_at_ms,
/// event_type, id)`, which MariaDB reads one entry per type ("Using index
/// for group-by", a loose index scan) only when no column before
/// `event_type` is a single equality: the tenant and the time as ranges of
/// one (`x >= v AND x <= v`), the status as a list of two (`''` is no
/// status; an adopted table's legacy values join the list). With
/// equalities it read every pending entry, on every stats poll (the
/// monitoring load of the seed's incident, growing with the backlog).
pub(crate) const BACKLOG: &str = postbox_sqlx::backlog!(
    "?1",
    now_ms!(),
    oldest: "(SELECT MIN(f.first_id) FROM (SELECT MIN(id) AS first_id FROM {table} \
       WHERE app_code >= ?1 AND app_code <= ?1 AND status IN ('pending', '') \
         AND next_retry_at_ms >= 0 AND next_retry_at_ms <= 0 \
       GROUP BY app_code, status, next_retry_at_ms, event_type) f)"
);

/// `list` without its predicates (`postbox_sqlx::list_select!`).
pub(crate) const LIST_SELECT: &str = postbox_sqlx::list_select!();

/// The smallest app_code above ?, or NULL: one probe of `{table}_event_uq
/// (app_code, event_id)` ("Select tables optimized away"). The engine
/// lists every app_code with one probe each. (A `DISTINCT` is read as a
/// loose index scan only while the statistics say there are few
/// app_codes: just after a bulk load MariaDB walked the whole index.)
pub(crate) const NEXT_APP_CODE: &str = "SELECT MIN(app_code) FROM {table} WHERE app_code > ?";

/// Archived rows of one event: the app_codes (`{ids}` list), then the
/// event id (`postbox_sqlx::find!`).
pub(crate) const FIND_ARCHIVED: &str = postbox_sqlx::find!("{archive}", "app_code IN ({ids})", "?");

/// Rows delivered per minute since a time, for the dashboard's chart.
/// Index: `{table}_due_idx (app_code, status, next_retry_at_ms, id)`, a
/// range read of the last hour's delivered rows only (a delivered row's
/// `next_retry_at_ms` is its time of delivery).
pub(crate) const DELIVERED_PER_MINUTE: &str =
    "SELECT (next_retry_at_ms DIV 60000) * 60000 AS minute_ms, COUNT(*) AS delivered \
     FROM {table} WHERE app_code = ? AND status IN ('delivered', 'published') AND next_retry_at_ms >= ? \
     GROUP BY minute_ms ORDER BY minute_ms";

/// By event id: the app_codes with rows (`{ids}` list), then the event id
/// (`postbox_sqlx::find!`).
pub(crate) const FIND: &str = postbox_sqlx::find!("{table}", "app_code IN ({ids})", "?");

/// Rows by primary key: what a replay wrote, read back (MySQL has no
/// `UPDATE … RETURNING`).
pub(crate) const SELECT_IDS: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM {table} WHERE id IN ({ids}) ORDER BY id"
);

/// Rows a replay by event ids would touch (the ids, then app_code, read twice).
pub(crate) const REPLAY_IDS_DRY: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM {table} \
     WHERE event_id IN ({ids}) AND app_code = ?2 AND status <> 'delivering' ORDER BY id"
);

/// Replay by event ids, step 1: lock the rows.
pub(crate) const REPLAY_IDS_LOCK: &str = "SELECT id FROM {table} \
     WHERE event_id IN ({ids}) AND app_code = ?2 AND status <> 'delivering' \
     ORDER BY id FOR UPDATE";

/// Rows a replay by filter would touch. `{filters}`: a predicate per given
/// filter (`postbox_sqlx::filter_query`), so the plan uses the index those
/// lead, e.g. `{table}_due_idx (app_code, status, …)` for a tenant and
/// status.
pub(crate) const REPLAY_FILTER_DRY: &str = postbox_sqlx::replay_filter_dry!();

/// Replay by filter, step 1: lock the rows.
pub(crate) const REPLAY_FILTER_LOCK: &str = "SELECT id FROM {table} \
     WHERE status <> 'delivering'{filters} ORDER BY id FOR UPDATE";

/// Replay step 2 (by ids or filter), on the locked rows: back to pending
/// with retry_count 0, keeping event_id. Primary key lookups. Fanout
/// progress: a `delivered` row is sent to every publisher again
/// (backtracking), any other keeps the publishers that confirmed it, so
/// only the others get it. (`delivered_to` comes first: MySQL assigns left
/// to right, and it reads the old status.)
pub(crate) const REPLAY_IDS: &str = concat!(
    "UPDATE {table} FORCE INDEX (PRIMARY) SET delivered_to = CASE WHEN status IN ('delivered', 'published') \
       THEN NULL ELSE delivered_to END, \
       status = 'pending', retry_count = 0, next_retry_at_ms = 0, lock_until_ms = 0, \
       worker_id = NULL, replay_count = replay_count + 1, \
       updated_at_ms = ",
    now_ms!(),
    " \
     WHERE id IN ({ids})"
);

/// A replay that picked its targets: the replayed rows' ids, then
/// `delivered_to` (the publishers *not* targeted).
pub(crate) const REPLAY_SET_DELIVERED_TO: &str =
    "UPDATE {table} SET delivered_to = ?2 WHERE id IN ({ids})";

/// Archived rows a time-range replay would bring back: those not already in
/// the live table (archived rows are all `delivered`).
pub(crate) const UNARCHIVE_FILTER_DRY: &str = concat!(
    "SELECT ", columns!(), " FROM {archive} a \
     WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE t.app_code = a.app_code AND t.event_id = a.event_id) \
       AND NOT EXISTS (SELECT 1 FROM {table} t WHERE t.id = a.id){filters} \
     ORDER BY id"
);

/// Time-range replay, archive step 1: lock the archived rows to bring back.
pub(crate) const UNARCHIVE_FILTER_LOCK: &str = "SELECT id FROM {archive} a \
     WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE t.app_code = a.app_code AND t.event_id = a.event_id) \
       AND NOT EXISTS (SELECT 1 FROM {table} t WHERE t.id = a.id){filters} \
     ORDER BY id FOR UPDATE";

/// Archive step 2: copy them into the live table as pending (keeping id and
/// event_id).
pub(crate) const UNARCHIVE_IDS: &str = concat!(
    postbox_sqlx::unarchive_insert!(now_ms!()),
    " FROM {archive} WHERE id IN ({ids})"
);

/// Archive step 3: remove from the archive the rows a replay brought back.
pub(crate) const DELETE_UNARCHIVED: &str = "DELETE FROM {archive} WHERE id IN ({ids})";

// ---- attempt history (see `postbox_sqlx::history_writes!`) ----

postbox_sqlx::history_writes! {
    now_ms!(), rows: "id IN ({ids})", origin: "?2", targets: "?3",
    failed: ", ?2, ?3, ?4, ?5 FROM {table} \
       WHERE id IN ({ids}) AND worker_id = ?6 AND lock_until_ms = 0 AND retry_count = ?3"
}

/// Events of rows `{ids}` holding more than `?` entries. Index:
/// `{table}_history_event_idx (event_id, app_code, id)`.
pub(crate) const HISTORY_OVER_LIMIT: &str = "SELECT h.event_id, h.app_code \
     FROM {table} t JOIN {table}_history h ON h.event_id = t.event_id AND h.app_code = t.app_code \
     WHERE t.id IN ({ids}) GROUP BY h.event_id, h.app_code HAVING COUNT(*) > ?";

/// Keeps the newest entries of one event (event_id, app_code, then both
/// again and the limit − 1). The derived table is materialised, so MySQL
/// accepts reading the table it deletes from.
pub(crate) const HISTORY_PRUNE: &str = "DELETE FROM {table}_history \
     WHERE event_id = ? AND app_code = ? AND id < (SELECT id FROM ( \
       SELECT id FROM {table}_history WHERE event_id = ? AND app_code = ? \
       ORDER BY id DESC LIMIT 1 OFFSET ?) AS keep_from)";

/// An event's history, oldest first. Index: `{table}_history_event_idx`.
pub(crate) const HISTORY: &str = "SELECT at_ms, kind, attempt, publisher, detail \
     FROM {table}_history WHERE event_id = ? ORDER BY id";

// ---- archive ----

/// One archiver per table: a named lock on the archiver's own connection,
/// not waited for (released at the end, or when the session dies).
pub(crate) const ARCHIVE_LOCK: &str = "SELECT GET_LOCK(LEFT(CONCAT('postbox_archive:', ?), 64), 0)";

pub(crate) const ARCHIVE_UNLOCK: &str =
    "SELECT RELEASE_LOCK(LEFT(CONCAT('postbox_archive:', ?), 64))";

/// The rows one archive batch takes (app_code, cut-off twice, batch
/// size): delivered (and legacy `published`) rows last updated before the
/// cut-off. Index: `{table}_due_idx (app_code, status, next_retry_at_ms,
/// id)`, read in its order up to the cut-off (a delivered row's
/// `next_retry_at_ms` is its time of delivery); `updated_at_ms` is
/// checked too, for rows delivered before schema version 5.
macro_rules! archive_pick {
    () => {
        "SELECT id FROM {table} \
         WHERE app_code = ? AND status IN ('delivered', 'published', 'dropped') AND next_retry_at_ms < ? \
           AND updated_at_ms < ? AND NOT EXISTS (SELECT 1 FROM {archive} a WHERE a.id = {table}.id \
             AND (a.app_code <> {table}.app_code OR a.event_id <> {table}.event_id)) LIMIT ?"
    };
}

/// [`ARCHIVE_PICK_LOCK`] without the lock, for `doctor`'s EXPLAIN.
pub(crate) const ARCHIVE_PICK: &str = archive_pick!();

/// The rows of one archive batch, locked for the batch's transaction.
pub(crate) const ARCHIVE_PICK_LOCK: &str = concat!(archive_pick!(), " FOR UPDATE");

/// Archive step 2: copy what the archive lacks (unique `id`; a row already
/// there from an earlier run is skipped). Primary key lookups. Not `INSERT
/// IGNORE`: that also stores a value too long for its column cut short
/// (a warning, strict mode or not), and the live row was then deleted.
pub(crate) const ARCHIVE_COPY: &str = concat!(
    "INSERT INTO {archive} (",
    columns!(),
    ") SELECT ",
    columns!(),
    " FROM {table} WHERE id IN ({ids}) ON DUPLICATE KEY UPDATE id = {archive}.id"
);

/// Archive step 3: delete from the outbox only rows present in the
/// archive, or whose event the archive already holds under another id (an
/// event enqueued again after it was archived, and delivered again): the
/// archived copy is kept, the live duplicate goes, so such rows never stop
/// the archiver. Present means the same event: a row whose id the archive
/// holds for another event (ids reused after a reset) stays in the outbox.
pub(crate) const ARCHIVE_DELETE: &str = "DELETE FROM {table} WHERE id IN ({ids}) \
     AND EXISTS (SELECT 1 FROM {archive} a \
         WHERE a.app_code = {table}.app_code AND a.event_id = {table}.event_id)";

/// `id` in the ids bound first (expanded to one placeholder each).
pub(crate) const ID_LIST: &str = "id IN ({ids})";

/// An insert that leaves alone a row whose key is there, and fails on a
/// value its column cannot hold (`INSERT IGNORE` stored it cut short).
pub(crate) const INSERT_IGNORE: (&str, &str) = ("INSERT INTO", " ON DUPLICATE KEY UPDATE id = id");

/// Which of the event ids `{ids}` of an app_code (bound first) are
/// archived. Index: `{archive}_event_uq (app_code, event_id)`.
pub(crate) const ARCHIVED_EVENT_IDS: &str =
    "SELECT event_id FROM {archive} WHERE app_code = ? AND event_id IN ({ids})";

/// Heads of aggregates held back for long (see `OutboxStore::stuck_aggregates`):
/// app_code, age cut-off in ms, limit. Heads through `{table}_due_idx`
/// (app_code, status), siblings through `{table}_head_idx`.
pub(crate) const STUCK_AGGREGATES: &str = concat!(
    "SELECT c.aggregate_id, c.event_id, c.status, c.retry_count, c.last_error, \
       (",
    now_ms!(),
    " - c.created_at_ms) AS age_ms, \
       (SELECT COUNT(*) FROM {table} w FORCE INDEX ({table}_head_idx) WHERE w.app_code = c.app_code \
          AND w.open_aggregate_id = c.aggregate_id AND w.id <> c.id) AS waiting \
     FROM {table} c \
     WHERE c.app_code = ? AND c.status IN ('retryable', 'delivering') \
       AND c.aggregate_id IS NOT NULL AND c.created_at_ms < ",
    now_ms!(),
    " - ?",
    head_of_aggregate!(c, head: (
        "open_aggregate_id", "", "p.aggregate_seq", "FORCE INDEX ({table}_head_idx)"
    )),
    " AND EXISTS (SELECT 1 FROM {table} w FORCE INDEX ({table}_head_idx) WHERE w.app_code = c.app_code \
          AND w.open_aggregate_id = c.aggregate_id AND w.id <> c.id) \
     ORDER BY c.created_at_ms LIMIT ?"
);

// ---- doctor ----

/// The table's schema version.
pub(crate) const DOCTOR_VERSION: &str =
    "SELECT MAX(version) FROM postbox_schema_migrations WHERE table_name = ?";

/// Tables and indexes of the current database, by name.
pub(crate) const DOCTOR_OBJECTS: &str =
    "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE() \
     UNION SELECT CAST(index_name AS CHAR) FROM information_schema.statistics WHERE table_schema = DATABASE()";

// ---- schema ----

/// Serialises concurrent `migrate` runs (a server-wide named lock, held by
/// one connection; DDL commits implicitly, so no transaction can do this).
/// MySQL refuses lock names over 64 characters; truncating only makes two
/// long table names share a lock.
pub(crate) const MIGRATION_LOCK: &str =
    "SELECT GET_LOCK(LEFT(CONCAT('postbox_migrate:', ?), 64), 60)";

pub(crate) const MIGRATION_UNLOCK: &str =
    "SELECT RELEASE_LOCK(LEFT(CONCAT('postbox_migrate:', ?), 64))";

postbox_sqlx::ledger_statements!(int: "INT", options: " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4", now: now_ms!(), "?", "?", "?");

/// Which of the given tables (`{ids}`: the engine passes a list) exist in
/// the current database.
pub(crate) const EXISTING_TABLES: &str =
    "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
     WHERE table_schema = DATABASE() AND table_name IN ({ids})";

/// The highest id the archive kept, which a recreated outbox table must
/// continue after so that archiving never meets an id already there.
pub(crate) const ARCHIVE_MAX_ID: &str = "SELECT MAX(id) FROM {archive}";

/// How long a migration statement waits for the table's metadata lock
/// (the server's default is a day). An `ALTER TABLE` waiting behind a
/// long transaction on the table (a producer's, a report's) holds back
/// every statement on the table queued after it, producers' `INSERT`s
/// included, for as long as it waits: it gives up after 5 s instead, and
/// `migrate` can be run again at a quieter moment.
pub(crate) const MIGRATION_LOCK_WAIT: &str = "SET SESSION lock_wait_timeout = 5";

/// Gives the pooled connection back with the server's default.
pub(crate) const MIGRATION_LOCK_WAIT_RESET: &str = "SET SESSION lock_wait_timeout = DEFAULT";

/// `(version, description, statements)`, applied in order. MySQL commits
/// implicitly around every DDL statement, so the migration's transaction
/// does not make a run atomic: the named lock
/// ([`MIGRATION_LOCK`]) is held by one connection for the whole run. A
/// run cut short after the server committed a statement but before the
/// ledger recorded its version is re-run: a statement that adds an index
/// or column already there, or drops one already gone, counts as applied
/// when the table has all it makes (`MySqlDialect::applied_before`).
pub(crate) const MIGRATIONS: &[Migration] = postbox_sqlx::migrations!(
    (5, postbox_sqlx::V5_DESCRIPTION, V5_INDEXES),
    (7, postbox_sqlx::V7_DESCRIPTION, V7_HEAD_INDEX),
    (8, postbox_sqlx::V8_DESCRIPTION, V8_DUE_INDEX),
    (9, postbox_sqlx::V9_DESCRIPTION, V9_CONTROLS),
    (10, postbox_sqlx::V10_DESCRIPTION, V10_RELAYS),
    (11, postbox_sqlx::V11_DESCRIPTION, V11_SAMPLING),
);

/// Version 9: the runtime controls (`postbox_sqlx::v9_controls!`).
pub(crate) const V9_CONTROLS: &[&str] =
    postbox_sqlx::v9_controls!("id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY");

/// Version 10: the relay registry (`postbox_sqlx::v10_relays!`).
/// Version 11: sampling's `sample_percent` (one statement: atomic).
/// `dropped` rows are archived through `{table}_due_idx`, which has the
/// status in its key.
pub(crate) const V11_SAMPLING: &[&str] =
    &["ALTER TABLE {table}_controls ADD COLUMN sample_percent INT"];

pub(crate) const V10_RELAYS: &[&str] =
    postbox_sqlx::v10_relays!(" ENGINE=InnoDB DEFAULT CHARSET=utf8mb4");

postbox_sqlx::control_plane_statements!(now: now_ms!(), "?", "?", "?", "?", "?", "?", "?", "?", "?");

/// The outbox table's indexes since version 5 (suffixes).
pub(crate) const INDEXES: &[&str] = &["_due_idx", "_head_idx"];

/// The index each claim query is written for: one for all.
pub(crate) const CLAIM_INDEXES: [postbox_sqlx::dialect::ClaimIndex; 4] =
    postbox_sqlx::dialect::claim_indexes(["_due_idx", "_due_idx", "_due_idx", "_head_idx"]);

/// The index [`ARCHIVE_PICK`] is written for.
pub(crate) const ARCHIVE_INDEX: &str = "_due_idx";

/// Version 5: one index for every status in place of five. InnoDB
/// rewrites a secondary index entry only when a column of that index
/// changes; every state change sets `status`, so every index holding it
/// was rewritten by each of the two updates an event costs (claim, mark):
/// four of them before, one now, as a table with a single claim index.
/// `{table}_due_idx (app_code, status, next_retry_at_ms, id)` serves every
/// claim, the idle probe, the counts, archiving and the chart, because
/// `next_retry_at_ms` is the time a row is next looked at: 0 for pending
/// (insertion order), a retryable row's retry, a delivering row's lease
/// end, a delivered or failed row's time of getting there.
/// `{table}_aggregate_idx` stays (no update changes its columns);
/// `{table}_event_id_idx` goes (`events show` probes `{table}_event_uq`
/// once per app_code). One `ALTER TABLE`: atomic, and MySQL 8 has no
/// `IF [NOT] EXISTS` for indexes.
pub(crate) const V5_INDEXES: &[&str] = &["ALTER TABLE {table} \
       ADD INDEX {table}_due_idx (app_code, status, next_retry_at_ms, id), \
       DROP INDEX {table}_claim_retry_idx, DROP INDEX {table}_claim_lease_idx, \
       DROP INDEX {table}_status_updated_idx, DROP INDEX {table}_event_id_idx, \
       DROP INDEX {table}_status_id_idx"];

/// Version 7: the head index in place of `{table}_aggregate_idx (app_code,
/// aggregate_id, id)`, which held every row, delivered ones included, so
/// a head check read an aggregate's whole history. MariaDB and MySQL have
/// no partial or expression indexes; two virtual (never stored) columns
/// stand in: `open_aggregate_id`, the aggregate while the row is pending,
/// delivering or retryable and NULL after, and `aggregate_seq`, the
/// version with NULL last. `{table}_head_idx (app_code, open_aggregate_id,
/// aggregate_seq, id)` then keeps each open aggregate's events in its
/// order under its key, so the head is the first entry (see
/// `postbox_sqlx::head_of_aggregate!`). Its entry changes once per event
/// (when it is delivered or fails); the index it replaces never changed.
/// Producers' `INSERT`s name their columns and are untouched. One `ALTER
/// TABLE`: atomic.
pub(crate) const V7_HEAD_INDEX: &[&str] = &["ALTER TABLE {table} \
       ADD COLUMN open_aggregate_id VARCHAR(128) AS \
         (CASE WHEN status IN ('pending', 'delivering', 'retryable') THEN aggregate_id END) VIRTUAL, \
       ADD COLUMN aggregate_seq BIGINT AS (COALESCE(aggregate_version, 9223372036854775807)) VIRTUAL, \
       ADD INDEX {table}_head_idx (app_code, open_aggregate_id, aggregate_seq, id), \
       DROP INDEX {table}_aggregate_idx"];

/// Version 8: `{table}_due_idx` gains the event type before the id,
/// `(app_code, status, next_retry_at_ms, event_type, id)`, so a pending
/// claim can read each type's oldest rows ([`PENDING_FIRST`]) and deal the
/// batch across types: a flood of one type no longer holds back another's
/// fresh event. The other statuses keep their order by
/// `next_retry_at_ms` (their claims order by `next_retry_at_ms,
/// event_type, id`, the index's order). Same rows, same writes, a wider
/// key. One `ALTER TABLE`: atomic, and online in InnoDB.
pub(crate) const V8_DUE_INDEX: &[&str] = &["ALTER TABLE {table} \
       DROP INDEX {table}_due_idx, \
       ADD INDEX {table}_due_idx (app_code, status, next_retry_at_ms, event_type, id)"];

/// The shared statements. MySQL has no `UPDATE … RETURNING`: its replay
/// statements lock the rows' ids (`…_LOCK`), and `MySqlDialect::replay_rows`
/// updates them by primary key ([`REPLAY_IDS`], [`UNARCHIVE_IDS`]) and
/// reads them back ([`SELECT_IDS`]). [`HISTORY_PRUNE`] prunes one event
/// (after [`HISTORY_OVER_LIMIT`], see `MySqlDialect::prune_history`).
pub(crate) const STATEMENTS: Statements = shared::STATEMENTS;

/// The engine's names for the statements whose MySQL form differs: the
/// replays lock (see [`STATEMENTS`]).
mod shared {
    use super::*;

    const REPLAY_IDS: &str = REPLAY_IDS_LOCK;
    const REPLAY_FILTER: &str = REPLAY_FILTER_LOCK;
    const UNARCHIVE_FILTER: &str = UNARCHIVE_FILTER_LOCK;

    pub(super) const STATEMENTS: Statements = postbox_sqlx::statements!();
}

/// Version 3: the index the admin API's lists read newest first per tenant
/// and status (keyset pagination by id).
pub(crate) const V3_LIST_INDEX: &[&str] =
    &["CREATE INDEX {table}_status_id_idx ON {table} (app_code, status, id)"];

/// Version 1: the outbox table with its indexes, and the archive twin.
/// Indexes are inline because MySQL 8 has no `CREATE INDEX IF NOT EXISTS`.
/// The expression defaults let other languages write a row with a plain
/// `INSERT` of the seven event columns.
pub(crate) const V1_SCHEMA: &[&str] = &[
    concat!(
        "CREATE TABLE IF NOT EXISTS {table} ( \
           id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, ",
        postbox_sqlx::outbox_columns!(payload: "MEDIUMTEXT", now: now_ms!()),
        ", \
           UNIQUE KEY {table}_event_uq (app_code, event_id), \
           KEY {table}_claim_retry_idx (app_code, status, next_retry_at_ms, created_at_ms, event_id), \
           KEY {table}_claim_lease_idx (app_code, status, lock_until_ms, created_at_ms, event_id), \
           KEY {table}_status_updated_idx (app_code, status, updated_at_ms, event_id), \
           KEY {table}_event_id_idx (event_id), \
           KEY {table}_aggregate_idx (app_code, aggregate_id, id) \
         ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    ),
    concat!(
        "CREATE TABLE IF NOT EXISTS {archive} ( \
           id BIGINT NOT NULL PRIMARY KEY, ",
        postbox_sqlx::outbox_columns!(payload: "MEDIUMTEXT", now: now_ms!()),
        ", \
           UNIQUE KEY {archive}_event_uq (app_code, event_id), \
           KEY {archive}_created_idx (app_code, created_at_ms) \
         ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    ),
];

/// Version 2: the bounded attempt history, keyed by event id so that it
/// survives archiving of the outbox row.
pub(crate) const V2_HISTORY: &[&str] = &["CREATE TABLE IF NOT EXISTS {table}_history ( \
       id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
       app_code VARCHAR(64) NOT NULL, \
       event_id VARCHAR(64) NOT NULL, \
       at_ms BIGINT NOT NULL, \
       kind VARCHAR(16) NOT NULL, \
       attempt INT NOT NULL, \
       publisher VARCHAR(512) NULL, \
       detail TEXT NULL, \
       KEY {table}_history_event_idx (event_id, app_code, id) \
     ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"];

/// One app_code's branch of the idle probe (`RelayStore::due`; the
/// indexes each sub-query probes: `postbox_sqlx::due_branch!`).
pub(crate) const DUE_BRANCH: &str = postbox_sqlx::due_branch!("CHAR(64)", now_ms!());

/// The optional aggregate index (`postbox migrate --aggregate-index`), an
/// online build (`LOCK=NONE`): the outbox's writers never wait for it.
/// MySQL 8 has no `IF NOT EXISTS` here; the engine creates only a missing one.
pub(crate) const CREATE_AGGREGATE_INDEX: &[&str] =
    &["CREATE INDEX {name} ON {on} (app_code, aggregate_id, id) ALGORITHM=INPLACE LOCK=NONE"];

/// Drops it (InnoDB only updates the dictionary: no table rebuild).
pub(crate) const DROP_AGGREGATE_INDEX: &str = "DROP INDEX {name} ON {on}";

/// `doctor --scans`: whether `performance_schema` is on.
pub(crate) const PERFORMANCE_SCHEMA_ON: &str = "SELECT @@performance_schema + 0";

/// `doctor --scans`: statements run since the digest table filled up
/// (`performance_schema_digests_size`), each counted in its one row of no
/// digest instead of its own.
pub(crate) const STATEMENTS_UNRECORDED: &str =
    "SELECT CAST(COALESCE(SUM(COUNT_STAR), 0) AS SIGNED) \
     FROM performance_schema.events_statements_summary_by_digest WHERE DIGEST IS NULL";

/// `doctor --scans`: the statement digests of this schema whose text names
/// the table (`?`), the most time first (timers are in picoseconds).
pub(crate) const STATEMENT_STATS: &str =
    "SELECT DIGEST_TEXT AS query, CAST(COUNT_STAR AS SIGNED) AS calls, \
       CAST(SUM_TIMER_WAIT / 1000000 AS SIGNED) AS total_us, \
       CAST(SUM_ROWS_SENT + SUM_ROWS_AFFECTED AS SIGNED) AS rows_returned, \
       CAST(SUM_ROWS_EXAMINED AS SIGNED) AS rows_examined, CAST(NULL AS SIGNED) AS blocks \
     FROM performance_schema.events_statements_summary_by_digest \
     WHERE SCHEMA_NAME = DATABASE() AND LOCATE(LOWER(?), LOWER(DIGEST_TEXT)) > 0 \
     ORDER BY SUM_TIMER_WAIT DESC LIMIT 500";

/// `postbox adopt` (and, by its first column, `migrate`'s check of a run
/// cut short): each column of a table: name, NULL allowed, default,
/// length in characters and bytes. (A `NOT NULL` column without a default
/// has a NULL `column_default` too, and a nullable one's default may be
/// NULL: both count as none.)
pub(crate) const ADOPT_COLUMNS: &str =
    "SELECT CAST(column_name AS CHAR), CAST(is_nullable = 'YES' AS SIGNED), \
       CAST(column_default IS NOT NULL AND column_default <> 'NULL' AS SIGNED), \
       CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) \
     FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = ?";

/// `postbox adopt` (and `migrate`'s check of a run cut short): the table's
/// secondary indexes.
pub(crate) const ADOPT_INDEXES_OF: &str =
    "SELECT DISTINCT CAST(index_name AS CHAR) FROM information_schema.statistics \
     WHERE table_schema = DATABASE() AND table_name = ? AND index_name <> 'PRIMARY' ORDER BY 1";

/// `postbox adopt`: the outbox table's indexes as the migrations leave
/// them (versions 1, 7 and 8), each built in place while the table takes
/// writes (`LOCK=NONE`). The head index comes with its two virtual columns
/// ([`V7_HEAD_INDEX`]).
pub(crate) const ADOPT_INDEXES: &[(&str, &[&str])] = &[
    (
        "_event_uq",
        &["ALTER TABLE {table} ADD UNIQUE INDEX {table}_event_uq (app_code, event_id), \
           ALGORITHM=INPLACE, LOCK=NONE"],
    ),
    (
        "_due_idx",
        &["ALTER TABLE {table} ADD INDEX {table}_due_idx (app_code, status, next_retry_at_ms, event_type, id), \
           ALGORITHM=INPLACE, LOCK=NONE"],
    ),
    (
        "_head_idx",
        // MariaDB adds virtual columns in place only on their own.
        &[
            "ALTER TABLE {table} \
               ADD COLUMN IF NOT EXISTS open_aggregate_id VARCHAR(128) AS \
                 (CASE WHEN status IN ('pending', 'delivering', 'retryable') THEN aggregate_id END) VIRTUAL, \
               ADD COLUMN IF NOT EXISTS aggregate_seq BIGINT AS (COALESCE(aggregate_version, 9223372036854775807)) VIRTUAL, \
               ALGORITHM=INPLACE, LOCK=NONE",
            "ALTER TABLE {table} ADD INDEX {table}_head_idx (app_code, open_aggregate_id, aggregate_seq, id), \
               ALGORITHM=INPLACE, LOCK=NONE",
        ],
    ),
];

/// A missing column, added in place while the table takes writes.
pub(crate) fn add_column(table: &str, _column: &str, definition: &str) -> Vec<String> {
    vec![format!(
        "ALTER TABLE {table} ADD COLUMN {definition}, ALGORITHM=INPLACE, LOCK=NONE"
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_placeholder_lists() {
        assert_eq!(
            in_list("x IN ({ids}) AND y = ?", 3),
            "x IN (?, ?, ?) AND y = ?"
        );
        assert_eq!(in_list("x IN ({ids})", 1), "x IN (?)");
        assert_eq!(padded_len(1), 1);
        assert_eq!(padded_len(3), 4);
        assert_eq!(padded_len(1024), 1024);
    }

    #[test]
    fn only_ids_is_left_to_render() {
        for sql in [
            CLAIM_TAKE,
            MARK_DELIVERED,
            MARK_FAILED,
            RELEASE,
            DEFER,
            SELECT_IDS,
            REPLAY_IDS,
            DELETE_UNARCHIVED,
        ] {
            assert!(sql.contains("{ids}"), "{sql}");
        }
        for sql in [CLAIM_PENDING, LIST_SELECT, BACKLOG, REPLAY_FILTER_LOCK] {
            assert!(!sql.contains("{ids}"), "{sql}");
        }
    }

    /// The ordered pending claim has one bind per `?`: a tenant where the
    /// tenant is compared, a limit where a limit is.
    #[test]
    fn the_ordered_claim_binds_each_placeholder() {
        let sql = CLAIM_PENDING_ORDERED;
        let marks: Vec<usize> = sql.match_indices('?').map(|(i, _)| i).collect();
        assert_eq!(marks.len(), PENDING_ORDERED_BINDS.len(), "{sql}");
        for (at, bind) in marks.into_iter().zip(PENDING_ORDERED_BINDS) {
            let before = sql[..at].trim_end();
            match bind {
                Bind::Tenant => assert!(before.ends_with("app_code ="), "tenant at {at}: {sql}"),
                Bind::Limit(_) => assert!(before.ends_with("LIMIT"), "limit at {at}: {sql}"),
                Bind::Skipped => {
                    assert!(before.ends_with("JSON_CONTAINS("), "types at {at}: {sql}")
                }
                Bind::Dealt => assert!(before.ends_with("JSON_TABLE("), "ids at {at}: {sql}"),
            }
        }
    }
}
