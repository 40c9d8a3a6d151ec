//! `room-service`: the example's processes. `room-service demo` runs them
//! all in one process on SQLite; on MariaDB + RabbitMQ each runs on its own
//! (see README.md).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use postbox::relay::CancellationToken;
use room_service::db::Db;
use room_service::im::Im;
use room_service::projection::Projection;
use room_service::service::{self, RoomService};
use room_service::wallet::{self, WalletClient, WalletService};
use room_service::{app_code, load_config, serve, spawn_relay};
use tokio::net::TcpListener;

#[derive(Parser)]
#[command(name = "room-service", about = "The seed's room service on postbox")]
struct Cli {
    /// Log lines as text or JSON (one object per line, fields included).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// The room service: HTTP commands on `--listen`.
    Serve {
        /// The postbox config (the same file `postbox relay` reads).
        #[arg(long, default_value = "config/room.toml")]
        config: PathBuf,
        #[arg(long, default_value = "127.0.0.1:8090")]
        listen: SocketAddr,
        /// The wallet service.
        #[arg(long, default_value = "http://127.0.0.1:8092")]
        wallet: String,
        /// A snapshot every n versions of a room.
        #[arg(long, default_value_t = 10)]
        snapshot_every_n: i64,
        /// Run the relay in this process (else run `postbox relay --config …`).
        #[arg(long)]
        relay: bool,
    },
    /// The wallet service (its own tables and outbox).
    Wallet {
        #[arg(long, default_value = "config/wallet.toml")]
        config: PathBuf,
        #[arg(long, default_value = "127.0.0.1:8092")]
        listen: SocketAddr,
        /// A new user's balance.
        #[arg(long, default_value_t = 1000)]
        initial_balance: i64,
        /// Run the wallet's relay in this process.
        #[arg(long)]
        relay: bool,
    },
    /// The IM stand-in (the room relay's webhook target).
    Im {
        #[arg(long, default_value = "127.0.0.1:8091")]
        listen: SocketAddr,
    },
    /// A projection (activity, notice): the handler `postbox consume` posts to.
    Projection {
        #[arg(long, default_value = "127.0.0.1:8093")]
        listen: SocketAddr,
    },
    /// Everything in one process on SQLite, with file sinks: no server needed.
    Demo {
        /// Where the databases, configs and event files go.
        #[arg(long, default_value = "room-demo")]
        dir: PathBuf,
        /// The room service's port; IM is on the next, the wallet on the
        /// one after, the room relay's dashboard on port + 9.
        #[arg(long, default_value_t = 8090)]
        port: u16,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }
    let shutdown = CancellationToken::new();
    postbox::runtime::signals::spawn_signal_handler(shutdown.clone(), || {});
    match run(cli.command, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("room-service: {e}");
            ExitCode::from(if matches!(e, postbox::Error::Config { .. }) {
                2
            } else {
                1
            })
        }
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, postbox::Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| postbox::Error::config("--listen", format!("cannot listen on {addr}: {e}")))
}

/// An owner service's database (migrated with its `tables`), and its relay
/// when it runs in this process.
async fn owner(
    config: &Path,
    tables: &[&str],
    relay: bool,
    shutdown: &CancellationToken,
) -> Result<(Db, String, Option<Relay>), postbox::Error> {
    let settings = load_config(config)?;
    let db = Db::open(&settings, tables).await?;
    let relay = match relay {
        true => Some(spawn_relay(&settings, &db, shutdown.clone()).await?),
        false => None,
    };
    Ok((db, app_code(&settings), relay))
}

