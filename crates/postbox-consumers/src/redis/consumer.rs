//! The read loop: due retries and orphans first (`XPENDING` + `XCLAIM`),
//! then new entries (`XREADGROUP`), one at a time, `XACK` after success.

use std::sync::Arc;
use std::time::Duration;

use postbox_core::config::{ConsumerConfig, ConsumerKind};
use postbox_core::redact::redact_url;
use postbox_core::Error;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamId, StreamRangeReply, StreamReadReply};
use redis::RedisError;
use tokio_util::sync::CancellationToken;

use crate::session::{run_sessions, Session, SessionEnd};
use tracing::Instrument;

use super::entry::{dead_fields, message_from_entry};
use crate::metrics::count;
use crate::rabbitmq::{consumer_tag, ConsumeReport};
use crate::{Handled, Handler, RetryDecision, RetryPolicy};

/// Longest `XREADGROUP … BLOCK`: also how often due retries are looked for
/// while the stream is quiet, and the longest a shutdown waits.
const MAX_BLOCK: Duration = Duration::from_secs(1);

/// Pending entries looked at per `XPENDING` scan.
const SCAN_BATCH: usize = 100;

/// `<stream>.dead`: where an entry goes after `max_attempts` deliveries.
pub fn dead_stream(stream: &str) -> String {
    format!("{stream}.dead")
}

/// A Redis Streams consumer-group member driving one [`Handler`].
pub struct RedisConsumer {
    config: ConsumerConfig,
    handler: Arc<dyn Handler>,
    policy: RetryPolicy,
    name: String,
}

impl std::fmt::Debug for RedisConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConsumer")
            .field("name", &self.config.name())
            .field("stream", &self.config.queue)
            .field("group", &self.config.consumer_group())
            .field("url", &self.config.url)
            .field("consumer", &self.name)
            .finish_non_exhaustive()
    }
}

/// A pending entry as `XPENDING` reports it.
struct Pending {
    id: String,
    idle_ms: u64,
    deliveries: u32,
}

impl RedisConsumer {
    /// A consumer of `config` (a `kind = "redis"` entry: `queue` is the
    /// stream, `consumer_group` the group) calling `handler` for every entry.
    pub fn new(config: ConsumerConfig, handler: Arc<dyn Handler>) -> Result<Self, Error> {
        if config.kind != ConsumerKind::Redis {
            return Err(Error::config(
                "kind",
                format!("`{}` is not a Redis consumer", config.kind.as_str()),
            ));
        }
        let policy = RetryPolicy::of(&config);
        let name = consumer_tag(config.consumer_group());
        Ok(RedisConsumer {
            config,
            handler,
            policy,
            name,
        })
    }

    /// Replaces the consumer name (default `{group}-{host}-{pid}`); a process
    /// running several consumers in one group gives each its own.
    pub fn with_tag(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The consumer name within the group (`XINFO CONSUMERS` shows it).
    pub fn tag(&self) -> &str {
        &self.name
    }

    /// Consumes until `shutdown` is cancelled, then finishes (and acks) the
    /// entries in hand and returns. A broken connection is re-established
    /// with a growing pause (0.5 s to 30 s); entries left pending are claimed
    /// again once idle for the retry delay.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<ConsumeReport, Error> {
        run_sessions(self, shutdown).await
    }

    fn block(&self) -> Duration {
        self.policy.retry_delay.min(MAX_BLOCK)
    }

