//! postbox publishers. Each target is a folder with the same files, so a
//! reader who knows one knows them all: `mod.rs` (the [`Publisher`]
//! implementation) and its tests.
//!
//! [`Publisher`]: postbox_core::Publisher
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod file;
pub mod rabbitmq;

use std::sync::Arc;

use postbox_core::config::PublisherConfig;
use postbox_core::{Publisher, Result};

/// Builds the publisher a config entry describes.
pub async fn build(config: &PublisherConfig) -> Result<Arc<dyn Publisher>> {
    match config {
        PublisherConfig::File(c) => Ok(Arc::new(file::FilePublisher::open(c).await?)),
        PublisherConfig::Rabbitmq(c) => {
            Ok(Arc::new(rabbitmq::RabbitMqPublisher::connect(c).await?))
        }
        other => Err(postbox_core::Error::config(
            "publishers",
            format!("kind `{}` is not built yet", other.kind()),
        )),
    }
}

/// Builds every configured publisher, in order.
pub async fn build_all(configs: &[PublisherConfig]) -> Result<Vec<Arc<dyn Publisher>>> {
    let mut out = Vec::with_capacity(configs.len());
    for c in configs {
        out.push(build(c).await?);
    }
    Ok(out)
}
