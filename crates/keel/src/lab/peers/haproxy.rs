//! HAProxy's configuration for a peer row, as operators run it: two threads (`nbthread 2`,
//! which share the servers' counters), one backend of the row's servers.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use super::plan::{ms, PeerConfig, PeerStrategy, Setting, WORKERS};

/// `haproxy.cfg` for the row.
pub(crate) fn config(c: &PeerConfig<'_>) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "# keel lab --peers: {} / {}\n\
         global\n    \
         nbthread {WORKERS}\n    \
         maxconn 4096\n\
         defaults\n    \
         mode http\n    \
         timeout connect {connect}ms\n    \
         timeout client 30s\n    \
         timeout server {timeout}ms\n    \
         timeout http-keep-alive 30s\n",
        c.strategy.name(),
        c.setting.name(),
        connect = ms(c.connect_timeout),
        timeout = ms(c.timeout),
    );
    match c.setting {
        Setting::Bare => s.push_str("    retries 0\n"),
        // retry-on keeps its default (conn-failure): a 5xx or a timed-out answer is not retried.
        Setting::Operators => s.push_str("    retries 3\n    option redispatch\n"),
    }
    let _ = write!(
        s,
        "frontend fe\n    \
         bind 127.0.0.1:{}\n    \
         default_backend lab\n\
         backend lab\n",
        c.listen
    );
    let balance = match c.strategy {
        PeerStrategy::RoundRobin => "roundrobin".to_string(),
        // HAProxy's default: two draws, the less loaded of the two (P2C), as operators write it.
        PeerStrategy::Random => "random".into(),
        PeerStrategy::LeastConnections => "leastconn".into(),
        // The header the client sets, one value per request: a request's calls hash alike.
        PeerStrategy::Hash => format!(
            "hdr({})\n    hash-type consistent",
            crate::lab::cases::REQUEST_KEY
        ),
    };
    let _ = writeln!(s, "    balance {balance}");
    if c.setting == Setting::Operators {
        // observe needs checks: a TCP connect every second brings a marked-down server back
        // after two in a row.
        s.push_str(
            "    default-server check inter 1s fall 3 rise 2 observe layer7 error-limit 10 \
             on-error mark-down\n",
        );
    }
    for (i, b) in c.backends.iter().enumerate() {
        let _ = writeln!(s, "    server s{i} {b}");
    }
    s
}

/// Runs HAProxy in the foreground on `conf`.
pub(crate) fn command(bin: &Path, _dir: &Path, conf: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("-db").arg("-f").arg(conf);
    cmd
}

/// `haproxy -c`: checks `conf` without serving.
#[cfg(test)]
pub(crate) fn check(bin: &Path, _dir: &Path, conf: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("-c").arg("-q").arg("-f").arg(conf);
    cmd
}
