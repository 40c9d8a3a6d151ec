//! What every consumer (RabbitMQ, NATS, Redis) shares, written once:
//!
//! - [`settle`]: the one ack / retry / dead path. The decision for a message
//!   (handled, duplicate, stale, retry after a delay, dead) and its
//!   bookkeeping (metric, log line, attempt counting, the report) live
//!   there; a broker implements only its transport actions
//!   ([`settle::Transport`]: ack, deliver again after a delay, store a dead
//!   copy, keep the message while its handler runs).
//! - [`session`]: the reconnect loop around a broker connection.
//! - [`ConsumeReport`], what a consumer did, and [`consumer_tag`], how a
//!   consumer process names itself to the broker.
//! - `Core`, what every consumer is made of (config, handler, retry
//!   policy, tag), built and checked once.

pub(crate) mod session;
pub(crate) mod settle;
mod spans;
pub mod state;

pub(crate) use state::Counted;

/// `with_tag`, `tag` and `Debug` of a consumer type `$consumer` whose
/// [`Core`] is its field `core` (the type's docs say what the tag is to its
/// broker); `$fields` name its queue, group and tag in `Debug` (see
/// [`Core::debug`]).
macro_rules! consumer_basics {
    ($consumer:ident, $fields:expr) => {
        impl $consumer {
            /// Replaces the tag (default: [`consumer_tag`](crate::consumer_tag)
            /// of the queue or group); a process running several consumers on
            /// one queue or group gives each its own.
            pub fn with_tag(mut self, tag: impl Into<String>) -> Self {
                self.core.tag = tag.into();
                self
            }

            /// The tag this consumer gives itself to the broker.
            pub fn tag(&self) -> &str {
                &self.core.tag
            }

            /// Its live state and pause switch, for an admin server
            /// ([`ConsumerState`](crate::consume::state::ConsumerState)).
            pub fn state(&self) -> std::sync::Arc<crate::consume::state::ConsumerState> {
                self.core.state.clone()
            }
        }

        impl std::fmt::Debug for $consumer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.core.debug(f, stringify!($consumer), $fields)
            }
        }
    };
}
pub(crate) use consumer_basics;

use std::sync::Arc;

use postbox_core::config::{ConsumerConfig, ConsumerKind};
use postbox_core::Error;

use crate::metrics::count;
use crate::{Handled, Handler, RetryPolicy};

/// `{queue}-{host}-{pid}`: tells the processes on one queue apart in the
/// broker's tools (the RabbitMQ management UI and `rabbitmqctl
/// list_consumers`, NATS `CONNZ`, Redis `XINFO CONSUMERS`).
pub fn consumer_tag(queue: &str) -> String {
    let host = postbox_core::wire::host_name().unwrap_or_else(|| "localhost".to_owned());
    format!("{queue}-{host}-{}", std::process::id())
}

/// What every consumer is made of: its config, the handler it calls, the
/// retry policy of its config and the tag it gives itself to the broker.
pub(crate) struct Core {
    /// The broker's name in messages ("RabbitMQ", "NATS", "Redis").
    pub broker: &'static str,
    pub config: ConsumerConfig,
    pub handler: Arc<dyn Handler>,
    pub policy: RetryPolicy,
    pub tag: String,
    /// Counts, connection and pause switch, shared with an admin server.
    pub state: Arc<state::ConsumerState>,
}

impl Core {
    /// The core of a `kind` consumer (`broker` names it when `config` is of
    /// another kind); its tag is [`consumer_tag`] of `tag_of(&config)`.
    pub(crate) fn new(
        config: ConsumerConfig,
        handler: Arc<dyn Handler>,
        kind: ConsumerKind,
        broker: &'static str,
        tag_of: fn(&ConsumerConfig) -> &str,
    ) -> Result<Self, Error> {
        if config.kind != kind {
            return Err(Error::config(
                "kind",
                format!("`{}` is not a {broker} consumer", config.kind.as_str()),
            ));
        }
        Ok(Core {
            broker,
            policy: RetryPolicy::of(&config),
            tag: consumer_tag(tag_of(&config)),
            state: Arc::new(state::ConsumerState::new(
                config.name(),
                config.kind.as_str(),
                config.queue.as_str(),
            )),
            config,
            handler,
        })
    }

    /// `Debug` of consumer type `consumer`: the config's name, its queue
    /// as `queue` and (with `group`) its consumer group as that, the URL and
    /// the tag as `tag`.
    pub(crate) fn debug(
        &self,
        f: &mut std::fmt::Formatter<'_>,
        consumer: &str,
        (queue, group, tag): (&str, Option<&str>, &str),
    ) -> std::fmt::Result {
        let mut d = f.debug_struct(consumer);
        d.field("name", &self.config.name())
            .field(queue, &self.config.queue);
        if let Some(group) = group {
            d.field(group, &self.config.consumer_group());
        }
        d.field("url", &self.config.url)
            .field(tag, &self.tag)
            .finish_non_exhaustive()
    }
}

/// What a consumer did until it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumeReport {
    /// Handled and acknowledged.
    pub ok: u64,
    /// Already in the inbox: acknowledged without a second effect.
    pub duplicate: u64,
    /// Older than the aggregate's last version: acknowledged and skipped.
    pub stale: u64,
    /// Failed and sent to be retried after a delay.
    pub retry: u64,
    /// Failed for the last time (or unreadable) and dead-lettered.
    pub dead: u64,
    /// Held back behind an earlier event of its aggregate waiting in retry
    /// (`ordering = "per_aggregate"`, RabbitMQ): sent to `<queue>.retry`
    /// unhandled, without counting an attempt (counted as `retry` in the
    /// metric).
    pub held: u64,
}

impl ConsumeReport {
    /// Messages settled for good: handled, skipped or dead-lettered (a
    /// retried or held-back one comes back).
    pub(crate) fn done(&self) -> u64 {
        self.ok + self.duplicate + self.stale + self.dead
    }

    /// Counts one settled message of `consumer` in the report and in
    /// `postbox_consume_total{consumer,result}`.
    pub(crate) fn count(&mut self, consumer: &str, what: Counted) {
        let (field, result) = match what {
            Counted::Handled(h @ Handled::Ok) => (&mut self.ok, h.as_str()),
            Counted::Handled(h @ Handled::Duplicate) => (&mut self.duplicate, h.as_str()),
            Counted::Handled(h @ Handled::Stale) => (&mut self.stale, h.as_str()),
            Counted::Retry => (&mut self.retry, "retry"),
            Counted::Held => (&mut self.held, "retry"),
            Counted::Dead => (&mut self.dead, "dead"),
        };
        *field += 1;
        count(consumer, result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_message_is_reported_held_and_counted_as_retry() {
        let mut r = ConsumeReport::default();
        r.count("c", Counted::Held);
        r.count("c", Counted::Handled(Handled::Stale));
        r.count("c", Counted::Dead);
        assert_eq!(
            r,
            ConsumeReport {
                held: 1,
                stale: 1,
                dead: 1,
                ..ConsumeReport::default()
            }
        );
    }

    #[test]
    fn the_tag_names_queue_and_process() {
        let tag = consumer_tag("q");
        assert!(tag.starts_with("q-"), "{tag}");
        assert!(tag.ends_with(&format!("-{}", std::process::id())), "{tag}");
    }
}
