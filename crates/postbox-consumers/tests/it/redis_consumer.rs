//! The Redis Streams consumer against the real Redis
//! (`POSTBOX_TEST_REDIS_URL`, default `redis://127.0.0.1:6379/0`).

use crate::nats_redis_suite;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use nats_redis_suite::{config_with, test_event, Broker, ConsumerTask, DeadCopy, Start, Unacked};
use postbox_consumers::consume::state::ConsumerState;
use postbox_consumers::redis::{dead_stream, RedisConsumer};
use postbox_consumers::{Handled, Handler, HandlerError, Message};
use postbox_core::config::ConsumerConfig;
use postbox_core::envelope::Envelope;
use postbox_testkit::servers::{how_to_start, redis_url};
use redis::aio::MultiplexedConnection;
use tokio_util::sync::CancellationToken;

struct RedisBroker {
    stream: String,
    conn: MultiplexedConnection,
    /// The server's URL.
    url: String,
}

impl RedisBroker {
    async fn new() -> Self {
        Self::on(redis_url()).await
    }

    /// [`RedisBroker::new`] on the server at `url`.
    async fn on(url: String) -> Self {
        let client = redis::Client::open(url.as_str()).expect("redis URL");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("redis")));
        drop_stale_streams(&conn).await;
        RedisBroker {
            stream: nats_redis_suite::group("pbt:stream").replace('_', ":"),
            conn,
            url,
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
        let settings = serde_json::json!({
            "kind": "redis",
            "url": self.url,
            "stream": self.stream,
            "consumer_group": group,
            "declare": true,
            "retry_delay": "300ms",
        });
        config_with(settings, overrides)
    }

    /// Exactly the `XADD` of postbox's Redis publisher.
    async fn publish(&self, e: &Envelope) {
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
            .arg(e.payload.get());
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

    fn start_controlled(&self, s: Start) -> (ConsumerTask, Arc<ConsumerState>) {
        nats_redis_suite::started!(RedisConsumer, s)
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
    // `stream`, the key a Redis entry is written with; it named `queue`,
    // the key's other name, which the file never had.
    let postbox_core::Error::Config { key, .. } = &err else {
        panic!("a config error: {err}");
    };
    assert_eq!(key, "stream");
    b.cleanup().await;
}

/// Counts handler calls and how many run at once; each call blocks its
/// thread (not just its task) for `block`, like a handler doing blocking I/O.
struct Blocking {
    block: std::time::Duration,
    calls: std::sync::atomic::AtomicUsize,
    running: std::sync::atomic::AtomicUsize,
    most_at_once: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Handler for Blocking {
    async fn handle(&self, _message: &Message) -> Result<Handled, HandlerError> {
        use std::sync::atomic::Ordering::SeqCst;
        self.calls.fetch_add(1, SeqCst);
        let now = self.running.fetch_add(1, SeqCst) + 1;
        self.most_at_once.fetch_max(now, SeqCst);
        std::thread::sleep(self.block);
        self.running.fetch_sub(1, SeqCst);
        Ok(Handled::Ok)
    }
}

/// The first `count` pending entries of `group`: id, owner, idle ms and
/// deliveries.
async fn pending(b: &RedisBroker, group: &str, count: usize) -> Vec<(String, String, u64, u64)> {
    redis::cmd("XPENDING")
        .arg(&b.stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(count)
        .query_async(&mut b.conn.clone())
        .await
        .unwrap()
}

/// The owner of each pending entry of `group`.
async fn owners(b: &RedisBroker, group: &str) -> Vec<String> {
    let rows = pending(b, group, 10).await;
    rows.into_iter().map(|r| r.1).collect()
}

/// Issue 10.9: a handler that blocks its thread for five times the claim
/// idle time (retry_delay) keeps its entry: the keep-alive runs where the
/// handler cannot stall it, so the other consumer never claims the entry
/// and it is handled once, never twice at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thread_blocking_handler_keeps_its_entry() {
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;
    let b = RedisBroker::new().await;
    let g = nats_redis_suite::group("blocking");
    let handler = Arc::new(Blocking {
        block: Duration::from_millis(1500),
        calls: Default::default(),
        running: Default::default(),
        most_at_once: Default::default(),
    });
    // Published first: once the handler blocks a worker thread, the test's
    // own connection may have to wait for that thread too.
    b.publish(&test_event(0)).await;
    // A retry delay far above the thief's keep-alive (every 50 ms), so that
    // a thief slowed by a loaded machine still keeps its entry: at 300 ms
    // `a` sometimes claimed it back as due, legitimately.
    let config = b.config(&g, serde_json::json!({ "retry_delay": "3s" }));
    let cancel = CancellationToken::new();
    let ta = b.spawn(config.clone(), handler.clone(), "a", cancel.clone());
    let tb = b.spawn(config, handler.clone(), "b", cancel.clone());
    let h = handler.clone();
    nats_redis_suite::wait_until(Duration::from_secs(10), "the first call", move || {
        h.calls.load(SeqCst) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        handler.most_at_once.load(SeqCst),
        1,
        "handled twice at once"
    );
    assert_eq!(handler.calls.load(SeqCst), 1, "the entry was taken over");
    assert_eq!(
        b.outstanding(&g).await,
        0,
        "acked by the consumer that kept it"
    );
    let ra = nats_redis_suite::stop(&cancel, ta).await;
    let rb = nats_redis_suite::stop(&cancel, tb).await;
    assert_eq!(ra.ok + rb.ok, 1, "{ra:?} {rb:?}");
    assert_eq!(ra.retry + rb.retry, 0, "{ra:?} {rb:?}");
    b.cleanup().await;
}

/// Waits in its handler until told to finish.
struct Held {
    entered: std::sync::atomic::AtomicBool,
    release: tokio::sync::Notify,
}

#[async_trait]
impl Handler for Held {
    async fn handle(&self, _message: &Message) -> Result<Handled, HandlerError> {
        // Only the first call waits: a second one (the entry claimed back)
        // must show as a count the test asserts on, not as a consumer that
        // never stops.
        if !self.entered.swap(true, std::sync::atomic::Ordering::SeqCst) {
            self.release.notified().await;
        }
        Ok(Handled::Ok)
    }
}

/// Issue 10.9: once another consumer owns an entry (it claimed it while
/// this one was stalled), this consumer's keep-alive does not take it back,
/// and its handler's result is not acknowledged as if the entry were still
/// its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_entry_another_consumer_took_is_not_taken_back() {
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;
    let b = RedisBroker::new().await;
    let g = nats_redis_suite::group("taken");
    let handler = Arc::new(Held {
        entered: Default::default(),
        release: Default::default(),
    });
    // A retry delay far above the thief's keep-alive (every 50 ms), so that
    // a thief slowed by a loaded machine still keeps its entry: at 300 ms
    // `a` sometimes claimed it back as due, legitimately.
    let config = b.config(&g, serde_json::json!({ "retry_delay": "3s" }));
    let cancel = CancellationToken::new();
    let task = b.spawn(config, handler.clone(), "a", cancel.clone());
    b.publish(&test_event(0)).await;
    let h = handler.clone();
    nats_redis_suite::wait_until(Duration::from_secs(10), "the handler", move || {
        h.entered.load(SeqCst)
    })
    .await;
    assert_eq!(owners(&b, &g).await, ["a"]);
    // Another consumer takes the entry over (as after a stall of `a`).
    let id = pending(&b, &g, 1).await;
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg(&b.stream)
        .arg(&g)
        .arg("thief")
        .arg(0)
        .arg(&id[0].0)
        .arg("JUSTID")
        .query_async(&mut b.conn.clone())
        .await
        .unwrap();
    // Two keep-alive periods (retry_delay / 3) later it is still theirs.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(
        owners(&b, &g).await,
        ["thief"],
        "the keep-alive took it back"
    );
    // The thief is alive: it keeps the entry from now on.
    let thief = {
        let (stream, group, id, mut conn) =
            (b.stream.clone(), g.clone(), id[0].0.clone(), b.conn.clone());
        tokio::spawn(async move {
            loop {
                let _: redis::RedisResult<redis::Value> = redis::cmd("XCLAIM")
                    .arg(&stream)
                    .arg(&group)
                    .arg("thief")
                    .arg(0)
                    .arg(&id)
                    .arg("JUSTID")
                    .query_async(&mut conn)
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    handler.release.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        owners(&b, &g).await,
        ["thief"],
        "`a` acknowledged an entry that was no longer its own"
    );
    let report = nats_redis_suite::stop(&cancel, task).await;
    thief.abort();
    assert_eq!(report.ok, 0, "{report:?}");
    b.cleanup().await;
}

/// The group is destroyed while a consumer with `declare = true` runs
/// (`XGROUP DESTROY`; a failover to a replica that never had it): the
/// consumer makes it again and goes on, instead of stopping (and with it
/// every consumer of the process) on `NOGROUP`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_destroyed_mid_run_is_made_again() {
    let b = RedisBroker::new().await;
    let group = nats_redis_suite::group("regroup");
    let calls = nats_redis_suite::Calls::default();
    let cancel = CancellationToken::new();
    let task = b.spawn(
        b.config(&group, serde_json::json!({})),
        nats_redis_suite::recording("a", &calls, std::time::Duration::ZERO),
        "a",
        cancel.clone(),
    );
    let first = test_event(0);
    b.publish(&first).await;
    nats_redis_suite::wait_until(
        std::time::Duration::from_secs(10),
        "the first handled",
        || !calls.lock().unwrap().is_empty(),
    )
    .await;
    let destroyed: i64 = redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(&b.stream)
        .arg(&group)
        .query_async(&mut b.conn.clone())
        .await
        .unwrap();
    assert_eq!(destroyed, 1);
    let second = test_event(1);
    b.publish(&second).await;
    nats_redis_suite::wait_until(
        std::time::Duration::from_secs(20),
        "the second handled after the group was made again",
        || {
            calls
                .lock()
                .unwrap()
                .iter()
                .any(|c| c.message.event_id() == second.event_id)
        },
    )
    .await;
    assert!(!task.is_finished(), "the consumer stopped");
    nats_redis_suite::stop(&cancel, task).await;
    b.cleanup().await;
}

/// The members of `group` (`XINFO CONSUMERS`), by name.
async fn members(b: &RedisBroker, group: &str) -> Vec<String> {
    let rows: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(&b.stream)
        .arg(group)
        .query_async(&mut b.conn.clone())
        .await
        .unwrap();
    let mut names: Vec<String> = rows
        .iter()
        .map(|r| redis::from_redis_value_ref(&r["name"]).unwrap())
        .collect();
    names.sort();
    names
}

/// Two entries of one config on one stream and group, named apart and
/// left with their default tags (as `postbox consume` runs them), are two
/// members of the group, each owning what it took: one stopping leaves the
/// other's pending entry alone (with one member name between them, each
/// took the other's entries for its own, and the `XGROUP DELCONSUMER` of
/// one stopping could drop what the other had in hand).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_consumers_of_one_group_in_one_process_are_two_members() {
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;
    let b = RedisBroker::new().await;
    let g = nats_redis_suite::group("members");
    let mut running = Vec::new();
    for name in ["orders-a", "orders-b"] {
        let config = b.config(&g, serde_json::json!({ "name": name }));
        let handler = Arc::new(Held {
            entered: Default::default(),
            release: Default::default(),
        });
        let consumer = RedisConsumer::new(config, handler.clone()).unwrap();
        let tag = consumer.tag().to_owned();
        let cancel = CancellationToken::new();
        let task = tokio::spawn({
            let cancel = cancel.clone();
            async move { consumer.run(cancel).await }
        });
        running.push((tag, handler, cancel, task));
    }
    // One entry each: prefetch 1, and each holds its entry in its handler.
    b.publish(&test_event(0)).await;
    b.publish(&test_event(1)).await;
    nats_redis_suite::wait_until(Duration::from_secs(10), "both handlers", || {
        running.iter().all(|r| r.1.entered.load(SeqCst))
    })
    .await;
    let mut owner_of_each = owners(&b, &g).await;
    owner_of_each.sort();
    let tags = [running[0].0.clone(), running[1].0.clone()];
    assert_eq!(owner_of_each, tags, "one member per consumer");
    assert_eq!(members(&b, &g).await, tags);
    // `b` finishes its entry and stops; `a` still has its own in hand.
    let (_, handler, cancel, task) = running.pop().unwrap();
    handler.release.notify_one();
    let report = nats_redis_suite::stop(&cancel, task).await;
    assert_eq!(report.ok, 1, "{report:?}");
    assert_eq!(
        owners(&b, &g).await,
        [tags[0].clone()],
        "a's entry is pending"
    );
    assert_eq!(members(&b, &g).await, [tags[0].clone()], "b left the group");
    let (_, handler, cancel, task) = running.pop().unwrap();
    handler.release.notify_one();
    let report = nats_redis_suite::stop(&cancel, task).await;
    assert_eq!(report.ok, 1, "{report:?}");
    assert_eq!(b.outstanding(&g).await, 0);
    b.cleanup().await;
}

/// A server that cannot take the group yet: a replica after a failover,
/// or one loading its data after a restart (`READONLY`, `LOADING`). The
/// consumer retries until it can, then consumes; it stopped for good on
/// the first refusal ("check the user's permissions").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_not_ready_for_the_group_is_waited_for() {
    // A replica of a primary that is not there: it refuses writes.
    let server =
        postbox_testkit::servers::OwnRedis::start(&["--replicaof", "127.0.0.1", "1"]).await;
    let b = RedisBroker::on(server.url.clone()).await;
    let group = nats_redis_suite::group("notready");
    let calls = nats_redis_suite::Calls::default();
    let cancel = CancellationToken::new();
    let task = b.spawn(
        b.config(&group, serde_json::json!({})),
        nats_redis_suite::recording("a", &calls, std::time::Duration::ZERO),
        "a",
        cancel.clone(),
    );
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(
        !task.is_finished(),
        "the consumer stopped: {:?}",
        task.await
    );
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut b.conn.clone())
        .await
        .unwrap();
    let event = test_event(0);
    b.publish(&event).await;
    nats_redis_suite::wait_until(
        std::time::Duration::from_secs(30),
        "the event handled once the server takes writes",
        || !calls.lock().unwrap().is_empty(),
    )
    .await;
    nats_redis_suite::stop(&cancel, task).await;
}

