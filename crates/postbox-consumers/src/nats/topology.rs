//! The stream, the dead-letter subject's stream and the durable consumer.

use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{
    ConsumerInfoErrorKind, CreateStreamErrorKind, GetStreamByNameErrorKind, GetStreamErrorKind,
};
use async_nats::jetstream::stream::{self, ConsumerErrorKind};
use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;
use postbox_core::config::ConsumerConfig;
use postbox_core::wire::nats::default_dead_subjects;
use postbox_core::Error;

/// The durable's `max_deliver`: unlimited. postbox counts the attempts
/// itself (the delivery count against `max_attempts`) and dead-letters the
/// message; a finite `max_deliver` would let the server drop a message whose
/// dead copy could not be stored for a while (dead stream full, leader
/// election), each failed try spending one delivery.
pub const MAX_DELIVER: i64 = -1;

/// Why the set-up failed.
pub(crate) enum SetupError {
    /// The server answered no: retrying cannot help.
    Fatal(Error),
    /// The server did not answer: reconnect and try again.
    Broken(String),
}

pub use postbox_core::wire::nats::{dead_stream, subject_matches};

/// Makes sure the stream and a home for dead copies exist (creating them when
/// `declare = true`), then returns the durable pull consumer (created or
/// updated when `declare = true`).
pub(crate) async fn prepare(
    js: &Context,
    config: &ConsumerConfig,
) -> Result<PullConsumer, SetupError> {
    let name = config.queue.as_str();
    let stream = match js.get_stream(name).await {
        Ok(s) => s,
        Err(e) if is_stream_not_found(e.kind()) => {
            let Some(subject) = config.subject.clone().filter(|_| config.declare) else {
                return Err(SetupError::Fatal(Error::config(
                    "stream",
                    format!("JetStream stream `{name}` does not exist: create it, or set declare = true and subject"),
                )));
            };
            create_stream(
                js,
                "stream",
                stream::Config {
                    name: name.to_owned(),
                    subjects: vec![subject.clone()],
                    ..Default::default()
                },
            )
            .await?;
            tracing::info!(stream = name, subject, "created JetStream stream");
            js.get_stream(name)
                .await
                .map_err(|e| SetupError::Broken(e.to_string()))?
        }
        Err(e) => {
            return Err(SetupError::Broken(format!(
                "looking up stream `{name}`: {e}"
            )))
        }
    };
    ensure_dead_home(js, config).await?;
    let durable = config.consumer_group();
    if config.declare {
        stream
            .create_consumer(pull::Config {
                durable_name: Some(durable.to_owned()),
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::Explicit,
                ack_wait: config.ack_wait.get(),
                max_deliver: MAX_DELIVER,
                filter_subject: config.subject.clone().unwrap_or_default(),
                ..Default::default()
            })
            .await
            .map_err(|e| consumer_error(config, e))
    } else {
        match stream.consumer_info(durable).await {
            Err(e) if matches!(e.kind(), ConsumerInfoErrorKind::NotFound) => {
                Err(SetupError::Fatal(Error::config(
                    "consumer_group",
                    format!(
                        "durable consumer `{durable}` does not exist on stream `{}`: create it, or set declare = true",
                        config.queue
                    ),
                )))
            }
            Err(e) => Err(SetupError::Broken(format!("looking up consumer `{durable}`: {e}"))),
            Ok(info) => {
                if info.config.max_deliver > 0 {
                    tracing::warn!(
                        consumer = config.name(),
                        durable,
                        max_deliver = info.config.max_deliver,
                        "the durable consumer has a finite max_deliver: while dead copies cannot be stored, the server may stop redelivering a message that is neither handled nor dead; set max_deliver = -1 (postbox counts attempts itself)"
                    );
                }
                stream
                .get_consumer(durable)
                .await
                .map_err(|e| SetupError::Broken(format!("binding consumer `{durable}`: {e}")))
            }
        }
    }
}

