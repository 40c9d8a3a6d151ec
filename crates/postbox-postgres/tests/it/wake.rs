//! Push wake-up on PostgreSQL (issue 12): the trigger `migrate` creates
//! notifies `postbox_<table>` once per INSERT statement, and the relay
//! LISTENs.

use std::sync::Arc;

use postbox_core::store::ReplayStore;

use postbox_testkit::servers::postgres_url;
use postbox_testkit::wake;

use super::postgres::outbox;

// The probe, the idle cost, and the in-process wake, as on every backend.
postbox_testkit::wake_suite!(outbox);

/// A producer in another language: a plain INSERT, not the API, wakes a
/// relay polling every 30 s through the trigger's NOTIFY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_insert_wakes_an_idle_relay() {
    let store = outbox().await;
    let (pool, table) = (store.pool().clone(), store.table().as_str().to_owned());
    wake::an_idle_relay_wakes_for(Arc::new(store), "wake", async move {
        let event_id = "plain-insert-1".to_owned();
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query(&format!(
            "INSERT INTO {table} (app_code, event_id, event_type, payload) VALUES ($1, $2, 'Woken', '{{}}')"
        ))
        .bind("wake")
        .bind(&event_id)
        .execute(&mut *tx)
        .await
        .expect("plain INSERT");
        tx.commit().await.expect("commit");
        event_id
    })
    .await;
}

/// A table made before the trigger existed (schema version 3) gets it
/// from `migrate`; running `migrate` again changes nothing, and the
/// schema report lists the trigger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_adds_the_trigger_to_an_existing_table_once() {
    let store = outbox().await;
    let t = store.table().as_str().to_owned();
    let pool = store.pool().clone();
    for sql in [
        format!("DROP TRIGGER {t}_wake ON {t}"),
        format!("DROP FUNCTION {t}_wake()"),
        format!("DELETE FROM postbox_schema_migrations WHERE table_name = '{t}' AND version >= 4"),
    ] {
        sqlx::query(&sql).execute(&pool).await.expect(&sql);
    }
    let before = store.inspect_schema().await.expect("inspect");
    assert_eq!(before.version, 3);
    let trigger = |r: &postbox_core::store::SchemaReport| {
        r.objects
            .iter()
            .find(|o| o.kind == "trigger")
            .map(|o| (o.name.clone(), o.present))
    };
    assert_eq!(trigger(&before), Some((format!("{t}_wake"), false)));
    let report = store.migrate().await.expect("upgrade");
    assert_eq!(report.applied, vec![4, 5, 6, 7, 8, 9, 10, 11], "{report:?}");
    let again = store.migrate().await.expect("again");
    assert!(again.applied.is_empty(), "{again:?}");
    let after = store.inspect_schema().await.expect("inspect");
    assert_eq!(after.version, 11);
    assert_eq!(trigger(&after), Some((format!("{t}_wake"), true)));

    // One notification per statement: a 1,000-row INSERT sends one.
    let mut listener = sqlx::postgres::PgListener::connect(&postgres_url())
        .await
        .expect("listen");
    listener
        .listen(&format!("postbox_{t}"))
        .await
        .expect("LISTEN");
    sqlx::query(&format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload) \
         SELECT 'bulk', 'bulk-' || g, 'T', '{{}}' FROM generate_series(1, 1000) g"
    ))
    .execute(&pool)
    .await
    .expect("bulk INSERT");
    let first = tokio::time::timeout(std::time::Duration::from_secs(5), listener.recv())
        .await
        .expect("a notification")
        .expect("recv");
    assert_eq!(first.channel(), format!("postbox_{t}"));
    let second = tokio::time::timeout(std::time::Duration::from_millis(300), listener.recv()).await;
    assert!(
        second.is_err(),
        "one notification per statement, got a second"
    );
}

/// The relay's LISTEN connection dies: it is re-established, and a plain
/// INSERT after that still wakes the relay without waiting for the poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_listen_connection_is_re_established() {
    let store = outbox().await;
    let (pool, table) = (store.pool().clone(), store.table().as_str().to_owned());
    wake::an_idle_relay_wakes_for(Arc::new(store), "wake", async move {
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE query LIKE 'LISTEN %' AND query LIKE '%' || $1 || '%'",
        )
        .bind(format!("postbox_{table}"))
        .fetch_one(&pool)
        .await
        .expect("terminate the LISTEN session");
        assert_eq!(killed, 1, "the relay's LISTEN session");
        // Reconnecting takes a pause of 200 ms after the first loss.
        tokio::time::sleep(std::time::Duration::from_millis(1_000)).await;
        let event_id = "after-reconnect-1".to_owned();
        sqlx::query(&format!(
            "INSERT INTO {table} (app_code, event_id, event_type, payload) VALUES ($1, $2, 'Woken', '{{}}')"
        ))
        .bind("wake")
        .bind(&event_id)
        .execute(&pool)
        .await
        .expect("plain INSERT");
        event_id
    })
    .await;
}

