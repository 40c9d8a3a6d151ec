//! Rules for SQL that reads an outbox table: the statement shapes that
//! turned outbox polling into a database outage (seed 002: many workers
//! polling owner tables with `OR`-branched, app_code-less claims saturated
//! MySQL's CPU).
//!
//! [`lint`] parses SQL text (PostgreSQL or MySQL syntax, with `$1` or `?`
//! placeholders, as written in code or as the database's statement
//! statistics normalise it) and reports, per statement that reads or writes
//! one of the given tables:
//!
//! - [`Rule::OrAcrossStatuses`]: an `OR` with `status` on one side and
//!   something else on the other (`status = 'pending' OR (status =
//!   'failed' AND retry_at < ?)`): no index range serves both branches, so
//!   the planner reads the tenant's rows, or the table. One statement per
//!   status (or `UNION ALL`), or `status IN (…)` where the branches only
//!   differ by status, keeps each to its index.
//! - [`Rule::NoAppCode`]: neither an `app_code` predicate nor an `id` key:
//!   every tenant's rows are read (the monitoring `COUNT(*) … GROUP BY
//!   status` of the incident is one).
//!
//! A statement the parser does not understand is reported as
//! [`Rule::Unparsed`], never passed as clean.

use std::ops::ControlFlow;

use serde::Serialize;
use sqlparser::ast::{
    BinaryOperator, Expr, FromTable, FunctionArg, FunctionArgExpr, FunctionArguments,
    JoinConstraint, JoinOperator, ObjectName, OrderByKind, Query, Select, SelectItem, SetExpr,
    Spanned, Statement, TableFactor, TableWithJoins, Visit, Visitor,
};
use sqlparser::dialect::{Dialect, GenericDialect, MySqlDialect, PostgreSqlDialect};
use sqlparser::parser::Parser;

/// A rule a statement can break; serialized as its [`Rule::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// `OR` between `status` and another condition.
    OrAcrossStatuses,
    /// No `app_code` predicate and no `id` key.
    NoAppCode,
    /// The database's statistics show it reading far more than it returns
    /// (`doctor --scans` only: [`reads_far_more`]).
    ReadsFarMore,
    /// The statement could not be parsed.
    Unparsed,
}

/// `--json` names a rule as the text output and the README do (it wrote
/// `or_across_statuses` beside the text's `or-across-statuses`).
impl Serialize for Rule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl Rule {
    /// The rule's name, as `--json` and the text output write it.
    pub fn name(self) -> &'static str {
        match self {
            Rule::OrAcrossStatuses => "or-across-statuses",
            Rule::NoAppCode => "no-app-code",
            Rule::ReadsFarMore => "reads-far-more-than-it-returns",
            Rule::Unparsed => "unparsed",
        }
    }

    /// Why the rule exists and what to write instead.
    pub fn advice(self) -> &'static str {
        match self {
            Rule::OrAcrossStatuses => {
                "an OR between status and another condition reads past every index: write one statement per status (or UNION ALL), or status IN (…) when the branches differ only by status"
            }
            Rule::NoAppCode => {
                "no app_code predicate (nor an id key): it reads every tenant's rows; lead with app_code = ?, the first column of every outbox index"
            }
            Rule::ReadsFarMore => {
                "it reads far more than it returns: a scan where an index read was meant; EXPLAIN it"
            }
            Rule::Unparsed => "not understood by the SQL parser, so not checked",
        }
    }
}

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// 1-based line of the statement's start in the linted text.
    pub line: u64,
    /// What was broken.
    pub rule: Rule,
    /// The table it reads, when the rule concerns one.
    pub table: Option<String>,
    /// The statement, on one line, cut at 200 characters.
    pub statement: String,
}

/// What the rules look for: the outbox tables and their column names.
#[derive(Debug, Clone)]
pub struct Target {
    tables: Vec<String>,
    app_code: String,
    status: String,
    id: String,
}

impl Target {
    /// The outbox table `table` and its archive, with postbox's column
    /// names (`app_code`, `status`, `id`).
    pub fn outbox(table: &str) -> Self {
        Target {
            tables: vec![
                table.to_ascii_lowercase(),
                format!("{table}_archive").to_ascii_lowercase(),
            ],
            app_code: "app_code".into(),
            status: "status".into(),
            id: "id".into(),
        }
    }

