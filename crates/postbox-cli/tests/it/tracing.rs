//! Trace context across the hop (SPEC §10, tracing): a producer's span
//! reaches the handler through the outbox row, the relay and RabbitMQ; with
//! `[tracing] otlp` the relay and the consumer export spans that chain
//! producer → `publish` → `consume` → `postbox.handler`, received here by an
//! in-test OTLP/HTTP collector.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use postbox_core::NewEvent;
use postbox_testkit::consumer_fixtures::{broker, delete_queues, eventually};
use postbox_testkit::http::{Recorded, Recorder};
use postbox_testkit::servers::{amqp_url, scratch_name};
use prost::Message as _;

use crate::common;

/// A span as the collector received it, with the service that sent it.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    span: Span,
}

impl Got {
    fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }
    fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }
    fn parent(&self) -> String {
        hex(&self.span.parent_span_id)
    }
    fn attribute(&self, key: &str) -> Option<String> {
        let kv = self.span.attributes.iter().find(|kv| kv.key == key)?;
        match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            Value::IntValue(i) => Some(i.to_string()),
            other => Some(format!("{other:?}")),
        }
    }
    /// Links as `trace id-span id`.
    fn links(&self) -> Vec<String> {
        (self.span.links.iter())
            .map(|l| format!("{}-{}", hex(&l.trace_id), hex(&l.span_id)))
            .collect()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every span the collector received, decoded from OTLP protobuf.
fn spans(collector: &Recorder) -> Vec<Got> {
    let mut out = Vec::new();
    for r in collector.requests() {
        assert_eq!(r.path, "/v1/traces", "the exporter posts to /v1/traces");
        assert_eq!(r.header("content-type"), Some("application/x-protobuf"));
        let request = ExportTraceServiceRequest::decode(r.body.as_slice())
            .unwrap_or_else(|e| panic!("not an OTLP trace export: {e}"));
        for rs in request.resource_spans {
            let service = (rs.resource.iter().flat_map(|r| &r.attributes))
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    out.push(Got {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
    }
    out
}

/// The request `recorder` got for `event_id` (by `Idempotency-Key`).
fn request_for(recorder: &Recorder, event_id: &str) -> Option<Recorded> {
    (recorder.requests().into_iter()).find(|r| r.header("idempotency-key") == Some(event_id))
}

struct Setup {
    dir: tempfile::TempDir,
    url: String,
    table: String,
    exchange: String,
    queue: String,
}

impl Setup {
    /// The config: a RabbitMQ publisher and a webhook (`hook`) publisher; a
    /// consumer of the exchange bridging to `handler`; `tracing` appended.
    fn config(&self, hook: &Recorder, handler: &Recorder, tracing: &str) -> String {
        let Setup {
            url,
            table,
            exchange,
            queue,
            ..
        } = self;
        let amqp = amqp_url();
        let body = format!(
            "[database]\nurl = \"{url}\"\ntable = \"{table}\"\napp_codes = [\"room\"]\n\
             [outbox_worker]\npoll_interval = \"100ms\"\ninitial_backoff = \"100ms\"\nmax_backoff = \"300ms\"\n\
             [[publishers]]\nkind = \"rabbitmq\"\nname = \"rabbit\"\nurl = \"{amqp}\"\nexchange = \"{exchange}\"\ndeclare = true\n\
             [[publishers]]\nkind = \"webhook\"\nname = \"hook\"\nurl = \"{}/hook\"\n\
             [[consumers]]\nkind = \"rabbitmq\"\nurl = \"{amqp}\"\nqueue = \"{queue}\"\ndeclare = true\nprefetch = 1\n\
             bindings = [{{ exchange = \"{exchange}\", routing_key = \"#\" }}]\n\
             handler = {{ http = \"{}/handle\", timeout = \"5s\" }}\n{tracing}",
            hook.url, handler.url
        );
        let path = self.dir.path().join("postbox.toml");
        std::fs::write(&path, body).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

/// `postbox --config cfg <command>`, `service` its `[tracing]
/// service_name`, spans exported every 100 ms.
fn spawn(dir: &Path, cfg: &str, command: &str, service: &str) -> tokio::process::Child {
    let env = [
        ("POSTBOX__TRACING__SERVICE_NAME", service),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    common::spawn_async(dir, cfg, command, &env)
}

/// Runs the consumer, then the relay, until `hook` and `handler` each got
/// every one of `event_ids`; then stops both.
async fn deliver(
    setup: &Setup,
    cfg: &str,
    hook: &Recorder,
    handler: &Recorder,
    event_ids: &[&str],
) {
    let mut consume = spawn(setup.dir.path(), cfg, "consume", "postbox-consume");
    // The consumer declares its queue and binding; wait for them so that
    // the relay's first publish is routed.
    let (conn, _) = broker().await;
    eventually(
        "the consumer's queue",
        Duration::from_secs(20),
        async || {
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            let options = lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            (ch.queue_declare(setup.queue.as_str().into(), options, Default::default())
                .await)
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;
    let mut relay = spawn(setup.dir.path(), cfg, "relay", "postbox-relay");
    eventually(
        "every event at the webhook and the handler",
        Duration::from_secs(30),
        async || {
            let missing: Vec<_> = (event_ids.iter())
                .filter(|id| request_for(hook, id).is_none() || request_for(handler, id).is_none())
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("missing {missing:?}"))
            }
        },
    )
    .await;
    common::stopped(&mut relay).await;
    common::stopped(&mut consume).await;
}

/// The one span named `name` in trace `trace_id`.
fn one<'a>(spans: &'a [Got], trace_id: &str, name: &str) -> &'a Got {
    let found: Vec<_> = (spans.iter())
        .filter(|s| s.trace_id() == trace_id && s.span.name == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one `{name}` span in trace {trace_id}: {found:#?}"
    );
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_runs_from_the_producer_through_the_relay_and_the_broker_to_the_handler() {
    let (url, store) = common::server_outbox("postgres", "pbx_trace", 2).await;
    let setup = Setup {
        dir: tempfile::tempdir().unwrap(),
        url: url.clone(),
        table: store.table().as_str().to_owned(),
        exchange: scratch_name("pbx_trace_x"),
        queue: scratch_name("pbx_trace_q"),
    };
    let (hook, handler, collector) = (
        Recorder::start().await,
        Recorder::start().await,
        Recorder::start().await,
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let plain_insert = |event_id: &'static str, traceparent: &'static str| {
        let sql = format!(
            "INSERT INTO {} (app_code, event_id, event_type, payload, headers) \
             VALUES ('room', '{event_id}', 'RoomCreated', '{{}}', '{{\"traceparent\": \"{traceparent}\", \"tracestate\": \"vendor=1\"}}')",
            setup.table
        );
        let pool = pool.clone();
        async move { sqlx::query(&sql).execute(&pool).await.unwrap() }
    };

    // Without an exporter: the producer's context reaches the webhook and
    // the handler as it was written, and nothing is exported.
    const UNTRACED_RELAY: &str = "00-5a1e5a1e5a1e5a1e5a1e5a1e5a1e5a1e-1111111111111111-01";
    plain_insert("plain-0", UNTRACED_RELAY).await;
    let cfg = setup.config(&hook, &handler, "");
    deliver(&setup, &cfg, &hook, &handler, &["plain-0"]).await;
    for got in [&hook, &handler] {
        let r = request_for(got, "plain-0").unwrap();
        assert_eq!(r.header("traceparent"), Some(UNTRACED_RELAY), "{r:?}");
        assert_eq!(r.header("tracestate"), Some("vendor=1"));
    }

    // The Rust API: the context current at enqueue goes into the row.
    let producer = SpanContext::new(
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
        SpanId::from_hex("b7ad6b7169203331").unwrap(),
        TraceFlags::SAMPLED,
        true,
        TraceState::NONE,
    );
    let event = NewEvent::new("room", "RoomCreated", r#"{"room_id":1}"#).aggregate("room-1", 1);
    let cx = opentelemetry::Context::new().with_remote_span_context(producer.clone());
    (store.enqueue_batch(std::slice::from_ref(&event), 1 << 20))
        .with_context(cx)
        .await
        .unwrap();
    let stored: String = sqlx::query_scalar(&format!(
        "SELECT headers FROM {} WHERE event_id = $1",
        setup.table
    ))
    .bind(&event.event_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    let api_parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    assert!(stored.contains(api_parent), "{stored}");
    // Another language's plain INSERT.
    const PLAIN: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    plain_insert("plain-1", PLAIN).await;

    let cfg = setup.config(
        &hook,
        &handler,
        &format!("[tracing]\notlp = \"{}\"\n", collector.url),
    );
    deliver(&setup, &cfg, &hook, &handler, &[&event.event_id, "plain-1"]).await;
    let spans = eventually("the exported spans", Duration::from_secs(15), async || {
        let spans = spans(&collector);
        let handlers = spans
            .iter()
            .filter(|s| s.span.name == "postbox.handler")
            .count();
        if handlers >= 2 {
            Ok(spans)
        } else {
            Err(format!("{} spans, {handlers} handler spans", spans.len()))
        }
    })
    .await;
    let names: HashMap<&str, usize> = spans.iter().fold(HashMap::new(), |mut m, s| {
        *m.entry(s.span.name.as_str()).or_default() += 1;
        m
    });
    println!("spans received: {names:?}");

    let consume_name = format!("consume {}", setup.queue);
    for (event_id, trace_id, parent) in [
        (
            event.event_id.as_str(),
            "0af7651916cd43dd8448eb211c80319c",
            "b7ad6b7169203331",
        ),
        (
            "plain-1",
            "4bf92f3577b34da6a3ce929d0e0e4736",
            "00f067aa0ba902b7",
        ),
    ] {
        // The relay: a publish span per publisher, children of the producer.
        let rabbit = one(&spans, trace_id, "publish rabbit");
        let webhook = one(&spans, trace_id, "publish hook");
        for publish in [rabbit, webhook] {
            assert_eq!(publish.parent(), parent, "{publish:#?}");
            assert_eq!(publish.service, "postbox-relay");
            assert_eq!(publish.span.kind, 4, "a PRODUCER span");
            assert_eq!(
                publish.attribute("messaging.message.id").as_deref(),
                Some(event_id)
            );
        }
        // The webhook request carries the webhook's publish span.
        let hooked = request_for(&hook, event_id).unwrap();
        assert_eq!(
            hooked.header("traceparent").map(str::to_owned),
            Some(format!("00-{trace_id}-{}-01", webhook.span_id()))
        );
        // The consumer: consume is the RabbitMQ publish span's child,
        // the handler consume's.
        let consume = one(&spans, trace_id, &consume_name);
        assert_eq!(consume.parent(), rabbit.span_id(), "{consume:#?}");
        assert_eq!(consume.service, "postbox-consume");
        assert_eq!(consume.span.kind, 5, "a CONSUMER span");
        let handled = one(&spans, trace_id, "postbox.handler");
        assert_eq!(handled.parent(), consume.span_id());
        // The HTTP bridge hands the handler span's context to the service.
        let bridged = request_for(&handler, event_id).unwrap();
        assert_eq!(
            bridged.header("traceparent").map(str::to_owned),
            Some(format!("00-{trace_id}-{}-01", handled.span_id()))
        );
        // The batch spans link to the event's trace.
        for batch in ["postbox.claim", "postbox.mark"] {
            let link = format!("{trace_id}-{parent}");
            assert!(
                (spans.iter()).any(|s| s.span.name == batch && s.links().contains(&link)),
                "a `{batch}` span linked to {link}"
            );
        }
    }
    // The event delivered before, without an exporter, was never recorded.
    assert!(!spans
        .iter()
        .any(|s| s.trace_id() == "5a1e5a1e5a1e5a1e5a1e5a1e5a1e5a1e"));

    let (_conn, ch) = broker().await;
    delete_queues(&ch, &setup.queue).await;
}
