//! The seed's acceptance table (seed 000), against real servers: MariaDB
//! for the room and wallet databases (and the consumers' inboxes), RabbitMQ
//! for activity and notice, the IM stand-in for the webhook. Each test runs
//! the whole example in this process: room service and wallet with their
//! relays in-process, three activity consumers with `prefetch = 1` and a
//! notice consumer bridged to their HTTP handlers, as `postbox consume`
//! runs them.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use postbox::relay::CancellationToken;
use postbox::store::{EventFilter, ReplaySelector};
use postbox::Status;
use postbox_testkit::consumer_fixtures::{delete_queues, wait_until};
use postbox_testkit::servers::{amqp_url, ensure_database, mysql_url};
use room_service::db::Db;
use room_service::im::{Faults, Im};
use room_service::projection::Projection;
use room_service::service::{self, RoomService};
use room_service::wallet::{self, WalletClient, WalletService};
use room_service::{serve, spawn_relay};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------
// Logs: every test's lines, as JSON, to read room_command_timing and count
// the lines about a poison event.

fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = buf.clone();
        tracing_subscriber::fmt()
            .json()
            .with_env_filter("info,sqlx=warn")
            .with_writer(move || LogWriter(writer.clone()))
            .init();
        buf
    })
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Log lines (JSON objects) containing `needle`.
fn log_lines(needle: &str) -> Vec<Value> {
    let text = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
    text.lines()
        .filter(|l| l.contains(needle))
        .map(|l| serde_json::from_str(l).expect("log lines are JSON"))
        .collect()
}

// ---------------------------------------------------------------------
// A TCP proxy to RabbitMQ that can be taken down: connections are cut and
// new ones refused (nothing listens), as when the broker is down.

struct Proxy {
    addr: SocketAddr,
    stop: Mutex<Option<CancellationToken>>,
}

impl Proxy {
    async fn start() -> Arc<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Arc::new(Proxy {
            addr: listener.local_addr().unwrap(),
            stop: Mutex::new(None),
        });
        proxy.run(listener);
        proxy
    }

    fn run(&self, listener: TcpListener) {
        let stop = CancellationToken::new();
        *self.stop.lock().unwrap() = Some(stop.clone());
        tokio::spawn(async move {
            loop {
                let (mut client, _) = tokio::select! {
                    _ = stop.cancelled() => return,
                    got = listener.accept() => got.unwrap(),
                };
                let stop = stop.clone();
                tokio::spawn(async move {
                    let Ok(mut broker) = TcpStream::connect("127.0.0.1:5672").await else {
                        return;
                    };
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut client, &mut broker) => {}
                    }
                });
            }
        });
    }

    fn down(&self) {
        if let Some(stop) = self.stop.lock().unwrap().take() {
            stop.cancel();
        }
    }

    async fn up(&self) {
        // The port is free again once the accept loop has dropped it.
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        self.run(listener);
    }
}

// ---------------------------------------------------------------------
// The stack.

struct Options {
    max_retry_count: u32,
}

struct Stack {
    http: reqwest::Client,
    rooms: String,
    im: Im,
    activity: Projection,
    notice: Projection,
    room_db: Db,
    wallet_db: Db,
    proxy: Arc<Proxy>,
    shutdown: CancellationToken,
    names: Names,
    _dir: tempfile::TempDir,
}

#[derive(Clone)]
struct Names {
    database: String,
    room_exchange: String,
    wallet_exchange: String,
    activity_queue: String,
    notice_queue: String,
}

async fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

