//! The inbox: exactly-once effect on top of at-least-once delivery.
//!
//! For every event the inbox inserts `(consumer_group, event_id)` and, when
//! the event names an aggregate and a version, checks and moves the
//! aggregate's last version — in the **same** transaction as the handler's own
//! writes ([`TxHandler`]). A redelivered event finds its row and has no second
//! effect ([`Handled::Duplicate`]); an event older than the aggregate's last
//! version is skipped ([`Handled::Stale`]). Either way the message is
//! acknowledged.
//!
//! Two tables, created on first use ([`Inbox::migrate`]): `<table>` keyed by
//! `(consumer_group, event_id)` and `<table>_versions` keyed by
//! `(consumer_group, aggregate_id)`. Rows older than the retention are
//! deleted in batches by [`Inbox::purge`].
//!
//! ```no_run
//! use postbox_consumers::inbox::{Inbox, InboxHandler, TxHandler};
//! use postbox_consumers::{HandlerError, Message};
//!
//! struct CreditWallet;
//!
//! #[async_trait::async_trait]
//! impl TxHandler<sqlx::Postgres> for CreditWallet {
//!     async fn handle(
//!         &self,
//!         tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
//!         message: &Message,
//!     ) -> Result<(), HandlerError> {
//!         sqlx::query("UPDATE wallet SET balance = balance + 1 WHERE id = $1")
//!             .bind(message.envelope.aggregate_id.clone())
//!             .execute(&mut **tx)
//!             .await
//!             .map_err(HandlerError::new)?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn run() -> Result<(), postbox_core::Error> {
//! let inbox = Inbox::<sqlx::Postgres>::connect("postgres://localhost/app", "postbox_inbox").await?;
//! let handler = InboxHandler::new(inbox, "wallet", CreditWallet);
//! # Ok(()) }
//! ```

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::marker::PhantomData;

use async_trait::async_trait;
use postbox_core::config::{DatabaseKind, KeyPath};
use postbox_core::redact::SecretUrl;
use postbox_core::{Error, TableName};

use crate::{HandlerError, Message};

/// A handler whose writes commit together with the inbox row.
///
/// `tx` is the inbox's transaction: write through it (`&mut **tx`) and do not
/// commit it; the inbox commits after the handler returns `Ok`, and rolls
/// everything back on `Err`.
#[async_trait]
pub trait TxHandler<DB: sqlx::Database>: Send + Sync {
    /// Handles `message` inside `tx`.
    async fn handle(
        &self,
        tx: &mut sqlx::Transaction<'static, DB>,
        message: &Message,
    ) -> Result<(), HandlerError>;
}

/// The inbox tables of one database (PostgreSQL, MySQL/MariaDB or SQLite).
#[derive(Debug)]
pub struct Inbox<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    table: TableName,
    sql: Statements,
    _db: PhantomData<DB>,
}

impl<DB: sqlx::Database> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
            _db: PhantomData,
        }
    }
}

/// One dialect's statements with the table name filled in.
#[derive(Debug, Clone)]
struct Statements {
    create: Vec<String>,
    insert_event: String,
    has_event: String,
    insert_version: String,
    lock_version: String,
    update_version: String,
    purge_events: String,
    purge_versions: String,
}

impl Statements {
    fn render(table: &TableName, dialect: &sql::Dialect) -> Self {
        let r = |s: &str| s.replace("{table}", table.as_str());
        Statements {
            create: dialect.create.iter().map(|s| r(s)).collect(),
            insert_event: r(dialect.insert_event),
            has_event: r(dialect.has_event),
            insert_version: r(dialect.insert_version),
            lock_version: r(dialect.lock_version),
            update_version: r(dialect.update_version),
            purge_events: r(dialect.purge_events),
            purge_versions: r(dialect.purge_versions),
        }
    }
}

/// The inbox decision before the handler runs.
pub(crate) enum Admission {
    Fresh,
    Duplicate,
    Stale { remembered: i64 },
}

