//! `postbox consume` as a process: prefetch 1 across three processes on one
//! queue, the bridge to a Python handler, config errors.

use crate::common;

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use postbox_testkit::consumer_fixtures::{
    broker, delete_queues, eventually, rabbitmqctl_list, AmqpEvent,
};
use postbox_testkit::http::Recorder;
use postbox_testkit::servers::{amqp_url, scratch_table};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

fn postbox() -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.env_remove("POSTBOX_CONFIG").kill_on_drop(true);
    c
}

/// `postbox --config config consume`.
fn consume(config: &Path) -> tokio::process::Command {
    let mut c = postbox();
    c.args(["--config", config.to_str().unwrap(), "consume"]);
    c
}

/// All that `child` wrote to its piped stderr, once it has exited.
async fn stderr_of(child: &mut tokio::process::Child) -> String {
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    err
}

/// Publishes with the relay's mapping, straight to `queue`.
async fn publish(ch: &Channel, queue: &str, event_id: &str, payload: &str) {
    AmqpEvent {
        event_id,
        event_type: "RoomCreated",
        app_code: "room",
        created_at_ms: 1_700_000_000_000,
        aggregate_id: Some("room-7"),
        aggregate_version: None,
    }
    .publish(ch, queue, payload)
    .await;
}

/// Publishes without waiting for the confirm; returns it.
async fn publish_nowait(ch: &Channel, queue: &str, event_id: &str) -> lapin::PublisherConfirm {
    let props = BasicProperties::default()
        .with_message_id(event_id.into())
        .with_type("RoomCreated".into())
        .with_app_id("room".into())
        .with_delivery_mode(2);
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        b"{}",
        props,
    )
    .await
    .unwrap()
}

fn write_config(dir: &Path, body: &str) -> std::path::PathBuf {
    let path = dir.join("postbox.toml");
    std::fs::File::create(&path)
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    path
}

fn consumer_toml(queue: &str, handler_url: &str, extra: &str) -> String {
    format!(
        "[[consumers]]\nkind = \"rabbitmq\"\nurl = \"{}\"\nqueue = \"{queue}\"\ndeclare = true\nprefetch = 1\nretry_delay = \"200ms\"\nhandler = {{ http = \"{handler_url}\", timeout = \"5s\" }}\n{extra}",
        amqp_url()
    )
}

/// A handler answering every POST with 200 after `hold`, recording the
/// `Idempotency-Key` of each request.
async fn slow_server(hold: Duration) -> (String, Recorder) {
    http_server(hold, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await
}

/// [`slow_server`] giving `answer` (a whole HTTP/1.1 response).
async fn http_server(hold: Duration, answer: &'static [u8]) -> (String, Recorder) {
    let recorder = Recorder::answering(hold, answer).await;
    (format!("{}/events", recorder.url), recorder)
}

/// `rabbitmqctl`: the channels consuming `queue` and their unacked counts.
async fn sample_unacked(queue: &str) -> Vec<(String, u64)> {
    let pids = consumer_channels(queue).await;
    unacked_on(&pids).await
}

/// `rabbitmqctl list_consumers`: the channels consuming `queue`.
async fn consumer_channels(queue: &str) -> Vec<String> {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "--no-table-headers",
            "list_consumers",
            "queue_name",
            "channel_pid",
        ])
        .output()
        .await
        .expect("rabbitmqctl on PATH");
    let pids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split('\t');
            (f.next()? == queue).then(|| f.next().map(str::to_owned))?
        })
        .collect();
    pids
}

