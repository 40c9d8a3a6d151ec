//! Running every `[[consumers]]` entry: each queue bridged to its HTTP
//! handler, through its inbox when one is configured, with the inbox purge
//! beside it, and `/healthz` and `/metrics` on `admin.listen` when
//! `[admin]` is set.

use std::sync::Arc;
use std::time::Duration;

use postbox_consumers::consume::state::ConsumerState;
use postbox_consumers::http::HttpHandler;
use postbox_consumers::nats::NatsConsumer;
use postbox_consumers::ordering::AggregateHolds;
use postbox_consumers::rabbitmq::RabbitMqConsumer;
use postbox_consumers::redis::RedisConsumer;
use postbox_consumers::{ConsumeReport, Handler, RetryPolicy};
use postbox_core::config::{ConsumerConfig, ConsumerKind, KeyPath, Settings};
use postbox_core::relay::CancellationToken;
use postbox_core::{BoxFuture, Error};

use crate::inbox;

/// Runs every consumer until `shutdown` is cancelled; the first that fails
/// stops the others, and its error (naming its key, `consumers.1.queue`) is
/// returned.
pub fn run(settings: &Settings, shutdown: CancellationToken) -> BoxFuture<'_, Result<(), Error>> {
    Box::pin(run_here(settings, shutdown))
}

async fn run_here(settings: &Settings, shutdown: CancellationToken) -> Result<(), Error> {
    if settings.consumers.is_empty() {
        return Err(Error::config(
            "consumers",
            "no [[consumers]] entry: nothing to consume",
        ));
    }
    for (at, c) in settings.consumers() {
        if c.handler.is_none() {
            return Err(Error::config(
                at.join("handler"),
                "postbox consume needs a handler, e.g. handler = { http = \"http://127.0.0.1:8080/events\" }",
            ));
        }
        warn_short_retention(&at, c);
    }

    // `[admin]`: this process's `/healthz`, `/metrics`
    // (`postbox_consume_total`, `postbox_consume_handler_seconds`) and
    // `/api/consumers`; bound first, so a taken address fails at once.
    let server = match &settings.admin {
        Some(admin) => Some(postbox_admin::MetricsServer::bind(&admin.listen).await?),
        None => None,
    };
    let mut controls: Vec<Arc<dyn postbox_admin::ConsumerControl>> = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    let mut failure = None;
    for (at, c) in settings.consumers() {
        // Opening an inbox waits on its database (bounded: `inbox::bridge`).
        // A stop asked for meanwhile ends the start-up at once; a consumer
        // that cannot be built stops those already running, each finishing
        // the message in hand (dropping the task set aborted them).
        let built = tokio::select! {
            built = build_consumer(&at, c, &shutdown) => built,
            _ = shutdown.cancelled() => break,
        };
        let (state, run) = match built {
            Ok(built) => built,
            Err(e) => {
                shutdown.cancel();
                failure = Some(e);
                break;
            }
        };
        let name = c.name().to_owned();
        let placed = at.clone();
        controls.push(Arc::new(Controlled {
            state,
            config: c.clone(),
        }));
        tasks.spawn(async move { (name, run.await.map_err(|e| e.within(&placed))) });
    }
    let metrics = server.map(|server| {
        let server = server.with_consumers(controls, &settings.admin_or_default());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) = server.run(stop).await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        })
    });
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((name, Ok(report))) => {
                tracing::info!(consumer = name, ?report, "consumer finished")
            }
            Ok((name, Err(e))) => {
                tracing::error!(consumer = name, error = %e, "consumer failed; stopping the others");
                shutdown.cancel();
                failure.get_or_insert(e);
            }
            Err(e) => {
                shutdown.cancel();
                failure.get_or_insert(Error::Internal(format!("a consumer task panicked: {e}")));
            }
        }
    }
    if let Some(metrics) = metrics {
        shutdown.cancel();
        let _ = metrics.await;
    }
    failure.map_or(Ok(()), Err)
}

/// A consumer's state as the admin server controls it, and its config
/// for the passes over its dead letters.
struct Controlled {
    state: Arc<ConsumerState>,
    config: ConsumerConfig,
}

impl postbox_admin::ConsumerControl for Controlled {
    fn name(&self) -> &str {
        self.state.name()
    }

    fn snapshot(&self) -> serde_json::Value {
        serde_json::to_value(self.state.snapshot()).unwrap_or_default()
    }

    fn pause(&self) -> bool {
        self.state.pause()
    }

    fn resume(&self) -> bool {
        self.state.resume()
    }

