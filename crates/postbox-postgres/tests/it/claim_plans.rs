//! With 1,000,000 delivered rows (and another tenant's backlog) in the
//! table, every claim query reads through its `app_code`-led index and
//! touches only rows it could claim.

use postbox_postgres::PgOutbox;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::migrated;

/// A migrated store on a scratch table named after `prefix`.
async fn plans_store(prefix: &'static str) -> PgOutbox {
    migrated("postgres", postgres_url(), move |url| async move {
        PgOutbox::connect(&url, &scratch_table(prefix), 2).await
    })
    .await
}

/// Runs each of `statements` on `pool`, in order.
async fn load(pool: &sqlx::PgPool, statements: impl IntoIterator<Item = String>) {
    for sql in statements {
        sqlx::query(&sql).execute(pool).await.expect(&sql);
    }
}

/// `rows` pending rows of app_code `plan` in `t` (event ids `<prefix><n>`),
/// then `VACUUM ANALYZE`: statistics that see every row pending.
fn analysed_backlog(t: &str, prefix: &str, rows: u32) -> [String; 2] {
    [
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload) \
             SELECT 'plan', '{prefix}' || g, 'New', '{{}}' FROM generate_series(1, {rows}) g"
        ),
        format!("VACUUM ANALYZE {t}"),
    ]
}

/// Rows read by sequential scans of `tables` so far, once the count is
/// settled (see [`settled`]).
async fn settled_scans(pool: &sqlx::PgPool, tables: &[&str]) -> i64 {
    settled(
        pool,
        "SELECT COALESCE(SUM(seq_tup_read), 0)::BIGINT FROM pg_stat_user_tables WHERE relname = ANY($1)",
        tables,
    )
    .await
}

/// Index entries read through `index` so far, once the count is settled.
async fn settled_index_reads(pool: &sqlx::PgPool, index: &str) -> i64 {
    settled(
        pool,
        "SELECT COALESCE(SUM(idx_tup_read), 0)::BIGINT FROM pg_stat_user_indexes WHERE indexrelname = ANY($1)",
        &[index],
    )
    .await
}

/// A statistics count (`sql` over the relation names `names`), once
/// settled: a backend reports its statistics when its transaction ends,
/// at most once a second (an idle pooled connection's, up to a second
/// later), so the count is read until two reads a second apart agree.
async fn settled(pool: &sqlx::PgPool, sql: &str, names: &[&str]) -> i64 {
    let read = async || -> i64 {
        sqlx::query_scalar(sql)
            .bind(names)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let mut last = read().await;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
        let now = read().await;
        if now == last {
            return now;
        }
        last = now;
    }
}

/// Drops the scratch table `t` and its twins.
async fn drop_tables(pool: &sqlx::PgPool, t: &str) {
    sqlx::query(&format!(
        "DROP TABLE {t}, {t}_archive, {t}_history, {t}_controls, {t}_control_log, {t}_relays"
    ))
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_use_their_index_over_a_million_delivered_rows() {
    let store = plans_store("plans").await;
    postbox_testkit::conformance::claims_use_their_index_over(
        std::sync::Arc::new(store.clone()),
        store.pool().clone(),
        &postbox_testkit::conformance::Numbers::POSTGRES,
    )
    .await;
}

/// A backlog analysed while every row was pending, then half drained
/// before the statistics catch up (autovacuum analyses after 10 % of the
/// rows changed, a minute apart at best): the pending claim still reads
/// `_pending_idx` and only the rows it takes. With `_pending_idx (app_code,
/// id)` and `ORDER BY id`, the planner read the primary key, which has the
/// same order, and filtered out every row delivered so far on each claim
/// (schema version 6 is the fix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_claim_keeps_its_index_while_an_analysed_backlog_drains() {
    let store = plans_store("drain_plan").await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    load(
        &pool,
        analysed_backlog(&t, "p-", 40_000).into_iter().chain([
            // The first half delivered, as a relay would leave them.
            format!(
                "UPDATE {t} SET status = 'delivered', next_retry_at_ms = 1, updated_at_ms = 1 \
                 WHERE id <= (SELECT MIN(id) + 19999 FROM {t})"
            ),
        ]),
    )
    .await;
    let plans = store.explain_claims("plan", 500).await.unwrap();
    // 500 index entries, then the 500 rows locked and the 500 updated.
    postbox_testkit::assert_plan_reads(&plans, "claim_pending", 1_600);
    drop_tables(&pool, &t).await;
}

