//! The MySQL backend against a real server (MariaDB locally).
//!
//! The URL comes from `POSTBOX_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/postbox_test`); the database is created if
//! missing and every test uses its own table, so tests run in parallel. An
//! unreachable server fails the test, naming how to start it.

use sqlx::Row;

use postbox_core::event::Fence;
use postbox_core::store::{
    ClaimRequest, EnqueueOutcome, EventFilter, FailureUpdate, ReplaySelector, ReplayStore,
    EXPECTED_TABLES,
};
use postbox_core::{ClaimSource, ClaimedEvent, Error, NewEvent, Status};
use postbox_mysql::MySqlOutbox;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::mysql_url;
use postbox_testkit::store_setup::connected;

/// Makes sure the test database exists and returns a migrated store on a
/// fresh table.
async fn store(prefix: &str) -> MySqlOutbox {
    let store = connected("mysql", mysql_url(), |url| async move {
        MySqlOutbox::connect(&url, &scratch_table(prefix), 5).await
    })
    .await;
    let report = store.migrate().await.expect("first migrate");
    assert_eq!(report.applied, vec![1, 2, 3, 5, 7, 8, 9, 10, 11]);
    assert_eq!(report.version, 11);
    store
}

/// A store for the wake-up cases (issue 12: no push from MariaDB; an
/// in-process `enqueue` wakes the relay).
async fn wake_store() -> MySqlOutbox {
    store("myw").await
}

postbox_testkit::wake_suite!(wake_store);

async fn drop_tables(store: &MySqlOutbox) {
    let t = store.table().as_str().to_owned();
    let tables = EXPECTED_TABLES.map(|suffix| format!("DROP TABLE IF EXISTS {t}{suffix}"));
    for sql in tables.into_iter().chain([format!(
        "DELETE FROM postbox_schema_migrations WHERE table_name = '{t}'"
    )]) {
        sqlx::query(&sql).execute(store.pool()).await.unwrap();
    }
}

fn req<'a>(app_code: &'a str, worker_id: &'a str, lease_ms: i64) -> ClaimRequest<'a> {
    ClaimRequest {
        app_code,
        limit: 10,
        worker_id,
        lease_ms,
        ordered: false,
        skip_types: &[],
    }
}

/// What `worker` claims from `source` for app_code `room`, with a 30 s lease.
async fn claim(store: &MySqlOutbox, source: ClaimSource, worker: &str) -> Vec<ClaimedEvent> {
    store
        .claim(source, &req("room", worker, 30_000))
        .await
        .unwrap()
}

fn ids(events: &[ClaimedEvent]) -> Vec<i64> {
    events.iter().map(|e| e.record.id).collect()
}

async fn enqueue_committed(store: &MySqlOutbox, event: &NewEvent) -> i64 {
    let mut tx = store.pool().begin().await.unwrap();
    let id = store.enqueue(&mut tx, event).await.unwrap();
    tx.commit().await.unwrap();
    id
}

#[tokio::test]
async fn migrate_is_idempotent_and_serialised() {
    let store = store("mb_migrate").await;
    let again = store.migrate().await.unwrap();
    assert!(
        again.applied.is_empty(),
        "second migrate applied {:?}",
        again.applied
    );
    assert_eq!(again.version, 11);

    // Two concurrent runs on a new table: exactly one applies the versions.
    let other = MySqlOutbox::new(store.pool().clone(), &scratch_table("mb_migrate2")).unwrap();
    let (a, b) = tokio::join!(other.migrate(), other.migrate());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.applied.len() + b.applied.len(), 9, "{a:?} {b:?}");
    assert!(a.applied.is_empty() || b.applied.is_empty(), "{a:?} {b:?}");
    assert_eq!((a.version, b.version), (11, 11));

    drop_tables(&other).await;
    drop_tables(&store).await;
}

/// A `migrate` cut short after the server committed a version's `ALTER
/// TABLE` but before the ledger recorded it (each MySQL DDL statement
/// commits on its own) is run again: the versions whose changes are there
/// are recorded, the others applied. Re-running version 5's `ALTER`
/// failed on its index already there (1061), version 7's on its column
/// (1060), and every later `migrate` failed the same way.
#[tokio::test]
async fn a_migrate_cut_short_after_an_alter_is_run_again() {
    let store = store("mb_cut_short").await;
    let t = store.table().as_str().to_owned();
    sqlx::query("DELETE FROM postbox_schema_migrations WHERE table_name = ? AND version >= 5")
        .bind(&t)
        .execute(store.pool())
        .await
        .unwrap();
    let again = store
        .migrate()
        .await
        .expect("the migrate after one cut short");
    assert_eq!(again.applied, vec![5, 7, 8, 9, 10, 11]);
    assert!(store.migrate().await.unwrap().applied.is_empty());
    drop_tables(&store).await;
}

