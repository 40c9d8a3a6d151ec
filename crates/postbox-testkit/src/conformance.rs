//! The conformance suite: every database backend must pass it. Each case
//! takes a freshly migrated, empty store; `conformance_suite!(make_store)`
//! turns the one list of cases (`cases!` below) into `#[tokio::test]`s for
//! one backend.
// A case function missing from `cases!` is dead code: refuse to compile.
#![deny(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use postbox_core::config::{HumanDuration, RelaySettings, WorkerConfig};
use postbox_core::event::Fence;
use postbox_core::relay::CancellationToken;
use postbox_core::relay::{Relay, RelayReport};
use postbox_core::store::{
    AppStats, ArchiveRequest, ClaimRequest, EnqueueOutcome, EventFilter, FailureUpdate,
    HistoryKind, OutboxStore, RelayStore, ReplayPick, ReplayRequest, ReplaySelector, ReplayTargets,
    HISTORY_LIMIT,
};
use postbox_core::{ClaimSource, Error, NewEvent, Publisher, Status};

use postbox_sqlx::{Dialect, SqlOutbox};

use crate::consumer_fixtures::wait_until;
use crate::RecordingPublisher;

/// Declares the conformance cases, and is their one list. Every name is a
/// private `async fn(Arc<dyn OutboxStore>)` of this module; for each this
/// makes a public runner in [`cases`] and one test in `conformance_suite!`.
///
/// A case cannot be forgotten: a case function left out of the list is
/// called by nobody, and `dead_code` is denied in this module, so the crate
/// does not compile; a listed name without its function does not compile
/// either (and a case written `pub` is caught by the test
/// `every_case_taking_only_a_store_is_listed`). `$d` is `$`, for the
/// metavariables of the generated macro.
macro_rules! cases {
    ($d:tt $($case:ident),* $(,)?) => {
        /// The conformance cases, one public runner each: `cases::NAME(store)`
        /// runs the case on a fresh, migrated, empty store.
        pub mod cases {
            $(
                #[doc = concat!("Runs the `", stringify!($case), "` conformance case.")]
                pub async fn $case(store: std::sync::Arc<dyn postbox_core::store::OutboxStore>) {
                    super::$case(store).await
                }
            )*
        }

        /// The names of the conformance cases, as listed.
        pub const CASES: &[&str] = &[$(stringify!($case)),*];

        /// Generates one `#[tokio::test]` per conformance case for a backend.
        /// The argument is an async fn returning a fresh, migrated
        /// `Arc<dyn OutboxStore>`; the cases are the ones declared in
        /// `postbox_testkit::conformance`, all of them.
        #[macro_export]
        macro_rules! conformance_suite {
            ($d make:path) => {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $case() {
                        $d crate::conformance::cases::$case($d make().await).await;
                    }
                )*
            };
        }
    };
}

cases! {$
    claim_pending_takes_batches_and_leases,
    claim_deals_a_batch_across_event_types,
    mark_delivered_is_fenced,
    failed_attempt_becomes_retryable_after_backoff,
    failed_attempts_of_a_batch_are_one_write,
    expired_lease_is_taken_over_and_counted,
    release_returns_rows_without_an_attempt,
    replay_keeps_event_id_and_resets_retry_count,
    duplicate_and_oversized_enqueue_are_typed_errors,
    stats_count_by_status,
    list_filters_newest_first,
    concurrent_claims_never_share_a_row,
    relay_delivers_everything,
    relay_fanout_retries_only_the_failed_publisher,
    relay_keeps_pace_when_a_publisher_hangs,
    relay_publishes_as_many_batches_at_once_as_its_publisher_takes,
    relay_keeps_pace_when_a_publisher_is_slow,
    relay_waits_when_every_publisher_is_behind,
    relay_claims_fairly_across_app_codes,
    relay_dead_letters_poison_while_others_flow,
    relay_follows_the_backoff_schedule,
    relay_dead_letters_an_event_whose_last_lease_expired,
    relay_dead_letters_an_event_taken_over_on_its_last_attempt_and_given_back,
    a_relay_crash_costs_only_the_crashing_events_attempts,
    relay_shutdown_releases_and_leaves_nothing_delivering,
    relay_skips_retries_for_at_most_once_types,
    relay_orders_events_per_aggregate,
    relay_orders_an_aggregate_mixing_versions_and_nulls,
    ordered_claim_skips_held_aggregates_in_age_order,
    ordered_claim_reaches_past_many_held_aggregates,
    ordered_claim_reads_past_a_paused_type,
    ordered_claim_finds_events_without_an_aggregate_behind_held_followers,
    archive_moves_past_live_duplicates_of_archived_events,
    a_replay_without_an_app_code_reaches_a_tenant_all_archived,
    stuck_aggregates_are_heads_that_cannot_move,
    history_records_attempts_dead_letters_and_replays,
    replay_goes_only_to_publishers_that_did_not_confirm,
    archived_rows_are_found_and_listed,
    events_are_searched_by_aggregate_in_the_table_and_the_archive,
    a_paced_replay_walks_its_rows_in_id_order_by_batches,
    controls_are_set_cleared_and_logged,
    relay_applies_controls_while_it_runs,
    relay_holds_a_paused_event_type_and_delivers_the_others,
    a_paused_types_due_retries_do_not_hold_back_the_others,
    relays_register_by_their_heartbeats,
    relay_samples_a_type_and_drops_the_rest,
}

const APP: &str = "conf";

/// A worker config with short intervals, for tests.
pub fn fast_worker() -> WorkerConfig {
    WorkerConfig {
        poll_interval: HumanDuration::millis(20),
        batch_size: 50,
        publish_timeout: HumanDuration::secs(2),
        lease: HumanDuration::secs(10),
        max_retry_count: 3,
        initial_backoff: HumanDuration::millis(50),
        max_backoff: HumanDuration::millis(200),
        ..WorkerConfig::default()
    }
}

/// [`fast_worker`] retrying a failed row up to `max_retry_count` times,
/// backing off from `initial_backoff_ms` to at most `max_backoff_ms`.
pub fn retrying_worker(
    max_retry_count: u32,
    initial_backoff_ms: u64,
    max_backoff_ms: u64,
) -> WorkerConfig {
    WorkerConfig {
        max_retry_count,
        initial_backoff: HumanDuration::millis(initial_backoff_ms),
        max_backoff: HumanDuration::millis(max_backoff_ms),
        ..fast_worker()
    }
}

/// Fences that are not `fence`'s claim's: `[another worker's, another
/// lease end's]`. A mark or release under either writes nothing.
pub fn wrong_fences(fence: &Fence) -> [Fence; 2] {
    let wrong_worker = Fence {
        worker_id: format!("not-{}", fence.worker_id),
        ..fence.clone()
    };
    let wrong_lease = Fence {
        lock_until_ms: fence.lock_until_ms + 1,
        ..fence.clone()
    };
    [wrong_worker, wrong_lease]
}

fn events(n: usize, event_type: &str) -> Vec<NewEvent> {
    (0..n)
        .map(|i| {
            NewEvent::new(APP, event_type, format!(r#"{{"n":{i}}}"#))
                .aggregate(format!("agg-{}", i % 7), i as i64)
        })
        .collect()
}

async fn enqueue(store: &dyn OutboxStore, evs: &[NewEvent]) {
    let out = store.enqueue_batch(evs, 1 << 20).await.expect("enqueue");
    assert!(out.iter().all(|o| matches!(o, EnqueueOutcome::Inserted(_))));
}

/// Whether a claim from `source` by `worker` finds nothing to take.
async fn claims_nothing(store: &dyn OutboxStore, source: ClaimSource, worker: &str) -> bool {
    let claimed = store.claim(source, &req(worker, 10, 30_000)).await;
    claimed.expect("claim").is_empty()
}

fn req<'a>(worker: &'a str, limit: u32, lease_ms: i64) -> ClaimRequest<'a> {
    claim_request(APP, worker, limit, lease_ms)
}

/// An unordered claim of up to `limit` rows of `app_code` by `worker`.
pub(crate) fn claim_request<'a>(
    app_code: &'a str,
    worker: &'a str,
    limit: u32,
    lease_ms: i64,
) -> ClaimRequest<'a> {
    ClaimRequest {
        app_code,
        limit,
        worker_id: worker,
        lease_ms,
        ordered: false,
        skip_types: &[],
    }
}

/// A first failed attempt by `publisher`, due again at once.
fn first_failure_due_now(error: &str, publisher: &str) -> FailureUpdate {
    FailureUpdate {
        status: Status::Retryable,
        retry_count: 1,
        retry_after_ms: 0,
        retry_jitter_ms: 0,
        delivered_to: vec![],
        error: error.into(),
        publisher: Some(publisher.into()),
    }
}

async fn stats(store: &dyn OutboxStore) -> AppStats {
    app_stats(store, APP).await
}

/// The counts of `app`.
pub async fn app_stats(store: &dyn OutboxStore, app: &str) -> AppStats {
    store
        .stats(&[app.to_owned()])
        .await
        .expect("stats")
        .remove(0)
}

async fn status_of(store: &dyn OutboxStore, event_id: &str) -> postbox_core::EventRecord {
    let mut rows = store.find(event_id).await.expect("find");
    assert_eq!(rows.len(), 1, "one row for {event_id}");
    rows.remove(0)
}

/// Runs a relay until `done(stats)` holds (30 s at most), then stops it.
pub async fn run_relay_until(
    store: Arc<dyn OutboxStore>,
    publishers: Vec<Arc<dyn Publisher>>,
    config: WorkerConfig,
    done: impl Fn(&AppStats) -> bool,
) -> RelayReport {
    run_relay_until_for(store, publishers, config, APP, done).await
}

/// Runs a relay (3 s lease, 1 s publish timeout) on `app_code` until
/// `events`, its only rows not yet delivered, all are, and checks that each
/// was delivered on its first attempt. Returns the relay's publisher and
/// how long the relay took.
pub async fn relay_delivers_each_once(
    store: Arc<dyn OutboxStore>,
    app_code: &str,
    events: &[NewEvent],
) -> (Arc<RecordingPublisher>, Duration) {
    let p = Arc::new(RecordingPublisher::new("rec"));
    let config = WorkerConfig {
        lease: HumanDuration::secs(3),
        publish_timeout: HumanDuration::secs(1),
        ..fast_worker()
    };
    let started = Instant::now();
    let delivered = events.len() as i64;
    run_relay_until_for(store.clone(), vec![p.clone()], config, app_code, |s| {
        s.delivered == delivered
    })
    .await;
    let took = started.elapsed();
    for e in events {
        let row = store.find(&e.event_id).await.unwrap().remove(0);
        assert_eq!(row.status, Status::Delivered, "{row:?}");
        assert_eq!(row.retry_count, 0, "{row:?}");
    }
    (p, took)
}

/// Issue 9.3: a producer's open transaction holding an uncommitted outbox
/// row must not stall the relay. On a small table MariaDB plans `id IN (…)`
/// as a whole-primary-key scan; at REPEATABLE READ the scan waited for the
/// producer's row lock (50 s), the lease expired and rows were published
/// twice. Every relay statement must lock only the rows it names: the
/// rows committed after the open one are claimed, marked, failed,
/// released and taken over within seconds, a relay delivers rows committed
/// after it once each, and the producer still commits. Not a listed case:
/// the producer's transaction needs the backend's own store.
pub async fn an_open_producer_transaction_stalls_nothing<D>(store: SqlOutbox<D>)
where
    D: Dialect,
    SqlOutbox<D>: OutboxStore,
{
    use tokio::time::timeout;
    let outbox: &dyn OutboxStore = &store;
    let quick = Duration::from_secs(5);
    // The producer inserts first and keeps its transaction open throughout.
    let mut producer = store.pool().begin().await.unwrap();
    let open = NewEvent::new("room", "Open", "{}");
    store.enqueue(&mut producer, &open).await.unwrap();
    let mut committed = Vec::new();
    for i in 0..6 {
        let mut tx = store.pool().begin().await.unwrap();
        let e = NewEvent::new("room", "E", format!("{{\"i\":{i}}}"));
        committed.push(store.enqueue(&mut tx, &e).await.unwrap());
        tx.commit().await.unwrap();
    }
    // The ids `worker` claims from `source` with a lease of `lease_ms`,
    // and the claim, unless it waits longer than `quick` (on a lock).
    let claim_within = async |source, worker, lease_ms, what: &str| {
        let req = claim_request("room", worker, 10, lease_ms);
        let claimed = timeout(quick, outbox.claim(source, &req))
            .await
            .unwrap_or_else(|_| panic!("{what} waited"))
            .unwrap();
        let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
        (ids, claimed)
    };

    // Claim, then mark, fail and release: each within seconds.
    let (ids, claimed) = claim_within(ClaimSource::Pending, "w1", 30_000, "claim").await;
    assert_eq!(ids, committed);
    let fence = claimed[0].fence();
    let delivered = timeout(quick, outbox.mark_delivered(&fence, &committed[..3]))
        .await
        .expect("mark_delivered waited on the producer's row")
        .unwrap();
    assert_eq!(delivered, 3);
    let failure = first_failure_due_now("boom", "p");
    assert_eq!(
        timeout(quick, outbox.mark_failed(&fence, &[committed[3]], &failure))
            .await
            .expect("mark_failed waited on the producer's row")
            .unwrap(),
        1
    );
    let released = timeout(quick, outbox.release(&fence, &committed[4..]))
        .await
        .expect("release waited on the producer's row")
        .unwrap();
    assert_eq!(released, 2);

    // The released and the retryable rows come back; an expired lease is
    // taken over (with its history entry) without waiting either.
    let (again, _) = claim_within(ClaimSource::Pending, "w2", 1, "second claim").await;
    assert_eq!(again, committed[4..]);
    let (retry, _) = claim_within(ClaimSource::DueRetry, "w2", 30_000, "retry claim").await;
    assert_eq!(retry, [committed[3]]);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (taken, claimed) = claim_within(ClaimSource::ExpiredLease, "w3", 30_000, "takeover").await;
    assert_eq!(taken, committed[4..]);
    let done = timeout(quick, outbox.mark_delivered(&claimed[0].fence(), &taken))
        .await
        .expect("mark_delivered after takeover waited")
        .unwrap();
    assert_eq!(done, 2);

    // A relay delivers rows committed after the open row, each once, and
    // only them.
    let relay_events: Vec<NewEvent> = (0..5).map(|_| NewEvent::new("relay", "R", "{}")).collect();
    outbox.enqueue_batch(&relay_events, 1024).await.unwrap();
    let (p, took) = relay_delivers_each_once(Arc::new(store.clone()), "relay", &relay_events).await;
    assert!(took < Duration::from_secs(3), "took {took:?}");
    for e in &relay_events {
        assert_eq!(p.attempts(&e.event_id), 1, "published once: {}", e.event_id);
    }
    assert_eq!(
        p.offers().len(),
        relay_events.len(),
        "only the relay's rows"
    );

    // The producer's transaction was open all along, and still commits.
    producer.commit().await.unwrap();
}

/// [`run_relay_until`] for the tenant `app`.
pub async fn run_relay_until_for(
    store: Arc<dyn OutboxStore>,
    publishers: Vec<Arc<dyn Publisher>>,
    config: WorkerConfig,
    app: &str,
    done: impl Fn(&AppStats) -> bool,
) -> RelayReport {
    run_relay_over_until(store.clone(), store.as_ref(), publishers, config, app, done).await
}

