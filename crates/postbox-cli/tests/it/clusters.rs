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
/// retry budget (10 attempts, 0.5 s doubling to 2 s: about 17 s) outlasts
/// a cluster's leader elections on a loaded 2-core machine.
fn outbox_toml(url: &str, table: &str) -> String {
    format!(
        "[database]\nurl = \"{url}\"\ntable = \"{table}\"\napp_codes = [\"room\"]\nmax_connections = 4\n\
         [outbox_worker]\npoll_interval = \"100ms\"\nbatch_size = 100\ninitial_backoff = \"500ms\"\nmax_backoff = \"2s\"\n"
    )
}

/// Enqueues [`EVENTS`] events in batches of 40 every 50 ms (about 800 a
/// second), like a service under load.
fn produce(store: Arc<dyn OutboxStore>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for chunk in 0..EVENTS / 40 {
            let events: Vec<_> = (0..40)
                .map(|k| {
                    NewEvent::new(
                        "room",
                        "RoomCreated",
                        format!(r#"{{"n":{}}}"#, chunk * 40 + k),
                    )
                })
                .collect();
            store.enqueue_batch(&events, 1 << 20).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
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
    let producer = produce(store.clone());
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
    eventually(
        "every event handled",
        Duration::from_secs(180),
        async || {
            let (distinct, _) = handled(handler);
            (distinct == EVENTS)
                .then_some(())
                .ok_or(format!("{distinct} of {EVENTS} handled"))
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
    let mut cluster = NatsCluster::start(3).await;
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
