//! The one error type of postbox-core and the backends.

use std::fmt;

/// Everything that can go wrong in postbox's library code.
///
/// Messages say what failed and on what; they never contain secrets (database
/// URLs are redacted before they get here).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An event with this `(app_code, event_id)` is already in the outbox.
    /// The caller's transaction is still usable.
    #[error("duplicate event: app_code `{app_code}` already has event_id `{event_id}`")]
    DuplicateEvent {
        /// Tenant of the event.
        app_code: String,
        /// The id that already exists.
        event_id: String,
    },
    /// The payload is larger than `database.max_payload_bytes`.
    #[error("payload of event `{event_id}` is {size} bytes, over the limit of {limit} bytes (database.max_payload_bytes)")]
    PayloadTooLarge {
        /// The event's id.
        event_id: String,
        /// Payload size in bytes.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A field of a new event is missing or malformed.
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    /// A table name that is not a plain SQL identifier.
    #[error("invalid table name `{0}`: must match ^[A-Za-z_][A-Za-z0-9_]{{0,41}}$ (postbox adds suffixes of up to 21 characters, such as `_archive_created_idx`, and PostgreSQL cuts names at 63 characters, MySQL refuses them)")]
    InvalidTableName(String),
    /// The configuration is wrong; `key` names the offending key (or the
    /// command-line flag, `--listen`, that overrides it).
    #[error("{} `{key}`: {reason}", if key.starts_with("--") { "flag" } else { "config key" })]
    Config {
        /// Dotted path of the key, e.g. `outbox_worker.batch_size`.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The database schema is missing or older than this postbox.
    #[error("schema: {0}")]
    Schema(String),
    /// A database operation failed.
    #[error("database error during {operation}: {source}")]
    Database {
        /// What postbox was doing.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The database refused a value as malformed (SQLSTATE class 22, data
    /// exception: a NUL byte in text, a value too long for its column, …):
    /// bad input, not a failing database.
    #[error("invalid input during {operation}: {source}")]
    InvalidInput {
        /// What postbox was doing.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A deadlock or serialization failure: the database rolled the
    /// transaction back, and running it again is expected to succeed.
    /// Services that `enqueue` inside their own transaction retry it as they
    /// would any transaction that hit a deadlock.
    #[error("transient database conflict during {operation} (retry the transaction): {source}")]
    Transient {
        /// What postbox was doing.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A request that would do harm as asked (a replay to chosen
    /// publishers that would mark events delivered without the others):
    /// the message says why and what to ask instead. Nothing changed.
    #[error("{0}")]
    Refused(String),
    /// A bug: something postbox relies on did not hold (a relay stage
    /// panicked). The message says what stopped.
    #[error("internal error (a bug in postbox; please report it): {0}")]
    Internal(String),
    /// Filesystem or other I/O failed.
    #[error("{context}: {source}")]
    Io {
        /// What postbox was doing.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps a driver error with the operation that failed.
    pub fn database(
        operation: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Database {
            operation,
            source: Box::new(source),
        }
    }

    /// Wraps a driver error, classifying it by its SQLSTATE (or SQLite result
    /// code): deadlocks and serialization failures become
    /// [`Error::Transient`].
    pub fn from_driver(
        operation: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
        code: Option<&str>,
    ) -> Self {
        // 40001 serialization failure / MySQL deadlock, 40P01 PostgreSQL
        // deadlock; SQLite 5 BUSY, 6 LOCKED, 517 BUSY_SNAPSHOT.
        if matches!(code, Some("40001" | "40P01" | "5" | "6" | "517")) {
            Error::Transient {
                operation,
                source: Box::new(source),
            }
        } else if code.is_some_and(|c| c.len() == 5 && c.starts_with("22")) {
            Error::InvalidInput {
                operation,
                source: Box::new(source),
            }
        } else {
            Error::database(operation, source)
        }
    }

    /// True for a deadlock or serialization failure worth retrying.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Transient { .. })
    }

    /// A database error of `operation`: no answer within `within` (a
    /// database gone silent; postbox stopped waiting).
    pub fn no_answer(operation: &'static str, within: std::time::Duration) -> Self {
        Error::Database {
            operation,
            source: Box::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer from the database within {within:?}"),
            )),
        }
    }

    /// `work`, or [`Error::no_answer`] when it has not ended within
    /// `within`: every wait on a database that may go silent.
    pub async fn unless_silent<T>(
        operation: &'static str,
        within: std::time::Duration,
        work: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        tokio::time::timeout(within, work)
            .await
            .unwrap_or_else(|_| Err(Error::no_answer(operation, within)))
    }

    /// A configuration error on `key`.
    pub fn config(key: impl Into<String>, reason: impl fmt::Display) -> Self {
        Error::Config {
            key: key.into(),
            reason: reason.to_string(),
        }
    }

    /// Places a config error of a component built from one config entry at
    /// that entry: components name keys relative to their entry (`url`),
    /// the caller knows where the entry is (`publishers.2`), and the user
    /// reads `publishers.2.url`. Other errors pass unchanged.
    pub fn within(self, entry: &crate::config::KeyPath) -> Self {
        match self {
            Error::Config { key, reason } => Error::Config {
                key: entry.join(&key).into(),
                reason,
            },
            other => other,
        }
    }

    /// True for errors caused by bad input or configuration (exit code 2),
    /// false for runtime failures (exit code 1).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            Error::Config { .. }
                | Error::InvalidTableName(_)
                | Error::InvalidEvent(_)
                | Error::InvalidInput { .. }
                | Error::PayloadTooLarge { .. }
                | Error::Refused(_)
        )
    }
}

/// Runs `op` again, up to five times in all, while it fails with a
/// transient error (deadlock, serialization failure), pausing a few random
/// milliseconds between tries. For whole transactions postbox owns.
pub async fn retry_transient<T, F, Fut>(mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut tries = 1;
    loop {
        match op().await {
            Err(e) if e.is_transient() && tries < 5 => {
                tries += 1;
                let pause = rand::random_range(5..50u64) * tries;
                tracing::debug!(error = %e, tries, "transient database conflict; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
            }
            other => return other,
        }
    }
}

/// Result alias used throughout postbox.
pub type Result<T, E = Error> = std::result::Result<T, E>;
