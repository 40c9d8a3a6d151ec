//! The service's own tables beside its outbox, on MariaDB or SQLite.
//!
//! Both databases take `?` placeholders, so every statement of the service
//! is written once; [`Db`] only picks the driver. A service on one database
//! would use its sqlx pool and `MySqlOutbox` (or `SqliteOutbox`) directly:
//! the enum exists so this example runs with no server at all.

use postbox::config::{DatabaseKind, Settings};
use postbox::mysql::MySqlOutbox;
use postbox::sqlite::SqliteOutbox;
use postbox::{NewEvent, OutboxStore};
use sqlx::mysql::MySqlRow;
use sqlx::sqlite::SqliteRow;
use sqlx::{FromRow, MySql, Sqlite, Transaction};

/// A value bound to a `?`.
#[derive(Debug, Clone)]
pub enum Arg {
    /// An integer.
    Int(i64),
    /// A string.
    Text(String),
}

impl From<i64> for Arg {
    fn from(v: i64) -> Self {
        Arg::Int(v)
    }
}

impl From<&str> for Arg {
    fn from(v: &str) -> Self {
        Arg::Text(v.to_owned())
    }
}

impl From<String> for Arg {
    fn from(v: String) -> Self {
        Arg::Text(v)
    }
}

/// `args![a, b]`: the values of a statement's placeholders, in order.
#[macro_export]
macro_rules! args {
    ($($v:expr),* $(,)?) => { vec![$($crate::db::Arg::from($v)),*] };
}

/// A database with an outbox table in it.
#[derive(Clone, Debug)]
pub enum Db {
    /// MySQL or MariaDB.
    MySql(MySqlOutbox),
    /// SQLite (one process).
    Sqlite(SqliteOutbox),
}

/// A row a query returns, readable from either driver.
pub trait Row:
    for<'r> FromRow<'r, MySqlRow> + for<'r> FromRow<'r, SqliteRow> + Send + Unpin
{
}
impl<T> Row for T where
    T: for<'r> FromRow<'r, MySqlRow> + for<'r> FromRow<'r, SqliteRow> + Send + Unpin
{
}

