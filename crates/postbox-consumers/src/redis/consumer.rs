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

/// Connects with bounded waits; `block` is the longest `BLOCK` the
/// connection's commands use.
async fn connect(url: &str, block: Duration) -> Result<ConnectionManager, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let io = Duration::from_secs(5);
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(io))
        .set_response_timeout(Some(io + block))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(1));
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| e.to_string())
}

/// Resets the idle time (`XCLAIM … 0 … JUSTID`, no delivery counted) of the
/// entries in `ARGV[3..]` that group `ARGV[1]` still has pending for
/// consumer `ARGV[2]`; returns the others (now another consumer's, or no
/// longer pending). Atomic: an entry another consumer has claimed is never
/// taken back.
const KEEP_IF_MINE: &str = r"
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
";

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

/// Keeps the entries a consumer is working on from a thread of its own, with
/// its own connection and runtime: a handler that blocks its thread or
/// stalls its task cannot stop the keep-alive, so no other consumer takes
/// the entries for due retries while they are being worked on. It refreshes
/// only entries still pending for this consumer ([`KEEP_IF_MINE`]) and
/// notes the ones another consumer now owns.
struct Keeper {
    shared: Arc<Kept>,
    /// Dropped with the keeper: the thread ends.
    _stop: tokio::sync::oneshot::Sender<()>,
}

#[derive(Default)]
struct Kept {
    in_hand: std::sync::Mutex<Vec<String>>,
    lost: std::sync::Mutex<std::collections::HashSet<String>>,
}

fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Keeper {
    /// Starts the thread; it touches the entries in hand every `every`.
    fn start(
        url: String,
        stream: String,
        group: String,
        name: String,
        every: Duration,
    ) -> Result<Self, String> {
        let shared = Arc::new(Kept::default());
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let kept = shared.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("starting the keep-alive runtime: {e}"))?;
        std::thread::Builder::new()
            .name(format!("postbox-keep-{name}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let mut conn: Option<ConnectionManager> = None;
                    loop {
                        tokio::select! {
                            _ = &mut stopped => return,
                            _ = tokio::time::sleep(every) => {}
                        }
                        let ids = locked(&kept.in_hand).clone();
                        if ids.is_empty() {
                            continue;
                        }
                        if conn.is_none() {
                            match connect(&url, Duration::ZERO).await {
                                Ok(c) => conn = Some(c),
                                Err(e) => {
                                    tracing::warn!(error = %e, "could not connect to keep the entries in hand");
                                    continue;
                                }
                            }
                        }
                        let Some(c) = conn.as_mut() else { continue };
                        match keep_if_mine(c, &stream, &group, &name, &ids).await {
                            Ok(lost) if !lost.is_empty() => {
                                locked(&kept.lost).extend(lost);
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "could not keep the entries in hand");
                            }
                        }
                    }
                });
            })
            .map_err(|e| format!("starting the keep-alive thread: {e}"))?;
        Ok(Keeper {
            shared,
            _stop: stop,
        })
    }

    /// The entries to keep from now on (empty: none).
    fn hold(&self, ids: &[String]) {
        *locked(&self.shared.in_hand) = ids.to_vec();
        locked(&self.shared.lost).retain(|id| ids.contains(id));
    }

    /// Whether the keep-alive found `id` owned by another consumer (or no
    /// longer pending).
    fn was_lost(&self, id: &str) -> bool {
        locked(&self.shared.lost).contains(id)
    }
}

