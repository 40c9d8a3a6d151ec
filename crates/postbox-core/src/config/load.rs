//! Reading the config file and the environment.

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Toml, Yaml};
use figment::Figment;

use super::{Config, Settings};
use crate::redact::SecretUrl;
use crate::Error;

/// Where the configuration comes from.
#[derive(Debug, Clone, Default)]
pub struct ConfigSource {
    /// `--config FILE`; `None` reads `postbox.toml` when it exists.
    pub file: Option<PathBuf>,
    /// `--database-url`, overriding the file and the environment.
    pub database_url: Option<String>,
}

impl ConfigSource {
    /// The file to read: `--config`'s (which must exist), else
    /// `postbox.toml` when it exists; `None`: defaults and the environment.
    pub fn file_to_read(&self) -> Result<Option<PathBuf>, Error> {
        match &self.file {
            Some(f) if !f.exists() => Err(Error::config(
                "--config",
                format!("file `{}` does not exist", f.display()),
            )),
            Some(f) => Ok(Some(f.clone())),
            None => Ok(Some(PathBuf::from("postbox.toml")).filter(|p| p.exists())),
        }
    }
}

/// Loads and validates the configuration into [`Settings`]: file (TOML or YAML by extension),
/// then `POSTBOX__SECTION__KEY` variables, then command-line overrides.
pub fn load(source: &ConfigSource) -> Result<Settings, Error> {
    load_for(source, super::Uses::ALL)
}

/// [`load`] for a command that uses only `uses` besides `[database]`: an
/// unset `${VAR}` in another section is not an error.
pub fn load_for(source: &ConfigSource, uses: super::Uses) -> Result<Settings, Error> {
    load_config(source)?.checked(uses)
}

/// [`load_for`] for a command that connects to nothing and reads only
/// `[database]` (`migrate --print-sql`): an unset `${VAR}` in
/// `database.url` (its password, say) is no error, as long as what is left
/// names the database's kind, and `[archive] url` is not read. It was, and
/// printing the SQL for a team's migration tool in CI needed the
/// production database's password.
pub fn load_offline(source: &ConfigSource) -> Result<Settings, Error> {
    let mut config = load_config(source)?;
    // A URL that is one `${VAR}` names no kind: the variable is named.
    if config.database.url.unresolved().is_some() && config.database.url.expose().contains("://") {
        config.database.url = SecretUrl::new(config.database.url.expose().to_owned());
    }
    config.archive.url = None;
    config.checked(super::Uses::DATABASE)
}

impl Config {
    fn checked(self, uses: super::Uses) -> Result<Settings, Error> {
        self.require_env(uses)?;
        self.validate()
    }
}

/// The file, the environment and `--database-url`, not yet checked.
fn load_config(source: &ConfigSource) -> Result<Config, Error> {
    let mut figment = Figment::new();
    let file = source.file_to_read()?;
    if let Some(f) = &file {
        figment = match extension(f) {
            "yaml" | "yml" => figment.merge(Yaml::file(f)),
            "toml" => figment.merge(Toml::file(f)),
            other => {
                return Err(Error::config(
                    "--config",
                    format!(
                        "`{}`: unknown extension `{other}`, use .toml or .yaml",
                        f.display()
                    ),
                ))
            }
        };
    }
    // `vars()` panics on a variable that is not UTF-8 (anyone's): skipped.
    let vars = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
    let lists = ListOverrides::of(&figment, vars)?;
    let in_lists = lists.paths.clone();
    figment = figment.merge(lists).merge(
        // `lowercase` last: each `split`/`map` sets it back to `true`.
        Env::prefixed("POSTBOX__")
            .split("__")
            .map(|key| env_path(key.as_str()).into())
            .filter(move |key| !in_lists.iter().any(|p| key == p.as_str()))
            .lowercase(false),
    );
    let mut config: Config = figment.extract().map_err(from_figment)?;
    if let Some(url) = &source.database_url {
        config.database.url = SecretUrl::new(url.clone());
    }
    Ok(config)
}

