//! NGINX's configuration for a peer row, as operators run it: a master process and two
//! workers, one upstream of the row's backends in a shared `zone` (so the workers share the
//! servers' max_fails counters and the rotation's weights).

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use super::plan::{ms, PeerConfig, PeerStrategy, Setting, WORKERS};

/// NGINX's variable for the request-key header (`$http_` and the name with `_` for `-`).
pub(crate) fn header_variable() -> String {
    format!("$http_{}", crate::lab::cases::REQUEST_KEY.replace('-', "_"))
}

/// `nginx.conf` for the row.
pub(crate) fn config(c: &PeerConfig<'_>) -> String {
    let dir = c.dir.display();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# keel lab --peers: {} / {}\n\
         daemon off;\n\
         master_process on;\n\
         worker_processes {WORKERS};\n\
         pid {dir}/nginx.pid;\n\
         error_log {dir}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n    \
         access_log off;\n    \
         client_body_temp_path {dir}/body;\n    \
         proxy_temp_path {dir}/proxy;\n    \
         fastcgi_temp_path {dir}/fastcgi;\n    \
         uwsgi_temp_path {dir}/uwsgi;\n    \
         scgi_temp_path {dir}/scgi;\n    \
         upstream lab {{\n        \
         zone lab 64k;",
        c.strategy.name(),
        c.setting.name()
    );
    match c.strategy {
        PeerStrategy::RoundRobin => {}
        PeerStrategy::Random => s.push_str("        random;\n"),
        PeerStrategy::LeastConnections => s.push_str("        least_conn;\n"),
        // The header the client sets, one value per request: a request's calls hash alike.
        PeerStrategy::Hash => {
            let _ = writeln!(s, "        hash {} consistent;", header_variable());
        }
    }
    // NGINX's own default is max_fails=1 fail_timeout=10s even when nothing is written: bare
    // turns it off.
    let passive = match c.setting {
        Setting::Bare => "max_fails=0",
        Setting::Operators => "max_fails=1 fail_timeout=10s",
    };
    for b in c.backends {
        let _ = writeln!(s, "        server {b} {passive};");
    }
    let _ = write!(
        s,
        "        keepalive 64;\n    \
         }}\n    \
         server {{\n        \
         listen 127.0.0.1:{port};\n        \
         location / {{\n            \
         proxy_pass http://lab;\n            \
         proxy_http_version 1.1;\n            \
         proxy_set_header Connection \"\";\n            \
         proxy_connect_timeout {connect}ms;\n            \
         proxy_send_timeout {timeout}ms;\n            \
         proxy_read_timeout {timeout}ms;\n            \
         proxy_next_upstream {next};\n        \
         }}\n    \
         }}\n\
         }}\n",
        port = c.listen,
        connect = ms(c.connect_timeout),
        timeout = ms(c.timeout),
        next = match c.setting {
            Setting::Bare => "off",
            // NGINX's default, written out.
            Setting::Operators => "error timeout",
        },
    );
    s
}

/// Runs NGINX in the foreground on `conf`.
pub(crate) fn command(bin: &Path, dir: &Path, conf: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(conf)
        .arg("-e")
        .arg(dir.join("error.log"));
    cmd
}

/// `nginx -t`: checks `conf` without serving.
#[cfg(test)]
pub(crate) fn check(bin: &Path, dir: &Path, conf: &Path) -> Command {
    let mut cmd = command(bin, dir, conf);
    cmd.arg("-t").arg("-q");
    cmd
}
