//! The NATS JetStream consumer against the real server
//! (`POSTBOX_TEST_NATS_URL`, default `nats://127.0.0.1:4222`).

use crate::nats_redis_suite;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use async_nats::HeaderMap;
use async_trait::async_trait;
use nats_redis_suite::{config_with, test_event, Broker, ConsumerTask, DeadCopy, Start, Unacked};
use postbox_consumers::consume::state::ConsumerState;
use postbox_consumers::nats::{dead_stream, NatsConsumer};
use postbox_core::config::ConsumerConfig;
use postbox_core::envelope::Envelope;
use postbox_testkit::servers::{how_to_start, nats_url};
use tokio_util::sync::CancellationToken;

struct NatsBroker {
    /// Stream name; its subjects are `<prefix>.>`.
    stream: String,
    prefix: String,
    js: jetstream::Context,
    /// What consumers connect to.
    url: String,
}

impl NatsBroker {
    /// A scratch stream with a short duplicate window, so that a test can
    /// publish the same event id twice.
    async fn new() -> Self {
        let client = async_nats::connect(nats_url())
            .await
            .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("nats")));
        Self::on(client, nats_url()).await
    }

    /// [`NatsBroker::new`] on the server of `client`, which consumers
    /// reach at `url`.
    async fn on(client: async_nats::Client, url: String) -> Self {
        let js = jetstream::new(client);
        drop_stale_streams(&js).await;
        let stream = nats_redis_suite::group("PBT");
        let prefix = stream.to_lowercase();
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("creating the scratch stream (is JetStream on? `-js`): {e}"));
        NatsBroker {
            stream,
            prefix,
            js,
            url,
        }
    }
}

/// Deletes scratch streams (`PBT…_<pid>_<hex>`) that test processes which
/// panicked before cleaning up left behind; this process's are kept.
async fn drop_stale_streams(js: &jetstream::Context) {
    use futures::StreamExt;
    static ONCE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    ONCE.get_or_init(|| async {
        let mine = format!("_{}_", std::process::id());
        let names: Vec<String> = js
            .stream_names()
            .filter_map(|n| async move { n.ok() })
            .collect()
            .await;
        for name in names {
            if name.starts_with("PBT") && !name.contains(&mine) {
                let _ = js.delete_stream(&name).await;
            }
        }
    })
    .await;
}

#[async_trait]
impl Broker for NatsBroker {
    fn config(&self, group: &str, overrides: serde_json::Value) -> ConsumerConfig {
        let settings = serde_json::json!({
            "kind": "nats",
            "url": self.url,
            "stream": self.stream,
            "subject": format!("{}.>", self.prefix),
            "consumer_group": group,
            "declare": true,
            "retry_delay": "300ms",
        });
        config_with(settings, overrides)
    }

    /// Exactly the headers of postbox's NATS publisher, on
    /// `<prefix>.<app_code>.<event_type>`.
    async fn publish(&self, e: &Envelope) {
        let mut h = HeaderMap::new();
        for (k, v) in &e.headers {
            h.insert(
                k.as_str(),
                v.as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| v.to_string())
                    .as_str(),
            );
        }
        let msg_id = format!("{}:0:{}", e.app_code, e.event_id);
        h.insert("Nats-Msg-Id", msg_id.as_str());
        h.insert("x-event-id", e.event_id.as_str());
        h.insert("x-event-type", e.event_type.as_str());
        h.insert("x-app-code", e.app_code.as_str());
        if let Some(a) = &e.aggregate_id {
            h.insert("x-aggregate-id", a.as_str());
        }
        if let Some(v) = e.aggregate_version {
            h.insert("x-aggregate-version", v.to_string().as_str());
        }
        h.insert("x-created-at-ms", e.created_at_ms.to_string().as_str());
        h.insert("x-attempt", "1");
        // Past the duplicate window, so a deliberate duplicate is stored.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let subject = format!("{}.{}.{}", self.prefix, e.app_code, e.event_type);
        let ack = self
            .js
            .publish_with_headers(subject, h, e.payload.get().to_owned().into())
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(!ack.duplicate);
    }

    async fn unacked(&self, group: &str) -> Unacked {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        match stream.consumer_info(group).await {
            Ok(info) => Unacked {
                per_consumer: None,
                total: info.num_ack_pending as u64,
            },
            Err(_) => Unacked::default(),
        }
    }

    async fn outstanding(&self, group: &str) -> u64 {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let info = stream.consumer_info(group).await.unwrap();
        info.num_ack_pending as u64 + info.num_pending
    }

    async fn dead(&self, group: &str) -> Vec<DeadCopy> {
        let Ok(dead) = self.js.get_stream(dead_stream(&self.stream)).await else {
            return Vec::new();
        };
        let subject = format!("{}.dead.{group}", self.stream);
        match dead.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => vec![DeadCopy {
                event_id: m.headers.get("x-event-id").unwrap().as_str().to_owned(),
                last_error: m.headers.get("x-last-error").unwrap().as_str().to_owned(),
            }],
            Err(_) => Vec::new(),
        }
    }

    fn start_controlled(&self, s: Start) -> (ConsumerTask, Arc<ConsumerState>) {
        nats_redis_suite::started!(NatsConsumer, s)
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
        let _ = self.js.delete_stream(dead_stream(&self.stream)).await;
    }
}