    /// The table names postbox's `app_code`, `status` and `id` columns
    /// its own way (an adopted table, `[database.columns]`).
    pub fn columns(mut self, app_code: &str, status: &str, id: &str) -> Self {
        self.app_code = app_code.to_ascii_lowercase();
        self.status = status.to_ascii_lowercase();
        self.id = id.to_ascii_lowercase();
        self
    }

    /// Also checks statements on `table`.
    pub fn and_table(mut self, table: &str) -> Self {
        self.tables.push(table.to_ascii_lowercase());
        self
    }

    /// The tables checked, lower case.
    pub fn tables(&self) -> &[String] {
        &self.tables
    }

    /// Whether `name` (possibly schema-qualified, possibly quoted) is one
    /// of the tables.
    fn is_target(&self, name: &ObjectName) -> Option<String> {
        let last = name.0.last()?.as_ident()?.value.to_ascii_lowercase();
        self.tables.contains(&last).then_some(last)
    }
}

/// Whether a statement's totals show it reading far more than it returns:
/// on average at least 10,000 rows examined (MariaDB/MySQL) or 1,000
/// buffer pages (PostgreSQL, 8 MiB) per call, and 100 times more rows
/// examined (or 10 times more pages) than rows returned. An index read of
/// an outbox claim examines about the rows it takes.
pub fn reads_far_more(
    calls: i64,
    rows: i64,
    rows_examined: Option<i64>,
    blocks: Option<i64>,
) -> bool {
    let calls = calls.max(1);
    let rows = rows.max(1);
    match (rows_examined, blocks) {
        (Some(examined), _) => examined / calls >= 10_000 && examined / rows >= 100,
        (None, Some(blocks)) => blocks / calls >= 1_000 && blocks / rows >= 10,
        (None, None) => false,
    }
}

/// The SQL syntax to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// PostgreSQL (`$1` placeholders, `"quoted"` names).
    Postgres,
    /// MySQL and MariaDB (`?`, `` `quoted` `` names).
    MySql,
}

impl Syntax {
    fn dialect(self) -> Box<dyn Dialect> {
        match self {
            Syntax::Postgres => Box::new(PostgreSqlDialect {}),
            Syntax::MySql => Box::new(MySqlDialect {}),
        }
    }
}

/// The rules' findings for `sql` (one or more statements separated by
/// `;`), in order of line.
pub fn lint(sql: &str, target: &Target, syntax: Syntax) -> Vec<Finding> {
    let mut out = Vec::new();
    match parse(sql, syntax) {
        Ok(statements) => {
            for st in &statements {
                check(st, target, st.span().start.line.max(1), &mut out);
            }
        }
        // One statement the parser refuses should not hide the others:
        // each is parsed alone, at its own line.
        Err(_) => {
            for (line, text) in split_statements(sql) {
                match parse(text, syntax) {
                    Ok(statements) => {
                        for st in &statements {
                            check(st, target, line, &mut out);
                        }
                    }
                    Err(_) if mentions_a_target(text, target) => out.push(Finding {
                        line,
                        rule: Rule::Unparsed,
                        table: None,
                        statement: one_line(text, STATEMENT_WIDTH),
                    }),
                    Err(_) => {}
                }
            }
        }
    }
    out.sort_by_key(|f| f.line);
    out
}

/// `sql` read as `syntax`, else as generic SQL (a driver's `?`
/// placeholders in PostgreSQL code, say).
fn parse(sql: &str, syntax: Syntax) -> Result<Vec<Statement>, sqlparser::parser::ParserError> {
    Parser::parse_sql(syntax.dialect().as_ref(), sql)
        .or_else(|_| Parser::parse_sql(&GenericDialect {}, sql))
}

/// Whether `sql` reads or writes one of the tables through a `SELECT`,
/// `UPDATE` or `DELETE` (`None`: it could not be parsed).
pub fn reads_a_target(sql: &str, target: &Target, syntax: Syntax) -> Option<bool> {
    let statements = parse(sql, syntax).ok()?;
    let mut v = Checker::new(target);
    for st in &statements {
        let _ = st.visit(&mut v);
    }
    Some(v.scoped)
}

/// How much of a statement a finding quotes.
const STATEMENT_WIDTH: usize = 200;

