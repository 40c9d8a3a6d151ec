//! MySQL 8 / MariaDB 10.6+ as a dialect of the postbox engine.
//!
//! MySQL has no `UPDATE … RETURNING`, so every statement that PostgreSQL
//! runs as one `UPDATE … RETURNING` is a short transaction here: lock the
//! rows (`SELECT … FOR UPDATE`), update them by primary key, and read them
//! back. It has no array parameter either: an id list is a padded `IN (?,
//! …)` list, split into statements of at most [`sql::MAX_IN_LIST`]
//! ([`MySqlDialect::expand`]).

use std::borrow::Cow;

use async_trait::async_trait;
use sqlx::mysql::{MySqlPool, MySqlQueryResult};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, Executor, MySql, MySqlConnection, Row};

use postbox_core::config::RelayCommit;
use postbox_core::store::{ClaimRequest, QueryPlan, StatementStats, HISTORY_LIMIT};
use postbox_core::{
    ClaimSource, ClaimedEvent, Error, EventRecord, NewEvent, Result, Status, TableName,
};
use postbox_sqlx::dialect::{enqueue_error, insert_values, ClaimStatements, Q};
use postbox_sqlx::{
    claimed_records, db_error, query, records, Connect, Dialect, ReplayStep, SqlOutbox, Value,
};

use crate::sql;

/// The MySQL / MariaDB dialect.
#[derive(Debug, Clone, Copy)]
pub struct MySqlDialect;

/// Statements only MySQL's hooks run, rendered once per store.
#[derive(Debug)]
pub struct Own {
    insert_event: String,
    pub(crate) claims: ClaimStatements,
    pub(crate) pending_first: String,
    pending_after: String,
    pending_of_type: String,
    pending_undue: String,
    claim_take: String,
    claim_take_expired: String,
    select_ids: String,
    replay_ids: String,
    unarchive_ids: String,
    history_over_limit: String,
    pub(crate) archive_pick: String,
    archive_pick_lock: String,
    archive_copy: String,
    archive_delete: String,
    delivered_estimate: String,
}

impl Own {
    /// The claim statement the relay runs for `source` (`ordered`: with
    /// `ordering = "per_aggregate"`), placeholders app_code then limit;
    /// for reading its plan.
    pub fn claim_sql(&self, source: postbox_core::ClaimSource, ordered: bool) -> &str {
        self.claims.of(source, ordered)
    }
}

/// `chunk`, padded to [`sql::padded_len`] by repeating its last element.
fn padded<T>(chunk: &[T]) -> impl Iterator<Item = &T> {
    let pad = sql::padded_len(chunk.len()) - chunk.len();
    chunk
        .iter()
        .chain(chunk.last().into_iter().cycle().take(pad))
}

/// The elements of a list value, one scalar each.
fn elements<'q>(value: &Value<'q>) -> Option<Vec<Value<'q>>> {
    match *value {
        Value::Ids(ids) => Some(ids.iter().map(|&id| id.into()).collect()),
        Value::Texts(texts) => Some(texts.iter().map(Value::from).collect()),
        _ => None,
    }
}

/// `sql` with plain `?` placeholders in the order it reads its values, and
/// those values: `?N` is the engine's N-th value, a plain `?` the next
/// value that is not the list, `{ids}` the list's `chunk`, padded. A `?`
/// inside a string literal is text.
fn render<'q>(sql: &str, values: &[Value<'q>], chunk: &[Value<'q>]) -> (String, Vec<Value<'q>>) {
    let mut scalars = values.iter().filter(|v| elements(v).is_none());
    let mut out = String::with_capacity(sql.len());
    let mut binds = Vec::with_capacity(values.len() + chunk.len());
    let mut quoted = false;
    let mut rest = sql;
    while let Some(c) = rest.chars().next() {
        if !quoted && rest.starts_with("{ids}") {
            let list: Vec<Value<'q>> = padded(chunk).copied().collect();
            out.push_str(&sql::in_list("{ids}", list.len()));
            binds.extend(list);
            rest = &rest["{ids}".len()..];
            continue;
        }
        rest = &rest[c.len_utf8()..];
        out.push(c);
        match c {
            '\'' => quoted = !quoted,
            '?' if !quoted => {
                let digits =
                    rest.len() - rest.trim_start_matches(|d: char| d.is_ascii_digit()).len();
                let value = if digits == 0 {
                    scalars.next()
                } else {
                    let n: usize = rest[..digits].parse().unwrap_or(0);
                    rest = &rest[digits..];
                    n.checked_sub(1).and_then(|i| values.get(i))
                };
                // A missing value leaves the count short: the server says so.
                binds.extend(value.copied());
            }
            _ => {}
        }
    }
    (out, binds)
}

