//! `kind = "redis"`: Redis Streams (SPEC §4). Each event is one
//! `XADD <stream> [MAXLEN ~ n] * field value …` with the fields (named in
//! [`postbox_core::wire::redis`], which the consumer reads too) `event_id`,
//! `event_type`, `app_code`, `aggregate_id` and `aggregate_version` (left out
//! when the event has none), `created_at_ms`, `headers` (a JSON object: the
//! event's headers plus `x-attempt`, and `x-replayed: true` on a replay) and
//! `payload` (the body as stored). The stream name comes from the `stream`
//! template. A batch is one pipelined round trip, and each `XADD`'s reply is
//! its event's result.
//!
//! The connection is a [`ConnectionManager`]: after a dropped connection the
//! batch in flight fails (and is retried by the relay), and the next batch
//! reconnects. A connection that fails a batch in a way its manager does
//! not repair is replaced before the next batch: one whose replies stopped
//! coming (a host that died, a conntrack entry gone, behind which the
//! socket looks open until the kernel gives up, minutes later; the batch
//! timed out, or the relay's `publish_timeout` dropped it), and one whose
//! server is no longer the primary (`READONLY` after a failover behind an
//! address that now points at the new primary). On Redis 7.2 and later each connection announces itself as
//! library `postbox-<publisher name>` (`lib-name` in `CLIENT LIST`); older
//! servers ignore it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, RedisResult, Value};

use postbox_core::config::RedisPublisherConfig;
use postbox_core::publish::{Delivery, PublishError};
use postbox_core::redact::{redact_url, SecretUrl};
use postbox_core::template::Template;
use postbox_core::wire::{self, redis as fields};
use postbox_core::{Error, Publisher, Result};

/// Bounds connecting and each reply, so a dead server makes a batch fail as
/// retryable instead of hanging.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Appends events to Redis streams with `XADD`.
pub struct RedisPublisher {
    name: String,
    stream: Template,
    maxlen: Option<u64>,
    client: redis::Client,
    manager_config: ConnectionManagerConfig,
    conn: Mutex<ConnectionManager>,
    /// The connection failed a batch in a way its manager does not
    /// repair: the next batch opens a new one.
    suspect: Arc<AtomicBool>,
}

/// Marks the connection suspect when dropped armed: a batch whose
/// replies never came (the relay dropped it at its deadline).
struct Unanswered(Arc<AtomicBool>, bool);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.1 {
            self.0.store(true, Ordering::SeqCst);
        }
    }
}

/// A server's error that says this server cannot take writes any more,
/// which reconnecting to the same address repairs after a failover.
fn not_primary(e: &redis::RedisError) -> bool {
    matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"))
}

