//! The `postbox` binary as a user runs it: exit codes, config errors that
//! name their key, secrets kept out of output, the SQLite workflow end to
//! end, and the quickstart.

mod common;

use common::{run as postbox, text};
use std::path::Path;
use std::process::Command;

fn write_config(dir: &Path, body: &str) -> String {
    let path = dir.join("postbox.toml");
    std::fs::write(&path, body).unwrap();
    path.to_str().unwrap().to_owned()
}

const GOOD: &str = r#"
[database]
url = "sqlite://DIR/outbox.db"
table = "room_outbox"
app_codes = ["room"]

[outbox_worker]
poll_interval = "50ms"

[[publishers]]
kind = "file"
path = "DIR/out.jsonl"
"#;

fn good(dir: &Path) -> String {
    GOOD.replace("DIR", dir.to_str().unwrap())
}

#[test]
fn bad_config_exits_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &str, &str)] = &[
        (
            "poll_interval = \"0s\"",
            "[outbox_worker]",
            "outbox_worker.poll_interval",
        ),
        (
            "batch_size = 0",
            "[outbox_worker]",
            "outbox_worker.batch_size",
        ),
        (
            "publish_timeout = \"40s\"",
            "[outbox_worker]",
            "outbox_worker.publish_timeout",
        ),
        (
            "pol_interval = \"1s\"",
            "[outbox_worker]",
            "outbox_worker.pol_interval",
        ),
        (
            "lease = \"a while\"",
            "[outbox_worker]",
            "outbox_worker.lease",
        ),
        ("table = \"room-outbox\"", "[database]", "database.table"),
    ];
    for (line, section, key) in cases {
        let body = good(dir.path()).replace(section, &format!("{section}\n{line}"));
        // Drop the good file's own value of the key under test.
        let body = body
            .replace("table = \"room_outbox\"\n", "")
            .replace("poll_interval = \"50ms\"\n", "");
        let cfg = write_config(dir.path(), &body);
        let out = postbox(dir.path(), &["--config", &cfg, "status"], &[]);
        assert_eq!(out.status.code(), Some(2), "{line}: {}", text(&out));
        assert!(
            text(&out).contains(key),
            "{line}: message names `{key}`: {}",
            text(&out)
        );
    }
    let cfg = write_config(
        dir.path(),
        &good(dir.path()).replace("kind = \"file\"", "kind = \"kafka\""),
    );
    let out = postbox(dir.path(), &["--config", &cfg, "relay"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("publishers.0.kind") && text(&out).contains("kafka"),
        "{}",
        text(&out)
    );
}

/// A database nobody listens on: the error names the address and the cause,
/// not just `pool timed out`, and never the password.
#[test]
fn an_unreachable_database_is_named_with_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let urls: [&'static str; 2] = [
        "postgres://postgres:hunter2pw@127.0.0.1:1/postgres",
        "mysql://root:hunter2pw@127.0.0.1:1/postbox",
    ];
    let runs: Vec<_> = urls
        .iter()
        .map(|&url| {
            let dir = dir.path().to_owned();
            std::thread::spawn(move || postbox(&dir, &["--database-url", url, "status"], &[]))
        })
        .collect();
    for (url, run) in urls.iter().zip(runs) {
        let out = run.join().unwrap();
        let all = text(&out);
        assert_eq!(out.status.code(), Some(1), "{url}: {all}");
        assert!(
            all.contains("127.0.0.1:1") && all.contains("Connection refused"),
            "{url}: {all}"
        );
        assert!(!all.contains("hunter2pw"), "{url}: {all}");
    }
}

#[test]
fn env_overrides_the_file_and_is_validated_too() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &good(dir.path()));
    let out = postbox(
        dir.path(),
        &["--config", &cfg, "status"],
        &[("POSTBOX__OUTBOX_WORKER__BATCH_SIZE", "0")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("outbox_worker.batch_size"),
        "{}",
        text(&out)
    );
}

