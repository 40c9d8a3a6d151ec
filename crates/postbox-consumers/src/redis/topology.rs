//! The server side of a Redis consumer: connecting, the consumer group and
//! the dead stream (named by [`postbox_core::wire::redis`]).

use std::time::Duration;

use postbox_core::config::ConsumerConfig;
use postbox_core::redact::redact_url;
use postbox_core::Error;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::RedisError;

pub use postbox_core::wire::redis::dead_stream;

/// Connects with bounded waits; `block` is the longest `BLOCK` the
/// connection's commands use.
pub(super) async fn connect(url: &str, block: Duration) -> Result<ConnectionManager, String> {
    connect_answering_within(url, IO_WITHIN + block).await
}

/// How long connecting, and a command that does not block, may take.
const IO_WITHIN: Duration = Duration::from_secs(5);

/// Connects; a command's answer is waited for at most `answer`.
pub(super) async fn connect_answering_within(
    url: &str,
    answer: Duration,
) -> Result<ConnectionManager, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(IO_WITHIN))
        .set_response_timeout(Some(answer))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(1));
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| e.to_string())
}

/// `declare = true`: creates the group on the stream (and the stream),
/// from `0`: a new group also gets what the stream already holds, as a
/// durable NATS consumer does. A group that exists is left as it is.
pub(super) async fn create_group(
    conn: &mut ConnectionManager,
    stream: &str,
    group: &str,
) -> Result<(), RedisError> {
    let created: Result<(), RedisError> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Ok(()) => {
            // From the stream's start: a group made again after it was
            // lost (see `RedisConsumer::broken_or_refused`) delivers the
            // entries still in the stream once more; consumers dedupe by
            // event_id. From `$` it would skip those added meanwhile.
            tracing::info!(
                stream,
                group,
                "created Redis consumer group, reading the stream from its start"
            );
            Ok(())
        }
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether `e` says the set-up is wrong (no group, not a stream, no
/// permission): retrying cannot help.
pub(super) fn is_refusal(e: &RedisError) -> bool {
    matches!(e.code(), Some("NOGROUP" | "WRONGTYPE" | "NOPERM"))
}

/// The config error a refusal of the group's set-up is, with what to do.
pub(super) fn refused(config: &ConsumerConfig, e: &RedisError) -> Error {
    let hint = match e.code() {
        Some("NOGROUP") => "create the group (XGROUP CREATE … MKSTREAM), or set declare = true",
        Some("WRONGTYPE") => "the key exists and is not a stream: choose another queue",
        _ => "check the user's permissions",
    };
    Error::config(
        // `stream`, as the README writes a Redis or NATS entry's key
        // (`queue` is its other name).
        "stream",
        format!(
            "Redis refused group `{}` on stream `{}`: {} ({hint})",
            config.consumer_group(),
            config.queue,
            redact_url(&e.to_string())
        ),
    )
}
