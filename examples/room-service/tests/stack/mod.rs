//! The whole example in one process against the real servers: the
//! acceptance tests and the load run (benches/load.rs) start it.

#![allow(dead_code)] // each user of the stack uses part of it

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use postbox::relay::CancellationToken;
use postbox_testkit::consumer_fixtures::{delete_queues, wait_until};
use postbox_testkit::servers::{amqp_url, ensure_database, mysql_url};
use room_service::db::Db;
use room_service::im::Im;
use room_service::projection::Projection;
use room_service::service::{self, RoomService};
use room_service::wallet::{self, WalletClient, WalletService};
use room_service::{serve, spawn_relay};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------
// Logs: every test's lines, as JSON, to read room_command_timing and count
// the lines about a poison event.

pub fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
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

pub struct LogWriter(Arc<Mutex<Vec<u8>>>);

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
pub fn log_lines(needle: &str) -> Vec<Value> {
    let text = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
    text.lines()
        .filter(|l| l.contains(needle))
        .map(|l| serde_json::from_str(l).expect("log lines are JSON"))
        .collect()
}

// ---------------------------------------------------------------------
// A TCP proxy to RabbitMQ that can be taken down: connections are cut and
// new ones refused (nothing listens), as when the broker is down.

pub struct Proxy {
    addr: SocketAddr,
    stop: Mutex<Option<CancellationToken>>,
}