async fn run(command: Command, shutdown: CancellationToken) -> Result<(), postbox::Error> {
    let (what, listen, router, relay) = match command {
        Command::Serve {
            config,
            listen,
            wallet,
            snapshot_every_n,
            relay,
        } => {
            let (db, app, relay) = owner(&config, &service::TABLES, relay, &shutdown).await?;
            let rooms = RoomService::new(db, &app, WalletClient::new(&wallet), snapshot_every_n);
            ("room service", listen, rooms.router(), relay)
        }
        Command::Wallet {
            config,
            listen,
            initial_balance,
            relay,
        } => {
            let (db, app, relay) = owner(&config, &wallet::TABLES, relay, &shutdown).await?;
            let wallet = WalletService::new(db, &app, initial_balance);
            ("wallet", listen, wallet.router(), relay)
        }
        Command::Im { listen } => (
            "IM stand-in: POST /im, POST /control, GET /groups/{room_id}, GET /stats",
            listen,
            Im::default().router(),
            None,
        ),
        Command::Projection { listen } => (
            "projection: POST /events, GET /stats",
            listen,
            Projection::default().router(),
            None,
        ),
        Command::Demo { dir, port } => return demo(&dir, port, shutdown).await,
    };
    let listener = bind(listen).await?;
    tracing::info!(%listen, relay = relay.is_some(), "{what} up");
    wait(serve(listener, router, shutdown.clone()), relay, shutdown).await
}

type Relay = tokio::task::JoinHandle<Result<postbox::relay::RelayReport, postbox::Error>>;

/// Until the server or the relay stops (the relay only on shutdown or an
/// error, which stops the rest).
async fn wait(
    served: tokio::task::JoinHandle<std::io::Result<()>>,
    relay: Option<Relay>,
    shutdown: CancellationToken,
) -> Result<(), postbox::Error> {
    let internal = |e: tokio::task::JoinError| postbox::Error::Internal(e.to_string());
    let Some(relay) = relay else {
        return served
            .await
            .map_err(internal)?
            .map_err(|e| postbox::Error::Internal(e.to_string()));
    };
    let report = relay.await.map_err(internal);
    shutdown.cancel();
    let _ = served.await;
    let report = report??;
    tracing::info!(delivered = report.delivered, "relay stopped");
    Ok(())
}

const DEMO_ROOM: &str = r#"# The room service's postbox config: `room-service serve` opens [database],
# its in-process relay (or `postbox relay --config` this file) runs the rest.
[database]
url = "sqlite://{dir}/room.db"
table = "room_outbox"
app_codes = ["room"]

[outbox_worker]
poll_interval = "1s"
ordering = "per_aggregate"     # each room's events in version order
batch_size = 100
publish_timeout = "3s"
max_retry_count = 5
initial_backoff = "1s"
max_backoff = "30s"

[[publishers]]                 # the IM stand-in: RoomCreated ensures the group, the rest are group messages
kind = "webhook"
name = "im"
url = "http://127.0.0.1:{im_port}/im"
timeout = "3s"

[[publishers]]                 # activity; on MariaDB this is RabbitMQ (config/room.toml)
kind = "file"
name = "activity"
path = "{dir}/activity.jsonl"

[admin]                        # dashboard and API of the room relay
listen = "127.0.0.1:{dashboard_port}"
token = "demo"
"#;

const DEMO_WALLET: &str = r#"# The wallet's own outbox and relay.
[database]
url = "sqlite://{dir}/wallet.db"
table = "wallet_outbox"
app_codes = ["wallet"]

[outbox_worker]
poll_interval = "1s"
ordering = "per_aggregate"

[[publishers]]
kind = "file"
name = "notice"
path = "{dir}/wallet-events.jsonl"
"#;

