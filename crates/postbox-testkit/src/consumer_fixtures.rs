//! Fixtures of the consumer tests (`postbox-consumers` and `postbox consume`):
//! a RabbitMQ connection, events published the way the relay publishes them,
//! scratch queues removed with their twins, `rabbitmqctl` listings, and a
//! poll that fails loudly when its condition never holds.

use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::servers::{amqp_url, how_to_start};

/// A connection and a confirming channel for the test's own publishing.
pub async fn broker() -> (Connection, Channel) {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("rabbitmq")));
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    (conn, ch)
}

/// One event as the relay maps it to AMQP (SPEC §4).
#[derive(Debug, Clone, Copy)]
pub struct AmqpEvent<'a> {
    /// `message_id`.
    pub event_id: &'a str,
    /// `type`.
    pub event_type: &'a str,
    /// `app_id`.
    pub app_code: &'a str,
    /// `x-created-at-ms`.
    pub created_at_ms: i64,
    /// `x-aggregate-id`, when set.
    pub aggregate_id: Option<&'a str>,
    /// `x-aggregate-version`, when set.
    pub aggregate_version: Option<i64>,
}

impl AmqpEvent<'_> {
    /// The message properties the relay sends: persistent, `x-attempt` 1.
    pub fn properties(&self) -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert("x-attempt".into(), AMQPValue::LongLongInt(1));
        h.insert(
            "x-created-at-ms".into(),
            AMQPValue::LongLongInt(self.created_at_ms),
        );
        if let Some(id) = self.aggregate_id {
            h.insert("x-aggregate-id".into(), AMQPValue::LongString(id.into()));
        }
        if let Some(v) = self.aggregate_version {
            h.insert("x-aggregate-version".into(), AMQPValue::LongLongInt(v));
        }
        BasicProperties::default()
            .with_message_id(self.event_id.into())
            .with_type(self.event_type.into())
            .with_app_id(self.app_code.into())
            .with_delivery_mode(2)
            .with_headers(h)
    }

    /// Publishes the event with `payload` to `queue` through the default
    /// exchange and waits for the confirm.
    pub async fn publish(&self, ch: &Channel, queue: &str, payload: &str) {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            payload.as_bytes(),
            self.properties(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
}

/// Messages ready in `queue` (a passive declare).
pub async fn ready(ch: &Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        lapin::options::QueueDeclareOptions {
            passive: true,
            ..lapin::options::QueueDeclareOptions::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

/// Deletes `queue` and its twins `<queue>.retry` and `<queue>.dead`.
pub async fn delete_queues(ch: &Channel, queue: &str) {
    for q in [
        queue.to_owned(),
        format!("{queue}.retry"),
        format!("{queue}.dead"),
    ] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

/// `rabbitmqctl -q --no-table-headers list_<what> <columns…>`: one line per
/// item, its columns separated by tabs.
pub async fn rabbitmqctl_list(what: &str, columns: &[&str]) -> String {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(["-q", "--no-table-headers", &format!("list_{what}")])
        .args(columns)
        .output()
        .await
        .expect("rabbitmqctl on PATH");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `probe` every 100 ms until it gives `Ok`, and returns that; after
/// `limit`, panics with `what` and the last `Err` (what was seen instead).
pub async fn eventually<T>(
    what: &str,
    limit: Duration,
    mut probe: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(seen) => assert!(
                start.elapsed() < limit,
                "timed out after {limit:?} waiting for {what}: {seen}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `check` every 50 ms until it holds, panicking with `what` after
/// `limit`.
pub async fn wait_until(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
