//! The MySQL 8 / MariaDB 10.6+ backend of postbox.
//!
//! Services enqueue inside their own transaction:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::MySqlPool) -> postbox_core::Result<()> {
//! use postbox_core::NewEvent;
//! use postbox_mysql::MySqlOutbox;
//!
//! let outbox = MySqlOutbox::new(pool.clone(), "room_outbox")?;
//! let mut tx = pool.begin().await.map_err(|e| postbox_core::Error::database("begin", e))?;
//! // ... the service's own writes on &mut *tx ...
//! outbox.enqueue(&mut tx, &NewEvent::new("room", "RoomCreated", r#"{"room_id":42}"#)).await?;
//! tx.commit().await.map_err(|e| postbox_core::Error::database("commit", e))?;
//! # Ok(()) }
//! ```
//!
//! The relay and the CLI use the same type through
//! [`OutboxStore`](postbox_core::OutboxStore).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod dialect;
mod doctor;
mod explain;
mod sql;

pub use dialect::MySqlDialect;

/// An outbox table in MySQL 8 or MariaDB 10.6+: the engine with the MySQL
/// dialect. `connect` takes `mysql://…` or `mariadb://…`; `enqueue`
/// writes on the caller's connection or transaction (pass `&mut tx`), and
/// a duplicate `(app_code, event_id)` returns
/// [`postbox_core::Error::DuplicateEvent`] leaving the transaction usable
/// (MySQL undoes only the failed statement).
pub type MySqlOutbox = postbox_sqlx::SqlOutbox<MySqlDialect>;

/// Opens an outbox table as a `dyn OutboxStore`: [`postbox_sqlx::SqlOutbox::open`].
pub fn open(options: postbox_sqlx::OpenOptions<'_>) -> postbox_sqlx::Opened<'_> {
    MySqlOutbox::open(options)
}
