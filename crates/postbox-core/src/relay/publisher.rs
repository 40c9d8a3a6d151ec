//! Stage 2: hand each batch to every publisher that has not confirmed it
//! yet, and decide (with [`crate::retry::decide`]) where each row goes next.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::breaker::{BatchResult, Breaker, Change};
use super::Batch;
use crate::config::{LeaseBudget, WorkerConfig};
use crate::metrics as m;
use crate::publish::{Delivery, PublishError, PublishResults, Publisher};
use crate::retry::{decide, Attempt, AttemptResult, ClaimedRow, Decision, RetryPolicy};
use crate::store::RelayStore;
use crate::{ClaimSource, ClaimedEvent, Result};

pub(super) struct PublishStage {
    pub store: Arc<dyn RelayStore>,
    pub publishers: Vec<Arc<dyn Publisher>>,
    pub config: WorkerConfig,
    pub budget: LeaseBudget,
    /// `database.max_payload_bytes`: larger rows are never published.
    pub max_payload_bytes: usize,
    /// One per publisher, in the same order (see [`super::breaker`]).
    pub breakers: Vec<Breaker>,
}

impl PublishStage {
    /// Returns the number of rows released at shutdown. Publish errors are
    /// outcomes, not failures of the stage; a publisher that panics (a bug)
    /// stops it (see [`super::releasing_on_failure`]).
    pub async fn run(
        self,
        mut input: mpsc::Receiver<Batch>,
        output: mpsc::Sender<Vec<Outcome>>,
        shutdown: CancellationToken,
    ) -> Result<u64> {
        let mut released = 0;
        while let Some(batch) = input.recv().await {
            if shutdown.is_cancelled() {
                released += self.release(batch).await;
                continue;
            }
            if !self.budget.may_start_publish(batch.claimed_at.elapsed()) {
                // Publishing now could outlive the lease, and another relay
                // would send the same rows again: give them back instead.
                tracing::warn!(
                    rows = batch.events.len(),
                    waited = ?batch.claimed_at.elapsed(),
                    "batch waited too long for its publish; released unstarted (the database or a publisher is slower than the lease allows)"
                );
                released += self.release(batch).await;
                continue;
            }
            let held = super::held_rows(&batch.events);
            let outcomes = super::releasing_on_failure(
                self.store.as_ref(),
                held,
                &mut input,
                |queued| super::held_rows(&queued.events),
                async { Ok(self.publish(batch).await) },
            )
            .await?;
            if let Err(unsent) = output.send(outcomes).await {
                // The mark stage is gone (it failed, and says so itself):
                // give the rows back rather than leave them to an expiring
                // lease, which would count an attempt. They are published
                // again.
                let events: Vec<ClaimedEvent> = unsent.0.into_iter().map(|o| o.event).collect();
                released +=
                    super::release(self.store.as_ref(), &events, "the mark stage stopped").await;
                // And so are the batches claimed behind it.
                input.close();
                while let Some(batch) = input.recv().await {
                    released += self.release(batch).await;
                }
                break;
            }
        }
        Ok(released)
    }

    async fn release(&self, batch: Batch) -> u64 {
        super::release(self.store.as_ref(), &batch.events, "unstarted batch").await
    }

    /// The retry rules for a row of `event_type`.
    fn policy(&self, event_type: &str) -> RetryPolicy {
        RetryPolicy {
            max_retry_count: self.config.max_retry_count_for(event_type),
            delivery: self.config.delivery_for(event_type),
        }
    }

