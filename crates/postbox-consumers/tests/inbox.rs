//! The inbox on PostgreSQL, MariaDB and SQLite: one transaction for the
//! handler's writes and the inbox row, duplicates and stale versions skipped,
//! a failed handler leaves no trace, purge in batches.

use async_trait::async_trait;
use postbox_consumers::inbox::{Inbox, TxHandler};
use postbox_consumers::{Handled, HandlerError, Message};
use postbox_core::envelope::Envelope;
use postbox_testkit::servers::{ensure_database, mysql_url, postgres_url, scratch_table};

fn message(event_id: &str, aggregate: Option<(&str, i64)>) -> Message {
    Message {
        envelope: Envelope {
            event_id: event_id.to_owned(),
            app_code: "test".to_owned(),
            event_type: "T".to_owned(),
            aggregate_id: aggregate.map(|a| a.0.to_owned()),
            aggregate_version: aggregate.map(|a| a.1),
            created_at_ms: 0,
            headers: Default::default(),
            payload: serde_json::json!({}),
        },
        attempt: 1,
        redelivered: false,
    }
}

/// Generates the same cases for one database.
macro_rules! inbox_cases {
    ($module:ident, $db:ty, $insert:literal, $setup:expr) => {
        mod $module {
            use super::*;

            struct Effect {
                table: String,
                fail: bool,
            }

            #[async_trait]
            impl TxHandler<$db> for Effect {
                async fn handle(
                    &self,
                    tx: &mut sqlx::Transaction<'static, $db>,
                    m: &Message,
                ) -> Result<(), HandlerError> {
                    sqlx::query(&format!($insert, self.table))
                        .bind(m.event_id())
                        .execute(&mut **tx)
                        .await
                        .map_err(HandlerError::new)?;
                    if self.fail {
                        return Err(HandlerError::new("downstream said no"));
                    }
                    Ok(())
                }
            }

            async fn count(inbox: &Inbox<$db>, table: &str) -> i64 {
                sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
                    .fetch_one(inbox.pool())
                    .await
                    .unwrap()
            }

            #[tokio::test]
            async fn exactly_once_effect_stale_versions_and_purge() {
                let (url, _dir): (String, Option<tempfile::TempDir>) = $setup.await;
                let table = scratch_table("inbox");
                let inbox = Inbox::<$db>::connect(&url, &table).await.unwrap();
                // A second connect (another process starting) is harmless.
                Inbox::<$db>::connect(&url, &table).await.unwrap();
                let effect = format!("{table}_effect");
                sqlx::query(&format!(
                    "CREATE TABLE {effect} (event_id VARCHAR(64) NOT NULL)"
                ))
                .execute(inbox.pool())
                .await
                .unwrap();
                let ok = Effect {
                    table: effect.clone(),
                    fail: false,
                };
                let failing = Effect {
                    table: effect.clone(),
                    fail: true,
                };

                // A failing handler rolls back its write and the inbox row.
                let m1 = message("e1", Some(("a", 5)));
                assert!(inbox.process("g", &m1, &failing).await.is_err());
                assert_eq!(count(&inbox, &effect).await, 0);
                assert_eq!(inbox.process("g", &m1, &ok).await.unwrap(), Handled::Ok);
                assert_eq!(
                    inbox.process("g", &m1, &ok).await.unwrap(),
                    Handled::Duplicate
                );
                // Another group handles the same event on its own.
                assert_eq!(inbox.process("h", &m1, &ok).await.unwrap(), Handled::Ok);
                assert_eq!(count(&inbox, &effect).await, 2);

                let older = message("e0", Some(("a", 4)));
                assert_eq!(
                    inbox.process("g", &older, &ok).await.unwrap(),
                    Handled::Stale
                );
                let same = message("e1b", Some(("a", 5)));
                assert_eq!(inbox.process("g", &same, &ok).await.unwrap(), Handled::Ok);
                let newer = message("e2", Some(("a", 6)));
                assert_eq!(inbox.process("g", &newer, &ok).await.unwrap(), Handled::Ok);
                assert_eq!(
                    inbox.process("g", &older, &ok).await.unwrap(),
                    Handled::Stale
                );
                let other = message("b1", Some(("b", 1)));
                assert_eq!(inbox.process("g", &other, &ok).await.unwrap(), Handled::Ok);
                assert_eq!(count(&inbox, &effect).await, 5);

                // Purge: nothing is older than a minute ago; everything is older than the future.
                let now = postbox_core::time::now_ms();
                assert_eq!(inbox.purge(now - 60_000, 2).await.unwrap(), 0);
                let rows =
                    count(&inbox, &table).await + count(&inbox, &format!("{table}_versions")).await;
                assert_eq!(inbox.purge(now + 1_000, 2).await.unwrap() as i64, rows);
                assert_eq!(count(&inbox, &table).await, 0);
                // After the purge the event is new again: retention must outlast redelivery.
                assert_eq!(inbox.process("g", &m1, &ok).await.unwrap(), Handled::Ok);

                for t in [effect, format!("{table}_versions"), table] {
                    let _ = sqlx::query(&format!("DROP TABLE {t}"))
                        .execute(inbox.pool())
                        .await;
                }
            }
        }
    };
}

inbox_cases!(
    postgres,
    sqlx::Postgres,
    "INSERT INTO {} (event_id) VALUES ($1)",
    async {
        let url = postgres_url();
        ensure_database("postgres", &url).await;
        (url, None)
    }
);

inbox_cases!(
    mariadb,
    sqlx::MySql,
    "INSERT INTO {} (event_id) VALUES (?)",
    async {
        let url = mysql_url();
        ensure_database("mysql", &url).await;
        (url, None)
    }
);

inbox_cases!(
    sqlite,
    sqlx::Sqlite,
    "INSERT INTO {} (event_id) VALUES (?)",
    async {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
        (url, Some(dir))
    }
);