/// `rabbitmqctl list_channels`: unacked messages on each of `pids`.
async fn unacked_on(pids: &[String]) -> Vec<(String, u64)> {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "--no-table-headers",
            "list_channels",
            "pid",
            "messages_unacknowledged",
        ])
        .output()
        .await
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split('\t');
            let pid = f.next()?.to_owned();
            let unacked = f.next()?.trim().parse().ok()?;
            pids.contains(&pid).then_some((pid, unacked))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_with_prefetch_one_share_a_queue() {
    const N: usize = 1000;
    let (_conn, ch) = broker().await;
    let queue = scratch_table("prefetch");
    let (url, keys) = slow_server(Duration::from_millis(20)).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &consumer_toml(&queue, &url, ""));

    // Declare through a first process start, then fill the queue.
    let mut procs = Vec::new();
    for _ in 0..3 {
        procs.push(
            postbox()
                .args([
                    "--config",
                    config.to_str().unwrap(),
                    "--log",
                    "postbox_consumers=debug",
                    "consume",
                ])
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
    }
    // Read the logs as they come, so that a full pipe never stalls a consumer.
    let logs: Vec<_> = procs
        .iter_mut()
        .map(|p| {
            let mut err = p.stderr.take().unwrap();
            tokio::spawn(async move {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s).await;
                s
            })
        })
        .collect();
    let start = Instant::now();
    let pids = loop {
        let pids = consumer_channels(&queue).await;
        if pids.len() == 3 {
            break pids;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "three consumers did not start"
        );
    };
    // Publish the whole backlog quickly: confirms are awaited together.
    let mut confirms = Vec::new();
    for i in 0..N {
        confirms.push(publish_nowait(&ch, &queue, &format!("p-{i}")).await);
    }
    for c in confirms {
        c.await.unwrap();
    }
    let mut samples = Vec::new();
    while keys.keys().len() < N {
        assert!(
            start.elapsed() < Duration::from_secs(55),
            "not all messages handled"
        );
        let s = unacked_on(&pids).await;
        if keys.keys().len() < N - 50 {
            samples.push(s);
        }
    }
    for p in &procs {
        common::signal("TERM", p.id().unwrap());
    }
    let mut handled_per_process = Vec::new();
    for (mut p, log) in procs.into_iter().zip(logs) {
        let status = p.wait().await.unwrap();
        assert!(status.success(), "consume exits 0 on SIGTERM: {status:?}");
        let log = log.await.unwrap();
        handled_per_process.push(log.lines().filter(|l| l.contains("handled")).count());
    }
    println!(
        "handled per process: {handled_per_process:?}; {} samples: {samples:?}",
        samples.len()
    );
    assert!(
        samples.len() >= 2,
        "too few rabbitmqctl samples during the run"
    );
    for s in &samples {
        for (pid, unacked) in s {
            assert!(
                *unacked <= 1,
                "channel {pid} held {unacked} unacked messages with prefetch 1"
            );
        }
    }
    assert!(
        samples.iter().any(|s| s.iter().any(|(_, u)| *u == 1)),
        "samples saw work in flight"
    );
    assert!(
        handled_per_process.iter().all(|n| *n > 0),
        "every process did work: {handled_per_process:?}"
    );
    let keys = keys.keys();
    let mut distinct: Vec<&String> = keys.iter().collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), N, "every message reached the handler");
    assert_eq!(handled_per_process.iter().sum::<usize>(), N);
    delete_queues(&ch, &queue).await;
}

