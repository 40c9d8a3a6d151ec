//! What `postbox doctor` asks of PostgreSQL: claim plans via
//! `EXPLAIN (ANALYZE, FORMAT JSON)`, rolled back, and plans made with
//! sequential scans, bitmap scans, sorts, hash and merge joins disabled, so
//! that a tiny, fresh or unanalysed table (where any plan is about as cheap
//! as any other) still shows which index a query can use.

use std::collections::HashMap;

use serde_json::Value;
use sqlx::Row;

use postbox_core::store::{ClaimRequest, QueryPlan, ARCHIVE_QUERY, SMALL_TABLE_ROWS};
use postbox_core::{Error, Result};
use postbox_sqlx::{db_error, ReplayProbeArgs};

use crate::sql::{claim_query, ARCHIVE_INDEX, CLAIM_INDEXES};
use crate::{PgDialect, PgOutbox};

/// The claim `doctor` explains: no type paused, a 30 s lease.
fn explained(app_code: &str, limit: u32, ordered: bool) -> ClaimRequest<'_> {
    ClaimRequest {
        app_code,
        limit,
        worker_id: "postbox-doctor",
        lease_ms: 30_000,
        ordered,
        skip_types: &[],
    }
}

/// Plans of the claim queries, executed and rolled back.
pub(crate) async fn claim_plans(
    outbox: &PgOutbox,
    app_code: &str,
    limit: u32,
) -> Result<Vec<QueryPlan>> {
    let db = |e| db_error("explain claims", e);
    let t = outbox.table().as_str();
    let mut plans = Vec::with_capacity(CLAIM_INDEXES.len());
    let mut tx = outbox.pool().begin().await.map_err(db)?;
    let parents = partition_parents(&mut tx, t).await?;
    for (query, source, ordered, index_suffix) in CLAIM_INDEXES {
        let sql = outbox.own().claims.of(source, ordered);
        let expected_index = format!("{t}{index_suffix}");
        let sql = format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}");
        let row = claim_query(&sql, source, &explained(app_code, limit, ordered))
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        plans.push(plan(
            query,
            t,
            expected_index,
            &row,
            Analysed::Yes,
            &parents,
        )?);
    }
    tx.rollback().await.map_err(db)?;
    Ok(plans)
}

/// Whether the claim and archive queries can read through their indexes.
pub(crate) async fn index_use(outbox: &PgOutbox, app_code: &str) -> Result<Vec<QueryPlan>> {
    let db = |e| db_error("explain", e);
    let t = outbox.table().as_str();
    let mut tx = outbox.pool().begin().await.map_err(db)?;
    let parents = partition_parents(&mut tx, t).await?;
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
    for (query, source, ordered, suffix) in CLAIM_INDEXES {
        let sql = outbox.own().claims.of(source, ordered);
        let sql = format!("EXPLAIN (FORMAT JSON) {sql}");
        let row = claim_query(&sql, source, &explained(app_code, 100, ordered))
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        plans.push(plan(
            query,
            t,
            format!("{t}{suffix}"),
            &row,
            Analysed::No,
            &parents,
        )?);
    }
    let row = sqlx::query(&format!(
        "EXPLAIN (FORMAT JSON) {}",
        outbox.own().archive_pick
    ))
    .bind(app_code)
    .bind(0_i64)
    .bind(10_000_i64)
    .fetch_one(&mut *tx)
    .await
    .map_err(db)?;
    plans.push(plan(
        ARCHIVE_QUERY,
        t,
        format!("{t}{ARCHIVE_INDEX}"),
        &row,
        Analysed::No,
        &parents,
    )?);
    let args = ReplayProbeArgs::new(app_code);
    for probe in outbox.replay_probes(&args) {
        let sql = format!("EXPLAIN (FORMAT JSON) {}", probe.sql);
        let row = postbox_sqlx::query::<PgDialect>(&sql, probe.values)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        let mut probed = plan(
            probe.query,
            &probe.table,
            probe.expected_index,
            &row,
            Analysed::No,
            &parents,
        )?;
        // Steering decides between an index and a scan, not between two
        // indexes: on a table of a few rows the one a replay reads and
        // `migrate --aggregate-index`'s cost the same, and the planner
        // took either.
        // A missing index is never "too small to tell".
        if !probed.uses_expected() && exists(&mut tx, &probed.expected_index).await? {
            probed.too_small_to_tell =
                estimated_rows(&mut tx, &probe.table).await? < SMALL_TABLE_ROWS;
        }
        plans.push(probed);
    }
    tx.rollback().await.map_err(db)?;
    Ok(plans)
}

/// Whether the relation (an index) `name` exists.
async fn exists(tx: &mut sqlx::PgConnection, name: &str) -> Result<bool> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| db_error("look up an index", e))
}

