//! A route's `mirror` on loopback: copies of the sampled share reach the mirror and are
//! counted; a mirror that accepts connections and never answers costs the client nothing (its
//! latency with the hung mirror against without, in one run) and keel's memory stays flat
//! (resident set before and after 20,000 mirrored requests). A binary of its own: it reads the
//! process's resident memory.

use std::time::{Duration, Instant};

use crate::support::*;
use hyper::{Method, StatusCode};

/// This process's resident memory, in bytes (`/proc/self/statm`).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf reads a system constant.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// A server that accepts connections and holds them, never reading or answering.
async fn hung_server() -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    addr
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn a_hung_mirror_costs_the_client_nothing_and_memory_stays_flat() {
    crate::alone(async {
        let bs = backends(2, Duration::ZERO).await;
        let (a, ok) = (bs[0].addr(), bs[1].addr());
        let hung = hung_server().await;
        let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\n\
         [[listener.route]]\npath_prefix = \"/plain/\"\ncluster = \"a\"\n\n\
         [[listener.route]]\nname = \"hung\"\npath_prefix = \"/mirrored/\"\ncluster = \"a\"\n\
         mirror = {{ cluster = \"hung\", percent = 100, max_in_flight = 8 }}\n\n\
         [[listener.route]]\nname = \"copied\"\npath_prefix = \"/copied/\"\ncluster = \"a\"\n\
         mirror = {{ cluster = \"ok\", percent = 50 }}\n\n\
         [[cluster]]\nname = \"a\"\nendpoints = [{{ address = \"{a}\" }}]\n\n\
         [[cluster]]\nname = \"ok\"\nendpoints = [{{ address = \"{ok}\" }}]\n\n\
         [[cluster]]\nname = \"hung\"\nrequest_timeout = \"2s\"\nendpoints = [{{ address = \"{hung}\" }}]\n"
    );
        let config = keel_proxy::ProxyConfig::from_toml_str(&text, "mirror.toml")
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        let proxy = keel_proxy::start(config).await.unwrap();
        let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());
        let client = client();
        let get = |path: &'static str| {
            let (client, url) = (client.clone(), format!("http://{addr}{path}"));
            async move {
                let t = Instant::now();
                let r = send(&client, Method::GET, &url, &[], b"").await.unwrap();
                assert_eq!(r.status, StatusCode::OK, "{}", r.text());
                t.elapsed()
            }
        };

        // Copies of half the requests reach the mirror that answers.
        for _ in 0..1000 {
            get("/copied/x").await;
        }
        let copied = "keel_route_mirrored_total{listener=\"";
        let line = |route: &str, cluster: &str, result: &str| {
            format!(
                "{copied}{addr}\",route=\"{route}\",cluster=\"{cluster}\",result=\"{result}\"}}"
            )
        };
        let answered = |route: &'static str, result: &'static str| {
            let l = line(route, "a", result);
            async move { metric(admin, &l).await.unwrap_or(-1.0) }
        };
        let mut sent = 0.0;
        for _ in 0..50 {
            sent = answered("copied", "answered").await;
            if sent >= 490.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            (490.0..=510.0).contains(&sent),
            "{sent} copies of 1,000 answered at 50 %"
        );

        // Latency with the hung mirror against without, interleaved in one run.
        for _ in 0..200 {
            get("/plain/x").await;
            get("/mirrored/x").await;
        }
        let (mut plain, mut mirrored) = (Vec::new(), Vec::new());
        for _ in 0..2000 {
            plain.push(get("/plain/x").await);
            mirrored.push(get("/mirrored/x").await);
        }
        plain.sort();
        mirrored.sort();
        let (p50, p99) = (percentile(&plain, 0.5), percentile(&plain, 0.99));
        let (m50, m99) = (percentile(&mirrored, 0.5), percentile(&mirrored, 0.99));
        println!(
            "without mirror p50 {p50:?} p99 {p99:?}; with the hung mirror p50 {m50:?} p99 {m99:?}"
        );
        // Tolerance for a shared 2-core machine: p50 within 1.5x + 300 us, p99 within 2x + 3 ms.
        assert!(
            m50 <= p50 * 3 / 2 + Duration::from_micros(300),
            "p50 {m50:?} with the hung mirror, {p50:?} without"
        );
        assert!(
            m99 <= p99 * 2 + Duration::from_millis(3),
            "p99 {m99:?} with the hung mirror, {p99:?} without"
        );
        let dropped = answered("hung", "dropped").await;
        assert!(
            dropped > 1000.0,
            "{dropped} copies dropped at max_in_flight"
        );

        // Memory: flat over 20,000 more mirrored requests (after the 4,400 above warmed the pools).
        let before = rss();
        for _ in 0..20_000 {
            get("/mirrored/x").await;
        }
        let after = rss();
        let grown = after.saturating_sub(before);
        println!("resident {before} -> {after} bytes over 20,000 requests with the hung mirror");
        assert!(
            grown <= 4 << 20,
            "resident memory grew {grown} bytes over 20,000 mirrored requests"
        );
        // Every copy to the hung mirror ends: failed at its request_timeout, none left under way.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let failed = answered("hung", "failed").await;
        let dropped = answered("hung", "dropped").await;
        assert_eq!(
            failed + dropped,
            22_200.0,
            "{failed} failed + {dropped} dropped of 22,200 copies"
        );
        assert!(failed >= 8.0, "{failed} copies failed");
        proxy.shutdown(Duration::from_secs(1)).await;
    });
}
