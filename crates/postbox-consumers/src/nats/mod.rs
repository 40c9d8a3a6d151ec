//! The NATS JetStream consumer (SPEC §7).
//!
//! A durable pull consumer named after `consumer_group` on the stream
//! `queue` (filtered by `subject`), with explicit acks. Every process pulls
//! at most `prefetch` messages and settles them all before pulling again, so
//! it never holds more than `prefetch` unacknowledged messages; any number of
//! processes share the durable. (`max_ack_pending` is left to the server:
//! it counts the whole group, nak'ed messages waiting for their delay
//! included, so setting it to `prefetch` would let one failing message stop
//! every process.)
//!
//! - Success: ack, confirmed by the server.
//! - Failure: nak with a delay of `retry_delay × 2^(n-1)` (capped at
//!   `max_retry_delay`); the attempt number `n` is JetStream's delivery count.
//! - After `max_attempts`: a copy goes to the dead subject (default
//!   `<stream>.dead.<consumer_group>`, headers `x-last-error`,
//!   `x-consume-attempt`, `x-event-id`), and only after its PubAck is the
//!   original terminated. A message delivered more than `max_attempts` times
//!   (its consumers died mid-message) is dead-lettered without being handled
//!   again. When the dead copy cannot be stored (dead stream full, no
//!   leader) the original is nak'ed with a growing delay (from
//!   `retry_delay`, capped at `max_retry_delay`) and dead-lettered again when
//!   it comes back, until the copy is stored. `max_deliver` is unlimited
//!   (`-1`): postbox counts attempts itself, so trouble with the dead stream
//!   never makes the server give up on a message (with `declare = false` a
//!   finite `max_deliver` is warned about at start).
//! - A consumer that dies mid-message: the server redelivers after
//!   `ack_wait`; a running handler keeps its message with progress signals.
//!
//! With `declare = true` the stream (capturing `subject`), a `<stream>_dead`
//! stream capturing `<stream>.dead.>` (when no stream captures the dead
//! subject) and the durable consumer are created.
//!
//! Files: `topology.rs` (the streams and the durable consumer),
//! `message.rs` (a JetStream message as a [`Message`](crate::Message), and
//! the headers of a dead copy), `consumer.rs` (the pull loop and the
//! transport actions of the shared ack / retry / dead path,
//! [`crate::consume`]). The header, subject and stream names are
//! [`postbox_core::wire::nats`]'s.

mod consumer;
pub(crate) mod dead;
mod message;
mod topology;

pub use consumer::NatsConsumer;

use postbox_core::config::nodes::{nats_nodes, NatsCredentials};
use postbox_core::redact::SecretUrl;

/// Options carrying the credentials in `nodes`' URLs, and the nodes
/// without them, to connect to ([`nats_nodes`]: the client reads none
/// from a URL).
pub fn connect_options(
    nodes: &[SecretUrl],
) -> Result<(async_nats::ConnectOptions, Vec<String>), String> {
    let (servers, credentials) = nats_nodes(nodes)?;
    let options = async_nats::ConnectOptions::new();
    let options = match credentials {
        Some(NatsCredentials::UserPassword(user, password)) => {
            options.user_and_password(user, password)
        }
        Some(NatsCredentials::Token(token)) => options.token(token),
        None => options,
    };
    Ok((options, servers))
}
pub use message::{dead_headers, message_from_nats};
pub use topology::{dead_stream, subject_matches, MAX_DELIVER};
