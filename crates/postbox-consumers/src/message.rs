//! What a handler receives: the SPEC §4 envelope and the facts of this
//! delivery.

use postbox_core::envelope::Envelope;

/// Header carrying the consumer's own attempt counter (1 on first delivery):
/// [`postbox_core::wire::CONSUME_ATTEMPT`].
pub const CONSUME_ATTEMPT_HEADER: &str = postbox_core::wire::CONSUME_ATTEMPT;

/// Header on a dead-lettered copy, the handler's last error:
/// [`postbox_core::wire::LAST_ERROR`].
pub const LAST_ERROR_HEADER: &str = postbox_core::wire::LAST_ERROR;

/// The event id a broker message carries (`id`), checked: a message
/// without one (`missing` says so) cannot be deduplicated, and one longer
/// than an event_id may be is not postbox's. `what` names where it was
/// read, for the error.
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis"))]
pub(crate) fn checked_event_id(
    id: Option<String>,
    what: &str,
    missing: &str,
) -> Result<String, String> {
    let id = id
        .filter(|s| !s.is_empty())
        .ok_or_else(|| missing.to_owned())?;
    use postbox_core::event::MAX_ID_LEN;
    if id.len() > MAX_ID_LEN {
        return Err(format!(
            "{what} is {} bytes, longer than an event_id may be ({MAX_ID_LEN})",
            id.len()
        ));
    }
    Ok(id)
}

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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Asserts that `e` is the event every broker's mapping test publishes,
    /// with its relay attempt header `x-attempt` as `attempt` (each broker
    /// carries header values its own way).
    pub(crate) fn assert_published(e: &Envelope, attempt: serde_json::Value) {
        assert_eq!(e.event_id, "ev-1");
        assert_eq!(e.event_type, "RoomCreated");
        assert_eq!(e.app_code, "room");
        assert_eq!(e.aggregate_id.as_deref(), Some("room-1"));
        assert_eq!(e.aggregate_version, Some(7));
        assert_eq!(e.created_at_ms, 1_700_000_000_123);
        assert_eq!(e.payload.get(), r#"{"a":1}"#);
        assert_eq!(e.headers["x-attempt"], attempt);
        assert_eq!(e.headers["tenant"], "acme");
    }
}