stream_consumer_suite!(
    NatsBroker::new(),
    kill_config = serde_json::json!({ "ack_wait": "1s" })
);

#[tokio::test]
async fn a_dead_subject_the_consumer_would_read_again_is_refused() {
    let b = NatsBroker::new().await;
    let config = b.config(
        "loop",
        serde_json::json!({ "dead_subject": format!("{}.dead", b.prefix) }),
    );
    let handler = nats_redis_suite::recording("a", &Default::default(), Duration::ZERO);
    let err = NatsConsumer::new(config, handler)
        .unwrap()
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("dead_subject"), "{err}");
    b.cleanup().await;
}

#[tokio::test]
async fn declare_creates_a_missing_stream() {
    let b = NatsBroker::new().await;
    let name = nats_redis_suite::group("PBTNEW");
    let mut config = b.config("fresh", serde_json::json!({}));
    config.queue = name.clone();
    config.subject = Some(format!("{}.>", name.to_lowercase()));
    let cancel = CancellationToken::new();
    let task = b.spawn(
        config,
        nats_redis_suite::recording("a", &Default::default(), Duration::ZERO),
        "a",
        cancel.clone(),
    );
    crate::common::wait_until(
        "declare to create the stream and its durable consumer",
        Duration::from_secs(10),
        async || match b.js.get_stream(&name).await {
            Ok(stream) => stream.consumer_info("fresh").await.is_ok(),
            Err(_) => false,
        },
    )
    .await;
    cancel.cancel();
    task.await.unwrap().unwrap();
    let consumer =
        b.js.get_stream(&name)
            .await
            .unwrap()
            .consumer_info("fresh")
            .await
            .unwrap();
    assert_eq!(
        consumer.config.max_deliver, -1,
        "unlimited: postbox counts attempts"
    );
    assert_eq!(
        consumer.config.ack_policy,
        jetstream::consumer::AckPolicy::Explicit
    );
    let _ = b.js.delete_stream(&name).await;
    let _ = b.js.delete_stream(dead_stream(&name)).await;
    b.cleanup().await;
}

/// Publishes `events`, then runs a consumer of `group` that fails every
/// attempt at the first one's id, dead after two attempts, until each event
/// was tried twice.
async fn fail_twice(
    b: &NatsBroker,
    group: &str,
    events: &[&Envelope],
) -> (nats_redis_suite::Calls, CancellationToken, ConsumerTask) {
    for e in events {
        b.publish(e).await;
    }
    let calls = nats_redis_suite::Calls::default();
    let config = b.config(
        group,
        serde_json::json!({ "max_attempts": 2, "retry_delay": "100ms", "max_retry_delay": "200ms" }),
    );
    let cancel = CancellationToken::new();
    let handler = nats_redis_suite::poisoned(&calls, events[0]);
    let task = b.spawn(config, handler, "a", cancel.clone());
    let attempts = 2 * events.len();
    nats_redis_suite::wait_until(
        Duration::from_secs(10),
        &format!("{attempts} failed attempts"),
        || calls.lock().unwrap().len() == attempts,
    )
    .await;
    (calls, cancel, task)
}

