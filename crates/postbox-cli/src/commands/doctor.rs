//! `postbox doctor`: schema, indexes, query plans and config, each a named
//! check that is ok, warn or fail; exit 1 when any fails.

use postbox_core::config::Uses;
use serde::Serialize;

use postbox_core::config::{Config, LeaseBudget};
use postbox_core::store::OutboxStore;

use crate::cli::Global;
use crate::error::CliError;
use crate::held_back::{describe_held_back, held_back, HELD_BACK_AFTER_MS};
use crate::open::{load_config, open_store};
use crate::output;
use postbox_runtime::store::Create;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug, Serialize)]
struct Check {
    name: String,
    level: Level,
    message: String,
}

fn check(name: impl Into<String>, level: Level, message: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        level,
        message: message.into(),
    }
}

pub async fn run(g: &Global) -> Result<(), CliError> {
    let config = load_config(g, Uses::DATABASE)?;
    let store = open_store(&config).await?;
    let mut checks = database_checks(store.as_ref(), &config).await;
    checks.extend(archive_database_check(&config).await);
    let migrated = checks
        .iter()
        .any(|c| c.name == "schema_version" && c.level == Level::Ok);
    checks.extend(partitions_check(store.as_ref(), migrated).await);
    checks.extend(app_code_checks(store.as_ref(), &config).await);
    // Loaded for the database only: name what other commands will miss.
    if let Err(e) = config.require_env(Uses::ALL) {
        checks.push(check("config:env", Level::Fail, e.to_string()));
    }
    checks.extend(config_checks(&config));

    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| c.level == Level::Fail)
        .map(|c| c.name.as_str())
        .collect();
    if g.json {
        #[derive(Serialize)]
        struct Out<'a> {
            ok: bool,
            backend: &'a str,
            table: &'a str,
            checks: &'a [Check],
        }
        output::json(&Out {
            ok: failed.is_empty(),
            backend: store.backend(),
            table: store.table().as_str(),
            checks: &checks,
        })?;
    } else {
        for c in &checks {
            let tag = match c.level {
                Level::Ok => "ok  ",
                Level::Warn => "WARN",
                Level::Fail => "FAIL",
            };
            outln!("{tag}  {:<44} {}", c.name, c.message);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "{} check(s) failed: {}",
            failed.len(),
            failed.join(", ")
        )))
    }
}

