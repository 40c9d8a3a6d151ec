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
    pub(crate) fn nth(self, n: usize) -> String {
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

/// The ids, in order, of at most `filter.limit` rows of `table`
/// (`{table}` or `{archive}`) that match the filter, as [`filter_query`]
/// writes it (`status_column` likewise): where a paced replay's batch
/// ends.
pub fn ids_query<'a>(
    table: &str,
    filter: &'a EventFilter,
    status_column: &str,
    p: Placeholders,
) -> ListQuery<'a> {
    let select = format!("SELECT id FROM {table} WHERE 1 = 1{FILTERS}");
    let mut q = filter_query(&select, filter, status_column, p);
    q.sql.push_str(" ORDER BY id LIMIT ");
    q.sql.push_str(&p.nth(q.args.len() + 1));
    q.args.push(ListArg::Int(i64::from(filter.limit)));
    q
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
        ("id > ", filter.after_id),
        ("id <= ", filter.through_id),
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
/// The status of an archived row, as a replay's status filter compares
/// it: `dropped` (sampled out, archived since schema version 11) or, for
/// every other row there, `delivered` (`published` and a legacy table's
/// own values included).
pub const ARCHIVED_STATUS: &str =
    "(CASE WHEN status = 'dropped' THEN 'dropped' ELSE 'delivered' END)";

fn status_literal(column: &str, status: Status) -> String {
    match status {
        // A seed table's `published` rows read as delivered (SPEC), in the
        // counts and here: `replay --status delivered` left them out of
        // the live table while taking the archived ones.
        Status::Delivered => format!("{column} IN ('delivered', 'published')"),
        other => format!("{column} = '{}'", other.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which statement a case builds.
    enum Build {
        /// [`list_query`] after this `SELECT … FROM`.
        List(&'static str),
        /// [`filter_query`] of this statement, the status filter comparing
        /// this column.
        Replay(&'static str, &'static str),
    }

    /// Each case: a statement, a filter and the placeholders, and the SQL
    /// and values they make. Only the given filters become predicates, in
    /// the order of the indexes' columns; a replay takes no `before_id` nor
    /// `limit`.
    #[test]
    fn only_given_filters_become_predicates_in_order() {
        use Build::{List, Replay};
        use Placeholders::{Numbered, Question};
        let first_50 = EventFilter {
            limit: 50,
            ..Default::default()
        };
        // Rows of `room` in `status`.
        let room = |status| EventFilter {
            app_code: Some("room".into()),
            status: Some(status),
            ..Default::default()
        };
        let room_failed_page = EventFilter {
            before_id: Some(900),
            limit: 20,
            ..room(Status::Failed)
        };
        let typed_range = EventFilter {
            event_type: Some("T".into()),
            since_ms: Some(1),
            until_ms: Some(2),
            limit: 1,
            ..Default::default()
        };
        let room_delivered_until = EventFilter {
            until_ms: Some(7),
            before_id: Some(1),
            limit: 3,
            ..room(Status::Delivered)
        };
        let none = EventFilter::default();
        let room_page = || vec![ListArg::Text("room"), ListArg::Int(900), ListArg::Int(20)];
        let room_until = || vec![ListArg::Text("room"), ListArg::Int(7)];
        let cases = [
            // No filter reads the primary key backwards.
            (
                List("SELECT id FROM {table}"),
                &first_50,
                Numbered,
                "SELECT id FROM {table} ORDER BY id DESC LIMIT $1",
                vec![ListArg::Int(50)],
            ),
            (
                List("SELECT id FROM {table}"),
                &room_failed_page,
                Numbered,
                "SELECT id FROM {table} WHERE app_code = $1 AND id < $2 AND status = 'failed' ORDER BY id DESC LIMIT $3",
                room_page(),
            ),
            (
                List("SELECT id FROM {table}"),
                &room_failed_page,
                Question,
                "SELECT id FROM {table} WHERE app_code = ? AND id < ? AND status = 'failed' ORDER BY id DESC LIMIT ?",
                room_page(),
            ),
            (
                List("S"),
                &typed_range,
                Question,
                "S WHERE event_type = ? AND created_at_ms >= ? AND created_at_ms < ? ORDER BY id DESC LIMIT ?",
                vec![
                    ListArg::Text("T"),
                    ListArg::Int(1),
                    ListArg::Int(2),
                    ListArg::Int(1),
                ],
            ),
            (
                Replay(
                    "UPDATE {table} SET x = 1 WHERE status <> 'delivering'{filters} RETURNING id",
                    "status",
                ),
                &room_delivered_until,
                Numbered,
                "UPDATE {table} SET x = 1 WHERE status <> 'delivering' AND app_code = $1 \
                 AND created_at_ms < $2 AND status IN ('delivered', 'published') RETURNING id",
                room_until(),
            ),
            (
                Replay("S WHERE 1 = 1{filters}", "'delivered'"),
                &room_delivered_until,
                Question,
                "S WHERE 1 = 1 AND app_code = ? AND created_at_ms < ? AND 'delivered' IN ('delivered', 'published')",
                room_until(),
            ),
            (
                Replay("S WHERE 1 = 1{filters} ORDER BY id", "status"),
                &none,
                Question,
                "S WHERE 1 = 1 ORDER BY id",
                vec![],
            ),
        ];
        for (build, filter, p, sql, args) in cases {
            let q = match build {
                List(select_from) => list_query(select_from, filter, p),
                Replay(statement, status_column) => {
                    filter_query(statement, filter, status_column, p)
                }
            };
            assert_eq!(q.sql, sql, "{filter:?}");
            assert_eq!(q.args, args, "{filter:?}");
        }
    }
}
