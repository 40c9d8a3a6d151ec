//! The pull loop: at most `prefetch` messages in hand, ack after success,
//! nak with a growing delay on failure, a confirmed dead copy before the
//! original is terminated, reconnect with backoff.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use postbox_core::config::{nodes, ConsumerConfig, ConsumerKind};
use postbox_core::{BoxFuture, Error};
use tokio_util::sync::CancellationToken;

use super::message::{dead_headers, message_from_nats};
use super::topology::{prepare, SetupError};
use crate::consume::session::{run_sessions, Run, Session, SessionEnd};
use crate::consume::settle::{DeadCopy, Handling, Settled, Transport, Verdict};
use crate::consume::{consumer_basics, ConsumeReport, Core};
use crate::{Handler, Message};

/// How long one pull request waits for messages; also the longest a
/// shutdown waits for a pull in flight to end.
const PULL_WAIT: Duration = Duration::from_secs(1);

/// Bounds every request to the server (PubAck, acks, API calls).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a session's end waits for its acks to leave.
const FLUSH_WITHIN: Duration = Duration::from_secs(2);

/// A NATS JetStream consumer driving one [`Handler`].
///
/// Its tag is its connection name (default `{consumer_group}-{host}-{pid}`,
/// with the config's `name` after the group when it is another;
/// `CONNZ` and `nats server report connections` show it).
pub struct NatsConsumer {
    core: Core,
    /// The handler's last error of messages whose dead copy could not be
    /// stored, by stream sequence, so that the copy stored on a later
    /// delivery still says why (bounded by [`UNSTORED_MEMORY`]).
    unstored: std::sync::Mutex<HashMap<u64, String>>,
}

/// Most messages whose last error [`NatsConsumer`] remembers while their
/// dead copy waits for room; beyond that the copy says only how often the
/// message was delivered.
const UNSTORED_MEMORY: usize = 1024;

consumer_basics!(NatsConsumer, ("stream", Some("durable"), "tag"));

impl NatsConsumer {
    /// A consumer of `config` (a `kind = "nats"` entry) calling `handler`
    /// for every message.
    pub fn new(config: ConsumerConfig, handler: Arc<dyn Handler>) -> Result<Self, Error> {
        nodes::nats_nodes(config.nodes()).map_err(|e| Error::config("url", e))?;
        Ok(NatsConsumer {
            core: Core::new(
                config,
                handler,
                ConsumerKind::Nats,
                "NATS",
                ConsumerConfig::consumer_group,
            )?,
            unstored: Default::default(),
        })
    }

