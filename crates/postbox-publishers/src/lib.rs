//! postbox publishers: one folder per target (`file`, `rabbitmq`, `nats`,
//! `redis`, `webhook`), each with a `mod.rs` that implements [`Publisher`]
//! and documents the target's SPEC §4 mapping. A target with more parts
//! splits them into files of their own (RabbitMQ: `message.rs` for the
//! mapping, `connection.rs` and `session.rs` for the reconnecting
//! connection). The names on the wire (headers, `Nats-Msg-Id`, stream
//! fields) and each broker's naming rules come from
//! [`postbox_core::wire`], which the consumers read with, so the two sides
//! cannot drift. Unit tests sit beside the code; the integration tests
//! against real servers are `tests/<target>_*.rs`, most of them running the
//! shared publisher suite of `postbox-testkit`.
//!
//! [`Publisher`]: postbox_core::Publisher
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod file;
pub mod nats;
pub mod rabbitmq;
pub mod redis;
pub mod webhook;

use std::sync::Arc;

use postbox_core::config::{PublisherConfig, Settings};
use postbox_core::{Publisher, Result};

/// Builds the publisher a config entry describes; config errors name keys
/// relative to the entry (`url`), see [`postbox_core::Error::within`].
pub async fn build(config: &PublisherConfig) -> Result<Arc<dyn Publisher>> {
    match config {
        PublisherConfig::File(c) => Ok(Arc::new(file::FilePublisher::open(c).await?)),
        PublisherConfig::Rabbitmq(c) => {
            Ok(Arc::new(rabbitmq::RabbitMqPublisher::connect(c).await?))
        }
        PublisherConfig::Nats(c) => Ok(Arc::new(nats::NatsPublisher::connect(c).await?)),
        PublisherConfig::Redis(c) => Ok(Arc::new(redis::RedisPublisher::connect(c).await?)),
        PublisherConfig::Webhook(c) => Ok(Arc::new(webhook::WebhookPublisher::new(c)?)),
    }
}

/// Builds every configured publisher, in order. A config error names the
/// entry's key (`publishers.2.url`): publishers name their keys relative
/// to their entry.
pub async fn build_all(settings: &Settings) -> Result<Vec<Arc<dyn Publisher>>> {
    let mut out = Vec::with_capacity(settings.publishers.len());
    for (at, c) in settings.publishers() {
        out.push(build(c).await.map_err(|e| e.within(&at))?);
    }
    Ok(out)
}
