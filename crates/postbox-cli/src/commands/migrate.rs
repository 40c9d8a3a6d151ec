//! `postbox migrate`.

use postbox_core::config::{DatabaseKind, Settings};
use postbox_runtime::store::ScriptVersion;

use crate::cli::{Global, MigrateArgs, ScriptFormat};
use crate::error::CliError;
use crate::open::{load_config, load_config_offline, open_store_creating, WITH_CONSUMERS};
use crate::output;

pub async fn run(g: &Global, args: MigrateArgs) -> Result<(), CliError> {
    if args.print_sql {
        // Only the database's kind and the table's names are printed from.
        return print_sql(&load_config_offline(g)?, &args);
    }
    let config = load_config(g, WITH_CONSUMERS)?;
    let store = open_store_creating(&config).await?;
    let report = store.migrate().await?;
    let inboxes = postbox_runtime::consumers::migrate_inboxes(&config).await?;
    let aggregate_index = match (args.aggregate_index, args.drop_aggregate_index) {
        (false, false) => None,
        (wanted, _) => Some((wanted, store.aggregate_index(wanted).await?)),
    };
    if g.json {
        let mut out = serde_json::to_value(&report).map_err(CliError::runtime)?;
        if let Some((wanted, changed)) = &aggregate_index {
            let key = if *wanted { "created" } else { "dropped" };
            out["aggregate_index"] = serde_json::json!({ key: changed });
        }
        return output::json(&out);
    }
    for note in &report.notes {
        outln!("{} `{}`: {note}.", store.backend(), store.table());
    }
    if report.applied.is_empty() {
        outln!(
            "{} `{}` is up to date (schema version {}).",
            store.backend(),
            store.table(),
            report.version
        );
    } else {
        outln!(
            "{} `{}`: applied schema versions {:?}; now at version {}.",
            store.backend(),
            store.table(),
            report.applied,
            report.version
        );
    }
    for line in inboxes {
        outln!("{line}.");
    }
    match aggregate_index {
        Some((true, changed)) if changed.is_empty() => {
            outln!("search by aggregate: its indexes were already there.")
        }
        Some((true, changed)) => outln!(
            "search by aggregate: created {} (one more index entry per event write).",
            changed.join(", ")
        ),
        Some((false, changed)) if changed.is_empty() => {
            outln!("search by aggregate: its indexes were not there.")
        }
        Some((false, changed)) => outln!(
            "search by aggregate: dropped {}; it is refused until `postbox migrate --aggregate-index`.",
            changed.join(", ")
        ),
        None => {}
    }
    Ok(())
}

/// `--print-sql`: the versions after `--from`, to stdout or a file each.
fn print_sql(config: &Settings, args: &MigrateArgs) -> Result<(), CliError> {
    let versions = postbox_runtime::store::migration_script(config, args.from);
    let backend = match config.database_kind() {
        DatabaseKind::Postgres => "PostgreSQL",
        DatabaseKind::MySql => "MariaDB/MySQL",
        DatabaseKind::Sqlite => "SQLite",
    };
    let table = config.database.table.as_str();
    let text = |v: &ScriptVersion| {
        let mut s = format!(
            "-- postbox schema version {} of `{table}` ({backend}): {}\n",
            v.version, v.description
        );
        for st in &v.statements {
            s.push_str(st.trim_end());
            s.push_str(";\n");
        }
        s
    };
    let Some(dir) = &args.out else {
        if versions.is_empty() {
            errln!("postbox: nothing after schema version {}", args.from);
        }
        for v in &versions {
            outln!("{}", text(v));
        }
        return Ok(());
    };
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::runtime(format!("--out {}: {e}", dir.display())))?;
    for v in &versions {
        let slug: String = v
            .description
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect::<String>()
            .split('_')
            .filter(|w| !w.is_empty())
            .take(8)
            .collect::<Vec<_>>()
            .join("_");
        let name = match args.format {
            ScriptFormat::Flyway => format!("V{}__{slug}.sql", v.version),
            ScriptFormat::GolangMigrate => format!("{:06}_{slug}.up.sql", v.version),
        };
        let path = dir.join(&name);
        std::fs::write(&path, text(v))
            .map_err(|e| CliError::runtime(format!("{}: {e}", path.display())))?;
        outln!("{}", path.display());
    }
    Ok(())
}