    /// Consumes until `shutdown` is cancelled, then stops pulling, finishes
    /// (and acknowledges) the message in hand, gives back the ones pulled but
    /// not started (nak without delay; one on its last attempt is handled
    /// first, since a nak'd delivery still counts) and returns. A broken connection is
    /// re-established with a growing pause (0.5 s to 30 s); messages it held
    /// unacknowledged come back after `ack_wait`.
    pub fn run(&self, shutdown: CancellationToken) -> BoxFuture<'_, Result<ConsumeReport, Error>> {
        Box::pin(run_sessions(self, shutdown))
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
            if stopping || shutdown.is_cancelled() || !self.core.state.unless_paused(shutdown).await
            {
                return SessionEnd::Cancelled;
            }
            let mut batch = match consumer
                .batch()
                .max_messages(usize::from(self.core.config.prefetch))
                .expires(PULL_WAIT)
                .messages()
                .await
            {
                Ok(b) => b,
                Err(e) => return SessionEnd::Broken(format!("pull request: {e}")),
            };
            // Messages the pull brought while one was in hand, oldest first,
            // told every third of ack_wait (counted from the pull, not from
            // each message taken) that they are still here.
            let mut waiting: VecDeque<jetstream::Message> = VecDeque::new();
            let mut pulled = false;
            let mut pull_failed = None;
            let every = self.core.config.ack_wait.get() / 3;
            let mut keep_alive =
                tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                // A pull in flight is never abandoned: a message the server
                // sends after we stopped listening would wait out ack_wait.
                // On shutdown the pull runs to its end and anything it brings
                // is given back at once, but for a message on its last
                // attempt (handled first, see below).
                let message = match waiting.pop_front() {
                    Some(m) => m,
                    None if pulled => break,
                    None => {
                        let next = tokio::select! {
                            biased;
                            _ = shutdown.cancelled(), if !stopping => {
                                stopping = true;
                                continue;
                            }
                            next = tokio::time::timeout(PULL_WAIT + REQUEST_TIMEOUT, batch.next()) => next,
                        };
                        match next {
                            Err(_) => {
                                return SessionEnd::Broken("no answer to a pull request".to_owned())
                            }
                            Ok(None) => break,
                            Ok(Some(Err(e))) => return SessionEnd::Broken(format!("pull: {e}")),
                            Ok(Some(Ok(m))) => m,
                        }
                    }
                };
                stopping |= shutdown.is_cancelled();
                // Given back, a delivery still counts: JetStream's delivery
                // count is the attempt number, so one on its last attempt
                // would come back past `max_attempts` and be dead-lettered
                // unhandled. It is handled before the stop; the others go
                // back at once.
                let last_attempt = message
                    .info()
                    .is_ok_and(|i| i.delivered >= i64::from(self.core.policy.max_attempts));
                if stopping && !last_attempt {
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                    continue;
                }
                // While it is handled, the rest of the pull is read as it
                // comes and kept alive: `ack_wait` runs for each from its
                // delivery, and the server would hand one that waits past
                // it to another consumer of the group while it is still
                // here (handled twice).
                let work = self.process(message, js, report);
                tokio::pin!(work);
                let done = loop {
                    tokio::select! {
                        done = &mut work => break done,
                        next = batch.next(), if !pulled => match next {
                            Some(Ok(m)) => waiting.push_back(m),
                            Some(Err(e)) => {
                                pulled = true;
                                pull_failed = Some(format!("pull: {e}"));
                            }
                            None => pulled = true,
                        },
                        _ = keep_alive.tick(), if !waiting.is_empty() => {
                            for m in &waiting {
                                let _ = m.ack_with(AckKind::Progress).await;
                            }
                        }
                    }
                };
                if let Err(reason) = done {
                    return SessionEnd::Broken(reason);
                }
                if waiting.is_empty() {
                    if let Some(reason) = pull_failed.take() {
                        return SessionEnd::Broken(reason);
                    }
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
        let info = m
            .info()
            .map_err(|e| format!("not a JetStream message: {e}"))?;
        let delivered = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
        let sequence = info.stream_sequence;
        let stream = info.stream.to_owned();
        let read = message_from_nats(
            m.headers.as_ref(),
            m.subject.as_str(),
            &m.payload,
            delivered,
        );
        let mut in_hand = InHand {
            consumer: self,
            m: &m,
            js,
            stream,
            sequence,
        };
        self.core
            .settle(report, &mut in_hand, read, delivered)
            .await
    }
}

/// The JetStream message in hand and what settles it: acks confirmed by
/// the server, a nak with a delay, a dead copy confirmed by PubAck before
/// the original is terminated, progress signals while the handler runs.
struct InHand<'a> {
    consumer: &'a NatsConsumer,
    m: &'a jetstream::Message,
    js: &'a jetstream::Context,
    stream: String,
    sequence: u64,
}