/// [`run_relay_until_for`] with a relay over `relay_store` (a wrapper of
/// `store` that injects faults, say) while `store` is watched.
pub async fn run_relay_over_until(
    relay_store: Arc<dyn RelayStore>,
    store: &dyn OutboxStore,
    publishers: Vec<Arc<dyn Publisher>>,
    config: WorkerConfig,
    app: &str,
    done: impl Fn(&AppStats) -> bool,
) -> RelayReport {
    let shutdown = CancellationToken::new();
    let settings =
        RelaySettings::new(config, vec![app.to_owned()]).expect("a valid [outbox_worker]");
    let relay = Relay::new(relay_store, publishers, settings);
    let handle = tokio::spawn(relay.run(shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = app_stats(store, app).await;
        if done(&s) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "relay did not reach the expected state in 30 s: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    handle.await.expect("relay task").expect("relay run")
}

/// Pending rows are claimed in batches of at most `limit`, oldest first,
/// leased to the worker on the database clock, and claimed once; another
/// tenant's rows are never claimed.
async fn claim_pending_takes_batches_and_leases(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(5, "T")).await;
    enqueue(store.as_ref(), &[NewEvent::new("conf_other", "T", "{}")]).await;
    let before = store.now_ms().await.unwrap();
    let first = store
        .claim(ClaimSource::Pending, &req("w1", 3, 30_000))
        .await
        .unwrap();
    let after = store.now_ms().await.unwrap();
    assert_eq!(first.len(), 3);
    for c in &first {
        assert_eq!(c.source, ClaimSource::Pending);
        assert_eq!(c.record.status, Status::Delivering);
        assert_eq!(c.record.worker_id.as_deref(), Some("w1"));
        assert!(
            (before + 30_000 - 5..=after + 30_000).contains(&c.record.lock_until_ms),
            "lease on the database clock"
        );
        assert_eq!(c.fence(), first[0].fence(), "one fence per claim");
    }
    // The database agrees with what claim returned.
    let stored = status_of(store.as_ref(), &first[0].record.event_id).await;
    assert_eq!(stored.status, Status::Delivering);
    assert_eq!(stored.worker_id.as_deref(), Some("w1"));
    assert_eq!(stored.lock_until_ms, first[0].record.lock_until_ms);
    assert_eq!(stored.updated_at_ms, first[0].record.updated_at_ms);
    let second = store
        .claim(ClaimSource::Pending, &req("w2", 3, 30_000))
        .await
        .unwrap();
    assert_eq!(second.len(), 2);
    assert!(claims_nothing(store.as_ref(), ClaimSource::Pending, "w3").await);
    assert!(
        claims_nothing(store.as_ref(), ClaimSource::ExpiredLease, "w3").await,
        "live leases are not taken"
    );
    let mut ids: Vec<_> = first.iter().chain(&second).map(|c| c.record.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5);
    let mut oldest: Vec<_> = first.iter().map(|c| c.record.id).collect();
    oldest.sort();
    assert_eq!(oldest, ids[..3], "oldest first");
    assert_eq!(stats(store.as_ref()).await.delivering, 5);
}

/// A pending claim deals its batch across event types (SPEC §3): a flood
/// of one type, written first, does not hold back another type's fresh
/// events by even one batch; within a type rows go in insertion order; a
/// lone type gets the whole batch. The backlog's oldest pending row is the
/// oldest of every type, not of the first type by name.
async fn claim_deals_a_batch_across_event_types(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(40, "Zflood")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    enqueue(store.as_ref(), &events(2, "Fresh")).await;
    enqueue(store.as_ref(), &events(1, "Another")).await;
    let app = stats(store.as_ref()).await;
    assert!(
        app.oldest_pending_age_seconds >= 0.25,
        "the oldest pending row is the flood's: {} s",
        app.oldest_pending_age_seconds
    );
    let batch = store
        .claim(ClaimSource::Pending, &req("w1", 6, 30_000))
        .await
        .unwrap();
    let of = |t: &str| -> Vec<i64> {
        let mut ids: Vec<i64> = batch
            .iter()
            .filter(|c| c.record.event_type == t)
            .map(|c| c.record.id)
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(batch.len(), 6);
    assert_eq!(of("Fresh").len(), 2, "both fresh events in the first batch");
    assert_eq!(of("Another").len(), 1, "the lone event in the first batch");
    let flood = of("Zflood");
    assert_eq!(flood.len(), 3, "the flood gets the rest of the batch");
    // The flood's oldest rows, in insertion order, from claim to claim.
    let mut taken = flood;
    loop {
        let next = store
            .claim(ClaimSource::Pending, &req("w1", 6, 30_000))
            .await
            .unwrap();
        if next.is_empty() {
            break;
        }
        assert!(next.iter().all(|c| c.record.event_type == "Zflood"));
        let mut ids: Vec<i64> = next.iter().map(|c| c.record.id).collect();
        ids.sort();
        assert!(
            ids.first() > taken.last(),
            "a lone type goes in insertion order: {ids:?} after {taken:?}"
        );
        assert!(
            next.len() == 6 || taken.len() + next.len() == 40,
            "a lone type fills the batch"
        );
        taken.extend(ids);
    }
    assert_eq!(taken.len(), 40);
}

/// Only the claim that holds the lease can mark a row delivered (or
/// failed, or release it); a delivered row is no longer leased.
async fn mark_delivered_is_fenced(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(3, "T")).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 2, 30_000))
        .await
        .unwrap();
    let others = store
        .claim(ClaimSource::Pending, &req("w2", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(others.len(), 1);
    let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
    let fence = claimed[0].fence();
    assert_eq!(
        store
            .mark_delivered(&fence, &[others[0].record.id])
            .await
            .unwrap(),
        0,
        "another claim's row"
    );
    let [wrong_worker, wrong_lease] = wrong_fences(&fence);
    assert_eq!(store.mark_delivered(&wrong_worker, &ids).await.unwrap(), 0);
    assert_eq!(store.mark_delivered(&wrong_lease, &ids).await.unwrap(), 0);
    let failure = first_failure_due_now("late", "p");
    assert_eq!(
        store
            .mark_failed(&wrong_worker, &ids, &failure)
            .await
            .unwrap(),
        0
    );
    assert_eq!(store.release(&wrong_lease, &ids).await.unwrap(), 0);
    assert_eq!(store.mark_delivered(&fence, &[]).await.unwrap(), 0);
    assert_eq!(store.mark_delivered(&fence, &ids).await.unwrap(), 2);
    assert_eq!(
        store.mark_delivered(&fence, &ids).await.unwrap(),
        0,
        "a delivered row is never marked twice"
    );
    let s = stats(store.as_ref()).await;
    assert_eq!((s.delivered, s.delivering), (2, 1));
    let row = status_of(store.as_ref(), &claimed[0].record.event_id).await;
    assert_eq!((row.status, row.lock_until_ms), (Status::Delivered, 0));
    let other = status_of(store.as_ref(), &others[0].record.event_id).await;
    assert_eq!(other.status, Status::Delivering);
}

/// A failed attempt makes the row retryable, no longer leased, due after
/// the backoff, and only the due-retry claim takes it, keeping its
/// progress; a dead-lettered row is claimed by nobody.
async fn failed_attempt_becomes_retryable_after_backoff(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(2, "T")).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 10, 30_000))
        .await
        .unwrap();
    let fence = claimed[0].fence();
    let (late, soon) = (&claimed[0].record, &claimed[1].record);
    let update = |after: i64| FailureUpdate {
        status: Status::Retryable,
        retry_count: 1,
        retry_after_ms: after,
        retry_jitter_ms: 0,
        delivered_to: vec!["rabbit".into()],
        error: "broker said no".into(),
        publisher: Some("p".into()),
    };
    assert_eq!(
        store
            .mark_failed(&fence, &[late.id], &update(60_000))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store
            .mark_failed(&fence, &[soon.id], &update(0))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store
            .mark_failed(&fence, &[soon.id], &update(0))
            .await
            .unwrap(),
        0,
        "fenced: no longer leased"
    );

    let row = status_of(store.as_ref(), &late.event_id).await;
    assert_eq!(row.status, Status::Retryable);
    assert_eq!(row.retry_count, 1);
    assert_eq!(row.last_error.as_deref(), Some("broker said no"));
    assert_eq!(row.delivered_to, vec!["rabbit".to_string()]);
    assert_eq!(row.lock_until_ms, 0);
    let wait = row.next_retry_at_ms - row.updated_at_ms;
    assert!(
        (59_000..=60_000).contains(&wait),
        "due 60 s after the failure, got {wait} ms"
    );

    assert!(claims_nothing(store.as_ref(), ClaimSource::Pending, "w2").await);
    let due = store
        .claim(ClaimSource::DueRetry, &req("w2", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(due.len(), 1, "only the row whose backoff is over");
    assert_eq!(due[0].source, ClaimSource::DueRetry);
    assert_eq!(due[0].record.event_id, soon.event_id);
    assert_eq!(due[0].record.retry_count, 1);
    assert_eq!(due[0].record.delivered_to, vec!["rabbit".to_string()]);
    assert!(
        claims_nothing(store.as_ref(), ClaimSource::DueRetry, "w3").await,
        "a due row is claimed once"
    );

    // Dead letter: neither claim takes it.
    let dead = FailureUpdate {
        status: Status::Failed,
        retry_count: 2,
        ..update(0)
    };
    assert_eq!(
        store
            .mark_failed(&due[0].fence(), &[soon.id], &dead)
            .await
            .unwrap(),
        1
    );
    let row = status_of(store.as_ref(), &soon.event_id).await;
    assert_eq!((row.status, row.retry_count), (Status::Failed, 2));
    assert!(claims_nothing(store.as_ref(), ClaimSource::DueRetry, "w3").await);
    assert!(claims_nothing(store.as_ref(), ClaimSource::Pending, "w3").await);
}

/// A batch's rows that failed alike are one write: every row still held
/// gets the attempt and one history entry, a row no longer held gets
/// neither, and the due times spread over the jitter by id.
async fn failed_attempts_of_a_batch_are_one_write(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(6, "T")).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 6);
    let fence = claimed[0].fence();
    let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
    // One row is no longer held by the time the failures are written.
    assert_eq!(store.mark_delivered(&fence, &ids[..1]).await.unwrap(), 1);
    let update = FailureUpdate {
        status: Status::Retryable,
        retry_count: 1,
        retry_after_ms: 60_000,
        retry_jitter_ms: 10_000,
        delivered_to: vec![],
        error: "hook: 503".into(),
        publisher: Some("hook".into()),
    };
    let [wrong_worker, _] = wrong_fences(&fence);
    assert_eq!(
        store
            .mark_failed(&wrong_worker, &ids, &update)
            .await
            .unwrap(),
        0,
        "a stale fence writes nothing"
    );
    assert_eq!(store.mark_failed(&fence, &ids, &update).await.unwrap(), 5);
    let mut due = Vec::new();
    for c in &claimed[1..] {
        let row = status_of(store.as_ref(), &c.record.event_id).await;
        assert_eq!((row.status, row.retry_count), (Status::Retryable, 1));
        assert_eq!(row.last_error.as_deref(), Some("hook: 503"));
        let wait = row.next_retry_at_ms - row.updated_at_ms;
        assert!(
            (50_000..=60_000).contains(&wait),
            "due within the jitter before 60 s, got {wait} ms"
        );
        due.push(wait);
        let h = store.history(&c.record.event_id).await.unwrap();
        assert_eq!(h.len(), 1, "one entry per failed row: {h:?}");
        assert_eq!((h[0].kind, h[0].attempt), (HistoryKind::Failed, 1));
        assert_eq!(h[0].publisher.as_deref(), Some("hook"));
    }
    due.sort();
    due.dedup();
    assert!(due.len() > 1, "rows failing together are spread: {due:?}");
    let delivered = &claimed[0].record.event_id;
    assert_eq!(
        status_of(store.as_ref(), delivered).await.status,
        Status::Delivered
    );
    assert!(store.history(delivered).await.unwrap().is_empty());
    assert_eq!(
        store.mark_failed(&fence, &ids, &update).await.unwrap(),
        0,
        "written once"
    );
    for c in &claimed[1..] {
        assert_eq!(store.history(&c.record.event_id).await.unwrap().len(), 1);
    }
}

/// An expired lease is taken over, counted as an attempt and noted as the
/// last error, and the old holder's late result is dropped.
async fn expired_lease_is_taken_over_and_counted(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(1, "T")).await;
    let old = store
        .claim(ClaimSource::Pending, &req("slow", 10, 500))
        .await
        .unwrap();
    assert_eq!(old.len(), 1);
    assert!(claims_nothing(store.as_ref(), ClaimSource::ExpiredLease, "w2").await);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let new = store
        .claim(ClaimSource::ExpiredLease, &req("w2", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(new.len(), 1);
    assert_eq!(new[0].source, ClaimSource::ExpiredLease);
    let taken = &new[0].record;
    assert_eq!(taken.status, Status::Delivering);
    assert_eq!(taken.retry_count, 1, "the lost attempt counts");
    assert_eq!(taken.worker_id.as_deref(), Some("w2"));
    assert_eq!(taken.event_id, old[0].record.event_id);
    assert_eq!(
        taken.last_error.as_deref(),
        Some("lease expired while held by slow")
    );
    assert!(taken.lock_until_ms > store.now_ms().await.unwrap());
    // The database agrees with what claim returned.
    let stored = status_of(store.as_ref(), &taken.event_id).await;
    assert_eq!(
        (
            stored.status,
            stored.retry_count,
            stored.worker_id.as_deref(),
            stored.last_error.as_deref()
        ),
        (
            Status::Delivering,
            1,
            Some("w2"),
            taken.last_error.as_deref()
        )
    );

    let id = old[0].record.id;
    assert_eq!(
        store.mark_delivered(&old[0].fence(), &[id]).await.unwrap(),
        0,
        "late result dropped"
    );
    let late_failure = FailureUpdate {
        status: Status::Failed,
        retry_count: 9,
        retry_after_ms: 0,
        retry_jitter_ms: 0,
        delivered_to: vec![],
        error: "late".into(),
        publisher: Some("p".into()),
    };
    assert_eq!(
        store
            .mark_failed(&old[0].fence(), &[id], &late_failure)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        store.mark_delivered(&new[0].fence(), &[id]).await.unwrap(),
        1
    );
    let row = status_of(store.as_ref(), &new[0].record.event_id).await;
    assert_eq!(row.status, Status::Delivered);
    assert_eq!(row.retry_count, 1);
    assert!(claims_nothing(store.as_ref(), ClaimSource::ExpiredLease, "w3").await);
}

/// Released rows are claimable again at once, with no attempt counted: a
/// row never attempted goes back `pending`, one with attempts `retryable`
/// (due at once), and neither is leased to anyone.
async fn release_returns_rows_without_an_attempt(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(4, "T")).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 10, 30_000))
        .await
        .unwrap();
    let mut ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
    // The last row failed once and is taken again: it has an attempt.
    let attempted = ids.pop().unwrap();
    let retry_now = first_failure_due_now("e", "p");
    assert_eq!(
        store
            .mark_failed(&claimed[0].fence(), &[attempted], &retry_now)
            .await
            .unwrap(),
        1
    );
    let retried = store
        .claim(ClaimSource::DueRetry, &req("w1", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(retried.len(), 1);
    assert_eq!(
        store
            .release(
                &Fence {
                    worker_id: "x".into(),
                    ..claimed[0].fence()
                },
                &ids
            )
            .await
            .unwrap(),
        0
    );
    assert_eq!(store.release(&claimed[0].fence(), &[]).await.unwrap(), 0);
    assert_eq!(store.release(&claimed[0].fence(), &ids).await.unwrap(), 3);
    assert_eq!(store.release(&claimed[0].fence(), &ids).await.unwrap(), 0);
    assert_eq!(
        store
            .release(&retried[0].fence(), &[attempted])
            .await
            .unwrap(),
        1
    );
    for c in &claimed {
        let row = status_of(store.as_ref(), &c.record.event_id).await;
        let back = if row.id == attempted {
            (Status::Retryable, 1)
        } else {
            (Status::Pending, 0)
        };
        assert_eq!((row.status, row.retry_count), back, "{row:?}");
        assert_eq!((row.next_retry_at_ms, row.lock_until_ms), (0, 0));
        assert_eq!(row.worker_id, None);
    }
    let again = store
        .claim(ClaimSource::Pending, &req("w2", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(again.len(), 3);
    assert!(again.iter().all(|c| c.record.retry_count == 0));
    let due = store
        .claim(ClaimSource::DueRetry, &req("w2", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(
        (due[0].record.id, due[0].record.retry_count),
        (attempted, 1)
    );
}

/// Replay puts rows back to pending with retry_count 0 and the same
/// event_id; a dry run changes nothing.
async fn replay_keeps_event_id_and_resets_retry_count(store: Arc<dyn OutboxStore>) {
    let evs = events(3, "T");
    enqueue(store.as_ref(), &evs).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 10, 30_000))
        .await
        .unwrap();
    let fence = claimed[0].fence();
    for c in &claimed {
        let dead = FailureUpdate {
            status: Status::Failed,
            retry_count: 10,
            retry_after_ms: 0,
            retry_jitter_ms: 0,
            delivered_to: vec![],
            error: "gone".into(),
            publisher: Some("p".into()),
        };
        assert_eq!(
            store
                .mark_failed(&fence, &[c.record.id], &dead)
                .await
                .unwrap(),
            1
        );
    }
    assert_eq!(stats(store.as_ref()).await.failed, 3);

    let by_id = ReplaySelector::EventIds {
        app_code: None,
        event_ids: vec![evs[0].event_id.clone()],
    };
    let dry = store.replay(&by_id, true, "test").await.unwrap();
    assert_eq!(dry.len(), 1);
    assert_eq!(
        stats(store.as_ref()).await.failed,
        3,
        "dry run changes nothing"
    );
    let done = store.replay(&by_id, false, "test").await.unwrap();
    assert_eq!(done.len(), 1);
    let row = status_of(store.as_ref(), &evs[0].event_id).await;
    assert_eq!(
        (row.status, row.retry_count, row.replay_count),
        (Status::Pending, 0, 1)
    );
    assert_eq!(row.event_id, evs[0].event_id);

    let by_status = ReplaySelector::Filter(EventFilter {
        app_code: Some(APP.into()),
        status: Some(Status::Failed),
        ..Default::default()
    });
    assert_eq!(
        store.replay(&by_status, true, "test").await.unwrap().len(),
        2
    );
    assert_eq!(
        store.replay(&by_status, false, "test").await.unwrap().len(),
        2
    );
    let s = stats(store.as_ref()).await;
    assert_eq!((s.pending, s.failed), (3, 0));

    // A replayed row is marked as such for consumers.
    let p = Arc::new(RecordingPublisher::new("rec"));
    run_relay_until(store.clone(), vec![p.clone()], fast_worker(), |s| {
        s.delivered == 3
    })
    .await;
    assert!(p
        .delivered()
        .iter()
        .all(|(_, attempt, replayed)| *attempt == 1 && *replayed));
}

/// Duplicates and oversized payloads are typed errors, and nothing is
/// written for them.
async fn duplicate_and_oversized_enqueue_are_typed_errors(store: Arc<dyn OutboxStore>) {
    let e = NewEvent::new(APP, "T", "{}");
    assert_eq!(
        store
            .enqueue_batch(std::slice::from_ref(&e), 1024)
            .await
            .unwrap()
            .len(),
        1
    );
    let again = store
        .enqueue_batch(&[e.clone(), NewEvent::new(APP, "T", "{}")], 1024)
        .await
        .unwrap();
    assert_eq!(again[0], EnqueueOutcome::Duplicate);
    assert!(
        matches!(again[1], EnqueueOutcome::Inserted(_)),
        "a duplicate does not spoil the batch"
    );
    // The same event id in another app_code is a different event.
    let other_app = NewEvent {
        app_code: "other".into(),
        ..e.clone()
    };
    assert!(matches!(
        store.enqueue_batch(&[other_app], 1024).await.unwrap()[0],
        EnqueueOutcome::Inserted(_)
    ));

    let big = NewEvent::new(APP, "T", "x".repeat(2048));
    match store.enqueue_batch(&[big], 1024).await {
        Err(Error::PayloadTooLarge {
            size: 2048,
            limit: 1024,
            ..
        }) => {}
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    assert_eq!(stats(store.as_ref()).await.pending, 2);
}

/// Status counts and the backlog figures, per app_code; an app_code
/// without rows counts nothing.
async fn stats_count_by_status(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), &events(5, "T")).await;
    enqueue(store.as_ref(), &[NewEvent::new("conf_other", "T", "{}")]).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 4, 30_000))
        .await
        .unwrap();
    let fence = claimed[0].fence();
    store
        .mark_delivered(&fence, &[claimed[0].record.id])
        .await
        .unwrap();
    let retry_now = first_failure_due_now("e", "p");
    store
        .mark_failed(&fence, &[claimed[1].record.id], &retry_now)
        .await
        .unwrap();
    let dead = FailureUpdate {
        status: Status::Failed,
        ..first_failure_due_now("e", "p")
    };
    store
        .mark_failed(&fence, &[claimed[2].record.id], &dead)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let all = store
        .stats(&[APP.to_owned(), "conf_other".to_owned(), "nobody".to_owned()])
        .await
        .expect("stats");
    let s = &all[0];
    assert_eq!(s.app_code, APP);
    assert_eq!(
        (s.pending, s.delivering, s.delivered, s.retryable, s.failed),
        (1, 1, 1, 1, 1)
    );
    assert_eq!(s.retryable_due, 1);
    assert!(s.oldest_pending_age_seconds > 0.0);
    assert_eq!(
        (all[1].app_code.as_str(), all[1].pending),
        ("conf_other", 1)
    );
    assert_eq!(
        all[2],
        AppStats {
            app_code: "nobody".into(),
            ..Default::default()
        },
        "an app_code without rows"
    );
}

