//! A consumer's dead letters, handled (`postbox dead`, the admin API):
//! list them, show one, replay them into the consumer's main queue, or
//! purge them, on RabbitMQ (`<queue>.dead`), NATS (the dead subject) and
//! Redis (`<stream>.dead`, the consumer group's entries).
//!
//! One pass ([`run`]) reads the dead letters once, in the broker's order,
//! and applies a [`DeadAction`] to those a [`DeadFilter`] takes. A replay
//! sends each copy back, waits for the broker to confirm it, and only then
//! removes the dead copy: a pass cut short (a crash, a lost connection)
//! duplicates at most the letter in hand, never loses one. Consumers dedupe
//! by event id, so a duplicate is harmless.
//!
//! Where a replay goes: RabbitMQ publishes it to `<queue>` through the
//! default exchange, so only this consumer's queue gets it. NATS publishes
//! it on the event's original subject and Redis adds it to the stream:
//! every consumer group of that subject or stream sees it again (marked
//! `x-replayed`), and those that handled it already skip it by event id.

pub(crate) mod letter;

use letter::Pass;
pub use letter::{DeadAction, DeadFilter, DeadLetter, DeadReport, Progress, CLEARED_ON_REPLAY};

use postbox_core::config::{ConsumerConfig, ConsumerKind};

/// Why a pass over dead letters stopped.
#[derive(Debug, thiserror::Error)]
pub enum DeadError {
    /// The consumer cannot have dead letters handled in this build.
    #[error("{0}")]
    Unsupported(String),
    /// The broker refused or failed; what was done before stays done (the
    /// report of a pass cut short is not returned, its progress was shown).
    #[error("consumer `{consumer}`: dead letters in {dead_letters}: {reason}")]
    Broker {
        /// The consumer's name.
        consumer: String,
        /// Where its dead letters are.
        dead_letters: String,
        /// What failed.
        reason: String,
    },
}

/// The lock a pass over `config`'s dead letters holds: passes over one
/// consumer's letters run one at a time in a process. A RabbitMQ pass
/// holds the letters it reads until it ends, so a pass beside it (the
/// dashboard listing them while a replay runs) found fewer letters than
/// the queue held and replayed or purged nothing.
fn pass_lock(config: &ConsumerConfig) -> std::sync::Arc<tokio::sync::Mutex<()>> {
    type Locks = std::collections::HashMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>;
    static LOCKS: std::sync::OnceLock<std::sync::Mutex<Locks>> = std::sync::OnceLock::new();
    let key = format!("{:?} {}", config.kind, config.queue);
    let mut locks = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    locks.entry(key).or_default().clone()
}

/// One pass over `config`'s dead letters: `action` on those `filter`
/// takes (none changed when `dry_run`), `progress` called as it goes.
pub async fn run(
    config: &ConsumerConfig,
    action: DeadAction,
    filter: &DeadFilter,
    dry_run: bool,
    progress: Progress<'_>,
) -> Result<DeadReport, DeadError> {
    let pass = Pass {
        config,
        action,
        filter,
        dry_run,
        progress,
    };
    let lock = pass_lock(config);
    let _one_at_a_time = lock.lock().await;
    match config.kind {
        #[cfg(feature = "rabbitmq")]
        ConsumerKind::Rabbitmq => crate::rabbitmq::dead::run(&pass).await,
        #[cfg(feature = "nats")]
        ConsumerKind::Nats => crate::nats::dead::run(&pass).await,
        #[cfg(feature = "redis")]
        ConsumerKind::Redis => crate::redis::dead::run(&pass).await,
        #[allow(unreachable_patterns)]
        other => {
            return Err(DeadError::Unsupported(format!(
                "consumer `{}`: this build has no `{other:?}` consumer (a Cargo feature left out)",
                config.name()
            )))
        }
    }
    .map_err(|(dead_letters, reason)| DeadError::Broker {
        consumer: config.name().to_owned(),
        dead_letters,
        reason,
    })
}
