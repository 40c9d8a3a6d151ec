//! What a handler receives: the SPEC §4 envelope and the facts of this
//! delivery.

use postbox_core::envelope::Envelope;

/// Header carrying the consumer's own attempt counter (1 on first delivery):
/// [`postbox_core::wire::CONSUME_ATTEMPT`].
pub const CONSUME_ATTEMPT_HEADER: &str = postbox_core::wire::CONSUME_ATTEMPT;

/// Header on a dead-lettered copy, the handler's last error:
/// [`postbox_core::wire::LAST_ERROR`].
pub const LAST_ERROR_HEADER: &str = postbox_core::wire::LAST_ERROR;

/// One event delivered to a consumer.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The event, as the webhook publisher and the HTTP bridge send it. Its
    /// `headers` carry the transport headers too (`x-attempt`,
    /// `x-replayed`, [`CONSUME_ATTEMPT_HEADER`]).
    pub envelope: Envelope,
    /// This consumer's attempt at the event: 1 on the first delivery, +1 per
    /// retry.
    pub attempt: u32,
    /// The broker says it delivered this message before (for instance to a
    /// consumer that died before acknowledging it). The RabbitMQ consumer
    /// counts such a delivery as a failed attempt and retries it as a fresh
    /// copy, so its handlers see `false`; NATS and Redis set it when
    /// `attempt > 1`.
    pub redelivered: bool,
}

impl Message {
    /// The event's id, the dedupe key.
    pub fn event_id(&self) -> &str {
        &self.envelope.event_id
    }
}
