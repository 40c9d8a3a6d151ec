//! Arguments.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// postbox: the database committed, so the message will be delivered.
#[derive(Debug, Parser)]
#[command(name = "postbox", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args, Clone)]
pub struct Global {
    /// Configuration file, TOML or YAML (default: postbox.toml when present).
    #[arg(long, global = true, env = "POSTBOX_CONFIG")]
    pub config: Option<PathBuf>,
    /// Database URL, overriding the file and POSTBOX__DATABASE__URL.
    #[arg(long, global = true)]
    pub database_url: Option<String>,
    /// Machine-readable JSON output.
    #[arg(long, global = true)]
    pub json: bool,
    /// Log line format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter (`info`, `postbox_core=debug`, …); also RUST_LOG.
    #[arg(long, global = true)]
    pub log: Option<String>,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the outbox tables and indexes (idempotent).
    Migrate(MigrateArgs),
    /// Run on an outbox table you already have: report what postbox needs
    /// (columns, indexes) by the table's own names ([database.columns],
    /// [database.statuses]) and print the DDL, or run it with --apply.
    Adopt(AdoptArgs),
    /// Relay committed rows to every publisher until SIGINT/SIGTERM.
    Relay(RelayArgs),
    /// Counts by status, oldest pending age and backlog per app_code.
    Status(StatusArgs),
    /// Inspect outbox rows.
    Events(EventsArgs),
    /// Put rows back to pending with retry_count 0, keeping their event_id.
    Replay(ReplayArgs),
    /// Run the [[consumers]] entries (HTTP bridge) until SIGINT/SIGTERM.
    Consume,
    /// List, pause or resume the consumers of a running `postbox consume` (through its [admin]).
    Consumers(ConsumersArgs),
    /// List, show, replay or purge a consumer's dead letters on its broker.
    Dead(DeadArgs),
    /// Who publishes what, and who consumes it: event type → publisher → target → queues, consumers, groups.
    Topology,
    /// Every relay of the table on any host: state, worker id, host, counts, rate, last heartbeat.
    Relays,
    /// Runtime controls: pause an app_code, change delivery or max_retry_count while relays run.
    Control(ControlArgs),
    /// Move delivered rows older than a cut-off into <table>_archive, in batches.
    Archive(ArchiveArgs),
    /// Check schema, indexes, the plan of every claim and archive query, and the config.
    Doctor(DoctorArgs),
    /// Check SQL text for the outbox query shapes that overload a database
    /// (OR across statuses, no app_code); exit 1 on any finding.
    LintSql(LintSqlArgs),
    /// Write events: one from flags, or many from a JSON-lines file.
    Enqueue(EnqueueArgs),
    /// Serve the admin API, /metrics and the dashboard (from `[admin]`).
    Serve(ServeArgs),
    /// A self-contained demo on SQLite and a JSON-lines file; no servers needed.
    Quickstart(QuickstartArgs),
}

#[derive(Debug, Args)]
pub struct AdoptArgs {
    /// Run the statements (online: `CREATE INDEX CONCURRENTLY`, columns
    /// added without a table rewrite), then add postbox's own tables and
    /// record the schema version.
    #[arg(long)]
    pub apply: bool,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Print the SQL `migrate` would run, version by version, instead of
    /// running it (no connection is made): for a team's own migration tool.
    #[arg(long)]
    pub print_sql: bool,
    /// With --print-sql: only the versions after N (the schema's version now).
    #[arg(long, value_name = "N", default_value_t = 0, requires = "print_sql")]
    pub from: u32,
    /// With --print-sql: one file per version in DIR instead of stdout.
    #[arg(long, value_name = "DIR", requires = "print_sql")]
    pub out: Option<std::path::PathBuf>,
    /// With --out: the files' names, as the tool that applies them wants.
    #[arg(long, value_enum, default_value_t = ScriptFormat::Flyway, requires = "out")]
    pub format: ScriptFormat,
    /// Also create the optional index search by aggregate reads
    /// (`<table>_agg_idx`, `<table>_archive_agg_idx`), without blocking
    /// writes where the database can. It costs every event one more index
    /// entry per write.
    #[arg(long, conflicts_with_all = ["print_sql", "drop_aggregate_index"])]
    pub aggregate_index: bool,
    /// Drop that index (search by aggregate is then refused).
    #[arg(long, conflicts_with = "print_sql")]
    pub drop_aggregate_index: bool,
}

