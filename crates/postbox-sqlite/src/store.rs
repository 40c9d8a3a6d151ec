//! [`OutboxStore`] for SQLite.

use async_trait::async_trait;
use sqlx::Row;

use postbox_core::event::Fence;
use postbox_core::store::{
    AppStats, ArchiveReport, ArchiveRequest, ClaimRequest, EnqueueOutcome, EventFilter,
    FailureUpdate, HistoryEntry, MigrateReport, MinuteCount, OutboxStore, QueryPlan,
    ReplaySelector, ReplayTargets, SchemaReport, ARCHIVE_QUERIES, HISTORY_LIMIT,
};
use postbox_core::{ClaimSource, ClaimedEvent, EventRecord, NewEvent, Result, Status, TableName};

use crate::{finish, SqliteOutbox};

use postbox_sqlx::{history_entries, records, ListArg, Placeholders};

const PH: Placeholders = Placeholders::Question;

/// An id list as the JSON array text `json_each` reads.
fn json_list<T: Clone + Into<serde_json::Value>>(items: &[T]) -> String {
    serde_json::Value::from(items.to_vec()).to_string()
}

impl SqliteOutbox {
    /// Writes one history entry per row of `ids` with `sql` (?1 the ids,
    /// ?2 the origin when given), then deletes entries beyond
    /// [`HISTORY_LIMIT`] for those events.
    async fn record_history(
        &self,
        conn: &mut sqlx::SqliteConnection,
        sql: &str,
        origin: Option<&str>,
        ids: &[i64],
    ) -> std::result::Result<(), sqlx::Error> {
        let list = json_list(ids);
        let mut q = sqlx::query(sql).bind(&list);
        if let Some(origin) = origin {
            q = q.bind(origin);
        }
        q.execute(&mut *conn).await?;
        self.prune_history(conn, &list).await
    }

    async fn prune_history(
        &self,
        conn: &mut sqlx::SqliteConnection,
        ids_json: &str,
    ) -> std::result::Result<(), sqlx::Error> {
        sqlx::query(&self.sql.history_prune)
            .bind(ids_json)
            .bind(HISTORY_LIMIT)
            .execute(conn)
            .await
            .map(|_| ())
    }
}

#[async_trait]
impl OutboxStore for SqliteOutbox {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn table(&self) -> &TableName {
        &self.table
    }

    async fn migrate(&self) -> Result<MigrateReport> {
        self.run_migrations().await
    }

    async fn claim(
        &self,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>> {
        let db = |e| crate::db_error("claim", e);
        let sql = self.sql.claim_select(source, req.ordered);
        // SQLite is embedded: the host clock is the database clock. The lease
        // end is computed once, so every row of this claim shares one fence.
        let now = postbox_core::time::now_ms();
        let lock_until_ms = now + req.lease_ms;
        // One immediate write transaction per claim, in place of
        // `FOR UPDATE SKIP LOCKED`.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(db)?;
        let res = async {
            let rows = sqlx::query(sql)
                .bind(req.app_code)
                .bind(i64::from(req.limit))
                .bind(req.worker_id)
                .bind(lock_until_ms)
                .bind(now)
                .fetch_all(&mut *tx)
                .await
                .map_err(db)?;
            let claimed = records(rows, "claim")?;
            if source == ClaimSource::ExpiredLease && !claimed.is_empty() {
                // The takeover counted an attempt: record it with the claim.
                let ids: Vec<i64> = claimed.iter().map(|r| r.id).collect();
                self.record_history(&mut tx, &self.sql.history_lease_expired, None, &ids)
                    .await
                    .map_err(db)?;
            }
            Ok(claimed)
        }
        .await;
        let mut claimed = finish(tx, res, "claim").await?;
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

    async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.sql.mark_delivered)
            .bind(json_list(ids))
            .bind(&fence.worker_id)
            .bind(fence.lock_until_ms)
            .execute(&self.pool)
            .await
            .map_err(|e| crate::db_error("mark delivered", e))?;
        Ok(done.rows_affected())
    }

