//! Parse, don't validate: [`Settings`] is a [`Config`] that passed every
//! check, and [`RelaySettings`] the part the relay runs on. Neither can be
//! built without its checks, so whoever holds one never checks again.

use std::collections::HashSet;
use std::ops::Deref;

use super::{
    AdminConfig, Config, ConsumerConfig, DatabaseKind, KeyPath, LeaseBudget, PublisherConfig, Uses,
    WorkerConfig,
};
use crate::Error;

/// A configuration that passed every check, built only by
/// [`Config::validate`] (which [`load`](super::load) calls). It reads as
/// the [`Config`] it wraps, and cannot be changed.
#[derive(Debug, Clone)]
pub struct Settings {
    config: Config,
    database: DatabaseKind,
    archive: Option<DatabaseKind>,
}

impl Deref for Settings {
    type Target = Config;

    fn deref(&self) -> &Config {
        &self.config
    }
}

impl Settings {
    /// The database `database.url` names.
    pub fn database_kind(&self) -> DatabaseKind {
        self.database
    }

    /// The database `archive.url` names, when the archive is kept in
    /// another database.
    pub fn archive_kind(&self) -> Option<DatabaseKind> {
        self.archive
    }

    /// `[admin]`, or the defaults when it is absent (the default address,
    /// no token: read-only).
    pub fn admin_or_default(&self) -> AdminConfig {
        self.config.admin.clone().unwrap_or_default()
    }

    /// `app_codes` when given, else `database.app_codes`.
    pub fn app_codes_or_default(&self, app_codes: Vec<String>) -> Vec<String> {
        if app_codes.is_empty() {
            self.config.database.app_codes.clone()
        } else {
            app_codes
        }
    }

    /// The `[[publishers]]` entries with their key paths.
    pub fn publishers(&self) -> impl Iterator<Item = (KeyPath, &PublisherConfig)> {
        (self.config.publishers.iter().enumerate()).map(|(i, p)| (KeyPath::publisher(i), p))
    }

    /// The `[[consumers]]` entries with their key paths.
    pub fn consumers(&self) -> impl Iterator<Item = (KeyPath, &ConsumerConfig)> {
        (self.config.consumers.iter().enumerate()).map(|(i, c)| (KeyPath::consumer(i), c))
    }

    /// What the relay runs on, for `app_codes` (empty: `database.app_codes`).
    /// Fails, naming the key, when the relay has nothing to publish to.
    pub fn relay(&self, app_codes: Vec<String>) -> Result<RelaySettings, Error> {
        if self.config.publishers.is_empty() {
            return Err(Error::config(
                "publishers",
                "the relay needs at least one [[publishers]] entry",
            ));
        }
        let settings = RelaySettings::new(
            self.config.outbox_worker.clone(),
            self.app_codes_or_default(app_codes),
        )?;
        Ok(settings.with_max_payload_bytes(self.config.database.max_payload_bytes))
    }

    /// The configuration, to change and validate again.
    pub fn into_config(self) -> Config {
        self.config
    }
}

/// What the relay runs on: a checked `[outbox_worker]` section and the
/// tenants it claims for. Built by [`Settings::relay`], or by
/// [`RelaySettings::new`] for a relay configured in code.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    worker: WorkerConfig,
    app_codes: Vec<String>,
    max_payload_bytes: usize,
}

impl RelaySettings {
    /// Checks `worker` and `app_codes` with the rules `[outbox_worker]` and
    /// `database.app_codes` are loaded with; the error names the key.
    /// `max_payload_bytes` is `database.max_payload_bytes`' default.
    pub fn new(worker: WorkerConfig, app_codes: Vec<String>) -> Result<Self, Error> {
        validate_worker(&worker)?;
        validate_app_codes(&app_codes)?;
        Ok(RelaySettings {
            worker,
            app_codes,
            max_payload_bytes: super::DatabaseConfig::default().max_payload_bytes,
        })
    }

    /// Sets `database.max_payload_bytes`: a claimed row with a larger
    /// payload is dead-lettered without trying any publisher.
    pub fn with_max_payload_bytes(mut self, max_payload_bytes: usize) -> Self {
        self.max_payload_bytes = max_payload_bytes;
        self
    }

    /// The `[outbox_worker]` section.
    pub fn worker(&self) -> &WorkerConfig {
        &self.worker
    }

