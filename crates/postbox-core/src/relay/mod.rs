//! The relay: claim → publish → mark, as three overlapping stages.
//!
//! ```text
//!  claimer ──batch──▶ publisher ──results──▶ marker
//!  (claim queries)    (a lane per publisher, (one fenced UPDATE for the
//!                      each at its own pace)  delivered rows, one per
//!                                             deferral, one per failure)
//! ```
//!
//! The stages are joined by small bounded channels, so while batches are
//! being published the next is already claimed and finished ones are being
//! marked. On shutdown the claimer stops, batches not yet started are
//! released, the publishes in flight finish and are marked, and `run`
//! returns.
//!
//! Each stage returns a `Result`. The first stage that fails (returns an
//! error, or panics: a bug) stops the whole relay: the other stages wind
//! down as on shutdown (releasing the batches they hold), and `run` returns
//! the failure, naming the stage ([`Error::Internal`] for a panic), never a
//! report that looks like a clean stop. Database errors while claiming or
//! marking are not failures: the claimer backs off and tries again, the
//! marker counts them as `mark_errors` and lets the leases expire.
//!
//! Where a row goes after its attempt (delivered, retried, dead-lettered,
//! or not published at all) is decided by [`crate::retry::decide`], in the
//! publish stage; the mark stage writes the decision.

mod bounded;
mod breaker;
mod claimer;
mod controls;
mod heartbeat;
mod marker;
mod publisher;
mod pulse;
mod spans;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
pub use pulse::Pulse;
use serde::Serialize;
use tokio::sync::mpsc;
pub use tokio_util::sync::CancellationToken;

use crate::config::{LeaseBudget, RelaySettings, WakeMode, WorkerConfig};
use crate::event::Fence;
use crate::publish::Publisher;
use crate::store::RelayStore;
use crate::{ClaimedEvent, Error, Result};

/// Counters of one relay run, returned when it stops.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct RelayReport {
    /// Rows claimed.
    pub claimed: u64,
    /// Rows marked delivered.
    pub delivered: u64,
    /// Rows marked retryable.
    pub retried: u64,
    /// Rows dead-lettered.
    pub failed: u64,
    /// Rows left out by sampling (`dropped`).
    pub dropped: u64,
    /// Rows given back at shutdown.
    pub released: u64,
    /// Rows given back for a publisher that was behind (no attempt
    /// counted), keeping what the others confirmed.
    pub deferred: u64,
    /// Results dropped because the lease had been taken over.
    pub fenced_out: u64,
    /// Results not written because the database failed on every try (the
    /// rows' leases expire and they are tried again), or not known to be
    /// written because the answer was lost and reading the rows back failed
    /// too. Never counted as `fenced_out`.
    pub mark_errors: u64,
}

/// A batch claimed by one query.
pub(crate) struct Batch {
    events: Vec<ClaimedEvent>,
    /// When the claim returned, on this host's monotonic clock.
    claimed_at: std::time::Instant,
    /// A row taken over from an expired lease holds the claimer's takeover
    /// gate until its publish has answered (or it is given back): the next
    /// one waits for it (see `claimer::TAKEOVER_BATCH`).
    gate: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Moves committed outbox rows to every publisher.
pub struct Relay {
    store: Arc<dyn RelayStore>,
    publishers: Vec<Arc<dyn Publisher>>,
    config: WorkerConfig,
    app_codes: Vec<String>,
    worker_id: String,
    max_payload_bytes: usize,
    pulse: Pulse,
}

impl Relay {
    /// A relay over `store`, publishing to every publisher, run on checked
    /// settings ([`Settings::relay`](crate::config::Settings::relay) or
    /// [`RelaySettings::new`]).
    pub fn new(
        store: Arc<dyn RelayStore>,
        publishers: Vec<Arc<dyn Publisher>>,
        settings: RelaySettings,
    ) -> Self {
        let (config, app_codes, max_payload_bytes) = settings.into_parts();
        let store = Arc::new(bounded::Bounded {
            inner: store,
            within: config.lease.get(),
        });
        Relay {
            store,
            publishers,
            pulse: Pulse::of(&config),
            config,
            app_codes,
            worker_id: default_worker_id(),
            max_payload_bytes,
        }
    }

    /// Whether this relay's claim loop goes round, for a liveness check
    /// (`/healthz`).
    pub fn pulse(&self) -> Pulse {
        self.pulse.clone()
    }

