//! `postbox consume`: runs every `[[consumers]]` entry until SIGINT/SIGTERM,
//! bridging each queue to its HTTP handler.

use postbox_core::config::Uses;
use std::sync::Arc;
use std::time::Duration;

use postbox_consumers::http::HttpHandler;
use postbox_consumers::inbox::{Inbox, InboxHandler};
use postbox_consumers::nats::NatsConsumer;
use postbox_consumers::ordering::{AggregateHolds, Holds};
use postbox_consumers::rabbitmq::RabbitMqConsumer;
use postbox_consumers::redis::RedisConsumer;
use postbox_consumers::{Handler, RetryPolicy};
use postbox_core::config::{ConsumerConfig, ConsumerKind, Ordering};
use postbox_core::relay::CancellationToken;
use postbox_core::Error;

use crate::cli::Global;
use crate::commands::relay::spawn_signal_handler;
use crate::error::CliError;
use crate::open::load_config;

/// Rows per purge statement.
const PURGE_BATCH: u32 = 5_000;

pub async fn run(g: &Global) -> Result<(), CliError> {
    let config = load_config(
        g,
        Uses {
            consumers: true,
            ..Uses::DATABASE
        },
    )?;
    if config.consumers.is_empty() {
        return Err(
            Error::config("consumers", "no [[consumers]] entry: nothing to consume").into(),
        );
    }
    for (i, c) in config.consumers.iter().enumerate() {
        if c.handler.is_none() {
            return Err(Error::config(
                format!("consumers.{i}.handler"),
                "postbox consume needs a handler, e.g. handler = { http = \"http://127.0.0.1:8080/events\" }",
            )
            .into());
        }
        warn_short_retention(i, c);
    }

    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let mut tasks = tokio::task::JoinSet::new();
    for (i, c) in config.consumers.iter().enumerate() {
        let (handler, holds) = build_handler(i, c, &shutdown).await?;
        let shutdown = shutdown.clone();
        let name = c.name().to_owned();
        match c.kind {
            ConsumerKind::Rabbitmq => {
                let mut consumer = RabbitMqConsumer::new(c.clone(), handler)?;
                if let Some(holds) = holds {
                    consumer = consumer.with_holds(holds);
                }
                tasks.spawn(async move { (name, consumer.run(shutdown).await) });
            }
            ConsumerKind::Nats => {
                let consumer = NatsConsumer::new(c.clone(), handler)?;
                tasks.spawn(async move { (name, consumer.run(shutdown).await) });
            }
            ConsumerKind::Redis => {
                let consumer = RedisConsumer::new(c.clone(), handler)?;
                tasks.spawn(async move { (name, consumer.run(shutdown).await) });
            }
        }
    }
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((name, Ok(report))) => {
                tracing::info!(consumer = name, ?report, "consumer finished")
            }
            Ok((name, Err(e))) => {
                tracing::error!(consumer = name, error = %e, "consumer failed; stopping the others");
                shutdown.cancel();
                failure.get_or_insert(CliError::from(e));
            }
            Err(e) => {
                shutdown.cancel();
                failure.get_or_insert(CliError::runtime(format!("a consumer task panicked: {e}")));
            }
        }
    }
    failure.map_or(Ok(()), Err)
}

/// Creates the inbox tables of every consumer that has one (for `postbox
/// migrate`); returns a line per inbox.
pub async fn migrate_inboxes(consumers: &[ConsumerConfig]) -> Result<Vec<String>, CliError> {
    let mut done = Vec::new();
    for (i, c) in consumers.iter().enumerate() {
        let Some(inbox) = &c.inbox else { continue };
        let (url, table) = (inbox.url.expose(), inbox.table.as_str());
        let result = match inbox.url.scheme() {
            "postgres" | "postgresql" => {
                Inbox::<sqlx::Postgres>::connect(url, table).await.map(drop)
            }
            "mysql" | "mariadb" => Inbox::<sqlx::MySql>::connect(url, table).await.map(drop),
            _ => Inbox::<sqlx::Sqlite>::connect(url, table).await.map(drop),
        };
        result
            .map_err(|e| CliError::runtime(format!("consumers.{i}.inbox ({}): {e}", inbox.url)))?;
        done.push(format!(
            "inbox `{table}` of consumer `{}` is ready",
            c.name()
        ));
    }
    Ok(done)
}

