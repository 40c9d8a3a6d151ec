//! The inbox on PostgreSQL, MariaDB and SQLite: one transaction for the
//! handler's writes and the inbox row, duplicates and stale versions skipped,
//! a failed handler leaves no trace, purge in batches.

use async_trait::async_trait;
use postbox_consumers::inbox::{Inbox, TxHandler};
use postbox_consumers::{Handled, HandlerError, Message};
use postbox_core::envelope::Envelope;
use postbox_testkit::servers::{ensure_database, mysql_url, postgres_url, scratch_table};

use crate::common::{EffectRow, Tx};

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
            payload: Envelope::payload_of("{}"),
        },
        attempt: 1,
        redelivered: false,
    }
}

/// Takes aggregate `a`'s row of group `g` in `versions` for update.
fn lock_aggregate_a(versions: &str) -> String {
    format!(
        "SELECT aggregate_version FROM {versions} WHERE consumer_group = 'g' AND aggregate_id = 'a' FOR UPDATE"
    )
}

/// Creates `<table>_effect`, the table the handlers write event ids to,
/// with the columns (and options) `definition`; returns its name.
async fn create_effect_table<DB>(pool: &sqlx::Pool<DB>, table: &str, definition: &str) -> String
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    let effect = format!("{table}_effect");
    sqlx::query(&format!("CREATE TABLE {effect} {definition}"))
        .execute(pool)
        .await
        .unwrap();
    effect
}

/// The event ids written to the table `effect`, in order.
async fn effects<DB>(pool: &sqlx::Pool<DB>, effect: &str) -> Vec<String>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    (String,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    sqlx::query_scalar(&format!("SELECT event_id FROM {effect} ORDER BY event_id"))
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Drops the tables `tables` where they exist.
async fn drop_tables<DB>(pool: &sqlx::Pool<DB>, tables: [String; 3])
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    for t in tables {
        let _ = sqlx::query(&format!("DROP TABLE {t}")).execute(pool).await;
    }
}

/// Two more connections to `url`: `holder`, in a transaction, to hold
/// rows, and `watcher`, to see who waits for them.
async fn holder_and_watcher<C>(url: &str) -> (C, C)
where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    for<'q> <C::Database as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, C::Database>,
{
    let mut holder = C::connect(url).await.unwrap();
    let watcher = C::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    (holder, watcher)
}

/// Generates the same cases for one database.
macro_rules! inbox_cases {
    ($module:ident, $db:ty, $setup:expr) => {
        mod $module {
            use super::*;

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
                let effect =
                    create_effect_table(inbox.pool(), &table, "(event_id VARCHAR(64) NOT NULL)")
                        .await;
                let ok = EffectRow::new(effect.clone());
                let failing = EffectRow {
                    fail: true,
                    ..EffectRow::new(effect.clone())
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

                drop_tables(inbox.pool(), [effect, format!("{table}_versions"), table]).await;
            }
        }
    };
}

inbox_cases!(postgres, sqlx::Postgres, server("postgres", postgres_url()));
inbox_cases!(mariadb, sqlx::MySql, server("mysql", mysql_url()));
inbox_cases!(sqlite, sqlx::Sqlite, sqlite_file());

/// The URL of database server `kind`, made sure to exist.
async fn server(kind: &str, url: String) -> (String, Option<tempfile::TempDir>) {
    ensure_database(kind, &url).await;
    (url, None)
}

/// The URL of a fresh SQLite file, with the directory that holds it.
async fn sqlite_file() -> (String, Option<tempfile::TempDir>) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
    (url, Some(dir))
}

/// MariaDB/MySQL row locking of the version check (issue 10.5): forced
/// interleavings with a third connection that holds the aggregate's row.
mod mariadb_locking {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use sqlx::MySqlConnection;
    use tokio::sync::{oneshot, Mutex};

    use super::*;

    /// Writes the event id to `effect`; for `block_on` it first says so on
    /// `entered` and waits for `release`.
    struct Gate {
        effect: String,
        block_on: String,
        entered: Mutex<Option<oneshot::Sender<()>>>,
        release: Mutex<Option<oneshot::Receiver<()>>>,
    }

    #[async_trait]
    impl TxHandler<sqlx::MySql> for Gate {
        async fn handle(&self, tx: &mut Tx<sqlx::MySql>, m: &Message) -> Result<(), HandlerError> {
            if m.event_id() == self.block_on {
                if let Some(tx) = self.entered.lock().await.take() {
                    let _ = tx.send(());
                }
                if let Some(rx) = self.release.lock().await.take() {
                    let _ = rx.await;
                }
            }
            TxHandler::<sqlx::MySql>::handle(&EffectRow::new(&self.effect), tx, m).await
        }
    }

