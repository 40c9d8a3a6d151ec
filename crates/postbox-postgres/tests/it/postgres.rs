//! PostgreSQL: the conformance suite and what only this backend does.

use std::sync::Arc;

use postbox_core::store::{OutboxStore, ReplayStore};
use postbox_core::{Error, NewEvent};
use postbox_postgres::PgOutbox;
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::migrated;
use postbox_testkit::{conformance_suite, scratch_table};

pub(crate) async fn outbox() -> PgOutbox {
    migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table("pg"), 4).await
    })
    .await
}

async fn fresh_store() -> Arc<dyn OutboxStore> {
    Arc::new(outbox().await)
}

conformance_suite!(fresh_store);

/// A table named in mixed case (PostgreSQL keeps it in lower case, since
/// postbox never quotes it) is found by its second `migrate`: every run
/// took it for gone, applied every version again and rebuilt its indexes.
#[tokio::test]
async fn a_mixed_case_table_name_is_migrated_once() {
    let name = scratch_table("Room_Outbox");
    let store = migrated("postgres", postgres_url(), |url| {
        let name = name.clone();
        async move { PgOutbox::connect(&url, &name, 2).await }
    })
    .await;
    let again = store.migrate().await.unwrap();
    assert!(
        again.applied.is_empty() && again.notes.is_empty(),
        "the second migrate of {name}: {again:?}"
    );
    assert_eq!(store.table().as_str(), name.to_ascii_lowercase());
}