impl Transport for InHand<'_> {
    async fn verdict(&mut self, message: &Message) -> Verdict {
        let policy = &self.consumer.core.policy;
        if message.attempt <= policy.max_attempts {
            return Verdict::Handle;
        }
        // Its consumer died during the last attempt: like an expired lease
        // in the relay, that attempt counts.
        let reason = self.consumer.remembered_error(self.sequence).unwrap_or_else(|| {
            format!(
                "delivered {} times without a result (its consumers stopped mid-message, or its dead copy could not be stored)",
                message.attempt
            )
        });
        Verdict::Dead {
            attempt: message.attempt,
            reason,
        }
    }

    /// Runs the handler, telling the server every third of `ack_wait` that
    /// the message is still being worked on, so a slow handler keeps it.
    async fn handle(&mut self, handler: &dyn Handler, message: &Message) -> Handling {
        let handling = handler.handle(message);
        tokio::pin!(handling);
        let every = self.consumer.core.config.ack_wait.get() / 3;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                result = &mut handling => return Some(result),
                _ = ticker.tick() => {
                    let _ = self.m.ack_with(AckKind::Progress).await;
                }
            }
        }
    }

    async fn ack(&mut self) -> Result<Settled, String> {
        settle(self.m, AckKind::Ack).await?;
        Ok(Settled::Done)
    }

    async fn retry(&mut self, delay: Duration, _next_attempt: u32) -> Result<Settled, String> {
        // JetStream's delivery count is the next attempt's number.
        settle(self.m, AckKind::Nak(Some(delay))).await?;
        Ok(Settled::Done)
    }

    /// Publishes a dead copy, waits for its PubAck, then terminates the
    /// original. When the copy cannot be stored the original is nak'ed with a
    /// delay growing from `retry_delay` to `max_retry_delay` and comes back
    /// to be dead-lettered again; `max_deliver` is unlimited, so this never
    /// spends the message's last deliveries.
    async fn dead(&mut self, copy: DeadCopy<'_>) -> Result<Settled, String> {
        let consumer = self.consumer;
        let subject = consumer.core.config.nats_dead_subject();
        let headers = dead_headers(
            self.m.headers.as_ref(),
            copy.message.map(Message::event_id),
            self.m.subject.as_str(),
            &self.stream,
            self.sequence,
            consumer.core.config.consumer_group(),
            copy.attempt,
            copy.last_error,
        );
        let stored = async {
            self.js
                .publish_with_headers(subject.clone(), headers, self.m.payload.clone())
                .await?
                .await
        }
        .await;
        if let Err(e) = stored {
            // The n-th try at the dead copy waits like the n-th retry.
            let policy = &consumer.core.policy;
            let tries = copy.attempt.saturating_sub(policy.max_attempts);
            let delay = policy.delay_after(tries.max(1));
            tracing::error!(
                consumer = consumer.core.config.name(),
                dead_subject = %subject,
                error = %e,
                retry_in_ms = delay.as_millis() as u64,
                "the dead copy was not stored (is the dead stream full or without a leader?); the message comes back to be dead-lettered again"
            );
            consumer.remember_error(self.sequence, copy.last_error);
            settle(self.m, AckKind::Nak(Some(delay))).await?;
            return Ok(Settled::NotHere);
        }
        consumer.forget_error(self.sequence);
        settle(self.m, AckKind::Term).await?;
        Ok(Settled::Done)
    }

    fn dead_letters(&self) -> String {
        self.consumer.core.config.nats_dead_subject()
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

impl Session for NatsConsumer {
    fn core(&self) -> &Core {
        &self.core
    }

    async fn session(&self, run: &mut Run<'_>) -> SessionEnd {
        let (options, servers) = match super::connect_options(self.core.config.nodes()) {
            Ok(both) => both,
            Err(e) => return SessionEnd::Fatal(Error::config("url", e)),
        };
        let client = match options
            .name(self.core.tag.clone())
            .request_timeout(Some(REQUEST_TIMEOUT))
            .retain_servers_order()
            .connect(servers)
            .await
        {
            Ok(c) => c,
            Err(e) => return SessionEnd::Broken(e.to_string()),
        };
        let js = jetstream::ContextBuilder::new()
            .timeout(REQUEST_TIMEOUT)
            .build(client.clone());
        let consumer = match prepare(&js, &self.core.config).await {
            Ok(c) => c,
            Err(SetupError::Fatal(e)) => return SessionEnd::Fatal(e),
            Err(SetupError::Broken(reason)) => return SessionEnd::Broken(reason),
        };
        run.up();
        tracing::info!(
            consumer = self.core.config.name(),
            stream = %self.core.config.queue,
            durable = self.core.config.consumer_group(),
            tag = %self.core.tag,
            prefetch = self.core.config.prefetch,
            "consuming"
        );
        let end = self
            .pull_loop(&consumer, &js, run.shutdown, run.report)
            .await;
        // Acks are plain publishes: make sure they left before closing.
        // A client reconnecting to a server that is down holds the flush
        // until the server is back: a stopping consumer does not wait for
        // it (an ack that did not leave is a redelivery, which the
        // consumer's dedupe by event_id absorbs).
        let _ = tokio::time::timeout(FLUSH_WITHIN, client.flush()).await;
        if matches!(end, SessionEnd::Cancelled) {
            tracing::info!(consumer = self.core.config.name(), "consumer stopped");
        }
        end
    }
}
