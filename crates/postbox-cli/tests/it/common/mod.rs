//! Shared by the CLI test binaries: run the real `postbox` binary.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// Runs `postbox args…` in `dir` with extra environment variables.
pub fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_postbox"));
    cmd.current_dir(dir).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run postbox")
}

/// Runs `postbox args…` in `dir`.
pub fn postbox(dir: &Path, args: &[&str]) -> Output {
    run(dir, args, &[])
}

/// stdout then stderr, for assertions and failure messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
