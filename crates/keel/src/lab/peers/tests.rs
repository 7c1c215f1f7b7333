//! The generated configurations: what each setting writes, and (when the peer is installed)
//! that the peer itself accepts every one of them.

use std::net::SocketAddr;
use std::time::Duration;

use super::plan::{PeerConfig, Setting};
use super::*;

fn backends() -> Vec<SocketAddr> {
    (0..5)
        .map(|i| SocketAddr::from(([127, 0, 0, 1], 30001 + i)))
        .collect()
}

fn generate(peer: Peer, strategy: PeerStrategy, setting: Setting, dir: &Path) -> String {
    let b = backends();
    peer.config(&PeerConfig {
        listen: 30100,
        admin: 30101,
        backends: &b,
        strategy,
        setting,
        timeout: Duration::from_millis(400),
        connect_timeout: CONNECT_TIMEOUT,
        dir,
    })
}

#[test]
fn nginx_bare_turns_off_retries_and_its_default_max_fails() {
    let dir = Path::new("/tmp/x");
    let bare = generate(Peer::Nginx, PeerStrategy::RoundRobin, Setting::Bare, dir);
    assert!(bare.contains("proxy_next_upstream off;"), "{bare}");
    assert_eq!(bare.matches("max_fails=0;").count(), 5, "{bare}");
    // As operators run it: a master, two workers, the upstream's counters in a shared zone.
    assert!(bare.contains("master_process on;") && bare.contains("worker_processes 2;"));
    assert!(bare.contains("zone lab 64k;"), "{bare}");
    assert!(bare.contains("proxy_read_timeout 400ms;"));
    let ops = generate(
        Peer::Nginx,
        PeerStrategy::LeastConnections,
        Setting::Operators,
        dir,
    );
    assert!(ops.contains("proxy_next_upstream error timeout;"), "{ops}");
    assert_eq!(ops.matches("max_fails=1 fail_timeout=10s;").count(), 5);
    assert!(ops.contains("least_conn;"));
    let hash = generate(Peer::Nginx, PeerStrategy::Hash, Setting::Bare, dir);
    assert!(hash.contains("hash $http_x_lab_key consistent;"), "{hash}");
}

#[test]
fn haproxy_settings_differ_in_retries_and_observe_only() {
    let dir = Path::new("/tmp/x");
    let bare = generate(Peer::Haproxy, PeerStrategy::Random, Setting::Bare, dir);
    assert!(bare.contains("retries 0"), "{bare}");
    assert!(!bare.contains("observe") && !bare.contains("redispatch"));
    assert!(
        bare.contains("balance random\n"),
        "HAProxy's default two draws: {bare}"
    );
    assert!(bare.contains("nbthread 2"));
    assert!(bare.contains("timeout server 400ms"));
    let ops = generate(Peer::Haproxy, PeerStrategy::Hash, Setting::Operators, dir);
    assert!(
        ops.contains("retries 3") && ops.contains("option redispatch"),
        "{ops}"
    );
    assert!(ops.contains("observe layer7 error-limit 10 on-error mark-down"));
    assert!(
        ops.contains("balance hdr(x-lab-key)\n    hash-type consistent"),
        "{ops}"
    );
    assert_eq!(ops.matches("\n    server s").count(), 5);
}

#[test]
fn envoy_operators_adds_retries_and_outlier_detection() {
    let dir = Path::new("/tmp/x");
    let bare = generate(
        Peer::Envoy,
        PeerStrategy::LeastConnections,
        Setting::Bare,
        dir,
    );
    assert!(bare.contains("lb_policy: LEAST_REQUEST"), "{bare}");
    assert!(!bare.contains("retry_policy") && !bare.contains("outlier_detection"));
    assert!(bare.contains("timeout: 0.4s"));
    let ops = generate(Peer::Envoy, PeerStrategy::Hash, Setting::Operators, dir);
    assert!(ops.contains("retry_on: \"5xx,connect-failure\""), "{ops}");
    assert!(ops.contains("per_try_timeout: 0.4s") && ops.contains("timeout: 1.2s"));
    assert!(ops.contains("consecutive_5xx: 5"));
    assert!(ops.contains("lb_policy: RING_HASH") && ops.contains("header_name: x-lab-key"));
    let cmd = Peer::Envoy.command(Path::new("envoy"), dir, Path::new("envoy.yaml"));
    let args: Vec<_> = cmd
        .get_args()
        .map(|a| a.to_string_lossy().to_string())
        .collect();
    assert!(
        args.windows(2).any(|w| w == ["--concurrency", "2"]),
        "{args:?}"
    );
    assert_eq!(ops.matches("- endpoint:").count(), 5);
}

#[test]
fn an_unknown_peer_is_a_usage_error_naming_the_allowed_ones() {
    let e = parse(&["nginx".into(), "traefik".into()]).unwrap_err();
    assert_eq!(e, UnknownPeer("traefik".into()));
    let e = e.to_string();
    assert!(
        e.contains("traefik") && e.contains("nginx, haproxy, envoy"),
        "{e}"
    );
    assert_eq!(
        parse(&["NGINX".into(), "nginx".into(), "envoy".into()]).unwrap(),
        vec![Peer::Nginx, Peer::Envoy]
    );
}

/// Every configuration the lab generates passes the peer's own check (`nginx -t`,
/// `haproxy -c`, `envoy --mode validate`). Skipped, saying so, for a peer that is not
/// installed (CI installs none; scripts/install-peers.sh does).
#[test]
fn every_generated_config_passes_the_peers_own_check() {
    let mut checked = 0;
    for peer in Peer::ALL {
        let Some(bin) = peer.find() else {
            eprintln!(
                "skipping {}'s config check: not installed (scripts/install-peers.sh)",
                peer.name()
            );
            continue;
        };
        for setting in [Setting::Bare, Setting::Operators] {
            for strategy in PeerStrategy::ALL {
                let dir = work_dir(peer).unwrap();
                let b = backends();
                let conf = write_config(
                    peer,
                    &PeerConfig {
                        listen: 30100,
                        admin: 30101,
                        backends: &b,
                        strategy,
                        setting,
                        timeout: Timing::default().timeout,
                        connect_timeout: CONNECT_TIMEOUT,
                        dir: &dir,
                    },
                )
                .unwrap();
                let out = peer.check_command(&bin, &dir, &conf).output().unwrap();
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(
                    out.status.success(),
                    "{} rejects its {} {} config: {text}\n{}",
                    peer.name(),
                    setting.name(),
                    strategy.name(),
                    std::fs::read_to_string(&conf).unwrap()
                );
                let _ = std::fs::remove_dir_all(&dir);
                checked += 1;
            }
        }
    }
    eprintln!("{checked} generated configurations checked by their peers");
}
