//! The receiving side of postbox (SPEC §7): consumers that process each event
//! exactly once in effect.
//!
//! - [`Handler`] is what a consumer calls for every message: an [`Message`]
//!   (the SPEC §4 envelope plus delivery facts) in, [`Handled`] or a
//!   [`HandlerError`] out. An error takes the retry path; it never loops.
//! - [`inbox`] makes a handler idempotent: the handler's own writes and the
//!   inbox row `(consumer_group, event_id)` commit in one transaction
//!   ([`inbox::TxHandler`]), and per `aggregate_id` an older
//!   `aggregate_version` than the last one seen is skipped as stale.
//! - [`rabbitmq::RabbitMqConsumer`] runs a handler on a queue: bounded by
//!   `prefetch`, manual ack after success, retries through `<queue>.retry`,
//!   dead letters in `<queue>.dead`.
//! - [`nats::NatsConsumer`] runs a handler on a JetStream durable pull
//!   consumer: `prefetch` messages per pull, nak with a growing delay, a
//!   dead subject confirmed by PubAck before the original is terminated.
//! - [`redis::RedisConsumer`] runs a handler in a Redis Streams consumer
//!   group: `XACK` after success, due retries claimed from the pending list,
//!   `<stream>.dead` after `max_attempts` deliveries.
//! - [`http::HttpHandler`] is the bridge for services in other languages: it
//!   POSTs the envelope and treats 2xx as success.
//!
//! The three broker consumers share one ack / retry / dead path
//! ([`consume`]): the decision and its bookkeeping are written once, each
//! broker folder (`mod.rs`, `topology.rs`, `message.rs`, `consumer.rs`)
//! holds only its transport. Every outcome is counted as
//! `postbox_consume_total{consumer,result}` and in the [`ConsumeReport`].
//! The names on the wire are [`postbox_core::wire`]'s, which the
//! publishers write with.
//!
//! Each broker is a Cargo feature (`rabbitmq`, `nats`, `redis`), and so are
//! the HTTP bridge (`http`) and each inbox database (`postgres`, `mysql`,
//! `sqlite`: [`inbox::Inbox`] and [`ordering::Holds`] on it, and sqlx's
//! driver); all are on by default. The handler, retry and inbox types are
//! always built; [`inbox::database_of`] refuses a URL whose database is not
//! in the build.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

// Each broker uses part of the shared path; a build without some brokers
// leaves the rest unused.
#[cfg_attr(
    not(all(feature = "rabbitmq", feature = "nats", feature = "redis")),
    allow(dead_code)
)]
pub mod consume;
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis"))]
pub mod dead;
pub mod handler;
#[cfg(feature = "http")]
pub mod http;
// A build without any inbox database has the inbox's and the holds'
// machinery but no database to run it on.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code, unused_imports, unused_macros)
)]
pub mod inbox;
pub mod message;
pub mod metrics;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code, unused_imports, unused_macros)
)]
pub mod ordering;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
pub mod retry;

pub use consume::{consumer_tag, ConsumeReport};
pub use handler::{Handled, Handler, HandlerError};
pub use message::Message;
pub use retry::{RetryDecision, RetryPolicy};
