//! The PostgreSQL backend of postbox.
//!
//! Services enqueue inside their own transaction:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> postbox_core::Result<()> {
//! use postbox_core::NewEvent;
//! use postbox_postgres::PgOutbox;
//!
//! let outbox = PgOutbox::new(pool.clone(), "room_outbox")?;
//! let mut tx = pool.begin().await.map_err(|e| postbox_core::Error::database("begin", e))?;
//! // ... the service's own writes on &mut *tx ...
//! outbox.enqueue(&mut tx, &NewEvent::new("room", "RoomCreated", r#"{"room_id":42}"#)).await?;
//! tx.commit().await.map_err(|e| postbox_core::Error::database("commit", e))?;
//! # Ok(()) }
//! ```
//!
//! The relay and the CLI use the same type through
//! [`OutboxStore`](postbox_core::OutboxStore).
//!
//! A relay should run on a pool of its own ([`PgOutbox::connect`]), whose
//! sessions have JIT compilation off: the planner's cost estimate of the
//! claims passes `jit_above_cost`, and compiling costs ten times the
//! claim. A relay handed the service's pool (`PgOutbox::new`) should get
//! one connected with `options=-c jit=off` in its URL.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod dialect;
mod explain;
mod sql;
mod wake;

pub use dialect::PgDialect;

/// An outbox table in PostgreSQL: the engine with the PostgreSQL dialect.
/// [`PgOutbox::connect`] connects a pool of `max_connections` to `url`.
pub type PgOutbox = postbox_sqlx::SqlOutbox<PgDialect>;

/// Opens an outbox table as a `dyn OutboxStore`: [`postbox_sqlx::SqlOutbox::open`].
pub fn open(options: postbox_sqlx::OpenOptions<'_>) -> postbox_sqlx::Opened<'_> {
    PgOutbox::open(options)
}
