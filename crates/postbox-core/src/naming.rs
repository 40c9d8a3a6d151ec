//! An adopted table's own names (`[database.columns]`,
//! `[database.statuses]`): the columns it calls differently and the legacy
//! status values its rows may hold. Every statement postbox runs is
//! written with postbox's names; [`Naming::rewrite`] turns it into the
//! table's, once per store, when the templates are rendered
//! ([`crate::TableName::render`]):
//!
//! - a column postbox names `lock_until_ms` is written as the table's
//!   `locked_until_ms` wherever it stands (string literals, quoted
//!   identifiers and `{placeholders}` are left alone);
//! - a status predicate also matches the legacy values read as that
//!   status: `status = 'delivered'` becomes `status IN ('delivered',
//!   'published', 'done')`, `status <> 'delivering'` becomes `status NOT
//!   IN ('delivering', 'running')`, and `IN (…)` lists grow the same way.
//!   An assignment (`SET status = 'delivered'`, `…, status = 'pending'`)
//!   is left alone: postbox writes only its own values.
//!
//! Rows are read back through [`Naming::column`] and [`Naming::status`].

use std::collections::BTreeMap;

use crate::{Error, Status};

/// The columns of an outbox row, by postbox's names (SPEC §2).
pub const COLUMNS: [&str; 18] = [
    "id",
    "app_code",
    "event_id",
    "event_type",
    "aggregate_id",
    "aggregate_version",
    "payload",
    "headers",
    "status",
    "retry_count",
    "next_retry_at_ms",
    "lock_until_ms",
    "worker_id",
    "last_error",
    "delivered_to",
    "replay_count",
    "created_at_ms",
    "updated_at_ms",
];

/// How an adopted table names postbox's columns and which legacy status
/// values its rows hold. The default changes nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Naming {
    /// postbox's column name → the table's, only those that differ.
    columns: BTreeMap<String, String>,
    /// A legacy status value → the status it reads as.
    statuses: BTreeMap<String, Status>,
}

impl Naming {
    /// Checks `columns` (postbox name → the table's) and `statuses` (legacy
    /// value → postbox status name); errors name the config key at fault
    /// under `database.columns` / `database.statuses`.
    pub fn new(
        columns: &BTreeMap<String, String>,
        statuses: &BTreeMap<String, String>,
    ) -> Result<Naming, Error> {
        let mut naming = Naming::default();
        for (ours, theirs) in columns {
            let key = format!("database.columns.{ours}");
            if !COLUMNS.contains(&ours.as_str()) {
                return Err(Error::config(
                    key,
                    format!(
                        "`{ours}` is not a postbox column: expected one of {}",
                        COLUMNS.join(", ")
                    ),
                ));
            }
            if !is_identifier(theirs) {
                return Err(Error::config(
                    key,
                    format!("`{theirs}` is not a plain column name (letters, digits and `_`, at most 64, not starting with a digit)"),
                ));
            }
            if ours != theirs {
                naming.columns.insert(ours.clone(), theirs.clone());
            }
        }
        // A table's name is never another postbox column's (each column
        // needs its own, and rewriting a statement twice changes nothing).
        for (ours, theirs) in &naming.columns {
            if let Some(other) = COLUMNS.iter().find(|c| c.eq_ignore_ascii_case(theirs)) {
                return Err(Error::config(
                    format!("database.columns.{ours}"),
                    format!("`{theirs}` is postbox's name of `{other}`: map `{other}` too, or pick a name of the table's own"),
                ));
            }
            let twice = naming
                .columns
                .iter()
                .find(|(o, t)| *o != ours && t.eq_ignore_ascii_case(theirs));
            if let Some((other, _)) = twice {
                return Err(Error::config(
                    format!("database.columns.{ours}"),
                    format!("`{theirs}` is also the column of `{other}`: each postbox column needs its own"),
                ));
            }
        }
        for (legacy, ours) in statuses {
            let key = format!("database.statuses.{legacy}");
            let status = ours.parse::<Status>().ok().filter(|s| s.as_str() == ours);
            let Some(status) = status else {
                return Err(Error::config(
                    key,
                    format!("`{ours}` is not a postbox status: expected pending, delivering, delivered, retryable, failed or dropped"),
                ));
            };
            if !legacy
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-. ".contains(c))
                || legacy.is_empty()
                || legacy.len() > 16
            {
                return Err(Error::config(
                    key,
                    "a legacy status is 1 to 16 letters, digits, `_`, `-`, `.` or spaces",
                ));
            }
            if Status::ALL.iter().any(|s| s.as_str() == legacy) {
                return Err(Error::config(
                    key,
                    format!("`{legacy}` is postbox's own status and always reads as itself"),
                ));
            }
            naming.statuses.insert(legacy.clone(), status);
        }
        Ok(naming)
    }

