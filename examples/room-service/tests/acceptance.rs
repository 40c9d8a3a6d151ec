//! The seed's acceptance table (seed 000), against real servers: MariaDB
//! for the room and wallet databases (and the consumers' inboxes), RabbitMQ
//! for activity and notice, the IM stand-in for the webhook. Each test runs
//! the whole example in this process: room service and wallet with their
//! relays in-process, three activity consumers with `prefetch = 1` and a
//! notice consumer bridged to their HTTP handlers, as `postbox consume`
//! runs them; one test runs the room's relay and the activity workers as
//! `postbox` processes instead.

mod stack;

use std::time::Duration;

use postbox::store::{EventFilter, ReplaySelector};
use postbox::Status;
use postbox_testkit::consumer_fixtures::{eventually, wait_until};
use room_service::im::Faults;
use serde_json::{json, Value};
use stack::{all_delivered, log_lines, Options, Stack};

// ---------------------------------------------------------------------
// The acceptance table.

/// normal + real chain: every event of a room reaches IM and activity,
/// IM sees each room's events in version order, notice gets room and
/// wallet events from RabbitMQ, and every command logged its timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_every_event_reaches_im_and_activity_in_version_order() {
    normal(Options::retries(5), "n").await;
}

/// The same, laid out as the README runs it in production: the room's
/// relay is a `postbox relay --config room.toml` process and activity is
/// three `postbox consume` processes with one unacked message each
/// (seed 003's PHP workers), deduping through their shared inbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_with_postbox_relay_and_three_consume_processes() {
    normal(Options::retries(5).in_processes(), "proc").await;
}

/// Rooms `{rooms}1` … `{rooms}3` (the log is shared by the tests of this
/// process: each test has rooms of its own).
async fn normal(options: Options, rooms: &str) {
    let s = Stack::start(options).await;
    let rooms: Vec<String> = (1..=3).map(|n| format!("{rooms}{n}")).collect();
    let mut all = Vec::new();
    for room in &rooms {
        all.extend(s.chain(room).await);
    }
    for room in &rooms {
        s.wait_rows(room, "every row delivered", |r| all_delivered(r, 5))
            .await;
        assert_eq!(
            s.im_versions(room),
            vec![1, 2, 3, 4, 5],
            "IM got {room}'s events in version order"
        );
    }
    // On a timeout, say which events activity lacks and what it saw.
    eventually(
        "activity handled every event",
        Duration::from_secs(30),
        async || {
            let missing: Vec<&String> = all.iter().filter(|id| !s.activity.has(id)).collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("missing {missing:?}; seen {:?}", s.activity.seen()))
            }
        },
    )
    .await;
    wait_until(
        "notice handled room events and the gifts' debits",
        Duration::from_secs(30),
        async || {
            let seen = s.notice.seen();
            seen.by_type.get("WalletDebited") == Some(&3) && all.iter().all(|id| s.notice.has(id))
        },
    )
    .await;
    let activity = s.activity.seen();
    assert_eq!(activity.handled, 15, "{activity:?}");
    assert_eq!(
        activity.duplicates, 0,
        "the inbox lets no event through twice"
    );
    assert_eq!(s.im.counts().1, 0, "no push was sent twice");

    // real chain: one room_command_timing line per command, every field.
    for command in ["create", "join", "mic", "gift", "leave"] {
        let id = format!("{}-{command}", rooms[0]);
        let lines: Vec<Value> = log_lines(&format!("\"command_id\":\"{id}\""))
            .into_iter()
            .filter(|l| l["fields"]["message"] == "room_command_timing")
            .collect();
        assert_eq!(lines.len(), 1, "one timing line for {id}");
        let f = &lines[0]["fields"];
        for field in [
            "idempotency_ms",
            "lease_ms",
            "wallet_debit_ms",
            "save_mutation_ms",
            "snapshot_ms",
            "projection_ms",
            "activity_ms",
            "tencent_im_ms",
            "total_ms",
        ] {
            assert!(f[field].is_number(), "{id}: {field} in {f}");
        }
        assert_eq!(f["activity_ms"], 0.0);
        assert_eq!(f["tencent_im_ms"], 0.0);
        assert_eq!(f["activity_async_outbox"], true, "{f}");
        assert_eq!(f["tencent_im_async_outbox"], true, "{f}");
        if command == "gift" {
            assert!(
                f["wallet_debit_ms"].as_f64().unwrap() > 0.0,
                "a gift is paid for: {f}"
            );
        }
    }
    s.stop().await;
}