/// Takes the named lock `sql` (`GET_LOCK`) of `table` on the session of
/// `conn`; true when granted.
async fn get_lock(
    conn: &mut MySqlConnection,
    sql: &str,
    table: &TableName,
    op: &'static str,
) -> Result<bool> {
    let locked: Option<i64> = sqlx::query_scalar(sql)
        .bind(table.as_str())
        .fetch_one(conn)
        .await
        .map_err(|e| db_error(op, e))?;
    Ok(locked == Some(1))
}

/// Releases the named lock `sql` (`RELEASE_LOCK`) of `table`.
async fn release_lock(
    conn: &mut MySqlConnection,
    sql: &str,
    table: &TableName,
) -> std::result::Result<(), sqlx::Error> {
    sqlx::query(sql)
        .bind(table.as_str())
        .execute(conn)
        .await
        .map(|_| ())
}

/// Deletes history beyond [`HISTORY_LIMIT`] entries for the events of rows
/// `ids`, in two steps: MySQL cannot read the table it deletes from.
async fn prune_history(
    outbox: &SqlOutbox<MySqlDialect>,
    conn: &mut MySqlConnection,
    ids: &[i64],
) -> std::result::Result<(), sqlx::Error> {
    let binds = vec![Value::Ids(ids), HISTORY_LIMIT.into()];
    let over = outbox
        .fetch_expanded(&mut *conn, &outbox.own().history_over_limit, binds)
        .await?;
    for row in over {
        let event_id: String = row.try_get(0)?;
        let app_code: String = row.try_get(1)?;
        sqlx::query(&outbox.statements().history_prune)
            .bind(&event_id)
            .bind(&app_code)
            .bind(&event_id)
            .bind(&app_code)
            .bind(HISTORY_LIMIT - 1)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// A replay step: locks the rows' ids with `sql`, updates them by primary
/// key and reads them back, in id order.
async fn replay_locked(
    outbox: &SqlOutbox<MySqlDialect>,
    conn: &mut MySqlConnection,
    step: ReplayStep,
    sql: &str,
    values: Vec<Value<'_>>,
) -> Result<Vec<EventRecord>> {
    let (op, write) = match step {
        ReplayStep::Replay => ("replay", &outbox.own().replay_ids),
        ReplayStep::Unarchive => ("replay from archive", &outbox.own().unarchive_ids),
    };
    let db = |e| db_error(op, e);
    let locked = outbox
        .fetch_expanded(&mut *conn, sql, values)
        .await
        .map_err(db)?;
    let mut ids: Vec<i64> = locked
        .iter()
        .map(|r| r.try_get(0))
        .collect::<std::result::Result<_, _>>()
        .map_err(db)?;
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    outbox
        .execute_expanded(&mut *conn, write, vec![Value::Ids(&ids)])
        .await
        .map_err(db)?;
    let rows = outbox
        .fetch_expanded(&mut *conn, &outbox.own().select_ids, vec![Value::Ids(&ids)])
        .await
        .map_err(|e| db_error("replay", e))?;
    let mut out = records(rows, outbox.table().naming(), "replay")?;
    out.sort_by_key(|r| r.id);
    Ok(out)
}

#[async_trait]
impl Dialect for MySqlDialect {
    postbox_sqlx::dialect_constants!(db: MySql, backend: "mysql", placeholders: Question, begin_write: None);
    /// Continued by [`MySqlDialect::continue_ids`] instead.
    const CONTINUE_IDS_AFTER_ARCHIVE: &'static [&'static str] = &[];
    const REPLAY_FAILED_INDEX: &'static str = "_due_idx";
    const ADOPT: Option<postbox_sqlx::Adopt> = Some(postbox_sqlx::Adopt {
        columns_of: sql::ADOPT_COLUMNS,
        indexes: Some(sql::ADOPT_INDEXES),
        invalid_indexes: None,
        indexes_of: sql::ADOPT_INDEXES_OF,
        drop_index: "ALTER TABLE {table} DROP INDEX {name}",
        online_index: str::to_owned,
        add_column: sql::add_column,
    });
    const DUE_BRANCH: Option<&'static str> = Some(sql::DUE_BRANCH);
    /// A pooled connection whose next transaction runs at READ COMMITTED:
    /// its locking reads take no gap locks, so claims and replays never
    /// block producers' inserts, and rows that do not match are unlocked at
    /// once. Every relay statement (claims, marks, releases, history) runs
    /// in such a transaction: at REPEATABLE READ an `UPDATE … WHERE id IN
    /// (…)` that MariaDB plans as a whole-table scan (it does on small
    /// tables) waits for every row a producer's open transaction holds; at
    /// READ COMMITTED its semi-consistent read skips rows it does not name.
    const RELAY_ISOLATION: Option<&'static str> = Some(sql::CLAIM_ISOLATION);

    fn own(t: &TableName) -> Own {
        Own {
            insert_event: t.render(sql::INSERT_EVENT),
            claims: ClaimStatements::render(t, sql::CLAIMS),
            pending_first: t.render(sql::PENDING_FIRST),
            pending_after: t.render(sql::PENDING_AFTER),
            pending_of_type: t.render(sql::PENDING_OF_TYPE),
            pending_undue: t.render(sql::PENDING_UNDUE),
            claim_take: t.render(sql::CLAIM_TAKE),
            claim_take_expired: t.render(sql::CLAIM_TAKE_EXPIRED),
            select_ids: t.render(sql::SELECT_IDS),
            replay_ids: t.render(sql::REPLAY_IDS),
            unarchive_ids: t.render(sql::UNARCHIVE_IDS),
            history_over_limit: t.render(sql::HISTORY_OVER_LIMIT),
            archive_pick: t.render(sql::ARCHIVE_PICK),
            archive_pick_lock: t.render(sql::ARCHIVE_PICK_LOCK),
            archive_copy: t.render(sql::ARCHIVE_COPY),
            archive_delete: t.render(sql::ARCHIVE_DELETE),
            delivered_estimate: t.render(sql::DELIVERED_ESTIMATE),
        }
    }

    /// Two connections (the claimer's and the marker's), connected on
    /// first use, whose sessions run at READ COMMITTED
    /// ([`MySqlDialect::RELAY_ISOLATION`]): a fenced mark is then one
    /// statement, not a `SET TRANSACTION` and the statement. Commits stay
    /// as the server is configured (`innodb_flush_log_at_trx_commit` is
    /// server-wide), whatever `commit` says.
    fn relay_pool(pool: &MySqlPool, commit: RelayCommit) -> Option<MySqlPool> {
        let _ = commit;
        Some(
            postbox_sqlx::released_within(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(2)
                    .acquire_timeout(std::time::Duration::from_secs(10)),
            )
            .after_connect(|conn, _| {
                Box::pin(async move { conn.execute(sql::SESSION_ISOLATION).await.map(|_| ()) })
            })
            .connect_lazy_with((*pool.connect_options()).clone()),
        )
    }

    /// Connects to `url` (`mysql://…` or `mariadb://…`); a server database
    /// is never created.
    async fn connect_pool(url: &str, max_connections: u32, how: Connect) -> Result<MySqlPool> {
        let normalized = match url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => url.to_owned(),
        };
        postbox_sqlx::connect_server(
            url,
            &normalized,
            max_connections,
            how,
            "connecting to MySQL",
            |opts| opts,
        )
        .await
    }

    /// From `performance_schema`'s statement digests, which must be on.
    async fn statement_stats(outbox: &SqlOutbox<Self>) -> Result<StatementStats> {
        let db = |e| db_error("read performance_schema", e);
        let on: i64 = sqlx::query_scalar(sql::PERFORMANCE_SCHEMA_ON)
            .fetch_one(outbox.pool())
            .await
            .map_err(db)?;
        if on == 0 {
            return Err(Error::Schema(
                "performance_schema is off: set performance_schema = ON under [mysqld] (MariaDB: [mariadbd]) and restart the server; its statement digests are on by default".into(),
            ));
        }
        let rows = sqlx::query(sql::STATEMENT_STATS)
            .bind(outbox.table().as_str())
            .fetch_all(outbox.pool())
            .await
            .map_err(db)?;
        let mut stats = postbox_sqlx::statement_stats_of(rows, "performance_schema")?;
        stats.unrecorded = sqlx::query_scalar(sql::STATEMENTS_UNRECORDED)
            .fetch_one(outbox.pool())
            .await
            .map_err(db)?;
        Ok(stats)
    }

    fn rows_affected(done: &MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    fn bind<'q>(q: Q<'q, MySql>, value: Value<'q>) -> Q<'q, MySql> {
        match value {
            Value::Text(v) => q.bind(v),
            Value::Int(v) => q.bind(v),
            Value::Int32(v) => q.bind(v),
            // `expand` binds a list's elements one by one; so does this.
            Value::Ids(ids) => ids.iter().fold(q, |q, id| q.bind(*id)),
            Value::Texts(texts) => texts.iter().fold(q, |q, t| q.bind(t.as_str())),
        }
    }

    /// Renders `{ids}` and numbered placeholders ([`render`]), one
    /// statement per [`sql::MAX_IN_LIST`] list elements, padded to
    /// [`sql::padded_len`] so that few statement texts reach sqlx's
    /// prepared-statement cache. An empty list runs nothing.
    fn expand<'s, 'q>(sql: &'s str, values: Vec<Value<'q>>) -> Vec<(Cow<'s, str>, Vec<Value<'q>>)> {
        let list = values.iter().find_map(elements);
        let rendered = |chunk: &[Value<'q>]| {
            let (text, binds) = render(sql, &values, chunk);
            (Cow::Owned(text), binds)
        };
        match &list {
            None => vec![rendered(&[])],
            Some(items) => items.chunks(sql::MAX_IN_LIST).map(rendered).collect(),
        }
    }

    /// A plain insert; the id is `LAST_INSERT_ID()`, and a duplicate
    /// `(app_code, event_id)` fails with error 1062, which MySQL undoes
    /// alone, so the caller's transaction stays usable.
    async fn insert_event(
        outbox: &MySqlOutbox,
        conn: &mut MySqlConnection,
        event: &NewEvent,
    ) -> Result<i64> {
        let headers = event.headers_json();
        query::<MySqlDialect>(&outbox.own().insert_event, insert_values(event, &headers))
            .execute(conn)
            .await
            // The column is a signed BIGINT, so the id always fits.
            .map(|done| done.last_insert_id() as i64)
            .map_err(|e| enqueue_error(event, e))
    }

    /// Lock up to `limit` rows (`FOR UPDATE SKIP LOCKED`), take the lease
    /// by primary key, and hand the rows out as the update left them, in
    /// one READ COMMITTED transaction.
    async fn claim(
        outbox: &MySqlOutbox,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>> {
        let db = |e| db_error("claim", e);
        let own = outbox.own();
        let take = match source {
            ClaimSource::ExpiredLease => &own.claim_take_expired,
            ClaimSource::Pending | ClaimSource::DueRetry => &own.claim_take,
        };
        let mut tx = outbox.begin_bookkeeping(true).await.map_err(db)?;
        // 1. Lock up to `limit` rows, skipping those another relay holds.
        let limit = i64::from(req.limit);
        let statement = own.claims.of(source, req.ordered);
        // New rows: the candidates dealt across types, in that order, the
        // paused types read past (under per-aggregate ordering, those of
        // them that are heads are one of the claim's candidate sets).
        let mut dealt = String::new();
        if source == ClaimSource::Pending {
            let ids = pending_candidates(&mut tx, own, req, limit, 1)
                .await
                .map_err(db)?;
            if ids.is_empty() {
                // Pending rows a producer wrote with a time in
                // `next_retry_at_ms` are not where the candidates are read
                // (`sql::PENDING_UNDUE`): put them there for the next claim.
                let moved = sqlx::query(&own.pending_undue)
                    .bind(req.app_code)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?
                    .rows_affected();
                if moved > 0 {
                    tracing::warn!(app_code = req.app_code, rows = moved, "pending rows had next_retry_at_ms set by their producer (it must be left to its default, 0): reset, so that they are claimed");
                }
                if !req.ordered {
                    tx.commit().await.map_err(db)?;
                    return Ok(Vec::new());
                }
            }
            dealt = serde_json::to_string(&ids).unwrap_or_default();
        }
        let claim_from = |dealt: String| {
            let mut claim = sqlx::query(statement);
            if source == ClaimSource::Pending && !req.ordered {
                claim = claim.bind(dealt.clone());
            }
            for bind in sql::claim_binds(source, req.ordered) {
                claim = match *bind {
                    sql::Bind::Tenant => claim.bind(req.app_code),
                    sql::Bind::Limit(times) => claim.bind(times * limit),
                    sql::Bind::Skipped => {
                        claim.bind(serde_json::to_string(req.skip_types).unwrap_or_default())
                    }
                    sql::Bind::Dealt => claim.bind(dealt.clone()),
                };
            }
            claim
        };
        let mut rows = claim_from(dealt).fetch_all(&mut *tx).await.map_err(db)?;
        if source == ClaimSource::Pending && req.ordered && (rows.len() as i64) < limit {
            // Came back short: once more from candidates read past the
            // followers of held aggregates (`sql::FOLLOWER_SCAN`). The rows
            // this transaction locked already come back again: kept once.
            let deeper = pending_candidates(&mut tx, own, req, limit, sql::FOLLOWER_SCAN)
                .await
                .map_err(db)?;
            let more = claim_from(serde_json::to_string(&deeper).unwrap_or_default())
                .fetch_all(&mut *tx)
                .await
                .map_err(db)?;
            let id_of =
                |r: &sqlx::mysql::MySqlRow| r.try_get::<i64, _>(outbox.table().column("id")).ok();
            let mut seen: std::collections::HashSet<i64> = rows.iter().filter_map(id_of).collect();
            for row in more {
                if (rows.len() as i64) < limit && id_of(&row).is_some_and(|id| seen.insert(id)) {
                    rows.push(row);
                }
            }
        }
        let Some(first) = rows.first() else {
            tx.commit().await.map_err(db)?;
            return Ok(Vec::new());
        };
        // 2. One lease end for the whole batch, on the database clock: the fence.
        let db_now_ms: i64 = first.try_get("db_now_ms").map_err(db)?;
        let lock_until_ms = db_now_ms + req.lease_ms;
        let (mut claimed, mut unreadable) = claimed_records(rows, outbox.table().naming())?;
        // 3. Take the lease (also of the rows that cannot be read, failed
        // once it is taken).
        let ids: Vec<i64> = claimed
            .iter()
            .map(|r| r.id)
            .chain(unreadable.iter().map(|u| u.id))
            .collect();
        let binds = vec![
            req.worker_id.into(),
            lock_until_ms.into(),
            db_now_ms.into(),
            Value::Ids(&ids),
        ];
        outbox
            .execute_expanded(&mut tx, take, binds)
            .await
            .map_err(db)?;
        // The takeover counted an attempt: record it with the claim.
        if source == ClaimSource::ExpiredLease {
            outbox
                .record_lease_expired(&mut tx, &ids)
                .await
                .map_err(db)?;
        }
        // 4. Commit, fail the rows that cannot be read, and hand out the
        // others as the update left them.
        tx.commit().await.map_err(db)?;
        if !unreadable.is_empty() {
            for u in &mut unreadable {
                // Read before the update: the lease is the one just taken.
                u.lock_until_ms = None;
                if source == ClaimSource::ExpiredLease {
                    u.retry_count += 1;
                }
            }
            outbox
                .fail_unreadable(req.app_code, &unreadable, req.worker_id, lock_until_ms)
                .await;
        }
        for r in &mut claimed {
            if source == ClaimSource::ExpiredLease {
                r.retry_count += 1;
                r.last_error = Some(format!(
                    "lease expired while held by {}",
                    r.worker_id.as_deref().unwrap_or("?")
                ));
            }
            r.status = Status::Delivering;
            r.worker_id = Some(req.worker_id.to_owned());
            r.lock_until_ms = lock_until_ms;
            r.updated_at_ms = db_now_ms;
        }
        Ok(claimed
            .into_iter()
            .map(|record| ClaimedEvent { record, source })
            .collect())
    }

    /// One archiver per table: a named lock on the archiver's own
    /// connection, not waited for.
    async fn archive_lock(conn: &mut PoolConnection<MySql>, table: &TableName) -> Result<bool> {
        get_lock(conn, sql::ARCHIVE_LOCK, table, "archive").await
    }

    async fn archive_unlock(
        conn: &mut PoolConnection<MySql>,
        table: &TableName,
    ) -> std::result::Result<(), sqlx::Error> {
        release_lock(conn, sql::ARCHIVE_UNLOCK, table).await
    }

    fn archive_pick_lock<'a>(
        outbox: &'a MySqlOutbox,
        app_code: &'a str,
        before_ms: i64,
        size: u32,
    ) -> (&'a str, Vec<Value<'a>>) {
        let binds = vec![
            app_code.into(),
            before_ms.into(),
            before_ms.into(),
            i64::from(size).into(),
        ];
        (&outbox.own().archive_pick_lock, binds)
    }

    /// Locks one batch's rows, copies them into the archive and deletes
    /// them, in one READ COMMITTED transaction.
    async fn archive_batch(
        outbox: &MySqlOutbox,
        conn: &mut PoolConnection<MySql>,
        app_code: &str,
        before_ms: i64,
        batch_size: u32,
    ) -> Result<(u64, u64)> {
        let db = |e| db_error("archive", e);
        let own = outbox.own();
        conn.execute(sql::CLAIM_ISOLATION).await.map_err(db)?;
        let mut tx = conn.begin().await.map_err(db)?;
        let rows = sqlx::query(&own.archive_pick_lock)
            .bind(app_code)
            .bind(before_ms)
            .bind(before_ms)
            .bind(i64::from(batch_size))
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
        let ids: Vec<i64> = rows
            .iter()
            .map(|r| r.try_get(0))
            .collect::<std::result::Result<_, _>>()
            .map_err(db)?;
        let (mut moved, mut copied) = (0, 0);
        if !ids.is_empty() {
            copied = outbox
                .execute_expanded(&mut tx, &own.archive_copy, vec![Value::Ids(&ids)])
                .await
                .map_err(db)?;
            moved = outbox
                .execute_expanded(&mut tx, &own.archive_delete, vec![Value::Ids(&ids)])
                .await
                .map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok((moved, copied))
    }

    /// Nothing: [`MySqlDialect::migration_session_lock`] serialises runs.
    async fn migration_lock(_: &mut MySqlConnection) -> std::result::Result<(), sqlx::Error> {
        Ok(())
    }

    /// A server-wide named lock held by the migration's connection for
    /// the whole run, waited for up to 60 s.
    async fn migration_session_lock(
        conn: &mut PoolConnection<MySql>,
        table: &TableName,
    ) -> Result<()> {
        if !get_lock(conn, sql::MIGRATION_LOCK, table, "migrate").await? {
            return Err(Error::Schema(format!(
                "another `postbox migrate` on table `{table}` held the migration lock for 60s; try again"
            )));
        }
        if let Err(e) = sqlx::query(sql::MIGRATION_LOCK_WAIT)
            .execute(&mut **conn)
            .await
        {
            // Not left held by a connection going back to the pool.
            if release_lock(conn, sql::MIGRATION_UNLOCK, table)
                .await
                .is_err()
            {
                conn.close_on_drop();
            }
            return Err(db_error("migrate", e));
        }
        Ok(())
    }

    async fn migration_session_unlock(
        conn: &mut PoolConnection<MySql>,
        table: &TableName,
    ) -> std::result::Result<(), sqlx::Error> {
        sqlx::query(sql::MIGRATION_LOCK_WAIT_RESET)
            .execute(&mut **conn)
            .await?;
        release_lock(conn, sql::MIGRATION_UNLOCK, table).await
    }

    /// A statement whose indexes or columns clash (`ER_DUP_KEYNAME` 1061,
    /// `ER_CANT_DROP_FIELD_OR_KEY` 1091, `ER_DUP_FIELDNAME` 1060) was
    /// applied when every index and column it adds is on its table and
    /// every index it drops is gone ([`schema_changes`]).
    async fn applied_before(
        conn: &mut MySqlConnection,
        stmt: &str,
        error: &sqlx::Error,
    ) -> std::result::Result<bool, sqlx::Error> {
        let sqlx::Error::Database(e) = error else {
            return Ok(false);
        };
        let code = e
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|e| e.number());
        if !matches!(code, Some(1060 | 1061 | 1091)) {
            return Ok(false);
        }
        let Some(changes) = schema_changes(stmt) else {
            return Ok(false);
        };
        let indexes: Vec<String> = sqlx::query_scalar(sql::ADOPT_INDEXES_OF)
            .bind(&changes.table)
            .fetch_all(&mut *conn)
            .await?;
        let columns: Vec<String> = sqlx::query_scalar(sql::ADOPT_COLUMNS)
            .bind(&changes.table)
            .fetch_all(&mut *conn)
            .await?;
        let has = |names: &[String], n: &String| names.iter().any(|x| x.eq_ignore_ascii_case(n));
        Ok(changes.added_indexes.iter().all(|i| has(&indexes, i))
            && changes.dropped_indexes.iter().all(|i| !has(&indexes, i))
            && changes.added_columns.iter().all(|c| has(&columns, c)))
    }

    /// A (re)created outbox table continues after the highest id a kept
    /// archive holds, so archiving never meets an id already there.
    /// `AUTO_INCREMENT` takes no parameter or expression: the value is
    /// read first.
    async fn continue_ids(
        conn: &mut MySqlConnection,
        table: &TableName,
    ) -> std::result::Result<(), sqlx::Error> {
        let kept: Option<i64> = sqlx::query_scalar(&table.render(sql::ARCHIVE_MAX_ID))
            .fetch_one(&mut *conn)
            .await?;
        if let Some(max) = kept {
            let next = max.saturating_add(1);
            let alter = table.render(&format!("ALTER TABLE {{table}} AUTO_INCREMENT = {next}"));
            conn.execute(alter.as_str()).await?;
        }
        Ok(())
    }

    async fn replay_rows(
        outbox: &MySqlOutbox,
        conn: &mut MySqlConnection,
        step: ReplayStep,
        sql: &str,
        values: Vec<Value<'_>>,
    ) -> Option<Result<Vec<EventRecord>>> {
        Some(replay_locked(outbox, conn, step, sql, values).await)
    }

    async fn prune_history(
        outbox: &MySqlOutbox,
        conn: &mut MySqlConnection,
        ids: &[i64],
    ) -> Option<std::result::Result<(), sqlx::Error>> {
        Some(prune_history(outbox, conn, ids).await)
    }

    async fn explain_claims(
        outbox: &MySqlOutbox,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<QueryPlan>> {
        crate::explain::explain_claims(outbox, app_code, limit).await
    }

    async fn explain_index_use(outbox: &MySqlOutbox, app_code: &str) -> Result<Vec<QueryPlan>> {
        crate::doctor::index_use(outbox, app_code).await
    }

    /// The `rows` InnoDB estimates for a range read of `{table}_due_idx`.
    async fn delivered_estimate(
        outbox: &MySqlOutbox,
        app_code: &str,
    ) -> Option<Result<(i64, bool)>> {
        let db = |e| db_error("estimate delivered rows", e);
        let estimate = async {
            let row = sqlx::query(&outbox.own().delivered_estimate)
                .bind(app_code)
                .fetch_one(outbox.pool())
                .await
                .map_err(db)?;
            // Text on MariaDB, an unsigned integer on MySQL 8; NULL when
            // the optimizer found nothing to read.
            let rows = match row.try_get::<Option<String>, _>("rows") {
                Ok(text) => text.and_then(|t| t.parse::<i64>().ok()),
                Err(_) => row
                    .try_get::<Option<u64>, _>("rows")
                    .map_err(db)?
                    .map(|n| n as i64),
            };
            Ok((rows.unwrap_or(0), true))
        };
        Some(estimate.await)
    }
}

type MySqlOutbox = SqlOutbox<MySqlDialect>;

/// What a migration statement makes: `CREATE INDEX i ON t …` or `ALTER
/// TABLE t` with `ADD INDEX i`, `DROP INDEX i` and `ADD COLUMN c` clauses.
#[derive(Debug, Default, PartialEq, Eq)]
struct SchemaChanges {
    table: String,
    added_indexes: Vec<String>,
    dropped_indexes: Vec<String>,
    added_columns: Vec<String>,
}

/// Reads [`SchemaChanges`] from a migration statement; `None` for any
/// other statement.
fn schema_changes(stmt: &str) -> Option<SchemaChanges> {
    let words: Vec<&str> = stmt.split_whitespace().collect();
    let mut out = SchemaChanges::default();
    let name = |w: &str| w.trim_end_matches([',', '(']).to_owned();
    match words.as_slice() {
        ["CREATE", "INDEX", index, "ON", table, ..] => {
            out.table = name(table);
            out.added_indexes.push(name(index));
        }
        ["ALTER", "TABLE", table, ..] => out.table = name(table),
        _ => return None,
    }
    for w in words.windows(3) {
        match w {
            ["ADD", "INDEX", i] => out.added_indexes.push(name(i)),
            ["DROP", "INDEX", i] => out.dropped_indexes.push(name(i)),
            ["ADD", "COLUMN", c] => out.added_columns.push(name(c)),
            _ => {}
        }
    }
    Some(out)
}

/// The pending rows a claim of `limit` may take, dealt across event types
/// (`postbox_sqlx::fair_pending!`): each type's oldest `depth` × `limit`
/// rows, read type after type through `{table}_due_idx`
/// ([`sql::PENDING_FIRST`]), then the first 2 × `limit` (all of them when
/// deeper) in round-robin order ([`deal`]). One read when the
/// backlog is under `limit` rows; with a backlog, one per type that fills a
/// read, one more for a type a read cut short, and a last one that finds
/// no further type. At most `limit` types are dealt (the batch could not
/// hold more): the first by name. The types paused by a runtime control
/// (`req.skip_types`) are read past, not dealt.
async fn pending_candidates(
    tx: &mut MySqlConnection,
    own: &Own,
    req: &ClaimRequest<'_>,
    limit: i64,
    depth: i64,
) -> std::result::Result<Vec<i64>, sqlx::Error> {
    let app_code = req.app_code;
    let read_size = limit * depth;
    let mut types: Vec<(String, Vec<i64>)> = Vec::new();
    let mut after: Option<String> = None;
    let read = async |tx: &mut MySqlConnection, sql: &str, event_type: &str| {
        sqlx::query(sql)
            .bind(app_code)
            .bind(event_type)
            .bind(read_size)
            .fetch_all(tx)
            .await?
            .into_iter()
            .map(|row| {
                // By position: an adopted table names them its own way.
                Ok((row.try_get::<i64, _>(0)?, row.try_get::<String, _>(1)?))
            })
            .collect::<std::result::Result<Vec<(i64, String)>, sqlx::Error>>()
    };
    while (types.len() as i64) < limit {
        let rows = match &after {
            None => read(tx, &own.pending_first, "").await?,
            Some(t) => read(tx, &own.pending_after, t).await?,
        };
        let full = rows.len() as i64 == read_size;
        let first_type = types.len();
        let mut last: Option<String> = None;
        for (id, event_type) in rows {
            if last.as_deref() != Some(event_type.as_str()) {
                types.push((event_type.clone(), Vec::new()));
                last = Some(event_type);
            }
            if let Some((_, ids)) = types.last_mut() {
                ids.push(id);
            }
        }
        let Some(last) = last else { break };
        if !full {
            // Every type in it was read to its end, and none comes after.
            break;
        }
        // The last type may have been cut short by the limit; alone in the
        // read, it has its `read_size` rows already.
        if types.len() - first_type > 1 && !req.skip_types.contains(&last) {
            let rows = read(tx, &own.pending_of_type, &last).await?;
            if let Some((_, ids)) = types.last_mut() {
                *ids = rows.into_iter().map(|(id, _)| id).collect();
            }
        }
        after = Some(last);
    }
    types.retain(|(event_type, _)| !req.skip_types.contains(event_type));
    let types: Vec<Vec<i64>> = types.into_iter().map(|(_, ids)| ids).collect();
    // Deeper, each type keeps all it read (the claim keeps the first heads
    // among them): dealt down to 2 × `limit` in all, a type's share was
    // still its oldest `limit` rows with two types of backlog.
    let take = if depth > 1 {
        types.len() as i64 * read_size
    } else {
        2 * limit
    };
    Ok(deal(&types, take.max(0) as usize))
}

/// Round-robin over `types` (each a type's ids, oldest first): every
/// type's first id, oldest first, then every type's second, and so on,
/// up to `take` ids. A type with fewer rows leaves its turn to the others.
pub(crate) fn deal(types: &[Vec<i64>], take: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(take.min(types.iter().map(Vec::len).sum()));
    let mut round = Vec::with_capacity(types.len());
    for rank in 0.. {
        round.clear();
        round.extend(types.iter().filter_map(|ids| ids.get(rank).copied()));
        if round.is_empty() || out.len() >= take {
            break;
        }
        round.sort_unstable();
        let room = take - out.len();
        out.extend(round.iter().take(room));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch is dealt round-robin across types, oldest first within a
    /// round; a short type leaves its turns to the others.
    #[test]
    fn deal_gives_every_type_its_turn() {
        let flood: Vec<i64> = (1..=10).collect();
        let fresh = vec![20, 21];
        let lone = vec![30];
        assert_eq!(
            deal(&[flood.clone(), fresh.clone(), lone.clone()], 6),
            vec![1, 20, 30, 2, 21, 3]
        );
        assert_eq!(deal(std::slice::from_ref(&flood), 4), vec![1, 2, 3, 4]);
        assert_eq!(deal(&[vec![5], vec![]], 4), vec![5]);
        assert!(deal(&[], 4).is_empty());
        assert_eq!(deal(&[flood, fresh], 3), vec![1, 20, 2]);
    }

    #[test]
    fn renders_binds_in_statement_order() {
        let ids = [7, 8, 9];
        let values = vec![Value::Ids(&ids), "origin".into(), "to".into()];
        let (text, binds) = render(
            "x ?3, ?2, '?' IN ({ids}) AND y = ?",
            &values,
            &[1.into(), 2.into(), 3.into()],
        );
        assert_eq!(text, "x ?, ?, '?' IN (?, ?, ?, ?) AND y = ?");
        assert_eq!(binds.len(), 7);
        let expanded = MySqlDialect::expand("IN ({ids})", vec![Value::Ids(&[])]);
        assert!(expanded.is_empty());
        let many: Vec<i64> = (0..1500).collect();
        let expanded =
            MySqlDialect::expand("IN ({ids}) AND w = ?", vec![Value::Ids(&many), "w".into()]);
        assert_eq!(expanded.len(), 2);
        assert_eq!(expanded[1].1.len(), 512 + 1);
    }
}
