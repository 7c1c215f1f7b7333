//! Service discovery against a DNS server on loopback whose records the
//! tests change: A and AAAA records followed within `refresh` + 1 s, SRV records with only the
//! lowest priority in use and the records' weights, the last set kept (and the failures
//! counted) while the server does not answer, a proxy that starts while the first resolution
//! fails (503 until endpoints arrive), a file source following its edits, and endpoints that
//! stay keeping their state. The discovery lines docs/configuration.md shows are used as written (addresses
//! and ports replaced by the test's).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, SRV};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use keel_proxy::config::DiscoveryConfig;
use keel_proxy::{ProxyConfig, ProxyHandle};
use keel_testbed::backend::{self, BackendConfig, BackendHandle};

use crate::support::*;

/// The three discovery lines of docs/configuration.md, verbatim.
const DNS_DISCOVERY: &str = r#"discovery = { dns = "api.internal.test", port = 9000, resolver = "127.0.0.1:5353", refresh = "1s" }"#;
const SRV_DISCOVERY: &str = r#"discovery = { srv = "_http._tcp.api.internal.test", resolver = "127.0.0.1:5353", refresh = "1s" }"#;
const FILE_DISCOVERY: &str = r#"discovery = { file = "api-endpoints.toml" }   # holds `endpoints = [...]` as in the config; re-read when it changes"#;

/// The documented bound: a record change is followed within `refresh` + 1 s.
const FOLLOW_WITHIN: Duration = Duration::from_secs(2);

/// Records by (name, type), as the test DNS server answers them.
type Records = Arc<Mutex<HashMap<(String, RecordType), Vec<RData>>>>;

/// A DNS server on loopback (UDP) answering from records the test sets; it can be made to
/// stop answering.
struct Dns {
    addr: SocketAddr,
    records: Records,
    down: Arc<AtomicBool>,
    queries: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Dns {
    async fn start() -> Dns {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let records: Records = Arc::default();
        let down = Arc::new(AtomicBool::new(false));
        let queries = Arc::new(AtomicU64::new(0));
        let (r, d, q) = (records.clone(), down.clone(), queries.clone());
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                    return;
                };
                q.fetch_add(1, Relaxed);
                if d.load(Relaxed) {
                    continue;
                }
                let Ok(req) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let Some(query) = req.queries().first().cloned() else {
                    continue;
                };
                let name = query.name().to_ascii().to_ascii_lowercase();
                let mut resp = Message::new();
                resp.set_id(req.id())
                    .set_message_type(MessageType::Response)
                    .set_op_code(req.op_code())
                    .set_recursion_desired(req.recursion_desired())
                    .set_recursion_available(true)
                    .set_authoritative(true)
                    .add_query(query.clone());
                let (found, name_exists) = {
                    let map = r.lock().unwrap();
                    let found = map
                        .get(&(name.clone(), query.query_type()))
                        .cloned()
                        .unwrap_or_default();
                    let exists = map.iter().any(|((n, _), v)| *n == name && !v.is_empty());
                    (found, exists)
                };
                if !name_exists {
                    resp.set_response_code(ResponseCode::NXDomain);
                }
                for rdata in found {
                    resp.add_answer(Record::from_rdata(query.name().clone(), 0, rdata));
                }
                if let Ok(bytes) = resp.to_vec() {
                    let _ = socket.send_to(&bytes, from).await;
                }
            }
        });
        Dns {
            addr,
            records,
            down,
            queries,
            task,
        }
    }

    fn set(&self, name: &str, rtype: RecordType, data: Vec<RData>) {
        let key = (format!("{}.", name.trim_end_matches('.')), rtype);
        self.records.lock().unwrap().insert(key, data);
    }

    fn a(&self, name: &str, ips: &[Ipv4Addr]) {
        self.set(
            name,
            RecordType::A,
            ips.iter().map(|ip| RData::A(A(*ip))).collect(),
        );
    }

    fn aaaa(&self, name: &str, ips: &[Ipv6Addr]) {
        self.set(
            name,
            RecordType::AAAA,
            ips.iter().map(|ip| RData::AAAA(AAAA(*ip))).collect(),
        );
    }

    /// SRV records (priority, weight, port, target).
    fn srv(&self, name: &str, records: &[(u16, u16, u16, &str)]) {
        let data = records
            .iter()
            .map(|(p, w, port, target)| {
                RData::SRV(SRV::new(
                    *p,
                    *w,
                    *port,
                    Name::from_ascii(format!("{target}.")).unwrap(),
                ))
            })
            .collect();
        self.set(name, RecordType::SRV, data);
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Backends on `ips`, all on one port (A and AAAA records carry addresses, not ports).
async fn backends_on(ips: &[IpAddr]) -> (u16, Vec<BackendHandle>) {
    'again: loop {
        let first = backend::spawn(SocketAddr::new(ips[0], 0), BackendConfig::default())
            .await
            .unwrap();
        let port = first.addr().port();
        let mut all = vec![first];
        for ip in &ips[1..] {
            match backend::spawn(SocketAddr::new(*ip, port), BackendConfig::default()).await {
                Ok(b) => all.push(b),
                // That port is taken on another address: another one.
                Err(_) => continue 'again,
            }
        }
        return (port, all);
    }
}