async fn demo(dir: &Path, port: u16, shutdown: CancellationToken) -> Result<(), postbox::Error> {
    let io = |e: std::io::Error| postbox::Error::config("--dir", format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let dir = dir.canonicalize().map_err(io)?;
    let shown = dir.display().to_string();
    let write = |name: &str, text: &str| -> Result<PathBuf, postbox::Error> {
        let path = dir.join(name);
        let text = text
            .replace("{dir}", &shown)
            .replace("{im_port}", &(port + 1).to_string())
            .replace("{dashboard_port}", &(port + 9).to_string());
        std::fs::write(&path, text).map_err(io)?;
        Ok(path)
    };
    let room_config = write("room.toml", DEMO_ROOM)?;
    let wallet_config = write("wallet.toml", DEMO_WALLET)?;

    let at = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    let im = bind(at(port + 1)).await?;
    let wallet_listener = bind(at(port + 2)).await?;
    let rooms_listener = bind(at(port)).await?;
    let im_served = serve(im, Im::default().router(), shutdown.clone());

    let wallet_settings = load_config(&wallet_config)?;
    let wallet_db = Db::open(&wallet_settings, &wallet::TABLES).await?;
    let wallet_relay = spawn_relay(&wallet_settings, &wallet_db, shutdown.clone()).await?;
    let wallet = WalletService::new(wallet_db, "wallet", 1000);
    let wallet_served = serve(wallet_listener, wallet.router(), shutdown.clone());

    let room_settings = load_config(&room_config)?;
    let room_db = Db::open(&room_settings, &service::TABLES).await?;
    let room_relay = spawn_relay(&room_settings, &room_db, shutdown.clone()).await?;
    let rooms = RoomService::new(
        room_db,
        "room",
        WalletClient::new(&format!("http://{}", at(port + 2))),
        10,
    );
    let rooms_served = serve(rooms_listener, rooms.router(), shutdown.clone());

    let (im_port, wallet_port, dashboard) = (port + 1, port + 2, port + 9);
    println!(
        r#"
room-service demo: everything on SQLite in {shown}
  room service  http://127.0.0.1:{port}   (relay in-process: IM webhook + {shown}/activity.jsonl)
  wallet        http://127.0.0.1:{wallet_port}   (own outbox, own relay: {shown}/wallet-events.jsonl)
  IM stand-in   http://127.0.0.1:{im_port}   dashboard http://127.0.0.1:{dashboard} (token: demo)

Try (each command has a command_id; send one twice and nothing changes):
  curl -s localhost:{port}/rooms/r1/create -d '{{"command_id":"c1","user_id":"alice","title":"hi"}}' -H 'content-type: application/json'
  curl -s localhost:{port}/rooms/r1/join -d '{{"command_id":"c2","user_id":"bob"}}' -H 'content-type: application/json'
  curl -s localhost:{port}/rooms/r1/mic -d '{{"command_id":"c3","user_id":"bob","seat":1,"action":"take"}}' -H 'content-type: application/json'
  curl -s localhost:{port}/rooms/r1/sendGift -d '{{"command_id":"c4","user_id":"alice","to_user_id":"bob","gift_id":"rose","amount":10}}' -H 'content-type: application/json'
  curl -s localhost:{port}/rooms/r1/leave -d '{{"command_id":"c5","user_id":"bob"}}' -H 'content-type: application/json'
  curl -s localhost:{im_port}/groups/r1                     # what IM received, in version order
  tail {shown}/activity.jsonl {shown}/wallet-events.jsonl

IM down, then back:
  curl -s localhost:{im_port}/control -d '{{"down":true}}' -H 'content-type: application/json'
  postbox --config {shown}/room.toml status             # rows go retryable, then failed
  curl -s localhost:{im_port}/control -d '{{"down":false}}' -H 'content-type: application/json'
  postbox --config {shown}/room.toml replay --status failed

Every command logs a room_command_timing line below. Ctrl-C stops the demo.
"#,
    );
    let mut stopped = Ok(());
    for relay in [room_relay, wallet_relay] {
        let r = relay
            .await
            .map_err(|e| postbox::Error::Internal(e.to_string()));
        // A relay that fails stops the demo.
        shutdown.cancel();
        if let Err(e) = r.and_then(|r| r) {
            stopped = Err(e);
        }
    }
    for served in [im_served, wallet_served, rooms_served] {
        let _ = served.await;
    }
    stopped
}
