//! After a relay run against PostgreSQL, `/metrics` is valid Prometheus
//! text with the delivered count and the publish counters. The recorder and
//! its counters are process-wide: this is the only test of the binary that
//! runs a relay (the API tests only read and replay), so the counts it
//! reads are its own. A new test that runs a relay belongs elsewhere or
//! must not share these names.

use std::sync::Arc;
use std::time::Duration;

use postbox_admin::{AdminServer, AdminSettings};
use postbox_core::relay::CancellationToken;
use postbox_core::store::OutboxStore;
use postbox_core::{NewEvent, Publisher};
use postbox_postgres::PgOutbox;
use postbox_testkit::conformance::{fast_worker, run_relay_until_for};
use postbox_testkit::http::{parse_prometheus, request, sample_value};
use postbox_testkit::servers::ensure_database;
use postbox_testkit::{postgres_url, scratch_table, RecordingPublisher};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_relay_run() {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let store: Arc<dyn OutboxStore> = Arc::new(
        PgOutbox::connect(&url, &scratch_table("metrics"), 4)
            .await
            .expect("connect"),
    );
    store.migrate().await.expect("migrate");
    let app = "metrics";
    let good: Vec<NewEvent> = (0..40)
        .map(|i| NewEvent::new(app, "Good", format!(r#"{{"n":{i}}}"#)))
        .collect();
    let poison: Vec<NewEvent> = (0..3)
        .map(|i| NewEvent::new(app, "Poison", format!(r#"{{"n":{i}}}"#)))
        .collect();
    store.enqueue_batch(&good, 1 << 20).await.expect("enqueue");
    store
        .enqueue_batch(&poison, 1 << 20)
        .await
        .expect("enqueue");

    // The server installs the recorder before the relay records anything.
    let server = AdminServer::bind(
        store.clone(),
        AdminSettings {
            listen: "127.0.0.1:0".into(),
            listen_from: "admin.listen",
            token: None,
            tokens: Vec::new(),
            metrics: postbox_core::config::MetricsAccess::Open,
            redact: Default::default(),
            app_codes: vec![app.into()],
            poll_interval: Duration::from_millis(100),
            publishers: vec![],
        },
    )
    .await
    .expect("bind admin");
    let addr = server.local_addr().unwrap();
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));

    let publisher = Arc::new(RecordingPublisher::new("rec").failing_type("Poison"));
    let publishers: Vec<Arc<dyn Publisher>> = vec![publisher.clone()];
    let worker = fast_worker(); // max_retry_count 3
    let report = run_relay_until_for(store.clone(), publishers, worker, app, |s| {
        s.delivered == 40 && s.failed == 3
    })
    .await;
    assert_eq!((report.delivered, report.failed), (40, 3));
    // Let the poller see the final counts.
    tokio::time::sleep(Duration::from_millis(400)).await;

    let res = request(addr, "GET", "/metrics", &[]).await;
    assert_eq!(res.status, 200);
    assert!(res
        .headers
        .iter()
        .any(|(k, v)| k == "content-type" && v.starts_with("text/plain")));
    let samples = parse_prometheus(&res.body).unwrap_or_else(|e| panic!("{e}\n{}", res.body));
    let v = |name: &str, labels: &[(&str, &str)]| {
        sample_value(&samples, name, labels)
            .unwrap_or_else(|| panic!("no {name}{labels:?} in\n{}", res.body))
    };
    let rec = ("publisher", "rec");
    assert_eq!(v("postbox_publish_total", &[rec, ("result", "ok")]), 40.0);
    // Three poison events, three attempts each.
    assert_eq!(v("postbox_publish_total", &[rec, ("result", "error")]), 9.0);
    assert!(sample_value(
        &samples,
        "postbox_publish_total",
        &[rec, ("result", "timeout")]
    )
    .is_none());
    assert!(v("postbox_publish_duration_seconds_count", &[rec]) >= 1.0);
    assert_eq!(v("postbox_delivery_lag_seconds_count", &[]), 40.0);
    assert_eq!(v("postbox_dead_lettered_total", &[("app_code", app)]), 3.0);
    let events = |status| {
        v(
            "postbox_outbox_events",
            &[("app_code", app), ("status", status)],
        )
    };
    assert_eq!(events("delivered"), 40.0);
    assert_eq!(events("failed"), 3.0);
    assert_eq!(events("pending"), 0.0);
    assert_eq!(
        v(
            "postbox_outbox_oldest_pending_age_seconds",
            &[("app_code", app)]
        ),
        0.0
    );
    // Issue 15.6: every relay metric the shipped alert rules and Grafana
    // dashboard name is one this relay exports.
    // (Partitions are counted by relays of a partitioned table: the CLI's
    // partitioned test checks that gauge.)
    postbox_testkit::http::assert_deploy_names_exported(&samples, |n| {
        !n.starts_with("postbox_consume_") && n != "postbox_partitions_ahead"
    });
    assert!(
        res.body
            .contains("# TYPE postbox_delivery_lag_seconds histogram"),
        "histograms are exported with buckets:\n{}",
        res.body
    );

    // The same snapshot serves /api/stats.
    let stats = request(addr, "GET", "/api/stats", &[]).await.json();
    assert_eq!(stats["apps"][0]["delivered"], 40);
    let per_minute: i64 = stats["delivered_per_minute"][app]
        .as_array()
        .expect("chart data")
        .iter()
        .map(|m| m["delivered"].as_i64().unwrap())
        .sum();
    assert_eq!(per_minute, 40, "the chart counts every delivered row");

    stop.cancel();
    serving.await.unwrap().expect("admin server stops cleanly");
}

/// The stats poller over a database gone silent: a poll gives up after
/// its bound, and a stop does not wait for the poll in flight. The poll
/// waited for good (the dashboard showing old figures as current), and
/// the admin server's stop, and the relay's beside it, waited with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_the_database_never_answers_does_not_hold_the_stop() {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let table = scratch_table("silentpoll");
    let store = PgOutbox::connect(&url, &table, 2).await.expect("connect");
    store.migrate().await.expect("migrate");
    let (proxy, through) = postbox_testkit::proxy::to_postgres().await;
    let through: Arc<dyn OutboxStore> = Arc::new(
        PgOutbox::connect(&through, &table, 2)
            .await
            .expect("connect"),
    );
    let poller = postbox_admin::StatsPoller::new(
        through,
        vec!["silent".into()],
        Duration::from_millis(100),
        None,
    );
    poller.poll_once().await;
    assert!(
        poller.snapshot().error.is_none(),
        "{:?}",
        poller.snapshot().error
    );
    proxy.silence();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(poller.clone().run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("the poller stops with a poll in flight")
        .unwrap();
}

/// A poll asked for (after a replay) runs before the next tick, without
/// the asker waiting for it; asks while one is pending make one poll. A
/// replay's answer waited for a whole poll, so a slow poll held an answer
/// whose change was already committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_asked_for_runs_before_the_next_tick() {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let store: Arc<dyn OutboxStore> = Arc::new(
        PgOutbox::connect(&url, &scratch_table("pollsoon"), 2)
            .await
            .expect("connect"),
    );
    store.migrate().await.expect("migrate");
    let poller = postbox_admin::StatsPoller::new(
        store.clone(),
        vec!["soon".into()],
        Duration::from_secs(3600),
        None,
    );
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(poller.clone().run(shutdown.clone()));
    let pending =
        |p: &postbox_admin::StatsPoller| p.snapshot().apps.first().map_or(-1, |a| a.pending);
    let started = std::time::Instant::now();
    while pending(&poller) != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the first poll"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    store
        .enqueue_batch(&[NewEvent::new("soon", "T", "{}")], 1 << 20)
        .await
        .expect("enqueue");
    for _ in 0..3 {
        poller.poll_soon();
    }
    let asked = std::time::Instant::now();
    while pending(&poller) != 1 {
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "no poll before the next tick (an hour away)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    run.await.unwrap();
}
