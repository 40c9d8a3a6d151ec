//! Which database a URL names: the one scheme rule that validation and
//! every opener (the outbox store, the inboxes) share.

use super::KeyPath;
use crate::redact::SecretUrl;
use crate::Error;

/// A supported database, by URL scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseKind {
    /// `postgres://` or `postgresql://`.
    Postgres,
    /// `mysql://` or `mariadb://`.
    MySql,
    /// `sqlite://`.
    Sqlite,
}

impl DatabaseKind {
    /// The database `url` names; an unknown scheme is an error naming `key`
    /// (never a guess: a typo must not open a SQLite file).
    pub fn of(url: &SecretUrl, key: &KeyPath) -> Result<DatabaseKind, Error> {
        match url.scheme() {
            "postgres" | "postgresql" => Ok(DatabaseKind::Postgres),
            "mysql" | "mariadb" => Ok(DatabaseKind::MySql),
            "sqlite" => Ok(DatabaseKind::Sqlite),
            _ => Err(Error::config(
                key.clone(),
                format!(
                    "{}: use postgres://, mysql:// or sqlite://",
                    url.scheme_refused()
                ),
            )),
        }
    }

    /// [`DatabaseKind::of`] for validation: a URL holding an unset
    /// `${VAR}` is not judged here (`Config::require_env` names it, for the
    /// commands that use it).
    pub(crate) fn check(url: &SecretUrl, key: &KeyPath) -> Result<(), Error> {
        match url.unresolved() {
            Some(_) => Ok(()),
            None => DatabaseKind::of(url, key).map(drop),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_name_their_database_and_others_are_refused() {
        let key = KeyPath::root("database").join("url");
        for (url, kind) in [
            ("postgres://h/db", DatabaseKind::Postgres),
            ("postgresql://h/db", DatabaseKind::Postgres),
            ("mysql://h/db", DatabaseKind::MySql),
            ("mariadb://h/db", DatabaseKind::MySql),
            ("sqlite://x.db", DatabaseKind::Sqlite),
        ] {
            assert_eq!(DatabaseKind::of(&SecretUrl::new(url), &key).unwrap(), kind);
        }
        match DatabaseKind::of(&SecretUrl::new("oracle://u:pw@h/db"), &key) {
            Err(Error::Config { key, reason }) => {
                assert_eq!(key, "database.url");
                assert!(
                    reason.contains("`oracle`") && !reason.contains("pw"),
                    "{reason}"
                );
            }
            other => panic!("expected a config error, got {other:?}"),
        }
        // Not a URL: a libpq key/value string, an ADO one, a bare
        // password. What came before the first `:` was quoted as the
        // "scheme": the whole value, password and all.
        for not_a_url in [
            "host=db user=app password=hunter2 dbname=room",
            "Server=db;Password=hunter2:x",
            "hunter2",
        ] {
            match DatabaseKind::of(&SecretUrl::new(not_a_url), &key) {
                Err(Error::Config { reason, .. }) => {
                    assert!(
                        reason.starts_with("not a URL") && !reason.contains("hunter2"),
                        "{reason}"
                    );
                }
                other => panic!("expected a config error, got {other:?}"),
            }
        }
    }
}
