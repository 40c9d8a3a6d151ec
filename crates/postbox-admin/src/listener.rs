//! The admin servers' listening socket.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use postbox_core::{Error, Result};

/// A listener on `listen` (`host:port`, the key `admin.listen`).
pub(crate) async fn listen(listen: &str) -> Result<TcpListener> {
    let addr: SocketAddr = listen.parse().map_err(|e| {
        Error::config(
            "admin.listen",
            format!("`{listen}` is not a host:port address: {e}"),
        )
    })?;
    TcpListener::bind(addr).await.map_err(|e| Error::Io {
        context: format!("admin server cannot listen on {addr} (admin.listen)"),
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
