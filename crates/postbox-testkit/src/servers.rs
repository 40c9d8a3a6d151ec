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

/// How to start each server on a Debian machine, for failure messages.
pub fn how_to_start(server: &str) -> &'static str {
    match server {
        "postgres" => "PostgreSQL is not reachable: start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` or run scripts/test, which starts every server the suite needs",
        "mysql" => "MariaDB is not reachable: start it with `start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd` or run scripts/test",
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
    let mine = format!("_{}_", std::process::id());
    let stale = |names: Vec<String>| -> Vec<String> {
        names
            .into_iter()
            .filter(|n| is_scratch(n) && !n.contains(&mine))
            .collect()
    };
    match server {
        "postgres" => {
            let Ok(mut c) = sqlx::PgConnection::connect(url).await else {
                return;
            };
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT tablename::TEXT FROM pg_tables WHERE schemaname = 'public'",
            )
            .fetch_all(&mut c)
            .await
            .unwrap_or_default();
            for t in stale(names) {
                let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
                    .execute(&mut c)
                    .await;
            }
            let _ = sqlx::query("DELETE FROM postbox_schema_migrations WHERE table_name NOT IN (SELECT tablename::TEXT FROM pg_tables)")
                .execute(&mut c)
                .await;
        }
        _ => {
            let Ok(mut c) = sqlx::MySqlConnection::connect(url).await else {
                return;
            };
            let names: Vec<String> = sqlx::query_scalar("SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE()")
                .fetch_all(&mut c)
                .await
                .unwrap_or_default();
            for t in stale(names) {
                let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
                    .execute(&mut c)
                    .await;
            }
            let _ = sqlx::query("DELETE FROM postbox_schema_migrations WHERE table_name NOT IN (SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = DATABASE())")
                .execute(&mut c)
                .await;
        }
    }
    SEEN.lock().unwrap().push(key);
}

/// `{prefix}_{pid}_{n}_{6 hex}` (and its `_archive` and `_history`
/// twins), as made by [`scratch_table`].
fn is_scratch(name: &str) -> bool {
    let base = name
        .strip_suffix("_archive")
        .or_else(|| name.strip_suffix("_history"))
        .unwrap_or(name);
    let parts: Vec<&str> = base.rsplitn(4, '_').collect();
    parts.len() == 4
        && parts[0].len() == 6
        && parts[0].chars().all(|c| c.is_ascii_hexdigit())
        && parts[1].chars().all(|c| c.is_ascii_digit())
        && parts[2].chars().all(|c| c.is_ascii_digit())
        && !parts[3].is_empty()
}

/// A table name no other test uses: `{prefix}_{pid}_{n}_{random}`.
pub fn scratch_table(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let r = uuid::Uuid::now_v7().simple().to_string();
    let r = &r[r.len() - 6..];
    format!("{prefix}_{}_{n}_{}", std::process::id(), r)
}

#[cfg(test)]
mod tests {
    #[test]
    fn recognises_scratch_tables_only() {
        let t = super::scratch_table("pg");
        assert!(super::is_scratch(&t), "{t}");
        assert!(super::is_scratch(&format!("{t}_archive")));
        assert!(super::is_scratch(&format!("{t}_history")));
        for other in [
            "room_outbox",
            "postbox_schema_migrations",
            "wallet_outbox_archive",
            "a_1_2_xyz",
        ] {
            assert!(!super::is_scratch(other), "{other}");
        }
    }
}
