//! A consumer's OpenTelemetry spans, recorded only while the process
//! exports them ([`trace::exporting`]) and only for traced messages (a
//! valid `traceparent` header): `consume <consumer>`, a child of the
//! relay's `publish` span (or of the producer's, when the relay recorded
//! none), and `postbox.handler`, its child, current while the handler runs,
//! so the handler's own spans, and the HTTP bridge's `traceparent`, continue
//! the trace.

use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use postbox_core::trace;

use crate::Message;

/// The `consume` span of `message`, as a context to start the handler's in.
pub(crate) fn consume(consumer: &str, message: &Message) -> Option<Context> {
    if !trace::exporting() {
        return None;
    }
    let parent = trace::parent_of(&message.envelope.headers)?;
    let tracer = trace::tracer();
    let e = &message.envelope;
    let span = tracer
        .span_builder(format!("consume {consumer}"))
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("messaging.system", "postbox"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.consumer.group.name", consumer.to_owned()),
            KeyValue::new("messaging.message.id", e.event_id.clone()),
            KeyValue::new("postbox.app_code", e.app_code.clone()),
            KeyValue::new("postbox.event_type", e.event_type.clone()),
            KeyValue::new("postbox.consume_attempt", i64::from(message.attempt)),
        ])
        .start_with_context(&tracer, &trace::context_with_parent(Some(&parent)));
    Some(Context::new().with_span(span))
}

/// The `postbox.handler` span, a child of `consume`'s, as the context the
/// handler runs in.
pub(crate) fn handler(consume: &Context) -> Context {
    let tracer = trace::tracer();
    let span = tracer
        .span_builder("postbox.handler")
        .with_kind(SpanKind::Internal)
        .start_with_context(&tracer, consume);
    consume.with_span(span)
}

/// Ends the span of `cx`, failed with `error` when there is one.
pub(crate) fn end(cx: &Context, error: Option<&str>) {
    let span = cx.span();
    if let Some(error) = error {
        span.set_status(Status::error(error.to_owned()));
    }
    span.end();
}
