//! `[[consumers]]` entries (SPEC §7): what `postbox consume` runs.

use serde::Deserialize;

use super::{DatabaseKind, HumanDuration, KeyPath, Ordering};
use crate::redact::SecretUrl;
use crate::{wire, Error, TableName};

/// Longest queue name: AMQP names are at most 255 bytes and the queue gets
/// `.retry` and `.dead` twins.
pub const MAX_QUEUE_LEN: usize = 200;

/// Longest `consumer_group` (the inbox column is `VARCHAR(128)`).
pub const MAX_CONSUMER_GROUP_LEN: usize = 128;

/// The broker a consumer reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConsumerKind {
    /// A RabbitMQ queue with `.retry` and `.dead` twins.
    Rabbitmq,
    /// A NATS JetStream durable pull consumer.
    Nats,
    /// A Redis Streams consumer group.
    Redis,
}

impl ConsumerKind {
    /// The `kind` key's value.
    pub fn as_str(self) -> &'static str {
        match self {
            ConsumerKind::Rabbitmq => "rabbitmq",
            ConsumerKind::Nats => "nats",
            ConsumerKind::Redis => "redis",
        }
    }
}

/// One `[[consumers]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumerConfig {
    /// `rabbitmq`, `nats` or `redis`.
    pub kind: ConsumerKind,
    /// Labels metrics (`postbox_consume_total{consumer}`) and logs; defaults
    /// to the queue name.
    #[serde(default)]
    pub name: Option<String>,
    /// Broker URL (`amqp://…`, `nats://…`, `redis://…`): one server.
    #[serde(default)]
    pub url: SecretUrl,
    /// RabbitMQ, NATS: the nodes of a cluster, instead of `url`; each
    /// connection goes to the first live one, in order. Read both
    /// through `nodes()`.
    #[serde(default)]
    pub urls: Vec<SecretUrl>,
    /// RabbitMQ: the type of the queues `declare` creates, `classic` (the
    /// default) or `quorum` (replicated across a cluster's nodes: a
    /// consumer carries on when a node is lost).
    #[serde(default)]
    pub queue_type: QueueType,
    /// The queue (RabbitMQ) or the stream (NATS JetStream stream, Redis
    /// stream key); `stream` is accepted as another name for this key.
    #[serde(alias = "stream")]
    pub queue: String,
    /// NATS: the subject filter of the durable consumer (default: every
    /// subject of the stream); with `declare = true` also the subjects a
    /// missing stream is created with.
    #[serde(default)]
    pub subject: Option<String>,
    /// NATS: where a message goes after `max_attempts` (default
    /// `<stream>.dead.<consumer_group>`). Some stream must capture it and the
    /// consumer's own filter must not; `declare = true` creates a
    /// `<stream>_dead` stream capturing `<stream>.dead.>` when none does.
    #[serde(default)]
    pub dead_subject: Option<String>,
    /// NATS: how long the server waits for the ack of a message whose
    /// consumer went silent before redelivering it (default 30s). A handler
    /// still running keeps its message with progress signals.
    #[serde(default = "default_ack_wait")]
    pub ack_wait: HumanDuration,
    /// Exchange bindings of the queue, declared when `declare = true`.
    #[serde(default)]
    pub bindings: Vec<BindingConfig>,
    /// Declare `<queue>`, `<queue>.retry`, `<queue>.dead` and the bindings.
    #[serde(default)]
    pub declare: bool,
    /// Unacknowledged messages per consumer (default 1).
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
    /// Handler attempts before a message is dead-lettered (default 5).
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Delay after the first failure; doubles with each attempt (default 1s).
    #[serde(default = "default_retry_delay")]
    pub retry_delay: HumanDuration,
    /// Cap of the growing delay (default 5m).
    #[serde(default = "default_max_retry_delay")]
    pub max_retry_delay: HumanDuration,
    /// Inbox dedupe scope (default: the queue name).
    #[serde(default)]
    pub consumer_group: Option<String>,
    /// Where `postbox consume` delivers each event.
    #[serde(default)]
    pub handler: Option<HandlerConfig>,
    /// Dedupe through an inbox table.
    #[serde(default)]
    pub inbox: Option<InboxConfig>,
    /// How long inbox rows are kept (default 7d).
    #[serde(default = "default_inbox_retention")]
    pub inbox_retention: HumanDuration,
    /// `none` (default): a retried event can be overtaken by later events of
    /// its aggregate. `per_aggregate` (RabbitMQ, needs `inbox`): while an
    /// event is waiting in retry, later versions of its `aggregate_id` are
    /// held back behind it, through `<inbox table>_holds`.
    #[serde(default)]
    pub ordering: Ordering,
}

