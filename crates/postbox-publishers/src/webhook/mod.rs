//! `kind = "webhook"`: HTTP `POST` of the SPEC §4 JSON envelope (its
//! `headers` carry `x-attempt`, and `x-replayed: true` on a replay).
//!
//! Every request has `Content-Type: application/json` and
//! `Idempotency-Key: <event_id>`. With a `secret`, it is signed:
//! `X-Postbox-Timestamp: <unix seconds>` and
//! `X-Postbox-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`
//! (see `docs/webhook-signature.md` for verifying it); or, with `signature
//! = "standard"`, as Standard Webhooks sign: `webhook-id: <event_id>`,
//! `webhook-timestamp`, `webhook-signature: v1,<base64 HMAC-SHA256(key,
//! "<id>.<timestamp>.<body>")>`, the key being the bytes of the
//! `whsec_<base64>` secret.
//!
//! A 2xx answer is success. Anything else is a failed attempt: 408, 429 and
//! 5xx are the retryable kind, and a `Retry-After` on 429 or 503 (seconds or
//! an HTTP date, at most an hour) becomes the minimum delay before the retry;
//! other statuses (4xx, and 3xx since redirects are not followed) are not
//! retryable by nature, but like every failed attempt they count toward
//! `max_retry_count`. A batch's events are sent concurrently, at most
//! [`IN_FLIGHT`] at a time, over one pooled client.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures::future::join_all;
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{StatusCode, Url};
use sha2::Sha256;
use tokio::sync::Semaphore;

use postbox_core::config::{WebhookPublisherConfig, WebhookSignature, STANDARD_SECRET_PREFIX};
use postbox_core::envelope::Envelope;
use postbox_core::publish::{Delivery, PublishError, PublishResults};
use postbox_core::redact::Secret;
use postbox_core::wire::{self, http};
use postbox_core::{trace, Error, Publisher, Result};

/// Requests of one batch in flight at once.
pub const IN_FLIGHT: usize = 16;

/// A `Retry-After` longer than this is cut to it, so a mistaken header
/// cannot park an event for days.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// How much of an error response's body goes into the error message.
const BODY_EXCERPT: usize = 200;

/// Posts each event to an HTTP endpoint.
pub struct WebhookPublisher {
    name: String,
    url: Url,
    /// The URL without userinfo or query, for messages.
    shown_url: String,
    signer: Option<Signer>,
    timeout: Duration,
    client: reqwest::Client,
}

/// How requests are signed.
enum Signer {
    /// `X-Postbox-Signature` with the secret as the key.
    Postbox(Secret),
    /// Standard Webhooks, with the decoded key of a `whsec_` secret.
    Standard(Vec<u8>),
}

impl Signer {
    fn of(config: &WebhookPublisherConfig) -> Result<Option<Self>> {
        let Some(secret) = &config.secret else {
            return Ok(None);
        };
        Ok(Some(match config.signature {
            WebhookSignature::Postbox => Signer::Postbox(secret.clone()),
            WebhookSignature::Standard => Signer::Standard(standard_key(secret)?),
        }))
    }
}

/// The key of a Standard Webhooks secret: the base64 after `whsec_`.
pub fn standard_key(secret: &Secret) -> Result<Vec<u8>> {
    use base64::Engine as _;
    let encoded = secret
        .expose()
        .strip_prefix(STANDARD_SECRET_PREFIX)
        .ok_or_else(|| {
            Error::config(
                "secret",
                "must start with `whsec_` (signature = \"standard\")",
            )
        })?;
    // Padding or none, as the secret was written.
    let key = base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(encoded.trim_end_matches('='))
        .map_err(|_| Error::config("secret", "is not `whsec_` followed by base64"))?;
    if key.is_empty() {
        return Err(Error::config("secret", "holds an empty key after `whsec_`"));
    }
    Ok(key)
}

/// `v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>`, the
/// Standard Webhooks signature.
pub fn standard_signature(key: &[u8], id: &str, timestamp: u64, body: &str) -> String {
    use base64::Engine as _;
    let mac = hmac_of(key, &[id, &timestamp.to_string(), body]);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac)
    )
}

/// HMAC-SHA256 keyed with `key` of `parts` joined by `.`, as both
/// signatures take it.
fn hmac_of(key: &[u8], parts: &[&str]) -> [u8; 32] {
    // HMAC takes keys of any length, so this cannot fail.
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts any key length");
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            mac.update(b".");
        }
        mac.update(part.as_bytes());
    }
    mac.finalize().into_bytes().into()
}

