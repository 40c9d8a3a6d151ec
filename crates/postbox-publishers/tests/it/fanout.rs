//! Fanout across mixed publishers, the seed's shape: an IM webhook plus a
//! RabbitMQ exchange. While the webhook is down every row goes `retryable`;
//! the retries go only to the webhook, so RabbitMQ receives each event once
//! and the webhook, once back, receives every event.

use crate::rabbitmq_support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use postbox_core::config::{HumanDuration, RelaySettings, WebhookPublisherConfig, WorkerConfig};
use postbox_core::redact::SecretUrl;
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::store::{EventFilter, OutboxStore};
use postbox_core::{NewEvent, Publisher, Status};
use postbox_postgres::PgOutbox;
use postbox_publishers::rabbitmq::RabbitMqPublisher;
use postbox_publishers::webhook::WebhookPublisher;
use postbox_testkit::conformance::fast_worker;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::postgres_url;
use postbox_testkit::store_setup::migrated;
use rabbitmq_support::*;

const APP: &str = "im";
const N: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_outage_retries_only_the_webhook_and_rabbitmq_gets_each_event_once() {
    let _broker = broker_shared().await;
    let store = migrated("postgres", postgres_url(), |url| async move {
        PgOutbox::connect(&url, &scratch_table("fanout"), 4).await
    })
    .await;
    let store: Arc<dyn OutboxStore> = Arc::new(store);
    let events: Vec<NewEvent> = (0..N)
        .map(|i| {
            NewEvent::new(APP, "MessageSent", format!(r#"{{"n":{i}}}"#))
                .aggregate(format!("room-{}", i % 10), i as i64)
        })
        .collect();
    store.enqueue_batch(&events, 1 << 20).await.unwrap();

    // RabbitMQ: a scratch exchange with a queue bound to everything.
    let exchange = scratch("fanout");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    declare_exchange(&channel, &exchange).await;
    let rabbit_inbox = consume(&setup, &exchange, "#").await;
    let rabbit: Arc<dyn Publisher> = Arc::new(
        RabbitMqPublisher::connect(&config(&exchange, "{event_type}", false))
            .await
            .unwrap(),
    );

    // The webhook: a port nobody listens on yet.
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let webhook: Arc<dyn Publisher> = Arc::new(
        WebhookPublisher::new(&WebhookPublisherConfig {
            signature: Default::default(),
            name: Some("im-webhook".to_owned()),
            url: SecretUrl::new(format!("http://127.0.0.1:{port}/im/push")),
            secret: None,
            timeout: HumanDuration::secs(2),
        })
        .unwrap(),
    );

    let worker = WorkerConfig {
        batch_size: 100,
        max_retry_count: 1000,
        initial_backoff: HumanDuration::millis(100),
        max_backoff: HumanDuration::millis(400),
        ..fast_worker()
    };
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(
        Relay::new(
            store.clone(),
            vec![rabbit.clone(), webhook.clone()],
            RelaySettings::new(worker, vec![APP.to_owned()]).unwrap(),
        )
        .run(shutdown.clone()),
    );

    // While the webhook is down RabbitMQ takes every event and the rows wait
    // for the webhook alone.
    let started = Instant::now();
    rabbit_inbox.wait_for(N, Duration::from_secs(30)).await;
    assert_eq!(
        rabbit_inbox.counts(),
        (N, N),
        "RabbitMQ got every event once"
    );
    let waiting = store.stats(&[APP.to_owned()]).await.unwrap().remove(0);
    assert_eq!(
        waiting.delivered, 0,
        "no row is delivered without the webhook"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The webhook comes back.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let app = axum::Router::new().route(
        "/im/push",
        axum::routing::post({
            let seen = seen.clone();
            move |headers: HeaderMap| async move {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                seen.lock().unwrap().push(key);
                StatusCode::NO_CONTENT
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    loop {
        let s = store.stats(&[APP.to_owned()]).await.unwrap().remove(0);
        if s.delivered == N as i64 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not all delivered: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    server.abort();
    // Anything RabbitMQ got late would show here.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let rows = store
        .list(&EventFilter {
            app_code: Some(APP.into()),
            limit: N as u32,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(rows.len(), N);
    assert!(rows.iter().all(|r| r.status == Status::Delivered));
    // A webhook refusing connections is unreachable, not failing: its rows
    // waited for it with no attempt counted (each retry counted one, and
    // an outage longer than the retries dead-lettered them).
    let retried = rows.iter().filter(|r| r.retry_count > 0).count();
    assert_eq!(retried, 0, "the outage counted no attempt");
    let expected: BTreeSet<String> = rows.iter().map(|r| r.event_id.clone()).collect();
    let hooked = seen.lock().unwrap().clone();
    let hooked_set: BTreeSet<String> = hooked.iter().cloned().collect();
    assert_eq!(hooked_set, expected, "the webhook got every event");
    let (messages, distinct) = rabbit_inbox.counts();
    println!(
        "fanout: {N} events; RabbitMQ {messages} messages ({distinct} distinct); webhook {} requests ({} distinct); {retried} rows retried",
        hooked.len(),
        hooked_set.len()
    );
    assert_eq!(
        (messages, distinct),
        (N, N),
        "retries went only to the webhook: RabbitMQ received each event exactly once"
    );
    let got: BTreeSet<String> = rabbit_inbox
        .snapshot()
        .into_iter()
        .map(|m| m.event_id)
        .collect();
    assert_eq!(got, expected);
    rabbit.close().await;
    delete_exchange(&channel, &exchange).await;
}
