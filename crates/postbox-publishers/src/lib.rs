//! postbox publishers. Each target is a folder with the same files, so a
//! reader who knows one knows them all: `mod.rs` (the [`Publisher`]
//! implementation) and its tests.
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
