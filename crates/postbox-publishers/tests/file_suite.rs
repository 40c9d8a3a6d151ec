//! The publisher conformance suite on the file publisher: the lines read
//! back from the file carry every event faithfully.

use std::time::Duration;

use async_trait::async_trait;
use postbox_core::config::FilePublisherConfig;
use postbox_publishers::file::FilePublisher;
use postbox_testkit::publisher_suite::{check_publisher, sample_events, ReadBack, Received};

struct FileReader(std::path::PathBuf);

#[async_trait]
impl ReadBack for FileReader {
    async fn read(&mut self, _expected: usize, _timeout: Duration) -> Vec<Received> {
        let text = tokio::fs::read_to_string(&self.0).await.unwrap();
        text.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                Received::from_envelope(&v, self.0.display().to_string())
            })
            .collect()
    }
}

#[tokio::test]
async fn file_publisher_passes_the_publisher_suite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.jsonl");
    let config = FilePublisherConfig {
        name: None,
        path: path.display().to_string(),
    };
    let publisher = FilePublisher::open(&config).await.unwrap();
    let events = sample_events("room", 120);
    let mut reader = FileReader(path.clone());
    check_publisher(&publisher, &events, 50, &mut reader, |_| {
        path.display().to_string()
    })
    .await;
}
