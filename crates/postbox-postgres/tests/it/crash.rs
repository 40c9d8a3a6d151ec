//! PostgreSQL crashes while a relay drains. The relay's claims and marks
//! commit without waiting for the WAL flush (`relay_commit = "async"`, the
//! default), so a crash loses the last of them: the rows come back pending
//! or leased, and are published again. No event is lost.
//!
//! The server is a private one (initdb in a scratch directory, its own
//! port), so crashing it does not disturb the other tests. A crash of the
//! server's processes alone loses only WAL not yet handed to the kernel,
//! which the WAL writer does within milliseconds of an asynchronous
//! commit; a crash of the host loses what the kernel had not written
//! either (up to three `wal_writer_delay`s). To lose writes for certain,
//! the test stops the WAL writer (`SIGSTOP`) before the relay starts, with
//! WAL buffers large enough to hold the drain, then kills it (`SIGKILL`):
//! PostgreSQL treats that as a crash, ends every session and recovers
//! from its WAL on disk, without the relay's writes since the stop.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use postbox_core::config::{HumanDuration, RelaySettings, WorkerConfig};
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::NewEvent;
use postbox_postgres::PgOutbox;
use postbox_testkit::faults::WrappedStore;
use postbox_testkit::RecordingPublisher;

/// A PostgreSQL server of this test's own, stopped and removed on drop.
struct PrivatePostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    /// initdb (as the `postgres` user: the server refuses root), then start.
    fn start() -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL's binaries under /usr/lib/postgresql")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|b| b.join("initdb").exists())
            .max()
            .expect("an initdb under /usr/lib/postgresql/*/bin");
        let dir = std::env::temp_dir().join(format!("postbox-crash-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        as_postgres(&["chown", "-R", "postgres:postgres"], &dir, true);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pg = PrivatePostgres { bin, dir, port };
        pg.run(&[
            "initdb",
            "-D",
            &pg.data(),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ]);
        pg.up();
        pg
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs one of the server's programs as the `postgres` user.
    fn run(&self, args: &[&str]) {
        let program = self.bin.join(args[0]).display().to_string();
        let mut all = vec![program.as_str()];
        all.extend_from_slice(&args[1..]);
        as_postgres(&all, &self.dir, false);
    }

    fn up(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c wal_buffers=64MB",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log").display().to_string();
        self.run(&[
            "pg_ctl",
            "-D",
            &self.data(),
            "-w",
            "-l",
            &log,
            "-o",
            &options,
            "start",
        ]);
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .args(["-D", &self.data(), "-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `args` as the `postgres` user (`chown` as root when `root`), in `dir`;
/// panics with its output when it fails.
fn as_postgres(args: &[&str], dir: &Path, root: bool) {
    let mut cmd = if root {
        let mut c = Command::new(args[0]);
        c.args(&args[1..]).arg(dir);
        c
    } else {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).args(args).current_dir(dir);
        c
    };
    let out = cmd.output().expect("runuser (util-linux)");
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

const EVENTS: usize = 20_000;

/// Sends `signal` to process `pid`.
fn signal(pid: i32, signal: &str) {
    let out = Command::new("kill")
        .args([signal, &pid.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "kill {signal} {pid}");
}

/// 20,000 events; the server crashes when about a quarter are published
/// and recovers by itself. Every event is published at least once, every
/// row ends delivered, and the crash did lose relay writes: rows the
/// database had answered as marked delivered were published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_crash_loses_the_relays_last_writes_and_no_event() {
    let pg = PrivatePostgres::start();
    let pg_store = PgOutbox::connect(&pg.url(), "crash_outbox", 4)
        .await
        .expect("the private server");
    pg_store.migrate().await.unwrap();
    let events: Vec<NewEvent> = (0..EVENTS)
        .map(|i| NewEvent::new("crash", "Made", format!("{{\"n\":{i}}}")))
        .collect();
    for chunk in events.chunks(1_000) {
        pg_store.enqueue_batch(chunk, 1024).await.unwrap();
    }
    // Everything so far is flushed (each enqueue commits synchronously).
    let walwriter: i32 =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
            .fetch_one(pg_store.pool())
            .await
            .unwrap();
    signal(walwriter, "-STOP");
    let store = Arc::new(WrappedStore::new(Arc::new(pg_store.clone())));
    let publisher = Arc::new(RecordingPublisher::new("rec"));
    let config = WorkerConfig {
        poll_interval: HumanDuration::millis(100),
        batch_size: 100,
        publish_timeout: HumanDuration::secs(1),
        lease: HumanDuration::secs(3),
        ..WorkerConfig::default()
    };
    let settings = RelaySettings::new(config, vec!["crash".to_owned()]).unwrap();
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(
        Relay::new(store.clone(), vec![publisher.clone()], settings).run(shutdown.clone()),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    while store.marked().len() < EVENTS / 4 {
        assert!(
            Instant::now() < deadline,
            "the relay did not start delivering"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    signal(walwriter, "-KILL");
    let published_before = publisher.delivered_ids().len();
    let marked_before: HashSet<i64> = store.marked().into_iter().collect();
    assert!(published_before < EVENTS, "the crash came after the drain");
    // The server recovers by itself; the relay's pools reconnect.
    loop {
        let delivered = sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM crash_outbox WHERE status = 'delivered'",
        )
        .fetch_one(pg_store.pool())
        .await
        .unwrap_or(-1);
        if delivered == EVENTS as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every row was delivered after the crash: {delivered} of {EVENTS}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    let published = publisher.delivered_ids();
    let ids: HashMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT event_id, id FROM crash_outbox")
            .fetch_all(pg_store.pool())
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(ids.len(), EVENTS);
    let seen: HashSet<&String> = published.iter().collect();
    let lost = ids.keys().filter(|e| !seen.contains(e)).count();
    assert_eq!(lost, 0, "events never published");
    // Marked before the crash (the database said so), published after it:
    // the mark was lost with the crash.
    let lost_marks: HashSet<i64> = published[published_before..]
        .iter()
        .map(|e| ids[e])
        .filter(|id| marked_before.contains(id))
        .collect();
    println!(
        "crash: {EVENTS} events, {} marked delivered before the crash, {} of those marks lost \
         and published again, {} publishes in all, 0 lost",
        marked_before.len(),
        lost_marks.len(),
        published.len()
    );
    assert!(
        !lost_marks.is_empty(),
        "the crash lost none of the relay's marks: the test crashed nothing"
    );
}
