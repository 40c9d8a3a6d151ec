//! The publisher conformance suite on RabbitMQ, read back by a lapin
//! consumer, and the RabbitMQ publisher's start-up checks.

use crate::rabbitmq_support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use postbox_core::event::EventRecord;
use postbox_core::publish::{Delivery, PublishError, PublishResults};
use postbox_core::redact::SecretUrl;
use postbox_core::{Error, Publisher};
use postbox_publishers::rabbitmq::RabbitMqPublisher;
use postbox_testkit::publisher_suite::{
    check_publisher, publish_one, sample_events, ReadBack, Received,
};
use rabbitmq_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct QueueReader(Inbox);

#[async_trait]
impl ReadBack for QueueReader {
    async fn read(&mut self, expected: usize, timeout: Duration) -> Vec<Received> {
        let got = self.0.wait_for(expected, timeout).await;
        // Anything extra would arrive right behind.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = got;
        self.0.snapshot()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_publisher_passes_the_publisher_suite() {
    let _broker = broker_shared().await;
    let exchange = scratch("suite");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    // declare = true: the publisher creates the durable exchange itself.
    let config = config(&exchange, "{app_code}.{event_type}", true);
    let publisher = RabbitMqPublisher::connect(&config).await.expect("start");
    let inbox = consume(&setup, &exchange, "#").await;
    let events = sample_events("room", 150);
    let mut reader = QueueReader(inbox);
    check_publisher(&publisher, &events, 40, &mut reader, |e| {
        format!("{}.{}", e.app_code, e.event_type)
    })
    .await;
    publisher.close().await;
    delete_exchange(&channel, &exchange).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_events_fail_and_the_rest_of_the_batch_is_delivered() {
    let _broker = broker_shared().await;
    let target = scratch_exchange("unroutable", "RoomCreated").await;
    let (exchange, inbox) = (&target.name, &target.inbox);
    let publisher = publisher_to(exchange).await;
    let events = sample_events("room", 30); // RoomCreated, UserJoined, GiftSent, …
    let batch: Vec<Delivery<'_>> = events.iter().map(Delivery::of).collect();
    let results = publisher.publish(&batch).await;
    assert_eq!(results.len(), 30);
    for (e, r) in events.iter().zip(&results) {
        if e.event_type == "RoomCreated" {
            assert!(r.is_ok(), "{}: {r:?}", e.event_id);
        } else {
            let err = r.as_ref().unwrap_err().to_string();
            assert!(
                err.starts_with(&format!(
                    "unroutable: exchange {exchange}, routing key {}",
                    e.event_type
                )),
                "{err}"
            );
        }
    }
    let got = inbox.wait_for(10, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 10);
    assert!(got.iter().all(|r| r.event_type == "RoomCreated"));
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_publish_leaves_the_publisher_usable() {
    let _broker = broker_shared().await;
    let target = scratch_exchange("cancel", "#").await;
    let publisher = publisher_to(&target.name).await;
    let inbox = &target.inbox;
    let events = sample_events("room", 400);
    for chunk in events[..200].chunks(50) {
        let batch: Vec<Delivery<'_>> = chunk.iter().map(Delivery::of).collect();
        // Dropped part-way, as the relay's publish_timeout would.
        let _ = tokio::time::timeout(Duration::from_micros(200), publisher.publish(&batch)).await;
    }
    for chunk in events[200..].chunks(50) {
        let batch: Vec<Delivery<'_>> = chunk.iter().map(Delivery::of).collect();
        let results = publisher.publish(&batch).await;
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    }
    // Abandoned messages may arrive too: wait for the confirmed ones.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut got = inbox.snapshot();
    while tokio::time::Instant::now() < deadline
        && !events[200..]
            .iter()
            .all(|e| got.iter().any(|r| r.event_id == e.event_id))
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        got = inbox.snapshot();
    }
    for e in &events[200..] {
        assert!(
            got.iter().any(|r| r.event_id == e.event_id),
            "{} never arrived",
            e.event_id
        );
    }
    publisher.close().await;
}

#[tokio::test]
async fn a_missing_exchange_without_declare_is_a_config_error_naming_the_fix() {
    let _broker = broker_shared().await;
    let exchange = scratch("missing");
    let mut config = config(&exchange, "{event_type}", false);
    config.name = Some("orders".into());
    let err = RabbitMqPublisher::connect(&config)
        .await
        .err()
        .expect("start must fail");
    let text = err.to_string();
    assert!(matches!(err, Error::Config { .. }), "{text}");
    assert!(text.contains("publisher `orders`"), "{text}");
    assert!(text.contains(&format!("exchange `{exchange}`")), "{text}");
    assert!(text.contains("declare = true"), "{text}");
    assert!(!text.contains(":guest@"), "password leaked: {text}");
}

#[tokio::test]
async fn start_errors_never_show_the_password() {
    let _broker = broker_shared().await;
    let exchange = scratch("secret");
    let wrong_password = "hunter2-Very-Secret";
    for url in [
        // The broker refuses the login.
        format!("amqp://guest:{wrong_password}@127.0.0.1:5672/%2f"),
        // Nothing listens there.
        format!("amqp://guest:{wrong_password}@127.0.0.1:1/%2f"),
    ] {
        let mut config = config(&exchange, "{event_type}", true);
        config.url = SecretUrl::new(url);
        let err = RabbitMqPublisher::connect(&config)
            .await
            .err()
            .expect("start must fail");
        let text = format!("{err} / {err:?}");
        assert!(!text.contains(wrong_password), "password leaked: {text}");
        assert!(text.contains("127.0.0.1"), "says where: {text}");
    }
}

/// `declare = true` declares a missing exchange (durable topic) without
/// probing for it first, and still starts on an existing exchange of another
/// kind, as before.
#[tokio::test]
async fn declare_creates_a_missing_exchange_and_accepts_an_existing_one_of_another_kind() {
    let _broker = broker_shared().await;
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    let missing = scratch("declared");
    let publisher = RabbitMqPublisher::connect(&config(&missing, "{event_type}", true))
        .await
        .expect("declares the missing exchange");
    publisher.close().await;
    let check = connection.create_channel().await.unwrap();
    check
        .exchange_declare(
            missing.as_str().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .expect("the exchange exists now");
    delete_exchange(&channel, &missing).await;

    // An auto-delete topic exchange: not what postbox declares.
    let existing = scratch("existing");
    declare_exchange(&channel, &existing).await;
    let inbox = consume(&connection, &existing, "#").await;
    let publisher = RabbitMqPublisher::connect(&config(&existing, "{event_type}", true))
        .await
        .expect("an existing exchange of another kind is used as it is");
    let result = publish_one(&publisher).await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(inbox.wait_for(1, Duration::from_secs(5)).await.len(), 1);
    publisher.close().await;
    delete_exchange(&channel, &existing).await;
}

/// A TCP proxy to the broker that forwards everything, except that it
/// holds back the publisher confirms (`basic.ack`) of delivery tags above
/// `confirm_up_to`: a single ack above is dropped, a `multiple` ack above is
/// cut down to `confirm_up_to`. So the broker confirms the first messages of
/// a channel and the rest never, deterministically.
struct ConfirmProxy {
    url: String,
    confirm_up_to: Arc<AtomicU64>,
}

impl ConfirmProxy {
    async fn start(confirm_up_to: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (url, upstream) = postbox_testkit::amqp::through_proxy(listener.local_addr().unwrap());
        let limit = Arc::new(AtomicU64::new(confirm_up_to));
        let confirm_up_to = limit.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(&upstream).await.unwrap();
                let (mut client_read, client_write) = client.into_split();
                let (server_read, mut server_write) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                tokio::spawn(forward_frames(server_read, client_write, limit.clone()));
            }
        });
        ConfirmProxy { url, confirm_up_to }
    }
}

async fn forward_frames(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    limit: Arc<AtomicU64>,
) -> std::io::Result<()> {
    loop {
        let (header, mut rest) = read_frame(&mut from).await?;
        // A method frame of basic.ack: class 60, method 80, delivery tag
        // (u64), bits (multiple).
        if header[0] == 1 && rest.len() > 13 && rest[..4] == [0, 60, 0, 80] {
            let tag = u64::from_be_bytes(rest[4..12].try_into().unwrap());
            let multiple = rest[12] & 1 == 1;
            let up_to = limit.load(Ordering::SeqCst);
            if tag > up_to {
                if !multiple || up_to == 0 {
                    continue;
                }
                rest[4..12].copy_from_slice(&up_to.to_be_bytes());
            }
        }
        to.write_all(&header).await?;
        to.write_all(&rest).await?;
    }
}

/// Issue 10.2: `publish_timeout` bounds each publish, and what completed
/// counts. The broker confirms the first three messages of the batch and
/// never the fourth: the confirmed ones keep their results (delivered, or
/// failed as unroutable, matched by message_id as ever), only the fourth
/// times out. The abandoned channel is retired and the next batch is
/// confirmed on a fresh one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_each_keeps_the_confirms_that_came_before_the_deadline() {
    let _broker = broker_shared().await;
    let target = scratch_exchange("each", "RoomCreated").await;
    let (exchange, inbox) = (&target.name, &target.inbox);
    let proxy = ConfirmProxy::start(3).await;
    let mut config = config(exchange, "{event_type}", false);
    config.url = SecretUrl::new(proxy.url.clone());
    let publisher = RabbitMqPublisher::connect(&config).await.unwrap();

