//! A TCP proxy for fault tests: it forwards to one upstream `host:port`
//! and goes silent on demand. Silent means no byte flows either way while
//! both sockets stay open, as when a host dies or the network partitions:
//! the client sees no reset and no error, only no answer. A connection can
//! also go deaf: the server reads nothing more from its client while its
//! own bytes still flow, as RabbitMQ does to a connection it blocks under
//! a memory or disk alarm.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
    /// Bytes which, the next time a client sends them, silence that
    /// connection (before they are passed on); only its client's side
    /// when `Trigger::deaf`.
    trigger: Mutex<Option<Trigger>>,
    /// Connections silenced by a trigger so far.
    triggered: AtomicUsize,
}

struct Trigger {
    bytes: Vec<u8>,
    deaf: bool,
}

/// Whether `sent` holds `pattern`.
fn holds(sent: &[u8], pattern: &[u8]) -> bool {
    sent.windows(pattern.len()).any(|w| w == pattern)
}

impl State {
    /// Whether `sent` (from a client) silences its connection (once):
    /// `Some(deaf)`.
    fn silenced_by(&self, sent: &[u8]) -> Option<bool> {
        let mut trigger = self.trigger.lock().unwrap();
        let deaf = trigger
            .as_ref()
            .filter(|t| holds(sent, &t.bytes))
            .map(|t| t.deaf)?;
        *trigger = None;
        self.triggered.fetch_add(1, Ordering::SeqCst);
        Some(deaf)
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
                let silent = Arc::new(AtomicBool::new(false));
                for (from_client, from, into) in [
                    (true, client_read, server_write),
                    (false, server_read, client_write),
                ] {
                    let (state, silent) = (shared.clone(), silent.clone());
                    let link = Link {
                        state,
                        silent,
                        from_client,
                        deaf: false,
                    };
                    tokio::spawn(forward(from, into, link));
                }
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

    /// The next connection whose client sends `bytes` (within one read;
    /// what carries them is not passed on) goes silent: an AMQP method's
    /// class and method ids, say, to stop the broker answering that
    /// method. Later connections are forwarded.
    pub fn silence_on(&self, bytes: &[u8]) {
        *self.state.trigger.lock().unwrap() = Some(Trigger {
            bytes: bytes.to_vec(),
            deaf: false,
        });
    }

    /// As [`Proxy::silence_on`], but only the client's side goes silent:
    /// nothing it sends from then on reaches the server, while what the
    /// server sends (answers to earlier requests, heartbeats) still comes.
    pub fn deafen_on(&self, bytes: &[u8]) {
        *self.state.trigger.lock().unwrap() = Some(Trigger {
            bytes: bytes.to_vec(),
            deaf: true,
        });
    }

    /// How many connections [`Proxy::silence_on`] and
    /// [`Proxy::deafen_on`] have silenced.
    pub fn silenced(&self) -> usize {
        self.state.triggered.load(Ordering::SeqCst)
    }
}

/// One direction of one connection.
struct Link {
    state: Arc<State>,
    /// This connection went silent.
    silent: Arc<AtomicBool>,
    from_client: bool,
    /// This client's side of the connection went silent.
    deaf: bool,
}

impl Link {
    /// Whether `read` is held back, with all that follows.
    fn holds_back(&mut self, read: &[u8]) -> bool {
        if self.from_client {
            match self.state.silenced_by(read) {
                Some(true) => self.deaf = true,
                Some(false) => self.silent.store(true, Ordering::SeqCst),
                None => {}
            }
        }
        self.deaf || self.silent.load(Ordering::SeqCst) || self.state.silent.load(Ordering::SeqCst)
    }
}

/// Copies `from` into `into` until either side closes, or for good (both
/// left open) once the connection or the proxy is silent.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut into: tokio::net::tcp::OwnedWriteHalf,
    mut link: Link,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if link.holds_back(&buf[..n]) {
            // Both halves stay open: held by this task, which never ends.
            std::future::pending::<()>().await;
        }
        if into.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A proxy to the test PostgreSQL server ([`crate::servers::postgres_url`])
/// and that server's URL through it, without TLS (so that what a client
/// sends can be seen, for [`Proxy::silence_on`]).
pub async fn to_postgres() -> (Proxy, String) {
    to_postgres_at(&crate::servers::postgres_url()).await
}

/// [`to_postgres`] for the database of `url` on that server.
pub async fn to_postgres_at(url: &str) -> (Proxy, String) {
    let (head, rest) = url.split_once('@').expect("a URL with a user");
    let (server, db) = rest.split_once('/').expect("a URL with a database");
    let db = db.split('?').next().unwrap_or(db);
    let proxy = Proxy::start(server).await;
    let through = format!("{head}@{}/{db}?sslmode=disable", proxy.addr());
    (proxy, through)
}

/// A proxy to the test RabbitMQ broker ([`crate::servers::amqp_url`]) and
/// the broker's URL through it.
pub async fn to_amqp() -> (Proxy, String) {
    let url = crate::servers::amqp_url();
    let (scheme_auth, rest) = url.split_once('@').expect("an AMQP URL with a user");
    let (server, vhost) = rest.split_once('/').expect("an AMQP URL with a vhost");
    let proxy = Proxy::start(server).await;
    let through = format!("{scheme_auth}@{}/{vhost}", proxy.addr());
    (proxy, through)
}