/// `queue_type` of a RabbitMQ consumer's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueType {
    /// A classic queue, on one node.
    #[default]
    Classic,
    /// A quorum queue (`x-queue-type: quorum`), replicated with Raft.
    Quorum,
}

impl QueueType {
    /// The `x-queue-type` argument's value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// One `{ exchange, routing_key }` binding.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BindingConfig {
    /// The exchange (declared as a durable `topic` exchange when missing).
    pub exchange: String,
    /// Binding pattern (default `#`: everything).
    #[serde(default = "default_binding_key")]
    pub routing_key: String,
}

/// `handler = { http = URL, timeout = "10s" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandlerConfig {
    /// Endpoint receiving a `POST` of the SPEC §4 envelope per event.
    pub http: SecretUrl,
    /// Per-request timeout (default 10s); a timeout takes the retry path.
    #[serde(default = "default_handler_timeout")]
    pub timeout: HumanDuration,
}

/// `inbox = { url = …, table = "postbox_inbox" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboxConfig {
    /// `postgres://…`, `mysql://…` or `sqlite://…`.
    pub url: SecretUrl,
    /// Inbox table (`<table>_versions` is its twin).
    #[serde(default = "default_inbox_table")]
    pub table: TableName,
}

impl ConsumerConfig {
    /// The metrics and log label.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.queue)
    }

    /// The inbox dedupe scope.
    pub fn consumer_group(&self) -> &str {
        self.consumer_group.as_deref().unwrap_or(&self.queue)
    }

    /// NATS: the dead-letter subject (see [`ConsumerConfig::dead_subject`]).
    pub fn nats_dead_subject(&self) -> String {
        self.dead_subject
            .clone()
            .unwrap_or_else(|| wire::nats::default_dead_subject(&self.queue, self.consumer_group()))
    }

    /// Checks the keys that only some kinds take, and the names NATS and
    /// Redis put limits on.
    fn validate_kind_keys(&self, at: &KeyPath) -> Result<(), Error> {
        let only = |name: &str, kinds: &str| {
            Err(Error::config(
                at.join(name),
                format!(
                    "is not used by kind `{}` (only by {kinds})",
                    self.kind.as_str()
                ),
            ))
        };
        if self.kind != ConsumerKind::Rabbitmq && !self.bindings.is_empty() {
            return only("bindings", "rabbitmq");
        }
        if self.kind != ConsumerKind::Rabbitmq && self.queue_type != QueueType::Classic {
            return only("queue_type", "rabbitmq");
        }
        if self.kind != ConsumerKind::Nats {
            if self.subject.is_some() {
                return only("subject", "nats");
            }
            if self.dead_subject.is_some() {
                return only("dead_subject", "nats");
            }
            return Ok(());
        }
        if !wire::nats::valid_name(&self.queue) {
            return Err(Error::config(
                at.join("queue"),
                format!("names a JetStream stream, so it {}", wire::nats::NAME_RULE),
            ));
        }
        if !wire::nats::valid_name(self.consumer_group()) {
            return Err(Error::config(
                at.join("consumer_group"),
                format!(
                    "names the durable JetStream consumer, so it {}",
                    wire::nats::NAME_RULE
                ),
            ));
        }
        if let Some(subject) = &self.subject {
            if !wire::nats::valid_subject(subject, true) {
                return Err(Error::config(
                    at.join("subject"),
                    "must be a NATS subject: dot-separated non-empty tokens without spaces (`*` and a final `>` allowed)",
                ));
            }
        }
        if self.declare && self.subject.is_none() {
            // Only needed when the stream is missing, but a config that
            // works only while the stream exists is a trap.
            return Err(Error::config(
                at.join("subject"),
                "declare = true needs the subjects to create the stream with: set subject (for example `orders.>`)",
            ));
        }
        if !wire::nats::valid_subject(&self.nats_dead_subject(), false) {
            return Err(Error::config(
                at.join("dead_subject"),
                "must be a NATS subject without wildcards: dot-separated non-empty tokens without spaces",
            ));
        }
        if self.ack_wait.get() < std::time::Duration::from_millis(100) {
            return Err(Error::config(at.join("ack_wait"), "must be at least 100ms"));
        }
        Ok(())
    }

    /// Every node: `urls`, or `url` ([`super::nodes::all`]).
    pub fn nodes(&self) -> &[SecretUrl] {
        super::nodes::all(&self.url, &self.urls)
    }

    /// Settles `url` and `urls` ([`super::nodes::settle`]).
    pub(crate) fn settle_nodes(&mut self, at: &KeyPath) -> Result<(), Error> {
        let clusters = match self.kind {
            ConsumerKind::Redis => Err(super::nodes::REDIS_ONE_SERVER),
            _ => Ok(()),
        };
        super::nodes::settle(&mut self.url, &self.urls, at, clusters)
    }

    /// Checks one entry; `at` is its path, e.g. `consumers.0`.
    pub(crate) fn validate(&self, at: &KeyPath) -> Result<(), Error> {
        self.validate_kind_keys(at)?;
        let schemes: &[&str] = match self.kind {
            ConsumerKind::Rabbitmq => &["amqp", "amqps"],
            ConsumerKind::Nats => &["nats", "tls"],
            ConsumerKind::Redis => &["redis", "rediss"],
        };
        super::nodes::check_schemes(self.nodes(), at, self.kind.as_str(), schemes)?;
        if let Some(name) = &self.name {
            if name.is_empty() || name.len() > 64 {
                return Err(Error::config(at.join("name"), "must be 1 to 64 bytes"));
            }
        }
        let plain = |s: &str| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
        };
        if self.queue.is_empty() || self.queue.len() > MAX_QUEUE_LEN || !plain(&self.queue) {
            return Err(Error::config(
                at.join("queue"),
                format!("must be 1 to {MAX_QUEUE_LEN} characters of A-Z, a-z, 0-9, `_`, `-`, `.` or `:`"),
            ));
        }
        for (i, b) in self.bindings.iter().enumerate() {
            if b.exchange.is_empty() || b.exchange.len() > 255 {
                return Err(Error::config(
                    at.join("bindings").index(i).join("exchange"),
                    "must be 1 to 255 bytes (the default exchange cannot be bound)",
                ));
            }
            if b.routing_key.len() > 255 {
                return Err(Error::config(
                    at.join("bindings").index(i).join("routing_key"),
                    "must be at most 255 bytes",
                ));
            }
        }
        if self.prefetch == 0 {
            return Err(Error::config(
                at.join("prefetch"),
                "must be ≥ 1 (0 would mean no limit on unacknowledged messages)",
            ));
        }
        if self.max_attempts == 0 {
            return Err(Error::config(at.join("max_attempts"), "must be ≥ 1"));
        }
        if self.retry_delay.get().is_zero() {
            return Err(Error::config(
                at.join("retry_delay"),
                "must be > 0: a failed message is never requeued at once",
            ));
        }
        if self.max_retry_delay < self.retry_delay {
            return Err(Error::config(
                at.join("max_retry_delay"),
                format!(
                    "{} is shorter than retry_delay ({})",
                    self.max_retry_delay, self.retry_delay
                ),
            ));
        }
        if let Some(group) = &self.consumer_group {
            if group.is_empty() || group.len() > MAX_CONSUMER_GROUP_LEN {
                return Err(Error::config(
                    at.join("consumer_group"),
                    format!("must be 1 to {MAX_CONSUMER_GROUP_LEN} bytes"),
                ));
            }
        } else if self.inbox.is_some() && self.queue.len() > MAX_CONSUMER_GROUP_LEN {
            return Err(Error::config(
                at.join("consumer_group"),
                "defaults to the queue name, which is longer than 128 bytes: set it",
            ));
        }
        if let Some(h) = &self.handler {
            if h.http.unresolved().is_none() && !matches!(h.http.scheme(), "http" | "https") {
                return Err(Error::config(
                    at.join("handler.http"),
                    format!("{}: use http:// or https://", h.http.scheme_refused()),
                ));
            }
            if h.timeout.get().is_zero() {
                return Err(Error::config(at.join("handler.timeout"), "must be > 0"));
            }
        }
        if let Some(inbox) = &self.inbox {
            DatabaseKind::check(&inbox.url, &at.join("inbox.url"))?;
        }
        if self.ordering == Ordering::PerAggregate {
            if self.kind != ConsumerKind::Rabbitmq {
                return Err(Error::config(
                    at.join("ordering"),
                    format!(
                        "`per_aggregate` is only implemented for kind `rabbitmq`, not `{}`: use `none`",
                        self.kind.as_str()
                    ),
                ));
            }
            if self.inbox.is_none() {
                return Err(Error::config(
                    at.join("ordering"),
                    "`per_aggregate` needs an inbox (the held-back aggregates are kept in its database, shared by every process of the group): set inbox = { url = …, table = … }",
                ));
            }
        }
        if self.inbox_retention.get().is_zero() {
            return Err(Error::config(at.join("inbox_retention"), "must be > 0"));
        }
        Ok(())
    }
}