/// Writes `toml` to `dir/name` and loads it, as a user's config file.
fn settings(dir: &std::path::Path, name: &str, toml: &str) -> postbox::config::Settings {
    let path = dir.join(name);
    std::fs::write(&path, toml).unwrap();
    room_service::load_config(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

impl Stack {
    async fn start(options: Options) -> Stack {
        logs();
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        let names = Names {
            database: format!("room_it_{tag}"),
            room_exchange: format!("room_it_{tag}"),
            wallet_exchange: format!("wallet_it_{tag}"),
            activity_queue: format!("activity_it_{tag}"),
            notice_queue: format!("notice_it_{tag}"),
        };
        let base = mysql_url();
        let (server, _) = base.rsplit_once('/').unwrap();
        let db_url = format!("{server}/{}", names.database);
        ensure_database("mysql", &db_url).await;
        let dir = tempfile::tempdir().unwrap();
        let shutdown = CancellationToken::new();

        let im = Im::default();
        let (l, im_addr) = listener().await;
        serve(l, im.router(), shutdown.clone());
        let activity = Projection::default();
        let (l, activity_addr) = listener().await;
        serve(l, activity.router(), shutdown.clone());
        let notice = Projection::default();
        let (l, notice_addr) = listener().await;
        serve(l, notice.router(), shutdown.clone());
        let proxy = Proxy::start().await;
        let amqp = amqp_url();
        let proxied = amqp.replace("127.0.0.1:5672", &proxy.addr.to_string());

        let worker = format!(
            r#"
            [outbox_worker]
            poll_interval = "200ms"
            ordering = "per_aggregate"
            publish_timeout = "2s"
            lease = "10s"
            max_retry_count = {}
            initial_backoff = "100ms"
            max_backoff = "300ms"
            "#,
            options.max_retry_count
        );
        // The room: IM by webhook, activity by RabbitMQ (through the proxy).
        let room = settings(
            dir.path(),
            "room.toml",
            &format!(
                r#"
            [database]
            url = "{db_url}"
            table = "room_outbox"
            app_codes = ["room"]
            {worker}
            [[publishers]]
            kind = "webhook"
            name = "im"
            url = "http://{im_addr}/im"
            timeout = "2s"
            [[publishers]]
            kind = "rabbitmq"
            name = "activity"
            url = "{proxied}"
            exchange = "{}"
            routing_key = "{{app_code}}.{{event_type}}"
            declare = true
            "#,
                names.room_exchange
            ),
        );
        let room_db = Db::open(&room, &service::TABLES).await.unwrap();
        spawn_relay(&room, &room_db, shutdown.clone())
            .await
            .unwrap();

        // The wallet: its own outbox and relay, to its own exchange.
        let wallet_settings = settings(
            dir.path(),
            "wallet.toml",
            &format!(
                r#"
            [database]
            url = "{db_url}"
            table = "wallet_outbox"
            app_codes = ["wallet"]
            {worker}
            [[publishers]]
            kind = "rabbitmq"
            name = "wallet_mq"
            url = "{amqp}"
            exchange = "{}"
            routing_key = "{{app_code}}.{{event_type}}"
            declare = true
            "#,
                names.wallet_exchange
            ),
        );
        let wallet_db = Db::open(&wallet_settings, &wallet::TABLES).await.unwrap();
        spawn_relay(&wallet_settings, &wallet_db, shutdown.clone())
            .await
            .unwrap();
        let (l, wallet_addr) = listener().await;
        serve(
            l,
            WalletService::new(wallet_db.clone(), "wallet", 1000).router(),
            shutdown.clone(),
        );

        // Consumers, as `postbox consume` runs them: three activity
        // workers with one unacked message each, and notice, which reads
        // room and wallet events from RabbitMQ (never an owner's table).
        let consumer =
            |name: &str, queue: &str, bindings: &str, handler: SocketAddr, group: &str| {
                format!(
                    r#"
                [[consumers]]
                name = "{name}"
                kind = "rabbitmq"
                url = "{amqp}"
                queue = "{queue}"
                bindings = [{bindings}]
                declare = true
                prefetch = 1
                max_attempts = 5
                retry_delay = "200ms"
                consumer_group = "{group}"
                handler = {{ http = "http://{handler}/events", timeout = "5s" }}
                inbox = {{ url = "{db_url}", table = "{group}_inbox" }}
                "#
                )
            };
        let room_binding = format!(
            r##"{{ exchange = "{}", routing_key = "#" }}"##,
            names.room_exchange
        );
        let wallet_binding = format!(
            r##"{{ exchange = "{}", routing_key = "#" }}"##,
            names.wallet_exchange
        );
        let mut consumers = format!("[database]\nurl = \"{db_url}\"\n");
        for n in 1..=3 {
            consumers += &consumer(
                &format!("activity-{n}"),
                &names.activity_queue,
                &room_binding,
                activity_addr,
                "activity",
            );
        }
        consumers += &consumer(
            "notice",
            &names.notice_queue,
            &format!("{room_binding}, {wallet_binding}"),
            notice_addr,
            "notice",
        );
        let consumers = settings(dir.path(), "consume.toml", &consumers);
        postbox::runtime::consumers::migrate_inboxes(&consumers)
            .await
            .unwrap();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) = postbox::runtime::consumers::run(&consumers, stop).await {
                panic!("consumers stopped: {e}");
            }
        });

        // Ready when every consumer consumes: its queue is bound by then,
        // so no event is published before there is a queue to route it to.
        let mq = lapin::Connection::connect(&amqp, Default::default())
            .await
            .unwrap();
        for (queue, n) in [(&names.activity_queue, 3), (&names.notice_queue, 1)] {
            wait_until(
                "the consumers to start",
                Duration::from_secs(30),
                async || {
                    let passive = lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    };
                    // A missing queue closes the channel: a new one per look.
                    let ch = mq.create_channel().await.unwrap();
                    match ch
                        .queue_declare(queue.as_str().into(), passive, Default::default())
                        .await
                    {
                        Ok(q) => q.consumer_count() >= n,
                        Err(_) => false,
                    }
                },
            )
            .await;
        }
        let _ = mq.close(0, "ready".into()).await;

        let rooms = RoomService::new(
            room_db.clone(),
            "room",
            WalletClient::new(&format!("http://{wallet_addr}")),
            10,
        );
        let (l, rooms_addr) = listener().await;
        serve(l, rooms.router(), shutdown.clone());

        Stack {
            http: reqwest::Client::new(),
            rooms: format!("http://{rooms_addr}"),
            im,
            activity,
            notice,
            room_db,
            wallet_db,
            proxy,
            shutdown,
            names,
            _dir: dir,
        }
    }

    /// Sends a command; its status and body.
    async fn command(&self, room: &str, name: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/rooms/{room}/{name}", self.rooms))
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// Sends a command that must succeed; its event_id.
    async fn ok(&self, room: &str, name: &str, body: Value) -> String {
        let (status, answer) = self.command(room, name, body).await;
        assert_eq!(status, 200, "{name} on {room}: {answer}");
        answer["event_id"].as_str().unwrap().to_owned()
    }

    /// The whole chain of seed 000 on `room`; the event ids in version order.
    async fn chain(&self, room: &str) -> Vec<String> {
        let c = |n: &str| format!("{room}-{n}");
        vec![
            self.ok(room, "create", json!({ "command_id": c("create"), "user_id": "alice", "title": "t" })).await,
            self.ok(room, "join", json!({ "command_id": c("join"), "user_id": "bob" })).await,
            self.ok(room, "mic", json!({ "command_id": c("mic"), "user_id": "bob", "seat": 1, "action": "take" })).await,
            self.ok(
                room,
                "sendGift",
                json!({ "command_id": c("gift"), "user_id": "alice", "to_user_id": "bob", "gift_id": "rose", "amount": 10 }),
            )
            .await,
            self.ok(room, "leave", json!({ "command_id": c("leave"), "user_id": "bob" })).await,
        ]
    }

    /// `(event_id, status, retry_count)` of a room's outbox rows, in version order.
    async fn rows(&self, room: &str) -> Vec<(String, String, i64)> {
        self.room_db
            .fetch_all(
                "SELECT event_id, status, CAST(retry_count AS SIGNED) FROM room_outbox WHERE aggregate_id = ? ORDER BY aggregate_version",
                room_service::args![room],
            )
            .await
            .unwrap()
    }

    async fn wait_rows(
        &self,
        room: &str,
        what: &str,
        check: impl Fn(&[(String, String, i64)]) -> bool,
    ) {
        wait_until(what, Duration::from_secs(30), async || {
            check(&self.rows(room).await)
        })
        .await;
    }

    /// The event types IM shows for `room`, in arrival order.
    fn im_versions(&self, room: &str) -> Vec<i64> {
        self.im
            .group(room)
            .unwrap_or_default()
            .iter()
            .map(|m| m.version)
            .collect()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::sleep(Duration::from_millis(300)).await;
        if let Ok(c) = lapin::Connection::connect(&amqp_url(), Default::default()).await {
            let ch = c.create_channel().await.unwrap();
            for q in [&self.names.activity_queue, &self.names.notice_queue] {
                delete_queues(&ch, q).await;
            }
            for x in [&self.names.room_exchange, &self.names.wallet_exchange] {
                let _ = ch
                    .exchange_delete(x.as_str().into(), Default::default())
                    .await;
            }
        }
        let _ = self
            .room_db
            .execute(
                &format!("DROP DATABASE IF EXISTS {}", self.names.database),
                vec![],
            )
            .await;
    }
}

