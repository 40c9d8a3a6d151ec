//! `postbox dead` on NATS JetStream: a pass over the consumer's dead
//! subject, in the stream that captures it.
//!
//! The letters are read one by one by subject (`STREAM.MSG.GET` with
//! `next_by_subj`), up to the stream's last sequence when the pass began.
//! A replay publishes the copy on the subject the original was published on
//! (`x-source-subject`), waits for the PubAck, then deletes the dead copy;
//! its `Nats-Msg-Id` is made of the dead copy's place, so a replay re-sent
//! after a crash is dropped by the stream's duplicate window. A letter's
//! `position` is its sequence in the dead stream.

use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use async_nats::jetstream::{self, Context};
use async_nats::HeaderMap;
use postbox_core::wire::nats::{MSG_ID, SOURCE_SUBJECT};

use super::message::message_from_nats;
use crate::dead::letter::{replay_headers, DeadAction, DeadLetter, DeadReport, Failed, Pass};

pub(crate) async fn run(pass: &Pass<'_>) -> Result<DeadReport, Failed> {
    let subject = pass.config.nats_dead_subject();
    let fail = |e: String| (subject.clone(), e);
    let (options, servers) = super::connect_options(pass.config.nodes()).map_err(fail)?;
    let client = options
        .name(format!(
            "postbox-dead-{}",
            crate::consume::consumer_tag(&pass.config.queue)
        ))
        .retain_servers_order()
        .connect(servers)
        .await
        .map_err(|e| fail(format!("connecting: {e}")))?;
    let js = jetstream::new(client);
    pass_over(&js, pass, &subject).await.map_err(fail)
}

async fn pass_over(js: &Context, pass: &Pass<'_>, subject: &str) -> Result<DeadReport, String> {
    let name = match js.stream_by_subject(subject).await {
        Ok(name) => name,
        // The consumer makes (or finds) a home for its dead copies before
        // it takes a message: none yet, no dead letters yet.
        Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
            return Ok(pass.finished(DeadReport::new(format!(
                "{subject} (no stream captures it yet: the consumer has not run)"
            ))));
        }
        Err(e) => return Err(format!("looking up the stream of the dead subject: {e}")),
    };
    let mut dead: Stream = js
        .get_stream(&name)
        .await
        .map_err(|e| format!("stream `{name}`: {e}"))?;
    let last = dead
        .info()
        .await
        .map_err(|e| format!("stream `{name}`: {e}"))?
        .state
        .last_sequence;
    let mut report = DeadReport::new(format!("{subject} (stream {name})"));
    let mut next = 1;
    while next <= last {
        let m = match dead.get_first_raw_message_by_subject(subject, next).await {
            Ok(m) if m.sequence <= last => m,
            Ok(_) => break,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
            Err(e) => return Err(format!("reading at {next}: {e}")),
        };
        next = m.sequence + 1;
        let parsed =
            message_from_nats(Some(&m.headers), &m.subject, &m.payload, 1).map(|msg| msg.envelope);
        let time_ms = (m.time.unix_timestamp_nanos() / 1_000_000) as i64;
        let letter = DeadLetter::of(
            m.sequence.to_string(),
            parsed,
            headers_json(&m.headers),
            &m.payload,
            Some(time_ms),
        );
        if report.saw(&letter, pass.filter, pass.action) && pass.writes() {
            if pass.action == DeadAction::Replay {
                let to = source_subject(js, &m.headers, pass).await?;
                let headers = replay_nats_headers(&m.headers, &name, m.sequence);
                js.publish_with_headers(to.clone(), headers, m.payload.clone())
                    .await
                    .map_err(|e| format!("replaying on {to}: {e}"))?
                    .await
                    .map_err(|e| format!("PubAck for the replay on {to}: {e}"))?;
            }
            dead.delete_message(m.sequence)
                .await
                .map_err(|e| format!("deleting the letter at {}: {e}", m.sequence))?;
            report.done += 1;
        }
        if pass.stops_after(&report) {
            return Ok(report);
        }
    }
    Ok(pass.finished(report))
}

/// Where a replay goes: the copy's `x-source-subject`, else (a copy made
/// before postbox wrote it) the subject of the original, looked up in the
/// consumer's stream by the sequence its `Nats-Msg-Id` names.
async fn source_subject(js: &Context, h: &HeaderMap, pass: &Pass<'_>) -> Result<String, String> {
    if let Some(s) = h.get(SOURCE_SUBJECT) {
        return Ok(s.as_str().to_owned());
    }
    let original = h
        .get(MSG_ID)
        .and_then(|id| id.as_str().split(':').nth(1)?.parse::<u64>().ok());
    let stream = &pass.config.queue;
    let Some(seq) = original else {
        return Err(format!(
            "a dead copy has no {SOURCE_SUBJECT} and no Nats-Msg-Id naming the original: cannot tell where to replay it"
        ));
    };
    let s = js
        .get_stream(stream)
        .await
        .map_err(|e| format!("stream `{stream}`: {e}"))?;
    let m = s.get_raw_message(seq).await.map_err(|e| {
        format!("the original (sequence {seq} of `{stream}`) is gone ({e}) and the copy has no {SOURCE_SUBJECT}: cannot tell where to replay it")
    })?;
    Ok(m.subject.to_string())
}

/// The dead copy's headers for its replay ([`replay_headers`]), without
/// `x-source-subject`, with a `Nats-Msg-Id` of `<dead stream>:<sequence>:replay`.
fn replay_nats_headers(h: &HeaderMap, dead_stream: &str, sequence: u64) -> HeaderMap {
    let kept = replay_headers(headers_json(h));
    let mut out = HeaderMap::new();
    for (name, value) in kept {
        if name.eq_ignore_ascii_case(MSG_ID) || name == SOURCE_SUBJECT {
            continue;
        }
        let value = value
            .as_str()
            .map_or_else(|| value.to_string(), str::to_owned);
        out.insert(name.as_str(), value.as_str());
    }
    out.insert(MSG_ID, format!("{dead_stream}:{sequence}:replay").as_str());
    out
}

/// The headers as JSON strings (the last value of a repeated header).
fn headers_json(h: &HeaderMap) -> serde_json::Map<String, serde_json::Value> {
    h.iter()
        .filter_map(|(name, values)| {
            let v = values.last()?;
            Some((
                name.to_string(),
                serde_json::Value::String(v.as_str().to_owned()),
            ))
        })
        .collect()
}
