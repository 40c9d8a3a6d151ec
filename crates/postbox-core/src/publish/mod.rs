//! The interface every publisher implements, and what it exchanges with the
//! relay. The publishers themselves (RabbitMQ, NATS JetStream, Redis
//! Streams, webhook, file) live in `postbox-publishers`, a folder each.

use std::time::Duration;

use async_trait::async_trait;
use opentelemetry::trace::SpanContext;

use crate::{trace, EventRecord};

/// Per publisher with failover targets, the target it publishes to now,
/// for this process's admin API and dashboard.
static ACTIVE_TARGETS: std::sync::Mutex<std::collections::BTreeMap<String, String>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Records that `publisher` publishes to `target` now.
pub fn set_active_target(publisher: &str, target: &str) {
    let mut active = ACTIVE_TARGETS.lock().unwrap_or_else(|p| p.into_inner());
    active.insert(publisher.to_owned(), target.to_owned());
}

/// Per publisher with failover targets in this process, the target it
/// publishes to now.
pub fn active_targets() -> std::collections::BTreeMap<String, String> {
    ACTIVE_TARGETS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
}

/// One event handed to a publisher.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    /// The row.
    pub record: &'a EventRecord,
    /// This attempt's number, 1 for the first (`x-attempt`).
    pub attempt: i32,
    /// True when an operator replayed the row (`x-replayed`).
    pub replayed: bool,
    /// The relay's `publish` span for this event, when it records one: the
    /// trace context sent on in place of the producer's (see
    /// [`crate::trace`]).
    pub trace: Option<&'a SpanContext>,
}

impl<'a> Delivery<'a> {
    /// The delivery of a claimed row.
    pub fn of(record: &'a EventRecord) -> Self {
        Delivery {
            record,
            attempt: record.retry_count + 1,
            replayed: record.replay_count > 0,
            trace: None,
        }
    }

    /// The event's headers as this delivery sends them: the row's, with
    /// [`trace`](Delivery::trace) applied ([`Delivery::apply_trace`]).
    /// Without the delivery metadata ([`crate::wire::stamp_delivery`]).
    pub fn headers(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut headers = self.record.headers_map();
        self.apply_trace(&mut headers);
        headers
    }

    /// Writes [`trace`](Delivery::trace), when the relay records a span for
    /// this event, into the row's `headers` as `traceparent`/`tracestate`.
    pub fn apply_trace(&self, headers: &mut serde_json::Map<String, serde_json::Value>) {
        if let Some(context) = self.trace {
            trace::inject(context, headers);
        }
    }
}

/// Why one publish did not succeed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The publish did not complete within `publish_timeout`.
    #[error("publish timed out after {0:?}")]
    Timeout(Duration),
    /// The target could not be reached (no connection, or the broker
    /// blocks this one): nothing was sent. Not the event's fault: the relay
    /// defers the row for this publisher without counting an attempt, and
    /// the publisher's breaker opens as for a batch of timeouts.
    #[error("{0}")]
    Unreachable(String),
    /// The target refused or failed; `retry_after` is the earliest retry the
    /// target asked for (HTTP `Retry-After`).
    #[error("{message}")]
    Failed {
        /// What went wrong, without secrets.
        message: String,
        /// Earliest retry the target asked for.
        retry_after: Option<Duration>,
    },
}

impl PublishError {
    /// A plain failure.
    pub fn failed(message: impl Into<String>) -> Self {
        PublishError::Failed {
            message: message.into(),
            retry_after: None,
        }
    }

    /// The delay the target asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            PublishError::Failed { retry_after, .. } => *retry_after,
            PublishError::Timeout(_) | PublishError::Unreachable(_) => None,
        }
    }
}

/// The results of one batch as they come in, one slot per event (see
/// [`Publisher::publish_each`]). A slot never filled counts as timed out,
/// unless the publisher says when it starts each event
/// ([`PublishResults::start`]) and never started that one: it was not
/// sent, and counts no attempt.
#[derive(Debug)]
pub struct PublishResults {
    slots: std::sync::Mutex<Vec<Option<Result<(), PublishError>>>>,
    /// Per event, whether the publisher started it; `None` until the
    /// publisher says of one.
    started: std::sync::Mutex<Option<Vec<bool>>>,
}

impl PublishResults {
    /// Empty slots for a batch of `len` events.
    pub fn new(len: usize) -> Self {
        PublishResults {
            slots: std::sync::Mutex::new(vec![None; len]),
            started: std::sync::Mutex::new(None),
        }
    }