/// The HTTP bridge, through the inbox when one is configured; starts the
/// inbox purge. With `ordering = "per_aggregate"` also the holds beside the
/// inbox.
async fn build_handler(
    i: usize,
    c: &ConsumerConfig,
    shutdown: &CancellationToken,
) -> Result<(Arc<dyn Handler>, Option<Arc<dyn AggregateHolds>>), CliError> {
    let h = c.handler.as_ref().expect("checked above");
    let http = HttpHandler::new(h.http.clone(), h.timeout.get())?;
    let Some(inbox) = &c.inbox else {
        return Ok((Arc::new(http), None));
    };
    let ordered = c.ordering == Ordering::PerAggregate;
    let mut holds: Option<Arc<dyn AggregateHolds>> = None;
    let url = inbox.url.expose();
    let table = inbox.table.as_str();
    let group = c.consumer_group().to_owned();
    let retention = c.inbox_retention.get();
    let refuse = |e: Error| -> CliError {
        CliError::runtime(format!("consumers.{i}.inbox ({}): {e}", inbox.url))
    };
    let handler: Arc<dyn Handler> = match inbox.url.scheme() {
        "postgres" | "postgresql" => {
            let inbox = Inbox::<sqlx::Postgres>::connect(url, table)
                .await
                .map_err(refuse)?;
            if ordered {
                holds = Some(Arc::new(
                    Holds::<sqlx::Postgres>::of(&inbox).await.map_err(refuse)?,
                ));
            }
            spawn_purge(c.name(), retention, shutdown.clone(), {
                let inbox = inbox.clone();
                move |cut| {
                    let inbox = inbox.clone();
                    async move { inbox.purge(cut, PURGE_BATCH).await }
                }
            });
            Arc::new(InboxHandler::new(inbox, group, http))
        }
        "mysql" | "mariadb" => {
            let inbox = Inbox::<sqlx::MySql>::connect(url, table)
                .await
                .map_err(refuse)?;
            if ordered {
                holds = Some(Arc::new(
                    Holds::<sqlx::MySql>::of(&inbox).await.map_err(refuse)?,
                ));
            }
            spawn_purge(c.name(), retention, shutdown.clone(), {
                let inbox = inbox.clone();
                move |cut| {
                    let inbox = inbox.clone();
                    async move { inbox.purge(cut, PURGE_BATCH).await }
                }
            });
            Arc::new(InboxHandler::new(inbox, group, http))
        }
        _ => {
            let inbox = Inbox::<sqlx::Sqlite>::connect(url, table)
                .await
                .map_err(refuse)?;
            if ordered {
                holds = Some(Arc::new(
                    Holds::<sqlx::Sqlite>::of(&inbox).await.map_err(refuse)?,
                ));
            }
            spawn_purge(c.name(), retention, shutdown.clone(), {
                let inbox = inbox.clone();
                move |cut| {
                    let inbox = inbox.clone();
                    async move { inbox.purge(cut, PURGE_BATCH).await }
                }
            });
            Arc::new(InboxHandler::new(inbox, group, http))
        }
    };
    Ok((handler, holds))
}

/// Purges inbox rows older than `retention`: at start, then every
/// `min(retention / 10, 1h)`.
fn spawn_purge<F, Fut>(name: &str, retention: Duration, shutdown: CancellationToken, purge: F)
where
    F: Fn(i64) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<u64, Error>> + Send,
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
    });
}

/// An inbox that forgets an event before its last redelivery lets that
/// redelivery through a second time.
/// How long after its first delivery an event can still reach this
/// consumer's handler again: the sum of its retry delays.
pub fn redelivery_horizon(c: &ConsumerConfig) -> Duration {
    RetryPolicy::of(c).redelivery_horizon()
}

fn warn_short_retention(i: usize, c: &ConsumerConfig) {
    if c.inbox.is_none() {
        return;
    }
    let horizon = redelivery_horizon(c);
    if c.inbox_retention.get() < horizon {
        tracing::warn!(
            key = format!("consumers.{i}.inbox_retention"),
            retention = %c.inbox_retention,
            horizon = %humantime::format_duration(horizon),
            "inbox_retention is shorter than the redelivery horizon (the sum of the retry delays): a late retry of a handled event would be handled again"
        );
    }
}
