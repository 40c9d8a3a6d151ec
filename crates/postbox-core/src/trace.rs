//! W3C trace context across the outbox hop (SPEC §10: tracing).
//!
//! An event carries its producer's `traceparent` (and `tracestate`) in its
//! `headers`: written by the Rust API from the OpenTelemetry context current
//! at `enqueue` (with `tracing-opentelemetry`, the current `tracing` span's),
//! or by a plain `INSERT` that fills the column. Every publisher sends the
//! event's headers, so the context reaches consumers unchanged; the webhook
//! and the consumers' HTTP bridge send it as HTTP headers too.
//!
//! When a process exports spans (`[tracing] otlp`, installed by
//! `postbox-runtime`, which calls [`set_exporting`]), the relay records a
//! `publish` span per event and publisher, a child of the producer's span,
//! and sends *its* context on, so a consumer's `consume` span is the relay's
//! child; `claim` and `mark` spans cover each batch and link to the events'
//! traces. Without an exporter nothing is recorded and the hot path does no
//! trace work at all: the headers pass through as written.

use std::sync::atomic::{AtomicBool, Ordering};

/// A span's identity: trace id, span id, flags and state.
pub use opentelemetry::trace::SpanContext;
use opentelemetry::trace::{SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::Context;

/// The W3C header naming the caller's span: `00-<trace id>-<span id>-<flags>`.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendors' trace state beside [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";
/// The instrumentation scope postbox's spans are recorded under.
pub const SCOPE: &str = "postbox";
/// At most this many links on a batch span (`claim`, `mark`): one per
/// traced event of the batch, the rest left out.
pub const MAX_BATCH_LINKS: usize = 128;

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Says whether this process exports spans (an OTLP exporter is installed).
/// Without one, the relay and the consumers record no spans.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Turns span recording on or off; called by whoever installs (or shuts
/// down) the global tracer provider.
pub fn set_exporting(on: bool) {
    EXPORTING.store(on, Ordering::Relaxed);
}

/// The tracer postbox records its spans with: the global provider's.
pub fn tracer() -> opentelemetry::global::BoxedTracer {
    opentelemetry::global::tracer(SCOPE)
}

/// Parses a W3C `traceparent` value (version `00`, or a later version read
/// by its first four fields as the recommendation says). `None` for
/// anything malformed, and for the all-zero ids the format forbids.
pub fn parse_traceparent(value: &str) -> Option<SpanContext> {
    let value = value.trim();
    let mut parts = value.split('-');
    let version = parts.next()?;
    let (trace_id, span_id, flags) = (parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(version, 2) || version == "ff" || !hex(trace_id, 32) || !hex(span_id, 16) {
        return None;
    }
    if !hex(flags, 2) || (version == "00" && parts.next().is_some()) {
        return None;
    }
    // Lower case only, as the format says.
    if value.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace_id).ok()?;
    let span_id = SpanId::from_hex(span_id).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let context = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
        true,
        TraceState::NONE,
    );
    context.is_valid().then_some(context)
}

/// `context` as a `traceparent` value.
pub fn traceparent(context: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8()
    )
}

/// The span context an event's headers name, with its `tracestate`; `None`
/// when there is no valid `traceparent`.
pub fn parent_of(headers: &serde_json::Map<String, serde_json::Value>) -> Option<SpanContext> {
    let parent = parse_traceparent(headers.get(TRACEPARENT)?.as_str()?)?;
    let state = headers
        .get(TRACESTATE)
        .and_then(|s| s.as_str())
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or(TraceState::NONE);
    Some(SpanContext::new(
        parent.trace_id(),
        parent.span_id(),
        parent.trace_flags(),
        true,
        state,
    ))
}

/// The context to start a child span of `parent` in (the root context when
/// there is none: the span starts a trace of its own).
pub fn context_with_parent(parent: Option<&SpanContext>) -> Context {
    match parent {
        Some(p) => Context::new().with_remote_span_context(p.clone()),
        None => Context::new(),
    }
}

/// `context` as headers: `traceparent`, and `tracestate` when it has one.
pub fn header_pairs(context: &SpanContext) -> Vec<(&'static str, String)> {
    let mut pairs = vec![(TRACEPARENT, traceparent(context))];
    let state = context.trace_state().header();
    if !state.is_empty() {
        pairs.push((TRACESTATE, state));
    }
    pairs
}

/// Writes `context` into `headers` ([`header_pairs`]), replacing what was
/// there.
pub fn inject(context: &SpanContext, headers: &mut serde_json::Map<String, serde_json::Value>) {
    headers.remove(TRACESTATE);
    for (name, value) in header_pairs(context) {
        headers.insert(name.to_owned(), value.into());
    }
}

/// The span context current in this task (the OpenTelemetry context; with
/// `tracing-opentelemetry`'s layer, the current `tracing` span's), when it
/// is a valid one.
pub fn current() -> Option<SpanContext> {
    Context::map_current(|cx| {
        let span = cx.span();
        let context = span.span_context();
        context.is_valid().then(|| context.clone())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_round_trips_and_malformed_ones_are_refused() {
        let c = parse_traceparent(TP).unwrap();
        assert_eq!(c.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.span_id().to_string(), "00f067aa0ba902b7");
        assert!(c.is_sampled() && c.is_remote());
        assert_eq!(traceparent(&c), TP);
        let unsampled = parse_traceparent(&TP.replace("-01", "-00")).unwrap();
        assert!(!unsampled.is_sampled());
        // A later version may append fields; version 00 may not.
        assert!(parse_traceparent(&TP.replace("00-", "01-").replace("-01", "-01-xyz")).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn headers_carry_the_context_and_its_state() {
        let mut h = serde_json::Map::new();
        assert!(parent_of(&h).is_none());
        h.insert(TRACEPARENT.into(), TP.into());
        h.insert(TRACESTATE.into(), "congo=t61rcWkgMzE".into());
        let parent = parent_of(&h).unwrap();
        assert_eq!(parent.trace_state().get("congo"), Some("t61rcWkgMzE"));
        let mut out = serde_json::Map::new();
        inject(&parent, &mut out);
        assert_eq!(out[TRACEPARENT], TP);
        assert_eq!(out[TRACESTATE], "congo=t61rcWkgMzE");
        let row = |headers: &serde_json::Map<String, serde_json::Value>| crate::EventRecord {
            headers: Some(serde_json::to_string(headers).unwrap()),
            ..crate::template::tests::record()
        };
        assert_eq!(row(&out).trace_parent(), Some(parent));
        assert_eq!(row(&serde_json::Map::new()).trace_parent(), None);
    }

    #[test]
    fn enqueue_outside_a_span_adds_nothing_and_a_written_context_wins() {
        let plain = crate::NewEvent::new("room", "RoomCreated", "{}");
        assert_eq!(plain.headers_json(), None);

        let parent = parse_traceparent(TP).unwrap();
        let cx = Context::new().with_remote_span_context(parent);
        let _guard = cx.attach();
        let stamped: serde_json::Value =
            serde_json::from_str(&plain.clone().header("k", "v").headers_json().unwrap()).unwrap();
        assert_eq!(stamped[TRACEPARENT], TP);
        assert_eq!(stamped["k"], "v");

        let written = "00-11111111111111111111111111111111-2222222222222222-01";
        let own = plain.header(TRACEPARENT, written);
        let kept: serde_json::Value = serde_json::from_str(&own.headers_json().unwrap()).unwrap();
        assert_eq!(kept[TRACEPARENT], written);
    }
}
