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
                    "unsupported scheme `{}` for kind `{kind}`: use {}",
                    url.scheme(),
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
