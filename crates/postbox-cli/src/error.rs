//! CLI errors and their exit codes: 0 success, 1 runtime failure, 2 usage or
//! configuration error.

use std::fmt;

pub enum CliError {
    /// Bad arguments or configuration (exit 2).
    Usage(String),
    /// Something failed while running (exit 1).
    Runtime(String),
}

impl CliError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Runtime(_) => 1,
        }
    }

    pub fn usage(msg: impl fmt::Display) -> Self {
        CliError::Usage(msg.to_string())
    }

    pub fn runtime(msg: impl fmt::Display) -> Self {
        CliError::Runtime(msg.to_string())
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Runtime(m) => f.write_str(m),
        }
    }
}

impl From<postbox_core::Error> for CliError {
    fn from(e: postbox_core::Error) -> Self {
        if e.is_usage() {
            CliError::Usage(e.to_string())
        } else {
            CliError::Runtime(e.to_string())
        }
    }
}
