//! A store whose result writes fail on demand, as when a database
//! connection dies around a COMMIT; and the relay cases that use it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use postbox_core::config::RelaySettings;
use postbox_core::event::Fence;
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::store::{ClaimRequest, DeferUpdate, FailureUpdate, OutboxStore, RelayStore};
use postbox_core::wake::{Due, Wake};
use postbox_core::{ClaimSource, ClaimedEvent, Error, EventRecord, NewEvent, Result, TableName};

use crate::conformance::{fast_worker, run_relay_over_until};
use crate::RecordingPublisher;

/// Wraps a real store as a relay sees it, counting every call that reaches
/// the database ([`calls`](Self::calls): all but `backend`, `table`, `wake`
/// and `listen`). With [`lose_first_answers`](Self::lose_first_answers)
/// the first try of every mark is applied and committed, then reported as a
/// lost connection (its answer never arrived); with
/// [`fail_marks`](Self::fail_marks) the next marks fail without being
/// applied; with [`fail_reads`](Self::fail_reads) every `find` fails (the
/// read-back after a lost answer); with [`panic_on_mark`](Self::panic_on_mark)
/// the next mark panics, as a bug in the mark stage would.
pub struct WrappedStore {
    inner: Arc<dyn OutboxStore>,
    lose_answers: AtomicBool,
    /// The marks whose answer was lost once already (by ids).
    lost: Mutex<HashSet<Vec<i64>>>,
    failing: AtomicU32,
    failing_reads: AtomicBool,
    panicking: AtomicBool,
    calls: AtomicU64,
    failure_writes: AtomicU64,
    /// Ids whose `mark_delivered` the database answered as applied.
    marked: Mutex<Vec<i64>>,
    beats: AtomicU64,
}

impl WrappedStore {
    /// `inner` without faults.
    pub fn new(inner: Arc<dyn OutboxStore>) -> Self {
        WrappedStore {
            inner,
            lose_answers: false.into(),
            lost: Mutex::new(HashSet::new()),
            failing: AtomicU32::new(0),
            failing_reads: false.into(),
            panicking: false.into(),
            calls: AtomicU64::new(0),
            failure_writes: AtomicU64::new(0),
            marked: Mutex::new(Vec::new()),
            beats: AtomicU64::new(0),
        }
    }

    /// Ids of the rows the database reported marked delivered, in order
    /// (those of calls that marked every id they were given).
    pub fn marked(&self) -> Vec<i64> {
        self.marked.lock().expect("marked").clone()
    }

    /// `mark_failed` calls so far (each one write, of any number of rows).
    pub fn failure_writes(&self) -> u64 {
        self.failure_writes.load(Ordering::SeqCst)
    }

    /// Heartbeats written so far (each also counted in [`calls`](Self::calls)).
    pub fn beats(&self) -> u64 {
        self.beats.load(Ordering::SeqCst)
    }

    /// Calls so far that reached the database.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn count(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    /// Every `find` fails from now on, as on a lost connection.
    pub fn fail_reads(self) -> Self {
        self.failing_reads.store(true, Ordering::SeqCst);
        self
    }

    /// The next mark call panics (once).
    pub fn panic_on_mark(self) -> Self {
        self.panicking.store(true, Ordering::SeqCst);
        self
    }

    fn panic_once(&self, operation: &str) {
        if self.panicking.swap(false, Ordering::SeqCst) {
            panic!("WrappedStore: a bug in {operation}");
        }
    }

    /// Every mark's first try commits, then fails as a lost connection.
    pub fn lose_first_answers(self) -> Self {
        self.lose_answers.store(true, Ordering::SeqCst);
        self
    }

    /// The next `n` mark calls fail without touching the database.
    pub fn fail_marks(&self, n: u32) {
        self.failing.store(n, Ordering::SeqCst);
    }

    /// Mark calls still to fail.
    pub fn failing_left(&self) -> u32 {
        self.failing.load(Ordering::SeqCst)
    }

    fn fail_unapplied(&self) -> bool {
        self.failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// True the first time the mark of `ids` is answered.
    fn lose_answer(&self, ids: &[i64]) -> bool {
        self.lose_answers.load(Ordering::SeqCst) && self.lost.lock().unwrap().insert(ids.to_vec())
    }
}

fn lost_connection(operation: &'static str) -> Error {
    Error::database(
        operation,
        std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection lost (WrappedStore)",
        ),
    )
}