async fn database_checks(store: &dyn OutboxStore, config: &Config) -> Vec<Check> {
    let mut checks = Vec::new();
    match store.inspect_schema().await {
        Ok(schema) => {
            // A table named its own way is adopted, not created.
            let adopted = !store.table().naming().is_plain();
            let command = if adopted {
                "postbox adopt --apply"
            } else {
                "postbox migrate"
            };
            checks.push(if schema.version == 0 {
                check(
                    "schema_version",
                    Level::Fail,
                    format!(
                        "table `{}` was never migrated: run `{command}`",
                        store.table()
                    ),
                )
            } else if schema.version < schema.latest_version {
                check(
                    "schema_version",
                    Level::Fail,
                    format!(
                        "version {} of {}: run `postbox migrate`",
                        schema.version, schema.latest_version
                    ),
                )
            } else {
                check(
                    "schema_version",
                    Level::Ok,
                    format!("version {}", schema.version),
                )
            });
            for o in &schema.objects {
                let name = format!("{}:{}", o.kind, o.name);
                checks.push(if o.present {
                    check(name, Level::Ok, "present")
                } else {
                    check(
                        name,
                        Level::Fail,
                        format!("{} `{}` is missing: run `postbox migrate`", o.kind, o.name),
                    )
                });
            }
            checks.push(check(
                "search:aggregate",
                Level::Ok,
                if schema.aggregate_search {
                    "on: its index is on the table and the archive"
                } else {
                    "off (events list --aggregate is refused): `postbox migrate --aggregate-index` adds its index, one more index entry per event write"
                },
            ));
        }
        Err(e) => checks.push(check("schema", Level::Fail, e.to_string())),
    }
    // The table's own indexes postbox never reads (an adopted table's old
    // claim indexes): each is still written on every state change.
    if let Ok(adopt) = store.adopt(false).await {
        checks.push(if adopt.unread_indexes.is_empty() {
            check("indexes:unread", Level::Ok, "every index of the table is postbox's")
        } else {
            check(
                "indexes:unread",
                Level::Warn,
                format!(
                    "postbox never reads {}: each is written on every change of its columns; drop them once nothing else reads them",
                    adopt.unread_indexes.join(", ")
                ),
            )
        });
    }
    let app_code = config
        .database
        .app_codes
        .first()
        .map_or("default", String::as_str);
    match store.explain_index_use(app_code).await {
        Ok(plans) => {
            for p in plans {
                let name = format!("plan:{}", p.query);
                checks.push(if p.is_good() && !p.uses_expected() {
                    check(
                        name,
                        Level::Ok,
                        format!(
                            "uses {} (the table is too small for the planner to prefer {}; run doctor again once it holds rows)",
                            p.indexes_used.join(", "),
                            p.expected_index
                        ),
                    )
                } else if p.is_good() {
                    check(name, Level::Ok, format!("uses {}", p.expected_index))
                } else {
                    let used = if p.indexes_used.is_empty() {
                        "no index (full scan)".to_owned()
                    } else {
                        p.indexes_used.join(", ")
                    };
                    check(
                        name,
                        Level::Fail,
                        format!(
                            "query `{}` cannot use index `{}` (plan uses {used}); run `postbox migrate` or recreate the index",
                            p.query, p.expected_index
                        ),
                    )
                });
            }
        }
        Err(e) => checks.push(check(
            "plans",
            Level::Fail,
            format!("cannot explain the claim and archive queries: {e}"),
        )),
    }
    if config.outbox_worker.ordering == postbox_core::config::Ordering::PerAggregate {
        checks.push(held_back_check(store, &config.database.app_codes).await);
    }
    checks
}

/// A partitioned table: partitioned as `database.partitioning` says (of a
/// migrated table), and enough partitions ready ahead of the clock (an
/// insert past the last one fails).
async fn partitions_check(store: &dyn OutboxStore, migrated: bool) -> Option<Check> {
    if migrated {
        if let Err(e) = store.check_partitioning().await {
            return Some(check("partitions:config", Level::Fail, e.to_string()));
        }
    }
    let name = "partitions:ahead";
    match store.partitions_ahead().await {
        Ok(None) => None,
        Ok(Some(p)) if p.ahead >= postbox_core::partition::MINIMUM_AHEAD => Some(check(
            name,
            Level::Ok,
            format!("{} ready after the current one, through `{}`", p.ahead, p.through.unwrap_or_default()),
        )),
        Ok(Some(p)) => Some(check(
            name,
            Level::Fail,
            format!(
                "{} ready after the current one: a relay creates them every 10 minutes, `postbox migrate` now (inserts fail past the last)",
                p.ahead
            ),
        )),
        Err(e) => Some(check(name, Level::Fail, e.to_string())),
    }
}

/// `[archive] url`: the archive's database answers and holds a migrated
/// `<table>_archive` (none when the archive is beside the table).
async fn archive_database_check(settings: &postbox_core::config::Settings) -> Option<Check> {
    let url = settings.archive.url.as_ref()?;
    let name = "archive:database";
    let store = match postbox_runtime::store::open_archive(settings, Create::Never).await {
        Ok(store) => store?,
        Err(e) => return Some(check(name, Level::Fail, e.to_string())),
    };
    let archive = store.table().archive();
    Some(match store.inspect_schema().await {
        Err(e) => check(name, Level::Fail, format!("{url}: {e}")),
        Ok(schema) if schema.version < schema.latest_version => check(
            name,
            Level::Fail,
            format!(
                "{url} is at schema version {} of {}: run `postbox migrate` (it migrates both databases)",
                schema.version, schema.latest_version
            ),
        ),
        Ok(schema) => match schema.objects.iter().find(|o| !o.present && o.name.starts_with(&archive)) {
            Some(o) => check(
                name,
                Level::Fail,
                format!("{url}: {} `{}` is missing: run `postbox migrate`", o.kind, o.name),
            ),
            None => check(
                name,
                Level::Ok,
                format!("`{archive}` is kept in the {} database at {url}", store.backend()),
            ),
        },
    })
}