#[tokio::test]
async fn enqueue_commits_rolls_back_and_dedupes() {
    let store = store("mb_enqueue").await;

    let committed = NewEvent::new("room", "RoomCreated", r#"{"room_id":1}"#)
        .aggregate("room-1", 1)
        .header("trace", "abc");
    let id = enqueue_committed(&store, &committed).await;
    assert!(id > 0);

    let rolled_back = NewEvent::new("room", "RoomCreated", r#"{"room_id":2}"#);
    {
        let mut tx = store.pool().begin().await.unwrap();
        store.enqueue(&mut tx, &rolled_back).await.unwrap();
        tx.rollback().await.unwrap();
    }
    assert!(store.find(&rolled_back.event_id).await.unwrap().is_empty());

    let found = store.find(&committed.event_id).await.unwrap();
    assert_eq!(found.len(), 1);
    let row = &found[0];
    assert_eq!(row.id, id);
    assert_eq!(row.status, Status::Pending);
    assert_eq!(row.aggregate_id.as_deref(), Some("room-1"));
    assert_eq!(row.aggregate_version, Some(1));
    assert_eq!(row.headers_map()["trace"], "abc");
    assert!(row.created_at_ms > 0 && row.updated_at_ms >= row.created_at_ms);

    // A duplicate fails, and the transaction is still usable afterwards.
    let mut tx = store.pool().begin().await.unwrap();
    let dup = store.enqueue(&mut tx, &committed).await.unwrap_err();
    assert!(matches!(dup, Error::DuplicateEvent { .. }), "{dup}");
    let after = NewEvent::new("room", "RoomClosed", "{}");
    store.enqueue(&mut tx, &after).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.find(&after.event_id).await.unwrap().len(), 1);

    // The same event id in another app_code is not a duplicate.
    let other_app = NewEvent {
        app_code: "wallet".into(),
        ..committed.clone()
    };
    enqueue_committed(&store, &other_app).await;
    assert_eq!(store.find(&committed.event_id).await.unwrap().len(), 2);

    // Oversized payloads never reach the database.
    let small = store.clone().with_max_payload_bytes(8);
    let mut conn = store.pool().acquire().await.unwrap();
    let big = NewEvent::new("room", "Big", "x".repeat(9));
    assert!(matches!(
        small.enqueue(&mut conn, &big).await,
        Err(Error::PayloadTooLarge {
            size: 9,
            limit: 8,
            ..
        })
    ));

    // enqueue_batch reports duplicates instead of failing.
    let fresh = NewEvent::new("room", "RoomCreated", "{}");
    let outcomes = store
        .enqueue_batch(&[fresh.clone(), committed.clone()], 1024)
        .await
        .unwrap();
    assert!(matches!(outcomes[0], EnqueueOutcome::Inserted(_)));
    assert_eq!(outcomes[1], EnqueueOutcome::Duplicate);

    drop_tables(&store).await;
}

#[tokio::test]
async fn claim_lease_fence_and_failure() {
    let store = store("mb_claim").await;
    let a = enqueue_committed(&store, &NewEvent::new("room", "A", "{}")).await;
    let b = enqueue_committed(&store, &NewEvent::new("room", "B", "{}")).await;
    enqueue_committed(&store, &NewEvent::new("wallet", "W", "{}")).await;

    // Claim pending: scoped by app_code, in creation order, one fence.
    let claimed = claim(&store, ClaimSource::Pending, "w1").await;
    assert_eq!(ids(&claimed), vec![a, b]);
    let fence = claimed[0].fence();
    assert_eq!(fence, claimed[1].fence());
    assert_eq!(fence.worker_id, "w1");
    let now = store.now_ms().await.unwrap();
    assert!(
        (fence.lock_until_ms - now - 30_000).abs() < 5_000,
        "{fence:?} vs {now}"
    );
    for c in &claimed {
        assert_eq!(c.record.status, Status::Delivering);
        assert_eq!(c.source, ClaimSource::Pending);
    }
    // The database agrees with what claim returned.
    let stored = store
        .find(&claimed[0].record.event_id)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(stored.status, Status::Delivering);
    assert_eq!(stored.worker_id.as_deref(), Some("w1"));
    assert_eq!(stored.lock_until_ms, fence.lock_until_ms);
    assert_eq!(stored.updated_at_ms, claimed[0].record.updated_at_ms);

    // Nothing left to claim; a live lease is not taken over.
    assert!(claim(&store, ClaimSource::Pending, "w2").await.is_empty());
    assert!(claim(&store, ClaimSource::ExpiredLease, "w2")
        .await
        .is_empty());

    // A wrong fence writes nothing.
    let wrong = Fence {
        worker_id: "w2".into(),
        lock_until_ms: fence.lock_until_ms,
    };
    assert_eq!(store.mark_delivered(&wrong, &[a]).await.unwrap(), 0);
    let stale = Fence {
        worker_id: "w1".into(),
        lock_until_ms: fence.lock_until_ms - 1,
    };
    assert_eq!(store.mark_delivered(&stale, &[a]).await.unwrap(), 0);
    assert_eq!(store.mark_delivered(&fence, &[]).await.unwrap(), 0);

    // The right fence delivers.
    assert_eq!(store.mark_delivered(&fence, &[a]).await.unwrap(), 1);
    assert_eq!(
        store.mark_delivered(&fence, &[a]).await.unwrap(),
        0,
        "only once"
    );

    // A failed attempt: retryable, due later, with fanout progress.
    let update = FailureUpdate {
        status: Status::Retryable,
        retry_count: 1,
        retry_after_ms: 60_000,
        retry_jitter_ms: 0,
        delivered_to: vec!["file".into(), "rabbitmq".into()],
        error: "broker down".into(),
        publisher: Some("p".into()),
    };
    assert_eq!(store.mark_failed(&wrong, &[b], &update).await.unwrap(), 0);
    assert_eq!(store.mark_failed(&fence, &[b], &update).await.unwrap(), 1);
    let row = store
        .list(&EventFilter {
            status: Some(Status::Retryable),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .remove(0);
    assert_eq!(row.id, b);
    assert_eq!(row.retry_count, 1);
    assert_eq!(row.delivered_to, vec!["file", "rabbitmq"]);
    assert_eq!(row.last_error.as_deref(), Some("broker down"));
    assert_eq!(row.lock_until_ms, 0);
    assert!(row.next_retry_at_ms >= now + 50_000);
    // Not due yet.
    assert!(claim(&store, ClaimSource::DueRetry, "w1").await.is_empty());

    // Due at once after a zero backoff.
    let due = FailureUpdate {
        retry_after_ms: 0,
        retry_jitter_ms: 0,
        delivered_to: vec![],
        ..update.clone()
    };
    let again = claim(&store, ClaimSource::Pending, "w1").await;
    assert!(again.is_empty());
    sqlx::query(&format!(
        "UPDATE {} SET next_retry_at_ms = 0 WHERE id = ?",
        store.table()
    ))
    .bind(b)
    .execute(store.pool())
    .await
    .unwrap();
    let retried = claim(&store, ClaimSource::DueRetry, "w3").await;
    assert_eq!(ids(&retried), vec![b]);
    assert_eq!(retried[0].record.retry_count, 1);
    assert_eq!(retried[0].record.delivered_to, vec!["file", "rabbitmq"]);
    let f3 = retried[0].fence();
    assert_eq!(store.mark_failed(&f3, &[b], &due).await.unwrap(), 1);
    let row = store
        .find(&retried[0].record.event_id)
        .await
        .unwrap()
        .remove(0);
    assert!(row.delivered_to.is_empty(), "empty fanout progress is NULL");

    // Expired lease: taken over by another worker, attempt counted.
    let short = store
        .claim(ClaimSource::DueRetry, &req("room", "w4", -1_000))
        .await
        .unwrap();
    assert_eq!(ids(&short), vec![b]);
    let taken = claim(&store, ClaimSource::ExpiredLease, "w5").await;
    assert_eq!(ids(&taken), vec![b]);
    let t = &taken[0].record;
    assert_eq!(t.retry_count, 2);
    assert_eq!(t.worker_id.as_deref(), Some("w5"));
    assert_eq!(
        t.last_error.as_deref(),
        Some("lease expired while held by w4")
    );
    assert_eq!(taken[0].source, ClaimSource::ExpiredLease);
    let stored = store.find(&t.event_id).await.unwrap().remove(0);
    assert_eq!(stored.retry_count, 2);
    assert_eq!(stored.worker_id.as_deref(), Some("w5"));
    assert_eq!(stored.last_error, t.last_error);
    assert_eq!(stored.status, Status::Delivering);
    // The old holder's late result is dropped.
    assert_eq!(
        store.mark_delivered(&short[0].fence(), &[b]).await.unwrap(),
        0
    );

    // Release: back to retryable (it has attempts), due at once, no attempt counted.
    assert_eq!(store.release(&taken[0].fence(), &[b]).await.unwrap(), 1);
    let stored = store.find(&t.event_id).await.unwrap().remove(0);
    assert_eq!(stored.status, Status::Retryable);
    assert_eq!(stored.retry_count, 2);
    assert_eq!(stored.worker_id, None);
    assert_eq!((stored.lock_until_ms, stored.next_retry_at_ms), (0, 0));

    // A released never-failed row goes back to pending.
    let c = enqueue_committed(&store, &NewEvent::new("room", "C", "{}")).await;
    let got = claim(&store, ClaimSource::Pending, "w1").await;
    assert_eq!(ids(&got), vec![c]);
    assert_eq!(store.release(&got[0].fence(), &[c]).await.unwrap(), 1);
    let stored = store
        .list(&EventFilter {
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .remove(0);
    assert_eq!((stored.id, stored.status), (c, Status::Pending));

    // Dead letter.
    let got = claim(&store, ClaimSource::DueRetry, "w1").await;
    assert_eq!(ids(&got), vec![b]);
    let dead = FailureUpdate {
        status: Status::Failed,
        retry_count: 3,
        ..update
    };
    assert_eq!(
        store
            .mark_failed(&got[0].fence(), &[b], &dead)
            .await
            .unwrap(),
        1
    );
    let stored = store.find(&t.event_id).await.unwrap().remove(0);
    assert_eq!((stored.status, stored.retry_count), (Status::Failed, 3));

    drop_tables(&store).await;
}

#[tokio::test]
async fn replay_by_ids_filter_and_archive() {
    let store = store("mb_replay").await;
    let t = store.table().as_str().to_owned();
    let e1 = NewEvent::new("room", "A", "{}");
    let e2 = NewEvent::new("room", "B", "{}");
    let e3 = NewEvent::new("room", "A", "{}");
    let e4 = NewEvent::new("room", "Old", "{}");
    for e in [&e1, &e2, &e3, &e4] {
        enqueue_committed(&store, e).await;
    }
    // Deliver all four.
    let got = claim(&store, ClaimSource::Pending, "w1").await;
    assert_eq!(
        store
            .mark_delivered(&got[0].fence(), &ids(&got))
            .await
            .unwrap(),
        4
    );
    // e3 is being delivered again right now: replay leaves it alone.
    // e4 is archived (the way `postbox archive` does it: insert, then delete).
    sqlx::query(&format!(
        "INSERT INTO {t}_archive ({c}) SELECT {c} FROM {t} WHERE event_id = ?",
        c = postbox_sqlx::columns!()
    ))
    .bind(&e4.event_id)
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query(&format!("DELETE FROM {t} WHERE event_id = ?"))
        .bind(&e4.event_id)
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {t} SET status = 'delivering' WHERE event_id = ?"
    ))
    .bind(&e3.event_id)
    .execute(store.pool())
    .await
    .unwrap();

    // By ids: dry run changes nothing.
    let sel = ReplaySelector::EventIds {
        app_code: None,
        event_ids: vec![e1.event_id.clone(), e3.event_id.clone(), "missing".into()],
    };
    let dry = store.replay(&sel, true, "test").await.unwrap();
    assert_eq!(dry.len(), 1);
    assert_eq!(dry[0].event_id, e1.event_id);
    assert_eq!(dry[0].status, Status::Delivered);
    let done = store.replay(&sel, false, "test").await.unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].event_id, e1.event_id);
    assert_eq!(
        (done[0].status, done[0].retry_count, done[0].replay_count),
        (Status::Pending, 0, 1)
    );
    // Scoped by app_code.
    let other = ReplaySelector::EventIds {
        app_code: Some("wallet".into()),
        event_ids: vec![e2.event_id.clone()],
    };
    assert!(store
        .replay(&other, false, "test")
        .await
        .unwrap()
        .is_empty());

    // By filter: status + type.
    let f = EventFilter {
        status: Some(Status::Delivered),
        event_type: Some("B".into()),
        ..Default::default()
    };
    assert_eq!(
        store
            .replay(&ReplaySelector::Filter(f.clone()), true, "test")
            .await
            .unwrap()
            .len(),
        1
    );
    let done = store
        .replay(&ReplaySelector::Filter(f.clone()), false, "test")
        .await
        .unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(
        (done[0].event_id.as_str(), done[0].status),
        (e2.event_id.as_str(), Status::Pending)
    );
    assert!(store
        .replay(&ReplaySelector::Filter(f), false, "test")
        .await
        .unwrap()
        .is_empty());

    // Time range: also brings the archived row back, keeping id and event_id.
    let now = store.now_ms().await.unwrap();
    let range = EventFilter {
        app_code: Some("room".into()),
        since_ms: Some(now - 600_000),
        until_ms: Some(now + 600_000),
        ..Default::default()
    };
    let dry = store
        .replay(&ReplaySelector::Filter(range.clone()), true, "test")
        .await
        .unwrap();
    let mut dry_ids: Vec<&str> = dry.iter().map(|r| r.event_id.as_str()).collect();
    dry_ids.sort_unstable();
    let mut want = vec![
        e1.event_id.as_str(),
        e2.event_id.as_str(),
        e4.event_id.as_str(),
    ];
    want.sort_unstable();
    assert_eq!(dry_ids, want);
    let done = store
        .replay(&ReplaySelector::Filter(range.clone()), false, "test")
        .await
        .unwrap();
    assert_eq!(done.len(), 3);
    let back = done.iter().find(|r| r.event_id == e4.event_id).unwrap();
    assert_eq!((back.status, back.replay_count), (Status::Pending, 1));
    let archived: i64 = sqlx::query(&format!("SELECT COUNT(*) FROM {t}_archive"))
        .fetch_one(store.pool())
        .await
        .unwrap()
        .get(0);
    assert_eq!(archived, 0);
    assert_eq!(store.find(&e4.event_id).await.unwrap()[0].id, back.id);

    drop_tables(&store).await;
}

#[tokio::test]
async fn plain_insert_from_other_languages_and_legacy_rows() {
    let store = store("mb_plain").await;
    let t = store.table().as_str().to_owned();
    // What the README tells Go / PHP producers to write.
    sqlx::query(&format!(
        "INSERT INTO {t} (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, headers) \
         VALUES ('room', 'go-0001', 'RoomCreated', 'room-7', 3, '{{\"room_id\":7}}', NULL)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let row = store.find("go-0001").await.unwrap().remove(0);
    let now = store.now_ms().await.unwrap();
    assert_eq!(row.status, Status::Pending);
    assert_eq!(
        (
            row.retry_count,
            row.replay_count,
            row.next_retry_at_ms,
            row.lock_until_ms
        ),
        (0, 0, 0, 0)
    );
    assert!(
        (now - row.created_at_ms).abs() < 60_000,
        "created_at_ms {} vs now {now}",
        row.created_at_ms
    );
    assert_eq!(row.created_at_ms, row.updated_at_ms);
    let got = claim(&store, ClaimSource::Pending, "w1").await;
    assert_eq!(ids(&got), vec![row.id]);

    // Legacy `published` rows read as delivered.
    sqlx::query(&format!("UPDATE {t} SET status = 'published' WHERE id = ?"))
        .bind(row.id)
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(
        store.find("go-0001").await.unwrap()[0].status,
        Status::Delivered
    );
    assert_eq!(store.stats(&["room".into()]).await.unwrap()[0].delivered, 1);

    drop_tables(&store).await;
}

/// A pending row whose producer set `next_retry_at_ms` (a "due at" habit
/// of other languages' plain `INSERT`s) is claimed: the candidate reads
/// seek the pending rows at 0, and it was never delivered (PostgreSQL and
/// SQLite took it).
#[tokio::test]
async fn a_pending_row_written_with_a_due_time_is_claimed() {
    let store = store("mb_undue").await;
    let t = store.table().as_str().to_owned();
    let now = store.now_ms().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload, next_retry_at_ms) \
         VALUES ('room', 'go-due', 'RoomCreated', '{{}}', ?)"
    ))
    .bind(now)
    .execute(store.pool())
    .await
    .unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        got.extend(claim(&store, ClaimSource::Pending, "w1").await);
    }
    assert_eq!(
        got.iter()
            .map(|c| c.record.event_id.as_str())
            .collect::<Vec<_>>(),
        ["go-due"]
    );
    drop_tables(&store).await;
}