fn default_ack_wait() -> HumanDuration {
    HumanDuration::secs(30)
}

fn default_prefetch() -> u16 {
    1
}

fn default_max_attempts() -> u32 {
    5
}

fn default_retry_delay() -> HumanDuration {
    HumanDuration::secs(1)
}

fn default_max_retry_delay() -> HumanDuration {
    HumanDuration::secs(300)
}

fn default_inbox_retention() -> HumanDuration {
    HumanDuration::secs(7 * 86_400)
}

fn default_binding_key() -> String {
    "#".to_owned()
}

fn default_handler_timeout() -> HumanDuration {
    HumanDuration::secs(10)
}

fn default_inbox_table() -> TableName {
    TableName::new("postbox_inbox").expect("valid default inbox table")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(extra: serde_json::Value) -> ConsumerConfig {
        let mut c = serde_json::json!({
            "kind": "nats",
            "url": "nats://127.0.0.1:4222",
            "stream": "ORDERS",
            "subject": "orders.>",
            "consumer_group": "billing",
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        serde_json::from_value(c).unwrap()
    }

    fn key_of(extra: serde_json::Value) -> String {
        match entry(extra).validate(&KeyPath::consumer(0)) {
            Err(Error::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn nats_keys_load_with_defaults() {
        let c = entry(serde_json::json!({}));
        c.validate(&KeyPath::consumer(0)).unwrap();
        assert_eq!(c.queue, "ORDERS");
        assert_eq!(c.ack_wait.get(), std::time::Duration::from_secs(30));
        assert_eq!(c.nats_dead_subject(), "ORDERS.dead.billing");
        let c = entry(serde_json::json!({ "dead_subject": "dead.orders" }));
        assert_eq!(c.nats_dead_subject(), "dead.orders");
    }

    #[test]
    fn bad_nats_and_redis_keys_are_named() {
        use serde_json::json;
        assert_eq!(key_of(json!({ "stream": "OR.DERS" })), "consumers.0.queue");
        assert_eq!(
            key_of(json!({ "consumer_group": "a.b" })),
            "consumers.0.consumer_group"
        );
        assert_eq!(
            key_of(json!({ "subject": "orders..x" })),
            "consumers.0.subject"
        );
        assert_eq!(
            key_of(json!({ "subject": "orders.>.x" })),
            "consumers.0.subject"
        );
        assert_eq!(
            key_of(json!({ "dead_subject": "dead.*" })),
            "consumers.0.dead_subject"
        );
        assert_eq!(
            key_of(json!({ "ack_wait": "10ms" })),
            "consumers.0.ack_wait"
        );
        assert_eq!(
            key_of(json!({ "subject": null, "declare": true })),
            "consumers.0.subject"
        );
        assert_eq!(
            key_of(json!({ "kind": "redis", "url": "redis://127.0.0.1:6379/0" })),
            "consumers.0.subject"
        );
        assert_eq!(
            key_of(
                json!({ "kind": "redis", "url": "redis://127.0.0.1:6379/0", "subject": null, "dead_subject": "x" })
            ),
            "consumers.0.dead_subject"
        );
        assert_eq!(
            key_of(json!({ "bindings": [{ "exchange": "postbox" }] })),
            "consumers.0.bindings"
        );
        assert_eq!(
            key_of(json!({ "ordering": "per_aggregate" })),
            "consumers.0.ordering"
        );
        let rabbit = json!({ "kind": "rabbitmq", "url": "amqp://127.0.0.1", "subject": null, "ordering": "per_aggregate" });
        assert_eq!(key_of(rabbit.clone()), "consumers.0.ordering");
        let mut with_inbox = rabbit;
        with_inbox["inbox"] = json!({ "url": "postgres://127.0.0.1/x" });
        entry(with_inbox).validate(&KeyPath::consumer(0)).unwrap();
        let redis =
            entry(json!({ "kind": "redis", "url": "redis://127.0.0.1:6379/0", "subject": null }));
        redis.validate(&KeyPath::consumer(0)).unwrap();
    }
}
