//! `postbox archive` as a user runs it, on PostgreSQL, MariaDB and SQLite:
//! exactly the old delivered rows move; a run killed mid-way and run again
//! leaves every row in exactly one of the two tables; a second archiver
//! finds the lock taken.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{
    assert_ok, assert_says, json, server_pool, signal, sqlite_pool, text, Db, Project, ENQUEUE_T,
};
use postbox_testkit::scratch_table;

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

/// How a backend writes `n` rows in one statement: `insert` (with
/// `{status}`, `{updated}` and `{n}` to fill in) numbers its rows in the
/// column `seq`; `now_ms` is the clock in epoch milliseconds.
struct RowsSql {
    insert: String,
    seq: &'static str,
    now_ms: &'static str,
}

impl RowsSql {
    /// `n` rows of `status`, updated in 2001 (`old`) or now.
    fn rows(&self, status: &str, old: bool, n: i64) -> String {
        let updated = if old {
            format!("1000000000000 + {}", self.seq)
        } else {
            self.now_ms.to_owned()
        };
        self.insert
            .replace("{status}", status)
            .replace("{updated}", &updated)
            .replace("{n}", &n.to_string())
    }
}

async fn archive_scenario(db: Db, url: &str, t: &str, sql: RowsSql) {
    let project = Project::migrated(|_| {
        format!("[database]\nurl = \"{url}\"\ntable = \"{t}\"\napp_codes = [\"arch\"]\n")
    });
    let run = |args: &[&str]| project.run(args);

    let load = Load {
        old_delivered: match db {
            Db::Lite(_) => 20_000,
            _ => 200_000,
        },
        old_published: 100,
        fresh: 1_000,
        pending: 500,
    };
    // Old rows: updated in 2001. Fresh ones: updated now.
    db.exec(&sql.rows("'delivered'", true, load.old_delivered))
        .await;
    db.exec(&sql.rows("'published'", true, load.old_published))
        .await;
    db.exec(&sql.rows("'delivered'", false, load.fresh)).await;
    db.exec(&sql.rows("'pending'", true, load.pending)).await;

    // While another archiver holds the lock, a run does nothing and says so.
    let locked_out = || {
        let out = run(&["archive"]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert_says(&out, &["another archiver holds the lock"]);
    };
    // Takes the archive lock with `$lock` on a connection of `$pool`, runs
    // `locked_out`, and gives the lock back with `$unlock`.
    macro_rules! while_locked {
        ($pool:expr, $lock:literal, $unlock:literal) => {{
            let mut c = $pool.acquire().await.unwrap();
            let name = format!("postbox_archive:{t}");
            sqlx::query($lock)
                .bind(&name)
                .execute(&mut *c)
                .await
                .unwrap();
            locked_out();
            sqlx::query($unlock)
                .bind(&name)
                .execute(&mut *c)
                .await
                .unwrap();
        }};
    }
    match &db {
        Db::Pg(p) => while_locked!(
            p,
            "SELECT pg_advisory_lock(hashtext($1))",
            "SELECT pg_advisory_unlock(hashtext($1))"
        ),
        Db::My(p) => while_locked!(
            p,
            "SELECT GET_LOCK(LEFT(?, 64), 5)",
            "SELECT RELEASE_LOCK(LEFT(?, 64))"
        ),
        // SQLite: each batch holds the database's write lock instead.
        Db::Lite(_) => {}
    }
    assert_eq!(
        db.count(&format!("SELECT COUNT(*) FROM {t}_archive")).await,
        0
    );

    // A run SIGKILLed mid-way, with small batches so that it is mid-way.
    let mut child = project.spawn(&["archive", "--batch-size", "500"], Stdio::null());
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
    let out = run(&["--json", "archive", "--older-than", "30d"]);
    assert_ok(&out);
    let summary = json(&out);
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
    let out = run(&["--json", "archive"]);
    assert_ok(&out);
    assert_eq!(json(&out)["moved"], 0);

    db.drop_tables(t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_archive_moves_old_rows_and_survives_a_kill() {
    let (url, pool) = server_pool::<sqlx::Postgres>("postgres").await;
    let t = scratch_table("arch");
    let sql = RowsSql {
        insert: format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'arch', {{status}} || '-' || substr(md5(random()::text), 1, 8) || '-' || g, 'Old', '{{}}', {{status}}, 1000000000000 + g, {{updated}} \
             FROM generate_series(1, {{n}}) g"
        ),
        seq: "g",
        now_ms: "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
    };
    archive_scenario(Db::Pg(pool), &url, &t, sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_archive_moves_old_rows_and_survives_a_kill() {
    let (url, pool) = server_pool::<sqlx::MySql>("mysql").await;
    let t = scratch_table("arch");
    let sql = RowsSql {
        insert: format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'arch', CONCAT({{status}}, '-', UUID_SHORT(), '-', seq), 'Old', '{{}}', {{status}}, 1000000000000 + seq, {{updated}} \
             FROM seq_1_to_{{n}}"
        ),
        seq: "seq",
        now_ms: "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
    };
    archive_scenario(Db::My(pool), &url, &t, sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_archive_moves_old_rows_and_survives_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let sql = RowsSql {
        insert: "WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < {n}) \
             INSERT INTO room_outbox (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'arch', {status} || '-' || hex(randomblob(4)) || '-' || g, 'Old', '{}', {status}, 1000000000000 + g, {updated} FROM s"
            .to_owned(),
        seq: "g",
        now_ms: "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)",
    };
    archive_scenario(Db::Lite(sqlite_pool(&url).await), &url, "room_outbox", sql).await;
}

/// `postbox relay` with `[archive] enabled = true` archives what it
/// delivered on its interval, and stops archiving with the relay on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_archives_on_its_interval() {
    let project = Project::migrated(|dir| {
        let d = dir.display();
        format!(
            "[database]\nurl = \"sqlite://{d}/outbox.db\"\ntable = \"room_outbox\"\napp_codes = [\"room\"]\n\
             [outbox_worker]\npoll_interval = \"50ms\"\n\
             [[publishers]]\nkind = \"file\"\npath = \"{d}/out.jsonl\"\n\
             [archive]\nenabled = true\nolder_than = \"1ms\"\ninterval = \"200ms\"\n"
        )
    });
    for i in 0..5 {
        project.enqueue("room", &format!("{{\"n\":{i}}}"));
    }
    let mut relay = project.spawn(&["relay"], Stdio::null());
    let url = format!("sqlite://{}/outbox.db", project.path().display());
    let db = Db::Lite(sqlx::SqlitePool::connect(&url).await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    while db.count("SELECT COUNT(*) FROM room_outbox_archive").await < 5 {
        assert!(Instant::now() < deadline, "the relay never archived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 0);
    signal("TERM", relay.id());
    let status = relay.wait().unwrap();
    assert!(status.success(), "relay exit after SIGTERM: {status:?}");
}

/// Issue 10.3: `postbox enqueue` refuses an event id that is already
/// delivered and archived (it would be delivered again), skips and counts
/// such lines of `--file`, and writes them with `--allow-archived`; the
/// archiver then moves past the live duplicate instead of stalling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_refuses_archived_event_ids_and_the_archiver_moves_past_duplicates() {
    let mut url = String::new();
    let project = Project::migrated(|dir| {
        url = format!("sqlite://{}", dir.join("outbox.db").display());
        format!("[database]\nurl = \"{url}\"\ntable = \"room_outbox\"\napp_codes = [\"arch\"]\n")
    });
    let run = |args: &[&str]| project.run(args);
    let db = Db::Lite(sqlx::SqlitePool::connect(&url).await.unwrap());
    let deliver_old = "UPDATE room_outbox SET status = 'delivered', updated_at_ms = 1";
    let enqueue = |more: &[&str]| run(&[&ENQUEUE_T[..], &["--event-id"], more].concat());

    for id in ["dup-1", "dup-2"] {
        assert_ok(&enqueue(&[id]));
    }
    db.exec(deliver_old).await;
    assert_ok(&run(&["archive", "--older-than", "1s"]));
    assert_eq!(
        db.count("SELECT COUNT(*) FROM room_outbox_archive").await,
        2
    );

    // One event: refused, naming the way out.
    let out = enqueue(&["dup-1"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_says(&out, &["already delivered and archived"]);
    assert_says(&out, &["--allow-archived"]);
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 0);

    // A file: archived lines are skipped and counted, the rest written.
    let file = project.path().join("events.jsonl");
    std::fs::write(
        &file,
        "{\"event_id\":\"dup-2\",\"event_type\":\"T\",\"payload\":{}}\n\
         {\"event_id\":\"new-1\",\"event_type\":\"T\",\"payload\":{}}\n",
    )
    .unwrap();
    let out = run(&["--json", "enqueue", "--file", file.to_str().unwrap()]);
    assert_ok(&out);
    let summary = json(&out);
    assert_eq!(summary["inserted"], 1, "{summary}");
    assert_eq!(summary["archived"], 1, "{summary}");

    // Forced: written again, and delivered again.
    assert_ok(&enqueue(&["dup-1", "--allow-archived"]));
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 2);

    // The archiver keeps the archived copy, deletes the live duplicate
    // (sorted first, filling a batch of 1) and still archives new-1.
    db.exec(deliver_old).await;
    assert_ok(&run(&[
        "archive",
        "--older-than",
        "1s",
        "--batch-size",
        "1",
    ]));
    assert_eq!(db.count("SELECT COUNT(*) FROM room_outbox").await, 0);
    assert_eq!(
        db.count("SELECT COUNT(*) FROM room_outbox_archive").await,
        3
    );
}
