//! `postbox doctor` on PostgreSQL, MariaDB and SQLite: it passes on a fresh
//! migration (tiny tables, where planners would scan anyway), and fails
//! naming the index and the query once an index is dropped.

use crate::common;

use common::{
    assert_ok, assert_says, expect_in, json, server_pool, sqlite_pool, text, Db, Project,
};
use postbox_testkit::scratch_table;

/// Runs the scenario on the outbox table `t` of `db` (at `url`), and drops
/// the tables of a server database at the end.
async fn doctor_scenario(db: Db, url: &str, t: &str) {
    let project = Project::new(|_| {
        format!("[database]\nurl = \"{url}\"\ntable = \"{t}\"\napp_codes = [\"doc\"]\n")
    });
    let run = |args: &[&str]| project.run(args);

    // Before migrating: fails, naming the schema.
    let out = run(&["doctor"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_says(&out, &["schema_version"]);

    assert_ok(&run(&["migrate"]));
    let out = run(&["--json", "doctor"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let report = json(&out);
    assert_eq!(report["ok"], true);
    for q in [
        "plan:claim_pending",
        "plan:claim_due_retries",
        "plan:claim_expired_leases",
        "plan:archive_delivered",
        "plan:replay_by_event_id",
        "plan:replay_failed",
        "plan:replay_archived_range",
        &format!("index:{t}_{}", lease_index(&db)),
        &format!("index:{t}_history_event_idx"),
    ] {
        let c = expect_in(&report["checks"], "name", q);
        assert_eq!(c["level"], "ok", "{c:#}");
    }
    // postbox's own table has no index postbox does not read (`adopt`'s
    // report, on the databases it adopts on).
    if !matches!(db, Db::Lite(_)) {
        let c = expect_in(&report["checks"], "name", "indexes:unread");
        assert_eq!(c["level"], "ok", "{c:#}");
    }

    // Issue 9.10: a correct schema passes on a small table, analysed or not,
    // whichever postbox index the planner picks for such a table.
    let statuses = ["delivered", "pending", "delivering", "retryable", "failed"];
    for i in 0..100 {
        let status = statuses[if i < 80 { 0 } else { i % 5 }];
        db.exec(&format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, lock_until_ms, next_retry_at_ms, created_at_ms, updated_at_ms) \
             VALUES ('doc', 'e{i}', 'T', '{{}}', '{status}', {i}, {i}, {i}, {i})"
        ))
        .await;
    }
    let analyze = match db {
        Db::Pg(_) => format!("ANALYZE {t}"),
        Db::My(_) => format!("ANALYZE TABLE {t}"),
        Db::Lite(_) => "ANALYZE".to_owned(),
    };
    for round in ["unanalysed", "analysed"] {
        if round == "analysed" {
            db.exec(&analyze).await;
        }
        let out = run(&["doctor"]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "100 rows, {round}: {}",
            text(&out)
        );
    }

    let index = format!("{t}_{}", lease_index(&db));
    db.exec(&match db {
        Db::My(_) => format!("DROP INDEX {index} ON {t}"),
        _ => format!("DROP INDEX {index}"),
    })
    .await;
    let out = run(&["doctor"]);
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(1), "{shown}");
    assert!(
        shown.contains(&format!("index:{index}")),
        "names the missing index: {shown}"
    );
    assert!(
        shown.contains("FAIL  plan:claim_expired_leases"),
        "names the query that lost its index: {shown}"
    );
    // MySQL's claims share one index: all of them lose it.
    let pending = if matches!(db, Db::My(_)) {
        "FAIL"
    } else {
        "ok  "
    };
    assert!(
        shown.contains(&format!("{pending}  plan:claim_pending")),
        "other queries still fine where they have their own index: {shown}"
    );
    // Without the head index the per-aggregate claim fails, and is still
    // named (MySQL cannot even explain it: it forces that index).
    let head = format!("{t}_head_idx");
    db.exec(&match db {
        Db::My(_) => format!("DROP INDEX {head} ON {t}"),
        _ => format!("DROP INDEX {head}"),
    })
    .await;
    let shown = text(&run(&["doctor"]));
    assert!(
        shown.contains(&format!("index:{head}"))
            && shown.contains("FAIL  plan:claim_pending_ordered"),
        "names the per-aggregate claim: {shown}"
    );
    // Issue 11: replays read through their indexes too, and doctor names
    // the replay that lost one. (MySQL's failed rows are read through
    // `_due_idx`, dropped above.)
    let mut dropped = vec![
        (
            format!("{t}_event_uq"),
            t.to_owned(),
            "plan:replay_by_event_id",
        ),
        (
            format!("{t}_archive_created_idx"),
            format!("{t}_archive"),
            "plan:replay_archived_range",
        ),
    ];
    if !matches!(db, Db::My(_)) {
        dropped.push((
            format!("{t}_failed_idx"),
            t.to_owned(),
            "plan:replay_failed",
        ));
    }
    for (index, on, _) in &dropped {
        db.exec(&match db {
            Db::My(_) => format!("DROP INDEX {index} ON {on}"),
            _ => format!("DROP INDEX {index}"),
        })
        .await;
    }
    let shown = text(&run(&["doctor"]));
    for query in dropped.iter().map(|d| d.2).chain(["plan:replay_failed"]) {
        assert!(
            shown.contains(&format!("FAIL  {query}")),
            "names {query}: {shown}"
        );
    }
    if !matches!(db, Db::Lite(_)) {
        db.drop_tables(t).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_doctor_passes_fresh_and_names_a_dropped_index() {
    let (url, pool) = server_pool::<sqlx::Postgres>("postgres").await;
    doctor_scenario(Db::Pg(pool), &url, &scratch_table("doc")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_doctor_passes_fresh_and_names_a_dropped_index() {
    let (url, pool) = server_pool::<sqlx::MySql>("mysql").await;
    doctor_scenario(Db::My(pool), &url, &scratch_table("doc")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_doctor_passes_fresh_and_names_a_dropped_index() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let db = Db::Lite(sqlite_pool(&url).await);
    doctor_scenario(db, &url, "room_outbox").await;
}

/// `doctor --json`'s check `name` for a config of the SQLite database in
/// `dir` (migrated by the first call) followed by `rest`.
fn doctor_check(dir: &std::path::Path, rest: &str, name: &str) -> serde_json::Value {
    let db = dir.join("outbox.db");
    let config = dir.join("postbox.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}\"\napp_codes = [\"doc\"]\n{rest}",
            db.display()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    if !db.exists() {
        assert_ok(&common::postbox(dir, &["--config", config, "migrate"]));
    }
    let out = common::postbox(dir, &["--config", config, "--json", "doctor"]);
    expect_in(&json(&out)["checks"], "name", name)
}

#[test]
fn doctor_warns_when_an_inbox_forgets_before_redeliveries_end() {
    let dir = tempfile::tempdir().unwrap();
    let inbox_db = dir.path().join("inbox.db");
    let inbox = |retention: &str| {
        let rest = format!(
            "[outbox_worker]\nmax_retry_count = 10\nmax_backoff = \"5m\"\n\
             [[consumers]]\nkind = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\n\
             queue = \"doc_q\"\nmax_attempts = 5\nretry_delay = \"1s\"\n\
             inbox = {{ url = \"sqlite://{}\" }}\ninbox_retention = \"{retention}\"\n",
            inbox_db.display()
        );
        doctor_check(dir.path(), &rest, "config:consumers.0.inbox_retention")
    };
    let short = inbox("10m");
    // 10 relay retries × 5m alone is 50m: 10m of memory is too short.
    assert_eq!(short["level"], "warn", "{short:#}");
    assert!(
        short["message"]
            .as_str()
            .unwrap()
            .contains("consumers.0.inbox_retention (10m)"),
        "{short:#}"
    );
    let long = inbox("7d");
    assert_eq!(long["level"], "ok", "{long:#}");
}

/// Issue 10.1: with `ordering = "per_aggregate"`, `doctor` warns about (and
/// `status` lists) an aggregate whose head keeps failing while later events
/// wait behind it; a healthy aggregate is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_and_status_show_an_aggregate_whose_head_cannot_move() {
    let mut url = String::new();
    let project = Project::migrated(|dir| {
        url = format!("sqlite://{}", dir.join("outbox.db").display());
        format!(
            "[database]\nurl = \"{url}\"\ntable = \"room_outbox\"\napp_codes = [\"doc\"]\n\
             [outbox_worker]\nordering = \"per_aggregate\"\n"
        )
    });
    let run = |args: &[&str]| project.run(args);
    let out = run(&["doctor"]);
    assert_says(&out, &["ok    aggregates:held_back"]);

    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    // An hour-old head that keeps failing, one event behind it; a healthy
    // aggregate whose head is pending.
    sqlx::query(
        "INSERT INTO room_outbox (app_code, event_id, event_type, aggregate_id, aggregate_version, payload, status, retry_count, last_error, next_retry_at_ms, created_at_ms) VALUES \
         ('doc', 'head-1', 'T', 'room-7', 1, '{}', 'retryable', 3, 'broker said no', 0, 1000), \
         ('doc', 'next-1', 'T', 'room-7', 2, '{}', 'pending', 0, NULL, 0, 2000), \
         ('doc', 'ok-1', 'T', 'room-8', 1, '{}', 'pending', 0, NULL, 0, 1000), \
         ('doc', 'ok-2', 'T', 'room-8', 2, '{}', 'pending', 0, NULL, 0, 2000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = run(&["doctor"]);
    let shown = text(&out);
    assert!(shown.contains("WARN  aggregates:held_back"), "{shown}");
    assert!(
        shown.contains("room-7") && shown.contains("head-1"),
        "{shown}"
    );
    assert!(shown.contains("broker said no"), "{shown}");
    assert!(!shown.contains("room-8"), "{shown}");
    let out = run(&["status"]);
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("aggregates held back"), "{shown}");
    assert!(
        shown.contains("room-7") && !shown.contains("room-8"),
        "{shown}"
    );
}

/// The index the expired-lease claim reads: one per status where the
/// database has partial indexes, one for every status on MySQL.
fn lease_index(db: &Db) -> &'static str {
    match db {
        Db::My(_) => "due_idx",
        _ => "lease_idx",
    }
}

/// An admin server without a token on an address other hosts reach gives
/// every event's payload to whoever asks: `doctor` warns; with a token, or
/// on loopback only, it does not.
#[test]
fn doctor_warns_of_an_open_admin_server_beyond_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let admin_check =
        |admin: &str| doctor_check(dir.path(), &format!("[admin]\n{admin}"), "config:admin");
    let open = admin_check("listen = \"0.0.0.0:9464\"\n");
    assert_eq!(open["level"], "warn", "{open:#}");
    assert!(
        open["message"].as_str().unwrap().contains("0.0.0.0:9464"),
        "{open:#}"
    );
    let local = admin_check("listen = \"127.0.0.1:9464\"\n");
    assert_eq!(local["level"], "ok", "{local:#}");
    let guarded = admin_check("listen = \"0.0.0.0:9464\"\ntoken = \"s3cret\"\n");
    assert_eq!(guarded["level"], "ok", "{guarded:#}");
    assert!(
        !guarded.to_string().contains("s3cret"),
        "the token is never shown: {guarded:#}"
    );
}

/// Issue 15.2: `doctor --scans` reads the database's own statement
/// statistics. After a relay delivered, replayed and archived (and
/// `status` and `events list` ran), none of postbox's own statements on the
/// table is flagged; a foreign claim with an `OR` across statuses and no
/// app_code is, and a tenant-keyed one is listed but not flagged.
async fn scans_scenario(server: &str, db: Db) {
    use postbox_core::store::{ArchiveRequest, EventFilter, ReplaySelector};
    use postbox_core::NewEvent;
    let (url, store) = common::server_outbox(server, "scan", 2).await;
    let t = store.table().as_str().to_owned();
    match db {
        Db::Pg(_) => {
            db.exec("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                .await
        }
        // The digest table holds `performance_schema_digests_size` (5,000)
        // statements and then records no new one: every test run on a
        // scratch table adds its own, so a server many runs used had no
        // room left for this test's foreign statement.
        Db::My(_) => {
            db.exec("TRUNCATE TABLE performance_schema.events_statements_summary_by_digest")
                .await
        }
        Db::Lite(_) => {}
    }
    let project = Project::new(|_| {
        format!("[database]\nurl = \"{url}\"\ntable = \"{t}\"\napp_codes = [\"doc\"]\n")
    });
    let run = |args: &[&str]| project.run(args);
    let events: Vec<NewEvent> = (0..20)
        .map(|i| NewEvent::new("doc", "T", "{}").aggregate(format!("a{}", i % 3), i))
        .collect();
    store.enqueue_batch(&events, 1 << 20).await.unwrap();
    postbox_testkit::conformance::relay_delivers_each_once(store.clone(), "doc", &events).await;
    let failed = EventFilter {
        app_code: Some("doc".into()),
        ..Default::default()
    };
    store
        .replay(&ReplaySelector::Filter(failed), true, "test")
        .await
        .unwrap();
    let archive = ArchiveRequest {
        app_codes: vec!["doc".into()],
        before_ms: store.now_ms().await.unwrap() + 1,
        batch_size: 10,
        max_batches: None,
        partitions: Default::default(),
    };
    store.archive(&archive, &|_| {}).await.unwrap();
    assert_ok(&run(&["status"]));
    assert_ok(&run(&["events", "list", "--app-code", "doc"]));

    let clean = run(&["--json", "doctor", "--scans"]);
    let report = json(&clean);
    assert_eq!(
        clean.status.code(),
        Some(0),
        "postbox's own statements: {report:#}"
    );
    assert_eq!(report["flagged"], 0);
    // MariaDB's digest summary leaves out server-side prepared statements
    // (postbox's, through sqlx): it lists text-protocol statements, which
    // is how PHP's PDO sends them by default.
    if let Db::Pg(_) = db {
        let seen = report["statements"].as_array().unwrap().len();
        assert!(
            seen >= 5,
            "postbox's statements are in the statistics: {report:#}"
        );
    }

    let foreign = format!(
        "SELECT id FROM {t} WHERE status = 'pending' OR (status = 'retryable' AND next_retry_at_ms < 5) LIMIT 10"
    );
    let keyed =
        format!("SELECT id FROM {t} WHERE app_code = 'doc' AND status = 'pending' LIMIT 10");
    db.exec(&foreign).await;
    db.exec(&keyed).await;
    let out = run(&["--json", "doctor", "--scans"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let report = json(&out);
    let flagged: Vec<&serde_json::Value> = report["statements"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["flags"].as_array().is_some_and(|f| !f.is_empty()))
        .collect();
    assert_eq!(report["flagged"], 1, "{report:#}");
    let hit = flagged
        .iter()
        .find(|s| {
            s["flags"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f != "unparsed")
        })
        .expect("the foreign claim is flagged");
    assert!(hit["text"].as_str().unwrap().contains("OR"), "{hit}");
    assert_eq!(
        hit["flags"],
        serde_json::json!(["or-across-statuses", "no-app-code"]),
        "{hit}"
    );
    assert!(
        report["statements"].as_array().unwrap().iter().any(|s| {
            // `$1` on PostgreSQL, `?` and backquotes in MariaDB's digests.
            let text = s["text"]
                .as_str()
                .unwrap()
                .to_ascii_lowercase()
                .replace('`', "");
            let keyed = format!("select id from {t} where app_code = ");
            text.starts_with(&keyed)
                && text.contains(" and status = ")
                && s["flags"] == serde_json::json!([])
        }),
        "the keyed query is listed, unflagged: {report:#}"
    );
    let shown = run(&["doctor", "--scans"]);
    assert_says(&shown, &["FLAG", "or-across-statuses", "no-app-code"]);
    if let Db::My(_) = db {
        // A digest table full to the brim records no new statement: the
        // foreign claim run now is not seen, and `doctor --scans` says so
        // instead of reporting the table clean.
        db.exec("TRUNCATE TABLE performance_schema.events_statements_summary_by_digest")
            .await;
        let size = db.count("SELECT @@performance_schema_digests_size").await;
        for i in 0..size + 10 {
            db.exec(&format!("SELECT 1 AS c{i}")).await;
        }
        let unrecorded = "SELECT CAST(COALESCE(SUM(COUNT_STAR), 0) AS SIGNED) \
            FROM performance_schema.events_statements_summary_by_digest WHERE DIGEST IS NULL";
        assert!(db.count(unrecorded).await > 0, "the digest table filled");
        db.exec(&foreign).await;
        let full = run(&["--json", "doctor", "--scans"]);
        assert_eq!(full.status.code(), Some(1), "{}", text(&full));
        assert_says(
            &full,
            &["statement table is full", "TRUNCATE performance_schema"],
        );
        db.exec("TRUNCATE TABLE performance_schema.events_statements_summary_by_digest")
            .await;
    }
    db.drop_tables(&t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_doctor_scans_flag_a_foreign_or_claim_and_not_postbox() {
    let (_, pool) = server_pool::<sqlx::Postgres>("postgres").await;
    scans_scenario("postgres", Db::Pg(pool)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_doctor_scans_flag_a_foreign_or_claim_and_not_postbox() {
    let (_, pool) = server_pool::<sqlx::MySql>("mysql").await;
    scans_scenario("mysql", Db::My(pool)).await;
}

/// Issue 15.2: `lint-sql` on files and stdin, with line and rule, and
/// `--json`; a clean file passes.
#[test]
fn lint_sql_reports_line_and_rule_and_passes_clean_sql() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.sql");
    std::fs::write(
        &bad,
        "-- the PHP worker's claim\n\
         SELECT * FROM room_outbox\n  WHERE status = 0 OR (status = 3 AND next_retry_at < NOW())\n  LIMIT 100;\n\
         SELECT id FROM room_outbox WHERE app_code = 'room' AND status = 0 LIMIT 100;\n\
         SELECT status, COUNT(*) FROM room_outbox GROUP BY status;\n",
    )
    .unwrap();
    let good = dir.path().join("good.sql");
    std::fs::write(
        &good,
        "UPDATE room_outbox SET status = 'delivered' WHERE id IN (1, 2, 3);\n\
         SELECT * FROM users WHERE a = 1 OR b = 2;\n",
    )
    .unwrap();
    let run = |args: &[&str]| common::run(dir.path(), args, &[]);
    let out = run(&[
        "lint-sql",
        "--table",
        "room_outbox",
        "--syntax",
        "mysql",
        "bad.sql",
        "good.sql",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_says(
        &out,
        &[
            "bad.sql:2: or-across-statuses (room_outbox)",
            "bad.sql:2: no-app-code (room_outbox)",
            "bad.sql:6: no-app-code (room_outbox)",
        ],
    );
    assert!(!text(&out).contains("good.sql:"), "{}", text(&out));
    let out = run(&["--json", "lint-sql", "--table", "room_outbox", "bad.sql"]);
    let findings = json(&out);
    let got: Vec<(u64, &str)> = findings
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["line"].as_u64().unwrap(), f["rule"].as_str().unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            (2, "or-across-statuses"),
            (2, "no-app-code"),
            (6, "no-app-code")
        ]
    );
    assert_ok(&run(&["lint-sql", "--table", "room_outbox", "good.sql"]));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_postbox"))
        .current_dir(dir.path())
        .args(["lint-sql", "--table", "room_outbox"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"SELECT * FROM room_outbox WHERE created_at_ms > 5")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("<stdin>:1: no-app-code"));
    let usage = run(&["lint-sql", "bad.sql"]);
    assert_eq!(usage.status.code(), Some(2), "{}", text(&usage));
    assert_says(&usage, &["--table"]);
}