/// A `migrate` that must change the table while a transaction that wrote
/// to it stays open (a producer's) gives up within seconds, changing
/// nothing, instead of waiting for it: while it waited, every statement on
/// the table queued behind its lock, the producers' `INSERT`s included.
#[tokio::test]
async fn migrate_gives_up_on_a_table_a_long_transaction_holds() {
    let store = outbox().await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    sqlx::query("DELETE FROM postbox_schema_migrations WHERE table_name = $1 AND version >= 5")
        .bind(&t)
        .execute(&pool)
        .await
        .unwrap();
    let mut producer = pool.begin().await.unwrap();
    store
        .enqueue(&mut producer, &NewEvent::new("app", "T", "{}"))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let waited = tokio::time::timeout(std::time::Duration::from_secs(20), store.migrate()).await;
    let err = waited
        .expect("migrate waited for the producer's transaction")
        .expect_err("the table was locked");
    assert!(err.to_string().contains("lock timeout"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    producer.rollback().await.unwrap();
    assert_eq!(
        store.migrate().await.unwrap().applied,
        vec![5, 6, 7, 8, 9, 10, 11]
    );
}

/// The per-aggregate claim's second statement (past the followers of held
/// aggregates) fails: the rows its first statement leased are still handed
/// out. They were dropped with the error, left `delivering` until their
/// lease ended and then taken over as a failed attempt that never was.
#[tokio::test]
async fn a_failed_second_claim_statement_keeps_the_first_ones_rows() {
    use postbox_core::store::ClaimRequest;
    use postbox_core::ClaimSource;
    let store = outbox().await;
    let t = store.table().as_str().to_owned();
    let claim = async |limit: u32| {
        let req = ClaimRequest {
            app_code: "app",
            limit,
            worker_id: "w",
            lease_ms: 600_000,
            ordered: true,
            skip_types: &[],
        };
        store.claim(ClaimSource::Pending, &req).await
    };
    let heads: Vec<NewEvent> = (0..2)
        .map(|i| NewEvent::new("app", "Y", "{}").aggregate(format!("a-{i}"), 1))
        .collect();
    store.enqueue_batch(&heads, 1 << 20).await.unwrap();
    assert_eq!(claim(2).await.unwrap().len(), 2, "the heads, in flight");
    let followers: Vec<NewEvent> = (2..4)
        .flat_map(|v| {
            (0..2).map(move |i| NewEvent::new("app", "Y", "{}").aggregate(format!("a-{i}"), v))
        })
        .collect();
    store.enqueue_batch(&followers, 1 << 20).await.unwrap();
    let boom = NewEvent::new("app", "Y", "{}").event_id("boom");
    let z = NewEvent::new("app", "Z", "{}");
    store
        .enqueue_batch(&[boom, z.clone()], 1 << 20)
        .await
        .unwrap();
    // Only the second statement reaches `boom`, behind the followers.
    for stmt in [
        "CREATE FUNCTION {t}_boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'boom'; END $$".to_owned(),
        "CREATE TRIGGER {t}_boom BEFORE UPDATE ON {t} FOR EACH ROW WHEN (OLD.event_id = 'boom') EXECUTE FUNCTION {t}_boom()".to_owned(),
    ] {
        sqlx::query(&stmt.replace("{t}", &t)).execute(store.pool()).await.unwrap();
    }
    let got = claim(3).await.expect("the first statement's rows");
    let ids: Vec<&str> = got.iter().map(|c| c.record.event_id.as_str()).collect();
    assert_eq!(ids, [z.event_id.as_str()]);
    sqlx::query(&format!("DROP TRIGGER {t}_boom ON {t}"))
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query(&format!("DROP FUNCTION {t}_boom"))
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::test]
async fn migrate_is_idempotent() {
    let store = outbox().await;
    let again = store.migrate().await.unwrap();
    assert!(again.applied.is_empty(), "second run changes nothing");
    assert_eq!(
        again.version, 11,
        "with the wake-up trigger, the index per status, the pending index in claim order, \
         the head index, the pending index by event type and the runtime controls"
    );
}

/// A table made before schema version 5 (its eight indexes over every row,
/// rows in every status, some claimed under the old rules) upgrades in
/// place: the old indexes go, the partial ones come, every row stays
/// where it was, and the relay's statements find them through the new
/// indexes, including a lease taken before the upgrade.
#[tokio::test]
async fn version_5_replaces_the_indexes_of_an_existing_table() {
    let store = outbox().await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    let old = [
        "{t}_claim_retry_idx ON {t} (app_code, status, next_retry_at_ms, created_at_ms, event_id)",
        "{t}_claim_lease_idx ON {t} (app_code, status, lock_until_ms, created_at_ms, event_id)",
        "{t}_status_updated_idx ON {t} (app_code, status, updated_at_ms, event_id)",
        "{t}_event_id_idx ON {t} (event_id)",
        "{t}_aggregate_idx ON {t} (app_code, aggregate_id, id)",
        "{t}_status_id_idx ON {t} (app_code, status, id)",
    ];
    for index in old {
        let sql = format!("CREATE INDEX {}", index.replace("{t}", &t));
        sqlx::query(&sql).execute(&pool).await.expect(&sql);
    }
    for index in ["pending", "retry", "lease", "failed", "done", "head"] {
        let sql = format!("DROP INDEX {t}_{index}_idx");
        sqlx::query(&sql).execute(&pool).await.expect(&sql);
    }
    // Rows as version 4 wrote them: a lease whose next_retry_at_ms is not
    // its end (expired an hour ago), a delivered row, a due retry.
    let insert = format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload, status, worker_id, \
           lock_until_ms, next_retry_at_ms, updated_at_ms, aggregate_id) VALUES \
         ('up', 'leased', 'T', '{{}}', 'delivering', 'old-relay', 1, 0, 1, 'a'), \
         ('up', 'done', 'T', '{{}}', 'delivered', NULL, 0, 0, 1, NULL), \
         ('up', 'retry', 'T', '{{}}', 'retryable', NULL, 0, 1, 1, NULL), \
         ('up', 'new', 'T', '{{}}', 'pending', NULL, 0, 0, 1, 'b')"
    );
    sqlx::query(&insert).execute(&pool).await.expect("rows");
    sqlx::query("DELETE FROM postbox_schema_migrations WHERE table_name = $1 AND version >= 5")
        .bind(&t)
        .execute(&pool)
        .await
        .unwrap();

    let report = store.migrate().await.expect("upgrade");
    assert_eq!(report.applied, vec![5, 6, 7, 8, 9, 10, 11], "{report:?}");
    let schema = store.inspect_schema().await.unwrap();
    assert!(
        schema.objects.iter().all(|o| o.present),
        "every expected object: {schema:?}"
    );
    let indexes: Vec<String> =
        sqlx::query_scalar("SELECT indexname::TEXT FROM pg_indexes WHERE tablename = $1")
            .bind(&t)
            .fetch_all(&pool)
            .await
            .unwrap();
    let pending: String =
        sqlx::query_scalar("SELECT indexdef::TEXT FROM pg_indexes WHERE indexname = $1")
            .bind(format!("{t}_pending_idx"))
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        pending.contains("(app_code, event_type, next_retry_at_ms, id)"),
        "version 8's pending index: {pending}"
    );
    for gone in [
        "claim_retry",
        "claim_lease",
        "status_updated",
        "event_id",
        "aggregate",
        "status_id",
        "open_aggregate",
    ] {
        assert!(!indexes.contains(&format!("{t}_{gone}_idx")), "{indexes:?}");
    }

    let s = store.stats(&["up".into()]).await.unwrap().remove(0);
    assert_eq!(
        (s.pending, s.delivering, s.retryable, s.delivered, s.failed),
        (1, 1, 1, 1, 0),
        "{s:?}"
    );
    let req = postbox_core::store::ClaimRequest {
        app_code: "up",
        limit: 10,
        worker_id: "new-relay",
        lease_ms: 30_000,
        ordered: false,
        skip_types: &[],
    };
    use postbox_core::ClaimSource::*;
    for (source, event) in [
        (ExpiredLease, "leased"),
        (DueRetry, "retry"),
        (Pending, "new"),
    ] {
        let claimed = store.claim(source, &req).await.unwrap();
        let ids: Vec<&str> = claimed.iter().map(|c| c.record.event_id.as_str()).collect();
        assert_eq!(ids, vec![event], "{source:?}");
    }
    assert_eq!(
        store.find("done").await.unwrap().len(),
        1,
        "events show by id"
    );
}