/// The ids `list` gives for `filter`, in its order.
async fn listed(store: &dyn OutboxStore, filter: EventFilter) -> Vec<i64> {
    let rows = store.list(&filter).await.expect("list");
    rows.iter().map(|r| r.id).collect()
}

/// `list` gives rows newest first: only those matching every filter given
/// (app_code, status, event type, the creation time range), at most
/// `limit` of them, and pages back by id.
async fn list_filters_newest_first(store: Arc<dyn OutboxStore>) {
    // Rows of APP named after their status, and another tenant's.
    let evs: Vec<NewEvent> = ["Delivered", "Failed", "Delivering"]
        .into_iter()
        .map(|t| NewEvent::new(APP, t, "{}"))
        .collect();
    enqueue(store.as_ref(), &evs).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 10, 30_000))
        .await
        .unwrap();
    let fence = claimed[0].fence();
    let claimed_id = |t: &str| {
        let c = claimed.iter().find(|c| c.record.event_type == t);
        c.expect("claimed").record.id
    };
    let (delivered, failed, delivering) = (
        claimed_id("Delivered"),
        claimed_id("Failed"),
        claimed_id("Delivering"),
    );
    assert_eq!(store.mark_delivered(&fence, &[delivered]).await.unwrap(), 1);
    let dead = FailureUpdate {
        status: Status::Failed,
        ..first_failure_due_now("gone", "p")
    };
    assert_eq!(
        store.mark_failed(&fence, &[failed], &dead).await.unwrap(),
        1
    );
    let fresh = [
        NewEvent::new(APP, "Pending", "{}"),
        NewEvent::new("conf_other", "Pending", "{}"),
    ];
    enqueue(store.as_ref(), &fresh).await;
    let pending = status_of(store.as_ref(), &fresh[0].event_id).await.id;
    let other = status_of(store.as_ref(), &fresh[1].event_id).await.id;
    let now = store.now_ms().await.unwrap();
    let list = async |filter| listed(store.as_ref(), filter).await;
    let all = EventFilter {
        limit: 100,
        ..Default::default()
    };
    let app = EventFilter {
        app_code: Some(APP.into()),
        ..all.clone()
    };
    let mine = [pending, delivering, failed, delivered];

    assert_eq!(
        list(all.clone()).await,
        [other, pending, delivering, failed, delivered],
        "newest first"
    );
    assert_eq!(list(app.clone()).await, mine);
    let nobody = EventFilter {
        app_code: Some("nobody".into()),
        ..all.clone()
    };
    assert!(list(nobody).await.is_empty());
    let by_status = |status| EventFilter {
        status: Some(status),
        ..all.clone()
    };
    assert_eq!(list(by_status(Status::Pending)).await, [other, pending]);
    assert_eq!(list(by_status(Status::Delivering)).await, [delivering]);
    let app_failed = EventFilter {
        app_code: Some(APP.into()),
        ..by_status(Status::Failed)
    };
    assert_eq!(list(app_failed).await, [failed]);
    let typed = EventFilter {
        event_type: Some("Pending".into()),
        ..all.clone()
    };
    assert_eq!(
        list(typed.clone()).await,
        [other, pending],
        "every app_code"
    );
    let first = EventFilter {
        limit: 1,
        ..typed.clone()
    };
    assert_eq!(list(first).await, [other], "at most limit");
    let app_typed = EventFilter {
        app_code: Some(APP.into()),
        limit: 1,
        ..typed
    };
    assert_eq!(list(app_typed).await, [pending]);

    // Pages back by id.
    let before = |id, filter: &EventFilter| EventFilter {
        before_id: Some(id),
        ..filter.clone()
    };
    assert_eq!(list(before(pending, &all)).await, mine[1..]);
    assert_eq!(list(before(pending, &app)).await, mine[1..]);
    let one_page = EventFilter {
        limit: 1,
        ..app.clone()
    };
    assert_eq!(list(before(delivering, &one_page)).await, [failed]);

    // The creation time range.
    let since = |ms| EventFilter {
        since_ms: Some(ms),
        ..app.clone()
    };
    assert!(list(since(now + 60_000)).await.is_empty());
    assert_eq!(list(since(now - 60_000)).await, mine);
    let until = EventFilter {
        until_ms: Some(now + 60_000),
        ..app.clone()
    };
    assert_eq!(list(until).await, mine);
}

/// The relay delivers every row once when nothing fails.
async fn relay_delivers_everything(store: Arc<dyn OutboxStore>) {
    let evs = events(230, "T");
    enqueue(store.as_ref(), &evs).await;
    let p = Arc::new(RecordingPublisher::new("rec"));
    let report = run_relay_until(store.clone(), vec![p.clone()], fast_worker(), |s| {
        s.delivered == 230
    })
    .await;
    let mut got = p.delivered_ids();
    got.sort();
    let mut want: Vec<String> = evs.iter().map(|e| e.event_id.clone()).collect();
    want.sort();
    assert_eq!(got, want, "each event exactly once");
    assert_eq!(report.delivered, 230);
    assert_eq!(report.fenced_out, 0);
}

/// With two publishers, one failing for a while: every event reaches both,
/// and the healthy one receives each event exactly once.
async fn relay_fanout_retries_only_the_failed_publisher(store: Arc<dyn OutboxStore>) {
    let evs = events(40, "T");
    enqueue(store.as_ref(), &evs).await;
    let healthy = Arc::new(RecordingPublisher::new("rabbit"));
    let flaky = Arc::new(RecordingPublisher::new("hook"));
    flaky.set_down(true);
    let config = WorkerConfig {
        max_retry_count: 50,
        ..fast_worker()
    };
    let (s, f, h) = (store.clone(), flaky.clone(), healthy.clone());
    let heal = tokio::spawn(async move {
        // Let every row fail at least once on the webhook.
        while stats(s.as_ref()).await.retryable + stats(s.as_ref()).await.failed < 40
            && h.delivered().len() < 40
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        f.set_down(false);
    });
    run_relay_until(
        store.clone(),
        vec![healthy.clone(), flaky.clone()],
        config,
        |s| s.delivered == 40,
    )
    .await;
    heal.await.unwrap();
    let mut h_ids = healthy.delivered_ids();
    h_ids.sort();
    h_ids.dedup();
    assert_eq!(
        healthy.delivered_ids().len(),
        40,
        "healthy publisher got each event once"
    );
    assert_eq!(h_ids.len(), 40);
    let mut f_ids = flaky.delivered_ids();
    f_ids.sort();
    f_ids.dedup();
    assert_eq!(
        f_ids.len(),
        40,
        "the flaky publisher got every event in the end"
    );
    assert!(
        flaky
            .delivered()
            .iter()
            .all(|(_, attempt, _)| *attempt >= 2),
        "retries carry x-attempt"
    );
    for e in &evs {
        let row = status_of(store.as_ref(), &e.event_id).await;
        assert_eq!(row.status, Status::Delivered);
    }
}

/// A publisher that hangs (every publish times out) costs a healthy one
/// little: its lane fills, the rows wait for it as deferred rows, and
/// after one batch of timeouts it is skipped for a cool-down; the healthy
/// publisher gets every event at its own pace, and the hung one gets them
/// all once it answers again. Publishing each batch to both before the
/// next, each of the ten batches would wait out the hung publisher's
/// timeout (10 s at least).
async fn relay_keeps_pace_when_a_publisher_hangs(store: Arc<dyn OutboxStore>) {
    let hung = Arc::new(RecordingPublisher::new("hook"));
    hung.set_hanging(true);
    let config = WorkerConfig {
        publish_timeout: HumanDuration::secs(1),
        max_retry_count: 50,
        ..fast_worker()
    };
    let h = hung.clone();
    let (_, healthy_took, _) =
        healthy_beside(store, hung, config, move || h.set_hanging(false)).await;
    assert!(
        healthy_took < Duration::from_secs(6),
        "the healthy publisher kept its pace beside a hung one: all 200 in {healthy_took:?}"
    );
}

/// A lane has as many batches in flight as its publisher takes
/// (`Publisher::max_in_flight`): RabbitMQ's publisher takes two, so the
/// broker stores one batch while the next is sent; others take one at a
/// time. Every event is delivered once either way.
async fn relay_publishes_as_many_batches_at_once_as_its_publisher_takes(
    store: Arc<dyn OutboxStore>,
) {
    for (round, takes) in [1, 2].into_iter().enumerate() {
        let evs = events(100, "T");
        enqueue(store.as_ref(), &evs).await;
        let p = Arc::new(RecordingPublisher::new("rec").in_flight(takes));
        p.set_delay(Duration::from_millis(200));
        let config = WorkerConfig {
            batch_size: 10,
            ..fast_worker()
        };
        let done = 100 * (round as i64 + 1);
        let report = run_relay_until(store.clone(), vec![p.clone()], config, move |s| {
            s.delivered == done
        })
        .await;
        assert_eq!(
            p.most_at_once(),
            takes,
            "batches in flight at once with a publisher that takes {takes}: {report:?}"
        );
        let mut ids = p.delivered_ids();
        ids.sort();
        let mut want: Vec<String> = evs.iter().map(|e| e.event_id.clone()).collect();
        want.sort();
        assert_eq!(ids, want, "each event once");
    }
}

/// A publisher that is slow but answers (no timeout, so no breaker) holds
/// back only its own deliveries: the healthy one gets every event at its
/// own pace while the slow one's share waits for it as deferred rows (no
/// attempt counted). Publishing each batch to both before the next, the
/// healthy publisher would wait 10 × 500 ms.
async fn relay_keeps_pace_when_a_publisher_is_slow(store: Arc<dyn OutboxStore>) {
    let slow = Arc::new(RecordingPublisher::new("hook"));
    slow.set_delay(Duration::from_millis(500));
    let config = WorkerConfig {
        lease: HumanDuration::secs(10),
        publish_timeout: HumanDuration::secs(3),
        ..fast_worker()
    };
    let (report, healthy_took, evs) =
        healthy_beside(store.clone(), slow.clone(), config, || ()).await;
    assert!(
        healthy_took < Duration::from_millis(2_500),
        "the healthy publisher kept its pace beside a slow one: all 200 in {healthy_took:?} (lockstep: 5 s)"
    );
    assert!(
        report.deferred > 0,
        "rows waited for the slow publisher: {report:?}"
    );
    assert_eq!(
        slow.delivered().len(),
        200,
        "the slow one got each event once"
    );
    for e in &evs {
        let row = status_of(store.as_ref(), &e.event_id).await;
        assert_eq!(
            (row.status, row.retry_count),
            (Status::Delivered, 0),
            "a deferral is no attempt: {row:?}"
        );
    }
}

/// Two publishers of the same speed, both slower than the claims: every
/// lane is full, so nothing else could use the time a batch waits. It
/// waits for room (plain backpressure) instead of being deferred for
/// both, which would cost the database a claim and a write per batch and
/// publish nothing (before: 200 of 200 rows deferred once).
async fn relay_waits_when_every_publisher_is_behind(store: Arc<dyn OutboxStore>) {
    let evs = events(200, "T");
    enqueue(store.as_ref(), &evs).await;
    let publishers: Vec<Arc<RecordingPublisher>> = ["rabbit", "hook"]
        .into_iter()
        .map(|name| {
            let p = Arc::new(RecordingPublisher::new(name));
            p.set_delay(Duration::from_millis(150));
            p
        })
        .collect();
    let config = WorkerConfig {
        batch_size: 10,
        ..fast_worker()
    };
    let report = run_relay_until(
        store.clone(),
        publishers
            .iter()
            .map(|p| p.clone() as Arc<dyn Publisher>)
            .collect(),
        config,
        |s| s.delivered == 200,
    )
    .await;
    for p in &publishers {
        assert_eq!(p.delivered().len(), 200, "{} got each event once", p.name());
    }
    // Deferring every batch the lanes had no room for claimed each event
    // twice (400 claims); before the first publishes end, the lanes' pace
    // is a guess, and a batch or two may still be deferred.
    assert!(
        report.claimed < 300,
        "batches deferred for every publisher instead of waiting: {report:?}"
    );
}

/// Runs a relay over 200 fresh events (batch 20) to a healthy publisher
/// and `lagging`, calls `healed` once the healthy one has them all, and
/// checks that the healthy one got each event once and `lagging` each in
/// the end. Returns the relay's report, how long the healthy publisher
/// took, and the events.
async fn healthy_beside(
    store: Arc<dyn OutboxStore>,
    lagging: Arc<RecordingPublisher>,
    config: WorkerConfig,
    healed: impl FnOnce() + Send + 'static,
) -> (RelayReport, Duration, Vec<NewEvent>) {
    let evs = events(200, "T");
    enqueue(store.as_ref(), &evs).await;
    let healthy = Arc::new(RecordingPublisher::new("rabbit"));
    let started = Instant::now();
    let h = healthy.clone();
    let heal = tokio::spawn(async move {
        while h.delivered().len() < 200 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the healthy publisher got {} of 200",
                h.delivered().len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = started.elapsed();
        healed();
        took
    });
    let config = WorkerConfig {
        batch_size: 20,
        ..config
    };
    let report = run_relay_until(
        store.clone(),
        vec![healthy.clone(), lagging.clone()],
        config,
        |s| s.delivered == 200,
    )
    .await;
    let healthy_took = heal.await.unwrap();
    let distinct = |p: &RecordingPublisher| {
        let mut ids = p.delivered_ids();
        ids.sort();
        ids.dedup();
        ids.len()
    };
    assert_eq!(
        (distinct(&healthy), healthy.delivered().len()),
        (200, 200),
        "the healthy one got each event once"
    );
    assert_eq!(
        distinct(&lagging),
        200,
        "{} got every event in the end",
        lagging.name()
    );
    (report, healthy_took, evs)
}