impl RedisPublisher {
    /// Connects (a failure here is an error at start).
    pub async fn connect(config: &RedisPublisherConfig) -> Result<Self> {
        let name = config.name.clone().unwrap_or_else(|| "redis".to_owned());
        let fail = |reason: String| start_error(&name, &config.url, reason);
        let info = config
            .url
            .expose()
            .into_connection_info()
            .map_err(|e| fail(format!("invalid URL: {e}")))?;
        let settings = info
            .redis_settings()
            .clone()
            .set_lib_name(format!("postbox-{name}"), env!("CARGO_PKG_VERSION"));
        let info = info.set_redis_settings(settings);
        let client = redis::Client::open(info).map_err(|e| fail(format!("invalid URL: {e}")))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(IO_TIMEOUT))
            .set_response_timeout(Some(IO_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_with_config(client.clone(), manager_config.clone())
            .await
            .map_err(|e| fail(format!("cannot connect: {e}")))?;
        warn_unless_persistent(&name, conn.clone()).await;
        if let Some(n) = config.maxlen {
            // Redis trims by length alone, read or not.
            tracing::warn!(
                publisher = %name,
                maxlen = n,
                "maxlen trims each stream to about {n} entries whether or not its consumer groups have read them: while consumers are down or behind by more, events marked delivered are dropped unread (and entries pending a retry vanish from their group); size it past the longest backlog consumers may build, or leave it out and trim with XTRIM MINID behind the groups"
            );
        }
        Ok(RedisPublisher {
            name,
            stream: config.stream.clone(),
            maxlen: config.maxlen,
            client,
            manager_config,
            conn: Mutex::new(conn),
            suspect: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The connection for the next batch: a new one when the last was
    /// found suspect.
    async fn connection(&self) -> RedisResult<ConnectionManager> {
        if self.suspect.swap(false, Ordering::SeqCst) {
            tracing::warn!(
                publisher = %self.name,
                "the Redis connection stopped answering or its server is no longer the primary; opening a new one"
            );
            let fresh = ConnectionManager::new_with_config(
                self.client.clone(),
                self.manager_config.clone(),
            )
            .await
            .inspect_err(|_| self.suspect.store(true, Ordering::SeqCst))?;
            *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = fresh;
        }
        Ok(self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    /// The stream `d` is appended to.
    pub fn stream_of(&self, d: &Delivery<'_>) -> String {
        self.stream.render(d.record)
    }

    fn xadd(&self, d: &Delivery<'_>) -> redis::Cmd {
        let r = d.record;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.stream_of(d));
        if let Some(n) = self.maxlen {
            cmd.arg("MAXLEN").arg("~").arg(n);
        }
        cmd.arg("*")
            .arg(fields::EVENT_ID)
            .arg(&r.event_id)
            .arg(fields::EVENT_TYPE)
            .arg(&r.event_type)
            .arg(fields::APP_CODE)
            .arg(&r.app_code);
        if let Some(a) = &r.aggregate_id {
            cmd.arg(fields::AGGREGATE_ID).arg(a);
        }
        if let Some(v) = r.aggregate_version {
            cmd.arg(fields::AGGREGATE_VERSION).arg(v);
        }
        let mut headers = d.headers();
        wire::stamp_delivery(&mut headers, d.attempt, d.replayed);
        cmd.arg(fields::CREATED_AT_MS)
            .arg(r.created_at_ms)
            .arg(fields::HEADERS)
            .arg(serde_json::Value::Object(headers).to_string())
            .arg(fields::PAYLOAD)
            .arg(&r.payload);
        cmd
    }
}

// `publish_each` stays the default (the whole `publish` under
// `publish_timeout`): a batch is one pipelined round trip whose replies come
// back together, so there is no earlier per-event result to keep.
#[async_trait]
impl Publisher for RedisPublisher {
    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<std::result::Result<(), PublishError>> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for d in batch {
            pipe.add_command(self.xadd(d));
        }
        let mut unanswered = Unanswered(Arc::clone(&self.suspect), true);
        let mut connected = true;
        let replies: RedisResult<Vec<RedisResult<Value>>> = match self.connection().await {
            Ok(mut conn) => pipe.query_async(&mut conn).await,
            Err(e) => {
                connected = false;
                Err(e)
            }
        };
        unanswered.1 = false;
        let broken = match &replies {
            Ok(replies) => replies.iter().any(|r| r.as_ref().is_err_and(not_primary)),
            Err(e) => e.is_timeout() || not_primary(e),
        };
        if broken {
            self.suspect.store(true, Ordering::SeqCst);
        }
        match replies {
            Ok(replies) if replies.len() == batch.len() => replies
                .into_iter()
                .zip(batch)
                .map(|(reply, d)| match reply {
                    Ok(_) => Ok(()),
                    Err(e) => Err(PublishError::failed(format!(
                        "XADD to `{}` refused: {}",
                        self.stream_of(d),
                        redact_url(&e.to_string())
                    ))),
                })
                .collect(),
            Ok(replies) => {
                let message = format!(
                    "Redis answered {} replies to {} XADDs",
                    replies.len(),
                    batch.len()
                );
                vec![Err(PublishError::failed(message)); batch.len()]
            }
            Err(e) => {
                let message = format!(
                    "Redis pipeline failed (will reconnect and retry): {}",
                    redact_url(&e.to_string())
                );
                // No connection to send on (refused, or none could be
                // opened): nothing was sent. A connection lost mid-way
                // may have run the XADDs, and counts.
                let error = if !connected || e.is_connection_refusal() {
                    PublishError::Unreachable(message)
                } else {
                    PublishError::failed(message)
                };
                vec![Err(error); batch.len()]
            }
        }
    }
}

/// Says at start when the server keeps no append-only file: an `XADD`
/// is answered from memory, so an event marked delivered is lost if the
/// server dies before its next snapshot. A server that refuses `CONFIG`
/// (a managed one) is not second-guessed.
async fn warn_unless_persistent(name: &str, mut conn: ConnectionManager) {
    let reply: RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendonly")
        .query_async(&mut conn)
        .await;
    if let Ok(pair) = reply {
        if pair.get(1).is_some_and(|v| v == "no") {
            tracing::warn!(
                publisher = %name,
                "Redis runs with appendonly no: an event it acknowledged is marked delivered, and lost if Redis dies before its next snapshot; set appendonly yes (appendfsync everysec or always) where delivery must survive a crash"
            );
        }
    }
}

fn start_error(name: &str, url: &SecretUrl, reason: String) -> Error {
    Error::Io {
        context: format!("publisher `{name}` at {url}"),
        source: std::io::Error::other(redact_url(&reason)),
    }
}