    fn dead_letters(
        &self,
        r: postbox_admin::DeadRequest,
    ) -> BoxFuture<'_, Result<serde_json::Value, String>> {
        use postbox_admin::DeadVerb;
        use postbox_consumers::dead::{self, DeadAction, DeadFilter};
        Box::pin(async move {
            let action = match r.verb {
                DeadVerb::List(limit) => DeadAction::List(limit),
                DeadVerb::Replay => DeadAction::Replay,
                DeadVerb::Purge => DeadAction::Purge,
            };
            let filter = DeadFilter {
                event_id: r.event_id,
                event_type: r.event_type,
                since_ms: r.since_ms,
                until_ms: r.until_ms,
                error: r.error,
            };
            let report = dead::run(&self.config, action, &filter, r.dry_run, &|_, _| {})
                .await
                .map_err(|e| e.to_string())?;
            serde_json::to_value(report).map_err(|e| e.to_string())
        })
    }
}

/// Creates the inbox tables of every consumer that has one (for `postbox
/// migrate`); returns a line per inbox.
pub fn migrate_inboxes(settings: &Settings) -> BoxFuture<'_, Result<Vec<String>, Error>> {
    Box::pin(migrate_inboxes_here(settings))
}

async fn migrate_inboxes_here(settings: &Settings) -> Result<Vec<String>, Error> {
    let mut done = Vec::new();
    for (at, c) in settings.consumers() {
        let Some(config) = &c.inbox else { continue };
        inbox::migrate(&at.join("inbox"), config).await?;
        done.push(format!(
            "inbox `{}` of consumer `{}` is ready",
            config.table,
            c.name()
        ));
    }
    Ok(done)
}

/// How long after its first delivery an event can still reach this
/// consumer's handler again: the sum of its retry delays. An inbox that
/// forgets an event before then lets that redelivery through a second time.
pub fn redelivery_horizon(c: &ConsumerConfig) -> Duration {
    RetryPolicy::of(c).redelivery_horizon()
}

/// The HTTP bridge, through the inbox when one is configured (starting
/// its purge); with `ordering = "per_aggregate"` also the holds beside the
/// inbox.
/// A consumer's state and its run until `shutdown`.
type Built = (
    Arc<ConsumerState>,
    BoxFuture<'static, Result<ConsumeReport, Error>>,
);

/// Consumer `c` (at key `at`), its handler and, with an inbox, that
/// inbox opened.
async fn build_consumer(
    at: &KeyPath,
    c: &ConsumerConfig,
    shutdown: &CancellationToken,
) -> Result<Built, Error> {
    let (handler, holds) = build_handler(at, c, shutdown).await?;
    let shutdown = shutdown.clone();
    Ok(match c.kind {
        ConsumerKind::Rabbitmq => {
            let mut consumer =
                RabbitMqConsumer::new(c.clone(), handler).map_err(|e| e.within(at))?;
            if let Some(holds) = holds {
                consumer = consumer.with_holds(holds);
            }
            (
                consumer.state(),
                Box::pin(async move { consumer.run(shutdown).await }),
            )
        }
        ConsumerKind::Nats => {
            let consumer = NatsConsumer::new(c.clone(), handler).map_err(|e| e.within(at))?;
            (
                consumer.state(),
                Box::pin(async move { consumer.run(shutdown).await }),
            )
        }
        ConsumerKind::Redis => {
            let consumer = RedisConsumer::new(c.clone(), handler).map_err(|e| e.within(at))?;
            (
                consumer.state(),
                Box::pin(async move { consumer.run(shutdown).await }),
            )
        }
    })
}

async fn build_handler(
    at: &KeyPath,
    c: &ConsumerConfig,
    shutdown: &CancellationToken,
) -> Result<(Arc<dyn Handler>, Option<Arc<dyn AggregateHolds>>), Error> {
    let Some(h) = c.handler.as_ref() else {
        return Err(Error::config(at.join("handler"), "is required"));
    };
    let http = HttpHandler::new(h.http.clone(), h.timeout.get()).map_err(|e| e.within(at))?;
    match &c.inbox {
        None => Ok((Arc::new(http), None)),
        Some(_) => inbox::bridge(at, c, http, shutdown).await,
    }
}

fn warn_short_retention(at: &KeyPath, c: &ConsumerConfig) {
    if c.inbox.is_none() {
        return;
    }
    let horizon = redelivery_horizon(c);
    if c.inbox_retention.get() < horizon {
        tracing::warn!(
            key = %at.join("inbox_retention"),
            retention = %c.inbox_retention,
            horizon = %humantime::format_duration(horizon),
            "inbox_retention is shorter than the redelivery horizon (the sum of the retry delays): a late retry of a handled event would be handled again"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{key_of, settings};
    use postbox_core::config::Config;

    #[tokio::test]
    async fn consuming_needs_an_entry_with_a_handler() {
        let none = Config::default().validate().unwrap();
        let run_none = run(&none, CancellationToken::new()).await;
        assert_eq!(key_of(run_none.unwrap_err()), "consumers");

        let bare = settings(serde_json::json!({
            "consumers": [{
                "kind": "rabbitmq",
                "url": "amqp://guest:guest@127.0.0.1:5672/%2f",
                "queue": "q",
            }],
        }));
        let run_bare = run(&bare, CancellationToken::new()).await;
        assert_eq!(key_of(run_bare.unwrap_err()), "consumers.0.handler");
    }
}