/// The keep-alive's connection, idle between handlers, was dropped on the
/// way without a word (a NAT or load balancer's idle timeout): its next
/// keep is never answered. It is given up after the keep interval and a
/// new connection keeps the entry, so no other consumer takes it while
/// its handler runs. The dead connection was kept for good before: every
/// keep failed, and the entry was handled twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keep_alive_connection_dropped_on_the_way_is_replaced() {
    let b = RedisBroker::new().await;
    let group = nats_redis_suite::group("keepdrop");
    let url = redis_url();
    let rest = url.split_once("://").expect("a Redis URL").1;
    let (server, db) = rest.split_once('/').unwrap_or((rest, "0"));
    let proxy = postbox_testkit::proxy::Proxy::start(server).await;
    // The keep-alive's script, and nothing else a consumer sends.
    proxy.silence_on(b"p[1][2] == ARGV[2]");
    let calls = nats_redis_suite::Calls::default();
    let slow_config = b.config(
        &group,
        serde_json::json!({
            "url": format!("redis://{}/{db}", proxy.addr()),
            "retry_delay": "4s",
        }),
    );
    let cancel = CancellationToken::new();
    let slow = b.spawn(
        slow_config,
        nats_redis_suite::recording("a", &calls, std::time::Duration::from_secs(9)),
        "a",
        cancel.clone(),
    );
    b.publish(&test_event(0)).await;
    nats_redis_suite::wait_until(
        std::time::Duration::from_secs(10),
        "a took the entry",
        || !calls.lock().unwrap().is_empty(),
    )
    .await;
    let other = b.spawn(
        b.config(&group, serde_json::json!({ "retry_delay": "4s" })),
        nats_redis_suite::recording("b", &calls, std::time::Duration::ZERO),
        "b",
        cancel.clone(),
    );
    nats_redis_suite::wait_until(
        std::time::Duration::from_secs(10),
        "the first keep sent",
        || proxy.silenced() == 1,
    )
    .await;
    // Past a's handler, and twice the retry delay.
    tokio::time::sleep(std::time::Duration::from_secs(9)).await;
    let who: Vec<String> = calls
        .lock()
        .unwrap()
        .iter()
        .map(|c| c.who.clone())
        .collect();
    assert_eq!(
        who,
        ["a"],
        "the entry was taken from a while its handler ran"
    );
    nats_redis_suite::stop(&cancel, slow).await;
    nats_redis_suite::stop(&cancel, other).await;
    b.cleanup().await;
}
