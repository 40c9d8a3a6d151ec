//! Configuration (SPEC §5): one TOML or YAML file, every key overridable by
//! `POSTBOX__SECTION__KEY`, validated before anything starts.

mod consumer;
mod database;
mod duration;
mod key;
mod lease_budget;
mod load;
pub mod nodes;
mod publisher;
mod settings;

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;

pub use consumer::{
    BindingConfig, ConsumerConfig, ConsumerKind, HandlerConfig, InboxConfig, QueueType,
    MAX_CONSUMER_GROUP_LEN, MAX_QUEUE_LEN,
};
pub use database::DatabaseKind;
pub use duration::HumanDuration;
pub use key::KeyPath;
pub use lease_budget::LeaseBudget;
pub use load::{load, load_for, load_offline, ConfigSource};
pub use publisher::{
    target_name, FailoverTarget, FilePublisherConfig, NatsPublisherConfig, PublisherConfig,
    RabbitMqPublisherConfig, RedisPublisherConfig, WebhookPublisherConfig, WebhookSignature,
    STANDARD_SECRET_PREFIX,
};
pub use settings::{RelaySettings, Settings};

use crate::redact::{Secret, SecretUrl};
use crate::retry::Backoff;
use crate::Error;
use crate::TableName;

/// The parts of the configuration a command uses besides `[database]`:
/// only their `${VAR}` references must be set ([`Config::require_env`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Uses {
    /// `[[publishers]]` (the relay).
    pub publishers: bool,
    /// `[admin]` (the admin server).
    pub admin: bool,
    /// `[[consumers]]` (`postbox consume`, inbox migrations).
    pub consumers: bool,
}

impl Uses {
    /// Every section (the default of `config::load`).
    pub const ALL: Uses = Uses {
        publishers: true,
        admin: true,
        consumers: true,
    };
    /// `[database]` only.
    pub const DATABASE: Uses = Uses {
        publishers: false,
        admin: false,
        consumers: false,
    };
}

/// The whole configuration file as read, not yet checked: turn it into
/// [`Settings`] with [`Config::validate`] (or read it with [`load`]); the
/// relay, the consumers and the admin server take only `Settings`.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[database]`.
    pub database: DatabaseConfig,
    /// `[outbox_worker]`: the relay.
    pub outbox_worker: WorkerConfig,
    /// `[[publishers]]`: fanout targets; a row is delivered when all confirm.
    pub publishers: Vec<PublisherConfig>,
    /// `[archive]`.
    pub archive: ArchiveConfig,
    /// `[admin]`.
    pub admin: Option<AdminConfig>,
    /// `[[consumers]]`: what `postbox consume` runs.
    pub consumers: Vec<ConsumerConfig>,
    /// `[tracing]`: span export (the relay and the consumers).
    pub tracing: TracingConfig,
}

/// `[tracing]`: where the relay and the consumers export their spans.
/// Trace context travels in events' headers whether or not this is set
/// ([`crate::trace`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// An OTLP/HTTP collector (`http://collector:4318`): spans are sent,
    /// protobuf-encoded, to `<otlp>/v1/traces` (a URL with a path of its own
    /// is used as written). Unset: no exporter runs and no span is
    /// recorded.
    pub otlp: Option<SecretUrl>,
    /// The `service.name` resource of the exported spans.
    pub service_name: String,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp: None,
            service_name: "postbox".to_owned(),
        }
    }
}

impl TracingConfig {
    /// The URL spans are POSTed to: `otlp` with `/v1/traces` when it has no
    /// path of its own.
    pub fn traces_endpoint(&self) -> Option<String> {
        let url = self.otlp.as_ref()?.expose().trim_end_matches('/');
        let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
        Some(if after_scheme.contains('/') {
            url.to_owned()
        } else {
            format!("{url}/v1/traces")
        })
    }

    fn validate(&self) -> Result<(), Error> {
        if let Some(url) = &self.otlp {
            let after_scheme = url.expose().split_once("://").map(|(_, rest)| rest);
            let host = after_scheme.map(|rest| rest.split(['/', '?']).next().unwrap_or(""));
            if url.unresolved().is_none()
                && (!matches!(url.scheme(), "http" | "https") || host.is_none_or(str::is_empty))
            {
                return Err(Error::config(
                    "tracing.otlp",
                    format!("`{url}` is not an http:// or https:// URL of an OTLP collector"),
                ));
            }
        }
        if self.service_name.trim().is_empty() {
            return Err(Error::config("tracing.service_name", "must not be empty"));
        }
        Ok(())
    }
}

