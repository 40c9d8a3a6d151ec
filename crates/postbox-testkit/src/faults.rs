//! A store whose result writes fail on demand, as when a database
//! connection dies around a COMMIT; and the relay cases that use it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use postbox_core::event::Fence;
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::store::{
    AppStats, ArchiveReport, ArchiveRequest, ClaimRequest, EnqueueOutcome, EventFilter,
    FailureUpdate, HistoryEntry, MigrateReport, MinuteCount, OutboxStore, QueryPlan,
    ReplaySelector, ReplayTargets, SchemaReport, StuckAggregate,
};
use postbox_core::store::{
    ArchiveStore, EnqueueStore, InspectStore, RelayStore, ReplayStore, SchemaStore,
};
use postbox_core::{ClaimSource, ClaimedEvent, Error, EventRecord, NewEvent, Result, TableName};

use crate::conformance::{fast_worker, run_relay_until_for};
use crate::RecordingPublisher;

/// Wraps a real store. With [`lose_first_answers`](Self::lose_first_answers)
/// the first try of every mark is applied and committed, then reported as a
/// lost connection (its answer never arrived); with
/// [`fail_marks`](Self::fail_marks) the next marks fail without being applied.
pub struct FaultyMarks {
    inner: Arc<dyn OutboxStore>,
    lose_answers: std::sync::atomic::AtomicBool,
    /// The marks whose answer was lost once already (by ids).
    lost: Mutex<HashSet<Vec<i64>>>,
    failing: AtomicU32,
}

impl FaultyMarks {
    /// `inner` without faults.
    pub fn new(inner: Arc<dyn OutboxStore>) -> Self {
        FaultyMarks {
            inner,
            lose_answers: false.into(),
            lost: Mutex::new(HashSet::new()),
            failing: AtomicU32::new(0),
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
            "connection lost (FaultyMarks)",
        ),
    )
}

#[async_trait]
impl RelayStore for FaultyMarks {
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
        self.inner.claim(source, req).await
    }
    async fn mark_delivered(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        if self.fail_unapplied() {
            return Err(lost_connection("mark delivered"));
        }
        let n = self.inner.mark_delivered(fence, ids).await?;
        if self.lose_answer(ids) {
            return Err(lost_connection("mark delivered"));
        }
        Ok(n)
    }
    async fn mark_failed(&self, fence: &Fence, id: i64, update: &FailureUpdate) -> Result<bool> {
        if self.fail_unapplied() {
            return Err(lost_connection("mark failed attempt"));
        }
        let applied = self.inner.mark_failed(fence, id, update).await?;
        if self.lose_answer(&[id, update.retry_count as i64]) {
            return Err(lost_connection("mark failed attempt"));
        }
        Ok(applied)
    }
    async fn release(&self, fence: &Fence, ids: &[i64]) -> Result<u64> {
        self.inner.release(fence, ids).await
    }
    async fn now_ms(&self) -> Result<i64> {
        self.inner.now_ms().await
    }
}

#[async_trait]
impl EnqueueStore for FaultyMarks {
    async fn enqueue_batch(&self, events: &[NewEvent], max: usize) -> Result<Vec<EnqueueOutcome>> {
        self.inner.enqueue_batch(events, max).await
    }
}

#[async_trait]
impl InspectStore for FaultyMarks {
    async fn stats(&self, app_codes: &[String]) -> Result<Vec<AppStats>> {
        self.inner.stats(app_codes).await
    }
    async fn present_app_codes(&self) -> Result<Vec<String>> {
        self.inner.present_app_codes().await
    }
    async fn list(&self, filter: &EventFilter) -> Result<Vec<EventRecord>> {
        self.inner.list(filter).await
    }
    async fn delivered_per_minute(
        &self,
        app_code: &str,
        since_ms: i64,
    ) -> Result<Vec<MinuteCount>> {
        self.inner.delivered_per_minute(app_code, since_ms).await
    }
    async fn find(&self, event_id: &str) -> Result<Vec<EventRecord>> {
        self.inner.find(event_id).await
    }
    async fn find_archived(
        &self,
        event_id: &str,
        app_codes: &[String],
    ) -> Result<Vec<EventRecord>> {
        self.inner.find_archived(event_id, app_codes).await
    }
    async fn list_archived(&self, filter: &EventFilter) -> Result<Vec<EventRecord>> {
        self.inner.list_archived(filter).await
    }
    async fn history(&self, event_id: &str) -> Result<Vec<HistoryEntry>> {
        self.inner.history(event_id).await
    }
    async fn archived_event_ids(
        &self,
        app_code: &str,
        event_ids: &[String],
    ) -> Result<Vec<String>> {
        self.inner.archived_event_ids(app_code, event_ids).await
    }
    async fn stuck_aggregates(
        &self,
        app_code: &str,
        older_than_ms: i64,
        limit: u32,
    ) -> Result<Vec<StuckAggregate>> {
        self.inner
            .stuck_aggregates(app_code, older_than_ms, limit)
            .await
    }
}