/// The config path a `POSTBOX__…` variable sets (after the prefix, `__`
/// read as `.`): lower case, except a key of a map keyed by the user's own
/// names, kept as written: `OUTBOX_WORKER.EVENT_TYPES.PriceTick.DELIVERY`
/// is `outbox_worker.event_types.PriceTick.delivery` (lowered whole, it set
/// a type `pricetick` no event has, and the override did nothing).
fn env_path(key: &str) -> String {
    let mut path: Vec<String> = Vec::new();
    for segment in key.split('.') {
        let parent: Vec<&str> = path.iter().map(String::as_str).collect();
        let users_name = matches!(
            parent.as_slice(),
            ["outbox_worker", "event_types"] | ["admin", "redact"] | ["database", "statuses"]
        );
        path.push(if users_name {
            segment.to_owned()
        } else {
            segment.to_ascii_lowercase()
        });
    }
    path.join(".")
}

/// `POSTBOX__…` variables that set a key of one entry of a list in the
/// file (`POSTBOX__PUBLISHERS__0__URL`, `POSTBOX__ADMIN__TOKENS__1__TOKEN`),
/// applied to that entry. Read as the other variables are, they made a map
/// `{"0": …}` that replaced the whole list, and loading failed ("found
/// map, expected a sequence").
struct ListOverrides {
    /// The lists, each with its entries overridden, by path.
    lists: figment::value::Dict,
    /// The config paths of the variables applied here.
    paths: Vec<String>,
}

impl ListOverrides {
    fn of(file: &Figment, vars: impl Iterator<Item = (String, String)>) -> Result<Self, Error> {
        use figment::value::Value;
        let mut out = ListOverrides {
            lists: Default::default(),
            paths: Vec::new(),
        };
        let mut lists: Vec<(String, Vec<Value>)> = Vec::new();
        for (name, raw) in vars {
            let Some(rest) = name
                .get(..9)
                .filter(|p| p.eq_ignore_ascii_case("POSTBOX__"))
                .map(|_| &name[9..])
            else {
                continue;
            };
            let path = env_path(&rest.replace("__", "."));
            let segments: Vec<&str> = path.split('.').collect();
            // The first numeric segment under a list of the file.
            let Some((at, index)) = segments.iter().enumerate().skip(1).find_map(|(i, s)| {
                let index: usize = s.parse().ok()?;
                let list = segments[..i].join(".");
                matches!(file.find_value(&list), Ok(Value::Array(..))).then_some((i, index))
            }) else {
                continue;
            };
            let list = segments[..at].join(".");
            if !lists.iter().any(|(l, _)| *l == list) {
                let Ok(Value::Array(_, entries)) = file.find_value(&list) else {
                    continue;
                };
                lists.push((list.clone(), entries));
            }
            let entries = &mut lists.iter_mut().find(|(l, _)| *l == list).unwrap().1;
            let Some(entry) = entries.get_mut(index) else {
                return Err(Error::config(
                    format!("{list}.{index}"),
                    format!(
                        "`{name}`: the file's `{list}` has {} entries (a variable sets a key of an entry, it does not add one)",
                        entries.len()
                    ),
                ));
            };
            let value: Value = raw.parse().expect("infallible");
            set_in(entry, &segments[at + 1..], value).map_err(|why| {
                Error::config(format!("{list}.{index}"), format!("`{name}`: {why}"))
            })?;
            out.paths.push(path);
        }
        for (list, entries) in lists {
            let nested = figment::util::nest(&list, Value::from(entries));
            if let Some(dict) = nested.into_dict() {
                out.lists = figment::value::Dict::from_iter(out.lists.into_iter().chain(dict));
            }
        }
        Ok(out)
    }
}

impl figment::Provider for ListOverrides {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named("`POSTBOX__` environment variable(s)")
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        Ok(figment::Profile::Default.collect(self.lists.clone()))
    }
}

