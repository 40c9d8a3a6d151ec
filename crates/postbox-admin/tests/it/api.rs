//! The admin API against PostgreSQL: replay needs the token, pages cover
//! every row once, an event shows its timeline.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use postbox_admin::{AdminServer, AdminSettings};
use postbox_core::config::{AdminRole, AdminToken, MetricsAccess};
use postbox_core::redact::Secret;
use postbox_core::relay::CancellationToken;
use postbox_core::store::OutboxStore;
use postbox_core::{NewEvent, Status};
use postbox_postgres::PgOutbox;
use postbox_testkit::cli_fixtures::expect_in;
use postbox_testkit::http::{request, request_with};
use postbox_testkit::servers::ensure_database;
use postbox_testkit::{postgres_url, scratch_table};

const TOKEN: &str = "test-admin-token-7f3a";

/// A scratch outbox table whose rows are of tenant `app` (the one the
/// admin server serves).
struct Fixture {
    app: &'static str,
    store: Arc<dyn OutboxStore>,
    table: String,
    pool: sqlx::PgPool,
}

async fn fixture(prefix: &str, app: &'static str) -> Fixture {
    let url = postgres_url();
    ensure_database("postgres", &url).await;
    let table = scratch_table(prefix);
    let store: Arc<dyn OutboxStore> =
        Arc::new(PgOutbox::connect(&url, &table, 4).await.expect("connect"));
    store.migrate().await.expect("migrate");
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    Fixture {
        app,
        store,
        table,
        pool,
    }
}

impl Fixture {
    /// `n` events of the fixture's tenant; their ids.
    async fn enqueue(&self, n: usize) -> Vec<String> {
        self.enqueue_for(self.app, n).await
    }