#[async_trait]
impl ReplayStore for FaultyMarks {
    async fn replay_to(
        &self,
        selector: &ReplaySelector,
        dry_run: bool,
        origin: &str,
        targets: &ReplayTargets,
    ) -> Result<Vec<EventRecord>> {
        self.inner
            .replay_to(selector, dry_run, origin, targets)
            .await
    }
}

#[async_trait]
impl ArchiveStore for FaultyMarks {
    async fn archive(
        &self,
        req: &ArchiveRequest,
        on_batch: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ArchiveReport> {
        self.inner.archive(req, on_batch).await
    }
}

#[async_trait]
impl SchemaStore for FaultyMarks {
    async fn migrate(&self) -> Result<MigrateReport> {
        self.inner.migrate().await
    }
    async fn inspect_schema(&self) -> Result<SchemaReport> {
        self.inner.inspect_schema().await
    }
    async fn explain_claims(&self, app_code: &str, limit: u32) -> Result<Vec<QueryPlan>> {
        self.inner.explain_claims(app_code, limit).await
    }
    async fn explain_index_use(&self, app_code: &str) -> Result<Vec<QueryPlan>> {
        self.inner.explain_index_use(app_code).await
    }
}

const APP: &str = "marks";

/// Issue 9.13 / 11: a mark whose COMMIT went through but whose answer was
/// lost (a killed connection) is retried; the retry finds nothing left to
/// fence and must recognise the rows as its own result, not report "taken
/// over by another relay" with one relay running.
pub async fn relay_recognises_its_own_mark_after_a_lost_answer(store: Arc<dyn OutboxStore>) {
    let good: Vec<NewEvent> = (0..20)
        .map(|n| NewEvent::new(APP, "Good", format!(r#"{{"n":{n}}}"#)))
        .collect();
    let bad: Vec<NewEvent> = (0..3)
        .map(|n| NewEvent::new(APP, "Bad", format!(r#"{{"n":{n}}}"#)))
        .collect();
    store.enqueue_batch(&good, 1 << 20).await.expect("enqueue");
    store.enqueue_batch(&bad, 1 << 20).await.expect("enqueue");
    let faulty: Arc<dyn OutboxStore> =
        Arc::new(FaultyMarks::new(store.clone()).lose_first_answers());
    let publisher = Arc::new(RecordingPublisher::new("rec").failing_type("Bad"));
    let report = run_relay_until_for(faulty, vec![publisher], fast_worker(), APP, |s| {
        s.delivered == 20 && s.failed == 3
    })
    .await;
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
    let good: Vec<NewEvent> = (0..10)
        .map(|n| NewEvent::new(APP, "Good", format!(r#"{{"n":{n}}}"#)))
        .collect();
    store.enqueue_batch(&good, 1 << 20).await.expect("enqueue");
    let faulty = Arc::new(FaultyMarks::new(store.clone()));
    // The first mark and its five retries.
    faulty.fail_marks(6);
    let publisher = Arc::new(RecordingPublisher::new("rec"));
    let shutdown = CancellationToken::new();
    let relay = Relay::new(
        faulty.clone(),
        vec![publisher],
        fast_worker(),
        vec![APP.to_owned()],
    );
    let run = tokio::spawn(relay.run(shutdown.clone()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while faulty.failing_left() > 0 {
        assert!(Instant::now() < deadline, "the relay never marked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let report = run.await.expect("relay task").expect("relay run");
    assert_eq!(report.mark_errors, 10, "{report:?}");
    assert_eq!(report.fenced_out, 0, "not a takeover: {report:?}");
    assert_eq!(report.delivered, 0, "{report:?}");
    let s = store.stats(&[APP.to_owned()]).await.unwrap().remove(0);
    assert_eq!(s.delivering, 10, "left to their leases: {s:?}");
}