/// The findings for one statement, starting at `line`.
fn check(st: &Statement, target: &Target, line: u64, out: &mut Vec<Finding>) {
    let mut v = Checker::new(target);
    let _ = st.visit(&mut v);
    let text = one_line(&st.to_string(), STATEMENT_WIDTH);
    for (rule, table) in v.found {
        let finding = Finding {
            line,
            rule,
            table: Some(table),
            statement: text.clone(),
        };
        if !out.contains(&finding) {
            out.push(finding);
        }
    }
}

/// Walks a statement: every `SELECT` (subqueries and `UNION` branches
/// included), `UPDATE` and `DELETE` that names a target table.
struct Checker<'a> {
    target: &'a Target,
    found: Vec<(Rule, String)>,
    /// A target table was among the scopes checked.
    scoped: bool,
    /// The selects of `ORDER BY id … LIMIT` queries.
    paged: Vec<*const Select>,
}

impl<'a> Checker<'a> {
    fn new(target: &'a Target) -> Self {
        Checker {
            target,
            found: Vec::new(),
            scoped: false,
            paged: Vec::new(),
        }
    }
}

impl Visitor for Checker<'_> {
    type Break = ();

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        // `ORDER BY id … LIMIT n`: the primary key read from one end.
        let by_id = match query.order_by.as_ref().map(|o| &o.kind) {
            Some(OrderByKind::Expressions(exprs)) => exprs
                .first()
                .is_some_and(|o| is_column(&o.expr, &self.target.id)),
            _ => false,
        };
        if by_id && (query.limit_clause.is_some() || query.fetch.is_some()) {
            if let SetExpr::Select(select) = query.body.as_ref() {
                self.paged.push(std::ptr::from_ref(select.as_ref()));
            }
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_select(&mut self, select: &Select) -> ControlFlow<()> {
        // Without a WHERE, a page by id or `MIN(id)`/`MAX(id)` reads the
        // primary key's end, however many rows the table has.
        let bounded = select.selection.is_none()
            && (self.paged.contains(&std::ptr::from_ref(select)) || self.key_extremes(select));
        if !bounded {
            self.scope(&select.from, select.selection.as_ref());
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_statement(&mut self, st: &Statement) -> ControlFlow<()> {
        match st {
            Statement::Update(u) => {
                self.scope(std::slice::from_ref(&u.table), u.selection.as_ref());
            }
            Statement::Delete(d) => {
                let from = match &d.from {
                    FromTable::WithFromKeyword(t) | FromTable::WithoutKeyword(t) => t,
                };
                self.scope(from, d.selection.as_ref());
            }
            _ => {}
        }
        ControlFlow::Continue(())
    }
}

impl Checker<'_> {
    /// Every item of the select list is `MIN(id)` or `MAX(id)`.
    fn key_extremes(&self, select: &Select) -> bool {
        let extreme = |e: &Expr| {
            let Expr::Function(f) = e else { return false };
            let name = f.name.to_string().to_ascii_lowercase();
            let FunctionArguments::List(list) = &f.args else {
                return false;
            };
            (name == "min" || name == "max")
                && matches!(list.args.as_slice(),
                    [FunctionArg::Unnamed(FunctionArgExpr::Expr(arg))] if is_column(arg, &self.target.id))
        };
        !select.projection.is_empty()
            && select.projection.iter().all(|item| match item {
                SelectItem::UnnamedExpr(e) | SelectItem::ExprWithAlias { expr: e, .. } => {
                    extreme(e)
                }
                _ => false,
            })
    }

    /// Checks `selection` (with the join conditions) for each target table
    /// among `from`.
    fn scope(&mut self, from: &[TableWithJoins], selection: Option<&Expr>) {
        let mut tables = Vec::new();
        let mut conditions: Vec<&Expr> = selection.into_iter().collect();
        for t in from {
            tables.push(&t.relation);
            for j in &t.joins {
                tables.push(&j.relation);
                if let Some(on) = join_condition(&j.join_operator) {
                    conditions.push(on);
                }
            }
        }
        for factor in tables {
            let TableFactor::Table { name, .. } = factor else {
                continue;
            };
            let Some(table) = self.target.is_target(name) else {
                continue;
            };
            self.scoped = true;
            if conditions.iter().any(|c| self.or_across_statuses(c)) {
                self.found.push((Rule::OrAcrossStatuses, table.clone()));
            }
            let keyed = conditions
                .iter()
                .flat_map(|c| conjuncts(c))
                .any(|c| self.is_key(c));
            if !keyed {
                self.found.push((Rule::NoAppCode, table));
            }
        }
    }

    /// An `OR` anywhere in `e` with `status` in a branch, unless every
    /// branch is `status = <value>` (an `IN` list in disguise).
    fn or_across_statuses(&self, e: &Expr) -> bool {
        let mut hit = false;
        let _ = e.visit(&mut ExprWalk(|x: &Expr| {
            if let Expr::BinaryOp {
                left,
                op: BinaryOperator::Or,
                right,
            } = x
            {
                let status = |e: &Expr| mentions(e, &self.target.status);
                let only_status = disjuncts(x).iter().all(|d| self.is_status_eq(d));
                if (status(left) || status(right)) && !only_status {
                    hit = true;
                }
            }
        }));
        hit
    }

    /// `status = <value>`.
    fn is_status_eq(&self, e: &Expr) -> bool {
        matches!(e, Expr::BinaryOp { left, op: BinaryOperator::Eq, right }
            if is_column(left, &self.target.status) && !mentions_any_column(right)
                || is_column(right, &self.target.status) && !mentions_any_column(left))
    }

    /// A conjunct that leads an index: a comparison, `IN`, `BETWEEN` or
    /// `= ANY(…)` on `app_code`, or an equality, `IN` or `= ANY` on `id`.
    fn is_key(&self, e: &Expr) -> bool {
        let t = self.target;
        let on = |c: &Expr, name: &str| is_column(c, name);
        match e {
            Expr::BinaryOp { left, op, right } => {
                let range = matches!(
                    op,
                    BinaryOperator::Eq
                        | BinaryOperator::Gt
                        | BinaryOperator::GtEq
                        | BinaryOperator::Lt
                        | BinaryOperator::LtEq
                );
                (range && (on(left, &t.app_code) || on(right, &t.app_code)))
                    || (*op == BinaryOperator::Eq && (on(left, &t.id) || on(right, &t.id)))
            }
            Expr::AnyOp { left, .. } => on(left, &t.app_code) || on(left, &t.id),
            Expr::In {
                expr,
                negated: false,
                ..
            } => on(expr, &t.app_code) || on(expr, &t.id),
            Expr::Between {
                expr,
                negated: false,
                ..
            } => on(expr, &t.app_code),
            Expr::Nested(inner) => self.is_key(inner),
            _ => false,
        }
    }
}

/// Calls a closure on every expression.
struct ExprWalk<F: FnMut(&Expr)>(F);

impl<F: FnMut(&Expr)> Visitor for ExprWalk<F> {
    type Break = ();

    fn pre_visit_expr(&mut self, e: &Expr) -> ControlFlow<()> {
        (self.0)(e);
        ControlFlow::Continue(())
    }
}

fn join_condition(op: &JoinOperator) -> Option<&Expr> {
    let constraint = match op {
        JoinOperator::Join(c)
        | JoinOperator::Inner(c)
        | JoinOperator::Left(c)
        | JoinOperator::LeftOuter(c)
        | JoinOperator::Right(c)
        | JoinOperator::RightOuter(c)
        | JoinOperator::FullOuter(c)
        | JoinOperator::StraightJoin(c) => c,
        _ => return None,
    };
    match constraint {
        JoinConstraint::On(e) => Some(e),
        _ => None,
    }
}

/// The top-level `AND` terms of `e`.
fn conjuncts(e: &Expr) -> Vec<&Expr> {
    terms(e, &BinaryOperator::And)
}

/// The top-level `OR` terms of `e`.
fn disjuncts(e: &Expr) -> Vec<&Expr> {
    terms(e, &BinaryOperator::Or)
}

/// The operands of a chain of `op` (through parentheses).
fn terms<'e>(e: &'e Expr, op: &BinaryOperator) -> Vec<&'e Expr> {
    match e {
        Expr::BinaryOp { left, op: o, right } if o == op => {
            let mut v = terms(left, op);
            v.extend(terms(right, op));
            v
        }
        Expr::Nested(inner) => terms(inner, op),
        _ => vec![e],
    }
}

