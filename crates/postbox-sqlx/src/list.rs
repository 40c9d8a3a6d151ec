//! The `list` query, built per filter combination.
//!
//! One statement with `(? IS NULL OR …)` for every optional filter cannot be
//! planned for the filters actually given: the planner picks one plan for all
//! of them and reads far too many rows at 1,000,000. Here only the given
//! filters become predicates, so a query with `app_code` and a rare status
//! reads that status's index and stops after `limit` rows (keyset
//! pagination by `id` descending), and a query without filters (or for a
//! status most rows have) reads the primary key backwards. The status is
//! written as a literal (one of [`Status`]'s fixed names, never user text)
//! so that the planner can match a partial index for that status.

use postbox_core::store::EventFilter;
use postbox_core::Status;

/// How a dialect writes its placeholders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholders {
    /// PostgreSQL: `$1`, `$2`, …
    Numbered,
    /// MySQL and SQLite: `?`.
    Question,
}

impl Placeholders {
    /// The `n`th placeholder (from 1).
    fn nth(self, n: usize) -> String {
        match self {
            Placeholders::Numbered => format!("${n}"),
            Placeholders::Question => "?".to_owned(),
        }
    }
}

/// One bound value, in placeholder order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListArg<'a> {
    /// A text column value.
    Text(&'a str),
    /// An integer column value.
    Int(i64),
}

/// A list statement and its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery<'a> {
    /// The statement; `{table}` still to be rendered by the caller's
    /// validated [`TableName`](postbox_core::TableName).
    pub sql: String,
    /// Values, one per placeholder, in order.
    pub args: Vec<ListArg<'a>>,
}

/// The list statement for `filter`: `select_from` (`SELECT <columns> FROM
/// {table}`) followed by a predicate per given filter, newest first, at most
/// `filter.limit` rows.
pub fn list_query<'a>(
    select_from: &str,
    filter: &'a EventFilter,
    p: Placeholders,
) -> ListQuery<'a> {
    let (mut preds, mut args) = predicates(filter);
    if let Some(before) = filter.before_id {
        preds.push("id < ");
        args.push(ListArg::Int(before));
    }
    let placeholder = |n: usize| p.nth(n);
    let mut sql = select_from.to_owned();
    for (i, pred) in preds.iter().enumerate() {
        sql.push_str(if i == 0 { " WHERE " } else { " AND " });
        sql.push_str(pred);
        sql.push_str(&placeholder(i + 1));
    }
    if let Some(s) = filter.status {
        sql.push_str(if preds.is_empty() { " WHERE " } else { " AND " });
        sql.push_str(&status_literal("status", s));
    }
    sql.push_str(" ORDER BY id DESC LIMIT ");
    sql.push_str(&placeholder(preds.len() + 1));
    args.push(ListArg::Int(i64::from(filter.limit)));
    ListQuery { sql, args }
}

/// Where a statement takes the predicates of [`filter_query`].
pub const FILTERS: &str = "{filters}";

/// A replay statement for `filter`: `{filters}` in `sql` (which follows a
/// `WHERE` clause) becomes ` AND <column> = <placeholder>` for each given
/// filter among app_code, aggregate, status, event_type and the time range, numbered
/// from 1, so the plan uses the index of the filters actually given (the
/// `(? IS NULL OR …)` pattern cannot). `status_column` is what the status
/// filter compares (`status`, or `'delivered'` for archived rows). The
/// filter's `before_id` and `limit` do not apply to a replay.
pub fn filter_query<'a>(
    sql: &str,
    filter: &'a EventFilter,
    status_column: &str,
    p: Placeholders,
) -> ListQuery<'a> {
    let (preds, args) = predicates(filter);
    let mut filters = String::new();
    for (i, pred) in preds.iter().enumerate() {
        filters.push_str(" AND ");
        filters.push_str(pred);
        filters.push_str(&p.nth(i + 1));
    }
    if let Some(s) = filter.status {
        filters.push_str(" AND ");
        filters.push_str(&status_literal(status_column, s));
    }
    ListQuery {
        sql: sql.replace(FILTERS, &filters),
        args,
    }
}

