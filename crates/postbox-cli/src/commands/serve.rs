//! `postbox serve`: the admin API, `/metrics` and the dashboard until
//! SIGINT or SIGTERM. `postbox relay` runs the same server beside the relay
//! when `[admin]` is set.

use postbox_core::relay::CancellationToken;
use postbox_runtime::signals::spawn_signal_handler;

use crate::cli::{Global, ServeArgs};
use crate::error::CliError;
use crate::logging;
use crate::open::{load_config, open_store, require_schema, WITH_ADMIN};

pub async fn run(g: &Global, args: ServeArgs) -> Result<(), CliError> {
    let settings = load_config(g, WITH_ADMIN)?;
    let store = open_store(&settings).await?;
    require_schema(store.as_ref()).await?;
    let server =
        postbox_runtime::admin::bind(&settings, store, args.only.app_codes, args.listen).await?;
    let addr = server.local_addr()?;
    logging::notice(&format!(
        "postbox: admin API and dashboard on http://{addr}/"
    ));
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone(), logging::flush);
    server.run(shutdown).await?;
    Ok(())
}
