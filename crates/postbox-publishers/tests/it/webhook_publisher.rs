//! The webhook publisher against a small axum receiver in the test: the
//! conformance suite, HMAC signatures checked by the receiver's own code,
//! and retries through the real relay (500 then 200, 410, 429 with
//! `Retry-After`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, Mac};
use postbox_core::config::{HumanDuration, WebhookPublisherConfig};
use postbox_core::publish::Delivery;
use postbox_core::redact::{Secret, SecretUrl};
use postbox_core::store::OutboxStore;
use postbox_core::{NewEvent, Publisher};
use postbox_publishers::webhook::WebhookPublisher;
use postbox_sqlite::SqliteOutbox;
use postbox_testkit::conformance::{fast_worker, run_relay_until_for};
use postbox_testkit::publisher_suite::{
    check_publisher, publish_one, sample_events, ReadBack, Received,
};
use postbox_testkit::scratch_table;
use sha2::Sha256;

const SECRET: &str = "receiver-secret";

/// One request the receiver accepted (signature valid).
#[derive(Clone)]
struct Request {
    path: String,
    idempotency_key: String,
    body: serde_json::Value,
    /// The body as sent.
    text: String,
    at: Instant,
}

#[derive(Default)]
struct Inner {
    accepted: Vec<Request>,
    rejected: usize,
    /// Answers to give, in order; `default` once empty.
    script: VecDeque<(u16, Option<&'static str>)>,
    default: u16,
    /// How long every answer takes.
    delay: Duration,
}

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Inner>>);

