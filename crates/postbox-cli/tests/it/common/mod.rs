//! Shared by the CLI tests: run the real `postbox` binary with a config,
//! read its JSON, stop it, and reach the servers it runs against.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postbox_core::store::OutboxStore;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::{ensure_database, how_to_start, mysql_url, postgres_url};

pub use postbox_testkit::cli_fixtures::{expect_in, find_in, pluck};

/// `postbox enqueue` of one `T` event with an empty payload; more flags
/// (`--event-id`, `--app-code`) may follow.
pub const ENQUEUE_T: [&str; 5] = ["enqueue", "--event-type", "T", "--payload", "{}"];

/// Held by the tests that load the machine for a minute or more (a
/// cluster of three RabbitMQ nodes, four relay processes with kills), one
/// at a time: on a 2-core machine two of them at once starve each other's
/// time budgets (leases, retry budgets, elections), which would fail them
/// for want of CPU, not for a fault in postbox.
pub async fn one_heavy_test_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    HEAVY.lock().await
}

/// Runs `postbox args…` in `dir` with extra environment variables.
pub fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_postbox"));
    cmd.current_dir(dir).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run postbox")
}

/// Runs `postbox args…` in `dir`.
pub fn postbox(dir: &Path, args: &[&str]) -> Output {
    run(dir, args, &[])
}

/// stdout then stderr, for assertions and failure messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Asserts that the command exited 0, showing what it printed otherwise.
pub fn assert_ok(out: &Output) {
    assert!(out.status.success(), "{}", text(out));
}

/// Asserts that what the command printed contains each of `parts`.
pub fn assert_says(out: &Output, parts: &[&str]) {
    let shown = text(out);
    for part in parts {
        assert!(shown.contains(part), "no `{part}` in: {shown}");
    }
}

/// The command's stdout, parsed as JSON (`--json`).
pub fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text(out)))
}

/// Writes `body` as `dir/postbox.toml`; returns its path.
pub fn write_config(dir: &Path, body: &str) -> String {
    let path = dir.join("postbox.toml");
    std::fs::write(&path, body).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A temporary folder holding a `postbox.toml`, and the CLI run with it.
pub struct Project {
    pub dir: tempfile::TempDir,
    pub cfg: String,
}

impl Project {
    /// A migrated PostgreSQL outbox on a scratch table named after
    /// `prefix`, app_codes `room` and `wallet`, polled every 100 ms, its
    /// one publisher the file `out.jsonl` in the project's folder.
    pub async fn room_and_wallet_to_a_file(prefix: &str) -> Self {
        let (url, store) = server_outbox("postgres", prefix, 2).await;
        let table = store.table().as_str().to_owned();
        Project::migrated(|dir| {
            format!(
                "[database]\nurl = \"{url}\"\ntable = \"{table}\"\napp_codes = [\"room\", \"wallet\"]\n\
                 [outbox_worker]\npoll_interval = \"100ms\"\n\
                 [[publishers]]\nkind = \"file\"\npath = \"{}/out.jsonl\"\n",
                dir.display()
            )
        })
    }

    /// Enqueues an event of type `T` for `app_code` with `payload`.
    pub fn enqueue(&self, app_code: &str, payload: &str) {
        assert_ok(&self.run(&[
            "enqueue",
            "--app-code",
            app_code,
            "--event-type",
            "T",
            "--payload",
            payload,
        ]));
    }

    /// Lines written to the file `name` of the project's folder so far.
    pub fn lines(&self, name: &str) -> usize {
        std::fs::read_to_string(self.path().join(name)).map_or(0, |t| t.lines().count())
    }

    /// A fresh folder with the config `body(folder)`.
    pub fn new(body: impl FnOnce(&Path) -> String) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cfg = write_config(dir.path(), &body(dir.path()));
        Project { dir, cfg }
    }

    /// [`Project::new`], then `postbox migrate`, which must succeed.
    pub fn migrated(body: impl FnOnce(&Path) -> String) -> Self {
        let project = Project::new(body);
        assert_ok(&project.run(&["migrate"]));
        project
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `postbox --config postbox.toml args…`.
    pub fn run(&self, args: &[&str]) -> Output {
        run(self.path(), &self.args(args), &[])
    }

    /// `postbox --config postbox.toml args…` as a process of its own,
    /// stdout dropped; killed if the test ends while it runs.
    pub fn spawn(&self, args: &[&str], stderr: Stdio) -> Spawned {
        let child = Command::new(env!("CARGO_BIN_EXE_postbox"))
            .current_dir(self.path())
            .args(self.args(args))
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start postbox");
        Spawned(Some(child))
    }

    fn args<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        let mut all = vec!["--config", self.cfg.as_str()];
        all.extend_from_slice(args);
        all
    }
}

/// A postbox process of a test ([`Project::spawn`]): killed and reaped
/// when dropped while it still runs, so a test that fails part-way leaves
/// no relay running behind it (one did, for over an hour, after a failed
/// assertion skipped its SIGTERM).
pub struct Spawned(Option<Child>);

impl Spawned {
    /// Waits for the process to exit, with its piped output.
    pub fn wait_with_output(mut self) -> std::io::Result<Output> {
        self.0.take().expect("a spawned process").wait_with_output()
    }
}

