//! The pull loop: at most `prefetch` messages in hand, ack after success,
//! nak with a growing delay on failure, a confirmed dead copy before the
//! original is terminated, reconnect with backoff.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use postbox_core::config::{ConsumerConfig, ConsumerKind};
use postbox_core::Error;
use tokio_util::sync::CancellationToken;

use crate::session::{run_sessions, Session, SessionEnd};
use tracing::Instrument;

use super::message::{dead_headers, message_from_nats};
use super::topology::{prepare, SetupError};
use crate::metrics::count;
use crate::rabbitmq::{consumer_tag, ConsumeReport};
use crate::{Handled, Handler, RetryDecision, RetryPolicy};

/// How long one pull request waits for messages; also the longest a
/// shutdown waits for a pull in flight to end.
const PULL_WAIT: Duration = Duration::from_secs(1);

/// Bounds every request to the server (PubAck, acks, API calls).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A NATS JetStream consumer driving one [`Handler`].
pub struct NatsConsumer {
    config: ConsumerConfig,
    handler: Arc<dyn Handler>,
    policy: RetryPolicy,
    tag: String,
    /// The handler's last error of messages whose dead copy could not be
    /// stored, by stream sequence, so that the copy stored on a later
    /// delivery still says why (bounded by [`UNSTORED_MEMORY`]).
    unstored: std::sync::Mutex<HashMap<u64, String>>,
}

/// Most messages whose last error [`NatsConsumer`] remembers while their
/// dead copy waits for room; beyond that the copy says only how often the
/// message was delivered.
const UNSTORED_MEMORY: usize = 1024;

