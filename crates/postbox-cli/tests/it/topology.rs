//! Issue 14.6: `postbox topology` and `/api/topology` show each event type
//! of the outbox through each publisher to what takes it: a RabbitMQ queue
//! by its declared binding, a NATS durable consumer (read from the server)
//! by its filter, a Redis consumer group (read from the server), and a
//! consumer of the config that nothing reaches.

use crate::common;

use postbox_core::NewEvent;
use postbox_testkit::servers::{amqp_url, nats_url, redis_url, scratch_table};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_follows_each_event_type_to_its_takers() {
    let (url, store) = common::server_outbox("postgres", "topo", 2).await;
    let table = store.table().as_str().to_owned();
    let events = vec![
        NewEvent::new("room", "RoomCreated", "{}"),
        NewEvent::new("room", "RoomClosed", "{}"),
        NewEvent::new("wallet", "WalletCredited", "{}"),
    ];
    store
        .enqueue_batch(&events, 1 << 20)
        .await
        .expect("enqueue");

    let scratch = scratch_table("topo");
    let stream = format!("T_{scratch}");
    // The broker's own consumers: a NATS durable taking RoomCreated only, a
    // Redis group on the room stream.
    let nats = async_nats::connect(nats_url()).await.expect("NATS");
    let js = async_nats::jetstream::new(nats);
    let s = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{scratch}.>")],
            ..Default::default()
        })
        .await
        .expect("create the stream");
    s.create_consumer(async_nats::jetstream::consumer::pull::Config {
        durable_name: Some("im".into()),
        filter_subject: format!("{scratch}.room.RoomCreated"),
        ..Default::default()
    })
    .await
    .expect("create the durable");
    let redis_client = redis::Client::open(redis_url()).unwrap();
    let mut r = redis_client
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let room_stream = format!("{scratch}.room");
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&room_stream)
        .arg("search")
        .arg("$")
        .arg("MKSTREAM")
        .query_async(&mut r)
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let config = common::write_config(
        dir.path(),
        &format!(
            r#"[database]
url = "{url}"
table = "{table}"
app_codes = ["room", "wallet"]

[[publishers]]
kind = "rabbitmq"
url = "{amqp}"
exchange = "{scratch}"
routing_key = "{{app_code}}.{{event_type}}"

[[publishers]]
kind = "nats"
url = "{nats}"
stream = "{stream}"
subject = "{scratch}.{{app_code}}.{{event_type}}"

[[publishers]]
kind = "redis"
url = "{redis}"
stream = "{scratch}.{{app_code}}"

[[consumers]]
kind = "rabbitmq"
url = "{amqp}"
queue = "{scratch}_activity"
bindings = [{{ exchange = "{scratch}", routing_key = "room.#" }}]

[[consumers]]
kind = "rabbitmq"
url = "{amqp}"
queue = "{scratch}_orders"
bindings = [{{ exchange = "{scratch}", routing_key = "order.#" }}]
"#,
            amqp = amqp_url(),
            nats = nats_url(),
            redis = redis_url(),
        ),
    );
    let out = common::run(
        dir.path(),
        &["--config", &config, "--json", "topology"],
        &[],
    );
    common::assert_ok(&out);
    let t = common::json(&out);
    let route = |ty: &str, p: &str| -> serde_json::Value {
        t["routes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["event_type"] == ty && r["publisher"] == p)
            .cloned()
            .unwrap_or_else(|| panic!("no route of {ty} through {p}: {t}"))
    };
    let takers = |r: &serde_json::Value| -> Vec<String> {
        r["subscribers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s["name"].as_str().unwrap(),
                    s["source"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(t["event_types"].as_array().unwrap().len(), 3, "{t}");
    let created = route("RoomCreated", "rabbitmq");
    assert_eq!(
        created["target"],
        format!("exchange `{scratch}`, routing key `room.RoomCreated`")
    );
    assert_eq!(takers(&created), [format!("{scratch}_activity/config")]);
    assert!(
        takers(&route("WalletCredited", "rabbitmq")).is_empty(),
        "{t}"
    );
    assert_eq!(takers(&route("RoomCreated", "nats")), ["im/broker"]);
    assert!(
        takers(&route("RoomClosed", "nats")).is_empty(),
        "the filter of im: {t}"
    );
    assert_eq!(takers(&route("RoomClosed", "redis")), ["search/broker"]);
    assert_eq!(
        route("RoomClosed", "redis")["target"],
        format!("stream `{room_stream}`")
    );
    assert!(takers(&route("WalletCredited", "redis")).is_empty(), "{t}");
    assert_eq!(
        t["idle_consumers"],
        serde_json::json!([format!("{scratch}_orders")])
    );
    assert_eq!(t["brokers"]["unreachable"], serde_json::json!([]), "{t}");

    // The text form says the same.
    let out = common::run(dir.path(), &["--config", &config, "topology"], &[]);
    common::assert_says(
        &out,
        &[
            "RoomCreated (room)",
            &format!("→ {scratch}_activity via binding `room.#` (config)"),
            "→ im via filter",
            "→ nobody this config or the broker knows of",
            &format!("consumer `{scratch}_orders`: no route"),
        ],
    );

    js.delete_stream(&stream).await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&room_stream)
        .query_async(&mut r)
        .await
        .unwrap();
}