    /// Sets `database.max_payload_bytes` (default 1 MiB): a claimed row with
    /// a larger payload (written by a plain INSERT, which `enqueue`'s check
    /// never saw) is dead-lettered at once without trying any publisher.
    /// Give it the same limit as the store's `with_max_payload_bytes`: a
    /// store that accepts larger payloads than the relay would enqueue
    /// events the relay then dead-letters.
    pub fn with_max_payload_bytes(mut self, max_payload_bytes: usize) -> Self {
        self.max_payload_bytes = max_payload_bytes;
        self
    }

    /// Overrides the worker id written into leases (default
    /// `{host}-{pid}-{random}`).
    pub fn with_worker_id(mut self, worker_id: impl Into<String>) -> Self {
        self.worker_id = worker_id.into();
        self
    }

    /// This relay's worker id.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Runs until `shutdown` is cancelled, then finishes in-flight publishes,
    /// releases unstarted leases and returns the counters.
    pub fn run(
        self,
        shutdown: CancellationToken,
    ) -> crate::BoxFuture<'static, Result<RelayReport>> {
        Box::pin(self.run_here(shutdown))
    }

    async fn run_here(self, shutdown: CancellationToken) -> Result<RelayReport> {
        // With no publisher every row would count as confirmed by all.
        if self.publishers.is_empty() {
            return Err(crate::Error::config(
                "publishers",
                "the relay needs at least one publisher",
            ));
        }
        // The app_codes and the lease budget were checked when the
        // `RelaySettings` were made; the publishers come separately.
        let (claimed_tx, claimed_rx) = mpsc::channel::<Batch>(1);
        let (results_tx, results_rx) = mpsc::channel(2);
        tracing::info!(
            worker_id = %self.worker_id,
            backend = self.store.backend(),
            table = %self.store.table(),
            app_codes = ?self.app_codes,
            publishers = ?self.publishers.iter().map(|p| p.name().to_owned()).collect::<Vec<_>>(),
            "relay started"
        );

        // The store's in-process wake handle, which the database's push
        // (when `wake = "notify"` and the database has one) signals too.
        let wake = self.store.wake().unwrap_or_default();
        let controls = controls::ControlView::default();
        let tally = Arc::new(heartbeat::Tally::default());
        let claimer = claimer::Claimer {
            pulse: self.pulse.clone(),
            tally: tally.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            app_codes: self.app_codes.clone(),
            worker_id: self.worker_id.clone(),
            wake: wake.listen(),
            controls: controls.clone(),
            takeovers: Arc::new(tokio::sync::Semaphore::new(1)),
        };
        let publishing = publisher::PublishStage {
            controls,
            store: self.store.clone(),
            publishers: self.publishers.clone(),
            config: self.config.clone(),
            budget: LeaseBudget::of(&self.config),
            max_payload_bytes: self.max_payload_bytes,
            breakers: self.publishers.iter().map(|_| Default::default()).collect(),
        };
        let marking = marker::Marker {
            store: self.store.clone(),
            tally: tally.clone(),
        };
        let heartbeat = heartbeat::Heartbeat {
            store: self.store.clone(),
            worker_id: self.worker_id.clone(),
            app_codes: self.app_codes.clone(),
            tally,
            host: heartbeat::host_and_pid(),
        };

        // Cancelled on shutdown, and by the first stage that fails.
        let stop = shutdown.child_token();
        let listen_task = match self.config.wake {
            WakeMode::Notify => self.store.listen(wake, stop.clone()).map(tokio::spawn),
            WakeMode::Poll => None,
        };
        let claim_task = spawn_stage("claim", claimer.run(claimed_tx, stop.clone()), stop.clone());
        let publish_task = spawn_stage(
            "publish",
            publishing.run(claimed_rx, results_tx, stop.clone()),
            stop.clone(),
        );
        let mark_task = spawn_stage("mark", marking.run(results_rx), stop.clone());
        let heartbeat_task = tokio::spawn(heartbeat.run(stop.clone()));

        // Every stage winds down before `run` returns, failed or not: the
        // others release what they hold.
        let claimed = join_stage("claim", claim_task).await;
        let released = join_stage("publish", publish_task).await;
        let marked = join_stage("mark", mark_task).await;
        stop.cancel();
        if let Some(task) = listen_task {
            // It ends on `stop`; a panic in it is logged by the runtime.
            let _ = task.await;
        }
        close_publishers(&self.publishers, CLOSE_WITHIN).await;
        // The registry hears that this relay stopped, whatever the cause.
        if let Ok(heartbeat) = heartbeat_task.await {
            heartbeat.last().await;
        }
        let (claimed, released, mut report) = match (claimed, released, marked) {
            (Ok(c), Ok(r), Ok(m)) => (c, r, m),
            (c, r, m) => {
                let mut failures: Vec<StageFailure> =
                    [c.err(), r.err(), m.err()].into_iter().flatten().collect();
                failures.sort_by_key(|f| f.at);
                let error = stopped_by(failures);
                tracing::error!(worker_id = %self.worker_id, error = %error, "relay stopped by a failed stage");
                return Err(error);
            }
        };
        report.claimed = claimed;
        report.released = released;
        tracing::info!(worker_id = %self.worker_id, ?report, "relay stopped");
        Ok(report)
    }
}

