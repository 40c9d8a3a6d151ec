//! `kind = "file"`: one JSON envelope per line (SPEC §4), appended to a file
//! or written to stdout. A batch is confirmed once it is written (and, to
//! a regular file, synced to disk).
//!
//! A batch is written whole or not at all: when a write to a regular file
//! fails part-way (disk full, file-size limit), the file is truncated back to
//! its length before the batch, so no partial line stays behind for the next
//! batch to be appended to. On stdout (or a pipe or device) written bytes
//! cannot be taken back; the failure is reported and the batch retried.

use std::io::Write;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use postbox_core::config::FilePublisherConfig;
use postbox_core::envelope::Envelope;
use postbox_core::publish::{Delivery, PublishError};
use postbox_core::{Error, Publisher, Result};

enum Sink {
    /// Locked by the blocking write itself: a publish dropped at its
    /// deadline leaves that write running, and the next batch must not
    /// write (or truncate) beside it.
    File(Arc<std::sync::Mutex<std::fs::File>>),
    Stdout(tokio::io::Stdout),
}

/// Appends JSON lines to a file, or writes them to stdout for `path = "-"`.
pub struct FilePublisher {
    name: String,
    path: String,
    out: Mutex<Sink>,
}

impl FilePublisher {
    /// Opens (creating, appending) the configured path.
    pub async fn open(config: &FilePublisherConfig) -> Result<Self> {
        let out = if config.path == "-" {
            Sink::Stdout(tokio::io::stdout())
        } else {
            let file = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&config.path)
                .await
                // A path that cannot be opened (no such folder, no
                // permission) is the entry's `path` to fix: exit 2 naming it.
                .map_err(|e| {
                    Error::config(
                        "path",
                        format!("cannot open `{}` for appending: {e}", config.path),
                    )
                })?;
            Sink::File(Arc::new(std::sync::Mutex::new(file.into_std().await)))
        };
        Ok(FilePublisher {
            name: config.name.clone().unwrap_or_else(|| "file".to_owned()),
            path: config.path.clone(),
            out: Mutex::new(out),
        })
    }

    async fn write(&self, buf: Vec<u8>) -> std::result::Result<(), String> {
        let mut out = self.out.lock().await;
        match &mut *out {
            Sink::Stdout(stdout) => {
                let written = async {
                    stdout.write_all(&buf).await?;
                    stdout.flush().await
                }
                .await;
                written.map_err(|e| format!("writing to stdout failed: {e}"))
            }
            Sink::File(file) => {
                let file = Arc::clone(file);
                let path = self.path.clone();
                // The file's own lock is held by the blocking write (and
                // any truncation) until it is over, even when this future
                // is dropped at a publish deadline, so batches never
                // interleave.
                tokio::task::spawn_blocking(move || {
                    let file = file.lock().unwrap_or_else(|p| p.into_inner());
                    append_whole(&file, &buf, &path)
                })
                .await
                .unwrap_or_else(|e| Err(format!("writing `{}` panicked: {e}", self.path)))
            }
        }
    }
}

/// Appends `buf` to `file`; on failure truncates a regular file back to the
/// length it had before, so it holds only whole lines.
fn append_whole(file: &std::fs::File, buf: &[u8], path: &str) -> std::result::Result<(), String> {
    let before = match file.metadata() {
        Ok(m) if m.is_file() => Some(m.len()),
        Ok(_) => None,
        Err(e) => return Err(format!("cannot stat `{path}` before writing: {e}")),
    };
    let mut writer = file;
    // A regular file's lines are on disk before the batch counts as
    // delivered: its rows are marked next, and an OS crash must not take
    // back lines whose events postbox will never send again.
    let written = writer
        .write_all(buf)
        .and_then(|()| writer.flush())
        .and_then(|()| match before {
            Some(_) => file.sync_data(),
            None => Ok(()),
        });
    let Err(e) = written else {
        return Ok(());
    };
    let Some(before) = before else {
        return Err(format!("writing `{path}` failed: {e}; will retry"));
    };
    match file.set_len(before) {
        Ok(()) => Err(format!(
            "writing `{path}` failed: {e}; the file is back to its {before} bytes before this batch; will retry"
        )),
        Err(t) => Err(format!(
            "writing `{path}` failed: {e}; truncating it back to {before} bytes failed too ({t}), so its last line may be incomplete"
        )),
    }
}