#[tokio::test]
async fn the_bridge_delivers_to_a_python_handler_once_per_event() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("received.jsonl");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/handler.py");
    let mut python = tokio::process::Command::new("python3")
        .arg(&script)
        .arg(&out)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 on PATH");
    let port = BufReader::new(python.stdout.take().unwrap())
        .lines()
        .next_line()
        .await
        .unwrap()
        .expect("the handler prints its port");

    let (_conn, ch) = broker().await;
    let queue = scratch_table("bridge");
    let inbox = format!("sqlite://{}", dir.path().join("inbox.db").display());
    let config = write_config(
        dir.path(),
        &consume_toml_with_inbox(&queue, &format!("http://127.0.0.1:{port}/events"), &inbox),
    );
    let mut bridge = consume(&config).spawn().unwrap();
    let start = consuming(&queue).await;
    publish(&ch, &queue, "py-1", r#"{"room":7}"#).await;
    publish(&ch, &queue, "py-2", "not json").await;
    publish(&ch, &queue, "py-1", r#"{"room":7}"#).await; // a redelivery
    publish(&ch, &queue, "py-3", "[1,2]").await;
    let read = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    while read().len() < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "python handler got {:?}",
            read()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The redelivered py-1 sits between py-2 and py-3: it was not posted again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = read();
    let ids: Vec<&str> = got
        .iter()
        .map(|g| g["envelope"]["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["py-1", "py-2", "py-3"]);
    let first = &got[0];
    assert_eq!(first["idempotency_key"], "py-1");
    let e = &first["envelope"];
    assert_eq!(e["event_type"], "RoomCreated");
    assert_eq!(e["app_code"], "room");
    assert_eq!(e["aggregate_id"], "room-7");
    assert_eq!(e["created_at_ms"], 1_700_000_000_000i64);
    assert_eq!(e["payload"], serde_json::json!({"room": 7}));
    assert_eq!(e["headers"]["x-attempt"], 1);
    assert_eq!(got[1]["envelope"]["payload"], "not json");

    common::stopped(&mut bridge).await;
    delete_queues(&ch, &queue).await;
}

/// Waits until a consumer takes messages from `queue` (a consuming channel
/// shows up); returns when it started waiting.
async fn consuming(queue: &str) -> Instant {
    let start = Instant::now();
    while sample_unacked(queue).await.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "consumer did not start"
        );
    }
    start
}

/// A handler answering every POST with 422 (no such room).
async fn refusing_handler() -> (String, Recorder) {
    http_server(
        Duration::ZERO,
        b"HTTP/1.1 422 Unprocessable Entity\r\ncontent-length: 12\r\n\r\nno such room",
    )
    .await
}

/// A handler that answers 422 says no retry can mend the event: it is
/// posted once and dead-lettered at once, the answer in `x-last-error`,
/// while a retry (200 ms here, 5 attempts) would have posted it again.
#[tokio::test]
async fn a_422_from_the_handler_dead_letters_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (url, keys) = refusing_handler().await;
    let (_conn, ch) = broker().await;
    let queue = scratch_table("unprocessable");
    let config = write_config(dir.path(), &consumer_toml(&queue, &url, ""));
    let mut consumer = consume(&config).spawn().unwrap();
    let start = consuming(&queue).await;
    publish(&ch, &queue, "bad-1", r#"{"room":404}"#).await;
    let dead = postbox_core::wire::rabbitmq::dead_queue(&queue);
    let got = loop {
        let got = ch
            .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        if let Some(got) = got {
            break got;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "nothing reached {dead}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Time for a retry, had there been one.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(keys.keys(), ["bad-1"], "posted once");
    let headers = got.properties.headers().clone().unwrap_or_default();
    let last_error = match headers.inner().get(postbox_core::wire::LAST_ERROR) {
        Some(AMQPValue::LongString(s)) => s.to_string(),
        other => panic!("x-last-error is {other:?}"),
    };
    assert!(
        last_error.contains("422") && last_error.contains("no such room"),
        "{last_error}"
    );
    common::stopped(&mut consumer).await;
    delete_queues(&ch, &queue).await;
}

/// The body of `GET path` on `addr` (HTTP/1.0: the server closes).
async fn http_get(addr: &str, path: &str) -> String {
    http_get_as(addr, path, None).await
}

/// [`http_get`] with `token` as bearer; the answer must be a 200.
async fn http_get_as(addr: &str, path: &str, token: Option<&str>) -> String {
    let (status, body) = http_call(addr, "GET", path, token).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// A loopback address nothing listens on now, for `admin.listen`.
fn free_addr() -> String {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    free.local_addr().unwrap().to_string()
}

/// A running `postbox consume` of a scratch queue, bridged to a handler
/// answering 200 after 20 ms, with `[admin]` on a free address. (Bind
/// `_dir` and `_conn` too: they hold its config file and the broker
/// connection of `ch`.)
struct AdminConsume {
    _dir: tempfile::TempDir,
    keys: Recorder,
    _conn: lapin::Connection,
    ch: Channel,
    queue: String,
    addr: String,
    config: std::path::PathBuf,
    consumer: tokio::process::Child,
    /// When it started consuming.
    start: Instant,
}

/// [`AdminConsume`] on a queue named after `prefix`, `admin` added to its
/// `[admin]` section.
async fn admin_consume(prefix: &str, admin: &str) -> AdminConsume {
    admin_consume_on(slow_server(Duration::from_millis(20)).await, prefix, admin).await
}

/// [`admin_consume`] bridged to `handler` (its URL and the keys it saw).
async fn admin_consume_on(handler: (String, Recorder), prefix: &str, admin: &str) -> AdminConsume {
    let dir = tempfile::tempdir().unwrap();
    let (url, keys) = handler;
    let (conn, ch) = broker().await;
    let queue = scratch_table(prefix);
    let addr = free_addr();
    let toml = format!(
        "{}\n[admin]\nlisten = \"{addr}\"\n{admin}",
        consumer_toml(&queue, &url, "")
    );
    let config = write_config(dir.path(), &toml);
    let consumer = consume(&config).spawn().unwrap();
    let start = consuming(&queue).await;
    AdminConsume {
        _dir: dir,
        keys,
        _conn: conn,
        ch,
        queue,
        addr,
        config,
        consumer,
        start,
    }
}

/// With `[admin]`, `postbox consume` serves `/healthz` and `/metrics`:
/// each message counted by result, and the handler's time per message.
#[tokio::test]
async fn consume_serves_its_metrics() {
    let AdminConsume {
        keys,
        ch,
        queue,
        addr,
        mut consumer,
        start,
        _dir,
        _conn,
        ..
    } = admin_consume("consume_metrics", "").await;
    assert!(http_get(&addr, "/healthz").await.contains("ok"));
    publish(&ch, &queue, "m-1", "{}").await;
    publish(&ch, &queue, "m-2", "{}").await;
    let ok = format!("postbox_consume_total{{consumer=\"{queue}\",result=\"ok\"}} 2");
    let metrics = loop {
        let metrics = http_get(&addr, "/metrics").await;
        if metrics.contains(&ok) {
            break metrics;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no `{ok}` in:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(keys.keys().len(), 2);
    let count = format!("postbox_consume_handler_seconds_count{{consumer=\"{queue}\"}} 2");
    assert!(metrics.contains(&count), "no `{count}` in:\n{metrics}");
    // Issue 15.6: every consumer metric the shipped alert rules and Grafana
    // dashboard name is one this process exports.
    let samples = postbox_testkit::http::parse_prometheus(&metrics).unwrap();
    postbox_testkit::http::assert_deploy_names_exported(&samples, |n| {
        n.starts_with("postbox_consume_")
    });
    common::stopped(&mut consumer).await;
    delete_queues(&ch, &queue).await;
}

/// `POST path` on `addr` with `token` as bearer (if any): the status code
/// and the body.
async fn http_post(addr: &str, path: &str, token: Option<&str>) -> (u16, String) {
    http_call(addr, "POST", path, token).await
}

/// `method path` on `addr` with `token` as bearer (if any): the status
/// code and the body (HTTP/1.0: the server closes).
async fn http_call(addr: &str, method: &str, path: &str, token: Option<&str>) -> (u16, String) {
    http_send(addr, method, path, token, None).await
}

/// [`http_call`] with a JSON `body`, if any.
async fn http_send(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&serde_json::Value>,
) -> (u16, String) {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    let body = body.map_or(String::new(), |b| b.to_string());
    let kind = if body.is_empty() {
        ""
    } else {
        "content-type: application/json\r\n"
    };
    sock.write_all(
        format!(
            "{method} {path} HTTP/1.0\r\nhost: {addr}\r\n{auth}{kind}content-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut text = String::new();
    sock.read_to_string(&mut text).await.unwrap();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `POST /api/consumers/{name}/{action}` as the holder of `token`.
async fn switch(addr: &str, name: &str, action: &str, token: &str) -> (u16, String) {
    http_post(
        addr,
        &format!("/api/consumers/{name}/{action}"),
        Some(token),
    )
    .await
}

/// `name`'s entry in `GET /api/consumers` (read with `token`).
async fn consumer_entry(addr: &str, name: &str, token: &str) -> serde_json::Value {
    let all: serde_json::Value =
        serde_json::from_str(&http_get_as(addr, "/api/consumers", Some(token)).await).unwrap();
    all["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no consumer {name} in {all}"))
}

/// Issue 14.2: a consumer is paused and resumed by name through the admin
/// API of its `postbox consume` process. Paused, it cancels its RabbitMQ
/// consumer once the message in hand is done: new messages wait in the
/// queue, ready, held by no one; resumed, it takes them, each once, none
/// redelivered.
#[tokio::test]
async fn a_consumer_is_paused_and_resumed_by_name() {
    let token = "pause-token-5d1";
    let viewer = "viewer-token-9c2";
    let AdminConsume {
        keys,
        ch,
        queue,
        addr,
        config,
        mut consumer,
        start,
        _dir,
        _conn,
    } = admin_consume(
        "consume_pause",
        &format!(
            "token = \"{token}\"\n\
             [[admin.tokens]]\nname = \"watcher\"\nrole = \"viewer\"\ntoken = \"{viewer}\"\n"
        ),
    )
    .await;
    publish(&ch, &queue, "p-1", "{}").await;
    while keys.keys().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(20), "p-1 not handled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let entry = consumer_entry(&addr, &queue, token).await;
    assert_eq!(entry["state"], "consuming", "{entry}");
    assert_eq!(entry["kind"], "rabbitmq", "{entry}");
    let (status, body) = http_call(&addr, "GET", "/api/consumers", None).await;
    assert_eq!(
        status, 401,
        "with a token configured, listing needs one: {body}"
    );
    assert!(!body.contains(&queue), "{body}");
    // A viewer lists, and may not pause.
    assert_eq!(
        consumer_entry(&addr, &queue, viewer).await["state"],
        "consuming"
    );
    let (status, body) = switch(&addr, &queue, "pause", viewer).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains("watcher") && body.contains("operator"),
        "{body}"
    );

    let pause = format!("/api/consumers/{queue}/pause");
    assert_eq!(http_post(&addr, &pause, None).await.0, 401, "no token");
    assert_eq!(http_post(&addr, &pause, Some("wrong")).await.0, 401);
    let (status, body) = http_post(&addr, "/api/consumers/nope/pause", Some(token)).await;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains(&queue), "names the consumers it runs: {body}");
    let (status, body) = http_post(&addr, &pause, Some(token)).await;
    assert_eq!(status, 200, "{body}");
    let shown: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(shown["changed"], true, "{shown}");
    let paused = Instant::now();
    while consumer_entry(&addr, &queue, token).await["state"] != "paused" {
        assert!(paused.elapsed() < Duration::from_secs(10), "never paused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        consumer_channels(&queue).await.is_empty(),
        "the broker has no consumer of {queue} while paused"
    );
    for id in ["p-2", "p-3", "p-4"] {
        publish(&ch, &queue, id, "{}").await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(keys.keys(), ["p-1"], "nothing taken while paused");
    let counts = rabbitmqctl_list(
        "queues",
        &["name", "messages_ready", "messages_unacknowledged"],
    )
    .await;
    assert!(
        counts.lines().any(|l| l == format!("{queue}\t3\t0")),
        "three ready, none held: {counts}"
    );
    // The same from the command line, which reads `[admin]` of the config.
    let cli = |args: &[&str]| {
        let mut c = postbox();
        c.args(["--config", config.to_str().unwrap()]).args(args);
        c.output()
    };
    let out = cli(&["consumers", "pause", &queue]).await.unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        shown.contains(&format!("consumer {queue}: paused (no change)")),
        "{shown}"
    );
    let out = cli(&["consumers"]).await.unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with(queue.as_str()) && l.contains("paused")),
        "{shown}"
    );

    let (status, body) = switch(&addr, &queue, "resume", token).await;
    assert_eq!(status, 200, "{body}");
    let resumed = Instant::now();
    while keys.keys().len() < 4 {
        assert!(
            resumed.elapsed() < Duration::from_secs(20),
            "not resumed: {:?}",
            keys.keys()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut got = keys.keys();
    got.sort();
    assert_eq!(got, ["p-1", "p-2", "p-3", "p-4"], "each once");
    let entry = consumer_entry(&addr, &queue, token).await;
    assert_eq!(entry["state"], "consuming", "{entry}");
    assert_eq!(entry["ok"], 4, "{entry}");
    let out = cli(&["--json", "consumers", "list"]).await.unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed["consumers"][0]["ok"], 4, "{listed}");
    common::stopped(&mut consumer).await;
    // No process behind the address: exit 1, naming the address.
    let out = cli(&["consumers"]).await.unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&addr),
        "{out:?}"
    );
    delete_queues(&ch, &queue).await;
}

fn consume_toml_with_inbox(queue: &str, url: &str, inbox: &str) -> String {
    consumer_toml(
        queue,
        url,
        &format!(
            "consumer_group = \"py\"\ninbox = {{ url = \"{inbox}\", table = \"bridge_inbox\" }}\n"
        ),
    )
}

/// SIGTERM while `consume` opens an inbox whose database never answers
/// ends it at once, exit 0. It waited for the pool's 30 s connect timeout
/// (then failed), and a database that stopped answering after the
/// connection, while the inbox tables were checked, held it for good.
#[tokio::test]
async fn consume_stops_when_asked_while_its_inbox_database_is_silent() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, inbox) = postbox_testkit::proxy::to_postgres().await;
    proxy.silence();
    let toml = consume_toml_with_inbox("q-silent-inbox", "http://127.0.0.1:1/", &inbox);
    let config = write_config(dir.path(), &toml);
    let mut child = consume(&config).stderr(Stdio::piped()).spawn().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "consume is still opening its inbox"
    );
    common::signal("TERM", child.id().unwrap());
    let exited = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let Ok(status) = exited else {
        child.start_kill().unwrap();
        panic!("consume still running 10 s after SIGTERM");
    };
    let stderr = stderr_of(&mut child).await;
    assert!(status.unwrap().success(), "{stderr}");
}

#[tokio::test]
async fn bad_consumer_config_exits_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut cases = HashMap::new();
    cases.insert(
        "consumers.0.prefetch",
        consumer_toml("q", "http://127.0.0.1:1/", "prefetch = 0\n").replace("prefetch = 1\n", ""),
    );
    cases.insert(
        "consumers.0.handler",
        "[[consumers]]\nkind = \"rabbitmq\"\nurl = \"amqp://127.0.0.1\"\nqueue = \"q\"\n"
            .to_owned(),
    );
    cases.insert(
        "consumers.0.handler.http",
        consumer_toml("q", "ftp://x", ""),
    );
    // Per-aggregate ordering keeps its holds in the inbox database.
    cases.insert(
        "consumers.0.ordering",
        consumer_toml("q", "http://127.0.0.1:1/", "ordering = \"per_aggregate\"\n"),
    );
    for (key, toml) in cases {
        let config = write_config(dir.path(), &toml);
        let out = consume(&config).output().await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{key}: {stderr}");
        assert!(stderr.contains(&format!("`{key}`")), "{key}: {stderr}");
    }
}

