//! HTTP: the webhook publisher's request headers and the consumer bridge's
//! (`postbox consume` POSTs the envelope to a handler).

/// The event id, so the receiver can drop a repeated request.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
/// A signed webhook's timestamp (unix seconds).
pub const TIMESTAMP: &str = "X-Postbox-Timestamp";
/// A signed webhook's signature: `v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
pub const SIGNATURE: &str = "X-Postbox-Signature";
/// The consumer bridge's attempt at the event (the consumer's attempt
/// counter, 1 on the first delivery).
pub const CONSUME_ATTEMPT: &str = "X-Postbox-Attempt";

/// Standard Webhooks (`signature = "standard"`): the message id, the event
/// id.
pub const STANDARD_ID: &str = "webhook-id";
/// Standard Webhooks: unix seconds of the signature.
pub const STANDARD_TIMESTAMP: &str = "webhook-timestamp";
/// Standard Webhooks: `v1,<base64 HMAC-SHA256 of "id.timestamp.body">`.
pub const STANDARD_SIGNATURE: &str = "webhook-signature";