impl Proxy {
    pub async fn start() -> Arc<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Arc::new(Proxy {
            addr: listener.local_addr().unwrap(),
            stop: Mutex::new(None),
        });
        proxy.run(listener);
        proxy
    }

    pub fn run(&self, listener: TcpListener) {
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

    pub fn down(&self) {
        if let Some(stop) = self.stop.lock().unwrap().take() {
            stop.cancel();
        }
    }

    pub async fn up(&self) {
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

pub struct Options {
    pub max_retry_count: u32,
    /// The README's production layout: the room's relay as a `postbox
    /// relay` process and the activity workers as three `postbox consume`
    /// processes, instead of in this process.
    pub processes: bool,
}

impl Options {
    /// Everything in this process; rows fail after `max_retry_count`.
    pub fn retries(max_retry_count: u32) -> Options {
        Options {
            max_retry_count,
            processes: false,
        }
    }

    /// The room's relay and the activity workers as `postbox` processes.
    pub fn in_processes(self) -> Options {
        Options {
            processes: true,
            ..self
        }
    }
}

/// The `postbox` binary that `cargo test --workspace` builds beside this
/// test (`target/<profile>/postbox`).
pub fn postbox_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("postbox");
    assert!(
        bin.exists(),
        "{} is missing: this test runs the `postbox` binary; build it first \
         (`cargo build -p postbox-cli`; `cargo test --workspace` builds it)",
        bin.display()
    );
    bin
}

/// A `postbox` process: `postbox --config cfg --log-format json command`,
/// its log in `log`, killed when dropped.
pub struct Process {
    pub name: String,
    pub child: tokio::process::Child,
    pub log: std::path::PathBuf,
}

impl Process {
    pub fn spawn(dir: &std::path::Path, name: &str, cfg: &str, command: &str) -> Process {
        let log = dir.join(format!("{name}.log"));
        let child = tokio::process::Command::new(postbox_bin())
            .arg("--config")
            .arg(dir.join(cfg))
            .args(["--log-format", "json", command])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        Process {
            name: name.to_owned(),
            child,
            log,
        }
    }

    /// SIGTERM, then it must exit 0 within 30 s: it ran without a fatal
    /// error until then.
    pub async fn stop(mut self) {
        let pid = self.child.id().unwrap_or_else(|| {
            panic!(
                "{} ended early: {}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        });
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(killed.success(), "kill -TERM {pid}");
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} ignored SIGTERM", self.name))
            .unwrap();
        assert!(
            status.success(),
            "{} exited with {status}: {}",
            self.name,
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }
}

pub struct Stack {
    pub http: reqwest::Client,
    pub rooms: String,
    pub im: Im,
    pub activity: Projection,
    pub notice: Projection,
    pub room_db: Db,
    pub wallet_db: Db,
    /// The wallet service's base URL.
    pub wallet: String,
    pub proxy: Arc<Proxy>,
    pub shutdown: CancellationToken,
    /// The room and wallet relays: each must end without error at `stop`.
    pub relays: Vec<tokio::task::JoinHandle<Result<postbox::relay::RelayReport, postbox::Error>>>,
    /// The consumers: likewise.
    pub consuming: tokio::task::JoinHandle<Result<(), postbox::Error>>,
    /// With `Options::processes`: the room's relay and the activity
    /// workers; each must exit 0 on SIGTERM at `stop`.
    pub processes: Vec<Process>,
    pub names: Names,
    pub _dir: tempfile::TempDir,
}

#[derive(Clone)]
pub struct Names {
    pub database: String,
    pub room_exchange: String,
    pub wallet_exchange: String,
    pub activity_queue: String,
    pub notice_queue: String,
}

/// Serves `router` on a free loopback port until `shutdown`; its address.
pub async fn serve_any(router: axum::Router, shutdown: &CancellationToken) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    serve(l, router, shutdown.clone());
    addr
}

/// Writes `toml` to `dir/name` and loads it, as a user's config file.
pub fn settings(dir: &std::path::Path, name: &str, toml: &str) -> postbox::config::Settings {
    let path = dir.join(name);
    std::fs::write(&path, toml).unwrap();
    room_service::load_config(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

impl Stack {
    pub async fn start(options: Options) -> Stack {
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
        drop_stale_databases(&format!("{server}/")).await;
        let dir = tempfile::tempdir().unwrap();
        let shutdown = CancellationToken::new();

        let im = Im::default();
        let im_addr = serve_any(im.router(), &shutdown).await;
        let activity = Projection::default();
        let activity_addr = serve_any(activity.router(), &shutdown).await;
        let notice = Projection::default();
        let notice_addr = serve_any(notice.router(), &shutdown).await;
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
        // An owner's config: its own outbox table and app_code, the test's
        // worker settings, its publishers.
        let owner = |name: &str, table: &str, app: &str, publishers: String| {
            let toml = format!(
                "[database]\nurl = \"{db_url}\"\ntable = \"{table}\"\napp_codes = [\"{app}\"]\n{worker}\n{publishers}"
            );
            settings(dir.path(), name, &toml)
        };
        let rabbitmq = |name: &str, url: &str, exchange: &str| {
            format!(
                "[[publishers]]\nkind = \"rabbitmq\"\nname = \"{name}\"\nurl = \"{url}\"\nexchange = \"{exchange}\"\n\
                 routing_key = \"{{app_code}}.{{event_type}}\"\ndeclare = true\n"
            )
        };
        let mut relays = Vec::new();
        // The room: IM by webhook, activity by RabbitMQ (through the proxy).
        let im_publisher = format!(
            "[[publishers]]\nkind = \"webhook\"\nname = \"im\"\nurl = \"http://{im_addr}/im\"\ntimeout = \"2s\"\n"
        );
        let room = owner(
            "room.toml",
            "room_outbox",
            "room",
            im_publisher + &rabbitmq("activity", &proxied, &names.room_exchange),
        );
        let room_db = Db::open(&room, &service::TABLES).await.unwrap();
        let mut processes = Vec::new();
        if options.processes {
            processes.push(Process::spawn(
                dir.path(),
                "room-relay",
                "room.toml",
                "relay",
            ));
        } else {
            relays.push(
                spawn_relay(&room, &room_db, shutdown.clone())
                    .await
                    .unwrap(),
            );
        }

        // The wallet: its own outbox and relay, to its own exchange.
        let wallet_settings = owner(
            "wallet.toml",
            "wallet_outbox",
            "wallet",
            rabbitmq("wallet_mq", &amqp, &names.wallet_exchange),
        );
        let wallet_db = Db::open(&wallet_settings, &wallet::TABLES).await.unwrap();
        relays.push(
            spawn_relay(&wallet_settings, &wallet_db, shutdown.clone())
                .await
                .unwrap(),
        );
        let wallet = WalletService::new(wallet_db.clone(), "wallet", 1000);
        let wallet_addr = serve_any(wallet.router(), &shutdown).await;

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
                ordering = "per_aggregate"
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
        let database = format!("[database]\nurl = \"{db_url}\"\n");
        let activity_worker = |name: &str| {
            consumer(
                name,
                &names.activity_queue,
                &room_binding,
                activity_addr,
                "activity",
            )
        };
        let mut consumers = database.clone();
        if options.processes {
            // config/activity.toml's shape: one worker per process.
            let activity = database + &activity_worker("activity");
            let activity = settings(dir.path(), "activity.toml", &activity);
            postbox::runtime::consumers::migrate_inboxes(&activity)
                .await
                .unwrap();
            for n in 1..=3 {
                let name = format!("activity-{n}");
                processes.push(Process::spawn(
                    dir.path(),
                    &name,
                    "activity.toml",
                    "consume",
                ));
            }
        } else {
            for n in 1..=3 {
                consumers += &activity_worker(&format!("activity-{n}"));
            }
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
        let consuming =
            tokio::spawn(async move { postbox::runtime::consumers::run(&consumers, stop).await });

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
        let rooms_addr = serve_any(rooms.router(), &shutdown).await;

        Stack {
            http: http_client(),
            rooms: format!("http://{rooms_addr}"),
            im,
            activity,
            notice,
            room_db,
            wallet_db,
            wallet: format!("http://{wallet_addr}"),
            proxy,
            shutdown,
            names,
            relays,
            consuming,
            processes,
            _dir: dir,
        }
    }

    /// Sends a command; its status and body.
    pub async fn command(&self, room: &str, name: &str, body: Value) -> (u16, Value) {
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
    pub async fn ok(&self, room: &str, name: &str, body: Value) -> String {
        let (status, answer) = self.command(room, name, body).await;
        assert_eq!(status, 200, "{name} on {room}: {answer}");
        answer["event_id"].as_str().unwrap().to_owned()
    }

    /// The whole chain of seed 000 on `room`; the event ids in version order.
    pub async fn chain(&self, room: &str) -> Vec<String> {
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
    /// `user`'s wallet balance.
    pub async fn balance(&self, user: &str) -> i64 {
        let (balance,): (i64,) = self
            .wallet_db
            .fetch_optional(
                "SELECT balance FROM wallet_account WHERE user_id = ?",
                room_service::args![user],
            )
            .await
            .unwrap()
            .expect("the account exists");
        balance
    }

    pub async fn rows(&self, room: &str) -> Vec<(String, String, i64)> {
        self.room_db
            .fetch_all(
                "SELECT event_id, status, CAST(retry_count AS SIGNED) FROM room_outbox WHERE aggregate_id = ? ORDER BY aggregate_version",
                room_service::args![room],
            )
            .await
            .unwrap()
    }

    pub async fn wait_rows(
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
    pub fn im_versions(&self, room: &str) -> Vec<i64> {
        self.im
            .group(room)
            .unwrap_or_default()
            .iter()
            .map(|m| m.version)
            .collect()
    }

    /// Stops everything; every relay and the consumers must have run
    /// without error until then.
    pub async fn stop(self) {
        for process in self.processes {
            process.stop().await;
        }
        self.shutdown.cancel();
        for relay in self.relays {
            relay
                .await
                .unwrap()
                .expect("a relay failed during the test");
        }
        self.consuming
            .await
            .unwrap()
            .expect("the consumers failed during the test");
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

/// Drops the databases of earlier test processes that are gone (a failed
/// test never reaches `stop`).
async fn drop_stale_databases(server: &str) {
    use sqlx::Connection;
    let Ok(mut c) = sqlx::MySqlConnection::connect(server).await else {
        return;
    };
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(schema_name AS CHAR) FROM information_schema.schemata WHERE schema_name LIKE 'room\\_it\\_%'",
    )
    .fetch_all(&mut c)
    .await
    .unwrap_or_default();
    for name in names {
        let pid = name
            .trim_start_matches("room_it_")
            .split('_')
            .next()
            .unwrap_or("");
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
                .execute(&mut c)
                .await;
        }
    }
}

pub fn all_delivered(rows: &[(String, String, i64)], n: usize) -> bool {
    rows.len() == n && rows.iter().all(|r| r.1 == "delivered")
}

/// An HTTP client for the tests (reqwest is built without a bundled
/// crypto provider: install postbox's, ring, first, whichever test runs
/// first in the binary).
pub fn http_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}
