//! PostgreSQL as a dialect of the postbox engine: its statements, its
//! claim (one `UPDATE … RETURNING` over rows picked `FOR UPDATE SKIP
//! LOCKED`), its insert (`ON CONFLICT DO NOTHING RETURNING id`), its
//! advisory locks and its archive batch (one statement).

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgQueryResult;
use sqlx::{PgConnection, PgPool, Postgres, Row};

use postbox_core::config::RelayCommit;
use postbox_core::store::{ClaimRequest, QueryPlan, StatementStats};
use postbox_core::{ClaimSource, ClaimedEvent, NewEvent, Result, TableName};
use postbox_sqlx::dialect::{duplicate_event, insert_values, ClaimStatements, Q};
use postbox_sqlx::{claimed_records, db_error, query, Connect, Dialect, SqlOutbox, Value};

use crate::sql;

/// The PostgreSQL dialect.
#[derive(Debug, Clone, Copy)]
pub struct PgDialect;

/// Statements only PostgreSQL's hooks run, rendered once per store.
#[derive(Debug)]
pub struct Own {
    pub(crate) insert_event: String,
    insert_event_partitioned: String,
    pub(crate) claims: ClaimStatements,
    claim_pending_ordered_deep: String,
    pub(crate) archive_batch: String,
    pub(crate) archive_pick: String,
    archive_pick_lock: String,
    pub(crate) delivered_estimate: String,
}

