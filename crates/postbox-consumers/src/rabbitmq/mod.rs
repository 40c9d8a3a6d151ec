//! The RabbitMQ consumer (SPEC §7).
//!
//! One connection per consumer with two channels: the consuming channel has
//! `basic.qos(prefetch)` and manual acks; the publishing channel is in
//! confirm mode and carries retry and dead-letter copies. A message is
//! acknowledged only after its handler succeeded, or after its retry or dead
//! copy was confirmed by the broker, so nothing is lost in between.
//!
//! A message the broker redelivers (its consumer stopped without acking it:
//! crash, kill, lost connection) counts as a failed attempt and goes the
//! retry path unhandled, so a message that crashes every consumer ends in
//! `<queue>.dead` after `max_attempts` crashes.
//!
//! Topology (`declare = true`): `<queue>` (durable), `<queue>.retry` (durable;
//! a copy waits there for its per-message `expiration`, then dead-letters
//! back to `<queue>` through the default exchange), `<queue>.dead` (durable),
//! and the bindings. With `declare = false` the same topology is checked at
//! every connect, without changing it ([`check_topology`]); a missing queue or
//! a retry queue that does not dead-letter back refuses the consumer.
//!
//! `ordering = "per_aggregate"` holds later versions of an aggregate back
//! while an earlier one waits in retry ([`crate::ordering`]).
//!
//! Files: `topology.rs` (the queues), `dead.rs` (`postbox dead` on
//! `<queue>.dead`), `message.rs` (a delivery as a
//! [`Message`](crate::Message), and the properties of a copy),
//! `consumer.rs` (the consume loop and the transport actions of the shared
//! ack / retry / dead path, [`crate::consume`]). The queue names are
//! [`postbox_core::wire::rabbitmq`]'s.

mod consumer;
pub(crate) mod dead;
mod message;
mod topology;

pub use crate::consume::{consumer_tag, ConsumeReport};
pub use consumer::{RabbitMqConsumer, HOLD_GRACE};
pub use message::message_from_delivery;
pub use topology::{check_topology, dead_queue, declare_topology, retry_queue, TopologyError};

use std::future::Future;
use std::time::Duration;

use lapin::Connection;
use postbox_core::redact::SecretUrl;

/// How long one connection attempt to one node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to the first of `nodes` that answers, trying them in order from
/// `first` (wrapping around); the connection and its node's index, or every
/// node's reason.
pub(crate) async fn connect(
    nodes: &[SecretUrl],
    first: usize,
    props: lapin::ConnectionProperties,
) -> Result<(lapin::Connection, usize), String> {
    let mut reasons = Vec::new();
    for k in 0..nodes.len() {
        let i = (first + k) % nodes.len();
        let url = &nodes[i];
        let attempt = lapin::Connection::connect(url.expose(), props.clone());
        match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(Ok(connection)) => return Ok((connection, i)),
            Ok(Err(e)) => reasons.push(format!(
                "{url}: {}",
                postbox_core::redact::redact_url(&e.to_string())
            )),
            Err(_) => reasons.push(format!("{url}: no answer within {CONNECT_TIMEOUT:?}")),
        }
    }
    Err(reasons.join("; "))
}

/// How long one step on the broker outside a consumer's flow (a
/// dead-letter pass's read, confirm, ack or close; a consumer's check of
/// the queues it was given) waits for its answer.
const STEP_WITHIN: Duration = Duration::from_secs(15);

/// How often a wait on the broker looks whether its connection is lost.
const LOST_CHECK: Duration = Duration::from_millis(100);

/// `work` (an acknowledgement, a publish and its confirm), or `None` once
/// `connection` is lost. lapin may drop an operation sent as its connection
/// fails without ever answering it: awaited alone, it would hold the
/// consumer on a dead connection for good (the broker has already put the
/// message back for redelivery).
async fn unless_lost<T>(connection: &Connection, work: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        done = work => Some(done),
        _ = lost(connection) => None,
    }
}

/// Ends once `connection` is no longer connected.
async fn lost(connection: &Connection) {
    while connection.status().connected() {
        tokio::time::sleep(LOST_CHECK).await;
    }
}
