//! Redis Streams: the fields of an entry (SPEC §4) and the dead stream.
//!
//! The publisher `XADD`s [`FIELDS`] in that order (`aggregate_id` and
//! `aggregate_version` left out when the event has none; `headers` is a JSON
//! object holding the event's headers plus `x-attempt`, and `x-replayed` on
//! a replay). The consumer reads them back; after `max_attempts` it adds the
//! entry to [`dead_stream`] with [`CONSUMER_GROUP`] and [`SOURCE_ID`] too.

/// The event id.
pub const EVENT_ID: &str = "event_id";
/// The event type.
pub const EVENT_TYPE: &str = "event_type";
/// The app code.
pub const APP_CODE: &str = "app_code";
/// The aggregate id (absent when the event has none).
pub const AGGREGATE_ID: &str = "aggregate_id";
/// The aggregate version (absent when the event has none).
pub const AGGREGATE_VERSION: &str = "aggregate_version";
/// Created, epoch ms.
pub const CREATED_AT_MS: &str = "created_at_ms";
/// The headers, a JSON object.
pub const HEADERS: &str = "headers";
/// The body as stored.
pub const PAYLOAD: &str = "payload";

/// The fields of an entry, in the order the publisher writes them.
pub const FIELDS: [&str; 8] = [
    EVENT_ID,
    EVENT_TYPE,
    APP_CODE,
    AGGREGATE_ID,
    AGGREGATE_VERSION,
    CREATED_AT_MS,
    HEADERS,
    PAYLOAD,
];

/// On a dead copy: the consumer group that gave up on the entry.
pub const CONSUMER_GROUP: &str = "consumer_group";
/// On a dead copy: the original entry's id.
pub const SOURCE_ID: &str = "source_id";

/// `<stream>.dead`: where an entry goes after `max_attempts` deliveries.
pub fn dead_stream(stream: &str) -> String {
    format!("{stream}.dead")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dead_stream_is_named_after_the_stream() {
        assert_eq!(dead_stream("orders"), "orders.dead");
        assert_eq!(FIELDS[0], EVENT_ID);
        assert_eq!(FIELDS[7], PAYLOAD);
    }
}
