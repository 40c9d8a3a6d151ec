//! A broker entry's nodes: `url = "…"` for one server, or `urls = […]` for
//! the nodes of a cluster (RabbitMQ, NATS), tried in order on connect and
//! on every reconnect, so a client moves to the next live node when the
//! one it was on goes away.

use super::KeyPath;
use crate::redact::SecretUrl;
use crate::Error;

/// Every node: `urls`, or `url` alone when `urls` is empty (a config
/// built in code, not yet settled).
pub fn all<'a>(url: &'a SecretUrl, urls: &'a [SecretUrl]) -> &'a [SecretUrl] {
    if urls.is_empty() {
        std::slice::from_ref(url)
    } else {
        urls
    }
}

/// The nodes' URLs with their passwords, to connect with.
pub fn exposed(nodes: &[SecretUrl]) -> Vec<&str> {
    nodes.iter().map(SecretUrl::expose).collect()
}

/// What a NATS URL's user info carries: `nats://user:password@host` or
/// `nats://token@host`, percent-decoded. Shown as `***`.
#[derive(Clone, PartialEq, Eq)]
pub enum NatsCredentials {
    /// `user:password@`.
    UserPassword(String, String),
    /// `token@`.
    Token(String),
}

impl std::fmt::Debug for NatsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// The NATS nodes without their user info, and the credentials that user
/// info carries: the NATS client sends only credentials set on its
/// options, and none from a URL (a `nats://user:password@host` was
/// refused as unauthorized). Nodes that carry credentials must carry the
/// same ones; a node without any uses them too.
pub fn nats_nodes(nodes: &[SecretUrl]) -> Result<(Vec<String>, Option<NatsCredentials>), String> {
    let mut bare = Vec::with_capacity(nodes.len());
    let mut found: Option<NatsCredentials> = None;
    for node in nodes {
        let url = node.expose();
        let Some((start, at)) = crate::redact::userinfo(url) else {
            bare.push(url.to_owned());
            continue;
        };
        let info = &url[start..at];
        let decoded = |part: &str| {
            percent_decoded(part).ok_or_else(|| {
                format!("{}: the user info is not valid percent-encoded UTF-8", node)
            })
        };
        let these = match info.split_once(':') {
            Some((user, password)) => {
                NatsCredentials::UserPassword(decoded(user)?, decoded(password)?)
            }
            None => NatsCredentials::Token(decoded(info)?),
        };
        match &found {
            Some(first) if *first != these => {
                return Err(format!("{node}: its credentials differ from the first node's; every node of a NATS cluster is given the same"));
            }
            _ => found = Some(these),
        }
        bare.push(format!("{}{}", &url[..start], &url[at + 1..]));
    }
    Ok((bare, found))
}

/// `%XX` escapes decoded; `None` for a bad escape or bytes that are not
/// UTF-8.
fn percent_decoded(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Whether `url` was written (an unset `${VAR}` counts: it is reported by
/// `require_env`).
fn given(url: &SecretUrl) -> bool {
    !url.expose().is_empty() || url.unresolved().is_some()
}

/// Checks that one of `url` and `urls` is given, and sets `url` to the
/// first node when `urls` is (what log lines show); [`all`] lists the
/// nodes either way. Fails, naming the key, when neither or both are
/// given, or several nodes where `clusters` is `Err(why)` (the kind takes
/// one server).
pub(crate) fn settle(
    url: &mut SecretUrl,
    urls: &[SecretUrl],
    at: &KeyPath,
    clusters: Result<(), &str>,
) -> Result<(), Error> {
    match (given(url), urls.is_empty()) {
        (true, true) => {}
        (false, false) => *url = urls[0].clone(),
        (false, true) => {
            return Err(Error::config(
                at.join("url"),
                "is required: the broker's URL (or `urls`, the nodes of its cluster)",
            ))
        }
        (true, false) => {
            return Err(Error::config(
                at.join("urls"),
                "give `url` (one server) or `urls` (the nodes of a cluster), not both",
            ))
        }
    }
    if urls.len() > 1 {
        if let Err(why) = clusters {
            return Err(Error::config(at.join("urls"), why));
        }
    }
    Ok(())
}

/// The key of node `i` of `n`: `url` when there is one, `urls.<i>` else.
pub(crate) fn key(at: &KeyPath, i: usize, n: usize) -> KeyPath {
    if n == 1 {
        at.join("url")
    } else {
        at.join("urls").index(i)
    }
}

/// Checks every node's scheme against `schemes`, for kind `kind`.
pub(crate) fn check_schemes(
    urls: &[SecretUrl],
    at: &KeyPath,
    kind: &str,
    schemes: &[&str],
) -> Result<(), Error> {
    for (i, url) in urls.iter().enumerate() {
        // An unset `${VAR}` is reported by `require_env`, by the commands
        // that use this section only.
        if url.unresolved().is_none() && !schemes.contains(&url.scheme()) {
            let wanted: Vec<_> = schemes.iter().map(|s| format!("{s}://")).collect();
            return Err(Error::config(
                key(at, i, urls.len()),
                format!(
                    "{} for kind `{kind}`: use {}",
                    url.scheme_refused(),
                    wanted.join(" or ")
                ),
            ));
        }
    }
    Ok(())
}

/// The first unset `${VAR}` among the nodes, with its key.
pub(crate) fn unresolved<'a>(urls: &'a [SecretUrl], at: &KeyPath) -> Option<(KeyPath, &'a str)> {
    (urls.iter().enumerate()).find_map(|(i, u)| Some((key(at, i, urls.len()), u.unresolved()?)))
}

/// Why Redis takes one server.
pub(crate) const REDIS_ONE_SERVER: &str = "Redis takes one `url`: a stream lives on one primary, so a Redis failover needs Sentinel or a proxy in front that always points at the primary";

#[cfg(test)]
mod nats_tests {
    use super::*;

    fn urls(u: &[&str]) -> Vec<SecretUrl> {
        u.iter().map(|u| SecretUrl::new(*u)).collect()
    }

    #[test]
    fn nats_credentials_come_out_of_the_urls() {
        let (bare, creds) =
            nats_nodes(&urls(&["nats://app:p%40ss%3Aw@n1:4222", "nats://n2:4222"])).unwrap();
        assert_eq!(bare, ["nats://n1:4222", "nats://n2:4222"]);
        assert_eq!(
            creds,
            Some(NatsCredentials::UserPassword("app".into(), "p@ss:w".into()))
        );
        let (bare, creds) = nats_nodes(&urls(&["tls://s3cr3t@n1"])).unwrap();
        assert_eq!(
            (bare, creds),
            (
                vec!["tls://n1".to_owned()],
                Some(NatsCredentials::Token("s3cr3t".into()))
            )
        );
        assert_eq!(nats_nodes(&urls(&["nats://n1:4222"])).unwrap().1, None);
        let differ = nats_nodes(&urls(&["nats://a:1@n1", "nats://a:2@n2"])).unwrap_err();
        assert!(
            differ.contains("differ") && !differ.contains(":2@"),
            "{differ}"
        );
        assert!(nats_nodes(&urls(&["nats://a:%zz@n1"])).is_err());
        assert_eq!(format!("{:?}", NatsCredentials::Token("t".into())), "***");
    }
}
