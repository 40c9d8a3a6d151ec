//! `postbox archive` as a user runs it, on PostgreSQL, MariaDB and SQLite:
//! exactly the old delivered rows move; a run killed mid-way and run again
//! leaves every row in exactly one of the two tables; a second archiver
//! finds the lock taken.

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{postbox, text};
use postbox_testkit::scratch_table;
use postbox_testkit::servers::{ensure_database, how_to_start, mysql_url, postgres_url};

/// One database, reached directly for loading and counting.
enum Db {
    Pg(sqlx::PgPool),
    My(sqlx::MySqlPool),
    Lite(sqlx::SqlitePool),
}

impl Db {
    async fn exec(&self, sql: &str) {
        match self {
            Db::Pg(p) => sqlx::query(sql).execute(p).await.map(|_| ()),
            Db::My(p) => sqlx::query(sql).execute(p).await.map(|_| ()),
            Db::Lite(p) => sqlx::query(sql).execute(p).await.map(|_| ()),
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn count(&self, sql: &str) -> i64 {
        match self {
            Db::Pg(p) => sqlx::query_scalar(sql).fetch_one(p).await,
            Db::My(p) => sqlx::query_scalar(sql).fetch_one(p).await,
            Db::Lite(p) => sqlx::query_scalar(sql).fetch_one(p).await,
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// `(old delivered, old published, fresh delivered, old pending)`.
struct Load {
    old_delivered: i64,
    old_published: i64,
    fresh: i64,
    pending: i64,
}

impl Load {
    fn total(&self) -> i64 {
        self.old_delivered + self.old_published + self.fresh + self.pending
    }
    fn old(&self) -> i64 {
        self.old_delivered + self.old_published
    }
}

/// Every row is in exactly one of the two tables (counted in one
/// statement, so one snapshot, while a killed run's last statement may
/// still be finishing on the server).
async fn assert_each_row_once(db: &Db, t: &str, load: &Load) {
    let sum = db
        .count(&format!(
            "SELECT (SELECT COUNT(*) FROM {t}) + (SELECT COUNT(*) FROM {t}_archive)"
        ))
        .await;
    let both = db
        .count(&format!(
            "SELECT COUNT(*) FROM {t} o JOIN {t}_archive a ON a.id = o.id"
        ))
        .await;
    assert_eq!(both, 0, "rows in both tables");
    assert_eq!(sum, load.total(), "rows lost or duplicated");
}

async fn archive_scenario(db: Db, url: &str, t: &str, gen: impl Fn(&str, &str, i64) -> String) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("postbox.toml");
    std::fs::write(
        &config,
        format!("[database]\nurl = \"{url}\"\ntable = \"{t}\"\napp_codes = [\"arch\"]\n"),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let out = postbox(dir.path(), &["--config", config, "migrate"]);
    assert!(out.status.success(), "{}", text(&out));

    let load = Load {
        old_delivered: match db {
            Db::Lite(_) => 20_000,
            _ => 200_000,
        },
        old_published: 100,
        fresh: 1_000,
        pending: 500,
    };
    // Old rows: updated in 2001. Fresh ones: updated now (the default).
    db.exec(&gen("'delivered'", "1000000000000", load.old_delivered))
        .await;
    db.exec(&gen("'published'", "1000000000000", load.old_published))
        .await;
    db.exec(&gen("'delivered'", "NULL", load.fresh)).await;
    db.exec(&gen("'pending'", "1000000000000", load.pending))
        .await;

    // While another archiver holds the lock, a run does nothing and says so.
    let locked_out = |dir: &Path| {
        let out = postbox(dir, &["--config", config, "archive"]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(
            text(&out).contains("another archiver holds the lock"),
            "{}",
            text(&out)
        );
    };
    match &db {
        Db::Pg(p) => {
            let mut c = p.acquire().await.unwrap();
            let name = format!("postbox_archive:{t}");
            sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
                .bind(&name)
                .execute(&mut *c)
                .await
                .unwrap();
            locked_out(dir.path());
            sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
                .bind(&name)
                .execute(&mut *c)
                .await
                .unwrap();
        }
        Db::My(p) => {
            let mut c = p.acquire().await.unwrap();
            let name = format!("postbox_archive:{t}");
            sqlx::query("SELECT GET_LOCK(LEFT(?, 64), 5)")
                .bind(&name)
                .execute(&mut *c)
                .await
                .unwrap();
            locked_out(dir.path());
            sqlx::query("SELECT RELEASE_LOCK(LEFT(?, 64))")
                .bind(&name)
                .execute(&mut *c)
                .await
                .unwrap();
        }
        // SQLite: each batch holds the database's write lock instead.
        Db::Lite(_) => {}
    }
    assert_eq!(
        db.count(&format!("SELECT COUNT(*) FROM {t}_archive")).await,
        0
    );

    // A run SIGKILLed mid-way, with small batches so that it is mid-way.
    let mut child = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir.path())
        .args(["--config", config, "archive", "--batch-size", "500"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let archived = db.count(&format!("SELECT COUNT(*) FROM {t}_archive")).await;
        if archived > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "archive never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // The server may still finish the killed run's last statement: wait
    // until the archive stops growing.
    let mut archived = db.count(&format!("SELECT COUNT(*) FROM {t}_archive")).await;
    loop {
        assert_each_row_once(&db, t, &load).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = db.count(&format!("SELECT COUNT(*) FROM {t}_archive")).await;
        if now == archived {
            break;
        }
        archived = now;
    }
    assert!(
        archived < load.old(),
        "the kill landed mid-way ({archived} of {} archived)",
        load.old()
    );
    assert_each_row_once(&db, t, &load).await;

    // Run again: finishes the job.
    let out = postbox(
        dir.path(),
        &[
            "--config",
            config,
            "--json",
            "archive",
            "--older-than",
            "30d",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["complete"], true);
    assert_eq!(summary["moved"].as_i64().unwrap(), load.old() - archived);
    assert_each_row_once(&db, t, &load).await;
    let count = |sql: String| {
        let db = &db;
        async move { db.count(&sql).await }
    };
    assert_eq!(
        count(format!("SELECT COUNT(*) FROM {t}_archive")).await,
        load.old()
    );
    assert_eq!(
        count(format!(
            "SELECT COUNT(*) FROM {t} WHERE status = 'delivered'"
        ))
        .await,
        load.fresh,
        "fresh delivered rows stay"
    );
    assert_eq!(
        count(format!("SELECT COUNT(*) FROM {t} WHERE status = 'pending'")).await,
        load.pending,
        "pending rows stay, however old"
    );
    assert_eq!(
        count(format!(
            "SELECT COUNT(*) FROM {t}_archive WHERE status NOT IN ('delivered', 'published') \
             OR updated_at_ms >= 1000000000000 + 1000000"
        ))
        .await,
        0
    );

    // Nothing left to do: a third run moves nothing.
    let out = postbox(dir.path(), &["--config", config, "--json", "archive"]);
    assert!(out.status.success(), "{}", text(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["moved"], 0);

    for suffix in ["", "_archive", "_history"] {
        db.exec(&format!("DROP TABLE IF EXISTS {t}{suffix}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_archive_moves_old_rows_and_survives_a_kill() {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let pool = sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("postgres")));
    let t = scratch_table("arch");
    let tt = t.clone();
    let gen = move |status: &str, updated: &str, n: i64| {
        let updated = if updated == "NULL" {
            "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT".to_owned()
        } else {
            format!("{updated} + g")
        };
        format!(
            "INSERT INTO {tt} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'arch', {status} || '-' || substr(md5(random()::text), 1, 8) || '-' || g, 'Old', '{{}}', {status}, 1000000000000 + g, {updated} \
             FROM generate_series(1, {n}) g"
        )
    };
    archive_scenario(Db::Pg(pool), &url, &t, gen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_archive_moves_old_rows_and_survives_a_kill() {
    let url = mysql_url();
    ensure_database("mysql", &url).await;
    let pool = sqlx::MySqlPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("mysql")));
    let t = scratch_table("arch");
    let tt = t.clone();
    let gen = move |status: &str, updated: &str, n: i64| {
        let updated = if updated == "NULL" {
            "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)".to_owned()
        } else {
            format!("{updated} + seq")
        };
        format!(
            "INSERT INTO {tt} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'arch', CONCAT({status}, '-', UUID_SHORT(), '-', seq), 'Old', '{{}}', {status}, 1000000000000 + seq, {updated} \
             FROM seq_1_to_{n}"
        )
    };
    archive_scenario(Db::My(pool), &url, &t, gen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_archive_moves_old_rows_and_survives_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    let url = format!("sqlite://{}", path.display());
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .connect_with(
            url.parse::<sqlx::sqlite::SqliteConnectOptions>()
                .unwrap()
                .create_if_missing(true)
                .busy_timeout(Duration::from_secs(10)),
        )
        .await
        .unwrap();
    let t = "room_outbox".to_owned();
    let gen = |status: &str, updated: &str, n: i64| {
        let updated = if updated == "NULL" {
            "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)".to_owned()
        } else {
            format!("{updated} + g")
        };
        format!(
            "WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < {n}) \
             INSERT INTO room_outbox (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'arch', {status} || '-' || hex(randomblob(4)) || '-' || g, 'Old', '{{}}', {status}, 1000000000000 + g, {updated} FROM s"
        )
    };
    archive_scenario(Db::Lite(pool), &url, &t, gen).await;
}

/// `postbox relay` with `[archive] enabled = true` archives what it
/// delivered on its interval, and stops archiving with the relay on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_archives_on_its_interval() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let config = dir.path().join("postbox.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{d}/outbox.db\"\ntable = \"room_outbox\"\napp_codes = [\"room\"]\n\
             [outbox_worker]\npoll_interval = \"50ms\"\n\
             [[publishers]]\nkind = \"file\"\npath = \"{d}/out.jsonl\"\n\
             [archive]\nenabled = true\nolder_than = \"1ms\"\ninterval = \"200ms\"\n"
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let out = postbox(dir.path(), &["--config", config, "migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    for i in 0..5 {
        let payload = format!("{{\"n\":{i}}}");
        let out = postbox(
            dir.path(),
            &[
                "--config",
                config,
                "enqueue",
                "--app-code",
                "room",
                "--event-type",
                "T",
                "--payload",
                &payload,
            ],
        );
        assert!(out.status.success(), "{}", text(&out));
    }
    let mut relay = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir.path())
        .args(["--config", config, "relay"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("sqlite://{d}/outbox.db");
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let db = Db::Lite(pool);
    let deadline = Instant::now() + Duration::from_secs(20);
    while db.count("SELECT COUNT(*) FROM room_outbox_archive").await < 5 {
        assert!(Instant::now() < deadline, "the relay never archived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 0);
    let pid = relay.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let status = relay.wait().unwrap();
    assert!(status.success(), "relay exit after SIGTERM: {status:?}");
}

/// Issue 10.3: `postbox enqueue` refuses an event id that is already
/// delivered and archived (it would be delivered again), skips and counts
/// such lines of `--file`, and writes them with `--allow-archived`; the
/// archiver then moves past the live duplicate instead of stalling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_refuses_archived_event_ids_and_the_archiver_moves_past_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    let url = format!("sqlite://{}", path.display());
    let config = dir.path().join("postbox.toml");
    std::fs::write(
        &config,
        format!("[database]\nurl = \"{url}\"\ntable = \"room_outbox\"\napp_codes = [\"arch\"]\n"),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let run = |args: &[&str]| {
        let mut all = vec!["--config", config];
        all.extend_from_slice(args);
        postbox(dir.path(), &all)
    };
    let out = run(&["migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let db = Db::Lite(pool);
    let deliver_old = "UPDATE room_outbox SET status = 'delivered', updated_at_ms = 1";

    let enqueue = [
        "enqueue",
        "--event-type",
        "T",
        "--payload",
        "{}",
        "--event-id",
    ];
    for id in ["dup-1", "dup-2"] {
        let out = run(&[&enqueue[..], &[id]].concat());
        assert!(out.status.success(), "{}", text(&out));
    }
    db.exec(deliver_old).await;
    let out = run(&["archive", "--older-than", "1s"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        db.count("SELECT COUNT(*) FROM room_outbox_archive").await,
        2
    );

    // One event: refused, naming the way out.
    let out = run(&[&enqueue[..], &["dup-1"]].concat());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("already delivered and archived"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("--allow-archived"), "{}", text(&out));
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 0);

    // A file: archived lines are skipped and counted, the rest written.
    let file = dir.path().join("events.jsonl");
    std::fs::write(
        &file,
        "{\"event_id\":\"dup-2\",\"event_type\":\"T\",\"payload\":{}}\n\
         {\"event_id\":\"new-1\",\"event_type\":\"T\",\"payload\":{}}\n",
    )
    .unwrap();
    let out = run(&["--json", "enqueue", "--file", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["inserted"], 1, "{summary}");
    assert_eq!(summary["archived"], 1, "{summary}");

    // Forced: written again, and delivered again.
    let out = run(&[&enqueue[..], &["dup-1", "--allow-archived"]].concat());
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 2);

    // The archiver keeps the archived copy, deletes the live duplicate
    // (sorted first, filling a batch of 1) and still archives new-1.
    db.exec(deliver_old).await;
    let out = run(&["archive", "--older-than", "1s", "--batch-size", "1"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 0);
    assert_eq!(
        db.count("SELECT COUNT(*) FROM room_outbox_archive").await,
        3
    );
}
