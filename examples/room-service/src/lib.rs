//! The seed's room service on postbox (see README.md): room commands commit
//! their state, command log and outbox row in one transaction; a relay
//! delivers the rows to an IM stand-in (webhook) and to RabbitMQ (activity);
//! a wallet with its own outbox and relay pays for gifts; consumers dedupe
//! by `event_id`.
//!
//! | module         | what                                                        |
//! |----------------|-------------------------------------------------------------|
//! | [`room`]       | the room's state and commands, no I/O                       |
//! | [`service`]    | the HTTP commands and `SaveMutation`                        |
//! | [`wallet`]     | the wallet service (own tables, own outbox) and its client  |
//! | [`im`]         | the IM stand-in the webhook publisher posts to              |
//! | [`projection`] | the handler `postbox consume` posts to (activity, notice)   |
//! | [`db`]         | the same statements on MariaDB and SQLite                   |

use std::future::IntoFuture;
use std::path::Path;

use postbox::config::{self, ConfigSource, Settings};
use postbox::relay::{CancellationToken, RelayReport};
use postbox::runtime::relay::RelayService;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub mod db;
pub mod im;
pub mod projection;
pub mod room;
pub mod service;
pub mod wallet;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Reads a postbox config file: the service opens `[database]` and the
/// in-process relay runs `[outbox_worker]` and `[[publishers]]`, exactly as
/// `postbox relay --config FILE` would. `POSTBOX__…` variables apply.
pub fn load_config(path: &Path) -> Result<Settings, postbox::Error> {
    config::load(&ConfigSource {
        file: Some(path.to_owned()),
        database_url: None,
    })
}

/// The app_code the service enqueues under: the first of
/// `database.app_codes`.
pub fn app_code(settings: &Settings) -> String {
    settings.app_codes_or_default(Vec::new())[0].clone()
}

/// Serves `router` on `listener` until `shutdown`.
pub fn serve(
    listener: TcpListener,
    router: axum::Router,
    shutdown: CancellationToken,
) -> JoinHandle<std::io::Result<()>> {
    tokio::spawn(
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .into_future(),
    )
}

/// Runs the relay of `settings` inside this process, over the service's
/// own store (so every `enqueue` wakes it), until `shutdown`.
pub async fn spawn_relay(
    settings: &Settings,
    db: &db::Db,
    shutdown: CancellationToken,
) -> Result<JoinHandle<Result<RelayReport, postbox::Error>>, postbox::Error> {
    let relay = RelayService::over(settings, db.store(), Vec::new()).await?;
    Ok(tokio::spawn(relay.run(shutdown)))
}
