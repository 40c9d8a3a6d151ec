//! Test support for postbox: where the servers are, scratch table names,
//! publishers for tests, and the conformance suite every backend runs.
//!
//! A missing server is a loud failure naming the server and how to start
//! it, never a silent skip.

pub mod conformance;
pub mod publishers;
pub mod servers;

pub use publishers::RecordingPublisher;
pub use servers::{mysql_url, postgres_url, scratch_table};
