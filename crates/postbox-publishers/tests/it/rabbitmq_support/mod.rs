//! Shared by the RabbitMQ tests of this binary: scratch names, a consumer on a
//! scratch queue, and `rabbitmqctl`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use postbox_core::config::RabbitMqPublisherConfig;
use postbox_core::redact::SecretUrl;
use postbox_core::template::Template;
use postbox_publishers::rabbitmq::message::{json_value, POSTBOX_HEADERS};
use postbox_publishers::rabbitmq::RabbitMqPublisher;
use postbox_testkit::amqp::{bind_queue, declare_queue, declare_topic_exchange, Lifetime};
use postbox_testkit::publisher_suite::Received;
use postbox_testkit::servers::{amqp_url, how_to_start};

/// `{prefix}-{pid}-{random}`.
pub fn scratch(prefix: &str) -> String {
    format!(
        "postbox-test-{prefix}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

pub fn config(exchange: &str, routing_key: &str, declare: bool) -> RabbitMqPublisherConfig {
    RabbitMqPublisherConfig {
        name: Some(format!("t{:06x}", rand::random::<u32>() & 0xff_ffff)),
        routing_key: Template::parse(routing_key).unwrap(),
        declare,
        ..RabbitMqPublisherConfig::new(SecretUrl::new(amqp_url()), exchange)
    }
}

pub async fn connect() -> Connection {
    Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("rabbitmq")))
}

/// An auto-delete topic exchange: it goes away with the last binding, so a
/// failed test leaves nothing behind.
pub async fn declare_exchange(channel: &Channel, exchange: &str) {
    declare_topic_exchange(channel, exchange, Lifetime::Scratch).await;
}

/// A scratch exchange ([`declare_exchange`]) with a consumer bound to it by
/// a pattern: what a test publishes into and reads back from. The setup
/// connection and channel live as long as it does.
pub struct ScratchExchange {
    pub name: String,
    pub inbox: Inbox,
    pub connection: Connection,
    pub channel: Channel,
}

/// [`ScratchExchange`] named after `prefix`, its queue bound with `binding`.
pub async fn scratch_exchange(prefix: &str, binding: &str) -> ScratchExchange {
    let name = scratch(prefix);
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    declare_exchange(&channel, &name).await;
    let inbox = consume(&connection, &name, binding).await;
    ScratchExchange {
        name,
        inbox,
        connection,
        channel,
    }
}

/// A publisher to an existing `exchange`, routing by event type.
pub async fn publisher_to(exchange: &str) -> RabbitMqPublisher {
    RabbitMqPublisher::connect(&config(exchange, "{event_type}", false))
        .await
        .unwrap()
}

pub async fn delete_exchange(channel: &Channel, exchange: &str) {
    let _ = channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await;
}

/// What a consumer on an exclusive queue bound to `exchange` with
/// `binding` received (the queue dies with the consumer's connection).
#[derive(Clone, Default)]
pub struct Inbox(pub Arc<Mutex<Vec<Received>>>);

impl Inbox {
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    pub fn snapshot(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }

    /// (messages, distinct event ids).
    pub fn counts(&self) -> (usize, usize) {
        let all = self.0.lock().unwrap();
        let mut ids: Vec<&str> = all.iter().map(|r| r.event_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        (all.len(), ids.len())
    }

    /// Waits until `n` distinct event ids arrived (duplicates do not
    /// count), or `timeout` passed; returns [`counts`](Self::counts).
    pub async fn wait_for_distinct(&self, n: usize, timeout: Duration) -> (usize, usize) {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.counts().1 < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.counts()
    }

    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.len() < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.snapshot()
    }
}

pub async fn consume(connection: &Connection, exchange: &str, binding: &str) -> Inbox {
    let channel = connection.create_channel().await.unwrap();
    let queue = declare_queue(&channel, &scratch("q"), Lifetime::Scratch).await;
    bind_queue(&channel, queue.name().as_str(), exchange, binding).await;
    let mut consumer = channel
        .basic_consume(
            queue.name().as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let inbox = Inbox::default();
    let sink = inbox.clone();
    tokio::spawn(async move {
        let _channel = channel;
        while let Some(Ok(d)) = consumer.next().await {
            sink.0.lock().unwrap().push(received(&d));
        }
    });
    inbox
}

/// AMQP properties and headers as the suite's [`Received`].
pub fn received(d: &lapin::message::Delivery) -> Received {
    let p = &d.properties;
    let text = |s: &Option<lapin::types::ShortString>| {
        s.as_ref().map(|s| s.to_string()).unwrap_or_default()
    };
    let mut headers: BTreeMap<String, serde_json::Value> = p
        .headers()
        .as_ref()
        .map(|h| {
            h.into_iter()
                .map(|(k, v)| (k.to_string(), json_value(v)))
                .collect()
        })
        .unwrap_or_default();
    let mut take = |k: &str| headers.remove(k);
    let aggregate_id = take("x-aggregate-id").and_then(|v| v.as_str().map(str::to_owned));
    let aggregate_version = take("x-aggregate-version").and_then(|v| v.as_i64());
    let created_at_ms = take("x-created-at-ms")
        .and_then(|v| v.as_i64())
        .unwrap_or_default();
    let attempt = take("x-attempt").and_then(|v| v.as_i64()).unwrap_or(0) as i32;
    let replayed = take("x-replayed")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    for k in POSTBOX_HEADERS {
        assert!(!headers.contains_key(k));
    }
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    assert_eq!(
        p.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(
        p.timestamp().map(|t| t as i64),
        Some(created_at_ms / 1000),
        "timestamp in seconds"
    );
    Received {
        event_id: text(p.message_id()),
        event_type: text(p.kind()),
        app_code: text(p.app_id()),
        aggregate_id,
        aggregate_version,
        created_at_ms,
        headers,
        attempt,
        replayed,
        payload: String::from_utf8_lossy(&d.data).into_owned(),
        route: d.routing_key.to_string(),
    }
}

/// Runs `rabbitmqctl` with `args`, panicking with its output on failure.
pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "rabbitmqctl not runnable ({e}); {}",
                how_to_start("rabbitmq")
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Closes every connection whose client-provided name is `connection_name`
/// (found with `list_connections pid client_properties`; this broker's
/// `close_connection` takes the connection's pid); returns how many.
pub fn close_connections_named(connection_name: &str) -> usize {
    let list = rabbitmqctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    ]);
    let mut closed = 0;
    for line in list.lines() {
        if !line.contains(&format!("\"{connection_name}\"")) {
            continue;
        }
        let name = line.split('\t').next().unwrap().trim();
        rabbitmqctl(&["close_connection", name, "postbox fault test"]);
        closed += 1;
    }
    closed
}

/// The broker as the tests of this binary share it: one test process now
/// runs every RabbitMQ test at once. A test that disturbs every connection
/// (a memory alarm) holds it alone; every other RabbitMQ test holds it
/// shared for its whole run.
static BROKER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Held by a RabbitMQ test for its whole run: it waits while a test holds
/// the broker alone.
pub async fn broker_shared() -> tokio::sync::RwLockReadGuard<'static, ()> {
    BROKER.read().await
}

/// Held by a test that disturbs every connection: it runs once no other
/// RabbitMQ test does.
pub async fn broker_exclusive() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    BROKER.write().await
}