impl<DB: sqlx::Database> Inbox<DB> {
    /// The pool the inbox uses; a service may share it for its other work.
    pub fn pool(&self) -> &sqlx::Pool<DB> {
        &self.pool
    }

    /// The inbox table (`<table>_versions` is its twin).
    pub fn table(&self) -> &TableName {
        &self.table
    }
}

/// Runs an inner [`TxHandler`] through an [`Inbox`]; this is the [`Handler`]
/// a consumer drives.
///
/// [`Handler`]: crate::Handler
#[derive(Debug)]
pub struct InboxHandler<DB: sqlx::Database, H> {
    inbox: Inbox<DB>,
    consumer_group: String,
    inner: H,
}

impl<DB: sqlx::Database, H> InboxHandler<DB, H> {
    /// `inner` runs in the inbox transaction of `consumer_group`; groups
    /// dedupe independently, so two services may handle the same event.
    pub fn new(inbox: Inbox<DB>, consumer_group: impl Into<String>, inner: H) -> Self {
        InboxHandler {
            inbox,
            consumer_group: consumer_group.into(),
            inner,
        }
    }

    /// The inbox.
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.inbox
    }
}

/// The database `url` (at config key `key`) names, when this build has its
/// inbox: an error naming `key` and the Cargo feature to enable when the
/// database is not compiled in (features `postgres`, `mysql`, `sqlite` of
/// `postbox-consumers`, or of `postbox`), like an unknown scheme.
pub fn database_of(url: &SecretUrl, key: &KeyPath) -> Result<DatabaseKind, Error> {
    let kind = DatabaseKind::of(url, key)?;
    let (built, feature) = match kind {
        DatabaseKind::Postgres => (cfg!(feature = "postgres"), "postgres"),
        DatabaseKind::MySql => (cfg!(feature = "mysql"), "mysql"),
        DatabaseKind::Sqlite => (cfg!(feature = "sqlite"), "sqlite"),
    };
    if !built {
        return Err(Error::config(
            key.clone(),
            format!(
                "this build has no {feature} inbox: enable the `{feature}` feature of postbox (or postbox-consumers)"
            ),
        ));
    }
    Ok(kind)
}

/// `mariadb://` is spelled `mysql://` for sqlx; a SQLite file is created when
/// missing (`mode=rwc`) unless the URL says otherwise.
pub(crate) fn normalise_url(url: &str) -> String {
    if let Some(rest) = url.strip_prefix("mariadb://") {
        return format!("mysql://{rest}");
    }
    if url.starts_with("sqlite:") && !url.contains("mode=") && !url.contains(":memory:") {
        let sep = if url.contains('?') { '&' } else { '?' };
        return format!("{url}{sep}mode=rwc");
    }
    url.to_owned()
}

fn db_err(what: &str, e: sqlx::Error) -> HandlerError {
    HandlerError::new(format!("inbox {what}: {e}"))
}

/// How long one of the inbox's own steps (begin, check, commit, lookup)
/// may wait for its database. A database gone silent (a failover whose
/// old primary vanished, a frozen host) answers no statement and no TCP
/// keepalive notices: the consumer waited for good with the message in
/// hand, and did not stop when asked.
pub(crate) const INBOX_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// `step` of the inbox within [`INBOX_WITHIN`]; past it, a failure the
/// consumer's retry path takes (the message is handled again later).
pub(crate) async fn within<T>(
    what: &str,
    step: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<Result<T, sqlx::Error>, HandlerError> {
    tokio::time::timeout(INBOX_WITHIN, step).await.map_err(|_| {
        HandlerError::new(format!(
            "inbox {what}: no answer from the inbox database within {}s",
            INBOX_WITHIN.as_secs()
        ))
    })
}

/// Tries of the inbox check before a deadlock or serialization failure is
/// handed to the consumer's retry path.
pub(crate) const ADMISSION_TRIES: u32 = 5;

/// A deadlock or serialization failure: the database rolled the transaction
/// back and the same statements will most likely pass when run again
/// (SQLSTATE 40001 serialization failure, MySQL/MariaDB 1213 deadlock;
/// 40P01 PostgreSQL deadlock; 517 SQLite `SQLITE_BUSY_SNAPSHOT`).
pub(crate) fn is_retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            matches!(d.code().as_deref(), Some("40001" | "40P01" | "517"))
        }
        _ => false,
    }
}

