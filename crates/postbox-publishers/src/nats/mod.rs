//! `kind = "nats"`: NATS JetStream (SPEC §4). The body is the payload; the
//! subject comes from the `subject` template; the metadata rides in headers,
//! the event id in `x-event-id` (what consumers dedupe by). An event counts
//! as delivered only on the stream's PubAck; a PubAck marked `duplicate` is
//! delivered too, and counted in `postbox_publish_duplicates_total`.
//!
//! The dedupe key (`Nats-Msg-Id`), the subject rules and the subjects a
//! stream must capture are the wire contract's, shared with the consumer:
//! see [`postbox_core::wire::nats`]. `declare = true` creates the stream
//! with the subject filter [`stream_subjects`] gives.

use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, stream};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use async_trait::async_trait;
use bytes::Bytes;
use futures::future::join_all;

use postbox_core::config::nodes::{self, NatsCredentials};
use postbox_core::config::NatsPublisherConfig;
use postbox_core::publish::{Delivery, PublishError, PublishResults};
use postbox_core::redact::redact_url;
use postbox_core::template::Template;
use postbox_core::wire::{self, nats};
use postbox_core::{Error, Publisher, Result};

pub use postbox_core::wire::nats::{msg_id, stream_subjects, subject_for};

/// Events sent before their PubAcks are awaited. The JetStream context
/// lets 5,000 acks be in flight and makes a publish past them wait for a
/// free place, which only an awaited ack gives back: a batch sent whole
/// before awaiting any stalled past 5,000 events (a `batch_size` of 6,000,
/// or 2,500 beside the acks a timed-out batch left), every event then
/// timing out although the stream had most of them.
const ACK_WINDOW: usize = 1_000;

/// How long a publish waits for its PubAck. While the client is
/// disconnected, messages wait in its buffer and the ack times out into a
/// retryable failure instead of hanging.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// One sent event: the PubAck to await, or why it could not be sent.
type Sent = std::result::Result<jetstream::context::PublishAckFuture, PublishError>;

/// Publishes to a JetStream stream and awaits each PubAck.
pub struct NatsPublisher {
    name: String,
    subject: Template,
    stream: String,
    client: async_nats::Client,
    js: jetstream::Context,
}

impl NatsPublisher {
    /// Connects, then checks that the stream exists, creating it when
    /// `declare = true`.
    pub async fn connect(config: &NatsPublisherConfig) -> Result<Self> {
        let name = config.name.clone().unwrap_or_else(|| "nats".to_owned());
        // A cluster's nodes in the order given (the client also learns the
        // others from the server); on a lost connection it moves on to the
        // next live one.
        // The credentials the URLs carry, set on the options: the client
        // reads none from a URL.
        let (servers, credentials) =
            nodes::nats_nodes(config.nodes()).map_err(|e| start_error(&name, &config.url, e))?;
        let options = match credentials {
            Some(NatsCredentials::UserPassword(user, password)) => {
                async_nats::ConnectOptions::new().user_and_password(user, password)
            }
            Some(NatsCredentials::Token(token)) => async_nats::ConnectOptions::new().token(token),
            None => async_nats::ConnectOptions::new(),
        };
        let client = options
            .name(format!("postbox publisher {name}"))
            .retain_servers_order()
            .connect(servers)
            .await
            .map_err(|e| start_error(&name, &config.url, format!("cannot connect: {e}")))?;
        // A PubAck dropped unawaited (a batch past its deadline) keeps its
        // place among the acks in flight no longer than an awaited one.
        let js = jetstream::ContextBuilder::new()
            .timeout(ACK_TIMEOUT)
            .ack_timeout(ACK_TIMEOUT)
            .build(client.clone());
        let publisher = NatsPublisher {
            name,
            subject: config.subject.clone(),
            stream: config.stream.clone(),
            client,
            js,
        };
        publisher.ensure_stream(config).await?;
        Ok(publisher)
    }

