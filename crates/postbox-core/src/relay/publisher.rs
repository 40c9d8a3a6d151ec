//! Stage 2: hand each batch to every publisher that has not confirmed it
//! yet, each publisher on its own lane, and decide (with
//! [`crate::retry::decide`]) where each row goes next.
//!
//! ```text
//!                  ┌▶ lane "rabbit" (queue of 2 batches) ─┐
//!  claimed batch ──┤                                      ├──▶ outcomes, as each batch's
//!                  └▶ lane "hook"   (queue of 2 batches) ─┘    lanes have answered
//! ```
//!
//! A lane is one publisher's task with a queue of [`LANE_QUEUE`] batches,
//! so each publisher goes at its own pace (SPEC §3, isolation). It
//! publishes one batch at a time, or as many as its publisher takes at once
//! ([`Publisher::max_in_flight`]: RabbitMQ's next batch goes out while the
//! confirms of the last are on their way). A batch's
//! rows go to every lane that needs them and has room. A lane that is full
//! (its publisher is behind: slow, or hung until its timeouts) does not
//! take them: those rows are *deferred* for it, no attempt counted
//! ([`Decision::Defer`]), and fall due again when that lane is expected to
//! have room ([`Pace`]), keeping what the others confirmed. A batch that no
//! lane with room needs waits for room instead (plain backpressure: a
//! publisher alone, or every publisher behind, is never deferred). Batches
//! are marked as their lanes answer, in any order.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::breaker::{BatchResult, Breaker, Change};
use super::spans::PublishSpans;
use super::Batch;
use crate::config::{LeaseBudget, WorkerConfig};
use crate::control::Controls;
use crate::metrics as m;
use crate::publish::{Delivery, PublishError, PublishResults, Publisher};
use crate::retry::{decide, Attempt, AttemptResult, ClaimedRow, Decision, RetryDelay, RetryPolicy};
use crate::store::RelayStore;
use crate::{trace, ClaimSource, ClaimedEvent, Error, Result};

/// Batches a lane holds besides the one it is publishing.
pub(super) const LANE_QUEUE: usize = 2;

/// The shortest and longest wait of a deferred row.
const MIN_DEFER: Duration = Duration::from_millis(100);
const MAX_DEFER: Duration = Duration::from_secs(600);

pub(super) struct PublishStage {
    /// The runtime controls (retry rules per app_code and event type).
    pub controls: super::controls::ControlView,
    pub store: Arc<dyn RelayStore>,
    pub publishers: Vec<Arc<dyn Publisher>>,
    pub config: WorkerConfig,
    pub budget: LeaseBudget,
    /// `database.max_payload_bytes`: larger rows are never published.
    pub max_payload_bytes: usize,
    /// One per publisher, in the same order (see [`super::breaker`]).
    pub breakers: Vec<Breaker>,
}

/// A batch's future while its lanes publish it.
type InFlight = Pin<Box<dyn Future<Output = Answered> + Send>>;