/// `[database]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `postgres://…`, `mysql://…` or `sqlite://…`.
    pub url: SecretUrl,
    /// The outbox table; `<table>_archive` is its twin.
    pub table: TableName,
    /// Tenants this relay claims for; every claim is scoped by one.
    pub app_codes: Vec<String>,
    /// Largest payload `enqueue` accepts.
    pub max_payload_bytes: usize,
    /// Connection pool size.
    pub max_connections: u32,
    /// An adopted table's own column names, by postbox's name
    /// (`lock_until_ms = "locked_until_ms"`).
    pub columns: BTreeMap<String, String>,
    /// Legacy status values the table's rows hold, each with the status it
    /// reads as (`published = "delivered"`); postbox writes only its own.
    pub statuses: BTreeMap<String, String>,
    /// PostgreSQL: a new outbox table range-partitioned on
    /// `created_at_ms`, by day or by week (`"none"`, the default: a plain
    /// table).
    #[serde(deserialize_with = "crate::partition::deserialize_partitioning")]
    pub partitioning: Option<crate::partition::Partitioning>,
    /// How the relay's own writes commit (PostgreSQL): see [`RelayCommit`].
    pub relay_commit: RelayCommit,
}

/// `[database] relay_commit`: how the relay's own bookkeeping writes
/// (claims, marks, deferrals, releases) commit on PostgreSQL.
///
/// Losing one of them in a database crash loses no event: a lost claim
/// leaves its rows pending, a lost mark leaves them leased until the
/// lease ends; either way they are published again (at least once, as
/// any crash gives), and consumers dedupe by `event_id`. So by default
/// they do not wait for the WAL flush (`synchronous_commit = off` on the
/// relay's two bookkeeping connections only). Every other write (a
/// producer's events, replays, controls, archiving) commits as the
/// server is configured. MariaDB and SQLite commit as configured
/// (`innodb_flush_log_at_trx_commit` is server-wide).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RelayCommit {
    /// Without waiting for the WAL flush (the default).
    #[default]
    Async,
    /// As the server is configured, like any other write.
    Sync,
}

impl DatabaseConfig {
    /// The outbox table with its adopted names (`columns`, `statuses`);
    /// a bad mapping is an error naming its key.
    pub fn adopted_table(&self) -> Result<TableName, Error> {
        let naming = crate::naming::Naming::new(&self.columns, &self.statuses)?;
        Ok(self.table.clone().with_naming(naming))
    }
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: SecretUrl::new("sqlite://postbox.db"),
            table: TableName::default(),
            app_codes: vec!["default".to_owned()],
            max_payload_bytes: 1024 * 1024,
            max_connections: 10,
            columns: BTreeMap::new(),
            statuses: BTreeMap::new(),
            partitioning: None,
            relay_commit: RelayCommit::Async,
        }
    }
}

/// `[outbox_worker]`: the relay's knobs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Run the relay at all.
    pub enabled: bool,
    /// Sleep between claims when there is nothing to do.
    pub poll_interval: HumanDuration,
    /// Rows per claim query.
    pub batch_size: u32,
    /// Bound on every publish.
    pub publish_timeout: HumanDuration,
    /// How long a claim holds a row.
    pub lease: HumanDuration,
    /// Only `exponential_backoff`.
    pub retry_strategy: RetryStrategy,
    /// Attempts before a row is dead-lettered as `failed`.
    pub max_retry_count: u32,
    /// Delay after the first failure.
    pub initial_backoff: HumanDuration,
    /// Largest delay.
    pub max_backoff: HumanDuration,
    /// `none` or `per_aggregate`.
    pub ordering: Ordering,
    /// Per-event-type overrides (degradation).
    pub event_types: BTreeMap<String, EventTypeConfig>,
    /// `notify` (default: the database's push where it has one, besides
    /// polling) or `poll` (polling and in-process wake-up only).
    pub wake: WakeMode,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            enabled: true,
            poll_interval: HumanDuration::secs(1),
            batch_size: 100,
            publish_timeout: HumanDuration::secs(3),
            lease: HumanDuration::secs(30),
            retry_strategy: RetryStrategy::ExponentialBackoff,
            max_retry_count: 10,
            initial_backoff: HumanDuration::secs(5),
            max_backoff: HumanDuration::secs(300),
            ordering: Ordering::None,
            event_types: BTreeMap::new(),
            wake: WakeMode::Notify,
        }
    }
}