async fn keep_if_mine(
    conn: &mut ConnectionManager,
    stream: &str,
    group: &str,
    name: &str,
    ids: &[String],
) -> Result<Vec<String>, RedisError> {
    redis::cmd("EVAL")
        .arg(KEEP_IF_MINE)
        .arg(1)
        .arg(stream)
        .arg(group)
        .arg(name)
        .arg(ids)
        .query_async(conn)
        .await
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
        connect(self.config.url.expose(), self.block()).await
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
        let keeper = match Keeper::start(
            self.config.url.expose().to_owned(),
            stream.to_owned(),
            group.to_owned(),
            self.name.clone(),
            self.keep_every(),
        ) {
            Ok(k) => k,
            Err(e) => return SessionEnd::Broken(e),
        };
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
                    .process(&mut conn, &keeper, entry, deliveries, &held, report)
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
        keeper: &Keeper,
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
            if keeper.was_lost(&entry.id) {
                tracing::warn!(
                    consumer = name,
                    id = %entry.id,
                    "the entry was claimed by another consumer while it waited in this consumer's batch: not handled here"
                );
                return Ok(());
            }
            let mut in_hand: Vec<String> = held.to_vec();
            in_hand.push(entry.id.clone());
            keeper.hold(&in_hand);
            let result = self.handler.handle(&message).await;
            let lost = keeper.was_lost(&entry.id);
            keeper.hold(held);
            if lost {
                self.lost(&entry.id, &result);
                return Ok(());
            }
            match result {
                Ok(handled) => {
                    if !self.ack(conn, &entry.id).await? {
                        self.lost(&entry.id, &Ok(handled));
                        return Ok(());
                    }
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
                        let lost = self.touch(conn, std::slice::from_ref(&entry.id)).await?;
                        if !lost.is_empty() {
                            self.lost(&entry.id, &Err(e));
                            return Ok(());
                        }
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

    /// How often the entries in hand are kept: a third of the retry delay,
    /// the shortest idle time after which another consumer may claim them.
    fn keep_every(&self) -> Duration {
        (self.policy.retry_delay / 3).max(Duration::from_millis(10))
    }

    /// Resets the idle time of `ids` still pending for this consumer
    /// (`XCLAIM … JUSTID`: no delivery counted); returns the ones that are
    /// not (any more).
    async fn touch(
        &self,
        conn: &mut ConnectionManager,
        ids: &[String],
    ) -> Result<Vec<String>, RedisError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        keep_if_mine(
            conn,
            &self.config.queue,
            self.config.consumer_group(),
            &self.name,
            ids,
        )
        .await
    }

    /// The handler finished an entry that another consumer took over
    /// meanwhile (this one stalled longer than the retry delay): the result
    /// is not this consumer's to settle; the owner does.
    fn lost(&self, id: &str, result: &Result<Handled, crate::HandlerError>) {
        tracing::warn!(
            consumer = self.config.name(),
            id,
            result = match result {
                Ok(h) => h.as_str(),
                Err(_) => "error",
            },
            "the entry was claimed by another consumer while the handler ran (stalled longer than the retry delay?): its result is not acknowledged here"
        );
    }

    /// `XACK`s `id` if it is still pending for this consumer; false if
    /// another consumer owns it now (or it is no longer pending).
    async fn ack(&self, conn: &mut ConnectionManager, id: &str) -> Result<bool, RedisError> {
        let acked: i64 = redis::cmd("EVAL")
            .arg(ACK_IF_MINE)
            .arg(1)
            .arg(&self.config.queue)
            .arg(self.config.consumer_group())
            .arg(&self.name)
            .arg(id)
            .query_async(conn)
            .await?;
        Ok(acked == 1)
    }

    /// `XADD <stream>.dead` and `XACK` the original in one script, only
    /// while the entry is still this consumer's: no duplicate dead copy, no
    /// lost one.
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
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(DEAD_IF_MINE)
            .arg(2)
            .arg(&self.config.queue)
            .arg(&dead)
            .arg(self.config.consumer_group())
            .arg(&self.name)
            .arg(&entry.id);
        for (k, v) in &fields {
            cmd.arg(k).arg(v.as_slice());
        }
        let stored: i64 = cmd.query_async(conn).await?;
        if stored != 1 {
            tracing::warn!(
                consumer = self.config.name(),
                id = %entry.id,
                "the entry was claimed by another consumer before it could be dead-lettered here: its owner settles it"
            );
            return Ok(());
        }
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
