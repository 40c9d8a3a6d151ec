//! Who publishes what, and who consumes it (seed 004: "which systems
//! publish which topics, who subscribes"): for each event type the outbox
//! holds, each publisher's target (exchange and routing key, subject and
//! stream, Redis stream, webhook, file) and the queues, durable consumers
//! and consumer groups that take it.
//!
//! [`Topology::build`] is pure: the event types seen, the configured
//! publishers and consumers, and what the brokers said about themselves
//! ([`BrokerFacts`]: NATS streams with their durable consumers, Redis
//! streams with their groups). RabbitMQ's bindings come from the
//! consumers' declared `bindings` (AMQP cannot list them; the management
//! API is not assumed).

use serde::Serialize;

use crate::config::{ConsumerConfig, ConsumerKind, PublisherConfig};
use crate::wire::nats::subject_matches;
use crate::EventRecord;

/// One event type of one app_code, as the outbox holds it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct EventKind {
    /// The app_code.
    pub app_code: String,
    /// The event type.
    pub event_type: String,
}

/// A NATS stream as the server describes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NatsStream {
    /// The stream's name.
    pub name: String,
    /// The subjects it captures.
    pub subjects: Vec<String>,
    /// Its consumers: name and filter subjects (none: every subject).
    pub consumers: Vec<(String, Vec<String>)>,
}

/// A Redis stream as the server describes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RedisStream {
    /// The stream key.
    pub stream: String,
    /// Its consumer groups.
    pub groups: Vec<String>,
}

/// What the brokers said about themselves.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BrokerFacts {
    /// NATS streams the publishers and consumers name.
    pub nats: Vec<NatsStream>,
    /// Redis streams the publishers write.
    pub redis: Vec<RedisStream>,
    /// Brokers that could not be asked, and why.
    pub unreachable: Vec<String>,
}

/// One taker of a route.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Subscriber {
    /// The queue (RabbitMQ), durable consumer (NATS), consumer group (Redis).
    pub name: String,
    /// How it takes the route: the binding pattern, the filter subject, or
    /// the group.
    pub via: String,
    /// `config` (a `[[consumers]]` entry of this config) or `broker` (the
    /// broker's own description).
    pub source: &'static str,
}

/// One event type through one publisher.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Route {
    /// The app_code.
    pub app_code: String,
    /// The event type.
    pub event_type: String,
    /// The publisher's name.
    pub publisher: String,
    /// The publisher's kind.
    pub kind: &'static str,
    /// Where it goes: `exchange X, routing key K`, `subject S (stream T)`,
    /// `stream S`, the webhook's URL (without credentials), the file.
    pub target: String,
    /// Who takes it; empty when nobody this config or the broker knows of.
    pub subscribers: Vec<Subscriber>,
}

/// Who publishes what, and who consumes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Topology {
    /// The event types seen (the latest rows of each app_code).
    pub event_types: Vec<EventKind>,
    /// Each event type through each publisher.
    pub routes: Vec<Route>,
    /// Consumers of this config that no route reaches (a binding or filter
    /// that matches no event type seen).
    pub idle_consumers: Vec<String>,
    /// What the brokers said.
    pub brokers: BrokerFacts,
}

impl Topology {
    /// The topology of `event_types` through `publishers` to `consumers`
    /// and what the brokers said (`facts`).
    pub fn build(
        mut event_types: Vec<EventKind>,
        publishers: &[PublisherConfig],
        consumers: &[ConsumerConfig],
        facts: BrokerFacts,
    ) -> Topology {
        event_types.sort();
        event_types.dedup();
        let mut routes = Vec::new();
        let mut reached = vec![false; consumers.len()];
        for kind in &event_types {
            let record = EventRecord {
                app_code: kind.app_code.clone(),
                event_type: kind.event_type.clone(),
                aggregate_id: Some("{aggregate_id}".to_owned()),
                ..EventRecord::default()
            };
            for p in publishers {
                let (target, mut subscribers) =
                    route_of(p, &record, consumers, &facts, &mut reached);
                subscribers.sort();
                subscribers.dedup_by(|a, b| a.name == b.name);
                routes.push(Route {
                    app_code: kind.app_code.clone(),
                    event_type: kind.event_type.clone(),
                    publisher: p.name().to_owned(),
                    kind: p.kind(),
                    target,
                    subscribers,
                });
            }
        }
        let idle_consumers = consumers
            .iter()
            .zip(&reached)
            .filter(|(_, r)| !**r)
            .map(|(c, _)| c.name().to_owned())
            .collect();
        Topology {
            event_types,
            routes,
            idle_consumers,
            brokers: facts,
        }
    }
}