#[async_trait]
impl RelayStore for WrappedStore {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn table(&self) -> &TableName {
        self.inner.table()
    }
    async fn claim(
        &self,
        source: ClaimSource,
        req: &ClaimRequest<'_>,
    ) -> Result<Vec<ClaimedEvent>> {
        self.count();
        self.inner.claim(source, req).await
    }
    async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        self.count();
        self.panic_once("mark delivered");
        if self.fail_unapplied() {
            return Err(lost_connection("mark delivered"));
        }
        let n = self.inner.mark_delivered(fence, ids).await?;
        if self.lose_answer(ids) {
            return Err(lost_connection("mark delivered"));
        }
        if n == ids.len() as u64 {
            self.marked.lock().expect("marked").extend_from_slice(ids);
        }
        Ok(n)
    }
    async fn mark_failed(&self, fence: &Fence, ids: &[i64], update: &FailureUpdate) -> Result<u64> {
        self.count();
        self.failure_writes.fetch_add(1, Ordering::SeqCst);
        self.panic_once("mark failed attempts");
        if self.fail_unapplied() {
            return Err(lost_connection("mark failed attempts"));
        }
        let applied = self.inner.mark_failed(fence, ids, update).await?;
        let mut key = ids.to_vec();
        key.push(-i64::from(update.retry_count));
        if self.lose_answer(&key) {
            return Err(lost_connection("mark failed attempts"));
        }
        Ok(applied)
    }
    async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        self.count();
        self.inner.release(fence, ids).await
    }
    async fn controls(&self) -> Result<Vec<postbox_core::control::Control>> {
        self.inner.controls().await
    }
    async fn beat(&self, beat: &postbox_core::store::RelayBeat) -> Result<()> {
        self.count();
        self.beats.fetch_add(1, Ordering::SeqCst);
        self.inner.beat(beat).await
    }
    async fn defer(&self, fence: &Fence, ids: &[i64], update: &DeferUpdate) -> Result<u64> {
        self.count();
        self.inner.defer(fence, ids, update).await
    }
    async fn now_ms(&self) -> Result<i64> {
        self.count();
        self.inner.now_ms().await
    }
    async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>> {
        self.count();
        if self.failing_reads.load(Ordering::SeqCst) {
            return Err(lost_connection("find"));
        }
        self.inner.find(event_id).await
    }
    async fn due(&self, app_codes: &[String]) -> Result<Vec<Due>> {
        self.count();
        self.inner.due(app_codes).await
    }
    fn wake(&self) -> Option<Wake> {
        self.inner.wake()
    }
    fn listen(
        &self,
        wake: Wake,
        shutdown: CancellationToken,
    ) -> Option<postbox_core::BoxFuture<'static, ()>> {
        self.inner.listen(wake, shutdown)
    }
}

const APP: &str = "marks";