/// How `migrate --print-sql --out` names its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScriptFormat {
    /// `V<n>__<description>.sql` (Flyway; Liquibase includes them as SQL files).
    Flyway,
    /// `<n>_<description>.up.sql` (golang-migrate).
    GolangMigrate,
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Instead of the checks: list the statements the database's own
    /// statistics (pg_stat_statements, performance_schema) show touching
    /// the outbox table, flagging those that break the lint-sql rules or
    /// read far more rows than they return; exit 1 when any is flagged.
    #[arg(long)]
    pub scans: bool,
}

#[derive(Debug, Args)]
pub struct LintSqlArgs {
    /// SQL files (`-` or none: stdin).
    pub files: Vec<PathBuf>,
    /// The outbox table (its `_archive` too); repeatable. Default: the
    /// config's database.table.
    #[arg(long = "table", value_name = "NAME")]
    pub tables: Vec<String>,
    /// How to read the SQL. Default: the config's database, else postgres.
    #[arg(long, value_enum)]
    pub syntax: Option<SqlSyntax>,
}

/// The SQL syntax `lint-sql` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SqlSyntax {
    /// PostgreSQL.
    Postgres,
    /// MySQL and MariaDB.
    Mysql,
}

#[derive(Debug, Args)]
pub struct DeadArgs {
    #[command(subcommand)]
    pub action: DeadCommand,
}