/// A row the claim matches but cannot read (a producer wrote the status
/// as an enum's name, `'PENDING'`, which the case-insensitive collation
/// takes for `'pending'`) is failed with the reason, and the events behind
/// it are claimed. The whole claim failed on it before: it came back first
/// every time, and nothing of the tenant was delivered again.
#[tokio::test]
async fn a_row_the_claim_cannot_read_is_failed_and_the_rest_go_on() {
    let store = store("mb_unreadable").await;
    let t = store.table().as_str().to_owned();
    sqlx::query(&format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload, status) \
         VALUES ('room', 'java-1', 'RoomCreated', '{{}}', 'PENDING')"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let good = enqueue_committed(&store, &NewEvent::new("room", "RoomCreated", "{}")).await;
    let got = claim(&store, ClaimSource::Pending, "w1").await;
    assert_eq!(ids(&got), vec![good], "the readable row, once");
    let (status, error): (String, String) = sqlx::query_as(&format!(
        "SELECT status, last_error FROM {t} WHERE event_id = 'java-1'"
    ))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(status, "failed");
    assert!(
        error.contains("unreadable row") && error.contains("PENDING"),
        "{error}"
    );
    assert!(claim(&store, ClaimSource::Pending, "w1").await.is_empty());
    drop_tables(&store).await;
}

