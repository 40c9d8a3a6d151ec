//! A poison event type is dead-lettered while the rest flows, and the log
//! says so once per event — not once per poll or per attempt.

use std::io::Write;
use std::sync::{Arc, Mutex};

use postbox_core::config::{HumanDuration, WorkerConfig};
use postbox_core::store::OutboxStore;
use postbox_core::NewEvent;
use postbox_postgres::PgOutbox;
use postbox_testkit::conformance::{fast_worker, run_relay_until_for};
use postbox_testkit::servers::{ensure_database, how_to_start, postgres_url};
use postbox_testkit::{scratch_table, RecordingPublisher};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_and_logged_once_per_event() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();

    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let store = PgOutbox::connect(&url, &scratch_table("poison"), 4)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("postgres")));
    store.migrate().await.unwrap();
    let store: Arc<dyn OutboxStore> = Arc::new(store);
    let good: Vec<NewEvent> = (0..200)
        .map(|i| NewEvent::new("conf", "Good", format!("{{\"n\":{i}}}")))
        .collect();
    let bad: Vec<NewEvent> = (0..5)
        .map(|i| NewEvent::new("conf", "Poison", format!("{{\"n\":{i}}}")))
        .collect();
    store.enqueue_batch(&bad, 1 << 20).await.unwrap();
    store.enqueue_batch(&good, 1 << 20).await.unwrap();

    let publisher = Arc::new(RecordingPublisher::new("rec").failing_type("Poison"));
    let config = WorkerConfig {
        max_retry_count: 6,
        initial_backoff: HumanDuration::millis(20),
        max_backoff: HumanDuration::millis(60),
        ..fast_worker()
    };
    run_relay_until_for(
        store.clone(),
        vec![publisher.clone()],
        config,
        "conf",
        |s| s.delivered == 200 && s.failed == 5,
    )
    .await;

    for e in &bad {
        assert_eq!(
            publisher.attempts(&e.event_id),
            6,
            "tried max_retry_count times"
        );
    }
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    for e in &bad {
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(&e.event_id)).collect();
        assert_eq!(
            lines.len(),
            2,
            "one line at the first failure, one when dead-lettered, not one per attempt:\n{}",
            lines.join("\n")
        );
        assert!(
            lines[0].contains("will retry") && lines[1].contains("dead-lettered"),
            "{}",
            lines.join("\n")
        );
    }
    assert!(!text.contains("claim failed"), "{text}");
}

/// Issue 11: a relay stage that panics (here the publish stage, through a
/// publisher bug) stops the relay with an error instead of a clean-looking
/// report, and the rows the relay held are released, not left
/// `delivering` until their leases expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_stage_stops_the_relay_with_an_error_and_releases_its_rows() {
    use postbox_core::relay::{CancellationToken, Relay};

    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let store = PgOutbox::connect(&url, &scratch_table("panic"), 4)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("postgres")));
    store.migrate().await.unwrap();
    let store: Arc<dyn OutboxStore> = Arc::new(store);
    let events: Vec<NewEvent> = (0..150)
        .map(|i| NewEvent::new("conf", "Bug", format!("{{\"n\":{i}}}")))
        .collect();
    store.enqueue_batch(&events, 1 << 20).await.unwrap();

    let publisher = Arc::new(RecordingPublisher::new("buggy").panicking_type("Bug"));
    let relay = Relay::new(
        store.clone(),
        vec![publisher],
        fast_worker(),
        vec!["conf".to_owned()],
    );
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        relay.run(CancellationToken::new()),
    )
    .await
    .expect("the relay stops by itself when a stage panics");
    let error = result.expect_err("a panicking stage is an error, not a clean stop");
    assert!(
        error.to_string().contains("publish stage panicked"),
        "{error}"
    );
    let s = store.stats(&["conf".to_owned()]).await.unwrap().remove(0);
    assert_eq!(s.delivering, 0, "no lease left behind: {s:?}");
    assert_eq!(
        s.pending, 150,
        "every row released without an attempt: {s:?}"
    );
}

async fn fresh_store(prefix: &str) -> Arc<dyn OutboxStore> {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let store = PgOutbox::connect(&url, &scratch_table(prefix), 4)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("postgres")));
    store.migrate().await.unwrap();
    Arc::new(store)
}

/// Issue 9.13: a mark whose answer was lost after it committed is the
/// relay's own result when retried, not a takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_recognises_its_own_mark_after_a_lost_answer() {
    postbox_testkit::faults::relay_recognises_its_own_mark_after_a_lost_answer(
        fresh_store("lostack").await,
    )
    .await;
}

/// Issue 11: a database error while marking is reported as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_reports_a_failed_mark_as_a_database_error() {
    postbox_testkit::faults::relay_reports_a_failed_mark_as_a_database_error(
        fresh_store("markerr").await,
    )
    .await;
}