/// Generates the inbox operations for one sqlx database; only the statements
/// differ between dialects.
macro_rules! inbox_backend {
    ($db:ty, $dialect:expr) => {
        impl $crate::inbox::Inbox<$db> {
            /// Connects to `url` and creates the inbox tables when missing.
            pub async fn connect(url: &str, table: &str) -> Result<Self, postbox_core::Error> {
                let table = postbox_core::TableName::new(table)?;
                let pool = postbox_sqlx::released_within(sqlx::pool::PoolOptions::<$db>::new())
                    .max_connections(8)
                    .after_connect(|conn, _| {
                        Box::pin(async move {
                            if let Some(sql) = $dialect.on_connect {
                                sqlx::Executor::execute(conn, sql).await?;
                            }
                            Ok(())
                        })
                    })
                    .connect(&$crate::inbox::normalise_url(url))
                    .await
                    .map_err(|e| postbox_core::Error::database("connecting to the inbox database", e))?;
                let inbox = Self::from_pool(pool, table);
                inbox.migrate().await?;
                Ok(inbox)
            }

            /// Uses an existing pool (the service's own); call
            /// [`Inbox::migrate`] once before use.
            pub fn from_pool(pool: sqlx::Pool<$db>, table: postbox_core::TableName) -> Self {
                let sql = $crate::inbox::Statements::render(&table, &$dialect);
                $crate::inbox::Inbox {
                    pool,
                    table,
                    sql,
                    _db: std::marker::PhantomData,
                }
            }

            /// Creates `<table>` and `<table>_versions` and their indexes when
            /// missing; idempotent, safe from many processes at once.
            pub async fn migrate(&self) -> Result<(), postbox_core::Error> {
                let mut tx = self
                    .pool
                    .begin()
                    .await
                    .map_err(|e| postbox_core::Error::database("inbox migrate", e))?;
                for stmt in &self.sql.create {
                    sqlx::query(stmt)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| postbox_core::Error::database("inbox migrate", e))?;
                }
                tx.commit()
                    .await
                    .map_err(|e| postbox_core::Error::database("inbox migrate", e))
            }

            /// The inbox check of one event in `tx`: records it and, for a
            /// versioned event, locks its aggregate's row **exclusively** at
            /// the first touch (`insert_version` never leaves a shared lock
            /// to be upgraded: two such upgrades deadlock on MySQL/MariaDB),
            /// then compares and moves the version.
            async fn admit(
                &self,
                tx: &mut sqlx::Transaction<'static, $db>,
                consumer_group: &str,
                env: &postbox_core::envelope::Envelope,
            ) -> Result<$crate::inbox::Admission, sqlx::Error> {
                use $crate::inbox::Admission;
                let now = postbox_core::time::now_ms();
                let inserted = sqlx::query(&self.sql.insert_event)
                    .bind(consumer_group)
                    .bind(&env.event_id)
                    .bind(now)
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                if inserted == 0 {
                    return Ok(Admission::Duplicate);
                }
                let (Some(aggregate), Some(version)) = (&env.aggregate_id, env.aggregate_version) else {
                    return Ok(Admission::Fresh);
                };
                sqlx::query(&self.sql.insert_version)
                    .bind(consumer_group)
                    .bind(aggregate)
                    .bind(version)
                    .bind(now)
                    .execute(&mut **tx)
                    .await?;
                // Whether the row was new or known, read it under the lock
                // (MySQL reports a no-op upsert as one affected row too).
                let remembered: i64 = sqlx::query_scalar(&self.sql.lock_version)
                    .bind(consumer_group)
                    .bind(aggregate)
                    .fetch_one(&mut **tx)
                    .await?;
                if version < remembered {
                    return Ok(Admission::Stale { remembered });
                }
                sqlx::query(&self.sql.update_version)
                    .bind(version)
                    .bind(now)
                    .bind(consumer_group)
                    .bind(aggregate)
                    .execute(&mut **tx)
                    .await?;
                Ok(Admission::Fresh)
            }

            /// Whether `consumer_group` has recorded `event_id`: its
            /// handler's writes committed.
            pub async fn has(&self, consumer_group: &str, event_id: &str) -> Result<bool, $crate::HandlerError> {
                let lookup = sqlx::query_scalar(&self.sql.has_event)
                    .bind(consumer_group)
                    .bind(event_id)
                    .fetch_one(&self.pool);
                let rows: i64 = $crate::inbox::within("check", lookup)
                    .await?
                    .map_err(|e| $crate::inbox::db_err("check", e))?;
                Ok(rows > 0)
            }

            /// Runs `handler` and the inbox bookkeeping of `message` for
            /// `consumer_group` in one transaction.
            pub async fn process<H: $crate::inbox::TxHandler<$db> + ?Sized>(
                &self,
                consumer_group: &str,
                message: &$crate::Message,
                handler: &H,
            ) -> Result<$crate::Handled, $crate::HandlerError> {
                use $crate::inbox::{db_err, is_retryable, within, Admission, ADMISSION_TRIES};
                let env = &message.envelope;
                let mut try_no = 1u32;
                // The inbox's own steps are bounded ([`INBOX_WITHIN`]); a
                // transaction given up is dropped, not rolled back (the
                // rollback would wait too): its connection is closed.
                let (mut tx, admission) = loop {
                    let mut tx = within("begin", self.pool.begin()).await?.map_err(|e| db_err("begin", e))?;
                    match within("check", self.admit(&mut tx, consumer_group, env)).await? {
                        Ok(admission) => break (tx, admission),
                        // A deadlock or serialization failure before the
                        // handler ran costs nothing: roll back and start the
                        // inbox step over, transparently.
                        Err(e) if is_retryable(&e) && try_no < ADMISSION_TRIES => {
                            let _ = tx.rollback().await;
                            tracing::debug!(
                                event_id = %env.event_id,
                                error = %e,
                                try_no,
                                "inbox check hit a deadlock or serialization failure; trying again"
                            );
                            tokio::time::sleep(std::time::Duration::from_millis(5 * u64::from(try_no))).await;
                            try_no += 1;
                        }
                        Err(e) => {
                            let _ = tx.rollback().await;
                            return Err(db_err("check", e));
                        }
                    }
                };
                match admission {
                    Admission::Duplicate => {
                        let _ = tx.rollback().await;
                        return Ok($crate::Handled::Duplicate);
                    }
                    Admission::Stale { remembered } => {
                        tracing::info!(
                            event_id = %env.event_id,
                            consumer_group,
                            aggregate_id = env.aggregate_id.as_deref().unwrap_or(""),
                            aggregate_version = env.aggregate_version,
                            remembered,
                            "stale event skipped: the inbox has seen a newer version of its aggregate"
                        );
                        let _ = tx.rollback().await;
                        return Ok($crate::Handled::Stale);
                    }
                    Admission::Fresh => {}
                }
                if let Err(e) = handler.handle(&mut tx, message).await {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
                // Given up, the commit may still have been made: the
                // message then comes back as a duplicate.
                within("commit", tx.commit()).await?.map_err(|e| db_err("commit", e))?;
                Ok($crate::Handled::Ok)
            }

            /// Deletes inbox rows (and aggregate versions) recorded before
            /// `before_ms`, `batch_size` rows per statement, until none are
            /// left; returns how many rows went.
            pub async fn purge(&self, before_ms: i64, batch_size: u32) -> Result<u64, postbox_core::Error> {
                let mut total = 0;
                for stmt in [&self.sql.purge_events, &self.sql.purge_versions] {
                    loop {
                        let n = sqlx::query(stmt)
                            .bind(before_ms)
                            .bind(i64::from(batch_size))
                            .execute(&self.pool)
                            .await
                            .map_err(|e| postbox_core::Error::database("inbox purge", e))?
                            .rows_affected();
                        total += n;
                        if n < u64::from(batch_size) {
                            break;
                        }
                    }
                }
                Ok(total)
            }
        }

        #[async_trait::async_trait]
        impl<H: $crate::inbox::TxHandler<$db>> $crate::Handler for $crate::inbox::InboxHandler<$db, H> {
            async fn handle(&self, message: &$crate::Message) -> Result<$crate::Handled, $crate::HandlerError> {
                self.inbox.process(&self.consumer_group, message, &self.inner).await
            }

            async fn handled_before(&self, message: &$crate::Message) -> Result<bool, $crate::HandlerError> {
                self.inbox.has(&self.consumer_group, &message.envelope.event_id).await
            }
        }
    };
}

