//! Validated table names: the only identifier postbox splices into SQL.
//! (The other SQL built at run time is structure, never a value: the
//! predicates of the given filters in `postbox_sqlx::list_query`, and
//! MySQL's `IN (?, …)` placeholder lists.)

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::naming::Naming;
use crate::Error;

/// A table name checked against `^[A-Za-z_][A-Za-z0-9_]{0,41}$`, so it can be
/// spliced into SQL without quoting, and every name postbox derives from it
/// (suffixes of up to [`TableName::LONGEST_SUFFIX`] characters, such as
/// `_archive_created_idx`) stays within PostgreSQL's 63 and MySQL's 64
/// characters: PostgreSQL would silently cut a longer index name (two
/// indexes could then collide, and `doctor` would find neither) and MySQL
/// would refuse it.
///
/// An adopted table also carries its [`Naming`]: every statement
/// [`TableName::render`] renders is then written with the table's column
/// names and reads its legacy statuses.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TableName(String, Option<Arc<Naming>>);

impl TableName {
    /// The longest suffix postbox appends (`_versions_updated_idx`).
    pub const LONGEST_SUFFIX: usize = 21;
    /// The longest table name: 63 (PostgreSQL's limit) less the longest suffix.
    pub const MAX_LEN: usize = 63 - Self::LONGEST_SUFFIX;

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
        if first_ok && rest_ok && name.len() <= Self::MAX_LEN {
            Ok(TableName(name.to_owned(), None))
        } else {
            Err(Error::InvalidTableName(name.to_owned()))
        }
    }

    /// The name in lower case, as PostgreSQL keeps an unquoted name (postbox
    /// never quotes it): its catalog is read by this name.
    pub fn folded(mut self) -> Self {
        self.0.make_ascii_lowercase();
        self
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Name of the archive twin, `<table>_archive`.
    pub fn archive(&self) -> String {
        format!("{}_archive", self.0)
    }

    /// This table, whose columns and statuses `naming` describes.
    pub fn with_naming(mut self, naming: Naming) -> Self {
        self.1 = (!naming.is_plain()).then(|| Arc::new(naming));
        self
    }

    /// The table's column names and legacy statuses (plain unless
    /// adopted).
    pub fn naming(&self) -> &Naming {
        static PLAIN: std::sync::OnceLock<Naming> = std::sync::OnceLock::new();
        self.1
            .as_deref()
            .unwrap_or_else(|| PLAIN.get_or_init(Naming::default))
    }

    /// The table's name of postbox's column `ours`.
    pub fn column<'a>(&'a self, ours: &'a str) -> &'a str {
        match &self.1 {
            Some(n) => n.column(ours),
            None => ours,
        }
    }

    /// Replaces every `{table}` in a SQL template with this name, and
    /// `{archive}` with the archive twin's name; on an adopted table, the
    /// statement is first written with the table's own names
    /// ([`Naming::rewrite`]).
    pub fn render(&self, sql: &str) -> String {
        let sql = match &self.1 {
            Some(naming) => std::borrow::Cow::Owned(naming.rewrite(sql)),
            None => std::borrow::Cow::Borrowed(sql),
        };
        sql.replace("{table}", &self.0)
            .replace("{archive}", &self.archive())
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName("postbox_outbox".to_owned(), None)
    }
}

impl Serialize for TableName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
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
        for ok in ["room_outbox", "_x", "A1", &"a".repeat(42)] {
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
            // A 43-character name would make 64-character index names.
            &"a".repeat(43),
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
