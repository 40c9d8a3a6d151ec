//! `postbox doctor --scans`: the statements the database's own statistics
//! show touching the outbox table, checked with the `lint-sql` rules and
//! for reading far more than they return; exit 1 when any is flagged.

use postbox_core::config::Uses;
use postbox_core::store::StatementStat;
use postbox_lint::{lint, one_line, reads_a_target, reads_far_more, Rule, Syntax};
use serde::Serialize;

use crate::cli::Global;
use crate::error::CliError;
use crate::open::{load_config, open_store};
use crate::output;

/// A statement and the rules it breaks.
#[derive(Debug, Serialize)]
struct Scanned<'a> {
    #[serde(flatten)]
    stat: &'a StatementStat,
    flags: Vec<Rule>,
}

impl Scanned<'_> {
    /// Flagged: it breaks a rule. A text the parser cannot read (a
    /// digest cut at the server's length limit) is listed, not flagged.
    fn flagged(&self) -> bool {
        self.flags.iter().any(|r| *r != Rule::Unparsed)
    }
}

pub async fn run(g: &Global) -> Result<(), CliError> {
    let config = load_config(g, Uses::DATABASE)?;
    let store = open_store(&config).await?;
    let stats = store.statement_stats().await?;
    let table = store.table().as_str();
    let target = super::lint_sql::target_of(store.table());
    let syntax = match store.backend() {
        "mysql" => Syntax::MySql,
        _ => Syntax::Postgres,
    };
    let scanned: Vec<Scanned> = stats
        .statements
        .iter()
        .map(|stat| {
            let mut flags: Vec<Rule> = lint(&stat.text, &target, syntax)
                .into_iter()
                .map(|f| f.rule)
                .collect();
            flags.dedup();
            // Only reads and writes of the table's rows: DDL (a migration)
            // reads catalogs. An unparsed text counts when it reads rows.
            let dml = reads_a_target(&stat.text, &target, syntax).unwrap_or_else(|| {
                let head = stat.text.trim_start().to_ascii_uppercase();
                ["SELECT", "UPDATE", "DELETE", "WITH"]
                    .iter()
                    .any(|k| head.starts_with(k))
            });
            if dml && reads_far_more(stat.calls, stat.rows, stat.rows_examined, stat.blocks) {
                flags.push(Rule::ReadsFarMore);
            }
            Scanned { stat, flags }
        })
        .collect();
    let flagged = scanned.iter().filter(|s| s.flagged()).count();
    if g.json {
        #[derive(Serialize)]
        struct Out<'a> {
            ok: bool,
            source: &'a str,
            table: &'a str,
            flagged: usize,
            unrecorded: i64,
            statements: &'a [Scanned<'a>],
        }
        output::json(&Out {
            ok: flagged == 0 && stats.unrecorded == 0,
            source: stats.source,
            table,
            flagged,
            unrecorded: stats.unrecorded,
            statements: &scanned,
        })?;
    } else {
        outln!(
            "{}: {} statement(s) name `{table}`; {flagged} flagged.",
            stats.source,
            scanned.len()
        );
        for s in scanned.iter().filter(|s| !s.flags.is_empty()) {
            let names: Vec<&str> = s.flags.iter().map(|r| r.name()).collect();
            let examined = match (s.stat.rows_examined, s.stat.blocks) {
                (Some(n), _) => format!(", {n} rows examined"),
                (None, Some(b)) => format!(", {b} pages read"),
                _ => String::new(),
            };
            outln!(
                "{}  {}: {} calls, {:.0} ms in all, {} rows{examined}",
                if s.flagged() { "FLAG" } else { "note" },
                names.join(", "),
                s.stat.calls,
                s.stat.total_ms,
                s.stat.rows
            );
            outln!("      {}", one_line(&s.stat.text, 300));
            for r in &s.flags {
                outln!("      {}: {}", r.name(), r.advice());
            }
        }
    }
    if stats.unrecorded > 0 {
        let full = format!(
            "{}'s statement table is full: {} statement(s) since were not recorded one by one, so a scan among them cannot be seen; \
             empty it (TRUNCATE performance_schema.events_statements_summary_by_digest) or raise performance_schema_digests_size, \
             and run `doctor --scans` again after some traffic",
            stats.source, stats.unrecorded
        );
        if flagged == 0 {
            return Err(CliError::runtime(format!("doctor --scans: {full}")));
        }
        errln!("warning: {full}");
    }
    if flagged == 0 {
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "doctor --scans: {flagged} statement(s) on `{table}` flagged"
        )))
    }
}
