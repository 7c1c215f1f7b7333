//! Real traffic for the inference lab: N fake vLLM engines (`keel_testbed::llm`) on loopback,
//! each behind a relay that counts the HTTP requests it is sent by path, a router in front of
//! them (keel's proxy in this process, or a peer's process), and closed-loop clients sending
//! streaming completions whose prompts share prefixes.
//!
//! The relay is what lets the lab say how many calls a router makes to the engines besides the
//! request itself (renders, tokenizations, health and load polls): the engine's own count is of
//! generation requests only.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_model::inference::formula::Workload;
use keel_model::inference::EngineSpec;
use keel_testbed::llm::{self, LlmConfig, LlmHandle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The header naming the prompt's first block, sent by the lab's clients for a router that
/// hashes a header (keel's `rendezvous` with `hash_on`, the stand-in for prefix affinity when
/// the `prefix-affinity` strategy is not built in).
pub const PREFIX_HEADER: &str = "x-prefix-block";

/// Paths the relay counts as the request itself.
const GENERATION: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// Requests by path that reached one engine.
type PathCounts = Arc<Mutex<BTreeMap<String, u64>>>;

/// N engines on loopback, each behind a counting relay.
pub struct Pool {
    engines: Vec<LlmHandle>,
    relays: Vec<SocketAddr>,
    counts: Vec<PathCounts>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Pool {
    /// Starts `n` engines of `spec` and their relays.
    pub async fn start(n: usize, spec: EngineSpec, seed: u64) -> anyhow::Result<Pool> {
        let mut pool = Pool {
            engines: Vec::new(),
            relays: Vec::new(),
            counts: Vec::new(),
            tasks: Vec::new(),
        };
        for j in 0..n {
            let cfg = LlmConfig {
                spec,
                seed: seed.wrapping_add(j as u64),
                name: format!("engine-{j}"),
                ..LlmConfig::default()
            };
            let engine = llm::spawn("127.0.0.1:0".parse()?, cfg)
                .await
                .context("starting an LLM engine")?;
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let counts: PathCounts = Arc::default();
            pool.relays.push(listener.local_addr()?);
            pool.tasks
                .push(tokio::spawn(relay(listener, engine.addr(), counts.clone())));
            pool.counts.push(counts);
            pool.engines.push(engine);
        }
        Ok(pool)
    }

    /// The addresses routers send to (the relays).
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.relays
    }

    /// Calls per path so far, summed over the engines.
    pub fn calls(&self) -> BTreeMap<String, u64> {
        let mut all = BTreeMap::new();
        for c in &self.counts {
            for (k, v) in c.lock().expect("counts").iter() {
                *all.entry(k.clone()).or_insert(0) += v;
            }
        }
        all
    }

    /// Stops the relays and the engines.
    pub async fn shutdown(self) {
        for t in self.tasks {
            t.abort();
        }
        for e in self.engines {
            e.shutdown().await;
        }
    }
}

/// Calls that are not generation requests, from two snapshots of [`Pool::calls`].
pub fn extra_calls(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> u64 {
    after
        .iter()
        .filter(|(k, _)| !GENERATION.contains(&k.as_str()))
        .map(|(k, v)| v - before.get(k).copied().unwrap_or(0))
        .sum()
}

/// Forwards every connection to `to`, counting the requests on the way in by path.
async fn relay(listener: TcpListener, to: SocketAddr, counts: PathCounts) {
    while let Ok((client, _)) = listener.accept().await {
        let counts = counts.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(to).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let up = async {
                let mut counter = Counter::default();
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    for path in counter.feed(&buf[..n]) {
                        *counts.lock().expect("counts").entry(path).or_insert(0) += 1;
                    }
                    if sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = sw.shutdown().await;
            };
            let down = async {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
                let _ = cw.shutdown().await;
            };
            tokio::join!(up, down);
        });
    }
}

/// Finds the requests in one connection's bytes (HTTP/1.1 framing: `Content-Length` or
/// chunked bodies), so that a body's text is never mistaken for a request line.
#[derive(Default)]
struct Counter {
    head: Vec<u8>,
    /// Body bytes still to skip.
    body: u64,
    /// Inside a chunked body: the current line, or the chunk's data left.
    chunked: Option<Chunked>,
}

enum Chunked {
    Size(Vec<u8>),
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd(u8),
    /// Trailers after the last chunk, until an empty line.
    Trailer(Vec<u8>),
}