    async fn mark_failed(&self, fence: &Fence, id: i64, u: &FailureUpdate) -> Result<bool> {
        let db = |e| crate::db_error("mark failed attempt", e);
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(db)?;
        let res = async {
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
                    .bind(id)
                    .bind(u.history_kind().as_str())
                    .bind(u.retry_count)
                    .bind(&u.publisher)
                    .bind(&u.error)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                self.prune_history(&mut tx, &json_list(&[id]))
                    .await
                    .map_err(db)?;
            }
            Ok(written)
        }
        .await;
        finish(tx, res, "mark failed attempt").await
    }

    async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.sql.release)
            .bind(json_list(ids))
            .bind(&fence.worker_id)
            .bind(fence.lock_until_ms)
            .execute(&self.pool)
            .await
            .map_err(|e| crate::db_error("release leases", e))?;
        Ok(done.rows_affected())
    }

    async fn enqueue_batch(
        &self,
        events: &[NewEvent],
        max_payload_bytes: usize,
    ) -> Result<Vec<EnqueueOutcome>> {
        for e in events {
            e.validate(max_payload_bytes)?;
        }
        let this = self.clone().with_max_payload_bytes(max_payload_bytes);
        // Our own transaction, so a conflict is retried here.
        postbox_core::error::retry_transient(|| async {
            let mut tx = self
                .pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(|e| crate::db_error("begin", e))?;
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

    async fn stats(&self, app_codes: &[String]) -> Result<Vec<AppStats>> {
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

    async fn list(&self, f: &EventFilter) -> Result<Vec<EventRecord>> {
        self.list_from(&self.sql.list_select, f).await
    }

    async fn present_app_codes(&self) -> Result<Vec<String>> {
        let codes: Vec<Option<String>> = sqlx::query_scalar(&self.sql.present_app_codes)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("list app_codes", e))?;
        Ok(codes.into_iter().flatten().collect())
    }

    async fn list_archived(&self, f: &EventFilter) -> Result<Vec<EventRecord>> {
        let select = self.sql.list_select.replace("{table}", "{archive}");
        self.list_from(&select, f).await
    }

    async fn find_archived(
        &self,
        event_id: &str,
        app_codes: &[String],
    ) -> Result<Vec<EventRecord>> {
        if app_codes.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(&self.sql.find_archived)
            .bind(json_list(app_codes))
            .bind(event_id)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("find archived event", e))?;
        records(rows, "find archived event")
    }

    async fn delivered_per_minute(
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

    async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>> {
        let rows = sqlx::query(&self.sql.find)
            .bind(event_id)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("find event", e))?;
        records(rows, "find event")
    }

    async fn replay_to(
        &self,
        selector: &ReplaySelector,
        dry_run: bool,
        origin: &str,
        targets: &ReplayTargets,
    ) -> Result<Vec<EventRecord>> {
        let db = |e| crate::db_error("replay", e);
        // A dry run only reads (one consistent snapshot); a real replay
        // takes the write lock up front.
        let mut tx = if dry_run {
            self.pool.begin().await
        } else {
            self.pool.begin_with("BEGIN IMMEDIATE").await
        }
        .map_err(db)?;
        let res = async {
            let out = match selector {
                ReplaySelector::EventIds {
                    app_code,
                    event_ids,
                } => {
                    let sql = if dry_run {
                        &self.sql.replay_ids_dry
                    } else {
                        &self.sql.replay_ids
                    };
                    let rows = sqlx::query(sql)
                        .bind(json_list(event_ids))
                        .bind(app_code)
                        .fetch_all(&mut *tx)
                        .await
                        .map_err(db)?;
                    let mut out = records(rows, "replay")?;
                    out.sort_by_key(|r| r.id);
                    out
                }
                ReplaySelector::Filter(f) => {
                    {
                        let live_sql = if dry_run {
                            &self.sql.replay_filter_dry
                        } else {
                            &self.sql.replay_filter
                        };
                        let rows = sqlx::query(live_sql)
                            .bind(&f.app_code)
                            .bind(f.status.map(Status::as_str))
                            .bind(&f.event_type)
                            .bind(f.since_ms)
                            .bind(f.until_ms)
                            .fetch_all(&mut *tx)
                            .await
                            .map_err(db)?;
                        let mut out = records(rows, "replay")?;
                        out.sort_by_key(|r| r.id);
                        // A time range also covers rows already archived.
                        if f.since_ms.is_some() || f.until_ms.is_some() {
                            let sql = if dry_run {
                                &self.sql.unarchive_filter_dry
                            } else {
                                &self.sql.unarchive_filter
                            };
                            let rows = sqlx::query(sql)
                                .bind(&f.app_code)
                                .bind(f.status.map(Status::as_str))
                                .bind(&f.event_type)
                                .bind(f.since_ms)
                                .bind(f.until_ms)
                                .fetch_all(&mut *tx)
                                .await
                                .map_err(db)?;
                            let mut back = records(rows, "replay from archive")?;
                            back.sort_by_key(|r| r.id);
                            if !dry_run && !back.is_empty() {
                                let ids: Vec<i64> = back.iter().map(|r| r.id).collect();
                                sqlx::query(&self.sql.delete_unarchived)
                                    .bind(json_list(&ids))
                                    .execute(&mut *tx)
                                    .await
                                    .map_err(db)?;
                            }
                            out.extend(back);
                        }
                        out
                    }
                }
            };
            let mut out = out;
            if !dry_run && !out.is_empty() {
                let ids: Vec<i64> = out.iter().map(|r| r.id).collect();
                if let Some(delivered_to) = targets.delivered_to_override() {
                    sqlx::query(&self.sql.replay_set_delivered_to)
                        .bind(json_list(&ids))
                        .bind(delivered_to)
                        .execute(&mut *tx)
                        .await
                        .map_err(db)?;
                    targets.apply(&mut out);
                }
                for (to, group) in targets.history_groups(&out) {
                    sqlx::query(&self.sql.history_replayed)
                        .bind(json_list(&group))
                        .bind(origin)
                        .bind(to)
                        .execute(&mut *tx)
                        .await
                        .map_err(db)?;
                }
                self.prune_history(&mut tx, &json_list(&ids))
                    .await
                    .map_err(db)?;
            }
            Ok(out)
        }
        .await;
        finish(tx, res, "replay").await
    }

    async fn archive(
        &self,
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
                    let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(db)?;
                    let batch = |sql| {
                        sqlx::query(sql)
                            .bind(app_code)
                            .bind(status)
                            .bind(req.before_ms)
                            .bind(i64::from(req.batch_size))
                    };
                    let res = async {
                        let copied = batch(&self.sql.archive_copy)
                            .execute(&mut *tx)
                            .await
                            .map_err(db)?
                            .rows_affected();
                        let deleted = batch(&self.sql.archive_delete)
                            .execute(&mut *tx)
                            .await
                            .map_err(db)?
                            .rows_affected();
                        postbox_core::archive::log_archived_duplicates(
                            self.table.as_str(),
                            deleted as i64,
                            copied as i64,
                        );
                        Ok(deleted)
                    }
                    .await;
                    let moved = finish(tx, res, "archive").await?;
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

    async fn inspect_schema(&self) -> Result<SchemaReport> {
        self.schema_report().await
    }

    async fn explain_index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>> {
        self.index_use(app_code).await
    }

    async fn history(&self, event_id: &str) -> Result<Vec<HistoryEntry>> {
        let rows = sqlx::query(&self.sql.history)
            .bind(event_id)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("read history", e))?;
        history_entries(rows)
    }

    async fn archived_event_ids(
        &self,
        app_code: &str,
        event_ids: &[String],
    ) -> Result<Vec<String>> {
        let ids = json_list(event_ids);
        sqlx::query_scalar(&self.table.render(crate::sql::ARCHIVED_EVENT_IDS))
            .bind(app_code)
            .bind(ids)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("look up archived events", e))
    }

    async fn stuck_aggregates(
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

    async fn now_ms(&self) -> Result<i64> {
        sqlx::query_scalar(&self.sql.now_ms)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| crate::db_error("read database clock", e))
    }

    async fn explain_claims(
        &self,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<postbox_core::store::QueryPlan>> {
        self.explain_claim_queries(app_code, limit).await
    }
}

impl SqliteOutbox {
    /// `list` over `select` (`SELECT <columns> FROM {table}` or `{archive}`).
    async fn list_from(&self, select: &str, f: &EventFilter) -> Result<Vec<EventRecord>> {
        let q = postbox_sqlx::list_query(select, f, PH);
        let sql = self.table.render(&q.sql);
        let mut query = sqlx::query(&sql);
        for arg in q.args {
            query = match arg {
                ListArg::Text(s) => query.bind(s),
                ListArg::Int(i) => query.bind(i),
            };
        }
        let rows = query
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::db_error("list events", e))?;
        records(rows, "list events")
    }
}
