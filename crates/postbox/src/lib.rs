//! postbox: "the database committed, so the message will be delivered".
//!
//! Write an outbox row in the same transaction as your business rows with the
//! backend's `enqueue`; run `postbox relay` (or [`relay::Relay`]) to deliver
//! every committed row, at least once, to every configured publisher.
//!
//! This crate only re-exports: [`postbox_core`] holds the types and the relay,
//! one crate per database holds its SQL.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use postbox_core::*;
pub use postbox_publishers as publishers;

/// PostgreSQL backend.
#[cfg(feature = "postgres")]
pub use postbox_postgres as postgres;

/// MySQL / MariaDB backend.
#[cfg(feature = "mysql")]
pub use postbox_mysql as mysql;

/// SQLite backend.
#[cfg(feature = "sqlite")]
pub use postbox_sqlite as sqlite;