/// Where `p` sends `record`, and who takes it there (marking the
/// `consumers` it reaches).
fn route_of(
    p: &PublisherConfig,
    record: &EventRecord,
    consumers: &[ConsumerConfig],
    facts: &BrokerFacts,
    reached: &mut [bool],
) -> (String, Vec<Subscriber>) {
    let mut subscribers = Vec::new();
    // A consumer of this config takes the route.
    let mut take = |subscribers: &mut Vec<Subscriber>, i: usize, s: Subscriber| {
        reached[i] = true;
        subscribers.push(s);
    };
    let target = match p {
        PublisherConfig::Rabbitmq(c) => {
            let key = c.routing_key.render(record);
            for (i, consumer) in consumers.iter().enumerate() {
                if consumer.kind != ConsumerKind::Rabbitmq {
                    continue;
                }
                if let Some(b) = consumer
                    .bindings
                    .iter()
                    .find(|b| b.exchange == c.exchange && topic_matches(&b.routing_key, &key))
                {
                    take(
                        &mut subscribers,
                        i,
                        Subscriber {
                            name: consumer.queue.clone(),
                            via: format!("binding `{}`", b.routing_key),
                            source: "config",
                        },
                    );
                }
            }
            format!("exchange `{}`, routing key `{key}`", c.exchange)
        }
        PublisherConfig::Nats(c) => {
            let subject = c
                .subject
                .render_escaped(record, crate::wire::nats::subject_token);
            for s in facts.nats.iter().filter(|s| s.name == c.stream) {
                for (name, filters) in &s.consumers {
                    if filters.is_empty() || filters.iter().any(|f| subject_matches(f, &subject)) {
                        let via = if filters.is_empty() {
                            "every subject".to_owned()
                        } else {
                            format!("filter `{}`", filters.join("`, `"))
                        };
                        subscribers.push(Subscriber {
                            name: name.clone(),
                            via,
                            source: "broker",
                        });
                    }
                }
            }
            for (i, consumer) in consumers.iter().enumerate() {
                let filter = consumer.subject.clone().unwrap_or_else(|| ">".to_owned());
                if consumer.kind == ConsumerKind::Nats
                    && consumer.queue == c.stream
                    && subject_matches(&filter, &subject)
                {
                    take(
                        &mut subscribers,
                        i,
                        Subscriber {
                            name: consumer.consumer_group().to_owned(),
                            via: format!("filter `{filter}`"),
                            source: "config",
                        },
                    );
                }
            }
            format!("subject `{subject}` (stream `{}`)", c.stream)
        }
        PublisherConfig::Redis(c) => {
            let stream = c.stream.render(record);
            for s in facts.redis.iter().filter(|s| s.stream == stream) {
                for g in &s.groups {
                    subscribers.push(Subscriber {
                        name: g.clone(),
                        via: "consumer group".to_owned(),
                        source: "broker",
                    });
                }
            }
            for (i, consumer) in consumers.iter().enumerate() {
                if consumer.kind == ConsumerKind::Redis && consumer.queue == stream {
                    take(
                        &mut subscribers,
                        i,
                        Subscriber {
                            name: consumer.consumer_group().to_owned(),
                            via: "consumer group".to_owned(),
                            source: "config",
                        },
                    );
                }
            }
            format!("stream `{stream}`")
        }
        // As the publisher's errors show it: a webhook's secret is often
        // in its path or query (Slack, Discord, Azure Functions' `?code=`).
        PublisherConfig::Webhook(c) => format!("POST {}", crate::redact::shown_url(c.url.expose())),
        PublisherConfig::File(c) => format!("file `{}`", c.path),
    };
    (target, subscribers)
}

