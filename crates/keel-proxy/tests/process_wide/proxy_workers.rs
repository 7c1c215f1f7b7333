//! Worker threads (`start_with_workers`): each has its own runtime and pool stacks; new
//! connections go to the worker with the fewest open; requests on many connections are all
//! served, a reload applies to every worker, and shutdown ends the threads.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::*;
use hyper::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim_end().starts_with(prefix))
                })
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn workers_serve_every_connection_take_reloads_and_stop() {
    crate::alone(async {
        let bs = backends(3, Duration::ZERO).await;
        let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
        let config = simple_config(&addrs, "round-robin", "");
        let proxy = keel_proxy::start_with_workers(config, 3).await.unwrap();
        // Each thread names itself when it starts.
        assert!(
            eventually(Duration::from_secs(2), || threads_named("keel-worker-")
                == 3)
            .await,
            "{} worker threads",
            threads_named("keel-worker-")
        );
        let url = format!("http://{}/", proxy.listener_addrs()[0]);

        // 24 connections held open at once go 8 to each worker (the fewest open first).
        let mut held = Vec::new();
        for _ in 0..24 {
            let mut s = tokio::net::TcpStream::connect(proxy.listener_addrs()[0])
                .await
                .unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut buf = [0u8; 512];
            let n = s.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
            held.push(s);
        }
        assert_eq!(proxy.worker_connections(), vec![8, 8, 8]);
        drop(held);
        assert!(
            eventually(Duration::from_secs(2), || proxy.worker_connections()
                == vec![0, 0, 0])
            .await,
            "closed connections are not counted: {:?}",
            proxy.worker_connections()
        );

        // 24 clients with their own connections, 25 keep-alive requests each.
        let mut tasks = Vec::new();
        for _ in 0..24 {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let c = client();
                let mut by_endpoint: HashMap<String, usize> = HashMap::new();
                for _ in 0..25 {
                    let got = send(&c, Method::GET, &url, &[], b"").await.unwrap();
                    assert_eq!(got.status, 200, "{}", got.text());
                    *by_endpoint
                        .entry(got.header("x-keel-endpoint").unwrap().to_string())
                        .or_default() += 1;
                }
                by_endpoint
            }));
        }
        let mut total: HashMap<String, usize> = HashMap::new();
        for t in tasks {
            for (e, n) in t.await.unwrap() {
                *total.entry(e).or_default() += n;
            }
        }
        // One round-robin balancer shared by the workers: 600 requests, 200 each.
        assert_eq!(total.values().sum::<usize>(), 600);
        for a in &addrs {
            let n = total.get(&a.to_string()).copied().unwrap_or(0);
            assert!((190..=210).contains(&n), "{total:?}");
        }

        // A reload (two endpoints) applies to connections on every worker.
        let config = simple_config(&addrs[..2], "round-robin", "");
        proxy.reload(config).unwrap();
        for _ in 0..30 {
            let got = send(&client(), Method::GET, &url, &[], b"").await.unwrap();
            assert_eq!(got.status, 200);
            assert_ne!(got.header("x-keel-endpoint"), Some(&*addrs[2].to_string()));
        }

        proxy.shutdown(Duration::from_secs(2)).await;
        assert!(
            eventually(Duration::from_secs(2), || threads_named("keel-worker-")
                == 0)
            .await,
            "worker threads still running after shutdown"
        );
        assert!(
            send(&client(), Method::GET, &url, &[], b"").await.is_err(),
            "still accepting after shutdown"
        );
    });
}

#[test]
fn a_second_proxy_on_the_same_port_is_refused() {
    crate::alone(async {
        // Another process (or proxy) must not silently share a port in use.
        let bs = backends(1, Duration::ZERO).await;
        let addrs = [bs[0].addr()];
        let first = keel_proxy::start_with_workers(simple_config(&addrs, "round-robin", ""), 2)
            .await
            .unwrap();
        let port = first.listener_addrs()[0];
        let text = format!(
        "[[listener]]\nlisten = \"{port}\"\ncluster = \"app\"\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        addrs[0]
    );
        let config = keel_proxy::ProxyConfig::from_toml_str(&text, "second.toml").unwrap();
        let err = keel_proxy::start_with_workers(config, 2).await.unwrap_err();
        assert!(format!("{err:#}").contains("cannot listen on"), "{err:#}");
        first.shutdown(Duration::from_secs(1)).await;
    });
}
