//! Config key paths, spelled one way: dotted, with list entries by index
//! (`publishers.0.url`, `consumers.1.inbox.table`), as figment names the
//! keys it refuses. Every error that names a key builds it here.

use std::fmt;

/// The dotted path of a config key or section, e.g. `consumers.0.inbox`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyPath(String);

impl KeyPath {
    /// A top-level key or section: `database`, `outbox_worker`.
    pub fn root(name: &str) -> Self {
        KeyPath(name.to_owned())
    }

    /// The `i`-th `[[publishers]]` entry: `publishers.<i>`.
    pub fn publisher(i: usize) -> Self {
        KeyPath::root("publishers").index(i)
    }

    /// The `i`-th `[[consumers]]` entry: `consumers.<i>`.
    pub fn consumer(i: usize) -> Self {
        KeyPath::root("consumers").index(i)
    }

    /// A key below this one: `consumers.0` + `inbox` = `consumers.0.inbox`.
    /// `name` may itself be a relative path (`inbox.url`).
    pub fn join(&self, name: &str) -> Self {
        KeyPath(format!("{}.{name}", self.0))
    }

    /// The `i`-th entry of the list at this key: `bindings` + 2 =
    /// `bindings.2`.
    pub fn index(&self, i: usize) -> Self {
        KeyPath(format!("{}.{i}", self.0))
    }

    /// The path as written in error messages.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<KeyPath> for String {
    fn from(k: KeyPath) -> String {
        k.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_spelled_with_dots() {
        assert_eq!(
            KeyPath::publisher(0).join("url").as_str(),
            "publishers.0.url"
        );
        assert_eq!(
            KeyPath::consumer(1)
                .join("bindings")
                .index(2)
                .join("exchange")
                .as_str(),
            "consumers.1.bindings.2.exchange"
        );
        assert_eq!(
            KeyPath::consumer(3).join("inbox.url").to_string(),
            "consumers.3.inbox.url"
        );
    }
}
