//! `kind = "rabbitmq"`: persistent messages on an exchange, with publisher
//! confirms and `mandatory`, so a row is delivered only once the broker took
//! responsibility for its message and an unroutable one is a failed attempt.
//!
//! The mapping (SPEC §4): body = payload; `message_id` = event_id, `type` =
//! event_type, `app_id` = app_code, `timestamp` (seconds), `content_type`
//! `application/json`, `delivery_mode` 2; headers `x-aggregate-id`,
//! `x-aggregate-version`, `x-created-at-ms`, `x-attempt`, `x-replayed`
//! (when replayed) and the event's own headers; routing key from the
//! `routing_key` template.
//!
//! A batch is published in order and its confirms are awaited together;
//! each event's result counts as soon as its confirm arrives, so under
//! `publish_timeout` only events still unconfirmed time out. The relay
//! has two batches in flight at a time, each on a channel of its own: the
//! next batch is sent while the last one's confirms are on their way. The
//! connection lives in a session task of its own ([`session`]) that
//! reconnects with backoff and jitter after the broker or the network drops
//! it (lapin itself does not reconnect); publishes meanwhile fail and their
//! rows are retried. While the broker blocks the connection (a memory or
//! disk alarm) publishes fail the same way and nothing is lost.
//!
//! Operators find the publisher's connections by their client-provided
//! name, `postbox-publisher-<name>-<host>-<pid>`.
//!
//! ```toml
//! [[publishers]]
//! kind = "rabbitmq"
//! name = "orders"
//! url = "amqps://postbox:${AMQP_PASSWORD}@mq.internal:5671/%2f"
//! exchange = "postbox"
//! routing_key = "{app_code}.{event_type}"
//! declare = true
//! ca_file = "/etc/postbox/mq-ca.pem"   # optional, amqps:// only
//! ```

mod backoff;
mod connection;
pub mod message;
mod session;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use postbox_core::config::RabbitMqPublisherConfig;
use postbox_core::publish::{Delivery, PublishError, PublishResults};
use postbox_core::template::Template;
use postbox_core::{Error, Publisher, Result};

use connection::{OpenError, Target};
use session::{Request, Session};

/// Publishes to a RabbitMQ exchange with publisher confirms.
pub struct RabbitMqPublisher {
    /// Whether the session holds a live connection.
    connected: Arc<AtomicBool>,
    /// Whether the broker blocks that connection (a resource alarm).
    blocked: Arc<AtomicBool>,
    name: String,
    connection_name: String,
    routing_key: Template,
    requests: mpsc::Sender<Request>,
}

impl RabbitMqPublisher {
    /// Connects, checks the exchange (declaring it when `declare = true`),
    /// opens a confirm-mode channel and starts the session task. Fails when
    /// the broker cannot be reached or the exchange is missing without
    /// `declare`; errors never contain the URL's password.
    pub async fn connect(config: &RabbitMqPublisherConfig) -> Result<Self> {
        let target = Arc::new(Target::new(config)?);
        let link = match target.open().await {
            Ok(link) => link,
            Err(OpenError::MissingExchange) => return Err(target.missing_exchange()),
            Err(OpenError::Other(reason)) => return Err(start_error(&target, reason)),
        };
        tracing::info!(
            publisher = %target.name,
            url = %target.url(),
            exchange = %target.exchange,
            connection = target.connection_name(),
            "connected to RabbitMQ"
        );
        let (requests, queue) = mpsc::channel(16);
        let connected = Arc::new(AtomicBool::new(true));
        tokio::spawn(Session::new(target.clone(), link, connected.clone()).run(queue));
        Ok(RabbitMqPublisher {
            connected,
            blocked: target.blocked.clone(),
            name: target.name.clone(),
            connection_name: target.connection_name().to_owned(),
            routing_key: config.routing_key.clone(),
            requests,
        })
    }

    /// The `connection_name` client property of this publisher's
    /// connections: `postbox-publisher-<name>-<host>-<pid>`.
    pub fn connection_name(&self) -> &str {
        &self.connection_name
    }

    /// Hands `batch` to the session; its results come on the returned
    /// channel, each as soon as its confirm does.
    async fn start(
        &self,
        batch: &[Delivery<'_>],
    ) -> std::result::Result<mpsc::UnboundedReceiver<(usize, PublishResult)>, PublishError> {
        let messages = batch
            .iter()
            .map(|d| message::outgoing(d, &self.routing_key))
            .collect();
        let (reply, results) = mpsc::unbounded_channel();
        self.requests
            .send(Request::Publish { messages, reply })
            .await
            .map_err(|_| PublishError::failed("the rabbitmq publisher is closed"))?;
        Ok(results)
    }
}

type PublishResult = std::result::Result<(), PublishError>;

/// Why an event of a batch has no result although the session stopped
/// sending them.
const SESSION_ENDED: &str = "the rabbitmq publisher's session ended";

fn start_error(target: &Target, reason: String) -> Error {
    Error::Io {
        context: format!("starting rabbitmq publisher `{}`", target.name),
        source: std::io::Error::other(reason),
    }
}

#[async_trait]
impl Publisher for RabbitMqPublisher {
    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<std::result::Result<(), PublishError>> {
        let mut results = match self.start(batch).await {
            Ok(results) => results,
            Err(e) => return vec![Err(e); batch.len()],
        };
        let mut all: Vec<Option<PublishResult>> = vec![None; batch.len()];
        while let Some((i, r)) = results.recv().await {
            if let Some(slot) = all.get_mut(i) {
                *slot = Some(r);
            }
        }
        all.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(PublishError::failed(SESSION_ENDED))))
            .collect()
    }

    /// Records each event's result as soon as its confirm (or return, or
    /// failure) arrives; only events still unconfirmed at `publish_timeout`
    /// count as timed out. Giving up drops the reply channel, so the session
    /// retires the publishing channel and late confirms of this batch never
    /// count for the next.
    async fn publish_each(
        &self,
        batch: &[Delivery<'_>],
        publish_timeout: Duration,
        results: &PublishResults,
    ) {
        let work = async {
            let mut incoming = match self.start(batch).await {
                Ok(incoming) => incoming,
                Err(e) => return results.set_all(vec![Err(e); batch.len()]),
            };
            let mut recorded = vec![false; batch.len()];
            while let Some((i, r)) = incoming.recv().await {
                if let Some(seen) = recorded.get_mut(i) {
                    *seen = true;
                }
                results.set(i, r);
            }
            // The session ended before confirming these (not a timeout).
            for (i, _) in recorded.iter().enumerate().filter(|(_, seen)| !**seen) {
                results.set(i, Err(PublishError::failed(SESSION_ENDED)));
            }
        };
        let _ = tokio::time::timeout(publish_timeout, work).await;
    }

    /// A connection the broker blocks (memory or disk alarm) counts as
    /// down: it takes no publish until the alarm clears.
    fn connected(&self) -> Option<bool> {
        Some(self.connected.load(Ordering::Relaxed) && !self.blocked.load(Ordering::Relaxed))
    }

    /// Two: the broker stores and confirms one batch while the next is
    /// sent (see [`session`]).
    fn max_in_flight(&self) -> usize {
        2
    }

    async fn close(&self) {
        let (done, closed) = oneshot::channel();
        if self.requests.send(Request::Close { done }).await.is_ok() {
            let _ = closed.await;
        }
    }
}