    async fn enqueue_for(&self, app: &str, n: usize) -> Vec<String> {
        let evs: Vec<NewEvent> = (0..n)
            .map(|i| NewEvent::new(app, "Thing", format!(r#"{{"n":{i}}}"#)))
            .collect();
        self.store
            .enqueue_batch(&evs, 1 << 20)
            .await
            .expect("enqueue");
        evs.into_iter().map(|e| e.event_id).collect()
    }

    /// Makes a row a dead letter, as the relay would after its last attempt.
    async fn dead_letter(&self, event_id: &str) {
        self.update(
            event_id,
            "status = 'failed', retry_count = 3, last_error = 'broker said no'",
        )
        .await;
    }

    /// Writes `assignments` (an SQL `SET` list) into one row directly.
    async fn update(&self, event_id: &str, assignments: &str) {
        sqlx::query(&format!(
            "UPDATE {} SET {assignments} WHERE event_id = $1",
            self.table
        ))
        .bind(event_id)
        .execute(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("set {assignments}: {e}"));
    }

    async fn serve(&self, token: Option<&str>) -> (SocketAddr, CancellationToken) {
        self.serve_with(|s| s.token = token.map(Secret::new)).await
    }

    /// Serves the fixture's table with the settings `tweak` makes.
    async fn serve_with(
        &self,
        tweak: impl FnOnce(&mut AdminSettings),
    ) -> (SocketAddr, CancellationToken) {
        self.serve_beside(tweak, None).await
    }

    /// [`Fixture::serve_with`], beside a relay of `pulse` when given.
    async fn serve_beside(
        &self,
        tweak: impl FnOnce(&mut AdminSettings),
        pulse: Option<postbox_core::relay::Pulse>,
    ) -> (SocketAddr, CancellationToken) {
        let mut settings = AdminSettings {
            listen: "127.0.0.1:0".into(),
            listen_from: "admin.listen",
            token: None,
            tokens: Vec::new(),
            metrics: MetricsAccess::Open,
            redact: Default::default(),
            app_codes: vec![self.app.into()],
            poll_interval: Duration::from_millis(100),
            publishers: vec!["a".into(), "b".into()],
        };
        tweak(&mut settings);
        let mut server = AdminServer::bind(self.store.clone(), settings)
            .await
            .expect("bind admin");
        if let Some(pulse) = pulse {
            server = server.with_relay_pulse(pulse);
        }
        let addr = server.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(server.run(stop.clone()));
        (addr, stop)
    }
}

/// `GET /api/events/{event_id}`: a 200 and its JSON.
async fn show(addr: SocketAddr, event_id: &str) -> serde_json::Value {
    let res = request(addr, "GET", &format!("/api/events/{event_id}"), &[]).await;
    assert_eq!(res.status, 200, "{}", res.body);
    res.json()
}

/// The first step of `kind` in the timeline of a shown event.
fn step(shown: &serde_json::Value, kind: &str) -> serde_json::Value {
    let timeline = shown["timeline"].as_array().expect("a timeline");
    let found = timeline.iter().find(|t| t["kind"] == kind);
    found
        .cloned()
        .unwrap_or_else(|| panic!("no {kind} step: {shown}"))
}

#[tokio::test]
async fn replay_needs_the_token_and_keeps_the_event_id() {
    let fx = fixture("api_replay", "api").await;
    let ids = fx.enqueue(3).await;
    fx.dead_letter(&ids[1]).await;
    let (addr, stop) = fx.serve(Some(TOKEN)).await;
    let path = format!("/api/events/{}/replay", ids[1]);

    let none = request(addr, "POST", &path, &[]).await;
    assert_eq!(none.status, 401, "{}", none.body);
    assert!(none.json()["error"].as_str().unwrap().contains("Bearer"));
    let wrong = request(addr, "POST", &path, &[("Authorization", "Bearer nope")]).await;
    assert_eq!(wrong.status, 401, "{}", wrong.body);
    let almost = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
    let wrong = request(addr, "POST", &path, &[("Authorization", &almost)]).await;
    assert_eq!(wrong.status, 401);
    let row = fx.store.find(&ids[1]).await.unwrap().remove(0);
    assert_eq!(
        row.status,
        Status::Failed,
        "a refused replay changes nothing"
    );

    let bearer = format!("Bearer {TOKEN}");
    let ok = request(addr, "POST", &path, &[("Authorization", &bearer)]).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.json()["replayed"][0]["event_id"], ids[1].as_str());
    let row = fx.store.find(&ids[1]).await.unwrap().remove(0);
    assert_eq!(row.status, Status::Pending);
    assert_eq!(row.event_id, ids[1]);
    assert_eq!(row.retry_count, 0);
    assert_eq!(row.replay_count, 1);

    let missing = request(
        addr,
        "POST",
        "/api/events/no-such-event/replay",
        &[("Authorization", &bearer)],
    )
    .await;
    assert_eq!(missing.status, 404, "{}", missing.body);
    stop.cancel();
}

#[tokio::test]
async fn without_a_configured_token_replay_is_refused() {
    let fx = fixture("api_notoken", "api").await;
    let ids = fx.enqueue(1).await;
    fx.dead_letter(&ids[0]).await;
    let (addr, stop) = fx.serve(None).await;
    let path = format!("/api/events/{}/replay", ids[0]);
    for auth in [vec![], vec![("Authorization", "Bearer ")]] {
        let res = request(addr, "POST", &path, &auth).await;
        assert_eq!(res.status, 403, "{}", res.body);
        assert!(res.json()["error"]
            .as_str()
            .unwrap()
            .contains("admin.token"));
    }
    assert_eq!(
        fx.store.find(&ids[0]).await.unwrap()[0].status,
        Status::Failed
    );
    stop.cancel();
}

#[tokio::test]
async fn pages_cover_every_row_exactly_once() {
    let fx = fixture("api_pages", "pages").await;
    let mut ids = fx.enqueue(125).await;
    // Another tenant's rows never show up in this one's pages.
    fx.enqueue_for("other", 7).await;
    for id in ids.iter().step_by(10) {
        fx.dead_letter(id).await;
    }
    let (addr, stop) = fx.serve(None).await;

    for (query, expected) in [
        (format!("app_code={}", fx.app), ids.clone()),
        (
            format!("app_code={}&status=failed", fx.app),
            ids.iter().step_by(10).cloned().collect::<Vec<_>>(),
        ),
    ] {
        let mut seen = Vec::new();
        let mut last_id = i64::MAX;
        let mut cursor: Option<i64> = None;
        let mut pages = 0;
        loop {
            let path = match cursor {
                Some(c) => format!("/api/events?{query}&limit=50&before_id={c}"),
                None => format!("/api/events?{query}&limit=50"),
            };
            let page = request(addr, "GET", &path, &[]).await;
            assert_eq!(page.status, 200, "{}", page.body);
            let page = page.json();
            pages += 1;
            for item in page["items"].as_array().unwrap() {
                let id = item["id"].as_i64().unwrap();
                assert!(id < last_id, "newest first");
                last_id = id;
                assert_eq!(item["app_code"], fx.app);
                seen.push(item["event_id"].as_str().unwrap().to_owned());
            }
            match page["next"].as_i64() {
                Some(n) => cursor = Some(n),
                None => break,
            }
            assert!(pages < 10, "pagination does not end");
        }
        let unique: HashSet<_> = seen.iter().collect();
        assert_eq!(unique.len(), seen.len(), "{query}: a row on two pages");
        let mut want = expected.clone();
        want.sort();
        seen.sort();
        assert_eq!(seen, want, "{query}: every row exactly once");
    }
    ids.sort();

    let bad = request(addr, "GET", "/api/events?status=lost", &[]).await;
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"].as_str().unwrap().starts_with("status:"));
    stop.cancel();
}

/// Beside a relay, `/healthz` is a liveness check: 503 once the relay's
/// claim loop has not gone round for longer than any round can take (a
/// wedged relay, for the supervisor to restart); it said 200 whatever the
/// relay did.
#[tokio::test]
async fn healthz_fails_while_the_relay_beside_it_has_stalled() {
    let fx = fixture("api_pulse", "pulse").await;
    let going = postbox_core::relay::Pulse::new(Duration::from_secs(60));
    let (addr, stop) = fx.serve_beside(|_| {}, Some(going)).await;
    let health = request(addr, "GET", "/healthz", &[]).await;
    assert_eq!(health.status, 200, "{}", health.body);
    assert!(health.json()["relay_last_round_ms_ago"].is_u64());
    stop.cancel();

    let stalled = postbox_core::relay::Pulse::new(Duration::from_millis(10));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (addr, stop) = fx.serve_beside(|_| {}, Some(stalled)).await;
    let health = request(addr, "GET", "/healthz", &[]).await;
    assert_eq!(health.status, 503, "{}", health.body);
    assert_eq!(health.json()["status"], "stalled");
    assert!(
        health.json()["error"]
            .as_str()
            .unwrap()
            .contains("claim loop"),
        "{}",
        health.body
    );
    stop.cancel();
}

#[tokio::test]
async fn an_event_shows_its_rows_and_timeline() {
    let fx = fixture("api_show", "show").await;
    let ids = fx.enqueue(1).await;
    let (addr, stop) = fx.serve(None).await;
    let d = show(addr, &ids[0]).await;
    assert_eq!(d["rows"][0]["event_id"], ids[0].as_str());
    assert_eq!(d["timeline"][0]["kind"], "enqueued");
    let res = request(addr, "GET", "/api/events/nope", &[]).await;
    assert_eq!(res.status, 404);
    assert!(res.json()["error"].as_str().unwrap().contains("nope"));

    let health = request(addr, "GET", "/healthz", &[]).await;
    assert_eq!(health.status, 200);
    let page = request(addr, "GET", "/", &[]).await;
    assert_eq!(page.status, 200);
    assert!(page.body.contains("/dashboard.js"));
    let stats = request(addr, "GET", "/api/stats", &[]).await.json();
    assert_eq!(stats["apps"][0]["app_code"], fx.app);
    assert_eq!(stats["apps"][0]["pending"], 1);
    stop.cancel();
}

/// Issue 9.6: a replay keeps the publishers that confirmed unless told
/// otherwise; `publishers=` picks targets, unknown names are a 400; the
/// timeline names the targets.
#[tokio::test]
async fn replay_picks_its_publishers() {
    let fx = fixture("api_replay_to", "to").await;
    let ids = fx.enqueue(3).await;
    for id in &ids {
        fx.dead_letter(id).await;
    }
    sqlx::query(&format!("UPDATE {} SET delivered_to = 'a'", fx.table))
        .execute(&fx.pool)
        .await
        .unwrap();
    let (addr, stop) = fx.serve(Some(TOKEN)).await;
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("Authorization", bearer.as_str())];

    let listed = request(addr, "GET", "/api/publishers", &auth).await.json();
    assert_eq!(listed["publishers"], serde_json::json!(["a", "b"]));

    let path = |i: usize, q: &str| format!("/api/events/{}/replay?{q}", ids[i]);
    let bad = request(addr, "POST", &path(0, "publishers=a,nosuch"), &auth).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("nosuch"), "{}", bad.body);
    assert_eq!(
        fx.store.find(&ids[0]).await.unwrap()[0].status,
        Status::Failed
    );

