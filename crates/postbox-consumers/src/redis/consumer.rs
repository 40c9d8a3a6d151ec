//! The read loop: due retries and orphans first (`XPENDING` + `XCLAIM`),
//! then new entries (`XREADGROUP`), one at a time, `XACK` after success.

use std::sync::Arc;
use std::time::Duration;

use postbox_core::config::{ConsumerConfig, ConsumerKind};
use postbox_core::{BoxFuture, Error};
use redis::aio::ConnectionManager;
use redis::streams::{StreamId, StreamRangeReply, StreamReadReply};
use redis::RedisError;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::keeper::{keep_if_mine, Keeper};
use super::message::{dead_fields, message_from_entry};
use super::topology::{connect, create_group, dead_stream, is_refusal, refused};
use crate::consume::session::{run_sessions, Run, Session, SessionEnd};
use crate::consume::settle::{DeadCopy, Handling, Settled, Transport, Verdict};
use crate::consume::{consumer_basics, ConsumeReport, Core};
use crate::{Handler, Message};

/// Longest `XREADGROUP … BLOCK`: also how often due retries are looked for
/// while the stream is quiet, and the longest a shutdown waits.
const MAX_BLOCK: Duration = Duration::from_secs(1);

/// Pending entries looked at per `XPENDING` scan.
const SCAN_BATCH: usize = 100;

/// `XACK`s entry `ARGV[3]` only while group `ARGV[1]` has it pending for
/// consumer `ARGV[2]`; returns 1 if acked, 0 if it is not ours (any more).
const ACK_IF_MINE: &str = r"
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 1 and p[1][2] == ARGV[2] then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
";

/// While group `ARGV[1]` has entry `ARGV[3]` pending for consumer
/// `ARGV[2]`: `XADD`s the field/value pairs `ARGV[4..]` to `KEYS[2]` and
/// `XACK`s the entry, both or neither; returns 1, or 0 if it is not ours.
const DEAD_IF_MINE: &str = r"
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 1 and p[1][2] == ARGV[2] then
  local fields = {}
  for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('XADD', KEYS[2], '*', unpack(fields))
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
";

/// A Redis Streams consumer-group member driving one [`Handler`].
///
/// Its tag is its consumer name within the group (default
/// `{group}-{host}-{pid}`, with the config's `name` after the group when it
/// is another, see `with_tag`; `XINFO CONSUMERS` shows it).
pub struct RedisConsumer {
    core: Core,
}

