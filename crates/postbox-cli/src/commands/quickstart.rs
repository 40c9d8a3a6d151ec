//! `postbox quickstart`: the whole loop on the embedded default — SQLite,
//! a producer writing events in transactions, the relay, and a JSON-lines
//! file — with a live status line. No server to install.

use std::path::Path;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use postbox_admin::{AdminServer, AdminSettings};
use postbox_core::config::{self, ConfigSource, Settings};
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::NewEvent;
use postbox_runtime::signals::spawn_signal_handler;

use crate::cli::{Global, QuickstartArgs};
use crate::error::CliError;
use crate::logging;
use crate::open::open_store_creating;

const DEMO_TYPES: [&str; 4] = ["RoomCreated", "MemberJoined", "GiftSent", "MemberLeft"];

pub async fn run(g: &Global, args: QuickstartArgs) -> Result<(), CliError> {
    // Under --json, stdout is the one JSON document: the human lines go
    // to stderr (they came first on stdout, before the document).
    let json = g.json;
    macro_rules! say {
        ($($arg:tt)*) => {
            if json {
                errln!($($arg)*)
            } else {
                outln!($($arg)*)
            }
        };
    }
    // `--keep-serving` is what every quickstart does now.
    let _ = args.keep_serving;
    let dir = &args.dir;
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::runtime(format!("creating `{}`: {e}", dir.display())))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| CliError::runtime(format!("`{}`: {e}", dir.display())))?;
    let db = dir.join("postbox.db");
    let out = dir.join("events.jsonl");
    let config_path = dir.join("postbox.toml");
    // Its files are deleted and written again: only where an earlier
    // quickstart wrote them (`--dir .` in a project wiped its own
    // `postbox.db` and `postbox.toml`).
    let ours = |path: &Path| {
        std::fs::read_to_string(path).is_ok_and(|text| text.starts_with(QUICKSTART_MARK))
    };
    if (config_path.exists() || db.exists()) && !ours(&config_path) {
        return Err(CliError::Usage(format!(
            "`{}` holds a postbox.toml or postbox.db that `postbox quickstart` did not write; it deletes and rewrites them: give --dir an empty or new folder",
            dir.display()
        )));
    }
    for stale in [
        db.clone(),
        dir.join("postbox.db-wal"),
        dir.join("postbox.db-shm"),
        out.clone(),
    ] {
        let _ = std::fs::remove_file(stale);
    }
    std::fs::write(
        &config_path,
        demo_config(
            &db,
            &out,
            &args.listen,
            &postbox_core::event::new_event_id(),
        ),
    )
    .map_err(|e| CliError::runtime(format!("writing `{}`: {e}", config_path.display())))?;

    let config = config::load(&ConfigSource {
        file: Some(config_path.clone()),
        database_url: None,
    })?;
    let store = open_store_creating(&config).await?;
    store.migrate().await?;
    let publishers = postbox_publishers::build_all(&config).await?;
    let relay_settings = config.relay(Vec::new())?;

    let dashboard = bind_dashboard(store.clone(), &args.listen, &config).await?;
    let dashboard_addr = dashboard.local_addr()?;

    say!("postbox quickstart");
    say!("  database   {}", db.display());
    say!("  relay to   {}", out.display());
    say!(
        "  dashboard  http://{dashboard_addr}/   (it asks for the admin token: `token` in {})",
        config_path.display()
    );
    say!(
        "  writing {} demo events at {}/s; Ctrl-C stops early\n",
        args.events,
        args.rate
    );

    // Ctrl-C (or SIGTERM) ends everything; the demo's relay and producer
    // also stop by themselves once every event is delivered, while the
    // dashboard keeps serving until the signal.
    let interrupted = CancellationToken::new();
    spawn_signal_handler(interrupted.clone(), logging::flush);
    let shutdown = interrupted.child_token();
    let dashboard_stop = CancellationToken::new();
    let dashboard_task = tokio::spawn(dashboard.run(dashboard_stop.clone()));
    let relay = Relay::new(store.clone(), publishers, relay_settings);
    let relay_task = tokio::spawn(relay.run(shutdown.clone()));

    let producer = {
        let store = store.clone();
        let stop = shutdown.clone();
        let (total, rate) = (args.events, args.rate.max(1));
        tokio::spawn(async move {
            let mut written = 0u32;
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let per_tick = (rate / 10).max(1);
            while written < total && !stop.is_cancelled() {
                tick.tick().await;
                let n = per_tick.min(total - written);
                let batch: Vec<NewEvent> = (written..written + n).map(demo_event).collect();
                // A busy database (SQLite has one writer, and the relay
                // writes too) delays the demo, never cuts it short: the
                // same batch is tried again, for up to a minute.
                let mut tries = 0;
                while let Err(e) = store.enqueue_batch(&batch, 1 << 20).await {
                    tries += 1;
                    if tries == 300 || stop.is_cancelled() {
                        tracing::error!(error = %e, tries, "demo producer failed; stopping it");
                        return written;
                    }
                    tracing::warn!(error = %e, tries, "demo producer could not write; trying again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                written += n;
            }
            written
        })
    };

    let bar = ProgressBar::new(u64::from(args.events));
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} delivered  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let app = config.database.app_codes.clone();
    let delivered = loop {
        let s = store.stats(&app).await?.remove(0);
        let rate = s.delivered as f64 / started.elapsed().as_secs_f64().max(0.001);
        bar.set_position(s.delivered as u64);
        bar.set_message(format!(
            "pending {}  delivering {}  retryable {}  failed {}  {:.0} events/s",
            s.pending, s.delivering, s.retryable, s.failed, rate
        ));
        let produced_all = producer.is_finished();
        if shutdown.is_cancelled() || (produced_all && s.pending + s.delivering + s.retryable == 0)
        {
            break s.delivered;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    bar.finish_and_clear();
    shutdown.cancel();
    let written = producer.await.unwrap_or(0);
    let report = relay_task.await.map_err(CliError::runtime)??;
    let lines = std::fs::read_to_string(&out)
        .map(|t| t.lines().count())
        .unwrap_or(0);

    say!(
        "wrote {written} events in transactions; the relay delivered {delivered} ({} claimed) to {lines} lines of JSON in {:.1}s.\n",
        report.claimed,
        started.elapsed().as_secs_f64()
    );
    say!("Where to look:");
    say!("  head -3 {}", out.display());
    let cfg = config_path.display();
    // The binary as it was run (e.g. target/release/postbox under cargo run).
    let bin = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "postbox".to_owned());
    say!("  {bin} --config {cfg} status");
    say!("  {bin} --config {cfg} events list --limit 5");
    say!("  {bin} --config {cfg} enqueue --event-type Hello --payload '{{\"hi\":1}}'");
    // The config's [admin] listen is this dashboard's address while it runs.
    say!("Once this one has stopped (Ctrl-C; its dashboard holds the config's admin.listen):");
    say!("  {bin} --config {cfg} relay        # delivers it; Ctrl-C to stop");
    say!("  {bin} --config {cfg} serve        # the dashboard again");
    if g.json {
        crate::output::json(&serde_json::json!({
            "database": db, "output": out, "config": config_path,
            "written": written, "delivered": delivered, "lines": lines,
            "dashboard": format!("http://{dashboard_addr}/"),
        }))?;
    }
    if !interrupted.is_cancelled() {
        say!("\nThe dashboard stays up at http://{dashboard_addr}/ ; Ctrl-C to stop.");
        interrupted.cancelled().await;
    }
    dashboard_stop.cancel();
    match dashboard_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "dashboard stopped"),
        Err(e) => tracing::warn!(error = %e, "dashboard task failed"),
    }
    Ok(())
}