impl Counter {
    fn feed(&mut self, mut bytes: &[u8]) -> Vec<String> {
        let mut found = Vec::new();
        while !bytes.is_empty() {
            if self.body > 0 {
                let k = (self.body as usize).min(bytes.len());
                self.body -= k as u64;
                bytes = &bytes[k..];
                continue;
            }
            if let Some(state) = &mut self.chunked {
                let b = bytes[0];
                bytes = &bytes[1..];
                match state {
                    Chunked::Size(line) => {
                        if b == b'\n' {
                            let text = String::from_utf8_lossy(line);
                            let hex = text.trim().split(';').next().unwrap_or("").trim();
                            let size = u64::from_str_radix(hex, 16).unwrap_or(0);
                            *state = if size == 0 {
                                Chunked::Trailer(Vec::new())
                            } else {
                                Chunked::Data(size)
                            };
                        } else {
                            line.push(b);
                        }
                    }
                    Chunked::Data(left) => {
                        *left -= 1;
                        if *left == 0 {
                            *state = Chunked::DataEnd(2);
                        }
                    }
                    Chunked::DataEnd(left) => {
                        *left -= 1;
                        if *left == 0 {
                            *state = Chunked::Size(Vec::new());
                        }
                    }
                    Chunked::Trailer(line) => {
                        if b == b'\n' {
                            if line.iter().all(|c| *c == b'\r') {
                                self.chunked = None;
                            } else {
                                line.clear();
                            }
                        } else {
                            line.push(b);
                        }
                    }
                }
                continue;
            }
            self.head.push(bytes[0]);
            bytes = &bytes[1..];
            if self.head.ends_with(b"\r\n\r\n") {
                let text = String::from_utf8_lossy(&self.head).to_string();
                self.head.clear();
                let mut lines = text.lines();
                let path = lines
                    .next()
                    .and_then(|l| l.split(' ').nth(1))
                    .unwrap_or("?")
                    .split('?')
                    .next()
                    .unwrap_or("?")
                    .to_string();
                found.push(path);
                for l in lines {
                    let Some((k, v)) = l.split_once(':') else {
                        continue;
                    };
                    let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                    if k == "content-length" {
                        self.body = v.parse().unwrap_or(0);
                    } else if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked")
                    {
                        self.chunked = Some(Chunked::Size(Vec::new()));
                    }
                }
            }
        }
        found
    }
}

/// The prompts of a run: each request's group and text, drawn from a seed.
pub struct Prompts {
    /// Each group's prefix text.
    prefixes: Vec<String>,
    /// Each request's group.
    pub groups: Vec<usize>,
    /// Each request's own suffix.
    suffixes: Vec<String>,
    /// Each group's first block's name (hex), for [`PREFIX_HEADER`].
    pub first_blocks: Vec<String>,
}

impl Prompts {
    /// `requests` prompts of workload `w` for engines of `spec`.
    pub fn new(w: &Workload, spec: &EngineSpec, requests: usize, seed: u64) -> Prompts {
        let bytes = keel_balance::prefix::BYTES_PER_TOKEN;
        let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37);
        let letters = |rng: &mut StdRng, n: usize| -> String {
            (0..n).map(|_| rng.gen_range(b'a'..=b'z') as char).collect()
        };
        let prefixes: Vec<String> = (0..w.groups)
            .map(|g| {
                let mut r = StdRng::seed_from_u64(seed.wrapping_add(1000 + g as u64));
                letters(&mut r, w.prefix_tokens * bytes)
            })
            .collect();
        let first_blocks = prefixes
            .iter()
            .map(|p| {
                let mut h = keel_balance::prefix::PrefixHasher::new(spec.block_tokens);
                h.push(p.as_bytes());
                h.blocks()
                    .first()
                    .map_or("none".into(), |b| format!("{b:016x}"))
            })
            .collect();
        let cumulative: Vec<f64> = w
            .popularity
            .shares(w.groups)
            .iter()
            .scan(0.0, |acc, &p| {
                *acc += p;
                Some(*acc)
            })
            .collect();
        let mut groups = Vec::with_capacity(requests);
        let mut suffixes = Vec::with_capacity(requests);
        for _ in 0..requests {
            let x: f64 = rng.gen();
            groups.push(
                cumulative
                    .iter()
                    .position(|&a| x < a)
                    .unwrap_or(w.groups - 1),
            );
            suffixes.push(letters(&mut rng, w.unique_tokens * bytes));
        }
        Prompts {
            prefixes,
            groups,
            suffixes,
            first_blocks,
        }
    }

    pub(crate) fn body(&self, i: usize, output_tokens: usize) -> String {
        format!(
            "{{\"model\":\"keel-llm\",\"prompt\":\"{}{}\",\"max_tokens\":{output_tokens},\
             \"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}",
            self.prefixes[self.groups[i]], self.suffixes[i]
        )
    }
}

