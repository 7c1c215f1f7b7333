//! `keel advise` end to end on the example log: JSON shape, the running row, settings that
//! keel proxy accepts, the report and the scenario file `keel simulate` reruns, refusals.

use std::path::PathBuf;
use std::process::Command;

fn keel(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .output()
        .expect("keel runs")
}

fn example(name: &str) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/advise");
    root.join(name).display().to_string()
}

#[test]
fn advise_on_the_example_log_marks_the_running_row_and_writes_a_rerunnable_model() {
    let out_dir = std::env::temp_dir().join(format!("keel-advise-test-{}", std::process::id()));
    let log = example("access.log");
    let config = example("keel.toml");
    let out = keel(&[
        "advise",
        "--access-log",
        &log,
        "--config",
        &config,
        "--json",
        "--quiet",
        "--requests",
        "1500",
        "--replications",
        "2",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ranking = v["ranking"].as_array().unwrap();
    // 12 strategies x 3 protection sets; the running one (round-robin, one retry) is among them.
    assert_eq!(ranking.len(), 36);
    let running = v["running"].as_u64().expect("running index") as usize;
    assert_eq!(ranking[running]["strategy"], "round-robin");
    assert_eq!(ranking[running]["running"], true);
    assert!(ranking[running]["protections"]
        .as_str()
        .unwrap()
        .starts_with("keel defaults"));
    for r in ranking {
        for key in ["success", "p99_ms", "p999_ms"] {
            let x: Vec<f64> = r[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert!(x[1] <= x[0] && x[0] <= x[2], "{key} {x:?}");
        }
    }
    // Success tiers in order; within a tier, protection never rises down the ranking.
    let key = |r: &serde_json::Value| {
        let p = &r["protection"];
        (
            r["tier"].as_u64().unwrap(),
            std::cmp::Reverse((p[0].as_u64().unwrap(), p[1].as_u64().unwrap())),
        )
    };
    let running_first = ranking[0]["running"] == true;
    for (i, w) in ranking.windows(2).enumerate() {
        assert!(
            key(&w[0]) <= key(&w[1]) || (i == 0 && running_first),
            "{} then {}",
            w[0],
            w[1]
        );
    }
    // The endpoint failing fast (20 % in the model) is found in the fit.
    let b = &v["model"]["endpoints"][1];
    assert_eq!(b["name"], "10.0.0.2:8080");
    let ci = &b["failures"]["error"]["ci95"];
    assert!(
        ci[0].as_f64().unwrap() <= 0.2 && 0.2 <= ci[1].as_f64().unwrap(),
        "{b}"
    );
    // Every configuration's settings are a cluster keel proxy accepts.
    for r in ranking {
        let text = format!(
            "[[listener]]\nlisten = \"127.0.0.1:8080\"\ncluster = \"app\"\n\n{}",
            r["cluster_toml"].as_str().unwrap()
        );
        keel_proxy::ProxyConfig::from_toml_str(&text, "advice")
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
    }
    let html = std::fs::read_to_string(out_dir.join("index.html")).unwrap();
    assert!(html.contains("<svg") && html.contains("10.0.0.3:8080"));
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("advice.json")).unwrap())
            .unwrap();
    assert_eq!(file["ranking"], v["ranking"]);
    // The model reruns as a scenario.
    let scenario = out_dir.join("fitted.toml");
    let rerun = keel(&[
        "simulate",
        "--scenario",
        scenario.to_str().unwrap(),
        "--json",
        "--quiet",
        "--replications",
        "2",
    ]);
    assert!(
        rerun.status.success(),
        "{}",
        String::from_utf8_lossy(&rerun.stderr)
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn advise_refuses_what_it_cannot_fit() {
    let dir = std::env::temp_dir().join(format!("keel-advise-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(example("access.log")).unwrap();
    let mixed = dir.join("mixed.log");
    std::fs::write(
        &mixed,
        format!(
            "{text}{}",
            text.replace("\"cluster\":\"app\"", "\"cluster\":\"billing\"")
        ),
    )
    .unwrap();
    let out = keel(&["advise", "--access-log", mixed.to_str().unwrap(), "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mixes 2 clusters") && err.contains("--cluster"),
        "{err}"
    );
    let few = dir.join("few.log");
    std::fs::write(&few, text.lines().take(40).collect::<Vec<_>>().join("\n")).unwrap();
    let out = keel(&["advise", "--access-log", few.to_str().unwrap(), "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("has 40 requests") && err.contains("at least 100"),
        "{err}"
    );
    let out = keel(&[
        "advise",
        "--access-log",
        few.to_str().unwrap(),
        "--since",
        "soon",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every key path of a TOML table with its value (`retry.attempts = 2`), tables flattened.
fn flatten(prefix: &str, t: &toml::Table, out: &mut Vec<(String, toml::Value)>) {
    for (k, v) in t {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(sub) => flatten(&path, sub, out),
            v => out.push((path, v.clone())),
        }
    }
}

/// The README's quick start: the five backends of "Try the proxy" (10 ms), keel proxy with
/// examples/advise/quickstart.toml, 2,000 requests 8 at a time, then `keel advise` with its
/// defaults on the access log. Loopback ports and the log's path are the test's own (the
/// file's 9001-9005 and 8182 may be in use); everything else is the file as shipped.
#[test]
fn advise_on_the_quick_start_walkthrough_recommends_protection_and_keeps_every_running_key() {
    use std::io::{BufRead, BufReader};
    use std::net::SocketAddr;
    use std::process::Stdio;
    use std::time::Duration;

    use keel_testbed::backend::{self, BackendConfig};
    use keel_testbed::loadgen::{self, LoadSpec, Target};

    let dir = std::env::temp_dir().join(format!("keel-advise-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let shipped = std::fs::read_to_string(example("quickstart.toml")).unwrap();
    let log = dir.join("access.log");
    let mut text = shipped
        .replace("127.0.0.1:8182", "127.0.0.1:0")
        .replace("/tmp/keel-quickstart-access.log", log.to_str().unwrap());
    let mut backends = Vec::new();
    for i in 1..=5 {
        let cfg = BackendConfig {
            latency: keel_model::Latency::fixed(Duration::from_millis(10)),
            name: if i == 5 {
                "b-5".into()
            } else {
                format!("b-{i}")
            },
            ..BackendConfig::default()
        };
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let b = rt.block_on(backend::spawn(addr, cfg)).unwrap();
        text = text.replace(&format!("127.0.0.1:900{i}"), &b.addr().to_string());
        backends.push(b);
    }
    let config = dir.join("quickstart.toml");
    std::fs::write(&config, &text).unwrap();

    let mut proxy = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["proxy", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(proxy.stdout.take().unwrap());
    let mut line = String::new();
    let listen = loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = proxy.kill();
            panic!("keel proxy ended early");
        }
        if let Some(rest) = line.trim().strip_prefix("keel proxy: listening on http://") {
            break rest.split(' ').next().unwrap().to_string();
        }
    };
    let mut spec = LoadSpec::new(Target::Url(format!("http://{listen}/")), 2_000);
    spec.concurrency = 8;
    spec.timeout = Duration::from_secs(3);
    let load = rt.block_on(loadgen::run(spec));
    // The access log is written every 100 ms.
    std::thread::sleep(Duration::from_millis(400));
    let _ = proxy.kill();
    let _ = proxy.wait();
    assert_eq!(load.requests, 2_000, "{load}");

    let out = keel(&[
        "advise",
        "--access-log",
        log.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
        "--quiet",
        "--out",
        dir.join("advice").to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    // Answer first: the recommendation and the tie before the fit and the tables.
    let answer_at = stdout.find("Run ").expect("an answer");
    assert!(answer_at < stdout.find("fitted from").unwrap(), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("advice/advice.json")).unwrap())
            .unwrap();
    let best = &v["ranking"][0];
    // Every endpoint answers in 10 ms: success ties everywhere, and the tie goes to protection
    // (outlier detection, retries and health checks all on), never to "none".
    assert!(v["tied"].as_u64().unwrap() > 1, "{stdout}");
    assert!(v["answer"].as_str().unwrap().contains("tie"), "{stdout}");
    assert_eq!(best["protection"][0], 3, "{best}");
    assert!(best["protection"][1].as_u64().unwrap() >= 2, "{best}");
    let html = std::fs::read_to_string(dir.join("advice/index.html")).unwrap();
    let h1 = html.find("</h1>").unwrap();
    assert!(
        html[h1..].starts_with("</h1><p class=answer><b>Run "),
        "the page opens with the answer"
    );

    // The paste block is the running [[cluster]] with only what the recommendation changes.
    let paste = best["cluster_toml"].as_str().unwrap();
    // Durations as a person writes them: no microseconds or nanoseconds (`333ms 333us 333ns`).
    let b = paste.as_bytes();
    let sub_ms = (1..b.len().saturating_sub(1))
        .any(|i| b[i - 1].is_ascii_digit() && (b[i] == b'u' || b[i] == b'n') && b[i + 1] == b's');
    assert!(!sub_ms, "{paste}");
    let listener = "[[listener]]\nlisten = \"127.0.0.1:8080\"\ncluster = \"app\"\n\n";
    keel_proxy::ProxyConfig::from_toml_str(&format!("{listener}{paste}"), "advice")
        .unwrap_or_else(|e| panic!("{e}\n{paste}"));
    let cluster = |text: &str| -> toml::Table {
        let doc: toml::Table = text.parse().unwrap();
        doc["cluster"].as_array().unwrap()[0]
            .as_table()
            .unwrap()
            .clone()
    };
    let (mut running, mut pasted) = (Vec::new(), Vec::new());
    flatten("", &cluster(&text), &mut running);
    flatten("", &cluster(paste), &mut pasted);
    for (key, value) in &running {
        let now = pasted.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        if key == "strategy" {
            assert!(now.is_some(), "{paste}");
            continue;
        }
        assert_eq!(now, Some(value), "{key} changed or dropped:\n{paste}");
    }
    assert!(stdout.contains(paste.trim()), "{stdout}");
    // Every row's section parses, written as a person would (`key = value`), including those
    // that turn a protection table into `outlier_detection = false` or remove it.
    for r in v["ranking"].as_array().unwrap() {
        let toml = r["cluster_toml"].as_str().unwrap();
        keel_proxy::ProxyConfig::from_toml_str(&format!("{listener}{toml}"), "advice")
            .unwrap_or_else(|e| panic!("{e}\n{toml}"));
        for line in toml
            .lines()
            .filter(|l| l.contains('=') && !l.starts_with(['#', ' ']))
        {
            assert!(line.contains(" = "), "{line:?} in\n{toml}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A small fixed generator (no dependency): the same log every run.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Requests at 100 a second round-robin over three endpoints; the second answers 20 % of its
/// calls 503 within 1 ms (then the request is retried on the next one), the third takes 30 ms
/// instead of 10. Each request becomes one line of `line(start s, [(endpoint, status, ms)])`;
/// lines `bad` are replaced by text the format cannot read.
fn peer_log(
    requests: usize,
    bad: &[(usize, &str)],
    line: impl Fn(f64, &[(usize, u16, f64)]) -> String,
) -> String {
    let mut rng = Lcg(7);
    let mut out = String::new();
    let t0 = 1_764_667_566.0;
    for i in 0..requests {
        let n = i + 1;
        if let Some((_, text)) = bad.iter().find(|(at, _)| *at == n) {
            out.push_str(text);
            out.push('\n');
            continue;
        }
        let start = t0 + i as f64 * 0.01;
        let first = i % 3;
        let mut tries = Vec::new();
        let ms = |e: usize, u: f64| {
            if e == 2 {
                25.0 + 10.0 * u
            } else {
                8.0 + 4.0 * u
            }
        };
        if first == 1 && rng.next() < 0.2 {
            tries.push((1, 503, 0.5));
            tries.push((2, 200, ms(2, rng.next())));
        } else {
            tries.push((first, 200, ms(first, rng.next())));
        }
        out.push_str(&line(start, &tries));
        out.push('\n');
    }
    out
}

/// [`peer_log`] as NGINX writes it in [`NGINX_FORMAT`] (upstream group `app`).
fn nginx_log(requests: usize, bad: &[(usize, &str)]) -> String {
    let addr = |e: usize| format!("10.0.0.{}:80", e + 1);
    peer_log(requests, bad, |start, tries| {
        let total: f64 = tries.iter().map(|t| t.2).sum();
        let end = start + total / 1e3;
        let list = |f: &dyn Fn(&(usize, u16, f64)) -> String| {
            tries.iter().map(f).collect::<Vec<_>>().join(", ")
        };
        format!(
            "127.0.0.1 - - [02/Dec/2026:09:26:06 +0000] \"GET / HTTP/1.1\" {} 12 \"-\" \"test\" {end:.3} {:.3} app \"{}\" \"{}\" \"{}\"",
            tries.last().unwrap().1,
            total / 1e3,
            list(&|t| addr(t.0)),
            list(&|t| t.1.to_string()),
            list(&|t| format!("{:.3}", t.2 / 1e3)),
        )
    })
}

/// [`peer_log`] as HAProxy's `option httplog` writes it: one line per request, the last
/// server by name; a retried request (retries 1, redispatched: "+1") names only its last.
fn haproxy_log(requests: usize, bad: &[(usize, &str)]) -> String {
    peer_log(requests, bad, |start, tries| {
        let secs = start.rem_euclid(60.0);
        let (e, status, ms) = *tries.last().unwrap();
        let retries = if tries.len() > 1 { "+1" } else { "0" };
        format!(
            "Dec  2 09:26:06 localhost haproxy[1]: 10.0.1.2:33317 [02/Dec/2026:09:26:{secs:06.3}] http-in app/srv{} 0/0/0/{ms:.0}/{ms:.0} {status} 120 - - ---- 1/1/1/1/{retries} 0/0 \"GET / HTTP/1.1\"",
            e + 1
        )
    })
}

/// [`peer_log`] in Envoy's default format: the last try's host; a failed first try is not in
/// the line.
fn envoy_log(requests: usize, bad: &[(usize, &str)]) -> String {
    peer_log(requests, bad, |start, tries| {
        let (e, status, ms) = *tries.last().unwrap();
        let time = keel_model::fit::log::format_rfc3339(start);
        format!(
            "[{time}] \"GET / HTTP/1.1\" {status} - 0 12 {ms:.0} {ms:.0} \"-\" \"test\" \"id\" \"app\" \"10.0.0.{}:80\"",
            e + 1
        )
    })
}

/// [`peer_log`] in Istio's default format (a sidecar's outbound log to `reviews`).
fn istio_log(requests: usize) -> String {
    peer_log(requests, &[], |start, tries| {
        let (e, status, ms) = *tries.last().unwrap();
        let time = keel_model::fit::log::format_rfc3339(start);
        format!(
            "[{time}] \"GET /reviews/0 HTTP/1.1\" {status} - via_upstream - \"-\" 0 358 {ms:.0} {ms:.0} \"-\" \"Mozilla/5.0 (X11; Linux x86_64)\" \"8fcedd10-23a4\" \"reviews:9080\" \"10.0.0.{}:9080\" outbound|9080||reviews.default.svc.cluster.local 10.0.9.9:41234 10.96.0.7:9080 10.0.9.9:51000 - default",
            e + 1
        )
    })
}

const NGINX_FORMAT: &str = "$remote_addr - $remote_user [$time_local] \"$request\" $status $body_bytes_sent \"$http_referer\" \"$http_user_agent\" $msec $request_time $proxy_host \"$upstream_addr\" \"$upstream_status\" \"$upstream_response_time\"";

fn advise_peer(dir: &std::path::Path, name: &str, log: &str, extra: &[&str]) -> serde_json::Value {
    let path = dir.join(name);
    std::fs::write(&path, log).unwrap();
    let mut args = vec![
        "advise",
        "--access-log",
        path.to_str().unwrap(),
        "--json",
        "--quiet",
        "--requests",
        "1500",
        "--replications",
        "2",
    ];
    args.extend_from_slice(extra);
    let out = keel(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn notes(v: &serde_json::Value) -> String {
    v["model"]["notes"].to_string()
}

#[test]
fn nginx_logs_fit_every_try_count_unreadable_lines_by_number_and_answer_in_nginx_terms() {
    let dir = std::env::temp_dir().join(format!("keel-advise-nginx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = nginx_log(
        900,
        &[
            (57, "this is not an access-log line"),
            (
                300,
                r#"127.0.0.1 - - [02/Dec/2026:09:26:06 +0000] "GET / HTTP/1.1" 200"#,
            ),
        ],
    );
    let v = advise_peer(
        &dir,
        "nginx.log",
        &log,
        &["--log-format", "nginx", "--nginx-log-format", NGINX_FORMAT],
    );
    assert_eq!(v["balancer"], "nginx");
    let n = notes(&v);
    assert!(
        n.contains("2 of 900 lines") && n.contains("line 57") && n.contains("line 300"),
        "{n}"
    );
    // Every try counts: the failing endpoint's 20 % is found with its interval.
    let b = &v["model"]["endpoints"][1];
    assert_eq!(b["name"], "10.0.0.2:80");
    let ci = &b["failures"]["error"]["ci95"];
    assert!(
        ci[0].as_f64().unwrap() <= 0.2 && 0.2 <= ci[1].as_f64().unwrap(),
        "{b}"
    );
    let names = [
        "round-robin",
        "least_conn",
        "random",
        "random two least_conn",
        "hash consistent",
    ];
    for r in v["ranking"].as_array().unwrap() {
        assert!(names.contains(&r["strategy"].as_str().unwrap()), "{r}");
    }
    let best = &v["ranking"][0];
    let config = best["config"].as_str().unwrap();
    assert!(
        config.contains("upstream app {") && config.contains("server 10.0.0.2:80"),
        "{config}"
    );
    assert!(config.contains("cannot express"), "{config}");
    // The paste block's comments are wrapped like the report: every line within 100 columns.
    for l in config.lines() {
        assert!(
            l.chars().count() <= 100,
            "{} columns: {l}",
            l.chars().count()
        );
    }
    assert_ne!(best["protections"], "none", "{best}");
    assert!(v["limits"].to_string().contains("health checks"));
    // The terminal report: within 100 columns up to the paste block (its comments are
    // configuration); --wide keeps each sentence on one line and the intervals in the table.
    let path = dir.join("nginx.log");
    let report = |wide: bool| {
        let mut args = vec![
            "advise",
            "--access-log",
            path.to_str().unwrap(),
            "--log-format",
            "nginx",
            "--nginx-log-format",
            NGINX_FORMAT,
            "--quiet",
            "--requests",
            "1500",
            "--replications",
            "2",
        ];
        if wide {
            args.push("--wide");
        }
        let out = keel(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let text = report(false);
    let body = text.split("\nto run ").next().unwrap();
    for line in body.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}",
            line.chars().count()
        );
    }
    assert!(
        body.lines()
            .any(|l| l.starts_with("10.0.0.2:80") && l.contains("20.")),
        "{body}"
    );
    let wide = report(true);
    assert!(wide.lines().any(|l| l.chars().count() > 100), "{wide}");
    assert!(wide.contains("errors % [95 %]"), "{wide}");
    // Without the format, or with one that lacks the upstream variables: refused, with why.
    let out = keel(&[
        "advise",
        "--access-log",
        path.to_str().unwrap(),
        "--log-format",
        "nginx",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("log_format keel"));
    let out = keel(&[
        "advise",
        "--access-log",
        path.to_str().unwrap(),
        "--log-format",
        "nginx",
        "--nginx-log-format",
        "$remote_addr [$time_local] \"$request\" $status",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("$upstream_addr"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn haproxy_and_envoy_logs_answer_in_their_own_configuration() {
    let dir = std::env::temp_dir().join(format!("keel-advise-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // HAProxy: one line per request, the last server by name; a retried request (retries 1,
    // redispatched: "+1") names only its last server.
    let haproxy = haproxy_log(
        600,
        &[(
            10,
            "Dec  2 09:26:06 localhost haproxy[1]: truncated 10.0.1.2:33317",
        )],
    );
    let v = advise_peer(&dir, "haproxy.log", &haproxy, &["--log-format", "haproxy"]);
    assert_eq!(v["balancer"], "haproxy");
    assert!(notes(&v).contains("line 10"), "{}", notes(&v));
    let config = v["ranking"][0]["config"].as_str().unwrap();
    assert!(
        config.contains("backend app")
            && config.contains("balance ")
            && config.contains("srv1, srv2, srv3")
            && config.contains("keep your `timeout server`"),
        "{config}"
    );
    // HAProxy's `random` is two draws (least-request's rule); `random(1)` the uniform pick.
    let sim = |name: &str| {
        v["ranking"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["strategy"] == name)
            .map(|r| r["simulated"].as_str().unwrap().to_string())
            .unwrap()
    };
    assert_eq!(sim("random"), "least-request");
    assert_eq!(sim("random(1)"), "random");
    // The real defaults are named as such, with their own prediction, not a protected set's.
    let why = v["why"][0].as_str().unwrap();
    assert!(
        why.contains("HAProxy's defaults") && why.contains("roundrobin with none"),
        "{why}"
    );
    // Envoy: the last try's host; a failed first try is not in the line.
    let envoy = envoy_log(
        600,
        &[(
            33,
            "[2026-12-02T09:26:06.000Z] \"GET / HTTP/1.1\" 200 - 0 12 x",
        )],
    );
    let v = advise_peer(&dir, "envoy.log", &envoy, &["--log-format", "envoy"]);
    assert_eq!(v["balancer"], "envoy");
    assert!(notes(&v).contains("line 33"), "{}", notes(&v));
    let config = v["ranking"][0]["config"].as_str().unwrap();
    assert!(
        config.contains("lb_policy: ") && config.contains("port_value: 80"),
        "{config}"
    );
    // Envoy rounds its ejection cap down: 10 % of 3 hosts ejects none unless the block says
    // always_eject_one_host; retries come with a circuit breaker above Envoy's default 3 where
    // the load needs it, and previous_hosts with its typed_config (Envoy 1.40 needs it).
    for r in v["ranking"].as_array().unwrap() {
        let c = r["config"].as_str().unwrap();
        if c.contains("outlier_detection:") {
            assert!(
                c.contains("always_eject_one_host: true  # 10 % of 3 hosts alone ejects 0"),
                "{c}"
            );
        }
        if c.contains("retry_policy:") {
            assert!(
                c.contains("max_retries: ") && c.contains("PreviousHostsPredicate"),
                "{c}"
            );
        }
    }
    let why = v["why"][0].as_str().unwrap();
    assert!(
        why.contains("Envoy's defaults") && why.contains("ROUND_ROBIN with none"),
        "{why}"
    );
    // Istio's default format: given by name, the cluster is Istio's; without it, refused with
    // a message that says how to give it.
    let path = dir.join("istio.log");
    std::fs::write(&path, istio_log(600)).unwrap();
    let v = advise_peer(
        &dir,
        "istio.log",
        &istio_log(600),
        &["--log-format", "envoy", "--envoy-log-format", "istio"],
    );
    assert_eq!(
        v["model"]["cluster"],
        "outbound|9080||reviews.default.svc.cluster.local"
    );
    let out = keel(&[
        "advise",
        "--access-log",
        path.to_str().unwrap(),
        "--log-format",
        "envoy",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--envoy-log-format istio"), "{err}");
    // A format string without the host: refused, naming the missing field.
    let out = keel(&[
        "advise",
        "--access-log",
        path.to_str().unwrap(),
        "--log-format",
        "envoy",
        "--envoy-log-format",
        "[%START_TIME%] %RESPONSE_CODE% %DURATION%",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lacks %UPSTREAM_HOST%"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer's validator: `$KEEL_<NAME>` (the script sets it), else on PATH, else where
/// scripts/install-peers.sh and scripts/advise-validate.sh put it.
fn validator(name: &str) -> PathBuf {
    if let Ok(p) = std::env::var(format!("KEEL_{}", name.to_uppercase())) {
        return PathBuf::from(p);
    }
    let home = std::env::var("HOME").unwrap_or_default();
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .chain([PathBuf::from(home).join(".cache/keel/peers/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} not found: run scripts/advise-validate.sh (it installs the peers)")
        })
}

fn validate(tool: &str, args: &[&str], config: &std::path::Path, block: &str) {
    let out = Command::new(validator(tool))
        .args(args)
        .arg(config)
        .output()
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} refuses the paste block:\n{block}\n--- {}:\n{}\n{}",
        config.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every paste block of every ranked row (not only the best's), for NGINX, HAProxy and Envoy
/// (its default and Istio's log format), put where an operator pastes it in a minimal
/// configuration of that peer, passes the peer's own validator: `nginx -t`, `haproxy -c`,
/// `envoy --mode validate`. The blocks name servers HAProxy's log has no address for: the
/// server lines (the operator's own, which the block keeps) are added on loopback.
#[test]
#[ignore = "needs nginx, haproxy and envoy: scripts/advise-validate.sh installs them and runs it"]
fn every_peer_paste_block_passes_the_peers_own_validator() {
    let dir = std::env::temp_dir().join(format!("keel-advise-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let blocks = |v: &serde_json::Value| -> Vec<String> {
        let mut out: Vec<String> = v["ranking"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["config"].as_str().unwrap().to_string())
            .collect();
        out.sort();
        out.dedup();
        assert!(out.len() >= 10, "{} distinct blocks", out.len());
        out
    };
    let mut checked = 0;

    let v = advise_peer(
        &dir,
        "nginx.log",
        &nginx_log(900, &[]),
        &["--log-format", "nginx", "--nginx-log-format", NGINX_FORMAT],
    );
    for (i, b) in blocks(&v).iter().enumerate() {
        let (upstream, location) = b
            .split_once("# in each location with proxy_pass http://app;")
            .expect("the block says where its location part goes");
        let d = dir.join(format!("nginx-{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.display();
        let conf = format!(
            "pid {p}/nginx.pid;\nerror_log {p}/error.log;\nevents {{}}\nhttp {{\n    access_log off;\n    client_body_temp_path {p}/b;\n    proxy_temp_path {p}/p;\n    fastcgi_temp_path {p}/f;\n    uwsgi_temp_path {p}/u;\n    scgi_temp_path {p}/s;\n{upstream}\n    server {{\n        listen 127.0.0.1:18080;\n        location / {{\n            proxy_pass http://app;\n{location}\n        }}\n    }}\n}}\n"
        );
        let f = d.join("nginx.conf");
        std::fs::write(&f, conf).unwrap();
        validate("nginx", &["-q", "-t", "-p", &p.to_string(), "-c"], &f, b);
        checked += 1;
    }

    let v = advise_peer(
        &dir,
        "haproxy.log",
        &haproxy_log(600, &[]),
        &["--log-format", "haproxy"],
    );
    for (i, b) in blocks(&v).iter().enumerate() {
        let servers: String = (1..=3)
            .map(|k| format!("    server srv{k} 127.0.0.1:{}\n", 18080 + k))
            .collect();
        let conf = format!(
            "global\n    maxconn 100\ndefaults\n    mode http\n    timeout connect 1s\n    timeout client 5s\n    timeout server 1s\nfrontend in\n    bind 127.0.0.1:18080\n    default_backend app\n{b}{servers}"
        );
        let f = dir.join(format!("haproxy-{i}.cfg"));
        std::fs::write(&f, conf).unwrap();
        validate("haproxy", &["-q", "-c", "-f"], &f, b);
        checked += 1;
    }

    let envoy_logs = [
        ("envoy.log", envoy_log(600, &[]), vec![]),
        (
            "istio.log",
            istio_log(600),
            vec!["--envoy-log-format", "istio"],
        ),
    ];
    for (name, log, extra) in envoy_logs {
        let mut args = vec!["--log-format", "envoy"];
        args.extend(extra);
        let v = advise_peer(&dir, name, &log, &args);
        let cluster = match v["model"]["cluster"].as_str().unwrap() {
            "" => "app",
            c => c,
        }
        .to_string();
        for (i, b) in blocks(&v).iter().enumerate() {
            let (cl, route) = b
                .split_once("# --- in the route that sends to it")
                .expect("the block says where its route part goes");
            let indent = |text: &str, n: usize| -> String {
                text.lines()
                    .map(|l| format!("{}{l}\n", " ".repeat(n)))
                    .collect()
            };
            let route = route.split_once('\n').map_or("", |(_, r)| r);
            let conf = format!(
                "static_resources:\n  listeners:\n  - name: in\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 18080}}}}\n    filter_chains:\n    - filters:\n      - name: envoy.filters.network.http_connection_manager\n        typed_config:\n          \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n          stat_prefix: in\n          http_filters:\n          - name: envoy.filters.http.router\n            typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}\n          route_config:\n            virtual_hosts:\n            - name: all\n              domains: [\"*\"]\n              routes:\n              - match: {{prefix: \"/\"}}\n                route:\n                  cluster: \"{cluster}\"\n{}  clusters:\n  -\n{}",
                indent(route, 18),
                indent(cl, 4)
            );
            let f = dir.join(format!("{name}-{i}.yaml"));
            std::fs::write(&f, conf).unwrap();
            validate("envoy", &["--mode", "validate", "-l", "error", "-c"], &f, b);
            checked += 1;
        }
    }
    println!("advise-validate: {checked} paste blocks pass nginx -t, haproxy -c and envoy --mode validate");
    let _ = std::fs::remove_dir_all(&dir);
}
