//! `postbox doctor` on PostgreSQL, MariaDB and SQLite: it passes on a fresh
//! migration (tiny tables, where planners would scan anyway), and fails
//! naming the index and the query once an index is dropped.

use crate::common;

use common::{postbox, text};
use postbox_testkit::scratch_table;
use postbox_testkit::servers::{ensure_database, how_to_start, mysql_url, postgres_url};

/// Runs the scenario; `drop_index(sql)` runs one statement on the database
/// (the index's name, for dropping it), `exec(sql)` any statement, and
/// `analyze` is the backend's statement that gathers statistics.
async fn doctor_scenario<F, Fut, E, EFut>(url: &str, t: &str, drop_index: F, exec: E, analyze: &str)
where
    E: Fn(String) -> EFut,
    EFut: std::future::Future<Output = ()>,
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("postbox.toml");
    std::fs::write(
        &config,
        format!("[database]\nurl = \"{url}\"\ntable = \"{t}\"\napp_codes = [\"doc\"]\n"),
    )
    .unwrap();
    let config = config.to_str().unwrap();

    // Before migrating: fails, naming the schema.
    let out = postbox(dir.path(), &["--config", config, "doctor"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("schema_version"), "{}", text(&out));

    let out = postbox(dir.path(), &["--config", config, "migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = postbox(dir.path(), &["--config", config, "--json", "doctor"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["ok"], true);
    let checks = report["checks"].as_array().unwrap();
    for q in [
        "plan:claim_pending",
        "plan:claim_due_retries",
        "plan:claim_expired_leases",
        "plan:archive_delivered",
        "plan:archive_published",
        &format!("index:{t}_claim_lease_idx"),
        &format!("index:{t}_history_event_idx"),
    ] {
        let c = checks
            .iter()
            .find(|c| c["name"] == q)
            .unwrap_or_else(|| panic!("no check {q}: {report:#}"));
        assert_eq!(c["level"], "ok", "{c:#}");
    }

    // Issue 9.10: a correct schema passes on a small table, analysed or not,
    // whichever postbox index the planner picks for such a table.
    let statuses = ["delivered", "pending", "delivering", "retryable", "failed"];
    for i in 0..100 {
        let status = statuses[if i < 80 { 0 } else { i % 5 }];
        exec(format!(
            "INSERT INTO {t} (app_code, event_id, event_type, payload, status, lock_until_ms, next_retry_at_ms, created_at_ms, updated_at_ms) \
             VALUES ('doc', 'e{i}', 'T', '{{}}', '{status}', {i}, {i}, {i}, {i})"
        ))
        .await;
    }
    for round in ["unanalysed", "analysed"] {
        if round == "analysed" {
            exec(analyze.to_owned()).await;
        }
        let out = postbox(dir.path(), &["--config", config, "doctor"]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "100 rows, {round}: {}",
            text(&out)
        );
    }

    let index = format!("{t}_claim_lease_idx");
    drop_index(index.clone()).await;
    let out = postbox(dir.path(), &["--config", config, "doctor"]);
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
    assert!(
        shown.contains("ok    plan:claim_pending"),
        "other queries still fine: {shown}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_doctor_passes_fresh_and_names_a_dropped_index() {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let pool = sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("postgres")));
    let t = scratch_table("doc");
    doctor_scenario(
        &url,
        &t,
        |index| {
            let pool = pool.clone();
            async move {
                sqlx::query(&format!("DROP INDEX {index}"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        },
        |sql| {
            let pool = pool.clone();
            async move {
                sqlx::query(&sql).execute(&pool).await.unwrap();
            }
        },
        &format!("ANALYZE {t}"),
    )
    .await;
    sqlx::query(&format!("DROP TABLE {t}, {t}_archive, {t}_history"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_doctor_passes_fresh_and_names_a_dropped_index() {
    let url = mysql_url();
    ensure_database("mysql", &url).await;
    let pool = sqlx::MySqlPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", how_to_start("mysql")));
    let t = scratch_table("doc");
    let table = t.clone();
    doctor_scenario(
        &url,
        &t,
        |index| {
            let pool = pool.clone();
            let table = table.clone();
            async move {
                sqlx::query(&format!("DROP INDEX {index} ON {table}"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        },
        |sql| {
            let pool = pool.clone();
            async move {
                sqlx::raw_sql(&sql).execute(&pool).await.unwrap();
            }
        },
        &format!("ANALYZE TABLE {t}"),
    )
    .await;
    sqlx::query(&format!("DROP TABLE {t}, {t}_archive, {t}_history"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_doctor_passes_fresh_and_names_a_dropped_index() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let opts = url
        .parse::<sqlx::sqlite::SqliteConnectOptions>()
        .unwrap()
        .create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(opts).await.unwrap();
    doctor_scenario(
        &url,
        "room_outbox",
        |index| {
            let pool = pool.clone();
            async move {
                sqlx::query(&format!("DROP INDEX {index}"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        },
        |sql| {
            let pool = pool.clone();
            async move {
                sqlx::query(&sql).execute(&pool).await.unwrap();
            }
        },
        "ANALYZE",
    )
    .await;
}

#[test]
fn doctor_warns_when_an_inbox_forgets_before_redeliveries_end() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.db");
    let config = dir.path().join("postbox.toml");
    let write = |retention: &str| {
        std::fs::write(
            &config,
            format!(
                "[database]\nurl = \"sqlite://{}\"\napp_codes = [\"doc\"]\n\
                 [outbox_worker]\nmax_retry_count = 10\nmax_backoff = \"5m\"\n\
                 [[consumers]]\nkind = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\n\
                 queue = \"doc_q\"\nmax_attempts = 5\nretry_delay = \"1s\"\n\
                 inbox = {{ url = \"sqlite://{}\" }}\ninbox_retention = \"{retention}\"\n",
                db.display(),
                dir.path().join("inbox.db").display()
            ),
        )
        .unwrap();
    };
    let config_arg = config.to_str().unwrap();
    write("10m");
    let out = postbox(dir.path(), &["--config", config_arg, "migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = postbox(dir.path(), &["--config", config_arg, "--json", "doctor"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let inbox = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "config:consumers.0.inbox_retention")
        .unwrap_or_else(|| panic!("no inbox check: {report:#}"))
        .clone();
    // 10 relay retries × 5m alone is 50m: 10m of memory is too short.
    assert_eq!(inbox["level"], "warn", "{inbox:#}");
    assert!(
        inbox["message"]
            .as_str()
            .unwrap()
            .contains("consumers.0.inbox_retention (10m)"),
        "{inbox:#}"
    );

    write("7d");
    let out = postbox(dir.path(), &["--config", config_arg, "--json", "doctor"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let inbox = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "config:consumers.0.inbox_retention")
        .unwrap()
        .clone();
    assert_eq!(inbox["level"], "ok", "{inbox:#}");
}

/// Issue 10.1: with `ordering = "per_aggregate"`, `doctor` warns about (and
/// `status` lists) an aggregate whose head keeps failing while later events
/// wait behind it; a healthy aggregate is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_and_status_show_an_aggregate_whose_head_cannot_move() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let config = dir.path().join("postbox.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{url}\"\ntable = \"room_outbox\"\napp_codes = [\"doc\"]\n\
             [outbox_worker]\nordering = \"per_aggregate\"\n"
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let out = postbox(dir.path(), &["--config", config, "migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = postbox(dir.path(), &["--config", config, "doctor"]);
    assert!(
        text(&out).contains("ok    aggregates:held_back"),
        "{}",
        text(&out)
    );

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
    let out = postbox(dir.path(), &["--config", config, "doctor"]);
    let shown = text(&out);
    assert!(shown.contains("WARN  aggregates:held_back"), "{shown}");
    assert!(
        shown.contains("room-7") && shown.contains("head-1"),
        "{shown}"
    );
    assert!(shown.contains("broker said no"), "{shown}");
    assert!(!shown.contains("room-8"), "{shown}");
    let out = postbox(dir.path(), &["--config", config, "status"]);
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("aggregates held back"), "{shown}");
    assert!(
        shown.contains("room-7") && !shown.contains("room-8"),
        "{shown}"
    );
}
