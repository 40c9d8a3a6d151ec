//! Loading the configuration and opening the store it names, through
//! `postbox-runtime`.

use std::sync::Arc;

use postbox_core::config::{self, ConfigSource, Settings, Uses};
use postbox_core::store::OutboxStore;
use postbox_runtime::store::{self, Create};

use crate::cli::Global;
use crate::error::CliError;

/// `[database]` and `[[consumers]]`: `migrate` (which creates the inboxes).
pub const WITH_CONSUMERS: Uses = Uses {
    consumers: true,
    ..Uses::DATABASE
};

/// `[database]`, `[[consumers]]` and `[admin]` (the consumers' API, when
/// it is set): `consume`.
pub const CONSUME: Uses = Uses {
    consumers: true,
    admin: true,
    ..Uses::DATABASE
};

/// `[database]` and `[admin]`: `serve`.
pub const WITH_ADMIN: Uses = Uses {
    admin: true,
    ..Uses::DATABASE
};

/// Loads and checks the configuration for a command that uses `uses`
/// besides `[database]`: a `${VAR}` left unset in a section it does not
/// use is no error (`postbox status` needs no admin token).
pub fn load_config(g: &Global, uses: Uses) -> Result<Settings, CliError> {
    Ok(config::load_for(&source(g), uses)?)
}

/// [`load_config`] for a command that connects to nothing and reads only
/// `[database]` (`migrate --print-sql`): `database.url` need only name its
/// database's kind.
pub fn load_config_offline(g: &Global) -> Result<Settings, CliError> {
    Ok(config::load_offline(&source(g))?)
}

/// Whether a config file would be read (`--config`, or `postbox.toml`
/// here), not only defaults and the environment.
pub fn has_config_file(g: &Global) -> Result<bool, CliError> {
    Ok(source(g).file_to_read()?.is_some())
}

fn source(g: &Global) -> ConfigSource {
    ConfigSource {
        file: g.config.clone(),
        database_url: g.database_url.clone(),
    }
}

/// Opens the store; never creates a SQLite database file (a missing one is
/// an error naming it).
pub async fn open_store(settings: &Settings) -> Result<Arc<dyn OutboxStore>, CliError> {
    Ok(store::open(settings, Create::Never).await?)
}

/// [`open_store`] that creates a missing SQLite database file (`migrate`).
pub async fn open_store_creating(settings: &Settings) -> Result<Arc<dyn OutboxStore>, CliError> {
    Ok(store::open(settings, Create::IfMissing).await?)
}

/// Fails with a clear message when the outbox table does not exist yet.
pub async fn require_schema(store: &dyn OutboxStore) -> Result<(), CliError> {
    Ok(store::require_schema(store).await?)
}
