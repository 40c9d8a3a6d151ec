//! Push wake-up: the relay `LISTEN`s on channel `postbox_<table>`, which
//! the trigger of schema version 4 notifies once per `INSERT` statement
//! (and a replay inside its transaction), on a connection of its own.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::PgPool;

use postbox_core::relay::CancellationToken;
use postbox_core::wake::Wake;
use postbox_core::TableName;

/// Longest channel name PostgreSQL keeps (`NAMEDATALEN - 1`).
const MAX_CHANNEL: usize = 63;

/// The table's channel: `postbox_<table>`, with the table name as
/// PostgreSQL stores an unquoted one (lower case), as the trigger computes
/// it from `TG_TABLE_NAME` (cut to 63 bytes, which a valid table name
/// never reaches).
pub(crate) fn channel(table: &TableName) -> String {
    let mut channel = format!("postbox_{}", table.as_str().to_ascii_lowercase());
    channel.truncate(MAX_CHANNEL);
    channel
}

/// The pause before connecting again after the `n`th failure in a row.
fn backoff(n: u32) -> Duration {
    (Duration::from_millis(100) * 2u32.saturating_pow(n.min(9))).min(Duration::from_secs(30))
}

async fn subscribe(pool: &PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

/// Signals `wake` on every notification of `channel` until `shutdown`.
/// Listens on a pool of one connection of its own (never one the relay's
/// claims need). A lost connection is re-established with a growing pause,
/// logged once per streak, and counts as a wake (notifications may have
/// been missed meanwhile); polling covers the gap.
pub(crate) async fn listen(
    options: PgConnectOptions,
    channel: String,
    wake: Wake,
    shutdown: CancellationToken,
) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .connect_lazy_with(options);
    // Failures (to connect, or of the connection) since the last LISTEN
    // that worked.
    let mut streak = 0u32;
    // A LISTEN worked before (the next one is a re-establishment).
    let mut listened = false;
    'connect: while !shutdown.is_cancelled() {
        let connected = tokio::select! {
            connected = subscribe(&pool, &channel) => connected,
            _ = shutdown.cancelled() => break,
        };
        let mut listener = match connected {
            Ok(listener) => listener,
            Err(e) => {
                streak += 1;
                if streak == 1 {
                    tracing::warn!(channel, error = %e, "cannot LISTEN for new rows; polling until it can, retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff(streak)) => {}
                    _ = shutdown.cancelled() => break,
                }
                continue;
            }
        };
        if streak > 0 || listened {
            tracing::info!(channel, failures = streak, "listening for new rows again");
            // Rows may have been written while no one listened. (Not on
            // the first LISTEN: the relay starts with a look of its own.)
            wake.signal();
        } else {
            tracing::debug!(channel, "listening for new rows");
        }
        streak = 0;
        listened = true;
        loop {
            let next = tokio::select! {
                next = listener.try_recv() => next,
                _ = shutdown.cancelled() => break 'connect,
            };
            match next {
                Ok(Some(_)) => wake.signal(),
                Ok(None) | Err(_) => {
                    streak += 1;
                    tracing::warn!(
                        channel,
                        "lost the LISTEN connection; polling until it is back, reconnecting"
                    );
                    wake.signal();
                    continue 'connect;
                }
            }
        }
    }
    // Bounded: the close waits for the answer to the UNLISTEN the listener
    // sends as it goes, and a database gone silent never answers (the
    // relay's stop waited for it).
    let _ = tokio::time::timeout(Duration::from_secs(2), pool.close()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_channel_is_the_stored_table_name_cut_to_63_bytes() {
        assert_eq!(
            channel(&TableName::new("Room_Outbox").unwrap()),
            "postbox_room_outbox"
        );
        // Table names are short enough that the channel is never cut.
        let long = "t".repeat(TableName::MAX_LEN);
        assert_eq!(
            channel(&TableName::new(&long).unwrap()),
            format!("postbox_{long}")
        );
    }

    #[test]
    fn reconnects_back_off_up_to_30_s() {
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(40), Duration::from_secs(30));
    }
}
