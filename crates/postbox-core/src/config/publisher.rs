//! `[[publishers]]` entries, one variant per `kind` (SPEC §5).

use serde::{Deserialize, Deserializer};

use super::{nodes, HumanDuration, KeyPath};
use crate::redact::{Secret, SecretUrl};
use crate::template::Template;
use crate::Error;

/// One fanout target. The `kind` key selects the variant.
#[derive(Debug, Clone)]
pub enum PublisherConfig {
    /// JSON lines to a file or stdout.
    File(FilePublisherConfig),
    /// A RabbitMQ exchange, with publisher confirms.
    Rabbitmq(RabbitMqPublisherConfig),
    /// A NATS JetStream stream, acknowledged by PubAck.
    Nats(NatsPublisherConfig),
    /// A Redis stream (`XADD`).
    Redis(RedisPublisherConfig),
    /// An HTTP endpoint receiving the JSON envelope.
    Webhook(WebhookPublisherConfig),
}

/// The `kind`s there are.
const KINDS: &[&str] = &["file", "rabbitmq", "nats", "redis", "webhook"];

impl<'de> Deserialize<'de> for PublisherConfig {
    /// The entry's `kind`, then its variant. serde reads an internally
    /// tagged enum through a buffer, and an error inside names only the
    /// entry (`publishers.0`): here each variant is read with the path to
    /// the key that failed, put before [`KEY_MARK`] for the loader
    /// (`publishers.0.timeout`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut entry = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        let kind = match entry.remove("kind") {
            Some(serde_json::Value::String(kind)) => kind,
            Some(_) => {
                return Err(D::Error::custom(format!(
                    "kind{KEY_MARK}must be one of {KINDS:?}"
                )))
            }
            None => return Err(D::Error::missing_field("kind")),
        };
        let entry = serde_json::Value::Object(entry);
        match kind.as_str() {
            "file" => variant(entry).map(PublisherConfig::File),
            "rabbitmq" => variant(entry).map(PublisherConfig::Rabbitmq),
            "nats" => variant(entry).map(PublisherConfig::Nats),
            "redis" => variant(entry).map(PublisherConfig::Redis),
            "webhook" => variant(entry).map(PublisherConfig::Webhook),
            other => Err(D::Error::custom(format!(
                "kind{KEY_MARK}unknown kind `{other}`, expected one of {KINDS:?}"
            ))),
        }
    }
}

/// One publisher entry's variant, its error naming the key inside the
/// entry that failed (an unknown key names itself).
fn variant<T: serde::de::DeserializeOwned, E: serde::de::Error>(
    entry: serde_json::Value,
) -> Result<T, E> {
    serde_path_to_error::deserialize(entry).map_err(|e| {
        // `failover[0].url` as the loader's keys name it: `failover.0.url`.
        let path = e.path().to_string().replace('[', ".").replace(']', "");
        let inner = e.into_inner().to_string();
        if inner.contains(KEY_MARK) {
            // A template key named itself already.
            return E::custom(inner);
        }
        let key = match inner
            .strip_prefix("unknown field `")
            .and_then(|r| r.split_once('`'))
        {
            Some((field, _)) if path == "." => field.to_owned(),
            _ => path,
        };
        if key == "." {
            E::custom(inner)
        } else {
            E::custom(format!("{key}{KEY_MARK}{inner}"))
        }
    })
}

impl PublisherConfig {
    /// The publisher's name (defaults to its kind): labels metrics and
    /// per-publisher progress.
    pub fn name(&self) -> &str {
        self.configured_name().unwrap_or(self.kind())
    }