impl PublishStage {
    /// Returns the number of rows released at shutdown. Publish errors are
    /// outcomes, not failures of the stage; a publisher that panics (a bug)
    /// stops it: batches not started are released, the rows of the batches
    /// being published keep their leases (see
    /// [`super::releasing_on_failure`]).
    pub async fn run(
        mut self,
        mut input: mpsc::Receiver<Batch>,
        output: mpsc::Sender<Vec<Outcome>>,
        shutdown: CancellationToken,
    ) -> Result<u64> {
        let lanes = self.start_lanes(&shutdown);
        let mut in_flight: FuturesUnordered<InFlight> = FuturesUnordered::new();
        // A batch waiting for room on a lane that needs it.
        let mut parked: Option<Parked> = None;
        let mut released = 0;
        let mut input_open = true;
        let failure = loop {
            if !input_open && parked.is_none() && in_flight.is_empty() {
                break None;
            }
            let waiting_on = parked
                .as_ref()
                .map(|p| p.waiting_on.clone())
                .unwrap_or_default();
            let patience_ends = parked.as_ref().and_then(|p| p.until);
            tokio::select! {
                biased;
                Some(answered) = in_flight.next() => {
                    let (outcomes, unstarted) = match self.outcomes(answered, &lanes, &shutdown) {
                        Ok(resolved) => resolved,
                        Err(stop) => break Some(stop),
                    };
                    released += super::release(self.store.as_ref(), &unstarted, "unstarted at shutdown").await;
                    if let Err(unsent) = output.send(outcomes).await {
                        // The mark stage is gone (it failed, and says so
                        // itself): give the rows back rather than leave
                        // them to an expiring lease, which would count an
                        // attempt. They are published again.
                        let events: Vec<ClaimedEvent> =
                            unsent.0.into_iter().map(|o| o.event).collect();
                        released += super::release(self.store.as_ref(), &events, "the mark stage stopped").await;
                        break None;
                    }
                }
                _ = room(&lanes, &waiting_on), if parked.is_some() => {
                    if let Some(p) = parked.take() {
                        match self.dispatch(p.batch, p.until, &lanes, &mut in_flight) {
                            Ok(still) => parked = still,
                            Err(e) => break Some(Stop::Failed(e)),
                        }
                    }
                }
                _ = sleep_until(patience_ends), if parked.is_some() => {
                    if let Some(p) = parked.take() {
                        match self.dispatch(p.batch, Some(Instant::now()), &lanes, &mut in_flight) {
                            Ok(still) => parked = still,
                            Err(e) => break Some(Stop::Failed(e)),
                        }
                    }
                }
                _ = shutdown.cancelled(), if parked.is_some() => {
                    if let Some(p) = parked.take() {
                        released += super::release(self.store.as_ref(), &p.batch.events, "unstarted batch").await;
                    }
                }
                batch = input.recv(), if input_open && parked.is_none() => match batch {
                    None => input_open = false,
                    Some(batch) => {
                        if shutdown.is_cancelled() {
                            released += self.release(batch).await;
                        } else if !self.budget.may_start_publish(batch.claimed_at.elapsed()) {
                            // Publishing now could outlive the lease, and
                            // another relay would send the same rows
                            // again: give them back instead.
                            tracing::warn!(
                                rows = batch.events.len(),
                                waited = ?batch.claimed_at.elapsed(),
                                "batch waited too long for its publish; released unstarted (the database or a publisher is slower than the lease allows)"
                            );
                            released += self.release(batch).await;
                        } else {
                            let prepared = self.prepare(batch);
                            match self.dispatch(prepared, None, &lanes, &mut in_flight) {
                                Ok(still) => parked = still,
                                Err(e) => break Some(Stop::Failed(e)),
                            }
                        }
                    }
                },
            }
        };
        // Stopping: no new batch is taken; the ones claimed behind are
        // given back.
        input.close();
        while let Some(batch) = input.recv().await {
            released += self.release(batch).await;
        }
        if let Some(p) = parked.take() {
            released +=
                super::release(self.store.as_ref(), &p.batch.events, "unstarted batch").await;
        }
        for lane in &lanes {
            lane.task.abort();
        }
        match failure {
            Some(stop) => {
                tracing::error!(
                    batches = in_flight.len(),
                    "a publisher failed; the rows being published keep their leases, which expire and count a failed attempt"
                );
                match stop {
                    Stop::Failed(e) => Err(e),
                    // The stage panics with the publisher's panic, which
                    // the relay reports as this stage's.
                    Stop::Panicked(panic) => std::panic::resume_unwind(panic),
                }
            }
            None => {
                // Only when the mark stage went away: what is still being
                // published is given back when its lanes answer.
                while let Some(answered) = in_flight.next().await {
                    let events = answered.into_events();
                    released +=
                        super::release(self.store.as_ref(), &events, "the mark stage stopped")
                            .await;
                }
                Ok(released)
            }
        }
    }

    async fn release(&self, batch: Batch) -> u64 {
        super::release(self.store.as_ref(), &batch.events, "unstarted batch").await
    }

    /// One lane per publisher, each with its breaker.
    fn start_lanes(&mut self, shutdown: &CancellationToken) -> Vec<Lane> {
        let breakers = std::mem::take(&mut self.breakers);
        self.publishers
            .iter()
            .zip(breakers)
            .map(|(publisher, breaker)| {
                let (jobs, queue) = mpsc::channel(LANE_QUEUE);
                let pace = Arc::new(Mutex::new(Pace::default()));
                let worker = LaneWorker {
                    publisher: publisher.clone(),
                    breaker,
                    pace: pace.clone(),
                    timeout: self.config.publish_timeout.get(),
                    budget: self.budget,
                    shutdown: shutdown.clone(),
                };
                Lane {
                    name: publisher.name().to_owned(),
                    jobs,
                    pace,
                    task: tokio::spawn(worker.run(queue)),
                }
            })
            .collect()
    }

    /// The retry rules for a row of `event_type` in `app_code`: the runtime
    /// controls' (`controls`, read once per batch), else the config's.
    fn policy(&self, controls: &Controls, app_code: &str, event_type: &str) -> RetryPolicy {
        RetryPolicy {
            max_retry_count: controls
                .max_retry_count(app_code, event_type)
                .unwrap_or_else(|| self.config.max_retry_count_for(event_type)),
            delivery: controls
                .delivery(app_code, event_type)
                .unwrap_or_else(|| self.config.delivery_for(event_type)),
        }
    }

