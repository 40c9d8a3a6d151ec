//! What `postbox doctor` asks of PostgreSQL: the catalog, and plans made
//! with sequential scans, bitmap scans, sorts, hash and merge joins
//! disabled, so that a tiny, fresh or unanalysed table (where any plan is
//! about as cheap as any other) still shows which index a query can use.

use serde_json::Value;
use sqlx::Row;

use postbox_core::store::{QueryPlan, SchemaReport, ARCHIVE_QUERIES, CLAIM_QUERIES};
use postbox_core::Result;

use crate::{sql, PgOutbox};

impl PgOutbox {
    pub(crate) async fn schema_report(&self) -> Result<SchemaReport> {
        let db = |e| crate::db_error("inspect schema", e);
        let t = self.table.as_str();
        let version: Option<i32> = sqlx::query_scalar(sql::DOCTOR_VERSION)
            .bind(t)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(None);
        let names: Vec<String> = sqlx::query_scalar(sql::DOCTOR_OBJECTS)
            .fetch_all(&self.pool)
            .await
            .map_err(db)?;
        Ok(SchemaReport::from_catalog(
            t,
            version.unwrap_or(0) as u32,
            crate::migrate::MIGRATIONS.last().map_or(0, |m| m.0),
            &names,
            &["_archive_pk"],
        ))
    }

    pub(crate) async fn index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>> {
        let db = |e| crate::db_error("explain", e);
        let t = self.table.as_str();
        let mut tx = self.pool.begin().await.map_err(db)?;
        // On a small, empty or unanalysed table every plan costs about the
        // same, and the planner picks whichever postbox index (or a whole
        // primary-key scan) comes first: steer it the way a large table
        // does, so that a correct schema passes at any size. Without sorts,
        // the index that yields the query's order wins; without hash and
        // merge joins, the claim's UPDATE finds its rows by primary key.
        for setting in [
            "enable_seqscan",
            "enable_bitmapscan",
            "enable_sort",
            "enable_hashjoin",
            "enable_mergejoin",
        ] {
            sqlx::query(&format!("SET LOCAL {setting} = off"))
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        let mut plans = Vec::new();
        for (query, source, suffix) in CLAIM_QUERIES {
            let sql = self.sql.claim_select(source, false);
            let row = sqlx::query(&format!("EXPLAIN (FORMAT JSON) {sql}"))
                .bind(app_code)
                .bind(100_i64)
                .bind("postbox-doctor")
                .bind(30_000_i64)
                .fetch_one(&mut *tx)
                .await
                .map_err(db)?;
            plans.push(plan(query, t, suffix, &row)?);
        }
        for (query, status, suffix) in ARCHIVE_QUERIES {
            let row = sqlx::query(&format!("EXPLAIN (FORMAT JSON) {}", self.sql.archive_pick))
                .bind(app_code)
                .bind(status)
                .bind(0_i64)
                .bind(10_000_i64)
                .fetch_one(&mut *tx)
                .await
                .map_err(db)?;
            plans.push(plan(query, t, suffix, &row)?);
        }
        tx.rollback().await.map_err(db)?;
        Ok(plans)
    }
}

fn plan(
    query: &'static str,
    table: &str,
    suffix: &str,
    row: &sqlx::postgres::PgRow,
) -> Result<QueryPlan> {
    let text: String = row
        .try_get_unchecked(0)
        .map_err(|e| crate::db_error("explain", e))?;
    let json: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let mut plan = QueryPlan {
        query,
        expected_index: format!("{table}{suffix}"),
        indexes_used: Vec::new(),
        full_scan: false,
        rows_examined: None,
        plan: text,
    };
    crate::explain::visit(&json[0]["Plan"], table, &mut plan);
    Ok(plan)
}
