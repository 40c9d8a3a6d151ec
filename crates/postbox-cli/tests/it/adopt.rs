//! `postbox adopt` as a team runs it on the outbox table it already has
//! (seed 002): the plan, `--apply`, `doctor`, the relay delivering the
//! legacy rows, `lint-sql` reading the table's names, and a bad mapping.

use std::process::Stdio;
use std::time::Duration;

use crate::common;

use common::{assert_ok, assert_says, json, server_pool, signal, text, wait_until, Db, Project};
use postbox_testkit::adopted::{legacy_ddl, legacy_rows};
use postbox_testkit::scratch_table;

const NAMES: &str = "[database.columns]\n\
     event_type = \"biz_type\"\nstatus = \"state\"\nlock_until_ms = \"locked_until_ms\"\n\
     [database.statuses]\ninit = \"pending\"\ndone = \"delivered\"\nrunning = \"delivering\"\ndead = \"failed\"\n";

#[tokio::test]
async fn a_legacy_postgres_table_is_adopted_checked_and_relayed() {
    let (url, pool) = server_pool::<sqlx::Postgres>("postgres").await;
    let clock = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";
    let t = scratch_table("cliadopt");
    let ddl = legacy_ddl(&t, "BIGSERIAL PRIMARY KEY", "TEXT", clock);
    let index = format!(
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {t}_pending_idx ON {t} (app_code, biz_type, next_retry_at_ms, id) \
         WHERE state IN ('pending', 'init')"
    );
    adopt_scenario(Db::Pg(pool), &url, &t, &ddl, &index, "$1").await;
}

#[tokio::test]
async fn a_legacy_mariadb_table_is_adopted_checked_and_relayed() {
    let (url, pool) = server_pool::<sqlx::MySql>("mysql").await;
    let clock = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";
    let t = scratch_table("cliadopt");
    let ddl = legacy_ddl(
        &t,
        "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
        "MEDIUMTEXT",
        clock,
    );
    let index = format!(
        "ALTER TABLE {t} ADD INDEX {t}_due_idx (app_code, state, next_retry_at_ms, biz_type, id), \
         ALGORITHM=INPLACE, LOCK=NONE"
    );
    adopt_scenario(Db::My(pool), &url, &t, &ddl, &index, "?").await;
}

/// The legacy table `t` (`ddl`) of `db` at `url`, with the legacy rows:
/// the plan (which shows `index`), `--json`, `lint-sql` on a query with
/// `bind` placeholders, `--apply`, `doctor`, the relay, the counts.
async fn adopt_scenario(db: Db, url: &str, t: &str, ddl: &str, index: &str, bind: &str) {
    db.exec(ddl).await;
    db.exec(&legacy_rows(t)).await;
    // The old worker's claim index (seed 002's shape).
    db.exec(&format!(
        "CREATE INDEX {t}_claim_retry_idx ON {t} (app_code, state, next_retry_at_ms, created_at_ms, event_id)"
    ))
    .await;
    let project = Project::new(|dir| {
        format!(
            "[database]\nurl = \"{url}\"\ntable = \"{t}\"\napp_codes = [\"leg\"]\n\
             [outbox_worker]\npoll_interval = \"100ms\"\nordering = \"per_aggregate\"\n\
             [[publishers]]\nkind = \"file\"\npath = \"{}/out.jsonl\"\n{NAMES}",
            dir.display()
        )
    });

    // The plan: what it adds, by the table's names, online; nothing runs.
    let plan = project.run(&["adopt"]);
    assert_ok(&plan);
    println!("{}", text(&plan));
    assert_says(
        &plan,
        &[
            "event_type = biz_type",
            "init → pending",
            "columns to add: headers, delivered_to, replay_count",
            &format!("does not read (each is written on every change of its columns; drop them once the old worker is gone): {t}_claim_retry_idx"),
            index,
        ],
    );
    let planned = json(&project.run(&["--json", "adopt"]));
    assert_eq!(planned["applied"], false);
    assert_eq!(planned["missing_columns"].as_array().unwrap().len(), 3);
    // Other tools' SQL is read by the table's names.
    let sql = project.path().join("report.sql");
    std::fs::write(
        &sql,
        format!(
            "SELECT id FROM {t} WHERE app_code = {bind} AND (state = 'init' OR locked_until_ms < {bind})"
        ),
    )
    .unwrap();
    let lint = project.run(&["lint-sql", sql.to_str().unwrap()]);
    assert_eq!(lint.status.code(), Some(1), "{}", text(&lint));
    assert_says(&lint, &["or-across-statuses"]);

    let applied = project.run(&["adopt", "--apply"]);
    assert_ok(&applied);
    assert_says(
        &applied,
        &[
            "adopt: running",
            "adopt: done in",
            "applied",
            "at version 11",
        ],
    );
    let doctor = project.run(&["doctor"]);
    assert_eq!(doctor.status.code(), Some(0), "{}", text(&doctor));
    assert_says(
        &doctor,
        &["WARN  indexes:unread", &format!("{t}_claim_retry_idx")],
    );

    // The relay delivers the legacy new rows, takes over the row the old
    // worker left `running`, then its aggregate's next one, and a new event.
    project.enqueue("leg", "{\"n\":1}");
    let mut relay = project.spawn(&["relay"], Stdio::inherit());
    wait_until(
        30,
        Duration::from_millis(100),
        || project.lines("out.jsonl") >= 4,
        || format!("delivered {} of 4", project.lines("out.jsonl")),
    );
    signal("TERM", relay.id());
    assert!(relay.wait().unwrap().success());
    let out = std::fs::read_to_string(project.path().join("out.jsonl")).unwrap();
    for id in ["new-1", "held", "after-held"] {
        assert!(out.contains(&format!("\"{id}\"")), "{id}: {out}");
    }
    let held_at = out.find("\"held\"").unwrap();
    assert!(
        held_at < out.find("\"after-held\"").unwrap(),
        "per aggregate: {out}"
    );
    let status = json(&project.run(&["--json", "status"]));
    println!("{status}");
    assert_eq!(
        status[0]["delivered"], 6,
        "two legacy delivered rows, four now"
    );
    assert_eq!(status[0]["failed"], 1);
    let states = db
        .count(&format!(
            "SELECT count(*) FROM {t} WHERE state IN ('delivered', 'done', 'published')"
        ))
        .await;
    assert_eq!(
        states, 6,
        "postbox writes its own statuses, the legacy ones stay"
    );
}

#[test]
fn a_bad_mapping_exits_2_naming_its_key() {
    for (names, key) in [
        (
            "[database.columns]\nlock_until = \"x\"\n",
            "database.columns.lock_until",
        ),
        (
            "[database.columns]\nstatus = \"worker_id\"\n",
            "database.columns.status",
        ),
        (
            "[database.statuses]\ndone = \"finished\"\n",
            "database.statuses.done",
        ),
    ] {
        let project = Project::new(|_| {
            format!("[database]\nurl = \"postgres://127.0.0.1:1/x\"\ntable = \"t\"\n{names}")
        });
        let out = project.run(&["adopt"]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert_says(&out, &[key]);
    }
}