    /// Whether this changes nothing.
    pub fn is_plain(&self) -> bool {
        self.columns.is_empty() && self.statuses.is_empty()
    }

    /// The table's name of postbox's column `ours`.
    pub fn column<'a>(&'a self, ours: &'a str) -> &'a str {
        self.columns.get(ours).map_or(ours, String::as_str)
    }

    /// The renamed columns, postbox's name first.
    pub fn renamed(&self) -> impl Iterator<Item = (&str, &str)> {
        self.columns.iter().map(|(a, b)| (a.as_str(), b.as_str()))
    }

    /// The legacy status values and what each reads as.
    pub fn legacy_statuses(&self) -> impl Iterator<Item = (&str, Status)> {
        self.statuses.iter().map(|(a, b)| (a.as_str(), *b))
    }

    /// The status a stored value reads as: postbox's own, or a legacy one.
    pub fn status(&self, stored: &str) -> Result<Status, Error> {
        match self.statuses.get(stored) {
            Some(s) => Ok(*s),
            None => stored.parse(),
        }
    }

    /// The values a predicate on `status` must match: `ours` and every
    /// legacy value read as it.
    fn values_of(&self, ours: &str) -> Vec<&str> {
        let mut out: Vec<&str> = self
            .statuses
            .iter()
            .filter(|(_, s)| s.as_str() == ours)
            .map(|(legacy, _)| legacy.as_str())
            .collect();
        out.sort_unstable();
        out
    }

    /// `sql` written with the table's names (see the module docs).
    pub fn rewrite(&self, sql: &str) -> String {
        if self.is_plain() {
            return sql.to_owned();
        }
        let tokens = tokenize(sql);
        let tokens = self.expand_statuses(tokens);
        let mut out = String::with_capacity(sql.len() + 64);
        for t in &tokens {
            match t {
                Tok::Word(w) => out.push_str(self.columns.get(*w).map_or(*w, String::as_str)),
                Tok::Made(s) => out.push_str(s),
                Tok::Lit(s) | Tok::Space(s) | Tok::Other(s) => out.push_str(s),
            }
        }
        out
    }

    /// Widens every predicate on `status` by the legacy values.
    fn expand_statuses<'s>(&self, tokens: Vec<Tok<'s>>) -> Vec<Tok<'s>> {
        let mut out: Vec<Tok<'s>> = Vec::with_capacity(tokens.len());
        let mut i = 0;
        while i < tokens.len() {
            let t = &tokens[i];
            out.push(t.clone());
            i += 1;
            if !matches!(t, Tok::Word(w) if w.eq_ignore_ascii_case("status")) || is_assignment(&out)
            {
                continue;
            }
            // status <op> …
            let mut j = skip_space(&tokens, i);
            let negated;
            let in_list;
            match tokens.get(j) {
                Some(Tok::Other("=")) => (negated, in_list) = (false, false),
                Some(Tok::Other("<")) if tokens.get(j + 1) == Some(&Tok::Other(">")) => {
                    (negated, in_list) = (true, false);
                    j += 1;
                }
                Some(Tok::Other("!")) if tokens.get(j + 1) == Some(&Tok::Other("=")) => {
                    (negated, in_list) = (true, false);
                    j += 1;
                }
                Some(Tok::Word(w)) if w.eq_ignore_ascii_case("in") => {
                    (negated, in_list) = (false, true)
                }
                Some(Tok::Word(w)) if w.eq_ignore_ascii_case("not") => {
                    let k = skip_space(&tokens, j + 1);
                    match tokens.get(k) {
                        Some(Tok::Word(w)) if w.eq_ignore_ascii_case("in") => {
                            (negated, in_list) = (true, true);
                            j = k;
                        }
                        _ => continue,
                    }
                }
                _ => continue,
            }
            let values_at = skip_space(&tokens, j + 1);
            let (literals, end) = if in_list {
                match literal_list(&tokens, values_at) {
                    Some(found) => found,
                    None => continue,
                }
            } else {
                match tokens.get(values_at) {
                    Some(Tok::Lit(l)) => (vec![*l], values_at + 1),
                    _ => continue,
                }
            };
            let mut values: Vec<String> = literals.iter().map(|l| (*l).to_owned()).collect();
            for l in &literals {
                let ours = l.trim_matches('\'');
                for legacy in self.values_of(ours) {
                    let quoted = format!("'{legacy}'");
                    if !values.contains(&quoted) {
                        values.push(quoted);
                    }
                }
            }
            if values.len() == literals.len() {
                continue;
            }
            out.push(Tok::Space(" "));
            out.push(Tok::Other(if negated { "NOT IN (" } else { "IN (" }));
            out.push(Tok::Made(values.join(", ")));
            out.push(Tok::Other(")"));
            i = end;
        }
        out
    }
}