/// The given filters' predicates (each to be followed by its placeholder)
/// and values, in the order of the `(app_code, aggregate_id, …)` and
/// `(app_code, event_type, …)` indexes' columns.
fn predicates(filter: &EventFilter) -> (Vec<&'static str>, Vec<ListArg<'_>>) {
    let mut preds = Vec::new();
    let mut args = Vec::new();
    let text = [
        ("app_code = ", &filter.app_code),
        ("aggregate_id = ", &filter.aggregate_id),
        ("event_type = ", &filter.event_type),
    ];
    for (pred, value) in text {
        if let Some(v) = value {
            preds.push(pred);
            args.push(ListArg::Text(v));
        }
    }
    let ints = [
        ("created_at_ms >= ", filter.since_ms),
        ("created_at_ms < ", filter.until_ms),
    ];
    for (pred, value) in ints {
        if let Some(v) = value {
            preds.push(pred);
            args.push(ListArg::Int(v));
        }
    }
    (preds, args)
}

/// `column = '<status>'`: a status is one of a fixed set of names, so it
/// is written into the statement, where the planner sees it and can use
/// that status's partial index (a bound parameter hides it from a
/// generic plan).
fn status_literal(column: &str, status: Status) -> String {
    format!("{column} = '{}'", status.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_filter_reads_the_primary_key_backwards() {
        let f = EventFilter {
            limit: 50,
            ..Default::default()
        };
        let q = list_query("SELECT id FROM {table}", &f, Placeholders::Numbered);
        assert_eq!(q.sql, "SELECT id FROM {table} ORDER BY id DESC LIMIT $1");
        assert_eq!(q.args, vec![ListArg::Int(50)]);
    }

    #[test]
    fn only_given_filters_become_predicates_in_order() {
        let f = EventFilter {
            app_code: Some("room".into()),
            status: Some(Status::Failed),
            before_id: Some(900),
            limit: 20,
            ..Default::default()
        };
        let q = list_query("SELECT id FROM {table}", &f, Placeholders::Numbered);
        assert_eq!(
            q.sql,
            "SELECT id FROM {table} WHERE app_code = $1 AND id < $2 AND status = 'failed' ORDER BY id DESC LIMIT $3"
        );
        assert_eq!(
            q.args,
            vec![ListArg::Text("room"), ListArg::Int(900), ListArg::Int(20)]
        );
        let q = list_query("SELECT id FROM {table}", &f, Placeholders::Question);
        assert_eq!(
            q.sql,
            "SELECT id FROM {table} WHERE app_code = ? AND id < ? AND status = 'failed' ORDER BY id DESC LIMIT ?"
        );
    }

    #[test]
    fn replay_filters_become_predicates_only_when_given() {
        let f = EventFilter {
            app_code: Some("room".into()),
            status: Some(Status::Delivered),
            until_ms: Some(7),
            before_id: Some(1),
            limit: 3,
            ..Default::default()
        };
        let q = filter_query(
            "UPDATE {table} SET x = 1 WHERE status <> 'delivering'{filters} RETURNING id",
            &f,
            "status",
            Placeholders::Numbered,
        );
        assert_eq!(
            q.sql,
            "UPDATE {table} SET x = 1 WHERE status <> 'delivering' AND app_code = $1 \
             AND created_at_ms < $2 AND status = 'delivered' RETURNING id"
        );
        assert_eq!(q.args, vec![ListArg::Text("room"), ListArg::Int(7)]);
        let q = filter_query(
            "S WHERE 1 = 1{filters}",
            &f,
            "'delivered'",
            Placeholders::Question,
        );
        assert_eq!(
            q.sql,
            "S WHERE 1 = 1 AND app_code = ? AND created_at_ms < ? AND 'delivered' = 'delivered'"
        );
        let none = EventFilter::default();
        let q = filter_query(
            "S WHERE 1 = 1{filters} ORDER BY id",
            &none,
            "status",
            Placeholders::Question,
        );
        assert_eq!(q.sql, "S WHERE 1 = 1 ORDER BY id");
        assert!(q.args.is_empty());
    }

    #[test]
    fn time_range_and_type() {
        let f = EventFilter {
            event_type: Some("T".into()),
            since_ms: Some(1),
            until_ms: Some(2),
            limit: 1,
            ..Default::default()
        };
        let q = list_query("S", &f, Placeholders::Question);
        assert_eq!(
            q.sql,
            "S WHERE event_type = ? AND created_at_ms >= ? AND created_at_ms < ? ORDER BY id DESC LIMIT ?"
        );
        assert_eq!(q.args.len(), 4);
    }
}
