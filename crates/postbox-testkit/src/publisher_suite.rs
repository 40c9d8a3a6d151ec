//! One conformance suite for every publisher: publish events through the
//! [`Publisher`] and read them back with a real client of the broker.
//!
//! Each broker's test implements [`ReadBack`], turning what its client
//! received into a [`Received`], and calls [`check_publisher`]. The suite
//! checks identity, type, tenant, aggregate, creation time, user headers,
//! `x-attempt`, `x-replayed`, the body and the route (routing key, subject,
//! stream or path) of every event, and that nothing extra arrived.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use postbox_core::publish::Delivery;
use postbox_core::{trace, EventRecord, Publisher, Status};

/// One message as a broker's own client received it, normalised.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Received {
    /// `message_id`, `Nats-Msg-Id`, the `event_id` field, or the envelope's.
    pub event_id: String,
    /// `type`, header or field.
    pub event_type: String,
    /// `app_id`, field or envelope.
    pub app_code: String,
    /// `x-aggregate-id` or field; `None` when absent.
    pub aggregate_id: Option<String>,
    /// `x-aggregate-version` or field; `None` when absent.
    pub aggregate_version: Option<i64>,
    /// `x-created-at-ms` or field.
    pub created_at_ms: i64,
    /// The event's own headers, without the `x-` headers postbox adds.
    pub headers: BTreeMap<String, serde_json::Value>,
    /// `x-attempt`.
    pub attempt: i32,
    /// `x-replayed` (false when absent).
    pub replayed: bool,
    /// The payload text exactly as it arrived (the body, the `payload` field,
    /// or the envelope's `payload` as written): it must be byte-identical to
    /// the row's, never re-serialized.
    pub payload: String,
    /// Routing key, subject, stream name or request path.
    pub route: String,
}

impl Received {
    /// Normalises a SPEC §4 JSON envelope (file lines, webhook bodies) whose
    /// `headers` carry `x-attempt` and `x-replayed`. `text` is the envelope
    /// as received; its `payload` is kept as written.
    pub fn from_envelope(text: &str, route: impl Into<String>) -> Received {
        let v: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("envelope is not JSON ({e}): {text:?}"));
        let raw: BTreeMap<String, &serde_json::value::RawValue> = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("envelope is not a JSON object ({e}): {text:?}"));
        let mut headers: BTreeMap<String, serde_json::Value> = v["headers"]
            .as_object()
            .map(|m| m.clone().into_iter().collect())
            .unwrap_or_default();
        let attempt = headers
            .remove("x-attempt")
            .and_then(|a| a.as_i64())
            .unwrap_or(0) as i32;
        let replayed = headers
            .remove("x-replayed")
            .and_then(|r| r.as_bool())
            .unwrap_or(false);
        Received {
            event_id: v["event_id"].as_str().unwrap_or_default().to_owned(),
            event_type: v["event_type"].as_str().unwrap_or_default().to_owned(),
            app_code: v["app_code"].as_str().unwrap_or_default().to_owned(),
            aggregate_id: v["aggregate_id"].as_str().map(str::to_owned),
            aggregate_version: v["aggregate_version"].as_i64(),
            created_at_ms: v["created_at_ms"].as_i64().unwrap_or_default(),
            headers,
            attempt,
            replayed,
            payload: raw
                .get("payload")
                .map(|p| p.get().to_owned())
                .unwrap_or_default(),
            route: route.into(),
        }
    }
}

/// Reads what the broker took, with the broker's own client.
#[async_trait]
pub trait ReadBack: Send {
    /// Returns the messages received so far, waiting up to `timeout` for
    /// `expected` of them.
    async fn read(&mut self, expected: usize, timeout: Duration) -> Vec<Received>;
}

/// Publishes the first of [`sample_events`] of app `room` alone through
/// `publisher`; its result, a failure as its text.
pub async fn publish_one(publisher: &dyn Publisher) -> Result<(), String> {
    let events = sample_events("room", 1);
    let mut results = publisher.publish(&[Delivery::of(&events[0])]).await;
    results.remove(0).map_err(|e| e.to_string())
}