#[async_trait]
impl Dialect for PgDialect {
    postbox_sqlx::dialect_constants!(db: Postgres, backend: "postgres", placeholders: Numbered, begin_write: None);
    const FOLDS_NAMES: bool = true;
    const CONTINUE_IDS_AFTER_ARCHIVE: &'static [&'static str] = &[sql::CONTINUE_IDS_AFTER_ARCHIVE];
    const REPLAY_FAILED_INDEX: &'static str = "_failed_idx";
    const PARTITIONS: Option<postbox_sqlx::PartitionSql> = Some(sql::PARTITIONS);
    const ADOPT: Option<postbox_sqlx::Adopt> = Some(postbox_sqlx::Adopt {
        columns_of: sql::ADOPT_COLUMNS,
        indexes: None,
        invalid_indexes: Some(sql::ADOPT_INVALID_INDEXES),
        indexes_of: sql::ADOPT_INDEXES_OF,
        drop_index: "DROP INDEX CONCURRENTLY IF EXISTS {name}",
        online_index: sql::online_index,
        add_column: sql::add_column,
    });

    fn own(t: &TableName) -> Own {
        Own {
            insert_event: t.render(sql::INSERT_EVENT),
            insert_event_partitioned: t.render(sql::INSERT_EVENT_PARTITIONED),
            claims: ClaimStatements::render(t, sql::CLAIMS),
            claim_pending_ordered_deep: t.render(sql::CLAIM_PENDING_ORDERED_DEEP),
            archive_batch: t.render(sql::ARCHIVE_BATCH),
            archive_pick: t.render(sql::ARCHIVE_PICK),
            archive_pick_lock: t.render(sql::ARCHIVE_PICK_LOCK),
            delivered_estimate: t.render(sql::DELIVERED_ESTIMATE),
        }
    }

    /// Sessions without JIT compilation: postbox's statements are short
    /// index reads and writes, and the planner's cost estimate of a claim
    /// with common tables (the recursive scans of the fair and
    /// per-aggregate claims) passes `jit_above_cost`, when compiling it
    /// takes about 20 ms, ten times the claim itself.
    async fn connect_pool(url: &str, max_connections: u32, how: Connect) -> Result<PgPool> {
        postbox_sqlx::connect_server(
            url,
            url,
            max_connections,
            how,
            "connecting to PostgreSQL",
            |opts: sqlx::postgres::PgConnectOptions| opts.options([("jit", "off")]),
        )
        .await
    }

    /// With `relay_commit = "async"`: `synchronous_commit = off` for the
    /// session, connected on first use (a store that never relays never
    /// opens them). Two connections: the claimer's and the marker's.
    fn relay_pool(pool: &PgPool, commit: RelayCommit) -> Option<PgPool> {
        if commit == RelayCommit::Sync {
            return None;
        }
        let options = (*pool.connect_options())
            .clone()
            .options([("synchronous_commit", "off")]);
        Some(
            postbox_sqlx::released_within(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(2)
                    .acquire_timeout(std::time::Duration::from_secs(10)),
            )
            .connect_lazy_with(options),
        )
    }

    /// From `pg_stat_statements`, which must be preloaded and created.
    async fn statement_stats(outbox: &SqlOutbox<Self>) -> Result<StatementStats> {
        let rows = sqlx::query(sql::STATEMENT_STATS)
            .bind(outbox.table().as_str())
            .fetch_all(outbox.pool())
            .await;
        let rows = match rows {
            // 42P01: the view is not there; 55000: the library is not loaded.
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("42P01") | Some("55000")) =>
            {
                return Err(postbox_core::Error::Schema(format!(
                    "pg_stat_statements is not available ({}): add it to shared_preload_libraries in postgresql.conf, restart PostgreSQL, and run `CREATE EXTENSION pg_stat_statements` in this database",
                    e.message()
                )));
            }
            rows => rows.map_err(|e| db_error("read pg_stat_statements", e))?,
        };
        let mut stats = postbox_sqlx::statement_stats_of(rows, "pg_stat_statements")?;
        for s in &mut stats.statements {
            s.text = epoch_back(&s.text);
        }
        Ok(stats)
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn bind<'q>(q: Q<'q, Postgres>, value: Value<'q>) -> Q<'q, Postgres> {
        match value {
            Value::Text(v) => q.bind(v),
            Value::Int(v) => q.bind(v),
            Value::Int32(v) => q.bind(v),
            Value::Ids(ids) => q.bind(ids),
            Value::Texts(texts) => q.bind(texts),
        }
    }

    /// `ON CONFLICT DO NOTHING` keeps the caller's transaction usable when
    /// the event id already exists: no row comes back.
    async fn insert_event(
        outbox: &SqlOutbox<Self>,
        conn: &mut PgConnection,
        event: &NewEvent,
    ) -> Result<i64> {
        let headers = event.headers_json();
        let own = outbox.own();
        let insert = match outbox.partitioning() {
            Some(_) => &own.insert_event_partitioned,
            None => &own.insert_event,
        };
        let row = query::<Self>(insert, insert_values(event, &headers))
            .fetch_optional(conn)
            .await
            .map_err(|e| db_error("enqueue", e))?;
        let id: Option<i64> = row
            .map(|r| r.try_get(0))
            .transpose()
            .map_err(|e| db_error("enqueue", e))?;
        id.ok_or_else(|| duplicate_event(event))
    }

    async fn claim(
        outbox: &SqlOutbox<Self>,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>> {
        let db = |e| db_error("claim", e);
        let query = sql::claim_query(outbox.own().claims.of(source, req.ordered), source, req);
        let (claimed, unreadable) = if source == ClaimSource::ExpiredLease {
            // The takeover counts an attempt: record it in the claim's
            // transaction.
            let mut tx = outbox.begin_bookkeeping(true).await.map_err(db)?;
            let (claimed, unreadable) = claimed_records(
                query.fetch_all(&mut *tx).await.map_err(db)?,
                outbox.table().naming(),
            )?;
            if !claimed.is_empty() {
                let ids: Vec<i64> = claimed.iter().map(|r| r.id).collect();
                outbox
                    .record_lease_expired(&mut tx, &ids)
                    .await
                    .map_err(db)?;
            }
            tx.commit().await.map_err(db)?;
            (claimed, unreadable)
        } else {
            // One statement: no transaction round trips on the hot path.
            let (mut claimed, mut unreadable) = claimed_records(
                query
                    .fetch_all(outbox.bookkeeping_pool())
                    .await
                    .map_err(db)?,
                outbox.table().naming(),
            )?;
            // A per-aggregate claim that came back short claims once more,
            // reading past the followers of held aggregates
            // (`postbox_sqlx::deep_candidates!`).
            let taken = (claimed.len() + unreadable.len()) as u32;
            if source == ClaimSource::Pending && req.ordered && taken < req.limit {
                let rest = postbox_core::store::ClaimRequest {
                    limit: req.limit - taken,
                    ..*req
                };
                let deep =
                    sql::claim_query(&outbox.own().claim_pending_ordered_deep, source, &rest)
                        .bind(i64::from(req.limit));
                let more = deep
                    .fetch_all(outbox.bookkeeping_pool())
                    .await
                    .map_err(db)
                    .and_then(|rows| claimed_records(rows, outbox.table().naming()));
                match more {
                    Ok((more, more_unreadable)) => {
                        claimed.extend(more);
                        unreadable.extend(more_unreadable);
                    }
                    // The first statement's rows are leased (committed):
                    // they go out; the rest waits for the next claim.
                    Err(e) => tracing::warn!(
                        app_code = req.app_code,
                        error = %e,
                        "the per-aggregate claim's second statement failed; the rows of the first go on"
                    ),
                }
            }
            (claimed, unreadable)
        };
        if !unreadable.is_empty() {
            // Each row carries the lease end the claim wrote.
            outbox
                .fail_unreadable(req.app_code, &unreadable, req.worker_id, 0)
                .await;
        }
        Ok(claimed
            .into_iter()
            .map(|record| ClaimedEvent { record, source })
            .collect())
    }

    /// A session advisory lock on the archiver's own connection (released
    /// at the end, or when the session dies with its process).
    async fn archive_lock(conn: &mut PoolConnection<Postgres>, table: &TableName) -> Result<bool> {
        sqlx::query_scalar(sql::ARCHIVE_LOCK)
            .bind(table.as_str())
            .fetch_one(&mut **conn)
            .await
            .map_err(|e| db_error("archive", e))
    }

    async fn archive_unlock(
        conn: &mut PoolConnection<Postgres>,
        table: &TableName,
    ) -> std::result::Result<(), sqlx::Error> {
        sqlx::query(sql::ARCHIVE_UNLOCK)
            .bind(table.as_str())
            .execute(&mut **conn)
            .await
            .map(|_| ())
    }

    fn archive_pick_lock<'a>(
        outbox: &'a SqlOutbox<Self>,
        app_code: &'a str,
        before_ms: i64,
        size: u32,
    ) -> (&'a str, Vec<Value<'a>>) {
        let binds = vec![app_code.into(), before_ms.into(), i64::from(size).into()];
        (&outbox.own().archive_pick_lock, binds)
    }

    /// One statement: copy, delete, and count both.
    async fn archive_batch(
        outbox: &SqlOutbox<Self>,
        conn: &mut PoolConnection<Postgres>,
        app_code: &str,
        before_ms: i64,
        batch_size: u32,
    ) -> Result<(u64, u64)> {
        let db = |e| db_error("archive", e);
        let row = sqlx::query(&outbox.own().archive_batch)
            .bind(app_code)
            .bind(before_ms)
            .bind(i64::from(batch_size))
            .fetch_one(&mut **conn)
            .await
            .map_err(db)?;
        let deleted: i64 = row.try_get("deleted").map_err(db)?;
        let copied: i64 = row.try_get("copied").map_err(db)?;
        Ok((deleted as u64, copied as u64))
    }

    /// Serialises concurrent `migrate` runs, of any table: they share the
    /// migrations table, whose `CREATE … IF NOT EXISTS` is not race-free.
    async fn migration_lock(conn: &mut PgConnection) -> std::result::Result<(), sqlx::Error> {
        sqlx::query(sql::MIGRATION_LOCK).execute(&mut *conn).await?;
        sqlx::query(sql::MIGRATION_LOCK_WAIT)
            .execute(conn)
            .await
            .map(|_| ())
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

    async fn delivered_estimate(
        outbox: &SqlOutbox<Self>,
        app_code: &str,
    ) -> Option<Result<(i64, bool)>> {
        Some(
            crate::explain::delivered_estimate(outbox, app_code)
                .await
                .map(|n| (n, true)),
        )
    }

    fn due_query<'q>(
        table: &TableName,
        app_codes: &'q [String],
    ) -> Option<(String, Vec<Value<'q>>)> {
        Some((table.render(sql::DUE), vec![Value::Texts(app_codes)]))
    }

    fn listen(
        outbox: &SqlOutbox<Self>,
        wake: postbox_core::wake::Wake,
        shutdown: postbox_core::relay::CancellationToken,
    ) -> Option<postbox_sqlx::dialect::WakeFuture> {
        let options = (*outbox.pool().connect_options()).clone();
        let channel = crate::wake::channel(outbox.table());
        Some(Box::pin(crate::wake::listen(
            options, channel, wake, shutdown,
        )))
    }

    fn triggers() -> &'static [&'static str] {
        &["_wake"]
    }

    async fn notify_pending(
        outbox: &SqlOutbox<Self>,
        conn: &mut PgConnection,
    ) -> std::result::Result<(), sqlx::Error> {
        sqlx::query(sql::NOTIFY_PENDING)
            .bind(crate::wake::channel(outbox.table()))
            .execute(conn)
            .await
            .map(|_| ())
    }
}