#[tokio::test]
async fn enqueue_commits_and_rolls_back_with_the_callers_transaction() {
    let store = outbox().await;
    let pool = store.pool().clone();
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {}_rooms (id TEXT PRIMARY KEY)",
        store.table()
    ))
    .execute(&pool)
    .await
    .unwrap();

    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {}_rooms VALUES ('r1')",
        store.table()
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    let kept = NewEvent::new("room", "RoomCreated", r#"{"room":"r1"}"#);
    store.enqueue(&mut tx, &kept).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    let dropped = NewEvent::new("room", "RoomCreated", r#"{"room":"r2"}"#);
    store.enqueue(&mut tx, &dropped).await.unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(store.find(&kept.event_id).await.unwrap().len(), 1);
    assert!(store.find(&dropped.event_id).await.unwrap().is_empty());

    // A duplicate is a typed error and the transaction stays usable.
    let mut tx = pool.begin().await.unwrap();
    match store.enqueue(&mut tx, &kept).await {
        Err(Error::DuplicateEvent { event_id, .. }) => assert_eq!(event_id, kept.event_id),
        other => panic!("expected DuplicateEvent, got {other:?}"),
    }
    let after = NewEvent::new("room", "RoomClosed", "{}");
    store
        .enqueue(&mut tx, &after)
        .await
        .expect("transaction still usable");
    tx.commit().await.unwrap();
    assert_eq!(store.find(&after.event_id).await.unwrap().len(), 1);

    // Oversized: refused before the database is touched.
    let small = store.clone().with_max_payload_bytes(10);
    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(
        small
            .enqueue(&mut tx, &NewEvent::new("room", "Big", "x".repeat(11)))
            .await,
        Err(Error::PayloadTooLarge { .. })
    ));
}

/// The exact statement the README gives Go and PHP services.
#[tokio::test]
async fn readme_plain_insert_is_relayed_like_any_other_row() {
    let store = outbox().await;
    let readme_sql = include_str!("../../../../docs/plain-insert.postgres.sql")
        .replace("room_outbox", store.table().as_str());
    sqlx::query(&readme_sql)
        .bind("room")
        .bind("0192b7a4-8d7e-7cc1-b5e3-0a5b2c1d9e01")
        .bind("RoomCreated")
        .bind("room-42")
        .bind(1_i64)
        .bind(r#"{"room_id":42}"#)
        .bind(None::<String>)
        .execute(store.pool())
        .await
        .expect("plain insert");
    let rows = store
        .find("0192b7a4-8d7e-7cc1-b5e3-0a5b2c1d9e01")
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].status, postbox_core::Status::Pending);
    assert!(
        rows[0].created_at_ms > 1_700_000_000_000,
        "created_at_ms defaults to the database clock"
    );
}

/// Legacy `published` rows read as delivered and are never claimed.
#[tokio::test]
async fn legacy_published_rows_count_as_delivered() {
    let store = outbox().await;
    store
        .enqueue_batch(&[NewEvent::new("legacy", "Old", "{}")], 1024)
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {} SET status = 'published'",
        store.table()
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let s = store.stats(&["legacy".into()]).await.unwrap();
    assert_eq!((s[0].delivered, s[0].pending), (1, 0));
}

