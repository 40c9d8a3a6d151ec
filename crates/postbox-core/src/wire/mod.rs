//! The wire contract of SPEC §4: the names a message carries from a
//! publisher (the writer) to a consumer (the reader), written once so that
//! the two sides cannot drift apart.
//!
//! - This module: the headers every target shares (`x-attempt`,
//!   `x-replayed`, the envelope fields as `x-…` headers, the consumer's
//!   own `x-consume-attempt` and `x-last-error`) and the content type. The
//!   JSON envelope itself is [`Envelope`].
//! - One module per broker with its naming and topology rules, used by its
//!   publisher and its consumer alike: [`rabbitmq`] (`<queue>.retry`,
//!   `<queue>.dead`), [`nats`] (`Nats-Msg-Id`, stream names, subjects, the
//!   dead subject), [`redis`] (the entry's fields, `<stream>.dead`) and
//!   [`http`] (the webhook's and the consumer bridge's request headers).
//!
//! Only names and pure rules live here: no broker client, so every crate
//! can depend on it whatever brokers it is built for.

pub mod http;
pub mod nats;
pub mod rabbitmq;
pub mod redis;

pub use crate::envelope::Envelope;

/// The relay's delivery attempt of an event, 1 for the first (SPEC §3).
pub const ATTEMPT: &str = "x-attempt";
/// `true` on an event an operator replayed (absent otherwise).
pub const REPLAYED: &str = "x-replayed";
/// The event id, where the broker has no property of its own for it.
pub const EVENT_ID: &str = "x-event-id";
/// The event type, where the broker has no property of its own for it.
pub const EVENT_TYPE: &str = "x-event-type";
/// The app code, where the broker has no property of its own for it.
pub const APP_CODE: &str = "x-app-code";
/// The envelope's `aggregate_id` (absent when the event has none).
pub const AGGREGATE_ID: &str = "x-aggregate-id";
/// The envelope's `aggregate_version` (absent when the event has none).
pub const AGGREGATE_VERSION: &str = "x-aggregate-version";
/// The envelope's `created_at_ms`.
pub const CREATED_AT_MS: &str = "x-created-at-ms";

/// The consumer's own attempt counter (1 on first delivery), on retry and
/// dead copies. The relay's [`ATTEMPT`] counts publish attempts from the
/// outbox and is left untouched; this one counts handler attempts on the
/// consuming side.
pub const CONSUME_ATTEMPT: &str = "x-consume-attempt";
/// On a dead-lettered copy: the handler's last error.
pub const LAST_ERROR: &str = "x-last-error";
/// On a dead-lettered copy: when the consumer gave up on it, epoch ms.
pub const DEAD_AT_MS: &str = "x-dead-at-ms";
/// The longest [`LAST_ERROR`] a copy carries, in characters: the start says
/// what failed, and long errors would bloat every copy.
pub const LAST_ERROR_MAX_CHARS: usize = 1000;

/// The content type of every body postbox sends (the payload is JSON by
/// convention, the envelope always).
pub const CONTENT_TYPE: &str = "application/json";

/// This host's name, for the names a process gives itself on a broker
/// (consumer tags, connection names), so operators can tell processes
/// apart: the kernel's hostname, else `/etc/hostname`, else `$HOSTNAME`.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
}

/// Adds the delivery's metadata to an event's own headers: [`ATTEMPT`], and
/// [`REPLAYED`] `true` on a replay. Postbox's names win over an event header
/// of the same name.
pub fn stamp_delivery(
    headers: &mut serde_json::Map<String, serde_json::Value>,
    attempt: i32,
    replayed: bool,
) {
    headers.insert(ATTEMPT.to_owned(), attempt.into());
    if replayed {
        headers.insert(REPLAYED.to_owned(), true.into());
    }
}

/// `error` as a [`LAST_ERROR`] value: its first [`LAST_ERROR_MAX_CHARS`]
/// characters.
pub fn last_error(error: &str) -> String {
    error.chars().take(LAST_ERROR_MAX_CHARS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_stamp_wins_over_event_headers() {
        let mut h = serde_json::Map::new();
        h.insert(ATTEMPT.to_owned(), "spoofed".into());
        stamp_delivery(&mut h, 3, false);
        assert_eq!(h[ATTEMPT], 3);
        assert!(!h.contains_key(REPLAYED));
        stamp_delivery(&mut h, 1, true);
        assert_eq!(h[REPLAYED], true);
    }

    #[test]
    fn a_last_error_is_cut_to_its_start() {
        assert_eq!(last_error("boom"), "boom");
        assert_eq!(last_error(&"é".repeat(2000)).chars().count(), 1000);
    }
}
