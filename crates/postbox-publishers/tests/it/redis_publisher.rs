//! The Redis Streams publisher against the local server: the conformance
//! suite read back with `XRANGE`, `MAXLEN ~` trimming, and a relay run
//! through killed connections.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use postbox_core::config::RedisPublisherConfig;
use postbox_core::publish::{Delivery, PublishError};
use postbox_core::redact::SecretUrl;
use postbox_core::store::OutboxStore;
use postbox_core::template::Template;
use postbox_core::{NewEvent, Publisher};
use postbox_publishers::redis::RedisPublisher;
use postbox_sqlite::SqliteOutbox;
use postbox_testkit::conformance::{fast_worker, run_relay_until_for};
use postbox_testkit::publisher_suite::{check_publisher, sample_events, ReadBack, Received};
use postbox_testkit::servers::how_to_start;
use postbox_testkit::{redis_url, scratch_table};
use redis::AsyncCommands;

async fn admin() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("redis")))
}

fn config(name: &str, stream: &str, maxlen: Option<u64>) -> RedisPublisherConfig {
    RedisPublisherConfig {
        name: Some(name.to_owned()),
        url: SecretUrl::new(redis_url()),
        stream: Template::parse(stream).unwrap(),
        maxlen,
    }
}

/// Deletes the scratch keys when the test ends.
struct DropKeys(Vec<String>);

impl Drop for DropKeys {
    fn drop(&mut self) {
        if let Ok(mut c) = redis::Client::open(redis_url()).and_then(|c| c.get_connection()) {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(&self.0).query(&mut c);
        }
    }
}

type Entry = (String, BTreeMap<String, String>);

async fn xrange(stream: &str) -> Vec<Entry> {
    let mut c = admin().await;
    let reply: redis::streams::StreamRangeReply = c.xrange_all(stream).await.unwrap();
    reply
        .ids
        .into_iter()
        .map(|id| {
            let fields = id
                .map
                .iter()
                .map(|(k, v)| (k.clone(), redis::from_redis_value_ref::<String>(v).unwrap()))
                .collect();
            (stream.to_owned(), fields)
        })
        .collect()
}

struct XRangeReader(Vec<String>);

#[async_trait]
impl ReadBack for XRangeReader {
    async fn read(&mut self, _expected: usize, _timeout: Duration) -> Vec<Received> {
        let mut out = Vec::new();
        for stream in &self.0 {
            for (route, f) in xrange(stream).await {
                let mut headers: BTreeMap<String, serde_json::Value> =
                    serde_json::from_str(&f["headers"]).expect("headers field is a JSON object");
                let attempt = headers
                    .remove("x-attempt")
                    .and_then(|a| a.as_i64())
                    .unwrap();
                let replayed = headers.remove("x-replayed").and_then(|r| r.as_bool());
                out.push(Received {
                    event_id: f["event_id"].clone(),
                    event_type: f["event_type"].clone(),
                    app_code: f["app_code"].clone(),
                    aggregate_id: f.get("aggregate_id").cloned(),
                    aggregate_version: f.get("aggregate_version").map(|v| v.parse().unwrap()),
                    created_at_ms: f["created_at_ms"].parse().unwrap(),
                    headers,
                    attempt: attempt as i32,
                    replayed: replayed.unwrap_or(false),
                    payload: f["payload"].clone(),
                    route,
                });
            }
        }
        out
    }
}

#[tokio::test]
async fn redis_publisher_passes_the_publisher_suite() {
    let prefix = scratch_table("pbt");
    let template = format!("{prefix}:{{app_code}}");
    let streams = vec![format!("{prefix}:room"), format!("{prefix}:hall")];
    let _cleanup = DropKeys(streams.clone());
    let publisher = RedisPublisher::connect(&config("redis", &template, None))
        .await
        .unwrap_or_else(|e| panic!("{} ({e})", how_to_start("redis")));
    let mut events = sample_events("room", 90);
    events.extend(sample_events("hall", 30));
    let mut reader = XRangeReader(streams);
    let t = Template::parse(&template).unwrap();
    check_publisher(&publisher, &events, 50, &mut reader, |e| t.render(e)).await;
}

#[tokio::test]
async fn maxlen_keeps_the_stream_near_its_bound() {
    let stream = scratch_table("pbt_maxlen");
    let _cleanup = DropKeys(vec![stream.clone()]);
    let publisher = RedisPublisher::connect(&config("redis-maxlen", &stream, Some(100)))
        .await
        .unwrap();
    let events = sample_events("room", 1000);
    for chunk in events.chunks(100) {
        let batch: Vec<Delivery<'_>> = chunk.iter().map(Delivery::of).collect();
        assert!(publisher.publish(&batch).await.iter().all(Result::is_ok));
    }
    let len: u64 = admin().await.xlen(&stream).await.unwrap();
    // `~` trims whole stream nodes (100 entries by default), never below n.
    assert!(
        (100..=250).contains(&len),
        "XLEN {len} after 1000 XADDs with MAXLEN ~ 100"
    );
}

