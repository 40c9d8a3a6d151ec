//! The publisher conformance suite on RabbitMQ, read back by a lapin
//! consumer, and the RabbitMQ publisher's start-up checks.

mod rabbitmq_support;

use std::time::Duration;

use async_trait::async_trait;
use postbox_core::publish::Delivery;
use postbox_core::redact::SecretUrl;
use postbox_core::{Error, Publisher};
use postbox_publishers::rabbitmq::RabbitMqPublisher;
use postbox_testkit::publisher_suite::{check_publisher, sample_events, ReadBack, Received};
use rabbitmq_support::*;

struct QueueReader(Inbox);

#[async_trait]
impl ReadBack for QueueReader {
    async fn read(&mut self, expected: usize, timeout: Duration) -> Vec<Received> {
        let got = self.0.wait_for(expected, timeout).await;
        // Anything extra would arrive right behind.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = got;
        self.0.snapshot()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_publisher_passes_the_publisher_suite() {
    let exchange = scratch("suite");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    // declare = true: the publisher creates the durable exchange itself.
    let config = config(&exchange, "{app_code}.{event_type}", true);
    let publisher = RabbitMqPublisher::connect(&config).await.expect("start");
    let inbox = consume(&setup, &exchange, "#").await;
    let events = sample_events("room", 150);
    let mut reader = QueueReader(inbox);
    check_publisher(&publisher, &events, 40, &mut reader, |e| {
        format!("{}.{}", e.app_code, e.event_type)
    })
    .await;
    publisher.close().await;
    delete_exchange(&channel, &exchange).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_events_fail_and_the_rest_of_the_batch_is_delivered() {
    let exchange = scratch("unroutable");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    declare_exchange(&channel, &exchange).await;
    let inbox = consume(&setup, &exchange, "RoomCreated").await;
    let publisher = RabbitMqPublisher::connect(&config(&exchange, "{event_type}", false))
        .await
        .unwrap();
    let events = sample_events("room", 30); // RoomCreated, UserJoined, GiftSent, …
    let batch: Vec<Delivery<'_>> = events.iter().map(Delivery::of).collect();
    let results = publisher.publish(&batch).await;
    assert_eq!(results.len(), 30);
    for (e, r) in events.iter().zip(&results) {
        if e.event_type == "RoomCreated" {
            assert!(r.is_ok(), "{}: {r:?}", e.event_id);
        } else {
            let err = r.as_ref().unwrap_err().to_string();
            assert!(
                err.starts_with(&format!(
                    "unroutable: exchange {exchange}, routing key {}",
                    e.event_type
                )),
                "{err}"
            );
        }
    }
    let got = inbox.wait_for(10, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 10);
    assert!(got.iter().all(|r| r.event_type == "RoomCreated"));
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_publish_leaves_the_publisher_usable() {
    let exchange = scratch("cancel");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    declare_exchange(&channel, &exchange).await;
    let inbox = consume(&setup, &exchange, "#").await;
    let publisher = RabbitMqPublisher::connect(&config(&exchange, "{event_type}", false))
        .await
        .unwrap();
    let events = sample_events("room", 400);
    for chunk in events[..200].chunks(50) {
        let batch: Vec<Delivery<'_>> = chunk.iter().map(Delivery::of).collect();
        // Dropped part-way, as the relay's publish_timeout would.
        let _ = tokio::time::timeout(Duration::from_micros(200), publisher.publish(&batch)).await;
    }
    for chunk in events[200..].chunks(50) {
        let batch: Vec<Delivery<'_>> = chunk.iter().map(Delivery::of).collect();
        let results = publisher.publish(&batch).await;
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    }
    // Abandoned messages may arrive too: wait for the confirmed ones.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut got = inbox.snapshot();
    while tokio::time::Instant::now() < deadline
        && !events[200..]
            .iter()
            .all(|e| got.iter().any(|r| r.event_id == e.event_id))
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        got = inbox.snapshot();
    }
    for e in &events[200..] {
        assert!(
            got.iter().any(|r| r.event_id == e.event_id),
            "{} never arrived",
            e.event_id
        );
    }
    publisher.close().await;
}

#[tokio::test]
async fn a_missing_exchange_without_declare_is_a_config_error_naming_the_fix() {
    let exchange = scratch("missing");
    let mut config = config(&exchange, "{event_type}", false);
    config.name = Some("orders".into());
    let err = RabbitMqPublisher::connect(&config)
        .await
        .err()
        .expect("start must fail");
    let text = err.to_string();
    assert!(matches!(err, Error::Config { .. }), "{text}");
    assert!(text.contains("publisher `orders`"), "{text}");
    assert!(text.contains(&format!("exchange `{exchange}`")), "{text}");
    assert!(text.contains("declare = true"), "{text}");
    assert!(!text.contains(":guest@"), "password leaked: {text}");
}

#[tokio::test]
async fn start_errors_never_show_the_password() {
    let exchange = scratch("secret");
    let wrong_password = "hunter2-Very-Secret";
    for url in [
        // The broker refuses the login.
        format!("amqp://guest:{wrong_password}@127.0.0.1:5672/%2f"),
        // Nothing listens there.
        format!("amqp://guest:{wrong_password}@127.0.0.1:1/%2f"),
    ] {
        let mut config = config(&exchange, "{event_type}", true);
        config.url = SecretUrl::new(url);
        let err = RabbitMqPublisher::connect(&config)
            .await
            .err()
            .expect("start must fail");
        let text = format!("{err} / {err:?}");
        assert!(!text.contains(wrong_password), "password leaked: {text}");
        assert!(text.contains("127.0.0.1"), "says where: {text}");
    }
}

/// `declare = true` declares a missing exchange (durable topic) without
/// probing for it first, and still starts on an existing exchange of another
/// kind, as before.
#[tokio::test]
async fn declare_creates_a_missing_exchange_and_accepts_an_existing_one_of_another_kind() {
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    let missing = scratch("declared");
    let publisher = RabbitMqPublisher::connect(&config(&missing, "{event_type}", true))
        .await
        .expect("declares the missing exchange");
    publisher.close().await;
    let check = connection.create_channel().await.unwrap();
    check
        .exchange_declare(
            missing.as_str().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .expect("the exchange exists now");
    delete_exchange(&channel, &missing).await;

    // An auto-delete topic exchange: not what postbox declares.
    let existing = scratch("existing");
    declare_exchange(&channel, &existing).await;
    let inbox = consume(&connection, &existing, "#").await;
    let publisher = RabbitMqPublisher::connect(&config(&existing, "{event_type}", true))
        .await
        .expect("an existing exchange of another kind is used as it is");
    let events = sample_events("room", 1);
    let results = publisher.publish(&[Delivery::of(&events[0])]).await;
    assert!(results[0].is_ok(), "{results:?}");
    assert_eq!(inbox.wait_for(1, Duration::from_secs(5)).await.len(), 1);
    publisher.close().await;
    delete_exchange(&channel, &existing).await;
}