/// Rows of an app_code outside `database.app_codes` are never delivered
/// (a producer's typo): pending ones fail the check, old ones warn.
async fn app_code_checks(store: &dyn OutboxStore, config: &Config) -> Vec<Check> {
    let served = &config.database.app_codes;
    let present = match store.present_app_codes().await {
        Ok(p) => p,
        Err(e) => return vec![check("app_codes", Level::Fail, e.to_string())],
    };
    let unserved: Vec<String> = present
        .into_iter()
        .filter(|a| !served.contains(a))
        .collect();
    if unserved.is_empty() {
        return vec![check(
            "app_codes",
            Level::Ok,
            "every app_code with rows is in database.app_codes",
        )];
    }
    let stats = match store.stats(&unserved).await {
        Ok(s) => s,
        Err(e) => return vec![check("app_codes", Level::Fail, e.to_string())],
    };
    stats
        .into_iter()
        .map(|s| {
            let waiting = s.pending + s.retryable + s.delivering;
            let name = format!("app_code:{}", s.app_code);
            if waiting > 0 {
                check(
                    name,
                    Level::Fail,
                    format!(
                        "{waiting} undelivered row(s) of app_code `{}`, which is not in database.app_codes: no relay delivers them (fix the producer's app_code, or add it to database.app_codes)",
                        s.app_code
                    ),
                )
            } else {
                check(
                    name,
                    Level::Warn,
                    format!(
                        "rows of app_code `{}`, which is not in database.app_codes (none waiting)",
                        s.app_code
                    ),
                )
            }
        })
        .collect()
}

async fn held_back_check(store: &dyn OutboxStore, app_codes: &[String]) -> Check {
    let name = "aggregates:held_back";
    match held_back(store, app_codes, 5).await {
        Ok(stuck) if stuck.is_empty() => check(
            name,
            Level::Ok,
            format!(
                "no aggregate's head has held later events back for over {}s",
                HELD_BACK_AFTER_MS / 1000
            ),
        ),
        Ok(stuck) => check(
            name,
            Level::Warn,
            format!(
                "{} aggregate(s) held back by a head that keeps failing or stays leased (it moves once delivered or dead-lettered; see `postbox events show`): {}",
                stuck.len(),
                stuck.iter().map(describe_held_back).collect::<Vec<_>>().join("; ")
            ),
        ),
        Err(e) => check(name, Level::Warn, format!("cannot look for held-back aggregates: {e}")),
    }
}

