//! The Redis Streams consumer (SPEC §7).
//!
//! A member of the consumer group `consumer_group` on the stream `queue`,
//! named `{group}-{host}-{pid}` (`{group}-{name}-{host}-{pid}` for an entry
//! whose `name` is not its group's). `declare = true` creates the group (from
//! the start of the stream, `XGROUP CREATE … 0 MKSTREAM`).
//!
//! - New entries: `XREADGROUP … COUNT prefetch BLOCK`, so a consumer holds
//!   at most `prefetch` entries it has not settled; `XACK` after the handler
//!   succeeded.
//! - Failure: the entry stays pending. Once it has been idle for
//!   `retry_delay × 2^(n-1)` (capped; `n` is the group's delivery count) any
//!   consumer of the group claims it (`XPENDING … IDLE` then `XCLAIM`) and
//!   tries again. The same path picks up entries of consumers that died.
//!   While a handler runs, its entries' idle time is reset every third of
//!   `retry_delay` (`XCLAIM … JUSTID`) from a thread of the consumer's own,
//!   with its own connection, so a slow or thread-blocking handler keeps
//!   them. The reset (a Lua script) only touches entries still pending for
//!   this consumer: an entry another consumer claimed (this one stalled
//!   longer than the retry delay) is never taken back, and the stalled
//!   handler's result is not acknowledged (`XACK` too checks the owner); the
//!   new owner settles it.
//! - After `max_attempts` deliveries: the entry is `XADD`ed to
//!   `<stream>.dead` (its fields, `headers` with `x-last-error` and
//!   `x-consume-attempt`, plus `consumer_group` and `source_id`) and
//!   `XACK`ed in one script, only while it is still this consumer's.
//!
//! The consumer's Redis user needs `EVAL` (`+@scripting`) besides the stream
//! commands.
//!
//! Files: `topology.rs` (connecting, the group, the dead stream),
//! `message.rs` (an entry as a [`Message`](crate::Message), and the fields
//! of a dead copy), `consumer.rs` (the read loop and the transport actions
//! of the shared ack / retry / dead path, [`crate::consume`]), `keeper.rs`
//! (the keep-alive of the entries in hand). The field and stream names are
//! [`postbox_core::wire::redis`]'s.

mod consumer;
pub(crate) mod dead;
mod keeper;
mod message;
mod topology;

pub use consumer::RedisConsumer;
pub use message::{dead_fields, message_from_entry};
pub use topology::dead_stream;
