//! "Hosts" on one machine: Linux network namespaces joined to this one by a
//! veth pair each, for tests of processes that run on several machines.
//! A host reaches the shared servers (which listen on 127.0.0.1 only)
//! through forwarders this process runs on the host side of its link; a
//! host is lost all at once by killing every process in it and deleting its
//! link. Needs root (`ip netns`, from Debian's iproute2); nothing leaves
//! the machine.

use std::net::SocketAddr;
use std::process::Command;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// `ip args…`, which must succeed.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (Debian's iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {} (network namespaces need root)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One network namespace with a link to this one.
#[derive(Debug)]
pub struct Host {
    /// The namespace's name.
    pub name: String,
    /// This side's address on the link, where the forwarders listen.
    pub gateway: String,
    link: String,
    forwards: Vec<JoinHandle<()>>,
    lost: bool,
}

impl Host {
    /// Makes host `k` (0 to 99) of this test process: namespace, veth
    /// pair, addresses `10.213.<n>.1` here and `.2` there, links up.
    pub fn create(k: u8) -> Host {
        let tag = std::process::id() % 10_000;
        let name = format!("pbx{tag}h{k}");
        let link = format!("pb{tag}h{k}");
        let subnet = (std::process::id() % 100) as u8 * 2 + k % 2;
        let gateway = format!("10.213.{subnet}.1");
        let inside = format!("10.213.{subnet}.2/24");
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        let _ = Command::new("ip").args(["link", "del", &link]).output();
        ip(&["netns", "add", &name]);
        let peer = format!("{link}p");
        ip(&["link", "add", &link, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &name]);
        ip(&["addr", "add", &format!("{gateway}/24"), "dev", &link]);
        ip(&["link", "set", &link, "up"]);
        for args in [
            vec!["addr", "add", inside.as_str(), "dev", peer.as_str()],
            vec!["link", "set", peer.as_str(), "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut all = vec!["netns", "exec", name.as_str(), "ip"];
            all.extend(args);
            ip(&all);
        }
        Host {
            name,
            gateway,
            link,
            forwards: Vec::new(),
            lost: false,
        }
    }

    /// Forwards connections to this side's address (a port of its own) to
    /// `to`, for processes in the namespace; returns `gateway:port`.
    pub async fn forward(&mut self, to: SocketAddr) -> String {
        let listener = TcpListener::bind((self.gateway.as_str(), 0)).await.unwrap();
        let at = listener.local_addr().unwrap();
        self.forwards.push(tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
        at.to_string()
    }

    /// `ip netns exec <name> program`: a command that runs in the host.
    pub fn command(&self, program: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Loses the host at once: every process in it is killed (SIGKILL) and
    /// its link deleted, so its connections die as with a crashed machine.
    pub fn lose(&mut self) {
        self.kill_processes();
        for f in self.forwards.drain(..) {
            f.abort();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
        self.lost = true;
    }

    fn kill_processes(&self) {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output();
        for pid in out.iter().flat_map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .into_owned()
                .split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        }) {
            let _ = Command::new("kill").args(["-9", &pid]).status();
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if !self.lost {
            self.lose();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