    // A key the route does not know is refused, not dropped: `dry_run`
    // replayed for real.
    let typo = request(addr, "POST", &path(0, "dry_run=true"), &auth).await;
    assert_eq!(typo.status, 400, "{}", typo.body);
    assert!(typo.body.contains("dry_run"), "{}", typo.body);
    // An app_code the event is not in: not found (it answered 409, "being
    // delivered right now", for an event of another tenant).
    let elsewhere = request(addr, "POST", &path(0, "app_code=nosuch"), &auth).await;
    assert_eq!(elsewhere.status, 404, "{}", elsewhere.body);
    assert_eq!(
        fx.store.find(&ids[0]).await.unwrap()[0].status,
        Status::Failed
    );

    let ok = request(addr, "POST", &path(0, ""), &auth).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.json()["targets"][0], serde_json::json!(["b"]));
    assert_eq!(fx.store.find(&ids[0]).await.unwrap()[0].delivered_to, ["a"]);

    // A dead letter `b` never confirmed, to `a` alone: it would end
    // delivered without `b`, so it is refused, naming `b`.
    let refused = request(addr, "POST", &path(1, "publishers=a"), &auth).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.body.contains("not been confirmed by b"),
        "{}",
        refused.body
    );
    assert_eq!(
        fx.store.find(&ids[1]).await.unwrap()[0].status,
        Status::Failed
    );
    // So is a bulk replay by filter, which did it (and said 200).
    for dry_run in [true, false] {
        let body = serde_json::json!({
            "status": "failed", "app_code": fx.app, "publishers": "a", "dry_run": dry_run
        });
        let refused = request_with(addr, "POST", "/api/replay", &auth, Some(&body)).await;
        assert_eq!(refused.status, 400, "{}", refused.body);
        assert!(
            refused.body.contains("not been confirmed by b"),
            "{}",
            refused.body
        );
    }
    for id in &ids[1..] {
        assert_eq!(fx.store.find(id).await.unwrap()[0].status, Status::Failed);
    }
    // Once delivered (to both), backtracking to `a` alone is fine.
    fx.update(&ids[1], "status = 'delivered', delivered_to = NULL")
        .await;
    let ok = request(addr, "POST", &path(1, "publishers=a"), &auth).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(fx.store.find(&ids[1]).await.unwrap()[0].delivered_to, ["b"]);

    let ok = request(addr, "POST", &path(2, "all_publishers=true"), &auth).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert!(fx.store.find(&ids[2]).await.unwrap()[0]
        .delivered_to
        .is_empty());

    let d = request(addr, "GET", &format!("/api/events/{}", ids[1]), &auth)
        .await
        .json();
    let replayed = expect_in(&d["timeline"], "kind", "replayed");
    assert_eq!(replayed["publisher"], "a", "{d}");
    stop.cancel();
}

