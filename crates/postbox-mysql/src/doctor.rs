//! What `postbox doctor` asks of MySQL / MariaDB: the catalog, and
//! `EXPLAIN FORMAT=JSON`, whose `possible_keys` name the indexes a query can
//! use even where a tiny table makes the optimizer scan instead.

use serde_json::Value;

use postbox_core::store::{QueryPlan, ARCHIVE_QUERY};
use postbox_core::Result;

use crate::sql::{ARCHIVE_INDEX, CLAIM_INDEXES};
use crate::MySqlOutbox;

use postbox_sqlx::{db_error, ReplayProbeArgs};

/// MariaDB's error for `FORCE INDEX` naming an index the table lacks.
const KEY_DOES_NOT_EXIST: u16 = 1176;

/// Whether the claim and archive queries can use their indexes (see
/// `OutboxStore::explain_index_use`).
pub(crate) async fn index_use(outbox: &MySqlOutbox, app_code: &str) -> Result<Vec<QueryPlan>> {
    {
        let db = |e| db_error("explain", e);
        let t = outbox.table().as_str();
        let mut conn = outbox.pool().acquire().await.map_err(db)?;
        let app = crate::explain::literal(app_code);
        let mut statements = Vec::new();
        for (query, source, ordered, suffix) in CLAIM_INDEXES {
            let sql = crate::explain::inlined_claim(outbox, source, ordered, app_code, 100);
            statements.push((query, t.to_owned(), format!("{t}{suffix}"), sql));
        }
        let sql = outbox
            .own()
            .archive_pick
            .replacen('?', &app, 1)
            .replacen('?', "0", 2)
            .replacen('?', "10000", 1);
        statements.push((
            ARCHIVE_QUERY,
            t.to_owned(),
            format!("{t}{ARCHIVE_INDEX}"),
            sql,
        ));
        let args = ReplayProbeArgs::new(app_code);
        for probe in outbox.replay_probes(&args) {
            let sql = crate::explain::inlined(&probe.sql, &probe.values);
            statements.push((probe.query, probe.scanned_as, probe.expected_index, sql));
        }
        let mut plans = Vec::new();
        for (query, table, expected_index, sql) in statements {
            use sqlx::Executor;
            let rows = match conn
                .fetch_all(format!("EXPLAIN FORMAT=JSON {sql}").as_str())
                .await
            {
                Ok(rows) => rows,
                // A statement that names a missing index (`FORCE INDEX`)
                // cannot be explained: that query fails, the others are
                // still checked.
                Err(sqlx::Error::Database(e))
                    if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .is_some_and(|m| m.number() == KEY_DOES_NOT_EXIST) =>
                {
                    plans.push(QueryPlan {
                        query,
                        full_scan: true,
                        indexes_used: Vec::new(),
                        expected_index,
                        rows_examined: None,
                        plan: format!("cannot explain: {e}"),
                        too_small_to_tell: false,
                    });
                    continue;
                }
                Err(e) => return Err(db(e)),
            };
            let (text, json) = crate::explain::plan_of(&rows, "explain")?;
            let mut keys = Vec::new();
            collect_keys(&json, &table, &mut keys);
            plans.push(QueryPlan {
                query,
                full_scan: !keys.contains(&expected_index),
                indexes_used: keys,
                expected_index,
                rows_examined: None,
                plan: text,
                too_small_to_tell: false,
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
