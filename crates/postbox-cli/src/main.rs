//! The `postbox` command line (SPEC §6).
#![forbid(unsafe_code)]

/// `println!` that ends the process quietly (exit 0) when stdout is a
/// closed pipe (`postbox events list --json | head`) instead of panicking.
macro_rules! outln {
    () => {
        $crate::output::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::output::write_line(format_args!($($arg)*))
    };
}

/// Like `eprintln!` for a command's hints on stderr, but a closed or
/// broken stderr loses the line instead of panicking.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod cli;
mod commands;
mod error;
mod filter;
mod held_back;
mod logging;
mod open;
mod output;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::error::CliError;

fn main() {
    let cli = Cli::parse();
    // The quickstart shows its own status line; keep the relay's info lines out of it.
    let default_log = match cli.command {
        Command::Quickstart(_) => "warn",
        _ => "info,sqlx=warn",
    };
    logging::init(&cli.global, default_log);
    let log_format = cli.global.log_format;
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let e = CliError::runtime(format!("cannot start the async runtime: {e}"));
            logging::fatal(log_format, &e, e.exit_code());
            std::process::exit(e.exit_code());
        }
    };
    let result = runtime.block_on(run(cli));
    // A blocking write that never ends (the file publisher's stdout into a
    // pipe nobody reads any more) does not hold the exit: dropped alone,
    // the runtime waited for it for good.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    if let Err(e) = result {
        logging::fatal(log_format, &e, e.exit_code());
        std::process::exit(e.exit_code());
    }
    logging::flush();
}

async fn run(cli: Cli) -> Result<(), CliError> {
    let g = &cli.global;
    match cli.command {
        Command::Consume => commands::consume::run(g).await,
        Command::Consumers(args) => commands::consumers::run(g, args).await,
        Command::Migrate(args) => commands::migrate::run(g, args).await,
        Command::Adopt(args) => commands::adopt::run(g, args).await,
        Command::Relay(args) => commands::relay::run(g, args).await,
        Command::Status(args) => commands::status::run(g, args).await,
        Command::Events(args) => commands::events::run(g, args).await,
        Command::Replay(args) => commands::replay::run(g, args).await,
        Command::Dead(args) => commands::dead::run(g, args).await,
        Command::Topology => commands::topology::run(g).await,
        Command::Relays => commands::relays::run(g).await,
        Command::Control(args) => commands::control::run(g, args).await,
        Command::Archive(args) => commands::archive::run(g, args).await,
        Command::Doctor(args) if args.scans => commands::scans::run(g).await,
        Command::Doctor(_) => commands::doctor::run(g).await,
        Command::LintSql(args) => commands::lint_sql::run(g, args),
        Command::Enqueue(args) => commands::enqueue::run(g, args).await,
        Command::Serve(args) => commands::serve::run(g, args).await,
        Command::Quickstart(args) => commands::quickstart::run(g, args).await,
    }
}