/// Sets `path` (keys of tables, indexes of lists) inside `entry` to
/// `value`, making the tables on the way; an empty path sets `entry`.
fn set_in(
    entry: &mut figment::value::Value,
    path: &[&str],
    value: figment::value::Value,
) -> Result<(), String> {
    use figment::value::Value;
    let Some((key, rest)) = path.split_first() else {
        *entry = value;
        return Ok(());
    };
    match entry {
        Value::Dict(_, dict) => set_in(
            dict.entry((*key).to_owned())
                .or_insert_with(|| Value::from(figment::value::Dict::new())),
            rest,
            value,
        ),
        Value::Array(_, items) => {
            let len = items.len();
            let item = key
                .parse::<usize>()
                .ok()
                .and_then(|i| items.get_mut(i))
                .ok_or_else(|| format!("`{key}`: the list there has {len} entries"))?;
            set_in(item, rest, value)
        }
        _ => Err(format!("`{key}`: nothing there has keys")),
    }
}

fn extension(p: &Path) -> &str {
    p.extension().and_then(|e| e.to_str()).unwrap_or("")
}

fn from_figment(errors: figment::Error) -> Error {
    // Report the first error; figment collects several.
    let e = errors
        .into_iter()
        .next()
        .expect("figment errors are never empty");
    let mut path = e.path.clone();
    // figment names the unknown field in the path for plain tables but not
    // inside a tagged enum (a `[[publishers]]` entry).
    if let figment::error::Kind::UnknownField(field, _) = &e.kind {
        if path.last() != Some(field) {
            path.push(field.clone());
        }
    }
    let mut reason = e.kind.to_string();
    // A template key of a `[[publishers]]` entry names itself in its error.
    if let figment::error::Kind::Message(message) = &e.kind {
        if let Some((field, why)) = message.split_once(super::publisher::KEY_MARK) {
            path.push(field.to_owned());
            reason = why.to_owned();
        }
    }
    let key = if path.is_empty() {
        "(top level)".to_owned()
    } else {
        path.join(".")
    };
    let reason = hide_secrets(&e.kind, reason, &path);
    let mut reason = reason;
    if let Some(meta) = &e.metadata {
        reason.push_str(&format!(" (from {})", meta.name));
    }
    Error::config(key, reason)
}