fn all_delivered(rows: &[(String, String, i64)], n: usize) -> bool {
    rows.len() == n && rows.iter().all(|r| r.1 == "delivered")
}

// ---------------------------------------------------------------------
// The acceptance table.

/// normal + real chain: every event of a room reaches IM and activity,
/// IM sees each room's events in version order, notice gets room and
/// wallet events from RabbitMQ, and every command logged its timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_every_event_reaches_im_and_activity_in_version_order() {
    let s = Stack::start(Options { max_retry_count: 5 }).await;
    let rooms = ["n1", "n2", "n3"];
    let mut all = Vec::new();
    for room in rooms {
        all.extend(s.chain(room).await);
    }
    for room in rooms {
        s.wait_rows(room, "every row delivered", |r| all_delivered(r, 5))
            .await;
        assert_eq!(
            s.im_versions(room),
            vec![1, 2, 3, 4, 5],
            "IM got {room}'s events in version order"
        );
    }
    wait_until(
        "activity handled every event",
        Duration::from_secs(30),
        async || all.iter().all(|id| s.activity.has(id)),
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
        let id = format!("n1-{command}");
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
    let s = Stack::start(Options { max_retry_count: 5 }).await;
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
    assert_eq!(state["version"], 3, "create, join, one gift: {state}");
    assert_eq!(state["gift_total"], 100);
    s.wait_rows("i1", "three rows delivered", |r| all_delivered(r, 3))
        .await;
    let (balance,): (i64,) = s
        .wallet_db
        .fetch_optional(
            "SELECT balance FROM wallet_account WHERE user_id = ?",
            room_service::args!["alice"],
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(balance, 900, "debited once");
    let debits: Vec<(String,)> = s
        .wallet_db
        .fetch_all("SELECT command_id FROM wallet_debit", vec![])
        .await
        .unwrap();
    assert_eq!(debits, vec![("i1-g".to_owned(),)]);
    s.stop().await;
}

/// IM down: commands still succeed; their rows go retryable, then failed at
/// max_retry_count; IM back, replay delivers them, in order, to IM only
/// (activity confirmed them the first time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn im_down_commands_succeed_rows_fail_then_replay_delivers() {
    let s = Stack::start(Options { max_retry_count: 3 }).await;
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
/// retry and are delivered when it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activity_down_rows_retry_and_deliver_when_it_returns() {
    let s = Stack::start(Options {
        max_retry_count: 50,
    })
    .await;
    s.proxy.down();
    let ids = s.chain("a1").await;
    s.wait_rows("a1", "a row retryable while RabbitMQ is down", |r| {
        r.iter().any(|r| r.1 == "retryable")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        s.rows("a1").await.iter().all(|r| r.1 != "delivered"),
        "nothing delivered without activity"
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
    let s = Stack::start(Options { max_retry_count: 3 }).await;
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
    let lines = log_lines(&poison).len();
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
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().min(60000)
    };
    let mut demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_room-service"))
        .args(["demo", "--dir"])
        .arg(dir.path())
        .args(["--port", &port.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let http = reqwest::Client::new();
    let rooms = format!("http://127.0.0.1:{port}");
    wait_until("the demo to serve", Duration::from_secs(30), async || {
        http.get(format!("{rooms}/healthz")).send().await.is_ok()
    })
    .await;
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

/// The MariaDB + RabbitMQ configs the README runs are valid postbox configs.
#[test]
fn the_shipped_configs_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    for name in ["room.toml", "wallet.toml", "activity.toml", "notice.toml"] {
        room_service::load_config(&dir.join(name)).unwrap_or_else(|e| panic!("config/{name}: {e}"));
    }
}
