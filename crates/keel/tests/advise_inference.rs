//! `keel advise` on an inference pool's access log, checked against what then happens: three
//! fake vLLM engines (`keel backend --llm`) behind `keel proxy` with round-robin, streamed
//! completions whose prompts share prefixes (6 groups, Poisson arrivals); advise reads the
//! proxy's log and must recommend prefix-affinity; the proxy is then run with the section it
//! printed, on fresh engines, with a run of the same workload, and the measured share of prompt
//! tokens from cache and mean TTFT must land inside the predicted intervals. The reverse cases:
//! one prefix shared by every request, and every prompt its own, where advise must say
//! affinity does not pay.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// The two tests run one at a time: real-time engines on a shared machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Kills its process when dropped (a failed assertion leaves nothing running).
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for(port: u16) {
    let until = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < until, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn engines(ports: &[u16]) -> Running {
    let mut c = Command::new(KEEL);
    c.args(["backend", "--llm"]);
    for p in ports {
        c.args(["--listen", &format!("127.0.0.1:{p}")]);
    }
    let r = Running(
        c.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for &p in ports {
        wait_for(p);
    }
    r
}

/// keel proxy on `listen` with `cluster` (a `[[cluster]]` section named `llm`), its JSON
/// access log at `log`.
fn proxy(dir: &Path, listen: u16, cluster: &str, log: &Path) -> Running {
    let config = format!(
        "[[listener]]\nlisten = \"127.0.0.1:{listen}\"\ncluster = \"llm\"\n\n{cluster}\n[access_log]\npath = \"{}\"\nformat = \"json\"\n",
        log.display()
    );
    let path = dir.join(format!("keel-{listen}.toml"));
    std::fs::write(&path, config).unwrap();
    let r = Running(
        Command::new(KEEL)
            .args(["proxy", "--config"])
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(listen);
    r
}

/// `requests` streamed completions at Poisson arrivals of `rate` per second through
/// `port`: each prompt one of `groups` prefixes of 400 tokens (uniform), then 40 tokens of its
/// own (`groups = 0`: 440 tokens of its own), 24 tokens out.
fn drive(port: u16, requests: usize, rate: f64, groups: u64, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let failures = Arc::new(Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    let start = Instant::now();
    let mut at = 0.0f64;
    for i in 0..requests {
        at += -(1.0 - rng.gen::<f64>()).ln() / rate;
        let own: String = (0..160)
            .map(|_| char::from(b'a' + rng.gen_range(0..26u8)))
            .collect();
        let prompt = if groups == 0 {
            let more: String = (0..1600)
                .map(|_| char::from(b'a' + rng.gen_range(0..26u8)))
                .collect();
            format!("{more}{own}")
        } else {
            let g = rng.gen_range(0..groups);
            // 1,600 bytes = 400 tokens = 25 blocks of 16.
            let prefix: String = format!("group {g:02} says: ")
                .chars()
                .cycle()
                .take(1600)
                .collect();
            format!("{prefix}{own}")
        };
        let body =
            format!(r#"{{"model":"keel-llm","prompt":"{prompt}","max_tokens":24,"stream":true}}"#);
        let wait = Duration::from_secs_f64(at).saturating_sub(start.elapsed());
        std::thread::sleep(wait);
        let failures = failures.clone();
        threads.push(std::thread::spawn(move || {
            let req = format!(
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            let ok = (|| -> std::io::Result<bool> {
                let mut s = TcpStream::connect(("127.0.0.1", port))?;
                s.set_read_timeout(Some(Duration::from_secs(20)))?;
                s.write_all(req.as_bytes())?;
                let mut out = Vec::new();
                s.read_to_end(&mut out)?;
                Ok(out.starts_with(b"HTTP/1.1 200") && out.windows(6).any(|w| w == b"[DONE]"))
            })();
            if !matches!(ok, Ok(true)) {
                failures.lock().unwrap().push(format!("request {i}: {ok:?}"));
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    let f = failures.lock().unwrap();
    assert!(f.is_empty(), "failed requests: {f:?}");
}

/// The access log's measured answers: share of prompt tokens from cache and mean TTFT.
fn measured(log: &Path) -> (f64, f64, usize) {
    let text = std::fs::read_to_string(log).unwrap();
    let (mut prompt, mut cached, mut ttft, mut n) = (0u64, 0u64, 0.0, 0usize);
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let Some(t) = v["ttft_ms"].as_f64() else {
            continue;
        };
        assert!(
            v["prefix"].is_string(),
            "every answer names its prefix: {v}"
        );
        assert!(v["prompt_blocks"].as_u64().is_some(), "{v}");
        prompt += v["prompt_tokens"].as_u64().unwrap();
        cached += v["cached_tokens"].as_u64().unwrap();
        ttft += t;
        n += 1;
    }
    (cached as f64 / prompt as f64, ttft / n as f64, n)
}

fn advise(log: &Path) -> serde_json::Value {
    let out = Command::new(KEEL)
        .args(["advise", "--json", "--quiet", "--access-log"])
        .arg(log)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "advise: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn three(v: &serde_json::Value) -> [f64; 3] {
    [0, 1, 2].map(|i| v[i].as_f64().unwrap())
}

/// Waits for the access log's writer (every 100 ms) to have written `n` answers.
fn flushed(log: &Path, n: usize) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let lines = std::fs::read_to_string(log).map_or(0, |t| t.lines().count());
        if lines >= n || Instant::now() > until {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

const ROUND_ROBIN: &str = "[[cluster]]\nname = \"llm\"\ninference = true\nstrategy = \"round-robin\"\nendpoints = [ENDPOINTS]\n";

fn cluster(ports: &[u16]) -> String {
    let e: Vec<String> = ports
        .iter()
        .map(|p| format!("{{ address = \"127.0.0.1:{p}\" }}"))
        .collect();
    ROUND_ROBIN.replace("ENDPOINTS", &e.join(", "))
}

fn tmp() -> PathBuf {
    let d = std::env::temp_dir().join(format!("keel-advise-inference-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn advise_recommends_affinity_on_prefix_groups_and_the_measured_run_lands_inside_its_interval() {
    const REQUESTS: usize = 120;
    const RATE: f64 = 9.0;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp();
    let started = Instant::now();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    // The log: round-robin.
    let log = dir.join("rr.log");
    let (cached_rr, ttft_rr) = {
        let _e = engines(&ports);
        let listen = free_port();
        let _p = proxy(&dir, listen, &cluster(&ports), &log);
        drive(listen, REQUESTS, RATE, 6, 1);
        flushed(&log, REQUESTS);
        let (c, t, n) = measured(&log);
        assert_eq!(n, REQUESTS);
        (c, t)
    };
    let a = advise(&log);
    eprintln!("{}", a["answer"]);
    eprintln!("{}", a["why"]);
    assert_eq!(a["verdict"], "affinity", "{}", a["answer"]);
    let rr = three(&a["balanced"]["cached"]);
    // The round-robin log's own ratio lies in round-robin's interval (the fit's own check).
    assert!(
        rr[1] <= cached_rr && cached_rr <= rr[2],
        "round-robin measured {cached_rr:.3} against {rr:?}"
    );
    let toml = a["cluster_toml"].as_str().unwrap();
    assert!(toml.contains("strategy = \"prefix-affinity\""), "{toml}");
    // Apply it: fresh engines on the same addresses, the proxy with the advised section.
    let log2 = dir.join("affinity.log");
    let (cached, ttft) = {
        let _e = engines(&ports);
        let listen = free_port();
        let _p = proxy(&dir, listen, toml, &log2);
        drive(listen, REQUESTS, RATE, 6, 2);
        flushed(&log2, REQUESTS);
        let (c, t, n) = measured(&log2);
        assert_eq!(n, REQUESTS);
        (c, t)
    };
    let want_c = three(&a["affinity"]["cached"]);
    let want_t = three(&a["affinity"]["ttft_ms"]);
    eprintln!(
        "round-robin measured {cached_rr:.3}, {ttft_rr:.1} ms; prefix-affinity predicted {want_c:?}, {want_t:?} ms; measured {cached:.3}, {ttft:.1} ms ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    assert!(
        want_c[1] <= cached && cached <= want_c[2],
        "measured {cached:.3} outside {want_c:?}"
    );
    assert!(
        want_t[1] <= ttft && ttft <= want_t[2],
        "measured TTFT {ttft:.1} ms outside {want_t:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn advise_says_affinity_pays_nothing_for_one_shared_prefix() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp().join("one");
    std::fs::create_dir_all(&dir).unwrap();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let log = dir.join("rr.log");
    {
        let _e = engines(&ports);
        let listen = free_port();
        let _p = proxy(&dir, listen, &cluster(&ports), &log);
        drive(listen, 60, 9.0, 1, 3);
        flushed(&log, 60);
    }
    let a = advise(&log);
    eprintln!("{}", a["answer"]);
    assert_eq!(a["verdict"], "balance", "{}", a["answer"]);
    assert!(a["cluster_toml"]
        .as_str()
        .unwrap()
        .contains("strategy = \"round-robin\""));
    // Every prompt its own: nothing to keep together.
    let log = dir.join("unique.log");
    {
        let _e = engines(&ports);
        let listen = free_port();
        let _p = proxy(&dir, listen, &cluster(&ports), &log);
        drive(listen, 45, 9.0, 0, 4);
        flushed(&log, 45);
    }
    let a = advise(&log);
    eprintln!("{}", a["answer"]);
    assert_eq!(a["verdict"], "balance", "{}", a["answer"]);
    assert!(a["answer"]
        .as_str()
        .unwrap()
        .contains("no two requests share a prompt block"));
    let _ = std::fs::remove_dir_all(&dir);
}
