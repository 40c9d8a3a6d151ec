//! Claim plans via MariaDB's `ANALYZE FORMAT=JSON` (executed, then rolled
//! back), falling back to `EXPLAIN FORMAT=JSON` on MySQL.

use serde_json::Value;
use sqlx::mysql::MySqlRow;
use sqlx::{Connection, Row};

use postbox_core::store::QueryPlan;
use postbox_core::Result;

use crate::MySqlOutbox;

use postbox_sqlx::db_error;
use postbox_sqlx::dialect::Value as Bind;

/// A string literal for the two values an explained claim needs. `ANALYZE`
/// cannot be prepared, so they are inlined; quotes and backslashes escaped.
pub(crate) fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "''"))
}

/// `sql` with each `?` replaced by its value as a MySQL literal
/// (`EXPLAIN` cannot be prepared).
pub(crate) fn inlined(sql: &str, values: &[Bind<'_>]) -> String {
    let literals: Vec<String> = values.iter().map(value_literal).collect();
    postbox_sqlx::inline(sql, &literals, postbox_sqlx::Placeholders::Question)
}

fn value_literal(v: &Bind<'_>) -> String {
    let join = |items: Vec<String>| items.join(", ");
    match v {
        Bind::Text(Some(s)) => literal(s),
        Bind::Text(None) | Bind::Int(None) => "NULL".to_owned(),
        Bind::Int(Some(i)) => i.to_string(),
        Bind::Int32(i) => i.to_string(),
        Bind::Ids(ids) => join(ids.iter().map(i64::to_string).collect()),
        Bind::Texts(texts) => join(texts.iter().map(|t| literal(t)).collect()),
    }
}

/// A claim statement with its parameters inlined (`ANALYZE` and `EXPLAIN`
/// cannot be prepared): the tenant and the limit, where each goes.
pub(crate) fn inlined_claim(
    outbox: &MySqlOutbox,
    source: postbox_core::ClaimSource,
    ordered: bool,
    app_code: &str,
    limit: u32,
) -> String {
    let own = outbox.own();
    if source == postbox_core::ClaimSource::Pending && !ordered {
        // The new rows' claim locks candidates by primary key; the index
        // it relies on is read by the first candidate read.
        return own
            .pending_first
            .replacen('?', &literal(app_code), 1)
            .replacen('?', "''", 1)
            .replacen('?', &limit.to_string(), 1);
    }
    let sql = own.claims.of(source, ordered);
    let binds = crate::sql::claim_binds(source, ordered);
    use crate::sql::Bind;
    binds.iter().fold(sql.to_owned(), |sql, bind| match bind {
        Bind::Tenant => sql.replacen('?', &literal(app_code), 1),
        Bind::Limit(times) => sql.replacen('?', &(times * i64::from(limit)).to_string(), 1),
        Bind::Skipped | Bind::Dealt => sql.replacen('?', "'[]'", 1),
    })
}

/// Plans of the claim queries (see `OutboxStore::explain_claims`).
pub(crate) async fn explain_claims(
    outbox: &MySqlOutbox,
    app_code: &str,
    limit: u32,
) -> Result<Vec<QueryPlan>> {
    {
        let db = |e| db_error("explain claims", e);
        let t = outbox.table().as_str();
        let mut conn = outbox.pool().acquire().await.map_err(db)?;
        // `ANALYZE` runs the claims, locks and all: at the relay's
        // isolation, whose locks never hold up a producer's insert
        // (REPEATABLE READ's gap locks did, while `doctor` ran).
        sqlx::Executor::execute(&mut *conn, crate::sql::CLAIM_ISOLATION)
            .await
            .map_err(db)?;
        let mut tx = conn.begin().await.map_err(db)?;
        let mut plans = Vec::with_capacity(crate::sql::CLAIM_INDEXES.len());
        for (query, source, ordered, index_suffix) in crate::sql::CLAIM_INDEXES {
            let expected_index = format!("{t}{index_suffix}");
            let inlined = inlined_claim(outbox, source, ordered, app_code, limit);
            let analyzed = raw(&mut tx, format!("ANALYZE FORMAT=JSON {inlined}")).await;
            let (rows, measured) = match analyzed {
                Ok(rows) => (rows, true),
                // MySQL 8 has no ANALYZE statement: plan only.
                Err(_) => (
                    raw(&mut tx, format!("EXPLAIN FORMAT=JSON {inlined}"))
                        .await
                        .map_err(db)?,
                    false,
                ),
            };
            let (text, json) = plan_of(&rows, "explain claims")?;
            let mut plan = QueryPlan {
                query,
                expected_index,
                indexes_used: Vec::new(),
                full_scan: false,
                rows_examined: measured.then_some(0),
                plan: text,
                too_small_to_tell: false,
            };
            visit(&json, &mut plan);
            plans.push(plan);
        }
        tx.rollback().await.map_err(db)?;
        Ok(plans)
    }
}

/// Runs a statement that cannot be prepared.
async fn raw(conn: &mut sqlx::MySqlConnection, sql: String) -> Result<Vec<MySqlRow>, sqlx::Error> {
    use sqlx::Executor;
    // A plain string with no arguments goes over the text protocol.
    conn.fetch_all(sql.as_str()).await
}

/// Finds every access of the outbox table in the JSON plan: a claim reads
/// no other table, and the plan names it by its alias where it has one
/// (`c`, `p`), so every `"table": {…}` but the server's own temporary
/// tables (`<derived2>`, `<union3,4>`) is one.
fn visit(node: &Value, plan: &mut QueryPlan) {
    match node {
        Value::Object(map) => {
            let name = map.get("table_name").and_then(Value::as_str);
            if name.is_some_and(|n| !n.starts_with('<')) {
                let access = map.get("access_type").and_then(Value::as_str).unwrap_or("");
                // A `JSON_TABLE` of bound ids is read whole: it is no table.
                let table_function = map.contains_key("table_function");
                if (access == "ALL" || access == "index") && !table_function {
                    plan.full_scan = true;
                }
                if let Some(key) = map.get("key").and_then(Value::as_str) {
                    if !plan.indexes_used.iter().any(|k| k == key) {
                        plan.indexes_used.push(key.to_owned());
                    }
                }
                let n = |k: &str| map.get(k).and_then(Value::as_f64);
                if let (Some(total), Some(r_rows)) = (plan.rows_examined.as_mut(), n("r_rows")) {
                    *total += (r_rows * n("r_loops").unwrap_or(1.0)).round() as u64;
                }
            }
            for v in map.values() {
                visit(v, plan);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| visit(v, plan)),
        _ => {}
    }
}

/// The plan in the answer to an `EXPLAIN` or `ANALYZE` `FORMAT=JSON`, as
/// text and as JSON: the first row's one column (no row: an empty text);
/// `operation` names a failed read.
pub(crate) fn plan_of(rows: &[MySqlRow], operation: &'static str) -> Result<(String, Value)> {
    let text: String = rows
        .first()
        .map(|r| r.try_get_unchecked(0))
        .transpose()
        .map_err(|e| db_error(operation, e))?
        .unwrap_or_default();
    let json = parse_plan(&text)?;
    Ok((text, json))
}

/// `EXPLAIN FORMAT=JSON` output; a text the server did not write as JSON is
/// an error, not an empty plan.
pub(crate) fn parse_plan(text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| postbox_core::Error::Database {
        operation: "explain",
        source: format!("EXPLAIN output is not JSON ({e}): {text}").into(),
    })
}
