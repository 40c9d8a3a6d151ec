//! The NATS JetStream publisher against the local server: the conformance
//! suite read back with a JetStream consumer, duplicates by `Nats-Msg-Id`,
//! and the start-up and routing errors.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use postbox_core::config::NatsPublisherConfig;
use postbox_core::publish::Delivery;
use postbox_core::redact::SecretUrl;
use postbox_core::template::Template;
use postbox_core::Publisher;
use postbox_publishers::nats::{subject_for, NatsPublisher};
use postbox_testkit::publisher_suite::{
    check_publisher, publish_one, sample_events, ReadBack, Received,
};
use postbox_testkit::servers::how_to_start;
use postbox_testkit::{nats_url, scratch_table};

/// A scratch stream name and subject prefix, unique per process and test.
fn scratch() -> (String, String) {
    let base = scratch_table("pbt");
    (base.to_uppercase(), base)
}

async fn jetstream() -> jetstream::Context {
    let client = async_nats::connect(nats_url())
        .await
        .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("nats")));
    jetstream::new(client)
}

fn config(name: &str, stream: &str, subject: &str, declare: bool) -> NatsPublisherConfig {
    NatsPublisherConfig {
        name: Some(name.to_owned()),
        subject: Template::parse(subject).unwrap(),
        declare,
        ..NatsPublisherConfig::new(SecretUrl::new(nats_url()), stream)
    }
}

/// Starts a publisher `name` to `stream` on the subjects `<prefix>.<route>`
/// (`route` a template).
async fn start(
    name: &str,
    stream: &str,
    prefix: &str,
    route: &str,
    declare: bool,
) -> postbox_core::Result<NatsPublisher> {
    let subject = format!("{prefix}.{route}");
    NatsPublisher::connect(&config(name, stream, &subject, declare)).await
}

/// Deletes the stream when the test ends, however it ends.
struct DropStream(String);

impl Drop for DropStream {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                if let Ok(client) = async_nats::connect(nats_url()).await {
                    let _ = jetstream::new(client).delete_stream(&name).await;
                }
            });
        })
        .join();
    }
}

/// A scratch stream (deleted with the guard) that captures only
/// `<prefix>.a.*`, declared by publisher `name`; (stream, prefix, guard).
async fn stream_of_a(name: &str) -> (String, String, DropStream) {
    let (stream, prefix) = scratch();
    let cleanup = DropStream(stream.clone());
    start(name, &stream, &prefix, "a.{event_type}", true)
        .await
        .unwrap();
    (stream, prefix, cleanup)
}

struct StreamReader {
    js: jetstream::Context,
    stream: String,
}

#[async_trait]
impl ReadBack for StreamReader {
    async fn read(&mut self, expected: usize, timeout: Duration) -> Vec<Received> {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let consumer = stream
            .create_consumer(consumer::pull::Config {
                ack_policy: consumer::AckPolicy::None,
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut messages = consumer.messages().await.unwrap();
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while out.len() < expected {
            match tokio::time::timeout_at(deadline, messages.next()).await {
                Ok(Some(Ok(m))) => out.push(received(&m)),
                Ok(Some(Err(e))) => panic!("reading the stream: {e}"),
                Ok(None) | Err(_) => break,
            }
        }
        // Anything extra shows up within a short grace period.
        while let Ok(Some(Ok(m))) =
            tokio::time::timeout(Duration::from_millis(300), messages.next()).await
        {
            out.push(received(&m));
        }
        out
    }
}

fn received(m: &jetstream::Message) -> Received {
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    if let Some(h) = &m.headers {
        for (k, v) in h.iter() {
            headers.insert(k.to_string(), v[0].to_string());
        }
    }
    let mut take = |k: &str| headers.remove(k);
    let event_id = take("x-event-id").expect("x-event-id header");
    take("Nats-Msg-Id").expect("Nats-Msg-Id header");
    let event_type = take("x-event-type").unwrap_or_default();
    let app_code = take("x-app-code").unwrap_or_default();
    let aggregate_id = take("x-aggregate-id");
    let aggregate_version = take("x-aggregate-version").map(|v| v.parse().unwrap());
    let created_at_ms = take("x-created-at-ms").unwrap().parse().unwrap();
    let attempt = take("x-attempt").unwrap().parse().unwrap();
    let replayed = take("x-replayed").as_deref() == Some("true");
    Received {
        event_id,
        event_type,
        app_code,
        aggregate_id,
        aggregate_version,
        created_at_ms,
        headers: headers
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::String(v)))
            .collect(),
        attempt,
        replayed,
        payload: String::from_utf8(m.payload.to_vec()).expect("UTF-8 payload"),
        route: m.subject.to_string(),
    }
}