    /// The `kind` key.
    pub fn kind(&self) -> &'static str {
        match self {
            PublisherConfig::File(_) => "file",
            PublisherConfig::Rabbitmq(_) => "rabbitmq",
            PublisherConfig::Nats(_) => "nats",
            PublisherConfig::Redis(_) => "redis",
            PublisherConfig::Webhook(_) => "webhook",
        }
    }

    fn configured_name(&self) -> Option<&str> {
        match self {
            PublisherConfig::File(c) => c.name.as_deref(),
            PublisherConfig::Rabbitmq(c) => c.name.as_deref(),
            PublisherConfig::Nats(c) => c.name.as_deref(),
            PublisherConfig::Redis(c) => c.name.as_deref(),
            PublisherConfig::Webhook(c) => c.name.as_deref(),
        }
    }

    /// The URL it connects to, if any (for `doctor` and start-up logs; print
    /// it with `Display`, which hides the password).
    pub fn url(&self) -> Option<&SecretUrl> {
        match self {
            PublisherConfig::File(_) => None,
            PublisherConfig::Rabbitmq(c) => Some(&c.url),
            PublisherConfig::Nats(c) => Some(&c.url),
            PublisherConfig::Redis(c) => Some(&c.url),
            PublisherConfig::Webhook(c) => Some(&c.url),
        }
    }

    /// Every URL of the target: its cluster's nodes, or its one server
    /// (empty for the file publisher).
    pub fn nodes(&self) -> &[SecretUrl] {
        match self {
            PublisherConfig::File(_) => &[],
            PublisherConfig::Rabbitmq(c) => c.nodes(),
            PublisherConfig::Nats(c) => c.nodes(),
            PublisherConfig::Redis(c) => std::slice::from_ref(&c.url),
            PublisherConfig::Webhook(c) => std::slice::from_ref(&c.url),
        }
    }

    /// Settles `url` and `urls` ([`super::nodes::settle`]).
    pub(crate) fn settle_nodes(&mut self, at: &KeyPath) -> Result<(), Error> {
        match self {
            PublisherConfig::Rabbitmq(c) => {
                settle_failover(&mut c.failover, at, "rabbitmq", &["amqp", "amqps"])?;
                nodes::settle(&mut c.url, &c.urls, at, Ok(()))
            }
            PublisherConfig::Nats(c) => {
                settle_failover(&mut c.failover, at, "nats", &["nats", "tls"])?;
                nodes::settle(&mut c.url, &c.urls, at, Ok(()))
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn validate(&self, at: &KeyPath) -> Result<(), Error> {
        if let Some(name) = self.configured_name() {
            let ok = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            if !ok {
                // `delivered_to` joins names with commas, so names are plain.
                return Err(Error::config(
                    at.join("name"),
                    "must be 1 to 64 characters of A-Z, a-z, 0-9, `_`, `-` or `.`",
                ));
            }
        }
        let url_schemes: &[&str] = match self {
            PublisherConfig::File(c) if c.path.is_empty() => {
                return Err(Error::config(
                    at.join("path"),
                    "is empty; give a file path or \"-\" for stdout",
                ))
            }
            PublisherConfig::File(_) => return Ok(()),
            PublisherConfig::Rabbitmq(c) => {
                if c.exchange.is_empty() {
                    return Err(Error::config(
                        at.join("exchange"),
                        "is empty; the default exchange cannot confirm routing, name an exchange",
                    ));
                }
                positive_failover_times(at, &c.failover_after, &c.failback_after)?;
                if c.exchange.len() > 255 {
                    return Err(Error::config(
                        at.join("exchange"),
                        "is longer than 255 bytes, the AMQP limit for exchange names",
                    ));
                }
                match c.ca_file.as_deref() {
                    Some("") => {
                        return Err(Error::config(
                            at.join("ca_file"),
                            "is empty; leave it out to trust only the public web roots",
                        ))
                    }
                    Some(_) if c.url.unresolved().is_none() && c.url.scheme() != "amqps" => {
                        return Err(Error::config(
                            at.join("ca_file"),
                            "is only used for TLS: use an amqps:// url or leave ca_file out",
                        ))
                    }
                    _ => {}
                }
                &["amqp", "amqps"]
            }
            PublisherConfig::Nats(c) => {
                positive_failover_times(at, &c.failover_after, &c.failback_after)?;
                if !crate::wire::nats::valid_name(&c.stream) {
                    return Err(Error::config(
                        at.join("stream"),
                        format!(
                            "names a JetStream stream, so it {}",
                            crate::wire::nats::NAME_RULE
                        ),
                    ));
                }
                &["nats", "tls"]
            }
            PublisherConfig::Redis(c) => {
                if c.maxlen == Some(0) {
                    return Err(Error::config(
                        at.join("maxlen"),
                        "must be > 0 (leave it out for an unbounded stream)",
                    ));
                }
                &["redis", "rediss"]
            }
            PublisherConfig::Webhook(c) => {
                if c.timeout.get().is_zero() {
                    return Err(Error::config(at.join("timeout"), "must be > 0"));
                }
                if matches!(&c.secret, Some(s) if s.is_empty()) {
                    return Err(Error::config(
                        at.join("secret"),
                        "is empty; leave it out to send unsigned requests",
                    ));
                }
                if c.signature == WebhookSignature::Standard {
                    let resolved = c.secret.as_ref().filter(|s| s.unresolved().is_none());
                    match (&c.secret, resolved) {
                        (None, _) => {
                            return Err(Error::config(
                                at.join("secret"),
                                "is required with signature = \"standard\" (a `whsec_<base64>` secret)",
                            ))
                        }
                        (_, Some(s)) if !s.expose().starts_with(STANDARD_SECRET_PREFIX) => {
                            return Err(Error::config(
                                at.join("secret"),
                                "must be a Standard Webhooks secret, `whsec_` then the key in base64, with signature = \"standard\"",
                            ))
                        }
                        _ => {}
                    }
                }
                &["http", "https"]
            }
        };
        nodes::check_schemes(self.nodes(), at, self.kind(), url_schemes)
    }
}

/// `kind = "file"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePublisherConfig {
    /// Name (default `file`).
    #[serde(default)]
    pub name: Option<String>,
    /// File to append to, `-` for stdout.
    pub path: String,
}

/// `kind = "rabbitmq"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqPublisherConfig {
    /// Name (default `rabbitmq`).
    #[serde(default)]
    pub name: Option<String>,
    /// `amqp://user:pass@host:5672/vhost` or `amqps://…`: one server.
    #[serde(default)]
    pub url: SecretUrl,
    /// The nodes of a cluster, instead of `url`: the publisher connects to
    /// the first live one, in order, and moves to the next when it goes
    /// away. Read both through `nodes()`.
    #[serde(default)]
    pub urls: Vec<SecretUrl>,
    /// The exchange messages are published to.
    pub exchange: String,
    /// Routing key template (default `{event_type}`).
    #[serde(default = "default_routing_key", deserialize_with = "routing_key")]
    pub routing_key: Template,
    /// Declare the exchange (durable `topic`) when missing; otherwise a
    /// missing exchange is an error at start.
    #[serde(default)]
    pub declare: bool,
    /// PEM file of CA certificates trusted for `amqps://`, in addition to
    /// the public web roots (for a broker whose certificate a private CA
    /// signed). Only valid with `amqps://`.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// Other brokers (clusters) to publish to, in priority order, when
    /// this one (the primary) is unavailable for `failover_after`; the
    /// publisher returns to a higher-priority target once it has been
    /// reachable for `failback_after`. Each takes the entry's exchange and
    /// routing key.
    #[serde(default)]
    pub failover: Vec<FailoverTarget>,
    /// How long the active target must be unreachable before publishing
    /// moves to the next (default 10s).
    #[serde(default = "default_failover_after")]
    pub failover_after: HumanDuration,
    /// How long a higher-priority target must be reachable again before
    /// publishing returns to it (default 60s).
    #[serde(default = "default_failback_after")]
    pub failback_after: HumanDuration,
}

