//! Keeping secrets out of logs and errors.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// Replaces the password in `scheme://user:password@host/...` with `***`, and
/// the value of `password=`/`token=`/`secret=` query parameters.
///
/// ```
/// use postbox_core::redact::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
/// assert_eq!(redact_url("amqp://guest@h/"), "amqp://guest@h/");
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest_start = scheme_end + 3;
        let authority_end = out[rest_start..]
            .find(['/', '?', '#'])
            .map_or(out.len(), |i| rest_start + i);
        if let Some(at) = out[rest_start..authority_end].rfind('@') {
            let userinfo = &out[rest_start..rest_start + at];
            if let Some(colon) = userinfo.find(':') {
                let pw_start = rest_start + colon + 1;
                let pw_end = rest_start + at;
                out.replace_range(pw_start..pw_end, "***");
            }
        }
    }
    for key in ["password=", "token=", "secret=", "sslpassword="] {
        let mut from = 0;
        while let Some(pos) = out[from..].find(key) {
            let start = from + pos + key.len();
            let end = out[start..].find('&').map_or(out.len(), |i| start + i);
            out.replace_range(start..end, "***");
            from = start + 3;
        }
    }
    out
}

/// A string that must never be printed: `Debug` and `Display` show `***`.
///
/// A `${VAR}` whose variable is not set does not fail deserialization: the
/// value is then [`Secret::unresolved`], and only a command that uses it
/// fails (see `Config::require_env`), so a reading command does not need
/// the relay's or the admin server's secrets.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(String, Option<String>);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into(), None)
    }

    /// The secret itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True when no secret was set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty() && self.1.is_none()
    }

    /// Why the value could not be read from the environment (an unset
    /// `${VAR}`), if so.
    pub fn unresolved(&self) -> Option<&str> {
        self.1.as_deref()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"***\"")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        let (value, unresolved) = expand_env_lenient(&raw).map_err(serde::de::Error::custom)?;
        Ok(Secret(value, unresolved))
    }
}

/// A connection URL whose `Debug`/`Display` hide the password.
/// Like [`Secret`], an unset `${VAR}` leaves it [`SecretUrl::unresolved`].
#[derive(Clone, PartialEq, Eq, Default)]
pub struct SecretUrl(String, Option<String>);

impl SecretUrl {
    /// Wraps a URL.
    pub fn new(url: impl Into<String>) -> Self {
        SecretUrl(url.into(), None)
    }

    /// Why the URL could not be read from the environment (an unset
    /// `${VAR}`), if so.
    pub fn unresolved(&self) -> Option<&str> {
        self.1.as_deref()
    }

    /// The URL with its password, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL's scheme (`postgres`, `mysql`, `sqlite`, `amqp`, …).
    pub fn scheme(&self) -> &str {
        self.0.split(':').next().unwrap_or("")
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", redact_url(&self.0))
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.0))
    }
}

impl<'de> Deserialize<'de> for SecretUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        let (value, unresolved) = expand_env_lenient(&raw).map_err(serde::de::Error::custom)?;
        Ok(SecretUrl(value, unresolved))
    }
}

/// [`expand_env`] that does not fail on unset variables: they expand to
/// nothing, and the second value says which were unset. A malformed
/// reference is still an error.
fn expand_env_lenient(raw: &str) -> Result<(String, Option<String>), String> {
    let mut unset = Vec::new();
    let out = expand_env_with(raw, |var| {
        unset.push(format!("`{var}`"));
        Ok(())
    })?;
    let unresolved = (!unset.is_empty())
        .then(|| format!("environment variable {} is not set", unset.join(", ")));
    Ok((out, unresolved))
}

/// Expands `${VAR}` references from the environment, so secrets can stay out
/// of the config file. A missing variable is an error naming it.
pub fn expand_env(raw: &str) -> Result<String, String> {
    expand_env_with(raw, |var| {
        Err(format!("environment variable `{var}` is not set"))
    })
}

/// Expands `${VAR}` references, calling `unset` for each variable that is
/// not set (it expands to nothing unless `unset` fails the expansion).
fn expand_env_with(
    raw: &str,
    mut unset: impl FnMut(&str) -> Result<(), String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unclosed `${{` in `{}`", redact_url(raw)))?;
        let var = &after[..end];
        match std::env::var(var) {
            Ok(value) => out.push_str(&value),
            Err(_) => unset(var)?,
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_and_query_secrets() {
        assert_eq!(
            redact_url("mysql://root:pw@127.0.0.1:3306/db?password=x&a=b"),
            "mysql://root:***@127.0.0.1:3306/db?password=***&a=b"
        );
        assert_eq!(redact_url("sqlite://postbox.db"), "sqlite://postbox.db");
        assert_eq!(redact_url("amqp://u:p@ss@h/v"), "amqp://u:***@h/v");
    }

    #[test]
    fn secret_never_prints() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s} {s:?}"), "*** \"***\"");
        let u = SecretUrl::new("postgres://a:hunter2@h/d");
        assert!(!format!("{u} {u:?}").contains("hunter2"));
    }

    #[test]
    fn expands_env() {
        std::env::set_var("POSTBOX_REDACT_TEST", "v");
        assert_eq!(expand_env("a${POSTBOX_REDACT_TEST}b").unwrap(), "avb");
        assert!(expand_env("${POSTBOX_SURELY_UNSET_VAR}")
            .unwrap_err()
            .contains("POSTBOX_SURELY_UNSET_VAR"));
    }
}