#[tokio::test]
async fn nats_publisher_passes_the_publisher_suite() {
    let (stream, prefix) = scratch();
    let _cleanup = DropStream(stream.clone());
    let route = "{app_code}.{event_type}.{aggregate_id}";
    let template = format!("{prefix}.{route}");
    let publisher = start("nats", &stream, &prefix, route, true)
        .await
        .expect("connect and declare the stream");
    let mut events = sample_events("room", 120);
    // A dotted aggregate id still lands in the stream, as one token.
    events[0].aggregate_id = Some("order.42".to_owned());
    let mut reader = StreamReader {
        js: jetstream().await,
        stream: stream.clone(),
    };
    let t = Template::parse(&template).unwrap();
    check_publisher(&publisher, &events, 50, &mut reader, |e| subject_for(&t, e)).await;
    assert_eq!(
        subject_for(&t, &events[0]),
        format!("{prefix}.room.RoomCreated.order_42")
    );
    publisher.close().await;
}

fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).expect("first recorder of this binary");
        handle
    })
}

#[tokio::test]
async fn a_resent_event_is_a_counted_duplicate_stored_once() {
    let metrics = prometheus();
    let (stream, prefix) = scratch();
    let _cleanup = DropStream(stream.clone());
    let name = format!("nats-dup-{}", std::process::id());
    let publisher = start(&name, &stream, &prefix, "{event_type}", true)
        .await
        .unwrap();
    let events = sample_events("room", 2);
    let first = [Delivery::of(&events[0]), Delivery::of(&events[1])];
    assert!(publisher.publish(&first).await.iter().all(Result::is_ok));
    let again = [Delivery::of(&events[0])];
    let results = publisher.publish(&again).await;
    assert!(
        results[0].is_ok(),
        "a duplicate counts as delivered: {results:?}"
    );

    let line = format!("postbox_publish_duplicates_total{{publisher=\"{name}\"}} 1");
    let rendered = metrics.render();
    assert!(rendered.contains(&line), "{line} not in:\n{rendered}");
    let mut s = jetstream().await.get_stream(&stream).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 2, "stored once");
}

/// The broker's dedupe key (SPEC §4): a re-send of one delivery is dropped
/// inside the duplicate window, but the same event_id in another app_code and
/// an operator's replay are both stored; consumers still see the bare
/// event_id in `x-event-id`.
#[tokio::test]
async fn the_dedupe_key_drops_resends_but_keeps_other_app_codes_and_replays() {
    let (stream, prefix) = scratch();
    let _cleanup = DropStream(stream.clone());
    let publisher = start("nats-key", &stream, &prefix, "{app_code}", true)
        .await
        .unwrap();
    let room = sample_events("room", 1).remove(0);
    let mut gift = room.clone();
    gift.app_code = "gift".to_owned();
    let mut retried = room.clone();
    retried.retry_count += 1;
    let mut replayed = room.clone();
    replayed.replay_count += 1;
    replayed.retry_count = 0;
    let mut replayed_twice = replayed.clone();
    replayed_twice.replay_count += 1;

    for (what, record) in [
        ("first send", &room),
        ("same event_id, other app_code", &gift),
        ("re-send of the first", &room),
        ("retry of the first", &retried),
        ("replay", &replayed),
        ("re-send of the replay", &replayed),
        ("second replay", &replayed_twice),
    ] {
        let results = publisher.publish(&[Delivery::of(record)]).await;
        assert!(results[0].is_ok(), "{what}: {results:?}");
    }

    let mut reader = StreamReader {
        js: jetstream().await,
        stream: stream.clone(),
    };
    let stored = reader.read(4, Duration::from_secs(5)).await;
    let got: Vec<(String, String, bool)> = stored
        .iter()
        .map(|r| (r.event_id.clone(), r.app_code.clone(), r.replayed))
        .collect();
    let id = room.event_id.clone();
    assert_eq!(
        got,
        [
            (id.clone(), "room".to_owned(), false),
            (id.clone(), "gift".to_owned(), false),
            (id.clone(), "room".to_owned(), true),
            (id, "room".to_owned(), true),
        ],
        "stored: first send, other app_code, replay, second replay; re-sends dropped"
    );
}

