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

/// The event ids of app_code `arch` that `sql` selects.
async fn event_ids(db: &Db, sql: &str) -> std::collections::HashSet<String> {
    let ids: Vec<String> = match db {
        Db::Pg(p) => sqlx::query_scalar(sql).fetch_all(p).await,
        Db::My(p) => sqlx::query_scalar(sql).fetch_all(p).await,
        Db::Lite(p) => sqlx::query_scalar(sql).fetch_all(p).await,
    }
    .unwrap_or_else(|e| panic!("{sql}: {e}"));
    ids.into_iter().collect()
}

/// Where every event is: the outbox table and the archive beside it (on
/// `hot`), the archive in the other database (`far`).
struct Places {
    live: std::collections::HashSet<String>,
    beside: std::collections::HashSet<String>,
    far: std::collections::HashSet<String>,
}

impl Places {
    async fn read(hot: &Db, far: &Db, t: &str) -> Places {
        Places {
            live: event_ids(hot, &format!("SELECT event_id FROM {t}")).await,
            beside: event_ids(hot, &format!("SELECT event_id FROM {t}_archive")).await,
            far: event_ids(far, &format!("SELECT event_id FROM {t}_archive")).await,
        }
    }

    /// No event is lost: `total` distinct events, wherever they are.
    fn assert_none_lost(&self, total: usize) {
        let all: std::collections::HashSet<&String> = self
            .live
            .iter()
            .chain(&self.beside)
            .chain(&self.far)
            .collect();
        assert_eq!(all.len(), total, "events lost");
    }

    /// Every event in exactly one place.
    fn assert_each_once(&self, total: usize) {
        self.assert_none_lost(total);
        assert_eq!(
            self.live.len() + self.beside.len() + self.far.len(),
            total,
            "events in two places"
        );
    }
}