#[tokio::test]
async fn migrate_creates_the_inbox_of_a_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = format!("sqlite://{}", dir.path().join("inbox.db").display());
    let toml = format!(
        "[database]\nurl = \"sqlite://{}\"\n{}",
        dir.path().join("outbox.db").display(),
        consume_toml_with_inbox("q", "http://127.0.0.1:1/", &inbox)
    );
    let config = write_config(dir.path(), &toml);
    let out = postbox()
        .args(["--config", config.to_str().unwrap(), "migrate"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("inbox `bridge_inbox`"));
    let tables = inbox_tables(&inbox).await;
    assert_eq!(tables, ["bridge_inbox", "bridge_inbox_versions"]);
}

/// The tables of the SQLite inbox database at `inbox`, by name.
async fn inbox_tables(inbox: &str) -> Vec<String> {
    use sqlx::Connection;
    let mut c = sqlx::SqliteConnection::connect(inbox).await.unwrap();
    sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .fetch_all(&mut c)
        .await
        .unwrap()
}

/// Declares `queue` and `queue.dead` plain, and `queue.retry` with `retry_args`.
async fn hand_made_topology(ch: &Channel, queue: &str, retry_args: FieldTable) {
    use lapin::options::QueueDeclareOptions;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    for (q, args) in [
        (queue.to_owned(), FieldTable::default()),
        (format!("{queue}.dead"), FieldTable::default()),
        (format!("{queue}.retry"), retry_args),
    ] {
        ch.queue_declare(q.as_str().into(), durable, args)
            .await
            .unwrap();
    }
}