/// One `failover` target of a RabbitMQ or NATS publisher.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailoverTarget {
    /// Shown in logs and metrics (default `failover-<n>`, from 1).
    #[serde(default)]
    pub name: Option<String>,
    /// One server.
    #[serde(default)]
    pub url: SecretUrl,
    /// The nodes of a cluster, instead of `url`.
    #[serde(default)]
    pub urls: Vec<SecretUrl>,
}

impl FailoverTarget {
    /// Every node: `urls`, or `url` ([`nodes::all`]).
    pub fn nodes(&self) -> &[SecretUrl] {
        nodes::all(&self.url, &self.urls)
    }
}

/// Settles the nodes of each failover target and checks their schemes.
fn settle_failover(
    failover: &mut [FailoverTarget],
    at: &KeyPath,
    kind: &str,
    schemes: &[&str],
) -> Result<(), Error> {
    for (i, f) in failover.iter_mut().enumerate() {
        let at = at.join("failover").index(i);
        nodes::settle(&mut f.url, &f.urls, &at, Ok(()))?;
        nodes::check_schemes(f.nodes(), &at, kind, schemes)?;
    }
    Ok(())
}

/// `failover_after` and `failback_after` are positive.
fn positive_failover_times(
    at: &KeyPath,
    failover_after: &HumanDuration,
    failback_after: &HumanDuration,
) -> Result<(), Error> {
    for (key, d) in [
        ("failover_after", failover_after),
        ("failback_after", failback_after),
    ] {
        if d.get().is_zero() {
            return Err(Error::config(at.join(key), "must be > 0"));
        }
    }
    Ok(())
}

