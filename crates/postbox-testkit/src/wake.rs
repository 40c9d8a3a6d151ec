//! Wake-up and idle cost (issue 12): the idle probe, what an idle relay
//! asks of its store, and how soon a woken relay delivers. Every backend
//! runs these cases through `wake_suite!`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use postbox_core::config::{HumanDuration, RelaySettings, WorkerConfig};
use postbox_core::relay::{CancellationToken, Relay, RelayReport};
use postbox_core::store::{FailureUpdate, OutboxStore};
use postbox_core::{ClaimSource, NewEvent, Status};

use crate::faults::WrappedStore;
use crate::RecordingPublisher;

fn event(app: &str, n: usize) -> NewEvent {
    NewEvent::new(app, "Woken", format!(r#"{{"n":{n}}}"#))
}

/// Enqueues one event of `app`, claims it with `lease_ms` as `worker`,
/// and, with `retry_after_ms`, records a failed attempt due that much
/// later. Returns its event id.
async fn row_of(
    store: &dyn OutboxStore,
    app: &str,
    lease_ms: i64,
    retry_after_ms: Option<i64>,
) -> String {
    let ev = event(app, 0);
    store
        .enqueue_batch(std::slice::from_ref(&ev), 1 << 20)
        .await
        .expect("enqueue");
    let req = crate::conformance::claim_request(app, "w-test", 10, lease_ms);
    let claimed = store
        .claim(ClaimSource::Pending, &req)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1, "one row claimed for {app}");
    if let Some(after) = retry_after_ms {
        let update = FailureUpdate {
            status: Status::Retryable,
            retry_count: 1,
            retry_after_ms: after,
            retry_jitter_ms: 0,
            delivered_to: Vec::new(),
            error: "test".into(),
            publisher: Some("p".into()),
        };
        let fence = claimed[0].fence();
        assert_eq!(
            store
                .mark_failed(&fence, &[claimed[0].record.id], &update)
                .await
                .expect("mark failed"),
            1
        );
    }
    ev.event_id
}

/// The idle probe answers for every app_code asked, in one call: pending
/// rows, the time to the earliest due retry and to the earliest lease end
/// (negative once due), nothing for an app_code without rows.
pub async fn due_answers_per_app_code(store: Arc<dyn OutboxStore>) {
    store
        .enqueue_batch(&[event("w-pending", 0)], 1 << 20)
        .await
        .expect("enqueue");
    row_of(store.as_ref(), "w-later", 30_000, Some(3_600_000)).await;
    row_of(store.as_ref(), "w-now", 3_600_000, Some(-1_000)).await;
    row_of(store.as_ref(), "w-leased", 600_000, None).await;
    row_of(store.as_ref(), "w-expired", -1_000, None).await;
    let apps: Vec<String> = [
        "w-pending",
        "w-later",
        "w-now",
        "w-leased",
        "w-expired",
        "w-none",
    ]
    .map(String::from)
    .to_vec();
    let mut dues = store.due(&apps).await.expect("probe");
    dues.sort_by(|a, b| a.app_code.cmp(&b.app_code));
    let by = |app: &str| {
        dues.iter()
            .find(|d| d.app_code == app)
            .unwrap_or_else(|| panic!("no answer for {app}: {dues:?}"))
            .clone()
    };
    assert_eq!(dues.len(), apps.len(), "{dues:?}");
    let pending = by("w-pending");
    assert!(pending.pending, "{pending:?}");
    assert_eq!((pending.retry_in_ms, pending.lease_in_ms), (None, None));
    let later = by("w-later");
    assert!(!later.pending && !later.retry_due() && !later.lease_expired());
    let in_ms = later.retry_in_ms.expect("a retryable row");
    assert!((3_500_000..=3_600_000).contains(&in_ms), "{later:?}");
    assert_eq!(later.next_in_ms(), Some(in_ms));
    let now = by("w-now");
    assert!(now.retry_due() && !now.pending, "{now:?}");
    let leased = by("w-leased");
    assert!(
        !leased.lease_expired() && leased.retry_in_ms.is_none(),
        "{leased:?}"
    );
    assert!(
        (500_000..=600_000).contains(&leased.lease_in_ms.expect("a lease")),
        "{leased:?}"
    );
    let expired = by("w-expired");
    assert!(expired.lease_expired() && !expired.pending, "{expired:?}");
    let none = by("w-none");
    assert!(!none.pending && none.retry_in_ms.is_none() && none.lease_in_ms.is_none());
}

/// A relay over `store` for `apps` with `config`, delivering to a
/// recording publisher: (publisher, shutdown, the running relay).
fn spawn_relay(
    store: Arc<dyn postbox_core::RelayStore>,
    config: WorkerConfig,
    apps: Vec<String>,
) -> (
    Arc<RecordingPublisher>,
    CancellationToken,
    tokio::task::JoinHandle<postbox_core::Result<RelayReport>>,
) {
    let settings = RelaySettings::new(config, apps).expect("valid settings");
    let publisher = Arc::new(RecordingPublisher::new("rec"));
    let relay = Relay::new(store, vec![publisher.clone()], settings);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(relay.run(shutdown.clone()));
    (publisher, shutdown, run)
}

/// The config of a relay that polls only every 30 s: anything sooner was
/// a wake-up.
fn slow_polling() -> WorkerConfig {
    WorkerConfig {
        poll_interval: HumanDuration::secs(30),
        ..WorkerConfig::default()
    }
}

/// Five app_codes, each with a retryable row due in an hour and a live
/// lease, none pending, the default poll interval: the idle relay asks its
/// store at most about once a second (one probe for all app_codes), not
/// three claim queries per app_code per poll.
pub async fn idle_relay_makes_one_store_call_per_second(store: Arc<dyn OutboxStore>) {
    let apps: Vec<String> = (0..5).map(|i| format!("idle-{i}")).collect();
    for app in &apps {
        row_of(store.as_ref(), app, 30_000, Some(3_600_000)).await;
        row_of(store.as_ref(), app, 3_600_000, None).await;
    }
    let counting = Arc::new(WrappedStore::new(store));
    let (publisher, shutdown, run) = spawn_relay(counting.clone(), WorkerConfig::default(), apps);
    tokio::time::sleep(Duration::from_millis(5_200)).await;
    let calls = counting.calls();
    shutdown.cancel();
    let report = run.await.expect("relay task").expect("relay run");
    assert_eq!(report.claimed, 0, "nothing was due: {report:?}");
    assert!(publisher.delivered().is_empty());
    assert!(calls >= 1, "the relay looked at least once");
    assert!(
        calls <= 7,
        "an idle relay over 5 app_codes made {calls} store calls in ~5 s (at most ~1/s allowed)"
    );
}

/// An idle relay over 20.5 s at the default config (`poll_interval` 1 s,
/// a heartbeat every 10 s): at most 21 round trips in all, heartbeats
/// included (each takes the place of a probe). Before, the two beats of
/// the window came on top of about 20 probes.
pub async fn an_idle_relays_heartbeat_stays_within_one_call_per_second(
    store: Arc<dyn OutboxStore>,
) {
    let counting = Arc::new(WrappedStore::new(store));
    let (publisher, shutdown, run) = spawn_relay(
        counting.clone(),
        WorkerConfig::default(),
        vec!["idle-beat".to_owned()],
    );
    // Past the start (its first probe and the registering beat).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let (calls, beats) = (counting.calls(), counting.beats());
    tokio::time::sleep(Duration::from_millis(20_500)).await;
    let (calls, beats) = (counting.calls() - calls, counting.beats() - beats);
    shutdown.cancel();
    run.await.expect("relay task").expect("relay run");
    assert!(publisher.delivered().is_empty());
    assert!(beats >= 2, "the idle relay beat {beats} times in 20.5 s");
    assert!(
        calls <= 21,
        "an idle relay made {calls} round trips in 20.5 s ({beats} of them heartbeats): at most one per second allowed"
    );
}

/// An idle relay polling every 12 s (longer than a heartbeat, 10 s) still
/// looks at its store between heartbeats: about every 13 s over 30 s.
/// Each round found a heartbeat handed over and wrote it in place of its
/// probe, then slept a whole poll, by which time the next beat waited: it
/// probed once at start and never again, so rows written by other
/// processes, retries and expired leases waited for good.
pub async fn an_idle_relay_polling_slower_than_its_heartbeat_still_probes(
    store: Arc<dyn OutboxStore>,
) {
    let counting = Arc::new(WrappedStore::new(store));
    let config = WorkerConfig {
        poll_interval: HumanDuration::secs(12),
        ..WorkerConfig::default()
    };
    let (publisher, shutdown, run) =
        spawn_relay(counting.clone(), config, vec!["slow-poll".to_owned()]);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (calls, beats) = (counting.calls(), counting.beats());
    shutdown.cancel();
    run.await.expect("relay task").expect("relay run");
    assert!(publisher.delivered().is_empty());
    assert!(
        calls - beats >= 3,
        "an idle relay polling every 12 s probed {} times in 30 s ({beats} heartbeats)",
        calls - beats
    );
}

/// A relay polling only every 30 s, gone idle, delivers an event within a
/// few seconds of `produce` writing it (which must commit it).
pub async fn an_idle_relay_wakes_for<F>(
    store: Arc<dyn OutboxStore>,
    app: &str,
    produce: F,
) -> RelayReport
where
    F: Future<Output = String>,
{
    let (publisher, shutdown, run) = spawn_relay(store, slow_polling(), vec![app.to_owned()]);
    // Idle: the first probe found nothing, the next poll is 30 s away.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let event_id = produce.await;
    let written = Instant::now();
    while !publisher.delivered_ids().contains(&event_id) {
        if written.elapsed() > Duration::from_secs(5) {
            shutdown.cancel();
            panic!("event {event_id} not delivered within 5 s of its commit (poll_interval 30 s)");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    run.await.expect("relay task").expect("relay run")
}

/// 200 commits about a millisecond apart from one producer, each waking
/// the relay (an in-process `enqueue`): the relay claims them a few at a
/// time, in fewer store calls (claims, marks, probes) than events, not a
/// claim and a mark per event, and delivers every one. For a store whose
/// commit takes well under a millisecond (SQLite), so that the producer,
/// not the commit, sets the pace.
pub async fn a_stream_of_commits_is_claimed_in_few_rounds(store: Arc<dyn OutboxStore>) {
    const N: usize = 200;
    let app = "w-stream";
    let counting = Arc::new(WrappedStore::new(store.clone()));
    let (publisher, shutdown, run) =
        spawn_relay(counting.clone(), slow_polling(), vec![app.to_owned()]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = counting.calls();
    let started = Instant::now();
    for n in 0..N {
        store
            .enqueue_batch(&[event(app, n)], 1 << 20)
            .await
            .expect("enqueue");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let written = Instant::now();
    let took = written - started;
    while publisher.delivered().len() < N {
        if written.elapsed() > Duration::from_secs(10) {
            shutdown.cancel();
            panic!("{} of {N} events delivered", publisher.delivered().len());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let calls = counting.calls() - before;
    shutdown.cancel();
    run.await.expect("relay task").expect("relay run");
    // A woken round starts no sooner than 5 ms after the one before (the
    // relay's coalescing window) and costs a claim and a mark; a few more
    // calls for the fast polls after the stream. Uncoalesced, every commit
    // is a round of its own: about 2 calls per event.
    let rounds = took.as_millis() as u64 / 5 + 10;
    assert!(
        calls <= 2 * rounds,
        "{calls} store calls for {N} events committed one by one in {took:?} \
         (at most {} expected): woken rounds are not coalesced",
        2 * rounds
    );
}

/// The events of [`an_idle_relay_wakes_for`]: one of `app`, with its id.
pub fn wake_event(app: &str) -> NewEvent {
    event(app, 1)
}

/// Generates the wake-up tests for a backend: the idle probe's answers,
/// the idle relay's store calls, and an in-process `enqueue` (in the
/// caller's transaction, committed 100 ms later) waking a relay that polls
/// every 30 s. The argument is an async fn returning a fresh, migrated
/// `SqlOutbox` of the backend.
#[macro_export]
macro_rules! wake_suite {
    ($make:path) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn due_answers_per_app_code() {
            $crate::wake::due_answers_per_app_code(std::sync::Arc::new($make().await)).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_idle_relays_heartbeat_stays_within_one_call_per_second() {
            $crate::wake::an_idle_relays_heartbeat_stays_within_one_call_per_second(
                std::sync::Arc::new($make().await),
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn idle_relay_makes_one_store_call_per_second() {
            $crate::wake::idle_relay_makes_one_store_call_per_second(std::sync::Arc::new(
                $make().await,
            ))
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn enqueue_wakes_an_idle_relay_in_the_same_process() {
            let store = $make().await;
            let producer = store.clone();
            $crate::wake::an_idle_relay_wakes_for(std::sync::Arc::new(store), "wake", async move {
                let event = $crate::wake::wake_event("wake");
                let mut tx = producer.begin_write().await.expect("begin");
                producer.enqueue(&mut tx, &event).await.expect("enqueue");
                // The caller commits a little after its enqueue signalled.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                tx.commit().await.expect("commit");
                event.event_id
            })
            .await;
        }
    };
}