    struct Setup {
        url: String,
        table: String,
        effect: String,
        inbox: Inbox<sqlx::MySql>,
    }

    /// An inbox whose aggregate `a` is known at version 0.
    async fn setup() -> Setup {
        let url = mysql_url();
        ensure_database("mysql", &url).await;
        let table = scratch_table("inbox_lock");
        let inbox = Inbox::<sqlx::MySql>::connect(&url, &table).await.unwrap();
        let effect = create_effect_table(
            inbox.pool(),
            &table,
            "(event_id VARCHAR(64) NOT NULL) ENGINE = InnoDB",
        )
        .await;
        let gate = gate(&effect, "none").0;
        assert_eq!(
            inbox
                .process("g", &message("e0", Some(("a", 0))), &gate)
                .await
                .unwrap(),
            Handled::Ok
        );
        Setup {
            url,
            table,
            effect,
            inbox,
        }
    }

    fn gate(effect: &str, block_on: &str) -> (Gate, oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (entered_tx, entered_rx) = oneshot::channel();
        let (release_tx, release_rx) = oneshot::channel();
        (
            Gate {
                effect: effect.to_owned(),
                block_on: block_on.to_owned(),
                entered: Mutex::new(Some(entered_tx)),
                release: Mutex::new(Some(release_rx)),
            },
            entered_rx,
            release_tx,
        )
    }

    /// Connections (other than `c`) that have been executing a statement on
    /// `table` for over 50 ms (waiting for a row lock), with how long (ms).
    async fn waiting_on(c: &mut MySqlConnection, table: &str) -> Vec<(i64, f64)> {
        sqlx::query_as(
            "SELECT CAST(ID AS SIGNED), CAST(TIME_MS AS DOUBLE) FROM information_schema.PROCESSLIST
             WHERE COMMAND IN ('Query', 'Execute') AND TIME_MS > 50
               AND INFO LIKE CONCAT('%', ?, '%') AND ID <> CONNECTION_ID()
             ORDER BY TIME_MS DESC",
        )
        .bind(table)
        .fetch_all(c)
        .await
        .unwrap()
    }

    async fn wait_for_waiters(c: &mut MySqlConnection, table: &str, n: usize) -> Vec<(i64, f64)> {
        let start = Instant::now();
        loop {
            let w = waiting_on(c, table).await;
            if w.len() >= n {
                return w;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{n} transactions never waited on {table}: {w:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn version(s: &Setup) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT aggregate_version FROM {}_versions WHERE consumer_group = 'g' AND aggregate_id = 'a'",
            s.table
        ))
        .fetch_one(s.inbox.pool())
        .await
        .unwrap()
    }

    /// Drops the inbox's tables and the effect table.
    async fn drop_setup(s: &Setup) {
        let tables = [
            s.effect.clone(),
            format!("{}_versions", s.table),
            s.table.clone(),
        ];
        drop_tables(s.inbox.pool(), tables).await;
    }

    /// e1(v1) and e2(v2) of a known aggregate reach the version check at the
    /// same moment: a third transaction holds the row while both queue
    /// behind it, then lets go. With `INSERT IGNORE` (shared lock) then
    /// `FOR UPDATE` both got the shared lock together and deadlocked on the
    /// upgrade (1213, one event to the retry path, e1 then skipped as stale).
    /// Now the first in line takes the row exclusively, the second keeps
    /// waiting in the same transaction (no deadlock, no rollback), and both
    /// are applied in order, as on PostgreSQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_versions_of_a_known_aggregate_do_not_deadlock() {
        let s = setup().await;
        let versions = format!("{}_versions", s.table);
        let (mut holder, mut watcher) = holder_and_watcher::<MySqlConnection>(&s.url).await;
        sqlx::query(&lock_aggregate_a(&versions))
            .fetch_all(&mut holder)
            .await
            .unwrap();

        let (gate, entered, release) = gate(&s.effect, "e1");
        let gate = Arc::new(gate);
        let (inbox, g) = (s.inbox.clone(), gate.clone());
        let t1 = tokio::spawn(async move {
            inbox
                .process("g", &message("e1", Some(("a", 1))), &*g)
                .await
        });
        wait_for_waiters(&mut watcher, &versions, 1).await;
        let (inbox, g) = (s.inbox.clone(), gate.clone());
        let t2 = tokio::spawn(async move {
            inbox
                .process("g", &message("e2", Some(("a", 2))), &*g)
                .await
        });
        let queued: Vec<i64> = wait_for_waiters(&mut watcher, &versions, 2)
            .await
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
        let committed = Instant::now();

        // e1 was first in line: it reaches its handler while e2 waits.
        tokio::time::timeout(Duration::from_secs(10), entered)
            .await
            .expect("e1 never reached its handler (deadlock victim, retried behind e2?)")
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let since_commit = committed.elapsed().as_millis() as f64;
        let still: Vec<(i64, f64)> = waiting_on(&mut watcher, &versions)
            .await
            .into_iter()
            .filter(|(id, _)| queued.contains(id))
            .collect();
        // The one still waiting has waited since before the commit, in the
        // same statement: it was never rolled back and started over.
        assert_eq!(still.len(), 1, "e2 waits for e1's row lock: {still:?}");
        assert!(
            still[0].1 > since_commit + 250.0,
            "e2's wait began after the holder let go ({} ms ago): it was a deadlock victim started over: {still:?}",
            since_commit
        );
        release.send(()).unwrap();

        assert_eq!(t1.await.unwrap().unwrap(), Handled::Ok);
        assert_eq!(t2.await.unwrap().unwrap(), Handled::Ok);
        assert_eq!(effects(s.inbox.pool(), &s.effect).await, ["e0", "e1", "e2"]);
        assert_eq!(version(&s).await, 2);
        drop_setup(&s).await;
    }