fn default_failover_after() -> HumanDuration {
    HumanDuration::secs(10)
}

fn default_failback_after() -> HumanDuration {
    HumanDuration::secs(60)
}

impl RabbitMqPublisherConfig {
    /// A publisher to `exchange` on the broker at `url`, every other key
    /// at its default (for code that configures a publisher itself).
    pub fn new(url: SecretUrl, exchange: impl Into<String>) -> Self {
        RabbitMqPublisherConfig {
            name: None,
            url,
            urls: Vec::new(),
            exchange: exchange.into(),
            routing_key: default_routing_key(),
            declare: false,
            ca_file: None,
            failover: Vec::new(),
            failover_after: default_failover_after(),
            failback_after: default_failback_after(),
        }
    }

    /// The name of target `i` of the priority list ([`target_name`]).
    pub fn target_name(&self, i: usize) -> String {
        target_name(&self.failover, i)
    }

    /// The entry as it publishes to failover target `i` (from 0): its
    /// nodes, the entry's exchange and routing key, no failover of its own.
    pub fn for_failover(&self, i: usize) -> RabbitMqPublisherConfig {
        let target = &self.failover[i];
        RabbitMqPublisherConfig {
            url: target.nodes()[0].clone(),
            urls: target.nodes().to_vec(),
            failover: Vec::new(),
            ..self.clone()
        }
    }
}

impl RabbitMqPublisherConfig {
    /// Every node: `urls`, or `url` ([`nodes::all`]).
    pub fn nodes(&self) -> &[SecretUrl] {
        nodes::all(&self.url, &self.urls)
    }
}

impl NatsPublisherConfig {
    /// A publisher to `stream` on the server at `url`, every other key at
    /// its default (for code that configures a publisher itself).
    pub fn new(url: SecretUrl, stream: impl Into<String>) -> Self {
        NatsPublisherConfig {
            name: None,
            url,
            urls: Vec::new(),
            subject: default_subject(),
            stream: stream.into(),
            declare: false,
            failover: Vec::new(),
            failover_after: default_failover_after(),
            failback_after: default_failback_after(),
        }
    }

    /// Every node: `urls`, or `url` ([`nodes::all`]).
    pub fn nodes(&self) -> &[SecretUrl] {
        nodes::all(&self.url, &self.urls)
    }

    /// The entry as it publishes to failover target `i` (from 0): its
    /// nodes, the entry's stream and subject, no failover of its own.
    pub fn for_failover(&self, i: usize) -> NatsPublisherConfig {
        let target = &self.failover[i];
        NatsPublisherConfig {
            url: target.nodes()[0].clone(),
            urls: target.nodes().to_vec(),
            failover: Vec::new(),
            ..self.clone()
        }
    }
}

/// The name of target `i` of a priority list: `primary`, then each
/// failover's name (default `failover-<i>`).
pub fn target_name(failover: &[FailoverTarget], i: usize) -> String {
    match i {
        0 => "primary".to_owned(),
        i => (failover.get(i - 1).and_then(|f| f.name.clone()))
            .unwrap_or_else(|| format!("failover-{i}")),
    }
}