fn config_checks(config: &Config) -> Vec<Check> {
    let w = &config.outbox_worker;
    let a = &config.archive;
    let mut checks = Vec::new();
    // The relay's own rule (validation refuses what fails it).
    let budget = LeaseBudget::of(w);
    checks.push(match budget.check() {
        Ok(()) => check(
            "config:lease_margin",
            Level::Ok,
            format!(
                "publish_timeout {} fits lease {}: a batch may wait one publish, publish, and keep {} to mark",
                w.publish_timeout,
                w.lease,
                humantime::format_duration(budget.mark_reserve())
            ),
        ),
        Err(reason) => check(
            "config:lease_margin",
            Level::Fail,
            format!("outbox_worker.publish_timeout {reason}"),
        ),
    });
    let horizon = w.max_backoff.get() * w.max_retry_count;
    checks.push(check(
        "config:redelivery_horizon",
        Level::Ok,
        format!(
            "a failing event is retried for up to ~{} (max_retry_count {} × max_backoff {})",
            humantime::format_duration(horizon),
            w.max_retry_count,
            w.max_backoff
        ),
    ));
    // An inbox must remember an event for as long as it can arrive again:
    // the relay's retries (a publish confirmed late is published again) plus
    // the consumer's own retries.
    for (i, c) in config.consumers.iter().enumerate() {
        if c.inbox.is_none() {
            continue;
        }
        let needed = horizon + postbox_runtime::consumers::redelivery_horizon(c);
        let name = format!("config:consumers.{i}.inbox_retention");
        checks.push(if c.inbox_retention.get() < needed {
            check(
                name,
                Level::Warn,
                format!(
                    "consumers.{i}.inbox_retention ({}) is shorter than the redelivery horizon (~{}: relay retries plus consumer retries): a late redelivery of a handled event would be handled again",
                    c.inbox_retention,
                    humantime::format_duration(needed)
                ),
            )
        } else {
            check(
                name,
                Level::Ok,
                format!(
                    "inbox_retention {} covers the redelivery horizon (~{})",
                    c.inbox_retention,
                    humantime::format_duration(needed)
                ),
            )
        });
    }
    checks.push(if !a.enabled {
        check(
            "config:archive",
            Level::Warn,
            "archive.enabled is false: delivered rows accumulate in the outbox table; enable [archive] or run `postbox archive` on a schedule",
        )
    } else if a.older_than.get() < a.interval.get() {
        check(
            "config:archive",
            Level::Warn,
            format!(
                "archive.older_than ({}) is shorter than archive.interval ({}): rows are kept for uneven times",
                a.older_than, a.interval
            ),
        )
    } else {
        check(
            "config:archive",
            Level::Ok,
            format!("every {}, rows older than {}", a.interval, a.older_than),
        )
    });
    if a.batch_size > 50_000 {
        checks.push(check(
            "config:archive_batch_size",
            Level::Warn,
            format!(
                "archive.batch_size {} holds locks and grows the WAL/binlog for long; 10000 is the default",
                a.batch_size
            ),
        ));
    }
    if let Some(admin) = &config.admin {
        checks.push(admin_check(admin));
    }
    if w.batch_size > 1_000 {
        checks.push(check(
            "config:batch_size",
            Level::Warn,
            format!(
                "outbox_worker.batch_size {} makes each claim hold many leases at once",
                w.batch_size
            ),
        ));
    }
    checks
}

/// `[admin]`: without a token, anyone who reaches `admin.listen` reads
/// every event's payload, which is a warning when the address is not
/// loopback-only.
fn admin_check(admin: &postbox_core::config::AdminConfig) -> Check {
    // A `${VAR}` not set here still names a token (`config:env` says so).
    let tokens = std::iter::once(&admin.token)
        .chain(admin.tokens.iter().map(|t| &t.token))
        .filter(|t| !t.is_empty() || t.unresolved().is_some())
        .count();
    if tokens > 0 {
        return check(
            "config:admin",
            Level::Ok,
            format!("{tokens} token(s); reading events needs one, changes need an operator's"),
        );
    }
    let loopback = admin
        .listen
        .parse::<std::net::SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback())
        || admin.listen.starts_with("localhost:");
    if loopback {
        check(
            "config:admin",
            Level::Ok,
            format!(
                "no token: reads are open on {} (loopback only), changes refused",
                admin.listen
            ),
        )
    } else {
        check(
            "config:admin",
            Level::Warn,
            format!(
                "no admin token, and admin.listen {} is reachable beyond this host: anyone who reaches it reads every event's payload; set admin.token or [[admin.tokens]], or listen on 127.0.0.1",
                admin.listen
            ),
        )
    }
}
