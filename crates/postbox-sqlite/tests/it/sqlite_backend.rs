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

#[tokio::test]
async fn claim_pending_and_mark_delivered_with_fence() {
    let s = scratch("claim").await;
    let o = &s.outbox;
    let events: Vec<NewEvent> = (0..3).map(|i| ev(&format!("E{i}"))).collect();
    let inserted = enqueue_all(o, &events).await;
    // Another tenant is never claimed for "room".
    enqueue_all(o, &[NewEvent::new("wallet", "W", "{}")]).await;

    let before = now_ms();
    let claimed = o
        .claim(
            ClaimSource::Pending,
            &ClaimRequest {
                limit: 2,
                ..req("worker-a", 30_000)
            },
        )
        .await
        .unwrap();
    let after = now_ms();
    assert_eq!(
        ids(&claimed),
        inserted[..2].to_vec(),
        "oldest first, at most limit"
    );
    let fence = claimed[0].fence();
    assert_eq!(fence.worker_id, "worker-a");
    assert!(fence.lock_until_ms >= before + 30_000 && fence.lock_until_ms <= after + 30_000);
    for c in &claimed {
        assert_eq!(c.source, ClaimSource::Pending);
        assert_eq!(c.record.status, Status::Delivering);
        assert_eq!(c.fence(), fence, "one fence per claim");
    }
    // Nothing pending is claimed twice; live leases are not expired.
    let rest = claim(o, ClaimSource::Pending, "worker-b", 30_000).await;
    assert_eq!(ids(&rest), vec![inserted[2]]);
    assert!(claim(o, ClaimSource::Pending, "worker-b", 30_000)
        .await
        .is_empty());
    assert!(claim(o, ClaimSource::ExpiredLease, "worker-b", 30_000)
        .await
        .is_empty());

    // Wrong fences write nothing.
    let [wrong_worker, wrong_lease] = postbox_testkit::conformance::wrong_fences(&fence);
    assert_eq!(
        o.mark_delivered(&wrong_worker, &ids(&claimed))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        o.mark_delivered(&wrong_lease, &ids(&claimed))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        o.mark_failed(
            &wrong_worker,
            &[inserted[0]],
            &failure(Status::Retryable, 1, 0)
        )
        .await
        .unwrap(),
        0
    );
    assert_eq!(o.release(&wrong_lease, &ids(&claimed)).await.unwrap(), 0);
    assert_eq!(o.mark_delivered(&fence, &[]).await.unwrap(), 0);

    // The right fence marks them; a second time is a no-op.
    assert_eq!(o.mark_delivered(&fence, &ids(&claimed)).await.unwrap(), 2);
    assert_eq!(o.mark_delivered(&fence, &ids(&claimed)).await.unwrap(), 0);
    let row = one(o, &events[0].event_id).await;
    assert_eq!(row.status, Status::Delivered);
    assert_eq!(row.lock_until_ms, 0);
    assert_eq!(one(o, &events[2].event_id).await.status, Status::Delivering);
}

#[tokio::test]
async fn mark_failed_schedules_a_retry_and_due_retries_are_claimed() {
    let s = scratch("failed").await;
    let o = &s.outbox;
    let events = [ev("A"), ev("B")];
    let inserted = enqueue_all(o, &events).await;
    let claimed = claim(o, ClaimSource::Pending, "worker-a", 30_000).await;
    let fence = claimed[0].fence();

    let before = now_ms();
    assert_eq!(
        o.mark_failed(
            &fence,
            &[inserted[0]],
            &failure(Status::Retryable, 1, 5_000)
        )
        .await
        .unwrap(),
        1
    );
    let after = now_ms();
    assert_eq!(
        o.mark_failed(&fence, &[inserted[1]], &failure(Status::Retryable, 1, -1))
            .await
            .unwrap(),
        1
    );
    // The fence is gone once the row left `delivering`.
    assert_eq!(
        o.mark_failed(&fence, &[inserted[0]], &failure(Status::Failed, 2, 0))
            .await
            .unwrap(),
        0
    );

    let row = one(o, &events[0].event_id).await;
    assert_eq!(row.status, Status::Retryable);
    assert_eq!(row.retry_count, 1);
    assert!(
        row.next_retry_at_ms >= before + 5_000 && row.next_retry_at_ms <= after + 5_000,
        "{} not in [{}, {}]",
        row.next_retry_at_ms,
        before + 5_000,
        after + 5_000
    );
    assert_eq!(row.lock_until_ms, 0);
    assert_eq!(row.delivered_to, vec!["file".to_owned()]);
    assert_eq!(row.last_error.as_deref(), Some("broker down"));

    // Only the due one comes back, keeping its progress.
    let due = claim(o, ClaimSource::DueRetry, "worker-b", 30_000).await;
    assert_eq!(ids(&due), vec![inserted[1]]);
    assert_eq!(due[0].source, ClaimSource::DueRetry);
    assert_eq!(due[0].record.retry_count, 1);
    assert_eq!(due[0].record.delivered_to, vec!["file".to_owned()]);
    assert!(claim(o, ClaimSource::DueRetry, "worker-b", 30_000)
        .await
        .is_empty());

    // Dead letter.
    let f = due[0].fence();
    assert_eq!(
        o.mark_failed(&f, &[inserted[1]], &failure(Status::Failed, 2, 0))
            .await
            .unwrap(),
        1
    );
    let dead = one(o, &events[1].event_id).await;
    assert_eq!((dead.status, dead.retry_count), (Status::Failed, 2));
    assert!(claim(o, ClaimSource::DueRetry, "worker-b", 30_000)
        .await
        .is_empty());
    assert!(claim(o, ClaimSource::Pending, "worker-b", 30_000)
        .await
        .is_empty());
}

