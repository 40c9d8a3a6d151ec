//! The HTTP bridge: a handler that POSTs the SPEC §4 envelope to a service
//! written in any language.
//!
//! The request carries `Idempotency-Key: <event_id>`; a 2xx answer acknowledges
//! the message, anything else (or no answer within the timeout) takes the
//! retry path. Run it through an [`Inbox`](crate::inbox::Inbox) and an event
//! whose POST was answered 2xx is not posted again, whatever the broker
//! redelivers.

use std::time::Duration;

use async_trait::async_trait;
use postbox_core::redact::SecretUrl;

use crate::inbox::TxHandler;
use crate::{Handled, Handler, HandlerError, Message};

/// POSTs each event to one URL.
#[derive(Debug, Clone)]
pub struct HttpHandler {
    client: reqwest::Client,
    url: SecretUrl,
}

impl HttpHandler {
    /// A handler for `url`, each request bounded by `timeout`.
    pub fn new(url: SecretUrl, timeout: Duration) -> Result<Self, postbox_core::Error> {
        // reqwest is built without a bundled crypto provider: postbox uses ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| {
                postbox_core::Error::config(
                    "handler.http",
                    format!("cannot build an HTTP client: {e}"),
                )
            })?;
        Ok(HttpHandler { client, url })
    }

    /// Delivers one event; `Ok` on 2xx.
    pub async fn post(&self, message: &Message) -> Result<(), HandlerError> {
        let response = self
            .client
            .post(self.url.expose())
            .header("Idempotency-Key", message.event_id())
            .header("X-Postbox-Attempt", message.attempt.to_string())
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
                    self.url,
                    postbox_core::redact::redact_url(&e.without_url().to_string())
                ))
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response.text().await.unwrap_or_default();
        let body: String = body.chars().take(200).collect();
        Err(HandlerError::new(format!(
            "POST to {} answered {status}: {body}",
            self.url
        )))
    }
}

#[async_trait]
impl Handler for HttpHandler {
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError> {
        self.post(message).await.map(|()| Handled::Ok)
    }
}

/// Inside an inbox transaction the POST is the effect: the inbox row commits
/// only after a 2xx answer.
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