/// A replay run elsewhere (another store, so no in-process wake reaches
/// the relay) notifies inside its transaction: the idle relay delivers the
/// replayed event without waiting for the poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_elsewhere_wakes_an_idle_relay() {
    use postbox_core::store::{ClaimRequest, ReplaySelector};
    let store = outbox().await;
    let elsewhere =
        postbox_postgres::PgOutbox::new(store.pool().clone(), store.table().as_str()).unwrap();
    let event = wake::wake_event("wake");
    elsewhere
        .enqueue_batch(std::slice::from_ref(&event), 1 << 20)
        .await
        .expect("enqueue");
    let req = ClaimRequest {
        app_code: "wake",
        limit: 1,
        worker_id: "w-before",
        lease_ms: 30_000,
        ordered: false,
        skip_types: &[],
    };
    let claimed = elsewhere
        .claim(postbox_core::ClaimSource::Pending, &req)
        .await
        .expect("claim");
    let delivered = elsewhere
        .mark_delivered(&claimed[0].fence(), &[claimed[0].record.id])
        .await
        .expect("deliver");
    assert_eq!(delivered, 1);
    wake::an_idle_relay_wakes_for(Arc::new(store), "wake", async move {
        let selector = ReplaySelector::EventIds {
            app_code: Some("wake".into()),
            event_ids: vec![event.event_id.clone()],
        };
        let replayed = elsewhere
            .replay(&selector, false, "test")
            .await
            .expect("replay");
        assert_eq!(replayed.len(), 1);
        event.event_id
    })
    .await;
}

/// The README's one-statement form (`docs/plain-insert-in-the-change.postgres.sql`,
/// exactly): the business UPDATE and its outbox row in one data-modifying
/// CTE. The trigger fires for the CTE's INSERT too, so an idle relay wakes;
/// the row's version is the one the UPDATE wrote; an UPDATE that changes
/// nothing writes no event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_row_written_by_the_business_statement_wakes_the_relay() {
    let store = outbox().await;
    let (pool, table) = (store.pool().clone(), store.table().as_str().to_owned());
    let accounts = format!("{table}_accounts");
    for sql in [
        format!("CREATE TABLE {accounts} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, version BIGINT NOT NULL)"),
        format!("INSERT INTO {accounts} VALUES (7, 100, 4)"),
    ] {
        sqlx::query(&sql).execute(&pool).await.expect(&sql);
    }
    let statement = include_str!("../../../../docs/plain-insert-in-the-change.postgres.sql")
        .replace("room_outbox", &table)
        .replace("accounts", &accounts);
    let change = async |account: i64, event_id: &str| {
        let mut tx = pool.begin().await.expect("begin");
        let written = sqlx::query(&statement)
            .bind(account)
            .bind("wake")
            .bind(event_id)
            .bind("BalanceChanged")
            .bind(r#"{"delta":1}"#)
            .bind(None::<String>)
            .execute(&mut *tx)
            .await
            .expect("the one statement")
            .rows_affected();
        tx.commit().await.expect("commit");
        written
    };
    let store = Arc::new(store);
    wake::an_idle_relay_wakes_for(store.clone(), "wake", async {
        assert_eq!(change(7, "in-the-change-1").await, 1);
        "in-the-change-1".to_owned()
    })
    .await;
    let rows = store.find("in-the-change-1").await.unwrap();
    assert_eq!(
        (rows[0].aggregate_id.as_deref(), rows[0].aggregate_version),
        (Some("acct-7"), Some(5)),
        "the version the UPDATE wrote"
    );
    assert_eq!(change(8, "in-the-change-2").await, 0, "no account 8");
    assert!(store.find("in-the-change-2").await.unwrap().is_empty());
    sqlx::query(&format!("DROP TABLE {accounts}"))
        .execute(&pool)
        .await
        .unwrap();
}
