//! Broker clusters on this machine for failover tests: a 3-node RabbitMQ
//! cluster and a 3-node NATS JetStream cluster, each node a process of its
//! own on loopback ports with its own data folder, started here and killed
//! when the value is dropped. The shared single-node servers are left alone
//! (other node names, ports, folders and, for RabbitMQ, root's own Erlang
//! cookie).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// A free loopback port (bound and released: a tiny race, fine for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A fresh folder under the system temp dir, named after `what` and this
/// process.
fn scratch_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "postbox-{what}-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `kill -9 pid`, ignoring a process already gone.
fn kill9(pid: u32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}

/// RabbitMQ's own scripts (as root they run the node as root, with root's
/// Erlang cookie, which every node here shares).
const RABBITMQ_BIN: &str = "/usr/lib/rabbitmq/bin";

/// One node of a [`RabbitCluster`].
#[derive(Debug)]
pub struct RabbitNode {
    /// `pbx…@localhost`.
    pub name: String,
    /// Its AMQP port on 127.0.0.1.
    pub port: u16,
    /// The Erlang VM's OS pid, once up.
    pid: Option<u32>,
    /// Where the node writes its pid.
    pid_file: PathBuf,
}

impl RabbitNode {
    fn pid_from_file(&self) -> Option<u32> {
        std::fs::read_to_string(&self.pid_file)
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

/// A RabbitMQ cluster of nodes on loopback.
#[derive(Debug)]
pub struct RabbitCluster {
    /// The nodes, the first the one the others joined.
    pub nodes: Vec<RabbitNode>,
    dir: PathBuf,
}

fn rabbitmqctl(node: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(format!("{RABBITMQ_BIN}/rabbitmqctl"))
        .args(["-n", node])
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl: {e}"))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("rabbitmqctl -n {node} {}: {text}", args.join(" ")))
    }
}

impl RabbitCluster {
    /// Starts `n` nodes and joins them into one cluster; panics, saying
    /// what failed, when they do not come up within two minutes. Blocking:
    /// call it from `spawn_blocking` or before the runtime is busy.
    pub fn start(n: usize) -> RabbitCluster {
        let dir = scratch_dir("rabbit-cluster");
        let tag = format!(
            "{}{}",
            std::process::id(),
            &uuid::Uuid::now_v7().simple().to_string()[26..]
        );
        let mut cluster = RabbitCluster {
            nodes: Vec::new(),
            dir: dir.clone(),
        };
        for i in 0..n {
            let name = format!("pbx{tag}n{i}@localhost");
            let (port, dist) = (free_port(), free_port());
            let home = dir.join(format!("n{i}"));
            std::fs::create_dir_all(home.join("log")).unwrap();
            std::fs::write(
                home.join("rabbitmq.conf"),
                format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n"),
            )
            .unwrap();
            std::fs::write(home.join("enabled_plugins"), "[].\n").unwrap();
            let status = Command::new(format!("{RABBITMQ_BIN}/rabbitmq-server"))
                .arg("-detached")
                .env("RABBITMQ_NODENAME", &name)
                .env("RABBITMQ_NODE_PORT", port.to_string())
                .env("RABBITMQ_DIST_PORT", dist.to_string())
                .env("RABBITMQ_CONFIG_FILE", home.join("rabbitmq.conf"))
                .env("RABBITMQ_MNESIA_BASE", home.join("mnesia"))
                .env("RABBITMQ_LOG_BASE", home.join("log"))
                .env(
                    "RABBITMQ_ENABLED_PLUGINS_FILE",
                    home.join("enabled_plugins"),
                )
                .env("RABBITMQ_PID_FILE", home.join("pid"))
                .status()
                .expect("rabbitmq-server (Debian's rabbitmq-server package)");
            assert!(
                status.success(),
                "rabbitmq-server -detached for {name}: {status}"
            );
            cluster.nodes.push(RabbitNode {
                name,
                port,
                pid: None,
                pid_file: home.join("pid"),
            });
        }
        for node in &mut cluster.nodes {
            // `wait` waits for the pid file, then for the node to boot.
            let pid_file = node.pid_file.to_str().unwrap();
            rabbitmqctl(&node.name, &["wait", pid_file, "--timeout", "120"])
                .unwrap_or_else(|e| panic!("node did not start: {e}"));
            node.pid = node.pid_from_file();
        }
        let first = cluster.nodes[0].name.clone();
        for node in &cluster.nodes[1..] {
            for args in [
                vec!["stop_app"],
                vec!["join_cluster", first.as_str()],
                vec!["start_app"],
            ] {
                rabbitmqctl(&node.name, &args).unwrap_or_else(|e| panic!("{e}"));
            }
        }
        let status = rabbitmqctl(&first, &["cluster_status"]).unwrap();
        for node in &cluster.nodes {
            assert!(
                status.contains(&node.name),
                "{} not in the cluster: {status}",
                node.name
            );
        }
        cluster
    }

    /// The nodes' AMQP URLs, in order.
    pub fn urls(&self) -> Vec<String> {
        (self.nodes.iter())
            .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", n.port))
            .collect()
    }