#[tokio::test]
async fn a_missing_stream_is_a_clear_error_at_start() {
    let (stream, prefix) = scratch();
    let err = start("nats-missing", &stream, &prefix, "{event_type}", false)
        .await
        .err()
        .expect("a missing stream without declare is refused");
    let text = err.to_string();
    assert!(
        text.contains("nats-missing") && text.contains(&stream) && text.contains("declare"),
        "{text}"
    );
}

#[tokio::test]
async fn a_subject_no_stream_captures_is_a_failed_attempt() {
    let (stream, prefix, _cleanup) = stream_of_a("nats-a").await;
    let stray = start("nats-stray", &stream, &prefix, "b.{event_type}", false)
        .await
        .unwrap();
    let err = publish_one(&stray).await.expect_err("nothing captured it");
    assert!(
        err.contains("no stream captures it") && err.contains(&format!("{prefix}.b.")),
        "{err}"
    );
}

/// Issue 10.2: `publish_timeout` bounds each publish, and what completed
/// counts. One event's subject is taken by a plain subscriber that never
/// answers (so its PubAck never comes, and no "no responders" error either);
/// the others are captured by the stream and acked at once. The acked events
/// are recorded as delivered, only the silent one times out.
#[tokio::test]
async fn publish_each_keeps_the_acks_that_came_before_the_deadline() {
    use postbox_core::publish::{PublishError, PublishResults};

    // The subject `<prefix>.b.silent` belongs to a subscriber that never
    // replies.
    let (stream, prefix, _cleanup) = stream_of_a("nats-each-a").await;
    let publisher = start(
        "nats-each",
        &stream,
        &prefix,
        "{app_code}.{event_type}",
        false,
    )
    .await
    .unwrap();
    let silent = async_nats::connect(nats_url()).await.unwrap();
    let silent_subject = format!("{prefix}.b.silent");
    let mut sub = silent.subscribe(silent_subject.clone()).await.unwrap();
    // `flush` only writes out: receiving our own probe proves the server
    // registered the subscription (else the publish gets "no responders").
    silent
        .publish(silent_subject, Bytes::from_static(b"probe"))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .expect("the probe comes back")
        .expect("subscription open");

    let mut events = sample_events("a", 4);
    events[2].app_code = "b".to_owned();
    events[2].event_type = "silent".to_owned();
    let batch: Vec<Delivery<'_>> = events.iter().map(Delivery::of).collect();
    let timeout = Duration::from_millis(800);
    let results = PublishResults::new(batch.len());
    publisher.publish_each(&batch, timeout, &results).await;
    let results = results.into_results(timeout);
    for (i, r) in results.iter().enumerate() {
        if i == 2 {
            assert_eq!(r, &Err(PublishError::Timeout(timeout)), "event {i}");
        } else {
            assert_eq!(r, &Ok(()), "event {i} was acked: {results:?}");
        }
    }
    let mut s = jetstream().await.get_stream(&stream).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 3);
}

/// A batch larger than the JetStream context's acks in flight (5,000) is
/// published whole: it was sent whole before any PubAck was awaited, and
/// the publish past the 5,000th waited for a place only an awaited ack
/// gives back, so every event of the batch timed out.
#[tokio::test]
async fn a_batch_larger_than_the_acks_in_flight_is_published() {
    let (stream, prefix) = scratch();
    let _cleanup = DropStream(stream.clone());
    let publisher = start("nats-big", &stream, &prefix, "{event_type}", true)
        .await
        .unwrap();
    let events = sample_events("room", 6_000);
    let batch: Vec<Delivery<'_>> = events.iter().map(Delivery::of).collect();
    let results = tokio::time::timeout(Duration::from_secs(30), publisher.publish(&batch))
        .await
        .expect("the batch finished");
    assert!(
        results.iter().all(Result::is_ok),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    let mut s = jetstream().await.get_stream(&stream).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 6_000);
}

