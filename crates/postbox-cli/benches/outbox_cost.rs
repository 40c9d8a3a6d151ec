//! What postbox costs against a minimal hand-written outbox, measured in
//! the same run.
//!
//! ```sh
//! cargo bench -p postbox-cli --bench outbox_cost -- [postgres|mysql] [ROWS] [RUNS] \
//!     [--only drain|rabbitmq|producer|latency|isolation|history] [--history N]
//! ```
//!
//! RUNS (default 3) runs per section; each prints its figures per run, the
//! medians and the ratios of the medians. The sections:
//!
//! - **drain** (PostgreSQL, MariaDB): ROWS pending rows (default 100,000)
//!   drained twice per run. *minimal*: a sequential loop over a minimal
//!   table (primary key, unique `(app_code, event_id)`, one claim index
//!   `(app_code, status, id)`) that claims 100 rows with `FOR UPDATE SKIP
//!   LOCKED` and marks them delivered with one fenced `UPDATE`; *postbox*:
//!   the real relay over a `migrate`d table, to the `file` publisher writing
//!   to `/dev/null`, batch_size 100. Both tables hold the same rows
//!   (payload ~100 bytes). Reports events/s, and the log volume per
//!   delivered event: PostgreSQL WAL (`pg_current_wal_lsn()` around the
//!   drain, after a `CHECKPOINT`, so both pay their full-page images), or
//!   MariaDB redo (`Innodb_os_log_written`, each reading once InnoDB's
//!   purge has caught up, so a drain counts the purge of its own updates
//!   and no other's). Both counters are server-wide:
//!   anything else writing meanwhile is counted too. To show where the time
//!   goes, each run also drains a third table with postbox's own claim and
//!   mark statements back to back (no relay),
//!   and prints the share of claim and mark in both loops and the plan each
//!   pending claim gets right after loading; and a fourth with two relays
//!   side by side (target: ≥ 1.5 × one), beside two minimal loops side by
//!   side over one minimal table (what a second loop of the simplest kind
//!   gains on this machine). On PostgreSQL, the minimal loop
//!   also runs on a table without statistics, which keeps its claim on its
//!   index (after `ANALYZE` of the loaded backlog it reads the primary key).
//! - **rabbitmq** (PostgreSQL, MariaDB): the same, publishing to RabbitMQ
//!   (persistent, mandatory, publisher confirms awaited per batch) to a
//!   scratch durable topic exchange with a bound durable queue, batch_size
//!   500 for both; ROWS (when given, as for drain) defaults to 50,000
//!   here. The queue is purged after
//!   every drain, and queue and exchange are deleted at the end.
//! - **producer** (PostgreSQL, MariaDB): one connection running up to 5,000
//!   transactions (or 5 s) per variant and run, the variants taking turns
//!   every 250 transactions:
//!   *business* — `UPDATE <accounts> SET balance = balance + 1, version =
//!   version + 1 WHERE id = k` on a scratch table of one row per key (k
//!   rotating over 1,000 keys) alone;
//!   *enqueue* — the same plus `enqueue` through the Rust API; *plain
//!   INSERT* — the same plus `docs/plain-insert.<db>.sql`; for reference,
//!   *minimal INSERT* — the same plus an INSERT into the drain section's
//!   minimal table (what one more statement costs with any outbox).
//!   Reports tx/s and the producer overhead business / variant (target
//!   ≤ 1.15), from the medians and as the median of each run's own ratio.
//! - **latency** (PostgreSQL only): a relay with the default
//!   `[outbox_worker]` (poll_interval 1 s) in a database of its own,
//!   `postbox_bench_idle`, while a producer commits 1 event per transaction
//!   at 1,000 events/s for 10 s: commit → published latency p50/p99/max
//!   (and the p99 of the events after the first second: the first ones can
//!   find the relay asleep in its idle poll), for plain INSERTs with `wake
//!   = "notify"`, plain INSERTs with `wake = "poll"`, and `enqueue` on a
//!   store other than the relay's (so no in-process wake) with `notify`.
//!   Then the idle cost: the transactions the database counts
//!   (`pg_stat_database.xact_commit`) in 10 s, once the relay has been idle
//!   for 3 s and the busy phase's counts have landed (11 s: PostgreSQL 15
//!   can hold a backend's counts back for 10 s). The counter is read from
//!   the `postgres` database, so the reading connection adds none;
//!   autovacuum visiting the database in the window would be counted too. Run once, not RUNS times: each row is a
//!   distribution over 10,000 events.
//! - **isolation** (PostgreSQL, MariaDB): ROWS pending rows (default
//!   50,000) drained by the relay (batch_size 100, publish_timeout 1 s) to
//!   a healthy publisher (`/dev/null`) *alone*, then beside another healthy
//!   one (answers at once: no row should be deferred), beside a *slow* one
//!   (answers each batch after 250 ms) and beside a *hung* one (never
//!   answers). Reports the rate at which the healthy publisher gets every
//!   row, the rows the relay deferred, and each case's ratio to *alone*
//!   (target: ≥ 0.9).
//! - **history** (PostgreSQL, MariaDB; only when asked for with `--only
//!   history`, as loading takes minutes): one `migrate`d table loaded once
//!   with `--history N` delivered rows (default 10,000,000). Per run, ROWS
//!   pending rows (default 100,000) drained by the relay to `/dev/null` on
//!   a fresh empty table and beside that history (target: ≥ 0.9 ×); then
//!   `postbox status` run as a process (the release binary, from start to
//!   exit, median of 5) and the stats poller's query (`stats`, median of 20)
//!   on both tables; last, `postbox relay` as a process draining ROWS more
//!   rows beside the history, its peak resident memory (`VmHWM`, target
//!   ≤ 64 MiB) and rate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use postbox_core::config::{
    FilePublisherConfig, HumanDuration, NatsPublisherConfig, RabbitMqPublisherConfig,
    RelaySettings, WakeMode, WorkerConfig,
};
use postbox_core::event::new_event_id;
use postbox_core::publish::{Delivery, PublishError, PublishResults};
use postbox_core::redact::SecretUrl;
use postbox_core::relay::{CancellationToken, Relay};
use postbox_core::store::{ClaimRequest, OutboxStore, EXPECTED_TABLES};
use postbox_core::{ClaimSource, NewEvent, Publisher};
use postbox_mysql::MySqlOutbox;
use postbox_postgres::PgOutbox;
use postbox_publishers::file::FilePublisher;
use postbox_publishers::nats::NatsPublisher;
use postbox_publishers::rabbitmq::RabbitMqPublisher;
use postbox_testkit::amqp::{bind_queue, declare_queue, declare_topic_exchange, Lifetime};
use postbox_testkit::conformance::app_stats;
use postbox_testkit::scratch_table;
use postbox_testkit::servers::{amqp_url, ensure_database, mysql_url, postgres_url};
use postbox_testkit::sql_text::{interpolate, Literal};
use sqlx::{Connection as _, MySqlPool, PgPool, Row as _};

const APP: &str = "bench";
const DRAIN_BATCH: u32 = 100;
const RABBIT_BATCH: u32 = 500;
const LEASE_MS: i64 = 30_000;
/// Every wait panics after this long without progress.
const NO_PROGRESS: Duration = Duration::from_secs(120);
/// The payload of every loaded row: ~100 bytes of JSON (`n` = row number).
const PAD: &str = "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";
const PLAIN_INSERT_PG: &str = include_str!("../../../docs/plain-insert.postgres.sql");
const IN_THE_CHANGE_PG: &str =
    include_str!("../../../docs/plain-insert-in-the-change.postgres.sql");
const PLAIN_INSERT_MYSQL: &str = include_str!("../../../docs/plain-insert.mysql.sql");
const IN_THE_CHANGE_MYSQL: &str =
    include_str!("../../../docs/plain-insert-in-the-change.mysql.sql");
/// The database the latency section has to itself.
const IDLE_DB: &str = "postbox_bench_idle";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Db {
    Postgres,
    MySql,
}