/// The receiver's own check: HMAC-SHA256 over `<timestamp>.<body>`.
fn signature_ok(headers: &HeaderMap, body: &[u8]) -> bool {
    let get = |k: &str| headers.get(k).and_then(|v| v.to_str().ok());
    let (Some(ts), Some(sig)) = (get("x-postbox-timestamp"), get("x-postbox-signature")) else {
        return false;
    };
    let Some(hex_sig) = sig.strip_prefix("v1=") else {
        return false;
    };
    let Ok(ts_num) = ts.parse::<u64>() else {
        return false;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    if now.abs_diff(ts_num) > 300 {
        return false;
    }
    let Ok(given) = hex::decode(hex_sig) else {
        return false;
    };
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(ts.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.verify_slice(&given).is_ok()
}

async fn handle(State(r): State<Receiver>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let (response, delay) = answer(&r, uri, headers, body);
    tokio::time::sleep(delay).await;
    response
}

/// The answer to one request and how long to wait before giving it.
fn answer(r: &Receiver, uri: Uri, headers: HeaderMap, body: Bytes) -> (Response, Duration) {
    let mut inner = r.0.lock().unwrap();
    if !signature_ok(&headers, &body) {
        inner.rejected += 1;
        return (
            (StatusCode::UNAUTHORIZED, "bad signature").into_response(),
            Duration::ZERO,
        );
    }
    assert_eq!(headers["content-type"], "application/json");
    inner.accepted.push(Request {
        path: uri.path().to_owned(),
        idempotency_key: String::from_utf8(headers["idempotency-key"].as_bytes().to_vec()).unwrap(),
        body: serde_json::from_slice(&body).unwrap(),
        text: String::from_utf8(body.to_vec()).unwrap(),
        at: Instant::now(),
    });
    let default = inner.default;
    let (status, retry_after) = inner.script.pop_front().unwrap_or((default, None));
    let mut response = (StatusCode::from_u16(status).unwrap(), "receiver says no").into_response();
    if let Some(ra) = retry_after {
        response
            .headers_mut()
            .insert("retry-after", ra.parse().unwrap());
    }
    (response, inner.delay)
}

impl Receiver {
    /// Starts a receiver answering `default` unless scripted otherwise;
    /// returns it and its base URL.
    async fn start(default: u16) -> (Receiver, String) {
        let r = Receiver::default();
        r.0.lock().unwrap().default = default;
        let app = axum::Router::new().fallback(handle).with_state(r.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (r, format!("http://{addr}"))
    }

    fn accepted(&self) -> Vec<Request> {
        self.0.lock().unwrap().accepted.clone()
    }
}

fn config(url: &str, secret: &str) -> WebhookPublisherConfig {
    WebhookPublisherConfig {
        signature: Default::default(),
        name: Some("webhook".to_owned()),
        url: SecretUrl::new(url),
        secret: Some(Secret::new(secret)),
        timeout: HumanDuration::secs(5),
    }
}

#[async_trait]
impl ReadBack for Receiver {
    async fn read(&mut self, _expected: usize, _timeout: Duration) -> Vec<Received> {
        self.accepted()
            .iter()
            .map(|r| Received::from_envelope(&r.text, r.path.clone()))
            .collect()
    }
}

#[tokio::test]
async fn webhook_publisher_passes_the_publisher_suite() {
    let (mut receiver, base) = Receiver::start(200).await;
    let publisher =
        WebhookPublisher::new(&config(&format!("{base}/hooks/in?token=abc"), SECRET)).unwrap();
    let events = sample_events("room", 120);
    check_publisher(&publisher, &events, 50, &mut receiver, |_| {
        "/hooks/in".to_owned()
    })
    .await;
    for r in receiver.accepted() {
        assert_eq!(r.idempotency_key, r.body["event_id"].as_str().unwrap());
    }
}

#[tokio::test]
async fn a_wrong_secret_is_rejected_by_the_receiver() {
    let (receiver, base) = Receiver::start(200).await;
    let publisher = WebhookPublisher::new(&config(
        &format!("http://u:pw@{}/in?token=tok", &base[7..]),
        "wrong",
    ))
    .unwrap();
    let err = publish_one(&publisher)
        .await
        .expect_err("401 is a failed attempt");
    assert!(
        err.contains("401") && err.contains("not retryable"),
        "{err}"
    );
    assert!(
        !err.contains("pw") && !err.contains("tok") && !err.contains("wrong"),
        "{err}"
    );
    assert_eq!(receiver.0.lock().unwrap().rejected, 1);
    assert!(receiver.accepted().is_empty());
}

async fn store_with(app: &str, n: usize) -> Arc<dyn OutboxStore> {
    let path = std::env::temp_dir().join(format!("{}.db", scratch_table("webhook")));
    let store = SqliteOutbox::connect(&format!("sqlite://{}", path.display()), "outbox", 4)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let events: Vec<NewEvent> = (0..n)
        .map(|i| NewEvent::new(app, "Ping", format!(r#"{{"n":{i}}}"#)))
        .collect();
    store.enqueue_batch(&events, 1 << 20).await.unwrap();
    Arc::new(store)
}

fn publisher(base: &str) -> Vec<Arc<dyn Publisher>> {
    vec![Arc::new(
        WebhookPublisher::new(&config(&format!("{base}/in"), SECRET)).unwrap(),
    )]
}

#[tokio::test]
async fn a_500_then_200_is_delivered_through_the_relay() {
    let (receiver, base) = Receiver::start(200).await;
    receiver.0.lock().unwrap().script.push_back((500, None));
    let store = store_with("w500", 1).await;
    run_relay_until_for(store, publisher(&base), fast_worker(), "w500", |s| {
        s.delivered == 1
    })
    .await;
    let got = receiver.accepted();
    assert_eq!(got.len(), 2, "one 500, one 200");
    assert_eq!(got[0].idempotency_key, got[1].idempotency_key);
    assert_eq!(
        got[0].idempotency_key,
        got[0].body["event_id"].as_str().unwrap()
    );
    assert_eq!(got[0].body["headers"]["x-attempt"], 1);
    assert_eq!(got[1].body["headers"]["x-attempt"], 2);
}

#[tokio::test]
async fn a_410_is_retried_until_failed_at_max_retry_count() {
    let (receiver, base) = Receiver::start(410).await;
    let store = store_with("w410", 1).await;
    let worker = fast_worker();
    let max = worker.max_retry_count as usize;
    run_relay_until_for(store.clone(), publisher(&base), worker, "w410", |s| {
        s.failed == 1
    })
    .await;
    let got = receiver.accepted();
    assert!(
        (max..=max + 1).contains(&got.len()),
        "{} attempts for max_retry_count {max}",
        got.len()
    );
    // The relay names the publisher once: `webhook: <url> answered …`.
    let rows = store
        .list(&postbox_core::store::EventFilter {
            app_code: Some("w410".to_owned()),
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let last_error = rows[0].last_error.clone().unwrap_or_default();
    assert!(
        last_error.starts_with(&format!("webhook: {base}")) && last_error.contains("410"),
        "{last_error}"
    );
}

#[tokio::test]
async fn a_429_retry_after_delays_the_retry() {
    let (receiver, base) = Receiver::start(200).await;
    receiver
        .0
        .lock()
        .unwrap()
        .script
        .push_back((429, Some("2")));
    let store = store_with("w429", 1).await;
    // fast_worker backs off at most 200 ms: only Retry-After explains 2 s.
    run_relay_until_for(store, publisher(&base), fast_worker(), "w429", |s| {
        s.delivered == 1
    })
    .await;
    let got = receiver.accepted();
    assert_eq!(got.len(), 2);
    let waited = got[1].at - got[0].at;
    // Due on the database's clock (SQLite's, rounded to the millisecond),
    // measured here on the monotonic clock: a few ms of slack between the
    // two, far from the 200 ms the backoff alone would give.
    assert!(
        waited >= Duration::from_millis(1_990),
        "retried after {waited:?}"
    );
}

/// Issue 10.2: `publish_timeout` bounds each publish, not the batch. A
/// receiver that answers 200 after 0.5 s, 100 events, the default batch
/// size, publish_timeout and lease: 16 requests at a time need 3.5 s for the
/// batch, more than publish_timeout (3 s). Before, the timeout discarded the
/// whole batch, confirmed events included, and every event was POSTed again
/// and counted as a failed attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_gets_every_event_once_without_retries() {
    let (receiver, base) = Receiver::start(200).await;
    receiver.0.lock().unwrap().delay = Duration::from_millis(500);
    let store = store_with("wslow", 100).await;
    let worker = postbox_core::config::WorkerConfig {
        poll_interval: HumanDuration::millis(50),
        ..Default::default()
    };
    assert_eq!(worker.batch_size, 100);
    let report = run_relay_until_for(store.clone(), publisher(&base), worker, "wslow", |s| {
        s.delivered == 100
    })
    .await;
    let got = receiver.accepted();
    let distinct: std::collections::HashSet<&str> =
        got.iter().map(|r| r.idempotency_key.as_str()).collect();
    assert_eq!(distinct.len(), 100, "every event POSTed");
    assert_eq!(got.len(), 100, "and each exactly once");
    assert_eq!(
        report.retried, 0,
        "no attempt counted as failed: {report:?}"
    );
    assert_eq!(report.failed, 0, "{report:?}");
    let rows = store
        .list(&postbox_core::store::EventFilter {
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        rows.iter().all(|r| r.retry_count == 0),
        "no row has a failed attempt"
    );
}

/// Where `scripts/test` installs the Standard Webhooks Python package
/// (`python3 -m pip install --target … standardwebhooks==1.1.0`).
fn standardwebhooks_dir() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python");
    assert!(
        dir.join("standardwebhooks").exists(),
        "the Python package standardwebhooks is not installed: run `python3 -m pip install --target {} standardwebhooks==1.1.0` (scripts/test does this)",
        dir.display()
    );
    dir
}

/// Issue 15.5: with `signature = "standard"`, every request verifies with
/// the Standard Webhooks Python package from PyPI, unmodified, given the
/// `whsec_` secret; a changed body, id or secret does not.
#[tokio::test]
async fn a_standard_webhooks_receiver_verifies_every_request() {
    let site = standardwebhooks_dir();
    type Seen = Arc<Mutex<Vec<(serde_json::Map<String, serde_json::Value>, String)>>>;
    let seen: Seen = Arc::default();
    let app = axum::Router::new()
        .fallback(
            async |State(seen): State<Seen>, headers: HeaderMap, body: Bytes| {
                let headers = headers
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap().into()))
                    .collect();
                let body = String::from_utf8(body.to_vec()).unwrap();
                seen.lock().unwrap().push((headers, body));
                StatusCode::NO_CONTENT
            },
        )
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let publisher = WebhookPublisher::new(&WebhookPublisherConfig {
        signature: postbox_core::config::WebhookSignature::Standard,
        ..config(&format!("{base}/hooks"), secret)
    })
    .unwrap();
    let events = sample_events("room", 3);
    for e in &events {
        let delivery = postbox_core::publish::Delivery::of(e);
        publisher.publish(&[delivery]).await.remove(0).unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    for (headers, _) in &seen {
        assert!(
            events
                .iter()
                .any(|e| headers["webhook-id"] == e.event_id.as_str()),
            "webhook-id is the event id: {headers:?}"
        );
        assert!(!headers.contains_key("x-postbox-signature"), "{headers:?}");
    }
    let check = r#"
import json, sys
from standardwebhooks import Webhook, WebhookVerificationError
requests, secret = json.load(open(sys.argv[1])), sys.argv[2]
def verifies(secret, body, headers):
    try:
        Webhook(secret).verify(body, headers)
        return True
    except WebhookVerificationError:
        return False
for headers, body in requests:
    assert verifies(secret, body, headers), "a request postbox sent does not verify"
    assert not verifies(secret, body.replace("room", "r00m"), headers), "a changed body verifies"
    assert not verifies(secret, body, dict(headers, **{"webhook-id": "other"})), "another id verifies"
    assert not verifies("whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB", body, headers), "another secret verifies"
print("verified", len(requests))
"#;
    let dir = tempfile::tempdir().unwrap();
    let requests = dir.path().join("requests.json");
    std::fs::write(&requests, serde_json::to_string(&seen).unwrap()).unwrap();
    let out = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(check)
        .arg(&requests)
        .arg(secret)
        .env("PYTHONPATH", &site)
        .output()
        .await
        .expect("python3 on PATH");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("verified 3"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An error answer whose body is huge (here 100 MB announced, its first
/// bytes sent, the rest never): the attempt fails at once with the start
/// of the body, which is all that is read. The whole body was read into
/// memory before (16 requests at a time), and the attempt waited for it to
/// the end, here until the timeout.
#[tokio::test]
async fn only_the_start_of_an_error_body_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = vec![0u8; 64 * 1024];
                let _ = socket.read(&mut request).await;
                let head =
                    "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100000000\r\n\r\n";
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(&[b'x'; 4096]).await;
                let _ = socket.write_all(b"boom").await;
                tokio::time::sleep(Duration::from_secs(30)).await;
            });
        }
    });
    let publisher = WebhookPublisher::new(&config(&format!("{base}/in"), "s")).unwrap();
    let events = sample_events("room", 1);
    let started = Instant::now();
    let results = publisher
        .publish(&[postbox_core::publish::Delivery::of(&events[0])])
        .await;
    let err = results[0].as_ref().expect_err("a 500").to_string();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}: {err}",
        started.elapsed()
    );
    assert!(err.contains("500") && err.contains("xxxx"), "{err}");
}

/// An event id that is not ASCII (a producer's own `订单-1`) is sent as
/// it is, its UTF-8 bytes the Idempotency-Key header's value (HTTP takes
/// bytes past ASCII in a value).
#[tokio::test]
async fn an_event_id_that_is_not_ascii_is_delivered() {
    let (receiver, base) = Receiver::start(200).await;
    let publisher = WebhookPublisher::new(&config(&format!("{base}/in"), SECRET)).unwrap();
    let mut event = sample_events("room", 1).remove(0);
    event.event_id = "订单-1".to_owned();
    let results = publisher.publish(&[Delivery::of(&event)]).await;
    assert!(results[0].is_ok(), "{results:?}");
    let got = receiver.accepted();
    assert_eq!(got[0].idempotency_key, "订单-1");
    assert_eq!(got[0].body["event_id"], "订单-1");
}

/// A batch larger than the webhook sends in the time it has (16 requests
/// at a time, each answered in 0.9 s, a 2 s publish deadline): the events
/// it never started were not sent, and count no attempt; each reaches the
/// receiver first as attempt 1. They were counted as timed out, so a slow
/// endpoint walked events it never saw towards `failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_the_webhook_never_started_count_no_attempt() {
    let (receiver, base) = Receiver::start(200).await;
    receiver.0.lock().unwrap().delay = Duration::from_millis(900);
    let store = store_with("wslow", 64).await;
    let worker = postbox_core::config::WorkerConfig {
        batch_size: 64,
        lease: HumanDuration::millis(2500),
        publish_timeout: HumanDuration::secs(1),
        max_retry_count: 5,
        ..fast_worker()
    };
    run_relay_until_for(store, publisher(&base), worker, "wslow", |s| {
        s.delivered == 64
    })
    .await;
    let mut first_attempt: std::collections::HashMap<String, i64> = Default::default();
    for r in receiver.accepted() {
        let attempt = r.body["headers"]["x-attempt"].as_i64().unwrap();
        let id = r.body["event_id"].as_str().unwrap().to_owned();
        let seen = first_attempt.entry(id).or_insert(attempt);
        *seen = (*seen).min(attempt);
    }
    assert_eq!(first_attempt.len(), 64);
    let late: Vec<_> = first_attempt.iter().filter(|(_, a)| **a > 1).collect();
    assert!(
        late.is_empty(),
        "events first sent as a later attempt: {late:?}"
    );
}
