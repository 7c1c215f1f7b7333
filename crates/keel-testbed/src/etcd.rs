//! A real etcd cluster on loopback for tests and the lab: `etcd` processes (Debian's
//! `etcd-server`, 3.4) with their own ports and data directories in a temporary directory,
//! killed and removed on drop. Members can be killed, stopped (SIGSTOP), resumed and restarted,
//! for the fault experiments.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why a cluster could not be started.
#[derive(Debug)]
pub enum EtcdStartError {
    /// `etcd` is not on PATH (Debian: `apt-get install etcd-server`).
    NotInstalled(std::io::Error),
    /// A file or port could not be had.
    Io(std::io::Error),
    /// The members did not all answer `/health` in time; the members' log tail.
    NotHealthy(String),
}

impl std::fmt::Display for EtcdStartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EtcdStartError::NotInstalled(e) => write!(
                f,
                "cannot run `etcd` ({e}); install it: apt-get install etcd-server (or run scripts/test-etcd.sh)"
            ),
            EtcdStartError::Io(e) => write!(f, "{e}"),
            EtcdStartError::NotHealthy(log) => write!(f, "etcd did not become healthy:\n{log}"),
        }
    }
}

impl std::error::Error for EtcdStartError {}

/// One member.
struct Member {
    name: String,
    client: SocketAddr,
    peer: SocketAddr,
    child: Option<Child>,
    stopped: bool,
}

/// An etcd cluster of member processes on loopback.
pub struct EtcdCluster {
    dir: PathBuf,
    members: Vec<Member>,
}

/// A free loopback port for a member, below the kernel's ephemeral range: a member restarted
/// on its old port (a restore, a crash) must find it free, and a port from `bind(:0)` lies in
/// the range every outgoing connection on the machine draws from, so another test's client
/// could hold it by then. Bound then released: another process could take it in between,
/// which a test would see as a failed start.
fn free_port() -> std::io::Result<SocketAddr> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    if low > 12_000 {
        for _ in 0..64 {
            let port = 10_000 + rand::random::<u16>() % (low - 10_000);
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
                return l.local_addr();
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

impl EtcdCluster {
    /// Starts `n` members and waits until each answers `/health` (at most 20 s).
    pub fn start(n: usize) -> Result<Self, EtcdStartError> {
        let dir = std::env::temp_dir().join(format!(
            "keel-etcd-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).map_err(EtcdStartError::Io)?;
        let mut members = Vec::with_capacity(n);
        for i in 0..n {
            members.push(Member {
                name: format!("m{i}"),
                client: free_port().map_err(EtcdStartError::Io)?,
                peer: free_port().map_err(EtcdStartError::Io)?,
                child: None,
                stopped: false,
            });
        }
        let mut cluster = EtcdCluster { dir, members };
        for i in 0..n {
            cluster.spawn(i)?;
        }
        cluster.wait_healthy(Duration::from_secs(20))?;
        Ok(cluster)
    }

    /// The members' client URLs.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://{}", m.client))
            .collect()
    }

    /// The members' client URLs, comma-separated (as `etcdctl --endpoints` takes them).
    pub fn endpoints_csv(&self) -> String {
        self.endpoints().join(",")
    }

    /// The number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// True without members.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The data directory root.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn spawn(&mut self, i: usize) -> Result<(), EtcdStartError> {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}=http://{}", m.name, m.peer))
            .collect();
        let m = &self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", m.name)))
            .map_err(EtcdStartError::Io)?;
        let child = Command::new("etcd")
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(self.dir.join(&m.name))
            .arg(format!("--listen-client-urls=http://{}", m.client))
            .arg(format!("--advertise-client-urls=http://{}", m.client))
            .arg(format!("--listen-peer-urls=http://{}", m.peer))
            .arg(format!("--initial-advertise-peer-urls=http://{}", m.peer))
            .arg(format!("--initial-cluster={}", initial.join(",")))
            .arg("--initial-cluster-token=keel-test")
            .arg("--initial-cluster-state=new")
            // Loopback: fast heartbeats, so that a lost leader is replaced within a second.
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=500")
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(EtcdStartError::NotInstalled)?;
        let m = &mut self.members[i];
        m.child = Some(child);
        m.stopped = false;
        Ok(())
    }

    /// True if member `i` answers `GET /health` with `"health":"true"`.
    pub fn healthy(&self, i: usize) -> bool {
        let m = &self.members[i];
        let Ok(mut s) = TcpStream::connect_timeout(&m.client, Duration::from_millis(300)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!(
            "GET /health HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            m.client
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"health\":\"true\"")
    }

    /// Waits until every running member is healthy.
    pub fn wait_healthy(&self, within: Duration) -> Result<(), EtcdStartError> {
        let until = Instant::now() + within;
        loop {
            let all = (0..self.members.len())
                .filter(|&i| self.members[i].child.is_some() && !self.members[i].stopped)
                .all(|i| self.healthy(i));
            if all {
                return Ok(());
            }
            if Instant::now() > until {
                return Err(EtcdStartError::NotHealthy(self.log_tail()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The last lines of every member's log.
    pub fn log_tail(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let text = std::fs::read_to_string(self.dir.join(format!("{}.log", m.name)))
                .unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {} ---\n", m.name));
            for l in &lines[lines.len().saturating_sub(10)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Kills member `i` (SIGKILL) and waits for it.
    pub fn kill(&mut self, i: usize) {
        let m = &mut self.members[i];
        if let Some(mut c) = m.child.take() {
            if m.stopped {
                signal(&c, libc_sig::CONT);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        m.stopped = false;
    }

    /// Kills every member.
    pub fn kill_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// Starts member `i` again on its data directory and ports.
    pub fn restart(&mut self, i: usize) -> Result<(), EtcdStartError> {
        self.kill(i);
        self.spawn(i)
    }

    /// Starts every member that is not running, and waits until all are healthy.
    pub fn restart_all(&mut self) -> Result<(), EtcdStartError> {
        for i in 0..self.members.len() {
            if self.members[i].child.is_none() {
                self.spawn(i)?;
            }
        }
        self.wait_healthy(Duration::from_secs(20))
    }

    /// Stops member `i` (SIGSTOP): its sockets stay open and nothing answers.
    pub fn stop(&mut self, i: usize) {
        let m = &mut self.members[i];
        if let Some(c) = &m.child {
            signal(c, libc_sig::STOP);
            m.stopped = true;
        }
    }

    /// Resumes a stopped member (SIGCONT).
    pub fn resume(&mut self, i: usize) {
        let m = &mut self.members[i];
        if let Some(c) = &m.child {
            signal(c, libc_sig::CONT);
            m.stopped = false;
        }
    }

    /// The index of the member that is the leader now, asked through its `/metrics`
    /// (`etcd_server_is_leader 1`).
    pub fn leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&i| {
            let m = &self.members[i];
            if m.child.is_none() || m.stopped {
                return false;
            }
            let Ok(mut s) = TcpStream::connect_timeout(&m.client, Duration::from_millis(300))
            else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let req = format!(
                "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                m.client
            );
            if s.write_all(req.as_bytes()).is_err() {
                return false;
            }
            let mut body = String::new();
            let _ = s.read_to_string(&mut body);
            body.lines().any(|l| l.trim() == "etcd_server_is_leader 1")
        })
    }
}

/// The signals sent (through `kill(1)`: rare, and it keeps this crate free of libc).
mod libc_sig {
    pub const STOP: &str = "STOP";
    pub const CONT: &str = "CONT";
}

fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status();
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill_all();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
