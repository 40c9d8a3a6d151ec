//! `postbox lint-sql`: the outbox query rules (`postbox-lint`) on SQL text,
//! for CI; exit 1 on any finding.

use std::io::Read;
use std::path::PathBuf;

use postbox_core::config::{DatabaseKind, Uses};
use postbox_core::TableName;
use postbox_lint::{lint, Finding, Syntax, Target};
use serde::Serialize;

use crate::cli::{Global, LintSqlArgs, SqlSyntax};
use crate::error::CliError;
use crate::open::{has_config_file, load_config};
use crate::output;

/// One finding, with the file it is in.
#[derive(Debug, Serialize)]
struct Located {
    file: String,
    #[serde(flatten)]
    finding: Finding,
    why: &'static str,
}

/// The rules' target: `table` and its archive, by the table's own column
/// names.
pub(crate) fn target_of(table: &TableName) -> Target {
    Target::outbox(table.as_str()).columns(
        table.column("app_code"),
        table.column("status"),
        table.column("id"),
    )
}

pub fn run(g: &Global, args: LintSqlArgs) -> Result<(), CliError> {
    let (tables, config) = if args.tables.is_empty() {
        // Without a config file the defaults would name a table nobody has.
        if !has_config_file(g)? {
            return Err(CliError::usage(
                "name the outbox table with --table NAME, or give a config (--config) with database.table",
            ));
        }
        let config = load_config(g, Uses::DATABASE).map_err(|e| {
            CliError::usage(format!(
                "name the outbox table with --table NAME, or give a config with database.table ({e})"
            ))
        })?;
        let syntax = match config.database_kind() {
            DatabaseKind::MySql => Syntax::MySql,
            _ => Syntax::Postgres,
        };
        let table = config.database.adopted_table()?;
        (vec![table.as_str().to_owned()], Some((syntax, table)))
    } else {
        (args.tables.clone(), None)
    };
    let syntax = match args.syntax {
        Some(SqlSyntax::Postgres) => Syntax::Postgres,
        Some(SqlSyntax::Mysql) => Syntax::MySql,
        None => config
            .as_ref()
            .map_or(Syntax::Postgres, |(syntax, _)| *syntax),
    };
    let first = match &config {
        Some((_, table)) => target_of(table),
        None => Target::outbox(&tables[0]),
    };
    let target = tables[1..].iter().fold(first, |t, name| {
        t.and_table(name).and_table(&format!("{name}_archive"))
    });
    let stdin = [PathBuf::from("-")];
    let files = if args.files.is_empty() {
        &stdin[..]
    } else {
        &args.files[..]
    };
    let mut found = Vec::new();
    for path in files {
        let (name, text) = read(path)?;
        found.extend(
            lint(&text, &target, syntax)
                .into_iter()
                .map(|finding| Located {
                    file: name.clone(),
                    why: finding.rule.advice(),
                    finding,
                }),
        );
    }
    if g.json {
        output::json(&found)?;
    } else {
        for f in &found {
            outln!(
                "{}:{}: {} ({}): {}",
                f.file,
                f.finding.line,
                f.finding.rule.name(),
                f.finding.table.as_deref().unwrap_or("?"),
                f.finding.statement
            );
            outln!("    {}", f.why);
        }
    }
    if found.is_empty() {
        if !g.json {
            outln!(
                "lint-sql: no finding in {} file(s) for {}.",
                files.len(),
                target.tables().join(", ")
            );
        }
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "lint-sql: {} finding(s)",
            found.len()
        )))
    }
}

/// The text of `path` (`-`: stdin) and the name to report it by.
fn read(path: &PathBuf) -> Result<(String, String), CliError> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| CliError::runtime(format!("stdin: {e}")))?;
        return Ok(("<stdin>".into(), text));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::usage(format!("{}: {e}", path.display())))?;
    Ok((path.display().to_string(), text))
}