/// A bulk replay, or its dry run, takes at most 10,000 events: beyond,
/// the paced replay. It read every matching row into the process and
/// wrote them in one transaction.
#[tokio::test]
async fn a_bulk_replay_is_bounded() {
    let fx = fixture("api_replay_max", "max").await;
    sqlx::query(&format!(
        "INSERT INTO {} (app_code, event_id, event_type, payload, status) \
         SELECT '{}', 'm-' || g, 'Thing', '{{}}', 'failed' FROM generate_series(1, 10001) g",
        fx.table, fx.app
    ))
    .execute(&fx.pool)
    .await
    .unwrap();
    let (addr, stop) = fx.serve(Some(TOKEN)).await;
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("Authorization", bearer.as_str())];
    for dry_run in [true, false] {
        let body =
            serde_json::json!({ "status": "failed", "app_code": fx.app, "dry_run": dry_run });
        let res = request_with(addr, "POST", "/api/replay", &auth, Some(&body)).await;
        assert_eq!(res.status, 400, "{}", res.body);
        assert!(res.body.contains("postbox replay"), "{}", res.body);
    }
    let failed: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE status = 'failed'",
        fx.table
    ))
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!(failed, 10_001, "nothing replayed");
    sqlx::query(&format!("DELETE FROM {} WHERE event_id <> 'm-1'", fx.table))
        .execute(&fx.pool)
        .await
        .unwrap();
    let body = serde_json::json!({ "status": "failed", "app_code": fx.app, "dry_run": true });
    let res = request_with(addr, "POST", "/api/replay", &auth, Some(&body)).await;
    assert_eq!(res.status, 200, "{}", res.body);
    assert_eq!(res.json()["count"], 1);
    stop.cancel();
}

