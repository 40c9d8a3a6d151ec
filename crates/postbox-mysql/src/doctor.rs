//! What `postbox doctor` asks of MySQL / MariaDB: the catalog, and
//! `EXPLAIN FORMAT=JSON`, whose `possible_keys` name the indexes a query can
//! use even where a tiny table makes the optimizer scan instead.

use serde_json::Value;
use sqlx::Row;

use postbox_core::store::{QueryPlan, SchemaReport, ARCHIVE_QUERIES, CLAIM_QUERIES};
use postbox_core::Result;

use crate::{sql, MySqlOutbox};

impl MySqlOutbox {
    pub(crate) async fn schema_report(&self) -> Result<SchemaReport> {
        let db = |e| crate::db_error("inspect schema", e);
        let t = self.table.as_str();
        let rows = sqlx::query(sql::DOCTOR_OBJECTS)
            .fetch_all(&self.pool)
            .await
            .map_err(db)?;
        let mut names = Vec::with_capacity(rows.len());
        for r in rows {
            names.push(r.try_get::<String, _>(0).map_err(db)?);
        }
        // Without the ledger the schema is at version 0; with it, a failed
        // read is an error, never "version 0".
        let version: Option<i32> = if names.iter().any(|n| n == postbox_sqlx::MIGRATIONS_LEDGER) {
            sqlx::query_scalar(sql::DOCTOR_VERSION)
                .bind(t)
                .fetch_one(&self.pool)
                .await
                .map_err(db)?
        } else {
            None
        };
        Ok(SchemaReport::from_catalog(
            t,
            version.unwrap_or(0) as u32,
            crate::migrate::MIGRATIONS.last().map_or(0, |m| m.0),
            &names,
            &[],
        ))
    }

    pub(crate) async fn index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>> {
        let db = |e| crate::db_error("explain", e);
        let t = self.table.as_str();
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let app = crate::explain::literal(app_code);
        let mut statements = Vec::new();
        for (query, source, suffix) in CLAIM_QUERIES {
            let sql = self
                .sql
                .claim_select(source, false)
                .replacen('?', &app, 1)
                .replacen('?', "100", 1);
            statements.push((query, suffix, sql));
        }
        for (query, status, suffix) in ARCHIVE_QUERIES {
            let sql = self
                .sql
                .archive_pick
                .replacen('?', &app, 1)
                .replacen('?', &crate::explain::literal(status), 1)
                .replacen('?', "0", 1)
                .replacen('?', "10000", 1);
            statements.push((query, suffix, sql));
        }
        let mut plans = Vec::new();
        for (query, suffix, sql) in statements {
            use sqlx::Executor;
            let rows = conn
                .fetch_all(format!("EXPLAIN FORMAT=JSON {sql}").as_str())
                .await
                .map_err(db)?;
            let text: String = rows
                .first()
                .map(|r| r.try_get_unchecked(0))
                .transpose()
                .map_err(db)?
                .unwrap_or_default();
            let json: Value = crate::explain::parse_plan(&text)?;
            let expected_index = format!("{t}{suffix}");
            let mut keys = Vec::new();
            collect_keys(&json, t, &mut keys);
            plans.push(QueryPlan {
                query,
                full_scan: !keys.contains(&expected_index),
                indexes_used: keys,
                expected_index,
                rows_examined: None,
                plan: text,
            });
        }
        Ok(plans)
    }
}

/// The chosen `key` and every `possible_keys` entry of `table`'s accesses.
fn collect_keys(node: &Value, table: &str, keys: &mut Vec<String>) {
    match node {
        Value::Object(map) => {
            if map.get("table_name").and_then(Value::as_str) == Some(table) {
                let chosen = map.get("key").and_then(Value::as_str).map(str::to_owned);
                let possible = map
                    .get("possible_keys")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|k| k.as_str().map(str::to_owned));
                for k in chosen.into_iter().chain(possible) {
                    if !keys.contains(&k) {
                        keys.push(k);
                    }
                }
            }
            for v in map.values() {
                collect_keys(v, table, keys);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_keys(v, table, keys)),
        _ => {}
    }
}