/// Why one stage ended the relay.
struct StageFailure {
    stage: &'static str,
    /// When it failed: the first failure is the cause, later ones may be
    /// its consequences.
    at: std::time::Instant,
    cause: StageCause,
}

enum StageCause {
    /// The stage returned an error.
    Failed(Error),
    /// The stage panicked (a bug); the panic's message.
    Panicked(String),
}

impl std::fmt::Display for StageFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.cause {
            StageCause::Panicked(message) => {
                write!(f, "its {} stage panicked: {message}", self.stage)
            }
            // Without the "internal error" prefix: the outer error has it.
            StageCause::Failed(Error::Internal(message)) => {
                write!(f, "its {} stage failed: {message}", self.stage)
            }
            StageCause::Failed(e) => write!(f, "its {} stage failed: {e}", self.stage),
        }
    }
}

/// The error `run` returns for `failures` (oldest first, at least one):
/// the first stage's own error when it is not a bug (it says what failed;
/// the log line names the stage), else [`Error::Internal`] naming every
/// failed stage.
fn stopped_by(mut failures: Vec<StageFailure>) -> Error {
    let one_plain_error = failures.len() == 1
        && matches!(&failures[0].cause, StageCause::Failed(e) if !matches!(e, Error::Internal(_)));
    if one_plain_error {
        if let Some(StageFailure {
            cause: StageCause::Failed(e),
            ..
        }) = failures.pop()
        {
            return e;
        }
    }
    Error::Internal(format!(
        "the relay stopped because {}; rows it held are released or their leases expire",
        failures
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", then ")
    ))
}

/// Starts one stage. Its first failure, an error or a panic, cancels `stop`
/// so that the other stages wind down, and comes back as the
/// [`StageFailure`].
fn spawn_stage<T: Send + 'static>(
    stage: &'static str,
    run: impl std::future::Future<Output = Result<T>> + Send + 'static,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<std::result::Result<T, StageFailure>> {
    tokio::spawn(async move {
        let cause = match std::panic::AssertUnwindSafe(run).catch_unwind().await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => {
                tracing::error!(stage, error = %e, "relay stage failed; stopping the relay");
                StageCause::Failed(e)
            }
            Err(panic) => {
                let message = panic_message(panic.as_ref());
                tracing::error!(stage, panic = %message, "relay stage panicked; stopping the relay");
                StageCause::Panicked(message)
            }
        };
        stop.cancel();
        Err(StageFailure {
            stage,
            at: std::time::Instant::now(),
            cause,
        })
    })
}

/// The stage's result, or why it has none.
async fn join_stage<T>(
    stage: &'static str,
    task: tokio::task::JoinHandle<std::result::Result<T, StageFailure>>,
) -> std::result::Result<T, StageFailure> {
    match task.await {
        Ok(result) => result,
        // Only a runtime shutting down cancels a stage task.
        Err(e) => Err(StageFailure {
            stage,
            at: std::time::Instant::now(),
            cause: StageCause::Failed(Error::Internal(format!("its task ended abnormally: {e}"))),
        }),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-text panic".to_owned()
    }
}

/// Gives claimed rows back without counting an attempt (shutdown, or a
/// batch no later stage will take); returns how many were released. Rows
/// already marked are left alone: the release is fenced like a mark.
async fn release(store: &dyn RelayStore, events: &[ClaimedEvent], why: &str) -> u64 {
    release_rows(store, held_rows(events), why).await
}

/// `(fence, id)` of each claimed row.
fn held_rows(events: &[ClaimedEvent]) -> Vec<(Fence, i64)> {
    events.iter().map(|e| (e.fence(), e.record.id)).collect()
}