#[derive(Debug, Subcommand)]
pub enum DeadCommand {
    /// The dead letters the filters take, oldest first (nothing changes).
    List {
        #[command(flatten)]
        filter: DeadFilterArgs,
        /// At most this many letters.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Every dead letter of one event, with its headers and payload.
    Show {
        /// The consumer's name (its `name`, or its queue).
        #[arg(long)]
        consumer: String,
        /// The event's id.
        event_id: String,
    },
    /// Send the letters the filters take back to the consumer's queue
    /// (same event_id, marked x-replayed, attempts afresh), then remove them.
    Replay(DeadChange),
    /// Remove the letters the filters take.
    Purge(DeadChange),
}

/// The letters a replay or purge takes, and how far it may go.
#[derive(Debug, Args, Clone, Default)]
pub struct DeadChange {
    #[command(flatten)]
    pub filter: DeadFilterArgs,
    /// Count and show what would be done; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Take every letter of the consumer when no filter is given.
    #[arg(long)]
    pub all: bool,
}

/// Which consumer's dead letters, and which of them.
#[derive(Debug, Args, Clone, Default)]
pub struct DeadFilterArgs {
    /// The consumer's name (its `name`, or its queue).
    #[arg(long)]
    pub consumer: String,
    /// Only this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Only this event id.
    #[arg(long)]
    pub event_id: Option<String>,
    /// Dead-lettered at or after: RFC 3339, epoch ms, or a duration ago (`2h`).
    #[arg(long)]
    pub since: Option<String>,
    /// Dead-lettered before: RFC 3339, epoch ms, or a duration ago.
    #[arg(long)]
    pub until: Option<String>,
    /// Only letters whose last error contains this text (any case).
    #[arg(long)]
    pub error: Option<String>,
}

#[derive(Debug, Args)]
pub struct ControlArgs {
    #[command(subcommand)]
    pub action: Option<ControlAction>,
}

/// Which control: `(app_code, event_type)`, `*` for any.
#[derive(Debug, Args, Clone)]
pub struct ControlKey {
    /// The app_code, or `*` for every one.
    #[arg(long, default_value = "*")]
    pub app_code: String,
    /// The event type, or `*` for every one.
    #[arg(long, default_value = "*")]
    pub event_type: String,
}

#[derive(Debug, Subcommand)]
pub enum ControlAction {
    /// The controls in force and the recent changes (the default).
    List {
        /// How many recent changes to show.
        #[arg(long, default_value_t = 20)]
        changes: u32,
    },
    /// Change the control of a key; flags not given keep their value.
    Set {
        #[command(flatten)]
        key: ControlKey,
        /// Stop claiming the key's rows (they stay pending; other keys go on).
        #[arg(long)]
        pause: bool,
        /// Claim them again.
        #[arg(long)]
        resume: bool,
        /// at_least_once, at_most_once, or default (the config's).
        #[arg(long)]
        delivery: Option<String>,
        /// A count, or default (the config's).
        #[arg(long)]
        max_retry_count: Option<String>,
        /// Deliver this percentage (0–100) of the key's events, mark the others
        /// `dropped`; or default (every event).
        #[arg(long)]
        sample_percent: Option<String>,
    },
    /// Remove the control of a key: the config's rules apply again.
    Clear {
        #[command(flatten)]
        key: ControlKey,
    },
}

#[derive(Debug, Args)]
pub struct ConsumersArgs {
    #[command(subcommand)]
    pub action: Option<ConsumersAction>,
}

#[derive(Debug, Subcommand)]
pub enum ConsumersAction {
    /// Each consumer's kind, queue, state and what it settled (the default).
    List,
    /// Stop consumer NAME taking messages, once those in hand are finished.
    Pause {
        /// The consumer's name (its `name`, or its queue).
        name: String,
    },
    /// Let a paused consumer take messages again.
    Resume {
        /// The consumer's name (its `name`, or its queue).
        name: String,
    },
}

/// `--app-code`, taken by the commands that can serve fewer app_codes
/// than the config names.
#[derive(Debug, Args)]
pub struct AppCodes {
    /// Only these app_codes (default: database.app_codes).
    #[arg(long = "app-code")]
    pub app_codes: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RelayArgs {
    #[command(flatten)]
    pub only: AppCodes,
    /// Run `migrate` before relaying.
    #[arg(long)]
    pub migrate: bool,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Listen address, overriding `admin.listen` (default 127.0.0.1:9464).
    #[arg(long)]
    pub listen: Option<String>,
    #[command(flatten)]
    pub only: AppCodes,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub only: AppCodes,
}

#[derive(Debug, Args)]
pub struct EventsArgs {
    #[command(subcommand)]
    pub command: EventsCommand,
}

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Rows matching the filters, newest first.
    List(ListArgs),
    /// One event with its state and last error.
    Show(ShowArgs),
}

/// Filters shared by `events list` and `replay`.
#[derive(Debug, Args, Clone, Default)]
pub struct FilterArgs {
    /// pending, delivering, delivered, retryable, failed or dropped.
    #[arg(long)]
    pub status: Option<String>,
    /// Only this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Only this app_code.
    #[arg(long)]
    pub app_code: Option<String>,
    /// Only this aggregate's events (with --app-code; needs the index
    /// `postbox migrate --aggregate-index` creates).
    #[arg(long, value_name = "AGGREGATE_ID")]
    pub aggregate: Option<String>,
    /// Created at or after: RFC 3339, epoch ms, or a duration ago (`2h`).
    #[arg(long)]
    pub since: Option<String>,
    /// Created before: RFC 3339, epoch ms, or a duration ago.
    #[arg(long)]
    pub until: Option<String>,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// At most this many rows.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Only rows with a smaller id (next page).
    #[arg(long)]
    pub before_id: Option<i64>,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The event's id.
    pub event_id: String,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Event ids to replay.
    pub event_ids: Vec<String>,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Show what would be replayed, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Send only to this publisher (its `name`, or its `kind` when unnamed);
    /// repeatable. Default: a `delivered` event goes to every publisher, any
    /// other only to the publishers that have not confirmed it.
    #[arg(
        long = "publisher",
        value_name = "NAME",
        conflicts_with = "all_publishers"
    )]
    pub publishers: Vec<String>,
    /// Send to every publisher, also those that already confirmed.
    #[arg(long)]
    pub all_publishers: bool,
    /// Paced: at most N rows a second (a backfill of a filter's rows, in
    /// batches, never more than one batch ahead of the relay).
    #[arg(long, value_name = "N")]
    pub rate: Option<postbox_runtime::backfill::Rate>,
    /// Paced: rows per batch (default 1000).
    #[arg(long, value_name = "N")]
    pub batch: Option<std::num::NonZeroU32>,
    /// Paced: continue the replay stopped with this state file.
    #[arg(long)]
    pub resume: bool,
    /// Paced: the file keeping the cursor (default .postbox-replay.json).
    #[arg(long, value_name = "FILE")]
    pub state: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ArchiveArgs {
    /// Move rows last updated longer ago than this (default: archive.older_than).
    #[arg(long)]
    pub older_than: Option<String>,
    /// Rows per batch, one transaction each (default: archive.batch_size).
    #[arg(long)]
    pub batch_size: Option<u32>,
    /// Stop after this many batches.
    #[arg(long)]
    pub max_batches: Option<u64>,
    #[command(flatten)]
    pub only: AppCodes,
}

