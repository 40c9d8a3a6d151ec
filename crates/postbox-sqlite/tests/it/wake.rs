//! Wake-up and idle cost on SQLite (issue 12): no push from the
//! database, so an in-process `enqueue` wakes the relay.

use std::sync::Arc;
use std::time::Duration;

use postbox_sqlite::SqliteOutbox;
use postbox_testkit::{scratch_table, wake};

async fn outbox() -> SqliteOutbox {
    let path = std::env::temp_dir().join(format!("{}.db", scratch_table("wake")));
    let store = SqliteOutbox::connect(&format!("sqlite://{}", path.display()), "room_outbox", 4)
        .await
        .expect("open SQLite");
    store.migrate().await.expect("migrate");
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn due_answers_per_app_code() {
    wake::due_answers_per_app_code(Arc::new(outbox().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_relay_makes_one_store_call_per_second() {
    wake::idle_relay_makes_one_store_call_per_second(Arc::new(outbox().await)).await;
}

/// `enqueue` in the caller's transaction, committed a little later, wakes
/// a relay of the same process polling every 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_wakes_an_idle_relay_in_the_same_process() {
    let store = outbox().await;
    let producer = store.clone();
    wake::an_idle_relay_wakes_for(Arc::new(store), "wake", async move {
        let event = wake::wake_event("wake");
        let mut tx = producer.begin_write().await.expect("begin");
        producer.enqueue(&mut tx, &event).await.expect("enqueue");
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.commit().await.expect("commit");
        event.event_id
    })
    .await;
}
