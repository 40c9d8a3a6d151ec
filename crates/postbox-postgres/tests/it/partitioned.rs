//! A range-partitioned outbox table (`[database] partitioning`, issue
//! 16.4): the whole conformance suite runs on a table partitioned by day,
//! whose claims and indexes work per partition and whose events stay
//! unique across partitions.

use std::sync::Arc;

use postbox_core::partition::Partitioning;
use postbox_core::store::{EnqueueOutcome, ReplayStore};
use postbox_core::OutboxStore;
use postbox_postgres::PgOutbox;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::migrated;

async fn partitioned() -> PgOutbox {
    migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table("pgpart"), 4)
            .await
            .map(|s| s.with_partitioning(Partitioning::Daily))
    })
    .await
}

async fn fresh_store() -> Arc<dyn OutboxStore> {
    Arc::new(partitioned().await)
}

mod conformance {
    use super::fresh_store;
    use postbox_testkit::conformance_suite;
    conformance_suite!(fresh_store);
}

const DAY: i64 = 86_400_000;

/// The partition of `day` days before the clock's, created for the test
/// (the keeper creates only the current one and those ahead).
async fn past_partition(store: &PgOutbox, day: i64) -> (String, postbox_core::partition::Range) {
    let now = store.now_ms().await.unwrap();
    let range = Partitioning::Daily.range_of(now - day * DAY);
    let t = store.table().as_str();
    let name = range.name(t);
    sqlx::query(&format!(
        "CREATE TABLE {name} PARTITION OF {t} FOR VALUES FROM ({}) TO ({})",
        range.from_ms, range.to_ms
    ))
    .execute(store.pool())
    .await
    .unwrap();
    (name, range)
}

/// `n` rows of `status` created at `created` (updated long ago), events
/// `prefix-0…`.
async fn rows(store: &PgOutbox, prefix: &str, status: &str, created: i64, n: i64) {
    let t = store.table().as_str();
    sqlx::query(&format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
         SELECT 'part', '{prefix}-' || g, 'T', '{{}}', '{status}', {created} + g, 1 FROM generate_series(0, {n} - 1) g"
    ))
    .execute(store.pool())
    .await
    .unwrap();
}

async fn count(store: &PgOutbox, sql: &str) -> i64 {
    let sql = sql.replace("{t}", store.table().as_str());
    sqlx::query_scalar(&sql)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

fn archive_all(now: i64, drop: bool) -> postbox_core::store::ArchiveRequest {
    postbox_core::store::ArchiveRequest {
        app_codes: vec!["part".into()],
        before_ms: now,
        batch_size: 1000,
        max_batches: None,
        partitions: if drop {
            postbox_core::config::PartitionArchive::Drop
        } else {
            postbox_core::config::PartitionArchive::Move
        },
    }
}

/// Two keepers side by side (a `migrate` and a starting relay) both make
/// the missing partitions without an error: `CREATE TABLE IF NOT EXISTS …
/// PARTITION OF` is not safe beside itself, and the one that lost the race
/// failed with "already exists".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_partition_keepers_side_by_side_both_succeed() {
    let store = partitioned().await;
    let t = store.table().as_str().to_owned();
    let other = PgOutbox::connect(&postgres_url(), &t, 4)
        .await
        .unwrap()
        .with_partitioning(Partitioning::Daily);
    for round in 0..3 {
        let ahead: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::TEXT FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = to_regclass($1)",
        )
        .bind(&t)
        .fetch_all(store.pool())
        .await
        .unwrap();
        for name in ahead {
            sqlx::query(&format!("DROP TABLE {name}"))
                .execute(store.pool())
                .await
                .unwrap();
        }
        let (a, b) = tokio::join!(store.keep_partitions(), other.keep_partitions());
        let (a, b) = (
            a.unwrap_or_else(|e| panic!("round {round}: {e}")),
            b.unwrap_or_else(|e| panic!("round {round}: {e}")),
        );
        assert!(a.len() + b.len() >= 15, "round {round}: {a:?} {b:?}");
        assert_eq!(store.partitions_ahead().await.unwrap().unwrap().ahead, 14);
    }
}