    /// The tenants claimed for (never empty).
    pub fn app_codes(&self) -> &[String] {
        &self.app_codes
    }

    /// `database.max_payload_bytes`.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// The lease arithmetic of the worker section (its check passed).
    pub fn budget(&self) -> LeaseBudget {
        LeaseBudget::of(&self.worker)
    }

    /// The parts, for the relay to keep: worker section, tenants, payload
    /// limit.
    pub fn into_parts(self) -> (WorkerConfig, Vec<String>, usize) {
        (self.worker, self.app_codes, self.max_payload_bytes)
    }
}

impl Config {
    /// Checks every rule that a type alone cannot and returns the checked
    /// [`Settings`]; the error names the key. `database.url` must be set
    /// (other sections' unset `${VAR}`s are [`Config::require_env`]'s).
    pub fn validate(mut self) -> Result<Settings, Error> {
        self.require_env(Uses::DATABASE)?;
        for (i, p) in self.publishers.iter_mut().enumerate() {
            p.settle_nodes(&KeyPath::publisher(i))?;
        }
        for (i, c) in self.consumers.iter_mut().enumerate() {
            c.settle_nodes(&KeyPath::consumer(i))?;
        }
        let db = &self.database;
        let database = DatabaseKind::of(&db.url, &KeyPath::root("database").join("url"))?;
        validate_app_codes(&db.app_codes)?;
        if db.max_payload_bytes == 0 {
            return Err(Error::config("database.max_payload_bytes", "must be > 0"));
        }
        if db.max_connections < 2 {
            return Err(Error::config(
                "database.max_connections",
                "must be at least 2 (the relay claims and marks on separate connections)",
            ));
        }
        validate_worker(&self.outbox_worker)?;

        let mut names = HashSet::new();
        for (i, p) in self.publishers.iter().enumerate() {
            let at = KeyPath::publisher(i);
            p.validate(&at)?;
            name_once(&mut names, &at, p.name(), "", "publisher")?;
            if p.name().contains(',') {
                return Err(Error::config(at.join("name"), "must not contain `,`"));
            }
        }

        let mut consumer_names = HashSet::new();
        for (i, c) in self.consumers.iter().enumerate() {
            let at = KeyPath::consumer(i);
            c.validate(&at)?;
            let default = " (the name defaults to the queue)";
            name_once(&mut consumer_names, &at, c.name(), default, "consumer")?;
        }

        if let Some(admin) = &self.admin {
            admin.validate()?;
        }
        self.tracing.validate()?;
        self.database.adopted_table()?;
        if self.database.partitioning.is_some() {
            if database != DatabaseKind::Postgres {
                return Err(Error::config(
                    "database.partitioning",
                    "is PostgreSQL's: MariaDB cannot keep `(app_code, event_id)` unique across partitions, nor detach one online (README: Partitioned outbox)",
                ));
            }
            if !self.database.table.naming().is_plain()
                || !self.database.columns.is_empty()
                || !self.database.statuses.is_empty()
            {
                return Err(Error::config(
                    "database.partitioning",
                    "is for a table postbox creates, not an adopted one",
                ));
            }
        }
        if self.archive.batch_size == 0 {
            return Err(Error::config("archive.batch_size", "must be > 0"));
        }
        if self.archive.interval.get().is_zero() {
            return Err(Error::config("archive.interval", "must be > 0"));
        }
        let archive = match &self.archive.url {
            None => None,
            Some(url) if url.expose() == self.database.url.expose() => {
                return Err(Error::config(
                    "archive.url",
                    "is database.url: leave it unset to keep the archive beside the table",
                ));
            }
            Some(url) => Some(DatabaseKind::of(
                url,
                &KeyPath::root("archive").join("url"),
            )?),
        };
        if self.archive.max_connections == 0 {
            return Err(Error::config("archive.max_connections", "must be > 0"));
        }
        Ok(Settings {
            config: self,
            database,
            archive,
        })
    }