    /// Decides what may be published ([`decide`] on each claimed row) and
    /// which rows each publisher still needs.
    fn prepare(&self, batch: Batch) -> Prepared {
        let controls = self.controls.get();
        let before: Vec<Decision> = batch
            .events
            .iter()
            .map(|event| {
                let r = &event.record;
                // Sampled out by a runtime control: no publisher sees it. A
                // replayed event was asked for by name, and goes.
                if let Some(percent) = controls.sample_percent(&r.app_code, &r.event_type) {
                    if r.replay_count == 0 && !crate::control::sampled_in(&r.event_id, percent) {
                        return Decision::Dropped {
                            reason: format!(
                                "sampled out: a runtime control delivers {percent} % of {}/{}",
                                r.app_code, r.event_type
                            ),
                        };
                    }
                }
                let claimed = Attempt::Claimed(ClaimedRow {
                    retry_count: r.retry_count,
                    from_expired_lease: event.source == ClaimSource::ExpiredLease,
                    delivered_to: r.delivered_to.clone(),
                    undeliverable: (r.payload.len() > self.max_payload_bytes).then(|| {
                        format!(
                            "payload is {} bytes, over database.max_payload_bytes ({}); dead-lettered without trying any publisher: shrink the event (or raise the limit if every broker takes it), then replay it",
                            r.payload.len(),
                            self.max_payload_bytes
                        )
                    }),
                });
                // A refusal needs no backoff: it is never a retry.
                decide(&claimed, self.policy(&controls, &r.app_code, &r.event_type), |_| {
                    RetryDelay::default()
                })
            })
            .collect();
        let todo = self
            .publishers
            .iter()
            .map(|p| {
                (0..batch.events.len())
                    .filter(|&i| {
                        before[i] == Decision::Publish
                            && !batch.events[i]
                                .record
                                .delivered_to
                                .iter()
                                .any(|d| d == p.name())
                    })
                    .collect()
            })
            .collect();
        Prepared {
            events: batch.events,
            claimed_at: batch.claimed_at,
            gate: batch.gate,
            before,
            todo,
        }
    }