/// A Redis ACL user for one test, so its connections can be found and
/// killed without touching anyone else's; deleted (with its connections)
/// when the test ends.
struct ScratchUser(String);

impl ScratchUser {
    async fn create() -> (Self, String) {
        let user = scratch_table("pbt_user");
        let _: () = redis::cmd("ACL")
            .arg(&["SETUSER", &user, "on", ">s3cret-pw", "~*", "&*", "+@all"])
            .query_async(&mut admin().await)
            .await
            .unwrap();
        let url = redis_url().replacen("redis://", &format!("redis://{user}:s3cret-pw@"), 1);
        (ScratchUser(user), url)
    }
}

impl Drop for ScratchUser {
    fn drop(&mut self) {
        if let Ok(mut c) = redis::Client::open(redis_url()).and_then(|c| c.get_connection()) {
            let _: redis::RedisResult<()> =
                redis::cmd("ACL").arg("DELUSER").arg(&self.0).query(&mut c);
        }
    }
}

#[tokio::test]
async fn killed_connections_lose_nothing() {
    const N: usize = 3000;
    let stream = scratch_table("pbt_kill");
    let _cleanup = DropKeys(vec![stream.clone()]);
    let (user, url) = ScratchUser::create().await;
    let mut c = config("redis-kill", &stream, None);
    c.url = SecretUrl::new(url);
    let publisher: Arc<dyn Publisher> = Arc::new(RedisPublisher::connect(&c).await.unwrap());

    let path = std::env::temp_dir().join(format!("{}.db", scratch_table("redis_kill")));
    let store = SqliteOutbox::connect(&format!("sqlite://{}", path.display()), "outbox", 4)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn OutboxStore> = Arc::new(store);
    let app = "kill";
    let events: Vec<NewEvent> = (0..N)
        .map(|i| NewEvent::new(app, "Tick", format!(r#"{{"n":{i}}}"#)))
        .collect();
    store.enqueue_batch(&events, 1 << 20).await.unwrap();

    // Kill the publisher's connections three times while the relay runs.
    let killer = {
        let store = store.clone();
        let user = user.0.clone();
        tokio::spawn(async move {
            let mut killed = 0;
            let mut admin = admin().await;
            for round in 1..=3 {
                loop {
                    let s = store.stats(&[app.to_owned()]).await.unwrap().remove(0);
                    if s.delivered as usize >= round * N / 5 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let n: i64 = redis::cmd("CLIENT")
                    .arg(&["KILL", "USER", &user])
                    .query_async(&mut admin)
                    .await
                    .unwrap();
                killed += n;
            }
            killed
        })
    };
    let mut worker = fast_worker();
    worker.max_retry_count = 20;
    let report = run_relay_until_for(store.clone(), vec![publisher], worker, app, |s| {
        s.delivered as usize == N
    })
    .await;
    let killed = killer.await.unwrap();
    assert!(
        killed >= 1,
        "no connection was killed: the test proved nothing"
    );

    let ids: HashSet<String> = xrange(&stream)
        .await
        .into_iter()
        .map(|(_, f)| f["event_id"].clone())
        .collect();
    assert_eq!(ids.len(), N, "every event in the stream ({report:?})");
    let _ = std::fs::remove_file(&path);
}

/// A TCP proxy in front of Redis for one test: each new connection goes
/// to the upstream set now (`route`); `blackhole` stops forwarding on
/// every connection open at the time and keeps its sockets open, as a
/// host that died does (the client sees no reset, only silence).
struct Proxy {
    url: String,
    upstream: Arc<std::sync::Mutex<String>>,
    /// Connections accepted so far.
    accepted: Arc<std::sync::atomic::AtomicU64>,
    /// Connections up to this one are silent.
    cut: Arc<std::sync::atomic::AtomicU64>,
}

impl Proxy {
    async fn start(upstream: &str) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}/0", listener.local_addr().unwrap());
        let upstream = Arc::new(std::sync::Mutex::new(upstream.to_owned()));
        let cut = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let (to, cutoff, count) = (upstream.clone(), cut.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let generation = count.fetch_add(1, Ordering::SeqCst) + 1;
                let addr = to.lock().unwrap().clone();
                let Ok(server) = tokio::net::TcpStream::connect(&addr).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (from, into) in [(client_read, server_write), (server_read, client_write)] {
                    let cutoff = cutoff.clone();
                    tokio::spawn(async move {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let (mut from, mut into) = (from, into);
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if generation <= cutoff.load(Ordering::SeqCst) {
                                // Silence, with both sockets left open.
                                std::future::pending::<()>().await;
                            }
                            if into.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Proxy {
            url,
            upstream,
            accepted,
            cut,
        }
    }

    /// New connections go to `addr` (`host:port`).
    fn route(&self, addr: &str) {
        *self.upstream.lock().unwrap() = addr.to_owned();
    }

    /// Every connection open now goes silent; later ones are forwarded.
    fn blackhole(&self) {
        use std::sync::atomic::Ordering;
        self.cut
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// `host:port` of the test server.
fn redis_addr() -> String {
    let url = redis_url();
    let rest = url.trim_start_matches("redis://");
    rest.split('/')
        .next()
        .unwrap()
        .rsplit('@')
        .next()
        .unwrap()
        .to_owned()
}

/// Publishes `events` as one batch, given `within` (the relay's
/// `publish_timeout`); `None` when the batch was dropped at the deadline.
async fn publish_within(
    publisher: &RedisPublisher,
    events: &[postbox_core::EventRecord],
    within: Duration,
) -> Option<Vec<Result<(), postbox_core::publish::PublishError>>> {
    let batch: Vec<Delivery<'_>> = events.iter().map(Delivery::of).collect();
    tokio::time::timeout(within, publisher.publish(&batch))
        .await
        .ok()
}

/// The publisher's connection goes silent (its host died; the socket
/// stays open): the batch in flight is dropped at the relay's deadline,
/// and the next batch is published over a new connection, not sent into
/// the silence until the kernel gives up on it minutes later.
#[tokio::test]
async fn a_connection_gone_silent_is_replaced() {
    let stream = scratch_table("pbt_silent");
    let _cleanup = DropKeys(vec![stream.clone()]);
    let proxy = Proxy::start(&redis_addr()).await;
    let mut c = config("redis-silent", &stream, None);
    c.url = SecretUrl::new(proxy.url.clone());
    let publisher = RedisPublisher::connect(&c).await.unwrap();
    let events = sample_events("room", 30);
    let first = publish_within(&publisher, &events[..10], Duration::from_secs(5)).await;
    assert!(first.expect("answered").iter().all(Result::is_ok));

    proxy.blackhole();
    let silent = publish_within(&publisher, &events[10..20], Duration::from_secs(1)).await;
    assert!(silent.is_none(), "a silent connection answered: {silent:?}");
    let after = publish_within(&publisher, &events[20..], Duration::from_secs(8)).await;
    let after = after.expect("the batch after the silence was not answered in 8 s");
    assert!(after.iter().all(Result::is_ok), "{after:?}");
    let ids: Vec<String> = xrange(&stream)
        .await
        .into_iter()
        .map(|(_, f)| f["event_id"].clone())
        .collect();
    for e in &events[20..] {
        assert!(
            ids.contains(&e.event_id),
            "{} not in the stream",
            e.event_id
        );
    }
}

/// A Redis server that is gone (refusing connections) is unreachable, not
/// failing: nothing was sent, and the relay defers the rows with no
/// attempt counted (a restart of Redis dead-lettered events that had run
/// out of retries meanwhile).
#[tokio::test]
async fn a_server_that_is_gone_is_unreachable() {
    let own = postbox_testkit::servers::OwnRedis::start(&[]).await;
    let stream = scratch_table("pbt_gone");
    let mut c = config("redis-gone", &stream, None);
    c.url = SecretUrl::new(own.url.clone());
    let publisher = RedisPublisher::connect(&c).await.unwrap();
    let events = sample_events("room", 3);
    let sent = publish_within(&publisher, &events[..1], Duration::from_secs(5))
        .await
        .expect("answered");
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
    drop(own);
    let mut unreachable = false;
    for _ in 0..10 {
        let results = publish_within(&publisher, &events[1..], Duration::from_secs(5))
            .await
            .expect("answered");
        assert!(results.iter().all(Result::is_err), "{results:?}");
        if results
            .iter()
            .all(|r| matches!(r, Err(PublishError::Unreachable(_))))
        {
            unreachable = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(unreachable, "a refused connection is unreachable");
}

/// The server behind the publisher's address stops being the primary (a
/// failover behind a proxy that now points at the new primary): its
/// `READONLY` fails the batch, and the next batch reconnects and reaches
/// the primary.
#[tokio::test]
async fn a_server_no_longer_primary_is_left_for_the_new_one() {
    // A replica of nothing: read-only, as a demoted primary is.
    let replica =
        postbox_testkit::servers::OwnRedis::start(&["--replicaof", "127.0.0.1", "1"]).await;
    let replica_addr = replica.addr.clone();

    let stream = scratch_table("pbt_readonly");
    let _cleanup = DropKeys(vec![stream.clone()]);
    let proxy = Proxy::start(&replica_addr).await;
    let mut c = config("redis-failover", &stream, None);
    c.url = SecretUrl::new(proxy.url.clone());
    let publisher = RedisPublisher::connect(&c).await.unwrap();
    let events = sample_events("room", 20);
    let refused = publish_within(&publisher, &events[..10], Duration::from_secs(5))
        .await
        .expect("answered");
    assert!(
        refused.iter().all(|r| r
            .as_ref()
            .is_err_and(|e| e.to_string().contains("read only"))),
        "{refused:?}"
    );
    proxy.route(&redis_addr());
    let after = publish_within(&publisher, &events[10..], Duration::from_secs(5))
        .await
        .expect("answered");
    assert!(after.iter().all(Result::is_ok), "{after:?}");
    assert_eq!(xrange(&stream).await.len(), 10);
}