/// How the lab's client offers its requests.
#[derive(Debug, Clone, Copy)]
pub enum Offered {
    /// Closed loop: this many at a time, each sending the next when its answer ends.
    Clients(usize),
    /// Open loop: Poisson arrivals at `rate` per second to the router (seeded).
    Poisson {
        /// Requests per second.
        rate: f64,
        /// The arrivals' seed.
        seed: u64,
    },
}

/// What one run of traffic measured.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// Requests answered.
    pub requests: u64,
    /// Prompt tokens the engines reported.
    pub prompt_tokens: u64,
    /// Of those, served from cache.
    pub cached_tokens: u64,
    /// Mean time to the first streamed token, seconds.
    pub ttft_mean: f64,
    /// Requests per engine (from the engines' `x-backend` names).
    pub per_engine: Vec<u64>,
    /// Share of all requests of group `g` on engine `j`.
    pub mix: Vec<Vec<f64>>,
    /// Calls to the engines besides the requests themselves.
    pub extra_calls: u64,
    /// Those calls by path.
    pub extra_paths: BTreeMap<String, u64>,
    /// Wall time, seconds.
    pub seconds: f64,
}

impl Measured {
    /// Share of prompt tokens served from cache.
    pub fn cached(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

struct Answer {
    ttft: Duration,
    engine: Option<usize>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Sends every prompt of `prompts` to `router`, `clients` at a time (closed loop), and counts
/// what the engines of `pool` were asked besides.
pub async fn drive(
    pool: &Pool,
    router: SocketAddr,
    prompts: &Prompts,
    groups: usize,
    output_tokens: usize,
    offered: Offered,
    sent: &dyn Fn(),
) -> anyhow::Result<Measured> {
    let started = Instant::now();
    let before = pool.calls();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let total = prompts.groups.len();
    let answers: Mutex<Vec<(usize, Answer)>> = Mutex::new(Vec::with_capacity(total));
    let one = |i: usize| {
        let answers = &answers;
        async move {
            let body = prompts.body(i, output_tokens);
            let header = &prompts.first_blocks[prompts.groups[i]];
            let a = complete(router, &body, header)
                .await
                .with_context(|| format!("request {i} through {router}"))?;
            answers.lock().expect("answers").push((i, a));
            sent();
            Ok::<(), anyhow::Error>(())
        }
    };
    match offered {
        Offered::Clients(clients) => {
            let client = || async {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= total {
                        return Ok::<(), anyhow::Error>(());
                    }
                    one(i).await?;
                }
            };
            let all: Vec<_> = (0..clients.max(1)).map(|_| client()).collect();
            for r in futures_join(all).await {
                r?;
            }
        }
        Offered::Poisson { rate, seed } => {
            // Each request at its own arrival time, whatever the ones before it do.
            let mut rng = StdRng::seed_from_u64(seed ^ 0x0a11);
            let mut at = 0.0;
            let mut all = Vec::with_capacity(total);
            for i in 0..total {
                let due = tokio::time::Instant::from_std(started + Duration::from_secs_f64(at));
                at += -(1.0 - rng.gen::<f64>()).ln() / rate.max(1e-9);
                let request = one(i);
                all.push(async move {
                    tokio::time::sleep_until(due).await;
                    request.await
                });
            }
            for r in futures_join(all).await {
                r?;
            }
        }
    }
    let n = pool.addrs().len();
    let mut m = Measured {
        per_engine: vec![0; n],
        mix: vec![vec![0.0; groups]; n],
        ..Measured::default()
    };
    let answers = answers.into_inner().expect("answers");
    let mut ttft = 0.0;
    for (i, a) in &answers {
        m.requests += 1;
        m.prompt_tokens += a.prompt_tokens;
        m.cached_tokens += a.cached_tokens;
        ttft += a.ttft.as_secs_f64();
        if let Some(j) = a.engine.filter(|&j| j < n) {
            m.per_engine[j] += 1;
            m.mix[j][prompts.groups[*i]] += 1.0;
        }
    }
    m.ttft_mean = ttft / m.requests.max(1) as f64;
    for row in m.mix.iter_mut() {
        for x in row.iter_mut() {
            *x /= m.requests.max(1) as f64;
        }
    }
    let after = pool.calls();
    m.extra_calls = extra_calls(&before, &after);
    m.extra_paths = after
        .iter()
        .filter(|(k, _)| !GENERATION.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    m.seconds = started.elapsed().as_secs_f64();
    Ok(m)
}

/// Runs the futures together on this task.
pub(crate) async fn futures_join<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in fs {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in set.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|x| x.expect("ready")).collect()
}

/// One streaming completion on a connection of its own (HTTP/1.0, so that the answer is not
/// chunked and ends with the connection): the time to its first event, the engine that
/// answered and its usage.
async fn complete(router: SocketAddr, body: &str, first_block: &str) -> anyhow::Result<Answer> {
    let r = ask(router, body, first_block, None).await?;
    anyhow::ensure!(r.status == 200, "status {}: {}", r.status, r.head);
    Ok(Answer {
        ttft: r.ttft.context("no event in the stream")?,
        engine: r.engine,
        prompt_tokens: r.prompt_tokens.context("no usage in the stream")?,
        cached_tokens: r.cached_tokens,
    })
}

/// What a router answered to one streaming completion, whatever its status.
pub(crate) struct Reply {
    /// The status.
    pub status: u16,
    /// The start of the answer (for errors).
    pub head: String,
    /// Time to the first streamed event.
    pub ttft: Option<Duration>,
    /// The engine that answered (its `x-backend` name `engine-J`).
    pub engine: Option<usize>,
    /// Prompt tokens in the stream's usage.
    pub prompt_tokens: Option<u64>,
    /// Of those, served from cache.
    pub cached_tokens: u64,
}

/// Sends one streaming completion (with `x-request-id: request_id` when given) and reads its
/// answer to the end, on a connection of its own (HTTP/1.0).
pub(crate) async fn ask(
    router: SocketAddr,
    body: &str,
    first_block: &str,
    request_id: Option<&str>,
) -> anyhow::Result<Reply> {
    let id = request_id.map_or(String::new(), |id| format!("x-request-id: {id}\r\n"));
    ask_with(
        router,
        body,
        &format!("{PREFIX_HEADER}: {first_block}\r\n{id}"),
    )
    .await
}

/// [`ask`] with the request's own header lines (`headers`, each ending in CRLF).
pub(crate) async fn ask_with(
    router: SocketAddr,
    body: &str,
    headers: &str,
) -> anyhow::Result<Reply> {
    let exchange = async {
        let start = Instant::now();
        let mut s = TcpStream::connect(router).await?;
        s.set_nodelay(true)?;
        let req = format!(
            "POST /v1/completions HTTP/1.0\r\nHost: {router}\r\nContent-Type: application/json\r\n\
             {headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::with_capacity(16 << 10);
        let mut chunk = [0u8; 16 << 10];
        let mut first = None;
        loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if first.is_none() {
                if let Some(at) = find(&buf, b"\r\n\r\n") {
                    if find(&buf[at..], b"data:").is_some() {
                        first = Some(start.elapsed());
                    }
                }
            }
        }
        Ok::<_, std::io::Error>((first, buf))
    };
    let (first, buf) = tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .context("no answer within 60 s")??;
    let text = String::from_utf8_lossy(&buf);
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let engine = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("x-backend").then(|| v.trim())
        })
        .and_then(|v| v.strip_prefix("engine-"))
        .and_then(|v| v.parse().ok());
    let usage = body
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
        .filter_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .next_back();
    Ok(Reply {
        status,
        head: crate_head(&text),
        ttft: first,
        engine,
        prompt_tokens: usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64()),
        cached_tokens: usage
            .as_ref()
            .and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64())
            .unwrap_or(0),
    })
}

fn crate_head(text: &str) -> String {
    text.chars().take(300).collect()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A free port on loopback (bound, then released for a peer's process to take).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::Counter;

    #[test]
    fn the_counter_skips_bodies_and_chunks() {
        let mut c = Counter::default();
        let a = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 25\r\n\r\nGET /fake HTTP/1.1\r\n\r\n...";
        let b = b"POST /v1/completions/render HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n\
                  5\r\nGET /\r\n0\r\n\r\nGET /health HTTP/1.1\r\n\r\n";
        let mut found = Vec::new();
        for piece in a.chunks(7).chain(b.chunks(5)) {
            found.extend(c.feed(piece));
        }
        assert_eq!(
            found,
            ["/v1/completions", "/v1/completions/render", "/health"]
        );
    }
}