/// One app_code's backlog does not hold back another's fresh event: the
/// relay claims every app_code in turn, one batch each, so the fresh
/// event is published within a couple of batches of the backlog, long
/// before the backlog drains.
async fn relay_claims_fairly_across_app_codes(store: Arc<dyn OutboxStore>) {
    let backlog: Vec<NewEvent> = events(1_000, "Backlog");
    enqueue(store.as_ref(), &backlog).await;
    let p = Arc::new(RecordingPublisher::new("rec"));
    let config = WorkerConfig {
        batch_size: 20,
        ..fast_worker()
    };
    let apps = vec![APP.to_owned(), "fresh".to_owned()];
    let settings = RelaySettings::new(config, apps.clone()).expect("a valid [outbox_worker]");
    let shutdown = CancellationToken::new();
    let relay = Relay::new(store.clone(), vec![p.clone()], settings);
    let handle = tokio::spawn(relay.run(shutdown.clone()));
    // Once the backlog is being drained, a fresh event of another app_code.
    let deadline = Instant::now() + Duration::from_secs(30);
    while p.delivered().len() < 40 {
        assert!(Instant::now() < deadline, "the backlog does not move");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let fresh = NewEvent::new("fresh", "Fresh", "{}");
    // Counted from its commit: on SQLite the enqueue itself can wait
    // behind the relay's write transactions (one write lock, an unfair
    // busy handler), which is not the claim order this case is about.
    enqueue(store.as_ref(), std::slice::from_ref(&fresh)).await;
    let published_before = p.delivered().len();
    while !p.delivered_ids().contains(&fresh.event_id) {
        assert!(
            Instant::now() < deadline,
            "the fresh event was not published"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let ids = p.delivered_ids();
    let at = ids.iter().position(|id| *id == fresh.event_id).unwrap();
    shutdown.cancel();
    handle.await.expect("relay task").expect("relay run");
    // Batches of 20: the one being published when it was written, the
    // one claimed behind it, then the fresh app_code's turn (and slack for
    // a batch marked in between).
    assert!(
        at <= published_before + 4 * 20,
        "the fresh event came {} events after it was written, behind a backlog of 1,000",
        at - published_before.min(at)
    );
    assert!(
        at < backlog.len(),
        "before the backlog drained: position {at}, {published_before} published when it committed"
    );
}

/// A poison event type ends `failed` after max_retry_count while every
/// other event is delivered.
async fn relay_dead_letters_poison_while_others_flow(store: Arc<dyn OutboxStore>) {
    let good = events(60, "Good");
    let bad = events(5, "Poison");
    enqueue(store.as_ref(), &good).await;
    enqueue(store.as_ref(), &bad).await;
    let p = Arc::new(RecordingPublisher::new("rec").failing_type("Poison"));
    let report = run_relay_until(store.clone(), vec![p.clone()], fast_worker(), |s| {
        s.delivered == 60 && s.failed == 5
    })
    .await;
    assert_eq!(report.failed, 5);
    for e in &bad {
        let row = status_of(store.as_ref(), &e.event_id).await;
        assert_eq!(row.status, Status::Failed);
        assert_eq!(row.retry_count, 3, "dead-lettered at max_retry_count");
        assert!(row
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("refuses Poison"));
        assert_eq!(p.attempts(&e.event_id), 3);
    }
    // A dead letter is never retried automatically.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(stats(store.as_ref()).await.failed, 5);
}

/// Retries wait out the exponential backoff, with jitter at most a quarter.
async fn relay_follows_the_backoff_schedule(store: Arc<dyn OutboxStore>) {
    let e = NewEvent::new(APP, "Poison", "{}");
    enqueue(store.as_ref(), std::slice::from_ref(&e)).await;
    let p = Arc::new(RecordingPublisher::new("rec").failing_type("Poison"));
    let config = retrying_worker(4, 200, 400);
    let start = Instant::now();
    run_relay_until(store.clone(), vec![p.clone()], config, |s| s.failed == 1).await;
    let took = start.elapsed();
    // Waits after failures 1..3: 200, 400, 400 (capped) ms, each ≥ 3/4 of that.
    assert!(
        took >= Duration::from_millis(750),
        "retries came too fast: {took:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "retries came too slowly: {took:?}"
    );
    assert_eq!(p.attempts(&e.event_id), 4);
}

/// An event whose relay died on its last allowed attempt is dead-lettered
/// without being published again.
async fn relay_dead_letters_an_event_whose_last_lease_expired(store: Arc<dyn OutboxStore>) {
    let e = NewEvent::new(APP, "Crashy", "{}");
    enqueue(store.as_ref(), std::slice::from_ref(&e)).await;
    store
        .claim(ClaimSource::Pending, &req("crashed-relay", 10, 1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let p = Arc::new(RecordingPublisher::new("rec"));
    let config = WorkerConfig {
        max_retry_count: 1,
        ..fast_worker()
    };
    run_relay_until(store.clone(), vec![p.clone()], config, |s| s.failed == 1).await;
    assert_eq!(p.attempts(&e.event_id), 0);
    let row = status_of(store.as_ref(), &e.event_id).await;
    assert_eq!(row.retry_count, 2);
    assert!(row.last_error.unwrap_or_default().contains("lease expired"));
}

/// An event taken over on its last allowed attempt and given back before
/// the relay refused it (the taking relay stopped, its type was paused, its
/// batch waited too long) is refused when it comes back as a due retry: it
/// was published once more, and could crash one more relay.
async fn relay_dead_letters_an_event_taken_over_on_its_last_attempt_and_given_back(
    store: Arc<dyn OutboxStore>,
) {
    let e = NewEvent::new(APP, "Crashy", "{}");
    enqueue(store.as_ref(), std::slice::from_ref(&e)).await;
    store
        .claim(ClaimSource::Pending, &req("crashed-relay", 10, 1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let taken = store
        .claim(
            ClaimSource::ExpiredLease,
            &req("stopping-relay", 10, 30_000),
        )
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].record.retry_count, 1);
    let released = store
        .release(&taken[0].fence(), &[taken[0].record.id])
        .await
        .unwrap();
    assert_eq!(released, 1);
    let p = Arc::new(RecordingPublisher::new("rec"));
    let config = WorkerConfig {
        max_retry_count: 1,
        ..fast_worker()
    };
    run_relay_until(store.clone(), vec![p.clone()], config, |s| s.failed == 1).await;
    assert_eq!(p.attempts(&e.event_id), 0, "not published once more");
    let row = status_of(store.as_ref(), &e.event_id).await;
    assert_eq!(row.retry_count, 2);
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("no attempt left"),
        "{row:?}"
    );
}

/// An event that crashes its relay costs only its own attempts: its batch,
/// left leased by the crash, is taken over a row at a time, so the other
/// rows are delivered and it alone ends `failed`. Taken over together,
/// they went into the same crash again, and all ten were dead-lettered.
async fn a_relay_crash_costs_only_the_crashing_events_attempts(store: Arc<dyn OutboxStore>) {
    /// Crashes (panics) on a batch holding a `Crashy` event.
    struct Crashing(RecordingPublisher);
    #[async_trait::async_trait]
    impl Publisher for Crashing {
        fn name(&self) -> &str {
            self.0.name()
        }
        async fn publish(
            &self,
            batch: &[postbox_core::publish::Delivery<'_>],
        ) -> Vec<Result<(), postbox_core::PublishError>> {
            if batch.iter().any(|d| d.record.event_type == "Crashy") {
                panic!("the relay crashes on a Crashy event");
            }
            self.0.publish(batch).await
        }
    }
    let crashy = NewEvent::new(APP, "Crashy", "{}");
    let mut all = vec![crashy.clone()];
    all.extend((0..9).map(|i| NewEvent::new(APP, "Good", format!(r#"{{"n":{i}}}"#))));
    enqueue(store.as_ref(), &all).await;
    // The relay that crashed first had them in one batch.
    let first = store
        .claim(ClaimSource::Pending, &req("crashed-relay", 10, 1))
        .await
        .unwrap();
    assert_eq!(first.len(), 10);
    let publisher = Arc::new(Crashing(RecordingPublisher::new("rec")));
    let config = WorkerConfig {
        max_retry_count: 2,
        lease: HumanDuration::millis(1_000),
        publish_timeout: HumanDuration::millis(200),
        ..fast_worker()
    };
    let done = |s: &AppStats| s.delivered == 9 && s.failed == 1;
    // Restarted after each crash, as systemd would, once the leases end.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        if done(&stats(store.as_ref()).await) {
            break;
        }
        let shutdown = CancellationToken::new();
        let settings = RelaySettings::new(config.clone(), vec![APP.to_owned()])
            .expect("a valid [outbox_worker]");
        let relay = Relay::new(store.clone(), vec![publisher.clone()], settings);
        let run = tokio::spawn(relay.run(shutdown.clone()));
        let until = Instant::now() + Duration::from_secs(5);
        while !run.is_finished() && Instant::now() < until {
            if done(&stats(store.as_ref()).await) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shutdown.cancel();
        let _ = run.await;
    }
    let s = stats(store.as_ref()).await;
    assert!(done(&s), "only the crashing event is dead-lettered: {s:?}");
    let row = status_of(store.as_ref(), &crashy.event_id).await;
    assert_eq!(row.status, Status::Failed);
    assert_eq!(publisher.0.delivered().len(), 9);
    // Each of the others was taken over once (the first crash), and never
    // went into another: one attempt counted.
    for e in &all[1..] {
        let row = status_of(store.as_ref(), &e.event_id).await;
        assert_eq!(row.retry_count, 1, "{row:?}");
    }
}

/// Stopping the relay finishes what is in flight and gives back the rest:
/// no row is left `delivering`.
async fn relay_shutdown_releases_and_leaves_nothing_delivering(store: Arc<dyn OutboxStore>) {
    struct Slow(RecordingPublisher);
    #[async_trait::async_trait]
    impl Publisher for Slow {
        fn name(&self) -> &str {
            self.0.name()
        }
        async fn publish(
            &self,
            batch: &[postbox_core::publish::Delivery<'_>],
        ) -> Vec<Result<(), postbox_core::PublishError>> {
            tokio::time::sleep(Duration::from_millis(150)).await;
            self.0.publish(batch).await
        }
    }
    enqueue(store.as_ref(), &events(300, "T")).await;
    let slow = Arc::new(Slow(RecordingPublisher::new("slow")));
    let config = WorkerConfig {
        batch_size: 20,
        ..fast_worker()
    };
    // Stop while one batch publishes and the next waits claimed (the
    // claimer claims only when the publish stage has room for the batch).
    let report = run_relay_until(store.clone(), vec![slow.clone()], config, |s| {
        s.delivered >= 20 && s.delivering >= 40
    })
    .await;
    let s = stats(store.as_ref()).await;
    assert_eq!(s.delivering, 0, "no lease left behind: {s:?}");
    assert_eq!(s.delivered + s.pending, 300);
    assert_eq!(
        s.delivered as usize,
        slow.0.delivered().len(),
        "everything published was marked"
    );
    assert!(
        report.released > 0,
        "claimed-but-unstarted batches were released: {report:?}"
    );
    assert_eq!(
        report.claimed,
        report.delivered + report.released,
        "every claimed row delivered or released: {report:?}"
    );
}

/// `delivery = "at_most_once"` types get one try and are never retried.
async fn relay_skips_retries_for_at_most_once_types(store: Arc<dyn OutboxStore>) {
    use postbox_core::config::{Delivery, EventTypeConfig};
    let e = NewEvent::new(APP, "PriceTick", "{}");
    enqueue(store.as_ref(), std::slice::from_ref(&e)).await;
    let p = Arc::new(RecordingPublisher::new("rec").failing_type("PriceTick"));
    let mut config = fast_worker();
    config.event_types.insert(
        "PriceTick".into(),
        EventTypeConfig {
            delivery: Some(Delivery::AtMostOnce),
            max_retry_count: None,
        },
    );
    run_relay_until(store.clone(), vec![p.clone()], config, |s| s.failed == 1).await;
    assert_eq!(p.attempts(&e.event_id), 1);
}

/// `ordering = "per_aggregate"` with two relays: each aggregate's events are
/// published in version order (id order without versions), and a failing
/// event holds back only the later events of its own aggregate.
async fn relay_orders_events_per_aggregate(store: Arc<dyn OutboxStore>) {
    use postbox_core::config::Ordering;
    // Aggregate A: versions written out of order (v2 first).
    let a: Vec<NewEvent> = [2, 1, 3, 4, 5]
        .iter()
        .map(|v| NewEvent::new(APP, "A", format!("{{\"v\":{v}}}")).aggregate("A", *v))
        .collect();
    // Aggregate B: its first event always fails.
    let mut b: Vec<NewEvent> = (2..=5)
        .map(|v| NewEvent::new(APP, "B", "{}").aggregate("B", v))
        .collect();
    b.insert(0, NewEvent::new(APP, "Poison", "{}").aggregate("B", 1));
    // Aggregate C: no versions, id order.
    let c: Vec<NewEvent> = (0..10)
        .map(|i| {
            let mut e = NewEvent::new(APP, "C", format!("{{\"i\":{i}}}"));
            e.aggregate_id = Some("C".into());
            e
        })
        .collect();
    let free: Vec<NewEvent> = (0..10).map(|_| NewEvent::new(APP, "Free", "{}")).collect();
    for batch in [&a, &b, &c, &free] {
        enqueue(store.as_ref(), batch).await;
    }

    // Two batches at once per relay, as RabbitMQ's: ordering holds anyway.
    let p = Arc::new(
        RecordingPublisher::new("rec")
            .failing_type("Poison")
            .in_flight(2),
    );
    let config = WorkerConfig {
        ordering: Ordering::PerAggregate,
        ..retrying_worker(4, 100, 400)
    };
    let shutdown = CancellationToken::new();
    let relays: Vec<_> = ["r1", "r2"]
        .iter()
        .map(|w| {
            let publishers: Vec<Arc<dyn Publisher>> = vec![p.clone()];
            let settings = RelaySettings::new(config.clone(), vec![APP.to_owned()])
                .expect("a valid [outbox_worker]");
            let relay = Relay::new(store.clone(), publishers, settings).with_worker_id(*w);
            tokio::spawn(relay.run(shutdown.clone()))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = stats(store.as_ref()).await;
        if s.delivered == 29 && s.failed == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "not done: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    for r in relays {
        r.await.unwrap().unwrap();
    }

    let offers = p.offers();
    let pos = |id: &str| {
        offers
            .iter()
            .position(|(e, ok)| e == id && *ok)
            .unwrap_or_else(|| panic!("{id} delivered"))
    };
    let last_offer = |id: &str| offers.iter().rposition(|(e, _)| e == id).unwrap();
    let mut a_by_version = a.clone();
    a_by_version.sort_by_key(|e| e.aggregate_version);
    let a_order: Vec<usize> = a_by_version.iter().map(|e| pos(&e.event_id)).collect();
    assert!(
        a_order.windows(2).all(|w| w[0] < w[1]),
        "A in version order: {a_order:?}"
    );
    let c_order: Vec<usize> = c.iter().map(|e| pos(&e.event_id)).collect();
    assert!(
        c_order.windows(2).all(|w| w[0] < w[1]),
        "C in id order: {c_order:?}"
    );
    let b_tail: Vec<usize> = b[1..].iter().map(|e| pos(&e.event_id)).collect();
    assert!(
        b_tail.windows(2).all(|w| w[0] < w[1]),
        "B in version order: {b_tail:?}"
    );
    let b1_dead = last_offer(&b[0].event_id);
    assert!(
        b_tail[0] > b1_dead,
        "B v2 waited for B v1 to be dead-lettered"
    );
    assert_eq!(p.attempts(&b[0].event_id), 4);
    assert!(
        *a_order.last().unwrap() < b1_dead && *c_order.last().unwrap() < b1_dead,
        "other aggregates were not held back by B's failing event"
    );
}

/// Issue 10.1: one aggregate mixing versioned and unversioned events still
/// has a head. y1 (v2), y2 (no version), y3 (v1) used to each have an
/// "earlier" pending sibling (the old order fell back to `id` when a version
/// was NULL, which is not transitive), so none was ever claimed. The order
/// is total: by version, NULL after every version, then by id.
async fn relay_orders_an_aggregate_mixing_versions_and_nulls(store: Arc<dyn OutboxStore>) {
    use postbox_core::config::Ordering;
    let ev = |v: Option<i64>| {
        let mut e = NewEvent::new(APP, "Y", "{}");
        e.aggregate_id = Some("Y".into());
        e.aggregate_version = v;
        e
    };
    // One per enqueue, so that ids follow this order.
    let (y1, y2, y3, y4) = (ev(Some(2)), ev(None), ev(Some(1)), ev(Some(3)));
    for e in [&y1, &y2, &y3, &y4] {
        enqueue(store.as_ref(), std::slice::from_ref(e)).await;
    }
    let p = Arc::new(RecordingPublisher::new("rec"));
    let config = WorkerConfig {
        ordering: Ordering::PerAggregate,
        ..fast_worker()
    };
    run_relay_until(store.clone(), vec![p.clone()], config, |s| s.delivered == 4).await;
    let order: Vec<String> = p.offers().into_iter().map(|(e, _)| e).collect();
    let expected: Vec<String> = [&y3, &y1, &y4, &y2]
        .iter()
        .map(|e| e.event_id.clone())
        .collect();
    assert_eq!(order, expected, "v1, v2, v3, then the unversioned event");
    for e in [&y1, &y2, &y3, &y4] {
        assert_eq!(status_of(store.as_ref(), &e.event_id).await.retry_count, 0);
    }
}

/// A per-aggregate claim takes the oldest heads first among many
/// aggregates, whatever their keys; it finds every aggregate that can
/// move, however many events queue behind one whose head cannot (more
/// than the batch here, so they fill the claim's window of oldest rows);
/// and while heads are in flight it takes none of their followers.
async fn ordered_claim_skips_held_aggregates_in_age_order(store: Arc<dyn OutboxStore>) {
    let ordered = |limit| ClaimRequest {
        ordered: true,
        ..req("w", limit, 60_000)
    };
    let claim_ids = |limit| {
        let store = store.clone();
        async move {
            let got = store
                .claim(ClaimSource::Pending, &ordered(limit))
                .await
                .expect("claim");
            got.into_iter()
                .map(|c| c.record.event_id)
                .collect::<Vec<String>>()
        }
    };
    let ids_of =
        |evs: &[NewEvent]| -> Vec<String> { evs.iter().map(|e| e.event_id.clone()).collect() };

    // Thirty aggregates with one event each, keys in the reverse of their
    // age: a claim of 4 takes the 4 oldest.
    let many: Vec<NewEvent> = (0..30)
        .rev()
        .map(|i| NewEvent::new(APP, "Many", "{}").aggregate(format!("k-{i:02}"), 1))
        .collect();
    enqueue(store.as_ref(), &many).await;
    assert_eq!(
        claim_ids(4).await,
        ids_of(&many[..4]),
        "the oldest four heads"
    );
    deliver_all(store.as_ref()).await;

    let held: Vec<NewEvent> = (1..=25)
        .map(|v| NewEvent::new(APP, "Held", "{}").aggregate("m-held", v))
        .collect();
    enqueue(store.as_ref(), &held[..1]).await;
    let head = store
        .claim(ClaimSource::Pending, &ordered(5))
        .await
        .expect("claim");
    assert_eq!(head.len(), 1);
    assert_eq!(
        store
            .mark_failed(
                &head[0].fence(),
                &[head[0].record.id],
                &FailureUpdate {
                    status: Status::Retryable,
                    retry_count: 1,
                    retry_after_ms: 3_600_000,
                    retry_jitter_ms: 0,
                    delivered_to: Vec::new(),
                    error: "down".into(),
                    publisher: None,
                },
            )
            .await
            .expect("mark failed"),
        1
    );
    enqueue(store.as_ref(), &held[1..]).await;
    // Keys sorting before and after the held aggregate's.
    let free: Vec<NewEvent> = ["a-1", "z-1", "b-1", "y-1"]
        .iter()
        .map(|k| NewEvent::new(APP, "Free", "{}").aggregate(*k, 1))
        .collect();
    enqueue(store.as_ref(), &free).await;
    assert_eq!(
        claim_ids(5).await,
        ids_of(&free),
        "the four free heads, in age order, and nothing of the held aggregate"
    );
    // Their heads are in flight: their followers wait.
    let next: Vec<NewEvent> = ["a-1", "z-1"]
        .iter()
        .map(|k| NewEvent::new(APP, "Free", "{}").aggregate(*k, 2))
        .collect();
    enqueue(store.as_ref(), &next).await;
    let none = claim_ids(5).await;
    assert!(none.is_empty(), "followers of heads in flight: {none:?}");
}

/// The event ids a per-aggregate pending claim of `limit` by worker `w`
/// takes (a 10-minute lease), `skip` paused, sorted.
async fn ordered_claim(store: &dyn OutboxStore, limit: u32, skip: Vec<String>) -> Vec<String> {
    let req = ClaimRequest {
        ordered: true,
        skip_types: &skip,
        ..req("w", limit, 600_000)
    };
    let got = store
        .claim(ClaimSource::Pending, &req)
        .await
        .expect("claim");
    let mut ids: Vec<String> = got.into_iter().map(|c| c.record.event_id).collect();
    ids.sort();
    ids
}

/// More aggregates are held than a claim looks at first (2 × the batch),
/// their followers the oldest pending rows: heads in flight (versioned or
/// not), or of a paused type. A fresh aggregate's event is still claimed; it waited
/// until the held heads moved, or for as long as the type stayed paused.
async fn ordered_claim_reaches_past_many_held_aggregates(store: Arc<dyn OutboxStore>) {
    let ids_of = |evs: &[NewEvent]| -> Vec<String> {
        let mut ids: Vec<String> = evs.iter().map(|e| e.event_id.clone()).collect();
        ids.sort();
        ids
    };
    let claim = |limit: u32, skip: Vec<String>| ordered_claim(store.as_ref(), limit, skip);
    // Six aggregates whose keys sort first: heads taken (in flight).
    let heads: Vec<NewEvent> = (0..6)
        .map(|i| NewEvent::new(APP, "Y", "{}").aggregate(format!("a-{i}"), 1))
        .collect();
    enqueue(store.as_ref(), &heads).await;
    assert_eq!(claim(6, Vec::new()).await, ids_of(&heads));
    let followers: Vec<NewEvent> = (0..6)
        .map(|i| NewEvent::new(APP, "Y", "{}").aggregate(format!("a-{i}"), 2))
        .collect();
    enqueue(store.as_ref(), &followers).await;
    // Six more whose pending heads are of a type about to be paused.
    let paused: Vec<NewEvent> = (0..6)
        .flat_map(|i| {
            [
                NewEvent::new(APP, "P", "{}").aggregate(format!("b-{i}"), 1),
                NewEvent::new(APP, "Y", "{}").aggregate(format!("b-{i}"), 2),
            ]
        })
        .collect();
    enqueue(store.as_ref(), &paused).await;
    // Six whose events carry no version (one order among them: by id),
    // heads taken.
    let unversioned = |i: usize| {
        let mut e = NewEvent::new(APP, "Y", "{}");
        e.aggregate_id = Some(format!("c-{i}"));
        e
    };
    let heads: Vec<NewEvent> = (0..6).map(unversioned).collect();
    enqueue(store.as_ref(), &heads).await;
    assert_eq!(claim(6, vec!["P".to_owned()]).await, ids_of(&heads));
    let followers: Vec<NewEvent> = (0..6).map(unversioned).collect();
    enqueue(store.as_ref(), &followers).await;
    let fresh = vec![NewEvent::new(APP, "Y", "{}").aggregate("z-1", 1)];
    enqueue(store.as_ref(), &fresh).await;
    assert_eq!(
        claim(3, vec!["P".to_owned()]).await,
        ids_of(&fresh),
        "the free head behind eighteen held aggregates"
    );
}

/// Under per-aggregate ordering, a paused type whose name sorts first and
/// whose backlog fills a batch does not hide the other types' events
/// without an aggregate (MariaDB's claim read its candidates in type
/// order, the paused rows first, and claimed nothing while the pause
/// lasted).
async fn ordered_claim_reads_past_a_paused_type(store: Arc<dyn OutboxStore>) {
    let paused: Vec<NewEvent> = (0..3).map(|_| NewEvent::new(APP, "A", "{}")).collect();
    enqueue(store.as_ref(), &paused).await;
    let other = vec![NewEvent::new(APP, "B", "{}")];
    enqueue(store.as_ref(), &other).await;
    let skip = vec!["A".to_owned()];
    let req = ClaimRequest {
        ordered: true,
        skip_types: &skip,
        ..req("w", 2, 60_000)
    };
    let got = store
        .claim(ClaimSource::Pending, &req)
        .await
        .expect("claim");
    let ids: Vec<&str> = got.iter().map(|c| c.record.event_id.as_str()).collect();
    assert_eq!(ids, [other[0].event_id.as_str()], "the other type's event");
}

/// Under per-aggregate ordering, the oldest pending rows of a type are
/// followers of held aggregates (heads in flight, or of a paused type),
/// more than a batch of them: an event of that type without an aggregate,
/// behind them, is still claimed (up to `postbox_sqlx::follower_scan!`
/// batches of them). The claim took its candidates from the
/// oldest batch of each type and kept the heads among them, so it claimed
/// nothing for as long as the aggregates were held (a pause: until it was
/// lifted).
async fn ordered_claim_finds_events_without_an_aggregate_behind_held_followers(
    store: Arc<dyn OutboxStore>,
) {
    let claim = |limit: u32, skip: Vec<String>| ordered_claim(store.as_ref(), limit, skip);
    // Two aggregates whose heads go out now (in flight) and two whose
    // heads are of a type about to be paused; three followers each, all
    // of type "Y".
    let taken: Vec<NewEvent> = (0..2)
        .map(|i| NewEvent::new(APP, "Y", "{}").aggregate(format!("a-{i}"), 1))
        .collect();
    enqueue(store.as_ref(), &taken).await;
    assert_eq!(claim(2, Vec::new()).await.len(), 2, "the two heads");
    // Another type's events without an aggregate: the claim takes them
    // and comes back short.
    let others: Vec<NewEvent> = (0..2).map(|_| NewEvent::new(APP, "Z", "{}")).collect();
    let paused: Vec<NewEvent> = (0..2)
        .map(|i| NewEvent::new(APP, "P", "{}").aggregate(format!("b-{i}"), 1))
        .collect();
    enqueue(store.as_ref(), &paused).await;
    let followers: Vec<NewEvent> = (2..4)
        .flat_map(|v| {
            ["a-0", "a-1", "b-0", "b-1"].map(|k| NewEvent::new(APP, "Y", "{}").aggregate(k, v))
        })
        .collect();
    enqueue(store.as_ref(), &followers).await;
    let free = vec![NewEvent::new(APP, "Y", "{}")];
    enqueue(store.as_ref(), &free).await;
    enqueue(store.as_ref(), &others).await;
    let mut expected: Vec<String> = others
        .iter()
        .chain(&free)
        .map(|e| e.event_id.clone())
        .collect();
    expected.sort();
    let got = claim(5, vec!["P".to_owned()]).await;
    assert_eq!(
        got, expected,
        "the other type's events, and the event without an aggregate behind eight held followers"
    );
}

/// Archives the delivered rows of [`APP`] (up to a minute ahead of the
/// database clock), `batch_size` rows a batch.
async fn archive_delivered(
    store: &dyn OutboxStore,
    batch_size: u32,
) -> postbox_core::store::ArchiveReport {
    let req = postbox_core::store::ArchiveRequest {
        app_codes: vec![APP.to_owned()],
        before_ms: store.now_ms().await.expect("now") + 60_000,
        batch_size,
        max_batches: None,
        partitions: Default::default(),
    };
    store.archive(&req, &|_| {}).await.expect("archive")
}

/// Claims and delivers every pending row of [`APP`].
async fn deliver_all(store: &dyn OutboxStore) {
    loop {
        let got = store
            .claim(ClaimSource::Pending, &req("w", 100, 30_000))
            .await
            .expect("claim");
        let Some(first) = got.first() else { return };
        let ids: Vec<i64> = got.iter().map(|c| c.record.id).collect();
        store
            .mark_delivered(&first.fence(), &ids)
            .await
            .expect("mark");
    }
}

/// Issue 10.3: an event enqueued again after it was archived (the live
/// table's unique key does not cover the archive) was refused by the
/// archiver forever, and once such rows filled a batch (they sort first)
/// every batch moved nothing. The archive keeps its copy, the live
/// duplicate is deleted, and the rows after it are archived.
async fn archive_moves_past_live_duplicates_of_archived_events(store: Arc<dyn OutboxStore>) {
    let first = events(3, "T");
    enqueue(store.as_ref(), &first).await;
    deliver_all(store.as_ref()).await;
    assert_eq!(archive_delivered(store.as_ref(), 10).await.moved, 3);
    let mut ids: Vec<String> = first.iter().map(|e| e.event_id.clone()).collect();
    ids.push("never-enqueued".into());
    let mut expected = ids[..3].to_vec();
    expected.sort();
    let mut found = store.archived_event_ids(APP, &ids).await.expect("lookup");
    found.sort();
    assert_eq!(
        found, expected,
        "the archive holds exactly the archived events"
    );
    assert!(store
        .archived_event_ids("other-app", &ids)
        .await
        .expect("lookup")
        .is_empty());

    // The same events again (the live table accepts them), then new ones.
    enqueue(store.as_ref(), &first).await;
    let later = events(2, "T");
    enqueue(store.as_ref(), &later).await;
    deliver_all(store.as_ref()).await;
    let report = archive_delivered(store.as_ref(), 2).await;
    assert!(report.complete, "{report:?}");
    assert_eq!(
        report.moved, 5,
        "duplicates deleted, new rows copied: {report:?}"
    );
    let s = stats(store.as_ref()).await;
    assert_eq!(s.delivered, 0, "nothing left behind: {s:?}");
    let all: Vec<String> = first
        .iter()
        .chain(&later)
        .map(|e| e.event_id.clone())
        .collect();
    assert_eq!(
        store
            .archived_event_ids(APP, &all)
            .await
            .expect("lookup")
            .len(),
        5
    );
}

/// A replay of a time range that names no app_code visits every tenant,
/// including one whose rows are all archived (none left in the table,
/// where the app_codes were read from): its events come back, in the
/// dry run and in the replay, and the paced replay's batches hold them.
async fn a_replay_without_an_app_code_reaches_a_tenant_all_archived(store: Arc<dyn OutboxStore>) {
    use postbox_core::store::{EventFilter, ReplaySelector};
    let archived = events(2, "T");
    enqueue(store.as_ref(), &archived).await;
    deliver_all(store.as_ref()).await;
    let now = store.now_ms().await.expect("now");
    assert_eq!(archive_delivered(store.as_ref(), 10).await.moved, 2);
    // Another tenant has a live row.
    enqueue(store.as_ref(), &[NewEvent::new("conf-live", "T", "{}")]).await;

    let filter = EventFilter {
        since_ms: Some(now - 3_600_000),
        until_ms: Some(now + 60_000),
        status: Some(Status::Delivered),
        ..Default::default()
    };
    let mut want: Vec<String> = archived.iter().map(|e| e.event_id.clone()).collect();
    want.sort();
    let ids = store
        .replay_ids_after(&filter, 0, 10)
        .await
        .expect("next batch");
    assert_eq!(ids.len(), 2, "the paced replay's batch: {ids:?}");
    let range = ReplaySelector::Filter(filter);
    let event_ids = |rows: Vec<postbox_core::EventRecord>| {
        let mut ids: Vec<String> = rows.into_iter().map(|r| r.event_id).collect();
        ids.sort();
        ids
    };
    let dry = store.replay(&range, true, "test").await.expect("dry run");
    assert_eq!(event_ids(dry), want, "the dry run");
    let done = store.replay(&range, false, "test").await.expect("replay");
    assert_eq!(event_ids(done), want, "the replay");
    for id in &want {
        let rows = store.find(id).await.expect("find");
        assert_eq!(rows.len(), 1, "{id} is back in the table");
        assert_eq!(rows[0].status, Status::Pending);
    }
}

/// Issue 10.1: `status` and `doctor` show aggregates whose head cannot
/// move: a head that keeps failing (`retryable`) or is held by a lease,
/// with later events waiting. A pending head, a head with nothing behind
/// it and a young head are not reported.
async fn stuck_aggregates_are_heads_that_cannot_move(store: Arc<dyn OutboxStore>) {
    let agg = |id: &str, v: i64| NewEvent::new(APP, "S", "{}").aggregate(id, v);
    // S: head fails; U: head leased; T: head alone; V: all pending.
    for e in [
        agg("S", 1),
        agg("S", 2),
        agg("U", 1),
        agg("U", 2),
        agg("T", 1),
        agg("V", 1),
        agg("V", 2),
    ] {
        enqueue(store.as_ref(), std::slice::from_ref(&e)).await;
    }
    let heads = store
        .claim(
            ClaimSource::Pending,
            &ClaimRequest {
                ordered: true,
                ..req("w", 3, 60_000)
            },
        )
        .await
        .expect("claim");
    let head = |a: &str| {
        heads
            .iter()
            .find(|c| c.record.aggregate_id.as_deref() == Some(a))
            .unwrap_or_else(|| panic!("head of {a} claimed"))
    };
    let s1 = head("S");
    assert_eq!(
        store
            .mark_failed(
                &s1.fence(),
                &[s1.record.id],
                &FailureUpdate {
                    status: Status::Retryable,
                    retry_count: 1,
                    retry_after_ms: 600_000,
                    retry_jitter_ms: 0,
                    delivered_to: Vec::new(),
                    error: "broker said no".into(),
                    publisher: Some("p".into()),
                },
            )
            .await
            .expect("mark failed"),
        1
    );
    let (u1, t1) = (head("U").record.clone(), head("T").record.clone());
    tokio::time::sleep(Duration::from_millis(30)).await;

    let stuck = store.stuck_aggregates(APP, 10, 10).await.expect("stuck");
    let found: Vec<(&str, Status, i64)> = stuck
        .iter()
        .map(|s| (s.aggregate_id.as_str(), s.head_status, s.waiting))
        .collect();
    assert_eq!(
        found,
        vec![("S", Status::Retryable, 1), ("U", Status::Delivering, 1)],
        "{stuck:?}"
    );
    assert_eq!(stuck[0].head_event_id, s1.record.event_id);
    assert_eq!(stuck[0].head_retry_count, 1);
    assert_eq!(stuck[0].head_last_error.as_deref(), Some("broker said no"));
    assert!(stuck[0].head_age_seconds >= 0.01, "{stuck:?}");
    assert_eq!(stuck[1].head_event_id, u1.event_id);
    assert!(stuck.iter().all(|s| s.head_event_id != t1.event_id));
    assert_eq!(
        store
            .stuck_aggregates(APP, 10, 1)
            .await
            .expect("stuck")
            .len(),
        1
    );
    assert!(store
        .stuck_aggregates(APP, 3_600_000, 10)
        .await
        .expect("stuck")
        .is_empty());
}

/// Failed attempts (with publisher, error and attempt number), expired-lease
/// takeovers, dead-lettering and replays (with their origin) are recorded in
/// order; a result dropped by the fence records nothing; the history keeps
/// the newest [`HISTORY_LIMIT`] entries per event.
async fn history_records_attempts_dead_letters_and_replays(store: Arc<dyn OutboxStore>) {
    let evs = events(2, "T");
    enqueue(store.as_ref(), &evs).await;
    let id_of = |e: &NewEvent| e.event_id.clone();
    let (first, other) = (id_of(&evs[0]), id_of(&evs[1]));
    assert!(store.history(&first).await.unwrap().is_empty());

    // Attempt 1 fails at publisher `hook`.
    let got = store
        .claim(ClaimSource::Pending, &req("w1", 1, 30_000))
        .await
        .unwrap();
    assert_eq!(got[0].record.event_id, first);
    let fail = FailureUpdate {
        status: Status::Retryable,
        retry_count: 1,
        retry_after_ms: 0,
        retry_jitter_ms: 0,
        delivered_to: vec![],
        error: "hook: 503 Service Unavailable".into(),
        publisher: Some("hook".into()),
    };
    assert_eq!(
        store
            .mark_failed(&got[0].fence(), &[got[0].record.id], &fail)
            .await
            .unwrap(),
        1
    );
    // A late result under a stale fence records nothing.
    assert_eq!(
        store
            .mark_failed(&got[0].fence(), &[got[0].record.id], &fail)
            .await
            .unwrap(),
        0
    );

    // Attempt 2: the lease expires and another relay takes over.
    let again = store
        .claim(ClaimSource::DueRetry, &req("slow", 10, 300))
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let taken = store
        .claim(ClaimSource::ExpiredLease, &req("w2", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);

    // Attempt 3 dead-letters it.
    let dead = FailureUpdate {
        status: Status::Failed,
        retry_count: 3,
        error: "hook: 400 Bad Request".into(),
        ..fail.clone()
    };
    assert_eq!(
        store
            .mark_failed(&taken[0].fence(), &[taken[0].record.id], &dead)
            .await
            .unwrap(),
        1
    );
    let by_id = ReplaySelector::EventIds {
        app_code: None,
        event_ids: vec![first.clone()],
    };
    assert_eq!(
        store.replay(&by_id, true, "cli").await.unwrap().len(),
        1,
        "dry run"
    );
    assert_eq!(
        store
            .replay(&by_id, false, "api 127.0.0.1:9")
            .await
            .unwrap()
            .len(),
        1
    );

    let h = store.history(&first).await.unwrap();
    let kinds: Vec<HistoryKind> = h.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            HistoryKind::Failed,
            HistoryKind::LeaseExpired,
            HistoryKind::DeadLettered,
            HistoryKind::Replayed
        ],
        "{h:#?}"
    );
    assert_eq!(h[0].attempt, 1);
    assert_eq!(h[0].publisher.as_deref(), Some("hook"));
    assert_eq!(
        h[0].detail.as_deref(),
        Some("hook: 503 Service Unavailable")
    );
    assert_eq!(h[1].attempt, 2, "the expired lease counted as attempt 2");
    assert!(
        h[1].detail.as_deref().unwrap_or("").contains("slow"),
        "{h:#?}"
    );
    assert_eq!(h[2].attempt, 3);
    assert_eq!(h[2].detail.as_deref(), Some("hook: 400 Bad Request"));
    assert_eq!(h[3].detail.as_deref(), Some("api 127.0.0.1:9"));
    assert!(h.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    assert!(
        store.history(&other).await.unwrap().is_empty(),
        "other events untouched"
    );

    // Bounded: 25 more replays keep only the newest HISTORY_LIMIT entries.
    for i in 0..25 {
        store
            .replay(&by_id, false, &format!("cli {i}"))
            .await
            .unwrap();
    }
    let h = store.history(&first).await.unwrap();
    assert_eq!(h.len() as i64, HISTORY_LIMIT);
    assert!(h.iter().all(|e| e.kind == HistoryKind::Replayed));
    assert_eq!(h.last().unwrap().detail.as_deref(), Some("cli 24"));
    assert_eq!(
        h[0].detail.as_deref(),
        Some(format!("cli {}", 25 - HISTORY_LIMIT).as_str())
    );
}

/// Replay keeps fanout progress: a `failed` event goes by default only to
/// the publishers that did not confirm it, a `delivered` one to every
/// publisher; `Only` and `All` pick the targets; the history names them.
async fn replay_goes_only_to_publishers_that_did_not_confirm(store: Arc<dyn OutboxStore>) {
    let evs = events(4, "T");
    enqueue(store.as_ref(), &evs).await;
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", 10, 30_000))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 4);
    let fence = claimed[0].fence();
    let id_of = |event_id: &str| {
        claimed
            .iter()
            .find(|c| c.record.event_id == event_id)
            .unwrap()
            .record
            .id
    };
    // evs 0, 2, 3: `a` confirmed, `b` never did (dead letters); evs 1: delivered.
    for i in [0, 2, 3] {
        let dead = FailureUpdate {
            status: Status::Failed,
            retry_count: 3,
            retry_after_ms: 0,
            retry_jitter_ms: 0,
            delivered_to: vec!["a".into()],
            error: "b: down".into(),
            publisher: Some("b".into()),
        };
        assert_eq!(
            store
                .mark_failed(&fence, &[id_of(&evs[i].event_id)], &dead)
                .await
                .unwrap(),
            1
        );
    }
    store
        .mark_delivered(&fence, &[id_of(&evs[1].event_id)])
        .await
        .unwrap();

    let ab = vec!["a".to_owned(), "b".to_owned()];
    let by_id = |i: usize| ReplaySelector::EventIds {
        app_code: None,
        event_ids: vec![evs[i].event_id.clone()],
    };
    // Replays event `i` (not a dry run) to `targets`.
    let replay = |i: usize, targets: &ReplayTargets| {
        let store = store.clone();
        let (selector, targets) = (by_id(i), targets.clone());
        async move {
            let request = ReplayRequest {
                selector: &selector,
                dry_run: false,
                origin: "t",
                targets: &targets,
            };
            store.replay_to(request).await.unwrap()
        }
    };
    let default = ReplayTargets::new(ReplayPick::Unconfirmed, ab.clone()).unwrap();
    let r = replay(0, &default).await;
    assert_eq!(
        r[0].delivered_to,
        vec!["a".to_owned()],
        "failed: progress kept"
    );
    let r = replay(1, &default).await;
    assert!(
        r[0].delivered_to.is_empty(),
        "delivered: backtracking to all"
    );
    // To `a` alone, a dead letter `b` never confirmed would end delivered
    // without `b`: refused, for every caller, and nothing changes.
    let only_a = ReplayTargets::new(ReplayPick::Only(vec!["a".into()]), ab.clone()).unwrap();
    let refused = store
        .replay_to(ReplayRequest {
            selector: &by_id(2),
            dry_run: false,
            origin: "t",
            targets: &only_a,
        })
        .await;
    match refused {
        Err(Error::Refused(why)) => assert!(why.contains("not been confirmed by b"), "{why}"),
        other => panic!("a replay leaving out an unconfirmed publisher: {other:?}"),
    }
    assert_eq!(
        status_of(store.as_ref(), &evs[2].event_id).await.status,
        Status::Failed
    );
    let only_b = ReplayTargets::new(ReplayPick::Only(vec!["b".into()]), ab.clone()).unwrap();
    let r = replay(2, &only_b).await;
    assert_eq!(r[0].delivered_to, vec!["a".to_owned()], "only b");
    let all = ReplayTargets::new(ReplayPick::All, ab.clone()).unwrap();
    let r = replay(3, &all).await;
    assert!(r[0].delivered_to.is_empty(), "all publishers");
    for (i, want) in [(0, vec!["a"]), (1, vec![]), (2, vec!["a"]), (3, vec![])] {
        let row = status_of(store.as_ref(), &evs[i].event_id).await;
        assert_eq!(row.status, Status::Pending);
        assert_eq!(row.delivered_to, want, "stored delivered_to of event {i}");
        let h = store.history(&evs[i].event_id).await.unwrap();
        let replayed = h.iter().rfind(|e| e.kind == HistoryKind::Replayed).unwrap();
        let to = ["b", "a,b", "b", "a,b"][i];
        assert_eq!(
            replayed.publisher.as_deref(),
            Some(to),
            "history of event {i}"
        );
    }

    let a = Arc::new(RecordingPublisher::new("a"));
    let b = Arc::new(RecordingPublisher::new("b"));
    run_relay_until(
        store.clone(),
        vec![a.clone(), b.clone()],
        fast_worker(),
        |s| s.delivered == 4,
    )
    .await;
    let mut got_a = a.delivered_ids();
    got_a.sort();
    let mut want_a = vec![evs[1].event_id.clone(), evs[3].event_id.clone()];
    want_a.sort();
    assert_eq!(got_a, want_a, "a already had events 0 and 2");
    let mut got_b = b.delivered_ids();
    got_b.sort();
    let mut want_b: Vec<String> = evs[..4].iter().map(|e| e.event_id.clone()).collect();
    want_b.sort();
    assert_eq!(got_b, want_b, "b had none of them");
}

/// Claims the `n` oldest pending rows, marks them delivered and archives
/// every delivered row; returns the claimed rows.
async fn deliver_and_archive(store: &dyn OutboxStore, n: u32) -> Vec<postbox_core::ClaimedEvent> {
    let claimed = store
        .claim(ClaimSource::Pending, &req("w1", n, 30_000))
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
    store
        .mark_delivered(&claimed[0].fence(), &ids)
        .await
        .unwrap();
    let archive = ArchiveRequest {
        app_codes: vec![APP.into()],
        before_ms: store.now_ms().await.unwrap() + 1,
        batch_size: 10,
        max_batches: None,
        partitions: Default::default(),
    };
    let report = store.archive(&archive, &|_| {}).await.unwrap();
    assert_eq!(report.moved, u64::from(n), "{report:?}");
    claimed
}

/// Archived rows stay visible to inspection: found by event id and listed
/// (newest first, merged with live rows), marked as archived.
async fn archived_rows_are_found_and_listed(store: Arc<dyn OutboxStore>) {
    let evs = events(3, "T");
    enqueue(store.as_ref(), &evs).await;
    let claimed = deliver_and_archive(store.as_ref(), 2).await;
    let gone = &claimed[0].record.event_id;
    assert!(store.find(gone).await.unwrap().is_empty(), "moved");
    let found = store.find_inspected(gone, &[APP.to_owned()]).await.unwrap();
    assert_eq!(found.len(), 1);
    assert!(found[0].archived);
    assert_eq!(found[0].record.status, Status::Delivered);
    assert!(store
        .find_archived(gone, &["other".to_owned()])
        .await
        .unwrap()
        .is_empty());

    let all = EventFilter {
        app_code: Some(APP.into()),
        limit: 10,
        ..Default::default()
    };
    let listed = store.list_inspected(&all).await.unwrap();
    assert_eq!(listed.len(), 3);
    assert!(listed.windows(2).all(|w| w[0].record.id > w[1].record.id));
    assert_eq!(listed.iter().filter(|r| r.archived).count(), 2);
    let page = EventFilter {
        limit: 2,
        ..all.clone()
    };
    let first = store.list_inspected(&page).await.unwrap();
    let next = EventFilter {
        before_id: Some(first[1].record.id),
        ..page.clone()
    };
    let second = store.list_inspected(&next).await.unwrap();
    assert_eq!(first.len() + second.len(), 3, "pages cover every row once");
    let pending = EventFilter {
        status: Some(Status::Pending),
        ..all.clone()
    };
    assert!(store
        .list_inspected(&pending)
        .await
        .unwrap()
        .iter()
        .all(|r| !r.archived));
}

/// Events are searched by aggregate through the optional aggregate index,
/// in the live table and the archive alike, newest first, page by page,
/// and replayed by aggregate; without the index (or without an app_code)
/// the search is refused, never a scan of the table.
async fn events_are_searched_by_aggregate_in_the_table_and_the_archive(
    store: Arc<dyn OutboxStore>,
) {
    // agg-1: evs[1] and evs[8]; agg-0: evs[0] and evs[7].
    let evs = events(10, "T");
    enqueue(store.as_ref(), &evs).await;
    let of = |aggregate: &str, limit: u32| EventFilter {
        app_code: Some(APP.into()),
        aggregate_id: Some(aggregate.into()),
        limit,
        ..Default::default()
    };
    let found = async |f: &EventFilter| -> Vec<(String, bool)> {
        let rows = store.list_inspected(f).await.expect("search by aggregate");
        rows.into_iter()
            .map(|r| (r.record.event_id, r.archived))
            .collect()
    };
    let id = |i: usize, archived: bool| (evs[i].event_id.clone(), archived);
    let by_aggregate = ReplaySelector::Filter(EventFilter {
        aggregate_id: Some("agg-1".into()),
        ..Default::default()
    });

    let refused = store.list_inspected(&of("agg-1", 10)).await.unwrap_err();
    assert!(
        matches!(refused, Error::Schema(_)) && refused.to_string().contains("--aggregate-index"),
        "without its index: {refused}"
    );
    let refused = store.replay(&by_aggregate, true, "test").await.unwrap_err();
    assert!(matches!(refused, Error::Schema(_)), "{refused}");
    assert!(!store.inspect_schema().await.unwrap().aggregate_search);

    let created = store.aggregate_index(true).await.expect("create the index");
    assert_eq!(
        created.len(),
        2,
        "on the table and the archive: {created:?}"
    );
    assert_eq!(
        store.aggregate_index(true).await.unwrap(),
        Vec::<String>::new()
    );
    assert!(store.inspect_schema().await.unwrap().aggregate_search);
    let no_app_code = EventFilter {
        app_code: None,
        ..of("agg-1", 10)
    };
    let refused = store.list_inspected(&no_app_code).await.unwrap_err();
    assert!(refused.is_usage(), "{refused}");

    // evs[0] and evs[1] delivered, then archived.
    deliver_and_archive(store.as_ref(), 2).await;

    assert_eq!(found(&of("agg-1", 10)).await, [id(8, false), id(1, true)]);
    assert_eq!(found(&of("agg-0", 10)).await, [id(7, false), id(0, true)]);
    assert_eq!(found(&of("agg-9", 10)).await, []);
    let first = found(&of("agg-1", 1)).await;
    assert_eq!(first, [id(8, false)]);
    let live_id = store.find(&evs[8].event_id).await.unwrap()[0].id;
    let next = EventFilter {
        before_id: Some(live_id),
        ..of("agg-1", 1)
    };
    assert_eq!(found(&next).await, [id(1, true)], "the next page");
    let delivered = EventFilter {
        status: Some(Status::Delivered),
        ..of("agg-1", 10)
    };
    assert_eq!(found(&delivered).await, [id(1, true)]);

    // A replay by aggregate brings its archived event back too.
    let dry = store.replay(&by_aggregate, true, "test").await.unwrap();
    assert_eq!(dry.len(), 2, "{dry:?}");
    store.replay(&by_aggregate, false, "test").await.unwrap();
    assert_eq!(found(&of("agg-1", 10)).await, [id(8, false), id(1, false)]);
    assert_eq!(
        found(&of("agg-0", 10)).await,
        [id(7, false), id(0, true)],
        "only agg-1"
    );

    let dropped = store.aggregate_index(false).await.expect("drop the index");
    assert_eq!(dropped, created);
    assert!(!store.inspect_schema().await.unwrap().aggregate_search);
    assert!(matches!(
        store.list_inspected(&of("agg-1", 10)).await,
        Err(Error::Schema(_))
    ));
}

/// A paced replay's batches (`replay_ids_after`, then a replay between
/// `after_id` and `through_id`): the filter's rows in id order, archived
/// ones included when a time range is given, each batch exactly its ids.
async fn a_paced_replay_walks_its_rows_in_id_order_by_batches(store: Arc<dyn OutboxStore>) {
    let evs = events(10, "T");
    enqueue(store.as_ref(), &evs).await;
    // The two oldest delivered and archived, the rest pending.
    let archived = deliver_and_archive(store.as_ref(), 2).await;
    let live = store
        .list(&EventFilter {
            limit: 20,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut all: Vec<i64> = live.iter().map(|r| r.id).collect();
    all.extend(archived.iter().map(|c| c.record.id));
    all.sort_unstable();
    let range = EventFilter {
        since_ms: Some(0),
        ..Default::default()
    };
    let first = store.replay_ids_after(&range, 0, 4).await.unwrap();
    assert_eq!(first, all[..4], "the oldest four, archived ones first");
    let batch = EventFilter {
        after_id: Some(0),
        through_id: Some(first[3]),
        ..range.clone()
    };
    let replayed = store
        .replay(&ReplaySelector::Filter(batch), false, "test")
        .await
        .unwrap();
    let mut got: Vec<i64> = replayed.iter().map(|r| r.id).collect();
    got.sort_unstable();
    assert_eq!(got, first, "exactly the batch");
    assert!(store.find(&evs[0].event_id).await.unwrap()[0].status == Status::Pending);
    let next = store.replay_ids_after(&range, first[3], 4).await.unwrap();
    assert_eq!(next, all[4..8]);
    let rest = store.replay_ids_after(&range, all[7], 4).await.unwrap();
    assert_eq!(rest, all[8..], "the last, shorter batch");
    assert!(store
        .replay_ids_after(&range, all[9], 4)
        .await
        .unwrap()
        .is_empty());
    // Without a time range only live rows are replayed, as a filter's are.
    let failed = EventFilter {
        status: Some(Status::Failed),
        ..Default::default()
    };
    assert!(store
        .replay_ids_after(&failed, 0, 4)
        .await
        .unwrap()
        .is_empty());
    // The rows of a batch still pending, as the backfill waits on them.
    let waiting = EventFilter {
        status: Some(Status::Pending),
        after_id: Some(first[0] - 1),
        through_id: Some(first[3]),
        limit: 10,
        ..Default::default()
    };
    assert_eq!(store.list(&waiting).await.unwrap().len(), 4);
}

/// Workers claiming at the same time never get the same row: each of 200
/// rows is delivered by exactly one of four workers, whatever the claim
/// does to keep them apart (`SKIP LOCKED`, lock-then-update, `BEGIN
/// IMMEDIATE`).
async fn concurrent_claims_never_share_a_row(store: Arc<dyn OutboxStore>) {
    let evs = events(200, "Concurrent");
    enqueue(store.as_ref(), &evs).await;
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                let worker = format!("worker-{w}");
                let mut mine = Vec::new();
                loop {
                    let claimed = store
                        .claim(ClaimSource::Pending, &req(&worker, 7, 30_000))
                        .await
                        .expect("claim");
                    if claimed.is_empty() {
                        break mine;
                    }
                    let fence = claimed[0].fence();
                    let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
                    assert_eq!(
                        store.mark_delivered(&fence, &ids).await.expect("mark"),
                        ids.len() as u64,
                        "{worker} lost rows it had just claimed"
                    );
                    mine.extend(ids);
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.expect("worker"));
    }
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "a row was claimed by two workers");
    assert_eq!(n, 200, "every row claimed once");
    assert_eq!(stats(store.as_ref()).await.delivered, 200);
}

/// How a database numbers the rows of one `INSERT … SELECT`, for
/// [`claims_use_their_index_over`].
pub struct Numbers {
    /// A `FROM` of the rows numbered 1 to `{n}`.
    pub from: &'static str,
    /// The column that holds the number.
    pub column: &'static str,
    /// The statement that refreshes the statistics of the table `{t}`.
    pub analyze: &'static str,
}

impl Numbers {
    /// PostgreSQL's `generate_series`.
    pub const POSTGRES: Numbers = Numbers {
        from: "generate_series(1, {n}) g",
        column: "g",
        analyze: "ANALYZE {t}",
    };
    /// MariaDB's sequence engine.
    pub const MARIADB: Numbers = Numbers {
        from: "seq_1_to_{n}",
        column: "seq",
        analyze: "ANALYZE TABLE {t}",
    };
}

/// With tenant `plan`'s 150 pending, 200 retryable and 200 leased rows,
/// half of each due, and a million delivered ones, beside another tenant's
/// backlog (written on `pool` in one statement each, the rows numbered as
/// `numbers` says, then analysed), every claim query reads through its
/// `app_code`-led index and at most 250 rows (the 100 rows claimed, read
/// once through the claim index and once by primary key for the update,
/// with a little slack), and explaining changes nothing. Drops the tables;
/// returns the plans.
pub async fn claims_use_their_index_over<DB>(
    store: Arc<dyn OutboxStore>,
    pool: sqlx::Pool<DB>,
    numbers: &Numbers,
) -> Vec<postbox_core::store::QueryPlan>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    let t = store.table().as_str();
    let i = numbers.column;
    let rows = |n: u32| numbers.from.replace("{n}", &n.to_string());
    let load = [
        // History: a million delivered rows of the tenant being claimed.
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'plan', CONCAT('d-', {i}), 'Old', '{{}}', 'delivered', 1000000000000 + {i}, 1000000000000 + {i} \
             FROM {}",
            rows(1_000_000)
        ),
        // Another tenant's backlog, which a claim for `plan` must not read.
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload) \
             SELECT 'other', CONCAT('o-', {i}), 'New', '{{}}' FROM {}",
            rows(20_000)
        ),
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload) \
             SELECT 'plan', CONCAT('p-', {i}), 'New', '{{}}' FROM {}",
            rows(150)
        ),
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, retry_count, next_retry_at_ms) \
             SELECT 'plan', CONCAT('r-', {i}), 'Retry', '{{}}', 'retryable', 1, \
               CASE WHEN {i} <= 100 THEN 0 ELSE 9000000000000000 END \
             FROM {}",
            rows(200)
        ),
        format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, worker_id, lock_until_ms) \
             SELECT 'plan', CONCAT('l-', {i}), 'Leased', '{{}}', 'delivering', 'w', \
               CASE WHEN {i} <= 100 THEN 0 ELSE 9000000000000000 END \
             FROM {}",
            rows(200)
        ),
        numbers.analyze.replace("{t}", t),
    ];
    for sql in &load {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let plans = store.explain_claims("plan", 100).await.unwrap();
    // Each row taken is read up to three times: its claim-index entry,
    // its row where the claim locks it, and its row where it is updated.
    crate::assert_claim_plans(&plans, 3 * 100 + 50);
    // The counts read the open rows' indexes only; a million delivered rows
    // are estimated, not counted.
    let s = store.stats(&["plan".into()]).await.unwrap().remove(0);
    assert_eq!((s.pending, s.retryable, s.delivering), (150, 200, 200));
    assert!(s.delivered_estimated, "{s:?}");
    assert!(
        (500_000..=2_000_000).contains(&s.delivered),
        "an estimate near 1,000,000 delivered rows: {s:?}"
    );
    sqlx::query(&format!("DROP TABLE {t}, {t}_archive, {t}_history"))
        .execute(&pool)
        .await
        .unwrap();
    plans
}

/// A replay's status filter reads an archived row's own status: a
/// sampled-out (`dropped`) row archived beside delivered ones is not
/// replayed by `--status delivered` (it was, sent as if delivered once),
/// and `--status dropped` reaches it.
pub async fn a_replay_by_status_tells_archived_dropped_rows_from_delivered<DB>(
    store: Arc<dyn OutboxStore>,
    pool: sqlx::Pool<DB>,
) where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    use postbox_core::store::{EventFilter, ReplaySelector};
    let evs = events(2, "T");
    enqueue(store.as_ref(), &evs).await;
    deliver_all(store.as_ref()).await;
    let sql = store.table().render(&format!(
        "UPDATE {{table}} SET status = 'dropped' WHERE event_id = '{}'",
        evs[0].event_id
    ));
    sqlx::query(&sql).execute(&pool).await.expect(&sql);
    let now = store.now_ms().await.expect("now");
    assert_eq!(archive_delivered(store.as_ref(), 10).await.moved, 2);
    let by = |status: Status, dry_run: bool| {
        let store = store.clone();
        async move {
            let range = ReplaySelector::Filter(EventFilter {
                app_code: Some(APP.to_owned()),
                since_ms: Some(now - 3_600_000),
                until_ms: Some(now + 60_000),
                status: Some(status),
                ..Default::default()
            });
            let rows = store.replay(&range, dry_run, "test").await.expect("replay");
            rows.into_iter().map(|r| r.event_id).collect::<Vec<_>>()
        }
    };
    // A search by status finds the archived rows of either status (the
    // dashboard's "dropped" found none: only `delivered` read the archive).
    for (status, ev) in [(Status::Dropped, &evs[0]), (Status::Delivered, &evs[1])] {
        let listed = store
            .list_inspected(&EventFilter {
                app_code: Some(APP.to_owned()),
                status: Some(status),
                limit: 10,
                ..Default::default()
            })
            .await
            .expect("list");
        let found: Vec<_> = listed
            .iter()
            .map(|r| (r.record.event_id.clone(), r.archived))
            .collect();
        assert_eq!(found, [(ev.event_id.clone(), true)], "{status:?}");
    }
    assert_eq!(by(Status::Dropped, true).await, [evs[0].event_id.clone()]);
    assert_eq!(by(Status::Delivered, true).await, [evs[1].event_id.clone()]);
    assert_eq!(
        by(Status::Delivered, false).await,
        [evs[1].event_id.clone()]
    );
    assert!(
        store.find(&evs[0].event_id).await.expect("find").is_empty(),
        "the dropped row stays archived"
    );
}