/// A per-aggregate claim over a backlog in few aggregates whose heads are
/// in flight (the next claim runs while a batch publishes), each with a
/// delivered history: the claim reads the head index, not the backlog.
/// The check it replaces read every pending row, because with fewer heads
/// than the batch its LIMIT was never reached (252 ms and 77,867 buffers
/// per claim that found nothing, at 26,000 pending rows in 100 aggregates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ordered_claim_reads_heads_not_the_backlog() {
    let store = plans_store("head_plan").await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    load(
        &pool,
        [
            format!(
                "INSERT INTO {t} (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, \
                   status, worker_id, lock_until_ms, next_retry_at_ms) \
                 SELECT 'room', 'e-' || g, 'RoomEvent', 'room-' || (g % 100), g, '{{}}', \
                   CASE WHEN g <= 6000 THEN 'delivered' WHEN g <= 6100 THEN 'delivering' ELSE 'pending' END, \
                   'w', CASE WHEN g <= 6100 THEN 9000000000000000 ELSE 0 END, \
                   CASE WHEN g <= 6100 THEN 9000000000000000 ELSE 0 END \
                 FROM generate_series(1, 26100) g"
            ),
            format!("VACUUM ANALYZE {t}"),
        ],
    )
    .await;
    let plans = store.explain_claims("room", 500).await.unwrap();
    // A probe or two per aggregate and per row of the 500 oldest: about
    // 1,800 index entries. The old check read all 20,000 pending rows.
    postbox_testkit::assert_plan_reads(&plans, "claim_pending_ordered", 5_000);
    drop_tables(&pool, &t).await;
}

/// A replay by event id without an app_code reads the unique `(app_code,
/// event_id)` index once per app_code with rows, never the whole table
/// (as `($2 IS NULL OR app_code = $2)` it could use no index: a
/// sequential scan of every row, delivered history included, per replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_by_event_id_reads_no_whole_table() {
    use postbox_core::store::{ReplaySelector, ReplayStore};
    let store = plans_store("replay_plan").await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    load(
        &pool,
        [
            format!(
                "INSERT INTO {t} (app_code, event_id, event_type, payload, status) \
                 SELECT CASE WHEN g % 2 = 0 THEN 'a' ELSE 'b' END, 'e-' || g, 'Old', '{{}}', 'delivered' \
                 FROM generate_series(1, 50000) g"
            ),
            format!(
                "INSERT INTO {t} (app_code, event_id, event_type, payload, status) \
                 VALUES ('', 'blank-1', 'Old', '{{}}', 'delivered')"
            ),
            format!("VACUUM ANALYZE {t}"),
        ],
    )
    .await;
    let tables = [t.as_str()];
    let before = settled_scans(&pool, &tables).await;
    // Every app_code with rows, a plain INSERT's empty one included.
    assert_eq!(store.present_app_codes().await.unwrap(), ["", "a", "b"]);
    let by_id = ReplaySelector::EventIds {
        app_code: None,
        event_ids: vec!["e-7".to_owned(), "e-8".to_owned()],
    };
    let dry = store.replay(&by_id, true, "test").await.unwrap();
    assert_eq!(dry.len(), 2, "one of each app_code");
    let done = store.replay(&by_id, false, "test").await.unwrap();
    assert_eq!(done.len(), 2);
    assert_eq!(
        settled_scans(&pool, &tables).await,
        before,
        "rows read by whole-table scans during the replay"
    );
    drop_tables(&pool, &t).await;
}

