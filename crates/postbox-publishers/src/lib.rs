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

pub mod failover;
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

use postbox_core::config::{PublisherConfig, Settings};
use postbox_core::{BoxFuture, Publisher, Result};

/// Builds the publisher a config entry describes; config errors name keys
/// relative to the entry (`url`), see [`postbox_core::Error::within`]. A
/// kind whose feature this build left out is a config error naming the
/// feature.
pub fn build(config: &PublisherConfig) -> BoxFuture<'_, Result<Arc<dyn Publisher>>> {
    Box::pin(build_here(config))
}

/// A publisher entry `c` with failover targets: its publishers, connected
/// with `connect`, behind one [`failover::FailoverPublisher`].
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
macro_rules! failover_of {
    ($config:expr, $c:expr, $connect:path) => {{
        let configs = (0..$c.failover.len()).map(|i| $c.for_failover(i));
        let targets = std::iter::once($c.clone()).chain(configs).collect();
        let times = (
            $c.failover.as_slice(),
            $c.failover_after.get(),
            $c.failback_after.get(),
        );
        with_failover($config.name(), times, targets, |mut one, name| async move {
            one.name = Some(name);
            Ok(Arc::new($connect(&one).await?) as Arc<dyn Publisher>)
        })
        .await
    }};
}

async fn build_here(config: &PublisherConfig) -> Result<Arc<dyn Publisher>> {
    match config {
        PublisherConfig::File(c) => Ok(Arc::new(file::FilePublisher::open(c).await?)),
        #[cfg(feature = "rabbitmq")]
        PublisherConfig::Rabbitmq(c) if c.failover.is_empty() => {
            Ok(Arc::new(rabbitmq::RabbitMqPublisher::connect(c).await?))
        }
        #[cfg(feature = "rabbitmq")]
        PublisherConfig::Rabbitmq(c) => {
            failover_of!(config, c, rabbitmq::RabbitMqPublisher::connect)
        }
        #[cfg(feature = "nats")]
        PublisherConfig::Nats(c) if c.failover.is_empty() => {
            Ok(Arc::new(nats::NatsPublisher::connect(c).await?))
        }
        #[cfg(feature = "nats")]
        PublisherConfig::Nats(c) => failover_of!(config, c, nats::NatsPublisher::connect),
        #[cfg(feature = "redis")]
        PublisherConfig::Redis(c) => Ok(Arc::new(redis::RedisPublisher::connect(c).await?)),
        #[cfg(feature = "webhook")]
        PublisherConfig::Webhook(c) => Ok(Arc::new(webhook::WebhookPublisher::new(c)?)),
        // Reached only in a build without some broker feature.
        #[allow(unreachable_patterns)]
        other => Err(postbox_core::Error::config(
            "kind",
            format!(
                "this build of postbox has no `{kind}` publisher: enable the `{kind}` feature",
                kind = other.kind()
            ),
        )),
    }
}

/// A [`failover::FailoverPublisher`] named `name` over `configs` (the
/// primary's, then each failover target's), each connected by `connect`
/// under the name `<name>.<target>`. A target unreachable at start keeps
/// connecting in the background ([`failover::Connecting`]) as long as
/// another one is reachable; when none is, the primary's error (a target's
/// names its `failover.<i>` key).
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
async fn with_failover<C, F, Fut>(
    name: &str,
    (failover, failover_after, failback_after): (
        &[postbox_core::config::FailoverTarget],
        std::time::Duration,
        std::time::Duration,
    ),
    configs: Vec<C>,
    connect: F,
) -> Result<Arc<dyn Publisher>>
where
    C: Clone + Send + Sync + 'static,
    F: Fn(C, String) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Arc<dyn Publisher>>> + Send + 'static,
{
    let mut targets = Vec::with_capacity(configs.len());
    let mut first_error = None;
    for (i, one) in configs.into_iter().enumerate() {
        let target = postbox_core::config::target_name(failover, i);
        let full = format!("{name}.{target}");
        let publisher = match connect(one.clone(), full.clone()).await {
            Ok(p) => p,
            Err(e) => {
                let e = match i {
                    0 => e,
                    _ => e.within(&postbox_core::config::KeyPath::root("failover").index(i - 1)),
                };
                let again = connect.clone();
                let later = failover::Connecting::start(full.clone(), &e, move || {
                    again(one.clone(), full.clone())
                });
                first_error.get_or_insert(e);
                Arc::new(later)
            }
        };
        targets.push(failover::Target {
            name: target,
            publisher,
        });
    }
    if let Some(e) = first_error.filter(|_| {
        targets
            .iter()
            .all(|t| t.publisher.connected() == Some(false))
    }) {
        return Err(e);
    }
    Ok(Arc::new(failover::FailoverPublisher::new(
        name.to_owned(),
        targets,
        failover_after,
        failback_after,
    )))
}

/// Builds every configured publisher, in order. A config error names the
/// entry's key (`publishers.2.url`): publishers name their keys relative
/// to their entry.
pub fn build_all(settings: &Settings) -> BoxFuture<'_, Result<Vec<Arc<dyn Publisher>>>> {
    Box::pin(build_all_here(settings))
}

async fn build_all_here(settings: &Settings) -> Result<Vec<Arc<dyn Publisher>>> {
    let mut out = Vec::with_capacity(settings.publishers.len());
    for (at, c) in settings.publishers() {
        out.push(build(c).await.map_err(|e| e.within(&at))?);
    }
    Ok(out)
}