/// Whether the AMQP topic binding `pattern` matches routing key `key`: words
/// split by `.`, `*` one word, `#` zero or more.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    fn go(p: &[&str], k: &[&str]) -> bool {
        match p.split_first() {
            None => k.is_empty(),
            Some((&"#", rest)) => (0..=k.len()).any(|n| go(rest, &k[n..])),
            Some((&"*", rest)) => !k.is_empty() && go(rest, &k[1..]),
            Some((w, rest)) => k.first() == Some(w) && go(rest, &k[1..]),
        }
    }
    let p: Vec<&str> = pattern.split('.').collect();
    let k: Vec<&str> = key.split('.').collect();
    go(&p, &k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns_match_like_rabbitmq() {
        assert!(topic_matches("#", "room.RoomCreated"));
        assert!(topic_matches("room.#", "room.RoomCreated"));
        assert!(topic_matches("room.#", "room"));
        assert!(topic_matches("*.RoomCreated", "room.RoomCreated"));
        assert!(!topic_matches("*.RoomCreated", "room.x.RoomCreated"));
        assert!(topic_matches("#.RoomCreated", "a.b.RoomCreated"));
        assert!(!topic_matches("wallet.#", "room.RoomCreated"));
        assert!(topic_matches("RoomCreated", "RoomCreated"));
        assert!(!topic_matches("room.*", "room"));
    }

    fn config<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn routes_reach_the_queues_streams_and_groups_that_take_them() {
        let publishers: Vec<PublisherConfig> = vec![
            config(
                serde_json::json!({"kind": "rabbitmq", "url": "amqp://h", "exchange": "ex", "routing_key": "{app_code}.{event_type}"}),
            ),
            config(
                serde_json::json!({"kind": "nats", "url": "nats://h", "stream": "ROOMS", "subject": "rooms.{event_type}"}),
            ),
            config(
                serde_json::json!({"kind": "redis", "url": "redis://h", "stream": "postbox.{app_code}"}),
            ),
        ];
        let consumers: Vec<ConsumerConfig> = vec![
            config(
                serde_json::json!({"kind": "rabbitmq", "url": "amqp://h", "queue": "activity", "bindings": [{"exchange": "ex", "routing_key": "room.#"}]}),
            ),
            config(
                serde_json::json!({"kind": "rabbitmq", "url": "amqp://h", "queue": "wallet", "bindings": [{"exchange": "ex", "routing_key": "wallet.#"}]}),
            ),
            config(
                serde_json::json!({"kind": "nats", "url": "nats://h", "queue": "ROOMS", "subject": "rooms.RoomCreated", "consumer_group": "im"}),
            ),
        ];
        let facts = BrokerFacts {
            nats: vec![NatsStream {
                name: "ROOMS".into(),
                subjects: vec!["rooms.*".into()],
                consumers: vec![
                    ("im".into(), vec!["rooms.RoomCreated".into()]),
                    ("all".into(), vec![]),
                ],
            }],
            redis: vec![RedisStream {
                stream: "postbox.room".into(),
                groups: vec!["search".into()],
            }],
            unreachable: vec![],
        };
        let kinds = vec![
            EventKind {
                app_code: "room".into(),
                event_type: "RoomCreated".into(),
            },
            EventKind {
                app_code: "room".into(),
                event_type: "RoomClosed".into(),
            },
            EventKind {
                app_code: "room".into(),
                event_type: "RoomCreated".into(),
            },
        ];
        let t = Topology::build(kinds, &publishers, &consumers, facts);
        assert_eq!(t.event_types.len(), 2, "deduplicated");
        let route = |ty: &str, p: &str| {
            t.routes
                .iter()
                .find(|r| r.event_type == ty && r.publisher == p)
                .unwrap()
        };
        let amqp = route("RoomCreated", "rabbitmq");
        assert_eq!(amqp.target, "exchange `ex`, routing key `room.RoomCreated`");
        let names: Vec<&str> = amqp.subscribers.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["activity"]);
        let nats = route("RoomCreated", "nats");
        assert_eq!(nats.target, "subject `rooms.RoomCreated` (stream `ROOMS`)");
        let names: Vec<&str> = nats.subscribers.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["all", "im"],
            "the broker's consumers, the config's merged"
        );
        let closed = route("RoomClosed", "nats");
        let names: Vec<&str> = closed.subscribers.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["all"], "the filter of `im` takes RoomCreated only");
        let redis = route("RoomClosed", "redis");
        assert_eq!(redis.target, "stream `postbox.room`");
        assert_eq!(redis.subscribers[0].name, "search");
        assert_eq!(t.idle_consumers, ["wallet"]);
    }

    /// A webhook's route shows its URL as the publisher's errors do: its
    /// path token and query hidden (it showed them, to any viewer of
    /// `/api/topology`).
    #[test]
    fn a_webhook_route_hides_the_url_s_secrets() {
        let publishers: Vec<PublisherConfig> = vec![config(serde_json::json!({
            "kind": "webhook",
            "url": "https://u:pw@hooks.example/services/T01/B02/abcdefghijklmnopqrstuvwx?code=s3cret"
        }))];
        let kinds = vec![EventKind {
            app_code: "room".into(),
            event_type: "RoomCreated".into(),
        }];
        let t = Topology::build(kinds, &publishers, &[], BrokerFacts::default());
        assert_eq!(
            t.routes[0].target,
            "POST https://u:***@hooks.example/services/T01/B02/***"
        );
    }
}
