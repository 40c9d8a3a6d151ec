//! A consumer's inbox, opened by its URL's scheme, and the purge that
//! keeps it small.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use postbox_consumers::http::HttpHandler;
use postbox_consumers::inbox::{Inbox, InboxHandler};
use postbox_consumers::ordering::{AggregateHolds, Holds};
use postbox_consumers::Handler;
use postbox_core::config::{ConsumerConfig, DatabaseKind, InboxConfig, KeyPath, Ordering};
use postbox_core::relay::CancellationToken;
use postbox_core::Error;

/// Rows per purge statement.
pub const PURGE_BATCH: u32 = 5_000;

/// An inbox that cannot be opened: a runtime failure that names the
/// inbox's key (`consumers.0.inbox`) and URL (password hidden).
fn refused(at: &KeyPath, config: &InboxConfig, e: Error) -> Error {
    Error::Io {
        context: format!("{at} ({})", config.url),
        source: std::io::Error::other(e.to_string()),
    }
}

/// Creates the inbox table of `config` (at key `at`, `consumers.0.inbox`)
/// when missing. An unknown URL scheme is an error naming `<at>.url`.
pub async fn migrate(at: &KeyPath, config: &InboxConfig) -> Result<(), Error> {
    let (url, table) = (config.url.expose(), config.table.as_str());
    let opened = match DatabaseKind::of(&config.url, &at.join("url"))? {
        DatabaseKind::Postgres => Inbox::<sqlx::Postgres>::connect(url, table).await.map(drop),
        DatabaseKind::MySql => Inbox::<sqlx::MySql>::connect(url, table).await.map(drop),
        DatabaseKind::Sqlite => Inbox::<sqlx::Sqlite>::connect(url, table).await.map(drop),
    };
    opened.map_err(|e| refused(at, config, e))
}

/// What opening an inbox is called in its error.
const OPENING: &str = "opening the inbox database";

/// How long opening an inbox may wait on its database: connecting (the
/// pool gives up after 30 s) and creating the tables when missing, which
/// a database that stopped answering after the connection would hold for
/// good, the consumer neither starting nor failing.
const OPEN_WITHIN: Duration = Duration::from_secs(60);

/// `http` behind the inbox of consumer `c` (at key `at`, `consumers.0`),
/// with the holds of `ordering = "per_aggregate"`; starts the inbox purge,
/// which stops with `shutdown`.
pub(crate) async fn bridge(
    at: &KeyPath,
    c: &ConsumerConfig,
    http: HttpHandler,
    shutdown: &CancellationToken,
) -> Result<(Arc<dyn Handler>, Option<Arc<dyn AggregateHolds>>), Error> {
    let Some(config) = &c.inbox else {
        return Ok((Arc::new(http), None));
    };
    let at = at.join("inbox");
    let (url, table) = (config.url.expose(), config.table.as_str());
    let ordered = c.ordering == Ordering::PerAggregate;
    let group = c.consumer_group().to_owned();
    let retention = c.inbox_retention.get();
    let refuse = |e: Error| refused(&at, config, e);
    // The inbox and holds are generated per database by the consumers
    // crate, so each arm names its database once.
    macro_rules! bridge_on {
        ($db:ty) => {{
            let inbox =
                Error::unless_silent(OPENING, OPEN_WITHIN, Inbox::<$db>::connect(url, table))
                    .await
                    .map_err(refuse)?;
            let holds = if ordered {
                let holds = Error::unless_silent(OPENING, OPEN_WITHIN, Holds::<$db>::of(&inbox));
                Some(Arc::new(holds.await.map_err(refuse)?))
            } else {
                None
            };
            spawn_purge(c.name(), retention, shutdown.clone(), {
                let (inbox, holds) = (inbox.clone(), holds.clone());
                move |cut| {
                    let (inbox, holds) = (inbox.clone(), holds.clone());
                    async move {
                        let mut purged = inbox.purge(cut, PURGE_BATCH).await?;
                        if let Some(holds) = holds {
                            purged += holds.purge(cut, PURGE_BATCH).await?;
                        }
                        Ok(purged)
                    }
                }
            });
            let holds = holds.map(|h| h as Arc<dyn AggregateHolds>);
            let handler: Arc<dyn Handler> = Arc::new(InboxHandler::new(inbox, group, http));
            (handler, holds)
        }};
    }
    Ok(match DatabaseKind::of(&config.url, &at.join("url"))? {
        DatabaseKind::Postgres => bridge_on!(sqlx::Postgres),
        DatabaseKind::MySql => bridge_on!(sqlx::MySql),
        DatabaseKind::Sqlite => bridge_on!(sqlx::Sqlite),
    })
}

/// Purges inbox rows older than `retention` with `purge(cut_ms)`: at
/// start, then every `min(retention / 10, 1h)` (at least every second),
/// until `shutdown`. Failures are logged and tried again.
pub fn spawn_purge<F, Fut>(
    name: &str,
    retention: Duration,
    shutdown: CancellationToken,
    purge: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(i64) -> Fut + Send + 'static,
    Fut: Future<Output = Result<u64, Error>> + Send,
{
    let name = name.to_owned();
    let every = (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(3600));
    tokio::spawn(async move {
        loop {
            let cut = postbox_core::time::now_ms()
                .saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
            match purge(cut).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(consumer = name, rows = n, "inbox purged"),
                Err(e) => {
                    tracing::warn!(consumer = name, error = %e, "inbox purge failed; trying again later")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inbox(url: &str) -> InboxConfig {
        serde_json::from_value(serde_json::json!({ "url": url })).unwrap()
    }

    /// Regression: `postbox migrate` opened an inbox whose URL scheme it
    /// did not know as SQLite (`_ =>` in the CLI's switch); a config built
    /// in code, unvalidated, reached it. Now it is refused, naming the key.
    #[tokio::test]
    async fn an_unknown_inbox_scheme_is_refused_not_opened_as_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("oracle://{}/inbox.db", dir.path().display());
        let at = KeyPath::consumer(0).join("inbox");
        match migrate(&at, &inbox(&url)).await {
            Err(Error::Config { key, reason }) => {
                assert_eq!(key, "consumers.0.inbox.url");
                assert!(reason.contains("`oracle`"), "{reason}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_sqlite_inbox_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
        migrate(&KeyPath::consumer(0).join("inbox"), &inbox(&url))
            .await
            .unwrap();
        assert!(dir.path().join("inbox.db").exists());
    }
}