    /// Fails, naming the key, when a part of the configuration `uses`
    /// names holds a `${VAR}` whose variable is not set. `database.url` is
    /// always needed; the other sections only by the commands that use
    /// them, so `postbox status` does not need the admin token.
    pub fn require_env(&self, uses: Uses) -> Result<(), Error> {
        let check = |key: KeyPath, unresolved: Option<&str>| match unresolved {
            Some(why) => Err(Error::config(key, why.to_owned())),
            None => Ok(()),
        };
        check(
            KeyPath::root("database").join("url"),
            self.database.url.unresolved(),
        )?;
        check(
            KeyPath::root("archive").join("url"),
            self.archive.url.as_ref().and_then(|u| u.unresolved()),
        )?;
        if uses.publishers {
            for (i, p) in self.publishers.iter().enumerate() {
                let at = KeyPath::publisher(i);
                if let Some((key, why)) = super::nodes::unresolved(p.nodes(), &at) {
                    check(key, Some(why))?;
                }
                if let PublisherConfig::Webhook(w) = p {
                    check(
                        at.join("secret"),
                        w.secret.as_ref().and_then(|s| s.unresolved()),
                    )?;
                }
            }
        }
        if uses.admin {
            if let Some(admin) = &self.admin {
                check(
                    KeyPath::root("admin").join("token"),
                    admin.token.unresolved(),
                )?;
                for (i, t) in admin.tokens.iter().enumerate() {
                    let at = KeyPath::root("admin").join("tokens").index(i);
                    check(at.join("token"), t.token.unresolved())?;
                }
            }
        }
        if uses.publishers || uses.consumers {
            let otlp = self.tracing.otlp.as_ref();
            check(
                KeyPath::root("tracing").join("otlp"),
                otlp.and_then(|u| u.unresolved()),
            )?;
        }
        if uses.consumers {
            for (i, c) in self.consumers.iter().enumerate() {
                let at = KeyPath::consumer(i);
                if let Some((key, why)) = super::nodes::unresolved(c.nodes(), &at) {
                    check(key, Some(why))?;
                }
                if let Some(h) = &c.handler {
                    check(at.join("handler.http"), h.http.unresolved())?;
                }
                if let Some(inbox) = &c.inbox {
                    check(at.join("inbox.url"), inbox.url.unresolved())?;
                }
            }
        }
        Ok(())
    }
}

/// `database.app_codes` (or the tenants a relay is given): at least one,
/// each 1 to 64 bytes.
fn validate_app_codes(app_codes: &[String]) -> Result<(), Error> {
    if app_codes.is_empty() {
        return Err(Error::config(
            "database.app_codes",
            "must name at least one app_code",
        ));
    }
    for code in app_codes {
        if code.is_empty() || code.len() > crate::event::MAX_ID_LEN {
            return Err(Error::config(
                "database.app_codes",
                format!("`{code}` must be 1 to 64 bytes"),
            ));
        }
    }
    Ok(())
}

/// The config error of the first `(wrong, key, reason)` check that is
/// wrong, in the order given.
fn first_wrong(checks: &[(bool, &str, &str)]) -> Result<(), Error> {
    match checks.iter().find(|(wrong, _, _)| *wrong) {
        Some((_, key, reason)) => Err(Error::config(*key, reason)),
        None => Ok(()),
    }
}

/// Refuses the entry at `at` when its `name` is already in `seen`: two
/// entries of one kind cannot share a name (`note` says where a name
/// came from when the user wrote none).
fn name_once<'a>(
    seen: &mut HashSet<&'a str>,
    at: &KeyPath,
    name: &'a str,
    note: &str,
    entry: &str,
) -> Result<(), Error> {
    if seen.insert(name) {
        return Ok(());
    }
    Err(Error::config(
        at.join("name"),
        format!("`{name}` is used twice{note}; give each {entry} its own name"),
    ))
}