    // RoomCreated (routed), UserJoined, GiftSent (unroutable), RoomCreated.
    let events = sample_events("room", 4);
    let batch: Vec<Delivery<'_>> = events.iter().map(Delivery::of).collect();
    let timeout = Duration::from_millis(1500);
    let results = PublishResults::new(batch.len());
    publisher.publish_each(&batch, timeout, &results).await;
    let results = results.into_results(timeout);
    assert_eq!(results[0], Ok(()), "{results:?}");
    for (i, r) in results.iter().enumerate().take(3).skip(1) {
        let err = r.as_ref().unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "unroutable: exchange {exchange}, routing key {}",
                events[i].event_type
            )),
            "event {i}: {err}"
        );
    }
    assert_eq!(
        results[3],
        Err(PublishError::Timeout(timeout)),
        "{results:?}"
    );

    proxy.confirm_up_to.store(u64::MAX, Ordering::SeqCst);
    let next = sample_events("room", 1);
    let batch = [Delivery::of(&next[0])];
    let results = PublishResults::new(1);
    publisher.publish_each(&batch, timeout, &results).await;
    assert_eq!(results.into_results(timeout), [Ok(())]);
    let got = inbox.wait_for(3, Duration::from_secs(5)).await;
    for e in [&events[0], &events[3], &next[0]] {
        assert!(got.iter().any(|r| r.event_id == e.event_id), "{got:?}");
    }
    publisher.close().await;
}

