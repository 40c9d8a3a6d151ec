//! The SQLite backend against a real database file.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use postbox_core::store::{
    ClaimRequest, EnqueueOutcome, EventFilter, FailureUpdate, ReplaySelector, ReplayStore,
};
use postbox_core::time::now_ms;
use postbox_core::{ClaimSource, ClaimedEvent, Error, NewEvent, Status};
use postbox_sqlite::SqliteOutbox;

const TABLE: &str = "room_outbox";

/// A scratch database file, removed (with its WAL files) on drop.
struct Scratch {
    path: PathBuf,
    outbox: SqliteOutbox,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

async fn scratch(name: &str) -> Scratch {
    let path = std::env::temp_dir().join(format!(
        "postbox-sqlite-{name}-{}-{}-{}.db",
        std::process::id(),
        now_ms(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let url = format!("sqlite://{}", path.display());
    let outbox = SqliteOutbox::connect(&url, TABLE, 4)
        .await
        .expect("connect");
    let report = outbox.migrate().await.expect("migrate");
    assert_eq!(report.applied, vec![1, 2, 3, 5, 6, 7, 8, 9, 10, 11]);
    Scratch { path, outbox }
}

fn ev(event_type: &str) -> NewEvent {
    NewEvent::new("room", event_type, r#"{"room_id":42}"#)
}

async fn enqueue_all(o: &SqliteOutbox, events: &[NewEvent]) -> Vec<i64> {
    o.enqueue_batch(events, 1024 * 1024)
        .await
        .expect("enqueue batch")
        .into_iter()
        .map(|r| match r {
            EnqueueOutcome::Inserted(id) => id,
            EnqueueOutcome::Duplicate => panic!("unexpected duplicate"),
        })
        .collect()
}

fn req<'a>(worker_id: &'a str, lease_ms: i64) -> ClaimRequest<'a> {
    ClaimRequest {
        app_code: "room",
        limit: 10,
        worker_id,
        lease_ms,
        ordered: false,
        skip_types: &[],
    }
}

async fn claim(
    o: &SqliteOutbox,
    source: ClaimSource,
    worker: &str,
    lease_ms: i64,
) -> Vec<ClaimedEvent> {
    o.claim(source, &req(worker, lease_ms))
        .await
        .expect("claim")
}

async fn one(o: &SqliteOutbox, event_id: &str) -> postbox_core::EventRecord {
    let mut rows = o.find(event_id).await.expect("find");
    assert_eq!(rows.len(), 1, "{event_id}");
    rows.remove(0)
}

/// Runs `sql` with `id` bound to `?1`.
async fn exec(o: &SqliteOutbox, sql: &str, id: i64) {
    sqlx::query(sql)
        .bind(id)
        .execute(o.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

fn ids(claimed: &[ClaimedEvent]) -> Vec<i64> {
    claimed.iter().map(|c| c.record.id).collect()
}

fn failure(status: Status, retry_count: i32, retry_after_ms: i64) -> FailureUpdate {
    FailureUpdate {
        status,
        retry_count,
        retry_after_ms,
        retry_jitter_ms: 0,
        delivered_to: vec!["file".into()],
        error: "broker down".into(),
        publisher: Some("p".into()),
    }
}

#[tokio::test]
async fn migrate_is_idempotent() {
    let s = scratch("migrate").await;
    let again = s.outbox.migrate().await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(again.version, 11);
    // A second table in the same database gets its own versions.
    let other = SqliteOutbox::new(s.outbox.pool().clone(), "wallet_outbox").unwrap();
    assert_eq!(
        other.migrate().await.unwrap().applied,
        vec![1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    );
    assert_eq!(other.migrate().await.unwrap().version, 11);
    assert_eq!(s.outbox.backend(), "sqlite");
}

/// A row the claim takes but cannot read (SQLite keeps what a producer
/// gives it: a payload bound as bytes is a BLOB, not TEXT) is failed with
/// the reason, and the events behind it are claimed. The whole claim
/// failed on it before: it came back first every time, and nothing of
/// the tenant was delivered again.
#[tokio::test]
async fn a_row_the_claim_cannot_read_is_failed_and_the_rest_go_on() {
    let s = scratch("unreadable").await;
    sqlx::query(&format!(
        "INSERT INTO {TABLE} (app_code, event_id, event_type, payload) VALUES ('room', 'go-1', 'T', X'7b7d')"
    ))
    .execute(s.outbox.pool())
    .await
    .unwrap();
    let good = enqueue_all(&s.outbox, &[ev("T")]).await;
    let got = claim(&s.outbox, ClaimSource::Pending, "w", 30_000).await;
    assert_eq!(ids(&got), good, "the readable row");
    let (status, error): (String, String) = sqlx::query_as(&format!(
        "SELECT status, last_error FROM {TABLE} WHERE event_id = 'go-1'"
    ))
    .fetch_one(s.outbox.pool())
    .await
    .unwrap();
    assert_eq!(status, "failed");
    assert!(
        error.contains("unreadable row") && error.contains("payload"),
        "{error}"
    );
    assert!(claim(&s.outbox, ClaimSource::Pending, "w", 30_000)
        .await
        .is_empty());
}

#[tokio::test]
async fn enqueue_commits_and_rolls_back_with_the_caller() {
    let s = scratch("enqueue-tx").await;
    let pool = s.outbox.pool();

    let kept = ev("RoomCreated")
        .aggregate("room-42", 1)
        .header("trace", "t1");
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let id = s.outbox.enqueue(&mut tx, &kept).await.unwrap();
    assert!(id > 0);
    tx.commit().await.unwrap();
    let row = one(&s.outbox, &kept.event_id).await;
    assert_eq!(row.id, id);
    assert_eq!(row.status, Status::Pending);
    assert_eq!(row.aggregate_id.as_deref(), Some("room-42"));
    assert_eq!(row.aggregate_version, Some(1));
    assert_eq!(row.headers_map()["trace"], "t1");
    assert_eq!((row.retry_count, row.replay_count), (0, 0));
    assert!((row.created_at_ms - now_ms()).abs() < 60_000);

    let dropped = ev("RoomCreated");
    let mut tx = pool.begin().await.unwrap();
    s.outbox.enqueue(&mut tx, &dropped).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(s.outbox.find(&dropped.event_id).await.unwrap().is_empty());

    let big = NewEvent::new("room", "Big", "x".repeat(11));
    let small = s.outbox.clone().with_max_payload_bytes(10);
    let mut conn = pool.acquire().await.unwrap();
    assert!(matches!(
        small.enqueue(&mut conn, &big).await,
        Err(Error::PayloadTooLarge {
            size: 11,
            limit: 10,
            ..
        })
    ));
}

#[tokio::test]
async fn duplicate_leaves_the_transaction_usable() {
    let s = scratch("duplicate").await;
    let first = ev("RoomCreated");
    let second = ev("RoomRenamed");
    let mut tx = s.outbox.pool().begin().await.unwrap();
    s.outbox.enqueue(&mut tx, &first).await.unwrap();
    match s.outbox.enqueue(&mut tx, &first).await {
        Err(Error::DuplicateEvent { app_code, event_id }) => {
            assert_eq!(
                (app_code.as_str(), event_id.as_str()),
                ("room", first.event_id.as_str())
            );
        }
        other => panic!("expected DuplicateEvent, got {other:?}"),
    }
    s.outbox.enqueue(&mut tx, &second).await.unwrap();
    tx.commit().await.unwrap();
    one(&s.outbox, &first.event_id).await;
    one(&s.outbox, &second.event_id).await;

    // The same event id in another app_code is a different event.
    let other_app = NewEvent::new("wallet", "X", "{}").event_id(first.event_id.clone());
    let third = ev("RoomClosed");
    let out = s
        .outbox
        .enqueue_batch(&[first.clone(), other_app, third], 1024)
        .await
        .unwrap();
    assert_eq!(out[0], EnqueueOutcome::Duplicate);
    assert!(matches!(out[1], EnqueueOutcome::Inserted(_)));
    assert!(matches!(out[2], EnqueueOutcome::Inserted(_)));
    assert_eq!(s.outbox.find(&first.event_id).await.unwrap().len(), 2);
}

/// Creates: one delivered, one failed, one delivering, one pending row.
async fn mixed(o: &SqliteOutbox) -> ([NewEvent; 4], Vec<i64>) {
    let events = [
        ev("Delivered"),
        ev("Failed"),
        ev("Delivering"),
        ev("Pending"),
    ];
    let ids_ = enqueue_all(o, &events[..3]).await;
    let c = claim(o, ClaimSource::Pending, "worker-a", 30_000).await;
    let f = c[0].fence();
    assert_eq!(o.mark_delivered(&f, &ids_[..1]).await.unwrap(), 1);
    assert_eq!(
        o.mark_failed(&f, &[ids_[1]], &failure(Status::Failed, 3, 0))
            .await
            .unwrap(),
        1
    );
    let mut all = ids_;
    all.extend(enqueue_all(o, &events[3..]).await);
    (events, all)
}

#[tokio::test]
async fn replay_by_ids() {
    let s = scratch("replay-ids").await;
    let o = &s.outbox;
    let (events, ids_) = mixed(o).await;
    let wanted: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
    let sel = ReplaySelector::EventIds {
        app_code: None,
        event_ids: wanted.clone(),
    };

    // Dry run: reports, changes nothing. The delivering row is left alone.
    let dry = o.replay(&sel, true, "test").await.unwrap();
    assert_eq!(
        dry.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids_[0], ids_[1], ids_[3]]
    );
    assert_eq!(one(o, &events[0].event_id).await.status, Status::Delivered);
    assert_eq!(one(o, &events[1].event_id).await.status, Status::Failed);

    // Scoped to another app_code: nothing.
    let other = ReplaySelector::EventIds {
        app_code: Some("wallet".into()),
        event_ids: wanted,
    };
    assert!(o.replay(&other, false, "test").await.unwrap().is_empty());

    let done = o.replay(&sel, false, "test").await.unwrap();
    assert_eq!(done.len(), 3);
    for r in &done {
        assert_eq!(r.status, Status::Pending);
        assert_eq!((r.retry_count, r.replay_count), (0, 1));
        // A failed row keeps the publishers that confirmed it (only the
        // others get it again); a delivered row goes to every publisher.
        if r.id == ids_[1] {
            assert_eq!(r.delivered_to, ["file"]);
        } else {
            assert!(r.delivered_to.is_empty());
        }
    }
    let failed = one(o, &events[1].event_id).await;
    assert_eq!(
        (failed.status, failed.retry_count, failed.replay_count),
        (Status::Pending, 0, 1)
    );
    assert_eq!(failed.event_id, events[1].event_id, "keeps the event id");
    assert_eq!(one(o, &events[2].event_id).await.status, Status::Delivering);
}

#[tokio::test]
async fn replay_by_filter_and_time_range_with_archive() {
    let s = scratch("replay-filter").await;
    let o = &s.outbox;
    let (events, ids_) = mixed(o).await;

    let failed_only = ReplaySelector::Filter(EventFilter {
        status: Some(Status::Failed),
        ..Default::default()
    });
    let dry = o.replay(&failed_only, true, "test").await.unwrap();
    assert_eq!(dry.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids_[1]]);
    assert_eq!(one(o, &events[1].event_id).await.status, Status::Failed);
    let done = o.replay(&failed_only, false, "test").await.unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(one(o, &events[1].event_id).await.status, Status::Pending);

    // Archive the delivered row the way `postbox archive` does.
    exec(
        o,
        "INSERT INTO room_outbox_archive SELECT * FROM room_outbox WHERE id = ?1",
        ids_[0],
    )
    .await;
    exec(o, "DELETE FROM room_outbox WHERE id = ?1", ids_[0]).await;
    assert!(o.find(&events[0].event_id).await.unwrap().is_empty());

    let range = ReplaySelector::Filter(EventFilter {
        since_ms: Some(0),
        until_ms: Some(now_ms() + 60_000),
        event_type: Some("Delivered".into()),
        ..Default::default()
    });
    let dry = o.replay(&range, true, "test").await.unwrap();
    assert_eq!(dry.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids_[0]]);
    assert!(
        o.find(&events[0].event_id).await.unwrap().is_empty(),
        "dry run moved a row"
    );

    let back = o.replay(&range, false, "test").await.unwrap();
    assert_eq!(back.len(), 1);
    let row = one(o, &events[0].event_id).await;
    assert_eq!(row.id, ids_[0], "keeps the id");
    assert_eq!(
        (row.status, row.retry_count, row.replay_count),
        (Status::Pending, 0, 1)
    );
    let archived: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM room_outbox_archive")
        .fetch_one(o.pool())
        .await
        .unwrap();
    assert_eq!(archived, 0);
    // New ids continue after the restored one.
    let next = enqueue_all(o, &[ev("Later")]).await;
    assert!(next[0] > *ids_.iter().max().unwrap());

    // A range that matches nothing.
    let empty = ReplaySelector::Filter(EventFilter {
        since_ms: Some(0),
        until_ms: Some(1),
        ..Default::default()
    });
    assert!(o.replay(&empty, false, "test").await.unwrap().is_empty());
}

/// What only raw SQL sets up (the counts themselves are conformance cases):
/// a legacy `published` row counts as delivered, and the oldest pending
/// row's age is in seconds.
#[tokio::test]
async fn stats_count_legacy_rows_and_the_oldest_pending_age() {
    let s = scratch("stats").await;
    let o = &s.outbox;
    let pending = enqueue_all(o, &[ev("P")]).await[0];
    sqlx::query(
        "INSERT INTO room_outbox (app_code, event_id, event_type, payload, status) \
         VALUES ('room', 'legacy-1', 'Old', '{}', 'published')",
    )
    .execute(o.pool())
    .await
    .unwrap();
    // Make the pending row look a minute old.
    exec(
        o,
        "UPDATE room_outbox SET created_at_ms = created_at_ms - 60000 WHERE id = ?1",
        pending,
    )
    .await;

    let room = o.stats(&["room".to_owned()]).await.unwrap().remove(0);
    assert_eq!((room.pending, room.delivered), (1, 1));
    assert!(
        (59.0..120.0).contains(&room.oldest_pending_age_seconds),
        "{}",
        room.oldest_pending_age_seconds
    );
    assert_eq!(one(o, "legacy-1").await.status, Status::Delivered);
}

#[tokio::test]
async fn plain_insert_uses_the_defaults() {
    let s = scratch("plain-insert").await;
    let o = &s.outbox;
    let before = now_ms();
    sqlx::query(
        "INSERT INTO room_outbox (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers) \
         VALUES ('room', 'from-php-1', 'RoomCreated', 'room-7', 3, '{\"room_id\":7}', NULL)",
    )
    .execute(o.pool())
    .await
    .unwrap();
    let after = now_ms();
    let row = one(o, "from-php-1").await;
    assert_eq!(row.status, Status::Pending);
    assert_eq!((row.retry_count, row.replay_count), (0, 0));
    assert_eq!((row.next_retry_at_ms, row.lock_until_ms), (0, 0));
    assert!(
        row.created_at_ms >= before && row.created_at_ms <= after,
        "{} not in [{before}, {after}]",
        row.created_at_ms
    );
    assert_eq!(row.created_at_ms, row.updated_at_ms);
    let db_now = o.now_ms().await.unwrap();
    assert!((db_now - now_ms()).abs() < 1_000);
    // And the relay picks it up.
    assert_eq!(
        ids(&claim(o, ClaimSource::Pending, "w", 1000).await),
        vec![row.id]
    );
}

#[tokio::test]
async fn connects_to_memory_and_plain_paths() {
    let m = SqliteOutbox::connect("sqlite::memory:", TABLE, 8)
        .await
        .unwrap();
    m.migrate().await.unwrap();
    let e = ev("A");
    let mut tx = m.pool().begin().await.unwrap();
    m.enqueue(&mut tx, &e).await.unwrap();
    tx.commit().await.unwrap();
    // Every connection sees the same in-memory database.
    assert_eq!(m.find(&e.event_id).await.unwrap().len(), 1);
    assert_eq!(m.pool().options().get_max_connections(), 1);

    let path = std::env::temp_dir().join(format!(
        "postbox-sqlite-plain-{}-{}.db",
        std::process::id(),
        now_ms()
    ));
    let p = SqliteOutbox::connect(&format!("sqlite:{}", path.display()), TABLE, 2)
        .await
        .unwrap();
    assert_eq!(
        p.migrate().await.unwrap().applied,
        vec![1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    );
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(p.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    p.pool().close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }

    assert!(matches!(
        SqliteOutbox::connect("sqlite::memory:", "bad-name", 1).await,
        Err(Error::InvalidTableName(_))
    ));
}

#[tokio::test]
async fn a_failed_claim_rolls_back_its_transaction() {
    // One connection: a transaction left open would break the next call.
    let o = SqliteOutbox::connect("sqlite::memory:", TABLE, 1)
        .await
        .unwrap();
    let err = o
        .claim(ClaimSource::Pending, &req("w", 1000))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("claim"), "{err}");
    assert_eq!(
        o.migrate().await.unwrap().applied,
        vec![1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    );
    enqueue_all(&o, &[ev("A")]).await;
    assert_eq!(claim(&o, ClaimSource::Pending, "w", 1000).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_by_status_tells_archived_dropped_rows_from_delivered() {
    let s = scratch("dropstatus").await;
    let pool = s.outbox.pool().clone();
    let store = SqliteOutbox::new(pool.clone(), TABLE).unwrap();
    postbox_testkit::conformance::a_replay_by_status_tells_archived_dropped_rows_from_delivered(
        std::sync::Arc::new(store),
        pool,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_keeps_a_row_whose_id_the_archive_holds_for_another_event() {
    let s = scratch("idreuse").await;
    let pool = s.outbox.pool().clone();
    let store = SqliteOutbox::new(pool.clone(), TABLE).unwrap();
    postbox_testkit::conformance::archive_keeps_a_row_whose_id_the_archive_holds_for_another_event(
        std::sync::Arc::new(store),
        pool,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_recreates_tables_dropped_by_hand() {
    let s = scratch("redrop").await;
    let pool = s.outbox.pool().clone();
    let store = SqliteOutbox::new(pool.clone(), TABLE).unwrap();
    postbox_testkit::conformance::migrate_recreates_tables_dropped_by_hand(
        std::sync::Arc::new(store),
        pool,
    )
    .await;
}

/// An archive run holds no pooled connection between its batches: each
/// batch is one `BEGIN IMMEDIATE` transaction on a connection of its own, so
/// the relay sharing a small pool (the scheduled archiver runs inside
/// `postbox relay`) is never starved for the whole run. Regression: the
/// one-engine archive first held one connection from the first batch to
/// the last, so here the clock read waited for the whole archive.
#[tokio::test]
async fn archive_leaves_the_pool_free_between_batches() {
    use postbox_core::store::ArchiveRequest;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    let s = scratch("archive-pool").await;
    let events: Vec<NewEvent> = (0..300).map(|i| ev(&format!("E{i}"))).collect();
    enqueue_all(&s.outbox, &events).await;
    sqlx::query("UPDATE room_outbox SET status = 'delivered', updated_at_ms = 0")
        .execute(s.outbox.pool())
        .await
        .unwrap();

    // One connection, shared by the archiver and everything else.
    let url = format!("sqlite://{}", s.path.display());
    let one = SqliteOutbox::connect(&url, TABLE, 1)
        .await
        .expect("connect");
    let archiving = Arc::new(AtomicBool::new(true));
    let first_batch = Arc::new(tokio::sync::Notify::new());
    let archive = {
        let one = one.clone();
        let archiving = archiving.clone();
        let first_batch = first_batch.clone();
        async move {
            let request = ArchiveRequest {
                app_codes: vec!["room".into()],
                before_ms: now_ms(),
                batch_size: 1,
                max_batches: None,
                partitions: Default::default(),
            };
            let report = one
                .archive(&request, &|_| first_batch.notify_one())
                .await
                .expect("archive");
            archiving.store(false, Ordering::SeqCst);
            report
        }
    };
    // Asks for the connection once the archive is under way, with 299
    // batches to go.
    let clock = async {
        first_batch.notified().await;
        one.now_ms().await.expect("read the clock");
        archiving.load(Ordering::SeqCst)
    };
    let (report, read_while_archiving) = tokio::join!(archive, clock);
    assert_eq!(report.moved, 300);
    assert!(
        read_while_archiving,
        "the clock read had to wait for the whole archive run"
    );
}
