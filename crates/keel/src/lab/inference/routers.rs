//! The inference peers: vLLM Router and SMG, each started as its own process on loopback in
//! front of the lab's engines, with its metrics listener on loopback too (both default to port
//! 29000, SMG's on 0.0.0.0). Found through `KEEL_VLLM_ROUTER` / `KEEL_SMG`, then
//! `~/.cache/keel/inference-peers/bin` (where scripts/install-inference-peers.sh puts them),
//! then PATH; one that is absent is named and skipped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An inference router other than keel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Router {
    /// vLLM Router (`vllm-router`).
    VllmRouter,
    /// SGLang Model Gateway (`smg launch`).
    Smg,
}

impl Router {
    /// Its `--peers` name.
    pub fn name(self) -> &'static str {
        match self {
            Router::VllmRouter => "vllm-router",
            Router::Smg => "smg",
        }
    }

    /// The router named `s`, if it is one of these.
    pub fn parse(s: &str) -> Option<Router> {
        match s {
            "vllm-router" => Some(Router::VllmRouter),
            "smg" => Some(Router::Smg),
            _ => None,
        }
    }

    fn env(self) -> &'static str {
        match self {
            Router::VllmRouter => "KEEL_VLLM_ROUTER",
            Router::Smg => "KEEL_SMG",
        }
    }

    /// Its executable, if found.
    pub fn find(self) -> Option<PathBuf> {
        if let Some(p) = std::env::var_os(self.env()) {
            let p = PathBuf::from(p);
            return p.is_file().then_some(p);
        }
        let bin = self.name();
        let mut dirs = Vec::new();
        if let Some(home) = std::env::var_os("HOME") {
            dirs.push(PathBuf::from(home).join(".cache/keel/inference-peers/bin"));
        }
        if let Some(path) = std::env::var_os("PATH") {
            dirs.extend(std::env::split_paths(&path));
        }
        dirs.into_iter().map(|d| d.join(bin)).find(|p| p.is_file())
    }
}

/// A running peer; killed when dropped.
pub struct Running {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `router` with `policy` (`round_robin` or `cache_aware`) in front of `engines`, and
/// waits until it answers `/health` (and then a first model list) on loopback.
pub async fn start(
    router: Router,
    bin: &PathBuf,
    policy: &str,
    engines: &[SocketAddr],
    log: &std::path::Path,
) -> anyhow::Result<Running> {
    let port = super::traffic::free_port()?;
    let metrics = super::traffic::free_port()?;
    let urls: Vec<String> = engines.iter().map(|a| format!("http://{a}")).collect();
    let mut cmd = Command::new(bin);
    if router == Router::Smg {
        cmd.arg("launch");
    }
    cmd.arg("--worker-urls")
        .args(&urls)
        .args(["--policy", policy, "--host", "127.0.0.1", "--port"])
        .arg(port.to_string())
        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port"])
        .arg(metrics.to_string());
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let running = Running {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // Healthy, and serving the engines' model (SMG answers 404 model_not_found until it
        // has asked its workers).
        if let Ok((200, _)) = get(running.addr, "/health").await {
            if let Ok((200, body)) = get(running.addr, "/v1/models").await {
                if body.contains("keel-llm") {
                    return Ok(running);
                }
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} did not answer /health on {} within 60 s (log: {})",
            router.name(),
            running.addr,
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(2), exchange).await??;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status")?;
    Ok((
        status,
        text.split_once("\r\n\r\n").map_or("", |x| x.1).to_string(),
    ))
}