/// `rabbitmqctl`: the arguments of `queue`, as listed.
async fn queue_arguments(queue: &str) -> String {
    rabbitmqctl_list("queues", &["name", "arguments"])
        .await
        .lines()
        .find(|l| l.split('\t').next() == Some(queue))
        .unwrap_or_else(|| panic!("{queue} not listed"))
        .to_owned()
}

#[tokio::test]
async fn a_hand_made_retry_queue_that_does_not_dead_letter_back_is_refused() {
    let (_conn, ch) = broker().await;
    let dir = tempfile::tempdir().unwrap();
    let ls = |s: &str| AMQPValue::LongString(s.into());

    // Without the dead-letter arguments, then with one pointing elsewhere.
    let no_args = scratch_table("handmade");
    let mut wrong_key = FieldTable::default();
    wrong_key.insert("x-dead-letter-exchange".into(), ls(""));
    wrong_key.insert("x-dead-letter-routing-key".into(), ls("elsewhere"));
    let wrong = scratch_table("handmade");
    for (queue, args, missing) in [
        (&no_args, FieldTable::default(), "x-dead-letter-exchange"),
        (&wrong, wrong_key, "x-dead-letter-routing-key"),
    ] {
        hand_made_topology(&ch, queue, args).await;
        let before = queue_arguments(&format!("{queue}.retry")).await;
        let toml = consumer_toml(queue, "http://127.0.0.1:1/", "")
            .replace("declare = true", "declare = false");
        let config = write_config(dir.path(), &toml);
        let out = tokio::time::timeout(Duration::from_secs(20), consume(&config).output())
            .await
            .expect("consume kept running instead of refusing the topology")
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("{stderr}");
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(&format!("`{queue}.retry`")), "{stderr}");
        assert!(stderr.contains(missing), "{stderr}");
        assert_eq!(
            queue_arguments(&format!("{queue}.retry")).await,
            before,
            "the check changed nothing"
        );
        delete_queues(&ch, queue).await;
    }

    // Right dead-letter arguments plus ones postbox does not set (a quorum
    // retry queue with a length limit): it runs.
    let good = scratch_table("handmade");
    let mut args = FieldTable::default();
    args.insert("x-dead-letter-exchange".into(), ls(""));
    args.insert("x-dead-letter-routing-key".into(), ls(&good));
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(100_000));
    args.insert("x-queue-type".into(), ls("quorum"));
    hand_made_topology(&ch, &good, args).await;
    let (url, keys) = slow_server(Duration::ZERO).await;
    let toml = consumer_toml(&good, &url, "").replace("declare = true", "declare = false");
    let config = write_config(dir.path(), &toml);
    let mut child = consume(&config).stderr(Stdio::piped()).spawn().unwrap();
    publish(&ch, &good, "hand-1", "{}").await;
    let start = Instant::now();
    while keys.keys().is_empty() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("consume exited {status:?}: {}", stderr_of(&mut child).await);
        }
        assert!(start.elapsed() < Duration::from_secs(20), "nothing handled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let err = stderr_of(&mut child).await;
    println!("{err}");
    assert!(!err.contains("cannot verify"), "{err}");
    delete_queues(&ch, &good).await;
}

