//! Configuration (SPEC §5): one TOML or YAML file, every key overridable by
//! `POSTBOX__SECTION__KEY`, validated before anything starts.

mod consumer;
mod duration;
mod lease_budget;
mod load;
mod publisher;

use std::collections::BTreeMap;

use serde::Deserialize;

pub use consumer::{
    BindingConfig, ConsumerConfig, ConsumerKind, HandlerConfig, InboxConfig,
    MAX_CONSUMER_GROUP_LEN, MAX_QUEUE_LEN,
};
pub use duration::HumanDuration;
pub use lease_budget::LeaseBudget;
pub use load::{load, load_for, ConfigSource};
pub use publisher::{
    FilePublisherConfig, NatsPublisherConfig, PublisherConfig, RabbitMqPublisherConfig,
    RedisPublisherConfig, WebhookPublisherConfig,
};

use crate::redact::{Secret, SecretUrl};
use crate::retry::Backoff;
use crate::{Error, TableName};

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

/// The whole configuration file.
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
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: SecretUrl::new("sqlite://postbox.db"),
            table: TableName::default(),
            app_codes: vec!["default".to_owned()],
            max_payload_bytes: 1024 * 1024,
            max_connections: 10,
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
        self.event_types
            .get(event_type)
            .and_then(|o| o.max_retry_count)
            .unwrap_or(self.max_retry_count)
    }

    /// Delivery guarantee for one event type, after overrides.
    pub fn delivery_for(&self, event_type: &str) -> Delivery {
        self.event_types
            .get(event_type)
            .and_then(|o| o.delivery)
            .unwrap_or_default()
    }
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
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
}