/// `e` is the column `name` (bare or qualified), case-insensitively.
fn is_column(e: &Expr, name: &str) -> bool {
    match e {
        Expr::Identifier(i) => i.value.eq_ignore_ascii_case(name),
        Expr::CompoundIdentifier(parts) => parts
            .last()
            .is_some_and(|i| i.value.eq_ignore_ascii_case(name)),
        Expr::Nested(inner) => is_column(inner, name),
        _ => false,
    }
}

/// `e` reads the column `name` somewhere.
fn mentions(e: &Expr, name: &str) -> bool {
    let mut hit = false;
    let _ = e.visit(&mut ExprWalk(|x: &Expr| hit |= is_column(x, name)));
    hit
}

/// `e` reads some column.
fn mentions_any_column(e: &Expr) -> bool {
    let mut hit = false;
    let _ = e.visit(&mut ExprWalk(|x: &Expr| {
        hit |= matches!(x, Expr::Identifier(_) | Expr::CompoundIdentifier(_));
    }));
    hit
}

/// Whether `text` names one of the target tables (a word of it).
fn mentions_a_target(text: &str, target: &Target) -> bool {
    let lower = text.to_ascii_lowercase();
    lower
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .any(|w| target.tables.iter().any(|t| t == w))
}

/// `sql` cut at each `;` outside quotes and comments, with the 1-based
/// line each piece starts on (after leading blank lines).
fn split_statements(sql: &str) -> Vec<(u64, &str)> {
    let mut out = Vec::new();
    let (mut start, mut line, mut start_line) = (0, 1u64, 1u64);
    let mut quote: Option<char> = None;
    let mut chars = sql.char_indices().peekable();
    let mut in_line_comment = false;
    let mut in_block_comment = false;
    let mut fresh = true;
    while let Some((i, c)) = chars.next() {
        if c == '\n' {
            line += 1;
            in_line_comment = false;
        }
        if fresh && !c.is_whitespace() {
            start_line = line;
            fresh = false;
        }
        if in_line_comment {
            continue;
        }
        if in_block_comment {
            if c == '*' && chars.peek().map(|p| p.1) == Some('/') {
                chars.next();
                in_block_comment = false;
            }
            continue;
        }
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None => match c {
                '\'' | '"' | '`' => quote = Some(c),
                '-' if chars.peek().map(|p| p.1) == Some('-') => in_line_comment = true,
                '/' if chars.peek().map(|p| p.1) == Some('*') => in_block_comment = true,
                ';' => {
                    out.push((start_line, &sql[start..i]));
                    start = i + 1;
                    fresh = true;
                }
                _ => {}
            },
        }
    }
    out.push((start_line, &sql[start..]));
    out.retain(|(_, s)| !s.trim().is_empty());
    out
}

