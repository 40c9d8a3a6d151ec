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
    let plans = postbox_testkit::conformance::claims_use_their_index_over(
        std::sync::Arc::new(store.clone()),
        store.pool().clone(),
        &postbox_testkit::conformance::Numbers::MARIADB,
    )
    .await;
    assert!(
        plans.iter().all(|p| p.rows_examined.is_some()),
        "MariaDB measures rows read"
    );
}

/// A per-aggregate claim over a backlog in few aggregates whose heads are
/// in flight (the next claim runs while a batch publishes), each with a
/// delivered history: the claim reads the head index, not the backlog nor
/// the history. The check it replaces read every pending row (fewer heads
/// than the batch, so its LIMIT was never reached) and, for each, the
/// aggregate's events from its first delivered one (9.4 s per claim at
/// 26,000 pending rows in 100 rooms in the room-service load run; 0.7 s
/// with the aggregate index forced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ordered_claim_reads_heads_not_the_backlog() {
    use sqlx::Executor;
    let store = scratch_store("headplan").await;
    let t = store.table().as_str().to_owned();
    // 100 rooms: 60 delivered events each, the head of each leased, 20,000
    // pending behind them. No ANALYZE TABLE: the planner works from
    // InnoDB's sampled statistics, as on a live outbox.
    let sql = format!(
        "INSERT INTO {t} (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, status, worker_id, lock_until_ms) \
         SELECT 'room', CONCAT('e-', seq), 'RoomEvent', CONCAT('room-', seq % 100), seq, '{{}}', \
           IF(seq <= 6000, 'delivered', IF(seq <= 6100, 'delivering', 'pending')), 'w', IF(seq <= 6100, 9000000000000000, 0) \
         FROM seq_1_to_26100"
    );
    store.pool().execute(sql.as_str()).await.unwrap();
    let plans = store.explain_claims("room", 500).await.unwrap();
    // The open rows of the first 1,000 aggregates, index only (20,100),
    // the 500 oldest pending rows, a probe for each: about 21,000. The old
    // check read 600,000.
    postbox_testkit::assert_plan_reads(&plans, "claim_pending_ordered", 30_000);
}

/// The stats poll's oldest pending row over a backlog of 20,000 rows in
/// five types reads one index entry per type, not the backlog: it read
/// every pending entry at every poll, a monitoring cost that grew with the
/// backlog (the seed's incident).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_pending_row_is_found_without_reading_the_backlog() {
    use sqlx::Row;
    let store = scratch_store("oldest").await;
    let t = store.table().as_str().to_owned();
    for sql in [
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, created_at_ms) \
             SELECT 'room', CONCAT('e-', seq), CONCAT('T', seq % 5), '{{}}', 1000 + seq FROM seq_1_to_20000"
        ),
        format!("ANALYZE TABLE {t}"),
    ] {
        sqlx::query(&sql).execute(store.pool()).await.unwrap();
    }
    let backlog = store.statements().backlog.replace("?1", "'room'");
    let analyzed = sqlx::query(&format!("ANALYZE FORMAT=JSON {backlog}"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    let plan: String = analyzed.try_get(0).unwrap();
    let json: serde_json::Value = serde_json::from_str(&plan).unwrap();
    fn r_rows(v: &serde_json::Value) -> f64 {
        match v {
            serde_json::Value::Object(m) => m
                .iter()
                .map(|(k, v)| {
                    if k == "r_rows" {
                        v.as_f64().unwrap_or(0.0)
                    } else {
                        r_rows(v)
                    }
                })
                .sum(),
            serde_json::Value::Array(a) => a.iter().map(r_rows).sum(),
            _ => 0.0,
        }
    }
    assert!(
        r_rows(&json) < 1_000.0,
        "read {} rows:\n{plan}",
        r_rows(&json)
    );
    let stats = store.stats(&["room".to_owned()]).await.unwrap();
    assert_eq!(stats[0].pending, 20_000);
    assert!(
        stats[0].oldest_pending_age_seconds > 1_000_000.0,
        "{:?}",
        stats[0]
    );
}

/// A replay by filter without an app_code (`replay --status failed`) runs
/// once per app_code with rows, each through `_due_idx (app_code, status,
/// …)`: without the app_code, MariaDB had no index to read and scanned
/// every row, delivered history included. (Listing the app_codes is one
/// index probe each: a `DISTINCT` walked the whole `_event_uq` index just
/// after the bulk load.) Counted on the store's only
/// connection: rows read by scans (`Handler_read_rnd_next`) and by walks
/// along an index (`Handler_read_next`; a scan of the primary key in id
/// order is one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_by_status_reads_no_whole_table() {
    use postbox_core::store::{EventFilter, ReplaySelector, ReplayStore};
    use postbox_core::Status;
    let store = migrated("mysql", mysql_url(), |url| async move {
        MySqlOutbox::connect(&url, &scratch_table("replay_scan"), 1).await
    })
    .await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    for sql in [
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status) \
             SELECT IF(seq % 2 = 0, 'a', 'b'), CONCAT('d-', seq), 'Old', '{{}}', 'delivered' \
             FROM seq_1_to_40000"
        ),
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, retry_count) \
             SELECT IF(seq % 2 = 0, 'a', 'b'), CONCAT('f-', seq), 'Bad', '{{}}', 'failed', 5 \
             FROM seq_1_to_6"
        ),
        // A plain INSERT's empty app_code is an app_code with rows too.
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status) \
             VALUES ('', 'blank-1', 'Old', '{{}}', 'delivered')"
        ),
        format!("ANALYZE TABLE {t}"),
    ] {
        sqlx::query(&sql).execute(&pool).await.expect(&sql);
    }
    let scanned = async || -> i64 {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SHOW SESSION STATUS WHERE Variable_name IN ('Handler_read_rnd_next', 'Handler_read_next')",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        rows.iter().map(|r| r.1.parse::<i64>().unwrap()).sum()
    };
    let failed = ReplaySelector::Filter(EventFilter {
        status: Some(Status::Failed),
        ..EventFilter::default()
    });
    let before = scanned().await;
    assert_eq!(store.present_app_codes().await.unwrap(), ["", "a", "b"]);
    let dry = store.replay(&failed, true, "test").await.unwrap();
    assert_eq!(dry.len(), 6, "three failed rows of each app_code");
    let done = store.replay(&failed, false, "test").await.unwrap();
    assert_eq!(done.len(), 6);
    assert!(done.iter().all(|r| r.status == Status::Pending));
    let read = scanned().await - before;
    assert!(
        read < 5_000,
        "{read} rows read by scans for a replay of 6 rows among 40,007"
    );
    sqlx::query(&format!("DROP TABLE {t}, {t}_archive, {t}_history"))
        .execute(&pool)
        .await
        .unwrap();
}