    async fn ensure_stream(&self, config: &NatsPublisherConfig) -> Result<()> {
        match self.js.get_stream(&self.stream).await {
            Ok(_) => Ok(()),
            Err(e) if is_stream_not_found(&e) => {
                if !config.declare {
                    return Err(Error::config(
                        "stream",
                        format!(
                            "publisher `{}`: JetStream stream `{}` does not exist: create it (capturing `{}`) or set `declare = true`",
                            self.name,
                            self.stream,
                            stream_subjects(&self.subject)
                        ),
                    ));
                }
                let subjects = stream_subjects(&self.subject);
                self.js
                    .create_stream(stream::Config {
                        name: self.stream.clone(),
                        subjects: vec![subjects.clone()],
                        storage: stream::StorageType::File,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| {
                        start_error(
                            &self.name,
                            &config.url,
                            format!(
                                "cannot create stream `{}` for subjects `{subjects}`: {e}",
                                self.stream
                            ),
                        )
                    })?;
                tracing::info!(publisher = %self.name, stream = %self.stream, subjects = %subjects, "created JetStream stream");
                Ok(())
            }
            Err(e) => Err(start_error(
                &self.name,
                &config.url,
                format!("cannot look up stream `{}`: {e}", self.stream),
            )),
        }
    }

    /// The subject `d` is published on.
    pub fn subject_of(&self, d: &Delivery<'_>) -> String {
        subject_for(&self.subject, d.record)
    }

    fn headers(&self, d: &Delivery<'_>) -> std::result::Result<HeaderMap, String> {
        let r = d.record;
        let mut h = HeaderMap::new();
        let mut put = |k: &str, v: &str| -> std::result::Result<(), String> {
            let name: HeaderName = k
                .parse()
                .map_err(|_| format!("header name `{k}` is not valid in NATS"))?;
            let value: HeaderValue = v
                .parse()
                .map_err(|_| format!("header `{k}` has a value NATS refuses (line break)"))?;
            h.insert(name, value);
            Ok(())
        };
        for (k, v) in d.headers() {
            // `Nats-…` headers are JetStream's own: it acts on them when
            // storing (`Nats-TTL` expires the message unread,
            // `Nats-Expected-*` and `Nats-Rollup` refuse or purge), and a
            // consumer never sees them. A producer's are left out.
            if k.len() >= 5 && k[..5].eq_ignore_ascii_case("nats-") {
                tracing::warn!(
                    publisher = %self.name,
                    event_id = %r.event_id,
                    header = %k,
                    "a producer's header named Nats-… is JetStream's own and is not sent"
                );
                continue;
            }
            match v {
                serde_json::Value::String(s) => put(&k, &s)?,
                other => put(&k, &other.to_string())?,
            }
        }
        put(nats::MSG_ID, &msg_id(r))?;
        put(wire::EVENT_ID, &r.event_id)?;
        put(wire::EVENT_TYPE, &r.event_type)?;
        put(wire::APP_CODE, &r.app_code)?;
        if let Some(a) = &r.aggregate_id {
            put(wire::AGGREGATE_ID, a)?;
        }
        if let Some(v) = r.aggregate_version {
            put(wire::AGGREGATE_VERSION, &v.to_string())?;
        }
        put(wire::CREATED_AT_MS, &r.created_at_ms.to_string())?;
        put(wire::ATTEMPT, &d.attempt.to_string())?;
        if d.replayed {
            put(wire::REPLAYED, "true")?;
        }
        Ok(h)
    }

    /// Sends a window of the batch first (the acks are awaited afterwards:
    /// one round trip for the window rather than one per event); per event
    /// its subject and the PubAck to await, or why it could not be sent.
    async fn send_all(&self, batch: &[Delivery<'_>]) -> Vec<(String, Sent)> {
        let mut pending = Vec::with_capacity(batch.len());
        for d in batch {
            let subject = self.subject_of(d);
            let sent = match self.headers(d) {
                Err(m) => Err(PublishError::failed(format!(
                    "event {}: {m}",
                    d.record.event_id
                ))),
                Ok(headers) => {
                    let body = Bytes::from(d.record.payload.clone().into_bytes());
                    self.js
                        .publish_with_headers(subject.clone(), headers, body)
                        .await
                        .map_err(|e| self.publish_error(&subject, &e))
                }
            };
            pending.push((subject, sent));
        }
        pending
    }

    /// The result of one sent event: delivered on its PubAck (a duplicate
    /// too, counted).
    async fn await_ack(
        &self,
        subject: String,
        sent: Sent,
    ) -> std::result::Result<(), PublishError> {
        let ack = sent?.await.map_err(|e| self.publish_error(&subject, &e))?;
        if ack.stream != self.stream {
            // Stored, but where this publisher's consumers do not read.
            return Err(PublishError::failed(format!(
                "subject `{subject}` is captured by stream `{}`, not `{}`: the event is stored there, where consumers of `{}` never see it (fix `subject` or the streams' subjects); will retry",
                ack.stream, self.stream, self.stream
            )));
        }
        if ack.duplicate {
            metrics::counter!("postbox_publish_duplicates_total", "publisher" => self.name.clone())
                .increment(1);
        }
        Ok(())
    }

    fn publish_error(&self, subject: &str, e: &jetstream::context::PublishError) -> PublishError {
        let message = match e.kind() {
            // NATS answers "no responders" both when no stream captures
            // the subject and, in a cluster, while the stream elects a new
            // leader after losing a node.
            PublishErrorKind::StreamNotFound => format!(
                "no JetStream stream answered for subject `{subject}` (expected stream `{}`): no stream captures it (fix `subject` or the stream's subjects), or in a cluster the stream is electing a new leader; will retry",
                self.stream
            ),
            PublishErrorKind::TimedOut => format!(
                "no PubAck for `{subject}` within {ACK_TIMEOUT:?} (NATS unreachable or the stream is slow); will retry"
            ),
            _ => format!("publishing to `{subject}` failed: {e}"),
        };
        PublishError::failed(message)
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<std::result::Result<(), PublishError>> {
        let mut results = Vec::with_capacity(batch.len());
        for window in batch.chunks(ACK_WINDOW) {
            let pending = self.send_all(window).await;
            results.extend(
                join_all(
                    pending
                        .into_iter()
                        .map(|(subject, sent)| self.await_ack(subject, sent)),
                )
                .await,
            );
        }
        results
    }

    /// Every event's result is recorded as soon as its PubAck (or error)
    /// arrives; the acks that came before `publish_timeout` count, only the
    /// events still waiting for theirs time out.
    async fn publish_each(
        &self,
        batch: &[Delivery<'_>],
        publish_timeout: Duration,
        results: &PublishResults,
    ) {
        let work =
            async {
                for (w, window) in batch.chunks(ACK_WINDOW).enumerate() {
                    let pending = self.send_all(window).await;
                    join_all(pending.into_iter().enumerate().map(
                        |(i, (subject, sent))| async move {
                            results.set(w * ACK_WINDOW + i, self.await_ack(subject, sent).await);
                        },
                    ))
                    .await;
                }
            };
        let _ = tokio::time::timeout(publish_timeout, work).await;
    }

    fn connected(&self) -> Option<bool> {
        let state = self.client.connection_state();
        Some(state == async_nats::connection::State::Connected)
    }

    async fn close(&self) {
        if let Err(e) = self.client.flush().await {
            tracing::debug!(publisher = %self.name, error = %e, "flush at close failed");
        }
    }
}

fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    use jetstream::context::GetStreamErrorKind;
    matches!(e.kind(), GetStreamErrorKind::JetStream(j) if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

fn start_error(name: &str, url: &postbox_core::redact::SecretUrl, reason: String) -> Error {
    Error::Io {
        context: format!("publisher `{name}` at {url}"),
        source: std::io::Error::other(redact_url(&reason)),
    }
}