consumer_basics!(RedisConsumer, ("stream", Some("group"), "consumer"));

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
        Ok(RedisConsumer {
            core: Core::new(
                config,
                handler,
                ConsumerKind::Redis,
                "Redis",
                ConsumerConfig::consumer_group,
            )?,
        })
    }

    /// Consumes until `shutdown` is cancelled, then finishes (and acks) the
    /// entries in hand and returns. A broken connection is re-established
    /// with a growing pause (0.5 s to 30 s); entries left pending are claimed
    /// again once idle for the retry delay.
    pub fn run(&self, shutdown: CancellationToken) -> BoxFuture<'_, Result<ConsumeReport, Error>> {
        Box::pin(run_sessions(self, shutdown))
    }

    fn block(&self) -> Duration {
        self.core.policy.retry_delay.min(MAX_BLOCK)
    }

    async fn connect(&self) -> Result<ConnectionManager, String> {
        connect(self.core.config.url.expose(), self.block()).await
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
        let stream = self.core.config.queue.as_str();
        let group = self.core.config.consumer_group();
        let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .arg("IDLE")
            .arg(self.core.policy.retry_delay.as_millis() as u64)
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
            .take(usize::from(self.core.config.prefetch));
        let mut claimed = Vec::new();
        for p in due {
            let reply: StreamRangeReply = redis::cmd("XCLAIM")
                .arg(stream)
                .arg(group)
                .arg(&self.core.tag)
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
        self.core.policy.delay_after(deliveries.max(1))
    }

    async fn read_new(
        &self,
        conn: &mut ConnectionManager,
    ) -> Result<Vec<(StreamId, u32)>, RedisError> {
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(self.core.config.consumer_group())
            .arg(&self.core.tag)
            .arg("COUNT")
            .arg(self.core.config.prefetch)
            .arg("BLOCK")
            .arg(self.block().as_millis().max(1) as u64)
            .arg("STREAMS")
            .arg(&self.core.config.queue)
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
        keeper: &Keeper,
        entry: &StreamId,
        deliveries: u32,
        held: &[String],
        report: &mut ConsumeReport,
    ) -> Result<(), String> {
        let read = message_from_entry(&entry.map, deliveries);
        let mut in_hand = InHand {
            consumer: self,
            conn,
            keeper,
            entry,
            held,
        };
        self.core
            .settle(report, &mut in_hand, read, deliveries)
            .instrument(tracing::info_span!("entry", id = %entry.id))
            .await
    }

    /// How often the entries in hand are kept: a third of the retry delay,
    /// the shortest idle time after which another consumer may claim them.
    fn keep_every(&self) -> Duration {
        (self.core.policy.retry_delay / 3).max(Duration::from_millis(10))
    }

    /// On shutdown, a consumer that holds nothing leaves the group, so
    /// `XINFO CONSUMERS` does not fill up with one name per past process.
    async fn leave(&self, conn: &mut ConnectionManager) {
        let mine: Result<Vec<(String, String, u64, u64)>, RedisError> = redis::cmd("XPENDING")
            .arg(&self.core.config.queue)
            .arg(self.core.config.consumer_group())
            .arg("-")
            .arg("+")
            .arg(1)
            .arg(&self.core.tag)
            .query_async(conn)
            .await;
        if matches!(mine, Ok(ref rows) if rows.is_empty()) {
            let _: Result<i64, RedisError> = redis::cmd("XGROUP")
                .arg("DELCONSUMER")
                .arg(&self.core.config.queue)
                .arg(self.core.config.consumer_group())
                .arg(&self.core.tag)
                .query_async(conn)
                .await;
        }
    }

    fn broken_or_refused(&self, e: RedisError) -> SessionEnd {
        // With `declare`, a group gone mid-run (`XGROUP DESTROY`, the key
        // deleted, a failover to a replica that never had it) is made again
        // by the next session's set-up: not a reason to stop every
        // consumer of the process.
        let made_again = self.core.config.declare && e.code() == Some("NOGROUP");
        if is_refusal(&e) && !made_again {
            SessionEnd::Fatal(refused(&self.core.config, &e))
        } else {
            SessionEnd::Broken(e.to_string())
        }
    }
}

/// The entry in hand and what settles it: `XACK`, the dead copy and the
/// pending list, each only while the entry is still this consumer's (a
/// consumer that stalled longer than the retry delay may have lost it to
/// another, which then settles it).
struct InHand<'a> {
    consumer: &'a RedisConsumer,
    conn: &'a mut ConnectionManager,
    keeper: &'a Keeper,
    entry: &'a StreamId,
    /// The other entries of the batch, kept while this one is handled.
    held: &'a [String],
}