    /// Stops RabbitMQ on node `i`, the Erlang VM left running: its
    /// listeners close and its clients are disconnected, as in a broker
    /// outage. Blocking.
    pub fn stop_app(&self, i: usize) {
        rabbitmqctl(&self.nodes[i].name, &["stop_app"]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts RabbitMQ on node `i` again after [`RabbitCluster::stop_app`].
    /// Blocking.
    pub fn start_app(&self, i: usize) {
        rabbitmqctl(&self.nodes[i].name, &["start_app"]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Raises (or clears) a memory alarm on node `i`: its memory high
    /// watermark set to one byte (or back to the default 0.4), so the
    /// broker blocks every connection that publishes, as when it runs out
    /// of memory. Blocking.
    pub fn memory_alarm(&self, i: usize, on: bool) {
        let args: &[&str] = if on {
            &["set_vm_memory_high_watermark", "absolute", "1"]
        } else {
            &["set_vm_memory_high_watermark", "0.4"]
        };
        rabbitmqctl(&self.nodes[i].name, args).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Kills node `i` at once (SIGKILL), as a crash would.
    pub fn kill(&mut self, i: usize) {
        if let Some(pid) = self.nodes[i].pid.take() {
            kill9(pid);
        }
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        // A node that never came up may still be booting: its pid file
        // names it.
        for node in &mut self.nodes {
            if let Some(pid) = node.pid.take().or_else(|| node.pid_from_file()) {
                kill9(pid);
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A NATS cluster with JetStream on every node (one node: a plain
/// JetStream server).
#[derive(Debug)]
pub struct NatsCluster {
    /// The client ports on 127.0.0.1, in node order.
    pub ports: Vec<u16>,
    /// Each node's `nats-server` arguments, to start it again.
    args: Vec<Vec<String>>,
    processes: std::sync::Mutex<Vec<Option<std::process::Child>>>,
    dir: PathBuf,
    /// The user and password every client must give
    /// ([`NatsCluster::start_with_user`]).
    user: Option<(String, String)>,
}

fn nats_server(args: &[String]) -> std::process::Child {
    Command::new("nats-server")
        .args(args)
        .spawn()
        .expect("nats-server (Debian's nats-server package)")
}

impl NatsCluster {
    /// Starts `n` routed `nats-server -js` nodes and waits until JetStream
    /// answers on every one (a meta leader is elected).
    pub async fn start(n: usize) -> NatsCluster {
        Self::start_as(n, None).await
    }

    /// [`NatsCluster::start`], with every client required to log in as
    /// `user` with `password`.
    pub async fn start_with_user(n: usize, user: &str, password: &str) -> NatsCluster {
        Self::start_as(n, Some((user.to_owned(), password.to_owned()))).await
    }

    /// A client of node `url`, logged in as the cluster requires.
    pub async fn connect(&self, url: &str) -> Result<async_nats::Client, async_nats::ConnectError> {
        let options = async_nats::ConnectOptions::new();
        let options = match &self.user {
            Some((user, password)) => options.user_and_password(user.clone(), password.clone()),
            None => options,
        };
        options.connect(url).await
    }

    async fn start_as(n: usize, user: Option<(String, String)>) -> NatsCluster {
        let dir = scratch_dir("nats-cluster");
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let routes: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let name = format!(
            "pbx{}x{}",
            std::process::id(),
            &uuid::Uuid::now_v7().simple().to_string()[26..]
        );
        let mut all_args = Vec::new();
        for i in 0..n {
            let others: Vec<String> = (0..n)
                .filter(|&j| j != i)
                .map(|j| format!("nats://127.0.0.1:{}", routes[j]))
                .collect();
            let mut args: Vec<String> = ["-a", "127.0.0.1", "-p", &ports[i].to_string(), "-js"]
                .map(str::to_owned)
                .to_vec();
            args.extend([
                "-sd".into(),
                dir.join(format!("n{i}")).display().to_string(),
            ]);
            args.extend(["--server_name".into(), format!("{name}n{i}")]);
            args.extend([
                "-l".into(),
                dir.join(format!("n{i}.log")).display().to_string(),
            ]);
            if let Some((name, password)) = &user {
                args.extend([
                    "--user".into(),
                    name.clone(),
                    "--pass".into(),
                    password.clone(),
                ]);
            }
            if n > 1 {
                args.extend(["--cluster_name".into(), name.clone()]);
                args.extend([
                    "--cluster".into(),
                    format!("nats://127.0.0.1:{}", routes[i]),
                ]);
                args.extend(["--routes".into(), others.join(",")]);
            }
            all_args.push(args);
        }
        let processes = all_args.iter().map(|a| Some(nats_server(a))).collect();
        let cluster = NatsCluster {
            ports,
            args: all_args,
            processes: std::sync::Mutex::new(processes),
            dir,
            user,
        };
        let started = Instant::now();
        for url in cluster.urls() {
            loop {
                let ready = async {
                    let client = cluster.connect(&url).await.map_err(|e| e.to_string())?;
                    let js = async_nats::jetstream::new(client);
                    // JetStream answers (a missing stream is an answer)
                    // once the cluster has a meta leader.
                    match js.get_stream("POSTBOX_READY_PROBE").await {
                        Ok(_) => Ok(()),
                        Err(e) if e.to_string().contains("not found") => Ok(()),
                        Err(e) => Err(e.to_string()),
                    }
                };
                let seen = match tokio::time::timeout(Duration::from_secs(2), ready).await {
                    Ok(Ok(_)) => break,
                    Ok(Err(e)) => e,
                    Err(_) => "no answer within 2 s".to_owned(),
                };
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "JetStream did not come up on {url} ({seen}); logs in {}",
                    cluster.dir.display()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        cluster
    }

    /// The nodes' client URLs, in order.
    pub fn urls(&self) -> Vec<String> {
        (self.ports.iter())
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect()
    }

    /// Kills node `i` at once (SIGKILL), as a crash would.
    pub fn kill(&self, i: usize) {
        let mut processes = self.processes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mut child) = processes[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again (after [`NatsCluster::kill`]) on its port and
    /// its data folder, and waits until it answers.
    pub async fn restart(&self, i: usize) {
        self.kill(i);
        let child = nats_server(&self.args[i]);
        self.processes.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(child);
        let url = self.urls()[i].clone();
        let started = Instant::now();
        while self.connect(&url).await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{url} did not come back"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.args.len() {
            self.kill(i);
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