#[tokio::test]
async fn per_aggregate_ordering_keeps_its_holds_beside_the_inbox() {
    let (_conn, ch) = broker().await;
    let dir = tempfile::tempdir().unwrap();
    let inbox = format!("sqlite://{}", dir.path().join("inbox.db").display());
    let queue = scratch_table("ordered");
    let (url, keys) = slow_server(Duration::ZERO).await;
    let toml = format!(
        "{}ordering = \"per_aggregate\"\n",
        consume_toml_with_inbox(&queue, &url, &inbox)
    );
    let config = write_config(dir.path(), &toml);
    let mut child = consume(&config).spawn().unwrap();
    let start = Instant::now();
    // The queue exists once consume has declared it.
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "consume did not start"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("consume exited: {status:?}");
        }
        let probe = broker().await.0;
        let ch2 = probe.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if ch2
            .queue_declare(queue.as_str().into(), passive, FieldTable::default())
            .await
            .is_ok()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    publish(&ch, &queue, "ord-1", "{}").await;
    while keys.keys().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(20), "nothing handled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let tables = inbox_tables(&inbox).await;
    assert_eq!(
        tables,
        [
            "bridge_inbox",
            "bridge_inbox_holds",
            "bridge_inbox_versions"
        ]
    );
    delete_queues(&ch, &queue).await;
}