/// Issue 10.6: while the dead stream refuses writes (full, `discard = new`)
/// for much longer than the old `max_deliver` margin of five redeliveries,
/// the message is never dropped by the server: once the dead stream takes
/// writes again the dead copy is stored and the original terminated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_stream_refusing_writes_never_costs_the_message() {
    use nats_redis_suite::{first_dead, stop};
    let b = NatsBroker::new().await;
    // The dead home, made by the test: one message and no room for more.
    let dead_home =
        b.js.create_stream(stream::Config {
            name: dead_stream(&b.stream),
            subjects: vec![format!("{}.dead.>", b.stream)],
            max_messages: 1,
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    b.js.publish(format!("{}.dead.filler", b.stream), "filler".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let g = nats_redis_suite::group("deadfull");
    let poison = test_event(0);
    let (calls, cancel, task) = fail_twice(&b, &g, &[&poison]).await;
    // Well over 5 retry delays of refused dead copies.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(b.dead(&g).await.is_empty(), "the dead stream is full");
    let info =
        b.js.get_stream(&b.stream)
            .await
            .unwrap()
            .consumer_info(&g)
            .await
            .unwrap();
    assert!(
        info.num_ack_pending == 1,
        "the message is still the consumer's to settle: {info:?}"
    );
    dead_home.purge().await.unwrap();
    let dead = first_dead(
        &b,
        &g,
        Duration::from_secs(10),
        "the message was dropped: no dead copy once the dead stream took writes again",
    )
    .await;
    let report = stop(&cancel, task).await;
    assert_eq!(dead[0].event_id, poison.event_id);
    assert!(dead[0].last_error.contains("poison"), "{dead:?}");
    assert_eq!(calls.lock().unwrap().len(), 2, "handled max_attempts times");
    assert_eq!(report.dead, 1, "{report:?}");
    assert_eq!(b.outstanding(&g).await, 0);
    b.cleanup().await;
}

/// An event and its replay (same `event_id`) that both exhaust
/// `max_attempts` leave two dead copies: the second is not taken for a
/// re-send of the first by the dead stream's duplicate window (default two
/// minutes) while its original is terminated.
#[tokio::test]
async fn a_replayed_event_failing_again_gets_its_own_dead_copy() {
    use nats_redis_suite::stop;
    let b = NatsBroker::new().await;
    let g = nats_redis_suite::group("deadreplay");
    let poison = test_event(0);
    let mut replay = poison.clone();
    replay.headers.insert("x-replayed".into(), "1".into());
    let (_calls, cancel, task) = fail_twice(&b, &g, &[&poison, &replay]).await;
    let start = std::time::Instant::now();
    while b.outstanding(&g).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "both messages settled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = stop(&cancel, task).await;
    assert_eq!(report.dead, 2, "{report:?}");
    let dead = b.js.get_stream(dead_stream(&b.stream)).await.unwrap();
    let stored = dead.cached_info().state.messages;
    assert_eq!(
        stored,
        2,
        "every terminated original has its dead copy in {}",
        dead_stream(&b.stream)
    );
    for seq in [1, 2] {
        let m = dead.get_raw_message(seq).await.unwrap();
        assert_eq!(
            m.headers.get("x-event-id").unwrap().as_str(),
            poison.event_id
        );
    }
    b.cleanup().await;
}

/// A stop while a pull's messages wait behind the one in hand, with
/// `max_attempts = 1`: each is handled once, none is dead-lettered unhandled.
/// Given back (nak), a delivery still counts in JetStream's delivery count,
/// which is the attempt number: a message on its last attempt came back past
/// `max_attempts` and went to the dead subject without ever being handled.
/// One on its last attempt is now handled before the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_spends_no_messages_last_attempt() {
    let b = NatsBroker::new().await;
    let group = nats_redis_suite::group("last_attempt");
    let events = nats_redis_suite::publish_events(&b, 0..3).await;
    let calls = nats_redis_suite::Calls::default();
    let mut config = b.config(&group, serde_json::json!({ "prefetch": 3 }));
    config.max_attempts = 1;
    let cancel = CancellationToken::new();
    let task = b.spawn(
        config.clone(),
        nats_redis_suite::recording("a", &calls, Duration::from_millis(500)),
        "a",
        cancel.clone(),
    );
    nats_redis_suite::wait_until(Duration::from_secs(15), "the first in hand", || {
        !calls.lock().unwrap().is_empty()
    })
    .await;
    nats_redis_suite::stop(&cancel, task).await;
    let next_cancel = CancellationToken::new();
    let next = b.spawn(
        config,
        nats_redis_suite::recording("b", &calls, Duration::ZERO),
        "b",
        next_cancel.clone(),
    );
    nats_redis_suite::wait_until(Duration::from_secs(15), "all three settled", || {
        calls.lock().unwrap().len() >= 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    nats_redis_suite::stop(&next_cancel, next).await;
    let mut handled: Vec<String> = calls
        .lock()
        .unwrap()
        .iter()
        .map(|c| c.message.event_id().to_owned())
        .collect();
    handled.sort();
    let mut expected: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
    expected.sort();
    assert_eq!(handled, expected, "each handled once");
    assert!(b.dead(&group).await.is_empty(), "dead-lettered unhandled");
    b.cleanup().await;
}

/// Prefetch 5, each message taking 0.3 s (less than a third of
/// `ack_wait`, 1 s): the messages a pull brought wait behind the ones in
/// hand longer than `ack_wait`, and are kept (progress) meanwhile. Each is handled once, by the consumer
/// that pulled it; the last one used to be redelivered to a second
/// consumer of the group while it still waited, and handled twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefetched_messages_are_kept_while_they_wait() {
    let b = NatsBroker::new().await;
    let group = nats_redis_suite::group("prefetch");
    let events = nats_redis_suite::publish_events(&b, 0..5).await;
    let calls = nats_redis_suite::Calls::default();
    let config = b.config(
        &group,
        serde_json::json!({ "prefetch": 5, "ack_wait": "1s" }),
    );
    let cancel = CancellationToken::new();
    let task = b.spawn(
        config,
        nats_redis_suite::recording("a", &calls, Duration::from_millis(300)),
        "a",
        cancel.clone(),
    );
    nats_redis_suite::wait_until(Duration::from_secs(15), "the first in hand", || {
        !calls.lock().unwrap().is_empty()
    })
    .await;
    // A second consumer of the group, idle: it gets what the server redelivers.
    let other_cancel = CancellationToken::new();
    let other = b.spawn(
        b.config(&group, serde_json::json!({ "ack_wait": "1s" })),
        nats_redis_suite::recording("b", &calls, Duration::ZERO),
        "b",
        other_cancel.clone(),
    );
    nats_redis_suite::wait_until(Duration::from_secs(15), "five handled", || {
        calls.lock().unwrap().len() >= 5
    })
    .await;
    // Room for a redelivery to show.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    nats_redis_suite::stop(&other_cancel, other).await;
    let report = nats_redis_suite::stop(&cancel, task).await;
    let seen: Vec<(String, String, u32)> = calls
        .lock()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c.who.clone(),
                c.message.event_id().to_owned(),
                c.message.attempt,
            )
        })
        .collect();
    let expected: Vec<(String, String, u32)> = events
        .iter()
        .map(|e| ("a".to_owned(), e.event_id.clone(), 1))
        .collect();
    assert_eq!(seen, expected, "each once, on its first delivery");
    assert_eq!(report.ok, 5, "{report:?}");
    b.cleanup().await;
}

/// A server that requires a login: the user and password in the URL
/// (percent-encoded) log the consumer in. The NATS client reads no
/// credentials from a URL: the consumer was refused as unauthorized and
/// reconnected for good, consuming nothing.
#[tokio::test]
async fn credentials_in_the_url_log_in() {
    let server = postbox_testkit::clusters::NatsCluster::start_with_user(1, "app", "p@ss:w").await;
    let port = server.ports[0];
    let client = server.connect(&server.urls()[0]).await.unwrap();
    let b = NatsBroker::on(client, format!("nats://app:p%40ss%3Aw@127.0.0.1:{port}")).await;
    let calls = nats_redis_suite::Calls::default();
    let cancel = CancellationToken::new();
    let task = b.spawn(
        b.config("login", serde_json::json!({})),
        nats_redis_suite::recording("a", &calls, Duration::ZERO),
        "a",
        cancel.clone(),
    );
    b.publish(&test_event(0)).await;
    crate::common::wait_until("the event consumed", Duration::from_secs(20), async || {
        calls.lock().unwrap().len() == 1
    })
    .await;
    cancel.cancel();
    task.await.unwrap().unwrap();
}
