//! Scratch RabbitMQ topology for tests and benchmarks: topic exchanges and
//! queues, declared to last as long as a test needs them, and bound.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind, Queue};

/// How long a declared exchange or queue lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// Until deleted, across broker restarts.
    Durable,
    /// An exchange until its last binding goes (auto-delete), a queue until
    /// its connection does (exclusive): a failed test leaves nothing behind.
    Scratch,
}

/// Declares the topic exchange `name`, living for `lifetime`.
pub async fn declare_topic_exchange(channel: &Channel, name: &str, lifetime: Lifetime) {
    let options = ExchangeDeclareOptions {
        durable: lifetime == Lifetime::Durable,
        auto_delete: lifetime == Lifetime::Scratch,
        ..Default::default()
    };
    channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            options,
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("declare exchange {name}: {e}"));
}

/// Declares the queue `name`, living for `lifetime`; returns it.
pub async fn declare_queue(channel: &Channel, name: &str, lifetime: Lifetime) -> Queue {
    let options = QueueDeclareOptions {
        durable: lifetime == Lifetime::Durable,
        exclusive: lifetime == Lifetime::Scratch,
        ..Default::default()
    };
    channel
        .queue_declare(name.into(), options, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("declare queue {name}: {e}"))
}

/// Binds the queue `queue` to the exchange `exchange` with `pattern`.
pub async fn bind_queue(channel: &Channel, queue: &str, exchange: &str, pattern: &str) {
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            pattern.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("bind queue {queue} to {exchange}: {e}"));
}

/// The test broker's URL ([`crate::servers::amqp_url`]) as reached through
/// a proxy listening at `proxy`, and the broker's own `host:port`, which
/// the proxy connects to.
pub fn through_proxy(proxy: std::net::SocketAddr) -> (String, String) {
    let broker = crate::servers::amqp_url();
    let (scheme_auth, rest) = broker.split_once('@').expect("amqp url with user");
    let (server, vhost) = rest.split_once('/').expect("amqp url with vhost");
    (format!("{scheme_auth}@{proxy}/{vhost}"), server.to_owned())
}
