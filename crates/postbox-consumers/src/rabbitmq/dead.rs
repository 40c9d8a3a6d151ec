//! `postbox dead` on RabbitMQ: a pass over `<queue>.dead`.
//!
//! The letters are read with `basic.get` without acking, as many as the
//! queue held when the pass began (a letter dead-lettered meanwhile waits
//! for the next pass). A letter the pass takes is acked once it is done
//! with (replayed and confirmed, or purged); every other one stays unacked
//! until the pass closes its channel, when the broker puts them back in
//! their places. RabbitMQ has no id for a message, so a letter's
//! `position` is its place in the queue at the time of reading.
//!
//! A replay takes an event once per pass. A replayed letter the handler
//! refuses again comes back to the end of `<queue>.dead` while the pass
//! still reads, and is read in place of a letter the broker has not put
//! back yet (one an earlier pass held, say): that copy is the new failure,
//! left where it is, not replayed again.

use std::collections::HashSet;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

use super::message::{confirmed, headers_json, message_from_delivery, replay_properties};
use crate::dead::letter::{DeadAction, DeadLetter, DeadReport, Failed, Pass};
use postbox_core::wire::rabbitmq::dead_queue;

pub(crate) async fn run(pass: &Pass<'_>) -> Result<DeadReport, Failed> {
    let queue = pass.config.queue.clone();
    let dead = dead_queue(&queue);
    let props = ConnectionProperties::default().with_connection_name(
        format!("postbox-dead-{}", crate::consume::consumer_tag(&queue)).into(),
    );
    let (conn, _) = super::connect(pass.config.nodes(), 0, props)
        .await
        .map_err(|e| (dead.clone(), format!("connecting: {e}")))?;
    let result = pass_over(&conn, pass, &queue, &dead).await;
    // Letters read and not taken go back to their places with the channel.
    let _ = conn.close(200, "dead-letter pass done".into()).await;
    result.map_err(|e| (dead, e))
}

async fn pass_over(
    conn: &Connection,
    pass: &Pass<'_>,
    queue: &str,
    dead: &str,
) -> Result<DeadReport, String> {
    let reading = conn.create_channel().await.map_err(|e| e.to_string())?;
    let publishing = conn.create_channel().await.map_err(|e| e.to_string())?;
    publishing
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let held = reading
        .queue_declare(
            dead.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("{dead} does not exist ({e}); is the consumer declared?"))?
        .message_count();
    let mut report = DeadReport::new(dead.to_owned());
    let mut replayed: HashSet<String> = HashSet::new();
    for place in 1..=u64::from(held) {
        let Some(got) = reading
            .basic_get(dead.into(), BasicGetOptions { no_ack: false })
            .await
            .map_err(|e| format!("reading: {e}"))?
        else {
            break;
        };
        let d = got.delivery;
        let parsed = message_from_delivery(&d.properties, d.routing_key.as_str(), &d.data, false)
            .map(|m| m.envelope);
        let letter = DeadLetter::of(
            place.to_string(),
            parsed,
            headers_json(&d.properties),
            &d.data,
            None,
        );
        let again = |id: &String| pass.action == DeadAction::Replay && replayed.contains(id);
        if letter.event_id.as_ref().is_some_and(again) {
            // Back from this pass's own replay: read, not taken.
            report.scanned += 1;
        } else if report.saw(&letter, pass.filter, pass.action) && pass.writes() {
            if pass.action == DeadAction::Replay {
                let confirm = publishing
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &d.data,
                        replay_properties(&d.properties),
                    )
                    .await
                    .map_err(|e| format!("replaying to {queue}: {e}"))?
                    .await
                    .map_err(|e| format!("confirm from {queue}: {e}"))?;
                confirmed(confirm, queue)?;
            }
            d.acker
                .ack(BasicAckOptions::default())
                .await
                .map_err(|e| format!("removing the letter at {place}: {e}"))?;
            report.done += 1;
            if pass.action == DeadAction::Replay {
                replayed.extend(letter.event_id);
            }
        }
        if pass.stops_after(&report) {
            return Ok(report);
        }
    }
    Ok(pass.finished(report))
}
