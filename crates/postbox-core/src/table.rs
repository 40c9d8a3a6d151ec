//! Validated table names: the only piece of SQL postbox builds at run time.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

use crate::Error;

/// A table name checked against `^[A-Za-z_][A-Za-z0-9_]{0,62}$`, so it can be
/// spliced into SQL without quoting.
#[derive(Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct TableName(String);

impl TableName {
    /// Validates `name`.
    ///
    /// ```
    /// use postbox_core::TableName;
    /// assert!(TableName::new("room_outbox").is_ok());
    /// assert!(TableName::new("room_outbox; drop table x").is_err());
    /// ```
    pub fn new(name: &str) -> Result<Self, Error> {
        let mut chars = name.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if first_ok && rest_ok && name.len() <= 63 {
            Ok(TableName(name.to_owned()))
        } else {
            Err(Error::InvalidTableName(name.to_owned()))
        }
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Name of the archive twin, `<table>_archive`.
    pub fn archive(&self) -> String {
        format!("{}_archive", self.0)
    }

    /// Replaces every `{table}` in a SQL template with this name, and
    /// `{archive}` with the archive twin's name.
    pub fn render(&self, sql: &str) -> String {
        sql.replace("{table}", &self.0)
            .replace("{archive}", &self.archive())
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName("postbox_outbox".to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl<'de> Deserialize<'de> for TableName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        TableName::new(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        for ok in ["room_outbox", "_x", "A1", &"a".repeat(63)] {
            assert!(TableName::new(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn refuses_anything_else() {
        for bad in [
            "",
            "1abc",
            "room-outbox",
            "a b",
            "x;drop",
            "t\"",
            &"a".repeat(64),
            "é",
        ] {
            assert!(TableName::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn renders_table_and_archive() {
        let t = TableName::new("room_outbox").unwrap();
        assert_eq!(
            t.render("INSERT INTO {archive} SELECT * FROM {table}"),
            "INSERT INTO room_outbox_archive SELECT * FROM room_outbox"
        );
    }
}