/// `n` varied events of `app_code`: with and without aggregate and version,
/// with user headers, unicode and nested payloads, first attempts, retries and
/// replays.
pub fn sample_events(app_code: &str, n: usize) -> Vec<EventRecord> {
    (0..n)
        .map(|i| {
            // Every sixth event carries its producer's trace context.
            let headers = (i % 3 == 0).then(|| {
                let mut h = serde_json::json!({ "trace_id": format!("t-{i}"), "tenant": "北京" });
                if i % 6 == 0 {
                    h[trace::TRACEPARENT] = format!("00-{:032x}-{:016x}-01", i + 1, i + 1).into();
                    h[trace::TRACESTATE] = "vendor=producer".into();
                }
                h.to_string()
            });
            EventRecord {
                id: i as i64 + 1,
                app_code: app_code.to_owned(),
                event_id: format!("{}-{i:05}", uuid::Uuid::now_v7()),
                event_type: ["RoomCreated", "UserJoined", "GiftSent"][i % 3].to_owned(),
                aggregate_id: (i % 2 == 0).then(|| format!("room-{}", i % 7)),
                aggregate_version: (i % 4 == 0).then_some(i as i64 * 10),
                payload: if i % 2 == 1 {
                    // Text serde_json would change: a 23-digit integer, an
                    // id past u64, trailing zeros, an exponent, unsorted
                    // keys and inner spacing. It must arrive byte-identical.
                    format!(
                        r#"{{"room_id":1,"n":{i},"big":12345678901234567890123,"amount":19.990,"id":18446744073709551617,"f":1.10,"e":2.50E3, "a" : [ 1.0 ]}}"#
                    )
                } else {
                    serde_json::json!({
                        "n": i,
                        "name": "房间 ✓",
                        "nested": { "list": [1, 2, 3], "ok": true },
                    })
                    .to_string()
                },
                headers,
                status: Status::Delivering,
                retry_count: (i % 5) as i32,
                next_retry_at_ms: 0,
                lock_until_ms: 0,
                worker_id: Some("suite".to_owned()),
                last_error: None,
                delivered_to: Vec::new(),
                replay_count: i32::from(i % 6 == 5),
                created_at_ms: 1_764_000_000_000 + i as i64,
                updated_at_ms: 1_764_000_000_000 + i as i64,
            }
        })
        .collect()
}

/// Publishes `events` in batches of `batch`, expects every publish to
/// succeed, reads them back and checks each against its row. `route` is the
/// route each event must arrive on (the rendered template).
pub async fn check_publisher(
    publisher: &dyn Publisher,
    events: &[EventRecord],
    batch: usize,
    reader: &mut dyn ReadBack,
    route: impl Fn(&EventRecord) -> String,
) {
    // Every fourth event is published as the relay does while it records
    // spans: with its own context, sent in place of the producer's.
    let relay_spans: Vec<_> = events.iter().map(relay_span).collect();
    for (chunk, spans) in events
        .chunks(batch.max(1))
        .zip(relay_spans.chunks(batch.max(1)))
    {
        let deliveries: Vec<Delivery<'_>> = (chunk.iter().zip(spans))
            .map(|(e, span)| Delivery {
                trace: span.as_ref(),
                ..Delivery::of(e)
            })
            .collect();
        let results = publisher.publish(&deliveries).await;
        assert_eq!(
            results.len(),
            chunk.len(),
            "{}: one result per event",
            publisher.name()
        );
        for (r, e) in results.iter().zip(chunk) {
            assert!(
                r.is_ok(),
                "{}: publishing {} failed: {r:?}",
                publisher.name(),
                e.event_id
            );
        }
    }
    let got = reader.read(events.len(), Duration::from_secs(20)).await;
    let mut by_id: BTreeMap<&str, &Received> = BTreeMap::new();
    for m in &got {
        assert!(
            by_id.insert(&m.event_id, m).is_none(),
            "{}: {} arrived twice",
            publisher.name(),
            m.event_id
        );
    }
    for e in events {
        let m = by_id
            .remove(e.event_id.as_str())
            .unwrap_or_else(|| panic!("{}: {} never arrived", publisher.name(), e.event_id));
        let mut expected = expected(e, route(e));
        if let Some(span) = relay_span(e) {
            let delivery = Delivery {
                trace: Some(&span),
                ..Delivery::of(e)
            };
            expected.headers = delivery.headers().into_iter().collect();
            let sent = &expected.headers[trace::TRACEPARENT];
            assert!(
                sent.as_str().unwrap().ends_with("-00000000000000aa-01"),
                "{sent}"
            );
        }
        assert_eq!(
            m,
            &expected,
            "{}: {} arrived different from its row",
            publisher.name(),
            e.event_id
        );
    }
    assert!(
        by_id.is_empty(),
        "{}: unexpected messages {:?}",
        publisher.name(),
        by_id.keys().collect::<Vec<_>>()
    );
}

/// The relay's span context for every fourth event (as if it recorded a
/// `publish` span for it), `None` for the others.
fn relay_span(e: &EventRecord) -> Option<trace::SpanContext> {
    (e.id % 4 == 1).then(|| {
        trace::parse_traceparent(&format!("00-{:032x}-00000000000000aa-01", e.id)).unwrap()
    })
}

/// What a faithful publisher delivers for `e` on `route`.
pub fn expected(e: &EventRecord, route: String) -> Received {
    let delivery = Delivery::of(e);
    Received {
        event_id: e.event_id.clone(),
        event_type: e.event_type.clone(),
        app_code: e.app_code.clone(),
        aggregate_id: e.aggregate_id.clone(),
        aggregate_version: e.aggregate_version,
        created_at_ms: e.created_at_ms,
        headers: e.headers_map().into_iter().collect(),
        attempt: delivery.attempt,
        replayed: delivery.replayed,
        payload: e.payload.clone(),
        route,
    }
}