/// A time-range replay also brings archived rows back, keeping their ids.
#[tokio::test]
async fn time_range_replay_covers_archived_rows() {
    use postbox_core::store::{EventFilter, ReplaySelector};
    let store = outbox().await;
    let t = store.table().as_str().to_owned();
    sqlx::query(&format!(
        "INSERT INTO {t}_archive (id, app_code, event_id, event_type, payload, status, retry_count, created_at_ms, updated_at_ms) \
         VALUES (1000001, 'room', 'archived-1', 'RoomCreated', '{{}}', 'delivered', 0, 5000, 5000), \
                (1000002, 'room', 'archived-2', 'RoomCreated', '{{}}', 'delivered', 0, 9000, 9000)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let range = ReplaySelector::Filter(EventFilter {
        app_code: Some("room".into()),
        since_ms: Some(4000),
        until_ms: Some(6000),
        ..Default::default()
    });
    let dry = store.replay(&range, true, "test").await.unwrap();
    assert_eq!(
        dry.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(),
        ["archived-1"]
    );
    assert!(
        store.find("archived-1").await.unwrap().is_empty(),
        "dry run changes nothing"
    );

    let done = store.replay(&range, false, "test").await.unwrap();
    assert_eq!(done.len(), 1);
    let row = store.find("archived-1").await.unwrap().remove(0);
    assert_eq!(
        (row.id, row.status, row.replay_count),
        (1000001, postbox_core::Status::Pending, 1)
    );
    let left: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {t}_archive"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(left, 1, "only the replayed row left the archive");
}

