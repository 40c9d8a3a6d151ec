//! The interface every publisher implements (file here; RabbitMQ, NATS,
//! Redis Streams and webhooks in `postbox-publishers`).

use std::time::Duration;

use async_trait::async_trait;

use crate::EventRecord;

/// One event handed to a publisher.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    /// The row.
    pub record: &'a EventRecord,
    /// This attempt's number, 1 for the first (`x-attempt`).
    pub attempt: i32,
    /// True when an operator replayed the row (`x-replayed`).
    pub replayed: bool,
}

impl<'a> Delivery<'a> {
    /// The delivery of a claimed row.
    pub fn of(record: &'a EventRecord) -> Self {
        Delivery {
            record,
            attempt: record.retry_count + 1,
            replayed: record.replay_count > 0,
        }
    }
}

/// Why one publish did not succeed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The publish did not complete within `publish_timeout`.
    #[error("publish timed out after {0:?}")]
    Timeout(Duration),
    /// The target refused or failed; `retry_after` is the earliest retry the
    /// target asked for (HTTP `Retry-After`).
    #[error("{message}")]
    Failed {
        /// What went wrong, without secrets.
        message: String,
        /// Earliest retry the target asked for.
        retry_after: Option<Duration>,
    },
}

impl PublishError {
    /// A plain failure.
    pub fn failed(message: impl Into<String>) -> Self {
        PublishError::Failed {
            message: message.into(),
            retry_after: None,
        }
    }

    /// The delay the target asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            PublishError::Failed { retry_after, .. } => *retry_after,
            PublishError::Timeout(_) => None,
        }
    }
}

/// A target that takes responsibility for events.
///
/// `publish` returns only when the target has confirmed (or refused) every
/// event of the batch: a broker's confirm, a webhook's 2xx, a flushed file.
/// It returns one result per input, in order. The relay bounds each call by
/// `publish_timeout`.
#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// The configured name; recorded in per-row fanout progress.
    fn name(&self) -> &str;

    /// Publishes a batch and waits for confirmation of each event.
    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>>;

    /// Flushes and closes; called once at shutdown.
    async fn close(&self) {}
}