/// The proxy's endpoints of `cluster` as (address, weight), sorted.
fn endpoints(proxy: &ProxyHandle, cluster: &str) -> Vec<(String, u32)> {
    let mut v: Vec<_> = proxy
        .cluster_status(cluster)
        .unwrap()
        .into_iter()
        .map(|s| (s.address, s.weight))
        .collect();
    v.sort();
    v
}

/// Waits until `cluster` has exactly `want` (address, weight); returns how long it took.
async fn follows(proxy: &ProxyHandle, cluster: &str, want: &[(String, u32)]) -> Duration {
    let start = Instant::now();
    let mut want = want.to_vec();
    want.sort();
    let ok = eventually(Duration::from_secs(6), || endpoints(proxy, cluster) == want).await;
    assert!(
        ok,
        "{cluster}: {:?}, want {want:?}",
        endpoints(proxy, cluster)
    );
    start.elapsed()
}

fn config(discovery_line: &str, dns: SocketAddr, port: u16) -> ProxyConfig {
    let line = discovery_line
        .replace("127.0.0.1:5353", &dns.to_string())
        .replace("port = 9000", &format!("port = {port}"));
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"api\"\n\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"api\"\nstrategy = \"weighted-round-robin\"\n{line}\n"
    );
    ProxyConfig::from_toml_str(&text, "discovery.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

fn at(ip: IpAddr, port: u16) -> (String, u32) {
    (SocketAddr::new(ip, port).to_string(), 1)
}

async fn metrics(proxy: &ProxyHandle) -> String {
    get(&format!("http://{}/metrics", proxy.admin_addr().unwrap()))
        .await
        .unwrap()
        .text()
}

async fn status(proxy: &ProxyHandle) -> serde_json::Value {
    let text = get(&format!("http://{}/status", proxy.admin_addr().unwrap()))
        .await
        .unwrap()
        .text();
    serde_json::from_str(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_a_and_aaaa_records_are_followed_and_the_last_set_kept_while_the_server_is_down() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let (port, _bs) = backends_on(&[ip("127.0.0.2"), ip("127.0.0.3"), ip("::1")]).await;
    let dns = Dns::start().await;
    dns.a("api.internal.test", &["127.0.0.2".parse().unwrap()]);
    let proxy = keel_proxy::start(config(DNS_DISCOVERY, dns.addr, port))
        .await
        .unwrap();
    follows(&proxy, "api", &[at(ip("127.0.0.2"), port)]).await;
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..20 {
        let r = send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, 200);
    }

    // A second A record, then an AAAA record: each followed within refresh + 1 s.
    dns.a(
        "api.internal.test",
        &["127.0.0.2".parse().unwrap(), "127.0.0.3".parse().unwrap()],
    );
    let took = follows(
        &proxy,
        "api",
        &[at(ip("127.0.0.2"), port), at(ip("127.0.0.3"), port)],
    )
    .await;
    assert!(took <= FOLLOW_WITHIN, "A change followed in {took:?}");
    dns.aaaa("api.internal.test", &["::1".parse().unwrap()]);
    let three = [
        at(ip("127.0.0.2"), port),
        at(ip("127.0.0.3"), port),
        at(ip("::1"), port),
    ];
    let took = follows(&proxy, "api", &three).await;
    assert!(took <= FOLLOW_WITHIN, "AAAA change followed in {took:?}");
    // Requests reach all three, the IPv6 one included.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..30 {
        let r = send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, 200);
        seen.insert(r.header("x-keel-endpoint").unwrap().to_string());
    }
    assert_eq!(seen.len(), 3, "{seen:?}");

    // 127.0.0.2 goes: the others keep their state (their successes so far).
    let successes = |proxy: &ProxyHandle, addr: &str| {
        proxy
            .cluster_status("api")
            .unwrap()
            .into_iter()
            .find(|s| s.address == addr)
            .map(|s| s.successes)
    };
    let kept = at(ip("127.0.0.3"), port).0;
    let before = successes(&proxy, &kept).unwrap();
    assert!(before > 0);
    dns.a("api.internal.test", &["127.0.0.3".parse().unwrap()]);
    let took = follows(
        &proxy,
        "api",
        &[at(ip("127.0.0.3"), port), at(ip("::1"), port)],
    )
    .await;
    assert!(took <= FOLLOW_WITHIN, "removal followed in {took:?}");
    assert!(successes(&proxy, &kept).unwrap() >= before, "state kept");

    // The server stops answering: the last set stays, the failures are counted, requests go on.
    let now = endpoints(&proxy, "api");
    let errors = |m: &str| -> u64 {
        let key = "keel_discovery_errors_total{cluster=\"api\"} ";
        let at = m.find(key).unwrap_or_else(|| panic!("no {key} in\n{m}")) + key.len();
        m[at..].lines().next().unwrap().parse().unwrap()
    };
    let errors_before = errors(&metrics(&proxy).await);
    dns.down.store(true, Relaxed);
    let asked = dns.queries.load(Relaxed);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(dns.queries.load(Relaxed) > asked, "still asking");
    assert_eq!(
        endpoints(&proxy, "api"),
        now,
        "last set kept while the server is down"
    );
    assert!(errors(&metrics(&proxy).await) > errors_before);
    let st = status(&proxy).await;
    let d = &st["clusters"][0]["discovery"];
    assert_eq!(d["kind"], "dns");
    assert!(d["last_error"].is_string(), "{d}");
    assert!(
        d["source"].as_str().unwrap().contains("api.internal.test"),
        "{d}"
    );
    for _ in 0..10 {
        let r = send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, 200);
    }
    // NXDOMAIN keeps it too.
    dns.down.store(false, Relaxed);
    dns.a("api.internal.test", &[]);
    dns.aaaa("api.internal.test", &[]);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(endpoints(&proxy, "api"), now, "last set kept on NXDOMAIN");
    // Back: followed again.
    dns.a("api.internal.test", &["127.0.0.2".parse().unwrap()]);
    let took = follows(&proxy, "api", &[at(ip("127.0.0.2"), port)]).await;
    assert!(took <= FOLLOW_WITHIN, "followed again in {took:?}");
    let st = status(&proxy).await;
    let d = &st["clusters"][0]["discovery"];
    assert!(d["last_error"].is_null(), "{d}");
    assert!(d["last_refresh_ago_s"].as_f64().unwrap() < 2.0, "{d}");
    assert!(d["last_refresh"].as_str().unwrap().ends_with('Z'), "{d}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srv_records_lowest_priority_only_with_their_weights() {
    let bs = backends(3, Duration::ZERO).await;
    let port = |i: usize| bs[i].addr().port();
    let dns = Dns::start().await;
    let name = "_http._tcp.api.internal.test";
    // Two targets at priority 10 (weights 3 and 1), one at 20.
    dns.a("a.internal.test", &[Ipv4Addr::LOCALHOST]);
    dns.a("b.internal.test", &[Ipv4Addr::LOCALHOST]);
    dns.a("c.internal.test", &[Ipv4Addr::LOCALHOST]);
    dns.srv(
        name,
        &[
            (10, 3, port(0), "a.internal.test"),
            (10, 1, port(1), "b.internal.test"),
            (20, 5, port(2), "c.internal.test"),
        ],
    );
    let proxy = keel_proxy::start(config(SRV_DISCOVERY, dns.addr, 0))
        .await
        .unwrap();
    let ep = |i: usize, w: u32| (bs[i].addr().to_string(), w);
    follows(&proxy, "api", &[ep(0, 3), ep(1, 1)]).await;
    // The weights shape the traffic: 3 to 1 under weighted round-robin.
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..40 {
        assert_eq!(
            send(&c, hyper::Method::GET, &url, &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    assert_eq!(bs[2].requests(), 0, "priority 20 is not in use");
    let (a, b) = (bs[0].requests(), bs[1].requests());
    assert!(a >= 2 * b, "weights 3:1 -> {a}:{b}");
    // The records change: a target's weight, then the priority 10 records go.
    dns.srv(
        name,
        &[
            (10, 1, port(0), "a.internal.test"),
            (10, 0, port(1), "b.internal.test"),
            (20, 5, port(2), "c.internal.test"),
        ],
    );
    let took = follows(&proxy, "api", &[ep(0, 1), ep(1, 1)]).await;
    assert!(took <= FOLLOW_WITHIN, "weights followed in {took:?}");
    dns.srv(name, &[(20, 5, port(2), "c.internal.test")]);
    let took = follows(&proxy, "api", &[ep(2, 5)]).await;
    assert!(took <= FOLLOW_WITHIN, "priority followed in {took:?}");
    assert_eq!(
        send(&c, hyper::Method::GET, &url, &[], b"")
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(bs[2].requests(), 1);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_starts_when_the_first_resolution_fails_and_answers_503_until_endpoints_arrive() {
    let bs = backends(1, Duration::ZERO).await;
    let dns = Dns::start().await;
    dns.down.store(true, Relaxed);
    dns.a("api.internal.test", &[Ipv4Addr::LOCALHOST]);
    let proxy = keel_proxy::start(config(DNS_DISCOVERY, dns.addr, bs[0].addr().port()))
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let r = send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("no endpoint"), "{}", r.text());
    dns.down.store(false, Relaxed);
    follows(&proxy, "api", &[(bs[0].addr().to_string(), 1)]).await;
    let r = send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
    assert_eq!(r.status, 200);
    proxy.shutdown(Duration::from_secs(1)).await;
}

fn endpoints_file(addrs: &[&BackendHandle]) -> String {
    let list: Vec<String> = addrs
        .iter()
        .map(|b| format!("{{ address = \"{}\" }}", b.addr()))
        .collect();
    format!("endpoints = [{}]\n", list.join(", "))
}

fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_source_follows_its_edits() {
    let bs = backends(2, Duration::ZERO).await;
    let dir: PathBuf = std::env::temp_dir().join(format!("keel-disc-file-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("api-endpoints.toml");
    std::fs::write(&file, endpoints_file(&[&bs[0]])).unwrap();
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"api\"\n\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"api\"\n{FILE_DISCOVERY}\n"
    );
    std::fs::write(dir.join("keel.toml"), &text).unwrap();
    let config = ProxyConfig::from_file(&dir.join("keel.toml")).unwrap();
    let proxy = keel_proxy::start(config).await.unwrap();
    // Read at start: served at once.
    let one = [(bs[0].addr().to_string(), 1)];
    assert_eq!(endpoints(&proxy, "api"), one);
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    assert_eq!(get(&url).await.unwrap().status, 200);

    std::fs::write(&file, endpoints_file(&[&bs[0], &bs[1]])).unwrap();
    let mut both = vec![(bs[0].addr().to_string(), 1), (bs[1].addr().to_string(), 1)];
    both.sort();
    let took = follows(&proxy, "api", &both).await;
    assert!(took <= FOLLOW_WITHIN, "edit followed in {took:?}");
    // A broken edit keeps the last set, counted.
    write_atomically(&file, "endpoints = [ { address = \"nowhere\" } ]\n");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(endpoints(&proxy, "api"), both);
    let st = status(&proxy).await;
    let d = &st["clusters"][0]["discovery"];
    assert_eq!(d["kind"], "file");
    assert!(d["last_error"].as_str().unwrap().contains("nowhere"), "{d}");
    assert!(d["errors"].as_u64().unwrap() >= 1, "{d}");
    write_atomically(&file, &endpoints_file(&[&bs[1]]));
    let took = follows(&proxy, "api", &[(bs[1].addr().to_string(), 1)]).await;
    assert!(took <= FOLLOW_WITHIN, "fixed edit followed in {took:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn discovery_settings_are_checked_without_resolving() {
    let dir = std::env::temp_dir().join(format!("keel-disc-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let load = |line: &str| {
        let text = format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"api\"\n\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"api\"\n{line}\n"
        );
        std::fs::write(dir.join("k.toml"), text).unwrap();
        ProxyConfig::from_file(&dir.join("k.toml"))
    };
    // No server answers at this address: validation does not ask it.
    let started = Instant::now();
    let c = load(DNS_DISCOVERY).unwrap();
    let d = c.clusters[0].discovery.as_ref().unwrap();
    assert_eq!(d.refresh(), Duration::from_secs(1));
    assert!(
        matches!(d, DiscoveryConfig::Dns { port: 9000, .. }),
        "{d:?}"
    );
    load(SRV_DISCOVERY).unwrap();
    let c = load("discovery = { dns = \"api.internal.test\", port = 80 }").unwrap();
    assert_eq!(
        c.clusters[0].discovery.as_ref().unwrap().refresh(),
        Duration::from_secs(5)
    );
    assert!(started.elapsed() < Duration::from_secs(1));
    std::fs::write(
        dir.join("api-endpoints.toml"),
        "endpoints = [{ address = \"127.0.0.1:9001\", weight = 2 }]\n",
    )
    .unwrap();
    let c = load(FILE_DISCOVERY).unwrap();
    let Some(DiscoveryConfig::File { path: file }) = c.clusters[0].discovery.clone() else {
        panic!("a file source: {:?}", c.clusters[0].discovery);
    };
    assert_eq!(
        file,
        dir.join("api-endpoints.toml"),
        "relative to the configuration file"
    );
    for (line, key, words) in [
        ("discovery = { dns = \"api internal\", port = 80 }", "cluster[0].discovery.dns", "not a DNS name"),
        ("discovery = { dns = \"api.test\" }", "cluster[0].discovery.port", "port"),
        ("discovery = { srv = \"api.test\" }", "cluster[0].discovery.srv", "RFC 2782"),
        ("discovery = { srv = \"_a._tcp.api.test\", port = 80 }", "cluster[0].discovery.port", "SRV records carry the port"),
        ("discovery = { dns = \"a.test\", port = 80, refresh = \"500ms\" }", "cluster[0].discovery.refresh", "at least 1s"),
        ("discovery = { dns = \"a.test\", srv = \"_a._tcp.b.test\", port = 80 }", "cluster[0].discovery", "one of"),
        ("discovery = { file = \"missing.toml\" }", "cluster[0].discovery.file", "cannot read"),
        ("discovery = { file = \"api-endpoints.toml\", refresh = \"2s\" }", "cluster[0].discovery.refresh", "every second"),
        ("discovery = { dns = \"a.test\", port = 80, ttl = 3 }", "cluster[0].discovery.ttl", "unknown field"),
        ("endpoints = [{ address = \"127.0.0.1:1\" }]\ndiscovery = { dns = \"a.test\", port = 80 }", "cluster[0].discovery", "not both"),
    ] {
        let e = load(line).unwrap_err();
        assert_eq!(e.key.as_deref(), Some(key), "{line}: {e}");
        assert!(e.message.contains(words), "{line}: {e}");
    }
    std::fs::write(
        dir.join("api-endpoints.toml"),
        "endpoints = [{ address = \"a:1\" }, { address = \"a:1\" }]\n",
    )
    .unwrap();
    let e = load(FILE_DISCOVERY).unwrap_err();
    assert!(e.message.contains("twice"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
