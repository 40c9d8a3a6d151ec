//! The relay's OpenTelemetry spans, recorded only while the process exports
//! them ([`trace::exporting`]): a `postbox.claim` and a `postbox.mark` span
//! per batch, linked to the traced events among its rows, and a
//! `publish <publisher>` span per traced event and publisher, a child of
//! the producer's span, whose context the publisher sends on.

use std::borrow::Cow;
use std::time::SystemTime;

use opentelemetry::trace::{Link, Span, SpanContext, SpanKind, Status, Tracer};
use opentelemetry::KeyValue;

use crate::publish::PublishError;
use crate::{trace, ClaimedEvent, EventRecord};

/// Links to the traced events among `records` (at most
/// [`trace::MAX_BATCH_LINKS`]).
pub(super) fn links<'a>(records: impl Iterator<Item = &'a EventRecord>) -> Vec<Link> {
    records
        .filter_map(EventRecord::trace_parent)
        .take(trace::MAX_BATCH_LINKS)
        .map(Link::with_context)
        .collect()
}

/// Records a batch span (`postbox.claim`, `postbox.mark`) that ran from
/// `started` to now, with `links` to its traced events.
pub(super) fn batch(
    name: &'static str,
    started: SystemTime,
    links: Vec<Link>,
    attributes: Vec<KeyValue>,
    error: Option<String>,
) {
    let tracer = trace::tracer();
    let mut span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(started)
        .with_links(links)
        .with_attributes(attributes)
        .start_with_context(&tracer, &opentelemetry::Context::new());
    if let Some(error) = error {
        span.set_status(Status::error(error));
    }
    span.end();
}

/// The `publish` spans of one publisher's share of a batch.
pub(super) struct PublishSpans {
    /// Per delivery, in order: its span, when the event is traced.
    spans: Vec<Option<opentelemetry::global::BoxedSpan>>,
    /// Per delivery: its span's context, what the publisher sends on.
    contexts: Vec<Option<SpanContext>>,
}

impl PublishSpans {
    /// Starts a span for each traced event among `todo`'s rows of `events`.
    pub fn start(publisher: &str, events: &[ClaimedEvent], todo: &[usize]) -> Self {
        let tracer = trace::tracer();
        let spans: Vec<_> = todo
            .iter()
            .map(|&i| {
                let r = &events[i].record;
                let parent = r.trace_parent()?;
                let span = tracer
                    .span_builder(Cow::Owned(format!("publish {publisher}")))
                    .with_kind(SpanKind::Producer)
                    .with_attributes([
                        KeyValue::new("messaging.system", "postbox"),
                        KeyValue::new("messaging.operation.type", "send"),
                        KeyValue::new("messaging.destination.name", publisher.to_owned()),
                        KeyValue::new("messaging.message.id", r.event_id.clone()),
                        KeyValue::new("postbox.app_code", r.app_code.clone()),
                        KeyValue::new("postbox.event_type", r.event_type.clone()),
                        KeyValue::new("postbox.attempt", i64::from(r.retry_count) + 1),
                    ])
                    .start_with_context(&tracer, &trace::context_with_parent(Some(&parent)));
                Some(span)
            })
            .collect();
        let contexts = spans
            .iter()
            .map(|s| s.as_ref().map(|s| s.span_context().clone()))
            .collect();
        PublishSpans { spans, contexts }
    }

    /// The context delivery `k` sends on.
    pub fn context(&self, k: usize) -> Option<&SpanContext> {
        self.contexts.get(k)?.as_ref()
    }

    /// Ends every span with its delivery's result.
    pub fn end(self, results: &[Result<(), PublishError>]) {
        for (span, result) in self.spans.into_iter().zip(results) {
            let Some(mut span) = span else { continue };
            if let Err(e) = result {
                span.set_status(Status::error(e.to_string()));
            }
            span.end();
        }
    }
}