/// Enqueues `n` events of `event_type`.
async fn enqueue(store: &dyn OutboxStore, n: usize, event_type: &str) {
    let events: Vec<NewEvent> = (0..n)
        .map(|n| NewEvent::new(APP, event_type, format!(r#"{{"n":{n}}}"#)))
        .collect();
    store
        .enqueue_batch(&events, 1 << 20)
        .await
        .expect("enqueue");
}

/// Runs a relay over `faulty` until 20 `Good` events are delivered and 3
/// `Bad` ones (refused by the publisher) dead-lettered.
async fn deliver_20_and_dead_letter_3(faulty: WrappedStore) -> postbox_core::relay::RelayReport {
    let store = faulty.inner.clone();
    enqueue(store.as_ref(), 20, "Good").await;
    enqueue(store.as_ref(), 3, "Bad").await;
    let publisher = Arc::new(RecordingPublisher::new("rec").failing_type("Bad"));
    let watched = store.as_ref();
    run_relay_over_until(
        Arc::new(faulty),
        watched,
        vec![publisher],
        fast_worker(),
        APP,
        |s| s.delivered == 20 && s.failed == 3,
    )
    .await
}

/// Issue 9.13 / 11: a mark whose COMMIT went through but whose answer was
/// lost (a killed connection) is retried; the retry finds nothing left to
/// fence and must recognise the rows as its own result, not report "taken
/// over by another relay" with one relay running.
pub async fn relay_recognises_its_own_mark_after_a_lost_answer(store: Arc<dyn OutboxStore>) {
    let report = deliver_20_and_dead_letter_3(WrappedStore::new(store).lose_first_answers()).await;
    assert_eq!(report.fenced_out, 0, "nothing was taken over: {report:?}");
    assert_eq!(report.mark_errors, 0, "{report:?}");
    assert_eq!(report.delivered, 20, "{report:?}");
    // max_retry_count 3: two retryable attempts and a dead letter each.
    assert_eq!(report.retried, 6, "{report:?}");
    assert_eq!(report.failed, 3, "{report:?}");
}

/// Issue 11: a database error while marking is a database error, not "the
/// lease was taken over".
pub async fn relay_reports_a_failed_mark_as_a_database_error(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), 10, "Good").await;
    let faulty = Arc::new(WrappedStore::new(store.clone()));
    // Every mark fails for longer than the relay tries it (5 s).
    const FAILING: u32 = 1_000;
    faulty.fail_marks(FAILING);
    let publisher = Arc::new(RecordingPublisher::new("rec"));
    let shutdown = CancellationToken::new();
    let settings =
        RelaySettings::new(fast_worker(), vec![APP.to_owned()]).expect("a valid [outbox_worker]");
    let relay = Relay::new(faulty.clone(), vec![publisher], settings);
    let run = tokio::spawn(relay.run(shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while faulty.failing_left() == FAILING {
        assert!(Instant::now() < deadline, "the relay never marked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its tries end within 5 s of the first.
    tokio::time::sleep(Duration::from_secs(7)).await;
    shutdown.cancel();
    let report = run.await.expect("relay task").expect("relay run");
    assert_eq!(report.mark_errors, 10, "{report:?}");
    assert_eq!(report.fenced_out, 0, "not a takeover: {report:?}");
    assert_eq!(report.delivered, 0, "{report:?}");
    let s = store.stats(&[APP.to_owned()]).await.unwrap().remove(0);
    assert_eq!(s.delivering, 10, "left to their leases: {s:?}");
}

/// A database that refuses the relay's marks for a second or two (a
/// restart, a failover) loses no result: the mark is tried again until it
/// goes through. It was given up after 0.6 s (six tries), the rows left to
/// their leases: delivered again, and dead-lettered although delivered
/// when that was their last allowed attempt.
pub async fn relay_rides_out_a_database_blip_while_marking(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), 10, "Good").await;
    let faulty = Arc::new(WrappedStore::new(store.clone()));
    // Eight failed tries: about 1.3 s of pauses between them.
    faulty.fail_marks(8);
    let publisher = Arc::new(RecordingPublisher::new("rec"));
    let report = run_relay_over_until(
        faulty.clone(),
        store.as_ref(),
        vec![publisher],
        fast_worker(),
        APP,
        |s| s.delivered == 10,
    )
    .await;
    assert_eq!(faulty.failing_left(), 0);
    assert_eq!(report.mark_errors, 0, "{report:?}");
    assert_eq!(report.delivered, 10, "{report:?}");
}

/// Issue 11: when a mark's answer was lost and the read-back that tells
/// "our own commit" from "taken over" fails too, the rows are mark errors
/// (a database error), not fenced out. Before, the failed read-back counted
/// and logged them as taken over by another relay, with one relay running.
pub async fn relay_reports_an_unreadable_lost_mark_as_a_database_error(
    store: Arc<dyn OutboxStore>,
) {
    let report =
        deliver_20_and_dead_letter_3(WrappedStore::new(store).lose_first_answers().fail_reads())
            .await;
    assert_eq!(report.fenced_out, 0, "nothing was taken over: {report:?}");
    // Every write committed but none could be confirmed: 20 delivered
    // rows, and per bad row two retryable attempts and a dead letter.
    assert_eq!(report.mark_errors, 20 + 9, "{report:?}");
    assert_eq!(
        report.delivered + report.retried + report.failed,
        0,
        "{report:?}"
    );
}

/// Issue 12: rows that fail alike (a target refusing a whole batch) are
/// written together: one failed-attempt write per batch and attempt, not
/// one transaction per row (before: 40 rows × 3 attempts = 120 writes).
pub async fn relay_writes_a_batch_of_failures_at_once(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), 40, "Bad").await;
    let faulty = Arc::new(WrappedStore::new(store.clone()));
    let publisher = Arc::new(RecordingPublisher::new("rec").failing_type("Bad"));
    let report = run_relay_over_until(
        faulty.clone(),
        store.as_ref(),
        vec![publisher],
        fast_worker(),
        APP,
        |s| s.failed == 40,
    )
    .await;
    // max_retry_count 3: two retryable attempts and a dead letter each.
    assert_eq!((report.retried, report.failed), (80, 40), "{report:?}");
    let writes = faulty.failure_writes();
    assert!(
        (3..=20).contains(&writes),
        "{writes} failure writes for 3 attempts of 40 rows that failed alike"
    );
}

/// Issue 11: a mark stage that fails (here it panics) stops the whole relay
/// by itself: `run` returns an error naming the stage, the claimer stops,
/// batches queued behind the failed one are released, and only the rows the
/// failed stage held keep their leases (to expire and count an attempt).
pub async fn relay_stops_with_an_error_when_its_mark_stage_fails(store: Arc<dyn OutboxStore>) {
    enqueue(store.as_ref(), 40, "Good").await;
    let faulty: Arc<dyn RelayStore> = Arc::new(WrappedStore::new(store.clone()).panic_on_mark());
    let config = postbox_core::config::WorkerConfig {
        batch_size: 5,
        ..fast_worker()
    };
    let settings =
        RelaySettings::new(config, vec![APP.to_owned()]).expect("a valid [outbox_worker]");
    let relay = Relay::new(
        faulty,
        vec![Arc::new(RecordingPublisher::new("rec"))],
        settings,
    );
    // Never cancelled: the relay must stop by itself.
    let run = relay.run(CancellationToken::new());
    let error = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the relay stops by itself when a stage fails")
        .expect_err("a failed stage is an error, not a clean stop");
    let text = error.to_string();
    assert!(text.contains("mark stage panicked"), "{text}");
    assert!(text.contains("a bug in mark delivered"), "{text}");
    let s = store.stats(&[APP.to_owned()]).await.unwrap().remove(0);
    assert_eq!(
        s.delivering, 5,
        "only the failed batch keeps its leases: {s:?}"
    );
    assert_eq!(s.pending + s.delivering, 40, "{s:?}");
}
