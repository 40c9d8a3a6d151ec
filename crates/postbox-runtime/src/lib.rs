//! postbox's wiring as a library: what the `postbox` command runs, for a
//! service that embeds postbox instead.
//!
//! ```text
//!  config::load ──▶ Settings (checked once)
//!                     │
//!                     ├─ store::open ─────────▶ Arc<dyn OutboxStore>  (the one URL scheme → backend switch)
//!                     ├─ relay::RelayService ─▶ relay + admin server ([admin]) + archiver ([archive] enabled)
//!                     ├─ consumers::run ──────▶ every [[consumers]] entry + its inbox purge
//!                     └─ admin::bind ─────────▶ the admin API, /metrics and the dashboard alone
//!  signals::spawn_signal_handler: SIGINT/SIGTERM cancel the shutdown token; a second one exits
//! ```
//!
//! Everything takes [`Settings`](postbox_core::config::Settings), so a
//! configuration is checked once, by
//! [`config::load`](postbox_core::config::load) or
//! [`Config::validate`](postbox_core::config::Config::validate); errors are
//! [`postbox_core::Error`], and a configuration error names its key
//! (`publishers.1.url`).
//!
//! # Embedding the relay in a service
//!
//! ```no_run
//! use postbox_core::config::{self, ConfigSource};
//! use postbox_core::relay::CancellationToken;
//! use postbox_runtime::relay::{RelayOptions, RelayService};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), postbox_core::Error> {
//!     let settings = config::load(&ConfigSource {
//!         file: Some("postbox.toml".into()),
//!         database_url: None,
//!     })?;
//!     // Opens the store and connects every publisher: a bad URL or a
//!     // missing table fails here, before anything runs.
//!     let relay = RelayService::start(&settings, RelayOptions::default()).await?;
//!
//!     // The service decides when to stop; here on SIGINT/SIGTERM, as
//!     // `postbox relay` does.
//!     let shutdown = CancellationToken::new();
//!     postbox_runtime::signals::spawn_signal_handler(shutdown.clone(), || {});
//!
//!     // Runs beside the service's own tasks until `shutdown` is cancelled:
//!     // in-flight publishes finish, unstarted leases are released.
//!     let report = tokio::spawn(relay.run(shutdown.clone()))
//!         .await
//!         .map_err(|e| postbox_core::Error::Internal(e.to_string()))??;
//!     println!("delivered {}", report.delivered);
//!     Ok(())
//! }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod backfill;
pub mod consumers;
pub mod inbox;
pub mod relay;
pub mod signals;
pub mod spans;
pub mod store;
#[cfg(test)]
mod test_support;
pub mod topology;

pub use postbox_core::config::DEFAULT_ADMIN_LISTEN;