/// The archive holds another event under the id a live row has (ids
/// reused: MySQL 5.7 restarts AUTO_INCREMENT at the table's highest id,
/// so ids of archived rows come back; `TRUNCATE … RESTART IDENTITY`).
/// The row cannot be copied under its id, and it is not archived: it
/// stays in the outbox, never deleted as if the archive held it.
pub async fn archive_keeps_a_row_whose_id_the_archive_holds_for_another_event<DB>(
    store: Arc<dyn OutboxStore>,
    pool: sqlx::Pool<DB>,
) where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    let old = events(1, "T");
    enqueue(store.as_ref(), &old).await;
    deliver_all(store.as_ref()).await;
    assert_eq!(archive_delivered(store.as_ref(), 10).await.moved, 1);
    let new = events(1, "T");
    let new_id = match store.enqueue_batch(&new, 1 << 20).await.expect("enqueue")[..] {
        [EnqueueOutcome::Inserted(id)] => id,
        ref other => panic!("{other:?}"),
    };
    deliver_all(store.as_ref()).await;
    // The archived event now holds the live row's id, as after a reset.
    let t = store.table().clone();
    let sql = t.render(&format!(
        "UPDATE {{archive}} SET id = {new_id} WHERE event_id = '{}'",
        old[0].event_id
    ));
    sqlx::query(&sql).execute(&pool).await.expect(&sql);
    // Later rows: the archiver moves past the one it cannot take, even
    // one row a batch (it filled every batch, which moved nothing).
    let later = events(2, "T");
    enqueue(store.as_ref(), &later).await;
    deliver_all(store.as_ref()).await;

    let report = archive_delivered(store.as_ref(), 1).await;
    assert_eq!(report.moved, 2, "{report:?}");
    let live = store.find(&new[0].event_id).await.expect("find");
    assert_eq!(
        live.len(),
        1,
        "row {new_id} deleted from the outbox, and not archived"
    );
    assert_eq!(live[0].status, Status::Delivered);
}

