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
            /// Replaces the tag (default: `{queue or group}-{host}-{pid}`, with
            /// the config's `name` after the queue or group when it is
            /// another: `{group}-{name}-{host}-{pid}`, so entries of one
            /// config on one queue or group get their own); tags of
            /// consumers on one queue or group must differ.
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

/// The tag a consumer gives itself unless told otherwise (`with_tag`):
/// [`consumer_tag`] of `base` (its queue, or its group), with its
/// configured `name` after `base` when the two differ:
/// `{base}-{name}-{host}-{pid}`. One process may run several entries on
/// one queue or group (their names differ: a config refuses two entries
/// of one name); on Redis the tag is the group member, whose pending
/// entries its "still mine" checks and its `XGROUP DELCONSUMER` at
/// shutdown act on, so two entries sharing it would take each other's
/// entries for their own and could drop them.
///
/// At most [`MAX_TAG_LEN`] bytes (an AMQP consumer tag and connection name
/// are short strings): a long `base` is cut, never the name, host or pid
/// that tell the consumers apart.
fn default_tag(base: &str, name: &str) -> String {
    let process = consumer_tag("");
    let after_base = if name == base {
        process
    } else {
        format!("-{name}{process}")
    };
    let mut end = MAX_TAG_LEN.saturating_sub(after_base.len()).min(base.len());
    while !base.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{after_base}", &base[..end])
}

/// The longest tag [`default_tag`] makes: AMQP short strings are at most
/// 255 bytes.
const MAX_TAG_LEN: usize = 255;

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
    /// another kind); its tag is [`default_tag`] of `tag_of(&config)` and
    /// the config's name.
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
            tag: default_tag(tag_of(&config), config.name()),
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

    struct Nothing;

    #[async_trait::async_trait]
    impl Handler for Nothing {
        async fn handle(&self, _: &crate::Message) -> Result<Handled, crate::HandlerError> {
            Ok(Handled::Ok)
        }
    }

    /// The default tag of a `kind` consumer of stream or queue `q`, group
    /// `g`, named `name`.
    fn default_tag_of(kind: ConsumerKind, name: Option<&str>) -> String {
        let config: ConsumerConfig = serde_json::from_value(serde_json::json!({
            "kind": kind.as_str(),
            "url": "redis://127.0.0.1",
            "queue": "q",
            "consumer_group": "g",
            "name": name,
        }))
        .unwrap();
        fn queue(c: &ConsumerConfig) -> &str {
            &c.queue
        }
        let base: fn(&ConsumerConfig) -> &str = match kind {
            ConsumerKind::Rabbitmq => queue,
            _ => ConsumerConfig::consumer_group,
        };
        Core::new(config, Arc::new(Nothing), kind, "broker", base)
            .unwrap()
            .tag
    }

    /// Two entries of one config on the same queue or group, named apart
    /// (`postbox consume` refuses two entries of one name), get tags apart:
    /// on Redis the tag is the member name, whose pending entries a
    /// stopping consumer checks and drops (`XGROUP DELCONSUMER`).
    #[test]
    fn consumers_named_apart_get_tags_apart() {
        let pid = std::process::id();
        for kind in [
            ConsumerKind::Rabbitmq,
            ConsumerKind::Nats,
            ConsumerKind::Redis,
        ] {
            let a = default_tag_of(kind, Some("orders-a"));
            let b = default_tag_of(kind, Some("orders-b"));
            assert_ne!(a, b, "{kind:?}");
            assert!(a.contains("-orders-a-"), "{a}");
            assert!(a.ends_with(&format!("-{pid}")), "{a}");
        }
        // Unnamed, or named as its queue: `{queue}-{host}-{pid}` (SPEC §7).
        assert_eq!(
            default_tag_of(ConsumerKind::Rabbitmq, None),
            consumer_tag("q")
        );
        assert_eq!(
            default_tag_of(ConsumerKind::Redis, Some("g")),
            consumer_tag("g")
        );
    }

    #[test]
    fn a_long_base_is_cut_to_fit_an_amqp_short_string() {
        let base = "q".repeat(300);
        let tag = default_tag(&base, "orders-a");
        assert_eq!(tag.len(), MAX_TAG_LEN, "{tag}");
        assert!(tag.ends_with(&format!("-orders-a{}", consumer_tag(""))));
        let short = default_tag("q", "orders-a");
        assert_eq!(short, format!("q-orders-a{}", consumer_tag("")));
    }

    #[test]
    fn the_tag_names_queue_and_process() {
        let tag = consumer_tag("q");
        assert!(tag.starts_with("q-"), "{tag}");
        assert!(tag.ends_with(&format!("-{}", std::process::id())), "{tag}");
    }
}