/// The dead subject must land in some stream, and not in one this consumer
/// reads (the copy would come back as a new message and loop).
async fn ensure_dead_home(js: &Context, config: &ConsumerConfig) -> Result<(), SetupError> {
    let dead = config.nats_dead_subject();
    match js.stream_by_subject(dead.clone()).await {
        Ok(owner) => {
            let filter = config.subject.as_deref().unwrap_or(">");
            if owner == config.queue && subject_matches(filter, &dead) {
                return Err(SetupError::Fatal(Error::config(
                    "dead_subject",
                    format!(
                        "`{dead}` is captured by stream `{owner}` and matches this consumer's filter `{filter}`: dead copies would be consumed again; choose a dead_subject outside the filter"
                    ),
                )));
            }
            Ok(())
        }
        Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
            if !config.declare {
                return Err(SetupError::Fatal(Error::config(
                    "dead_subject",
                    format!(
                        "no JetStream stream captures `{dead}`: create one, or set declare = true"
                    ),
                )));
            }
            let home = dead_stream(&config.queue);
            let subjects = if config.dead_subject.is_none() {
                default_dead_subjects(&config.queue)
            } else {
                dead.clone()
            };
            create_stream(
                js,
                "dead_subject",
                stream::Config {
                    name: home.clone(),
                    subjects: vec![subjects.clone()],
                    duplicate_window: Duration::from_secs(120),
                    ..Default::default()
                },
            )
            .await?;
            tracing::info!(stream = %home, subject = %subjects, "created JetStream stream for dead copies");
            Ok(())
        }
        Err(e) => Err(SetupError::Broken(format!(
            "looking up the stream of `{dead}`: {e}"
        ))),
    }
}

/// Creates a file-stored stream of `config`; a refusal is fatal and blamed
/// on the consumer setting `field`.
async fn create_stream(
    js: &Context,
    field: &str,
    config: stream::Config,
) -> Result<(), SetupError> {
    let (name, subjects) = (config.name.clone(), config.subjects.join(" "));
    js.create_stream(stream::Config {
        storage: stream::StorageType::File,
        ..config
    })
    .await
    .map(drop)
    .map_err(|e| {
        let refused = match e.kind() {
            CreateStreamErrorKind::JetStream(j) => refuses_for_good(&j),
            _ => false,
        };
        let why = format!("cannot create JetStream stream `{name}` for `{subjects}`: {e}");
        if refused {
            SetupError::Fatal(Error::config(field, why))
        } else {
            SetupError::Broken(why)
        }
    })
}

/// Whether a JetStream API error is an answer that stays the same when
/// asked again (a name taken, settings refused: 4xx), not a cluster's
/// passing state (no meta leader or quorum during a rolling restart,
/// "JetStream system temporarily unavailable", no suitable peers: 5xx),
/// which a consumer waits out like a lost connection.
fn refuses_for_good(e: &async_nats::jetstream::Error) -> bool {
    (400..500).contains(&e.code())
}

fn is_stream_not_found(kind: GetStreamErrorKind) -> bool {
    matches!(kind, GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

fn consumer_error(config: &ConsumerConfig, e: stream::ConsumerError) -> SetupError {
    let durable = config.consumer_group();
    match e.kind() {
        ConsumerErrorKind::JetStream(j) if refuses_for_good(&j) => SetupError::Fatal(Error::config(
            "consumer_group",
            format!(
                "JetStream refused durable consumer `{durable}` on stream `{}`: {j} (an existing consumer of that name with another filter or settings must be removed or renamed)",
                config.queue
            ),
        )),
        _ => SetupError::Broken(format!("setting up consumer `{durable}`: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(code: usize, err_code: u64, description: &str) -> async_nats::jetstream::Error {
        serde_json::from_value(
            serde_json::json!({ "code": code, "err_code": err_code, "description": description }),
        )
        .unwrap()
    }

    /// A cluster between leaders answers 5xx: the consumer waits it out.
    /// Every JetStream error stopped the consumer for good as a config
    /// error, the 503 of a rolling restart too.
    #[test]
    fn only_answers_that_stay_stop_the_consumer() {
        let config: ConsumerConfig = serde_json::from_value(serde_json::json!({
            "kind": "nats", "url": "nats://127.0.0.1:4222", "stream": "S", "consumer_group": "g",
        }))
        .unwrap();
        let unavailable = answer(503, 10008, "JetStream system temporarily unavailable");
        let taken = answer(400, 10148, "consumer already exists");
        for (e, fatal) in [
            (unavailable, false),
            (answer(500, 10005, "no suitable peers for placement"), false),
            (taken, true),
        ] {
            let error = stream::ConsumerError::with_source(
                ConsumerErrorKind::JetStream(e.clone()),
                e.clone(),
            );
            let end = consumer_error(&config, error);
            assert_eq!(matches!(end, SetupError::Fatal(_)), fatal, "{e}");
        }
    }
}