/// Issue 14.4: `postbox dead` and the consume process's dead-letter API on
/// letters a real `postbox consume` dead-lettered (its handler answers 422):
/// listed with masked payloads for a viewer, refused without a token or a
/// filter, counted by a dry run, replayed into the queue (where the bridge
/// takes it again) and purged, from the API and the command line.
#[tokio::test]
async fn dead_letters_from_the_cli_and_the_api() {
    let token = "dead-operator-51a";
    let viewer = "dead-viewer-77b";
    let mut b = admin_consume_on(
        refusing_handler().await,
        "dead_cli",
        &format!(
            "token = \"{token}\"\n\
             [[admin.tokens]]\nname = \"watcher\"\nrole = \"viewer\"\ntoken = \"{viewer}\"\n\
             [admin.redact]\nRoomCreated = [\"secret\"]\n"
        ),
    )
    .await;
    let (ch, queue, addr, config, keys) = (&b.ch, &b.queue, &b.addr, &b.config, &b.keys);
    let start = b.start;
    for i in 1..=3 {
        publish(
            ch,
            queue,
            &format!("d-{i}"),
            &format!(r#"{{"secret":"s3cr3t","n":{i}}}"#),
        )
        .await;
    }
    let path = format!("/api/consumers/{queue}/dead");
    let listed = eventually("3 dead letters", Duration::from_secs(20), async || {
        let (status, body) = http_call(addr, "GET", &path, Some(viewer)).await;
        assert_eq!(status, 200, "{body}");
        let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
        match listed["matched"] == 3 {
            true => Ok(listed),
            false => Err(listed.to_string()),
        }
    })
    .await;
    // A viewer sees the letters, the configured field masked.
    let text = listed.to_string();
    assert!(!text.contains("s3cr3t"), "{text}");
    let first = &listed["letters"][0];
    assert_eq!(first["event_type"], "RoomCreated", "{first}");
    assert!(
        first["last_error"].as_str().unwrap().contains("422"),
        "{first}"
    );
    assert!(
        first["payload"].as_str().unwrap().contains("***"),
        "{first}"
    );
    assert!(first["dead_at_ms"].as_i64().unwrap() > 1_700_000_000_000);
    // Refusals never show a letter.
    let (status, body) = http_call(addr, "GET", &path, None).await;
    assert_eq!(status, 401);
    assert!(!body.contains("d-1") && !body.contains("s3cr3t"), "{body}");
    let purge = format!("{path}/purge");
    let all = serde_json::json!({ "all": true });
    let (status, body) = http_send(addr, "POST", &purge, Some(viewer), Some(&all)).await;
    assert_eq!(status, 403, "a viewer may not purge: {body}");
    let (status, body) = http_send(addr, "POST", &purge, Some(token), None).await;
    assert_eq!(status, 400, "no filter, no `all`: {body}");
    assert!(body.contains("all"), "{body}");
    let dry = serde_json::json!({ "all": true, "dry_run": true });
    let (status, body) = http_send(addr, "POST", &purge, Some(token), Some(&dry)).await;
    assert_eq!(status, 200, "{body}");
    let dry: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (dry["matched"].as_u64(), dry["done"].as_u64()),
        (Some(3), Some(0)),
        "{dry}"
    );

    // The command line, straight on the broker.
    let cli = |args: &[&str]| {
        let mut c = postbox();
        c.args(["--config", config.to_str().unwrap()]).args(args);
        c.output()
    };
    let out = cli(&["--json", "dead", "list", "--consumer", queue])
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // A pass that worked logs no error: its channels were still closing
    // when it closed the connection, and lapin logged "ERROR Connection
    // error: invalid channel state: Closing" every time.
    let logged = String::from_utf8_lossy(&out.stderr);
    assert!(!logged.contains("ERROR"), "{logged}");
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut ids: Vec<&str> = listed["letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["event_id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["d-1", "d-2", "d-3"]);
    // A list that stopped at its limit says so, not "2 of 2".
    let out = cli(&["dead", "list", "--consumer", queue, "--limit", "2"])
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        said.contains("the first 2 dead letters") && said.contains("more may match"),
        "{said}"
    );
    let out = cli(&["dead", "show", "--consumer", queue, "d-2"])
        .await
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        shown.contains("event_id:     d-2") && shown.contains("no such room"),
        "{shown}"
    );
    let out = cli(&["dead", "replay", "--consumer", queue]).await.unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a replay needs a filter: {out:?}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--all"),
        "{out:?}"
    );
    let out = cli(&["dead", "list", "--consumer", "nope"]).await.unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(queue.as_str()),
        "names the consumers: {out:?}"
    );

    // Replayed, d-1 goes back to the queue: the bridge posts it again, and
    // the handler's 422 dead-letters it again.
    let out = cli(&["dead", "replay", "--consumer", queue, "--event-id", "d-1"])
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(said.contains("1 of 3 dead letters"), "{said}");
    while keys.keys().iter().filter(|k| *k == "d-1").count() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "d-1 never handled again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = eventually("d-1 dead again", Duration::from_secs(30), async || {
        let out = cli(&[
            "--json",
            "dead",
            "list",
            "--consumer",
            queue,
            "--event-id",
            "d-1",
        ])
        .await
        .unwrap();
        let back: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        match back["matched"] == 1 {
            true => Ok(back),
            false => Err(back.to_string()),
        }
    })
    .await;
    assert_eq!(back["letters"][0]["headers"]["x-replayed"], true, "{back}");

    let (status, body) = http_send(addr, "POST", &purge, Some(token), Some(&all)).await;
    assert_eq!(status, 200, "{body}");
    let purged: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(purged["done"], 3, "{purged}");
    let out = cli(&["--json", "dead", "list", "--consumer", queue])
        .await
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed["matched"], 0, "{listed}");
    common::stopped(&mut b.consumer).await;
    delete_queues(ch, queue).await;
}

