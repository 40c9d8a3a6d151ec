//! Broker clusters (issue 16, item 1): `postbox relay` and `postbox
//! consume` given every node of a 3-node cluster (`urls`) carry on when the
//! node they are connected to is killed mid-run, and nothing is lost. Each
//! test starts and stops its own nodes; the shared servers are untouched.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use postbox_core::store::OutboxStore;
use postbox_core::NewEvent;
use postbox_testkit::clusters::{NatsCluster, RabbitCluster};
use postbox_testkit::consumer_fixtures::eventually;
use postbox_testkit::http::Recorder;
use postbox_testkit::servers::scratch_name;

use crate::common;

/// Events each test delivers.
const EVENTS: usize = 1_200;

/// `["a", "b"]` as a TOML array.
fn toml_list(urls: &[String]) -> String {
    let quoted: Vec<_> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

/// `[database]` and `[outbox_worker]` for a scratch PostgreSQL table. The
/// retry budget (40 attempts, 0.5 s doubling to 2 s: about 80 s) outlasts
/// a cluster's leader elections on a loaded 2-core machine, as an operator
/// of a cluster would set it.
fn outbox_toml(url: &str, table: &str) -> String {
    format!(
        "[database]\nurl = \"{url}\"\ntable = \"{table}\"\napp_codes = [\"room\"]\nmax_connections = 4\n\
         [outbox_worker]\npoll_interval = \"100ms\"\nbatch_size = 100\nmax_retry_count = 40\n\
         initial_backoff = \"500ms\"\nmax_backoff = \"2s\"\n"
    )
}

/// The distinct events `handler` got (by `Idempotency-Key`), and all its
/// requests.
fn handled(handler: &Recorder) -> (usize, usize) {
    let requests = handler.requests();
    let ids: HashSet<_> = (requests.iter())
        .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
        .collect();
    (ids.len(), requests.len())
}

/// Runs the consumer and the relay with `cfg`, produces [`EVENTS`] events,
/// calls `kill` once a third of them reached the handler, and waits until
/// every one has; prints the figures. `ready` waits for the consumer's
/// topology.
async fn run_through_a_node_failure(
    name: &str,
    dir: &Path,
    cfg: &str,
    store: Arc<dyn OutboxStore>,
    handler: &Recorder,
    ready: impl AsyncFnOnce(),
    kill: impl FnOnce(),
) {
    let mut consume = common::spawn_async(dir, cfg, "consume", &[]);
    ready().await;
    let mut relay = common::spawn_async(dir, cfg, "relay", &[]);
    let producer = common::produce(store.clone(), EVENTS, 40);
    eventually(
        "a third of the events handled",
        Duration::from_secs(60),
        async || {
            let (distinct, _) = handled(handler);
            (distinct >= EVENTS / 3)
                .then_some(())
                .ok_or(format!("{distinct} handled"))
        },
    )
    .await;
    let killed_at = Instant::now();
    kill();
    let before_kill = handler.requests().len();
    // A failure says which side stopped: rows left in the outbox are the
    // relay's, rows delivered and not handled the consumer's.
    eventually(
        "every event handled",
        Duration::from_secs(180),
        async || {
            let (distinct, _) = handled(handler);
            if distinct == EVENTS {
                return Ok(());
            }
            let outbox = store.stats(&["room".to_owned()]).await;
            let dead = outbox.as_ref().map_or(0, |s| s[0].failed);
            assert_eq!(dead, 0, "the relay dead-lettered events: {outbox:?}");
            Err(format!("{distinct} of {EVENTS} handled; outbox {outbox:?}"))
        },
    )
    .await;
    producer.await.unwrap();
    let (distinct, requests) = handled(handler);
    let resumed = (handler.requests().into_iter().skip(before_kill))
        .find(|r| r.at > killed_at + Duration::from_millis(1))
        .map(|r| r.at.duration_since(killed_at));
    let outbox = store.stats(&["room".to_owned()]).await.unwrap();
    println!(
        "{name}: {EVENTS} events, lost {}, duplicates {}, first delivery after the kill {:?}; outbox {outbox:?}",
        EVENTS - distinct,
        requests - distinct,
        resumed
    );
    common::stopped(&mut relay).await;
    common::stopped(&mut consume).await;
    assert_eq!(distinct, EVENTS, "lost {}", EVENTS - distinct);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_carry_on_when_a_rabbitmq_cluster_node_dies() {
    let _heavy = common::one_heavy_test_at_a_time().await;
    let mut cluster = tokio::task::spawn_blocking(|| RabbitCluster::start(3))
        .await
        .unwrap();
    let urls = toml_list(&cluster.urls());
    let (url, store) = common::server_outbox("postgres", "pbx_rq_cluster", 4).await;
    let handler = Recorder::start().await;
    let (exchange, queue) = (scratch_name("pbx_clx"), scratch_name("pbx_clq"));
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::write_config(
        dir.path(),
        &format!(
            "{}[[publishers]]\nkind = \"rabbitmq\"\nname = \"rabbit\"\nurls = {urls}\nexchange = \"{exchange}\"\ndeclare = true\n\
             [[consumers]]\nkind = \"rabbitmq\"\nurls = {urls}\nqueue = \"{queue}\"\nqueue_type = \"quorum\"\ndeclare = true\n\
             prefetch = 20\nretry_delay = \"200ms\"\nbindings = [{{ exchange = \"{exchange}\", routing_key = \"#\" }}]\n\
             handler = {{ http = \"{}/handle\", timeout = \"5s\" }}\n",
            outbox_toml(&url, store.table().as_str()),
            handler.url
        ),
    );
    let first = cluster.urls()[0].clone();
    let first_node = cluster.nodes[0].name.clone();
    let ready = async || {
        let conn = lapin::Connection::connect(&first, Default::default())
            .await
            .unwrap();
        eventually(
            "the consumer's quorum queue",
            Duration::from_secs(30),
            async || {
                let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
                let options = lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                (ch.queue_declare(queue.as_str().into(), options, Default::default())
                    .await)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            },
        )
        .await;
        let types = queue_types(&first_node);
        assert!(types.contains(&format!("{queue}\tquorum")), "{types}");
    };
    // Both connect to the first node; it dies.
    run_through_a_node_failure(
        "rabbitmq cluster",
        dir.path(),
        &cfg,
        store,
        &handler,
        ready,
        || cluster.kill(0),
    )
    .await;
}

/// `rabbitmqctl list_queues name type` on `node`.
fn queue_types(node: &str) -> String {
    let out = std::process::Command::new("/usr/lib/rabbitmq/bin/rabbitmqctl")
        .args([
            "-n",
            node,
            "-q",
            "--no-table-headers",
            "list_queues",
            "name",
            "type",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_carry_on_when_a_nats_cluster_node_dies() {
    let cluster = NatsCluster::start(3).await;
    let urls = toml_list(&cluster.urls());
    let (url, store) = common::server_outbox("postgres", "pbx_nats_cluster", 4).await;
    let handler = Recorder::start().await;
    let stream = scratch_name("PBXCL").replace('-', "_");
    // The stream, replicated on all three nodes (R3), made the way an
    // operator would before pointing postbox at it.
    let client = async_nats::connect(cluster.urls()[1].as_str())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.ev.>")],
        num_replicas: 3,
        ..Default::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::write_config(
        dir.path(),
        &format!(
            "{}[[publishers]]\nkind = \"nats\"\nname = \"nats\"\nurls = {urls}\nstream = \"{stream}\"\nsubject = \"{stream}.ev.{{app_code}}.{{event_type}}\"\n\
             [[consumers]]\nkind = \"nats\"\nurls = {urls}\nqueue = \"{stream}\"\nsubject = \"{stream}.ev.>\"\ndeclare = true\n\
             prefetch = 20\nretry_delay = \"200ms\"\nack_wait = \"5s\"\n\
             handler = {{ http = \"{}/handle\", timeout = \"5s\" }}\n",
            outbox_toml(&url, store.table().as_str()),
            handler.url
        ),
    );
    let ready = async || {
        eventually(
            "the durable consumer",
            Duration::from_secs(30),
            async || {
                let s = js.get_stream(&stream).await.map_err(|e| e.to_string())?;
                let info = s.cached_info();
                (info.state.consumer_count > 0)
                    .then_some(())
                    .ok_or_else(|| "no consumer yet".to_owned())
            },
        )
        .await;
    };
    run_through_a_node_failure(
        "nats cluster",
        dir.path(),
        &cfg,
        store,
        &handler,
        ready,
        || cluster.kill(0),
    )
    .await;
}

/// Declares `exchange` (durable topic) and `queue`, bound with `#`, on the
/// broker at `url`.
async fn exchange_and_queue(url: &str, exchange: &str, queue: &str) -> lapin::Connection {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    let conn = lapin::Connection::connect(url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let kind = lapin::ExchangeKind::Topic;
    (ch.exchange_declare(exchange.into(), kind, durable, Default::default())
        .await)
        .unwrap();
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    (ch.queue_declare(queue.into(), options, Default::default())
        .await)
        .unwrap();
    let bind = QueueBindOptions::default();
    (ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        bind,
        Default::default(),
    )
    .await)
        .unwrap();
    conn
}

/// The `message_id`s of every message in `queue` (read and removed).
async fn drain(url: &str, queue: &str) -> Vec<String> {
    let conn = lapin::Connection::connect(url, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let mut ids = Vec::new();
    let options = lapin::options::BasicGetOptions { no_ack: true };
    while let Some(m) = ch.basic_get(queue.into(), options).await.unwrap() {
        ids.push(
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string(),
        );
    }
    ids
}

/// A sample of the relay's `/metrics`, 0 when absent.
async fn metric(admin: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let response =
        postbox_testkit::http::request(admin.parse().unwrap(), "GET", "/metrics", &[]).await;
    let samples = postbox_testkit::http::parse_prometheus(&response.body).unwrap();
    (samples.iter())
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map_or(0.0, |s| s.value)
}

/// Enqueues `n` events; their ids.
async fn enqueue(store: &Arc<dyn OutboxStore>, n: usize) -> Vec<String> {
    let events: Vec<_> = (0..n)
        .map(|i| NewEvent::new("room", "RoomCreated", format!(r#"{{"n":{i}}}"#)))
        .collect();
    for chunk in events.chunks(50) {
        store.enqueue_batch(chunk, 1 << 20).await.unwrap();
    }
    events.into_iter().map(|e| e.event_id).collect()
}

async fn delivered(store: &Arc<dyn OutboxStore>, n: usize, what: &str) {
    eventually(what, Duration::from_secs(60), async || {
        let delivered = common::delivered_rooms(store.as_ref()).await as usize;
        (delivered == n)
            .then_some(())
            .ok_or(format!("{delivered} of {n} delivered"))
    })
    .await;
}

/// Drives a publisher `mq` with a failover target through an outage of
/// its primary: 300 events through the primary; `stop`, 300 more (through
/// the secondary); `start`, back on the primary; 300 more. `read(primary)`
/// gives the event ids a target holds. Every event must reach a target,
/// each phase's on the right one, with one switch each way.
/// A relay's setup for [`fail_over_and_back`]: its config file in `dir`,
/// its outbox, the address of its admin server.
struct Failover<'a> {
    label: &'a str,
    dir: &'a Path,
    cfg: &'a str,
    store: &'a Arc<dyn OutboxStore>,
    admin: &'a str,
}

async fn fail_over_and_back(
    Failover {
        label,
        dir,
        cfg,
        store,
        admin,
    }: Failover<'_>,
    stop: impl AsyncFnOnce(),
    start: impl AsyncFnOnce(),
    read: impl AsyncFn(bool) -> Vec<String>,
) {
    let mut relay = common::spawn_async(dir, cfg, "relay", &[]);
    let active = async |target: &str| {
        let labels = [("publisher", "mq"), ("target", target)];
        metric(admin, "postbox_publisher_active_target", &labels).await
    };
    let active_in_api = async || {
        let api =
            postbox_testkit::http::request(admin.parse().unwrap(), "GET", "/api/publishers", &[])
                .await;
        api.json()["active_targets"]["mq"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };

    let before = enqueue(store, 300).await;
    delivered(store, 300, "the first events, through the primary").await;

    let down = Instant::now();
    stop().await;
    let during = enqueue(store, 300).await;
    delivered(store, 600, "the events sent while the primary is down").await;
    let failover = down.elapsed();
    assert_eq!(active("secondary").await, 1.0);
    assert_eq!(active_in_api().await, "secondary");

    let up = Instant::now();
    start().await;
    eventually(
        "publishing back on the primary",
        Duration::from_secs(60),
        async || {
            (active("primary").await == 1.0)
                .then_some(())
                .ok_or_else(|| "still on the secondary".to_owned())
        },
    )
    .await;
    let failback = up.elapsed();
    assert_eq!(active_in_api().await, "primary");
    let after = enqueue(store, 300).await;
    delivered(store, 900, "the events after the primary came back").await;
    for (from, to) in [("primary", "secondary"), ("secondary", "primary")] {
        let labels = [("publisher", "mq"), ("from", from), ("to", to)];
        let switches = metric(admin, "postbox_publisher_switches_total", &labels).await;
        assert_eq!(switches, 1.0, "one switch from {from} to {to}");
    }
    common::stopped(&mut relay).await;

    let on_primary: HashSet<_> = read(true).await.into_iter().collect();
    let on_secondary: HashSet<_> = read(false).await.into_iter().collect();
    let all: HashSet<_> = before
        .iter()
        .chain(&during)
        .chain(&after)
        .cloned()
        .collect();
    let reached: HashSet<_> = on_primary.union(&on_secondary).cloned().collect();
    let both = on_primary.intersection(&on_secondary).count();
    println!(
        "{label}: 900 events, lost {}, on both targets {both}; the events of the outage all delivered (through the secondary) {failover:?} after the primary stopped; back on the primary {failback:?} after it started",
        all.difference(&reached).count()
    );
    assert_eq!(reached, all, "every event reached a target");
    assert!(
        before.iter().all(|id| on_primary.contains(id)),
        "before the outage: the primary"
    );
    assert!(
        during.iter().all(|id| on_secondary.contains(id)),
        "during it: the secondary"
    );
    assert!(
        after.iter().all(|id| on_primary.contains(id)),
        "after the failback: the primary"
    );
}

/// `[admin]` on a free port, and its address.
fn admin_toml() -> (String, String) {
    let admin = format!("127.0.0.1:{}", postbox_testkit::clusters::free_port());
    (format!("[admin]\nlisten = \"{admin}\"\n"), admin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_fails_over_to_the_secondary_broker_and_back() {
    rabbit_fail_over_and_back("rabbitmq failover", "pbx_failover", |primary, up| {
        if up {
            primary.start_app(0)
        } else {
            primary.stop_app(0)
        }
    })
    .await;
}

/// The primary broker blocks publishing (a memory alarm) and clears it:
/// the publisher counts a blocked connection as down, fails over to the
/// secondary and comes back. A blocked connection counted as up: the
/// publisher stayed on the primary, every publish failed and the events
/// walked towards `failed` while the secondary stood idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_fails_over_while_the_primary_blocks_publishing() {
    rabbit_fail_over_and_back(
        "rabbitmq failover on a memory alarm",
        "pbx_alarm",
        |primary, up| primary.memory_alarm(0, !up),
    )
    .await;
}

/// [`fail_over_and_back`] over two single-node RabbitMQ brokers, the
/// primary taken down and up again by `set(primary, up)` (blocking).
async fn rabbit_fail_over_and_back(label: &str, prefix: &str, set: fn(&RabbitCluster, bool)) {
    let (primary, secondary) = tokio::join!(
        tokio::task::spawn_blocking(|| RabbitCluster::start(1)),
        tokio::task::spawn_blocking(|| RabbitCluster::start(1)),
    );
    let (primary, secondary) = (Arc::new(primary.unwrap()), secondary.unwrap());
    let (primary_url, secondary_url) = (primary.urls()[0].clone(), secondary.urls()[0].clone());
    let (url, store) = common::server_outbox("postgres", prefix, 4).await;
    let (exchange, queue) = (scratch_name("pbx_fox"), scratch_name("pbx_foq"));
    exchange_and_queue(&primary_url, &exchange, &queue).await;
    exchange_and_queue(&secondary_url, &exchange, &queue).await;
    let (admin_toml, admin) = admin_toml();
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::write_config(
        dir.path(),
        &format!(
            "{}[[publishers]]\nkind = \"rabbitmq\"\nname = \"mq\"\nurl = \"{primary_url}\"\nexchange = \"{exchange}\"\n\
             failover = [{{ name = \"secondary\", url = \"{secondary_url}\" }}]\nfailover_after = \"2s\"\nfailback_after = \"3s\"\n{admin_toml}",
            outbox_toml(&url, store.table().as_str()),
        ),
    );
    let (down, up) = (primary.clone(), primary.clone());
    let setup = Failover {
        label,
        dir: dir.path(),
        cfg: &cfg,
        store: &store,
        admin: &admin,
    };
    fail_over_and_back(
        setup,
        async || {
            tokio::task::spawn_blocking(move || set(&down, false))
                .await
                .unwrap()
        },
        async || {
            tokio::task::spawn_blocking(move || set(&up, true))
                .await
                .unwrap()
        },
        async |primary| {
            let url = if primary {
                &primary_url
            } else {
                &secondary_url
            };
            drain(url, &queue).await
        },
    )
    .await;
}

/// The `x-event-id` of every message in `stream` on the server at `url`.
async fn stream_event_ids(url: &str, stream: &str) -> Vec<String> {
    let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
    let mut stream = js.get_stream(stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut ids = Vec::new();
    for seq in 1..=last {
        let m = stream.get_raw_message(seq).await.unwrap();
        ids.push(m.headers.get("x-event-id").unwrap().as_str().to_owned());
    }
    ids
}

/// Two single-server JetStream systems, each with the stream `stream`, a
/// PostgreSQL outbox, and a config whose publisher `mq` publishes to the
/// primary with the secondary as its failover target (`failover_after =
/// "2s"`, `failback_after = "3s"`) and `[admin]` on `admin`.
struct NatsPair {
    primary: NatsCluster,
    /// Held so that the secondary runs as long as the pair (it stops on drop).
    _secondary: NatsCluster,
    primary_url: String,
    secondary_url: String,
    store: Arc<dyn OutboxStore>,
    stream: String,
    admin: String,
    dir: tempfile::TempDir,
    cfg: String,
}

impl NatsPair {
    async fn start(prefix: &str) -> NatsPair {
        let (primary, secondary) = (NatsCluster::start(1).await, NatsCluster::start(1).await);
        let (primary_url, secondary_url) = (primary.urls()[0].clone(), secondary.urls()[0].clone());
        let (url, store) = common::server_outbox("postgres", prefix, 4).await;
        let stream = scratch_name("PBXFO").replace('-', "_");
        for url in [&primary_url, &secondary_url] {
            let js = async_nats::jetstream::new(async_nats::connect(url.as_str()).await.unwrap());
            js.create_stream(async_nats::jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![format!("{stream}.>")],
                ..Default::default()
            })
            .await
            .unwrap();
        }
        let (admin_toml, admin) = admin_toml();
        let dir = tempfile::tempdir().unwrap();
        let cfg = common::write_config(
            dir.path(),
            &format!(
                "{}[[publishers]]\nkind = \"nats\"\nname = \"mq\"\nurl = \"{primary_url}\"\nstream = \"{stream}\"\nsubject = \"{stream}.{{app_code}}.{{event_type}}\"\n\
                 failover = [{{ name = \"secondary\", url = \"{secondary_url}\" }}]\nfailover_after = \"2s\"\nfailback_after = \"3s\"\n{admin_toml}",
                outbox_toml(&url, store.table().as_str()),
            ),
        );
        NatsPair {
            primary,
            _secondary: secondary,
            primary_url,
            secondary_url,
            store,
            stream,
            admin,
            dir,
            cfg,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_publisher_fails_over_to_the_secondary_system_and_back() {
    let pair = NatsPair::start("pbx_nats_failover").await;
    let setup = Failover {
        label: "nats failover",
        dir: pair.dir.path(),
        cfg: &pair.cfg,
        store: &pair.store,
        admin: &pair.admin,
    };
    fail_over_and_back(
        setup,
        async || pair.primary.kill(0),
        async || pair.primary.restart(0).await,
        async |primary| {
            let url = if primary {
                &pair.primary_url
            } else {
                &pair.secondary_url
            };
            stream_event_ids(url, &pair.stream).await
        },
    )
    .await;
}

/// A relay that starts while the primary is down publishes to the failover
/// target (it refused to start before: every target had to answer), and
/// moves to the primary once it is up and steady.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_starts_while_the_primary_is_down_and_fails_back_when_it_is_up() {
    let pair = NatsPair::start("pbx_nats_late").await;
    pair.primary.kill(0);
    let mut relay = common::spawn_async(pair.dir.path(), &pair.cfg, "relay", &[]);
    let started = Instant::now();
    let during = enqueue(&pair.store, 300).await;
    delivered(
        &pair.store,
        300,
        "the events sent while the primary is down",
    )
    .await;
    let first_delivery = started.elapsed();
    // The gauge is exported on the watcher's next look (every 0.5 s).
    let on = async |target: &str| {
        let labels = [("publisher", "mq"), ("target", target)];
        eventually(
            &format!("publishing on the {target}"),
            Duration::from_secs(60),
            async || {
                let active = metric(&pair.admin, "postbox_publisher_active_target", &labels).await;
                (active == 1.0)
                    .then_some(())
                    .ok_or_else(|| format!("not on the {target}"))
            },
        )
        .await
    };
    on("secondary").await;

    let up = Instant::now();
    pair.primary.restart(0).await;
    on("primary").await;
    let failback = up.elapsed();
    let after = enqueue(&pair.store, 300).await;
    delivered(&pair.store, 600, "the events after the primary came up").await;
    common::stopped(&mut relay).await;

    let on_primary: HashSet<_> = stream_event_ids(&pair.primary_url, &pair.stream)
        .await
        .into_iter()
        .collect();
    let on_secondary: HashSet<_> = stream_event_ids(&pair.secondary_url, &pair.stream)
        .await
        .into_iter()
        .collect();
    println!(
        "relay started with the primary down: 300 events through the secondary in {first_delivery:?}; on the primary {failback:?} after it started; 300 more there"
    );
    assert!(
        during.iter().all(|id| on_secondary.contains(id)),
        "while down: the secondary"
    );
    assert!(
        after.iter().all(|id| on_primary.contains(id)),
        "once up: the primary"
    );
}
