//! A poison event type is dead-lettered while the rest flows, and the log
//! says so once per event — not once per poll or per attempt.

use std::io::Write;
use std::sync::{Arc, Mutex};

use postbox_core::config::{HumanDuration, RelaySettings, WorkerConfig};
use postbox_core::store::{AppStats, OutboxStore};
use postbox_core::NewEvent;
use postbox_postgres::PgOutbox;
use postbox_testkit::conformance::{fast_worker, retrying_worker, run_relay_until_for};
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::migrated;
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

    let store = migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table("poison"), 4).await
    })
    .await;
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
    let config = retrying_worker(6, 20, 60);
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

    // An outage fails every event of a batch: one line per batch, not one
    // per event (each event is at debug). Dead letters first (one attempt
    // allowed), then first failures (the retry far away).
    for (event_type, worker, done, line) in [
        (
            "Dead",
            retrying_worker(1, 20, 60),
            (|s: &AppStats| s.failed == 125) as fn(&AppStats) -> bool,
            "events dead-lettered",
        ),
        (
            "Down",
            retrying_worker(3, 60_000, 60_000),
            |s: &AppStats| s.retryable == 120,
            "events failed their first attempt; will retry",
        ),
    ] {
        logs.0.lock().unwrap().clear();
        let events: Vec<NewEvent> = (0..120)
            .map(|i| NewEvent::new("conf", event_type, format!("{{\"n\":{i}}}")))
            .collect();
        store.enqueue_batch(&events, 1 << 20).await.unwrap();
        let publisher = Arc::new(RecordingPublisher::new("rec").failing_type(event_type));
        let worker = WorkerConfig {
            batch_size: 120,
            ..worker
        };
        run_relay_until_for(store.clone(), vec![publisher], worker, "conf", done).await;
        let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        // One line per claimed batch (all 120 at once, unless a claim
        // returned fewer), three of its events named as examples.
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(line)).collect();
        let counted: usize = (lines.iter())
            .filter_map(|l| {
                l.split("events=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .sum();
        let named = events.iter().filter(|e| text.contains(&e.event_id)).count();
        assert_eq!(counted, 120, "every event counted in a batch line:\n{text}");
        assert!(
            named <= 3 * lines.len() && lines.len() <= 4,
            "not one line per event:\n{text}"
        );
    }
}

/// Issue 11: a relay stage that panics (here the publish stage, through a
/// publisher bug on one event) stops the relay with an error instead of a
/// clean-looking report. The batch queued behind it is released, but the
/// rows it was working on keep their leases: a release counts no attempt,
/// so a restarted relay would claim the poison row and panic again,
/// forever. Their leases expire and count attempts, so the poison row ends
/// `failed` after a few restarts (SPEC §3) and the rest is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_stage_stops_the_relay_and_its_poison_ends_failed_after_restarts() {
    use postbox_core::relay::{CancellationToken, Relay};

    let store = fresh_store("panic").await;
    let app = vec!["conf".to_owned()];
    let mut events: Vec<NewEvent> = (0..40)
        .map(|i| NewEvent::new("conf", "Good", format!("{{\"n\":{i}}}")))
        .collect();
    events.insert(10, NewEvent::new("conf", "Bug", "{}"));
    store.enqueue_batch(&events, 1 << 20).await.unwrap();

    let worker = WorkerConfig {
        batch_size: 5,
        lease: HumanDuration::millis(800),
        publish_timeout: HumanDuration::millis(200),
        max_retry_count: 2,
        ..fast_worker()
    };
    let mut restarts = 0;
    loop {
        // What systemd does with a relay that exits 1: start it again.
        let publisher = Arc::new(RecordingPublisher::new("buggy").panicking_type("Bug"));
        let settings = RelaySettings::new(worker.clone(), app.clone()).unwrap();
        let relay = Relay::new(store.clone(), vec![publisher], settings);
        let stop = CancellationToken::new();
        let stopper = {
            let (store, app, stop) = (store.clone(), app.clone(), stop.clone());
            tokio::spawn(async move {
                loop {
                    let s = store.stats(&app).await.unwrap().remove(0);
                    if s.pending + s.retryable + s.delivering == 0 {
                        stop.cancel();
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            })
        };
        let result = tokio::time::timeout(std::time::Duration::from_secs(20), relay.run(stop))
            .await
            .expect("the relay stops by itself when a stage panics");
        stopper.abort();
        match result {
            Ok(_) => break,
            Err(e) => {
                assert!(e.to_string().contains("publish stage panicked"), "{e}");
                restarts += 1;
                assert!(restarts <= 6, "the poison row loops: {restarts} restarts");
                // Old leases expire on the database's clock.
                tokio::time::sleep(std::time::Duration::from_millis(900)).await;
            }
        }
    }
    let s = store.stats(&app).await.unwrap().remove(0);
    assert!(restarts >= 1, "the publisher never panicked: {s:?}");
    assert_eq!(s.pending + s.retryable + s.delivering, 0, "{s:?}");
    let bug = store.find(&events[10].event_id).await.unwrap();
    assert_eq!(bug.len(), 1);
    assert_eq!(bug[0].status.as_str(), "failed", "{:?}", bug[0]);
    // Only rows that shared the poison's batch can share its fate.
    assert!(s.failed <= worker.batch_size as i64, "{s:?}");
    assert_eq!(s.delivered + s.failed, 41, "{s:?}");
}

async fn fresh_store(prefix: &str) -> Arc<dyn OutboxStore> {
    let store = migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table(prefix), 4).await
    })
    .await;
    Arc::new(store)
}

/// One test per fault case of `postbox_testkit::faults`, each on a fresh
/// table named after `$prefix`.
macro_rules! fault_cases {
    ($($(#[doc = $doc:literal])* $case:ident($prefix:literal);)*) => {$(
        $(#[doc = $doc])*
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            postbox_testkit::faults::$case(fresh_store($prefix).await).await;
        }
    )*};
}

fault_cases! {
    /// Issue 9.13: a mark whose answer was lost after it committed is the
    /// relay's own result when retried, not a takeover.
    relay_recognises_its_own_mark_after_a_lost_answer("lostack");
    /// Issue 11: a database error while marking is reported as one.
    relay_reports_a_failed_mark_as_a_database_error("markerr");
    /// A database blip while marking loses no result (given up after
    /// 0.6 s before: the rows left to their leases).
    relay_rides_out_a_database_blip_while_marking("markblip");
    /// Issue 11: a lost mark whose read-back fails too is a database error,
    /// not a takeover (failed before: counted and logged as fenced out).
    relay_reports_an_unreadable_lost_mark_as_a_database_error("markread");
    /// Issue 11: a failed mark stage stops the relay with an error naming it,
    /// and the batches queued behind it are released.
    relay_stops_with_an_error_when_its_mark_stage_fails("markpanic");
    /// Issue 12: a batch that failed alike is one failure write per
    /// attempt (failed before: one per row).
    relay_writes_a_batch_of_failures_at_once("failbatch");
}
