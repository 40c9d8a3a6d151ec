//! The heart of postbox: the outbox row model, configuration, the retry
//! policy, the [`Publisher`](publish::Publisher) and
//! [`OutboxStore`](store::OutboxStore) traits, and the [`relay`] that moves
//! committed rows from a store to every publisher, at least once.
//!
//! Database backends (`postbox-postgres`, `postbox-mysql`, `postbox-sqlite`)
//! implement [`store::OutboxStore`]; publishers (`postbox-publishers`)
//! implement [`publish::Publisher`]. This crate does no I/O of its own besides
//! driving those two traits.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod archive;
pub mod config;
pub mod envelope;
pub mod error;
pub mod event;
pub mod metrics;
pub mod publish;
pub mod redact;
pub mod relay;
pub mod retry;
pub mod store;
pub mod table;
pub mod template;
pub mod time;
pub mod wake;
pub mod wire;

pub use error::{Error, Result};
pub use event::{ClaimSource, ClaimedEvent, EventRecord, NewEvent, Status};
pub use publish::{PublishError, Publisher};
pub use store::{
    ArchiveStore, EnqueueStore, InspectStore, OutboxStore, RelayStore, ReplayStore, SchemaStore,
};
pub use table::TableName;