/// Issue 12: the relay has two batches in flight on a RabbitMQ publisher
/// (`max_in_flight`): the second is sent while the first one's confirms
/// are still on their way, on a channel of its own. Here the broker's
/// confirms are held back for good: both batches reach the queue all the
/// same, long before the first one's publish times out. One batch at a
/// time, the second would wait out the first's 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_batch_goes_out_while_the_first_awaits_its_confirms() {
    let _broker = broker_shared().await;
    let target = scratch_exchange("inflight", "#").await;
    let (exchange, inbox) = (&target.name, &target.inbox);
    let proxy = ConfirmProxy::start(0).await;
    let mut config = config(exchange, "{event_type}", false);
    config.url = SecretUrl::new(proxy.url.clone());
    let publisher = RabbitMqPublisher::connect(&config).await.unwrap();
    assert_eq!(publisher.max_in_flight(), 2);

    let events = sample_events("room", 40);
    let (first, second) = events.split_at(20);
    let first: Vec<Delivery<'_>> = first.iter().map(Delivery::of).collect();
    let second: Vec<Delivery<'_>> = second.iter().map(Delivery::of).collect();
    let timeout = Duration::from_secs(30);
    let (first_results, second_results) = (PublishResults::new(20), PublishResults::new(20));
    let publishes = async {
        tokio::join!(
            publisher.publish_each(&first, timeout, &first_results),
            async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                publisher
                    .publish_each(&second, timeout, &second_results)
                    .await
            }
        )
    };
    tokio::select! {
        _ = publishes => panic!("the batches ended although the broker confirmed nothing"),
        got = inbox.wait_for(40, Duration::from_secs(10)) => {
            assert_eq!(got.len(), 40, "both batches reached the queue unconfirmed: {got:?}");
        }
    }
    publisher.close().await;
}

/// A TCP proxy to the broker that can hold back the publisher confirms
/// (`basic.ack` frames, kept and sent on once released) and stall the
/// next `channel.open` the client sends, with what follows it, as a
/// broker slow to open channels does.
struct StallProxy {
    url: String,
    hold_acks: Arc<std::sync::atomic::AtomicBool>,
    stall_open_ms: Arc<AtomicU64>,
}

impl StallProxy {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (url, upstream) = postbox_testkit::amqp::through_proxy(listener.local_addr().unwrap());
        let hold_acks = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stall_open_ms = Arc::new(AtomicU64::new(0));
        let (hold, stall) = (hold_acks.clone(), stall_open_ms.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(&upstream).await.unwrap();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(stall_channel_open(client_read, server_write, stall.clone()));
                tokio::spawn(hold_confirms(server_read, client_write, hold.clone()));
            }
        });
        StallProxy {
            url,
            hold_acks,
            stall_open_ms,
        }
    }
}