/// Issue 9.3, checked on PostgreSQL too: while a producer's transaction
/// holds an uncommitted outbox row, the relay claims, marks, fails,
/// releases and takes over the rows committed after it on a small table
/// without waiting, and a relay delivers rows once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_producer_transaction_does_not_stall_the_relay() {
    postbox_testkit::conformance::an_open_producer_transaction_stalls_nothing(outbox().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_by_status_tells_archived_dropped_rows_from_delivered() {
    let store = outbox().await;
    let pool = store.pool().clone();
    postbox_testkit::conformance::a_replay_by_status_tells_archived_dropped_rows_from_delivered(
        Arc::new(store),
        pool,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_keeps_a_row_whose_id_the_archive_holds_for_another_event() {
    let store = outbox().await;
    let pool = store.pool().clone();
    postbox_testkit::conformance::archive_keeps_a_row_whose_id_the_archive_holds_for_another_event(
        Arc::new(store),
        pool,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_recreates_tables_dropped_by_hand() {
    let store = outbox().await;
    let pool = store.pool().clone();
    postbox_testkit::conformance::migrate_recreates_tables_dropped_by_hand(Arc::new(store), pool)
        .await;
}

/// `[archive] url` set after rows were archived beside the table: until
/// archive runs move them over, a time-range replay (and the paced
/// replay's batches) still finds them here. It read only the archive
/// database, and left them out without a word.
#[tokio::test]
async fn with_the_archive_elsewhere_a_replay_reads_rows_still_archived_here() {
    use postbox_core::store::{ArchiveRequest, EventFilter, ReplaySelector};
    use postbox_testkit::servers::ensure_database;
    let hot = outbox().await;
    let t = hot.table().as_str().to_owned();
    let store: &dyn OutboxStore = &hot;
    let e = one_delivered(store).await;
    let now = store.now_ms().await.unwrap();
    let archive = ArchiveRequest {
        app_codes: vec!["room".into()],
        before_ms: now + 60_000,
        batch_size: 10,
        max_batches: None,
        partitions: Default::default(),
    };
    assert_eq!(store.archive(&archive, &|_| {}).await.unwrap().moved, 1);

    let far_url = format!("{}_far", postgres_url());
    ensure_database("postgres", &far_url).await;
    let far = PgOutbox::connect(&far_url, &t, 2).await.unwrap();
    far.migrate().await.unwrap();
    let hot = PgOutbox::connect(&postgres_url(), &t, 4)
        .await
        .unwrap()
        .with_archive_elsewhere(Arc::new(far));
    let store: &dyn OutboxStore = &hot;
    let filter = EventFilter {
        app_code: Some("room".into()),
        since_ms: Some(now - 3_600_000),
        until_ms: Some(now + 60_000),
        ..Default::default()
    };
    assert_eq!(
        store.replay_ids_after(&filter, 0, 10).await.unwrap().len(),
        1
    );
    let range = ReplaySelector::Filter(filter);
    let dry = store.replay(&range, true, "test").await.unwrap();
    assert_eq!(dry.len(), 1, "the dry run: {dry:?}");
    let done = store.replay(&range, false, "test").await.unwrap();
    assert_eq!(done.len(), 1, "the replay: {done:?}");
    let rows = store.find(&e.event_id).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].status, postbox_core::Status::Pending);
}

/// A migrated table holding five `conf` events, a proxy to its server, and
/// the server's URL through the proxy.
async fn five_events_behind_a_proxy(
    prefix: &str,
) -> (PgOutbox, postbox_testkit::proxy::Proxy, String) {
    let table = scratch_table(prefix);
    let direct = migrated("postgres", postgres_url(), |url| {
        let table = table.clone();
        async move { PgOutbox::connect(&url, &table, 4).await }
    })
    .await;
    let events: Vec<NewEvent> = (0..5)
        .map(|i| NewEvent::new("conf", "T", format!("{{\"n\":{i}}}")))
        .collect();
    direct.enqueue_batch(&events, 1 << 20).await.unwrap();
    let (proxy, through) = postbox_testkit::proxy::to_postgres().await;
    (direct, proxy, through)
}

/// A fast relay with a lease of `secs` (publishing within a quarter).
fn leased_for(secs: u64) -> postbox_core::config::WorkerConfig {
    postbox_core::config::WorkerConfig {
        lease: postbox_core::config::HumanDuration::secs(secs),
        publish_timeout: postbox_core::config::HumanDuration::millis(secs * 250),
        ..postbox_testkit::conformance::fast_worker()
    }
}

/// A claim the database never answers (a failover whose old primary
/// vanished without a reset: no error, only no answer) is given up after
/// twice the lease, and the relay claims again on a new connection. It waited
/// for good, delivering nothing, while its heartbeat on another
/// connection said it was alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_database_never_answers_is_given_up_and_made_again() {
    let (direct, proxy, through) = five_events_behind_a_proxy("silentclaim").await;
    let table = direct.table().as_str().to_owned();
    // The first claims' statements go unanswered, each on a connection of
    // its own: three, one more than the relay's claim-and-mark pool holds.
    // (A connection handed back after its call gave up was held by sqlx's
    // unbounded ping until the kernel gave up on it: two such calls used
    // the pool up.)
    proxy.silence_on(b"SKIP LOCKED");
    let proxy = Arc::new(proxy);
    let rearm = tokio::spawn({
        let proxy = proxy.clone();
        async move {
            for armed in 1..3 {
                while proxy.silenced() < armed {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                proxy.silence_on(b"SKIP LOCKED");
            }
        }
    });
    let through = PgOutbox::connect(&through, &table, 4).await.unwrap();
    let config = leased_for(2);
    let publisher = Arc::new(postbox_testkit::RecordingPublisher::new("rec"));
    let started = std::time::Instant::now();
    postbox_testkit::conformance::run_relay_over_until(
        Arc::new(through),
        &direct,
        vec![publisher.clone()],
        config,
        "conf",
        |s| s.delivered == 5,
    )
    .await;
    assert_eq!(proxy.silenced(), 3);
    rearm.await.unwrap();
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(10),
        "three claims were silenced: {:?}",
        started.elapsed()
    );
}

/// A relay over `direct`'s table through `through` (a proxy's URL), at
/// the default 30 s lease, publishing to a recorder: the recorder, the
/// relay's stop token and its task.
async fn relay_at_default_lease(
    direct: &PgOutbox,
    through: &str,
) -> (
    Arc<postbox_testkit::RecordingPublisher>,
    postbox_core::relay::CancellationToken,
    tokio::task::JoinHandle<postbox_core::Result<postbox_core::relay::RelayReport>>,
) {
    let through = PgOutbox::connect(through, direct.table().as_str(), 4)
        .await
        .unwrap();
    let settings =
        postbox_core::config::RelaySettings::new(leased_for(30), vec!["conf".into()]).unwrap();
    let publisher = Arc::new(postbox_testkit::RecordingPublisher::new("rec"));
    let relay =
        postbox_core::relay::Relay::new(Arc::new(through), vec![publisher.clone()], settings);
    let shutdown = postbox_core::relay::CancellationToken::new();
    let run = tokio::spawn(relay.run(shutdown.clone()));
    (publisher, shutdown, run)
}

/// A relay asked to stop while its database has gone silent (every
/// connection, the LISTEN one too) stops within seconds, whatever its
/// lease. The LISTEN connection's close waited for an answer to its
/// UNLISTEN for good, and the relay with it; then the idle probe and the
/// last heartbeat in flight held the stop for the pool's connect timeout
/// each (20 s in all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stops_while_its_database_is_silent() {
    let (direct, proxy, through) = five_events_behind_a_proxy("silentstop").await;
    let (publisher, shutdown, run) = relay_at_default_lease(&direct, &through).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while publisher.delivered().len() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "delivered before the silence"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    proxy.silence();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    shutdown.cancel();
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(10), run).await;
    assert!(stopped.is_ok(), "the relay did not stop within 10 s");
}

