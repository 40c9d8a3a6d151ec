//! Keeping secrets out of logs and errors.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// Replaces the password in `scheme://user:password@host/...` (and a NATS
/// URL's token, `nats://token@host`) with `***`, and
/// the value of query parameters that carry credentials (`password=`,
/// `token=`, `secret=`, `key=`, `sig=`, …).
///
/// A password pasted into a URL unencoded may hold `/`, `?` or `#` (a
/// base64 one often does): the user information ends at the last `@`
/// before the query, not at the first `/`, so all of it is hidden.
///
/// ```
/// use postbox_core::redact::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
/// assert_eq!(redact_url("amqps://app:ab/cd+e==@mq/v"), "amqps://app:***@mq/v");
/// assert_eq!(redact_url("amqp://guest@h/"), "amqp://guest@h/");
/// // NATS's `token@host`: the token stands where a user would.
/// assert_eq!(redact_url("nats://s3cr3t@n1:4222"), "nats://***@n1:4222");
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some((start, at)) = userinfo(&out) {
        if let Some(colon) = out[start..at].find(':') {
            out.replace_range(start + colon + 1..at, "***");
        } else if out.starts_with("nats://") || out.starts_with("tls://") {
            // NATS's `token@host`: the lone "user" is the secret.
            out.replace_range(start..at, "***");
        }
    }
    for key in SECRET_PARAMETERS {
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

/// Query parameters whose value is a credential (matched anywhere in a
/// parameter's name: `api_key=`, `access_token=`).
const SECRET_PARAMETERS: [&str; 6] = [
    "password=",
    "token=",
    "secret=",
    "key=",
    "sig=",
    "signature=",
];

/// [`redact_url`] without the query and fragment, and with long path
/// segments hidden ([`hide_path_tokens`]): a URL as an error or a log line
/// shows it (`https://hooks.example/in`).
///
/// ```
/// use postbox_core::redact::shown_url;
/// assert_eq!(shown_url("https://u:p@h.example/in?x=1#f"), "https://u:***@h.example/in");
/// ```
pub fn shown_url(url: &str) -> String {
    let mut out = redact_url(url);
    let authority = userinfo(&out).map_or_else(|| authority_start(&out).unwrap_or(0), |(_, at)| at);
    if let Some(cut) = out[authority..].find(['?', '#']) {
        out.truncate(authority + cut);
    }
    if let Some(slash) = out[authority..].find('/') {
        let path = hide_path_tokens(&out[authority + slash..]);
        out.truncate(authority + slash);
        out.push_str(&path);
    }
    out
}

/// `path` with each segment of 16 characters or more shown as `***`: the
/// secret of a webhook URL is often a path segment (Slack's
/// `/services/T…/B…/<token>`, Discord's `/api/webhooks/<id>/<token>`), and
/// an error or a log line shows the path to say which endpoint failed.
///
/// ```
/// use postbox_core::redact::hide_path_tokens;
/// assert_eq!(hide_path_tokens("/services/T01/B02/abcdefghijklmnopqrstuvwx"), "/services/T01/B02/***");
/// assert_eq!(hide_path_tokens("/hooks/orders"), "/hooks/orders");
/// ```
pub fn hide_path_tokens(path: &str) -> String {
    path.split('/')
        .map(|segment| {
            if segment.chars().count() >= 16 {
                "***"
            } else {
                segment
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// Where the authority of `url` starts: after `://`; else after `scheme:`
/// and its slashes however many (`postgres:/u:pw@h` is a typo a driver may
/// still quote back); else at the start when there is no scheme (`u:pw@h`)
/// and no space before the `@` (a sentence quoting a URL is not one).
fn authority_start(url: &str) -> Option<usize> {
    if let Some(i) = url.find("://") {
        return Some(i + 3);
    }
    let scheme = url.find(':').filter(|&colon| {
        let name = &url[..colon];
        name.starts_with(|c: char| c.is_ascii_alphabetic())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            && url[colon + 1..].starts_with('/')
    });
    match scheme {
        Some(colon) => Some(
            colon + 1 + url[colon + 1..].len() - url[colon + 1..].trim_start_matches('/').len(),
        ),
        None => {
            let at = url.find('@')?;
            (!url[..at].contains(char::is_whitespace)).then_some(0)
        }
    }
}

/// Where the user information of `url` starts and the `@` that ends it:
/// the last `@` before the first `?` or `#` after the first `@` (a `?`
/// or `#` before it is the password's own). `None` without one.
pub(crate) fn userinfo(url: &str) -> Option<(usize, usize)> {
    let start = authority_start(url)?;
    let first_at = start + url[start..].find('@')?;
    let query = url[first_at..]
        .find(['?', '#'])
        .map_or(url.len(), |i| first_at + i);
    let at = start + url[start..query].rfind('@')?;
    Some((start, at))
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
        /// A secret as written: text, or a number (a token of digits set
        /// through the environment, `POSTBOX__ADMIN__TOKEN=9876…`, reads
        /// as one), taken as its digits.
        struct Raw;
        impl serde::de::Visitor<'_> for Raw {
            type Value = String;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string (a secret, or `${VAR}` to read one from the environment)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
                Ok(v.to_owned())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<String, E> {
                Ok(v.to_string())
            }
        }
        let raw = d.deserialize_any(Raw)?;
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

    /// The URL's scheme (`postgres`, `mysql`, `sqlite`, `amqp`, …); empty
    /// when the value does not start with one (`host=db password=…`, a
    /// bare password): what comes before its first `:` could be anything,
    /// and was quoted in errors.
    pub fn scheme(&self) -> &str {
        let head = self.0.split(':').next().unwrap_or("");
        let scheme = self.0.contains(':')
            && head.len() <= 32
            && head.starts_with(|c: char| c.is_ascii_alphabetic())
            && head
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        if scheme {
            head
        } else {
            ""
        }
    }

    /// Why a URL of a scheme not wanted is refused: its scheme, or that it
    /// has none, never the value itself.
    pub fn scheme_refused(&self) -> String {
        match self.scheme() {
            "" => "not a URL (it does not start with `scheme://`)".to_owned(),
            other => format!("unsupported scheme `{other}`"),
        }
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

    /// A password pasted unencoded: `/`, `?`, `#` and `@` in it are its
    /// own, and a `@` in the query is not the end of the user information.
    #[test]
    fn hides_a_password_holding_url_delimiters() {
        for (url, shown) in [
            (
                "amqps://postbox:ab/cd+ef==@mq.example/v",
                "amqps://postbox:***@mq.example/v",
            ),
            ("amqp://u:a?b#c@h:5672/v", "amqp://u:***@h:5672/v"),
            ("amqp://u:p@s/x@h/v", "amqp://u:***@h/v"),
            ("amqp://u:pw@h/v?email=a@b", "amqp://u:***@h/v?email=a@b"),
            // A slash short, or none at all: still hidden.
            ("postgres:/u:pw@h/db", "postgres:/u:***@h/db"),
            ("postgres:u:pw@h/db", "postgres:***@h/db"),
            ("u:pw@h:5432", "u:***@h:5432"),
            (
                "https://h.example/in?api_key=k1&sig=s2&x=1",
                "https://h.example/in?api_key=***&sig=***&x=1",
            ),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        assert_eq!(
            shown_url("amqps://u:ab/c?d@h/v?token=t#f"),
            "amqps://u:***@h/v"
        );
        assert_eq!(
            shown_url("http://127.0.0.1:9/in?key=k"),
            "http://127.0.0.1:9/in"
        );
    }

    /// A secret is text or a number (its digits); anything else is refused
    /// saying what is expected, without the value.
    #[test]
    fn a_secret_reads_text_or_digits() {
        let read = |json: &str| serde_json::from_str::<Secret>(json);
        assert_eq!(read("\"s3cret\"").unwrap().expose(), "s3cret");
        assert_eq!(read("98765432101234").unwrap().expose(), "98765432101234");
        let refused = read("true").unwrap_err().to_string();
        assert!(refused.contains("expected a string"), "{refused}");
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