/// A pg_stat_statements text as written: the statistics replace the
/// field of `EXTRACT(EPOCH FROM …)` by a placeholder too (`EXTRACT($7
/// FROM …)`), which no SQL grammar (nor `doctor --scans`'s parser) takes.
fn epoch_back(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("EXTRACT($") {
        let (head, tail) = rest.split_at(at + "EXTRACT(".len());
        out.push_str(head);
        let digits = tail[1..]
            .find(|c: char| !c.is_ascii_digit())
            .map_or(tail.len(), |n| n + 1);
        if tail[digits..].starts_with(" FROM") {
            out.push_str("EPOCH");
            rest = &tail[digits..];
        } else {
            rest = tail;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::epoch_back;

    #[test]
    fn the_epoch_field_comes_back_and_nothing_else_changes() {
        assert_eq!(
            epoch_back(
                "SELECT (EXTRACT($3 FROM now()) * $4)::BIGINT, EXTRACT($12 FROM x) WHERE a = $1"
            ),
            "SELECT (EXTRACT(EPOCH FROM now()) * $4)::BIGINT, EXTRACT(EPOCH FROM x) WHERE a = $1"
        );
        assert_eq!(
            epoch_back("EXTRACT($1) AND EXTRACT($"),
            "EXTRACT($1) AND EXTRACT($"
        );
    }
}