/// A config error's reason without the secrets it may quote: a syntax
/// error's excerpt of the file (the line with the mistake: a database URL
/// with its password, a token) is left out, what remains has URL
/// passwords hidden, and a value of the wrong type under a key that holds
/// a secret is named by its type only.
fn hide_secrets(kind: &figment::error::Kind, reason: String, path: &[String]) -> String {
    use figment::error::{Actual, Kind};
    let secret_key = path.last().is_some_and(|k| {
        let k = k.to_ascii_lowercase();
        ["url", "token", "password", "secret", "key", "dsn"]
            .iter()
            .any(|s| k.contains(s))
    });
    let type_of = |actual: &Actual| match actual {
        Actual::Bool(_) => "a boolean",
        Actual::Unsigned(_) | Actual::Signed(_) => "an integer",
        Actual::Float(_) => "a float",
        Actual::Str(_) | Actual::Char(_) => "a string",
        _ => "another type",
    };
    match kind {
        Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected)
            if secret_key =>
        {
            format!(
                "invalid value: found {} (value hidden), expected {expected}",
                type_of(actual)
            )
        }
        _ => {
            // The excerpt lines of a TOML syntax error: `  |`, `3 | url = …`.
            let kept: Vec<&str> = reason
                .lines()
                .filter(|line| {
                    let t = line.trim_start();
                    let digits = t.trim_start_matches(|c: char| c.is_ascii_digit());
                    !digits.trim_start().starts_with('|')
                })
                .collect();
            crate::redact::redact_url(
                &kept
                    .join(" ")
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A config error never quotes a secret: not the line a syntax error
    /// points at, not a value of the wrong type under a secret's key.
    #[test]
    fn config_errors_hide_secrets() {
        let syntax = load_str("[database]\nurl = \"postgres://app:hunter2@db/x\" table\n");
        let text = format!("{syntax:?}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("line 2"), "where the mistake is: {text}");
        let typed = load_str("[database]\nurl = 98765432101234\n");
        let text = format!("{typed:?}");
        assert!(!text.contains("98765432101234"), "{text}");
        assert!(text.contains("database.url"), "{text}");
        // A token of digits (set through the environment) is a token.
        let digits = load_str("[admin]\ntoken = 98765432101234\n").expect("a token of digits");
        assert_eq!(digits.admin_or_default().token.expose(), "98765432101234");
    }

    /// An override keyed in another case than the event type (a variable
    /// in upper case) still applies; the type's own key wins.
    #[test]
    fn event_type_overrides_match_whatever_the_case() {
        let c = load_str(
            "[outbox_worker.event_types.ORDER_PLACED]\ndelivery = \"at_most_once\"\n\
             [outbox_worker.event_types.Tick]\nmax_retry_count = 2\n\
             [outbox_worker.event_types.tick]\nmax_retry_count = 3\n",
        )
        .unwrap();
        let w = &c.outbox_worker;
        assert_eq!(
            w.delivery_for("order_placed"),
            crate::config::Delivery::AtMostOnce
        );
        assert_eq!(w.max_retry_count_for("Tick"), 2);
        assert_eq!(w.max_retry_count_for("tick"), 3);
        assert_eq!(w.max_retry_count_for("Other"), w.max_retry_count);
    }

    #[test]
    fn environment_keys_keep_the_case_of_the_users_names() {
        assert_eq!(
            env_path("OUTBOX_WORKER.EVENT_TYPES.PriceTick.DELIVERY"),
            "outbox_worker.event_types.PriceTick.delivery"
        );
        assert_eq!(
            env_path("ADMIN.REDACT.UserSignedUp"),
            "admin.redact.UserSignedUp"
        );
        assert_eq!(
            env_path("DATABASE.STATUSES.PUBLISHED"),
            "database.statuses.PUBLISHED"
        );
        assert_eq!(
            env_path("DATABASE.COLUMNS.LOCK_UNTIL_MS"),
            "database.columns.lock_until_ms"
        );
        assert_eq!(env_path("Database.Url"), "database.url");
    }

    #[test]
    fn list_overrides_reach_nested_lists_and_plain_entries() {
        use figment::value::Value;
        let file = Figment::new().merge(Toml::string(
            r#"
            [database]
            app_codes = ["a", "b"]
            [[publishers]]
            kind = "rabbitmq"
            urls = ["amqp://one", "amqp://two"]
            "#,
        ));
        let vars = [
            ("POSTBOX__PUBLISHERS__0__URLS__1", "amqp://secret"),
            ("postbox__DATABASE__APP_CODES__1", "c"),
            ("OTHER__PUBLISHERS__0__URLS__0", "not ours"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let overrides = ListOverrides::of(&file, vars.into_iter()).unwrap();
        let merged = file.clone().merge(overrides);
        let publishers: Vec<std::collections::BTreeMap<String, Value>> =
            merged.extract_inner("publishers").unwrap();
        let urls: Vec<String> = publishers[0]["urls"].deserialize().unwrap();
        assert_eq!(urls, ["amqp://one", "amqp://secret"]);
        let apps: Vec<String> = merged.extract_inner("database.app_codes").unwrap();
        assert_eq!(apps, ["a", "c"]);
        let past = [("POSTBOX__PUBLISHERS__0__URLS__5".to_owned(), "x".to_owned())];
        match ListOverrides::of(&file, past.into_iter()) {
            Err(Error::Config { key, reason }) => {
                assert_eq!(key, "publishers.0");
                assert!(reason.contains("has 2 entries"), "{reason}");
            }
            other => panic!("expected a config error, got {:?}", other.map(|o| o.paths)),
        }
    }

    fn load_str(toml: &str) -> Result<Settings, Error> {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        f.write_all(toml.as_bytes()).unwrap();
        load(&ConfigSource {
            file: Some(f.path().to_owned()),
            database_url: None,
        })
    }

    fn key_of(toml: &str) -> String {
        match load_str(toml) {
            Err(Error::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_follow_the_seed() {
        let c = load_str("").unwrap();
        assert_eq!(c.outbox_worker.batch_size, 100);
        assert_eq!(c.outbox_worker.max_retry_count, 10);
        assert_eq!(c.outbox_worker.poll_interval, "1s".parse().unwrap());
        assert_eq!(c.database.table.as_str(), "postbox_outbox");
    }

    #[test]
    fn partitioning_is_none_daily_or_weekly_on_postgres() {
        let pg = "[database]\nurl = \"postgres://h/db\"\n";
        let of = |v: &str| {
            load_str(&format!("{pg}partitioning = \"{v}\"")).map(|c| c.database.partitioning)
        };
        assert_eq!(of("none").unwrap(), None);
        assert_eq!(
            of("daily").unwrap(),
            Some(crate::partition::Partitioning::Daily)
        );
        assert_eq!(
            of("weekly").unwrap(),
            Some(crate::partition::Partitioning::Weekly)
        );
        assert_eq!(load_str(pg).unwrap().database.partitioning, None);
        assert_eq!(
            key_of(&format!("{pg}partitioning = \"hourly\"")),
            "database.partitioning"
        );
        assert_eq!(
            key_of("[database]\npartitioning = \"daily\""),
            "database.partitioning",
            "SQLite"
        );
        assert_eq!(
            key_of("[archive]\npartitions = \"keep\""),
            "archive.partitions"
        );
    }

    #[test]
    fn relay_commit_is_async_unless_asked_sync() {
        use crate::config::RelayCommit;
        let of = |v: &str| {
            load_str(&format!("[database]\nrelay_commit = \"{v}\""))
                .map(|c| c.database.relay_commit)
        };
        assert_eq!(
            load_str("").unwrap().database.relay_commit,
            RelayCommit::Async
        );
        assert_eq!(of("sync").unwrap(), RelayCommit::Sync);
        assert_eq!(of("async").unwrap(), RelayCommit::Async);
        assert_eq!(
            key_of("[database]\nrelay_commit = \"later\""),
            "database.relay_commit"
        );
    }

    #[test]
    fn refuses_bad_values_naming_the_key() {
        let w = "[outbox_worker]\n";
        for (toml, key) in [
            (
                format!("{w}poll_interval = \"0s\""),
                "outbox_worker.poll_interval",
            ),
            (format!("{w}batch_size = 0"), "outbox_worker.batch_size"),
            (
                format!("{w}publish_timeout = \"30s\"\nlease = \"30s\""),
                "outbox_worker.publish_timeout",
            ),
            // Issue 9.2: accepted before, though the relay released every batch.
            (
                format!("{w}publish_timeout = \"2500ms\"\nlease = \"3s\""),
                "outbox_worker.publish_timeout",
            ),
            (
                format!("{w}poll_intervall = \"1s\""),
                "outbox_worker.poll_intervall",
            ),
            (format!("{w}lease = \"soon\""), "outbox_worker.lease"),
            (
                format!("{w}ordering = \"by_moon\""),
                "outbox_worker.ordering",
            ),
            (
                "[database]\ntable = \"room-outbox\"".into(),
                "database.table",
            ),
            (
                "[[publishers]]\nkind = \"kafka\"".into(),
                "publishers.0.kind",
            ),
            (
                "[[publishers]]\nkind = \"file\"\npath = \"-\"\ncolour = 1".into(),
                "publishers.0.colour",
            ),
            // A value of the wrong type inside an entry names its key,
            // not only the entry.
            (
                "[[publishers]]\nkind = \"webhook\"\nurl = \"http://h/\"\ntimeout = \"abc\"".into(),
                "publishers.0.timeout",
            ),
            (
                "[[publishers]]\nkind = \"rabbitmq\"\nurl = \"amqp://h/\"\nexchange = \"x\"\ndeclare = \"yes\"".into(),
                "publishers.0.declare",
            ),
            (
                "[[publishers]]\nkind = \"rabbitmq\"\nurl = \"amqp://h/\"\nexchange = \"x\"\n[[publishers.failover]]\nurl = 7".into(),
                "publishers.0.failover.0.url",
            ),
            ("[database]\nurl = \"oracle://x\"".into(), "database.url"),
        ] {
            assert_eq!(key_of(&toml), key, "{toml}");
        }
        // Template keys of a publisher, also as a later entry.
        let file = "[[publishers]]\nkind = \"file\"\npath = \"-\"\n";
        for (entry, key) in [
            (
                "kind = \"rabbitmq\"\nurl = \"amqp://h/\"\nexchange = \"x\"\nrouting_key = \"{nope}\"",
                "publishers.1.routing_key",
            ),
            (
                "kind = \"nats\"\nurl = \"nats://h\"\nstream = \"S\"\nsubject = \"a.}\"",
                "publishers.1.subject",
            ),
            (
                "kind = \"redis\"\nurl = \"redis://h\"\nstream = \"{event}\"",
                "publishers.1.stream",
            ),
        ] {
            let toml = format!("{file}[[publishers]]\n{entry}\n");
            assert_eq!(key_of(&toml), key, "{entry}");
            let err = load_str(&toml).unwrap_err().to_string();
            assert!(err.contains("template") && !err.contains('\u{1f}'), "{err}");
        }
        assert_eq!(
            key_of(&format!("{file}{file}")),
            "publishers.1.name",
            "the index is the entry's, as figment's keys"
        );
    }

    #[test]
    fn consumers_load_with_defaults_and_refuse_bad_keys() {
        let base = "[[consumers]]\nkind = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nqueue = \"console_bus\"\n";
        let c = load_str(&format!(
            "{base}bindings = [{{ exchange = \"postbox\" }}]\nhandler = {{ http = \"http://127.0.0.1:8080/events\" }}\ninbox = {{ url = \"sqlite://inbox.db\" }}\n"
        ))
        .unwrap();
        let c = &c.consumers[0];
        assert_eq!(c.prefetch, 1);
        assert_eq!(c.max_attempts, 5);
        assert_eq!(c.name(), "console_bus");
        assert_eq!(c.consumer_group(), "console_bus");
        assert_eq!(c.bindings[0].routing_key, "#");
        assert_eq!(c.inbox.as_ref().unwrap().table.as_str(), "postbox_inbox");
        assert_eq!(c.inbox_retention, "7d".parse().unwrap());
        for (extra, key) in [
            ("prefetch = 0", "consumers.0.prefetch"),
            ("prefetch = 70000", "consumers.0.prefetch"),
            ("max_attempts = 0", "consumers.0.max_attempts"),
            ("retry_delay = \"0s\"", "consumers.0.retry_delay"),
            (
                "retry_delay = \"10s\"\nmax_retry_delay = \"1s\"",
                "consumers.0.max_retry_delay",
            ),
            (
                "handler = { http = \"ftp://x\" }",
                "consumers.0.handler.http",
            ),
            ("inbox = { url = \"oracle://x\" }", "consumers.0.inbox.url"),
            (
                "inbox = { url = \"sqlite://x\", table = \"a-b\" }",
                "consumers.0.inbox.table",
            ),
            ("colour = 1", "consumers.0.colour"),
        ] {
            assert_eq!(key_of(&format!("{base}{extra}")), key, "{extra}");
        }
        assert_eq!(
            key_of(&format!("{base}{base}")),
            "consumers.1.name",
            "two consumers on one queue need names"
        );
        assert_eq!(
            key_of("[[consumers]]\nkind = \"rabbitmq\"\nurl = \"nats://x\"\nqueue = \"q\""),
            "consumers.0.url"
        );
    }

    #[test]
    fn brokers_take_one_url_or_the_nodes_of_a_cluster() {
        let rabbit = "[[publishers]]\nkind = \"rabbitmq\"\nexchange = \"x\"\n";
        let nodes = "urls = [\"amqp://a:5672/%2f\", \"amqp://b:5672/%2f\"]";
        let c = load_str(&format!("{rabbit}{nodes}")).unwrap();
        let urls: Vec<_> = c.publishers[0]
            .nodes()
            .iter()
            .map(|u| u.expose().to_owned())
            .collect();
        assert_eq!(urls, ["amqp://a:5672/%2f", "amqp://b:5672/%2f"]);
        assert_eq!(c.publishers[0].url().unwrap().expose(), "amqp://a:5672/%2f");
        let one = load_str(&format!("{rabbit}url = \"amqp://a/\"")).unwrap();
        assert_eq!(one.publishers[0].nodes().len(), 1);
        assert_eq!(key_of(rabbit), "publishers.0.url");
        assert_eq!(
            key_of(&format!("{rabbit}url = \"amqp://a/\"\n{nodes}")),
            "publishers.0.urls"
        );
        assert_eq!(
            key_of(&format!("{rabbit}urls = [\"amqp://a/\", \"http://b/\"]")),
            "publishers.0.urls.1"
        );
        let failover = format!("{rabbit}url = \"amqp://a/\"\nfailover = [{{ name = \"dr\", urls = [\"amqp://b/\", \"amqp://c/\"] }}, {{ url = \"amqp://d/\" }}]\n");
        let c = load_str(&failover).unwrap();
        let crate::config::PublisherConfig::Rabbitmq(r) = &c.publishers[0] else {
            panic!("a rabbitmq publisher")
        };
        assert_eq!(
            (r.target_name(0), r.target_name(1), r.target_name(2)),
            ("primary".into(), "dr".into(), "failover-2".into())
        );
        assert_eq!(r.for_failover(0).nodes().len(), 2);
        assert_eq!(r.for_failover(1).url.expose(), "amqp://d/");
        assert_eq!(r.failover_after.get(), std::time::Duration::from_secs(10));
        assert_eq!(
            key_of(&format!(
                "{rabbit}url = \"amqp://a/\"\nfailover = [{{ url = \"http://b/\" }}]"
            )),
            "publishers.0.failover.0.url"
        );
        assert_eq!(
            key_of(&format!(
                "{rabbit}url = \"amqp://a/\"\nfailover = [{{ name = \"x\" }}]"
            )),
            "publishers.0.failover.0.url"
        );
        assert_eq!(
            key_of(&format!("{failover}failback_after = \"0s\"")),
            "publishers.0.failback_after"
        );
        let nats = "[[publishers]]\nkind = \"nats\"\nstream = \"S\"\nurl = \"nats://a:4222\"\n";
        let c = load_str(&format!("{nats}failover = [{{ url = \"nats://b:4222\" }}]")).unwrap();
        let crate::config::PublisherConfig::Nats(n) = &c.publishers[0] else {
            panic!("a nats publisher")
        };
        assert_eq!(n.for_failover(0).url.expose(), "nats://b:4222");
        assert_eq!(n.for_failover(0).stream, "S");
        assert_eq!(
            key_of(&format!("{nats}failover = [{{ url = \"amqp://b/\" }}]")),
            "publishers.0.failover.0.url"
        );
        assert_eq!(
            key_of(&format!("{nats}failover_after = \"0s\"")),
            "publishers.0.failover_after"
        );
        let consumer = "[[consumers]]\nqueue = \"q\"\n";
        let c = load_str(&format!(
            "{consumer}kind = \"nats\"\nurls = [\"nats://a:4222\", \"nats://b:4222\"]"
        ))
        .unwrap();
        assert_eq!(c.consumers[0].nodes().len(), 2);
        assert_eq!(
            key_of(&format!(
                "{consumer}kind = \"redis\"\nurls = [\"redis://a\", \"redis://b\"]"
            )),
            "consumers.0.urls"
        );
        let quorum = load_str(&format!(
            "{consumer}kind = \"rabbitmq\"\nurl = \"amqp://a/\"\nqueue_type = \"quorum\""
        ))
        .unwrap();
        assert_eq!(
            quorum.consumers[0].queue_type,
            crate::config::QueueType::Quorum
        );
        assert_eq!(
            key_of(&format!(
                "{consumer}kind = \"nats\"\nurl = \"nats://a\"\nqueue_type = \"quorum\""
            )),
            "consumers.0.queue_type"
        );
    }

    #[test]
    fn tracing_takes_an_http_collector_and_names_its_traces_endpoint() {
        let t = "[tracing]\n";
        assert_eq!(load_str("").unwrap().tracing.traces_endpoint(), None);
        for (otlp, endpoint) in [
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            (
                "https://collector:4318/",
                "https://collector:4318/v1/traces",
            ),
            (
                "http://collector:4318/otlp/traces",
                "http://collector:4318/otlp/traces",
            ),
        ] {
            let c = load_str(&format!("{t}otlp = \"{otlp}\"\nservice_name = \"relay\"")).unwrap();
            assert_eq!(c.tracing.traces_endpoint().as_deref(), Some(endpoint));
            assert_eq!(c.tracing.service_name, "relay");
        }
        for bad in [
            "collector:4318",
            "grpc://collector:4317",
            "http://",
            "http:///v1/traces",
        ] {
            assert_eq!(
                key_of(&format!("{t}otlp = \"{bad}\"")),
                "tracing.otlp",
                "{bad}"
            );
        }
        assert_eq!(
            key_of(&format!("{t}service_name = \" \"")),
            "tracing.service_name"
        );
        assert_eq!(
            key_of(&format!("{t}exporter = \"jaeger\"")),
            "tracing.exporter"
        );
    }

    #[test]
    fn rabbitmq_ca_file_needs_amqps() {
        let p = "[[publishers]]\nkind = \"rabbitmq\"\nexchange = \"x\"\nca_file = \"ca.pem\"\n";
        assert_eq!(
            key_of(&format!("{p}url = \"amqp://h/\"")),
            "publishers.0.ca_file"
        );
        let c = load_str(&format!("{p}url = \"amqps://h/\"")).unwrap();
        assert_eq!(c.publishers[0].kind(), "rabbitmq");
    }

    /// A NATS stream name follows one rule for publishers and consumers:
    /// the publisher's own check used to accept a tab or a line break.
    #[test]
    fn a_nats_stream_name_follows_one_rule_everywhere() {
        for stream in ["ORDERS\\tV2", "ORDERS\\nV2", "OR.DERS", ""] {
            let publisher = format!(
                "[[publishers]]\nkind = \"nats\"\nurl = \"nats://h\"\nstream = \"{stream}\"\nsubject = \"a.b\"\n"
            );
            assert_eq!(key_of(&publisher), "publishers.0.stream", "{stream:?}");
            let consumer = format!(
                "[[consumers]]\nkind = \"nats\"\nurl = \"nats://h\"\nqueue = \"{stream}\"\nconsumer_group = \"g\"\n[consumers.handler]\nhttp = \"http://h/\"\n"
            );
            assert_eq!(key_of(&consumer), "consumers.0.queue", "{stream:?}");
        }
    }

    #[test]
    fn secrets_do_not_leak_into_errors() {
        let err = load_str("[database]\nurl = \"oracle://u:hunter2@h/db\"").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn seed_table_name_and_publishers_load() {
        let c = load_str(
            "[database]\ntable = \"room_outbox\"\napp_codes=[\"room\"]\n[[publishers]]\nkind=\"file\"\npath=\"-\"\n",
        )
        .unwrap();
        assert_eq!(c.database.table.as_str(), "room_outbox");
        assert_eq!(c.publishers[0].name(), "file");
    }

    #[test]
    fn wake_defaults_to_notify_and_refuses_other_values_naming_the_key() {
        use crate::config::WakeMode;
        assert_eq!(load_str("").unwrap().outbox_worker.wake, WakeMode::Notify);
        let poll = load_str("[outbox_worker]\nwake = \"poll\"").unwrap();
        assert_eq!(poll.outbox_worker.wake, WakeMode::Poll);
        assert_eq!(
            key_of("[outbox_worker]\nwake = \"bogus\""),
            "outbox_worker.wake"
        );
    }
}