/// A search by aggregate reads `_agg_idx` (built `CONCURRENTLY`, outside
/// a transaction) on the table and on the archive: with 50,000 rows in
/// each, it scans neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_by_aggregate_reads_its_index_in_the_table_and_the_archive() {
    use postbox_core::store::{EventFilter, InspectStore};
    let store = plans_store("agg_plan").await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    let rows = |table: &str, from: i64| {
        format!(
            "INSERT INTO {table} (id, app_code, event_id, event_type, payload, status, aggregate_id) \
             SELECT g, 'a', 'e-' || g, 'Old', '{{}}', 'delivered', 'order-' || (g % 10000) \
             FROM generate_series({from}, {from} + 49999) g"
        )
    };
    load(
        &pool,
        [
            rows(&format!("{t}_archive"), 1),
            rows(&t, 50_001),
            format!("VACUUM ANALYZE {t}"),
            format!("VACUUM ANALYZE {t}_archive"),
        ],
    )
    .await;
    // The index builds read every row. A backend may hold its table
    // statistics back for up to 10 s while idle, and reports them when it
    // exits at the latest: the builds run on connections of their own,
    // closed before the scans are counted.
    let builder = PgOutbox::connect(&postgres_url(), &t, 2).await.unwrap();
    // A concurrent build that failed half way leaves an invalid index of
    // the name, which serves no query: not counted, and rebuilt.
    let failed = sqlx::query(&format!(
        "CREATE UNIQUE INDEX CONCURRENTLY {t}_agg_idx ON {t} (app_code)"
    ))
    .execute(builder.pool())
    .await;
    assert!(failed.is_err(), "every row has app_code 'a'");
    assert!(!store.inspect_schema().await.unwrap().aggregate_search);
    let created = builder
        .aggregate_index(true)
        .await
        .expect("build the index");
    builder.pool().close().await;
    assert_eq!(
        created,
        [format!("{t}_agg_idx"), format!("{t}_archive_agg_idx")]
    );
    let archive = format!("{t}_archive");
    let tables = [t.as_str(), archive.as_str()];
    let before = settled_scans(&pool, &tables).await;
    let filter = EventFilter {
        app_code: Some("a".into()),
        aggregate_id: Some("order-7".into()),
        limit: 50,
        ..Default::default()
    };
    let found = store.list_inspected(&filter).await.unwrap();
    assert_eq!(found.len(), 10, "5 live and 5 archived events of order-7");
    assert_eq!(found.iter().filter(|r| r.archived).count(), 5);
    assert!(found.windows(2).all(|w| w[0].record.id > w[1].record.id));
    assert_eq!(
        settled_scans(&pool, &tables).await,
        before,
        "rows read by whole-table scans"
    );
    drop_tables(&pool, &t).await;
}

/// 20,000 rows in flight (leased), in a table analysed while they were
/// pending, as any table whose statistics see few delivering rows: a
/// mark of 100 of them reads those 100 by primary key. Written with a
/// plain `status = 'delivering'`, it read `_lease_idx` whole (every row
/// in flight, 20,000 entries, 11 ms instead of 1.1 ms per mark) and
/// filtered by id, a cost that grew with the rows in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_reads_its_rows_by_primary_key_however_many_are_in_flight() {
    use postbox_core::event::Fence;
    let store = plans_store("mark_plan").await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    load(
        &pool,
        analysed_backlog(&t, "m-", 20_000)
            .into_iter()
            .chain([format!(
                "UPDATE {t} SET status = 'delivering', worker_id = 'w', lock_until_ms = 5, \
                   next_retry_at_ms = 5"
            )]),
    )
    .await;
    let ids: Vec<i64> = sqlx::query_scalar(&format!("SELECT id FROM {t} ORDER BY id LIMIT 300"))
        .fetch_all(&pool)
        .await
        .unwrap();
    let fence = Fence {
        worker_id: "w".into(),
        lock_until_ms: 5,
    };
    let lease_idx = format!("{t}_lease_idx");
    let before = settled_index_reads(&pool, &lease_idx).await;
    assert_eq!(
        store.mark_delivered(&fence, &ids[..100]).await.unwrap(),
        100
    );
    let release = store.release(&fence, &ids[100..200]).await.unwrap();
    assert_eq!(release, 100);
    let defer = postbox_core::store::DeferUpdate {
        after_ms: 1_000,
        delivered_to: vec![],
        reason: "behind".into(),
    };
    assert_eq!(store.defer(&fence, &ids[200..], &defer).await.unwrap(), 100);
    // The bookkeeping connections report their reads when they close.
    store.bookkeeping_pool().close().await;
    let read = settled_index_reads(&pool, &lease_idx).await - before;
    assert_eq!(read, 0, "the marks read {read} entries of {lease_idx}");
    drop_tables(&pool, &t).await;
}

/// The relay's bookkeeping writes (claims, marks) run on connections that
/// commit without waiting for the WAL flush (`relay_commit = "async"`,
/// the default); every other connection of the store commits as the
/// server is configured, and `"sync"` keeps the relay's writes so too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_relays_bookkeeping_commits_asynchronously() {
    use postbox_core::config::RelayCommit;
    let store = plans_store("relay_commit").await;
    let setting = async |pool: &sqlx::PgPool| -> String {
        sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    assert_eq!(setting(store.bookkeeping_pool()).await, "off");
    assert_eq!(setting(store.pool()).await, "on");
    let sync = store.clone().with_relay_commit(RelayCommit::Sync);
    assert_eq!(setting(sync.bookkeeping_pool()).await, "on");
    // A store on the caller's own pool keeps to that pool until asked.
    let own = PgOutbox::new(store.pool().clone(), store.table().as_str()).unwrap();
    assert_eq!(setting(own.bookkeeping_pool()).await, "on");
    let t = store.table().as_str().to_owned();
    drop_tables(store.pool(), &t).await;
}
