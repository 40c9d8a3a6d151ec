//! Reaching the broker: the parsed URL, TLS trust, the connection name, and
//! opening a connection with a confirm-mode channel on a checked exchange.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{FieldTable, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Channel, Connection, ConnectionProperties, ErrorKind, Event, ExchangeKind};
use postbox_core::config::RabbitMqPublisherConfig;
use postbox_core::redact::{redact_url, SecretUrl};
use postbox_core::{Error, Result};
use tokio::task::JoinHandle;

/// How long one connection attempt (TCP, TLS, AMQP handshake, exchange
/// check, channel) may take before it counts as failed.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything needed to (re)connect, fixed at start.
pub(super) struct Target {
    /// The publisher's name.
    pub name: String,
    /// The exchange every message goes to.
    pub exchange: ShortString,
    /// The broker's nodes (`url`, or the `urls` of a cluster), tried in
    /// order from [`Target::current`].
    nodes: Vec<Node>,
    /// The node connected to last (or to try first).
    current: AtomicUsize,
    ca_pem: Option<String>,
    declare: bool,
    connection_name: String,
    /// Whether the broker blocks the current connection (a memory or disk
    /// alarm): it takes no publish, so the publisher counts as down (a
    /// failover moves to its next target).
    pub blocked: Arc<AtomicBool>,
}

/// One node of the broker.
struct Node {
    /// For messages: `Display` hides the password.
    url: SecretUrl,
    uri: AMQPUri,
    password: String,
}

impl Node {
    fn new(name: &str, url: &SecretUrl) -> Result<Self> {
        let raw = url.expose();
        let mut uri: AMQPUri = raw.parse().map_err(|e: String| {
            Error::config(
                "url",
                format!(
                    "publisher `{name}`: `{url}` is not an AMQP URL: {}",
                    scrub(&e, raw)
                ),
            )
        })?;
        // amq-protocol-uri takes the host from `Url::domain()`, which is
        // empty for IP addresses, and then connects to `localhost` instead.
        if let Some(host) = url::Url::parse(raw)
            .ok()
            .and_then(|u| u.host_str().map(str::to_owned))
        {
            uri.authority.host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
        }
        Ok(Node {
            password: uri.authority.userinfo.password.clone(),
            url: url.clone(),
            uri,
        })
    }
}

/// Why opening a connection failed.
pub(super) enum OpenError {
    /// The exchange does not exist and `declare` is off: a configuration
    /// problem, not worth retrying at start.
    MissingExchange,
    /// Anything else (network, TLS, credentials, broker errors), already
    /// free of the password.
    Other(String),
}

/// A live connection with its idle confirm-mode publishing channels.
pub(super) struct Link {
    pub connection: Connection,
    /// Channels with no batch in flight; a batch takes one (or opens one)
    /// and gives it back once its confirms are in.
    pub idle: Vec<Channel>,
    /// The broker's reason while it blocks the connection (resource alarm).
    pub blocked: Arc<Mutex<Option<String>>>,
    events: JoinHandle<()>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.events.abort();
    }
}