impl WebhookPublisher {
    /// Builds the client (TLS on rustls with the ring provider and the
    /// webpki roots). Nothing is sent until the first publish.
    pub fn new(config: &WebhookPublisherConfig) -> Result<Self> {
        let name = config.name.clone().unwrap_or_else(|| "webhook".to_owned());
        let key = "url".to_owned();
        let url = Url::parse(config.url.expose())
            .map_err(|e| Error::config(&key, format!("not a valid URL: {e}")))?;
        if url.host_str().is_none() {
            return Err(Error::config(&key, "has no host"));
        }
        let shown_url = shown_url(&url);
        let timeout = config.timeout.get();
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls_config()?)
            .timeout(timeout)
            .pool_max_idle_per_host(IN_FLIGHT)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("postbox/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Io {
                context: format!("building the HTTP client of publisher `{name}`"),
                source: std::io::Error::other(e.without_url().to_string()),
            })?;
        Ok(WebhookPublisher {
            name,
            url,
            shown_url,
            signer: Signer::of(config)?,
            timeout,
            client,
        })
    }

    /// One request, bounded by `timeout`.
    async fn send(
        &self,
        d: &Delivery<'_>,
        timeout: Duration,
    ) -> std::result::Result<(), PublishError> {
        let envelope = Envelope::of_delivery(d);
        // The relay's span when it records one, else the producer's.
        let trace = trace::parent_of(&envelope.headers);
        let body = envelope_body(&envelope);
        let mut request = self
            .client
            .post(self.url.clone())
            .timeout(timeout)
            .header(CONTENT_TYPE, wire::CONTENT_TYPE)
            .header(http::IDEMPOTENCY_KEY, idempotency_key(&d.record.event_id)?);
        for (name, value) in trace.map(|c| trace::header_pairs(&c)).unwrap_or_default() {
            request = request.header(name, value);
        }
        let timestamp = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs()
        };
        match &self.signer {
            None => {}
            Some(Signer::Postbox(secret)) => {
                let timestamp = timestamp();
                request = request
                    .header(http::TIMESTAMP, timestamp.to_string())
                    .header(http::SIGNATURE, signature(secret, timestamp, &body));
            }
            Some(Signer::Standard(key)) => {
                let timestamp = timestamp();
                let id = &d.record.event_id;
                request = request
                    .header(http::STANDARD_ID, idempotency_key(id)?)
                    .header(http::STANDARD_TIMESTAMP, timestamp.to_string())
                    .header(
                        http::STANDARD_SIGNATURE,
                        standard_signature(key, id, timestamp, &body),
                    );
            }
        }
        let response = match request.body(body).send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return Err(PublishError::Timeout(timeout)),
            Err(e) => {
                let unreachable = e.is_connect() && refused(&e);
                let message = format!(
                    "POST {} failed: {}",
                    self.shown_url,
                    error_chain(&e.without_url())
                );
                // The endpoint refused the connection (down, restarting):
                // the request never reached it. A name that does not
                // resolve or a certificate refused is the config's fault,
                // and counts.
                return Err(if unreachable {
                    PublishError::Unreachable(message)
                } else {
                    PublishError::failed(message)
                });
            }
        };
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let retry_after = if matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response
                .headers()
                .get(RETRY_AFTER)
                .and_then(|v| parse_retry_after(v, SystemTime::now()))
        } else {
            None
        };
        let excerpt = excerpt(&String::from_utf8_lossy(&first_bytes(response).await));
        let kind = if retryable_status(status) {
            "retryable"
        } else {
            "not retryable by nature, still counted toward max_retry_count"
        };
        Err(PublishError::Failed {
            message: format!("{} answered {status} ({kind}): {excerpt}", self.shown_url),
            retry_after,
        })
    }
}

#[async_trait]
impl Publisher for WebhookPublisher {
    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<std::result::Result<(), PublishError>> {
        let in_flight = Semaphore::new(IN_FLIGHT);
        let sends = batch.iter().map(|d| {
            let in_flight = &in_flight;
            async move {
                let _permit = in_flight.acquire().await;
                self.send(d, self.timeout).await
            }
        });
        join_all(sends).await
    }

    /// Each request is timed on its own, from when it is sent (after
    /// waiting for one of the [`IN_FLIGHT`] slots), by the shorter of the
    /// publisher's `timeout` and the relay's `publish_timeout`, and its
    /// result is recorded as soon as it is in: a batch larger than what
    /// fits in one `publish_timeout` keeps every answer it got.
    async fn publish_each(
        &self,
        batch: &[Delivery<'_>],
        publish_timeout: Duration,
        results: &PublishResults,
    ) {
        let timeout = self.timeout.min(publish_timeout);
        let in_flight = Semaphore::new(IN_FLIGHT);
        let sends = batch.iter().enumerate().map(|(i, d)| {
            let in_flight = &in_flight;
            async move {
                let _permit = in_flight.acquire().await;
                // One not started when the batch's time runs out was not
                // sent: no attempt is counted for it.
                results.start(i);
                results.set(i, self.send(d, timeout).await);
            }
        });
        join_all(sends).await;
    }
}

/// The request body: the envelope with `x-attempt` / `x-replayed`.
fn envelope_body(envelope: &Envelope) -> String {
    let mut line = crate::file::line_of(envelope);
    line.pop();
    line
}

fn idempotency_key(event_id: &str) -> std::result::Result<HeaderValue, PublishError> {
    HeaderValue::from_str(event_id).map_err(|_| {
        PublishError::failed(format!(
            "event_id `{}` cannot be an HTTP header value (Idempotency-Key)",
            event_id.escape_debug()
        ))
    })
}

/// `v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
pub fn signature(secret: &Secret, timestamp: u64, body: &str) -> String {
    let mac = hmac_of(secret.expose().as_bytes(), &[&timestamp.to_string(), body]);
    format!("v1={}", hex::encode(mac))
}

/// 408, 429 and 5xx: the receiver may well accept the same request later.
pub fn retryable_status(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// `Retry-After` as delta-seconds or an HTTP date, capped at an hour.
fn parse_retry_after(value: &HeaderValue, now: SystemTime) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    let delay = match text.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => httpdate::parse_http_date(text)
            .ok()?
            .duration_since(now)
            .unwrap_or_default(),
    };
    Some(delay.min(MAX_RETRY_AFTER))
}