    /// Hands `batch` to every lane that needs it and has room, deferring
    /// it for the lanes that are full and *behind*: expected to stay full
    /// longer than the patience ([`patience`]). Gives it back to wait
    /// (`Some`) while a full lane it needs may have room soon: until room
    /// comes, or the patience (`until`, set on the first wait) ends. With
    /// one publisher, or every lane full, it waits for room however long
    /// it takes. A batch no publisher needs is done at once.
    fn dispatch(
        &self,
        batch: Prepared,
        until: Option<Instant>,
        lanes: &[Lane],
        in_flight: &mut FuturesUnordered<InFlight>,
    ) -> Result<Option<Parked>> {
        let needed = batch.lanes();
        let full: Vec<usize> = needed
            .iter()
            .copied()
            .filter(|&l| lanes[l].jobs.capacity() == 0)
            .collect();
        // Every lane full: no publisher could use the time the batch
        // waits, so it waits for room on any of them (plain backpressure),
        // however long; then it is dispatched again as things stand.
        if !full.is_empty() && lanes.iter().all(|lane| lane.jobs.capacity() == 0) {
            return Ok(Some(Parked {
                batch,
                waiting_on: (0..lanes.len()).collect(),
                until: None,
            }));
        }
        let now = Instant::now();
        if !full.is_empty() && until.is_none_or(|t| now < t) {
            match patience(lanes, batch.events.len()) {
                // Nothing else could use the time: wait.
                None => {
                    return Ok(Some(Parked {
                        batch,
                        waiting_on: full,
                        until: None,
                    }))
                }
                Some(patience) => {
                    if full
                        .iter()
                        .any(|&l| lanes[l].pace().room_in(now) <= patience)
                    {
                        return Ok(Some(Parked {
                            batch,
                            waiting_on: full,
                            until: Some(until.unwrap_or(now + patience)),
                        }));
                    }
                }
            }
        }
        let Prepared {
            events,
            claimed_at,
            gate,
            before,
            todo,
        } = batch;
        let events = Arc::new(events);
        let mut answers = Vec::with_capacity(needed.len());
        let mut full = Vec::new();
        for l in needed {
            let (answer, answered) = oneshot::channel();
            let job = Job {
                events: events.clone(),
                todo: todo[l].clone(),
                claimed_at,
                answer,
            };
            match lanes[l].jobs.try_send(job) {
                Ok(()) => {
                    lanes[l].pace().held_rows += todo[l].len();
                    answers.push((l, answered));
                }
                Err(mpsc::error::TrySendError::Full(_)) => full.push(l),
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    return Err(Error::Internal(format!(
                        "the lane of publisher `{}` ended",
                        lanes[l].name
                    )))
                }
            }
        }
        in_flight.push(Box::pin(async move {
            let mut lane_answers = Vec::with_capacity(answers.len());
            for (l, answered) in answers {
                lane_answers.push((l, answered.await.ok()));
            }
            drop(gate);
            Answered {
                events,
                before,
                todo,
                answers: lane_answers,
                full,
            }
        }));
        Ok(None)
    }

    /// Every row's decision once its lanes have answered, and the rows to
    /// give back instead: at shutdown, those no publisher took.
    fn outcomes(
        &self,
        answered: Answered,
        lanes: &[Lane],
        shutdown: &CancellationToken,
    ) -> std::result::Result<(Vec<Outcome>, Vec<ClaimedEvent>), Stop> {
        let Answered {
            events,
            before,
            todo,
            answers,
            full,
        } = answered;
        let events = Arc::try_unwrap(events).unwrap_or_else(|shared| (*shared).clone());
        let mut rows: Vec<Row> = events
            .into_iter()
            .zip(before)
            .map(|(event, before)| Row {
                event,
                before,
                confirmed: Vec::new(),
                errors: Vec::new(),
                deferred: Vec::new(),
            })
            .collect();
        // `skipped`: the lane's breaker is open for that much longer. Of
        // the lane's rows, those `of` (all when `None`).
        let behind_of = |l: usize,
                         of: Option<&[usize]>,
                         rows: &mut Vec<Row>,
                         skipped: Option<Duration>| {
            let lane = &lanes[l];
            let these = of.unwrap_or(&todo[l]);
            let n = these.len();
            // At shutdown the rows are given back due at once.
            let after = if shutdown.is_cancelled() {
                Duration::ZERO
            } else {
                // Booked at the lane's pace; a skipped lane's rows not
                // before its cool-down ends.
                let booked = lane
                    .pace()
                    .defer(n, Instant::now(), self.config.poll_interval.get());
                skipped.map_or(booked, |left| left.max(booked))
            };
            let result = if skipped.is_some() {
                m::RESULT_SKIPPED
            } else {
                m::RESULT_DEFERRED
            };
            metrics::counter!(m::PUBLISH_TOTAL, "publisher" => lane.name.clone(), "result" => result)
                .increment(n as u64);
            for &i in these {
                rows[i].deferred.push((lane.name.clone(), after));
            }
        };
        let behind = |l: usize, rows: &mut Vec<Row>, skipped: Option<Duration>| {
            behind_of(l, None, rows, skipped)
        };
        for (l, answer) in answers {
            let lane = &lanes[l];
            lane.pace().held_rows -= todo[l].len();
            match answer {
                Some(Answer::Published(results, cooling)) => {
                    // Rows the publisher never started before the batch's
                    // time ran out were not sent: deferred for it, no
                    // attempt. Rows it
                    // could not send because its target was unreachable
                    // likewise: a broker restarting is not the events'
                    // fault, and each retry counted an attempt until rows
                    // were dead-lettered during the outage (at a backoff
                    // of 200 ms to 2 s, ten attempts in 10 s).
                    let (mut unsent, mut unreachable) = (Vec::new(), Vec::new());
                    for (&i, result) in todo[l].iter().zip(results) {
                        match result {
                            Some(Ok(())) => rows[i].confirmed.push(lane.name.clone()),
                            Some(Err(PublishError::Unreachable(_))) => unreachable.push(i),
                            Some(Err(e)) => rows[i].errors.push((lane.name.clone(), e)),
                            None => unsent.push(i),
                        }
                    }
                    if !unsent.is_empty() {
                        behind_of(l, Some(&unsent), &mut rows, None);
                    }
                    if !unreachable.is_empty() {
                        let cooling = cooling.unwrap_or(super::breaker::FIRST_COOL_DOWN);
                        behind_of(l, Some(&unreachable), &mut rows, Some(cooling));
                    }
                }
                Some(Answer::NotStarted) => behind(l, &mut rows, None),
                Some(Answer::Skipped(left)) => behind(l, &mut rows, Some(left)),
                Some(Answer::Panicked(panic)) => return Err(Stop::Panicked(panic)),
                None => {
                    return Err(Stop::Failed(Error::Internal(format!(
                        "the lane of publisher `{}` ended without an answer",
                        lane.name
                    ))))
                }
            }
        }
        for l in full {
            behind(l, &mut rows, None);
        }
        let stopping = shutdown.is_cancelled();
        let (unstarted, rows): (Vec<Row>, Vec<Row>) = rows.into_iter().partition(|row| {
            stopping
                && !row.deferred.is_empty()
                && row.confirmed.is_empty()
                && row.errors.is_empty()
        });
        Ok((
            {
                let controls = self.controls.get();
                rows.into_iter()
                    .map(|row| self.outcome(&controls, row))
                    .collect()
            },
            unstarted.into_iter().map(|row| row.event).collect(),
        ))
    }

    /// The decision after publishing (or the refusal made before).
    fn outcome(&self, controls: &Controls, row: Row) -> Outcome {
        if row.before != Decision::Publish {
            return Outcome {
                event: row.event,
                decision: row.before,
                failed_publishers: None,
            };
        }
        let r = &row.event.record;
        let result = AttemptResult {
            retry_count: r.retry_count,
            delivered_before: r.delivered_to.clone(),
            confirmed_now: row.confirmed,
            errors: row
                .errors
                .iter()
                .map(|(p, e)| (p.clone(), e.to_string()))
                .collect(),
            deferred: row.deferred,
        };
        // A target that asked for a later retry (HTTP Retry-After) gets it.
        let asked_delay = row.errors.iter().filter_map(|(_, e)| e.retry_after()).max();
        let backoff = self.config.backoff();
        let decision = decide(
            &Attempt::Published(result),
            self.policy(controls, &r.app_code, &r.event_type),
            |n| {
                let d = backoff.delay(n);
                asked_delay.map_or(d, |a| d.not_before(a))
            },
        );
        let failed_publishers = (!row.errors.is_empty()).then(|| {
            row.errors
                .iter()
                .map(|(p, _)| p.as_str())
                .collect::<Vec<_>>()
                .join(",")
        });
        Outcome {
            event: row.event,
            decision,
            failed_publishers,
        }
    }
}