impl Target {
    /// Checks the URLs and reads the CA file; nothing is contacted yet.
    pub fn new(config: &RabbitMqPublisherConfig) -> Result<Self> {
        let name = config.name.clone().unwrap_or_else(|| "rabbitmq".to_owned());
        let nodes = (config.nodes().iter())
            .map(|url| Node::new(&name, url))
            .collect::<Result<Vec<_>>>()?;
        let ca_pem = match &config.ca_file {
            None => None,
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                Error::config(
                    "ca_file",
                    format!("publisher `{name}`: cannot read CA file `{path}`: {e}"),
                )
            })?),
        };
        if ca_pem.is_some() && nodes.iter().any(|n| n.uri.scheme != AMQPScheme::AMQPS) {
            return Err(Error::config(
                "ca_file",
                format!("publisher `{name}`: ca_file is only used with amqps:// URLs"),
            ));
        }
        Ok(Target {
            connection_name: connection_name(&name),
            blocked: Arc::default(),
            exchange: ShortString::try_new(config.exchange.clone())
                .map_err(|e| Error::config("exchange", format!("publisher `{name}`: {e}")))?,
            declare: config.declare,
            nodes,
            current: AtomicUsize::new(0),
            ca_pem,
            name,
        })
    }

    fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed) % self.nodes.len()
    }

    /// The node connected to last, or to be tried first (`Display` hides
    /// the password).
    pub fn url(&self) -> &SecretUrl {
        &self.nodes[self.current()].url
    }

    /// After a lost connection: the next attempt starts at the next node,
    /// since the one just lost is likely down.
    pub fn skip_node(&self) {
        if self.nodes.len() > 1 {
            self.current
                .store((self.current() + 1) % self.nodes.len(), Ordering::Relaxed);
        }
    }

    /// The `connection_name` client property operators see in
    /// `rabbitmqctl list_connections` and the management UI.
    pub fn connection_name(&self) -> &str {
        &self.connection_name
    }

    /// Connects to the first node that answers, from the current one on,
    /// each attempt bounded by [`CONNECT_TIMEOUT`]; checks (or declares)
    /// the exchange and opens a channel in confirm mode. Fails with every
    /// node's reason when none answers.
    pub async fn open(&self) -> Result<Link, OpenError> {
        let first = self.current();
        let mut reasons = Vec::new();
        for k in 0..self.nodes.len() {
            let i = (first + k) % self.nodes.len();
            self.current.store(i, Ordering::Relaxed);
            match tokio::time::timeout(CONNECT_TIMEOUT, self.open_node(i)).await {
                Ok(Ok(link)) => {
                    if k > 0 {
                        tracing::warn!(publisher = %self.name, url = %self.url(), skipped = k, "connected to another node of the cluster");
                    }
                    return Ok(link);
                }
                Ok(Err(OpenError::MissingExchange)) => return Err(OpenError::MissingExchange),
                Ok(Err(OpenError::Other(reason))) => reasons.push(reason),
                Err(_) => reasons.push(format!(
                    "connecting to {} timed out after {CONNECT_TIMEOUT:?}",
                    self.url()
                )),
            }
        }
        Err(OpenError::Other(reasons.join("; ")))
    }

    /// [`Target::open`] on node `i` (the current one).
    async fn open_node(&self, i: usize) -> Result<Link, OpenError> {
        let props = ConnectionProperties::default()
            .with_connection_name(self.connection_name.clone().into())
            .with_client_property("product".into(), "postbox".into())
            .with_client_property("postbox_publisher".into(), self.name.clone().into());
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: self.ca_pem.clone(),
        };
        let runtime =
            lapin::runtime::default_runtime().map_err(|e| self.other("connecting", &e))?;
        let uri = self.nodes[i].uri.clone();
        let connection = Connection::connect_uri_with_config(uri, props, tls, runtime)
            .await
            .map_err(|e| self.other("connecting", &e))?;
        let blocked = Arc::new(Mutex::new(None));
        // A new connection is not blocked until the broker says so.
        self.blocked.store(false, Ordering::Relaxed);
        let events = tokio::spawn(watch_events(
            self.name.clone(),
            connection.events_listener(),
            blocked.clone(),
            self.blocked.clone(),
        ));
        let mut link = Link {
            connection,
            idle: Vec::new(),
            blocked,
            events,
        };
        self.ensure_exchange(&link.connection).await?;
        let channel = self
            .open_channel(&link.connection)
            .await
            .map_err(OpenError::Other)?;
        link.idle.push(channel);
        Ok(link)
    }

    /// A fresh channel in confirm mode on a live connection.
    pub async fn open_channel(&self, connection: &Connection) -> Result<Channel, String> {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| self.describe("opening a channel", &e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| self.describe("enabling publisher confirms", &e))?;
        Ok(channel)
    }

    /// With `declare` on, declares a durable topic exchange (a no-op when
    /// it exists alike); otherwise checks it passively. Each on a channel of
    /// its own, since a failed declare closes its channel. A missing
    /// exchange is never probed first: the broker's channel close for it
    /// is logged as an ERROR by lapin, which would be spurious when postbox
    /// goes on to declare it.
    async fn ensure_exchange(&self, connection: &Connection) -> Result<(), OpenError> {
        if self.declare {
            let declare = connection
                .create_channel()
                .await
                .map_err(|e| self.other("opening a channel", &e))?;
            let declared = declare
                .exchange_declare(
                    self.exchange.clone(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await;
            match declared {
                Ok(()) => {
                    tracing::debug!(publisher = %self.name, exchange = %self.exchange, "exchange declared (durable, topic)");
                    let _ = declare.close(200, "exchange declared".into()).await;
                    return Ok(());
                }
                // It exists with another type or durability: use it as it
                // is, as a passive check would have.
                Err(e) if is_precondition_failed(&e) => {
                    tracing::warn!(publisher = %self.name, exchange = %self.exchange, "the exchange exists but is not a durable topic exchange; publishing to it as it is");
                }
                Err(e) => return Err(self.other("declaring the exchange", &e)),
            }
        }
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let probe = connection
            .create_channel()
            .await
            .map_err(|e| self.other("opening a channel", &e))?;
        match probe
            .exchange_declare(
                self.exchange.clone(),
                ExchangeKind::Topic,
                passive,
                FieldTable::default(),
            )
            .await
        {
            Ok(()) => {
                let _ = probe.close(200, "exchange checked".into()).await;
                Ok(())
            }
            Err(e) if is_not_found(&e) => Err(OpenError::MissingExchange),
            Err(e) => Err(self.other("checking the exchange", &e)),
        }
    }

    /// The start error for `declare = false` and no exchange.
    pub fn missing_exchange(&self) -> Error {
        Error::config(
            "exchange",
            format!(
                "publisher `{}`: exchange `{}` does not exist on {}; create it, or set `declare = true` to let postbox declare it (durable, topic)",
                self.name,
                self.exchange,
                self.url()
            ),
        )
    }

    /// `while {doing} on {url}: {error}`, with the password scrubbed.
    pub fn describe(&self, doing: &str, error: &lapin::Error) -> String {
        let message = format!("{doing} on {}: {error}", self.url());
        (self.nodes.iter()).fold(message, |m, node| scrub(&m, &node.password))
    }

    fn other(&self, doing: &str, error: &lapin::Error) -> OpenError {
        OpenError::Other(self.describe(doing, error))
    }
}

/// Logs what the broker says about the connection and keeps the blocked
/// reason for error messages.
async fn watch_events(
    name: String,
    events: impl futures::Stream<Item = Event> + Send + 'static,
    blocked: Arc<Mutex<Option<String>>>,
    is_blocked: Arc<AtomicBool>,
) {
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        match event {
            Event::ConnectionBlocked(reason) => {
                tracing::warn!(publisher = %name, %reason, "the broker blocked the connection; publishes fail until it lifts the alarm");
                *blocked.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
                is_blocked.store(true, Ordering::Relaxed);
            }
            Event::ConnectionUnblocked => {
                tracing::info!(publisher = %name, "the broker unblocked the connection");
                *blocked.lock().unwrap_or_else(|e| e.into_inner()) = None;
                is_blocked.store(false, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

fn is_precondition_failed(e: &lapin::Error) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(p) if *p.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(p) if *p.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
}

/// `postbox-publisher-<name>-<host>-<pid>`.
fn connection_name(name: &str) -> String {
    let host = postbox_core::wire::host_name().unwrap_or_else(|| "unknown-host".to_owned());
    format!("postbox-publisher-{name}-{host}-{}", std::process::id())
}

/// Removes the password (raw and URL-encoded) and any URL credentials from
/// a message built from driver errors.
pub(super) fn scrub(message: &str, password: &str) -> String {
    let mut out = redact_url(message);
    if password.len() >= 3 {
        out = out.replace(password, "***");
        let encoded: String = password
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        out = out.replace(&encoded, "***");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> RabbitMqPublisherConfig {
        RabbitMqPublisherConfig {
            name: Some("orders".into()),
            ..RabbitMqPublisherConfig::new(SecretUrl::new(url), "postbox")
        }
    }

    #[test]
    fn keeps_ip_hosts_that_the_uri_parser_drops() {
        let t = Target::new(&config("amqp://u:p@10.1.2.3:5673/%2f")).unwrap();
        assert_eq!(t.nodes[0].uri.authority.host, "10.1.2.3");
        assert_eq!(t.nodes[0].uri.authority.port, 5673);
        assert_eq!(t.nodes[0].uri.vhost, "/");
        let t = Target::new(&config("amqps://[::1]/v")).unwrap();
        assert_eq!(t.nodes[0].uri.authority.host, "::1");
        assert_eq!(t.nodes[0].uri.authority.port, 5671);
    }

    #[test]
    fn names_the_connection_after_publisher_host_and_pid() {
        let t = Target::new(&config("amqp://h/")).unwrap();
        let n = t.connection_name();
        assert!(n.starts_with("postbox-publisher-orders-"), "{n}");
        assert!(n.ends_with(&format!("-{}", std::process::id())), "{n}");
    }

    #[test]
    fn scrubs_passwords_raw_and_encoded() {
        assert_eq!(
            scrub(
                "login as app:s3cr/t failed at amqp://app:s3cr%2Ft@h/",
                "s3cr/t"
            ),
            "login as app:*** failed at amqp://app:***@h/"
        );
    }

    #[test]
    fn a_ca_file_needs_amqps() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "x").unwrap();
        let mut c = config("amqp://h/");
        c.ca_file = Some(ca.display().to_string());
        let err = Target::new(&c).err().unwrap().to_string();
        assert!(err.contains("amqps://"), "{err}");
        c.ca_file = Some(dir.path().join("missing.pem").display().to_string());
        c.url = SecretUrl::new("amqps://h/");
        let err = Target::new(&c).err().unwrap().to_string();
        assert!(err.contains("cannot read CA file"), "{err}");
    }
}
