//! Issue 15.4: `postbox migrate --print-sql --out DIR` writes the schema
//! as files a team's migration tool applies; applied with the database's
//! own client (psql, mariadb), the result is a schema `migrate` finds up
//! to date and `doctor` accepts, and the whole conformance suite passes on
//! it.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use postbox_core::store::OutboxStore;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::{ensure_database, mysql_url, postgres_url};

/// The versioned files `migrate --print-sql --out` writes for `table` at
/// `url` (in `format`), in the order a tool applies them.
fn printed(dir: &Path, url: &str, table: &str, format: &str) -> Vec<std::path::PathBuf> {
    printed_with(dir, url, table, format, "")
}

/// [`printed`] with `more` lines in `[database]`.
fn printed_with(
    dir: &Path,
    url: &str,
    table: &str,
    format: &str,
    more: &str,
) -> Vec<std::path::PathBuf> {
    let config = dir.join("postbox.toml");
    std::fs::write(
        &config,
        format!("[database]\nurl = \"{url}\"\ntable = \"{table}\"\n{more}"),
    )
    .unwrap();
    let out = dir.join("sql");
    let run = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .env_remove("POSTBOX_CONFIG")
        .arg("--config")
        .arg(&config)
        .args(["migrate", "--print-sql", "--format", format, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let mut files: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let version = |p: &std::path::PathBuf| -> u32 {
        let name = p.file_name().unwrap().to_str().unwrap();
        name.trim_start_matches('V')
            .split('_')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    files.sort_by_key(version);
    // Every schema version of the database (MariaDB has no 4 and 6: no
    // wake-up trigger, and no separate pending index).
    let expected = if url.starts_with("mysql") { 9 } else { 11 };
    assert_eq!(files.len(), expected, "{files:?}");
    files
}

/// Applies `file` with `client` and its `args`, stopping at the first error.
fn apply(client: &str, args: &[&str], file: &Path) {
    let input = std::fs::File::open(file).unwrap();
    let run = Command::new(client)
        .args(args)
        .stdin(input)
        .output()
        .unwrap_or_else(|e| {
            panic!("{client} is missing ({e}): scripts/test installs the database clients")
        });
    assert!(
        run.status.success(),
        "{client} < {}: {}",
        file.display(),
        String::from_utf8_lossy(&run.stderr)
    );
}

/// A store whose table was made by the printed SQL, not by `migrate`:
/// the files for a scratch table of `server` at `url` (in `format`),
/// applied one by one with `client` and the `args` that point it at the
/// database; then checked as `migrate` and `doctor` see it.
/// A database: its testkit server name, the `--format` its files are
/// printed in, and its client.
struct Db {
    server: &'static str,
    format: &'static str,
    client: &'static str,
}

async fn printed_store<S: OutboxStore, F: std::future::Future<Output = postbox_core::Result<S>>>(
    Db {
        server,
        format,
        client,
    }: Db,
    url: String,
    args: &[&str],
    connect: impl FnOnce(String, String) -> F,
) -> Arc<dyn OutboxStore> {
    ensure_database(server, &url).await;
    let table = scratch_table("printed");
    let dir = tempfile::tempdir().unwrap();
    for file in printed(dir.path(), &url, &table, format) {
        apply(client, args, &file);
    }
    let store = connect(url, table).await.unwrap();
    let report = store.migrate().await.unwrap();
    assert!(
        report.applied.is_empty(),
        "migrate finds it up to date: {report:?}"
    );
    assert_eq!(report.version, 11);
    let schema = store.inspect_schema().await.unwrap();
    assert!(
        schema.objects.iter().all(|o| o.present),
        "doctor's schema check: {schema:?}"
    );
    Arc::new(store)
}

mod postgres {
    use super::*;
    use postbox_postgres::PgOutbox;
    use postbox_testkit::conformance_suite;

    async fn fresh() -> Arc<dyn OutboxStore> {
        let url = postgres_url();
        let args = [url.as_str(), "-q", "-v", "ON_ERROR_STOP=1", "-f", "-"];
        let db = Db {
            server: "postgres",
            format: "flyway",
            client: "psql",
        };
        let connect = async |url: String, table: String| PgOutbox::connect(&url, &table, 4).await;
        printed_store(db, url.clone(), &args, connect).await
    }

    conformance_suite!(fresh);
}

mod mariadb {
    use super::*;
    use postbox_mysql::MySqlOutbox;
    use postbox_testkit::conformance_suite;

    async fn fresh() -> Arc<dyn OutboxStore> {
        // mysql://user[:password]@host:port/database
        let url = mysql_url();
        let rest = url.split_once("://").unwrap().1;
        let (auth, place) = rest.rsplit_once('@').unwrap();
        let (user, password) = auth.split_once(':').unwrap_or((auth, ""));
        let (host_port, database) = place.split_once('/').unwrap();
        let (host, port) = host_port.split_once(':').unwrap_or((host_port, "3306"));
        let password = format!("--password={password}");
        let mut args = vec!["-h", host, "-P", port, "-u", user, database];
        if password != "--password=" {
            args.push(&password);
        }
        let db = Db {
            server: "mysql",
            format: "golang-migrate",
            client: "mariadb",
        };
        let connect =
            async |url: String, table: String| MySqlOutbox::connect(&url, &table, 4).await;
        printed_store(db, url.clone(), &args, connect).await
    }

    conformance_suite!(fresh);
}

/// `--from N` prints the versions after N only; without `--out`, to
/// stdout, each version headed by a comment. No connection is made: the
/// SQLite file named is not created.
#[test]
fn from_prints_only_the_later_versions() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("never.db");
    let run = Command::new(env!("CARGO_BIN_EXE_postbox"))
        .env_remove("POSTBOX_CONFIG")
        .arg("--database-url")
        .arg(format!("sqlite://{}", db.display()))
        .args(["migrate", "--print-sql", "--from", "7"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        text.contains("-- postbox schema version 8 of `postbox_outbox` (SQLite)")
            && text.contains("-- postbox schema version 11 of `postbox_outbox` (SQLite)"),
        "{text}"
    );
    assert!(!text.contains("schema version 7"), "{text}");
    assert!(
        text.contains("INSERT INTO postbox_schema_migrations"),
        "{text}"
    );
    assert!(!db.exists(), "nothing connected");
}

/// `--print-sql` connects to nothing, so it needs no secret: a
/// `database.url` whose password is an unset `${VAR}` still names its
/// database (it exited 2, "environment variable … is not set", and a CI
/// job printing the schema needed the production password). A URL that is
/// one unset variable names no database: the variable is named.
#[test]
fn print_sql_needs_no_database_password() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("postbox.toml");
    // The archive's and a consumer's secrets are not read either.
    let others = "[archive]\nurl = \"postgres://a:${POSTBOX_TEST_UNSET_PASSWORD}@history/h\"\n\
        [[consumers]]\nkind = \"rabbitmq\"\nurl = \"amqp://u:${POSTBOX_TEST_UNSET_PASSWORD}@mq/%2f\"\n\
        queue = \"q\"\nhandler = { http = \"http://127.0.0.1:1/\" }\n";
    let print = |url: &str| {
        std::fs::write(&config, format!("[database]\nurl = \"{url}\"\n{others}")).unwrap();
        Command::new(env!("CARGO_BIN_EXE_postbox"))
            .env_remove("POSTBOX_CONFIG")
            .env_remove("POSTBOX_TEST_UNSET_PASSWORD")
            .arg("--config")
            .arg(&config)
            .args(["migrate", "--print-sql"])
            .output()
            .unwrap()
    };
    let run = print("postgres://app:${POSTBOX_TEST_UNSET_PASSWORD}@db.example/app");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(String::from_utf8_lossy(&run.stdout).contains("(PostgreSQL)"));
    let run = print("${POSTBOX_TEST_UNSET_PASSWORD}");
    assert_eq!(run.status.code(), Some(2));
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(
        said.contains("database.url") && said.contains("POSTBOX_TEST_UNSET_PASSWORD"),
        "{said}"
    );
}

/// Issue 16.4: with `partitioning = "daily"` the printed version 1 creates
/// the table partitioned (with its keys table and triggers); applied with
/// psql, `postbox migrate` finds every version applied and creates the
/// partitions, and the table takes events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_table_is_printed_partitioned() {
    use postbox_core::partition::Partitioning;
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let table = scratch_table("printpart");
    let dir = tempfile::tempdir().unwrap();
    let files = printed_with(
        dir.path(),
        &url,
        &table,
        "flyway",
        "partitioning = \"daily\"\n",
    );
    let v1 = std::fs::read_to_string(&files[0]).unwrap();
    assert!(
        v1.contains("PARTITION BY RANGE (created_at_ms)") && v1.contains("_keys"),
        "{v1}"
    );
    let args = [url.as_str(), "-q", "-v", "ON_ERROR_STOP=1", "-f", "-"];
    for file in &files {
        apply("psql", &args, file);
    }
    let store = postbox_postgres::PgOutbox::connect(&url, &table, 4)
        .await
        .unwrap()
        .with_partitioning(Partitioning::Daily);
    let report = store.migrate().await.unwrap();
    assert!(report.applied.is_empty(), "{report:?}");
    let ahead = store.partitions_ahead().await.unwrap().unwrap();
    assert_eq!(ahead.ahead, 14, "{ahead:?}");
    let event = postbox_core::NewEvent::new("app", "T", "{}");
    let twice = store
        .enqueue_batch(&[event.clone(), event], 1 << 20)
        .await
        .unwrap();
    assert!(matches!(
        twice[0],
        postbox_core::store::EnqueueOutcome::Inserted(_)
    ));
    assert_eq!(twice[1], postbox_core::store::EnqueueOutcome::Duplicate);
}