/// `^[A-Za-z_][A-Za-z0-9_]{0,63}$`.
fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && s.len() <= 64
}

/// A piece of SQL text.
#[derive(Debug, Clone, PartialEq)]
enum Tok<'s> {
    /// An unquoted identifier or keyword.
    Word(&'s str),
    /// A string literal, quotes included.
    Lit(&'s str),
    /// Whitespace.
    Space(&'s str),
    /// Anything else, one character at a time, or a whole quoted
    /// identifier or `{placeholder}`.
    Other(&'s str),
    /// Text the rewrite made.
    Made(String),
}

fn tokenize(sql: &str) -> Vec<Tok<'_>> {
    let bytes = sql.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let c = bytes[i];
        let tok = if c == b'\'' {
            i += 1;
            while i < bytes.len() {
                if bytes[i] == b'\'' {
                    if bytes.get(i + 1) == Some(&b'\'') {
                        i += 2;
                        continue;
                    }
                    break;
                }
                i += 1;
            }
            i = (i + 1).min(bytes.len());
            Tok::Lit(&sql[start..i])
        } else if c == b'"' || c == b'`' || c == b'{' {
            let close = if c == b'{' { b'}' } else { c };
            i += 1;
            while i < bytes.len() && bytes[i] != close {
                i += 1;
            }
            i = (i + 1).min(bytes.len());
            Tok::Other(&sql[start..i])
        } else if c.is_ascii_alphabetic() || c == b'_' {
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            Tok::Word(&sql[start..i])
        } else if c.is_ascii_digit() || c == b'$' {
            // Numbers and `$1` binds: never a column.
            i += 1;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            Tok::Other(&sql[start..i])
        } else if c.is_ascii_whitespace() {
            while i < bytes.len() && bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            Tok::Space(&sql[start..i])
        } else {
            i += sql[i..].chars().next().map_or(1, char::len_utf8);
            Tok::Other(&sql[start..i])
        };
        out.push(tok);
    }
    out
}

fn skip_space(tokens: &[Tok<'_>], mut i: usize) -> usize {
    while matches!(tokens.get(i), Some(Tok::Space(_))) {
        i += 1;
    }
    i
}

/// Whether the `status` just pushed (qualified or not) is the target of an
/// assignment: it follows `SET` or a `,` (the next assignment of a `SET`
/// list; a predicate never follows a bare comma in postbox's statements).
fn is_assignment(out: &[Tok<'_>]) -> bool {
    let mut k = out.len() - 1;
    // `o.status`: step over the qualifier.
    if k >= 2 && out[k - 1] == Tok::Other(".") && matches!(out[k - 2], Tok::Word(_)) {
        k -= 2;
    }
    let before = out[..k].iter().rev().find(|t| !matches!(t, Tok::Space(_)));
    match before {
        Some(Tok::Word(w)) => w.eq_ignore_ascii_case("set"),
        Some(Tok::Other(",")) => true,
        _ => false,
    }
}

/// `( 'a', 'b' … )` at `i`: the literals and the index after `)`.
fn literal_list<'s>(tokens: &[Tok<'s>], i: usize) -> Option<(Vec<&'s str>, usize)> {
    if tokens.get(i) != Some(&Tok::Other("(")) {
        return None;
    }
    let mut literals = Vec::new();
    let mut k = i + 1;
    loop {
        k = skip_space(tokens, k);
        match tokens.get(k) {
            Some(Tok::Lit(l)) => literals.push(*l),
            _ => return None,
        }
        k = skip_space(tokens, k + 1);
        match tokens.get(k) {
            Some(Tok::Other(",")) => k += 1,
            Some(Tok::Other(")")) => return Some((literals, k + 1)),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy() -> Naming {
        let columns = BTreeMap::from([
            ("lock_until_ms".to_owned(), "locked_until_ms".to_owned()),
            ("status".to_owned(), "state".to_owned()),
            ("app_code".to_owned(), "app_code".to_owned()),
        ]);
        let statuses = BTreeMap::from([
            ("published".to_owned(), "delivered".to_owned()),
            ("done".to_owned(), "delivered".to_owned()),
            ("running".to_owned(), "delivering".to_owned()),
            ("dead".to_owned(), "failed".to_owned()),
            ("new".to_owned(), "pending".to_owned()),
        ]);
        Naming::new(&columns, &statuses).unwrap()
    }

    #[test]
    fn a_plain_naming_changes_nothing() {
        let sql =
            "UPDATE t SET status = 'delivered' WHERE status = 'delivering' AND lock_until_ms = $3";
        assert_eq!(Naming::default().rewrite(sql), sql);
    }

    #[test]
    fn columns_are_renamed_everywhere_but_in_literals_and_placeholders() {
        let n = legacy();
        assert_eq!(
            n.rewrite("SELECT o.lock_until_ms, 'lock_until_ms' FROM {table} o WHERE lock_until_ms <= $4{filters}"),
            "SELECT o.locked_until_ms, 'lock_until_ms' FROM {table} o WHERE locked_until_ms <= $4{filters}"
        );
        // Words that merely contain a column name stay.
        assert_eq!(
            n.rewrite("{table}_lease_idx status_idx"),
            "{table}_lease_idx status_idx"
        );
    }

    #[test]
    fn rewriting_twice_changes_nothing_more() {
        let n = legacy();
        let sql =
            "UPDATE t SET status = 'pending' WHERE status IN ('delivered') AND lock_until_ms = 0";
        let once = n.rewrite(sql);
        assert_eq!(n.rewrite(&once), once);
    }

    #[test]
    fn predicates_take_the_legacy_values_and_assignments_do_not() {
        let n = legacy();
        assert_eq!(
            n.rewrite("UPDATE t o SET status = 'delivered', lock_until_ms = 0 WHERE id = ANY($1) AND o.status = 'delivering'"),
            "UPDATE t o SET state = 'delivered', locked_until_ms = 0 WHERE id = ANY($1) AND o.state IN ('delivering', 'running')"
        );
        assert_eq!(
            n.rewrite("SET retry_count = 0, status = 'pending' WHERE status <> 'delivering' AND status IN ('delivered', 'published', 'dropped')"),
            "SET retry_count = 0, state = 'pending' WHERE state NOT IN ('delivering', 'running') AND state IN ('delivered', 'published', 'dropped', 'done')"
        );
        assert_eq!(
            n.rewrite("SUM(CASE WHEN status = 'failed' THEN 1 ELSE 0 END), IF(status = 'pending', 1, 0) AND status NOT IN ('failed')"),
            "SUM(CASE WHEN state IN ('failed', 'dead') THEN 1 ELSE 0 END), IF(state IN ('pending', 'new'), 1, 0) AND state NOT IN ('failed', 'dead')"
        );
        // A status without legacy values, and a bound one, stay as written.
        assert_eq!(
            n.rewrite("WHERE status = 'retryable' AND status = $2"),
            "WHERE state = 'retryable' AND state = $2"
        );
    }

    #[test]
    fn legacy_values_read_as_their_status() {
        let n = legacy();
        assert_eq!(n.status("done").unwrap(), Status::Delivered);
        assert_eq!(n.status("new").unwrap(), Status::Pending);
        assert_eq!(n.status("retryable").unwrap(), Status::Retryable);
        assert!(n.status("weird").is_err());
        assert_eq!(n.column("lock_until_ms"), "locked_until_ms");
        assert_eq!(n.column("event_id"), "event_id");
    }

    #[test]
    fn bad_mappings_name_their_key() {
        let err = |columns: &[(&str, &str)], statuses: &[(&str, &str)]| {
            let c = columns
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            let s = statuses
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            Naming::new(&c, &s).unwrap_err().to_string()
        };
        assert!(err(&[("lock_until", "x")], &[]).contains("database.columns.lock_until"));
        assert!(err(&[("status", "st;ate")], &[]).contains("database.columns.status"));
        let clash = err(&[("lock_until_ms", "worker_id")], &[]);
        assert!(
            clash.contains("database.columns.lock_until_ms") && clash.contains("worker_id"),
            "{clash}"
        );
        let twice = err(
            &[("lock_until_ms", "lease"), ("next_retry_at_ms", "lease")],
            &[],
        );
        assert!(
            twice.contains("database.columns.") && twice.contains("`lease`"),
            "{twice}"
        );
        assert!(err(&[], &[("done", "finished")]).contains("database.statuses.done"));
        assert!(err(&[], &[("pending", "failed")]).contains("database.statuses.pending"));
        assert!(err(&[], &[("it's", "failed")]).contains("database.statuses"));
    }
}