/// `kind = "nats"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsPublisherConfig {
    /// Name (default `nats`).
    #[serde(default)]
    pub name: Option<String>,
    /// `nats://host:4222`: one server.
    #[serde(default)]
    pub url: SecretUrl,
    /// The nodes of a cluster, instead of `url` (the client also learns the
    /// cluster's other nodes from the server). Read both through
    /// `nodes()`.
    #[serde(default)]
    pub urls: Vec<SecretUrl>,
    /// Subject template (default `{app_code}.{event_type}`).
    #[serde(default = "default_subject", deserialize_with = "subject")]
    pub subject: Template,
    /// The JetStream stream that must capture the subjects.
    pub stream: String,
    /// Create the stream (file storage, the subjects of `subject` with
    /// placeholders as wildcards) when missing.
    #[serde(default)]
    pub declare: bool,
    /// Other NATS systems to publish to, in priority order, as for
    /// RabbitMQ ([`RabbitMqPublisherConfig::failover`]); each takes the
    /// entry's stream and subject.
    #[serde(default)]
    pub failover: Vec<FailoverTarget>,
    /// As for RabbitMQ (default 10s).
    #[serde(default = "default_failover_after")]
    pub failover_after: HumanDuration,
    /// As for RabbitMQ (default 60s).
    #[serde(default = "default_failback_after")]
    pub failback_after: HumanDuration,
}

/// `kind = "redis"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisPublisherConfig {
    /// Name (default `redis`).
    #[serde(default)]
    pub name: Option<String>,
    /// `redis://host:6379/0` or `rediss://…`.
    pub url: SecretUrl,
    /// Stream name template (default `postbox.{app_code}`).
    #[serde(default = "default_stream", deserialize_with = "stream")]
    pub stream: Template,
    /// Approximate `MAXLEN ~` trimming on every `XADD`.
    #[serde(default)]
    pub maxlen: Option<u64>,
}

/// `kind = "webhook"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookPublisherConfig {
    /// Name (default `webhook`).
    #[serde(default)]
    pub name: Option<String>,
    /// The endpoint receiving `POST` requests.
    pub url: SecretUrl,
    /// HMAC-SHA256 key; when set every request is signed.
    #[serde(default)]
    pub secret: Option<Secret>,
    /// How requests are signed: `postbox` (`X-Postbox-Signature`, the
    /// default) or `standard` (the Standard Webhooks headers
    /// `webhook-id`, `webhook-timestamp`, `webhook-signature`, with a
    /// `whsec_…` secret), which receivers verify with the
    /// `standardwebhooks` libraries.
    #[serde(default)]
    pub signature: WebhookSignature,
    /// Per-request timeout (default 10s; the relay's `publish_timeout`
    /// still bounds the whole batch).
    #[serde(default = "default_webhook_timeout")]
    pub timeout: HumanDuration,
}

/// `signature` of a webhook publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookSignature {
    /// `X-Postbox-Timestamp` and `X-Postbox-Signature: v1=<hex HMAC>`.
    #[default]
    Postbox,
    /// Standard Webhooks (<https://www.standardwebhooks.com>): `webhook-id`
    /// (the event id), `webhook-timestamp`, `webhook-signature: v1,<base64
    /// HMAC-SHA256 of "id.timestamp.body">`, keyed by the bytes of a
    /// `whsec_<base64>` secret.
    Standard,
}

/// The prefix of a Standard Webhooks secret.
pub const STANDARD_SECRET_PREFIX: &str = "whsec_";

/// Separates a key from its reason in a template's error. Inside a
/// `[[publishers]]` entry (an internally tagged enum, buffered by serde) the
/// loader learns only the entry's path, `publishers.N`; template keys put
/// their name before this mark and the loader moves it into the path
/// (`publishers.N.routing_key`).
pub(crate) const KEY_MARK: char = '\u{1f}';

fn template_at<'de, D: Deserializer<'de>>(key: &str, d: D) -> Result<Template, D::Error> {
    let source = String::deserialize(d)?;
    Template::parse(&source).map_err(|e| serde::de::Error::custom(format!("{key}{KEY_MARK}{e}")))
}

fn routing_key<'de, D: Deserializer<'de>>(d: D) -> Result<Template, D::Error> {
    template_at("routing_key", d)
}

fn subject<'de, D: Deserializer<'de>>(d: D) -> Result<Template, D::Error> {
    template_at("subject", d)
}

fn stream<'de, D: Deserializer<'de>>(d: D) -> Result<Template, D::Error> {
    template_at("stream", d)
}

fn default_routing_key() -> Template {
    Template::parse("{event_type}").expect("valid default template")
}

fn default_subject() -> Template {
    Template::parse("{app_code}.{event_type}").expect("valid default template")
}

fn default_stream() -> Template {
    Template::parse("postbox.{app_code}").expect("valid default template")
}

fn default_webhook_timeout() -> HumanDuration {
    HumanDuration::secs(10)
}
