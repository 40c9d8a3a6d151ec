//! Claim plans via `EXPLAIN QUERY PLAN`.

use sqlx::Row;

use postbox_core::store::{QueryPlan, CLAIM_QUERIES};
use postbox_core::Result;

use crate::SqliteOutbox;

impl SqliteOutbox {
    pub(crate) async fn explain_claim_queries(
        &self,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<QueryPlan>> {
        let db = |e| crate::db_error("explain claims", e);
        let t = self.table.as_str();
        let mut plans = Vec::with_capacity(CLAIM_QUERIES.len());
        for (query, source, index_suffix) in CLAIM_QUERIES {
            let sql = self.sql.claim_select(source, false);
            // Parameters only shape the plan here; their values do not matter.
            let rows = sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
                .bind(app_code)
                .bind(i64::from(limit))
                .bind("postbox-explain")
                .bind(30_000_i64)
                .bind(0_i64)
                .fetch_all(&self.pool)
                .await
                .map_err(db)?;
            let text: Vec<String> = rows.iter().map(|r| r.get::<String, _>(3)).collect();
            plans.push(query_plan(query, t, index_suffix, text));
        }
        Ok(plans)
    }
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
    }
}
