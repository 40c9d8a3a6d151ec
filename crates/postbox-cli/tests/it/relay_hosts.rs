//! Many relay hosts (issue 16, item 3): two `postbox relay` processes, each
//! in a network namespace of its own (a "host" with its own loopback and a
//! link to this one), share one PostgreSQL table and one RabbitMQ broker.
//! One host is lost mid-run (every process killed, its link deleted): the
//! other takes its leases over when they expire, and nothing is lost.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::ExchangeKind;
use postbox_testkit::consumer_fixtures::{broker, delete_queues, eventually};
use postbox_testkit::netns::Host;
use postbox_testkit::servers::{amqp_url, scratch_name};

use crate::common;

const EVENTS: usize = 1_000;

/// `url` with its `host:port` replaced by `at`.
fn via(url: &str, at: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let userinfo = authority.rsplit_once('@').map(|(u, _)| format!("{u}@"));
    format!("{scheme}://{}{at}/{path}", userinfo.unwrap_or_default())
}

/// `host:port` of `url`.
fn address_of(url: &str) -> SocketAddr {
    let rest = url.split_once("://").unwrap().1;
    let authority = rest.split('/').next().unwrap();
    let host_port = authority.rsplit('@').next().unwrap();
    host_port.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_on_two_hosts_share_a_table_and_losing_one_loses_nothing() {
    let (url, store) = common::server_outbox("postgres", "pbx_hosts", 4).await;
    let table = store.table().as_str().to_owned();
    let (exchange, queue) = (scratch_name("pbx_hostx"), scratch_name("pbx_hostq"));
    let (_conn, ch) = broker().await;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    (ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        durable,
        Default::default(),
    )
    .await)
        .unwrap();
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), options, Default::default())
        .await
        .unwrap();
    (ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "#".into(),
        QueueBindOptions::default(),
        Default::default(),
    )
    .await)
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut hosts = Vec::new();
    let mut relays = Vec::new();
    for k in 0..2u8 {
        let mut host = Host::create(k);
        let db = host.forward(address_of(&url)).await;
        let mq = host.forward(address_of(&amqp_url())).await;
        let cfg = common::write_config(
            dir.path(),
            &format!(
                "[database]\nurl = \"{}\"\ntable = \"{table}\"\napp_codes = [\"room\"]\nmax_connections = 4\n\
                 [outbox_worker]\npoll_interval = \"100ms\"\nbatch_size = 50\nlease = \"3s\"\npublish_timeout = \"1s\"\n\
                 initial_backoff = \"200ms\"\nmax_backoff = \"1s\"\n\
                 [[publishers]]\nkind = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{exchange}\"\n",
                via(&url, &db),
                via(&amqp_url(), &mq)
            ),
        );
        let host_cfg = dir.path().join(format!("host{k}.toml"));
        std::fs::rename(&cfg, &host_cfg).unwrap();
        let relay = host
            .command(env!("CARGO_BIN_EXE_postbox"))
            .args(["--config", host_cfg.to_str().unwrap(), "relay"])
            .env_remove("POSTBOX_CONFIG")
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("postbox relay in a network namespace");
        hosts.push(host);
        relays.push(relay);
    }

    let producer = common::produce(store.clone(), EVENTS, 25);
    let delivered = async || common::delivered_rooms(store.as_ref()).await;
    eventually("a third delivered", Duration::from_secs(60), async || {
        let n = delivered().await;
        (n >= (EVENTS / 3) as i64)
            .then_some(())
            .ok_or(format!("{n} delivered"))
    })
    .await;
    // Lose the first host while it holds leased rows, so that the other
    // must take them over.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let held_by_first = format!(
        "SELECT count(*) FROM {table} WHERE status = 'delivering' AND worker_id LIKE '%-{}-%'",
        relays[0].id().unwrap()
    );
    let started = Instant::now();
    let count_held =
        async || -> i64 { (sqlx::query_scalar(&held_by_first).fetch_one(&pool).await).unwrap() };
    let first = relays[0].id().unwrap();
    let held: i64 = loop {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the first host never held a lease"
        );
        if count_held().await == 0 {
            continue;
        }
        // Frozen, it cannot mark what it holds between the count and
        // the loss; a mark it had already sent lands before the count.
        common::signal("STOP", first);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = count_held().await;
        if n > 0 {
            hosts[0].lose();
            break n;
        }
        common::signal("CONT", first);
    };
    let lost_at = Instant::now();
    producer.await.unwrap();
    eventually(
        "every event delivered",
        Duration::from_secs(120),
        async || {
            let n = delivered().await;
            (n == EVENTS as i64)
                .then_some(())
                .ok_or(format!("{n} of {EVENTS} delivered"))
        },
    )
    .await;
    let all_delivered_after = lost_at.elapsed();

    // What reached the broker: every event, some twice (a batch the lost
    // host had published but not yet marked).
    let mut ids = HashSet::new();
    let mut messages = 0;
    while let Some(m) = (ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await)
        .unwrap()
    {
        messages += 1;
        ids.insert(
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string(),
        );
    }
    let taken_over: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE retry_count > 0"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    println!(
        "relay hosts: {EVENTS} events, lost {}, duplicates {}; the lost host held {held} leased rows, {taken_over} were taken over; all delivered {all_delivered_after:?} after the loss",
        EVENTS - ids.len(),
        messages - ids.len()
    );
    assert!(
        taken_over >= held,
        "the leases of the lost host were taken over"
    );
    assert_eq!(ids.len(), EVENTS, "every event reached the broker");
    common::stopped(&mut relays[1]).await;
    delete_queues(&ch, &queue).await;
}
