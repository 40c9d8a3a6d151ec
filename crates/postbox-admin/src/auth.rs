//! Who may call what, checked in one place (a middleware in front of every
//! route) before any handler runs, so a refused request learns nothing,
//! not even whether an event exists.
//!
//! - `/healthz`, the dashboard's page and assets: open (they hold no data).
//! - `/metrics`: open, or with `admin.metrics = "token"` a token of either
//!   role.
//! - `GET /api/…` (stats, events with their payloads, timelines,
//!   consumers): a `viewer` or `operator` token.
//! - Every other `/api/…` call (replay, consumer pause and resume): an
//!   `operator` token.
//!
//! Without any token configured, reads are open (a local, trusted port)
//! to requests addressed to an IP address or `localhost`, and every change
//! is refused. A request addressed to a host name is refused then: a page
//! the operator's browser opens elsewhere could point its own name at
//! this address (DNS rebinding) and read events as a same-origin page.
//! Tokens are compared as SHA-256 digests in
//! constant time, against every configured token.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use postbox_core::config::{AdminConfig, AdminRole, MetricsAccess};
use postbox_core::redact::Secret;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No admin token configured: changes are disabled.
    NoTokenConfigured,
    /// Missing or unknown `Authorization: Bearer …`.
    BadToken,
    /// No token configured, and the request was addressed to this host
    /// name (`Host`), not to an IP address or `localhost`.
    NamedHost(String),
    /// A known token whose role may not do this.
    NotAllowed {
        /// The token's name.
        name: String,
        /// What the call needs.
        need: AdminRole,
    },
}

/// The caller of a request, put in its extensions by [`guard`] (absent
/// when no token is configured).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    /// The token's name (`admin` for `admin.token`).
    pub name: String,
}

/// Who made a change, as logs and an event's history record it:
/// `api <token name>@<ip>`, or `api <ip>` without a token.
pub(crate) fn origin(caller: Option<&Caller>, peer: std::net::SocketAddr) -> String {
    match caller {
        Some(c) => format!("api {}@{}", c.name, peer.ip()),
        None => format!("api {}", peer.ip()),
    }
}

#[derive(Debug)]
struct Holder {
    name: String,
    role: AdminRole,
    digest: [u8; 32],
}

/// The configured tokens and the `/metrics` rule.
#[derive(Debug, Clone)]
pub(crate) struct Access {
    holders: Arc<Vec<Holder>>,
    metrics: MetricsAccess,
}

impl Access {
    /// Access by `tokens` (name, role, token); empty tokens are left out.
    pub(crate) fn new(tokens: &[(String, AdminRole, Secret)], metrics: MetricsAccess) -> Self {
        let holders = tokens
            .iter()
            .filter(|(_, _, t)| !t.is_empty())
            .map(|(name, role, t)| Holder {
                name: name.clone(),
                role: *role,
                digest: Sha256::digest(t.expose().as_bytes()).into(),
            })
            .collect();
        Access {
            holders: Arc::new(holders),
            metrics,
        }
    }

    /// Access as `[admin]` configures it.
    pub(crate) fn of(admin: &AdminConfig) -> Self {
        Access::new(&admin.named_tokens(), admin.metrics)
    }

    /// No token configured: reads open, changes refused.
    pub(crate) fn is_open(&self) -> bool {
        self.holders.is_empty()
    }

    /// The caller of a request that needs `need`.
    pub(crate) fn check(
        &self,
        headers: &HeaderMap,
        need: AdminRole,
    ) -> Result<Option<Caller>, Refusal> {
        if self.is_open() {
            return match need {
                AdminRole::Viewer => addressed_locally(headers).map(|()| None),
                AdminRole::Operator => Err(Refusal::NoTokenConfigured),
            };
        }
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or(Refusal::BadToken)?;
        let given: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        // Every token compared, whichever matches.
        let mut found = None;
        for h in self.holders.iter() {
            if bool::from(given.ct_eq(&h.digest)) {
                found = Some(h);
            }
        }
        let holder = found.ok_or(Refusal::BadToken)?;
        if holder.role < need {
            return Err(Refusal::NotAllowed {
                name: holder.name.clone(),
                need,
            });
        }
        Ok(Some(Caller {
            name: holder.name.clone(),
        }))
    }

    /// What a request to `path` with `method` needs; `None`: open.
    fn need(&self, method: &Method, path: &str) -> Option<AdminRole> {
        if path.starts_with("/api/") || path == "/api" {
            Some(if method == Method::GET || method == Method::HEAD {
                AdminRole::Viewer
            } else {
                AdminRole::Operator
            })
        } else if path == "/metrics" && self.metrics == MetricsAccess::Token && !self.is_open() {
            Some(AdminRole::Viewer)
        } else {
            None
        }
    }
}

/// Whether a request was addressed (`Host`) to an IP address or to
/// `localhost`, as every client of an open API is: a browser's page
/// whose own name was pointed at this address sends that name.
fn addressed_locally(headers: &HeaderMap) -> Result<(), Refusal> {
    // HTTP/1.0 and HTTP/2 requests may carry no Host (the authority is in
    // the URI for HTTP/2, which browsers only speak over TLS).
    let Some(host) = headers.get(header::HOST) else {
        return Ok(());
    };
    let host = host.to_str().unwrap_or_default();
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let local = name.parse::<std::net::IpAddr>().is_ok()
        || name == "localhost"
        || name.ends_with(".localhost");
    if local {
        Ok(())
    } else {
        Err(Refusal::NamedHost(host.chars().take(255).collect()))
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::NoTokenConfigured => ApiError::new(
                StatusCode::FORBIDDEN,
                "changes are disabled: no admin token is configured (set `admin.token`, e.g. token = \"${POSTBOX_ADMIN_TOKEN}\", or [[admin.tokens]] with role = \"operator\")",
            ),
            Refusal::NamedHost(host) => ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "no admin token is configured, and this request was addressed to `{host}`: without a token the API answers only requests addressed to an IP address or localhost (a web page elsewhere could point its own name at this address and read events); use the address, or set `admin.token`"
                ),
            ),
            Refusal::BadToken => ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong admin token: send `Authorization: Bearer <token>` (admin.token or an [[admin.tokens]] entry)",
            ),
            Refusal::NotAllowed { name, need } => ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "the token `{name}` may not do this: it needs the `{}` role",
                    need.as_str()
                ),
            ),
        }
    }
}

