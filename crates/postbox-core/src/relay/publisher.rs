//! Stage 2: hand each batch to every publisher that has not confirmed it yet.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::marker::{Outcome, Unpublished};
use super::Batch;
use crate::config::{LeaseBudget, WorkerConfig};
use crate::metrics as m;
use crate::publish::{Delivery, PublishError, PublishResults, Publisher};
use crate::retry::publish_after_expired_lease;
use crate::store::OutboxStore;
use crate::{ClaimSource, ClaimedEvent};

pub(super) struct PublishStage {
    pub store: Arc<dyn OutboxStore>,
    pub publishers: Vec<Arc<dyn Publisher>>,
    pub config: WorkerConfig,
    pub budget: LeaseBudget,
    /// `database.max_payload_bytes`: larger rows are never published.
    pub max_payload_bytes: usize,
}

impl PublishStage {
    /// Returns the number of rows released at shutdown.
    pub async fn run(
        self,
        mut input: mpsc::Receiver<Batch>,
        output: mpsc::Sender<Vec<Outcome>>,
        shutdown: CancellationToken,
    ) -> u64 {
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
            let outcomes = super::releasing_on_panic(
                self.store.as_ref(),
                held,
                &mut input,
                |queued| super::held_rows(&queued.events),
                self.publish(batch),
            )
            .await;
            if let Err(unsent) = output.send(outcomes).await {
                // The mark stage is gone (it panicked): give the rows back
                // rather than leave them to an expiring lease, which would
                // count an attempt. They are published again.
                let events: Vec<ClaimedEvent> = unsent.0.into_iter().map(|o| o.event).collect();
                released +=
                    super::release(self.store.as_ref(), &events, "the mark stage stopped").await;
                break;
            }
        }
        released
    }

    async fn release(&self, batch: Batch) -> u64 {
        super::release(self.store.as_ref(), &batch.events, "unstarted batch").await
    }

    async fn publish(&self, batch: Batch) -> Vec<Outcome> {
        let timeout = self.config.publish_timeout.get();
        // Every publish of the batch ends by here, leaving the lease's mark
        // reserve; results not in by then count as timed out.
        let deadline =
            tokio::time::Instant::from_std(batch.claimed_at) + self.budget.publish_deadline();
        let mut outcomes: Vec<Outcome> = batch.events.into_iter().map(Outcome::new).collect();

        for o in &mut outcomes {
            let r = &o.event.record;
            if r.payload.len() > self.max_payload_bytes {
                o.unpublished = Some(Unpublished::PayloadTooLarge {
                    size: r.payload.len(),
                    limit: self.max_payload_bytes,
                });
            } else if o.event.source == ClaimSource::ExpiredLease
                && !publish_after_expired_lease(
                    r.retry_count,
                    self.config.max_retry_count_for(&r.event_type),
                    self.config.delivery_for(&r.event_type),
                )
            {
                // Its relay died holding it, and that attempt was its last.
                o.unpublished = Some(Unpublished::ExpiredOnLastAttempt);
            }
        }

        let per_publisher = self.publishers.iter().map(|p| {
            let todo: Vec<usize> = outcomes
                .iter()
                .enumerate()
                .filter(|(_, o)| {
                    o.unpublished.is_none()
                        && !o.event.record.delivered_to.iter().any(|d| d == p.name())
                })
                .map(|(i, _)| i)
                .collect();
            let deliveries: Vec<Delivery<'_>> = todo
                .iter()
                .map(|&i| Delivery::of(&outcomes[i].event.record))
                .collect();
            async move {
                let results = if deliveries.is_empty() {
                    Vec::new()
                } else {
                    publish_bounded(p.as_ref(), &deliveries, timeout, deadline).await
                };
                (p.name().to_owned(), todo, results)
            }
        });
        let all = join_all(per_publisher).await;
        for (name, todo, results) in all {
            for (i, result) in todo.into_iter().zip(results) {
                match result {
                    Ok(()) => outcomes[i].confirmed.push(name.clone()),
                    Err(e) => outcomes[i].errors.push((name.clone(), e)),
                }
            }
        }
        outcomes
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

impl Outcome {
    fn new(event: ClaimedEvent) -> Self {
        Outcome {
            event,
            unpublished: None,
            confirmed: Vec::new(),
            errors: Vec::new(),
        }
    }
}
