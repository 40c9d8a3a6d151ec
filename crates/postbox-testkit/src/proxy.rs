//! A TCP proxy for fault tests: it forwards to one upstream `host:port`
//! and goes silent on demand. Silent means no byte flows either way while
//! both sockets stay open, as when a host dies or the network partitions:
//! the client sees no reset and no error, only no answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy; it stops with the test's runtime.
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    silent: AtomicBool,
    /// Bytes which, once a client sends them, silence the proxy (before
    /// they are passed on).
    trigger: Mutex<Option<Vec<u8>>>,
}

impl State {
    /// Whether `sent` (from a client) silences the proxy now.
    fn silenced_by(&self, sent: &[u8]) -> bool {
        let trigger = self.trigger.lock().unwrap();
        if let Some(t) = trigger.as_deref() {
            if sent.windows(t.len()).any(|w| w == t) {
                self.silent.store(true, Ordering::SeqCst);
            }
        }
        self.silent.load(Ordering::SeqCst)
    }
}

impl Proxy {
    /// Listens on a free loopback port, forwarding each connection to
    /// `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let (upstream, shared) = (upstream.to_owned(), state.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(forward(client_read, server_write, shared.clone(), true));
                tokio::spawn(forward(server_read, client_write, shared.clone(), false));
            }
        });
        Proxy { addr, state }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every connection, open now or later, goes silent.
    pub fn silence(&self) {
        self.state.silent.store(true, Ordering::SeqCst);
    }

    /// The proxy goes silent once a client sends `bytes` (within one read;
    /// what carries them is not passed on): an AMQP method's class and
    /// method ids, say, to stop the broker answering that method.
    pub fn silence_on(&self, bytes: &[u8]) {
        *self.state.trigger.lock().unwrap() = Some(bytes.to_vec());
    }
}

/// Copies `from` into `into` until either side closes, or for good (both
/// left open) once the proxy is silent.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut into: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<State>,
    from_client: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let silent = if from_client {
            state.silenced_by(&buf[..n])
        } else {
            state.silent.load(Ordering::SeqCst)
        };
        if silent {
            // Both halves stay open: held by this task, which never ends.
            std::future::pending::<()>().await;
        }
        if into.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
