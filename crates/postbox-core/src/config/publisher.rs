//! `[[publishers]]` entries, one variant per `kind`.

use serde::Deserialize;

use crate::Error;

/// One fanout target. The `kind` key selects the variant.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum PublisherConfig {
    /// JSON lines to a file or stdout.
    File(FilePublisherConfig),
}

impl PublisherConfig {
    /// The publisher's name (defaults to its kind): labels metrics and
    /// per-publisher progress.
    pub fn name(&self) -> &str {
        match self {
            PublisherConfig::File(c) => c.name.as_deref().unwrap_or("file"),
        }
    }

    /// The `kind` key.
    pub fn kind(&self) -> &'static str {
        match self {
            PublisherConfig::File(_) => "file",
        }
    }

    pub(crate) fn validate(&self, key: &str) -> Result<(), Error> {
        if let Some(name) = match self {
            PublisherConfig::File(c) => c.name.as_deref(),
        } {
            if name.is_empty() || name.len() > 64 {
                return Err(Error::config(
                    format!("{key}.name"),
                    "must be 1 to 64 bytes",
                ));
            }
        }
        match self {
            PublisherConfig::File(c) if c.path.is_empty() => Err(Error::config(
                format!("{key}.path"),
                "is empty; give a file path or \"-\" for stdout",
            )),
            PublisherConfig::File(_) => Ok(()),
        }
    }
}

/// `kind = "file"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePublisherConfig {
    /// Name (default `file`).
    #[serde(default)]
    pub name: Option<String>,
    /// File to append to, `-` for stdout.
    pub path: String,
}