/// Issue 16.5: `[archive] url` keeps `<table>_archive` in another database
/// (here the outbox is PostgreSQL's and the archive MariaDB's). `migrate`
/// creates it there and `doctor` checks it; `archive` moves what was
/// archived beside the table before, then the old delivered rows, and a
/// run killed at any point (or one that crashed after copying, planted
/// here) loses and duplicates nothing; `events show` and time-range
/// replays, plain and paced, read it, bringing rows back; an archive that
/// holds another event under a row's id stops the run, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_archive_in_another_database_survives_kills_and_replays_from_there() {
    let (pg_url, pg) = server_pool::<sqlx::Postgres>("postgres").await;
    let (my_url, my) = server_pool::<sqlx::MySql>("mysql").await;
    let (hot, far) = (Db::Pg(pg), Db::My(my));
    let t = scratch_table("farc");
    let project = Project::migrated(|dir| {
        format!(
            "[database]\nurl = \"{pg_url}\"\ntable = \"{t}\"\napp_codes = [\"arch\"]\n\
             [outbox_worker]\npoll_interval = \"50ms\"\n\
             [archive]\nurl = \"{my_url}\"\n\
             [[publishers]]\nkind = \"file\"\npath = \"{}/out.jsonl\"\n",
            dir.display()
        )
    });
    let run = |args: &[&str]| project.run(args);
    let count_far = format!("SELECT COUNT(*) FROM {t}_archive");
    let far_count = || far.count(&count_far);
    assert_eq!(
        far_count().await,
        0,
        "migrate created the archive in MariaDB"
    );
    let out = run(&["--json", "doctor"]);
    let check = common::expect_in(&json(&out)["checks"], "name", "archive:database");
    assert_eq!(check["level"], "ok", "{check}");
    assert!(
        check["message"]
            .as_str()
            .unwrap()
            .contains("mysql database"),
        "{check}"
    );

    let sql = RowsSql {
        insert: format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             SELECT 'arch', {{status}} || '-' || g, 'Old', '{{}}', {{status}}, 1000000000000 + g, {{updated}} \
             FROM generate_series(1, {{n}}) g"
        ),
        seq: "g",
        now_ms: "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
    };
    let load = Load {
        old_delivered: 20_000,
        old_published: 100,
        fresh: 1_000,
        pending: 500,
    };
    hot.exec(&sql.rows("'delivered'", true, load.old_delivered))
        .await;
    hot.exec(&sql.rows("'published'", true, load.old_published))
        .await;
    // Fresh rows get their own event ids (the old rows' ids are `status-g`).
    hot.exec(
        &sql.rows("'delivered'", false, load.fresh)
            .replace("'delivered' || '-'", "'fresh-'"),
    )
    .await;
    hot.exec(&sql.rows("'pending'", true, load.pending)).await;
    // Rows archived beside the table before `[archive] url` was set.
    let beside = 300;
    hot.exec(&format!(
        "INSERT INTO {t}_archive (id, app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
         SELECT 10000000 + g, 'arch', 'beside-' || g, 'Old', '{{}}', 'delivered', 1000000000000 + g, 1000000000000 + g \
         FROM generate_series(1, {beside}) g"
    ))
    .await;
    // A run that crashed after copying 50 rows into the archive, before
    // deleting them from the outbox.
    let Db::Pg(pg) = &hot else { unreachable!() };
    let copied: Vec<(i64, String, i64, i64)> = sqlx::query_as(&format!(
        "SELECT id, event_id, created_at_ms, updated_at_ms FROM {t} \
         WHERE status = 'delivered' ORDER BY updated_at_ms, id LIMIT 50"
    ))
    .fetch_all(pg)
    .await
    .unwrap();
    for (id, event_id, created, updated) in &copied {
        far.exec(&format!(
            "INSERT INTO {t}_archive (id, app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
             VALUES ({id}, 'arch', '{event_id}', 'Old', '{{}}', 'delivered', {created}, {updated})"
        ))
        .await;
    }
    let total = (load.total() + beside) as usize;
    Places::read(&hot, &far, &t).await.assert_none_lost(total);

    // Runs SIGKILLed mid-way, each further along.
    for reached in [1_000, 8_000] {
        let mut child = project.spawn(&["archive", "--batch-size", "500"], Stdio::null());
        let deadline = Instant::now() + Duration::from_secs(60);
        while far_count().await < reached {
            assert!(
                Instant::now() < deadline,
                "the archive never reached {reached} rows"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        child.kill().unwrap();
        child.wait().unwrap();
        Places::read(&hot, &far, &t).await.assert_none_lost(total);
    }
    assert!(
        far_count().await < load.old() + beside,
        "the kills landed mid-way"
    );

    // Run again: finishes the job; every event in exactly one place.
    let out = run(&["--json", "archive", "--older-than", "30d"]);
    assert_ok(&out);
    assert_eq!(json(&out)["complete"], true);
    let places = Places::read(&hot, &far, &t).await;
    places.assert_each_once(total);
    assert_eq!(
        places.beside.len(),
        0,
        "what was archived beside the table moved"
    );
    assert_eq!(places.far.len() as i64, load.old() + beside);
    assert_eq!(places.live.len() as i64, load.fresh + load.pending);
    assert!(places.far.contains("beside-7") && places.far.contains(&copied[0].1));
    println!(
        "archive elsewhere: {total} events, 2 runs killed, 0 lost, 0 in two places; {} in the archive database, {} live",
        places.far.len(),
        places.live.len()
    );
    assert_eq!(
        far.count(&format!(
            "SELECT COUNT(*) FROM {t}_archive WHERE event_id = 'published-3' AND status = 'delivered' \
             AND payload = '{{}}' AND created_at_ms = 1000000000003 AND updated_at_ms = 1000000000003"
        ))
        .await,
        1,
        "rows are copied as they were (a legacy status as the status it reads as)"
    );

    // Reads find archived events there.
    let out = run(&["events", "show", "delivered-7"]);
    assert_ok(&out);
    assert_says(&out, &["delivered-7", "archived"]);

    // A time range replays archived rows: brought back as pending, gone
    // from the archive. Created in [101, 201): 100 old delivered rows and
    // 100 archived beside the table before, archived; 100 fresh and 100
    // pending rows, live.
    let range = [
        "--app-code",
        "arch",
        "--since",
        "1000000000101",
        "--until",
        "1000000000201",
    ];
    let out = run(&[&["--json", "replay", "--dry-run"][..], &range].concat());
    assert_ok(&out);
    assert_eq!(json(&out)["count"], 400, "dry run");
    assert_eq!(
        far_count().await,
        load.old() + beside,
        "a dry run changes nothing"
    );
    let out = run(&[&["--json", "replay"][..], &range].concat());
    assert_ok(&out);
    assert_eq!(json(&out)["count"], 400);
    let places = Places::read(&hot, &far, &t).await;
    places.assert_each_once(total);
    assert!(places.live.contains("delivered-150") && places.live.contains("beside-150"));
    assert_eq!(
        hot.count(&format!(
            "SELECT COUNT(*) FROM {t} WHERE status = 'pending' AND replay_count = 1 \
             AND created_at_ms >= 1000000000101 AND created_at_ms < 1000000000201"
        ))
        .await,
        400
    );

    // A paced replay of the next range (60 rows of each kind), beside a
    // relay taking its batches.
    let mut relay = project.spawn(&["relay"], Stdio::null());
    let out = run(&[
        "--json",
        "replay",
        "--app-code",
        "arch",
        "--since",
        "1000000000201",
        "--until",
        "1000000000261",
        "--rate",
        "1000",
        "--batch",
        "25",
    ]);
    assert_ok(&out);
    assert_eq!(json(&out)["replayed"], 240, "{}", text(&out));
    // The pending rows, and the replayed fresh and archived rows.
    let delivered = (load.pending + 300 + 180) as usize;
    let undelivered = format!("SELECT COUNT(*) FROM {t} WHERE status <> 'delivered'");
    let deadline = Instant::now() + Duration::from_secs(60);
    while project.lines("out.jsonl") < delivered || hot.count(&undelivered).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the relay delivered {} of {delivered}",
            project.lines("out.jsonl")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    signal("TERM", relay.id());
    assert!(relay.wait().unwrap().success());
    let places = Places::read(&hot, &far, &t).await;
    places.assert_each_once(total);
    assert!(places.live.contains("beside-230") && !places.far.contains("beside-230"));

    // Archived again, everything delivered: all of it is there.
    assert_ok(&run(&["archive", "--older-than", "1ms"]));
    let places = Places::read(&hot, &far, &t).await;
    places.assert_each_once(total);
    assert_eq!(places.far.len(), total);
    assert_eq!(
        far.count(&format!(
            "SELECT COUNT(*) FROM {t}_archive WHERE replay_count >= 1"
        ))
        .await,
        640,
        "replayed rows come back with their replay counted"
    );

    // The archive holds another event under a live row's id: the run stops
    // naming it, and the row stays.
    hot.exec(&format!(
        "INSERT INTO {t} (id, app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
         VALUES (20000000, 'arch', 'late', 'Old', '{{}}', 'delivered', 1, 1)"
    ))
    .await;
    far.exec(&format!(
        "INSERT INTO {t}_archive (id, app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
         VALUES (20000000, 'other', 'intruder', 'Old', '{{}}', 'delivered', 1, 1)"
    ))
    .await;
    let out = run(&["archive", "--older-than", "1ms"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_says(&out, &["holds other events under the ids", "20000000"]);
    assert_eq!(
        hot.count(&format!("SELECT COUNT(*) FROM {t} WHERE event_id = 'late'"))
            .await,
        1
    );

    hot.drop_tables(&t).await;
    far.drop_tables(&t).await;
}

/// `[archive] url` is connected on first use: a relay starts and delivers
/// while the archive's database is down, and `archive` then fails naming
/// `archive.url`. A bad `archive.url` exits 2 naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_delivers_while_the_archive_database_is_down() {
    let body = |dir: &std::path::Path| {
        let d = dir.display();
        format!(
            "[database]\nurl = \"sqlite://{d}/outbox.db\"\ntable = \"room_outbox\"\napp_codes = [\"room\"]\n\
             [outbox_worker]\npoll_interval = \"50ms\"\n\
             [[publishers]]\nkind = \"file\"\npath = \"{d}/out.jsonl\"\n"
        )
    };
    let project = Project::migrated(body);
    for i in 0..3 {
        project.enqueue("room", &format!("{{\"n\":{i}}}"));
    }
    let dir = project.path();
    // Nothing listens on port 9 of loopback.
    let down = common::write_config(
        dir,
        &format!(
            "{}[archive]\nurl = \"postgres://postbox:s3cret@127.0.0.1:9/archive\"\n",
            body(dir)
        ),
    );
    let mut relay = std::process::Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir)
        .args(["--config", &down, "relay"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while project.lines("out.jsonl") < 3 {
        assert!(
            Instant::now() < deadline,
            "the relay waited for the archive's database"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    signal("TERM", relay.id());
    assert!(relay.wait().unwrap().success());
    let db = Db::Lite(sqlite_pool(&format!("sqlite://{}/outbox.db", dir.display())).await);
    db.exec("UPDATE room_outbox SET updated_at_ms = 1").await;
    let out = common::run(dir, &["--config", &down, "archive"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_says(&out, &["archive.url"]);
    assert!(!text(&out).contains("s3cret"), "{}", text(&out));
    assert_eq!(
        db.count("SELECT COUNT(*) FROM room_outbox").await,
        3,
        "nothing moved"
    );

    for (line, says) in [
        ("url = \"oracle://h/db\"", "`oracle`"),
        (
            &*format!("url = \"sqlite://{}/outbox.db\"", dir.display()),
            "is database.url",
        ),
        ("url = \"${POSTBOX_NO_SUCH_VAR}\"", "POSTBOX_NO_SUCH_VAR"),
    ] {
        let cfg = common::write_config(dir, &format!("{}[archive]\n{line}\n", body(dir)));
        let out = common::run(dir, &["--config", &cfg, "status"], &[]);
        assert_eq!(out.status.code(), Some(2), "{line}: {}", text(&out));
        assert_says(&out, &["archive.url", says]);
    }
}

/// Issue 16.4 as a user runs it: `partitioning = "daily"` on PostgreSQL,
/// the archive kept in SQLite; `migrate` creates the partitioned table
/// with 14 days ahead, `doctor` passes (its claim and replay plans read the
/// partitions' indexes) and shows the partitions, the relay creates
/// missing ones and delivers, and `archive` moves an old partition whole
/// into the other database. MariaDB refuses the key, naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_postgres_outbox_is_created_checked_relayed_and_archived_by_partition() {
    let (url, pool) = server_pool::<sqlx::Postgres>("postgres").await;
    let db = Db::Pg(pool);
    let t = scratch_table("cpart");
    let admin = format!("127.0.0.1:{}", postbox_testkit::clusters::free_port());
    let project = Project::migrated(|dir| {
        format!(
            "[database]\nurl = \"{url}\"\ntable = \"{t}\"\napp_codes = [\"room\"]\npartitioning = \"daily\"\n\
             [outbox_worker]\npoll_interval = \"50ms\"\n\
             [archive]\nurl = \"sqlite://{d}/archive.db\"\n\
             [admin]\nlisten = \"{admin}\"\n\
             [[publishers]]\nkind = \"file\"\npath = \"{d}/out.jsonl\"\n",
            d = dir.display()
        )
    });
    let run = |args: &[&str]| project.run(args);
    assert_eq!(
        db.count(&format!(
            "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = to_regclass('{t}')"
        ))
        .await,
        15,
        "today and 14 days ahead"
    );
    let out = run(&["--json", "doctor"]);
    assert_ok(&out);
    let ahead = common::expect_in(&json(&out)["checks"], "name", "partitions:ahead");
    assert_eq!(ahead["level"], "ok", "{ahead}");
    assert!(
        ahead["message"].as_str().unwrap().starts_with("14 ready"),
        "{ahead}"
    );

    for i in 0..20 {
        project.enqueue("room", &format!("{{\"n\":{i}}}"));
    }
    // The three furthest ahead are gone: a relay creates them again.
    let partitions =
        format!("SELECT COUNT(*) FROM pg_inherits WHERE inhparent = to_regclass('{t}')");
    let Db::Pg(pg) = &db else { unreachable!() };
    let furthest: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT c.relname::TEXT FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass('{t}') ORDER BY c.relname DESC LIMIT 3"
    ))
    .fetch_all(pg)
    .await
    .unwrap();
    for name in &furthest {
        db.exec(&format!("DROP TABLE {name}")).await;
    }
    assert_eq!(db.count(&partitions).await, 12);
    let mut relay = project.spawn(&["relay"], Stdio::null());
    let deadline = Instant::now() + Duration::from_secs(30);
    while project.lines("out.jsonl") < 20 || db.count(&partitions).await < 15 {
        assert!(
            Instant::now() < deadline,
            "the relay delivered {}",
            project.lines("out.jsonl")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "partitioned: 20 events delivered, {} partitions (3 created again by the relay)",
        db.count(&partitions).await
    );
    // The relay exports how many are ready ahead (the alert rule's gauge),
    // once it has counted them after creating them.
    let ahead = postbox_testkit::consumer_fixtures::eventually(
        "postbox_partitions_ahead on /metrics",
        Duration::from_secs(10),
        async || {
            let metrics =
                postbox_testkit::http::request(admin.parse().unwrap(), "GET", "/metrics", &[])
                    .await;
            let samples = postbox_testkit::http::parse_prometheus(&metrics.body)?;
            postbox_testkit::http::sample_value(
                &samples,
                "postbox_partitions_ahead",
                &[("table", &t)],
            )
            .ok_or(metrics.body)
        },
    )
    .await;
    assert_eq!(ahead, 14.0);
    signal("TERM", relay.id());
    assert!(relay.wait().unwrap().success());

    // A config that leaves the key out (the migrate job's had it): the
    // relay refuses to start, and `doctor` says why. It started, and kept
    // no partition ahead: inserts failed once the last was past.
    let unset = project.path().join("unset.toml");
    std::fs::write(
        &unset,
        std::fs::read_to_string(&project.cfg)
            .unwrap()
            .replace("partitioning = \"daily\"\n", ""),
    )
    .unwrap();
    let unset = unset.to_str().unwrap();
    let out = common::postbox(project.path(), &["--config", unset, "relay"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert_says(&out, &["database.partitioning", "partitioned daily"]);
    let out = common::postbox(project.path(), &["--config", unset, "--json", "doctor"]);
    let config = common::expect_in(&json(&out)["checks"], "name", "partitions:config");
    assert_eq!(config["level"], "fail", "{config}");

    // An old day's partition, all delivered: archived whole.
    let day = 86_400_000i64;
    let now: i64 = db
        .count("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT")
        .await;
    let from = (now - 3 * day).div_euclid(day) * day;
    db.exec(&format!(
        "CREATE TABLE {t}_old PARTITION OF {t} FOR VALUES FROM ({from}) TO ({})",
        from + day
    ))
    .await;
    db.exec(&format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
         SELECT 'room', 'old-' || g, 'T', '{{}}', 'delivered', {from} + g, 1 FROM generate_series(1, 300) g"
    ))
    .await;
    let out = run(&["--json", "archive", "--older-than", "1d"]);
    assert_ok(&out);
    assert_eq!(json(&out)["moved"], 300, "{}", text(&out));
    assert_eq!(
        db.count(&format!(
            "SELECT COUNT(*) FROM pg_class WHERE relname = '{t}_old'"
        ))
        .await,
        0
    );
    // Copied into the archive kept in SQLite, checked there, then dropped.
    let far = format!("sqlite://{}/archive.db", project.path().display());
    let far = Db::Lite(sqlite_pool(&far).await);
    assert_eq!(
        far.count(&format!("SELECT COUNT(*) FROM {t}_archive"))
            .await,
        300
    );
    assert_eq!(
        db.count(&format!("SELECT COUNT(*) FROM {t}_archive")).await,
        0
    );
    assert_eq!(db.count(&format!("SELECT COUNT(*) FROM {t}")).await, 20);
    assert_eq!(
        db.count(&format!("SELECT COUNT(*) FROM {t}_keys")).await,
        20
    );
    db.drop_tables(&t).await;
    db.exec(&format!("DROP TABLE IF EXISTS {t}_keys")).await;

    let dir = tempfile::tempdir().unwrap();
    let (my_url, _) = server_pool::<sqlx::MySql>("mysql").await;
    let cfg = common::write_config(
        dir.path(),
        &format!("[database]\nurl = \"{my_url}\"\npartitioning = \"weekly\"\n"),
    );
    let out = common::run(dir.path(), &["--config", &cfg, "status"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert_says(&out, &["database.partitioning", "PostgreSQL"]);
}

/// The archive in another database from MariaDB's and SQLite's side
/// (their own batch pick and lock, id lists and replay inserts): `rows`
/// inserts 2,000 old delivered rows of app_code `arch` (events `old-1…`,
/// created at `1000000000000 + n`) into the outbox table.
async fn archive_elsewhere_from(
    hot: Db,
    hot_url: &str,
    far: Db,
    far_url: &str,
    t: &str,
    rows: &str,
) {
    let project = Project::migrated(|_| {
        format!(
            "[database]\nurl = \"{hot_url}\"\ntable = \"{t}\"\napp_codes = [\"arch\"]\n\
             [archive]\nurl = \"{far_url}\"\n"
        )
    });
    let run = |args: &[&str]| project.run(args);
    hot.exec(rows).await;
    let out = run(&["--json", "archive", "--batch-size", "300"]);
    assert_ok(&out);
    assert_eq!(json(&out)["moved"], 2000, "{}", text(&out));
    assert_eq!(
        far.count(&format!("SELECT COUNT(*) FROM {t}_archive"))
            .await,
        2000
    );
    assert_eq!(hot.count(&format!("SELECT COUNT(*) FROM {t}")).await, 0);
    assert_eq!(
        hot.count(&format!("SELECT COUNT(*) FROM {t}_archive"))
            .await,
        0
    );
    assert_says(&run(&["events", "show", "old-17"]), &["old-17", "archived"]);
    let out = run(&[
        "--json",
        "replay",
        "--app-code",
        "arch",
        "--since",
        "1000000000101",
        "--until",
        "1000000000201",
    ]);
    assert_ok(&out);
    assert_eq!(json(&out)["count"], 100, "{}", text(&out));
    assert_eq!(
        hot.count(&format!(
            "SELECT COUNT(*) FROM {t} WHERE status = 'pending' AND replay_count = 1"
        ))
        .await,
        100
    );
    assert_eq!(
        far.count(&format!("SELECT COUNT(*) FROM {t}_archive"))
            .await,
        1900
    );
    hot.drop_tables(t).await;
    far.drop_tables(t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_outbox_archives_into_postgres() {
    let (my_url, my) = server_pool::<sqlx::MySql>("mysql").await;
    let (pg_url, pg) = server_pool::<sqlx::Postgres>("postgres").await;
    let t = scratch_table("myfar");
    let rows = format!(
        "INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
         SELECT 'arch', CONCAT('old-', seq), 'Old', '{{}}', 'delivered', 1000000000000 + seq, 1 FROM seq_1_to_2000"
    );
    archive_elsewhere_from(Db::My(my), &my_url, Db::Pg(pg), &pg_url, &t, &rows).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_outbox_archives_into_mariadb() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let (my_url, my) = server_pool::<sqlx::MySql>("mysql").await;
    let t = scratch_table("litefar");
    let rows = format!(
        "WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < 2000) \
         INSERT INTO {t} (app_code, event_id, event_type, payload, status, created_at_ms, updated_at_ms) \
         SELECT 'arch', 'old-' || g, 'Old', '{{}}', 'delivered', 1000000000000 + g, 1 FROM s"
    );
    let hot = Db::Lite(sqlite_pool(&url).await);
    archive_elsewhere_from(hot, &url, Db::My(my), &my_url, &t, &rows).await;
}