/// `migrate` after the outbox table (then its `_archive`/`_history`) were
/// dropped by hand: the ledger still records version 3, yet `migrate`
/// recreates what is missing, says so, and the store works again. Not a
/// listed case because dropping tables needs the backend's `pool` (each
/// `DROP` runs on it outside any transaction).
pub async fn migrate_recreates_tables_dropped_by_hand<DB>(
    store: Arc<dyn OutboxStore>,
    pool: sqlx::Pool<DB>,
) where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    let exec = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(&sql).execute(&pool).await.expect(&sql);
        }
    };
    let t = store.table().as_str().to_owned();
    let missing = |report: &postbox_core::store::SchemaReport| -> Vec<String> {
        report
            .objects
            .iter()
            .filter(|o| !o.present)
            .map(|o| o.name.clone())
            .collect()
    };
    let claim_one = || async {
        let req = claim_request("room", "w-migrate", 10, 30_000);
        let claimed = store
            .claim(ClaimSource::Pending, &req)
            .await
            .expect("claim");
        assert_eq!(claimed.len(), 1, "{claimed:?}");
        let fence = claimed[0].fence();
        let id = claimed[0].record.id;
        assert_eq!(
            store.mark_delivered(&fence, &[id]).await.expect("deliver"),
            1
        );
        id
    };
    let enqueue = |n: &'static str| {
        let store = store.clone();
        async move {
            let out = store
                .enqueue_batch(&[NewEvent::new("room", n, "{}")], 1 << 20)
                .await
                .expect("enqueue");
            assert!(matches!(out[..], [EnqueueOutcome::Inserted(_)]), "{out:?}");
        }
    };

    // 1. Every table dropped: a new table again, every version applied.
    enqueue("Before").await;
    claim_one().await;
    for suffix in ["", "_archive", "_history"] {
        exec(format!("DROP TABLE {t}{suffix}")).await;
    }
    let report = store.migrate().await.expect("migrate after drop");
    // Every database has versions 1 to 3, 5 (the index per status), 7
    // (the head index), 8 (pending rows by event type), 9 (the runtime
    // controls), 10 (the relay registry) and 11 (sampling); PostgreSQL adds
    // its wake-up trigger (4), the databases with partial indexes
    // (PostgreSQL, SQLite) the pending index in claim order (6).
    let latest = report.version;
    let mariadb = [1, 2, 3, 5, 7, 8, 9, 10, 11];
    let sqlite = [1, 2, 3, 5, 6, 7, 8, 9, 10, 11];
    let postgres = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11];
    assert!(
        [&mariadb[..], &sqlite, &postgres].contains(&report.applied.as_slice()),
        "{report:?}"
    );
    assert_eq!(Some(&latest), report.applied.last(), "{report:?}");
    let every_version = report.applied.clone();
    assert!(
        report.notes.iter().any(|n| n.contains("does not exist")),
        "{report:?}"
    );
    let schema = store.inspect_schema().await.expect("inspect");
    assert!(missing(&schema).is_empty(), "{:?}", missing(&schema));
    assert_eq!(schema.version, latest);
    assert_eq!(schema.latest_version, latest);
    enqueue("AfterDrop").await;
    let kept = claim_one().await;
    let again = store.migrate().await.expect("third migrate");
    assert!(
        again.applied.is_empty() && again.notes.is_empty(),
        "{again:?}"
    );

    // 2. Only `_archive` and `_history` dropped: recreated, no version
    //    applied, and the report says which.
    exec(format!("DROP TABLE {t}_archive")).await;
    exec(format!("DROP TABLE {t}_history")).await;
    let report = store.migrate().await.expect("migrate after partial drop");
    assert!(report.applied.is_empty(), "{report:?}");
    assert_eq!(report.version, latest);
    for suffix in ["_archive", "_history"] {
        let name = format!("`{t}{suffix}`");
        assert!(
            report.notes.iter().any(|n| n.contains(&name)),
            "{name}: {report:?}"
        );
    }
    let schema = store.inspect_schema().await.expect("inspect");
    assert!(missing(&schema).is_empty(), "{:?}", missing(&schema));

    // 3. Only the outbox table dropped while its archive keeps rows: the
    //    recreated table's ids continue after the archive's, so archiving
    //    never meets (and silently skips) an id that is already there.
    exec(format!(
        "INSERT INTO {t}_archive ({c}) SELECT {c} FROM {t}",
        c = postbox_sqlx::columns!()
    ))
    .await;
    exec(format!("DROP TABLE {t}")).await;
    let report = store.migrate().await.expect("migrate after outbox drop");
    assert_eq!(report.applied, every_version, "{report:?}");
    enqueue("AfterOutboxDrop").await;
    let id = claim_one().await;
    assert!(id > kept, "id {id} reuses an archived id (<= {kept})");
}