impl WorkerConfig {
    /// The backoff schedule.
    pub fn backoff(&self) -> Backoff {
        Backoff {
            initial: self.initial_backoff.get(),
            max: self.max_backoff.get(),
        }
    }

    /// `max_retry_count` for one event type, after overrides.
    pub fn max_retry_count_for(&self, event_type: &str) -> u32 {
        of_event_type(&self.event_types, event_type)
            .and_then(|o| o.max_retry_count)
            .unwrap_or(self.max_retry_count)
    }

    /// Delivery guarantee for one event type, after overrides.
    pub fn delivery_for(&self, event_type: &str) -> Delivery {
        of_event_type(&self.event_types, event_type)
            .and_then(|o| o.delivery)
            .unwrap_or_default()
    }
}

/// The entry of a map keyed by event type (`[outbox_worker.event_types]`,
/// `[admin.redact]`) for `event_type`: its own key, else the one that
/// differs from it only in ASCII case. A `POSTBOX__…` variable writes its
/// key as given, and in upper case by habit
/// (`…__EVENT_TYPES__ORDER_PLACED__DELIVERY` for `order_placed`): with
/// exact keys only, such an override did nothing, and a redaction set so
/// showed what it should hide.
pub fn of_event_type<'a, V>(map: &'a BTreeMap<String, V>, event_type: &str) -> Option<&'a V> {
    map.get(event_type).or_else(|| {
        map.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(event_type))
            .map(|(_, v)| v)
    })
}

/// The retry schedule's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RetryStrategy {
    /// `initial_backoff × 2^n` up to `max_backoff`, with jitter.
    #[default]
    ExponentialBackoff,
}

/// Ordering guarantee.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Ordering {
    /// Any order; maximum throughput.
    #[default]
    None,
    /// Per `aggregate_id`, in one total order: `aggregate_version` (events
    /// without one after every versioned one), then `id`.
    PerAggregate,
}

/// Delivery guarantee of an event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// Retried until confirmed or dead-lettered.
    #[default]
    AtLeastOnce,
    /// One try, never retried (superseded-anyway events such as price ticks).
    AtMostOnce,
}

/// `[outbox_worker.event_types.<EventType>]`.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EventTypeConfig {
    /// Overrides `max_retry_count`.
    pub max_retry_count: Option<u32>,
    /// Overrides the delivery guarantee.
    pub delivery: Option<Delivery>,
}

/// `[archive]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArchiveConfig {
    /// Archive from inside the relay on `interval`.
    pub enabled: bool,
    /// Age of delivered rows to move.
    pub older_than: HumanDuration,
    /// Rows per batch.
    pub batch_size: u32,
    /// How often the relay archives.
    pub interval: HumanDuration,
    /// The database that keeps `<table>_archive`, when not the outbox's
    /// (any backend postbox supports; `migrate` creates it there).
    pub url: Option<SecretUrl>,
    /// The pool's size for `url`.
    pub max_connections: u32,
    /// A partitioned table's partitions whose rows are all done: `move`
    /// them into the archive, or `drop` them.
    pub partitions: PartitionArchive,
}

/// What archiving does with a whole partition (`archive.partitions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionArchive {
    /// Copy its rows into `<table>_archive`, then drop it.
    #[default]
    Move,
    /// Drop it: its rows are not kept.
    Drop,
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        ArchiveConfig {
            enabled: false,
            older_than: HumanDuration::secs(30 * 86_400),
            batch_size: 10_000,
            interval: HumanDuration::secs(3_600),
            url: None,
            max_connections: 4,
            partitions: PartitionArchive::Move,
        }
    }
}

/// `[admin]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Listen address.
    #[serde(default = "default_admin_listen")]
    pub listen: String,
    /// An `operator` token, named `admin` (the same as one
    /// `[[admin.tokens]]` entry with that role).
    #[serde(default)]
    pub token: Secret,
    /// `[[admin.tokens]]`: named tokens, each with its role. With any
    /// token configured, every `/api` call needs one (reading events shows
    /// payloads); without, reads are open and mutations refused.
    #[serde(default)]
    pub tokens: Vec<AdminToken>,
    /// `/metrics`: `open` (the default) or `token` (any role's token).
    #[serde(default)]
    pub metrics: MetricsAccess,
    /// `[admin.redact]`: per event type, the payload fields the API and
    /// the dashboard show as `"***"` (`UserSignedUp = ["email",
    /// "contact.phone"]`; a dotted path reaches into objects).
    #[serde(default)]
    pub redact: BTreeMap<String, Vec<String>>,
}

