//! [`OutboxStore`] for PostgreSQL.

use async_trait::async_trait;
use sqlx::Row;

use postbox_core::event::Fence;
use postbox_core::store::{
    AppStats, ArchiveReport, ArchiveRequest, ClaimRequest, EnqueueOutcome, EventFilter,
    FailureUpdate, HistoryEntry, MigrateReport, MinuteCount, OutboxStore, QueryPlan,
    ReplaySelector, ReplayTargets, SchemaReport, HISTORY_LIMIT,
};
use postbox_core::{ClaimSource, ClaimedEvent, EventRecord, NewEvent, Result, Status, TableName};

use crate::PgOutbox;

use postbox_sqlx::{history_entries, records, ListArg, Placeholders};

const PH: Placeholders = Placeholders::Numbered;

impl PgOutbox {
    /// Deletes history beyond [`HISTORY_LIMIT`] entries for the events of rows `ids`.
    async fn prune_history(
        &self,
        conn: &mut sqlx::PgConnection,
        ids: &[i64],
    ) -> std::result::Result<(), sqlx::Error> {
        sqlx::query(&self.sql.history_prune)
            .bind(ids)
            .bind(HISTORY_LIMIT)
            .execute(conn)
            .await
            .map(|_| ())
    }
}

#[async_trait]
impl OutboxStore for PgOutbox {
    fn backend(&self) -> &'static str {
        "postgres"
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
        let query = sqlx::query(sql)
            .bind(req.app_code)
            .bind(i64::from(req.limit))
            .bind(req.worker_id)
            .bind(req.lease_ms);
        let claimed = if source == ClaimSource::ExpiredLease {
            // The takeover counts an attempt: record it in the claim's
            // transaction.
            let mut tx = self.pool.begin().await.map_err(db)?;
            let claimed = records(query.fetch_all(&mut *tx).await.map_err(db)?, "claim")?;
            if !claimed.is_empty() {
                let ids: Vec<i64> = claimed.iter().map(|r| r.id).collect();
                sqlx::query(&self.sql.history_lease_expired)
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                self.prune_history(&mut tx, &ids).await.map_err(db)?;
            }
            tx.commit().await.map_err(db)?;
            claimed
        } else {
            // One statement: no transaction round trips on the hot path.
            records(query.fetch_all(&self.pool).await.map_err(db)?, "claim")?
        };
        Ok(claimed
            .into_iter()
            .map(|record| ClaimedEvent { record, source })
            .collect())
    }

    async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        let done = sqlx::query(&self.sql.mark_delivered)
            .bind(ids)
            .bind(&fence.worker_id)
            .bind(fence.lock_until_ms)
            .execute(&self.pool)
            .await
            .map_err(|e| crate::db_error("mark delivered", e))?;
        Ok(done.rows_affected())
    }

    async fn mark_failed(&self, fence: &Fence, id: i64, u: &FailureUpdate) -> Result<bool> {
        let db = |e| crate::db_error("mark failed attempt", e);
        let mut tx = self.pool.begin().await.map_err(db)?;
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
            self.prune_history(&mut tx, &[id]).await.map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok(written)
    }

    async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        let done = sqlx::query(&self.sql.release)
            .bind(ids)
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
                let status: String = row.get(0);
                let n: i64 = row.get(1);
                s.count(&status, n);
            }
            let row = sqlx::query(&self.sql.backlog)
                .bind(app_code)
                .fetch_one(&self.pool)
                .await
                .map_err(db)?;
            let oldest: Option<i64> = row.get(0);
            let due: i64 = row.get(1);
            let now: i64 = row.get(2);
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
            .bind(app_codes)
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
        let mut tx = self.pool.begin().await.map_err(db)?;
        let mut out = match selector {
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
                    .bind(event_ids)
                    .bind(app_code)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db)?;
                records(rows, "replay")?
            }
            ReplaySelector::Filter(f) => {
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
                    let back = records(rows, "replay from archive")?;
                    if !dry_run && !back.is_empty() {
                        let ids: Vec<i64> = back.iter().map(|r| r.id).collect();
                        sqlx::query(&self.sql.delete_unarchived)
                            .bind(&ids)
                            .execute(&mut *tx)
                            .await
                            .map_err(db)?;
                    }
                    out.extend(back);
                }
                out
            }
        };
        if !dry_run && !out.is_empty() {
            let ids: Vec<i64> = out.iter().map(|r| r.id).collect();
            if let Some(delivered_to) = targets.delivered_to_override() {
                sqlx::query(&self.sql.replay_set_delivered_to)
                    .bind(&ids)
                    .bind(delivered_to)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
                targets.apply(&mut out);
            }
            for (to, group) in targets.history_groups(&out) {
                sqlx::query(&self.sql.history_replayed)
                    .bind(&group)
                    .bind(origin)
                    .bind(to)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
            }
            self.prune_history(&mut tx, &ids).await.map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok(out)
    }

    async fn archive(
        &self,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport> {
        self.archive_rows(req, on_batch).await
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
        sqlx::query_scalar(&self.table.render(crate::sql::ARCHIVED_EVENT_IDS))
            .bind(app_code)
            .bind(event_ids)
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

impl PgOutbox {
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
