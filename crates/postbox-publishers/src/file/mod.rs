//! `kind = "file"`: one JSON envelope per line (SPEC §4), appended to a file
//! or written to stdout. A batch is confirmed once it is flushed.

use async_trait::async_trait;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

use postbox_core::config::FilePublisherConfig;
use postbox_core::envelope::Envelope;
use postbox_core::publish::{Delivery, PublishError};
use postbox_core::{Error, Publisher, Result};

/// Appends JSON lines to a file, or writes them to stdout for `path = "-"`.
pub struct FilePublisher {
    name: String,
    out: Mutex<Box<dyn AsyncWrite + Send + Unpin>>,
}

impl FilePublisher {
    /// Opens (creating, appending) the configured path.
    pub async fn open(config: &FilePublisherConfig) -> Result<Self> {
        let out: Box<dyn AsyncWrite + Send + Unpin> = if config.path == "-" {
            Box::new(tokio::io::stdout())
        } else {
            let file = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&config.path)
                .await
                .map_err(|source| Error::Io {
                    context: format!("opening file publisher path `{}`", config.path),
                    source,
                })?;
            Box::new(file)
        };
        Ok(FilePublisher {
            name: config.name.clone().unwrap_or_else(|| "file".to_owned()),
            out: Mutex::new(out),
        })
    }
}

/// One envelope line, with the delivery metadata that brokers carry in
/// headers (`x-attempt`, `x-replayed`).
pub fn envelope_line(d: &Delivery<'_>) -> String {
    let mut env = Envelope::from_record(d.record);
    env.headers.insert("x-attempt".to_owned(), d.attempt.into());
    if d.replayed {
        env.headers.insert("x-replayed".to_owned(), true.into());
    }
    let mut line = serde_json::to_string(&env).unwrap_or_default();
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
        let mut out = self.out.lock().await;
        let result = async {
            out.write_all(buf.as_bytes()).await?;
            out.flush().await
        }
        .await;
        match result {
            Ok(()) => vec![Ok(()); batch.len()],
            Err(e) => {
                vec![Err(PublishError::failed(format!("writing {}: {e}", self.name))); batch.len()]
            }
        }
    }

    async fn close(&self) {
        let _ = self.out.lock().await.flush().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postbox_core::{EventRecord, Status};

    fn record(id: i64) -> EventRecord {
        EventRecord {
            id,
            app_code: "room".into(),
            event_id: format!("e{id}"),
            event_type: "RoomCreated".into(),
            aggregate_id: Some("r1".into()),
            aggregate_version: Some(id),
            payload: r#"{"room":1}"#.into(),
            headers: Some(r#"{"trace":"t"}"#.into()),
            status: Status::Delivering,
            retry_count: 1,
            next_retry_at_ms: 0,
            lock_until_ms: 0,
            worker_id: None,
            last_error: None,
            delivered_to: vec![],
            replay_count: 1,
            created_at_ms: 5,
            updated_at_ms: 5,
        }
    }

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
}