#[test]
fn secrets_never_reach_output() {
    let dir = tempfile::tempdir().unwrap();
    let body = good(dir.path()).replace(
        &format!("sqlite://{}/outbox.db", dir.path().display()),
        "postgres://app:hunter2@127.0.0.1:1/nope",
    );
    let cfg = write_config(dir.path(), &body);
    let out = postbox(dir.path(), &["--config", &cfg, "status"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(!text(&out).contains("hunter2"), "{}", text(&out));
}

#[test]
fn sqlite_workflow_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &good(dir.path()));
    let run = |args: &[&str]| {
        let mut all = vec!["--config", cfg.as_str()];
        all.extend_from_slice(args);
        postbox(dir.path(), &all, &[])
    };

    let out = run(&["status"]);
    assert_eq!(out.status.code(), Some(1), "no schema yet: {}", text(&out));
    assert!(text(&out).contains("postbox migrate"));
    assert!(run(&["migrate"]).status.success());
    let again = run(&["--json", "migrate"]);
    let report: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(
        report["applied"],
        serde_json::json!([]),
        "second migrate changes nothing"
    );

    let one = run(&[
        "enqueue",
        "--event-type",
        "RoomCreated",
        "--payload",
        r#"{"room":1}"#,
        "--event-id",
        "evt-1",
        "--header",
        "trace=abc",
    ]);
    assert!(one.status.success(), "{}", text(&one));
    let dup = run(&[
        "enqueue",
        "--event-type",
        "RoomCreated",
        "--payload",
        "{}",
        "--event-id",
        "evt-1",
    ]);
    assert_eq!(dup.status.code(), Some(1));
    assert!(text(&dup).contains("duplicate"));

    let file = dir.path().join("missed.jsonl");
    std::fs::write(
        &file,
        "{\"event_id\":\"evt-2\",\"event_type\":\"GiftSent\",\"payload\":{\"gift\":7}}\n\
         not json\n\
         {\"event_id\":\"evt-1\",\"event_type\":\"RoomCreated\",\"payload\":{}}\n\
         {\"event_type\":\"MemberJoined\",\"aggregate_id\":\"room-1\",\"aggregate_version\":3,\"payload\":\"raw text\"}\n",
    )
    .unwrap();
    let up = run(&["--json", "enqueue", "--file", file.to_str().unwrap()]);
    assert_eq!(
        up.status.code(),
        Some(1),
        "an invalid line is reported: {}",
        text(&up)
    );
    let summary: serde_json::Value = serde_json::from_slice(&up.stdout).unwrap();
    assert_eq!(summary["inserted"], 2, "{summary}");
    assert_eq!(summary["duplicates"], 1);
    assert_eq!(summary["invalid"][0]["line"], 2);

    // Relay until everything is delivered, then SIGTERM.
    let mut relay = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir.path())
        .args(["--config", &cfg, "relay"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let s = run(&["--json", "status"]);
        let v: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
        if v[0]["delivered"] == 3 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not delivered: {v}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    assert!(relay.wait().unwrap().success(), "relay exits 0 on SIGTERM");

    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.path().join("out.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    let first = lines.iter().find(|l| l["event_id"] == "evt-1").unwrap();
    assert_eq!(first["payload"]["room"], 1);
    assert_eq!(first["headers"]["trace"], "abc");
    assert_eq!(first["app_code"], "room");

    let list = run(&["--json", "events", "list", "--status", "delivered"]);
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(rows.len(), 3);
    let show = run(&["events", "show", "evt-2"]);
    assert!(
        text(&show).contains("GiftSent") && text(&show).contains("delivered"),
        "{}",
        text(&show)
    );

    let nothing = run(&["replay"]);
    assert_eq!(nothing.status.code(), Some(2), "replay needs a selector");
    let dry = run(&["--json", "replay", "evt-2", "--dry-run"]);
    let d: serde_json::Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(
        (d["count"].as_i64(), d["dry_run"].as_bool()),
        (Some(1), Some(true))
    );
    assert!(run(&["replay", "evt-2"]).status.success());
    let row: serde_json::Value =
        serde_json::from_slice(&run(&["--json", "events", "show", "evt-2"]).stdout).unwrap();
    assert_eq!(row[0]["status"], "pending");
    assert_eq!(row[0]["event_id"], "evt-2");
    assert_eq!(row[0]["replay_count"], 1);
    let bad_time = run(&["replay", "--since", "yesterday"]);
    assert_eq!(bad_time.status.code(), Some(2));
    assert!(text(&bad_time).contains("--since"));
}

/// The quickstart delivers every demo event, then keeps its dashboard up
/// (stdout is a pipe here, not a terminal) until SIGINT, which ends it with
/// exit 0.
#[test]
fn quickstart_runs_with_no_server() {
    use std::io::{BufRead, Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir.path())
        .args([
            "quickstart",
            "--events",
            "300",
            "--rate",
            "1000",
            "--listen",
            "127.0.0.1:0",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !seen.iter().any(|l: &String| l.contains("stays up")) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => {
                let _ = child.kill();
                panic!("no `stays up` line: {seen:#?}");
            }
        }
    }
    let all = seen.join("\n");
    assert!(all.contains("Where to look"), "{all}");
    let addr = seen
        .iter()
        .find_map(|l| l.trim().strip_prefix("dashboard  http://"))
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("no dashboard address: {all}"))
        .to_owned();

    // Well after the demo (whose events are all delivered by now), the
    // dashboard still answers.
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(
        child.try_wait().unwrap().is_none(),
        "quickstart exited after the demo"
    );
    let mut conn = std::net::TcpStream::connect(&addr)
        .unwrap_or_else(|e| panic!("dashboard at {addr} closed: {e}"));
    conn.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer:.200}"
    );

    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let waited = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if waited.elapsed() > std::time::Duration::from_secs(10) {
            let _ = child.kill();
            panic!("quickstart still running 10 s after SIGINT");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "SIGINT ends the quickstart with 0: {status}"
    );

    let lines =
        std::fs::read_to_string(dir.path().join("postbox-quickstart/events.jsonl")).unwrap();
    let ids: std::collections::HashSet<String> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["event_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 300, "every demo event delivered");
    // The config it leaves behind works for the next commands.
    let cfg = dir.path().join("postbox-quickstart/postbox.toml");
    let st = postbox(
        dir.path(),
        &["--config", cfg.to_str().unwrap(), "--json", "status"],
        &[],
    );
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(v[0]["delivered"], 300);
}