impl std::ops::Deref for Spawned {
    type Target = Child;

    fn deref(&self) -> &Child {
        self.0.as_ref().expect("a spawned process")
    }
}

impl std::ops::DerefMut for Spawned {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("a spawned process")
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// `postbox --config cfg command` in `dir` as a tokio process (stdout
/// dropped, stderr inherited), with extra environment variables; killed
/// when dropped.
pub fn spawn_async(
    dir: &Path,
    cfg: &str,
    command: &str,
    env: &[(&str, &str)],
) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir)
        .args(["--config", cfg, command])
        .env_remove("POSTBOX_CONFIG")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start postbox")
}

/// SIGTERM to a postbox process, which must exit 0 within 15 s.
pub async fn stopped(child: &mut tokio::process::Child) {
    signal("TERM", child.id().unwrap());
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("postbox stops within 15 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// Enqueues `total` events of app_code `room`, `batch` at a time every
/// 50 ms, like a service under load.
pub fn produce(
    store: Arc<dyn OutboxStore>,
    total: usize,
    batch: usize,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for chunk in 0..total / batch {
            let events: Vec<_> = (0..batch)
                .map(|k| {
                    let payload = format!(r#"{{"n":{}}}"#, chunk * batch + k);
                    postbox_core::NewEvent::new("room", "RoomCreated", payload)
                })
                .collect();
            store.enqueue_batch(&events, 1 << 20).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// The delivered rows of app_code `room`.
pub async fn delivered_rooms(store: &dyn OutboxStore) -> i64 {
    store.stats(&["room".to_owned()]).await.unwrap()[0].delivered
}

/// `kill -NAME pid`, which must succeed.
pub fn signal(name: &str, pid: u32) {
    let st = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{name} {pid}");
}

/// Polls `done` every `every` until it holds; fails with `what()` after `secs`.
pub fn wait_until(
    secs: u64,
    every: Duration,
    mut done: impl FnMut() -> bool,
    what: impl Fn() -> String,
) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "{}", what());
        std::thread::sleep(every);
    }
}

/// The URL of `server` (`postgres` or `mysql`), its database created.
pub async fn server_url(server: &str) -> String {
    let url = match server {
        "postgres" => postgres_url(),
        "mysql" => mysql_url(),
        other => panic!("no test server `{other}`"),
    };
    ensure_database(server, &url).await;
    url
}

/// A pool on `server` (`postgres` or `mysql`) and its URL; a server that is
/// down fails naming how to start it.
pub async fn server_pool<DB: sqlx::Database>(server: &str) -> (String, sqlx::Pool<DB>) {
    let url = server_url(server).await;
    let pool = sqlx::Pool::<DB>::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start(server)));
    (url, pool)
}

/// A migrated outbox on a scratch table (`prefix`) of `server`, and its URL.
pub async fn server_outbox(
    server: &str,
    prefix: &str,
    max_connections: u32,
) -> (String, Arc<dyn OutboxStore>) {
    let url = server_url(server).await;
    let table = scratch_table(prefix);
    let store: Arc<dyn OutboxStore> = match server {
        "postgres" => postbox_postgres::PgOutbox::connect(&url, &table, max_connections)
            .await
            .map(|s| Arc::new(s) as _),
        _ => postbox_mysql::MySqlOutbox::connect(&url, &table, max_connections)
            .await
            .map(|s| Arc::new(s) as _),
    }
    .unwrap_or_else(|e| panic!("{}: {e}", how_to_start(server)));
    store.migrate().await.expect("migrate");
    (url, store)
}

/// A SQLite pool on `url`, creating the file, waiting out a writer's lock.
pub async fn sqlite_pool(url: &str) -> sqlx::SqlitePool {
    sqlx::sqlite::SqlitePoolOptions::new()
        .connect_with(
            url.parse::<sqlx::sqlite::SqliteConnectOptions>()
                .unwrap()
                .create_if_missing(true)
                .busy_timeout(Duration::from_secs(10)),
        )
        .await
        .unwrap()
}

/// One database, reached directly for loading, changing and counting.
pub enum Db {
    Pg(sqlx::PgPool),
    My(sqlx::MySqlPool),
    Lite(sqlx::SqlitePool),
}

impl Db {
    /// Runs one statement (on MariaDB as plain text, not prepared).
    pub async fn exec(&self, sql: &str) {
        match self {
            Db::Pg(p) => sqlx::query(sql).execute(p).await.map(|_| ()),
            Db::My(p) => sqlx::raw_sql(sql).execute(p).await.map(|_| ()),
            Db::Lite(p) => sqlx::query(sql).execute(p).await.map(|_| ()),
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// The one number `sql` selects.
    pub async fn count(&self, sql: &str) -> i64 {
        match self {
            Db::Pg(p) => sqlx::query_scalar(sql).fetch_one(p).await,
            Db::My(p) => sqlx::query_scalar(sql).fetch_one(p).await,
            Db::Lite(p) => sqlx::query_scalar(sql).fetch_one(p).await,
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Drops the outbox table `t` and its archive and history tables.
    pub async fn drop_tables(&self, t: &str) {
        for suffix in postbox_core::store::EXPECTED_TABLES {
            self.exec(&format!("DROP TABLE IF EXISTS {t}{suffix}"))
                .await;
        }
    }
}