pub(crate) use inbox_backend;

pub(crate) mod sql {
    /// One dialect's statements; `{table}` is replaced by the validated
    /// inbox table name.
    pub struct Dialect {
        /// Idempotent DDL, run in one transaction.
        pub create: &'static [&'static str],
        /// Binds group, event_id, now; affects 0 rows for a duplicate.
        pub insert_event: &'static str,
        /// Binds group, event_id; counts the event's row (0 or 1).
        pub has_event: &'static str,
        /// Binds group, aggregate_id, version, now; creates the row when the
        /// aggregate is new. Where it finds the row it must take no lock, or
        /// an exclusive one: never a shared lock that `lock_version` would
        /// then upgrade (two transactions upgrading deadlock).
        pub insert_version: &'static str,
        /// Binds group, aggregate_id; returns the version, locking the row.
        pub lock_version: &'static str,
        /// Binds version, now, group, aggregate_id.
        pub update_version: &'static str,
        /// Binds cut-off ms, batch size.
        pub purge_events: &'static str,
        /// Binds cut-off ms, batch size.
        pub purge_versions: &'static str,
        /// Run on each new connection of a pool [`Inbox::connect`] opens.
        pub on_connect: Option<&'static str>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_spelled_for_sqlx() {
        assert_eq!(normalise_url("mariadb://root@h/db"), "mysql://root@h/db");
        assert_eq!(normalise_url("sqlite://x.db"), "sqlite://x.db?mode=rwc");
        assert_eq!(
            normalise_url("sqlite://x.db?mode=ro"),
            "sqlite://x.db?mode=ro"
        );
        assert_eq!(normalise_url("postgres://h/db"), "postgres://h/db");
    }

    #[test]
    fn a_url_s_database_must_be_in_the_build() {
        let key = KeyPath::consumer(0).join("inbox").join("url");
        for (url, feature) in [
            ("postgres://h/db", cfg!(feature = "postgres")),
            ("mariadb://h/db", cfg!(feature = "mysql")),
            ("sqlite://x.db", cfg!(feature = "sqlite")),
        ] {
            let found = database_of(&SecretUrl::new(url.to_owned()), &key);
            assert_eq!(found.is_ok(), feature, "{url}: {found:?}");
            if let Err(e) = found {
                assert!(e.to_string().contains("feature"), "{e}");
            }
        }
        assert!(database_of(&SecretUrl::new("oracle://h".to_owned()), &key).is_err());
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn statements_name_the_table() {
        let t = TableName::new("room_inbox").unwrap();
        let s = Statements::render(&t, &postgres::DIALECT);
        assert!(s.insert_event.contains("room_inbox "), "{}", s.insert_event);
        assert!(s.lock_version.contains("room_inbox_versions"));
        assert!(s.create.iter().all(|c| !c.contains("{table}")));
    }
}