/// Events no queue takes (an exchange with nothing bound): the relay says so
/// in its own one line per event, never with the payload, and the start-up
/// (declaring the missing exchange) logs no ERROR.
#[test]
fn unroutable_events_keep_payloads_out_of_the_logs() {
    use postbox_testkit::servers::{amqp_url, scratch_name};
    let dir = tempfile::tempdir().unwrap();
    let exchange = scratch_name("pbx_noq");
    let body = format!(
        "[database]\nurl = \"sqlite://DIR/outbox.db\"\ntable = \"room_outbox\"\napp_codes = [\"room\"]\n\n\
         [outbox_worker]\npoll_interval = \"50ms\"\ninitial_backoff = \"100ms\"\nmax_backoff = \"200ms\"\n\n\
         [[publishers]]\nkind = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{exchange}\"\ndeclare = true\n",
        amqp_url()
    )
    .replace("DIR", dir.path().to_str().unwrap());
    let cfg = write_config(dir.path(), &body);
    let run = |args: &[&str]| {
        let mut all = vec!["--config", cfg.as_str()];
        all.extend_from_slice(args);
        postbox(dir.path(), &all, &[])
    };
    assert!(run(&["migrate"]).status.success());
    const MARKER: &str = "payload-bytes-never-logged";
    for i in 0..5 {
        let payload = format!(r#"{{"secret":"{MARKER}","n":{i}}}"#);
        let out = run(&[
            "enqueue",
            "--event-type",
            "RoomCreated",
            "--payload",
            &payload,
            "--event-id",
            &format!("evt-{i}"),
        ]);
        assert!(out.status.success(), "{}", text(&out));
    }

    let relay = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir.path())
        .env_remove("RUST_LOG")
        .args(["--config", &cfg, "relay"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Until every event has been returned at least twice.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let list = run(&["--json", "events", "list"]);
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&list.stdout).unwrap_or_default();
        if rows.len() == 5 && rows.iter().all(|r| r["retry_count"].as_i64() >= Some(2)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not retried: {}",
            text(&list)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    let out = relay.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    delete_exchange(&exchange);
    assert!(out.status.success(), "relay exits 0 on SIGTERM: {stderr}");
    // As text, or as the byte list a Debug print of the body shows.
    let bytes = format!("{:?}", MARKER.as_bytes());
    assert!(
        !stderr.contains(MARKER) && !stderr.contains(bytes.trim_matches(['[', ']'])),
        "payload in the logs:\n{stderr}"
    );
    assert!(
        !stderr.lines().any(|l| l.contains("ERROR")),
        "an ERROR line:\n{stderr}"
    );
    assert!(
        stderr.contains("unroutable") && stderr.contains(&exchange),
        "postbox's own message names the exchange:\n{stderr}"
    );
}

fn delete_exchange(exchange: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = lapin::Connection::connect(
            &postbox_testkit::servers::amqp_url(),
            lapin::ConnectionProperties::default(),
        )
        .await
        .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.exchange_delete(exchange.into(), Default::default())
            .await
            .unwrap();
        let _ = conn.close(200, "done".into()).await;
    });
}
