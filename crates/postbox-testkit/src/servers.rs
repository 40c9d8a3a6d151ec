//! Server URLs from the environment, with the standard local ports as
//! defaults, and the message a test prints when one is not reachable.

use std::sync::atomic::{AtomicU32, Ordering};

/// `POSTBOX_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/postbox_test`.
pub fn postgres_url() -> String {
    std::env::var("POSTBOX_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postbox_test".to_owned())
}

/// `POSTBOX_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/postbox_test`.
pub fn mysql_url() -> String {
    std::env::var("POSTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/postbox_test".to_owned())
}

/// `POSTBOX_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn amqp_url() -> String {
    std::env::var("POSTBOX_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// `POSTBOX_TEST_NATS_URL`, default `nats://127.0.0.1:4222`.
pub fn nats_url() -> String {
    std::env::var("POSTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// `POSTBOX_TEST_REDIS_URL`, default `redis://127.0.0.1:6379/0`.
pub fn redis_url() -> String {
    std::env::var("POSTBOX_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_owned())
}

/// How to start each server on a Debian machine, for failure messages.
pub fn how_to_start(server: &str) -> &'static str {
    match server {
        "postgres" => "PostgreSQL is not reachable: start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` or run scripts/test, which starts every server the suite needs",
        "mysql" => "MariaDB is not reachable: start it with `start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd` or run scripts/test",
        "rabbitmq" => "RabbitMQ is not reachable: start it with `rabbitmq-server -detached` or run scripts/test",
        "nats" => "NATS is not reachable: start it with `start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log` or run scripts/test",
        "redis" => "Redis is not reachable: start it with `redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log` or run scripts/test",
        _ => "a server the tests need is not reachable: run scripts/test",
    }
}

/// Ensures the test database of `url` exists (connecting to the server's
/// default database to create it), panicking with [`how_to_start`] when the
/// server is down.
pub async fn ensure_database(server: &str, url: &str) {
    use sqlx::Connection;
    let (base, db) = url.rsplit_once('/').expect("test URL has a database path");
    let db = db.split('?').next().unwrap_or(db);
    match server {
        "postgres" => {
            let mut c = sqlx::PgConnection::connect(&format!("{base}/postgres"))
                .await
                .unwrap_or_else(|e| panic!("{} ({e})", how_to_start(server)));
            let exists: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
                    .bind(db)
                    .fetch_one(&mut c)
                    .await
                    .expect("query pg_database");
            if !exists {
                // Two test binaries may race here; losing the race is fine.
                let _ = sqlx::query(&format!("CREATE DATABASE {db}"))
                    .execute(&mut c)
                    .await;
            }
        }
        "mysql" => {
            let mut c = sqlx::MySqlConnection::connect(&format!("{base}/"))
                .await
                .unwrap_or_else(|e| panic!("{} ({e})", how_to_start(server)));
            sqlx::query(&format!("CREATE DATABASE IF NOT EXISTS {db}"))
                .execute(&mut c)
                .await
                .expect("create test database");
        }
        other => panic!("unknown server {other}"),
    }
    drop_stale_scratch_tables(server, url).await;
}

/// Drops scratch tables (see [`scratch_table`]) left by earlier test
/// processes, once per process, so repeated runs do not grow the test
/// database. Tables of this process are kept.
async fn drop_stale_scratch_tables(server: &str, url: &str) {
    use sqlx::Connection;
    let key = format!("{server} {url}");
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    if SEEN.lock().unwrap().contains(&key) {
        return;
    }
    // A table is stale when the process that made it is gone: test binaries
    // of several runs (or engineers) may share the server at once.
    let stale = |names: Vec<String>| -> Vec<String> {
        names
            .into_iter()
            .filter(|n| scratch_pid(n).is_some_and(|pid| !process_alive(pid)))
            .collect()
    };
    // The same steps on either driver's connection: list this schema's
    // tables, drop the stale ones, forget the migrations of tables gone.
    macro_rules! drop_stale {
        ($connection:ty, $list_tables:expr, $forget_gone:expr) => {{
            let Ok(mut c) = <$connection>::connect(url).await else {
                return;
            };
            let names: Vec<String> = sqlx::query_scalar($list_tables)
                .fetch_all(&mut c)
                .await
                .unwrap_or_default();
            for t in stale(names) {
                let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
                    .execute(&mut c)
                    .await;
            }
            let _ = sqlx::query($forget_gone).execute(&mut c).await;
        }};
    }
    match server {
        "postgres" => drop_stale!(
            sqlx::PgConnection,
            "SELECT tablename::TEXT FROM pg_tables WHERE schemaname = 'public'",
            "DELETE FROM postbox_schema_migrations WHERE table_name NOT IN (SELECT tablename::TEXT FROM pg_tables)"
        ),
        _ => drop_stale!(
            sqlx::MySqlConnection,
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE()",
            "DELETE FROM postbox_schema_migrations WHERE table_name NOT IN (SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE())"
        ),
    }
    SEEN.lock().unwrap().push(key);
}

/// Whether process `pid` still runs on this machine.
fn process_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The pid in `{prefix}_{pid}_{n}_{6 hex}` (or one of its twins:
/// `_archive`, `_history`, `_versions`, `_controls`, `_control_log`), as
/// made by [`scratch_table`].
fn scratch_pid(name: &str) -> Option<u32> {
    let base = [
        "_archive",
        "_history",
        "_versions",
        "_controls",
        "_control_log",
    ]
    .iter()
    .find_map(|s| name.strip_suffix(s))
    .unwrap_or(name);
    let parts: Vec<&str> = base.rsplitn(4, '_').collect();
    let ok = parts.len() == 4
        && parts[0].len() == 6
        && parts[0].chars().all(|c| c.is_ascii_hexdigit())
        && parts[1].chars().all(|c| c.is_ascii_digit())
        && !parts[3].is_empty();
    if ok {
        parts[2].parse().ok()
    } else {
        None
    }
}

/// A table name no other test uses: `{prefix}_{pid}_{n}_{random}`.
pub fn scratch_table(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let r = uuid::Uuid::now_v7().simple().to_string();
    let r = &r[r.len() - 6..];
    format!("{prefix}_{}_{n}_{}", std::process::id(), r)
}

/// A broker object name (queue, exchange, stream, subject token) no other
/// test uses: `{prefix}_{pid}_{n}_{random}`.
pub fn scratch_name(prefix: &str) -> String {
    scratch_table(prefix)
}

/// A Redis server of a test's own on a free loopback port (no persistence),
/// killed when dropped: for faults the shared server must not see (a
/// replica's `READONLY`, a restart).
pub struct OwnRedis {
    child: std::process::Child,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    /// `redis://127.0.0.1:<port>/0`.
    pub url: String,
}

impl OwnRedis {
    /// Started with `args` besides its port, `--save ""` and
    /// `--appendonly no`; returns once it takes connections.
    pub async fn start(args: &[&str]) -> OwnRedis {
        let port = crate::clusters::free_port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(args)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (Debian's redis-server package)");
        let addr = format!("127.0.0.1:{port}");
        let own = OwnRedis {
            child,
            url: format!("redis://{addr}/0"),
            addr,
        };
        let started = std::time::Instant::now();
        while tokio::net::TcpStream::connect(&own.addr).await.is_err() {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "redis-server on {} did not start",
                own.addr
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        own
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn recognises_scratch_tables_only() {
        let t = super::scratch_table("pg");
        let pid = Some(std::process::id());
        assert_eq!(super::scratch_pid(&t), pid, "{t}");
        assert_eq!(super::scratch_pid(&format!("{t}_archive")), pid);
        assert_eq!(super::scratch_pid(&format!("{t}_history")), pid);
        assert!(super::process_alive(std::process::id()));
        for other in [
            "room_outbox",
            "postbox_schema_migrations",
            "wallet_outbox_archive",
            "a_1_2_xyz",
        ] {
            assert_eq!(super::scratch_pid(other), None, "{other}");
        }
    }
}
