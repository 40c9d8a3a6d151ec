//! The Redis Streams consumer against the real Redis
//! (`POSTBOX_TEST_REDIS_URL`, default `redis://127.0.0.1:6379/0`).

mod nats_redis_suite;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use nats_redis_suite::{Broker, DeadCopy, TestEvent, Unacked};
use postbox_consumers::rabbitmq::ConsumeReport;
use postbox_consumers::redis::{dead_stream, RedisConsumer};
use postbox_consumers::Handler;
use postbox_core::config::ConsumerConfig;
use postbox_testkit::servers::{how_to_start, redis_url};
use redis::aio::MultiplexedConnection;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

struct RedisBroker {
    stream: String,
    conn: MultiplexedConnection,
}

impl RedisBroker {
    async fn new() -> Self {
        let client = redis::Client::open(redis_url()).expect("redis URL");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("redis")));
        drop_stale_streams(&conn).await;
        RedisBroker {
            stream: nats_redis_suite::group("pbt:stream").replace('_', ":"),
            conn,
        }
    }
}

/// Deletes scratch streams (`pbt:stream:<pid>:<hex>` and their `.dead`
/// twins) that test processes which panicked before cleaning up left behind;
/// this process's are kept.
async fn drop_stale_streams(conn: &MultiplexedConnection) {
    static ONCE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    ONCE.get_or_init(|| async {
        let mine = format!(":{}:", std::process::id());
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("pbt:stream:*")
            .query_async(&mut conn.clone())
            .await
            .unwrap_or_default();
        for key in keys.into_iter().filter(|k| !k.contains(&mine)) {
            let _: redis::RedisResult<i64> = redis::cmd("DEL")
                .arg(key)
                .query_async(&mut conn.clone())
                .await;
        }
    })
    .await;
}

#[async_trait]
impl Broker for RedisBroker {
    fn config(&self, group: &str, overrides: serde_json::Value) -> ConsumerConfig {
        let mut c = serde_json::json!({
            "kind": "redis",
            "url": redis_url(),
            "stream": self.stream,
            "consumer_group": group,
            "declare": true,
            "retry_delay": "300ms",
        });
        for (k, v) in overrides.as_object().unwrap() {
            c[k] = v.clone();
        }
        serde_json::from_value(c).unwrap()
    }

    /// Exactly the `XADD` of postbox's Redis publisher.
    async fn publish(&self, e: &TestEvent) {
        let mut headers = e.headers.clone();
        headers.insert("x-attempt".into(), 1.into());
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream)
            .arg("*")
            .arg("event_id")
            .arg(&e.event_id)
            .arg("event_type")
            .arg(&e.event_type)
            .arg("app_code")
            .arg(&e.app_code);
        if let Some(a) = &e.aggregate_id {
            cmd.arg("aggregate_id").arg(a);
        }
        if let Some(v) = e.aggregate_version {
            cmd.arg("aggregate_version").arg(v);
        }
        cmd.arg("created_at_ms")
            .arg(e.created_at_ms)
            .arg("headers")
            .arg(serde_json::Value::Object(headers).to_string())
            .arg("payload")
            .arg(&e.payload);
        let _: String = cmd.query_async(&mut self.conn.clone()).await.unwrap();
    }

    async fn unacked(&self, group: &str) -> Unacked {
        let reply: redis::RedisResult<(
            u64,
            Option<String>,
            Option<String>,
            Option<Vec<(String, String)>>,
        )> = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(group)
            .query_async(&mut self.conn.clone())
            .await;
        match reply {
            // The group does not exist yet.
            Err(e) if e.code() == Some("NOGROUP") => Unacked::default(),
            Err(e) => panic!("XPENDING: {e}"),
            Ok((total, _, _, per)) => Unacked {
                total,
                per_consumer: Some(
                    per.unwrap_or_default()
                        .into_iter()
                        .map(|(c, n)| (c, n.parse().unwrap()))
                        .collect::<HashMap<_, _>>(),
                ),
            },
        }
    }

    async fn outstanding(&self, group: &str) -> u64 {
        let pending = self.unacked(group).await.total;
        let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.stream)
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        let lag = groups
            .iter()
            .find(|g| redis::from_redis_value_ref::<String>(&g["name"]).unwrap() == group)
            .map(|g| redis::from_redis_value_ref::<u64>(&g["lag"]).unwrap_or(0))
            .unwrap_or(0);
        pending + lag
    }

    async fn dead(&self, group: &str) -> Vec<DeadCopy> {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(dead_stream(&self.stream))
            .arg("-")
            .arg("+")
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        reply
            .ids
            .into_iter()
            .filter(|e| e.get::<String>("consumer_group").as_deref() == Some(group))
            .map(|e| {
                let headers: serde_json::Value =
                    serde_json::from_str(&e.get::<String>("headers").unwrap()).unwrap();
                DeadCopy {
                    event_id: e.get("event_id").unwrap(),
                    last_error: headers["x-last-error"].as_str().unwrap().to_owned(),
                }
            })
            .collect()
    }

    fn spawn(
        &self,
        config: ConsumerConfig,
        handler: Arc<dyn Handler>,
        tag: &str,
        cancel: CancellationToken,
    ) -> JoinHandle<Result<ConsumeReport, postbox_core::Error>> {
        let consumer = RedisConsumer::new(config, handler).unwrap().with_tag(tag);
        tokio::spawn(async move { consumer.run(cancel).await })
    }

    async fn cleanup(&self) {
        let _: redis::RedisResult<i64> = redis::cmd("DEL")
            .arg(&self.stream)
            .arg(dead_stream(&self.stream))
            .query_async(&mut self.conn.clone())
            .await;
    }
}

stream_consumer_suite!(
    RedisBroker::new(),
    kill_config = serde_json::json!({ "retry_delay": "300ms" })
);

#[tokio::test]
async fn a_missing_group_without_declare_names_the_key() {
    let b = RedisBroker::new().await;
    let mut config = b.config("nogroup", serde_json::json!({ "declare": false }));
    config.declare = false;
    let _: i64 = redis::cmd("XADD")
        .arg(&b.stream)
        .arg("*")
        .arg("event_id")
        .arg("x")
        .query_async(&mut b.conn.clone())
        .await
        .map(|_: String| 0)
        .unwrap();
    let handler = nats_redis_suite::recording("a", &Default::default(), std::time::Duration::ZERO);
    let err = RedisConsumer::new(config, handler)
        .unwrap()
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("declare = true"), "{err}");
    b.cleanup().await;
}