#[tokio::test]
async fn expired_lease_is_taken_over_and_counted() {
    let s = scratch("lease").await;
    let o = &s.outbox;
    let e = ev("A");
    let inserted = enqueue_all(o, std::slice::from_ref(&e)).await;
    // A negative lease is already over.
    let first = claim(o, ClaimSource::Pending, "worker-a", -1_000).await;
    let old = first[0].fence();

    let taken = claim(o, ClaimSource::ExpiredLease, "worker-b", 30_000).await;
    assert_eq!(ids(&taken), inserted);
    let r = &taken[0].record;
    assert_eq!(taken[0].source, ClaimSource::ExpiredLease);
    assert_eq!(r.status, Status::Delivering);
    assert_eq!(r.retry_count, 1);
    assert_eq!(r.worker_id.as_deref(), Some("worker-b"));
    assert_eq!(
        r.last_error.as_deref(),
        Some("lease expired while held by worker-a")
    );
    assert!(r.lock_until_ms > now_ms());

    // The late result of worker-a is dropped; worker-b's lands.
    assert_eq!(o.mark_delivered(&old, &inserted).await.unwrap(), 0);
    assert_eq!(
        o.mark_delivered(&taken[0].fence(), &inserted)
            .await
            .unwrap(),
        1
    );
    assert!(claim(o, ClaimSource::ExpiredLease, "worker-c", 30_000)
        .await
        .is_empty());
}