impl std::fmt::Debug for NatsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConsumer")
            .field("name", &self.config.name())
            .field("stream", &self.config.queue)
            .field("durable", &self.config.consumer_group())
            .field("url", &self.config.url)
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl NatsConsumer {
    /// A consumer of `config` (a `kind = "nats"` entry) calling `handler`
    /// for every message.
    pub fn new(config: ConsumerConfig, handler: Arc<dyn Handler>) -> Result<Self, Error> {
        if config.kind != ConsumerKind::Nats {
            return Err(Error::config(
                "kind",
                format!("`{}` is not a NATS consumer", config.kind.as_str()),
            ));
        }
        let policy = RetryPolicy::of(&config);
        let tag = consumer_tag(config.consumer_group());
        Ok(NatsConsumer {
            config,
            handler,
            policy,
            tag,
            unstored: Default::default(),
        })
    }

    /// Replaces the connection name (default `{consumer_group}-{host}-{pid}`).
    pub fn with_tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = tag.into();
        self
    }

    /// The connection name (`CONNZ` and `nats server report connections`
    /// show it).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Consumes until `shutdown` is cancelled, then stops pulling, finishes
    /// (and acknowledges) the message in hand, gives back the ones pulled but
    /// not started (nak without delay) and returns. A broken connection is
    /// re-established with a growing pause (0.5 s to 30 s); messages it held
    /// unacknowledged come back after `ack_wait`.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<ConsumeReport, Error> {
        run_sessions(self, shutdown).await
    }

    async fn run_session(
        &self,
        shutdown: &CancellationToken,
        report: &mut ConsumeReport,
        connected: &mut bool,
    ) -> SessionEnd {
        let client = match async_nats::ConnectOptions::new()
            .name(self.tag.clone())
            .request_timeout(Some(REQUEST_TIMEOUT))
            .connect(self.config.url.expose())
            .await
        {
            Ok(c) => c,
            Err(e) => return SessionEnd::Broken(e.to_string()),
        };
        let js = jetstream::ContextBuilder::new()
            .timeout(REQUEST_TIMEOUT)
            .build(client.clone());
        let consumer = match prepare(&js, &self.config).await {
            Ok(c) => c,
            Err(SetupError::Fatal(e)) => return SessionEnd::Fatal(e),
            Err(SetupError::Broken(reason)) => return SessionEnd::Broken(reason),
        };
        *connected = true;
        tracing::info!(
            consumer = self.config.name(),
            stream = %self.config.queue,
            durable = self.config.consumer_group(),
            tag = %self.tag,
            prefetch = self.config.prefetch,
            "consuming"
        );
        let end = self.pull_loop(&consumer, &js, shutdown, report).await;
        // Acks are plain publishes: make sure they left before closing.
        let _ = client.flush().await;
        if matches!(end, SessionEnd::Cancelled) {
            tracing::info!(consumer = self.config.name(), "consumer stopped");
        }
        end
    }

    /// Pulls `prefetch` messages at a time and settles each before pulling
    /// again, so this process never holds more than `prefetch` unacked
    /// messages.
    async fn pull_loop(
        &self,
        consumer: &PullConsumer,
        js: &jetstream::Context,
        shutdown: &CancellationToken,
        report: &mut ConsumeReport,
    ) -> SessionEnd {
        let mut stopping = false;
        loop {
            if stopping || shutdown.is_cancelled() {
                return SessionEnd::Cancelled;
            }
            let mut batch = match consumer
                .batch()
                .max_messages(usize::from(self.config.prefetch))
                .expires(PULL_WAIT)
                .messages()
                .await
            {
                Ok(b) => b,
                Err(e) => return SessionEnd::Broken(format!("pull request: {e}")),
            };
            loop {
                // A pull in flight is never abandoned: a message the server
                // sends after we stopped listening would wait out ack_wait.
                // On shutdown the pull runs to its end and anything it brings
                // is given back at once.
                let next = tokio::select! {
                    biased;
                    _ = shutdown.cancelled(), if !stopping => {
                        stopping = true;
                        continue;
                    }
                    next = tokio::time::timeout(PULL_WAIT + REQUEST_TIMEOUT, batch.next()) => next,
                };
                let message = match next {
                    Err(_) => return SessionEnd::Broken("no answer to a pull request".to_owned()),
                    Ok(None) => break,
                    Ok(Some(Err(e))) => return SessionEnd::Broken(format!("pull: {e}")),
                    Ok(Some(Ok(m))) => m,
                };
                if stopping {
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                    continue;
                }
                if let Err(reason) = self.process(message, js, report).await {
                    return SessionEnd::Broken(reason);
                }
            }
        }
    }

    /// Handles one message to the end: acked, nak'ed with a delay, or copied
    /// to the dead subject and then terminated. An error leaves it unsettled
    /// (the server redelivers it after `ack_wait`).
    async fn process(
        &self,
        m: jetstream::Message,
        js: &jetstream::Context,
        report: &mut ConsumeReport,
    ) -> Result<(), String> {
        let name = self.config.name();
        let (delivered, sequence) = match m.info() {
            Ok(info) => (
                u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX),
                info.stream_sequence,
            ),
            Err(e) => return Err(format!("not a JetStream message: {e}")),
        };
        let message = match message_from_nats(
            m.headers.as_ref(),
            m.subject.as_str(),
            &m.payload,
            delivered,
        ) {
            Ok(msg) => msg,
            Err(reason) => {
                tracing::warn!(consumer = name, reason, "unreadable message: dead-lettered");
                return self.dead(&m, js, None, delivered, &reason, report).await;
            }
        };
        let span =
            tracing::info_span!("event", event_id = %message.event_id(), attempt = message.attempt);
        async {
            if message.attempt > self.policy.max_attempts {
                // Its consumer died during the last attempt: like an expired
                // lease in the relay, that attempt counts.
                let reason = self.remembered_error(sequence).unwrap_or_else(|| {
                    format!(
                        "delivered {} times without a result (its consumers stopped mid-message, or its dead copy could not be stored)",
                        message.attempt
                    )
                });
                return self
                    .dead(
                        &m,
                        js,
                        Some(message.event_id()),
                        message.attempt,
                        &reason,
                        report,
                    )
                    .await;
            }
            match self.handle_keeping_alive(&m, &message).await {
                Ok(handled) => {
                    settle(&m, AckKind::Ack).await?;
                    count(name, handled.as_str());
                    match handled {
                        Handled::Ok => report.ok += 1,
                        Handled::Duplicate => report.duplicate += 1,
                        Handled::Stale => report.stale += 1,
                    }
                    tracing::debug!(consumer = name, result = handled.as_str(), "handled");
                    Ok(())
                }
                Err(e) => match self.policy.decide(message.attempt) {
                    RetryDecision::Retry {
                        delay,
                        next_attempt,
                    } => {
                        settle(&m, AckKind::Nak(Some(delay))).await?;
                        count(name, "retry");
                        report.retry += 1;
                        tracing::warn!(
                            consumer = name,
                            error = %e,
                            retry_in_ms = delay.as_millis() as u64,
                            next_attempt,
                            "handler failed; retrying later"
                        );
                        Ok(())
                    }
                    RetryDecision::Dead => {
                        self.dead(
                            &m,
                            js,
                            Some(message.event_id()),
                            message.attempt,
                            e.message(),
                            report,
                        )
                        .await
                    }
                },
            }
        }
        .instrument(span)
        .await
    }

    /// Runs the handler, telling the server every third of `ack_wait` that
    /// the message is still being worked on, so a slow handler keeps it.
    async fn handle_keeping_alive(
        &self,
        m: &jetstream::Message,
        message: &crate::Message,
    ) -> Result<Handled, crate::HandlerError> {
        let handling = self.handler.handle(message);
        tokio::pin!(handling);
        let every = self.config.ack_wait.get() / 3;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                result = &mut handling => return result,
                _ = ticker.tick() => {
                    let _ = m.ack_with(AckKind::Progress).await;
                }
            }
        }
    }

    /// Publishes a dead copy, waits for its PubAck, then terminates the
    /// original. When the copy cannot be stored the original is nak'ed with a
    /// delay growing from `retry_delay` to `max_retry_delay` and comes back
    /// to be dead-lettered again; `max_deliver` is unlimited, so this never
    /// spends the message's last deliveries.
    async fn dead(
        &self,
        m: &jetstream::Message,
        js: &jetstream::Context,
        event_id: Option<&str>,
        attempt: u32,
        last_error: &str,
        report: &mut ConsumeReport,
    ) -> Result<(), String> {
        let name = self.config.name();
        let subject = self.config.nats_dead_subject();
        let info = m
            .info()
            .map_err(|e| format!("not a JetStream message: {e}"))?;
        let sequence = info.stream_sequence;
        let headers = dead_headers(
            m.headers.as_ref(),
            event_id,
            info.stream,
            sequence,
            self.config.consumer_group(),
            attempt,
            last_error,
        );
        let stored = async {
            js.publish_with_headers(subject.clone(), headers, m.payload.clone())
                .await?
                .await
        }
        .await;
        if let Err(e) = stored {
            // The n-th try at the dead copy waits like the n-th retry.
            let delay = self
                .policy
                .delay_after(attempt.saturating_sub(self.policy.max_attempts).max(1));
            tracing::error!(
                consumer = name,
                dead_subject = %subject,
                error = %e,
                retry_in_ms = delay.as_millis() as u64,
                "the dead copy was not stored (is the dead stream full or without a leader?); the message comes back to be dead-lettered again"
            );
            self.remember_error(sequence, last_error);
            return settle(m, AckKind::Nak(Some(delay))).await;
        }
        self.forget_error(sequence);
        settle(m, AckKind::Term).await?;
        count(name, "dead");
        report.dead += 1;
        tracing::error!(
            consumer = name,
            error = last_error,
            attempt,
            dead_subject = %subject,
            "message dead-lettered"
        );
        Ok(())
    }
}

