//! With 1,000,000 delivered rows (and another tenant's backlog) in the
//! table, every claim query reads through its `app_code`-led index and
//! touches only rows it could claim (MariaDB `ANALYZE` measures it).

use postbox_mysql::MySqlOutbox;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::mysql_url;
use postbox_testkit::store_setup::migrated;

/// A migrated outbox table of its own.
async fn scratch_store(prefix: &'static str) -> MySqlOutbox {
    migrated("mysql", mysql_url(), |url| async move {
        MySqlOutbox::connect(&url, &scratch_table(prefix), 2).await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_use_their_index_over_a_million_delivered_rows() {
    let store = scratch_store("plans").await;
    let t = store.table().as_str().to_owned();
    let load = [
        // History: a million delivered rows (MariaDB's sequence engine).
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
                 SELECT 'plan', CONCAT('d-', seq), 'Old', '{{}}', 'delivered', 1000000000000 + seq, 1000000000000 + seq \
                 FROM seq_1_to_1000000"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload) \
                 SELECT 'other', CONCAT('o-', seq), 'New', '{{}}' FROM seq_1_to_20000"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload) \
                 SELECT 'plan', CONCAT('p-', seq), 'New', '{{}}' FROM seq_1_to_150"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, retry_count, next_retry_at_ms) \
                 SELECT 'plan', CONCAT('r-', seq), 'Retry', '{{}}', 'retryable', 1, IF(seq <= 100, 0, 9000000000000000) \
                 FROM seq_1_to_200"),
        format!("INSERT INTO {t} (app_code, event_id, event_type, payload, status, worker_id, lock_until_ms) \
                 SELECT 'plan', CONCAT('l-', seq), 'Leased', '{{}}', 'delivering', 'w', IF(seq <= 100, 0, 9000000000000000) \
                 FROM seq_1_to_200"),
        format!("ANALYZE TABLE {t}"),
    ];
    let plans = postbox_testkit::conformance::claims_use_their_index_over(
        std::sync::Arc::new(store.clone()),
        store.pool().clone(),
        &load,
    )
    .await;
    assert!(
        plans.iter().all(|p| p.rows_examined.is_some()),
        "MariaDB measures rows read"
    );
}

/// A per-aggregate claim over a backlog in few aggregates (fewer heads than
/// the batch, so the claim reads every pending row) checks each candidate's
/// earlier events through `_aggregate_idx`: MariaDB's planner, left alone,
/// read them through `_due_idx`, every open row of the app_code per
/// candidate (the room-service load run: 9.4 s per claim at 26,000 pending
/// rows in 100 rooms, and the relay fell to ~10 events/s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ordered_claim_reads_earlier_events_through_the_aggregate_index() {
    use postbox_core::ClaimSource;
    use sqlx::{Connection, Executor, Row};
    let store = scratch_store("headplan").await;
    let t = store.table().as_str().to_owned();
    let mut conn = store.pool().acquire().await.unwrap();
    for sql in [
        // The load run's shape: 100 rooms, a few events each delivered,
        // 26,000 pending behind them, a few heads waiting to retry.
        format!("INSERT INTO {t} (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, status) \
                 SELECT 'room', CONCAT('e-', seq), 'RoomEvent', CONCAT('room-', seq % 100), seq, '{{}}', \
                   IF(seq <= 1200, 'delivered', IF(seq <= 1213, 'retryable', 'pending')) FROM seq_1_to_27200"),
        // No ANALYZE TABLE: the planner works from InnoDB's sampled
        // statistics, as on a live outbox.
    ] {
        conn.execute(sql.as_str()).await.unwrap();
    }
    for source in [ClaimSource::Pending, ClaimSource::DueRetry] {
        let sql = store
            .own()
            .claim_sql(source, true)
            .replacen('?', "'room'", 1)
            .replacen('?', "100", 1);
        let mut tx = conn.begin().await.unwrap();
        let row = tx
            .fetch_one(format!("ANALYZE FORMAT=JSON {sql}").as_str())
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let plan: serde_json::Value = serde_json::from_str(&row.get::<String, _>(0)).unwrap();
        let mut earlier = Vec::new();
        find_table(&plan, "p", &mut earlier);
        assert!(
            !earlier.is_empty(),
            "{source:?}: no access of the earlier-events subquery in {plan}"
        );
        for access in earlier {
            assert_eq!(
                access["key"].as_str(),
                Some(format!("{t}_aggregate_idx").as_str()),
                "{source:?} reads earlier events through: {access}"
            );
        }
    }
}

fn find_table<'a>(node: &'a serde_json::Value, name: &str, out: &mut Vec<&'a serde_json::Value>) {
    match node {
        serde_json::Value::Object(map) => {
            if map.get("table_name").and_then(|v| v.as_str()) == Some(name) {
                out.push(node);
            }
            map.values().for_each(|v| find_table(v, name, out));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| find_table(v, name, out)),
        _ => {}
    }
}
