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
pub mod control;
pub mod envelope;
pub mod error;
pub mod event;
pub mod metrics;
pub mod naming;
pub mod partition;
pub mod publish;
pub mod redact;
pub mod relay;
pub mod retry;
pub mod store;
pub mod table;
pub mod template;
pub mod time;
pub mod timeline;
pub mod topology;
pub mod trace;
pub mod wake;
pub mod wire;

pub use error::{Error, Result};

/// The future of a public async entry point, boxed where it is defined.
///
/// An `async fn` is compiled in every crate that awaits it, with all it
/// awaits in turn; a future boxed in its own crate is compiled once, there.
/// Entry points that pull in much (a store, brokers, the relay, a server)
/// return this, so that the crates above them (the CLI, tests, a service)
/// do not compile them again.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
pub use event::{ClaimSource, ClaimedEvent, EventRecord, NewEvent, Status};
pub use publish::{PublishError, Publisher};
pub use store::{
    ArchiveStore, EnqueueStore, InspectStore, OutboxStore, RelayStore, ReplayStore, SchemaStore,
};
pub use table::TableName;