/// One AMQP frame: its header (type (1), channel (2), size (4)) and the
/// rest (payload, frame end (1)).
async fn read_frame(
    from: &mut tokio::net::tcp::OwnedReadHalf,
) -> std::io::Result<([u8; 7], Vec<u8>)> {
    let mut header = [0u8; 7];
    from.read_exact(&mut header).await?;
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
    let mut rest = vec![0u8; size + 1];
    from.read_exact(&mut rest).await?;
    Ok((header, rest))
}

/// Client to broker: the next `channel.open` (class 20, method 10) after
/// `stall_ms` is set waits that long.
async fn stall_channel_open(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stall_ms: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let mut protocol = [0u8; 8];
    from.read_exact(&mut protocol).await?;
    to.write_all(&protocol).await?;
    loop {
        let (header, rest) = read_frame(&mut from).await?;
        if header[0] == 1 && rest.len() >= 4 && rest[..4] == [0, 20, 0, 10] {
            let ms = stall_ms.swap(0, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        to.write_all(&header).await?;
        to.write_all(&rest).await?;
    }
}

/// Broker to client: `basic.ack` frames are kept while `hold` is set, and
/// sent once it is cleared.
async fn hold_confirms(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hold: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<()> {
    let (frames, mut incoming) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(frame) = read_frame(&mut from).await {
            if frames.send(frame).is_err() {
                return;
            }
        }
    });
    let mut held: Vec<([u8; 7], Vec<u8>)> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    loop {
        let frame = tokio::select! {
            frame = incoming.recv() => match frame {
                Some(frame) => Some(frame),
                None => return Ok(()),
            },
            _ = tick.tick() => None,
        };
        let holding = hold.load(Ordering::SeqCst);
        if !holding {
            for (header, rest) in held.drain(..) {
                to.write_all(&header).await?;
                to.write_all(&rest).await?;
            }
        }
        let Some((header, rest)) = frame else {
            continue;
        };
        if holding && header[0] == 1 && rest.len() >= 4 && rest[..4] == [0, 60, 0, 80] {
            held.push((header, rest));
            continue;
        }
        to.write_all(&header).await?;
        to.write_all(&rest).await?;
    }
}

/// The confirms of a batch in flight reach its caller as they come while
/// the session opens a channel for the next batch (up to 10 s on a broker
/// slow to answer). They were taken only once that channel was open, by
/// when the caller's `publish_timeout` had counted the confirmed messages
/// as timed out: sent again, and the breaker tripped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirms_reach_the_caller_while_another_batch_opens_its_channel() {
    let _broker = broker_shared().await;
    let target = scratch_exchange("opening", "#").await;
    let proxy = StallProxy::start().await;
    let mut config = config(&target.name, "{event_type}", false);
    config.url = SecretUrl::new(proxy.url.clone());
    let publisher = RabbitMqPublisher::connect(&config).await.unwrap();
    let events = sample_events("room", 20);
    let (first, second) = events.split_at(10);
    let first: Vec<Delivery<'_>> = first.iter().map(Delivery::of).collect();
    let second: Vec<Delivery<'_>> = second.iter().map(Delivery::of).collect();
    let (short, long) = (Duration::from_millis(1500), Duration::from_secs(15));
    let results = (PublishResults::new(10), PublishResults::new(10));
    proxy.hold_acks.store(true, Ordering::SeqCst);
    tokio::join!(publisher.publish_each(&first, short, &results.0), async {
        // The first batch is out, its confirms held; the second asks for a
        // channel, whose opening stalls; then the confirms go through.
        assert_eq!(
            target
                .inbox
                .wait_for(10, Duration::from_secs(5))
                .await
                .len(),
            10
        );
        proxy.stall_open_ms.store(4_000, Ordering::SeqCst);
        tokio::join!(publisher.publish_each(&second, long, &results.1), async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.hold_acks.store(false, Ordering::SeqCst);
        });
    });
    assert_eq!(
        results.0.into_results(short),
        vec![Ok(()); 10],
        "the first batch's confirms, while the second's channel opened"
    );
    assert_eq!(results.1.into_results(long), vec![Ok(()); 10]);
    publisher.close().await;
}