/// The middleware in front of every route (see the module docs).
pub(crate) async fn guard(State(access): State<Access>, mut req: Request, next: Next) -> Response {
    let Some(need) = access.need(req.method(), req.uri().path()) else {
        return next.run(req).await;
    };
    match access.check(req.headers(), need) {
        Ok(caller) => {
            if let Some(caller) = caller {
                req.extensions_mut().insert(caller);
            }
            next.run(req).await
        }
        Err(refusal) => {
            tracing::warn!(
                method = %req.method(),
                path = req.uri().path(),
                reason = ?refusal,
                "admin API: call refused"
            );
            ApiError::from(refusal).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, auth.parse().unwrap());
        h
    }

    fn access() -> Access {
        Access::new(
            &[
                ("ops".into(), AdminRole::Operator, Secret::new("op-s3cret")),
                ("eve".into(), AdminRole::Viewer, Secret::new("view-s3cret")),
            ],
            MetricsAccess::Open,
        )
    }

    #[test]
    fn each_token_gets_its_role() {
        let a = access();
        let caller = |name: &str| Ok(Some(Caller { name: name.into() }));
        assert_eq!(
            a.check(&headers("Bearer op-s3cret"), AdminRole::Operator),
            caller("ops")
        );
        assert_eq!(
            a.check(&headers("Bearer op-s3cret"), AdminRole::Viewer),
            caller("ops")
        );
        assert_eq!(
            a.check(&headers("Bearer view-s3cret"), AdminRole::Viewer),
            caller("eve")
        );
        assert_eq!(
            a.check(&headers("Bearer view-s3cret"), AdminRole::Operator),
            Err(Refusal::NotAllowed {
                name: "eve".into(),
                need: AdminRole::Operator
            })
        );
        for bad in ["Bearer op-s3cre", "op-s3cret", "Bearer "] {
            assert_eq!(
                a.check(&headers(bad), AdminRole::Viewer),
                Err(Refusal::BadToken),
                "{bad}"
            );
        }
        assert_eq!(
            a.check(&HeaderMap::new(), AdminRole::Viewer),
            Err(Refusal::BadToken)
        );
    }

    #[test]
    fn without_tokens_reads_are_open_and_changes_refused() {
        for t in [None, Some(Secret::new(""))] {
            let tokens: Vec<_> = t
                .into_iter()
                .map(|t| ("admin".into(), AdminRole::Operator, t))
                .collect();
            let a = Access::new(&tokens, MetricsAccess::Token);
            assert!(a.is_open());
            assert_eq!(a.check(&HeaderMap::new(), AdminRole::Viewer), Ok(None));
            assert_eq!(
                a.check(&headers("Bearer x"), AdminRole::Operator),
                Err(Refusal::NoTokenConfigured)
            );
            assert_eq!(a.need(&Method::GET, "/metrics"), None, "nothing to ask for");
        }
    }

    /// DNS rebinding: a page at `evil.example` points its name at
    /// 127.0.0.1 and reads the open API as a same-origin page. Without a
    /// token, only requests addressed to an IP address or localhost are
    /// answered; with one, the token decides.
    #[test]
    fn without_tokens_reads_are_open_only_to_requests_addressed_locally() {
        let open = Access::new(&[], MetricsAccess::Open);
        let host = |h: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::HOST, h.parse().unwrap());
            m
        };
        for ok in [
            "127.0.0.1:9464",
            "10.0.3.7",
            "[::1]:9464",
            "[fe80::1]",
            "localhost:9464",
            "LOCALHOST",
            "app.localhost:80",
            "localhost.",
        ] {
            assert_eq!(open.check(&host(ok), AdminRole::Viewer), Ok(None), "{ok}");
        }
        assert_eq!(open.check(&HeaderMap::new(), AdminRole::Viewer), Ok(None));
        for bad in [
            "evil.example:9464",
            "evil.example",
            "127.0.0.1.nip.io",
            "localhost.evil.example",
        ] {
            assert_eq!(
                open.check(&host(bad), AdminRole::Viewer),
                Err(Refusal::NamedHost(bad.into())),
                "{bad}"
            );
        }
        let mut named = host("relay-1.internal:9464");
        named.insert(header::AUTHORIZATION, "bearer view-s3cret".parse().unwrap());
        assert_eq!(
            access().check(&named, AdminRole::Viewer),
            Ok(Some(Caller { name: "eve".into() })),
            "a token decides, whatever the host (and the scheme's case)"
        );
    }

    #[test]
    fn what_each_route_needs() {
        let mut a = access();
        assert_eq!(a.need(&Method::GET, "/api/events"), Some(AdminRole::Viewer));
        assert_eq!(
            a.need(&Method::POST, "/api/events/e/replay"),
            Some(AdminRole::Operator)
        );
        assert_eq!(a.need(&Method::GET, "/healthz"), None);
        assert_eq!(a.need(&Method::GET, "/"), None);
        assert_eq!(a.need(&Method::GET, "/metrics"), None);
        a.metrics = MetricsAccess::Token;
        assert_eq!(a.need(&Method::GET, "/metrics"), Some(AdminRole::Viewer));
    }
}