/// A replay pass takes an event once. A replayed letter the handler
/// refuses again comes back to the end of the dead queue while the pass
/// still reads; when a letter the broker has not put back yet (held by an
/// earlier pass) leaves room, the pass read that copy and replayed the
/// event again (seen in CI: the dashboard's replay of one letter posted it
/// twice). Here the dead queue holds two copies of one event from the
/// start: one is replayed, the other left.
#[tokio::test]
async fn a_replay_takes_an_event_once_per_pass() {
    let mut b = admin_consume_on(refusing_handler().await, "dead_once", "token = \"t\"\n").await;
    let (ch, queue, config, keys, start) = (&b.ch, &b.queue, &b.config, &b.keys, b.start);
    publish(ch, queue, "d-1", "{}").await;
    publish(ch, queue, "d-1", "{}").await;
    let dead = postbox_core::wire::rabbitmq::dead_queue(queue);
    while postbox_testkit::consumer_fixtures::ready(ch, &dead).await < 2 {
        assert!(start.elapsed() < Duration::from_secs(20), "not 2 dead");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = postbox()
        .args(["--config", config.to_str().unwrap()])
        .args([
            "--json",
            "dead",
            "replay",
            "--consumer",
            queue,
            "--event-id",
            "d-1",
        ])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["matched"].as_u64(), report["done"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    // Posted twice before, once by the replay; then dead again, beside
    // the copy left.
    let posts = || keys.keys().iter().filter(|k| *k == "d-1").count();
    while posts() < 3 || postbox_testkit::consumer_fixtures::ready(ch, &dead).await < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{} posts",
            posts()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(posts(), 3);
    common::stopped(&mut b.consumer).await;
    delete_queues(ch, queue).await;
}

/// Issue 14.4 and 14.5 in a real browser: the dashboard served by `postbox
/// consume` shows its consumers (no outbox part), pauses and resumes one,
/// lists its dead letters, replays one after confirming the count (the
/// handler refuses it again, so it comes back dead) and purges them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumers_dashboard_handles_dead_letters_in_a_browser() {
    crate::dashboard::browser();
    let token = "dead-browser-3f0";
    let mut b = admin_consume_on(
        refusing_handler().await,
        "dead_browser",
        &format!("token = \"{token}\"\n"),
    )
    .await;
    let (ch, queue, addr, keys, start) = (&b.ch, &b.queue, &b.addr, &b.keys, b.start);
    for i in 1..=3 {
        publish(ch, queue, &format!("d-{i}"), "{}").await;
    }
    let dead = postbox_core::wire::rabbitmq::dead_queue(queue);
    while postbox_testkit::consumer_fixtures::ready(ch, &dead).await < 3 {
        assert!(start.elapsed() < Duration::from_secs(20), "not 3 dead");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let args = serde_json::json!({
        "url": format!("http://{addr}/"),
        "token": token,
        "consumer": queue,
        "replay": "d-1",
    });
    let result =
        tokio::task::spawn_blocking(move || crate::dashboard::run_browser("consumers.mjs", &args))
            .await
            .unwrap();
    assert_eq!(result["outbox_hidden"], true, "{result}");
    assert_eq!(
        result["states"],
        serde_json::json!(["consuming", "paused", "consuming"]),
        "{result}"
    );
    assert_eq!(result["dead_listed"], 3, "{result}");
    assert_eq!(result["position_before"], "1", "{result}");
    assert_eq!(result["prompts"], 1, "the token is asked once: {result}");
    assert_eq!(
        result["confirms"],
        serde_json::json!([
            format!("Replay 1 dead letter of {queue}?"),
            format!("Purge 3 dead letters of {queue}?")
        ]),
        "{result}"
    );
    assert_eq!(result["dead_after"], 0, "{result}");
    assert_eq!(
        result["offsite_requests"],
        serde_json::json!([]),
        "{result}"
    );
    assert_eq!(
        keys.keys().iter().filter(|k| *k == "d-1").count(),
        2,
        "the replayed letter was posted again"
    );
    assert_eq!(
        postbox_testkit::consumer_fixtures::ready(ch, &dead).await,
        0
    );
    common::stopped(&mut b.consumer).await;
    delete_queues(ch, queue).await;
}