impl Db {
    /// As `ensure_database` names the server.
    fn name(self) -> &'static str {
        match self {
            Db::Postgres => "postgres",
            Db::MySql => "mysql",
        }
    }

    fn url(self) -> String {
        match self {
            Db::Postgres => postgres_url(),
            Db::MySql => mysql_url(),
        }
    }

    /// What the server calls its log.
    fn log(self) -> &'static str {
        match self {
            Db::Postgres => "WAL",
            Db::MySql => "redo",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Section {
    Drain,
    Rabbitmq,
    Nats,
    Producer,
    Latency,
    Isolation,
    History,
}

impl Section {
    fn parse(s: &str) -> Section {
        match s {
            "drain" => Section::Drain,
            "rabbitmq" => Section::Rabbitmq,
            "producer" => Section::Producer,
            "latency" => Section::Latency,
            "isolation" => Section::Isolation,
            "history" => Section::History,
            "nats" => Section::Nats,
            other => {
                panic!("unknown section `{other}`: drain, rabbitmq, nats, producer, latency, isolation or history")
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` adds `--bench`; positional arguments and `--only` count.
    let mut positional = Vec::new();
    let mut only = None;
    let mut history = 10_000_000u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--history" {
            history = args
                .next()
                .and_then(|n| n.parse().ok())
                .expect("--history needs a number of rows");
        } else if a == "--only" {
            only = Some(Section::parse(
                &args.next().expect("--only needs a section"),
            ));
        } else if let Some(s) = a.strip_prefix("--only=") {
            only = Some(Section::parse(s));
        } else if !a.starts_with("--") {
            positional.push(a);
        }
    }
    let db = match positional.first().map(String::as_str).unwrap_or("postgres") {
        "postgres" => Db::Postgres,
        "mysql" | "mariadb" => Db::MySql,
        other => panic!("unknown database `{other}`: use postgres or mysql"),
    };
    let rows: Option<u64> = positional
        .get(1)
        .map(|s| s.parse().expect("ROWS is a number"));
    let runs: usize = positional
        .get(2)
        .map(|s| s.parse().expect("RUNS is a number"))
        .unwrap_or(3);
    assert!(runs > 0, "RUNS must be at least 1");
    ensure_database(db.name(), &db.url()).await;
    println!(
        "outbox_cost: {} ({}), {runs} runs",
        db.name(),
        server_version(db).await
    );
    let wanted = |s: Section| only.is_none_or(|o| o == s) && s != Section::History;
    if wanted(Section::Drain) {
        drain_section(db, rows.unwrap_or(100_000), runs).await;
    }
    if wanted(Section::Rabbitmq) {
        rabbitmq_section(db, rows.unwrap_or(50_000), runs).await;
    }
    if wanted(Section::Nats) {
        nats_section(db, rows.unwrap_or(50_000), runs).await;
    }
    if wanted(Section::Producer) {
        producer_section(db, runs).await;
    }
    if wanted(Section::Latency) {
        if db == Db::Postgres {
            latency_section().await;
        } else {
            println!("\n== latency: skipped (PostgreSQL only) ==");
        }
    }
    if wanted(Section::Isolation) {
        isolation_section(db, rows.unwrap_or(50_000), runs).await;
    }
    if only == Some(Section::History) {
        history_section(db, history, rows.unwrap_or(100_000), runs).await;
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// `fut`, or a panic naming `what` when it has not finished after
/// [`NO_PROGRESS`].
async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(NO_PROGRESS, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer after {NO_PROGRESS:?}"))
}

/// Panics when a polled counter stops moving for [`NO_PROGRESS`].
struct Watchdog {
    what: &'static str,
    last: Option<u64>,
    since: Instant,
}

impl Watchdog {
    fn new(what: &'static str) -> Self {
        Watchdog {
            what,
            last: None,
            since: Instant::now(),
        }
    }

    fn saw(&mut self, value: u64) {
        if self.last != Some(value) {
            self.last = Some(value);
            self.since = Instant::now();
        } else if self.since.elapsed() > NO_PROGRESS {
            panic!(
                "{}: no progress for {NO_PROGRESS:?} (stuck at {value})",
                self.what
            );
        }
    }
}

async fn server_version(db: Db) -> String {
    let sql = match db {
        Db::Postgres => "SELECT split_part(version(), ' on ', 1)",
        Db::MySql => "SELECT version()",
    };
    match db {
        Db::Postgres => {
            let mut c = pg_connect(&db.url()).await;
            sqlx::query_scalar(sql).fetch_one(&mut c).await
        }
        Db::MySql => {
            let mut c = mysql_connect(&db.url()).await;
            sqlx::query_scalar(sql).fetch_one(&mut c).await
        }
    }
    .expect("server version")
}

async fn pg_connect(url: &str) -> sqlx::PgConnection {
    sqlx::PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to PostgreSQL: {e}"))
}

async fn mysql_connect(url: &str) -> sqlx::MySqlConnection {
    sqlx::MySqlConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to MariaDB: {e}"))
}

/// Runs one statement on `db` over a connection of its own.
async fn exec(db: Db, sql: &str) {
    let url = db.url();
    match db {
        Db::Postgres => {
            let mut c = pg_connect(&url).await;
            sqlx::query(sql).execute(&mut c).await.map(|_| ())
        }
        Db::MySql => {
            let mut c = mysql_connect(&url).await;
            sqlx::query(sql).execute(&mut c).await.map(|_| ())
        }
    }
    .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The SQL expression of the loaded payload, in the loader's row number `n`.
fn payload_expr(db: Db, n: &str) -> String {
    match db {
        Db::Postgres => format!("'{{\"n\":' || {n} || ',\"pad\":\"{PAD}\"}}'"),
        Db::MySql => format!("CONCAT('{{\"n\":', {n}, ',\"pad\":\"{PAD}\"}}')"),
    }
}

/// `INSERT … SELECT` of `rows` rows into `columns` from `values` (in the
/// row number, `g` on PostgreSQL, `seq` on MariaDB's sequence engine).
fn load_sql(db: Db, table: &str, columns: &str, values: &[String], rows: u64) -> String {
    let values = values.join(", ");
    match db {
        Db::Postgres => format!(
            "INSERT INTO {table} ({columns}) SELECT {values} FROM generate_series(1, {rows}) g"
        ),
        Db::MySql => {
            format!("INSERT INTO {table} ({columns}) SELECT {values} FROM seq_1_to_{rows}")
        }
    }
}

fn row_number(db: Db) -> &'static str {
    match db {
        Db::Postgres => "g",
        Db::MySql => "seq",
    }
}

fn concat(db: Db, prefix: &str, expr: &str) -> String {
    match db {
        Db::Postgres => format!("'{prefix}' || {expr}"),
        Db::MySql => format!("CONCAT('{prefix}', {expr})"),
    }
}

async fn analyze(db: Db, table: &str) {
    match db {
        Db::Postgres => exec(db, &format!("VACUUM ANALYZE {table}")).await,
        Db::MySql => exec(db, &format!("ANALYZE TABLE {table}")).await,
    }
}

/// Bytes of a table with its indexes (MariaDB: from its statistics).
async fn table_bytes(db: Db, table: &str) -> i64 {
    match db {
        Db::Postgres => {
            let mut c = pg_connect(&db.url()).await;
            sqlx::query_scalar("SELECT pg_total_relation_size($1::text::regclass)")
                .bind(table)
                .fetch_one(&mut c)
                .await
        }
        Db::MySql => {
            let mut c = mysql_connect(&db.url()).await;
            sqlx::query_scalar(
                "SELECT CAST(data_length + index_length AS SIGNED) FROM information_schema.tables \
                 WHERE table_schema = DATABASE() AND table_name = ?",
            )
            .bind(table)
            .fetch_one(&mut c)
            .await
        }
    }
    .expect("table size")
}

// ---------------------------------------------------------------------------
// The minimal outbox.

/// A claimed row of the minimal table.
struct MinimalRow {
    id: i64,
    event_id: String,
    event_type: String,
    payload: String,
}

/// One claim: its rows and its fence.
struct MinimalBatch {
    rows: Vec<MinimalRow>,
    lock_until_ms: i64,
}

enum MinimalPool {
    Pg(PgPool),
    My(MySqlPool),
}

/// A hand-written outbox: the table and the two statements of a minimal
/// relay.
struct Minimal {
    db: Db,
    table: String,
    pool: MinimalPool,
}

/// `?, ?, …`, `n` times.
fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Creates the minimal outbox table: primary key, unique `(app_code,
/// event_id)`, one claim index `(app_code, status, id)`.
async fn create_minimal_table(db: Db, table: &str) {
    let ddl: Vec<String> = match db {
        Db::Postgres => vec![
            format!(
                "CREATE TABLE {table} ( \
                   id BIGSERIAL PRIMARY KEY, \
                   app_code VARCHAR(64) NOT NULL, \
                   event_id VARCHAR(64) NOT NULL, \
                   event_type VARCHAR(128) NOT NULL, \
                   payload TEXT NOT NULL, \
                   status VARCHAR(16) NOT NULL DEFAULT 'pending', \
                   lock_until_ms BIGINT NOT NULL DEFAULT 0, \
                   worker_id VARCHAR(128), \
                   updated_at_ms BIGINT NOT NULL DEFAULT 0)"
            ),
            format!("CREATE UNIQUE INDEX {table}_event_uq ON {table} (app_code, event_id)"),
            format!("CREATE INDEX {table}_claim_idx ON {table} (app_code, status, id)"),
        ],
        Db::MySql => vec![format!(
            "CREATE TABLE {table} ( \
               id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
               app_code VARCHAR(64) NOT NULL, \
               event_id VARCHAR(64) NOT NULL, \
               event_type VARCHAR(128) NOT NULL, \
               payload MEDIUMTEXT NOT NULL, \
               status VARCHAR(16) NOT NULL DEFAULT 'pending', \
               lock_until_ms BIGINT NOT NULL DEFAULT 0, \
               worker_id VARCHAR(128) NULL, \
               updated_at_ms BIGINT NOT NULL DEFAULT 0, \
               UNIQUE KEY {table}_event_uq (app_code, event_id), \
               KEY {table}_claim_idx (app_code, status, id) \
             ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        )],
    };
    for sql in &ddl {
        exec(db, sql).await;
    }
}

/// `Index Scan using x`, `Seq Scan on t`, … of a PostgreSQL text plan,
/// without the costs.
fn scans_in_plan(plan: &str) -> String {
    let scans: Vec<&str> = plan
        .lines()
        .filter(|l| l.contains(" Scan "))
        .map(|l| {
            let l = l.trim().trim_start_matches("->").trim();
            l.split("  (").next().unwrap_or(l)
        })
        .collect();
    scans.join("; ")
}

impl Minimal {
    /// A fresh minimal table holding `rows` pending rows, analyzed.
    /// With `analysed`, the table is analysed after loading, as
    /// autovacuum does soon after a bulk insert; without, on PostgreSQL it
    /// has no statistics (autovacuum off for it), so the planner keeps to
    /// the claim index.
    async fn create(db: Db, rows: u64, analysed: bool) -> Minimal {
        let table = scratch_table("cost_min");
        let url = db.url();
        create_minimal_table(db, &table).await;
        if !analysed && db == Db::Postgres {
            exec(
                db,
                &format!("ALTER TABLE {table} SET (autovacuum_enabled = false)"),
            )
            .await;
        }
        let n = row_number(db);
        let load = load_sql(
            db,
            &table,
            "app_code, event_id, event_type, payload",
            &[
                format!("'{APP}'"),
                concat(db, "ev-", n),
                "'BenchEvent'".to_owned(),
                payload_expr(db, n),
            ],
            rows,
        );
        exec(db, &load).await;
        if analysed || db == Db::MySql {
            analyze(db, &table).await;
        }
        let pool = match db {
            Db::Postgres => MinimalPool::Pg(open_pool(&url, 4).await),
            Db::MySql => MinimalPool::My(open_pool(&url, 4).await),
        };
        Minimal { db, table, pool }
    }

    /// Claims up to `limit` pending rows for `worker` with one lease end.
    async fn claim(&self, worker: &str, limit: u32) -> MinimalBatch {
        let t = &self.table;
        let now = now_ms();
        let lock_until_ms = now + LEASE_MS;
        let rows = match &self.pool {
            MinimalPool::Pg(pool) => {
                let sql = format!(
                    "WITH picked AS ( \
                       SELECT id FROM {t} WHERE app_code = $1 AND status = 'pending' \
                       ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED) \
                     UPDATE {t} o SET status = 'delivering', worker_id = $3, lock_until_ms = $4, \
                       updated_at_ms = $5 \
                     FROM picked WHERE o.id = picked.id \
                     RETURNING o.id, o.event_id, o.event_type, o.payload"
                );
                let rows = sqlx::query(&sql)
                    .bind(APP)
                    .bind(i64::from(limit))
                    .bind(worker)
                    .bind(lock_until_ms)
                    .bind(now)
                    .fetch_all(pool)
                    .await
                    .expect("minimal claim");
                rows.iter()
                    .map(|r| MinimalRow {
                        id: r.get("id"),
                        event_id: r.get("event_id"),
                        event_type: r.get("event_type"),
                        payload: r.get("payload"),
                    })
                    .collect::<Vec<_>>()
            }
            MinimalPool::My(pool) => {
                // Two loops side by side deadlock now and then at MariaDB's
                // default isolation; the simplest loop then tries again.
                loop {
                    match self
                        .claim_mysql(pool, worker, limit, lock_until_ms, now)
                        .await
                    {
                        Ok(rows) => break rows,
                        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40001") => {
                            continue
                        }
                        Err(e) => panic!("minimal claim: {e}"),
                    }
                }
            }
        };
        MinimalBatch {
            rows,
            lock_until_ms,
        }
    }

    /// One MariaDB claim transaction of the minimal loop.
    async fn claim_mysql(
        &self,
        pool: &MySqlPool,
        worker: &str,
        limit: u32,
        lock_until_ms: i64,
        now: i64,
    ) -> Result<Vec<MinimalRow>, sqlx::Error> {
        let t = &self.table;
        let mut tx = pool.begin().await?;
        let picked = sqlx::query(&format!(
            "SELECT id, event_id, event_type, payload FROM {t} \
             WHERE app_code = ? AND status = 'pending' \
             ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED"
        ))
        .bind(APP)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let rows: Vec<MinimalRow> = picked
            .iter()
            .map(|r| MinimalRow {
                id: r.get("id"),
                event_id: r.get("event_id"),
                event_type: r.get("event_type"),
                payload: r.get("payload"),
            })
            .collect();
        if !rows.is_empty() {
            let sql = format!(
                "UPDATE {t} SET status = 'delivering', worker_id = ?, lock_until_ms = ?, \
                   updated_at_ms = ? WHERE id IN ({})",
                placeholders(rows.len())
            );
            let mut q = sqlx::query(&sql).bind(worker).bind(lock_until_ms).bind(now);
            for r in &rows {
                q = q.bind(r.id);
            }
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(rows)
    }

    /// Marks a claimed batch delivered, fenced by its lease; returns the
    /// rows changed.
    async fn mark(&self, batch: &MinimalBatch, worker: &str) -> u64 {
        let t = &self.table;
        let ids: Vec<i64> = batch.rows.iter().map(|r| r.id).collect();
        match &self.pool {
            MinimalPool::Pg(pool) => sqlx::query(&format!(
                "UPDATE {t} SET status = 'delivered', lock_until_ms = 0, updated_at_ms = $1 \
                 WHERE id = ANY($2) AND worker_id = $3 AND lock_until_ms = $4"
            ))
            .bind(now_ms())
            .bind(&ids)
            .bind(worker)
            .bind(batch.lock_until_ms)
            .execute(pool)
            .await
            .expect("minimal mark")
            .rows_affected(),
            MinimalPool::My(pool) => {
                let sql = format!(
                    "UPDATE {t} SET status = 'delivered', lock_until_ms = 0, updated_at_ms = ? \
                     WHERE id IN ({}) AND worker_id = ? AND lock_until_ms = ?",
                    placeholders(ids.len())
                );
                let mut q = sqlx::query(&sql).bind(now_ms());
                for id in &ids {
                    q = q.bind(*id);
                }
                q.bind(worker)
                    .bind(batch.lock_until_ms)
                    .execute(pool)
                    .await
                    .expect("minimal mark")
                    .rows_affected()
            }
        }
    }

    /// Drains every row: claim → (publish) → mark, one batch after the
    /// other. Returns events/s and where the time went.
    async fn drain(
        &self,
        rows: u64,
        batch: u32,
        broker: Option<&dyn MinimalTarget>,
    ) -> (f64, String) {
        let start = Instant::now();
        let (done, claiming, publishing, marking) = self.drain_as("minimal", batch, broker).await;
        let elapsed = start.elapsed();
        assert_eq!(done, rows, "the minimal loop delivered every row");
        let share = |d: Duration| 100.0 * d.as_secs_f64() / elapsed.as_secs_f64();
        let mut split = format!("claim {:.0}%", share(claiming));
        if broker.is_some() {
            split.push_str(&format!(", publish {:.0}%", share(publishing)));
        }
        split.push_str(&format!(", mark {:.0}%", share(marking)));
        (rows as f64 / elapsed.as_secs_f64(), split)
    }

    /// One loop, as worker `worker`, until a claim finds nothing: rows
    /// delivered, and the time spent claiming, publishing and marking.
    async fn drain_as(
        &self,
        worker: &str,
        batch: u32,
        broker: Option<&dyn MinimalTarget>,
    ) -> (u64, Duration, Duration, Duration) {
        let mut done = 0u64;
        let (mut claiming, mut publishing, mut marking) =
            (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        loop {
            let t = Instant::now();
            let claimed = bounded("minimal claim", self.claim(worker, batch)).await;
            claiming += t.elapsed();
            if claimed.rows.is_empty() {
                break;
            }
            if let Some(broker) = broker {
                let t = Instant::now();
                bounded("minimal publish", broker.publish(&claimed.rows)).await;
                publishing += t.elapsed();
            }
            let t = Instant::now();
            done += bounded("minimal mark", self.mark(&claimed, worker)).await;
            marking += t.elapsed();
        }
        (done, claiming, publishing, marking)
    }

    /// `loops` loops side by side (each its own worker id and connection):
    /// events/s. What the machine gives a second relay of the simplest
    /// kind, the ceiling of postbox's two relays / one.
    async fn drain_side_by_side(&self, rows: u64, batch: u32, loops: usize) -> f64 {
        let start = Instant::now();
        let done: u64 =
            futures::future::join_all((0..loops).map(|i| async move {
                self.drain_as(&format!("minimal-{i}"), batch, None).await.0
            }))
            .await
            .into_iter()
            .sum();
        assert_eq!(done, rows, "the minimal loops delivered every row");
        rows as f64 / start.elapsed().as_secs_f64()
    }

    /// The index (or scan) the claim's `SELECT … FOR UPDATE SKIP LOCKED`
    /// reads through, from the plan the database picks now.
    async fn claim_plan(&self, limit: u32) -> String {
        let t = &self.table;
        let sql = format!(
            "EXPLAIN SELECT id FROM {t} WHERE app_code = '{APP}' AND status = 'pending' \
             ORDER BY id LIMIT {limit} FOR UPDATE SKIP LOCKED"
        );
        match &self.pool {
            MinimalPool::Pg(pool) => {
                let lines: Vec<String> = sqlx::query_scalar(&sql)
                    .fetch_all(pool)
                    .await
                    .expect("explain minimal claim");
                scans_in_plan(&lines.join("\n"))
            }
            MinimalPool::My(pool) => {
                let row = sqlx::raw_sql(&sql)
                    .fetch_one(pool)
                    .await
                    .expect("explain minimal claim");
                let key: Option<String> = row.try_get("key").expect("EXPLAIN key");
                let access: Option<String> = row.try_get("type").expect("EXPLAIN type");
                format!(
                    "{} ({})",
                    key.unwrap_or_else(|| "no index".to_owned()),
                    access.unwrap_or_default()
                )
            }
        }
    }

    async fn drop_table(self) {
        match self.pool {
            MinimalPool::Pg(p) => p.close().await,
            MinimalPool::My(p) => p.close().await,
        }
        exec(self.db, &format!("DROP TABLE IF EXISTS {}", self.table)).await;
    }
}

// ---------------------------------------------------------------------------
// postbox's side.

/// A migrated postbox table holding `rows` pending rows, analyzed.
async fn postbox_table(db: Db, rows: u64) -> Arc<dyn OutboxStore> {
    let table = scratch_table("cost_pb");
    let url = db.url();
    let store: Arc<dyn OutboxStore> = match db {
        Db::Postgres => Arc::new(PgOutbox::connect(&url, &table, 8).await.expect("connect")),
        Db::MySql => Arc::new(
            MySqlOutbox::connect(&url, &table, 8)
                .await
                .expect("connect"),
        ),
    };
    store.migrate().await.expect("migrate");
    load_pending(db, &table, rows, "ev-").await;
    store
}

/// Loads `rows` pending rows of [`APP`] (event ids `<prefix><n>`, an
/// aggregate per 1,000 rows) into a postbox table, then analyses it.
async fn load_pending(db: Db, table: &str, rows: u64, prefix: &str) {
    if rows == 0 {
        return;
    }
    let n = row_number(db);
    let load = load_sql(
        db,
        table,
        "app_code, event_id, event_type, aggregate_id, payload",
        &[
            format!("'{APP}'"),
            concat(db, prefix, n),
            "'BenchEvent'".to_owned(),
            concat(db, "agg-", &format!("({n} % 1000)")),
            payload_expr(db, n),
        ],
        rows,
    );
    exec(db, &load).await;
    analyze(db, table).await;
}

async fn drop_postbox_table(db: Db, table: &str) {
    let tables = EXPECTED_TABLES.map(|suffix| format!("{table}{suffix}"));
    exec(db, &format!("DROP TABLE IF EXISTS {}", tables.join(", "))).await;
    exec(
        db,
        &format!("DELETE FROM postbox_schema_migrations WHERE table_name = '{table}'"),
    )
    .await;
    if db == Db::Postgres {
        // The wake trigger's function outlives its table.
        exec(db, &format!("DROP FUNCTION IF EXISTS {table}_wake()")).await;
    }
}

/// Counts the events handed to the inner publisher, to know when to look.
struct Counting {
    inner: Arc<dyn Publisher>,
    offered: AtomicU64,
}

#[async_trait]
impl Publisher for Counting {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
        let r = self.inner.publish(batch).await;
        self.offered
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        r
    }

    async fn publish_each(
        &self,
        batch: &[Delivery<'_>],
        publish_timeout: Duration,
        results: &PublishResults,
    ) {
        self.inner
            .publish_each(batch, publish_timeout, results)
            .await;
        self.offered
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}

async fn dev_null() -> Arc<dyn Publisher> {
    Arc::new(
        FilePublisher::open(&FilePublisherConfig {
            name: None,
            path: "/dev/null".into(),
        })
        .await
        .expect("open /dev/null"),
    )
}

/// The real relay over `store` to `publisher` until every one of `rows`
/// rows is delivered. Returns events/s.
async fn relay_drain(
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    rows: u64,
    batch: u32,
) -> f64 {
    relays_drain(store, publisher, rows, batch, 1).await
}

/// [`relay_drain`] with `relays` relays (each its own worker id) side by
/// side on the one table.
async fn relays_drain(
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    rows: u64,
    batch: u32,
    relays: usize,
) -> f64 {
    let publisher = Arc::new(Counting {
        inner: publisher,
        offered: AtomicU64::new(0),
    });
    let config = WorkerConfig {
        batch_size: batch,
        poll_interval: HumanDuration::millis(50),
        ..WorkerConfig::default()
    };
    let shutdown = CancellationToken::new();
    let start = Instant::now();
    let tasks: Vec<_> = (0..relays)
        .map(|_| {
            let relay = Relay::new(
                store.clone(),
                vec![publisher.clone()],
                RelaySettings::new(config.clone(), vec![APP.to_owned()])
                    .expect("a valid [outbox_worker]"),
            );
            tokio::spawn(relay.run(shutdown.clone()))
        })
        .collect();
    let mut dog = Watchdog::new("relay publishing");
    loop {
        let offered = publisher.offered.load(Ordering::Relaxed);
        if offered >= rows {
            break;
        }
        dog.saw(offered);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Published all; wait for the last marks (pending and delivering are
    // exact counts; delivered may be an estimate).
    let mut dog = Watchdog::new("relay marking");
    loop {
        let s = app_stats(store.as_ref(), APP).await;
        assert_eq!(s.retryable + s.failed, 0, "no publish failed: {s:?}");
        let open = (s.pending + s.delivering) as u64;
        if open == 0 {
            break;
        }
        dog.saw(open);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    shutdown.cancel();
    let mut delivered = 0;
    for task in tasks {
        let report = bounded("relay shutdown", task)
            .await
            .expect("relay task")
            .expect("relay");
        delivered += report.delivered;
    }
    assert_eq!(delivered, rows, "the relays delivered every row once");
    rows as f64 / elapsed.as_secs_f64()
}

// ---------------------------------------------------------------------------
// Isolation between publishers.

/// A publisher that answers each batch after `delay`, or never (`None`:
/// the relay's `publish_timeout` ends each publish).
#[derive(Clone, Copy)]
struct Lagging {
    name: &'static str,
    delay: Option<Duration>,
}

#[async_trait]
impl Publisher for Lagging {
    fn name(&self) -> &str {
        self.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
        match self.delay {
            Some(delay) => {
                tokio::time::sleep(delay).await;
                batch.iter().map(|_| Ok(())).collect()
            }
            None => std::future::pending().await,
        }
    }
}

/// How fast a healthy publisher gets all of `rows` pending rows, beside
/// `beside` (if any): events/s, and the rows the relay deferred.
async fn isolation_run(db: Db, rows: u64, beside: Option<Lagging>) -> (f64, u64) {
    let store = postbox_table(db, rows).await;
    let table = store.table().as_str().to_owned();
    let healthy = Arc::new(Counting {
        inner: dev_null().await,
        offered: AtomicU64::new(0),
    });
    let mut publishers: Vec<Arc<dyn Publisher>> = vec![healthy.clone()];
    publishers.extend(beside.map(|p| Arc::new(p) as Arc<dyn Publisher>));
    let config = WorkerConfig {
        batch_size: DRAIN_BATCH,
        poll_interval: HumanDuration::millis(50),
        publish_timeout: HumanDuration::secs(1),
        max_retry_count: 1_000,
        ..WorkerConfig::default()
    };
    let settings =
        RelaySettings::new(config, vec![APP.to_owned()]).expect("a valid [outbox_worker]");
    let shutdown = CancellationToken::new();
    let start = Instant::now();
    let task = tokio::spawn(Relay::new(store.clone(), publishers, settings).run(shutdown.clone()));
    let mut dog = Watchdog::new("healthy publisher");
    loop {
        let offered = healthy.offered.load(Ordering::Relaxed);
        if offered >= rows {
            break;
        }
        dog.saw(offered);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    shutdown.cancel();
    let report = bounded("relay shutdown", task)
        .await
        .expect("relay task")
        .expect("relay");
    drop_postbox_table(db, &table).await;
    (rows as f64 / elapsed.as_secs_f64(), report.deferred)
}

async fn isolation_section(db: Db, rows: u64, runs: usize) {
    println!(
        "\n== isolation: {rows} rows, batch {DRAIN_BATCH}, the healthy publisher's rate (events/s) =="
    );
    let cases: [(&str, Option<Lagging>); 4] = [
        ("alone", None),
        (
            "beside another healthy one",
            Some(Lagging {
                name: "also-healthy",
                delay: Some(Duration::ZERO),
            }),
        ),
        (
            "beside a slow one (250 ms a batch)",
            Some(Lagging {
                name: "slow",
                delay: Some(Duration::from_millis(250)),
            }),
        ),
        (
            "beside a hung one (timeout 1 s)",
            Some(Lagging {
                name: "hung",
                delay: None,
            }),
        ),
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for run in 1..=runs {
        // The cases take turns, so drift on the machine touches each alike.
        for (i, (name, beside)) in cases.iter().enumerate() {
            let beside = *beside;
            let (rate, deferred) = isolation_run(db, rows, beside).await;
            println!("run {run}: {name:<36} {rate:>9.0}   ({deferred} rows deferred)");
            rates[i].push(rate);
        }
    }
    let alone = median(&rates[0]);
    println!("median: {:<35} {alone:>9.0}", cases[0].0);
    for (i, (name, _)) in cases.iter().enumerate().skip(1) {
        let m = median(&rates[i]);
        println!(
            "median: {name:<35} {m:>9.0}   ratio to alone {:.2} (target ≥ 0.9)",
            m / alone
        );
    }
}

// ---------------------------------------------------------------------------
// The servers' logs.

/// Reads the position of the server's log: PostgreSQL WAL bytes, MariaDB
/// `Innodb_os_log_written` once purge has caught up ([`purged`]).
enum LogMeter {
    Pg(sqlx::PgConnection),
    My(sqlx::MySqlConnection),
}

impl LogMeter {
    async fn connect(db: Db) -> LogMeter {
        match db {
            Db::Postgres => LogMeter::Pg(pg_connect(&db.url()).await),
            Db::MySql => LogMeter::My(mysql_connect(&db.url()).await),
        }
    }

    /// PostgreSQL: `CHECKPOINT`, so the first change of every page after
    /// it writes a full-page image, for both tables alike.
    async fn checkpoint(&mut self) {
        if let LogMeter::Pg(c) = self {
            sqlx::query("CHECKPOINT")
                .execute(&mut *c)
                .await
                .expect("CHECKPOINT");
        }
    }

    async fn bytes(&mut self) -> i64 {
        match self {
            LogMeter::Pg(c) => {
                sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::BIGINT")
                    .fetch_one(&mut *c)
                    .await
                    .expect("pg_current_wal_lsn")
            }
            LogMeter::My(c) => {
                purged(c).await;
                global_status(c, "Innodb_os_log_written").await
            }
        }
    }
}

/// A server-wide counter of `SHOW GLOBAL STATUS`.
async fn global_status(c: &mut sqlx::MySqlConnection, name: &str) -> i64 {
    let row = sqlx::raw_sql(&format!("SHOW GLOBAL STATUS LIKE '{name}'"))
        .fetch_one(&mut *c)
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let value: String = row.try_get(1).expect("status value");
    value.parse().expect("a number")
}

/// Waits (at most 60 s) for InnoDB's purge to catch up. An update leaves
/// the old secondary index entries and its undo record for the purge
/// thread, which removes them afterwards, writing redo of its own: read
/// without this wait, one drain's purge was counted in the next drain's
/// redo (the minimal loop's in postbox's, which ran after it).
async fn purged(c: &mut sqlx::MySqlConnection) {
    let until = Instant::now() + Duration::from_secs(60);
    let mut calm = 0;
    while Instant::now() < until {
        if global_status(c, "Innodb_history_list_length").await < 100 {
            calm += 1;
            // Twice in a row: purge batches can leave the list short
            // while its last pages are still being written.
            if calm == 2 {
                return;
            }
        } else {
            calm = 0;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("(purge still behind after 60 s: this reading counts part of it)");
}

/// One drain: events/s and log bytes per delivered event.
struct Drained {
    per_s: f64,
    log_per_event: f64,
    table_bytes: i64,
    /// The pending claim's plan right after loading.
    claim_plan: String,
    /// Where the minimal loop's time went.
    split: Option<String>,
}

/// Loads a minimal table and drains it with the minimal loop.
async fn drain_minimal(
    db: Db,
    rows: u64,
    batch: u32,
    broker: Option<&dyn MinimalTarget>,
    analysed: bool,
) -> Drained {
    let minimal = Minimal::create(db, rows, analysed).await;
    let table_bytes = table_bytes(db, &minimal.table).await;
    let claim_plan = minimal.claim_plan(batch).await;
    let mut meter = LogMeter::connect(db).await;
    meter.checkpoint().await;
    let before = meter.bytes().await;
    let (per_s, split) = minimal.drain(rows, batch, broker).await;
    let after = meter.bytes().await;
    minimal.drop_table().await;
    Drained {
        per_s,
        log_per_event: (after - before) as f64 / rows as f64,
        table_bytes,
        claim_plan,
        split: Some(split),
    }
}

/// Loads a postbox table and drains it with postbox's own claim and mark
/// statements, one after the other: what the
/// schema and statements cost without the relay's pipeline.
async fn drain_postbox_statements(db: Db, rows: u64, batch: u32) -> Drained {
    let store = postbox_table(db, rows).await;
    let table = store.table().as_str().to_owned();
    let table_bytes = table_bytes(db, &table).await;
    let mut meter = LogMeter::connect(db).await;
    meter.checkpoint().await;
    let before = meter.bytes().await;
    let req = ClaimRequest {
        app_code: APP,
        limit: batch,
        worker_id: "statements",
        lease_ms: LEASE_MS,
        ordered: false,
        skip_types: &[],
    };
    let start = Instant::now();
    let (mut claiming, mut marking, mut done) = (Duration::ZERO, Duration::ZERO, 0u64);
    loop {
        let t = Instant::now();
        let claimed = bounded("postbox claim", store.claim(ClaimSource::Pending, &req))
            .await
            .expect("claim");
        claiming += t.elapsed();
        if claimed.is_empty() {
            break;
        }
        let ids: Vec<i64> = claimed.iter().map(|c| c.record.id).collect();
        let t = Instant::now();
        done += bounded(
            "postbox mark",
            store.mark_delivered(&claimed[0].fence(), &ids),
        )
        .await
        .expect("mark");
        marking += t.elapsed();
    }
    let elapsed = start.elapsed();
    let after = meter.bytes().await;
    assert_eq!(done, rows, "postbox's statements delivered every row");
    drop_postbox_table(db, &table).await;
    let share = |d: Duration| 100.0 * d.as_secs_f64() / elapsed.as_secs_f64();
    Drained {
        per_s: rows as f64 / elapsed.as_secs_f64(),
        log_per_event: (after - before) as f64 / rows as f64,
        table_bytes,
        claim_plan: String::new(),
        split: Some(format!(
            "claim {:.0}%, mark {:.0}%",
            share(claiming),
            share(marking)
        )),
    }
}

/// What postbox's own `EXPLAIN` of its pending claim reads through.
async fn postbox_claim_plan(store: &dyn OutboxStore, limit: u32) -> String {
    let plans = store
        .explain_claims(APP, limit)
        .await
        .expect("explain postbox claims");
    let Some(p) = plans.iter().find(|p| p.query == "claim_pending") else {
        return "no claim_pending plan".to_owned();
    };
    let used = if p.plan.lines().any(|l| l.contains(" Scan ")) {
        scans_in_plan(&p.plan)
    } else {
        p.indexes_used.join(", ")
    };
    format!(
        "{used} (written for {}{})",
        p.expected_index,
        if p.full_scan { "; full scan" } else { "" }
    )
}

/// Loads a postbox table and drains it with the relay to `publisher`.
async fn drain_postbox(db: Db, rows: u64, batch: u32, publisher: Arc<dyn Publisher>) -> Drained {
    drain_postbox_with(db, rows, batch, publisher, 1).await
}

/// [`drain_postbox`] with `relays` relays side by side.
async fn drain_postbox_with(
    db: Db,
    rows: u64,
    batch: u32,
    publisher: Arc<dyn Publisher>,
    relays: usize,
) -> Drained {
    let store = postbox_table(db, rows).await;
    let table = store.table().as_str().to_owned();
    let table_bytes = table_bytes(db, &table).await;
    let claim_plan = postbox_claim_plan(store.as_ref(), batch).await;
    let mut meter = LogMeter::connect(db).await;
    meter.checkpoint().await;
    let before = meter.bytes().await;
    let per_s = relays_drain(store, publisher, rows, batch, relays).await;
    let after = meter.bytes().await;
    drop_postbox_table(db, &table).await;
    Drained {
        per_s,
        log_per_event: (after - before) as f64 / rows as f64,
        table_bytes,
        claim_plan,
        split: None,
    }
}

/// The pending claims' plans right after loading.
fn print_plans(minimal: &Drained, postbox: &Drained) {
    println!("pending claim plan: minimal {}", minimal.claim_plan);
    println!("pending claim plan: postbox {}", postbox.claim_plan);
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

// ---------------------------------------------------------------------------
// Section 1: drain.

async fn drain_section(db: Db, rows: u64, runs: usize) {
    let log = db.log();
    println!(
        "\n== drain: {rows} rows, batch_size {DRAIN_BATCH}; minimal loop vs relay to /dev/null =="
    );
    let (mut m, mut p, mut st, mut mi, mut tw, mut tm) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for run in 1..=runs {
        // Alternate which goes first, so neither always finds the warmer
        // server.
        let (mr, pr) = if run % 2 == 1 {
            let mr = drain_minimal(db, rows, DRAIN_BATCH, None, true).await;
            let pr = drain_postbox(db, rows, DRAIN_BATCH, dev_null().await).await;
            (mr, pr)
        } else {
            let pr = drain_postbox(db, rows, DRAIN_BATCH, dev_null().await).await;
            let mr = drain_minimal(db, rows, DRAIN_BATCH, None, true).await;
            (mr, pr)
        };
        // PostgreSQL: after ANALYZE of the loaded backlog the minimal
        // loop's claim reads the primary key (its `ORDER BY id` is that
        // order too) and filters out the rows it already delivered; the
        // same loop without statistics stays on its claim index, the
        // fairer baseline.
        if db == Db::Postgres {
            let r = drain_minimal(db, rows, DRAIN_BATCH, None, false).await;
            println!(
                "run {run}: minimal loop on its claim index (no statistics) {:>8.0} events/s {:>6.0} B {log}/event; plan {}",
                r.per_s, r.log_per_event, r.claim_plan
            );
            mi.push(r);
        }
        // For where the time goes: postbox's statements without the relay.
        let sr = drain_postbox_statements(db, rows, DRAIN_BATCH).await;
        // Two relays (two worker ids) on the one table.
        let two = drain_postbox_with(db, rows, DRAIN_BATCH, dev_null().await, 2).await;
        println!(
            "run {run}: two relays {:>8.0} events/s, {:.0} B {log}/event; two / one {:.2}",
            two.per_s,
            two.log_per_event,
            two.per_s / pr.per_s
        );
        tw.push(two);
        // The same machine's ceiling: two minimal loops side by side.
        let minimal = Minimal::create(db, rows, false).await;
        let one_loop = if db == Db::Postgres {
            mi.last().unwrap_or(&mr).per_s
        } else {
            mr.per_s
        };
        let two_loops = minimal.drain_side_by_side(rows, DRAIN_BATCH, 2).await;
        minimal.drop_table().await;
        println!(
            "run {run}: two minimal loops {two_loops:>8.0} events/s; two / one {:.2}",
            two_loops / one_loop
        );
        tm.push(two_loops / one_loop);
        if run == 1 {
            println!(
                "loaded: minimal {:.1} MiB, postbox {:.1} MiB (table and indexes)",
                mib(mr.table_bytes),
                mib(pr.table_bytes)
            );
            print_plans(&mr, &pr);
        }
        println!(
            "run {run}: minimal {:>8.0} events/s {:>6.0} B {log}/event | postbox {:>8.0} events/s {:>6.0} B {log}/event | postbox/minimal: events/s {:.2}, {log}/event {:.2}",
            mr.per_s,
            mr.log_per_event,
            pr.per_s,
            pr.log_per_event,
            pr.per_s / mr.per_s,
            pr.log_per_event / mr.log_per_event,
        );
        println!(
            "       (postbox's claim + mark statements back to back, no relay: {:.0} events/s, {:.0} B {log}/event; {}; minimal loop: {})",
            sr.per_s,
            sr.log_per_event,
            sr.split.as_deref().unwrap_or(""),
            mr.split.as_deref().unwrap_or(""),
        );
        m.push(mr);
        p.push(pr);
        st.push(sr);
    }
    let rate = |v: &[Drained]| median(&v.iter().map(|d| d.per_s).collect::<Vec<_>>());
    let bytes = |v: &[Drained]| median(&v.iter().map(|d| d.log_per_event).collect::<Vec<_>>());
    let (mr, pr, mb, pb) = (rate(&m), rate(&p), bytes(&m), bytes(&p));
    println!(
        "median: minimal {mr:.0} events/s, {mb:.0} B {log}/event; postbox {pr:.0} events/s, {pb:.0} B {log}/event; postbox statements without the relay {:.0} events/s",
        rate(&st)
    );
    println!(
        "ratio postbox/minimal: events/s {:.2}, {log} bytes/event {:.2}",
        pr / mr,
        pb / mb
    );
    println!(
        "ratio two relays / one: events/s {:.2} ({:.0} events/s; target >= 1.5); two minimal loops / one on the same machine: {:.2} (median of the runs' ratios)",
        rate(&tw) / pr,
        rate(&tw),
        median(&tm)
    );
    if !mi.is_empty() {
        let (ir, ib) = (rate(&mi), bytes(&mi));
        println!(
            "ratio postbox/minimal on its claim index ({ir:.0} events/s, {ib:.0} B {log}/event): events/s {:.2}, {log} bytes/event {:.2}",
            pr / ir,
            pb / ib
        );
    }
}

// ---------------------------------------------------------------------------
// Section 2: RabbitMQ.

/// A scratch durable topic exchange with a durable queue bound to `#`,
/// and a confirm-mode channel the minimal loop publishes on.
struct Broker {
    connection: Connection,
    setup: Channel,
    publish: Channel,
    exchange: String,
    queue: String,
}

/// The rates of a section's runs, minimal loop and postbox side by side.
#[derive(Default)]
struct Pairs {
    minimal: Vec<f64>,
    postbox: Vec<f64>,
}

impl Pairs {
    /// Prints and keeps one run's pair.
    fn add(&mut self, run: usize, minimal: &Drained, postbox: &Drained) {
        println!(
            "run {run}: minimal {:>8.0} events/s | postbox {:>8.0} events/s | postbox/minimal {:.2}   (minimal loop: {})",
            minimal.per_s,
            postbox.per_s,
            postbox.per_s / minimal.per_s,
            minimal.split.as_deref().unwrap_or(""),
        );
        self.minimal.push(minimal.per_s);
        self.postbox.push(postbox.per_s);
    }

    /// Prints the medians and their ratio; returns postbox's median.
    fn medians(&self) -> f64 {
        let (mm, pm) = (median(&self.minimal), median(&self.postbox));
        println!(
            "median: minimal {mm:.0} events/s, postbox {pm:.0} events/s, postbox/minimal = {:.2}",
            pm / mm
        );
        pm
    }
}

/// Where the minimal loop publishes a batch (and awaits its
/// confirmations) between its claim and its mark.
#[async_trait]
trait MinimalTarget: Sync {
    async fn publish(&self, rows: &[MinimalRow]);
}

#[async_trait]
impl MinimalTarget for Broker {
    async fn publish(&self, rows: &[MinimalRow]) {
        Broker::publish(self, rows).await
    }
}

impl Broker {
    async fn declare() -> Broker {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("connect to RabbitMQ: {e}"));
        let setup = connection.create_channel().await.expect("setup channel");
        let exchange = scratch_table("cost_x");
        let queue = scratch_table("cost_q");
        declare_topic_exchange(&setup, &exchange, Lifetime::Durable).await;
        declare_queue(&setup, &queue, Lifetime::Durable).await;
        bind_queue(&setup, &queue, &exchange, "#").await;
        let publish = connection.create_channel().await.expect("publish channel");
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        Broker {
            connection,
            setup,
            publish,
            exchange,
            queue,
        }
    }

    /// Publishes every row (persistent, mandatory), then awaits all
    /// confirms; panics on a nack or a return.
    async fn publish(&self, rows: &[MinimalRow]) {
        let mut confirms = Vec::with_capacity(rows.len());
        for r in rows {
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(r.event_id.as_str().into());
            let confirm = self
                .publish
                .basic_publish(
                    self.exchange.as_str().into(),
                    r.event_type.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    r.payload.as_bytes(),
                    properties,
                )
                .await
                .expect("basic.publish");
            confirms.push(confirm);
        }
        for c in confirms {
            let confirmation = c.await.expect("confirm");
            assert!(confirmation.is_ack(), "the broker nacked a message");
            assert!(
                confirmation.take_message().is_none(),
                "a message was unroutable"
            );
        }
    }

    /// The RabbitMQ publisher of postbox to this exchange.
    async fn postbox_publisher(&self) -> Arc<dyn Publisher> {
        let config = RabbitMqPublisherConfig {
            name: Some("bench".to_owned()),
            ..RabbitMqPublisherConfig::new(SecretUrl::new(amqp_url()), self.exchange.clone())
        };
        Arc::new(
            RabbitMqPublisher::connect(&config)
                .await
                .expect("RabbitMQ publisher"),
        )
    }

    /// Empties the queue; returns how many messages it held.
    async fn purge(&self) -> u32 {
        self.setup
            .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
            .await
            .expect("purge queue")
    }

    async fn delete(self) {
        self.setup
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .expect("delete queue");
        self.setup
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .expect("delete exchange");
        let _ = self.connection.close(200, "done".into()).await;
    }
}

async fn rabbitmq_section(db: Db, rows: u64, runs: usize) {
    println!(
        "\n== rabbitmq: {rows} rows, batch_size {RABBIT_BATCH}; minimal loop + lapin vs relay + RabbitMQ publisher (persistent, mandatory, confirms) =="
    );
    let broker = Broker::declare().await;
    let (mut pairs, mut mi) = (Pairs::default(), Vec::new());
    for run in 1..=runs {
        // `analysed`: the minimal loop's table (see the drain section).
        let one = |postbox: bool, analysed: bool| {
            let broker = &broker;
            async move {
                let d = if postbox {
                    let publisher = broker.postbox_publisher().await;
                    drain_postbox(db, rows, RABBIT_BATCH, publisher).await
                } else {
                    drain_minimal(db, rows, RABBIT_BATCH, Some(broker), analysed).await
                };
                let queued = broker.purge().await;
                assert!(
                    u64::from(queued) >= rows,
                    "the queue held {queued} of {rows} messages"
                );
                d
            }
        };
        let (mr, pr) = if run % 2 == 1 {
            let mr = one(false, true).await;
            (mr, one(true, true).await)
        } else {
            let pr = one(true, true).await;
            (one(false, true).await, pr)
        };
        if run == 1 {
            print_plans(&mr, &pr);
        }
        if db == Db::Postgres {
            let r = one(false, false).await;
            println!(
                "run {run}: minimal loop on its claim index (no statistics) {:>8.0} events/s   (minimal loop: {})",
                r.per_s,
                r.split.as_deref().unwrap_or("")
            );
            mi.push(r.per_s);
        }
        pairs.add(run, &mr, &pr);
    }
    broker.delete().await;
    let pm = pairs.medians();
    if !mi.is_empty() {
        let im = median(&mi);
        println!(
            "median: minimal loop on its claim index {im:.0} events/s, postbox/minimal = {:.2} (target >= 1.1)",
            pm / im
        );
    }
}

// ---------------------------------------------------------------------------
// Section: NATS JetStream.

/// A scratch JetStream stream (file storage) capturing `<subject>.>`.
struct Stream {
    js: async_nats::jetstream::Context,
    name: String,
    subject: String,
}

impl Stream {
    async fn declare() -> Stream {
        let client = async_nats::connect(postbox_testkit::servers::nats_url())
            .await
            .unwrap_or_else(|e| panic!("connect to NATS: {e}"));
        let js = async_nats::jetstream::new(client);
        let name = scratch_table("cost_s");
        let subject = scratch_table("cost_subj");
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{subject}.>")],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create stream {name}: {e}"));
        Stream { js, name, subject }
    }

    /// The postbox NATS publisher to this stream.
    async fn postbox_publisher(&self) -> Arc<dyn Publisher> {
        let mut config = NatsPublisherConfig::new(
            SecretUrl::new(postbox_testkit::servers::nats_url()),
            self.name.clone(),
        );
        config.name = Some("bench".to_owned());
        config.subject =
            postbox_core::template::Template::parse(&format!("{}.{{event_type}}", self.subject))
                .expect("subject template");
        Arc::new(
            NatsPublisher::connect(&config)
                .await
                .expect("NATS publisher"),
        )
    }

    /// How many messages the stream holds.
    async fn held(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.name).await.expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    async fn delete(self) {
        self.js
            .delete_stream(&self.name)
            .await
            .expect("delete stream");
    }
}

#[async_trait]
impl MinimalTarget for Stream {
    /// Publishes every row (message id = event_id, for JetStream's
    /// dedupe), then awaits every PubAck.
    async fn publish(&self, rows: &[MinimalRow]) {
        let mut acks = Vec::with_capacity(rows.len());
        for r in rows {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", r.event_id.as_str());
            let ack = self
                .js
                .publish_with_headers(
                    format!("{}.{}", self.subject, r.event_type),
                    headers,
                    r.payload.clone().into(),
                )
                .await
                .expect("publish");
            acks.push(ack);
        }
        for ack in
            futures::future::join_all(acks.into_iter().map(std::future::IntoFuture::into_future))
                .await
        {
            ack.expect("PubAck");
        }
    }
}

async fn nats_section(db: Db, rows: u64, runs: usize) {
    println!(
        "\n== nats: {rows} rows, batch_size {RABBIT_BATCH}; minimal loop + async-nats vs relay + NATS publisher (JetStream, every PubAck awaited) =="
    );
    let mut pairs = Pairs::default();
    // A stream per drain: JetStream drops a message id it stored within
    // its duplicate window, and each drain's rows have the same ids.
    let one = |postbox: bool| async move {
        let stream = Stream::declare().await;
        let d = if postbox {
            let publisher = stream.postbox_publisher().await;
            drain_postbox(db, rows, RABBIT_BATCH, publisher).await
        } else {
            drain_minimal(db, rows, RABBIT_BATCH, Some(&stream), true).await
        };
        let held = stream.held().await;
        assert!(held >= rows, "the stream held {held} of {rows} messages");
        stream.delete().await;
        d
    };
    for run in 1..=runs {
        let (mr, pr) = if run % 2 == 1 {
            let mr = one(false).await;
            (mr, one(true).await)
        } else {
            let pr = one(true).await;
            (one(false).await, pr)
        };
        pairs.add(run, &mr, &pr);
    }
    pairs.medians();
}

// ---------------------------------------------------------------------------
// Section 3: producer.

const ACCOUNTS: i64 = 1000;
const PRODUCER_TX: u64 = 5000;
const PRODUCER_TIME: Duration = Duration::from_secs(5);
const PRODUCER_SLICE: u64 = 250;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Variant {
    /// The business transaction alone.
    Business,
    /// Plus `enqueue` through the Rust API.
    Enqueue,
    /// Plus `docs/plain-insert.<db>.sql` into the postbox table.
    PlainInsert,
    /// Plus an INSERT into the minimal table of the drain section: what any
    /// outbox row costs, for reference.
    MinimalInsert,
    /// The outbox row goes with the business statement, no round trip
    /// added: `docs/plain-insert-in-the-change.postgres.sql` (one
    /// data-modifying CTE) or `.mysql.sql` (the UPDATE, checking the
    /// version it read, and the INSERT in one multi-statement query, its
    /// values inlined as a driver that prepares client-side sends them).
    InTheChange,
}

impl Variant {
    /// The variants `db` runs.
    fn all() -> Vec<Variant> {
        vec![
            Variant::Business,
            Variant::Enqueue,
            Variant::PlainInsert,
            Variant::MinimalInsert,
            Variant::InTheChange,
        ]
    }

    fn label(self) -> &'static str {
        match self {
            Variant::Business => "business",
            Variant::Enqueue => "+enqueue",
            Variant::PlainInsert => "+plain INSERT",
            Variant::MinimalInsert => "+minimal INSERT",
            Variant::InTheChange => "in the change",
        }
    }
}

/// The producer's statements, rendered for its tables.
struct ProducerSql {
    /// The business statement, bound to the account id.
    update: String,
    /// `docs/plain-insert.<db>.sql` for the postbox table.
    plain_insert: String,
    /// `(app_code, event_id, event_type, payload)` into the minimal table.
    minimal_insert: String,
    /// The business statement with the outbox row in it.
    in_the_change: String,
    /// Whether `in_the_change` is several statements, sent as text with
    /// its values inlined (MySQL: the server prepares one at a time).
    in_the_change_as_text: bool,
}

impl ProducerSql {
    /// The statements on `accounts`, `minimal` and the postbox `table`
    /// (from `plain_insert`'s text) with the database's placeholders `p`.
    fn new(db: Db, accounts: &str, minimal: &str, table: &str) -> Self {
        let (plain_insert, in_the_change, [p1, p2, p3, p4]) = match db {
            Db::Postgres => (PLAIN_INSERT_PG, IN_THE_CHANGE_PG, ["$1", "$2", "$3", "$4"]),
            Db::MySql => (PLAIN_INSERT_MYSQL, IN_THE_CHANGE_MYSQL, ["?"; 4]),
        };
        ProducerSql {
            update: format!(
                "UPDATE {accounts} SET balance = balance + 1, version = version + 1 WHERE id = {p1}"
            ),
            plain_insert: plain_insert.trim().replace("room_outbox", table),
            minimal_insert: format!(
                "INSERT INTO {minimal} (app_code, event_id, event_type, payload) VALUES ({p1}, {p2}, {p3}, {p4})"
            ),
            in_the_change: in_the_change
                .trim()
                .replace("room_outbox", table)
                .replace("accounts", accounts),
            in_the_change_as_text: db == Db::MySql,
        }
    }
}

/// A pool of at most `connections` to `url`.
async fn open_pool<DB: sqlx::Database>(url: &str, connections: u32) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(connections)
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("a pool to {url}: {e}"))
}

/// One producer connection, with the outbox `enqueue` writes through it.
enum Producer {
    Pg(PgPool, PgOutbox),
    My(MySqlPool, MySqlOutbox),
}

fn account_payload(k: i64, version: i64) -> String {
    format!("{{\"account\":{k},\"delta\":1,\"version\":{version},\"pad\":\"{PAD}\"}}")
}

/// The body of [`Producer::transaction`], the same on either driver.
macro_rules! business_transaction {
    ($pool:expr, $outbox:expr, $sql:expr, $variant:expr, $k:expr, $version:expr) => {{
        let (k, version) = ($k, $version);
        let aggregate = format!("acct-{k}");
        let mut tx = $pool.begin().await.expect("begin");
        if $variant != Variant::InTheChange {
            sqlx::query(&$sql.update)
                .bind(k)
                .execute(&mut *tx)
                .await
                .expect("business update");
        }
        match $variant {
            Variant::Business => {}
            Variant::InTheChange if $sql.in_the_change_as_text => {
                let payload = account_payload(k, version);
                let statements = interpolate(
                    &$sql.in_the_change,
                    &[
                        Literal::Int(k),
                        Literal::Int(version - 1),
                        Literal::Text(APP),
                        Literal::Text(&new_event_id()),
                        Literal::Text("BalanceChanged"),
                        Literal::Text(&aggregate),
                        Literal::Int(version),
                        Literal::Text(&payload),
                        Literal::Null,
                    ],
                );
                sqlx::raw_sql(&statements)
                    .execute(&mut *tx)
                    .await
                    .expect("business update with its outbox row");
            }
            Variant::InTheChange => {
                sqlx::query(&$sql.in_the_change)
                    .bind(k)
                    .bind(APP)
                    .bind(new_event_id())
                    .bind("BalanceChanged")
                    .bind(account_payload(k, version))
                    .bind(None::<String>)
                    .execute(&mut *tx)
                    .await
                    .expect("business update with its outbox row");
            }
            Variant::Enqueue => {
                let event = NewEvent::new(APP, "BalanceChanged", account_payload(k, version))
                    .aggregate(aggregate, version);
                $outbox.enqueue(&mut tx, &event).await.expect("enqueue");
            }
            Variant::PlainInsert => {
                sqlx::query(&$sql.plain_insert)
                    .bind(APP)
                    .bind(new_event_id())
                    .bind("BalanceChanged")
                    .bind(aggregate)
                    .bind(version)
                    .bind(account_payload(k, version))
                    .bind(None::<String>)
                    .execute(&mut *tx)
                    .await
                    .expect("plain insert");
            }
            Variant::MinimalInsert => {
                sqlx::query(&$sql.minimal_insert)
                    .bind(APP)
                    .bind(new_event_id())
                    .bind("BalanceChanged")
                    .bind(account_payload(k, version))
                    .execute(&mut *tx)
                    .await
                    .expect("minimal insert");
            }
        }
        tx.commit().await.expect("commit");
    }};
}

impl Producer {
    /// One business transaction on account `k` (now at `version`), with
    /// the variant's outbox write.
    async fn transaction(&self, sql: &ProducerSql, variant: Variant, k: i64, version: i64) {
        match self {
            Producer::Pg(pool, outbox) => {
                business_transaction!(pool, outbox, sql, variant, k, version)
            }
            Producer::My(pool, outbox) => {
                business_transaction!(pool, outbox, sql, variant, k, version)
            }
        }
    }
}

/// Business transactions in order over the accounts, each account's
/// version tracked as the database counts it.
struct Accounts {
    next: i64,
    versions: Vec<i64>,
}

impl Accounts {
    /// The next account and its version after this transaction.
    fn next(&mut self) -> (i64, i64) {
        let k = self.next % ACCOUNTS + 1;
        self.next += 1;
        let v = &mut self.versions[(k - 1) as usize];
        *v += 1;
        (k, *v)
    }
}

/// Runs `n` transactions of `variant`; returns how long they took.
async fn produce(
    producer: &Producer,
    sql: &ProducerSql,
    variant: Variant,
    n: u64,
    accounts: &mut Accounts,
) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        let (k, version) = accounts.next();
        bounded(
            "producer transaction",
            producer.transaction(sql, variant, k, version),
        )
        .await;
    }
    start.elapsed()
}

/// One run: slices of [`PRODUCER_SLICE`] transactions, the variants taking
/// turns (starting with the `first`th), until each ran [`PRODUCER_TX`]
/// or for [`PRODUCER_TIME`]. Slow drifts of the disk's commit latency
/// then hit every variant alike. Returns tx/s per variant.
async fn producer_run(
    producer: &Producer,
    sql: &ProducerSql,
    variants: &[Variant],
    first: usize,
    accounts: &mut Accounts,
) -> HashMap<Variant, f64> {
    let mut order = variants.to_vec();
    order.rotate_left(first % variants.len());
    let mut spent: HashMap<Variant, (u64, Duration)> = HashMap::new();
    loop {
        let mut ran = false;
        for &v in &order {
            let (n, t) = spent.entry(v).or_default();
            if *n >= PRODUCER_TX || *t >= PRODUCER_TIME {
                continue;
            }
            *t += produce(producer, sql, v, PRODUCER_SLICE, accounts).await;
            *n += PRODUCER_SLICE;
            ran = true;
        }
        if !ran {
            break;
        }
    }
    spent
        .into_iter()
        .map(|(v, (n, t))| (v, n as f64 / t.as_secs_f64()))
        .collect()
}

async fn producer_section(db: Db, runs: usize) {
    println!(
        "\n== producer: one connection, up to {PRODUCER_TX} transactions or {PRODUCER_TIME:?} per variant and run, variants taking turns every {PRODUCER_SLICE} =="
    );
    let url = db.url();
    let accounts = scratch_table("cost_acct");
    let (create, load) = match db {
        Db::Postgres => (
            format!("CREATE TABLE {accounts} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, version BIGINT NOT NULL)"),
            format!("INSERT INTO {accounts} SELECT g, 0, 0 FROM generate_series(1, {ACCOUNTS}) g"),
        ),
        Db::MySql => (
            format!("CREATE TABLE {accounts} (id BIGINT NOT NULL PRIMARY KEY, balance BIGINT NOT NULL, version BIGINT NOT NULL) ENGINE=InnoDB"),
            format!("INSERT INTO {accounts} SELECT seq, 0, 0 FROM seq_1_to_{ACCOUNTS}"),
        ),
    };
    exec(db, &create).await;
    exec(db, &load).await;
    analyze(db, &accounts).await;
    let minimal = scratch_table("cost_pmin");
    create_minimal_table(db, &minimal).await;
    let table = scratch_table("cost_prod");
    let producer = match db {
        Db::Postgres => {
            let pool = open_pool(&url, 1).await;
            let outbox = PgOutbox::new(pool.clone(), &table).expect("outbox");
            outbox.migrate().await.expect("migrate");
            Producer::Pg(pool, outbox)
        }
        Db::MySql => {
            let pool = open_pool(&url, 1).await;
            let outbox = MySqlOutbox::new(pool.clone(), &table).expect("outbox");
            outbox.migrate().await.expect("migrate");
            Producer::My(pool, outbox)
        }
    };
    let sql = ProducerSql::new(db, &accounts, &minimal, &table);
    let mut acc = Accounts {
        next: 0,
        versions: vec![0; ACCOUNTS as usize],
    };
    let variants = Variant::all();
    // Warm-up: the connection, prepared statements, caches.
    for &v in &variants {
        produce(&producer, &sql, v, 300, &mut acc).await;
    }
    let mut rates: HashMap<Variant, Vec<f64>> = HashMap::new();
    let mut ratios: HashMap<Variant, Vec<f64>> = HashMap::new();
    let overheads = |rate: &dyn Fn(Variant) -> f64| {
        let b = rate(Variant::Business);
        format!(
            "enqueue {:.3}, plain INSERT {:.3}, in the change {:.3} (minimal INSERT {:.3})",
            b / rate(Variant::Enqueue),
            b / rate(Variant::PlainInsert),
            b / rate(Variant::InTheChange),
            b / rate(Variant::MinimalInsert)
        )
    };
    for run in 1..=runs {
        // Each run starts with another variant.
        let this = producer_run(&producer, &sql, &variants, run - 1, &mut acc).await;
        for &v in &variants {
            rates.entry(v).or_default().push(this[&v]);
            ratios
                .entry(v)
                .or_default()
                .push(this[&Variant::Business] / this[&v]);
        }
        let mut line = format!("run {run}:");
        for &v in &variants {
            line.push_str(&format!("  {} {:>5.0} tx/s", v.label(), this[&v]));
        }
        println!("{line}  | overhead {}", overheads(&|v| this[&v]));
    }
    let med = |v: Variant| median(&rates[&v]);
    let line: Vec<String> = variants
        .iter()
        .map(|&v| format!("{} {:.0} tx/s", v.label(), med(v)))
        .collect();
    println!("median: {}", line.join(", "));
    println!(
        "producer overhead business/postbox (target <= 1.15), from the medians: {}",
        overheads(&med)
    );
    let of = |v: Variant| median(&ratios[&v]);
    println!(
        "producer overhead, median of the runs' own ratios: {}",
        overheads(&|v| 1.0 / of(v))
    );
    match producer {
        Producer::Pg(pool, _) => pool.close().await,
        Producer::My(pool, _) => pool.close().await,
    }
    drop_postbox_table(db, &table).await;
    exec(db, &format!("DROP TABLE IF EXISTS {accounts}, {minimal}")).await;
}

// ---------------------------------------------------------------------------
// Section 4: latency and idle cost (PostgreSQL).

const LATENCY_EVENTS: u64 = 10_000;
const LATENCY_RATE_PER_S: u64 = 1000;
const IDLE_BEFORE: Duration = Duration::from_secs(3);
const IDLE_WINDOW: Duration = Duration::from_secs(10);
/// How late a backend's counts can reach `pg_stat_database`: PostgreSQL 15
/// flushes them at most once a second, and a backend that goes idle within
/// a second of its last flush flushes after `PGSTAT_IDLE_INTERVAL` (10 s).
/// Without this wait the busy phase's last counts land in the idle window
/// (seen as bursts of ~60 transactions).
const STATS_SETTLE: Duration = Duration::from_secs(11);

/// Records when each event was first handed to it.
#[derive(Default)]
struct Stamps {
    at: Mutex<HashMap<String, Instant>>,
    count: AtomicU64,
}

#[async_trait]
impl Publisher for Stamps {
    fn name(&self) -> &str {
        "stamps"
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<Result<(), PublishError>> {
        let now = Instant::now();
        let mut at = self.at.lock().expect("stamps lock");
        for d in batch {
            at.entry(d.record.event_id.clone()).or_insert(now);
        }
        self.count.fetch_add(batch.len() as u64, Ordering::Relaxed);
        vec![Ok(()); batch.len()]
    }
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (base, rest) = url.rsplit_once('/').expect("a URL with a database path");
    let query = rest.find('?').map_or("", |i| &rest[i..]);
    format!("{base}/{database}{query}")
}

/// `(xact_commit, xact_rollback)` of `database`, on a fresh stats snapshot.
async fn xacts(c: &mut sqlx::PgConnection, database: &str) -> (i64, i64) {
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *c)
        .await
        .expect("pg_stat_clear_snapshot");
    sqlx::query_as("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1")
        .bind(database)
        .fetch_one(&mut *c)
        .await
        .expect("pg_stat_database")
}

struct LatencyCase {
    label: &'static str,
    wake: WakeMode,
    enqueue: bool,
}

async fn latency_section() {
    println!(
        "\n== latency: default [outbox_worker] (poll_interval 1s), {LATENCY_EVENTS} events at {LATENCY_RATE_PER_S}/s, 1 per transaction; database {IDLE_DB} =="
    );
    let url = with_database(&postgres_url(), IDLE_DB);
    ensure_database("postgres", &url).await;
    let cases = [
        LatencyCase {
            label: "notify/plain-insert",
            wake: WakeMode::Notify,
            enqueue: false,
        },
        LatencyCase {
            label: "poll/plain-insert",
            wake: WakeMode::Poll,
            enqueue: false,
        },
        LatencyCase {
            label: "notify/enqueue",
            wake: WakeMode::Notify,
            enqueue: true,
        },
    ];
    for case in cases {
        latency_case(&url, &case).await;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn latency_case(url: &str, case: &LatencyCase) {
    let table = scratch_table("cost_lat");
    let relay_store = PgOutbox::connect(url, &table, 4)
        .await
        .expect("relay store");
    relay_store.migrate().await.expect("migrate");
    let store: Arc<dyn OutboxStore> = Arc::new(relay_store);
    let stamps = Arc::new(Stamps::default());
    let config = WorkerConfig {
        wake: case.wake,
        ..WorkerConfig::default()
    };
    let relay = Relay::new(
        store.clone(),
        vec![stamps.clone() as Arc<dyn Publisher>],
        RelaySettings::new(config, vec![APP.to_owned()]).expect("a valid [outbox_worker]"),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(relay.run(shutdown.clone()));
    // Let it start, LISTEN and settle into idle polling.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Read from another database: the reading connection's own
    // transactions are not counted in `IDLE_DB`'s row.
    let mut reader = pg_connect(&with_database(url, "postgres")).await;
    let (before_run, _) = xacts(&mut reader, IDLE_DB).await;

    // The producer: one event per transaction, paced by an interval, each
    // transaction a task of its own over a pool of 4 so a slow commit does
    // not hold up the pace.
    let pool: PgPool = open_pool(url, 4).await;
    // Another store instance: its wake handle is not the relay's.
    let outbox = PgOutbox::new(pool.clone(), &table).expect("producer outbox");
    let insert = Arc::new(PLAIN_INSERT_PG.trim().replace("room_outbox", &table));
    // event_id → (sequence number, commit instant).
    let commits: Arc<Mutex<HashMap<String, (u64, Instant)>>> = Arc::default();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / LATENCY_RATE_PER_S));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for i in 0..LATENCY_EVENTS {
        tick.tick().await;
        let (pool, outbox, insert, commits) = (
            pool.clone(),
            outbox.clone(),
            insert.clone(),
            commits.clone(),
        );
        let enqueue = case.enqueue;
        tasks.spawn(async move {
            let payload = format!("{{\"n\":{i},\"pad\":\"{PAD}\"}}");
            let mut tx = pool.begin().await.expect("begin");
            let event_id = if enqueue {
                let event = NewEvent::new(APP, "BenchEvent", payload);
                let id = event.event_id.clone();
                outbox.enqueue(&mut tx, &event).await.expect("enqueue");
                id
            } else {
                let id = new_event_id();
                sqlx::query(&insert)
                    .bind(APP)
                    .bind(&id)
                    .bind("BenchEvent")
                    .bind(None::<String>)
                    .bind(None::<i64>)
                    .bind(payload)
                    .bind(None::<String>)
                    .execute(&mut *tx)
                    .await
                    .expect("plain insert");
                id
            };
            tx.commit().await.expect("commit");
            let at = Instant::now();
            commits
                .lock()
                .expect("commits lock")
                .insert(event_id, (i, at));
        });
    }
    bounded("producer tasks", async {
        while let Some(r) = tasks.join_next().await {
            r.expect("producer task");
        }
    })
    .await;
    let produced_in = started.elapsed();
    pool.close().await;

    let mut dog = Watchdog::new("latency: relay publishing");
    loop {
        let n = stamps.count.load(Ordering::Relaxed);
        if n >= LATENCY_EVENTS {
            break;
        }
        dog.saw(n);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Latencies of all events, and of those after the first second (the
    // first events may find the relay asleep in its idle poll).
    let (mut lat, mut later): (Vec<Duration>, Vec<Duration>) = (Vec::new(), Vec::new());
    {
        let commits = commits.lock().expect("commits lock");
        let at = stamps.at.lock().expect("stamps lock");
        assert_eq!(
            commits.len() as u64,
            LATENCY_EVENTS,
            "every commit recorded"
        );
        for (id, (i, committed)) in commits.iter() {
            let published = at
                .get(id)
                .unwrap_or_else(|| panic!("{id} was never published"));
            let l = published.saturating_duration_since(*committed);
            lat.push(l);
            if *i >= LATENCY_RATE_PER_S {
                later.push(l);
            }
        }
    }
    let pick = |v: &mut Vec<Duration>, q: usize| {
        v.sort();
        v[(v.len() * q / 100).min(v.len() - 1)]
    };
    let (p50, p99, max) = (pick(&mut lat, 50), pick(&mut lat, 99), pick(&mut lat, 100));
    let later_p99 = pick(&mut later, 99);

    // Idle: the rows just written leave autovacuum nothing to do in the
    // window; then nothing but the relay touches the database.
    {
        let mut c = pg_connect(url).await;
        sqlx::query(&format!("VACUUM ANALYZE {table}"))
            .execute(&mut c)
            .await
            .expect("vacuum");
        c.close().await.expect("close");
    }
    // Idle for IDLE_BEFORE, and long enough for the busy phase's counts
    // to have landed.
    tokio::time::sleep(IDLE_BEFORE.max(STATS_SETTLE)).await;
    // Read every second, to show how the window's transactions spread.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (c0, r0) = xacts(&mut reader, IDLE_DB).await;
    // Everything since the relay settled: the producer's commits, the
    // relay's claims and marks, a VACUUM and ~15 idle probes.
    let relay_per_event = (c0 - before_run - LATENCY_EVENTS as i64) as f64 / LATENCY_EVENTS as f64;
    let mut per_second = Vec::new();
    let mut last = c0;
    let window = Instant::now();
    for s in 1..=IDLE_WINDOW.as_secs() {
        let at = window + Duration::from_secs(s);
        tokio::time::sleep(at.saturating_duration_since(Instant::now())).await;
        let (c, _) = xacts(&mut reader, IDLE_DB).await;
        per_second.push((c - last).to_string());
        last = c;
    }
    let (c1, r1) = xacts(&mut reader, IDLE_DB).await;

    shutdown.cancel();
    let report = bounded("relay shutdown", task)
        .await
        .expect("relay task")
        .expect("relay");
    assert_eq!(report.delivered, LATENCY_EVENTS, "every event delivered");
    drop(store);
    {
        let mut c = pg_connect(url).await;
        for sql in [
            format!("DROP TABLE IF EXISTS {table}, {table}_archive, {table}_history"),
            format!("DROP FUNCTION IF EXISTS {table}_wake()"),
        ] {
            sqlx::query(&sql).execute(&mut c).await.expect("drop");
        }
    }
    let rollbacks = if r1 > r0 {
        format!(" (+{} rollbacks)", r1 - r0)
    } else {
        String::new()
    };
    println!(
        "{}: p50 {:.1} ms p99 {:.1} ms max {:.0} ms; idle {:.1} tx/{}s{rollbacks}   [p99 after the first second {:.1} ms; {LATENCY_EVENTS} events in {:.1} s = {:.0}/s; relay ~{:.2} tx/event while busy; idle tx per second: {}]",
        case.label,
        ms(p50),
        ms(p99),
        ms(max),
        (c1 - c0) as f64,
        IDLE_WINDOW.as_secs(),
        ms(later_p99),
        produced_in.as_secs_f64(),
        LATENCY_EVENTS as f64 / produced_in.as_secs_f64(),
        relay_per_event,
        per_second.join(" "),
    );
}

// ---------------------------------------------------------------------------
// Section 5: history.

/// A config file for the `postbox` binary: `table` of the bench database,
/// app_code [`APP`], the `file` publisher to `/dev/null`.
fn binary_config(db: Db, table: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join(format!("{table}.toml"));
    let toml = format!(
        "[database]\nurl = \"{}\"\ntable = \"{table}\"\napp_codes = [\"{APP}\"]\n\n\
         [outbox_worker]\nbatch_size = {DRAIN_BATCH}\npoll_interval = \"50ms\"\n\n\
         [[publishers]]\nkind = \"file\"\npath = \"/dev/null\"\n",
        db.url()
    );
    std::fs::write(&path, toml).expect("write the config");
    path
}

fn postbox_binary(config: &std::path::Path) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_postbox"));
    c.arg("--config").arg(config);
    c
}

/// `postbox status` from start to exit, median of 5, in ms.
fn status_ms(config: &std::path::Path) -> f64 {
    let mut times = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let out = postbox_binary(config)
            .arg("status")
            .output()
            .expect("run postbox status");
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        assert!(
            out.status.success(),
            "postbox status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    median(&times)
}

/// The stats poller's query for [`APP`], median of 20, in ms.
async fn stats_ms(store: &dyn OutboxStore) -> f64 {
    let mut times = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        store.stats(&[APP.to_owned()]).await.expect("stats");
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    median(&times)
}

/// A `/proc/<pid>/status` field in KiB (`VmRSS`, `VmHWM`).
fn proc_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// `postbox relay` as a process over `store`'s table until `rows` more rows
/// are delivered: (events/s, peak resident MiB).
async fn binary_relay(config: &std::path::Path, store: &dyn OutboxStore, rows: u64) -> (f64, f64) {
    let started = Instant::now();
    // Its log goes to a file: a pipe nobody reads could fill and stall it.
    let log_path = config.with_extension("relay.log");
    let log = std::fs::File::create(&log_path).expect("create the relay's log file");
    let mut child = postbox_binary(config)
        .arg("relay")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start postbox relay");
    let pid = child.id();
    let mut dog = Watchdog::new("postbox relay draining");
    let mut peak_kib = 0;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let err = std::fs::read_to_string(&log_path).unwrap_or_default();
            panic!("postbox relay exited early ({status}): {err}");
        }
        peak_kib = peak_kib.max(proc_kib(pid, "VmHWM").unwrap_or(0));
        let s = app_stats(store, APP).await;
        let open = (s.pending + s.delivering) as u64;
        if open == 0 {
            break;
        }
        dog.saw(open);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let per_s = rows as f64 / started.elapsed().as_secs_f64();
    peak_kib = peak_kib.max(proc_kib(pid, "VmHWM").unwrap_or(0));
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let status = bounded("postbox relay shutdown", async {
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(status.success(), "postbox relay exited with {status}");
    (per_s, peak_kib as f64 / 1024.0)
}

async fn history_section(db: Db, history: u64, rows: u64, runs: usize) {
    println!(
        "\n== history: {rows} rows drained beside {history} delivered rows vs on an empty table (relay to /dev/null, batch_size {DRAIN_BATCH}) =="
    );
    let dir = tempfile::tempdir().expect("a temporary directory");
    let full = postbox_table(db, 0).await;
    let t = full.table().as_str().to_owned();
    let n = row_number(db);
    let loading = Instant::now();
    // In slices, so that no single statement holds a 10 M-row transaction.
    let slice = 1_000_000u64;
    let mut loaded = 0;
    while loaded < history {
        let count = slice.min(history - loaded);
        let at = format!("({n} + {loaded})");
        let load = load_sql(
            db,
            &t,
            "app_code, event_id, event_type, payload, status, next_retry_at_ms, created_at_ms, updated_at_ms",
            &[
                format!("'{APP}'"),
                concat(db, "old-", &at),
                "'OldEvent'".to_owned(),
                payload_expr(db, &at),
                "'delivered'".to_owned(),
                format!("1000000000000 + {at}"),
                format!("1000000000000 + {at}"),
                format!("1000000000000 + {at}"),
            ],
            count,
        );
        exec(db, &load).await;
        loaded += count;
        println!(
            "  loaded {loaded} of {history} delivered rows ({:.0?})",
            loading.elapsed()
        );
    }
    analyze(db, &t).await;
    println!(
        "loaded {history} delivered rows in {:.0?}: {:.0} MiB (table and indexes)",
        loading.elapsed(),
        mib(table_bytes(db, &t).await)
    );
    let full_config = binary_config(db, &t, dir.path());
    let (mut empty_rates, mut full_rates) = (Vec::new(), Vec::new());
    let (mut status_empty, mut status_full, mut stats_empty, mut stats_full) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for run in 1..=runs {
        let empty = postbox_table(db, rows).await;
        let et = empty.table().as_str().to_owned();
        let e = relay_drain(empty.clone(), dev_null().await, rows, DRAIN_BATCH).await;
        status_empty.push(status_ms(&binary_config(db, &et, dir.path())));
        stats_empty.push(stats_ms(empty.as_ref()).await);
        drop_postbox_table(db, &et).await;

        load_pending(db, &t, rows, &format!("run{run}-")).await;
        let h = relay_drain(full.clone(), dev_null().await, rows, DRAIN_BATCH).await;
        status_full.push(status_ms(&full_config));
        stats_full.push(stats_ms(full.as_ref()).await);
        println!(
            "run {run}: empty table {e:>8.0} events/s | beside the history {h:>8.0} events/s | ratio {:.2} | status {:.0} / {:.0} ms, stats query {:.1} / {:.1} ms (the fresh table after its drain / history)",
            h / e,
            status_empty[run - 1],
            status_full[run - 1],
            stats_empty[run - 1],
            stats_full[run - 1],
        );
        empty_rates.push(e);
        full_rates.push(h);
    }
    let (e, h) = (median(&empty_rates), median(&full_rates));
    println!(
        "median: empty table {e:.0} events/s, beside {history} delivered rows {h:.0} events/s; ratio {:.2} (target >= 0.9)",
        h / e
    );
    println!(
        "median: postbox status {:.0} ms on the fresh table after its drain, {:.0} ms beside the history (target <= 50 ms); stats query {:.1} ms / {:.1} ms (ratio {:.2})",
        median(&status_empty),
        median(&status_full),
        median(&stats_empty),
        median(&stats_full),
        median(&stats_full) / median(&stats_empty),
    );
    load_pending(db, &t, rows, "binary-").await;
    let (per_s, peak) = binary_relay(&full_config, full.as_ref(), rows).await;
    println!(
        "postbox relay (the binary) beside the history: {per_s:.0} events/s, peak resident memory {peak:.1} MiB (target <= 64 MiB)"
    );
    drop_postbox_table(db, &t).await;
}