/// One envelope line (no line break inside), with the delivery metadata that brokers carry in
/// headers (`x-attempt`, `x-replayed`).
pub fn envelope_line(d: &Delivery<'_>) -> String {
    line_of(&Envelope::of_delivery(d))
}

/// `env` as one line (no line break inside), ending with one.
pub fn line_of(env: &Envelope) -> String {
    let line = serde_json::to_string(env).unwrap_or_default();
    // The payload is embedded verbatim (see `Envelope`), so a pretty-printed
    // payload brings its line breaks. In JSON text a raw CR or LF can only be
    // whitespace between tokens (inside strings they are escaped), so turning
    // them into spaces keeps one envelope per line and every value unchanged.
    let mut line = line.replace(['\n', '\r'], " ");
    line.push('\n');
    line
}

#[async_trait]
impl Publisher for FilePublisher {
    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, batch: &[Delivery<'_>]) -> Vec<std::result::Result<(), PublishError>> {
        let mut buf = String::with_capacity(batch.len() * 256);
        for d in batch {
            buf.push_str(&envelope_line(d));
        }
        match self.write(buf.into_bytes()).await {
            Ok(()) => vec![Ok(()); batch.len()],
            Err(message) => vec![Err(PublishError::failed(message)); batch.len()],
        }
    }

    async fn close(&self) {
        if let Sink::Stdout(stdout) = &mut *self.out.lock().await {
            let _ = stdout.flush().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postbox_testkit::records::room_created as record;

    #[tokio::test]
    async fn writes_one_envelope_per_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let p = FilePublisher::open(&FilePublisherConfig {
            name: None,
            path: path.to_str().unwrap().to_owned(),
        })
        .await
        .unwrap();
        let records = [record(1), record(2)];
        let batch: Vec<_> = records.iter().map(Delivery::of).collect();
        assert!(p.publish(&batch).await.iter().all(|r| r.is_ok()));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event_id"], "e1");
        assert_eq!(lines[1]["aggregate_version"], 2);
        assert_eq!(lines[0]["payload"]["room"], 1);
        assert_eq!(lines[0]["headers"]["trace"], "t");
        assert_eq!(lines[0]["headers"]["x-attempt"], 2);
        assert_eq!(lines[0]["headers"]["x-replayed"], true);
    }

    /// A pretty-printed payload keeps its values and key order, and its line
    /// breaks do not split the envelope's line.
    #[test]
    fn a_multi_line_payload_stays_on_one_line() {
        let mut r = record(1);
        r.payload = "{\r\n  \"z\": 19.990,\n  \"a\": \"x\\ny\"\n}".into();
        let line = envelope_line(&Delivery::of(&r));
        assert_eq!(line.matches('\n').count(), 1, "{line:?}");
        assert!(line.ends_with('\n'));
        assert!(
            line.contains(r#""payload":{    "z": 19.990,   "a": "x\ny" }"#),
            "{line:?}"
        );
    }

    /// A device that is always full (`/dev/full`, ENOSPC): every event of the
    /// batch fails with the cause named, nothing is reported as written.
    #[tokio::test]
    async fn a_full_device_fails_the_batch_with_the_cause() {
        let p = FilePublisher::open(&FilePublisherConfig {
            name: Some("sink".into()),
            path: "/dev/full".into(),
        })
        .await
        .unwrap();
        let records = [record(1), record(2)];
        let batch: Vec<_> = records.iter().map(Delivery::of).collect();
        let results = p.publish(&batch).await;
        assert_eq!(results.len(), 2);
        for r in results {
            let message = r.unwrap_err().to_string();
            assert!(
                message.starts_with("writing `/dev/full` failed:")
                    && message.contains("No space left on device"),
                "{message}"
            );
        }
    }
}
