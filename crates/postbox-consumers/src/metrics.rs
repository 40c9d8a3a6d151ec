//! `postbox_consume_total{consumer,result}` (SPEC §8).

/// The counter's name.
pub const CONSUME_TOTAL: &str = "postbox_consume_total";

/// Counts one message of `consumer` with `result` (`ok`, `duplicate`,
/// `stale`, `retry` or `dead`).
pub fn count(consumer: &str, result: &'static str) {
    metrics::counter!(CONSUME_TOTAL, "consumer" => consumer.to_owned(), "result" => result)
        .increment(1);
}