/// The relay's claims and marks run on two connections of its own whose
/// sessions are at READ COMMITTED, so a fenced mark is one statement: it
/// used to send `SET TRANSACTION ISOLATION LEVEL READ COMMITTED` first, a
/// round trip of its own before every mark, release and deferral. Counted
/// by `performance_schema` (on in `scripts/test`) for those connections'
/// threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_on_the_relays_connections_is_one_statement() {
    use postbox_core::store::ClaimRequest;
    use postbox_core::{ClaimSource, NewEvent};
    let store = scratch_store("one_statement").await;
    let relay = store.bookkeeping_pool();
    let setting = async |pool: &sqlx::MySqlPool| -> String {
        sqlx::query_scalar("SELECT @@tx_isolation")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    assert_eq!(setting(relay).await, "READ-COMMITTED");
    assert_eq!(setting(store.pool()).await, "REPEATABLE-READ");
    // The relay's two connections, open, and their threads.
    let (mut a, mut b) = (
        relay.acquire().await.unwrap(),
        relay.acquire().await.unwrap(),
    );
    let mut ids = Vec::new();
    for conn in [&mut a, &mut b] {
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        ids.push(id.to_string());
    }
    drop((a, b));
    let counting: i64 = sqlx::query_scalar("SELECT CAST(@@performance_schema AS SIGNED)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(
        counting, 1,
        "this test counts statements in performance_schema, which is off: turn it on in the server's config and restart it (scripts/test does)"
    );
    let statements = async |name: &str| -> i64 {
        let sql = format!(
            "SELECT CAST(COALESCE(SUM(s.COUNT_STAR), 0) AS SIGNED) \
             FROM performance_schema.events_statements_summary_by_thread_by_event_name s \
             JOIN performance_schema.threads t ON t.THREAD_ID = s.THREAD_ID \
             WHERE t.PROCESSLIST_ID IN ({}) AND s.EVENT_NAME = 'statement/{name}'",
            ids.join(",")
        );
        sqlx::query_scalar(&sql)
            .fetch_one(store.pool())
            .await
            .unwrap()
    };
    let events: Vec<_> = (0..100)
        .map(|i| NewEvent::new("room", "T", format!(r#"{{"i":{i}}}"#)))
        .collect();
    store.enqueue_batch(&events, 1 << 20).await.unwrap();
    let req = ClaimRequest {
        app_code: "room",
        limit: 100,
        worker_id: "w",
        lease_ms: 60_000,
        ordered: false,
        skip_types: &[],
    };
    let claimed = store.claim(ClaimSource::Pending, &req).await.unwrap();
    assert_eq!(claimed.len(), 100);
    let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
    // Prepared statements count as `com/Execute`; a SET is sent as text.
    let (sets, executes) = (
        statements("sql/set_option").await,
        statements("com/Execute").await,
    );
    let marked = store
        .mark_delivered(&claimed[0].fence(), &ids)
        .await
        .unwrap();
    assert_eq!(marked, 100);
    assert_eq!(
        statements("com/Execute").await - executes,
        1,
        "the mark ran on the relay's connections"
    );
    assert_eq!(
        statements("sql/set_option").await - sets,
        0,
        "no SET before the mark"
    );
    sqlx::query(&format!("DROP TABLE {}", store.table().as_str()))
        .execute(store.pool())
        .await
        .ok();
}
