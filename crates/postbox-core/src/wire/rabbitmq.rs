//! RabbitMQ (AMQP 0-9-1): how an event is a message, and the consumer's
//! queues.
//!
//! The message (SPEC §4): body = payload; `message_id` = event_id, `type` =
//! event_type, `app_id` = app_code, `timestamp` (seconds), `content_type`
//! [`CONTENT_TYPE`](super::CONTENT_TYPE), `delivery_mode`
//! [`PERSISTENT`]; headers [`POSTBOX_HEADERS`] and the event's own.
//!
//! The consumer's topology: `<queue>`, [`retry_queue`] (a copy waits there
//! for its per-message `expiration`, then dead-letters back to `<queue>`
//! through the default exchange: [`DEAD_LETTER_EXCHANGE`],
//! [`DEAD_LETTER_ROUTING_KEY`]) and [`dead_queue`].

use super::{AGGREGATE_ID, AGGREGATE_VERSION, ATTEMPT, CREATED_AT_MS, REPLAYED};

/// `delivery_mode` of a message the broker writes to disk.
pub const PERSISTENT: u8 = 2;

/// The headers postbox sets on every message, beside the event's own.
pub const POSTBOX_HEADERS: [&str; 5] = [
    AGGREGATE_ID,
    AGGREGATE_VERSION,
    CREATED_AT_MS,
    ATTEMPT,
    REPLAYED,
];

/// How often a quorum queue delivered a message before (set by the broker;
/// classic queues only set the `redelivered` flag).
pub const DELIVERY_COUNT: &str = "x-delivery-count";

/// Queue argument: the queue's type (`classic`, `quorum`), set by
/// `declare` from the consumer's `queue_type`.
pub const QUEUE_TYPE: &str = "x-queue-type";

/// Queue argument: where expired messages go (`""`, the default exchange,
/// on `<queue>.retry`).
pub const DEAD_LETTER_EXCHANGE: &str = "x-dead-letter-exchange";
/// Queue argument: their routing key (`<queue>` on `<queue>.retry`).
pub const DEAD_LETTER_ROUTING_KEY: &str = "x-dead-letter-routing-key";

/// Whether a header is the broker's bookkeeping of dead-lettering
/// (`x-death`, `x-first-death-*`, `x-last-death-*`), not the event's.
pub fn is_death_header(name: &str) -> bool {
    name == "x-death" || name.starts_with("x-first-death") || name.starts_with("x-last-death")
}

/// `<queue>.retry`: where a failed message waits for its delay.
pub fn retry_queue(queue: &str) -> String {
    format!("{queue}.retry")
}

/// `<queue>.dead`: where a message goes after `max_attempts`.
pub fn dead_queue(queue: &str) -> String {
    format!("{queue}.dead")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_and_dead_queues_are_named_after_the_queue() {
        assert_eq!(retry_queue("console_bus"), "console_bus.retry");
        assert_eq!(dead_queue("console_bus"), "console_bus.dead");
        assert!(is_death_header("x-death"));
        assert!(is_death_header("x-first-death-queue"));
        assert!(!is_death_header("x-attempt"));
    }
}
