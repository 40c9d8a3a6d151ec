//! [`OutboxStore`] for MySQL 8 and MariaDB 10.6+.
//!
//! MySQL has no `UPDATE … RETURNING`, so every statement that PostgreSQL
//! runs as one `UPDATE … RETURNING` is a short transaction here: lock the
//! rows (`SELECT … FOR UPDATE`), update them by primary key, and return
//! them.

use sqlx::mysql::{MySqlArguments, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::query::Query;
use sqlx::{Connection, Executor, MySql, MySqlConnection, Row};

use postbox_core::event::Fence;
use postbox_core::store::{
    AppStats, ArchiveReport, ArchiveRequest, ClaimRequest, EnqueueOutcome, EventFilter,
    FailureUpdate, HistoryEntry, MigrateReport, MinuteCount, QueryPlan, ReplaySelector,
    ReplayTargets, SchemaReport, ARCHIVE_QUERIES, HISTORY_LIMIT,
};
use postbox_core::{ClaimSource, ClaimedEvent, EventRecord, NewEvent, Result, Status, TableName};

use crate::{sql, MySqlOutbox};

use postbox_sqlx::{history_entries, records, ListArg, Placeholders};

const PH: Placeholders = Placeholders::Question;

/// The ids a locking `SELECT id …` returned.
fn first_column(rows: &[MySqlRow]) -> std::result::Result<Vec<i64>, sqlx::Error> {
    rows.iter().map(|r| r.try_get(0)).collect()
}

/// The values to bind for one `{ids}` list: `chunk`, padded to
/// [`sql::padded_len`] by repeating its last element.
fn padded<T>(chunk: &[T]) -> impl Iterator<Item = &T> {
    let pad = sql::padded_len(chunk.len()) - chunk.len();
    chunk
        .iter()
        .chain(chunk.last().into_iter().cycle().take(pad))
}

/// Binds the values of a [`postbox_sqlx::ListQuery`], in placeholder order.
fn bind_args<'q>(
    mut q: Query<'q, MySql, MySqlArguments>,
    args: &[ListArg<'q>],
) -> Query<'q, MySql, MySqlArguments> {
    for arg in args {
        q = match *arg {
            ListArg::Text(s) => q.bind(s),
            ListArg::Int(i) => q.bind(i),
        };
    }
    q
}

/// A replay statement (`{filters}` after its `WHERE` clause) for the given
/// filters of `f`; `status_column` is what the status filter compares.
fn filtered<'a>(sql: &str, f: &'a EventFilter, status_column: &str) -> postbox_sqlx::ListQuery<'a> {
    postbox_sqlx::filter_query(sql, f, status_column, PH)
}