/// Issue 16.4: `migrate` keeps 14 daily partitions ahead; an event is
/// unique across partitions; archiving detaches (`CONCURRENTLY`) and moves
/// each old partition whose rows are all done, row-archives the delivered
/// rows of one that is not, finishes a partition an interrupted run left
/// detached (dropping it in `drop` mode), and attaches back one that a
/// replay made busy after it was detached; a moved event's key is gone, so
/// it can be written again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_partitions_are_detached_and_moved_whole_and_events_stay_unique() {
    let store = partitioned().await;
    let ahead = store.partitions_ahead().await.unwrap().unwrap();
    assert_eq!(ahead.ahead, 14, "{ahead:?}");
    assert_eq!(
        store.keep_partitions().await.unwrap(),
        Vec::<String>::new(),
        "nothing missing"
    );

    let (d3, r3) = past_partition(&store, 3).await;
    let (d2, r2) = past_partition(&store, 2).await;
    let (d1, r1) = past_partition(&store, 1).await;
    rows(&store, "d3", "delivered", r3.from_ms, 100).await;
    rows(&store, "d2", "delivered", r2.from_ms, 100).await;
    rows(&store, "d2p", "pending", r2.from_ms + 500, 1).await;
    rows(&store, "d1", "published", r1.from_ms, 50).await;

    // Unique across partitions: the same event created on another day is
    // not written (the INSERT returns no row, as ON CONFLICT DO NOTHING).
    let t = store.table().as_str().to_owned();
    let dup = sqlx::query(&format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload, created_at_ms) VALUES ('part', 'd3-7', 'T', '{{}}', {})",
        r1.from_ms + 999
    ))
    .execute(store.pool())
    .await
    .unwrap();
    assert_eq!(dup.rows_affected(), 0);
    let dup = store
        .enqueue_batch(
            &[postbox_core::NewEvent::new("part", "T", "{}").event_id("d2-5")],
            1 << 20,
        )
        .await
        .unwrap();
    assert_eq!(dup[0], EnqueueOutcome::Duplicate);

    let now = store.now_ms().await.unwrap();
    let report = store
        .archive(&archive_all(now, false), &|_| {})
        .await
        .unwrap();
    assert!(report.complete);
    assert_eq!(
        report.moved,
        100 + 50 + 100,
        "two partitions whole, one's delivered rows"
    );
    let attached = |name: String| {
        let store = &store;
        async move {
            count(
                store,
                &format!("SELECT COUNT(*) FROM pg_inherits WHERE inhrelid = to_regclass('{name}')"),
            )
            .await
        }
    };
    let exists = |name: String| {
        let store = &store;
        async move {
            count(
                store,
                &format!("SELECT COUNT(*) FROM pg_class WHERE relname = '{name}'"),
            )
            .await
        }
    };
    assert_eq!(
        exists(d3.clone()).await + exists(d1.clone()).await,
        0,
        "moved and dropped"
    );
    assert_eq!(attached(d2.clone()).await, 1, "its pending row holds it");
    assert_eq!(count(&store, "SELECT COUNT(*) FROM {t}_archive").await, 250);
    assert_eq!(count(&store, "SELECT COUNT(*) FROM {t}").await, 1);
    assert_eq!(
        count(&store, "SELECT COUNT(*) FROM {t}_keys").await,
        1,
        "only the live event's key"
    );
    // A moved event can be written again.
    let again = store
        .enqueue_batch(
            &[postbox_core::NewEvent::new("part", "T", "{}").event_id("d3-7")],
            1 << 20,
        )
        .await
        .unwrap();
    assert!(matches!(again[0], EnqueueOutcome::Inserted(_)), "{again:?}");

    // A run that stopped after detaching: the next one drops it (`drop`).
    sqlx::query(&format!(
        "UPDATE {t} SET status = 'delivered' WHERE event_id = 'd2p-0'"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query(&format!(
        "ALTER TABLE {t} DETACH PARTITION {d2} CONCURRENTLY"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    // And one a replay made busy after it was detached: attached back.
    let (d4, r4) = past_partition(&store, 4).await;
    rows(&store, "d4", "pending", r4.from_ms, 3).await;
    sqlx::query(&format!(
        "ALTER TABLE {t} DETACH PARTITION {d4} CONCURRENTLY"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let report = store
        .archive(&archive_all(now, true), &|_| {})
        .await
        .unwrap();
    assert_eq!(report.moved, 1, "the detached partition's one row, dropped");
    assert_eq!(exists(d2).await, 0);
    assert_eq!(
        count(&store, "SELECT COUNT(*) FROM {t}_archive").await,
        250,
        "drop keeps nothing"
    );
    assert_eq!(attached(d4).await, 1, "attached back with its pending rows");
    assert_eq!(
        count(&store, "SELECT COUNT(*) FROM {t} WHERE status = 'pending'").await,
        4
    );
    assert_eq!(count(&store, "SELECT COUNT(*) FROM {t}_keys").await, 4);

    // A time-range replay of an archived partition's day: its rows come
    // back created now (their partition is gone), d3-7 stays the live one.
    let range = postbox_core::store::ReplaySelector::Filter(postbox_core::store::EventFilter {
        app_code: Some("part".into()),
        since_ms: Some(r3.from_ms),
        until_ms: Some(r3.to_ms),
        ..Default::default()
    });
    let back = ReplayStore::replay(&store, &range, false, "test")
        .await
        .unwrap();
    assert_eq!(back.len(), 99, "all but d3-7, live again (created today)");
    let today = Partitioning::Daily
        .range_of(store.now_ms().await.unwrap())
        .from_ms;
    assert_eq!(
        count(&store, &format!("SELECT COUNT(*) FROM {{t}} WHERE event_id LIKE 'd3-%' AND created_at_ms >= {today}")).await,
        100
    );
    assert_eq!(
        count(
            &store,
            "SELECT COUNT(*) FROM {t}_archive WHERE event_id LIKE 'd3-%'"
        )
        .await,
        1,
        "d3-7's archived copy"
    );
}

/// `database.partitioning` must say how the table was made. Unset on a
/// daily table, no relay kept partitions ahead (inserts failed once the
/// last was past); `weekly` over days skipped each week overlapping a day
/// made, leaving days without a partition; set on a plain table it did
/// nothing. Each is now refused, naming the key.
#[tokio::test]
async fn the_partitioning_configured_is_the_table_s() {
    let daily = partitioned().await;
    daily.check_partitioning().await.expect("daily, as made");
    // A week made long ago (an earlier setting) and a DEFAULT partition of
    // the operator's own stand in nothing's way.
    let t = daily.table().as_str().to_owned();
    let now = daily.now_ms().await.unwrap();
    let week = Partitioning::Weekly.range_of(now - 40 * DAY);
    for sql in [
        format!(
            "CREATE TABLE {t}_oldweek PARTITION OF {t} FOR VALUES FROM ({}) TO ({})",
            week.from_ms, week.to_ms
        ),
        format!("CREATE TABLE {t}_default PARTITION OF {t} DEFAULT"),
    ] {
        sqlx::query(&sql).execute(daily.pool()).await.unwrap();
    }
    daily.check_partitioning().await.expect("daily, as made");
    // The keeper and the archiver go on beside a DEFAULT partition (its
    // bound is no range: both failed on it).
    daily.keep_partitions().await.expect("the keeper runs");
    assert_eq!(daily.partitions_ahead().await.unwrap().unwrap().ahead, 14);
    daily
        .archive(&archive_all(now, false), &|_| {})
        .await
        .expect("the archiver runs");
    let reopen = |p: Option<Partitioning>| {
        let table = daily.table().as_str().to_owned();
        async move {
            let s = PgOutbox::connect(&postgres_url(), &table, 2).await.unwrap();
            match p {
                Some(p) => s.with_partitioning(p),
                None => s,
            }
        }
    };
    for (p, says) in [
        (None, "unset, but table"),
        (Some(Partitioning::Weekly), "is a day"),
    ] {
        let e = reopen(p)
            .await
            .check_partitioning()
            .await
            .expect_err("refused");
        let text = e.to_string();
        assert!(
            text.contains("database.partitioning") && text.contains(says),
            "{text}"
        );
        assert!(text.contains("partitioned daily") || p.is_some(), "{text}");
    }
    let plain = migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table("pgplain"), 2).await
    })
    .await;
    plain
        .check_partitioning()
        .await
        .expect("a plain table, unset");
    let table = plain.table().as_str().to_owned();
    let claimed = PgOutbox::connect(&postgres_url(), &table, 2)
        .await
        .unwrap()
        .with_partitioning(Partitioning::Daily);
    let e = claimed.check_partitioning().await.expect_err("refused");
    assert!(e.to_string().contains("is not partitioned"), "{e}");
}

/// A partition that cannot be detached (a transaction holding it past the
/// lock timeout) leaves its delivered rows to the row batches: the run
/// goes on. The whole run stopped with the error, archiving nothing, run
/// after run while the transaction stayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_that_cannot_be_detached_leaves_its_rows_to_the_row_batches() {
    let store = partitioned().await;
    let (d3, r3) = past_partition(&store, 3).await;
    rows(&store, "d3", "delivered", r3.from_ms, 100).await;
    let (_, r2) = past_partition(&store, 2).await;
    rows(&store, "d2", "delivered", r2.from_ms, 40).await;
    rows(&store, "d2p", "pending", r2.from_ms + 500, 1).await;
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE {d3} IN SHARE UPDATE EXCLUSIVE MODE"))
        .execute(&mut *holder)
        .await
        .unwrap();
    let now = store.now_ms().await.unwrap();
    let report = store
        .archive(&archive_all(now, false), &|_| {})
        .await
        .expect("the run goes on past the partition");
    assert_eq!(report.moved, 140, "{report:?}");
    holder.rollback().await.unwrap();
    assert_eq!(count(&store, "SELECT COUNT(*) FROM {t}").await, 1);
}

/// A partition is made while a long transaction reads the table (a report,
/// a slow producer), and producers' inserts never wait for it: `CREATE
/// TABLE … PARTITION OF` waited for that transaction for the table's ACCESS
/// EXCLUSIVE lock, every insert queued behind it, and after the 3 s lock
/// timeout the partition was not made either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_is_made_beside_a_long_transaction_and_inserts_do_not_wait() {
    let store = Arc::new(partitioned().await);
    let t = store.table().as_str().to_owned();
    let now = store.now_ms().await.unwrap();
    let last = Partitioning::Daily.range_of(now + 14 * DAY);
    sqlx::query(&format!("DROP TABLE {}", last.name(&t)))
        .execute(store.pool())
        .await
        .unwrap();
    let mut report = store.pool().begin().await.unwrap();
    sqlx::query(&format!("SELECT COUNT(*) FROM {t}"))
        .execute(&mut *report)
        .await
        .unwrap();
    let keeper = tokio::spawn({
        let store = store.clone();
        async move { store.keep_partitions().await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let beside = format!("INSERT INTO {t} (app_code, event_id, event_type, payload) VALUES ('part', 'beside', 'T', '{{}}')");
    let insert = sqlx::query(&beside).execute(store.pool());
    tokio::time::timeout(std::time::Duration::from_secs(2), insert)
        .await
        .expect("the insert waited behind the keeper")
        .unwrap();
    let made = keeper
        .await
        .unwrap()
        .expect("the partition is made beside the transaction");
    assert_eq!(made, vec![last.name(&t)]);
    report.rollback().await.unwrap();
    assert_eq!(store.partitions_ahead().await.unwrap().unwrap().ahead, 14);
    // The new partition is a whole one: an event written into it gets an
    // id from the table and stays unique.
    for _ in 0..2 {
        sqlx::query(&format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, created_at_ms) VALUES ('part', 'ahead', 'T', '{{}}', {})",
            last.from_ms + 1
        ))
        .execute(store.pool())
        .await
        .unwrap();
    }
    assert_eq!(
        count(
            &store,
            &format!(
                "SELECT COUNT(*) FROM {} WHERE event_id = 'ahead' AND id IS NOT NULL",
                last.name(&t)
            )
        )
        .await,
        1
    );
}