    /// Says that the event at `index` is being sent now. A publisher that
    /// sends the events of a batch a few at a time (the webhook) says so
    /// of each: those it never started when the batch's time ran out were
    /// not sent, and are not counted as attempts.
    pub fn start(&self, index: usize) {
        let len = self.slots.lock().unwrap_or_else(|p| p.into_inner()).len();
        let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(seen) = started
            .get_or_insert_with(|| vec![false; len])
            .get_mut(index)
        {
            *seen = true;
        }
    }

    /// Records the result of the event at `index` of the batch.
    pub fn set(&self, index: usize, result: Result<(), PublishError>) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get_mut(index) {
            *slot = Some(result);
        }
    }

    /// Records the results of the whole batch, in order; a publisher that
    /// returns the wrong number of them fails every event.
    pub fn set_all(&self, results: Vec<Result<(), PublishError>>) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if results.len() == slots.len() {
            for (slot, result) in slots.iter_mut().zip(results) {
                *slot = Some(result);
            }
        } else {
            let error = PublishError::failed(format!(
                "the publisher returned {} results for {} events (a bug in the publisher)",
                results.len(),
                slots.len()
            ));
            slots.iter_mut().for_each(|s| *s = Some(Err(error.clone())));
        }
    }

    /// One result per event; an event without one timed out after `timeout`.
    pub fn into_results(self, timeout: Duration) -> Vec<Result<(), PublishError>> {
        self.into_outcomes(timeout)
            .into_iter()
            .map(|r| r.unwrap_or(Err(PublishError::Timeout(timeout))))
            .collect()
    }

    /// [`PublishResults::into_results`], with `None` for an event the
    /// publisher never started (it says of each when it starts it).
    pub fn into_outcomes(self, timeout: Duration) -> Vec<Option<Result<(), PublishError>>> {
        let started = self.started.into_inner().unwrap_or_else(|p| p.into_inner());
        self.slots
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .into_iter()
            .enumerate()
            .map(|(i, r)| match r {
                Some(r) => Some(r),
                None if started.as_ref().is_some_and(|s| !s[i]) => None,
                None => Some(Err(PublishError::Timeout(timeout))),
            })
            .collect()
    }
}

/// A target that takes responsibility for events.
///
/// `publish` returns only when the target has confirmed (or refused) every
/// event of the batch: a broker's confirm, a webhook's 2xx, a flushed file.
/// It returns one result per input, in order. The relay calls
/// [`publish_each`](Publisher::publish_each), which bounds every single
/// publish by `publish_timeout` and keeps every result that came in.
#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// The configured name; recorded in per-row fanout progress.
    fn name(&self) -> &str;

    /// Publishes a batch and waits for confirmation of each event.
    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>>;

    /// Publishes a batch, recording each event's result in `results` as soon
    /// as it is known, with every single publish bounded by
    /// `publish_timeout`. The relay may stop waiting (dropping this future)
    /// when the batch's lease runs short: results recorded by then count,
    /// events without one count as timed out.
    ///
    /// The default runs [`publish`](Publisher::publish) under
    /// `publish_timeout` and records all results or none: right for a
    /// publisher whose batch succeeds or fails as one (a file append, a
    /// Redis pipeline). Publishers with a confirm per event (RabbitMQ, NATS)
    /// or requests per event (the webhook) override it to record each
    /// result as it arrives.
    async fn publish_each(
        &self,
        batch: &[Delivery<'_>],
        publish_timeout: Duration,
        results: &PublishResults,
    ) {
        if let Ok(all) = tokio::time::timeout(publish_timeout, self.publish(batch)).await {
            results.set_all(all);
        }
    }

    /// How many batches the relay may have this publisher publish at once,
    /// each from its own claim. 1, the default: a batch's confirmations are
    /// all in before the next batch begins. A publisher whose target
    /// confirms asynchronously (RabbitMQ) takes 2, so the target is never
    /// idle while confirmations travel. Batches in flight together may
    /// reach the target in either order; ordering per aggregate holds
    /// regardless (an aggregate never has two events in flight).
    fn max_in_flight(&self) -> usize {
        1
    }

    /// Whether the publisher holds a live connection to its target right
    /// now: `None` when it cannot tell (a file, HTTP requests). A
    /// publisher with failover targets switches on this.
    fn connected(&self) -> Option<bool> {
        None
    }

    /// Flushes and closes; called once at shutdown.
    async fn close(&self) {}
}
