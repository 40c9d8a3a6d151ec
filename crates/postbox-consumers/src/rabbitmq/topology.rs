//! `<queue>`, `<queue>.retry`, `<queue>.dead` and the bindings.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};
use postbox_core::config::{ConsumerConfig, QueueType};
use postbox_core::wire::rabbitmq::{DEAD_LETTER_EXCHANGE, DEAD_LETTER_ROUTING_KEY, QUEUE_TYPE};

pub use postbox_core::wire::rabbitmq::{dead_queue, retry_queue};

/// Declares the queue, its retry and dead twins and its bindings (exchanges
/// are declared as durable `topic` exchanges, as the RabbitMQ publisher
/// declares them). Idempotent; a queue that exists with other arguments is
/// an error from the broker.
pub async fn declare_topology(channel: &Channel, config: &ConsumerConfig) -> lapin::Result<()> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let queue = config.queue.as_str();
    let typed = |mut args: FieldTable| {
        if config.queue_type != QueueType::Classic {
            let kind = LongString::from(config.queue_type.as_str());
            args.insert(QUEUE_TYPE.into(), AMQPValue::LongString(kind));
        }
        args
    };
    channel
        .queue_declare(queue.into(), durable, typed(FieldTable::default()))
        .await?;
    channel
        .queue_declare(
            retry_queue(queue).into(),
            durable,
            typed(retry_arguments(queue)),
        )
        .await?;
    channel
        .queue_declare(
            dead_queue(queue).into(),
            durable,
            typed(FieldTable::default()),
        )
        .await?;
    for b in &config.bindings {
        channel
            .exchange_declare(
                b.exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                queue.into(),
                b.exchange.as_str().into(),
                b.routing_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// What [`check_topology`] found.
#[derive(Debug)]
pub enum TopologyError {
    /// A queue is missing or set up so that messages would be lost: retrying
    /// cannot help.
    Refused(String),
    /// The connection broke while checking.
    Broken(lapin::Error),
}

/// The arguments `<queue>.retry` needs: expired copies go back to `<queue>`
/// through the default exchange.
fn retry_arguments(queue: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        DEAD_LETTER_EXCHANGE.into(),
        AMQPValue::LongString(LongString::from("")),
    );
    args.insert(
        DEAD_LETTER_ROUTING_KEY.into(),
        AMQPValue::LongString(LongString::from(queue)),
    );
    args
}

/// Checks, for `declare = false`, the topology the consumer relies on without
/// changing it: `<queue>`, `<queue>.retry` and `<queue>.dead` exist (passive
/// declares), and `<queue>.retry` dead-letters to `<queue>` through the
/// default exchange.
///
/// AMQP does not report a queue's arguments, so the retry queue is declared
/// again with the expected ones: the broker answers declare-ok only when they
/// are equivalent (then nothing changes) and otherwise refuses with
/// `PRECONDITION_FAILED`, naming the first argument that differs. A
/// difference in an argument postbox does not set (`x-queue-type`,
/// `x-max-length`, `durable`…) is copied from the broker's answer and the
/// probe repeated, so only the dead-letter arguments can fail the check. Every
/// probe runs on its own channel (a refusal closes the channel). A user
/// without the `configure` permission cannot probe: that is logged and the
/// check passes on the passive declares alone.
pub async fn check_topology(conn: &Connection, queue: &str) -> Result<(), TopologyError> {
    let retry = retry_queue(queue);
    for q in [queue.to_owned(), retry.clone(), dead_queue(queue)] {
        let ch = conn.create_channel().await.map_err(TopologyError::Broken)?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match ch
            .queue_declare(q.as_str().into(), passive, FieldTable::default())
            .await
        {
            Ok(_) => {
                let _ = ch.close(200, "checked".into()).await;
            }
            Err(e) if e.is_amqp_soft_error() => {
                return Err(TopologyError::Refused(format!(
                    "queue `{q}` cannot be used ({e}): declare it (with `{retry}` dead-lettering to `{queue}`, and `{queue}.dead`), or set declare = true"
                )));
            }
            Err(e) => return Err(TopologyError::Broken(e)),
        }
    }
    let mut options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let mut args = retry_arguments(queue);
    for _ in 0..16 {
        let ch = conn.create_channel().await.map_err(TopologyError::Broken)?;
        let e = match ch
            .queue_declare(retry.as_str().into(), options, args.clone())
            .await
        {
            Ok(_) => {
                let _ = ch.close(200, "checked".into()).await;
                return Ok(());
            }
            Err(e) if e.is_amqp_soft_error() => e,
            Err(e) => return Err(TopologyError::Broken(e)),
        };
        let text = e.to_string();
        let Some(arg) = inequivalent_argument(&text) else {
            tracing::warn!(
                queue = %retry,
                error = %text,
                "cannot verify the arguments of the retry queue (the probe needs the configure permission); make sure it has x-dead-letter-exchange = \"\" and x-dead-letter-routing-key = \"{queue}\"",
            );
            return Ok(());
        };
        match arg {
            DEAD_LETTER_EXCHANGE | DEAD_LETTER_ROUTING_KEY => {
                let said = text
                    .split_once("PRECONDITION_FAILED - ")
                    .map_or(text.as_str(), |(_, said)| said);
                return Err(TopologyError::Refused(format!(
                    "queue `{retry}` does not dead-letter back to `{queue}`: its argument {arg} is missing or differs (RabbitMQ: {said}), so retried messages would be lost. Recreate it with x-dead-letter-exchange = \"\" and x-dead-letter-routing-key = \"{queue}\" (or delete it and set declare = true)"
                )));
            }
            "durable" => options.durable = !options.durable,
            "auto_delete" => options.auto_delete = !options.auto_delete,
            other => match current_value(&text) {
                Some(value) => {
                    args.insert(other.into(), value);
                }
                None => {
                    tracing::warn!(
                        queue = %retry,
                        error = %text,
                        "cannot verify the dead-letter arguments of the retry queue past its argument `{other}`; make sure it has x-dead-letter-exchange = \"\" and x-dead-letter-routing-key = \"{queue}\"",
                    );
                    return Ok(());
                }
            },
        }
    }
    tracing::warn!(queue = %retry, "gave up verifying the arguments of the retry queue");
    Ok(())
}

/// `inequivalent arg 'NAME' for queue …` → `NAME`.
fn inequivalent_argument(text: &str) -> Option<&str> {
    let rest = &text[text.find("inequivalent arg '")? + "inequivalent arg '".len()..];
    Some(&rest[..rest.find('\'')?])
}

/// `… but current is the value 'V' of type 'T'` → `V` as an AMQP value of
/// type `T` (`None` when the queue lacks the argument or the type is not
/// one a queue argument uses).
fn current_value(text: &str) -> Option<AMQPValue> {
    const MARK: &str = "but current is the value '";
    let rest = &text[text.find(MARK)? + MARK.len()..];
    let (value, rest) = rest.split_once("' of type '")?;
    let kind = &rest[..rest.find('\'')?];
    Some(match kind {
        "longstr" => AMQPValue::LongString(LongString::from(value)),
        "long" => AMQPValue::LongLongInt(value.parse().ok()?),
        "signedint" => AMQPValue::LongInt(value.parse().ok()?),
        "short" => AMQPValue::ShortInt(value.parse().ok()?),
        "byte" => AMQPValue::ShortShortInt(value.parse().ok()?),
        "bool" => AMQPValue::Boolean(value.parse().ok()?),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_broker_s_inequivalence_reply() {
        let missing = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q.retry' in vhost '/': received the value '' of type 'longstr' but current is none";
        assert_eq!(
            inequivalent_argument(missing),
            Some("x-dead-letter-exchange")
        );
        assert_eq!(current_value(missing), None);
        let other = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q.retry' in vhost '/': received none but current is the value 'quorum' of type 'longstr'";
        assert_eq!(inequivalent_argument(other), Some("x-queue-type"));
        assert_eq!(
            current_value(other),
            Some(AMQPValue::LongString(LongString::from("quorum")))
        );
        let ttl = "inequivalent arg 'x-max-length' for queue 'q.retry' in vhost '/': received none but current is the value '100' of type 'signedint'";
        assert_eq!(current_value(ttl), Some(AMQPValue::LongInt(100)));
        assert_eq!(inequivalent_argument("ACCESS_REFUSED - no"), None);
    }
}
