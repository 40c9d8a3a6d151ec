//! Gathering the topology ([`postbox_core::topology`]) of checked settings:
//! the event types of the latest rows of each app_code, and what the NATS
//! and Redis servers the config names say about their streams, consumers
//! and groups. Read-only, bounded (at most [`ROWS_PER_APP`] rows per
//! app_code, through the primary key; one request per stream), each broker
//! asked within [`BROKER_TIMEOUT`].

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use postbox_core::config::{ConsumerKind, PublisherConfig, Settings};
use postbox_core::store::{EventFilter, OutboxStore};
use postbox_core::topology::{BrokerFacts, EventKind, NatsStream, RedisStream, Topology};
use postbox_core::{BoxFuture, Error, EventRecord};

/// Rows read per app_code to see its event types.
pub const ROWS_PER_APP: u32 = 1_000;

/// How long one broker may take to answer.
pub const BROKER_TIMEOUT: Duration = Duration::from_secs(5);

/// The topology of `settings` with the event types `store` holds.
pub fn gather<'a>(
    settings: &'a Settings,
    store: &'a dyn OutboxStore,
) -> BoxFuture<'a, Result<Topology, Error>> {
    Box::pin(async move {
        let mut kinds = Vec::new();
        let app_codes = match settings.app_codes_or_default(Vec::new()) {
            codes if codes.is_empty() => store.present_app_codes().await?,
            codes => codes,
        };
        for app_code in app_codes {
            let rows = store
                .list(&EventFilter {
                    app_code: Some(app_code.clone()),
                    limit: ROWS_PER_APP,
                    ..EventFilter::default()
                })
                .await?;
            let types: BTreeSet<String> = rows.into_iter().map(|r| r.event_type).collect();
            kinds.extend(types.into_iter().map(|event_type| EventKind {
                app_code: app_code.clone(),
                event_type,
            }));
        }
        let facts = facts(settings, &kinds).await;
        Ok(Topology::build(
            kinds,
            &settings.publishers,
            &settings.consumers,
            facts,
        ))
    })
}

/// What the NATS and Redis servers say about the streams the config names.
async fn facts(settings: &Settings, kinds: &[EventKind]) -> BrokerFacts {
    let mut facts = BrokerFacts::default();
    // NATS: (url, stream) of every publisher and consumer.
    let mut nats: BTreeSet<(String, String)> = BTreeSet::new();
    for p in &settings.publishers {
        if let PublisherConfig::Nats(c) = p {
            nats.insert((c.url.expose().to_owned(), c.stream.clone()));
        }
    }
    for c in &settings.consumers {
        if c.kind == ConsumerKind::Nats {
            nats.insert((c.url.expose().to_owned(), c.queue.clone()));
        }
    }
    for (url, stream) in nats {
        match ask("NATS", &url, &stream, nats_stream(&url, &stream)).await {
            Ok(Some(s)) => facts.nats.push(s),
            Ok(None) => facts
                .unreachable
                .push(format!("NATS stream `{stream}` does not exist")),
            Err(why) => facts.unreachable.push(why),
        }
    }
    // Redis: each publisher's streams for the app_codes seen.
    let mut redis: BTreeSet<(String, String)> = BTreeSet::new();
    for p in &settings.publishers {
        if let PublisherConfig::Redis(c) = p {
            for k in kinds {
                let record = EventRecord {
                    app_code: k.app_code.clone(),
                    event_type: k.event_type.clone(),
                    ..EventRecord::default()
                };
                redis.insert((c.url.expose().to_owned(), c.stream.render(&record)));
            }
        }
    }
    for (url, stream) in redis {
        match ask("Redis", &url, &stream, redis_groups(&url, &stream)).await {
            Ok(groups) => facts.redis.push(RedisStream { stream, groups }),
            Err(why) => facts.unreachable.push(why),
        }
    }
    facts
}

/// The answer of `question` to the `broker` at `url` about `stream`
/// within [`BROKER_TIMEOUT`], or why there is none, naming both (the URL
/// without credentials).
async fn ask<T>(
    broker: &str,
    url: &str,
    stream: &str,
    question: impl std::future::Future<Output = Result<T, String>>,
) -> Result<T, String> {
    let why = |e: String| {
        let url = postbox_core::redact::redact_url(url);
        format!("{broker} {url} (stream `{stream}`): {e}")
    };
    match tokio::time::timeout(BROKER_TIMEOUT, question).await {
        Ok(answer) => answer.map_err(why),
        Err(_) => Err(why(format!("no answer within {BROKER_TIMEOUT:?}"))),
    }
}

/// The stream's subjects and consumers; `None` when it does not exist.
async fn nats_stream(url: &str, name: &str) -> Result<Option<NatsStream>, String> {
    let (options, servers) =
        postbox_consumers::nats::connect_options(&[postbox_core::redact::SecretUrl::new(url)])?;
    let client = options
        .name("postbox-topology")
        .connect(servers)
        .await
        .map_err(|e| e.to_string())?;
    let js = async_nats::jetstream::new(client);
    let mut stream = match js.get_stream(name).await {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                async_nats::jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e.to_string()),
    };
    let subjects = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .config
        .subjects
        .clone();
    let mut consumers = Vec::new();
    let mut list = stream.consumers();
    while let Some(info) = list.next().await {
        let info = info.map_err(|e| e.to_string())?;
        let mut filters = info.config.filter_subjects.clone();
        if !info.config.filter_subject.is_empty() {
            filters.push(info.config.filter_subject.clone());
        }
        consumers.push((info.name, filters));
    }
    consumers.sort();
    Ok(Some(NatsStream {
        name: name.to_owned(),
        subjects,
        consumers,
    }))
}

/// The stream's consumer groups (none when the stream does not exist).
async fn redis_groups(url: &str, stream: &str) -> Result<Vec<String>, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let reply: redis::RedisResult<Vec<std::collections::HashMap<String, redis::Value>>> =
        redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(stream)
            .query_async(&mut conn)
            .await;
    let groups = match reply {
        Ok(groups) => groups,
        Err(e) if e.to_string().contains("no such key") => return Ok(Vec::new()),
        Err(e) => return Err(e.to_string()),
    };
    let mut names: Vec<String> = groups
        .iter()
        .filter_map(|g| redis::from_redis_value_ref::<String>(g.get("name")?).ok())
        .collect();
    names.sort();
    Ok(names)
}