/// Issue 14.1: a control is stored in place of its key's, read back by
/// every relay's `controls()`, cleared, and every change is logged with
/// who made it, newest first.
async fn controls_are_set_cleared_and_logged(store: Arc<dyn OutboxStore>) {
    use postbox_core::config::Delivery;
    use postbox_core::control::{Control, ANY};
    assert!(store.controls().await.expect("no controls").is_empty());
    let tick = Control {
        delivery: Some(Delivery::AtMostOnce),
        max_retry_count: Some(0),
        ..Control::new(APP, "Tick")
    };
    let stored = store.set_control(&tick, "cli ops@host").await.expect("set");
    assert_eq!(stored.updated_by, "cli ops@host");
    assert!(stored.updated_at_ms > 1_700_000_000_000, "{stored:?}");
    // Set again: replaced, not added.
    let tick2 = Control {
        max_retry_count: None,
        ..tick.clone()
    };
    store
        .set_control(&tick2, "api eve@10.0.0.1")
        .await
        .expect("set again");
    let pause = Control {
        paused: true,
        ..Control::new(APP, ANY)
    };
    store
        .set_control(&pause, "cli ops@host")
        .await
        .expect("pause");
    let all = store.controls().await.expect("read");
    assert_eq!(all.len(), 2, "{all:?}");
    let read_tick = all.iter().find(|c| c.event_type == "Tick").unwrap();
    assert_eq!(
        (read_tick.delivery, read_tick.max_retry_count),
        (Some(Delivery::AtMostOnce), None)
    );
    assert!(all.iter().any(|c| c.paused && c.event_type == ANY));
    // A control with a blank key is refused, naming why.
    let blank = Control {
        paused: true,
        ..Control::new("", ANY)
    };
    let err = store
        .set_control(&blank, "x")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("app_code and event_type"), "{err}");
    assert!(store
        .clear_control(APP, ANY, "cli ops@host")
        .await
        .expect("clear"));
    assert!(!store
        .clear_control(APP, ANY, "cli ops@host")
        .await
        .expect("clear again"));
    let log = store.control_log(10).await.expect("log");
    let said: Vec<(&str, &str, &str)> = log
        .iter()
        .map(|e| (e.by.as_str(), e.event_type.as_str(), e.change.as_str()))
        .collect();
    assert_eq!(
        said,
        [
            ("cli ops@host", "*", "cleared"),
            ("cli ops@host", "*", "paused"),
            ("api eve@10.0.0.1", "Tick", "delivery=at_most_once"),
            (
                "cli ops@host",
                "Tick",
                "delivery=at_most_once max_retry_count=0"
            ),
        ]
    );
    assert_eq!(store.control_log(1).await.unwrap().len(), 1);
}