impl NatsConsumer {
    fn unstored(&self) -> std::sync::MutexGuard<'_, HashMap<u64, String>> {
        self.unstored
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn remember_error(&self, sequence: u64, last_error: &str) {
        let mut unstored = self.unstored();
        if unstored.len() < UNSTORED_MEMORY || unstored.contains_key(&sequence) {
            unstored.insert(sequence, last_error.to_owned());
        }
    }

    fn remembered_error(&self, sequence: u64) -> Option<String> {
        self.unstored().get(&sequence).cloned()
    }

    fn forget_error(&self, sequence: u64) {
        self.unstored().remove(&sequence);
    }
}

/// Acks, naks or terminates `m` and waits for the server to confirm it, so a
/// settled message is settled for sure before the next one is taken.
async fn settle(m: &jetstream::Message, kind: AckKind) -> Result<(), String> {
    m.double_ack_with(kind)
        .await
        .map_err(|e| format!("ack: {e}"))
}

#[async_trait::async_trait]
impl Session for NatsConsumer {
    const BROKER: &'static str = "NATS";

    fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    async fn session(
        &self,
        shutdown: &CancellationToken,
        report: &mut ConsumeReport,
        connected: &mut bool,
    ) -> SessionEnd {
        self.run_session(shutdown, report, connected).await
    }
}
