//! What `postbox doctor` asks of SQLite: `EXPLAIN QUERY PLAN`, which
//! (without `ANALYZE` statistics) picks an index from the query's shape
//! alone, so a fresh table shows what a full one would.

use sqlx::Row;

use postbox_core::store::{QueryPlan, ARCHIVE_QUERY};
use postbox_core::Result;
use postbox_sqlx::{db_error, ReplayProbeArgs};

use crate::sql::{ARCHIVE_INDEX, CLAIM_INDEXES};
use crate::{SqliteDialect, SqliteOutbox};

/// The `detail` lines of `EXPLAIN QUERY PLAN` for `q`.
async fn detail_lines<'q>(
    outbox: &SqliteOutbox,
    q: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
    op: &'static str,
) -> Result<Vec<String>> {
    q.fetch_all(outbox.pool())
        .await
        .map_err(|e| db_error(op, e))?
        .iter()
        .map(|r| r.try_get::<String, _>("detail"))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| db_error(op, e))
}

/// Plans of the claim queries.
pub(crate) async fn claim_plans(
    outbox: &SqliteOutbox,
    app_code: &str,
    limit: u32,
) -> Result<Vec<QueryPlan>> {
    let t = outbox.table().as_str();
    let mut plans = Vec::with_capacity(CLAIM_INDEXES.len());
    for (query, source, ordered, index_suffix) in CLAIM_INDEXES {
        let sql = format!(
            "EXPLAIN QUERY PLAN {}",
            outbox.own().claims.of(source, ordered)
        );
        // Parameters only shape the plan here; their values do not matter.
        let q = sqlx::query(&sql)
            .bind(app_code)
            .bind(i64::from(limit))
            .bind("postbox-explain")
            .bind(30_000_i64)
            .bind(0_i64);
        let text = detail_lines(outbox, q, "explain claims").await?;
        plans.push(query_plan(query, t, index_suffix, text));
    }
    Ok(plans)
}

/// Plans of the claim and archive queries.
pub(crate) async fn index_use(outbox: &SqliteOutbox, app_code: &str) -> Result<Vec<QueryPlan>> {
    let mut plans = claim_plans(outbox, app_code, 100).await?;
    let t = outbox.table().as_str();
    let sql = format!("EXPLAIN QUERY PLAN {}", outbox.own().archive_pick);
    let q = sqlx::query(&sql)
        .bind(app_code)
        .bind(0_i64)
        .bind(10_000_i64);
    let text = detail_lines(outbox, q, "explain").await?;
    plans.push(query_plan(ARCHIVE_QUERY, t, ARCHIVE_INDEX, text));
    let args = ReplayProbeArgs::new(app_code);
    for probe in outbox.replay_probes(&args) {
        let sql = format!("EXPLAIN QUERY PLAN {}", probe.sql);
        let q = postbox_sqlx::query::<SqliteDialect>(&sql, probe.values);
        let text = match detail_lines(outbox, q, "explain").await {
            Ok(text) => text,
            // A statement naming a missing index (`INDEXED BY`) cannot be
            // explained: that query fails, the others are still checked.
            Err(e) if e.to_string().contains("no such index") => {
                vec![format!("SCAN {} (cannot explain: {e})", probe.scanned_as)]
            }
            Err(e) => return Err(e),
        };
        let mut plan = query_plan(probe.query, &probe.scanned_as, "", text);
        plan.expected_index = probe.expected_index;
        plans.push(plan);
    }
    Ok(plans)
}

/// A plan from `EXPLAIN QUERY PLAN`'s detail lines.
pub(crate) fn query_plan(
    query: &'static str,
    table: &str,
    index_suffix: &str,
    text: Vec<String>,
) -> QueryPlan {
    let indexes_used = text
        .iter()
        .filter_map(|d| d.split(" INDEX ").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap_or("").to_owned())
        .collect();
    QueryPlan {
        query,
        expected_index: format!("{table}{index_suffix}"),
        indexes_used,
        full_scan: text.iter().any(|d| d.starts_with(&format!("SCAN {table}"))),
        rows_examined: None,
        plan: text.join("\n"),
        too_small_to_tell: false,
    }
}