#[tokio::test]
async fn release_gives_rows_back_without_an_attempt() {
    let s = scratch("release").await;
    let o = &s.outbox;
    let events = [ev("A"), ev("B")];
    let inserted = enqueue_all(o, &events).await;
    // B has failed once before, so it goes back as retryable (due at once).
    let c = claim(o, ClaimSource::Pending, "worker-a", -1).await;
    let c2 = claim(o, ClaimSource::ExpiredLease, "worker-a", 30_000).await;
    assert_eq!(ids(&c).len(), 2);
    // Both now have retry_count 1; reset A by hand to 0 to see both branches.
    sqlx::query("UPDATE room_outbox SET retry_count = 0 WHERE id = ?1")
        .bind(inserted[0])
        .execute(o.pool())
        .await
        .unwrap();
    let fence = c2[0].fence();
    assert_eq!(o.release(&fence, &[]).await.unwrap(), 0);
    assert_eq!(o.release(&fence, &inserted).await.unwrap(), 2);
    assert_eq!(o.release(&fence, &inserted).await.unwrap(), 0);
    let a = one(o, &events[0].event_id).await;
    let b = one(o, &events[1].event_id).await;
    assert_eq!((a.status, a.retry_count), (Status::Pending, 0));
    assert_eq!((b.status, b.retry_count), (Status::Retryable, 1));
    for r in [&a, &b] {
        assert_eq!((r.next_retry_at_ms, r.lock_until_ms), (0, 0));
        assert_eq!(r.worker_id, None);
    }
    assert_eq!(
        ids(&claim(o, ClaimSource::Pending, "w", 1000).await),
        vec![inserted[0]]
    );
    assert_eq!(
        ids(&claim(o, ClaimSource::DueRetry, "w", 1000).await),
        vec![inserted[1]]
    );
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
    sqlx::query("INSERT INTO room_outbox_archive SELECT * FROM room_outbox WHERE id = ?1")
        .bind(ids_[0])
        .execute(o.pool())
        .await
        .unwrap();
    sqlx::query("DELETE FROM room_outbox WHERE id = ?1")
        .bind(ids_[0])
        .execute(o.pool())
        .await
        .unwrap();
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

#[tokio::test]
async fn stats_count_by_status() {
    let s = scratch("stats").await;
    let o = &s.outbox;
    let (_events, ids_) = mixed(o).await;
    // One due retryable row.
    let e = ev("R");
    let rid = enqueue_all(o, std::slice::from_ref(&e)).await[0];
    let c = claim(o, ClaimSource::Pending, "w", 30_000).await;
    assert_eq!(ids(&c), vec![ids_[3], rid]);
    assert_eq!(
        o.mark_failed(&c[0].fence(), &[rid], &failure(Status::Retryable, 1, -10))
            .await
            .unwrap(),
        1
    );
    assert_eq!(o.release(&c[0].fence(), &ids_[3..]).await.unwrap(), 1);
    // A legacy row counts as delivered.
    sqlx::query(
        "INSERT INTO room_outbox (app_code, event_id, event_type, payload, status) \
         VALUES ('room', 'legacy-1', 'Old', '{}', 'published')",
    )
    .execute(o.pool())
    .await
    .unwrap();
    // Make the pending row look a minute old.
    sqlx::query("UPDATE room_outbox SET created_at_ms = created_at_ms - 60000 WHERE id = ?1")
        .bind(ids_[3])
        .execute(o.pool())
        .await
        .unwrap();

    let stats = o
        .stats(&["room".to_owned(), "nobody".to_owned()])
        .await
        .unwrap();
    let room = &stats[0];
    assert_eq!(room.app_code, "room");
    assert_eq!(
        (
            room.pending,
            room.delivering,
            room.delivered,
            room.retryable,
            room.failed
        ),
        (1, 1, 2, 1, 1)
    );
    assert_eq!(room.retryable_due, 1);
    assert!(
        (59.0..120.0).contains(&room.oldest_pending_age_seconds),
        "{}",
        room.oldest_pending_age_seconds
    );
    let nobody = &stats[1];
    assert_eq!(
        (nobody.pending, nobody.oldest_pending_age_seconds),
        (0, 0.0)
    );
    assert_eq!(one(o, "legacy-1").await.status, Status::Delivered);
}

#[tokio::test]
async fn list_filters_newest_first() {
    let s = scratch("list").await;
    let o = &s.outbox;
    let (_events, ids_) = mixed(o).await;
    enqueue_all(o, &[NewEvent::new("wallet", "Pending", "{}")]).await;

    let all = o
        .list(&EventFilter {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 5);
    assert!(all.windows(2).all(|w| w[0].id > w[1].id), "newest first");

    let room = EventFilter {
        app_code: Some("room".into()),
        limit: 100,
        ..Default::default()
    };
    assert_eq!(o.list(&room).await.unwrap().len(), 4);
    let failed = o
        .list(&EventFilter {
            status: Some(Status::Failed),
            ..room.clone()
        })
        .await
        .unwrap();
    assert_eq!(
        failed.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids_[1]]
    );
    let typed = o
        .list(&EventFilter {
            event_type: Some("Pending".into()),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(typed.len(), 2);
    let page = o
        .list(&EventFilter {
            before_id: Some(ids_[2]),
            limit: 1,
            ..room.clone()
        })
        .await
        .unwrap();
    assert_eq!(page.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids_[1]]);
    let future = o
        .list(&EventFilter {
            since_ms: Some(now_ms() + 60_000),
            ..room.clone()
        })
        .await
        .unwrap();
    assert!(future.is_empty());
    let past = o
        .list(&EventFilter {
            until_ms: Some(now_ms() + 60_000),
            ..room
        })
        .await
        .unwrap();
    assert_eq!(past.len(), 4);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_never_share_a_row() {
    let s = scratch("concurrent").await;
    let events: Vec<NewEvent> = (0..200).map(|i| ev(&format!("E{i}"))).collect();
    let mut inserted = enqueue_all(&s.outbox, &events).await;
    let mut tasks = Vec::new();
    for w in 0..6 {
        let o = s.outbox.clone();
        tasks.push(tokio::spawn(async move {
            let worker = format!("worker-{w}");
            let mut got = Vec::new();
            loop {
                let c = o
                    .claim(
                        ClaimSource::Pending,
                        &ClaimRequest {
                            limit: 7,
                            ..req(&worker, 30_000)
                        },
                    )
                    .await
                    .expect("claim");
                if c.is_empty() {
                    break got;
                }
                let f = c[0].fence();
                assert_eq!(
                    o.mark_delivered(&f, &ids(&c)).await.unwrap(),
                    c.len() as u64
                );
                got.extend(ids(&c));
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort_unstable();
    inserted.sort_unstable();
    assert_eq!(all, inserted, "every row exactly once");
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