/// A relay asked to stop while its claim waits on a connection gone
/// silent (the rest of the database answering) stops within seconds: the
/// claim's own bound is twice the lease, a minute by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stops_while_its_claim_waits_on_a_silent_connection() {
    let (direct, proxy, through) = five_events_behind_a_proxy("silentclaimstop").await;
    proxy.silence_on(b"SKIP LOCKED");
    let (publisher, shutdown, run) = relay_at_default_lease(&direct, &through).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while proxy.silenced() == 0 {
        assert!(std::time::Instant::now() < deadline, "the relay claims");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    shutdown.cancel();
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(15), run).await;
    assert!(stopped.is_ok(), "the relay did not stop within 15 s");
    assert!(publisher.delivered().is_empty());
}

/// `[archive] url`'s database goes silent while an archive run copies a
/// batch into it: the run gives up after its bound, its transaction on the
/// outbox rolls back, and the batch's rows stay, unlocked (a replay takes
/// them at once). The run held them locked for good (on SQLite, the write
/// lock every producer waits for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_database_gone_silent_is_given_up_and_its_batch_stays() {
    use postbox_core::store::{ArchiveRequest, ReplaySelector};
    use postbox_testkit::servers::ensure_database;
    let direct = outbox().await;
    let t = direct.table().as_str().to_owned();
    let e = one_delivered(&direct).await;

    let far_url = format!("{}_far", postgres_url());
    ensure_database("postgres", &far_url).await;
    let (proxy, through) = postbox_testkit::proxy::to_postgres_at(&far_url).await;
    let far = PgOutbox::connect(&through, &t, 2).await.unwrap();
    far.migrate().await.unwrap();
    proxy.silence_on(format!("INSERT INTO {t}_archive").as_bytes());
    let hot = PgOutbox::connect(&postgres_url(), &t, 4)
        .await
        .unwrap()
        .with_archive_elsewhere(Arc::new(far));
    let now = hot.now_ms().await.unwrap();
    let archive = ArchiveRequest {
        app_codes: vec!["room".into()],
        before_ms: now + 60_000,
        batch_size: 10,
        max_batches: None,
        partitions: Default::default(),
    };
    let run = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        hot.archive(&archive, &|_| {}),
    )
    .await
    .expect("the run gives up");
    let error = run.unwrap_err().to_string();
    assert!(error.contains("no answer"), "{error}");
    assert_eq!(proxy.silenced(), 1);
    let replay = ReplaySelector::EventIds {
        app_code: Some("room".into()),
        event_ids: vec![e.event_id.clone()],
    };
    let replayed = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        direct.replay(&replay, false, "test"),
    )
    .await
    .expect("the row is not held")
    .unwrap();
    assert_eq!(replayed.len(), 1, "the batch stays in the outbox");
}

/// One `room` event enqueued, claimed and marked delivered in `store`.
async fn one_delivered(store: &dyn OutboxStore) -> NewEvent {
    use postbox_core::store::ClaimRequest;
    let e = NewEvent::new("room", "T", "{}");
    store
        .enqueue_batch(std::slice::from_ref(&e), 1024)
        .await
        .unwrap();
    let req = ClaimRequest {
        app_code: "room",
        limit: 10,
        worker_id: "w",
        lease_ms: 60_000,
        ordered: false,
        skip_types: &[],
    };
    let claimed = store
        .claim(postbox_core::ClaimSource::Pending, &req)
        .await
        .unwrap();
    store
        .mark_delivered(&claimed[0].fence(), &[claimed[0].record.id])
        .await
        .unwrap();
    e
}
