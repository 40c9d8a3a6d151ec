//! `postbox_consume_total{consumer,result}` (SPEC §8) and
//! `postbox_consume_handler_seconds{consumer}`.

/// The counter's name.
pub const CONSUME_TOTAL: &str = "postbox_consume_total";

/// Counts one message of `consumer` with `result` (`ok`, `duplicate`,
/// `stale`, `retry` or `dead`).
pub fn count(consumer: &str, result: &'static str) {
    metrics::counter!(CONSUME_TOTAL, "consumer" => consumer.to_owned(), "result" => result)
        .increment(1);
}

/// Records how long `consumer`'s handler took over one message.
pub fn handler_took(consumer: &str, took: std::time::Duration) {
    metrics::histogram!(
        postbox_core::metrics::CONSUME_HANDLER_SECONDS,
        "consumer" => consumer.to_owned()
    )
    .record(took.as_secs_f64());
}