impl Transport for InHand<'_> {
    async fn verdict(&mut self, message: &Message) -> Verdict {
        if message.attempt > self.consumer.core.policy.max_attempts {
            return Verdict::Dead {
                attempt: message.attempt,
                reason: format!(
                    "delivered {} times without a result (its consumers stopped mid-message)",
                    message.attempt
                ),
            };
        }
        if self.keeper.was_lost(&self.entry.id) {
            tracing::warn!(
                consumer = self.consumer.core.config.name(),
                "the entry was claimed by another consumer while it waited in this consumer's batch: not handled here"
            );
            return Verdict::Skip;
        }
        Verdict::Handle
    }

    /// Runs the handler while the keeper resets the entry's idle time, so no
    /// other consumer claims it for a due retry meanwhile.
    async fn handle(&mut self, handler: &dyn Handler, message: &Message) -> Handling {
        let id = &self.entry.id;
        let mut in_hand: Vec<String> = self.held.to_vec();
        in_hand.push(id.clone());
        self.keeper.hold(&in_hand);
        let result = handler.handle(message).await;
        let lost = self.keeper.was_lost(id);
        self.keeper.hold(self.held);
        if lost {
            self.lost(match &result {
                Ok(h) => h.as_str(),
                Err(_) => "error",
            });
            return None;
        }
        Some(result)
    }

    /// `XACK`s the entry if it is still pending for this consumer.
    async fn ack(&mut self) -> Result<Settled, String> {
        let c = self.consumer;
        let acked: i64 = redis::cmd("EVAL")
            .arg(ACK_IF_MINE)
            .arg(1)
            .arg(&c.core.config.queue)
            .arg(c.core.config.consumer_group())
            .arg(&c.core.tag)
            .arg(&self.entry.id)
            .query_async(self.conn)
            .await
            .map_err(|e| e.to_string())?;
        if acked != 1 {
            self.lost("handled");
            return Ok(Settled::NotHere);
        }
        Ok(Settled::Done)
    }

    /// Leaves the entry pending: it is claimed again once idle for the
    /// delay, which runs from now, not from the delivery, so its idle time
    /// is reset (`XCLAIM … JUSTID`: no delivery counted).
    async fn retry(&mut self, _delay: Duration, _next_attempt: u32) -> Result<Settled, String> {
        let c = self.consumer;
        let lost = keep_if_mine(
            self.conn,
            &c.core.config.queue,
            c.core.config.consumer_group(),
            &c.core.tag,
            std::slice::from_ref(&self.entry.id),
        )
        .await
        .map_err(|e| e.to_string())?;
        if !lost.is_empty() {
            self.lost("error");
            return Ok(Settled::NotHere);
        }
        Ok(Settled::Done)
    }

    /// `XADD <stream>.dead` and `XACK` the original in one script, only
    /// while the entry is still this consumer's: no duplicate dead copy, no
    /// lost one.
    async fn dead(&mut self, copy: DeadCopy<'_>) -> Result<Settled, String> {
        let c = self.consumer;
        let fields = dead_fields(
            &self.entry.map,
            &self.entry.id,
            c.core.config.consumer_group(),
            copy.attempt,
            copy.last_error,
        );
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(DEAD_IF_MINE)
            .arg(2)
            .arg(&c.core.config.queue)
            .arg(dead_stream(&c.core.config.queue))
            .arg(c.core.config.consumer_group())
            .arg(&c.core.tag)
            .arg(&self.entry.id);
        for (k, v) in &fields {
            cmd.arg(k).arg(v.as_slice());
        }
        let stored: i64 = cmd
            .query_async(self.conn)
            .await
            .map_err(|e| e.to_string())?;
        if stored != 1 {
            tracing::warn!(
                consumer = c.core.config.name(),
                "the entry was claimed by another consumer before it could be dead-lettered here: its owner settles it"
            );
            return Ok(Settled::NotHere);
        }
        Ok(Settled::Done)
    }

    fn dead_letters(&self) -> String {
        dead_stream(&self.consumer.core.config.queue)
    }
}

impl InHand<'_> {
    /// The handler finished an entry that another consumer took over
    /// meanwhile (this one stalled longer than the retry delay): the result
    /// is not this consumer's to settle; the owner does.
    fn lost(&self, result: &str) {
        tracing::warn!(
            consumer = self.consumer.core.config.name(),
            result,
            "the entry was claimed by another consumer while the handler ran (stalled longer than the retry delay?): its result is not acknowledged here"
        );
    }
}

impl Session for RedisConsumer {
    fn core(&self) -> &Core {
        &self.core
    }

    async fn session(&self, run: &mut Run<'_>) -> SessionEnd {
        let mut conn = match self.connect().await {
            Ok(c) => c,
            Err(e) => return SessionEnd::Broken(e),
        };
        let stream = self.core.config.queue.as_str();
        let group = self.core.config.consumer_group();
        if self.core.config.declare {
            // Refused for good only for a cause that stays (a key that is
            // not a stream, no permission); a server loading its data
            // after a restart (`LOADING`), a replica after a failover
            // (`READONLY`) or a lost connection are waited out.
            if let Err(e) = create_group(&mut conn, stream, group).await {
                return self.broken_or_refused(e);
            }
        }
        let keeper = match Keeper::start(
            self.core.config.url.expose().to_owned(),
            stream.to_owned(),
            group.to_owned(),
            self.core.tag.clone(),
            self.keep_every(),
        ) {
            Ok(k) => k,
            Err(e) => return SessionEnd::Broken(e),
        };
        run.up();
        tracing::info!(
            consumer = self.core.config.name(),
            stream,
            group,
            name = %self.core.tag,
            prefetch = self.core.config.prefetch,
            "consuming"
        );
        let mut cursor = "-".to_owned();
        loop {
            // Nothing in hand here: a paused consumer waits before reading.
            if run.shutdown.is_cancelled() || !self.core.state.unless_paused(run.shutdown).await {
                self.leave(&mut conn).await;
                tracing::info!(consumer = self.core.config.name(), "consumer stopped");
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
                    .process(&mut conn, &keeper, &entry, deliveries, &held, run.report)
                    .await
                {
                    return SessionEnd::Broken(e);
                }
            }
        }
    }
}