/// Issue 14.1: a running relay applies a control set meanwhile (by another
/// process; here the store) before its next claims: an app_code paused is
/// not claimed while another goes on, and once cleared it drains; a type
/// set to `max_retry_count = 0` is dead-lettered at its first failure
/// instead of retried as the config says.
async fn relay_applies_controls_while_it_runs(store: Arc<dyn OutboxStore>) {
    use postbox_core::control::{Control, ANY};
    let held_app = "conf_held";
    let control = Control::new;
    store
        .set_control(
            &Control {
                paused: true,
                ..control(held_app, ANY)
            },
            "test",
        )
        .await
        .unwrap();
    let p = Arc::new(RecordingPublisher::new("rec").failing_type("Fragile"));
    let config = WorkerConfig {
        max_retry_count: 5,
        ..fast_worker()
    };
    let settings = RelaySettings::new(config, vec![APP.to_owned(), held_app.to_owned()])
        .expect("a valid [outbox_worker]");
    let shutdown = CancellationToken::new();
    let handle =
        tokio::spawn(Relay::new(store.clone(), vec![p.clone()], settings).run(shutdown.clone()));
    let held: Vec<NewEvent> = (0..3)
        .map(|_| NewEvent::new(held_app, "Held", "{}"))
        .collect();
    enqueue(store.as_ref(), &held).await;
    enqueue(store.as_ref(), &events(3, "Free")).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats(store.as_ref()).await.delivered < 3 {
        assert!(
            Instant::now() < deadline,
            "the free app_code was not delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = app_stats(store.as_ref(), held_app).await;
    assert_eq!(
        (s.pending, s.delivered),
        (3, 0),
        "a paused app_code is not claimed: {s:?}"
    );
    // max_retry_count 0 for Fragile, set while the relay runs.
    store
        .set_control(
            &Control {
                max_retry_count: Some(0),
                ..control(APP, "Fragile")
            },
            "test",
        )
        .await
        .unwrap();
    tokio::time::sleep(postbox_core::control::REFRESH + Duration::from_millis(300)).await;
    let fragile = NewEvent::new(APP, "Fragile", "{}");
    enqueue(store.as_ref(), std::slice::from_ref(&fragile)).await;
    while stats(store.as_ref()).await.failed < 1 {
        assert!(Instant::now() < deadline, "Fragile was not dead-lettered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(p.attempts(&fragile.event_id), 1, "one attempt, no retry");
    // Cleared, the held app_code drains.
    assert!(store.clear_control(held_app, ANY, "test").await.unwrap());
    while app_stats(store.as_ref(), held_app).await.delivered < 3 {
        assert!(
            Instant::now() < deadline,
            "the resumed app_code was not delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    handle.await.expect("relay task").expect("relay run");
}

/// Issue 14.1: a paused event type stays `pending` and does not delay the
/// other types of its app_code, with either ordering: the pending claims
/// leave it out, and a retry of it that falls due is given back as
/// `retryable` without an attempt counted. Per aggregate, a paused head
/// still holds its aggregate back. Cleared, everything is delivered.
async fn relay_holds_a_paused_event_type_and_delivers_the_others(store: Arc<dyn OutboxStore>) {
    use postbox_core::config::Ordering;
    use postbox_core::control::Control;
    for (app, ordering) in [
        ("conf_typed", Ordering::None),
        ("conf_typed_agg", Ordering::PerAggregate),
    ] {
        let new = |ty: &str, agg: String, v: i64| NewEvent::new(app, ty, "{}").aggregate(agg, v);
        // A Tick that failed once and is due now: the due-retry sweep takes it.
        enqueue(store.as_ref(), &[new("Tick", "tick-r".into(), 1)]).await;
        let claimed = store
            .claim(ClaimSource::Pending, &claim_request(app, "w0", 10, 30_000))
            .await
            .unwrap();
        let retry = first_failure_due_now("first try", "rec");
        let retried = claimed[0].record.clone();
        store
            .mark_failed(&claimed[0].fence(), &[retried.id], &retry)
            .await
            .unwrap();
        let pause = Control {
            paused: true,
            ..Control::new(app, "Tick")
        };
        store.set_control(&pause, "test").await.unwrap();
        let ticks: Vec<NewEvent> = (0..5)
            .map(|i| new("Tick", format!("tick-{i}"), 1))
            .collect();
        let orders: Vec<NewEvent> = (0..5)
            .map(|i| new("Order", format!("order-{i}"), 1))
            .collect();
        // An Order behind a Tick of its aggregate.
        let behind = [
            new("Tick", "mixed".into(), 1),
            new("Order", "mixed".into(), 2),
        ];
        enqueue(store.as_ref(), &ticks).await;
        enqueue(store.as_ref(), &orders).await;
        enqueue(store.as_ref(), &behind).await;
        let p = Arc::new(RecordingPublisher::new("rec"));
        let config = WorkerConfig {
            ordering,
            ..fast_worker()
        };
        let settings = RelaySettings::new(config, vec![app.to_owned()]).expect("[outbox_worker]");
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(
            Relay::new(store.clone(), vec![p.clone()], settings).run(shutdown.clone()),
        );
        let unordered = ordering == Ordering::None;
        let free = if unordered { 6 } else { 5 };
        wait_until(
            "the other type delivered",
            Duration::from_secs(20),
            async || app_stats(store.as_ref(), app).await.delivered >= free,
        )
        .await;
        // Sweeps enough to take the due Tick (and give it back).
        tokio::time::sleep(Duration::from_millis(500)).await;
        let s = app_stats(store.as_ref(), app).await;
        let held_back = if unordered { 0 } else { 1 };
        assert_eq!(
            (s.delivered, s.pending, s.retryable),
            (free, 6 + held_back, 1),
            "{app}: the paused type waits: {s:?}"
        );
        let row = status_of(store.as_ref(), &retried.event_id).await;
        assert_eq!(
            (row.status, row.retry_count, row.last_error.as_deref()),
            (Status::Retryable, 1, Some("paused by a runtime control")),
            "{app}: the due Tick was given back, no attempt counted"
        );
        for e in ticks.iter().chain([&behind[0]]) {
            assert_eq!(
                p.attempts(&e.event_id),
                0,
                "{app}: a paused Tick was published"
            );
        }
        // Cleared, the Ticks go (the due one within its recheck).
        assert!(store.clear_control(app, "Tick", "test").await.unwrap());
        wait_until(
            "the resumed type delivered",
            Duration::from_secs(20),
            async || app_stats(store.as_ref(), app).await.delivered >= 13,
        )
        .await;
        assert_eq!(
            status_of(store.as_ref(), &retried.event_id)
                .await
                .retry_count,
            1
        );
        shutdown.cancel();
        handle.await.expect("relay task").expect("relay run");
    }
}

/// A paused type's due retries, a hundred of them, come before another
/// type's in due order: the other type's retry is delivered at once. The
/// due-retry claim takes rows in due order whatever their type, and gave
/// back a batch of the paused type per round: at the default poll of a
/// second and a batch of 10, the other retry waited ten seconds.
async fn a_paused_types_due_retries_do_not_hold_back_the_others(store: Arc<dyn OutboxStore>) {
    use postbox_core::control::Control;
    let app = "conf_paused_retries";
    let fail_now = async |events: &[NewEvent]| {
        enqueue(store.as_ref(), events).await;
        let claimed = store
            .claim(
                ClaimSource::Pending,
                &claim_request(app, "w0", 1_000, 30_000),
            )
            .await
            .unwrap();
        let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
        store
            .mark_failed(
                &claimed[0].fence(),
                &ids,
                &first_failure_due_now("down", "rec"),
            )
            .await
            .unwrap();
    };
    let audits: Vec<NewEvent> = (0..100)
        .map(|_| NewEvent::new(app, "Audit", "{}"))
        .collect();
    fail_now(&audits).await;
    let pay = NewEvent::new(app, "Pay", "{}");
    fail_now(std::slice::from_ref(&pay)).await;
    let pause = Control {
        paused: true,
        ..Control::new(app, "Audit")
    };
    store.set_control(&pause, "test").await.unwrap();
    let p = Arc::new(RecordingPublisher::new("rec"));
    let config = WorkerConfig {
        batch_size: 10,
        ..WorkerConfig::default()
    };
    let settings = RelaySettings::new(config, vec![app.to_owned()]).expect("[outbox_worker]");
    let shutdown = CancellationToken::new();
    let handle =
        tokio::spawn(Relay::new(store.clone(), vec![p.clone()], settings).run(shutdown.clone()));
    let started = std::time::Instant::now();
    wait_until(
        "the other type's retry delivered",
        Duration::from_secs(4),
        async || p.attempts(&pay.event_id) > 0,
    )
    .await;
    // Given back a second time while the pause lasts, a paused retry waits
    // a minute, not 5 s: due every 5 s, a paused backlog came back faster
    // than a relay claims past it, and was rewritten every 5 s.
    tokio::time::sleep(Duration::from_secs(7).saturating_sub(started.elapsed())).await;
    shutdown.cancel();
    handle.await.expect("relay task").expect("relay run");
    assert!(
        audits.iter().all(|e| p.attempts(&e.event_id) == 0),
        "a paused Audit was published"
    );
    let now = store.now_ms().await.unwrap();
    let row = status_of(store.as_ref(), &audits[0].event_id).await;
    assert!(
        row.next_retry_at_ms - now > 30_000,
        "the paused retry, given back twice, is due in {} ms",
        row.next_retry_at_ms - now
    );
}

/// Issue 14.5: heartbeats register a relay in `<table>_relays`, each one
/// replacing the last; its last one says it stopped. A running relay
/// writes its own, with what it claimed and delivered.
async fn relays_register_by_their_heartbeats(store: Arc<dyn OutboxStore>) {
    use postbox_core::store::RelayBeat;
    let beat = RelayBeat {
        worker_id: "conf-w1".into(),
        host: "h1".into(),
        pid: 42,
        app_codes: vec![APP.into(), "other".into()],
        claimed: 5,
        delivered: 4,
        failed: 1,
        per_minute: 240,
        stopped: false,
    };
    store.beat(&beat).await.expect("first beat");
    let later = RelayBeat {
        delivered: 5,
        ..beat.clone()
    };
    store.beat(&later).await.expect("second beat");
    // The registry's row of `worker`.
    let registered = async |worker: &str| {
        let seen = store.relays().await.expect("relays");
        seen.into_iter()
            .find(|r| r.beat.worker_id == worker)
            .unwrap_or_else(|| panic!("{worker} is not registered"))
    };
    let r = registered("conf-w1").await;
    assert_eq!(
        (&r.beat, r.state, r.stopped_at_ms),
        (&later, "running", None)
    );
    assert!(r.seen_at_ms >= r.started_at_ms, "{r:?}");
    let last = RelayBeat {
        stopped: true,
        ..later.clone()
    };
    store.beat(&last).await.expect("last beat");
    let r = registered("conf-w1").await;
    assert_eq!((r.state, r.beat.stopped), ("stopped", true));
    assert!(
        r.stopped_at_ms.is_some_and(|at| at >= r.started_at_ms),
        "{r:?}"
    );

    // A relay that runs and stops.
    enqueue(store.as_ref(), &events(3, "T")).await;
    let p = Arc::new(RecordingPublisher::new("rec"));
    let settings =
        RelaySettings::new(fast_worker(), vec![APP.to_owned()]).expect("[outbox_worker]");
    let shutdown = CancellationToken::new();
    let relay = Relay::new(store.clone(), vec![p], settings).with_worker_id("conf-relay");
    let handle = tokio::spawn(relay.run(shutdown.clone()));
    wait_until("3 delivered", Duration::from_secs(20), async || {
        stats(store.as_ref()).await.delivered >= 3
    })
    .await;
    shutdown.cancel();
    handle.await.expect("relay task").expect("relay run");
    let r = registered("conf-relay").await;
    assert_eq!(
        (
            r.state,
            r.beat.claimed,
            r.beat.delivered,
            r.beat.app_codes.clone()
        ),
        ("stopped", 3, 3, vec![APP.to_owned()]),
        "{r:?}"
    );
    assert_eq!(r.beat.pid, std::process::id());
}

/// Issue 14.1: sampling at 50 % delivers about half of a type's events
/// and marks the others `dropped` with the reason, no publisher seeing
/// them, the same ones any relay would pick; the other types are untouched.
/// A dropped event replayed by name is delivered; `archive` moves dropped
/// rows with the delivered ones.
async fn relay_samples_a_type_and_drops_the_rest(store: Arc<dyn OutboxStore>) {
    use postbox_core::control::{sampled_in, Control};
    let sample = Control {
        sample_percent: Some(50),
        ..Control::new(APP, "Tick")
    };
    store
        .set_control(&sample, "test")
        .await
        .expect("set sampling");
    let ticks = events(200, "Tick");
    let others = events(20, "Other");
    enqueue(store.as_ref(), &ticks).await;
    enqueue(store.as_ref(), &others).await;
    let p = Arc::new(RecordingPublisher::new("rec"));
    let settings =
        RelaySettings::new(fast_worker(), vec![APP.to_owned()]).expect("[outbox_worker]");
    let shutdown = CancellationToken::new();
    let handle =
        tokio::spawn(Relay::new(store.clone(), vec![p.clone()], settings).run(shutdown.clone()));
    let dropped = |limit| {
        let store = store.clone();
        async move {
            let filter = EventFilter {
                app_code: Some(APP.into()),
                status: Some(Status::Dropped),
                limit,
                ..Default::default()
            };
            store.list(&filter).await.expect("list dropped")
        }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = stats(store.as_ref()).await;
        if s.pending + s.delivering + s.retryable == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "not all handled: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let gone = dropped(500).await;
    let counts = stats(store.as_ref()).await;
    let delivered = counts.delivered;
    assert_eq!(
        counts.dropped,
        gone.len() as i64,
        "status counts the dropped rows too"
    );
    println!(
        "sampling at 50 %: {} of 200 dropped, {delivered} delivered",
        gone.len()
    );
    assert_eq!(gone.len() as i64 + delivered, 220);
    assert!(
        (60..=140).contains(&gone.len()),
        "about half dropped: {}",
        gone.len()
    );
    for row in &gone {
        assert_eq!(row.event_type, "Tick");
        assert!(
            !sampled_in(&row.event_id, 50),
            "{} was sampled in",
            row.event_id
        );
        assert_eq!(
            p.attempts(&row.event_id),
            0,
            "a dropped event reached a publisher"
        );
        let why = row.last_error.as_deref().unwrap_or_default();
        assert!(why.contains("sampled out") && why.contains("50 %"), "{why}");
        assert_eq!(row.retry_count, 0, "no attempt counted");
    }
    for e in &others {
        assert_eq!(p.attempts(&e.event_id), 1, "another type is untouched");
    }
    let history = store.history(&gone[0].event_id).await.expect("history");
    assert!(
        history.iter().any(|h| h.kind == HistoryKind::Dropped),
        "{history:?}"
    );
    // Replayed by name, a dropped event goes.
    let by_id = ReplaySelector::EventIds {
        app_code: None,
        event_ids: vec![gone[0].event_id.clone()],
    };
    assert_eq!(store.replay(&by_id, false, "test").await.unwrap().len(), 1);
    wait_until(
        "the replayed dropped event delivered",
        Duration::from_secs(20),
        async || status_of(store.as_ref(), &gone[0].event_id).await.status == Status::Delivered,
    )
    .await;
    shutdown.cancel();
    handle.await.expect("relay task").expect("relay run");
    // Archived with the delivered rows.
    let req = ArchiveRequest {
        app_codes: vec![APP.to_owned()],
        before_ms: store.now_ms().await.expect("now") + 60_000,
        batch_size: 100,
        max_batches: None,
        partitions: Default::default(),
    };
    let report = store.archive(&req, &|_| {}).await.expect("archive");
    assert_eq!(report.moved, 220, "{report:?}");
    assert!(dropped(10).await.is_empty());
}

#[cfg(test)]
mod tests {
    use super::CASES;

    /// Backs `dead_code` up for a case written `pub` (exported, so never
    /// dead): every `async fn` of this file that takes only a store is a
    /// listed case, and every listed case is one.
    #[test]
    fn every_case_taking_only_a_store_is_listed() {
        // A case takes one argument, the store: its signature on one line,
        // or as rustfmt breaks a long one (`(\n    store: …,\n)`).
        let mut written: Vec<&str> = include_str!("conformance.rs")
            .split("async fn ")
            .skip(1)
            .filter_map(|rest| {
                let (name, args) = rest.split_once('(')?;
                let after = args
                    .trim_start()
                    .strip_prefix("store: Arc<dyn OutboxStore>")?;
                after
                    .trim_start_matches(',')
                    .trim_start()
                    .starts_with(')')
                    .then_some(name)
            })
            .collect();
        let mut listed = CASES.to_vec();
        written.sort_unstable();
        listed.sort_unstable();
        assert_eq!(written, listed, "a case function is missing from `cases!`");
    }
}
