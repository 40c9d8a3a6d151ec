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
//! reconnects. On Redis 7.2 and later each connection announces itself as
//! library `postbox-<publisher name>` (`lib-name` in `CLIENT LIST`); older
//! servers ignore it.

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
    conn: ConnectionManager,
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
        let conn = ConnectionManager::new_with_config(client, manager_config)
            .await
            .map_err(|e| fail(format!("cannot connect: {e}")))?;
        Ok(RedisPublisher {
            name,
            stream: config.stream.clone(),
            maxlen: config.maxlen,
            conn,
        })
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
        let mut conn = self.conn.clone();
        let replies: RedisResult<Vec<RedisResult<Value>>> = pipe.query_async(&mut conn).await;
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
                vec![Err(PublishError::failed(message)); batch.len()]
            }
        }
    }
}

fn start_error(name: &str, url: &SecretUrl, reason: String) -> Error {
    Error::Io {
        context: format!("publisher `{name}` at {url}"),
        source: std::io::Error::other(redact_url(&reason)),
    }
}