#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// JSON-lines file of envelopes (`-` for stdin); given event_ids are kept.
    #[arg(long, conflicts_with_all = ["event_type", "payload", "event_id", "aggregate_id", "aggregate_version", "headers"])]
    pub file: Option<PathBuf>,
    /// Event type, e.g. RoomCreated.
    #[arg(long, required_unless_present = "file")]
    pub event_type: Option<String>,
    /// Payload (JSON by convention).
    #[arg(long, required_unless_present = "file")]
    pub payload: Option<String>,
    /// app_code (default: the first of database.app_codes).
    #[arg(long)]
    pub app_code: Option<String>,
    /// Event id (default: a new UUIDv7).
    #[arg(long)]
    pub event_id: Option<String>,
    /// Aggregate id (ordering scope).
    #[arg(long)]
    pub aggregate_id: Option<String>,
    /// Aggregate version.
    #[arg(long)]
    pub aggregate_version: Option<i64>,
    /// Extra header, `key=value`; repeatable.
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// Rows per transaction when reading a file (1 to 10,000).
    #[arg(long, default_value_t = 500,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    pub batch_size: usize,
    /// Accept an app_code outside `database.app_codes` (no relay with this
    /// config delivers such rows).
    #[arg(long)]
    pub allow_unserved_app_code: bool,
    /// Write events whose event_id is already in `<table>_archive` (delivered
    /// and archived), so that they are delivered again; without it they are
    /// refused (one event) or skipped and counted (`--file`).
    #[arg(long)]
    pub allow_archived: bool,
}

#[derive(Debug, Args)]
pub struct QuickstartArgs {
    /// Folder for the demo's database, output and config.
    #[arg(long, default_value = "postbox-quickstart")]
    pub dir: PathBuf,
    /// How many demo events to write.
    #[arg(long, default_value_t = 500)]
    pub events: u32,
    /// Demo events written per second.
    #[arg(long, default_value_t = 100)]
    pub rate: u32,
    /// Dashboard address (a free port is taken when this one is busy).
    #[arg(long, default_value = postbox_runtime::DEFAULT_ADMIN_LISTEN)]
    pub listen: String,
    /// Accepted for older scripts: the dashboard now always stays up after
    /// the demo until Ctrl-C.
    #[arg(long, hide = true)]
    pub keep_serving: bool,
}