/// Whether `e` is a connection the endpoint's host refused or reset.
fn refused(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
            );
        }
        source = err.source();
    }
    false
}

/// `scheme://host[:port]/path`: no userinfo, no query, no fragment, and
/// no path segment long enough to be a token
/// ([`postbox_core::redact::hide_path_tokens`]).
fn shown_url(url: &Url) -> String {
    let mut shown = format!("{}://{}", url.scheme(), url.host_str().unwrap_or_default());
    if let Some(port) = url.port() {
        shown.push_str(&format!(":{port}"));
    }
    shown.push_str(&postbox_core::redact::hide_path_tokens(url.path()));
    shown
}

/// The first [`EXCERPT_BYTES`] of an answer's body, what the error shows
/// of it: the rest is never read (an endpoint or a proxy answering 500
/// with a body of hundreds of MB had it held whole in memory, 16 at a
/// time, and waited for to its end).
async fn first_bytes(mut response: reqwest::Response) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < EXCERPT_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    body.truncate(EXCERPT_BYTES);
    body
}

/// How much of an error answer's body is read.
const EXCERPT_BYTES: usize = 1024;

fn excerpt(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(BODY_EXCERPT)
        .collect();
    if text.chars().count() > BODY_EXCERPT {
        format!("{}…", flat.trim_end())
    } else {
        flat.trim().to_owned()
    }
}

fn error_chain(e: &reqwest::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn tls_config() -> Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Io {
            context: "configuring TLS for webhooks".to_owned(),
            source: std::io::Error::other(e),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_accepts_seconds_and_dates() {
        let now = SystemTime::now();
        let v = HeaderValue::from_static("2");
        assert_eq!(parse_retry_after(&v, now), Some(Duration::from_secs(2)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        let d = parse_retry_after(&HeaderValue::from_str(&later).unwrap(), now).unwrap();
        assert!(
            d > Duration::from_secs(28) && d <= Duration::from_secs(30),
            "{d:?}"
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        let v = HeaderValue::from_str(&past).unwrap();
        assert_eq!(parse_retry_after(&v, now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after(&HeaderValue::from_static("soon"), now),
            None
        );
        let v = HeaderValue::from_static("999999");
        assert_eq!(parse_retry_after(&v, now), Some(MAX_RETRY_AFTER));
    }

    #[test]
    fn shown_url_hides_userinfo_and_query() {
        let url = Url::parse("https://user:pw@hooks.example:8443/in/x?token=abc").unwrap();
        assert_eq!(shown_url(&url), "https://hooks.example:8443/in/x");
        // A token in the path (Slack's incoming webhooks) is hidden too.
        let slack =
            Url::parse("https://hooks.slack.com/services/T0001/B0002/XXXXXXXXXXXXXXXXXXXXXXXX")
                .unwrap();
        assert_eq!(
            shown_url(&slack),
            "https://hooks.slack.com/services/T0001/B0002/***"
        );
    }

    #[test]
    fn the_standard_signature_is_the_specifications() {
        // The example of the Standard Webhooks specification, as its
        // Python package `standardwebhooks` 1.1.0 signs it too.
        let key = standard_key(&Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")).unwrap();
        assert_eq!(
            standard_signature(
                &key,
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                r#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        for bad in [
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "whsec_not base64!",
            "whsec_",
        ] {
            let e = standard_key(&Secret::new(bad)).unwrap_err();
            assert!(e.to_string().contains("secret"), "{bad}: {e}");
            assert!(
                !e.to_string().contains("MfKQ"),
                "the secret is never shown: {e}"
            );
        }
    }

    #[test]
    fn signature_is_hmac_of_timestamp_dot_body() {
        // Reference value computed with Python's hmac module:
        // hmac.new(b"key", b"1700000000.{}", hashlib.sha256).hexdigest()
        let s = signature(&Secret::new("key"), 1_700_000_000, "{}");
        assert_eq!(
            s,
            "v1=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
        assert_ne!(s, signature(&Secret::new("other"), 1_700_000_000, "{}"));
    }

    #[test]
    fn retryable_statuses() {
        for s in [408, 429, 500, 502, 503] {
            assert!(retryable_status(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [400, 401, 404, 410, 422] {
            assert!(!retryable_status(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }
}