/// Issue 9.7: `GET /api/events/{id}` and the lists find archived rows,
/// marked `"archived": true`.
#[tokio::test]
async fn archived_events_are_shown_and_listed() {
    let fx = fixture("api_archived", "arch").await;
    let ids = fx.enqueue(2).await;
    fx.update(&ids[0], "status = 'delivered', updated_at_ms = 1000")
        .await;
    let report = fx
        .store
        .archive(
            &postbox_core::store::ArchiveRequest {
                app_codes: vec![fx.app.into()],
                before_ms: 2000,
                batch_size: 10,
                max_batches: None,
                partitions: Default::default(),
            },
            &|_| {},
        )
        .await
        .unwrap();
    assert_eq!(report.moved, 1);
    let (addr, stop) = fx.serve(None).await;
    let d = show(addr, &ids[0]).await;
    assert_eq!(d["rows"][0]["archived"], true, "{d}");
    assert!(d["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["kind"] == "delivered"));
    let page = request(
        addr,
        "GET",
        &format!("/api/events?app_code={}", fx.app),
        &[],
    )
    .await
    .json();
    let flags: Vec<(String, bool)> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["event_id"].as_str().unwrap().to_owned(),
                r["archived"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(flags, [(ids[1].clone(), false), (ids[0].clone(), true)]);
    stop.cancel();
}

/// Issue 9.13: bad input is a 4xx, never a 503; the timeline of a
/// delivered event names the publishers that confirmed on that attempt.
#[tokio::test]
async fn bad_input_is_400_and_delivered_names_the_right_publisher() {
    let fx = fixture("api_smalls", "smalls").await;
    let ids = fx.enqueue(1).await;
    // `a` confirmed on attempt 1, `b` on attempt 2.
    fx.update(
        &ids[0],
        "status = 'delivered', retry_count = 1, delivered_to = 'a'",
    )
    .await;
    let (addr, stop) = fx.serve(None).await;
    let nul = request(addr, "GET", "/api/events/%00", &[]).await;
    assert_eq!(nul.status, 400, "{}", nul.body);
    let d = show(addr, &ids[0]).await;
    let delivered = step(&d, "delivered");
    assert_eq!(delivered["publisher"], "b", "{d}");
    assert_eq!(delivered["attempt"], 2);
    stop.cancel();
}

/// Issue 14.7: every route × {no token, viewer, operator, wrong token}.
/// With tokens configured, reading events (payloads) needs a viewer or
/// operator token and changing anything an operator's; a refused answer
/// carries no byte of any payload and says nothing of whether the event
/// exists; `/healthz` and the dashboard's page stay open; a replay's
/// history names the token that made it; `[admin.redact]` masks fields.
#[tokio::test]
async fn each_route_answers_each_role_as_configured() {
    let fx = fixture("api_roles", "roles").await;
    let secret = r#"{"email":"secret-mail@example.com","n":1}"#;
    let ev = NewEvent::new(fx.app, "UserSignedUp", secret);
    fx.store
        .enqueue_batch(std::slice::from_ref(&ev), 1 << 20)
        .await
        .unwrap();
    fx.dead_letter(&ev.event_id).await;
    let (addr, stop) = fx
        .serve_with(|s| {
            s.token = Some(Secret::new("ops-token-1"));
            s.tokens = vec![AdminToken {
                name: "eve".into(),
                role: AdminRole::Viewer,
                token: Secret::new("viewer-token-2"),
            }];
            s.metrics = MetricsAccess::Token;
            s.redact = [("UserSignedUp".to_owned(), vec!["email".to_owned()])].into();
        })
        .await;
    let none: &[(&str, &str)] = &[];
    let viewer = [("Authorization", "Bearer viewer-token-2")];
    let operator = [("Authorization", "Bearer ops-token-1")];
    let wrong = [("Authorization", "Bearer ops-token-")];
    let event = format!("/api/events/{}", ev.event_id);
    let replay = format!("{event}/replay");
    let by_aggregate = format!("/api/events?app_code={}&aggregate_id=order-1", fx.app);
    // Statuses as (no token, viewer, operator, wrong token).
    const OPEN: [u16; 4] = [200, 200, 200, 200];
    const READ: [u16; 4] = [401, 200, 200, 401];
    let table: Vec<(&str, &str, [u16; 4])> = vec![
        ("GET", "/healthz", OPEN),
        ("GET", "/", OPEN),
        ("GET", "/metrics", READ),
        ("GET", "/api/stats", READ),
        ("GET", "/api/publishers", READ),
        ("GET", "/api/events?status=failed", READ),
        ("GET", &event, READ),
        ("GET", "/api/events/no-such-event", [401, 404, 404, 401]),
        (
            "POST",
            "/api/events/no-such-event/replay",
            [401, 403, 404, 401],
        ),
        // Not given a topology source here; without a filter, a bulk
        // replay is refused.
        ("GET", "/api/topology", [401, 404, 404, 401]),
        ("POST", "/api/replay", [401, 403, 400, 401]),
        ("GET", "/api/controls", READ),
        ("POST", "/api/controls", [401, 403, 415, 401]),
        ("GET", "/api/relays", READ),
        // Search by aggregate: without its optional index, 409; without
        // an app_code, 400.
        ("GET", &by_aggregate, [401, 409, 409, 401]),
        (
            "GET",
            "/api/events?aggregate_id=order-1",
            [401, 400, 400, 401],
        ),
    ];
    for (method, path, want) in &table {
        for (who, auth, status) in [
            ("no token", none, want[0]),
            ("viewer", &viewer[..], want[1]),
            ("operator", &operator[..], want[2]),
            ("wrong token", &wrong[..], want[3]),
        ] {
            let res = request(addr, method, path, auth).await;
            assert_eq!(res.status, status, "{method} {path} as {who}: {}", res.body);
            assert!(
                !res.body.contains("secret-mail"),
                "{method} {path} as {who} shows a redacted field: {}",
                res.body
            );
            if res.status == 401 || res.status == 403 {
                assert!(
                    !res.body.contains(&ev.event_id) && !res.body.contains("Thing"),
                    "a refusal tells nothing of the events: {}",
                    res.body
                );
            }
        }
    }
    // A viewer's refused replay names the role it lacks; nothing changed.
    let res = request(addr, "POST", &replay, &viewer).await;
    assert_eq!(res.status, 403, "{}", res.body);
    assert!(
        res.body.contains("`eve`") && res.body.contains("operator"),
        "{}",
        res.body
    );
    assert_eq!(
        fx.store.find(&ev.event_id).await.unwrap()[0].status,
        Status::Failed
    );
    // Shown, the redacted field is masked and the rest kept.
    let shown = request(addr, "GET", &event, &viewer).await.json();
    let payload: serde_json::Value =
        serde_json::from_str(shown["rows"][0]["payload"].as_str().unwrap()).unwrap();
    assert_eq!(payload, serde_json::json!({"email": "***", "n": 1}));
    // Issue 14.5: a bulk replay by filter, counted by a dry run first.
    let failed = serde_json::json!({ "status": "failed", "app_code": fx.app, "dry_run": true });
    let res = request_with(addr, "POST", "/api/replay", &viewer, Some(&failed)).await;
    assert_eq!(res.status, 403, "{}", res.body);
    let dry = request_with(addr, "POST", "/api/replay", &operator, Some(&failed))
        .await
        .json();
    assert_eq!(
        (dry["count"].as_u64(), dry["dry_run"].as_bool()),
        (Some(1), Some(true)),
        "{dry}"
    );
    assert!(!dry.to_string().contains("secret-mail"), "{dry}");
    assert_eq!(
        fx.store.find(&ev.event_id).await.unwrap()[0].status,
        Status::Failed,
        "a dry run changes nothing"
    );
    // Issue 14.1: a runtime control set by the operator, logged under its
    // token's name; a viewer may read but not set.
    let tick = serde_json::json!({ "app_code": "*", "event_type": "Tick", "max_retry_count": 0, "delivery": "at_most_once" });
    let res = request_with(addr, "POST", "/api/controls", &viewer, Some(&tick)).await;
    assert_eq!(res.status, 403, "{}", res.body);
    let res = request_with(addr, "POST", "/api/controls", &operator, Some(&tick)).await;
    assert_eq!(res.status, 200, "{}", res.body);
    let set = res.json();
    assert_eq!(
        (set["max_retry_count"].as_u64(), set["delivery"].as_str()),
        (Some(0), Some("at_most_once")),
        "{set}"
    );
    let blank = serde_json::json!({ "app_code": "", "event_type": "Tick", "paused": true });
    let res = request_with(addr, "POST", "/api/controls", &operator, Some(&blank)).await;
    assert_eq!(res.status, 400, "a blank app_code: {}", res.body);
    let shown = request(addr, "GET", "/api/controls", &viewer).await.json();
    assert_eq!(shown["controls"].as_array().unwrap().len(), 1, "{shown}");
    assert!(
        shown["log"][0]["by"]
            .as_str()
            .unwrap()
            .starts_with("api admin@"),
        "{shown}"
    );
    let clear = serde_json::json!({ "app_code": "*", "event_type": "Tick", "clear": true });
    let res = request_with(addr, "POST", "/api/controls", &operator, Some(&clear)).await;
    assert_eq!(res.json()["cleared"], true);
    // The operator's replay is recorded under its token's name.
    let res = request(addr, "POST", &replay, &operator).await;
    assert_eq!(res.status, 200, "{}", res.body);
    assert!(!res.body.contains("secret-mail"), "{}", res.body);
    let shown = request(addr, "GET", &event, &operator).await.json();
    let replayed = step(&shown, "replayed");
    assert!(
        replayed["detail"]
            .as_str()
            .unwrap()
            .starts_with("api admin@"),
        "{replayed}"
    );
    stop.cancel();
}

/// A database gone silent under the admin server: a call answers 503
/// after its bound, and the server still answers what needs no database.
/// The call waited for good, holding a connection of the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_database_never_answers_is_given_up() {
    let fx = fixture("api_silent", "api").await;
    let (proxy, through) = postbox_testkit::proxy::to_postgres().await;
    let store: Arc<dyn OutboxStore> = Arc::new(
        PgOutbox::connect(&through, &fx.table, 4)
            .await
            .expect("connect"),
    );
    let fx = Fixture { store, ..fx };
    let (addr, stop) = fx.serve(None).await;
    assert_eq!(request(addr, "GET", "/api/events", &[]).await.status, 200);
    // The search's statement (its text is sent once, with the search
    // filter): the database stops answering once it has it.
    proxy.silence_on(b"event_type = $");
    let search = "/api/events?event_type=Thing";
    let res = tokio::time::timeout(Duration::from_secs(60), request(addr, "GET", search, &[]))
        .await
        .expect("an answer");
    assert_eq!(res.status, 503, "{}", res.body);
    assert!(res.body.contains("no answer within 30s"), "{}", res.body);
    assert_eq!(proxy.silenced(), 1);
    assert_eq!(request(addr, "GET", "/healthz", &[]).await.status, 200);
    stop.cancel();
}

/// DNS rebinding: with no token, a request addressed to a host name (a
/// page elsewhere whose name now points here) reads nothing; one
/// addressed to the IP address does.
#[tokio::test]
async fn without_a_token_a_request_addressed_to_a_host_name_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fx = fixture("api_rebind", "api").await;
    fx.enqueue(1).await;
    let (addr, stop) = fx.serve(None).await;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        b"GET /api/events HTTP/1.1\r\nHost: evil.example:9464\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(
        answer.contains("addressed to `evil.example:9464`") && answer.contains("admin.token"),
        "{answer}"
    );
    assert!(!answer.contains("Thing"), "{answer}");
    assert_eq!(request(addr, "GET", "/api/events", &[]).await.status, 200);
    stop.cancel();
}
