//! Wake-up and idle cost on MySQL / MariaDB (issue 12): no push from the
//! database, so an in-process `enqueue` wakes the relay.

use std::sync::Arc;
use std::time::Duration;

use postbox_mysql::MySqlOutbox;
use postbox_testkit::servers::{ensure_database, how_to_start, mysql_url};
use postbox_testkit::{scratch_table, wake};

async fn outbox() -> MySqlOutbox {
    let url = mysql_url();
    ensure_database("mysql", &url).await;
    let store = MySqlOutbox::connect(&url, &scratch_table("myw"), 4)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("mysql")));
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
        let mut tx = producer.pool().begin().await.expect("begin");
        producer.enqueue(&mut tx, &event).await.expect("enqueue");
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.commit().await.expect("commit");
        event.event_id
    })
    .await;
}
