//! SQLite runs the shared conformance suite.

use std::sync::Arc;

use postbox_core::store::OutboxStore;
use postbox_sqlite::SqliteOutbox;
use postbox_testkit::{conformance_suite, scratch_table};

async fn outbox() -> SqliteOutbox {
    let path = std::env::temp_dir().join(format!("{}.db", scratch_table("conformance")));
    let url = format!("sqlite://{}", path.display());
    let store = SqliteOutbox::connect(&url, "room_outbox", 4)
        .await
        .expect("open SQLite");
    store.migrate().await.expect("migrate");
    store
}

async fn fresh_store() -> Arc<dyn OutboxStore> {
    Arc::new(outbox().await)
}

conformance_suite!(fresh_store);

// Issue 12: no push from SQLite; an in-process `enqueue` wakes the relay.
postbox_testkit::wake_suite!(outbox);

/// Woken rounds are coalesced (SQLite commits fast enough for the
/// producer to set the pace; see the case).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_commits_is_claimed_in_few_rounds() {
    postbox_testkit::wake::a_stream_of_commits_is_claimed_in_few_rounds(Arc::new(outbox().await))
        .await;
}

/// The relay's idle loop is the same on every backend: run on one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_polling_slower_than_its_heartbeat_still_probes() {
    postbox_testkit::wake::an_idle_relay_polling_slower_than_its_heartbeat_still_probes(Arc::new(
        outbox().await,
    ))
    .await;
}

/// A relay with no publisher refuses to start instead of marking every row
/// delivered.
#[tokio::test]
async fn relay_without_publishers_refuses_to_run() {
    use postbox_core::relay::{CancellationToken, Relay};
    let store = fresh_store().await;
    let relay = Relay::new(
        store,
        vec![],
        postbox_core::config::RelaySettings::new(
            postbox_core::config::WorkerConfig::default(),
            vec!["a".into()],
        )
        .unwrap(),
    );
    let err = relay.run(CancellationToken::new()).await.unwrap_err();
    assert!(err.to_string().contains("publishers"), "{err}");
}
