//! postbox publishers. Each target is a folder with the same files, so a
//! reader who knows one knows them all: `mod.rs` (the [`Publisher`]
//! implementation) and its tests.
//!
//! The file publisher is always built; each broker is a Cargo feature (all on
//! by default), so a build without it links no client for that broker:
//!
//! | feature    | publisher                      | client crate   |
//! |------------|--------------------------------|----------------|
//! | `rabbitmq` | [`rabbitmq::RabbitMqPublisher`] | `lapin`        |
//! | `nats`     | [`nats::NatsPublisher`]         | `async-nats`   |
//! | `redis`    | [`redis::RedisPublisher`]       | `redis`        |
//! | `webhook`  | [`webhook::WebhookPublisher`]   | `reqwest`      |
//!
//! [`Publisher`]: postbox_core::Publisher
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod file;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "webhook")]
pub mod webhook;

use std::sync::Arc;

use postbox_core::config::PublisherConfig;
use postbox_core::{Publisher, Result};

/// Builds the publisher a config entry describes. A kind whose feature
/// this build left out is a config error naming the feature.
pub async fn build(config: &PublisherConfig) -> Result<Arc<dyn Publisher>> {
    match config {
        PublisherConfig::File(c) => Ok(Arc::new(file::FilePublisher::open(c).await?)),
        #[cfg(feature = "rabbitmq")]
        PublisherConfig::Rabbitmq(c) => {
            Ok(Arc::new(rabbitmq::RabbitMqPublisher::connect(c).await?))
        }
        #[cfg(feature = "nats")]
        PublisherConfig::Nats(c) => Ok(Arc::new(nats::NatsPublisher::connect(c).await?)),
        #[cfg(feature = "redis")]
        PublisherConfig::Redis(c) => Ok(Arc::new(redis::RedisPublisher::connect(c).await?)),
        #[cfg(feature = "webhook")]
        PublisherConfig::Webhook(c) => Ok(Arc::new(webhook::WebhookPublisher::new(c)?)),
        // Reached only in a build without some broker feature.
        #[allow(unreachable_patterns)]
        other => Err(postbox_core::Error::config(
            "publishers.kind",
            format!(
                "this build of postbox has no `{kind}` publisher: enable the `{kind}` feature",
                kind = other.kind()
            ),
        )),
    }
}

/// Builds every configured publisher, in order.
pub async fn build_all(configs: &[PublisherConfig]) -> Result<Vec<Arc<dyn Publisher>>> {
    let mut out = Vec::with_capacity(configs.len());
    for (i, c) in configs.iter().enumerate() {
        out.push(build(c).await.map_err(|e| at_index(e, i))?);
    }
    Ok(out)
}

/// Publishers name their keys `publishers.<key>`; the config error a user
/// sees names the entry, `publishers.<i>.<key>`, as validation does.
fn at_index(e: postbox_core::Error, i: usize) -> postbox_core::Error {
    match e {
        postbox_core::Error::Config { key, reason } => postbox_core::Error::Config {
            key: match key.strip_prefix("publishers.") {
                Some(rest) => format!("publishers.{i}.{rest}"),
                None => key,
            },
            reason,
        },
        other => other,
    }
}