impl MySqlOutbox {
    /// A pooled connection whose next transaction runs at READ COMMITTED:
    /// its locking reads take no gap locks, so claims and replays never
    /// block producers' inserts, and rows that do not match are unlocked at
    /// once. Every relay statement (claims, marks, releases, history) runs
    /// in such a transaction: at REPEATABLE READ an `UPDATE … WHERE id IN
    /// (…)` that MariaDB plans as a whole-table scan (it does on small
    /// tables) waits for every row a producer's open transaction holds; at
    /// READ COMMITTED its semi-consistent read skips rows it does not name.
    async fn read_committed(&self) -> std::result::Result<PoolConnection<MySql>, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        // A `&str` goes over the text protocol: nothing to prepare.
        conn.execute(sql::CLAIM_ISOLATION).await?;
        Ok(conn)
    }

    /// Runs `template` (an id-list statement whose `{ids}` binds come
    /// first, followed by `tail`) over `ids` in chunks; returns the rows
    /// affected.
    async fn execute_ids(
        &self,
        conn: &mut MySqlConnection,
        template: &str,
        ids: &[i64],
        tail: Option<&Fence>,
    ) -> std::result::Result<u64, sqlx::Error> {
        let mut affected = 0;
        for chunk in ids.chunks(sql::MAX_IN_LIST) {
            let text = sql::in_list(template, sql::padded_len(chunk.len()));
            let mut q = sqlx::query(&text);
            for id in padded(chunk) {
                q = q.bind(*id);
            }
            if let Some(fence) = tail {
                q = q.bind(&fence.worker_id).bind(fence.lock_until_ms);
            }
            affected += q.execute(&mut *conn).await?.rows_affected();
        }
        Ok(affected)
    }

    /// The rows with these primary keys, in id order.
    async fn select_ids(
        &self,
        conn: &mut MySqlConnection,
        ids: &[i64],
    ) -> Result<Vec<EventRecord>> {
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(sql::MAX_IN_LIST) {
            let text = sql::in_list(&self.sql.select_ids, sql::padded_len(chunk.len()));
            let mut q = sqlx::query(&text);
            for id in padded(chunk) {
                q = q.bind(*id);
            }
            let rows = q
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| crate::db_error("replay", e))?;
            out.extend(records(rows, "replay")?);
        }
        out.sort_by_key(|r| r.id);
        Ok(out)
    }

    /// Writes one history entry per row of `ids` with `template`
    /// (`{ids}` list; `origin`, when given, is bound first), then prunes.
    async fn record_history(
        &self,
        conn: &mut MySqlConnection,
        template: &str,
        origin: Option<&str>,
        ids: &[i64],
    ) -> std::result::Result<(), sqlx::Error> {
        for chunk in ids.chunks(sql::MAX_IN_LIST) {
            let text = sql::in_list(template, sql::padded_len(chunk.len()));
            let mut q = sqlx::query(&text);
            if let Some(origin) = origin {
                q = q.bind(origin);
            }
            for id in padded(chunk) {
                q = q.bind(*id);
            }
            q.execute(&mut *conn).await?;
        }
        self.prune_history(conn, ids).await
    }

    /// Deletes history beyond [`HISTORY_LIMIT`] entries for the events of rows `ids`.
    async fn prune_history(
        &self,
        conn: &mut MySqlConnection,
        ids: &[i64],
    ) -> std::result::Result<(), sqlx::Error> {
        for chunk in ids.chunks(sql::MAX_IN_LIST) {
            let text = sql::in_list(&self.sql.history_over_limit, sql::padded_len(chunk.len()));
            let mut q = sqlx::query(&text);
            for id in padded(chunk) {
                q = q.bind(*id);
            }
            let over = q.bind(HISTORY_LIMIT).fetch_all(&mut *conn).await?;
            for row in over {
                let event_id: String = row.try_get(0)?;
                let app_code: String = row.try_get(1)?;
                sqlx::query(&self.sql.history_prune)
                    .bind(&event_id)
                    .bind(&app_code)
                    .bind(&event_id)
                    .bind(&app_code)
                    .bind(HISTORY_LIMIT - 1)
                    .execute(&mut *conn)
                    .await?;
            }
        }
        Ok(())
    }

    /// Archive batches on `conn`, which holds the archive lock.
    async fn archive_locked(
        &self,
        conn: &mut PoolConnection<MySql>,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport> {
        let db = |e| crate::db_error("archive", e);
        let mut report = ArchiveReport::default();
        for app_code in &req.app_codes {
            for (_, status, _) in ARCHIVE_QUERIES {
                loop {
                    if req.max_batches.is_some_and(|m| report.batches >= m) {
                        return Ok(report);
                    }
                    conn.execute(sql::CLAIM_ISOLATION).await.map_err(db)?;
                    let mut tx = conn.begin().await.map_err(db)?;
                    let rows = sqlx::query(&self.sql.archive_pick_lock)
                        .bind(app_code)
                        .bind(status)
                        .bind(req.before_ms)
                        .bind(i64::from(req.batch_size))
                        .fetch_all(&mut *tx)
                        .await
                        .map_err(db)?;
                    let ids = first_column(&rows).map_err(db)?;
                    let mut moved = 0;
                    if !ids.is_empty() {
                        let copied = self
                            .execute_ids(&mut tx, &self.sql.archive_copy, &ids, None)
                            .await
                            .map_err(db)?;
                        moved = self
                            .execute_ids(&mut tx, &self.sql.archive_delete, &ids, None)
                            .await
                            .map_err(db)?;
                        postbox_core::archive::log_archived_duplicates(
                            self.table.as_str(),
                            moved as i64,
                            copied as i64,
                        );
                    }
                    tx.commit().await.map_err(db)?;
                    if moved == 0 {
                        break;
                    }
                    report.moved += moved;
                    report.batches += 1;
                    on_batch(moved);
                }
            }
        }
        report.complete = true;
        Ok(report)
    }

    /// Runs `template` (an `{ids}` list after the `leading` parameters)
    /// over `ids`, in chunks.
    async fn execute_after(
        &self,
        conn: &mut MySqlConnection,
        template: &str,
        leading: &[Option<&str>],
        ids: &[i64],
    ) -> std::result::Result<(), sqlx::Error> {
        for chunk in ids.chunks(sql::MAX_IN_LIST) {
            let text = sql::in_list(template, sql::padded_len(chunk.len()));
            let mut q = sqlx::query(&text);
            for v in leading {
                q = q.bind(*v);
            }
            for id in padded(chunk) {
                q = q.bind(*id);
            }
            q.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// The replay's targets and its history, on the replayed rows `out`.
    async fn finish_replay(
        &self,
        conn: &mut MySqlConnection,
        out: &mut [EventRecord],
        origin: &str,
        targets: &ReplayTargets,
    ) -> std::result::Result<(), sqlx::Error> {
        let ids: Vec<i64> = out.iter().map(|r| r.id).collect();
        if let Some(delivered_to) = targets.delivered_to_override() {
            self.execute_after(
                conn,
                &self.sql.replay_set_delivered_to,
                &[delivered_to.as_deref()],
                &ids,
            )
            .await?;
            targets.apply(out);
        }
        for (to, group) in targets.history_groups(out) {
            self.execute_after(
                conn,
                &self.sql.history_replayed,
                &[to.as_deref(), Some(origin)],
                &group,
            )
            .await?;
        }
        self.prune_history(conn, &ids).await
    }

    /// Puts the (locked) rows `ids` back to pending and reads them back.
    async fn replay_locked(
        &self,
        conn: &mut MySqlConnection,
        ids: &[i64],
    ) -> Result<Vec<EventRecord>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.execute_ids(conn, &self.sql.replay_ids, ids, None)
            .await
            .map_err(|e| crate::db_error("replay", e))?;
        self.select_ids(conn, ids).await
    }
}

postbox_sqlx::capabilities_from_inherent!(impl[] MySqlOutbox where []);

/// The store operations, one per capability-trait method of the same name
/// (see [`OutboxStore`](postbox_core::OutboxStore) for what each does).
impl MySqlOutbox {
    /// [`ReplayStore::replay_to`](postbox_core::ReplayStore::replay_to) with the default targets.
    pub async fn replay(
        &self,
        selector: &ReplaySelector,
        dry_run: bool,
        origin: &str,
    ) -> Result<Vec<EventRecord>> {
        self.replay_to(selector, dry_run, origin, &ReplayTargets::default())
            .await
    }

    /// See `backend` of [`OutboxStore`](postbox_core::OutboxStore).
    pub fn backend(&self) -> &'static str {
        "mysql"
    }

    /// See `table` of [`OutboxStore`](postbox_core::OutboxStore).
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// See `migrate` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn migrate(&self) -> Result<MigrateReport> {
        self.run_migrations().await
    }

    /// See `claim` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn claim(
        &self,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>> {
        let db = |e| crate::db_error("claim", e);
        let select = self.sql.claim_select(source, req.ordered);
        let take = match source {
            ClaimSource::ExpiredLease => &self.sql.claim_take_expired,
            ClaimSource::Pending | ClaimSource::DueRetry => &self.sql.claim_take,
        };
        let mut conn = self.read_committed().await.map_err(db)?;
        let mut tx = conn.begin().await.map_err(db)?;
        // 1. Lock up to `limit` rows, skipping those another relay holds.
        let rows = sqlx::query(select)
            .bind(req.app_code)
            .bind(i64::from(req.limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
        let Some(first) = rows.first() else {
            tx.commit().await.map_err(db)?;
            return Ok(Vec::new());
        };
        // 2. One lease end for the whole batch, on the database clock: the fence.
        let db_now_ms: i64 = first.try_get("db_now_ms").map_err(db)?;
        let lock_until_ms = db_now_ms + req.lease_ms;
        let mut claimed = records(rows, "claim")?;
        // 3. Take the lease.
        let ids: Vec<i64> = claimed.iter().map(|r| r.id).collect();
        for chunk in ids.chunks(sql::MAX_IN_LIST) {
            let text = sql::in_list(take, sql::padded_len(chunk.len()));
            let mut q = sqlx::query(&text)
                .bind(req.worker_id)
                .bind(lock_until_ms)
                .bind(db_now_ms);
            for id in padded(chunk) {
                q = q.bind(*id);
            }
            q.execute(&mut *tx).await.map_err(db)?;
        }
        // The takeover counted an attempt: record it with the claim.
        if source == ClaimSource::ExpiredLease {
            self.record_history(&mut tx, &self.sql.history_lease_expired, None, &ids)
                .await
                .map_err(db)?;
        }
        // 4. Commit, and hand out the rows as the update left them.
        tx.commit().await.map_err(db)?;
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

    /// See `mark_delivered` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let db = |e| crate::db_error("mark delivered", e);
        let mut conn = self.read_committed().await.map_err(db)?;
        let mut tx = conn.begin().await.map_err(db)?;
        let marked = self
            .execute_ids(&mut tx, &self.sql.mark_delivered, ids, Some(fence))
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(marked)
    }

    /// See `mark_failed` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn mark_failed(&self, fence: &Fence, id: i64, u: &FailureUpdate) -> Result<bool> {
        let db = |e| crate::db_error("mark failed attempt", e);
        let mut conn = self.read_committed().await.map_err(db)?;
        let mut tx = conn.begin().await.map_err(db)?;
        let done = sqlx::query(&self.sql.mark_failed)
            .bind(u.status.as_str())
            .bind(u.retry_count)
            .bind(u.retry_after_ms)
            .bind(Some(u.delivered_to.join(",")).filter(|s| !s.is_empty()))
            .bind(&u.error)
            .bind(id)
            .bind(&fence.worker_id)
            .bind(fence.lock_until_ms)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        let written = done.rows_affected() == 1;
        if written {
            sqlx::query(&self.sql.history_failed)
                .bind(u.history_kind().as_str())
                .bind(u.retry_count)
                .bind(&u.publisher)
                .bind(&u.error)
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
            self.prune_history(&mut tx, &[id]).await.map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok(written)
    }

    /// See `release` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let db = |e| crate::db_error("release leases", e);
        let mut conn = self.read_committed().await.map_err(db)?;
        let mut tx = conn.begin().await.map_err(db)?;
        let released = self
            .execute_ids(&mut tx, &self.sql.release, ids, Some(fence))
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(released)
    }

    /// See `enqueue_batch` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn enqueue_batch(
        &self,
        events: &[NewEvent],
        max_payload_bytes: usize,
    ) -> Result<Vec<EnqueueOutcome>> {
        for e in events {
            e.validate(max_payload_bytes)?;
        }
        let this = self.clone().with_max_payload_bytes(max_payload_bytes);
        // Our own transaction, so a deadlock is retried here.
        postbox_core::error::retry_transient(|| async {
            let mut tx = self
                .pool
                .begin()
                .await
                .map_err(|e| crate::db_error("begin", e))?;
            let mut out = Vec::with_capacity(events.len());
            for e in events {
                out.push(EnqueueOutcome::from_insert(this.enqueue(&mut tx, e).await)?);
            }
            tx.commit()
                .await
                .map_err(|e| crate::db_error("commit", e))?;
            Ok(out)
        })
        .await
    }

    /// See `stats` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn stats(&self, app_codes: &[String]) -> Result<Vec<AppStats>> {
        let db = |e| crate::db_error("status", e);
        let mut out = Vec::with_capacity(app_codes.len());
        for app_code in app_codes {
            let mut s = AppStats::new(app_code);
            let rows = sqlx::query(&self.sql.count_by_status)
                .bind(app_code)
                .fetch_all(&self.pool)
                .await
                .map_err(db)?;
            for row in rows {
                let status: String = row.try_get(0).map_err(db)?;
                let n: i64 = row.try_get(1).map_err(db)?;
                s.count(&status, n);
            }
            let row = sqlx::query(&self.sql.backlog)
                .bind(app_code)
                .bind(app_code)
                .fetch_one(&self.pool)
                .await
                .map_err(db)?;
            let oldest: Option<i64> = row.try_get(0).map_err(db)?;
            let due: i64 = row.try_get(1).map_err(db)?;
            let now: i64 = row.try_get(2).map_err(db)?;
            s.backlog(oldest, due, now);
            out.push(s);
        }
        Ok(out)
    }

    /// See `list` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn list(&self, f: &EventFilter) -> Result<Vec<EventRecord>> {
        self.list_from(&self.sql.list_select, f).await
    }

    /// See `present_app_codes` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn present_app_codes(&self) -> Result<Vec<String>> {
        let codes: Vec<Option<String>> = sqlx::query_scalar(&self.sql.present_app_codes)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("list app_codes", e))?;
        Ok(codes.into_iter().flatten().collect())
    }

    /// See `list_archived` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn list_archived(&self, f: &EventFilter) -> Result<Vec<EventRecord>> {
        let select = self.sql.list_select.replace("{table}", "{archive}");
        self.list_from(&select, f).await
    }

    /// See `find_archived` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn find_archived(
        &self,
        event_id: &str,
        app_codes: &[String],
    ) -> Result<Vec<EventRecord>> {
        if app_codes.is_empty() {
            return Ok(Vec::new());
        }
        let text = sql::in_list(&self.sql.find_archived, app_codes.len());
        let mut q = sqlx::query(&text);
        for a in app_codes {
            q = q.bind(a);
        }
        let rows = q
            .bind(event_id)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("find archived event", e))?;
        records(rows, "find archived event")
    }

    /// See `delivered_per_minute` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn delivered_per_minute(
        &self,
        app_code: &str,
        since_ms: i64,
    ) -> Result<Vec<MinuteCount>> {
        let rows = sqlx::query(&self.sql.delivered_per_minute)
            .bind(app_code)
            .bind(since_ms)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("delivered per minute", e))?;
        postbox_sqlx::minute_counts(rows)
    }

    /// See `find` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query(&self.sql.find)
            .bind(event_id)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("find event", e))?;
        records(rows, "find event")
    }

    /// See `replay_to` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn replay_to(
        &self,
        selector: &ReplaySelector,
        dry_run: bool,
        origin: &str,
        targets: &ReplayTargets,
    ) -> Result<Vec<EventRecord>> {
        let db = |e| crate::db_error("replay", e);
        match selector {
            ReplaySelector::EventIds {
                app_code,
                event_ids,
            } => {
                if event_ids.is_empty() {
                    return Ok(Vec::new());
                }
                let mut conn = self.read_committed().await.map_err(db)?;
                let mut tx = conn.begin().await.map_err(db)?;
                let (template, mut ids, mut out) = if dry_run {
                    (
                        &self.sql.replay_ids_dry,
                        Vec::new(),
                        Vec::with_capacity(event_ids.len()),
                    )
                } else {
                    (
                        &self.sql.replay_ids_lock,
                        Vec::with_capacity(event_ids.len()),
                        Vec::new(),
                    )
                };
                for chunk in event_ids.chunks(sql::MAX_IN_LIST) {
                    let text = sql::in_list(template, sql::padded_len(chunk.len()));
                    let mut q = sqlx::query(&text);
                    for event_id in padded(chunk) {
                        q = q.bind(event_id);
                    }
                    let rows = q
                        .bind(app_code)
                        .bind(app_code)
                        .fetch_all(&mut *tx)
                        .await
                        .map_err(db)?;
                    if dry_run {
                        out.extend(records(rows, "replay")?);
                    } else {
                        ids.extend(first_column(&rows).map_err(db)?);
                    }
                }
                if !dry_run {
                    ids.sort_unstable();
                    ids.dedup();
                    out = self.replay_locked(&mut tx, &ids).await?;
                }
                out.sort_by_key(|r| r.id);
                if !dry_run && !out.is_empty() {
                    self.finish_replay(&mut tx, &mut out, origin, targets)
                        .await
                        .map_err(db)?;
                }
                tx.commit().await.map_err(db)?;
                Ok(out)
            }
            ReplaySelector::Filter(f) => {
                let mut conn = self.read_committed().await.map_err(db)?;
                let mut tx = conn.begin().await.map_err(db)?;
                let mut out = if dry_run {
                    let q = filtered(&self.sql.replay_filter_dry, f, "status");
                    let rows = bind_args(sqlx::query(&q.sql), &q.args)
                        .fetch_all(&mut *tx)
                        .await
                        .map_err(db)?;
                    records(rows, "replay")?
                } else {
                    let q = filtered(&self.sql.replay_filter_lock, f, "status");
                    let rows = bind_args(sqlx::query(&q.sql), &q.args)
                        .fetch_all(&mut *tx)
                        .await
                        .map_err(db)?;
                    let ids = first_column(&rows).map_err(db)?;
                    self.replay_locked(&mut tx, &ids).await?
                };
                // A time range also covers rows already archived.
                if f.since_ms.is_some() || f.until_ms.is_some() {
                    if dry_run {
                        let q = filtered(&self.sql.unarchive_filter_dry, f, "'delivered'");
                        let rows = bind_args(sqlx::query(&q.sql), &q.args)
                            .fetch_all(&mut *tx)
                            .await
                            .map_err(db)?;
                        out.extend(records(rows, "replay from archive")?);
                    } else {
                        let q = filtered(&self.sql.unarchive_filter_lock, f, "'delivered'");
                        let rows = bind_args(sqlx::query(&q.sql), &q.args)
                            .fetch_all(&mut *tx)
                            .await
                            .map_err(db)?;
                        let ids = first_column(&rows).map_err(db)?;
                        if !ids.is_empty() {
                            let op = |e| crate::db_error("replay from archive", e);
                            self.execute_ids(&mut tx, &self.sql.unarchive_ids, &ids, None)
                                .await
                                .map_err(op)?;
                            self.execute_ids(&mut tx, &self.sql.delete_unarchived, &ids, None)
                                .await
                                .map_err(op)?;
                            out.extend(self.select_ids(&mut tx, &ids).await?);
                        }
                    }
                }
                if !dry_run && !out.is_empty() {
                    self.finish_replay(&mut tx, &mut out, origin, targets)
                        .await
                        .map_err(db)?;
                }
                tx.commit().await.map_err(db)?;
                Ok(out)
            }
        }
    }

    /// See `archive` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn archive(
        &self,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport> {
        let db = |e| crate::db_error("archive", e);
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let locked: Option<i64> = sqlx::query_scalar(sql::ARCHIVE_LOCK)
            .bind(self.table.as_str())
            .fetch_one(&mut *conn)
            .await
            .map_err(db)?;
        if locked != Some(1) {
            return Ok(ArchiveReport {
                locked_out: true,
                ..Default::default()
            });
        }
        let report = self.archive_locked(&mut conn, req, on_batch).await;
        let released = sqlx::query(sql::ARCHIVE_UNLOCK)
            .bind(self.table.as_str())
            .execute(&mut *conn)
            .await;
        if let Err(e) = released {
            // The lock dies with the session: make sure the session dies.
            tracing::warn!(error = %e, "could not release the archive lock; closing its connection");
            conn.close_on_drop();
        }
        report
    }

    /// See `inspect_schema` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn inspect_schema(&self) -> Result<SchemaReport> {
        self.schema_report().await
    }

    /// See `explain_index_use` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn explain_index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>> {
        self.index_use(app_code).await
    }

    /// See `history` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn history(&self, event_id: &str) -> Result<Vec<HistoryEntry>> {
        let rows = sqlx::query(&self.sql.history)
            .bind(event_id)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("read history", e))?;
        history_entries(rows)
    }

    /// See `archived_event_ids` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn archived_event_ids(
        &self,
        app_code: &str,
        event_ids: &[String],
    ) -> Result<Vec<String>> {
        let template = self.table.render(sql::ARCHIVED_EVENT_IDS);
        let mut out = Vec::new();
        for chunk in event_ids.chunks(sql::MAX_IN_LIST) {
            let text = sql::in_list(&template, sql::padded_len(chunk.len()));
            let mut q = sqlx::query_scalar::<_, String>(&text).bind(app_code);
            for id in padded(chunk) {
                q = q.bind(id);
            }
            let found = q
                .fetch_all(&self.pool)
                .await
                .map_err(|e| crate::db_error("look up archived events", e))?;
            out.extend(found);
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// See `stuck_aggregates` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn stuck_aggregates(
        &self,
        app_code: &str,
        older_than_ms: i64,
        limit: u32,
    ) -> Result<Vec<postbox_core::store::StuckAggregate>> {
        let rows = sqlx::query(&self.table.render(crate::sql::STUCK_AGGREGATES))
            .bind(app_code)
            .bind(older_than_ms)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("find stuck aggregates", e))?;
        postbox_sqlx::stuck_aggregates(app_code, rows)
    }

    /// See `now_ms` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn now_ms(&self) -> Result<i64> {
        sqlx::query_scalar(&self.sql.now_ms)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| crate::db_error("read database clock", e))
    }

    /// See `explain_claims` of [`OutboxStore`](postbox_core::OutboxStore).
    pub async fn explain_claims(
        &self,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<postbox_core::store::QueryPlan>> {
        self.explain_claim_queries(app_code, limit).await
    }
}

impl MySqlOutbox {
    /// `list` over `select` (`SELECT <columns> FROM {table}` or `{archive}`).
    async fn list_from(&self, select: &str, f: &EventFilter) -> Result<Vec<EventRecord>> {
        let q = postbox_sqlx::list_query(select, f, PH);
        let sql = self.table.render(&q.sql);
        let rows = bind_args(sqlx::query(&sql), &q.args)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("list events", e))?;
        records(rows, "list events")
    }
}