/// One `[[admin.tokens]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminToken {
    /// Who holds it: logged with each call, and recorded as the origin of
    /// every change it makes (a replay's history entry).
    pub name: String,
    /// What it may do.
    pub role: AdminRole,
    /// The bearer token (`${VAR}` from the environment).
    pub token: Secret,
}

/// What an admin token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdminRole {
    /// Read: stats, events with their payloads and timelines, consumers.
    Viewer,
    /// Read, and change: replay, pause and resume consumers.
    Operator,
}

impl AdminRole {
    /// `viewer` or `operator`.
    pub fn as_str(self) -> &'static str {
        match self {
            AdminRole::Viewer => "viewer",
            AdminRole::Operator => "operator",
        }
    }
}

/// Every admin token with its name and role: `token` (`admin.token`) as
/// the operator `admin`, then `tokens` (`[[admin.tokens]]`); empty tokens
/// left out.
pub fn named_tokens(token: &Secret, tokens: &[AdminToken]) -> Vec<(String, AdminRole, Secret)> {
    let admin = ("admin".to_owned(), AdminRole::Operator, token.clone());
    std::iter::once(admin)
        .chain(
            tokens
                .iter()
                .map(|t| (t.name.clone(), t.role, t.token.clone())),
        )
        .filter(|(_, _, t)| !t.is_empty())
        .collect()
}

/// `[admin] metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MetricsAccess {
    /// Anyone who reaches `admin.listen` may scrape.
    #[default]
    Open,
    /// A scrape needs a token of either role.
    Token,
}

impl AdminConfig {
    /// Every token with its name and role ([`named_tokens`]).
    pub fn named_tokens(&self) -> Vec<(String, AdminRole, Secret)> {
        named_tokens(&self.token, &self.tokens)
    }

    /// Names unique and set, tokens set and distinct.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let mut names = HashSet::new();
        let mut tokens = HashSet::new();
        // An unset `${VAR}` (read as "") is no token to compare: it is
        // named by `require_env`, for the commands that serve the API. Two
        // of them were "the same token", and `status`, which needs none,
        // exited 2.
        let set = |s: &crate::redact::Secret| !s.is_empty() && s.unresolved().is_none();
        if !self.token.is_empty() {
            names.insert("admin");
        }
        if set(&self.token) {
            tokens.insert(self.token.expose());
        }
        for (i, t) in self.tokens.iter().enumerate() {
            let at = KeyPath::root("admin").join("tokens").index(i);
            if t.name.trim().is_empty() {
                return Err(Error::config(at.join("name"), "must not be empty"));
            }
            if !names.insert(t.name.as_str()) {
                return Err(Error::config(
                    at.join("name"),
                    format!("`{}` names two tokens (`admin` is `admin.token`'s)", t.name),
                ));
            }
            if t.token.unresolved().is_none() && t.token.is_empty() {
                return Err(Error::config(at.join("token"), "must not be empty"));
            }
            if set(&t.token) && !tokens.insert(t.token.expose()) {
                return Err(Error::config(
                    at.join("token"),
                    "is the same as another admin token: give each holder its own",
                ));
            }
        }
        for (event_type, fields) in &self.redact {
            if fields
                .iter()
                .any(|f| f.is_empty() || f.split('.').any(str::is_empty))
            {
                return Err(Error::config(
                    KeyPath::root("admin").join("redact").join(event_type),
                    "holds an empty field name (give paths like `email` or `contact.phone`)",
                ));
            }
        }
        Ok(())
    }
}

/// Where the admin server listens when `[admin]` or `listen` is absent.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9464";

fn default_admin_listen() -> String {
    DEFAULT_ADMIN_LISTEN.to_owned()
}

impl Default for AdminConfig {
    /// `[admin]` absent: the default address and no token (read-only).
    fn default() -> Self {
        AdminConfig {
            listen: default_admin_listen(),
            token: Secret::default(),
            tokens: Vec::new(),
            metrics: MetricsAccess::default(),
            redact: BTreeMap::new(),
        }
    }
}

/// `[outbox_worker] wake`: how an idle relay learns of new rows besides
/// polling every `poll_interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum WakeMode {
    /// The database's push where it has one (PostgreSQL `LISTEN` on
    /// channel `postbox_<table>`, notified by the trigger `migrate`
    /// creates), plus the in-process wake-up on `enqueue`.
    #[default]
    Notify,
    /// No `LISTEN`: polling, and the in-process wake-up on `enqueue`.
    Poll,
}
