//! Claim plans via `EXPLAIN (ANALYZE, FORMAT JSON)`, rolled back.

use serde_json::Value;
use sqlx::Row;

use postbox_core::store::{QueryPlan, CLAIM_QUERIES};
use postbox_core::Result;

use crate::PgOutbox;

impl PgOutbox {
    pub(crate) async fn explain_claim_queries(
        &self,
        app_code: &str,
        limit: u32,
    ) -> Result<Vec<QueryPlan>> {
        let db = |e| crate::db_error("explain claims", e);
        let t = self.table.as_str();
        let mut plans = Vec::with_capacity(CLAIM_QUERIES.len());
        let mut tx = self.pool.begin().await.map_err(db)?;
        for (query, source, index_suffix) in CLAIM_QUERIES {
            let sql = self.sql.claim_select(source, false);
            let expected_index = format!("{t}{index_suffix}");
            let row = sqlx::query(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}"))
                .bind(app_code)
                .bind(i64::from(limit))
                .bind("postbox-explain")
                .bind(30_000_i64)
                .fetch_one(&mut *tx)
                .await
                .map_err(db)?;
            let text: String = row.try_get_unchecked(0).map_err(db)?;
            let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let mut plan = QueryPlan {
                query,
                expected_index,
                indexes_used: Vec::new(),
                full_scan: false,
                rows_examined: Some(0),
                plan: text,
            };
            visit(&json[0]["Plan"], t, &mut plan);
            plans.push(plan);
        }
        tx.rollback().await.map_err(db)?;
        Ok(plans)
    }
}

/// Collects the scans of `table` in a plan tree.
pub(crate) fn visit(node: &Value, table: &str, plan: &mut QueryPlan) {
    if node["Relation Name"].as_str() == Some(table) {
        let kind = node["Node Type"].as_str().unwrap_or("");
        // An index scan without an index condition reads the whole index.
        let whole_index =
            kind.starts_with("Index") && node.get("Index Cond").is_none_or(Value::is_null);
        if kind == "Seq Scan" || whole_index {
            plan.full_scan = true;
        }
        if let Some(index) = node["Index Name"].as_str() {
            if !plan.indexes_used.iter().any(|i| i == index) {
                plan.indexes_used.push(index.to_owned());
            }
        }
        if kind.contains("Scan") {
            let n = |k: &str| node[k].as_f64().unwrap_or(0.0);
            let read =
                (n("Actual Rows") + n("Rows Removed by Filter")) * n("Actual Loops").max(1.0);
            if let Some(total) = plan.rows_examined.as_mut() {
                *total += read.round() as u64;
            }
        }
    }
    if let Some(children) = node["Plans"].as_array() {
        for child in children {
            visit(child, table, plan);
        }
    }
}