async fn release_rows(store: &dyn RelayStore, rows: Vec<(Fence, i64)>, why: &str) -> u64 {
    let mut by_fence: HashMap<Fence, Vec<i64>> = HashMap::new();
    for (fence, id) in rows {
        by_fence.entry(fence).or_default().push(id);
    }
    let mut released = 0;
    for (fence, ids) in by_fence {
        match retrying("release leases", || store.release(&fence, &ids)).await {
            Ok((n, _)) => released += n,
            Err(e) => {
                tracing::warn!(error = %e, rows = ids.len(), "could not release leases ({why}); they expire by themselves");
            }
        }
    }
    released
}

/// How long a result write (a mark, a release) is tried again before it
/// is given up. Giving up only means the rows' leases expire and they are
/// tried again, but then an attempt is counted: a delivered row on its
/// last allowed attempt, or of an `at_most_once` type, is dead-lettered
/// although delivered. Within a database restart or failover (a few
/// seconds); it gave up after 0.6 s.
const WRITE_PATIENCE: Duration = Duration::from_secs(5);

/// The longest pause between two tries of a result write.
const WRITE_RETRY_MAX_DELAY: Duration = Duration::from_secs(1);

/// Tries a result write again, with a growing pause, for up to
/// [`WRITE_PATIENCE`]. Every write it is given is fenced, so a try that
/// committed before its answer was lost is harmless to repeat. Returns the
/// value and whether an earlier try failed (and so may have committed
/// before its answer was lost).
async fn retrying<T, F, Fut>(what: &'static str, mut op: F) -> Result<(T, bool)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let started = Instant::now();
    let mut delay = Duration::from_millis(20);
    let mut tries = 0u32;
    loop {
        match op().await {
            Ok(v) => return Ok((v, tries > 0)),
            Err(e) if started.elapsed() + delay < WRITE_PATIENCE => {
                tries += 1;
                if tries == 1 || tries.is_power_of_two() {
                    tracing::warn!(error = %e, tries, "{what} failed; retrying");
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(WRITE_RETRY_MAX_DELAY);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs a stage's `work` on the rows it holds (`held`). When `work`
/// fails (returns an error or panics), every batch still queued in `input`
/// (not started) is released, then the failure goes on to [`spawn_stage`],
/// which stops the relay. The rows `work` held are *not* released: one of
/// them may be what made it fail, and a release counts no attempt, so a
/// restarted relay would claim it and fail again, forever. Their leases
/// expire instead, which counts a failed attempt (SPEC §3: an event that
/// crashes its relay ends `failed` instead of looping).
async fn releasing_on_failure<T, I>(
    store: &dyn RelayStore,
    held: Vec<(Fence, i64)>,
    input: &mut mpsc::Receiver<I>,
    rows_of: impl Fn(I) -> Vec<(Fence, i64)>,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    // The error to return, or the panic to resume once the queue is
    // released.
    let failure = match std::panic::AssertUnwindSafe(work).catch_unwind().await {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => Ok(e),
        Err(panic) => Err(panic),
    };
    input.close();
    let mut rows = Vec::new();
    while let Some(queued) = input.recv().await {
        rows.extend(rows_of(queued));
    }
    release_rows(store, rows, "a relay stage failed").await;
    tracing::error!(
        rows = held.len(),
        "a relay stage failed; the rows it was working on keep their leases, which expire and count a failed attempt"
    );
    match failure {
        Ok(error) => Err(error),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// How long shutdown waits for a publisher to flush and close.
const CLOSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Closes every publisher at once, each given `within` ([`CLOSE_WITHIN`]): a target
/// that is down (a NATS client reconnecting holds its flush until the
/// server is back) must not keep a stopping relay from exiting. Every
/// row is marked or released before this, so nothing waits on a close.
async fn close_publishers(publishers: &[Arc<dyn Publisher>], within: std::time::Duration) {
    futures::future::join_all(publishers.iter().map(|p| async move {
        if tokio::time::timeout(within, p.close()).await.is_err() {
            tracing::warn!(
                publisher = p.name(),
                "the publisher did not close within {within:?}; stopping without it"
            );
        }
    }))
    .await;
}

/// `{host}-{pid}-{4 hex}`: tells relays apart in `worker_id` and in logs.
pub fn default_worker_id() -> String {
    let (host, pid) = heartbeat::host_and_pid();
    worker_id_of(&host, pid, rand::random())
}

/// `{host}-{pid}-{suffix}` within the `worker_id` column's 128 bytes: a
/// long host name is cut (at a character's start), never the pid and
/// suffix that tell a host's relays apart. The whole id was cut at byte
/// 120: in a character of a host name that is not ASCII, a panic at start;
/// past a long host name, every relay of the host had the same id.
fn worker_id_of(host: &str, pid: u32, suffix: u16) -> String {
    let mut end = host.len().min(100);
    while !host.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}-{pid}-{suffix:04x}", &host[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_host_name_is_cut_and_the_pid_kept() {
        assert_eq!(worker_id_of("relay-1", 42, 0xab), "relay-1-42-00ab");
        let host = "北".repeat(50);
        let id = worker_id_of(&host, 4_000_000, 0xffff);
        assert!(id.len() <= 128 && id.ends_with("-4000000-ffff"), "{id}");
        assert_eq!(id, format!("{}-4000000-ffff", "北".repeat(33)));
    }

    fn failure(stage: &'static str, cause: StageCause) -> StageFailure {
        StageFailure {
            stage,
            at: std::time::Instant::now(),
            cause,
        }
    }

    #[tokio::test]
    async fn a_failing_stage_stops_the_others_and_names_itself() {
        let stop = CancellationToken::new();
        let waiting = {
            let cancelled = stop.clone();
            spawn_stage(
                "claim",
                async move {
                    cancelled.cancelled().await;
                    Ok(7u64)
                },
                stop.clone(),
            )
        };
        let failing = spawn_stage(
            "mark",
            async { Err::<u64, _>(Error::Internal("a broken invariant".into())) },
            stop.clone(),
        );
        let failed = join_stage("mark", failing).await.expect_err("failed");
        assert!(stop.is_cancelled(), "the first failure stops the relay");
        // The other stage winds down cleanly, with its own result.
        assert_eq!(join_stage("claim", waiting).await.ok(), Some(7));
        let error = stopped_by(vec![failed]);
        assert!(matches!(error, Error::Internal(_)), "{error:?}");
        assert_eq!(
            error.to_string(),
            "internal error (a bug in postbox; please report it): the relay stopped because its mark stage failed: a broken invariant; rows it held are released or their leases expire"
        );
    }

    #[tokio::test]
    async fn a_panicking_stage_is_an_error_naming_it_and_the_panic() {
        let stop = CancellationToken::new();
        let task = spawn_stage(
            "publish",
            async {
                if std::hint::black_box(true) {
                    panic!("boom");
                }
                Ok(())
            },
            stop.clone(),
        );
        let failed = join_stage("publish", task).await.expect_err("failed");
        assert!(stop.is_cancelled());
        let text = stopped_by(vec![failed]).to_string();
        assert!(text.contains("its publish stage panicked: boom"), "{text}");
    }

    /// A publisher whose close never ends (NATS reconnecting to a server
    /// that is down) does not hold the relay's shutdown, nor keep the
    /// others from closing.
    #[tokio::test]
    async fn a_publisher_that_never_closes_does_not_hold_shutdown() {
        struct Closing(&'static str, Option<Arc<std::sync::atomic::AtomicBool>>);
        #[async_trait::async_trait]
        impl Publisher for Closing {
            fn name(&self) -> &str {
                self.0
            }
            async fn publish(
                &self,
                batch: &[crate::publish::Delivery<'_>],
            ) -> Vec<std::result::Result<(), crate::publish::PublishError>> {
                batch.iter().map(|_| Ok(())).collect()
            }
            async fn close(&self) {
                match &self.1 {
                    Some(closed) => closed.store(true, std::sync::atomic::Ordering::SeqCst),
                    None => std::future::pending().await,
                }
            }
        }
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let publishers: Vec<Arc<dyn Publisher>> = vec![
            Arc::new(Closing("hung", None)),
            Arc::new(Closing("healthy", Some(Arc::clone(&closed)))),
        ];
        let within = std::time::Duration::from_millis(50);
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            close_publishers(&publishers, within),
        )
        .await
        .expect("shutdown waited on the hung publisher");
        assert!(closed.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn the_first_failure_comes_first_and_a_plain_error_keeps_its_kind() {
        let first = failure("publish", StageCause::Panicked("boom".into()));
        let then = failure("mark", StageCause::Failed(Error::Internal("gone".into())));
        let text = stopped_by(vec![first, then]).to_string();
        assert!(
            text.contains("its publish stage panicked: boom, then its mark stage failed: gone"),
            "{text}"
        );
        let db = Error::database("claim", std::io::Error::other("connection refused"));
        let error = stopped_by(vec![failure("claim", StageCause::Failed(db))]);
        assert!(matches!(error, Error::Database { .. }), "{error:?}");
    }
}
