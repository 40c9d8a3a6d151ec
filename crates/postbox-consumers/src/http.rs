//! The HTTP bridge: a handler that POSTs the SPEC §4 envelope to a service
//! written in any language.
//!
//! The request carries `Idempotency-Key: <event_id>`; a 2xx answer acknowledges
//! the message (a redirect is not followed: it takes the retry path), `422 Unprocessable Entity` dead-letters it at once (the
//! service will never accept it; the answer's first 200 characters become
//! its `x-last-error`), anything else (or no answer within the timeout)
//! takes the retry path. Run it through an [`Inbox`](crate::inbox::Inbox) and an event
//! whose POST was answered 2xx and whose inbox row committed is not posted
//! again, whatever the broker redelivers. The POST is not part of the
//! inbox's transaction: a 2xx followed by a failed commit, or a crash
//! between the two, posts the event again, so the service dedupes on
//! `Idempotency-Key` all the same.

use std::time::Duration;

use async_trait::async_trait;
use postbox_core::redact::SecretUrl;
use postbox_core::trace;
use postbox_core::wire::http;

use crate::inbox::TxHandler;
use crate::{Handled, Handler, HandlerError, Message};

/// POSTs each event to one URL.
#[derive(Debug, Clone)]
pub struct HttpHandler {
    client: reqwest::Client,
    url: SecretUrl,
    /// The URL as errors show it: no password, no query (its tokens).
    shown: String,
}