    /// A deadlock whose victim is the inbox transaction, before the handler
    /// ran: the inbox holds e1's row and waits for the aggregate's row; the
    /// holder of that row (heavier: it has written 200 rows, so InnoDB
    /// rolls back the inbox side) then asks for e1's row. The inbox step is
    /// started over without troubling the handler or the consumer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_deadlock_before_the_handler_is_retried() {
        let s = setup().await;
        let versions = format!("{}_versions", s.table);
        let (mut holder, mut watcher) = holder_and_watcher::<MySqlConnection>(&s.url).await;
        let ballast: Vec<String> = (0..200).map(|i| format!("('ballast-{i}')")).collect();
        sqlx::query(&format!(
            "INSERT INTO {} (event_id) VALUES {}",
            s.effect,
            ballast.join(", ")
        ))
        .execute(&mut holder)
        .await
        .unwrap();
        sqlx::query(&lock_aggregate_a(&versions))
            .fetch_all(&mut holder)
            .await
            .unwrap();

        let (gate, _entered, _release) = gate(&s.effect, "none");
        let inbox = s.inbox.clone();
        let t = tokio::spawn(async move {
            inbox
                .process("g", &message("e1", Some(("a", 1))), &gate)
                .await
        });
        wait_for_waiters(&mut watcher, &versions, 1).await;
        // Closes the cycle: the holder wants the inbox row e1 holds.
        let seen: Result<Vec<String>, sqlx::Error> = sqlx::query_scalar(&format!(
            "SELECT event_id FROM {} WHERE consumer_group = 'g' AND event_id = 'e1' FOR UPDATE",
            s.table
        ))
        .fetch_all(&mut holder)
        .await;
        let seen = seen.expect("the deadlock's victim must be the inbox transaction");
        assert!(
            seen.is_empty(),
            "the victim's insert was rolled back: {seen:?}"
        );
        sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();

        assert_eq!(
            tokio::time::timeout(Duration::from_secs(10), t)
                .await
                .expect("the inbox step never finished")
                .unwrap()
                .unwrap(),
            Handled::Ok,
            "the deadlock was retried transparently"
        );
        assert_eq!(effects(s.inbox.pool(), &s.effect).await, ["e0", "e1"]);
        assert_eq!(version(&s).await, 1);
        drop_setup(&s).await;
    }
}

/// The same interleaving on PostgreSQL, for comparison: `ON CONFLICT DO
/// NOTHING` takes no lock on a known row, both transactions queue on
/// `FOR UPDATE` behind the holder, and both events are applied in order.
mod postgres_locking {
    use std::time::{Duration, Instant};

    use sqlx::PgConnection;

    use super::*;