/// An open transaction: the service's writes and its outbox rows commit
/// together or not at all.
pub enum Tx {
    /// On MySQL.
    MySql(Transaction<'static, MySql>, MySqlOutbox),
    /// On SQLite.
    Sqlite(Transaction<'static, Sqlite>, SqliteOutbox),
}

/// A database error, as the service reports it.
pub type DbError = postbox::Error;

fn db_error(what: &'static str, e: sqlx::Error) -> DbError {
    postbox::Error::database(what, e)
}

macro_rules! bind_all {
    ($sql:expr, $args:expr) => {{
        let mut q = $sql;
        for a in $args {
            q = match a {
                Arg::Int(v) => q.bind(*v),
                Arg::Text(v) => q.bind(v.as_str()),
            };
        }
        q
    }};
}

/// `$body` once per driver: the same code, typed for MySQL or SQLite.
macro_rules! each_driver {
    ($value:expr, $enum:ident($($bind:pat),+) => $body:expr) => {
        match $value {
            $enum::MySql($($bind),+) => $body,
            $enum::Sqlite($($bind),+) => $body,
        }
    };
}

impl Db {
    /// Opens the database of `settings` (`[database]` of the postbox config
    /// the relay reads too), creating a missing SQLite file, and migrates the
    /// outbox table and the service's own `tables`.
    pub async fn open(settings: &Settings, tables: &[&str]) -> Result<Db, DbError> {
        let d = &settings.database;
        let (url, table, n) = (d.url.expose(), d.table.as_str(), d.max_connections);
        let db = match settings.database_kind() {
            DatabaseKind::MySql => Db::MySql(MySqlOutbox::connect(url, table, n).await?),
            DatabaseKind::Sqlite => Db::Sqlite(SqliteOutbox::connect(url, table, n).await?),
            other => {
                return Err(postbox::Error::config(
                    "database.url",
                    format!("the room service example runs on MariaDB or SQLite, not {other:?}"),
                ))
            }
        };
        db.outbox().migrate().await?;
        for ddl in tables {
            db.execute(ddl, vec![]).await?;
        }
        Ok(db)
    }

    /// The outbox, for the store operations (`status`, `replay`, …).
    pub fn outbox(&self) -> &dyn OutboxStore {
        each_driver!(self, Db(o) => o)
    }

    /// The outbox as the relay takes it: a relay over this store wakes on
    /// every `enqueue` of this process, without waiting for a poll.
    pub fn store(&self) -> std::sync::Arc<dyn OutboxStore> {
        each_driver!(self, Db(o) => std::sync::Arc::new(o.clone()))
    }

    /// `INSERT IGNORE` in this database's words.
    pub fn insert_ignore(&self) -> &'static str {
        match self {
            Db::MySql(_) => "INSERT IGNORE",
            Db::Sqlite(_) => "INSERT OR IGNORE",
        }
    }

    /// Starts a write transaction (SQLite: `BEGIN IMMEDIATE`, so a
    /// transaction that reads first never fails half-way on the write lock).
    pub async fn begin(&self) -> Result<Tx, DbError> {
        let begin = |e| db_error("begin", e);
        Ok(match self {
            Db::MySql(o) => Tx::MySql(o.pool().begin().await.map_err(begin)?, o.clone()),
            Db::Sqlite(o) => Tx::Sqlite(
                o.pool()
                    .begin_with("BEGIN IMMEDIATE")
                    .await
                    .map_err(begin)?,
                o.clone(),
            ),
        })
    }

    /// Runs one statement outside a transaction; the rows it changed.
    pub async fn execute(&self, sql: &str, args: Vec<Arg>) -> Result<u64, DbError> {
        each_driver!(self, Db(o) => bind_all!(sqlx::query(sql), &args).execute(o.pool()).await.map(|r| r.rows_affected()))
            .map_err(|e| db_error("execute", e))
    }

    /// Reads at most one row outside a transaction.
    pub async fn fetch_optional<T: Row>(
        &self,
        sql: &str,
        args: Vec<Arg>,
    ) -> Result<Option<T>, DbError> {
        each_driver!(self, Db(o) => bind_all!(sqlx::query_as(sql), &args).fetch_optional(o.pool()).await)
            .map_err(|e| db_error("query", e))
    }

    /// Reads every row outside a transaction.
    pub async fn fetch_all<T: Row>(&self, sql: &str, args: Vec<Arg>) -> Result<Vec<T>, DbError> {
        each_driver!(self, Db(o) => bind_all!(sqlx::query_as(sql), &args).fetch_all(o.pool()).await)
            .map_err(|e| db_error("query", e))
    }
}

impl Tx {
    /// Runs one statement in the transaction; the rows it changed.
    pub async fn execute(&mut self, sql: &str, args: Vec<Arg>) -> Result<u64, sqlx::Error> {
        each_driver!(self, Tx(tx, _) => bind_all!(sqlx::query(sql), &args).execute(&mut **tx).await.map(|r| r.rows_affected()))
    }

    /// Reads at most one row in the transaction.
    pub async fn fetch_optional<T: Row>(
        &mut self,
        sql: &str,
        args: Vec<Arg>,
    ) -> Result<Option<T>, DbError> {
        each_driver!(self, Tx(tx, _) => bind_all!(sqlx::query_as(sql), &args).fetch_optional(&mut **tx).await)
            .map_err(|e| db_error("query", e))
    }

    /// Writes `event` to the outbox in this transaction: it is delivered if,
    /// and only if, the transaction commits.
    pub async fn enqueue(&mut self, event: &NewEvent) -> Result<i64, DbError> {
        each_driver!(self, Tx(tx, o) => o.enqueue(tx, event).await)
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), DbError> {
        each_driver!(self, Tx(tx, _) => tx.commit().await).map_err(|e| db_error("commit", e))
    }
}

/// Whether `e` is a unique-key violation (a second writer of the same key).
pub fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.is_unique_violation())
}