impl Default for ArchiveConfig {
    fn default() -> Self {
        ArchiveConfig {
            enabled: false,
            older_than: HumanDuration::secs(30 * 86_400),
            batch_size: 10_000,
            interval: HumanDuration::secs(3_600),
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
    /// Bearer token for mutating endpoints.
    #[serde(default)]
    pub token: Secret,
}

fn default_admin_listen() -> String {
    "127.0.0.1:9464".to_owned()
}

impl Config {
    /// Checks every rule that a type alone cannot; the error names the key.
    pub fn validate(&self) -> Result<(), Error> {
        let db = &self.database;
        let scheme = db.url.scheme();
        if db.url.unresolved().is_none()
            && !matches!(
                scheme,
                "postgres" | "postgresql" | "mysql" | "mariadb" | "sqlite"
            )
        {
            return Err(Error::config(
                "database.url",
                format!("unsupported scheme `{scheme}`: use postgres://, mysql:// or sqlite://"),
            ));
        }
        if db.app_codes.is_empty() {
            return Err(Error::config(
                "database.app_codes",
                "must name at least one app_code",
            ));
        }
        for code in &db.app_codes {
            if code.is_empty() || code.len() > crate::event::MAX_ID_LEN {
                return Err(Error::config(
                    "database.app_codes",
                    format!("`{code}` must be 1 to 64 bytes"),
                ));
            }
        }
        if db.max_payload_bytes == 0 {
            return Err(Error::config("database.max_payload_bytes", "must be > 0"));
        }
        if db.max_connections < 2 {
            return Err(Error::config(
                "database.max_connections",
                "must be at least 2 (the relay claims and marks on separate connections)",
            ));
        }

        let w = &self.outbox_worker;
        if w.poll_interval.get().is_zero() {
            return Err(Error::config(
                "outbox_worker.poll_interval",
                "must be > 0, or an idle relay would busy-loop on the database",
            ));
        }
        if w.batch_size == 0 {
            return Err(Error::config(
                "outbox_worker.batch_size",
                "must be > 0 (a claim never takes the whole table)",
            ));
        }
        if w.publish_timeout.get().is_zero() {
            return Err(Error::config(
                "outbox_worker.publish_timeout",
                "must be > 0",
            ));
        }
        if let Err(reason) = LeaseBudget::of(w).check() {
            return Err(Error::config("outbox_worker.publish_timeout", reason));
        }
        if w.max_retry_count == 0 {
            return Err(Error::config(
                "outbox_worker.max_retry_count",
                "must be ≥ 1",
            ));
        }
        if w.initial_backoff.get().is_zero() {
            return Err(Error::config(
                "outbox_worker.initial_backoff",
                "must be > 0",
            ));
        }
        if w.max_backoff < w.initial_backoff {
            return Err(Error::config(
                "outbox_worker.max_backoff",
                format!(
                    "{} is shorter than initial_backoff ({})",
                    w.max_backoff, w.initial_backoff
                ),
            ));
        }
        for (ty, o) in &w.event_types {
            if o.max_retry_count == Some(0) {
                return Err(Error::config(
                    format!("outbox_worker.event_types.{ty}.max_retry_count"),
                    "must be ≥ 1",
                ));
            }
        }

        let mut names = std::collections::HashSet::new();
        for (i, p) in self.publishers.iter().enumerate() {
            p.validate(&format!("publishers.{i}"))?;
            if !names.insert(p.name().to_owned()) {
                return Err(Error::config(
                    format!("publishers.{i}.name"),
                    format!(
                        "`{}` is used twice; give each publisher its own name",
                        p.name()
                    ),
                ));
            }
            if p.name().contains(',') {
                return Err(Error::config(
                    format!("publishers.{i}.name"),
                    "must not contain `,`",
                ));
            }
        }

        let mut consumer_names = std::collections::HashSet::new();
        for (i, c) in self.consumers.iter().enumerate() {
            c.validate(&format!("consumers.{i}"))?;
            if !consumer_names.insert(c.name().to_owned()) {
                return Err(Error::config(
                    format!("consumers.{i}.name"),
                    format!(
                        "`{}` is used twice (the name defaults to the queue); give each consumer its own name",
                        c.name()
                    ),
                ));
            }
        }

        if self.archive.batch_size == 0 {
            return Err(Error::config("archive.batch_size", "must be > 0"));
        }
        if self.archive.interval.get().is_zero() {
            return Err(Error::config("archive.interval", "must be > 0"));
        }
        Ok(())
    }

    /// Fails, naming the key, when a part of the configuration `uses`
    /// names holds a `${VAR}` whose variable is not set. `database.url` is
    /// always needed; the other sections only by the commands that use
    /// them, so `postbox status` does not need the admin token.
    pub fn require_env(&self, uses: Uses) -> Result<(), Error> {
        let check = |key: String, unresolved: Option<&str>| match unresolved {
            Some(why) => Err(Error::config(key, why.to_owned())),
            None => Ok(()),
        };
        check("database.url".into(), self.database.url.unresolved())?;
        if uses.publishers {
            for (i, p) in self.publishers.iter().enumerate() {
                check(
                    format!("publishers.{i}.url"),
                    p.url().and_then(|u| u.unresolved()),
                )?;
                if let publisher::PublisherConfig::Webhook(w) = p {
                    check(
                        format!("publishers.{i}.secret"),
                        w.secret.as_ref().and_then(|s| s.unresolved()),
                    )?;
                }
            }
        }
        if uses.admin {
            if let Some(admin) = &self.admin {
                check("admin.token".into(), admin.token.unresolved())?;
            }
        }
        if uses.consumers {
            for (i, c) in self.consumers.iter().enumerate() {
                check(format!("consumers.{i}.url"), c.url.unresolved())?;
                if let Some(h) = &c.handler {
                    check(format!("consumers.{i}.handler.http"), h.http.unresolved())?;
                }
                if let Some(inbox) = &c.inbox {
                    check(format!("consumers.{i}.inbox.url"), inbox.url.unresolved())?;
                }
            }
        }
        Ok(())
    }

    /// Checks what the relay needs beyond [`Config::validate`].
    pub fn validate_for_relay(&self) -> Result<(), Error> {
        if self.publishers.is_empty() {
            return Err(Error::config(
                "publishers",
                "the relay needs at least one [[publishers]] entry",
            ));
        }
        Ok(())
    }
}
