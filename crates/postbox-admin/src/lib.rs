//! The postbox admin server: Prometheus `/metrics`, `/healthz`, a JSON API
//! over the outbox table and a small dashboard at `/` (SPEC §8).
//!
//! ```text
//!  StatsPoller ──every interval──▶ store.stats() ─▶ gauges + Snapshot
//!                                                     │
//!  GET /metrics ◀── PrometheusHandle::render()        │ (no query per scrape)
//!  GET /api/stats ◀───────────────────────────────────┘
//!  GET /api/events…, POST …/replay ──▶ store (replay needs the bearer token)
//! ```
//!
//! The relay records its counters through the `metrics` facade; a process
//! that installs [`install_recorder`] before it starts the relay serves them.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod api;
mod auth;
mod consumers_api;
mod dashboard;
mod error;
mod listener;
mod metrics_server;
mod poller;
mod recorder;
mod redact;
mod server;
mod state;

pub use consumers_api::{ConsumerControl, DeadRequest, DeadVerb};
pub use metrics_server::MetricsServer;
pub use poller::{Snapshot, StatsPoller};
pub use recorder::install_recorder;
pub use server::{AdminServer, AdminSettings};
pub use state::TopologySource;