    async fn wait_for_waiters(c: &mut PgConnection, table: &str, n: i64) {
        let start = Instant::now();
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'
                   AND pid <> pg_backend_pid()",
            )
            .bind(table)
            .fetch_one(&mut *c)
            .await
            .unwrap();
            if waiting >= n {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{n} transactions never waited on {table}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_versions_of_a_known_aggregate_queue_on_the_row() {
        let url = postgres_url();
        ensure_database("postgres", &url).await;
        let table = scratch_table("inbox_lock");
        let versions = format!("{table}_versions");
        let inbox = Inbox::<sqlx::Postgres>::connect(&url, &table)
            .await
            .unwrap();
        let effect = create_effect_table(inbox.pool(), &table, "(event_id TEXT NOT NULL)").await;
        let handler = std::sync::Arc::new(EffectRow::new(effect.clone()));
        let seed = message("e0", Some(("a", 0)));
        assert_eq!(
            inbox.process("g", &seed, &*handler).await.unwrap(),
            Handled::Ok
        );
        let (mut holder, mut watcher) = holder_and_watcher::<PgConnection>(&url).await;
        sqlx::query(&lock_aggregate_a(&versions))
            .fetch_all(&mut holder)
            .await
            .unwrap();
        let spawn = |id: &'static str, v: i64| {
            let (inbox, h) = (inbox.clone(), handler.clone());
            tokio::spawn(async move { inbox.process("g", &message(id, Some(("a", v))), &*h).await })
        };
        let t1 = spawn("e1", 1);
        wait_for_waiters(&mut watcher, &versions, 1).await;
        let t2 = spawn("e2", 2);
        wait_for_waiters(&mut watcher, &versions, 2).await;
        sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
        assert_eq!(t1.await.unwrap().unwrap(), Handled::Ok);
        assert_eq!(t2.await.unwrap().unwrap(), Handled::Ok);
        assert_eq!(effects(inbox.pool(), &effect).await, ["e0", "e1", "e2"]);
        drop_tables(inbox.pool(), [effect, versions, table]).await;
    }
}

/// Holds the SQLite write lock its inbox transaction took for `0`, then
/// succeeds (a slow handler).
struct Slow(std::time::Duration);

#[async_trait]
impl TxHandler<sqlx::Sqlite> for Slow {
    async fn handle(&self, _: &mut Tx<sqlx::Sqlite>, _: &Message) -> Result<(), HandlerError> {
        tokio::time::sleep(self.0).await;
        Ok(())
    }
}

/// Two consumers (two processes) sharing one SQLite inbox file: while one
/// handler runs 6 s, holding the file's write lock, the other waits for it
/// and then handles its event. It failed "database is locked" after sqlx's
/// 5 s, an attempt spent for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_inbox_waits_out_a_slow_handler_beside_it() {
    let (url, _dir) = sqlite_file().await;
    let table = scratch_table("inbox");
    let first = Inbox::<sqlx::Sqlite>::connect(&url, &table).await.unwrap();
    let second = Inbox::<sqlx::Sqlite>::connect(&url, &table).await.unwrap();
    let slow = tokio::spawn(async move {
        first
            .process(
                "g",
                &message("e1", None),
                &Slow(std::time::Duration::from_secs(6)),
            )
            .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let quick = second
        .process("g", &message("e2", None), &Slow(std::time::Duration::ZERO))
        .await;
    assert_eq!(quick.unwrap(), Handled::Ok);
    assert_eq!(slow.await.unwrap().unwrap(), Handled::Ok);
}

/// The inbox's database goes silent while it checks an event (a failover
/// whose old primary vanished): the check is given up after its bound, a
/// failure the consumer retries, and the next try, on a connection that
/// answers, handles the event once. The check waited for good, with the
/// message in hand, and the consumer could not stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_the_database_never_answers_is_given_up() {
    use postbox_consumers::inbox::Inbox;
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let table = scratch_table("inbox_silent");
    let (proxy, through) = postbox_testkit::proxy::to_postgres().await;
    let inbox = Inbox::<sqlx::Postgres>::connect(&through, &table)
        .await
        .unwrap();
    let effect = create_effect_table(inbox.pool(), &table, "(event_id VARCHAR(64) NOT NULL)").await;
    let ok = EffectRow::new(effect.clone());
    proxy.silence_on(format!("INSERT INTO {table} ").as_bytes());
    let m = message("silent-1", Some(("a", 1)));
    let given_up = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        inbox.process("g", &m, &ok),
    )
    .await
    .expect("the check is given up")
    .unwrap_err();
    assert!(
        given_up
            .to_string()
            .contains("no answer from the inbox database"),
        "{given_up}"
    );
    assert_eq!(proxy.silenced(), 1);
    assert_eq!(inbox.process("g", &m, &ok).await.unwrap(), Handled::Ok);
    assert_eq!(
        inbox.process("g", &m, &ok).await.unwrap(),
        Handled::Duplicate
    );
    let direct = sqlx::PgPool::connect(&url).await.unwrap();
    assert_eq!(effects(&direct, &effect).await, ["silent-1"]);
    drop_tables(
        &direct,
        [table.clone(), format!("{table}_versions"), effect],
    )
    .await;
}