/// `s` on one line, cut at `width` characters.
pub fn one_line(s: &str, width: usize) -> String {
    let flat: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(width) {
        Some((i, _)) => format!("{}…", &flat[..i]),
        None => flat,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_names_a_rule_as_the_text_does() {
        for rule in [
            Rule::OrAcrossStatuses,
            Rule::NoAppCode,
            Rule::ReadsFarMore,
            Rule::Unparsed,
        ] {
            assert_eq!(serde_json::to_value(rule).unwrap(), rule.name());
        }
    }

    /// (what it shows, SQL, syntax, the findings as (line, rule)).
    type Case = (
        &'static str,
        &'static str,
        Syntax,
        &'static [(u64, &'static str)],
    );

    const CASES: &[Case] = &[
        (
            "seed 002's claim: no app_code, an OR across statuses",
            "SELECT * FROM room_outbox\n WHERE status = 0 OR (status = 3 AND next_retry_at < NOW())\n LIMIT 100 FOR UPDATE",
            Syntax::MySql,
            &[(1, "or-across-statuses"), (1, "no-app-code")],
        ),
        (
            "tenant-keyed claims, marks by id, and an OR of statuses alone are clean",
            "SELECT id FROM room_outbox WHERE app_code = $1 AND status = 'pending' ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED;\n\
             UPDATE room_outbox SET status = 'delivered' WHERE id = ANY($1) AND worker_id = $2;\n\
             SELECT id FROM room_outbox WHERE app_code = $1 AND (status = 'pending' OR status = 'retryable')",
            Syntax::Postgres,
            &[],
        ),
        (
            "monitoring without app_code, at its line; other tables are not checked",
            "-- the dashboard\nSELECT 1;\n\nSELECT status, COUNT(*)\n  FROM room_outbox GROUP BY status;\nSELECT * FROM other_table",
            Syntax::Postgres,
            &[(4, "no-app-code")],
        ),
        (
            "UNION branches, DELETE, quoted names and subqueries",
            "SELECT * FROM room_outbox_archive a WHERE a.app_code = ? UNION ALL SELECT * FROM room_outbox WHERE created_at_ms > 5;\n\
             DELETE FROM room_outbox WHERE status = 'delivered' OR updated_at_ms < 10;\n\
             SELECT * FROM t WHERE x IN (SELECT id FROM `room_outbox` WHERE app_code = 'a')",
            Syntax::MySql,
            &[(1, "no-app-code"), (2, "or-across-statuses"), (2, "no-app-code")],
        ),
        (
            "an unparsable statement on the table is reported, the rest checked",
            "SELECT FROM WHERE room_outbox ((;\nSELECT * FROM room_outbox",
            Syntax::Postgres,
            &[(1, "unparsed"), (2, "no-app-code")],
        ),
        (
            "a page by id or the key's end reads no more than it returns",
            "SELECT id, status FROM room_outbox ORDER BY id DESC LIMIT 50;\n\
             SELECT MAX(id) FROM room_outbox;\n\
             SELECT id FROM room_outbox WHERE status = 'x' ORDER BY id LIMIT 5;\n\
             SELECT MAX(created_at_ms) FROM room_outbox",
            Syntax::Postgres,
            &[(3, "no-app-code"), (4, "no-app-code")],
        ),
        (
            "pg_stat_statements' normalised text",
            "SELECT id FROM room_outbox WHERE status = $1 OR next_retry_at_ms < $2",
            Syntax::Postgres,
            &[(1, "or-across-statuses"), (1, "no-app-code")],
        ),
        (
            "MariaDB's digest text",
            "SELECT `id` FROM `room_outbox` WHERE `app_code` = ? AND ( `status` = ? OR `lock_until_ms` < ? ) LIMIT ?",
            Syntax::MySql,
            &[(1, "or-across-statuses")],
        ),
        (
            "a driver's ? placeholders in PostgreSQL code",
            "SELECT id FROM room_outbox WHERE app_code = ? AND status = ?",
            Syntax::Postgres,
            &[],
        ),
    ];

    #[test]
    fn each_case_finds_what_it_should() {
        let target = Target::outbox("room_outbox");
        for (what, sql, syntax, want) in CASES {
            let got: Vec<(u64, &str)> = lint(sql, &target, *syntax)
                .into_iter()
                .map(|f| (f.line, f.rule.name()))
                .collect();
            assert_eq!(got, *want, "{what}");
        }
    }

    #[test]
    fn an_adopted_table_is_read_by_its_own_column_names() {
        let target = Target::outbox("room_outbox").columns("app", "state", "id");
        let rules = |sql: &str| -> Vec<&str> {
            lint(sql, &target, Syntax::MySql)
                .into_iter()
                .map(|f| f.rule.name())
                .collect()
        };
        assert_eq!(
            rules("SELECT id FROM room_outbox WHERE app = ? AND (state = 'init' OR locked_until_ms < ?)"),
            ["or-across-statuses"]
        );
        assert_eq!(
            rules("SELECT id FROM room_outbox WHERE app_code = ? AND state = 'init'"),
            ["no-app-code"],
            "postbox's name is not the table's"
        );
        assert!(rules("SELECT id FROM room_outbox WHERE app = ? AND state = 'init'").is_empty());
    }

    #[test]
    fn heavy_reads_need_both_volume_and_ratio() {
        assert!(reads_far_more(10, 10, Some(1_000_000), None));
        assert!(
            !reads_far_more(10, 100_000, Some(1_000_000), None),
            "returns what it reads"
        );
        assert!(
            !reads_far_more(1_000, 10, Some(1_000_000), None),
            "1,000 rows a call"
        );
        assert!(reads_far_more(2, 5, None, Some(20_000)));
        assert!(!reads_far_more(2, 5, None, Some(200)));
    }
}