    /// Publishes what [`decide`] lets through and decides every row's next
    /// state.
    async fn publish(&self, batch: Batch) -> Vec<Outcome> {
        let timeout = self.config.publish_timeout.get();
        // Every publish of the batch ends by here, leaving the lease's mark
        // reserve; results not in by then count as timed out.
        let deadline =
            tokio::time::Instant::from_std(batch.claimed_at) + self.budget.publish_deadline();
        let mut rows: Vec<Row> = batch
            .events
            .into_iter()
            .map(|event| {
                let r = &event.record;
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
                let before = decide(&claimed, self.policy(&r.event_type), |_| Duration::ZERO);
                Row {
                    event,
                    before,
                    confirmed: Vec::new(),
                    errors: Vec::new(),
                }
            })
            .collect();

        let per_publisher = self
            .publishers
            .iter()
            .zip(&self.breakers)
            .map(|(p, breaker)| {
                let todo: Vec<usize> = rows
                    .iter()
                    .enumerate()
                    .filter(|(_, row)| {
                        row.before == Decision::Publish
                            && !row.event.record.delivered_to.iter().any(|d| d == p.name())
                    })
                    .map(|(i, _)| i)
                    .collect();
                let deliveries: Vec<Delivery<'_>> = todo
                    .iter()
                    .map(|&i| Delivery::of(&rows[i].event.record))
                    .collect();
                async move {
                    let results = if deliveries.is_empty() {
                        Vec::new()
                    } else if let Some(left) = breaker.skip(std::time::Instant::now()) {
                        skipped(p.name(), deliveries.len(), left)
                    } else {
                        let results =
                            publish_bounded(p.as_ref(), &deliveries, timeout, deadline).await;
                        trip_or_reset(p.name(), breaker, &results);
                        results
                    };
                    (p.name().to_owned(), todo, results)
                }
            });
        let all = join_all(per_publisher).await;
        for (name, todo, results) in all {
            for (i, result) in todo.into_iter().zip(results) {
                match result {
                    Ok(()) => rows[i].confirmed.push(name.clone()),
                    Err(e) => rows[i].errors.push((name.clone(), e)),
                }
            }
        }
        rows.into_iter().map(|row| self.outcome(row)).collect()
    }

    /// The decision after publishing (or the refusal made before).
    fn outcome(&self, row: Row) -> Outcome {
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
        };
        // A target that asked for a later retry (HTTP Retry-After) gets it.
        let asked_delay = row.errors.iter().filter_map(|(_, e)| e.retry_after()).max();
        let backoff = self.config.backoff();
        let decision = decide(
            &Attempt::Published(result),
            self.policy(&r.event_type),
            |n| {
                let d = backoff.delay(n, &mut rand::rng());
                asked_delay.map_or(d, |a| a.max(d))
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

/// One row of the batch being published.
struct Row {
    event: ClaimedEvent,
    /// [`Decision::Publish`], or the refusal decided before publishing.
    before: Decision,
    /// Publishers that confirmed it in this attempt.
    confirmed: Vec<String>,
    /// Publishers that failed it in this attempt.
    errors: Vec<(String, PublishError)>,
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

/// The results of a batch not handed to `publisher` because its breaker is
/// open for `left` more: failed attempts, retried later like any other.
fn skipped(publisher: &str, n: usize, left: Duration) -> Vec<Result<(), PublishError>> {
    metrics::counter!(m::PUBLISH_TOTAL, "publisher" => publisher.to_owned(), "result" => m::RESULT_SKIPPED)
        .increment(n as u64);
    let message = format!(
        "not published: {publisher} timed out on a whole batch, so it is skipped for {left:.0?} more while the other publishers go on; retried after the backoff"
    );
    (0..n)
        .map(|_| Err(PublishError::failed(message.clone())))
        .collect()
}

/// Opens `breaker` when every delivery of the batch timed out, closes it
/// on a confirmation, and says so once.
fn trip_or_reset(publisher: &str, breaker: &Breaker, results: &[Result<(), PublishError>]) {
    let outcome = if results.iter().any(Result::is_ok) {
        BatchResult::Confirmed
    } else if results
        .iter()
        .all(|r| matches!(r, Err(PublishError::Timeout(_))))
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
            "every publish of the batch timed out: skipping this publisher for the cool-down so the others keep their pace (its events are retried for it later)"
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
) -> Vec<Result<(), PublishError>> {
    let started = std::time::Instant::now();
    let results = PublishResults::new(deliveries.len());
    if tokio::time::timeout_at(deadline, p.publish_each(deliveries, timeout, &results))
        .await
        .is_err()
    {
        tracing::warn!(
            publisher = p.name(),
            events = deliveries.len(),
            "the batch's lease ran short before every publish ended; events without a result count as timed out"
        );
    }
    let results = results.into_results(timeout);
    let publisher = p.name().to_owned();
    metrics::histogram!(m::PUBLISH_DURATION_SECONDS, "publisher" => publisher.clone())
        .record(started.elapsed().as_secs_f64());
    let (mut ok, mut error, mut timeout) = (0u64, 0u64, 0u64);
    for r in &results {
        match r {
            Ok(()) => ok += 1,
            Err(PublishError::Timeout(_)) => timeout += 1,
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
