//! postbox: "the database committed, so the message will be delivered".
//!
//! Write an outbox row in the same transaction as your business rows with the
//! backend's `enqueue`; run `postbox relay` (or [`relay::Relay`]) to deliver
//! every committed row, at least once, to every configured publisher. On the
//! receiving side, [`consumers`] run a handler per message, exactly once in
//! effect through an idempotent inbox.
//!
//! This crate only re-exports: [`postbox_core`] holds the types and the relay,
//! one crate per database holds its SQL, one crate each holds the publishers
//! and the consumers.
//!
//! # Example
//!
//! The event commits or rolls back with the rows written beside it:
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use postbox::postgres::PgOutbox;
//! use postbox::NewEvent;
//!
//! // The table `postbox migrate` created (or `OutboxStore::migrate`).
//! let outbox = PgOutbox::connect("postgres://localhost/app", "room_outbox", 4).await?;
//!
//! let mut tx = outbox.pool().begin().await?;
//! sqlx::query("INSERT INTO rooms (id) VALUES (42)")
//!     .execute(&mut *tx)
//!     .await?;
//! let event = NewEvent::new("room", "RoomCreated", r#"{"room_id":42}"#);
//! outbox.enqueue(&mut tx, &event).await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Features
//!
//! One feature per database and per broker; a build links only the
//! database drivers and broker clients it names (a broker feature brings the
//! consumers and their inbox, which works on the databases whose features
//! are on). The default is every
//! database and broker (what this crate offered before it had features). A
//! service that embeds PostgreSQL and NATS writes `postbox = { version = "…",
//! default-features = false, features = ["postgres", "nats"] }`.
//!
//! | feature    | enables                                                                                   | client crate |
//! |------------|-------------------------------------------------------------------------------------------|--------------|
//! | `postgres` | [`postgres`]: `PgOutbox`; the consumers' inbox and ordering holds on PostgreSQL           | `sqlx` (PostgreSQL) |
//! | `mysql`    | [`mysql`]: `MySqlOutbox` (MySQL, MariaDB); the inbox and holds on them                    | `sqlx` (MySQL) |
//! | `sqlite`   | [`sqlite`]: `SqliteOutbox`; the inbox and holds on SQLite                                 | `sqlx` (SQLite) |
//! | `rabbitmq` | `publishers::rabbitmq`, `consumers::rabbitmq`                                             | `lapin`      |
//! | `nats`     | `publishers::nats`, `consumers::nats` (JetStream)                                         | `async-nats` |
//! | `redis`    | `publishers::redis`, `consumers::redis` (Streams)                                         | `redis`      |
//! | `webhook`  | `publishers::webhook`, and `consumers::http` (the HTTP bridge) when a broker is on          | `reqwest`    |
//! | `runtime`  | [`runtime`]: run the relay (with its admin server and signal handling) or the consumers inside a service, from a config | all of the above |
//!
//! The file publisher ([`publishers::file`]) is always there. [`consumers`]
//! (handlers, retry policy, the inbox) comes with any broker feature.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use postbox_core::*;

/// Publishers: the file publisher, and one module per broker feature.
pub use postbox_publishers as publishers;

/// Consumers: handlers, the retry policy, the idempotent inbox, and one
/// consumer per broker feature.
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "redis"))]
pub use postbox_consumers as consumers;

/// PostgreSQL backend.
#[cfg(feature = "postgres")]
pub use postbox_postgres as postgres;

/// MySQL / MariaDB backend.
#[cfg(feature = "mysql")]
pub use postbox_mysql as mysql;

/// SQLite backend.
#[cfg(feature = "sqlite")]
pub use postbox_sqlite as sqlite;

/// The wiring the `postbox` binary runs on, for a service that embeds the
/// relay or the consumers.
#[cfg(feature = "runtime")]
pub use postbox_runtime as runtime;