/// The README's one-round-trip form (`docs/plain-insert-in-the-change.mysql.sql`,
/// exactly, its `?` filled in as a driver that prepares client-side does):
/// the business UPDATE, checking the version it read, and its outbox row
/// in one multi-statement query. An UPDATE that matches no row (a stale
/// version, no such account) writes no event; an INSERT that fails (a
/// duplicate `event_id`) fails the query, so the producer rolls its change
/// back and nothing is committed without its event.
#[tokio::test]
async fn the_business_update_and_its_outbox_row_in_one_round_trip() {
    use postbox_testkit::sql_text::{interpolate, Literal};

    let store = store("mb_change").await;
    let (pool, table) = (store.pool().clone(), store.table().as_str().to_owned());
    let accounts = format!("{table}_accounts");
    for sql in [
        format!("CREATE TABLE {accounts} (id BIGINT NOT NULL PRIMARY KEY, balance BIGINT NOT NULL, version BIGINT NOT NULL) ENGINE=InnoDB"),
        format!("INSERT INTO {accounts} VALUES (7, 100, 4)"),
    ] {
        sqlx::query(&sql).execute(&pool).await.expect(&sql);
    }
    let statements = include_str!("../../../../docs/plain-insert-in-the-change.mysql.sql")
        .replace("room_outbox", &table)
        .replace("accounts", &accounts);
    // Account `id`, read at version `read`, changed with event `event_id`.
    let change = async |id: i64, read: i64, event_id: &str| {
        let aggregate = format!("acct-{id}");
        let sql = interpolate(
            &statements,
            &[
                Literal::Int(id),
                Literal::Int(read),
                Literal::Text("room"),
                Literal::Text(event_id),
                Literal::Text("BalanceChanged"),
                Literal::Text(&aggregate),
                Literal::Int(read + 1),
                Literal::Text(r#"{"delta":1,"note":"it's"}"#),
                Literal::Null,
            ],
        );
        let mut tx = pool.begin().await.expect("begin");
        let sent = sqlx::raw_sql(&sql).execute(&mut *tx).await;
        match sent {
            Ok(_) => tx.commit().await.expect("commit"),
            Err(_) => tx.rollback().await.expect("rollback"),
        }
        sent.map(|_| ())
    };
    let account = async || -> (i64, i64) {
        let row = sqlx::query(&format!(
            "SELECT balance, version FROM {accounts} WHERE id = 7"
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        (row.get(0), row.get(1))
    };

    change(7, 4, "change-1").await.expect("the one round trip");
    let row = store.find("change-1").await.unwrap().remove(0);
    assert_eq!(
        (
            row.aggregate_id.as_deref(),
            row.aggregate_version,
            row.status
        ),
        (Some("acct-7"), Some(5), Status::Pending)
    );
    assert_eq!(row.payload, r#"{"delta":1,"note":"it's"}"#);
    assert_eq!(account().await, (101, 5));
    assert_eq!(
        ids(&claim(&store, ClaimSource::Pending, "w1").await),
        vec![row.id]
    );

    change(7, 4, "change-2")
        .await
        .expect("a stale version is no error");
    change(8, 0, "change-3")
        .await
        .expect("no account 8 is no error");
    for unchanged in ["change-2", "change-3"] {
        assert!(
            store.find(unchanged).await.unwrap().is_empty(),
            "{unchanged}: no change, no event"
        );
    }
    assert_eq!(account().await, (101, 5));

    let duplicate = change(7, 5, "change-1").await;
    assert!(
        matches!(&duplicate, Err(sqlx::Error::Database(e)) if e.message().contains("Duplicate")),
        "the INSERT's failure reaches the producer: {duplicate:?}"
    );
    assert_eq!(
        account().await,
        (101, 5),
        "the change without its event rolled back"
    );

    sqlx::query(&format!("DROP TABLE {accounts}"))
        .execute(&pool)
        .await
        .unwrap();
    drop_tables(&store).await;
}

#[tokio::test]
async fn connect_accepts_mariadb_urls_and_hides_passwords() {
    let url = mysql_url();
    // Make sure the server is there (and the database exists) first.
    let s = store("mb_connect").await;
    drop_tables(&s).await;
    let maria = url.replacen("mysql://", "mariadb://", 1);
    let store = MySqlOutbox::connect(&maria, "mb_connect_x", 1)
        .await
        .unwrap();
    assert_eq!(store.backend(), "mysql");
    assert!(store.now_ms().await.unwrap() > 1_600_000_000_000);

    // A refused login against the real server (fast: not retried).
    let authority = url
        .split("://")
        .nth(1)
        .unwrap_or("")
        .split('/')
        .next()
        .unwrap_or("");
    let host = authority.rsplit('@').next().unwrap_or(authority);
    let bad = MySqlOutbox::connect(
        &format!("mysql://postbox_no_such_user:hunter2@{host}/x"),
        "t",
        1,
    )
    .await
    .unwrap_err();
    assert!(!bad.to_string().contains("hunter2"), "{bad}");
    let bad = MySqlOutbox::connect("mysql://root:hunter2@127.0.0.1:notaport/x", "t", 1)
        .await
        .unwrap_err();
    assert!(!bad.to_string().contains("hunter2"), "{bad}");
    assert!(MySqlOutbox::connect(&url, "bad name", 1).await.is_err());
}

/// Issue 9.3: a producer's open transaction holding an uncommitted outbox
/// row must not stall the relay (MariaDB's whole-primary-key scan at
/// REPEATABLE READ waited for the producer's row lock; see the case).
#[tokio::test]
async fn an_open_producer_transaction_does_not_stall_the_relay() {
    let store = store("mb_open_tx").await;
    postbox_testkit::conformance::an_open_producer_transaction_stalls_nothing(store.clone()).await;
    drop_tables(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_by_status_tells_archived_dropped_rows_from_delivered() {
    let store = store("mb_dropstatus").await;
    let pool = store.pool().clone();
    let other = MySqlOutbox::new(pool.clone(), store.table().as_str()).unwrap();
    postbox_testkit::conformance::a_replay_by_status_tells_archived_dropped_rows_from_delivered(
        std::sync::Arc::new(store),
        pool,
    )
    .await;
    drop_tables(&other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_keeps_a_row_whose_id_the_archive_holds_for_another_event() {
    let store = store("mb_idreuse").await;
    let pool = store.pool().clone();
    let other = MySqlOutbox::new(pool.clone(), store.table().as_str()).unwrap();
    postbox_testkit::conformance::archive_keeps_a_row_whose_id_the_archive_holds_for_another_event(
        std::sync::Arc::new(store),
        pool,
    )
    .await;
    drop_tables(&other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_recreates_tables_dropped_by_hand() {
    let store = store("mb_redrop").await;
    let pool = store.pool().clone();
    let other = MySqlOutbox::new(pool.clone(), store.table().as_str()).unwrap();
    postbox_testkit::conformance::migrate_recreates_tables_dropped_by_hand(
        std::sync::Arc::new(store),
        pool,
    )
    .await;
    drop_tables(&other).await;
}

/// Issue 16.4, what MariaDB's partitioning allows (README: Partitioned
/// outbox): a table partitioned by range of `created_at_ms` cannot have a
/// unique `(app_code, event_id)` (error 1503: every unique key must hold
/// the partitioning columns), so without one the same event is written
/// twice into two partitions; and a partition leaves the table only by
/// `DROP PARTITION` or `CONVERT PARTITION … TO TABLE`, both under a
/// metadata lock on the whole table (no online detach). postbox therefore
/// refuses `partitioning` on MariaDB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_range_partitions_cannot_keep_an_event_unique() {
    let store = store("mpart").await;
    let pool = store.pool();
    let t = format!("{}_ranged", store.table());
    let columns = "id BIGINT NOT NULL AUTO_INCREMENT, app_code VARCHAR(64) NOT NULL, \
                   event_id VARCHAR(64) NOT NULL, created_at_ms BIGINT NOT NULL";
    let partitions = "PARTITION BY RANGE (created_at_ms) \
                      (PARTITION p1 VALUES LESS THAN (1000), PARTITION p2 VALUES LESS THAN (2000))";
    let refused = sqlx::query(&format!(
        "CREATE TABLE {t} ({columns}, PRIMARY KEY (id, created_at_ms), UNIQUE KEY (app_code, event_id)) {partitions}"
    ))
    .execute(pool)
    .await
    .unwrap_err();
    let code = refused
        .as_database_error()
        .and_then(|e| e.code())
        .unwrap_or_default();
    assert_eq!(code, "HY000", "{refused}");
    assert!(
        refused
            .to_string()
            .contains("UNIQUE INDEX must include all columns"),
        "{refused}"
    );

    sqlx::query(&format!(
        "CREATE TABLE {t} ({columns}, PRIMARY KEY (id, created_at_ms), \
         UNIQUE KEY (app_code, event_id, created_at_ms)) {partitions}"
    ))
    .execute(pool)
    .await
    .unwrap();
    for at in [10, 1010] {
        sqlx::query(&format!(
            "INSERT INTO {t} (app_code, event_id, created_at_ms) VALUES ('a', 'same', {at})"
        ))
        .execute(pool)
        .await
        .unwrap();
    }
    let twice: i64 =
        sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {t} WHERE event_id = 'same'"))
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(twice, 2, "one event, written into two partitions");
    sqlx::query(&format!(
        "ALTER TABLE {t} CONVERT PARTITION p1 TO TABLE {t}_p1"
    ))
    .execute(pool)
    .await
    .unwrap();
    let left: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {t}"))
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(left, 1);
    for drop in [format!("DROP TABLE {t}"), format!("DROP TABLE {t}_p1")] {
        sqlx::query(&drop).execute(pool).await.unwrap();
    }
}

/// A row the archive's columns cannot hold (a PostgreSQL or SQLite outbox
/// archiving to MariaDB: unbounded text there, `VARCHAR(128)` here) is
/// refused, so the outbox keeps it: `INSERT IGNORE` stored it cut short,
/// with a warning, and the archiver then deleted the live row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_archive_refuses_what_its_columns_cannot_hold() {
    let store = store("mb_arcut").await;
    let row = |id: i64, aggregate: String| postbox_core::EventRecord {
        id,
        app_code: "room".into(),
        event_id: format!("cut-{id}"),
        event_type: "T".into(),
        aggregate_id: Some(aggregate),
        payload: "{}".into(),
        status: Status::Delivered,
        ..postbox_core::EventRecord::default()
    };
    let refused = store.put_archived(&[row(1, "a".repeat(200))]).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(
        store.put_archived(&[row(2, "a".repeat(20))]).await.unwrap(),
        1
    );
    // A row already there is left alone.
    store.put_archived(&[row(2, "a".repeat(20))]).await.unwrap();
    let archived: Vec<(String, String)> = sqlx::query_as(&format!(
        "SELECT event_id, aggregate_id FROM {}_archive ORDER BY id",
        store.table().as_str()
    ))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(archived, [("cut-2".to_owned(), "a".repeat(20))]);
    drop_tables(&store).await;
}