/// `events` published as two batches in flight together (halves), each
/// given `timeout`; the results in the events' order.
async fn in_two_batches_at_once(
    publisher: &RabbitMqPublisher,
    events: &[EventRecord],
    timeout: Duration,
) -> Vec<Result<(), PublishError>> {
    let (first, second) = events.split_at(events.len() / 2);
    let first: Vec<Delivery<'_>> = first.iter().map(Delivery::of).collect();
    let second: Vec<Delivery<'_>> = second.iter().map(Delivery::of).collect();
    let results = (
        PublishResults::new(first.len()),
        PublishResults::new(second.len()),
    );
    tokio::join!(
        publisher.publish_each(&first, timeout, &results.0),
        publisher.publish_each(&second, timeout, &results.1),
    );
    let mut all = results.0.into_results(timeout);
    all.extend(results.1.into_results(timeout));
    all
}

/// Batches in flight together each get their own results: lapin hands a
/// returned (unroutable) message to whichever confirm of its channel it
/// resolves next, so each batch has a channel to itself and a return never
/// fails an event of the other batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_in_flight_together_keep_their_own_returns() {
    let _broker = broker_shared().await;
    let target = scratch_exchange("together", "RoomCreated").await;
    let (exchange, inbox) = (&target.name, &target.inbox);
    let publisher = publisher_to(exchange).await;
    let timeout = Duration::from_secs(10);
    let mut routed = 0;
    for _ in 0..5 {
        let events = sample_events("room", 60); // RoomCreated, UserJoined, GiftSent, …
        let results = in_two_batches_at_once(&publisher, &events, timeout).await;
        for (e, r) in events.iter().zip(results) {
            if e.event_type == "RoomCreated" {
                assert_eq!(r, Ok(()), "{}", e.event_id);
                routed += 1;
            } else {
                let err = r.unwrap_err().to_string();
                assert!(
                    err.starts_with(&format!(
                        "unroutable: exchange {exchange}, routing key {}",
                        e.event_type
                    )),
                    "{}: {err}",
                    e.event_id
                );
            }
        }
    }
    let got = inbox.wait_for(routed, Duration::from_secs(10)).await;
    assert_eq!(got.len(), routed);
    publisher.close().await;
}

/// `rabbitmqctl <args>`, which must succeed.
fn rabbitmqctl(args: &[&str]) {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl on PATH");
    assert!(out.status.success(), "rabbitmqctl {args:?}: {out:?}");
}

/// One event type the broker refuses (a topic permission denies its
/// routing key) does not fail the others. The broker closes the channel
/// at such a message, failing everything its batch had not had
/// confirmed; from then on the publisher fails that routing key's
/// messages unsent, naming the fix, and the rest of every batch is
/// delivered. Before, every batch holding one of them failed whole
/// (two batches in flight: 1–2 of 400 delivered per round), and its
/// other events used up their retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_key_the_broker_refuses_fails_alone() {
    let _broker = broker_shared().await;
    let target = scratch_exchange("refused", "#").await;
    let exchange = target.name.as_str();
    let permission = ["-p", "/", "guest", exchange];
    rabbitmqctl(
        &[
            &["set_topic_permissions"],
            &permission[..],
            &["^(?!GiftSent$).*", ".*"],
        ]
        .concat(),
    );
    let publisher = publisher_to(exchange).await;
    let timeout = Duration::from_secs(10);
    let mut delivered = 0;
    for round in 0..3 {
        let events = sample_events("room", 400); // RoomCreated, UserJoined, GiftSent, …
        let results = in_two_batches_at_once(&publisher, &events, timeout).await;
        for (e, r) in events.iter().zip(results) {
            delivered += usize::from(r.is_ok());
            // The first refusal fails what its batches had not had confirmed.
            if round == 0 {
                continue;
            }
            if e.event_type == "GiftSent" {
                let err = r.unwrap_err().to_string();
                assert!(
                    err.contains("routing key 'GiftSent'") && err.contains("grant write access"),
                    "{err}"
                );
            } else {
                assert_eq!(r, Ok(()), "round {round}: {} {}", e.event_type, e.event_id);
            }
        }
    }
    rabbitmqctl(&[&["clear_topic_permissions"], &permission[..]].concat());
    // Messages routed before a refusal closed their channel arrive too,
    // though not confirmed (at least once).
    let got = target
        .inbox
        .wait_for(delivered, Duration::from_secs(10))
        .await;
    assert!(got.len() >= delivered, "{} of {delivered}", got.len());
    assert!(got.iter().all(|r| r.event_type != "GiftSent"));
    publisher.close().await;
}