/// The rows of `table`, its partitions' summed for a partitioned one (a
/// partitioned parent is never analysed by autovacuum): the planner's
/// count (`pg_class.reltuples`), or, for a table never analysed (-1), its
/// size at 100 bytes a row, more rows than it holds. Read as 0, both had a
/// replay plan that missed its index pass on any such table.
async fn estimated_rows(tx: &mut sqlx::PgConnection, table: &str) -> Result<f64> {
    sqlx::query_scalar(
        "SELECT COALESCE(SUM(CASE WHEN c.reltuples >= 0 THEN c.reltuples::FLOAT8 \
           ELSE pg_relation_size(c.oid) / 100.0 END), 0)::FLOAT8 \
         FROM pg_partition_tree($1::regclass) t JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf",
    )
    .bind(table)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| db_error("estimate rows", e))
}

/// A partitioned table's partitions and their indexes, each with what it
/// is a partition of (the table, or the table's index): a plan scans
/// partitions through their own indexes. Empty for a plain table.
async fn partition_parents(
    tx: &mut sqlx::PgConnection,
    table: &str,
) -> Result<HashMap<String, String>> {
    let rows = sqlx::query(
        "SELECT c.relname::TEXT, p.relname::TEXT FROM pg_inherits i \
           JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent \
         WHERE i.inhparent = to_regclass($1) \
            OR i.inhparent IN (SELECT indexrelid FROM pg_index WHERE indrelid = to_regclass($1))",
    )
    .bind(table)
    .fetch_all(&mut *tx)
    .await
    .map_err(|e| db_error("list partitions", e))?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<std::result::Result<_, sqlx::Error>>()
        .map_err(|e| db_error("list partitions", e))
}

/// `EXPLAIN (FORMAT JSON)` output; a text PostgreSQL did not write as JSON
/// is an error, not an empty plan.
fn parse_plan(text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| Error::Database {
        operation: "explain",
        source: format!("EXPLAIN output is not JSON ({e}): {text}").into(),
    })
}

/// The plan of a statement on `table` that should read `expected_index`.
/// Whether the plan was executed (`EXPLAIN ANALYZE`), so that it counts
/// the rows read.
#[derive(PartialEq)]
enum Analysed {
    Yes,
    No,
}

fn plan(
    query: &'static str,
    table: &str,
    expected_index: String,
    row: &sqlx::postgres::PgRow,
    analysed: Analysed,
    parents: &HashMap<String, String>,
) -> Result<QueryPlan> {
    let text: String = row
        .try_get_unchecked(0)
        .map_err(|e| db_error("explain", e))?;
    let json = parse_plan(&text)?;
    let mut plan = QueryPlan {
        query,
        expected_index,
        indexes_used: Vec::new(),
        full_scan: false,
        rows_examined: (analysed == Analysed::Yes).then_some(0),
        plan: text,
        too_small_to_tell: false,
    };
    visit(&json[0]["Plan"], table, &mut plan, parents);
    Ok(plan)
}

/// Collects the scans of `table` (or of its partitions, named by their
/// parents) in a plan tree.
fn visit(node: &Value, table: &str, plan: &mut QueryPlan, parents: &HashMap<String, String>) {
    let parent = |name: &str| parents.get(name).map_or(name, String::as_str).to_owned();
    if node["Relation Name"].as_str().map(parent).as_deref() == Some(table) {
        let kind = node["Node Type"].as_str().unwrap_or("");
        // An index scan without an index condition reads the whole index.
        let whole_index =
            kind.starts_with("Index") && node.get("Index Cond").is_none_or(Value::is_null);
        if kind == "Seq Scan" || whole_index {
            plan.full_scan = true;
        }
        if let Some(index) = node["Index Name"].as_str().map(parent) {
            if !plan.indexes_used.contains(&index) {
                plan.indexes_used.push(index);
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
            visit(child, table, plan, parents);
        }
    }
}

/// The planner's row estimate of [`crate::sql::DELIVERED_ESTIMATE`] for
/// `app_code` (`Plan Rows` of the scan under its `Limit`).
pub(crate) async fn delivered_estimate(outbox: &PgOutbox, app_code: &str) -> Result<i64> {
    let db = |e| db_error("estimate delivered rows", e);
    let row = sqlx::query(&outbox.own().delivered_estimate)
        .bind(app_code)
        .fetch_one(outbox.pool())
        .await
        .map_err(db)?;
    let text: String = row.try_get_unchecked(0).map_err(db)?;
    let json = parse_plan(&text)?;
    let top = &json[0]["Plan"];
    let scan = top["Plans"].get(0).unwrap_or(top);
    Ok(scan["Plan Rows"].as_f64().unwrap_or(0.0).round() as i64)
}
