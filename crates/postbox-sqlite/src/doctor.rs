//! What `postbox doctor` asks of SQLite: `sqlite_master`, and
//! `EXPLAIN QUERY PLAN`, which (without `ANALYZE` statistics) picks an index
//! from the query's shape alone, so a fresh table shows what a full one would.

use sqlx::Row;

use postbox_core::store::{QueryPlan, SchemaReport, ARCHIVE_QUERIES, CLAIM_QUERIES};
use postbox_core::Result;

use crate::{sql, SqliteOutbox};

impl SqliteOutbox {
    pub(crate) async fn schema_report(&self) -> Result<SchemaReport> {
        let db = |e| crate::db_error("inspect schema", e);
        let t = self.table.as_str();
        let version: Option<i64> = sqlx::query_scalar(sql::DOCTOR_VERSION)
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
            &[],
        ))
    }

    pub(crate) async fn index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>> {
        let mut plans = self.explain_claim_queries(app_code, 100).await?;
        let db = |e| crate::db_error("explain", e);
        let t = self.table.as_str();
        for (query, status, suffix) in ARCHIVE_QUERIES {
            let rows = sqlx::query(&format!("EXPLAIN QUERY PLAN {}", self.sql.archive_pick))
                .bind(app_code)
                .bind(status)
                .bind(0_i64)
                .bind(10_000_i64)
                .fetch_all(&self.pool)
                .await
                .map_err(db)?;
            let text: Vec<String> = rows.iter().map(|r| r.get::<String, _>(3)).collect();
            plans.push(crate::explain::query_plan(query, t, suffix, text));
        }
        debug_assert_eq!(plans.len(), CLAIM_QUERIES.len() + ARCHIVE_QUERIES.len());
        Ok(plans)
    }
}