/// A subject another stream captures is stored there, where this
/// publisher's consumers never read: a failed attempt naming both streams,
/// not a delivery (its PubAck was taken as one).
#[tokio::test]
async fn a_subject_another_stream_captures_is_a_failed_attempt() {
    let (ours, _, _ours) = stream_of_a("nats-ours").await;
    let (theirs, other_prefix) = scratch();
    let _theirs = DropStream(theirs.clone());
    start("nats-theirs", &theirs, &other_prefix, "{event_type}", true)
        .await
        .unwrap();
    let subject = format!("{other_prefix}.{{event_type}}");
    let misrouted = NatsPublisher::connect(&config("nats-misrouted", &ours, &subject, false))
        .await
        .unwrap();
    let err = publish_one(&misrouted)
        .await
        .expect_err("stored in another stream");
    assert!(err.contains(&theirs) && err.contains(&ours), "{err}");
}

/// A server that requires a login: the user and password in the URL
/// (percent-encoded, as a URL carries them) log the publisher in. The
/// NATS client reads no credentials from a URL: the publisher was refused
/// as unauthorized, whatever the URL held.
#[tokio::test]
async fn credentials_in_the_url_log_in() {
    let server = postbox_testkit::clusters::NatsCluster::start_with_user(1, "app", "p@ss:w").await;
    let port = server.ports[0];
    let (stream, prefix) = scratch();
    let mut config = config(
        "nats-login",
        &stream,
        &format!("{prefix}.{{event_type}}"),
        true,
    );
    config.url = SecretUrl::new(format!("nats://app:p%40ss%3Aw@127.0.0.1:{port}"));
    config.urls = vec![config.url.clone()];
    let publisher = NatsPublisher::connect(&config).await.expect("logged in");
    let events = sample_events("room", 1);
    let results = publisher.publish(&[Delivery::of(&events[0])]).await;
    assert!(results[0].is_ok(), "{results:?}");
    let client = server.connect(&server.urls()[0]).await.unwrap();
    let mut s = jetstream::new(client).get_stream(&stream).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 1);

    config.url = SecretUrl::new(format!("nats://app:wrong@127.0.0.1:{port}"));
    config.urls = vec![config.url.clone()];
    let refused = NatsPublisher::connect(&config)
        .await
        .err()
        .expect("a wrong password is refused")
        .to_string();
    assert!(
        !refused.contains("wrong"),
        "the password is not shown: {refused}"
    );
}

/// A producer's header named `Nats-…` is JetStream's own, which acts on it
/// when storing: `Nats-Expected-Stream` of another stream refused the event
/// at every attempt, and `Nats-TTL` would expire it unread. It is left out;
/// the other headers go.
#[tokio::test]
async fn a_producer_s_nats_header_is_left_out() {
    let (stream, prefix) = scratch();
    let _cleanup = DropStream(stream.clone());
    let publisher = start("nats-own-headers", &stream, &prefix, "{event_type}", true)
        .await
        .unwrap();
    let mut event = sample_events("room", 1).remove(0);
    event.headers =
        Some(r#"{"Nats-Expected-Stream":"ELSEWHERE","nats-ttl":"1s","tenant":"acme"}"#.to_owned());
    let results = publisher.publish(&[Delivery::of(&event)]).await;
    assert!(results[0].is_ok(), "{results:?}");
    let s = jetstream().await.get_stream(&stream).await.unwrap();
    let stored = s
        .get_last_raw_message_by_subject(&format!("{prefix}.{}", event.event_type))
        .await
        .unwrap();
    let headers = stored.headers;
    assert_eq!(headers.get("tenant").map(|v| v.as_str()), Some("acme"));
    assert!(
        headers.get("Nats-Expected-Stream").is_none() && headers.get("nats-ttl").is_none(),
        "{headers:?}"
    );
}