/// idempotency: the same command_id twice is one state change and one set
/// of outbox rows (and one debit); a refused gift writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_command_id_twice_changes_nothing() {
    let s = Stack::start(Options::retries(5)).await;
    s.ok(
        "i1",
        "create",
        json!({ "command_id": "i1-c", "user_id": "alice" }),
    )
    .await;
    let join = json!({ "command_id": "i1-j", "user_id": "bob" });
    let (_, first) = s.command("i1", "join", join.clone()).await;
    let (status, again) = s.command("i1", "join", join).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["replayed"], true);
    assert_eq!(
        (again["event_id"].clone(), again["version"].clone()),
        (first["event_id"].clone(), first["version"].clone())
    );
    // A client's retries overlapping its first try: each is answered as
    // the first was (they waited for the room, then decided again on the
    // changed state: 409 "carol is in the room").
    let join = json!({ "command_id": "i1-j2", "user_id": "carol" });
    let tries =
        futures::future::join_all((0..4).map(|_| s.command("i1", "join", join.clone()))).await;
    let ids: std::collections::HashSet<String> = tries
        .iter()
        .map(|(status, answer)| {
            assert_eq!(*status, 200, "{answer}");
            answer["event_id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 1, "{tries:?}");

    let gift = json!({ "command_id": "i1-g", "user_id": "alice", "to_user_id": "bob", "gift_id": "rose", "amount": 100 });
    s.ok("i1", "sendGift", gift.clone()).await;
    s.ok("i1", "sendGift", gift).await;
    // Too dear: 402, and neither room, outbox nor wallet changes.
    let (status, answer) = s
        .command("i1", "sendGift", json!({ "command_id": "i1-g2", "user_id": "alice", "to_user_id": "bob", "gift_id": "car", "amount": 5000 }))
        .await;
    assert_eq!(status, 402, "{answer}");

    let (_, state) = {
        let r = s
            .http
            .get(format!("{}/rooms/i1", s.rooms))
            .send()
            .await
            .unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    };
    assert_eq!(state["version"], 4, "create, two joins, one gift: {state}");
    assert_eq!(state["gift_total"], 100);
    s.wait_rows("i1", "four rows delivered", |r| all_delivered(r, 4))
        .await;
    assert_eq!(s.balance("alice").await, 900, "debited once");
    let debits: Vec<(String,)> = s
        .wallet_db
        .fetch_all("SELECT command_id FROM wallet_debit", vec![])
        .await
        .unwrap();
    assert_eq!(debits, vec![("i1-g".to_owned(),)]);
    s.stop().await;
}

/// A gift paid for by a try whose commit failed, refused on the retry
/// (the receiver left meanwhile), is refunded once, with its
/// `WalletRefunded` event; the sender kept paying for a gift nobody got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gift_refused_after_its_debit_is_refunded() {
    let s = Stack::start(Options::retries(5)).await;
    s.ok(
        "r1",
        "create",
        json!({ "command_id": "r1-c", "user_id": "alice" }),
    )
    .await;
    // The first try of r1-g paid, then its commit failed: the wallet
    // holds the debit, the room nothing.
    let paid = s
        .http
        .post(format!("{}/debit", s.wallet))
        .json(&json!({ "command_id": "r1-g", "user_id": "alice", "amount": 100 }))
        .send()
        .await
        .unwrap();
    assert!(paid.status().is_success());
    assert_eq!(s.balance("alice").await, 900);
    // The retry: bob is not in the room (any more).
    let gift = json!({ "command_id": "r1-g", "user_id": "alice", "to_user_id": "bob", "gift_id": "rose", "amount": 100 });
    for _ in 0..2 {
        let (status, answer) = s.command("r1", "sendGift", gift.clone()).await;
        assert_eq!(status, 409, "{answer}");
        assert_eq!(s.balance("alice").await, 1000, "refunded, once");
    }
    let refunds: Vec<(String,)> = s
        .wallet_db
        .fetch_all(
            "SELECT event_type FROM wallet_outbox WHERE event_type = 'WalletRefunded'",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(refunds.len(), 1);
    // Sent again once bob is in the room, the refunded command is refused
    // (it was answered "paid" by the debit it no longer has, and the gift
    // went out free).
    s.ok(
        "r1",
        "join",
        json!({ "command_id": "r1-j", "user_id": "bob" }),
    )
    .await;
    let (status, answer) = s.command("r1", "sendGift", gift).await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(s.balance("alice").await, 1000);
    s.stop().await;
}

/// IM down: commands still succeed; their rows go retryable, then failed at
/// max_retry_count; IM back, replay delivers them, in order, to IM only
/// (activity confirmed them the first time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn im_down_commands_succeed_rows_fail_then_replay_delivers() {
    let s = Stack::start(Options::retries(3)).await;
    s.im.set_faults(Faults {
        down: true,
        ..Faults::default()
    });
    let ids = s.chain("d1").await;
    s.wait_rows("d1", "a row retryable", |r| {
        r.iter().any(|r| r.1 == "retryable")
    })
    .await;
    s.wait_rows("d1", "every row failed after 3 attempts", |r| {
        r.len() == 5 && r.iter().all(|r| r.1 == "failed" && r.2 == 3)
    })
    .await;
    assert!(s.im.group("d1").is_none(), "IM got nothing");
    wait_until(
        "activity got them all the same",
        Duration::from_secs(30),
        async || ids.iter().all(|id| s.activity.has(id)),
    )
    .await;

    s.im.set_faults(Faults::default());
    let failed = EventFilter {
        app_code: Some("room".into()),
        status: Some(Status::Failed),
        ..EventFilter::default()
    };
    let replayed = s
        .room_db
        .outbox()
        .replay(&ReplaySelector::Filter(failed), false, "test")
        .await
        .unwrap();
    assert_eq!(replayed.len(), 5);
    s.wait_rows("d1", "every row delivered after the replay", |r| {
        all_delivered(r, 5)
    })
    .await;
    assert_eq!(s.im_versions("d1"), vec![1, 2, 3, 4, 5]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        s.activity.seen().handled,
        5,
        "activity is not sent what it confirmed"
    );
    s.stop().await;
}

/// activity down (RabbitMQ refuses connections): commands succeed; rows
/// wait for it and are delivered when it returns. An unreachable broker is
/// not the events' fault: no attempt is counted while it is down, so an
/// outage longer than the retries (3 here, 100–300 ms apart) dead-letters
/// nothing (it did: each retry counted, and the rows went `failed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activity_down_rows_retry_and_deliver_when_it_returns() {
    let s = Stack::start(Options::retries(3)).await;
    s.proxy.down();
    let ids = s.chain("a1").await;
    s.wait_rows("a1", "a row retryable while RabbitMQ is down", |r| {
        r.iter().any(|r| r.1 == "retryable")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rows = s.rows("a1").await;
    assert!(
        rows.iter().all(|r| r.1 != "delivered" && r.1 != "failed"),
        "nothing delivered without activity, nothing dead-lettered: {rows:?}"
    );
    assert!(
        rows.iter().all(|r| r.2 == 0),
        "no attempt counted: {rows:?}"
    );
    s.proxy.up().await;
    s.wait_rows("a1", "every row delivered once RabbitMQ is back", |r| {
        all_delivered(r, 5)
    })
    .await;
    wait_until(
        "activity handled them",
        Duration::from_secs(30),
        async || ids.iter().all(|id| s.activity.has(id)),
    )
    .await;
    assert_eq!(s.im_versions("a1"), vec![1, 2, 3, 4, 5]);
    s.stop().await;
}

/// poison event (IM answers 400 for it): failed after max_retry_count, the
/// room's other events still delivered, and the log lines about it stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_fails_and_its_log_lines_stay_bounded() {
    let s = Stack::start(Options::retries(3)).await;
    s.im.set_faults(Faults {
        poison_event_types: vec!["MicTaken".into()],
        ..Faults::default()
    });
    let ids = s.chain("p1").await;
    let poison = ids[2].clone();
    s.wait_rows("p1", "the poison row failed, the rest delivered", |r| {
        r.len() == 5
            && r[2].1 == "failed"
            && r[2].2 == 3
            && r.iter().filter(|r| r.1 == "delivered").count() == 4
    })
    .await;
    assert_eq!(
        s.im_versions("p1"),
        vec![1, 2, 4, 5],
        "the room goes on past its dead event"
    );
    // The relay does speak of it (so the bound below is not met by silence):
    // its dead-lettering is logged.
    let said: Vec<String> = log_lines(&poison)
        .iter()
        .map(|l| {
            l["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(
        said.iter().any(|m| m.contains("dead-lettered")),
        "the dead-lettering of {poison} is logged: {said:?}"
    );
    let lines = said.len();
    assert!(lines <= 2 * 3 + 2, "{lines} log lines about {poison}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        log_lines(&poison).len(),
        lines,
        "no more lines about a dead event"
    );
    s.stop().await;
}

// ---------------------------------------------------------------------
// The no-server run and the shipped configs.

/// `room-service demo` runs the whole chain on SQLite with file sinks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_the_chain_on_sqlite_with_no_server() {
    let dir = tempfile::tempdir().unwrap();
    // The demo listens on port, port + 1, port + 2 and port + 9.
    let port = free_port_block(&[0, 1, 2, 9]);
    let log = dir.path().join("demo.log");
    let mut demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_room-service"))
        .args(["demo", "--dir"])
        .arg(dir.path())
        .args(["--port", &port.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let http = stack::http_client();
    let rooms = format!("http://127.0.0.1:{port}");
    let started = std::time::Instant::now();
    while http.get(format!("{rooms}/healthz")).send().await.is_err() {
        let stderr = || std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(status) = demo.try_wait().unwrap() {
            panic!("the demo exited ({status}) before serving:\n{}", stderr());
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the demo did not serve within 30 s:\n{}",
            stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let send = async |name: &str, body: Value| {
        let r = http
            .post(format!("{rooms}/rooms/r1/{name}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{name}");
    };
    send("create", json!({ "command_id": "c1", "user_id": "alice" })).await;
    send("join", json!({ "command_id": "c2", "user_id": "bob" })).await;
    send("sendGift", json!({ "command_id": "c3", "user_id": "alice", "to_user_id": "bob", "gift_id": "rose", "amount": 10 })).await;
    let lines = |name: &str| {
        std::fs::read_to_string(dir.path().join(name))
            .unwrap_or_default()
            .lines()
            .count()
    };
    wait_until(
        "activity.jsonl and wallet-events.jsonl",
        Duration::from_secs(30),
        async || lines("activity.jsonl") == 3 && lines("wallet-events.jsonl") == 1,
    )
    .await;
    let group: Value = http
        .get(format!("http://127.0.0.1:{}/groups/r1", port + 1))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let versions: Vec<i64> = group
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["version"].as_i64().unwrap())
        .collect();
    assert_eq!(versions, vec![1, 2, 3]);
    // The configs it wrote are what `postbox --config` reads.
    room_service::load_config(&dir.path().join("room.toml")).unwrap();
    demo.start_kill().unwrap();
    let _ = demo.wait().await;
    let mut out = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut demo.stdout.take().unwrap(), &mut out)
        .await
        .unwrap();
    assert!(out.contains("Try"), "the demo says what to try: {out}");
}

/// A base port below the kernel's ephemeral range (32768 and up, where a
/// port the test's own outgoing connections use could collide) such that
/// base + each offset is free now.
fn free_port_block(offsets: &[u16]) -> u16 {
    let start = 20_000 + (std::process::id() % 10_000) as u16;
    (0..1000)
        .map(|i| 20_000 + (start - 20_000 + i * 17) % 12_000)
        .find(|base| {
            offsets
                .iter()
                .all(|o| std::net::TcpListener::bind(("127.0.0.1", base + o)).is_ok())
        })
        .expect("a free block of ports below 32000")
}

/// The MariaDB + RabbitMQ configs the README runs are valid postbox configs.
#[test]
fn the_shipped_configs_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    for name in ["room.toml", "wallet.toml", "activity.toml", "notice.toml"] {
        room_service::load_config(&dir.join(name)).unwrap_or_else(|e| panic!("config/{name}: {e}"));
    }
}

/// Every `room-service` command the READMEs (English and Chinese) show
/// exists.
#[test]
fn every_room_service_command_in_the_readmes_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for doc in [
        root.join("README.md"),
        root.join("../../docs/zh-CN/room-service.md"),
    ] {
        let text = std::fs::read_to_string(&doc).unwrap();
        for line in text.lines() {
            let Some((_, rest)) = line.split_once("cargo run -p room-service -- ") else {
                continue;
            };
            let sub = rest.split_whitespace().next().unwrap();
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_room-service"))
                .args([sub, "--help"])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: `{line}`: no command `{sub}`",
                doc.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} commands found");
}

/// A snapshot row every `snapshot_every_n` (10) versions, none between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_every_ten_versions() {
    let s = Stack::start(Options::retries(5)).await;
    s.ok(
        "s1",
        "create",
        json!({ "command_id": "s1-c", "user_id": "alice" }),
    )
    .await;
    // Versions 2..=11: bob joins and leaves five times.
    for k in 0..5 {
        s.ok(
            "s1",
            "join",
            json!({ "command_id": format!("s1-j{k}"), "user_id": "bob" }),
        )
        .await;
        s.ok(
            "s1",
            "leave",
            json!({ "command_id": format!("s1-l{k}"), "user_id": "bob" }),
        )
        .await;
    }
    let snapshots: Vec<(i64, String)> = s
        .room_db
        .fetch_all(
            "SELECT version, state FROM room_snapshot WHERE room_id = ? ORDER BY version",
            room_service::args!["s1"],
        )
        .await
        .unwrap();
    assert_eq!(snapshots.len(), 1, "{snapshots:?}");
    assert_eq!(snapshots[0].0, 10);
    let state: Value = serde_json::from_str(&snapshots[0].1).unwrap();
    assert_eq!(
        state["version"], 10,
        "the snapshot holds the state at its version"
    );
    s.stop().await;
}