/// The admin server on `listen`, or on a free port when that one is taken
/// (another quickstart or a relay already serving there).
async fn bind_dashboard(
    store: std::sync::Arc<dyn postbox_core::store::OutboxStore>,
    listen: &str,
    config: &Settings,
) -> Result<AdminServer, CliError> {
    let mut settings = AdminSettings::from_settings(config, Vec::new());
    settings.listen = listen.to_owned();
    settings.listen_from = "--listen";
    settings.poll_interval = Duration::from_secs(1);
    match AdminServer::bind(store.clone(), settings.clone()).await {
        Ok(s) => Ok(s),
        Err(postbox_core::Error::Io { .. }) => {
            let host = listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
            settings.listen = format!("{host}:0");
            Ok(AdminServer::bind(store, settings).await?)
        }
        Err(e) => Err(e.into()),
    }
}

/// The first line of the config quickstart writes, by which it knows a
/// folder as its own.
const QUICKSTART_MARK: &str = "# Written by `postbox quickstart`.";

fn demo_config(db: &Path, out: &Path, listen: &str, token: &str) -> String {
    format!(
        r#"# Written by `postbox quickstart`.
[database]
url = "sqlite://{db}"
table = "room_outbox"
app_codes = ["room"]

[outbox_worker]
poll_interval = "100ms"
batch_size = 100

[[publishers]]
kind = "file"
path = "{out}"

# `postbox serve` and the quickstart's dashboard. The dashboard asks for
# this token: it reads events (payloads) and replays failed ones with it.
[admin]
listen = "{listen}"
token = "{token}"
"#,
        db = db.display(),
        out = out.display()
    )
}

fn demo_event(i: u32) -> NewEvent {
    let room = i % 20;
    let ty = DEMO_TYPES[(i as usize / 20) % DEMO_TYPES.len()];
    NewEvent::new(
        "room",
        ty,
        format!(r#"{{"room_id":"room-{room}","seq":{i}}}"#),
    )
    .aggregate(format!("room-{room}"), i64::from(i / 20))
    .header("source", "quickstart")
}
