//! The handler abstraction every consumer (RabbitMQ, NATS, Redis) drives.

use std::fmt;

use async_trait::async_trait;

use crate::Message;

/// What became of a message a handler accepted. Every variant acknowledges
/// the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// The handler did its work.
    Ok,
    /// The inbox had already recorded this `event_id`: no second effect.
    Duplicate,
    /// The inbox remembers a newer `aggregate_version` of this aggregate.
    Stale,
}

impl Handled {
    /// The `result` label of `postbox_consume_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Handled::Ok => "ok",
            Handled::Duplicate => "duplicate",
            Handled::Stale => "stale",
        }
    }
}

/// A handler failure: the message is retried after a delay, then
/// dead-lettered; or, [`permanent`](HandlerError::permanent), dead-lettered
/// at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    message: String,
    permanent: bool,
}

impl HandlerError {
    /// A failure described by `message` (it is logged and, on the last
    /// attempt, stored in the dead letter's `x-last-error` header: keep
    /// secrets out of it). The message is retried.
    pub fn new(message: impl fmt::Display) -> Self {
        HandlerError {
            message: message.to_string(),
            permanent: false,
        }
    }

    /// A failure that no retry can mend (the message is malformed, refers
    /// to something that will never exist, breaks a business rule): the
    /// message is dead-lettered at once, `message` in its `x-last-error`
    /// header, with no retry spent on it.
    pub fn permanent(message: impl fmt::Display) -> Self {
        HandlerError {
            message: message.to_string(),
            permanent: true,
        }
    }

    /// The description.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the message is dead-lettered without a retry.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for HandlerError {}

/// Processes one message. The consumer acknowledges it when this returns
/// `Ok`, and sends it down the retry path on `Err`.
///
/// Consumers call a handler for one message at a time per consuming task, so a
/// handler needs no locking of its own for ordering; it must be `Send + Sync`
/// because several consumers may share it.
#[async_trait]
pub trait Handler: Send + Sync {
    /// Handles `message`.
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError>;

    /// Whether `message`'s effect is already recorded. Asked before a
    /// message that comes back without a result (its consumer stopped
    /// mid-message, or the ack of a handled message was lost) is retried or
    /// dead-lettered unhandled: a message the handler has recorded is
    /// acknowledged as a [`Handled::Duplicate`] instead. An inbox knows
    /// ([`crate::inbox::InboxHandler`]); the default cannot tell (`false`).
    async fn handled_before(&self, _message: &Message) -> Result<bool, HandlerError> {
        Ok(false)
    }
}

#[async_trait]
impl<H: Handler + ?Sized> Handler for std::sync::Arc<H> {
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError> {
        (**self).handle(message).await
    }

    async fn handled_before(&self, message: &Message) -> Result<bool, HandlerError> {
        (**self).handled_before(message).await
    }
}
