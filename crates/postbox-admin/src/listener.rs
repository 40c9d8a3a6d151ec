//! The admin servers' listening socket.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use postbox_core::{Error, Result};

/// A listener on `listen` (`host:port`, set by `key`): an address, or a
/// host name resolved (`localhost:9464`, which `doctor` takes for
/// loopback; it was refused as "not a host:port address").
pub(crate) async fn listen(listen: &str, key: &str) -> Result<TcpListener> {
    let not_an_address =
        |why: String| Error::config(key, format!("`{listen}` is not a host:port address: {why}"));
    let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .map_err(|e| not_an_address(e.to_string()))?
        .collect();
    // The first address that binds is the one listened on: IPv4 first, as
    // scrapers and probes dial `127.0.0.1` (a resolver that lists `::1`
    // first for `localhost` left them refused).
    addrs.sort_by_key(|a| !a.is_ipv4());
    if addrs.is_empty() {
        return Err(not_an_address("the host has no address".to_owned()));
    }
    TcpListener::bind(&addrs[..]).await.map_err(|e| Error::Io {
        context: format!("admin server cannot listen on {listen} ({key})"),
        source: e,
    })
}

/// The address `listener` is bound to.
pub(crate) fn local_addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|e| Error::Io {
        context: "admin server address".to_owned(),
        source: e,
    })
}

/// How long a server stopping waits for its connections to end.
const STOP_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown`, then waits at most
/// [`STOP_WITHIN`] for the connections open then: a client that never
/// finishes its request (a half-open connection, a stuck scraper) held
/// the server, and the process with it, after SIGTERM for good.
pub(crate) async fn serve_until(
    listener: tokio::net::TcpListener,
    app: axum::extract::connect_info::IntoMakeServiceWithConnectInfo<
        axum::Router,
        std::net::SocketAddr,
    >,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    let stop = shutdown.clone();
    let served =
        axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await });
    tokio::select! {
        served = served => served,
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(STOP_WITHIN).await;
        } => {
            tracing::warn!("connections still open {}s after the stop: closed", STOP_WITHIN.as_secs());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_host_name_is_resolved() {
        let l = listen("localhost:0", "admin.listen")
            .await
            .expect("localhost:0");
        assert!(local_addr(&l).unwrap().ip().is_loopback());
        let l = listen("127.0.0.1:0", "admin.listen")
            .await
            .expect("an address");
        assert!(local_addr(&l).unwrap().ip().is_loopback());
        for bad in ["localhost", "no port here", ":::"] {
            let e = listen(bad, "--listen").await.expect_err(bad);
            assert!(e.to_string().contains("--listen"), "{e}");
        }
    }
}