impl HttpHandler {
    /// A handler for `url`, each request bounded by `timeout`.
    pub fn new(url: SecretUrl, timeout: Duration) -> Result<Self, postbox_core::Error> {
        // reqwest is built without a bundled crypto provider: postbox uses ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        // A redirect is not followed: reqwest would turn the POST into a
        // GET without the event (301, 302, 303), and the 2xx that GET gets
        // (a login page) would acknowledge an event the service never had.
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| {
                postbox_core::Error::config(
                    "handler.http",
                    format!("cannot build an HTTP client: {e}"),
                )
            })?;
        let shown = postbox_core::redact::shown_url(url.expose());
        Ok(HttpHandler { client, url, shown })
    }

    /// Delivers one event; `Ok` on 2xx.
    pub async fn post(&self, message: &Message) -> Result<(), HandlerError> {
        let response = self
            .client
            .post(self.url.expose())
            .header(http::IDEMPOTENCY_KEY, message.event_id())
            .header(http::CONSUME_ATTEMPT, message.attempt.to_string())
            .headers(trace_headers(message))
            .json(&message.envelope)
            .send()
            .await
            .map_err(|e| {
                let what = if e.is_timeout() {
                    "timed out"
                } else {
                    "failed"
                };
                // reqwest errors may quote the URL; never let its password through.
                HandlerError::new(format!(
                    "POST to {} {what}: {}",
                    self.shown,
                    postbox_core::redact::redact_url(&e.without_url().to_string())
                ))
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        if status.is_redirection() {
            let to = response
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .map(postbox_core::redact::shown_url)
                .unwrap_or_default();
            return Err(HandlerError::new(format!(
                "POST to {} answered {status} (to `{to}`): redirects are not followed, so the event was not delivered; set handler.http to the URL that takes the POST",
                self.shown
            )));
        }
        let body = first_bytes(response).await;
        let body: String = String::from_utf8_lossy(&body).chars().take(200).collect();
        let error = format!("POST to {} answered {status}: {body}", self.shown);
        // 422: the service understood the event and will never accept it.
        Err(if status == reqwest::StatusCode::UNPROCESSABLE_ENTITY {
            HandlerError::permanent(error)
        } else {
            HandlerError::new(error)
        })
    }
}

/// The start of an error answer's body, enough for its first 200
/// characters: the rest is not read (a proxy's error page, a service
/// answering a 500 with a dump, read whole at every retry, or waited for
/// until the timeout when it trickles).
async fn first_bytes(mut response: reqwest::Response) -> Vec<u8> {
    const EXCERPT_BYTES: usize = 800;
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

/// `traceparent` and `tracestate` for the handler: the handler span's when
/// the consumer records one (the context current here), else the
/// message's own, passed on as it came.
fn trace_headers(message: &Message) -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    let Some(context) = trace::current().or_else(|| trace::parent_of(&message.envelope.headers))
    else {
        return headers;
    };
    for (name, value) in trace::header_pairs(&context) {
        if let Ok(value) = reqwest::header::HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
    headers
}

#[async_trait]
impl Handler for HttpHandler {
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError> {
        self.post(message).await.map(|()| Handled::Ok)
    }
}

/// Inside an inbox transaction the POST is the effect: the inbox row commits
/// only after a 2xx answer (a commit that fails after it leaves the event
/// to be posted again). On SQLite the database's write lock is held for
/// the POST.
#[async_trait]
impl<DB: sqlx::Database> TxHandler<DB> for HttpHandler {
    async fn handle(
        &self,
        _tx: &mut sqlx::Transaction<'static, DB>,
        message: &Message,
    ) -> Result<(), HandlerError> {
        self.post(message).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An error answer whose body is long and keeps coming: its start is
    /// shown, the rest never read. It was read whole: here, waited for
    /// until the timeout, and the error showed no body at all.
    #[tokio::test]
    async fn an_error_answer_s_body_is_read_only_as_far_as_it_is_shown() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 64 * 1024];
            let _ = conn.read(&mut request).await;
            let head = "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100000000\r\n\r\n";
            conn.write_all(head.as_bytes()).await.unwrap();
            conn.write_all("overloaded ".repeat(200).as_bytes())
                .await
                .unwrap();
            // The rest never comes; the connection stays open.
            std::future::pending::<()>().await;
        });
        let url = SecretUrl::new(format!("http://{addr}/events"));
        let handler = HttpHandler::new(url, Duration::from_secs(3)).unwrap();
        let message: Message = crate::Message {
            envelope: serde_json::from_value(serde_json::json!({
                "event_id": "e-1", "app_code": "a", "event_type": "T", "created_at_ms": 0, "headers": {}, "payload": {},
            }))
            .unwrap(),
            attempt: 1,
            redelivered: false,
        };
        let started = std::time::Instant::now();
        let error = handler.post(&message).await.unwrap_err().to_string();
        assert!(
            error.contains("answered 500 Internal Server Error: overloaded overloaded"),
            "{error}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "waited for the whole body"
        );
    }

    /// Reads one request from `socket`: its first line and its body.
    async fn read_request(socket: &mut tokio::net::TcpStream) -> (String, String) {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = socket.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the request ended early");
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf).into_owned();
            let Some(end) = text.find("\r\n\r\n") else {
                continue;
            };
            let len: usize = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                let first = text.lines().next().unwrap_or_default().to_owned();
                break (
                    first,
                    String::from_utf8(buf[end + 4..end + 4 + len].to_vec()).unwrap(),
                );
            }
        }
    }

    /// Answers one request 200 and returns its body.
    async fn one_request(listener: tokio::net::TcpListener) -> String {
        let (mut socket, _) = listener.accept().await.unwrap();
        let (_, body) = read_request(&mut socket).await;
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        body
    }

    /// A service behind a proxy that sends the POST to a login page: the
    /// redirect is not followed, so no GET's 200 acknowledges the event;
    /// the message takes the retry path, its error naming the redirect.
    #[tokio::test]
    async fn a_redirect_is_not_an_acknowledgement() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/events?key=k3y", listener.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = std::sync::Arc::clone(&seen);
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let (first, _) = read_request(&mut socket).await;
                let redirect = first.starts_with("POST");
                log.lock().unwrap().push(first);
                let answer: &[u8] = if redirect {
                    b"HTTP/1.1 302 Found\r\nlocation: /login?token=t0k\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                };
                socket.write_all(answer).await.unwrap();
            }
        });
        let handler = HttpHandler::new(SecretUrl::new(url), Duration::from_secs(5)).unwrap();
        let props = lapin::BasicProperties::default()
            .with_message_id("ev-1".into())
            .with_type("Credited".into())
            .with_app_id("wallet".into());
        let message =
            crate::rabbitmq::message_from_delivery(&props, "wallet.Credited", b"{}", false)
                .unwrap();
        let error = handler.post(&message).await.unwrap_err();
        assert_eq!(*seen.lock().unwrap(), ["POST /events?key=k3y HTTP/1.1"]);
        assert!(!error.is_permanent(), "{error:?}");
        let text = error.message();
        assert!(
            text.contains("302") && text.contains("not delivered"),
            "{text}"
        );
        assert!(
            !text.contains("k3y") && !text.contains("t0k"),
            "a token in the error: {text}"
        );
    }

    /// The envelope POSTed for a RabbitMQ message carries the body as the
    /// publisher sent it: big integers, trailing zeros and key order intact.
    #[tokio::test]
    async fn the_bridge_posts_the_message_body_verbatim() {
        let payload = r#"{"room_id":1,"n":12345678901234567890123,"amount":19.990,"id":18446744073709551617,"f":1.10}"#;
        let props = lapin::BasicProperties::default()
            .with_message_id("ev-1".into())
            .with_type("Credited".into())
            .with_app_id("wallet".into());
        let message = crate::rabbitmq::message_from_delivery(
            &props,
            "wallet.Credited",
            payload.as_bytes(),
            false,
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/events", listener.local_addr().unwrap());
        let server = tokio::spawn(one_request(listener));
        let handler = HttpHandler::new(SecretUrl::new(url), Duration::from_secs(5)).unwrap();
        handler.post(&message).await.unwrap();
        let body = server.await.unwrap();
        let fields: std::collections::BTreeMap<String, &serde_json::value::RawValue> =
            serde_json::from_str(&body).unwrap();
        assert_eq!(fields["payload"].get(), payload, "body: {body}");
        assert_eq!(fields["event_id"].get(), r#""ev-1""#);
    }
}