    async fn connect(&self) -> Result<ConnectionManager, String> {
        let client = redis::Client::open(self.config.url.expose()).map_err(|e| e.to_string())?;
        let io = Duration::from_secs(5);
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(io))
            .set_response_timeout(Some(io + self.block()))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| e.to_string())
    }

    async fn run_session(
        &self,
        shutdown: &CancellationToken,
        report: &mut ConsumeReport,
        connected: &mut bool,
    ) -> SessionEnd {
        let mut conn = match self.connect().await {
            Ok(c) => c,
            Err(e) => return SessionEnd::Broken(e),
        };
        let stream = self.config.queue.as_str();
        let group = self.config.consumer_group();
        if self.config.declare {
            // From `0`: a new group also gets what the stream already holds,
            // as a durable NATS consumer does.
            let created: Result<(), RedisError> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(stream)
                .arg(group)
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut conn)
                .await;
            match created {
                Ok(()) => tracing::info!(stream, group, "created Redis consumer group"),
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => return self.refused(e),
            }
        }
        *connected = true;
        tracing::info!(
            consumer = self.config.name(),
            stream,
            group,
            name = %self.name,
            prefetch = self.config.prefetch,
            "consuming"
        );
        let mut cursor = "-".to_owned();
        loop {
            if shutdown.is_cancelled() {
                self.leave(&mut conn).await;
                tracing::info!(consumer = self.config.name(), "consumer stopped");
                return SessionEnd::Cancelled;
            }
            let claimed = match self.claim_due(&mut conn, &mut cursor).await {
                Ok(c) => c,
                Err(e) => return self.broken_or_refused(e),
            };
            let batch = if claimed.is_empty() {
                match self.read_new(&mut conn).await {
                    Ok(b) => b,
                    Err(e) => return self.broken_or_refused(e),
                }
            } else {
                claimed
            };
            // Entries in hand are finished even during a shutdown: they are
            // already ours, and another consumer could only have them after
            // the retry delay.
            let mut held: Vec<String> = batch.iter().map(|(e, _)| e.id.clone()).collect();
            for (entry, deliveries) in batch {
                held.retain(|id| *id != entry.id);
                if let Err(e) = self
                    .process(&mut conn, entry, deliveries, &held, report)
                    .await
                {
                    return SessionEnd::Broken(e.to_string());
                }
            }
        }
    }

    /// Entries of this group that have waited their retry delay (failed
    /// here or elsewhere, or held by a consumer that died), claimed for this
    /// consumer: at most `prefetch`. The delay of an entry delivered `n`
    /// times is `retry_delay × 2^(n-1)`, so each entry's own count is read
    /// with `XPENDING … IDLE` before `XCLAIM` (whose min-idle guard makes one
    /// consumer win a race). `XAUTOCLAIM` takes one idle time for all
    /// entries and could not honour the growing delay.
    async fn claim_due(
        &self,
        conn: &mut ConnectionManager,
        cursor: &mut String,
    ) -> Result<Vec<(StreamId, u32)>, RedisError> {
        let stream = self.config.queue.as_str();
        let group = self.config.consumer_group();
        let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .arg("IDLE")
            .arg(self.policy.retry_delay.as_millis() as u64)
            .arg(cursor.as_str())
            .arg("+")
            .arg(SCAN_BATCH)
            .query_async(conn)
            .await?;
        *cursor = match rows.last() {
            Some((id, ..)) if rows.len() == SCAN_BATCH => format!("({id}"),
            _ => "-".to_owned(),
        };
        let due = rows
            .into_iter()
            .map(|(id, _owner, idle_ms, deliveries)| Pending {
                id,
                idle_ms,
                deliveries: u32::try_from(deliveries).unwrap_or(u32::MAX),
            })
            .filter(|p| u128::from(p.idle_ms) >= self.due_after(p.deliveries).as_millis())
            .take(usize::from(self.config.prefetch));
        let mut claimed = Vec::new();
        for p in due {
            let reply: StreamRangeReply = redis::cmd("XCLAIM")
                .arg(stream)
                .arg(group)
                .arg(&self.name)
                .arg(self.due_after(p.deliveries).as_millis() as u64)
                .arg(&p.id)
                .query_async(conn)
                .await?;
            // Empty: another consumer won, or the entry was trimmed away
            // (Redis then drops it from the pending list).
            for entry in reply.ids {
                claimed.push((entry, p.deliveries.saturating_add(1)));
            }
        }
        Ok(claimed)
    }

    /// How long an entry delivered `deliveries` times waits before it is
    /// tried again.
    fn due_after(&self, deliveries: u32) -> Duration {
        self.policy.delay_after(deliveries.max(1))
    }

    async fn read_new(
        &self,
        conn: &mut ConnectionManager,
    ) -> Result<Vec<(StreamId, u32)>, RedisError> {
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(self.config.consumer_group())
            .arg(&self.name)
            .arg("COUNT")
            .arg(self.config.prefetch)
            .arg("BLOCK")
            .arg(self.block().as_millis().max(1) as u64)
            .arg("STREAMS")
            .arg(&self.config.queue)
            .arg(">")
            .query_async(conn)
            .await?;
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .map(|e| (e, 1))
            .collect())
    }

    /// Handles one entry to the end: acked, left pending for a retry, or
    /// copied to `<stream>.dead` and then acked.
    async fn process(
        &self,
        conn: &mut ConnectionManager,
        entry: StreamId,
        deliveries: u32,
        held: &[String],
        report: &mut ConsumeReport,
    ) -> Result<(), RedisError> {
        let name = self.config.name();
        let message = match message_from_entry(&entry.map, deliveries) {
            Ok(m) => m,
            Err(reason) => {
                tracing::warn!(consumer = name, id = %entry.id, reason, "unreadable entry: dead-lettered");
                return self.dead(conn, &entry, deliveries, &reason, report).await;
            }
        };
        let span =
            tracing::info_span!("event", event_id = %message.event_id(), attempt = message.attempt);
        async {
            if message.attempt > self.policy.max_attempts {
                let reason = format!(
                    "delivered {} times without a result (its consumers stopped mid-message)",
                    message.attempt
                );
                return self
                    .dead(conn, &entry, message.attempt, &reason, report)
                    .await;
            }
            let mut in_hand: Vec<String> = held.to_vec();
            in_hand.push(entry.id.clone());
            match self.handle_keeping_alive(conn, &message, &in_hand).await {
                Ok(handled) => {
                    self.ack(conn, &entry.id).await?;
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
                        // Left pending; the delay runs from now, not from
                        // the delivery.
                        self.touch(conn, std::slice::from_ref(&entry.id)).await?;
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
                        self.dead(conn, &entry, message.attempt, e.message(), report)
                            .await
                    }
                },
            }
        }
        .instrument(span)
        .await
    }

    /// Runs the handler while resetting the idle time of the entries in
    /// hand every third of the retry delay, so that no other consumer takes
    /// them for due retries while they are being worked on.
    async fn handle_keeping_alive(
        &self,
        conn: &mut ConnectionManager,
        message: &crate::Message,
        in_hand: &[String],
    ) -> Result<Handled, crate::HandlerError> {
        let handling = self.handler.handle(message);
        tokio::pin!(handling);
        let every = (self.policy.retry_delay / 3).max(Duration::from_millis(10));
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                result = &mut handling => return result,
                _ = ticker.tick() => {
                    if let Err(e) = self.touch(conn, in_hand).await {
                        tracing::debug!(error = %e, "could not keep the entries in hand");
                    }
                }
            }
        }
    }

    /// `XCLAIM … JUSTID` to this consumer: resets the idle time without
    /// counting a delivery.
    async fn touch(&self, conn: &mut ConnectionManager, ids: &[String]) -> Result<(), RedisError> {
        if ids.is_empty() {
            return Ok(());
        }
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(&self.config.queue)
            .arg(self.config.consumer_group())
            .arg(&self.name)
            .arg(0)
            .arg(ids)
            .arg("JUSTID")
            .query_async(conn)
            .await?;
        Ok(())
    }

    async fn ack(&self, conn: &mut ConnectionManager, id: &str) -> Result<(), RedisError> {
        let _: i64 = redis::cmd("XACK")
            .arg(&self.config.queue)
            .arg(self.config.consumer_group())
            .arg(id)
            .query_async(conn)
            .await?;
        Ok(())
    }

    /// `XADD <stream>.dead`, then `XACK` the original: a crash in between
    /// leaves it pending, to be dead-lettered again (a duplicate dead copy,
    /// never a lost one).
    async fn dead(
        &self,
        conn: &mut ConnectionManager,
        entry: &StreamId,
        attempt: u32,
        last_error: &str,
        report: &mut ConsumeReport,
    ) -> Result<(), RedisError> {
        let dead = dead_stream(&self.config.queue);
        let fields = dead_fields(
            &entry.map,
            &entry.id,
            self.config.consumer_group(),
            attempt,
            last_error,
        );
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&dead).arg("*");
        for (k, v) in &fields {
            cmd.arg(k).arg(v.as_slice());
        }
        let _: String = cmd.query_async(conn).await?;
        self.ack(conn, &entry.id).await?;
        count(self.config.name(), "dead");
        report.dead += 1;
        tracing::error!(
            consumer = self.config.name(),
            id = %entry.id,
            error = last_error,
            attempt,
            dead_stream = %dead,
            "entry dead-lettered"
        );
        Ok(())
    }

    /// On shutdown, a consumer that holds nothing leaves the group, so
    /// `XINFO CONSUMERS` does not fill up with one name per past process.
    async fn leave(&self, conn: &mut ConnectionManager) {
        let mine: Result<Vec<(String, String, u64, u64)>, RedisError> = redis::cmd("XPENDING")
            .arg(&self.config.queue)
            .arg(self.config.consumer_group())
            .arg("-")
            .arg("+")
            .arg(1)
            .arg(&self.name)
            .query_async(conn)
            .await;
        if matches!(mine, Ok(ref rows) if rows.is_empty()) {
            let _: Result<i64, RedisError> = redis::cmd("XGROUP")
                .arg("DELCONSUMER")
                .arg(&self.config.queue)
                .arg(self.config.consumer_group())
                .arg(&self.name)
                .query_async(conn)
                .await;
        }
    }

    fn broken_or_refused(&self, e: RedisError) -> SessionEnd {
        if e.code() == Some("NOGROUP")
            || e.code() == Some("WRONGTYPE")
            || e.code() == Some("NOPERM")
        {
            self.refused(e)
        } else {
            SessionEnd::Broken(e.to_string())
        }
    }

    fn refused(&self, e: RedisError) -> SessionEnd {
        let hint = match e.code() {
            Some("NOGROUP") => "create the group (XGROUP CREATE … MKSTREAM), or set declare = true",
            Some("WRONGTYPE") => "the key exists and is not a stream: choose another queue",
            _ => "check the user's permissions",
        };
        SessionEnd::Fatal(Error::config(
            "queue",
            format!(
                "Redis refused group `{}` on stream `{}`: {} ({hint})",
                self.config.consumer_group(),
                self.config.queue,
                redact_url(&e.to_string())
            ),
        ))
    }
}

#[async_trait::async_trait]
impl Session for RedisConsumer {
    const BROKER: &'static str = "Redis";

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