/// How long a batch may wait for a full lane that is about to have room
/// before its rows are deferred for it: the fastest lane's time for
/// a batch of `rows` (at least 2 ms; 20 ms before any publish ended).
/// `None` with one publisher: there is nothing else to do meanwhile.
fn patience(lanes: &[Lane], rows: usize) -> Option<Duration> {
    if lanes.len() < 2 {
        return None;
    }
    let fastest = lanes
        .iter()
        .filter_map(|lane| lane.pace().per_row)
        .min_by(f64::total_cmp);
    Some(match fastest {
        Some(per_row) => {
            Duration::from_secs_f64(per_row * rows as f64).max(Duration::from_millis(2))
        }
        None => Duration::from_millis(20),
    })
}

async fn sleep_until(until: Option<Instant>) {
    match until {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

/// A batch waiting for room on `waiting_on` (lanes it needs that were
/// full), until `until` at most.
struct Parked {
    batch: Prepared,
    waiting_on: Vec<usize>,
    until: Option<Instant>,
}

/// Resolves when a lane in `needed` has room for a batch.
async fn room(lanes: &[Lane], needed: &[usize]) {
    let waits = needed.iter().map(|&l| Box::pin(lanes[l].jobs.reserve()));
    if needed.is_empty() {
        return std::future::pending().await;
    }
    // The permit is dropped at once: this stage is the lanes' only sender,
    // so the room is still there when it hands the batch over.
    let _ = futures::future::select_all(waits).await;
}

/// A claimed batch with its before-publishing decisions.
struct Prepared {
    events: Vec<ClaimedEvent>,
    claimed_at: Instant,
    /// Held until the lanes answer (see [`super::Batch`]'s `gate`).
    gate: Option<tokio::sync::OwnedSemaphorePermit>,
    before: Vec<Decision>,
    /// Per publisher (by index), the rows it still needs.
    todo: Vec<Vec<usize>>,
}

impl Prepared {
    /// The lanes that have rows to publish.
    fn lanes(&self) -> Vec<usize> {
        (0..self.todo.len())
            .filter(|&l| !self.todo[l].is_empty())
            .collect()
    }
}

/// A batch whose lanes have answered.
struct Answered {
    events: Arc<Vec<ClaimedEvent>>,
    before: Vec<Decision>,
    todo: Vec<Vec<usize>>,
    /// Per lane that took the batch, its answer (`None`: the lane ended).
    answers: Vec<(usize, Option<Answer>)>,
    /// The lanes that were full.
    full: Vec<usize>,
}

impl Answered {
    fn into_events(self) -> Vec<ClaimedEvent> {
        Arc::try_unwrap(self.events).unwrap_or_else(|shared| (*shared).clone())
    }
}

/// One publisher's lane, as the stage sees it.
struct Lane {
    name: String,
    jobs: mpsc::Sender<Job>,
    pace: Arc<Mutex<Pace>>,
    task: tokio::task::JoinHandle<()>,
}

impl Lane {
    fn pace(&self) -> std::sync::MutexGuard<'_, Pace> {
        self.pace.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Rows of a batch for one lane.
struct Job {
    events: Arc<Vec<ClaimedEvent>>,
    todo: Vec<usize>,
    claimed_at: Instant,
    answer: oneshot::Sender<Answer>,
}

/// A lane's answer for one job.
enum Answer {
    /// One result per row, in the job's order; `None` for a row the
    /// publisher never started. With how much longer the publisher's
    /// breaker is open after the batch, if it is.
    Published(
        Vec<Option<std::result::Result<(), PublishError>>>,
        Option<Duration>,
    ),
    /// Not published: the job waited in the queue past the lease's publish
    /// budget, or the relay is stopping.
    NotStarted,
    /// Not published: the publisher's breaker is open for this much
    /// longer (it timed out on a whole batch).
    Skipped(Duration),
    /// The publisher panicked (a bug).
    Panicked(Box<dyn std::any::Any + Send>),
}

/// Why the stage stops before its input ends.
enum Stop {
    Failed(Error),
    /// A publisher panicked: the stage resumes its panic.
    Panicked(Box<dyn std::any::Any + Send>),
}

/// How fast a lane publishes, to say when rows deferred for it are worth
/// claiming again.
#[derive(Debug, Default)]
struct Pace {
    /// Seconds per row, a moving average of its publishes that confirmed.
    per_row: Option<f64>,
    /// Rows queued on the lane or being published.
    held_rows: usize,
    /// Rows deferred for the lane and not yet worked through, as of
    /// `booked_at`. Counted in rows, not time: when the lane speeds up
    /// (a target that recovers), what they are expected to take shrinks
    /// with it.
    booked_rows: f64,
    booked_at: Option<Instant>,
    /// The publishes under way: when each started, and its rows.
    running: Vec<(Instant, usize)>,
}

impl Pace {
    /// Seconds per row: the average, or before the first publish ended,
    /// what the oldest one under way has taken so far (a lower bound).
    fn per_row_estimate(&self, now: Instant) -> Option<f64> {
        self.per_row.or_else(|| {
            (self.running.iter().min_by_key(|&&(since, _)| since))
                .map(|&(since, rows)| now.duration_since(since).as_secs_f64() / rows.max(1) as f64)
        })
    }

    /// How long until a publish under way is expected to end (and so a
    /// full lane to have room): the soonest expected time left, or before
    /// the first publish ended, as long again as the youngest has taken so
    /// far (the least any of them can be expected to take). Publishes that
    /// overlap share the lane's pace.
    fn room_in(&self, now: Instant) -> Duration {
        let overlapping = self.running.len() as f64;
        let left = |&(since, rows): &(Instant, usize)| {
            let taken = now.duration_since(since);
            match self.per_row {
                Some(per_row) => {
                    Duration::from_secs_f64((per_row * rows as f64 * overlapping).min(3600.0))
                        .saturating_sub(taken)
                }
                None => taken,
            }
        };
        self.running
            .iter()
            .map(left)
            .min()
            .unwrap_or(Duration::ZERO)
    }

    /// Starts counting a publish of `rows`.
    fn start(&mut self, started: Instant, rows: usize) {
        self.running.push((started, rows));
    }

    /// Ends the publish [`start`](Pace::start)ed at `started`; when some
    /// of it confirmed, it counts towards the lane's pace, shared with the
    /// publishes it overlapped at the end.
    fn end(&mut self, started: Instant, rows: usize, confirmed: bool) {
        let overlapping = self.running.len().max(1);
        if let Some(k) = self.running.iter().position(|&r| r == (started, rows)) {
            self.running.swap_remove(k);
        }
        if confirmed {
            self.record(rows, started.elapsed() / overlapping as u32);
        }
    }

    fn record(&mut self, rows: usize, took: Duration) {
        if rows == 0 {
            return;
        }
        let sample = took.as_secs_f64() / rows as f64;
        self.per_row = Some(match self.per_row {
            None => sample,
            Some(avg) => avg * 0.7 + sample * 0.3,
        });
    }

    /// How long `rows` deferred at `now` should wait: until the lane has
    /// published what it holds and what was deferred before them
    /// (`fallback`, the poll interval, before its first publish ended).
    /// The rows deferred before are taken to have come back and been
    /// published at the lane's present pace since the last deferral.
    fn defer(&mut self, rows: usize, now: Instant, fallback: Duration) -> Duration {
        let Some(per_row) = self.per_row_estimate(now) else {
            return fallback.clamp(MIN_DEFER, MAX_DEFER);
        };
        if let Some(at) = self.booked_at {
            let worked = now.duration_since(at).as_secs_f64() / per_row.max(f64::MIN_POSITIVE);
            self.booked_rows = (self.booked_rows - worked).max(0.0);
        }
        self.booked_rows += rows as f64;
        self.booked_at = Some(now);
        let ahead = self.held_rows as f64 + self.booked_rows;
        Duration::from_secs_f64((per_row * ahead).min(3600.0)).clamp(MIN_DEFER, MAX_DEFER)
    }
}

/// The task behind one lane: starts its jobs in order, as many at once as
/// its publisher takes ([`Publisher::max_in_flight`]), and answers each as
/// it ends.
struct LaneWorker {
    publisher: Arc<dyn Publisher>,
    breaker: Breaker,
    pace: Arc<Mutex<Pace>>,
    timeout: Duration,
    budget: LeaseBudget,
    shutdown: CancellationToken,
}

impl LaneWorker {
    fn pace(&self) -> std::sync::MutexGuard<'_, Pace> {
        self.pace.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn run(self, mut queue: mpsc::Receiver<Job>) {
        let mut running = FuturesUnordered::new();
        let mut open = true;
        while open || !running.is_empty() {
            let room = running.len() < self.publisher.max_in_flight().max(1);
            tokio::select! {
                job = queue.recv(), if open && room => match job {
                    Some(job) => running.push(self.serve(job)),
                    None => open = false,
                },
                Some(()) = running.next(), if !running.is_empty() => {}
            }
        }
    }

    async fn serve(&self, job: Job) {
        let Job {
            events,
            todo,
            claimed_at,
            answer,
        } = job;
        let answered = self.publish(&events, &todo, claimed_at).await;
        // The rows go back to the stage whole: this lane's share of them
        // is dropped before it answers.
        drop(events);
        let _ = answer.send(answered);
    }

    async fn publish(
        &self,
        events: &[ClaimedEvent],
        todo: &[usize],
        claimed_at: Instant,
    ) -> Answer {
        if self.shutdown.is_cancelled() || !self.budget.may_start_publish(claimed_at.elapsed()) {
            return Answer::NotStarted;
        }
        let p = self.publisher.as_ref();
        if let Some(left) = self.breaker.skip(Instant::now()) {
            return Answer::Skipped(left);
        }
        let spans = trace::exporting().then(|| PublishSpans::start(p.name(), events, todo));
        let deliveries: Vec<Delivery<'_>> = (todo.iter().enumerate())
            .map(|(k, &i)| Delivery {
                trace: spans.as_ref().and_then(|s| s.context(k)),
                ..Delivery::of(&events[i].record)
            })
            .collect();
        // Every publish of the batch ends by here, leaving the lease's
        // mark reserve; results not in by then count as timed out.
        let deadline = tokio::time::Instant::from_std(claimed_at) + self.budget.publish_deadline();
        let started = Instant::now();
        self.pace().start(started, deliveries.len());
        let published =
            std::panic::AssertUnwindSafe(publish_bounded(p, &deliveries, self.timeout, deadline))
                .catch_unwind()
                .await;
        let rows = deliveries.len();
        drop(deliveries);
        // A publish that confirmed nothing (timeouts, a target that is
        // down) says nothing about the publisher's pace.
        let confirmed =
            matches!(&published, Ok(results) if results.iter().any(|r| matches!(r, Some(Ok(())))));
        self.pace().end(started, rows, confirmed);
        match published {
            Ok(results) => {
                if let Some(spans) = spans {
                    let ended: Vec<_> = (results.iter())
                        .map(|r| {
                            r.clone()
                                .unwrap_or(Err(PublishError::Timeout(self.timeout)))
                        })
                        .collect();
                    spans.end(&ended);
                }
                trip_or_reset(p.name(), &self.breaker, &results);
                Answer::Published(results, self.breaker.skip(Instant::now()))
            }
            Err(panic) => Answer::Panicked(panic),
        }
    }
}

/// One row of the batch being published.
struct Row {
    event: ClaimedEvent,
    /// [`Decision::Publish`], or the refusal decided before publishing.
    before: Decision,
    /// Publishers that confirmed it in this attempt.
    confirmed: Vec<String>,
    /// Publishers that failed it in this attempt.
    errors: Vec<(String, PublishError)>,
    /// Publishers that were behind and did not take it, and when they are
    /// expected to have room.
    deferred: Vec<(String, Duration)>,
}

/// What one claimed row's attempt decided, for the mark stage to write.
pub(super) struct Outcome {
    pub event: ClaimedEvent,
    /// Never [`Decision::Publish`]: the row has been through its attempt.
    pub decision: Decision,
    /// The publishers that failed it in this attempt, comma-separated (the
    /// history's `publisher` column); `None` when it was never published.
    pub failed_publishers: Option<String>,
}

/// Opens `breaker` when every delivery of the batch that was sent timed
/// out, closes it on a confirmation, and says so once.
fn trip_or_reset(publisher: &str, breaker: &Breaker, results: &[Option<Result<(), PublishError>>]) {
    let sent = || results.iter().flatten();
    let outcome = if sent().any(Result::is_ok) {
        BatchResult::Confirmed
    } else if sent().next().is_some()
        && sent().all(|r| {
            matches!(
                r,
                Err(PublishError::Timeout(_) | PublishError::Unreachable(_))
            )
        })
    {
        BatchResult::AllTimedOut
    } else {
        BatchResult::Other
    };
    match breaker.record(outcome, std::time::Instant::now()) {
        Change::Opened(cool_down) => tracing::warn!(
            publisher,
            events = results.len(),
            ?cool_down,
            "every publish of the batch timed out or found the target unreachable: skipping this publisher for the cool-down so the others keep their pace (its events are retried for it later)"
        ),
        Change::Closed => tracing::info!(publisher, "publisher confirms again: no longer skipped"),
        Change::None => {}
    }
}

/// [`Publisher::publish_each`] (each publish bounded by `timeout`, the batch
/// by `deadline`) and its metrics: one duration sample per call, one
/// `postbox_publish_total` increment per event. What completed counts; only
/// events without a result by the deadline are timed out.
async fn publish_bounded(
    p: &dyn Publisher,
    deliveries: &[Delivery<'_>],
    timeout: Duration,
    deadline: tokio::time::Instant,
) -> Vec<Option<Result<(), PublishError>>> {
    let started = std::time::Instant::now();
    let results = PublishResults::new(deliveries.len());
    if tokio::time::timeout_at(deadline, p.publish_each(deliveries, timeout, &results))
        .await
        .is_err()
    {
        tracing::warn!(
            publisher = p.name(),
            events = deliveries.len(),
            "the batch's lease ran short before every publish ended; events sent without a result count as timed out, those not sent yet are deferred"
        );
    }
    let results = results.into_outcomes(timeout);
    let publisher = p.name().to_owned();
    metrics::histogram!(m::PUBLISH_DURATION_SECONDS, "publisher" => publisher.clone())
        .record(started.elapsed().as_secs_f64());
    let (mut ok, mut error, mut timeout) = (0u64, 0u64, 0u64);
    // Rows never started are counted as deferred by the stage, rows whose
    // target was unreachable as skipped.
    for r in results.iter().flatten() {
        match r {
            Ok(()) => ok += 1,
            Err(PublishError::Timeout(_)) => timeout += 1,
            Err(PublishError::Unreachable(_)) => {}
            Err(_) => error += 1,
        }
    }
    for (result, n) in [
        (m::RESULT_OK, ok),
        (m::RESULT_ERROR, error),
        (m::RESULT_TIMEOUT, timeout),
    ] {
        if n > 0 {
            metrics::counter!(m::PUBLISH_TOTAL, "publisher" => publisher.clone(), "result" => result)
                .increment(n);
        }
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deferred_rows_are_due_when_their_lane_is_expected_to_have_room() {
        let now = Instant::now();
        let mut pace = Pace::default();
        // No publish has ended yet: the poll interval, within bounds.
        assert_eq!(
            pace.defer(20, now, Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(pace.defer(20, now, Duration::ZERO), MIN_DEFER);
        // 25 ms a row, 40 rows held: the 20 deferred are its rows 41..60,
        // and the next 20 are booked after them.
        pace.record(20, Duration::from_millis(500));
        pace.held_rows = 40;
        let first = pace.defer(20, now, Duration::from_secs(1));
        let second = pace.defer(20, now, Duration::from_secs(1));
        assert!((first.as_secs_f64() - 1.5).abs() < 1e-6, "{first:?}");
        assert!((second.as_secs_f64() - 2.0).abs() < 1e-6, "{second:?}");
        // A hung publisher's pace is capped, not hours.
        pace.record(1, Duration::from_secs(3_000));
        assert_eq!(pace.defer(500, now, Duration::from_secs(1)), MAX_DEFER);
    }

    /// A lane slow for a while books many deferred rows; once its target
    /// recovers, new rows wait for what the lane now takes, not for the
    /// slow pace's bookings (rows deferred for a recovered webhook were
    /// due only after MAX_DEFER, stalling their aggregates).
    #[test]
    fn a_lane_that_speeds_up_takes_deferred_rows_back_at_its_new_pace() {
        let now = Instant::now();
        let mut pace = Pace::default();
        pace.record(100, Duration::from_secs(10));
        for _ in 0..50 {
            assert!(pace.defer(100, now, Duration::from_secs(1)) >= Duration::from_secs(10));
        }
        for _ in 0..30 {
            pace.record(100, Duration::from_millis(10));
        }
        let later = now + Duration::from_secs(1);
        let wait = pace.defer(10, later, Duration::from_secs(1));
        assert!(wait <= Duration::from_secs(1), "{wait:?}");
    }

    #[test]
    fn publishes_in_flight_together_share_the_lanes_pace() {
        let mut pace = Pace::default();
        let started = Instant::now() - Duration::from_millis(400);
        pace.start(started, 100);
        pace.start(started + Duration::from_millis(200), 100);
        // Ending while the other still runs: its 400 ms were shared.
        pace.end(started, 100, true);
        let per_row = pace.per_row.expect("recorded");
        assert!(
            (0.0019..0.0025).contains(&per_row),
            "about 2 ms a row, not 4: {per_row}"
        );
        // The one left is expected to end after its share of 100 rows.
        let left = pace.room_in(Instant::now());
        assert!(left <= Duration::from_millis(50), "{left:?}");
        pace.end(started + Duration::from_millis(200), 100, false);
        assert!(pace.running.is_empty());
        assert_eq!(pace.room_in(Instant::now()), Duration::ZERO);
    }
}