/// `[outbox_worker]`: the relay's rules, [`LeaseBudget::check`] among them.
fn validate_worker(w: &WorkerConfig) -> Result<(), Error> {
    first_wrong(&[
        (
            w.poll_interval.get().is_zero(),
            "outbox_worker.poll_interval",
            "must be > 0, or an idle relay would busy-loop on the database",
        ),
        (
            w.batch_size == 0,
            "outbox_worker.batch_size",
            "must be > 0 (a claim never takes the whole table)",
        ),
        (
            w.publish_timeout.get().is_zero(),
            "outbox_worker.publish_timeout",
            "must be > 0",
        ),
    ])?;
    LeaseBudget::of(w).check_config()?;
    first_wrong(&[
        (
            w.max_retry_count == 0,
            "outbox_worker.max_retry_count",
            "must be ≥ 1",
        ),
        (
            w.initial_backoff.get().is_zero(),
            "outbox_worker.initial_backoff",
            "must be > 0",
        ),
    ])?;
    if w.max_backoff < w.initial_backoff {
        return Err(Error::config(
            "outbox_worker.max_backoff",
            format!(
                "{} is shorter than initial_backoff ({})",
                w.max_backoff, w.initial_backoff
            ),
        ));
    }
    let types = KeyPath::root("outbox_worker").join("event_types");
    for (ty, o) in &w.event_types {
        if o.max_retry_count == Some(0) {
            return Err(Error::config(
                types.join(ty).join("max_retry_count"),
                "must be ≥ 1",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AdminConfig, AdminRole, HumanDuration, PublisherConfig};
    use crate::redact::SecretUrl;

    fn key_of(e: Error) -> String {
        match e {
            Error::Config { key, .. } => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    fn file_publisher() -> PublisherConfig {
        serde_json::from_value(serde_json::json!({ "kind": "file", "path": "-" })).unwrap()
    }

    #[test]
    fn a_config_that_fails_a_check_yields_no_settings() {
        let mut config = Config::default();
        config.database.url = SecretUrl::new("oracle://u:pw@h/db");
        assert_eq!(key_of(config.validate().unwrap_err()), "database.url");

        let mut config = Config::default();
        config.outbox_worker.publish_timeout = HumanDuration::secs(30);
        assert_eq!(
            key_of(config.validate().unwrap_err()),
            "outbox_worker.publish_timeout"
        );

        let settings = Config::default().validate().unwrap();
        assert_eq!(settings.database_kind(), DatabaseKind::Sqlite);
        assert_eq!(
            settings.admin_or_default().listen,
            super::super::DEFAULT_ADMIN_LISTEN
        );
    }

    #[test]
    fn standard_webhook_signing_needs_a_whsec_secret() {
        let webhook = |extra: serde_json::Value| {
            let mut entry = serde_json::json!({ "kind": "webhook", "url": "http://127.0.0.1:1/h", "signature": "standard" });
            entry
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            Config {
                publishers: vec![serde_json::from_value(entry).unwrap()],
                ..Config::default()
            }
        };
        for extra in [
            serde_json::json!({}),
            serde_json::json!({ "secret": "plain" }),
        ] {
            assert_eq!(
                key_of(webhook(extra).validate().unwrap_err()),
                "publishers.0.secret"
            );
        }
        webhook(serde_json::json!({ "secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" }))
            .validate()
            .unwrap();
    }

    /// Two admin tokens from unset variables are not "the same token":
    /// only the commands serving the API need them (`require_env`), and
    /// `postbox status` with the README's `[admin]` block exited 2.
    #[test]
    fn admin_tokens_of_unset_variables_are_left_to_the_commands_that_serve() {
        let config = Config {
            admin: Some(
                serde_json::from_value(serde_json::json!({
                    "token": "${POSTBOX_TEST_UNSET_ADMIN_TOKEN}",
                    "tokens": [{ "name": "support", "role": "viewer", "token": "${POSTBOX_TEST_UNSET_SUPPORT_TOKEN}" }],
                }))
                .unwrap(),
            ),
            ..Config::default()
        };
        let settings = config.validate().expect("valid without the variables");
        let serving = Uses {
            admin: true,
            ..Uses::default()
        };
        assert_eq!(
            key_of(settings.require_env(serving).unwrap_err()),
            "admin.token"
        );
        settings.require_env(Uses::default()).unwrap();
    }

    #[test]
    fn admin_tokens_are_named_once_and_each_its_own() {
        let admin = |body: serde_json::Value| Config {
            admin: Some(serde_json::from_value(body).unwrap()),
            ..Config::default()
        };
        let token = |name: &str, role: &str, token: &str| serde_json::json!({ "name": name, "role": role, "token": token });
        let ok = admin(serde_json::json!({
            "token": "t0",
            "tokens": [token("eve", "viewer", "t1"), token("ops", "operator", "t2")],
            "metrics": "token",
            "redact": { "UserSignedUp": ["email", "contact.phone"] },
        }));
        let settings = ok.validate().unwrap();
        let names: Vec<(String, AdminRole)> = settings
            .admin_or_default()
            .named_tokens()
            .into_iter()
            .map(|(n, r, _)| (n, r))
            .collect();
        assert_eq!(
            names,
            [
                ("admin".to_owned(), AdminRole::Operator),
                ("eve".to_owned(), AdminRole::Viewer),
                ("ops".to_owned(), AdminRole::Operator)
            ]
        );
        for (body, key) in [
            (
                serde_json::json!({ "tokens": [token("eve", "viewer", "t1"), token("eve", "operator", "t2")] }),
                "admin.tokens.1.name",
            ),
            (
                serde_json::json!({ "token": "t1", "tokens": [token("admin", "viewer", "t2")] }),
                "admin.tokens.0.name",
            ),
            (
                serde_json::json!({ "token": "same", "tokens": [token("eve", "viewer", "same")] }),
                "admin.tokens.0.token",
            ),
            (
                serde_json::json!({ "tokens": [token("eve", "viewer", "")] }),
                "admin.tokens.0.token",
            ),
            (
                serde_json::json!({ "redact": { "UserSignedUp": ["contact."] } }),
                "admin.redact.UserSignedUp",
            ),
        ] {
            assert_eq!(
                key_of(admin(body.clone()).validate().unwrap_err()),
                key,
                "{body}"
            );
        }
        let bad_role: Result<AdminConfig, _> =
            serde_json::from_value(serde_json::json!({ "tokens": [token("eve", "root", "t")] }));
        assert!(bad_role.unwrap_err().to_string().contains("viewer"));
    }

    #[test]
    fn entries_are_named_the_one_way() {
        let config = Config {
            publishers: vec![file_publisher(), file_publisher()],
            ..Config::default()
        };
        assert_eq!(key_of(config.validate().unwrap_err()), "publishers.1.name");

        let config = Config {
            publishers: vec![file_publisher()],
            ..Config::default()
        };
        let settings = config.validate().unwrap();
        let keys: Vec<String> = settings.publishers().map(|(at, _)| at.into()).collect();
        assert_eq!(keys, ["publishers.0"]);

        let mut config = Config::default();
        config
            .outbox_worker
            .event_types
            .insert("Tick".into(), Default::default());
        config
            .outbox_worker
            .event_types
            .get_mut("Tick")
            .unwrap()
            .max_retry_count = Some(0);
        assert_eq!(
            key_of(config.validate().unwrap_err()),
            "outbox_worker.event_types.Tick.max_retry_count"
        );
    }

    #[test]
    fn the_relay_settings_carry_the_same_checks() {
        // No publisher: nothing to relay to.
        let settings = Config::default().validate().unwrap();
        assert_eq!(
            key_of(settings.relay(Vec::new()).unwrap_err()),
            "publishers"
        );

        let mut config = Config {
            publishers: vec![file_publisher()],
            ..Config::default()
        };
        config.database.max_payload_bytes = 7;
        let settings = config.validate().unwrap();
        let relay = settings.relay(Vec::new()).unwrap();
        assert_eq!(relay.app_codes(), ["default"]);
        assert_eq!(relay.max_payload_bytes(), 7);
        let relay = settings.relay(vec!["room".into()]).unwrap();
        assert_eq!(relay.app_codes(), ["room"]);
        assert_eq!(
            key_of(settings.relay(vec![String::new()]).unwrap_err()),
            "database.app_codes"
        );

        // Built in code: the lease rule validation applies (issue 9.2).
        let worker = WorkerConfig {
            lease: HumanDuration::millis(3_000),
            publish_timeout: HumanDuration::millis(2_500),
            ..WorkerConfig::default()
        };
        assert_eq!(
            key_of(RelaySettings::new(worker, vec!["a".into()]).unwrap_err()),
            "outbox_worker.publish_timeout"
        );
        assert_eq!(
            key_of(RelaySettings::new(WorkerConfig::default(), Vec::new()).unwrap_err()),
            "database.app_codes"
        );
    }

    #[test]
    fn a_component_error_is_placed_at_its_entry() {
        let e = Error::config("url", "bad").within(&KeyPath::publisher(2));
        assert_eq!(key_of(e), "publishers.2.url");
        let e = Error::Internal("x".into()).within(&KeyPath::consumer(0));
        assert!(matches!(e, Error::Internal(_)));
    }
}
