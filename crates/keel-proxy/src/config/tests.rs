//! The configuration's unit tests: loading, located errors, defaults, documentation.

use std::time::Duration;

use keel_balance::{BalancerConfig, EndpointSpec, OutlierConfig, StrategyKind};

use super::*;

/// examples/proxy.toml, verbatim.
pub(crate) const EXAMPLE_CONFIG: &str = include_str!("../../../../examples/proxy.toml");

#[test]
fn the_example_file_loads_with_its_values() {
    let c = ProxyConfig::from_toml_str(EXAMPLE_CONFIG, "proxy.toml").unwrap();
    assert_eq!(c.admin.as_ref().unwrap().listen.port(), 9901);
    assert_eq!(c.listeners.len(), 1);
    let app = c.cluster("app").unwrap();
    assert_eq!(app.balance.strategy, StrategyKind::LeastConnections);
    assert_eq!(app.endpoints.len(), 5);
    assert_eq!(app.endpoints[0].weight, 2);
    assert_eq!(app.endpoints[1].weight, 1);
    assert_eq!(app.timeouts.connect, Duration::from_millis(200));
    assert_eq!(app.timeouts.request, Duration::from_secs(1));
    assert_eq!(app.protections.retry.attempts, 2);
    assert_eq!(app.protections.retry.budget_percent, 20.0);
    assert_eq!(app.per_try_timeout(), Duration::from_secs(1) / 3);
    let hc = app.protections.health_check.as_ref().unwrap();
    assert_eq!(hc.interval, Duration::from_millis(500));
    assert_eq!(hc.unhealthy_threshold, 2);
    let od = app.protections.outlier_detection.as_ref().unwrap();
    assert_eq!(od.consecutive_failures, 3);
    assert_eq!(od.max_ejection_percent, 50.0);
    assert_eq!(od.max_ejected(5), 2);
}

fn err(text: &str) -> ConfigError {
    ProxyConfig::from_toml_str(text, "bad.toml").unwrap_err()
}

const HEAD: &str = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";

#[test]
fn unknown_key_names_file_line_key_and_allowed_keys() {
    let e = err(&format!(
        "{HEAD}[cluster.retry]\nattempts = 2\nbudget = 20\n"
    ));
    assert_eq!(e.line, Some(10), "{e}");
    assert_eq!(e.key.as_deref(), Some("cluster[0].retry.budget"), "{e}");
    let s = e.to_string();
    assert!(s.starts_with("bad.toml:10:1:"), "{s}");
    assert!(s.contains("budget_percent"), "lists allowed keys: {s}");
}

#[test]
fn unknown_strategy_lists_the_strategies() {
    let e = err(&HEAD.replace(
        "name = \"app\"\n",
        "name = \"app\"\nstrategy = \"fastest\"\n",
    ));
    assert_eq!(e.line, Some(7), "{e}");
    assert_eq!(e.key.as_deref(), Some("cluster[0].strategy"), "{e}");
    assert!(
        e.message.contains("maglev") && e.message.contains("fastest"),
        "{e}"
    );
}

#[test]
fn wrong_type_and_bad_duration_are_located() {
    let e = err(&format!("{HEAD}connect_timeout = \"fast\"\n"));
    assert_eq!(e.line, Some(8), "{e}");
    assert_eq!(e.key.as_deref(), Some("cluster[0].connect_timeout"), "{e}");
    let e = err(&format!("{HEAD}[cluster.retry]\nattempts = \"two\"\n"));
    assert_eq!(e.line, Some(9), "{e}");
    assert_eq!(e.key.as_deref(), Some("cluster[0].retry.attempts"), "{e}");
}

#[test]
fn a_listener_on_the_admin_address_is_refused_at_check() {
    let text = "[admin]\nlisten = \"127.0.0.1:9901\"\n\n[[listener]]\nlisten = \"0.0.0.0:9901\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";
    let e = err(text);
    assert_eq!(e.key.as_deref(), Some("listener[0].listen"), "{e}");
    assert_eq!(e.line, Some(5), "{e}");
    assert!(e.message.contains("admin"), "{e}");
    // Another port is fine.
    ProxyConfig::from_toml_str(&text.replace("0.0.0.0:9901", "0.0.0.0:9902"), "ok.toml").unwrap();
}

#[test]
fn trusted_proxies_are_cidr_blocks() {
    let c = ProxyConfig::from_toml_str(
        &HEAD.replace(
            "cluster = \"app\"\n",
            "cluster = \"app\"\ntrusted_proxies = [\"10.0.0.0/8\", \"::1/128\"]\nerror_detail = \"full\"\n",
        ),
        "ok.toml",
    )
    .unwrap();
    let l = &c.listeners[0];
    assert!(l.trusts("10.1.2.3".parse().unwrap()));
    assert!(l.trusts("::1".parse().unwrap()));
    assert!(!l.trusts("192.168.0.1".parse().unwrap()));
    assert_eq!(l.error_detail, ErrorDetail::Full);
    let e = err(&HEAD.replace(
        "cluster = \"app\"\n",
        "cluster = \"app\"\ntrusted_proxies = [\"10.0.0.0/33\"]\n",
    ));
    assert_eq!(
        e.key.as_deref(),
        Some("listener[0].trusted_proxies[0]"),
        "{e}"
    );
}

#[test]
fn semantic_errors_are_located() {
    let e = err(&HEAD.replace("cluster = \"app\"", "cluster = \"web\""));
    assert_eq!(e.line, Some(3), "{e}");
    assert!(
        e.message.contains("web") && e.message.contains("app"),
        "{e}"
    );
    let e = err(&format!("{HEAD}[cluster.retry]\nattempts = 50\n"));
    assert_eq!(e.line, Some(9), "{e}");
    assert!(e.message.contains("0..=10"), "{e}");
    let e = err(&format!(
        "{HEAD}[cluster.outlier_detection]\nmax_ejection_percent = 150\n"
    ));
    assert_eq!(e.line, Some(9), "{e}");
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].outlier_detection.max_ejection_percent")
    );
    let e = err(&format!("{HEAD}hash_on = \"header:x-user\"\n"));
    assert!(e.message.contains("hash strategies"), "{e}");
    let e = err(&HEAD.replace("9001\" }", "9001\" }, { address = \"127.0.0.1:9001\" }"));
    assert_eq!(e.line, Some(7), "{e}");
    assert!(e.message.contains("twice"), "{e}");
    let e = err(&HEAD.replace("127.0.0.1:9001", "localhost"));
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].endpoints[0].address"),
        "{e}"
    );
    let e = err("[[cluster]]\nname = \"a\"\nendpoints = []\n");
    assert!(e.message.contains("listener"), "{e}");
    let e = err("[admin\n");
    assert_eq!(e.line, Some(1), "{e}");
}

/// Every error keel-balance can find in a cluster's options, at the exact key and its line.
#[test]
fn every_balancer_option_error_is_at_its_key_and_line() {
    // (extra lines after HEAD, the key the error must name, the 1-based line of that key)
    let cases: &[(&str, &str, usize)] = &[
        ("choices = 1\n", "cluster[0].choices", 8),
        ("decay = \"0s\"\n", "cluster[0].decay", 8),
        ("strategy = \"ring-hash\"\nvnodes = 0\n", "cluster[0].vnodes", 9),
        ("strategy = \"maglev\"\ntable_size = 65536\n", "cluster[0].table_size", 9),
        ("bounded_load = 1.25\n", "cluster[0].bounded_load", 8),
        ("strategy = \"maglev\"\nbounded_load = 0.5\n", "cluster[0].bounded_load", 9),
        ("panic_threshold = 101\n", "cluster[0].panic_threshold", 8),
        (
            "[cluster.outlier_detection]\nmax_ejection_percent = 101\n",
            "cluster[0].outlier_detection.max_ejection_percent",
            9,
        ),
        (
            "[cluster.outlier_detection]\ninterval = \"0s\"\n",
            "cluster[0].outlier_detection.interval",
            9,
        ),
        (
            "[cluster.outlier_detection]\nbase_ejection_time = \"0s\"\n",
            "cluster[0].outlier_detection.base_ejection_time",
            9,
        ),
        (
            "[cluster.outlier_detection]\nbase_ejection_time = \"10s\"\nmax_ejection_time = \"9s\"\n",
            "cluster[0].outlier_detection.max_ejection_time",
            10,
        ),
        (
            "[cluster.outlier_detection]\nconsecutive_failures = 3\n\n[cluster.outlier_detection.failure_rate]\nminimum_requests = 10\nthreshold_percent = 100.5\n",
            "cluster[0].outlier_detection.failure_rate.threshold_percent",
            13,
        ),
        (
            "[cluster.slow_start]\nwindow = \"0s\"\n",
            "cluster[0].slow_start.window",
            9,
        ),
        (
            "[cluster.slow_start]\naggression = 0\n",
            "cluster[0].slow_start.aggression",
            9,
        ),
        (
            "[cluster.slow_start]\nmin_weight_percent = 100.5\n",
            "cluster[0].slow_start.min_weight_percent",
            9,
        ),
        (
            "[cluster.retry]\nbudget_percent = -1\n",
            "cluster[0].retry.budget_percent",
            9,
        ),
        (
            "[cluster.retry]\nmin_retries_per_second = -1\n",
            "cluster[0].retry.min_retries_per_second",
            9,
        ),
        (
            "[cluster.retry]\nbudget_window = \"5ms\"\n",
            "cluster[0].retry.budget_window",
            9,
        ),
        (
            "[cluster.hedge]\ndelay = \"p95\"\nmax = 2\n",
            "cluster[0].hedge.max",
            10,
        ),
        (
            "[cluster.hedge]\ndelay = \"p95\"\nbudget_percent = 100.5\n",
            "cluster[0].hedge.budget_percent",
            10,
        ),
        (
            "[cluster.hedge]\ndelay = \"0s\"\n",
            "cluster[0].hedge.delay",
            9,
        ),
        (
            "[cluster.hedge]\ndelay = \"p100\"\n",
            "cluster[0].hedge.delay",
            9,
        ),
    ];
    for (extra, key, line) in cases {
        let e = err(&format!("{HEAD}{extra}"));
        assert_eq!(e.key.as_deref(), Some(*key), "{extra}: {e}");
        assert_eq!(e.line, Some(*line), "{extra}: {e}");
    }
    // The endpoint rules: the endpoint's own key, on its own line.
    let eps = "endpoints = [\n  { address = \"127.0.0.1:9001\" },\n  { address = \"127.0.0.1:9002\", weight = 0 },\n  { address = \"127.0.0.1:9001\" },\n]\n";
    let one = "endpoints = [{ address = \"127.0.0.1:9001\" }]\n";
    let e = err(&HEAD.replace(one, &eps.replace(", weight = 0", "")));
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].endpoints[2].address"),
        "{e}"
    );
    assert_eq!(e.line, Some(10), "{e}");
    assert!(e.message.contains("twice"), "{e}");
    let e = err(&HEAD.replace(one, eps));
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].endpoints[1].weight"),
        "{e}"
    );
    assert_eq!(e.line, Some(9), "{e}");
    let e = err(&HEAD.replace(
        one,
        &format!(
            "strategy = \"maglev\"\ntable_size = 2\n{}",
            eps.replace(", weight = 0", "")
                .replace("9001\" },\n]", "9003\" },\n]")
        ),
    ));
    assert_eq!(e.key.as_deref(), Some("cluster[0].table_size"), "{e}");
    assert_eq!(e.line, Some(8), "{e}");
}

/// A configuration built in code gets the defaults a TOML file gets.
#[test]
fn built_in_code_equals_parsed() {
    let parsed =
        ProxyConfig::from_toml_str(&format!("{HEAD}[cluster.health_check]\n"), "t.toml").unwrap();
    let mut cluster = ClusterConfig::new("app", vec![EndpointSpec::new("127.0.0.1:9001")]);
    cluster.protections.health_check = Some(HealthCheckConfig::default());
    let built = ProxyConfig::new(
        vec![ListenerConfig::new("127.0.0.1:0".parse().unwrap(), "app")],
        vec![cluster],
    );
    assert_eq!(built, parsed);
    assert_eq!(built.validate(), Ok(()));
    // with_balancer is balancer_config's inverse.
    let mut b = BalancerConfig::new(StrategyKind::PeakEwma);
    b.options.choices = 3;
    b.outlier_detection = Some(OutlierConfig::default());
    b.seed = 42;
    let c = ClusterConfig::new("x", vec![]).with_balancer(&b);
    assert_eq!(c.balancer_config(), b);
}

#[test]
fn every_strategy_and_its_options_load() {
    for s in StrategyKind::ALL {
        let extra = if s.is_hash() {
            "hash_on = \"header:x-user\"\nbounded_load = 1.25\n"
        } else {
            "choices = 3\ndecay = \"5s\"\n"
        };
        let text = HEAD.replace(
            "name = \"app\"\n",
            &format!("name = \"app\"\nstrategy = \"{s}\"\n{extra}"),
        );
        let c = ProxyConfig::from_toml_str(&text, "s.toml").unwrap();
        let bc = c.clusters[0].balancer_config();
        assert_eq!(bc.strategy, s);
    }
    let c = ProxyConfig::from_toml_str(
        &format!("{HEAD}panic_threshold = 0\n[cluster.slow_start]\nwindow = \"2s\"\n"),
        "s.toml",
    )
    .unwrap();
    let bc = c.clusters[0].balancer_config();
    assert_eq!(bc.panic_threshold, 0.0);
    assert_eq!(bc.slow_start.unwrap().window, Duration::from_secs(2));
}

/// The keys serde accepts in each table, read back from its "unknown field" error.
fn allowed_keys(text: &str) -> Vec<String> {
    let e = err(text);
    let list = e
        .message
        .split("expected one of ")
        .nth(1)
        .or_else(|| e.message.split("expected ").nth(1))
        .unwrap_or_else(|| panic!("no key list in: {e}"));
    list.split(", ")
        .flat_map(|k| k.split(" or "))
        .map(|k| k.trim().trim_matches('`').to_string())
        .collect()
}

#[test]
fn every_option_is_documented() {
    let docs = include_str!("../../../../docs/configuration.md");
    let tables = [
        format!("nonsense = 1\n{HEAD}"),
        format!("[admin]\nnonsense = 1\n{HEAD}"),
        HEAD.replace("cluster = \"app\"", "cluster = \"app\"\nnonsense = 1"),
        format!("{HEAD}nonsense = 1\n"),
        format!("{HEAD}[cluster.retry]\nnonsense = 1\n"),
        format!("{HEAD}[cluster.engine_signals]\nnonsense = 1\n"),
        format!("{HEAD}[cluster.health_check]\nnonsense = 1\n"),
        format!("{HEAD}[cluster.outlier_detection]\nnonsense = 1\n"),
        format!("{HEAD}[cluster.outlier_detection.failure_rate]\nnonsense = 1\n"),
        format!("{HEAD}[cluster.slow_start]\nnonsense = 1\n"),
        HEAD.replace("9001\" }", "9001\", nonsense = 1 }"),
        HEAD.replace(
            "cluster = \"app\"",
            "cluster = \"app\"\n[listener.tls]\nnonsense = 1",
        ),
        format!("{HEAD}[cluster.tls]\nnonsense = 1\n"),
        format!("{HEAD}[cluster.hedge]\ndelay = \"p95\"\nnonsense = 1\n"),
        format!("[access_log]\npath = \"a.log\"\nnonsense = 1\n{HEAD}"),
        format!("[tracing]\nnonsense = 1\n{HEAD}"),
        HEAD.replace(
            "endpoints = [{ address = \"127.0.0.1:9001\" }]",
            "discovery = { dns = \"a.test\", port = 80, nonsense = 1 }",
        ),
        HEAD.replace(
            "cluster = \"app\"\n\n[[cluster]]",
            "cluster = \"app\"\n\n[[listener.route]]\ncluster = \"app\"\nnonsense = 1\n\n[[cluster]]",
        ),
        // Inline tables.
        format!("{HEAD}rate_limit = {{ rate = 1, nonsense = 1 }}\n"),
        format!("{HEAD}sticky = {{ cookie = \"s\", nonsense = 1 }}\n"),
        format!("{HEAD}request_headers = {{ nonsense = 1 }}\n"),
        format!("{HEAD}compression = {{ nonsense = 1 }}\n"),
        format!("{HEAD}response_headers = {{ nonsense = 1 }}\n"),
        format!("{HEAD}replace_prefix = {{ from = \"/a\", to = \"/b\", nonsense = 1 }}\n"),
        HEAD.replace(
            "cluster = \"app\"\n\n[[cluster]]",
            "cluster = \"app\"\n\n[[listener.route]]\nredirect = { location = \"/\", nonsense = 1 }\n\n[[cluster]]",
        ),
    ];
    let mut checked = 0;
    for t in &tables {
        for key in allowed_keys(t) {
            let documented = [
                format!("`{key}`"),
                format!("[{key}]"),
                format!("[cluster.{key}]"),
            ]
            .iter()
            .any(|form| docs.contains(form.as_str()));
            assert!(
                documented,
                "option `{key}` is not documented in docs/configuration.md"
            );
            checked += 1;
        }
    }
    assert!(checked > 40, "{checked} options checked");
}

#[test]
fn protocols_load_as_written_and_mismatches_are_refused() {
    // The TCP listener as the docs first wrote it, verbatim.
    let tcp = "[[listener]]\nlisten = \"127.0.0.1:7000\"\nprotocol = \"tcp\"       # default \"http\"\ncluster = \"db\"\n\n[[cluster]]\nname = \"db\"\nendpoints = [{ address = \"127.0.0.1:5432\" }]\nproxy_protocol = \"v2\"\n[cluster.health_check]\nkind = \"tcp\"\n";
    let c = ProxyConfig::from_toml_str(tcp, "tcp.toml").unwrap();
    assert_eq!(c.listeners[0].protocol, ListenerProtocol::Tcp);
    assert_eq!(
        c.listeners[0].tunnel_idle_timeout,
        Duration::from_secs(3600)
    );
    assert_eq!(c.clusters[0].proxy_protocol, Some(ProxyProtocol::V2));
    assert_eq!(c.clusters[0].protocol, UpstreamProtocol::Http1);
    let grpc = format!(
        "{HEAD}protocol = \"h2c\"\n[cluster.retry]\nretry_on_grpc_status = [8]\n[cluster.health_check]\nkind = \"grpc\"\n"
    );
    let c = ProxyConfig::from_toml_str(&grpc, "grpc.toml").unwrap();
    assert_eq!(c.clusters[0].protocol, UpstreamProtocol::H2c);
    assert_eq!(
        c.clusters[0].protections.retry.retry_on_grpc_status,
        vec![8]
    );
    let e = err(&format!("{HEAD}protocol = \"h2\"\n"));
    assert_eq!(e.key.as_deref(), Some("cluster[0].protocol"), "{e}");
    assert!(e.message.contains("[cluster.tls]"), "{e}");
    let e = err(&format!("{HEAD}[cluster.health_check]\nkind = \"grpc\"\n"));
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].health_check.kind"),
        "{e}"
    );
    let e = err(&format!("{HEAD}protocol = \"http3\"\n"));
    assert!(e.message.contains("h2c"), "{e}");
}

/// `[cluster.engine_signals]` loads as written and its errors are at their keys.
#[test]
fn engine_signals_load_and_their_errors_are_at_their_keys() {
    let c = ProxyConfig::from_toml_str(
        &format!("{HEAD}[cluster.engine_signals]\nsource = \"metrics\"\ninterval = \"20ms\"\n"),
        "ok.toml",
    )
    .unwrap();
    let s = c.clusters[0].engine_signals.as_ref().unwrap();
    assert_eq!(s.source, crate::config::SignalSource::Metrics);
    assert_eq!(
        (s.interval, s.max_age, s.metrics_path.as_str()),
        (
            Duration::from_millis(20),
            Duration::from_secs(2),
            "/metrics"
        )
    );
    for (text, key) in [
        (
            "protocol = \"h2c\"\n[cluster.engine_signals]\nsource = \"orca\"\n",
            "cluster[0].engine_signals.source",
        ),
        (
            "[cluster.engine_signals]\nsource = \"metrics\"\ninterval = \"1s\"\nmax_age = \"500ms\"\n",
            "cluster[0].engine_signals.max_age",
        ),
        (
            "[cluster.engine_signals]\nmax_age = \"0s\"\n",
            "cluster[0].engine_signals.max_age",
        ),
        (
            "[cluster.engine_signals]\nmetrics_path = \"metrics\"\n",
            "cluster[0].engine_signals.metrics_path",
        ),
    ] {
        let e = err(&format!("{HEAD}{text}"));
        assert_eq!(e.key.as_deref(), Some(key), "{e}");
    }
}

/// Every error of the protocol keys, at the exact key and its line.
#[test]
fn every_protocol_option_error_is_at_its_key_and_line() {
    let tcp = HEAD.replace(
        "cluster = \"app\"\n",
        "cluster = \"app\"\nprotocol = \"tcp\"\n",
    );
    let cases: Vec<(String, &str, usize)> = vec![
        (
            HEAD.replace(
                "cluster = \"app\"\n",
                "cluster = \"app\"\ntunnel_idle_timeout = \"0s\"\n",
            ),
            "listener[0].tunnel_idle_timeout",
            4,
        ),
        (
            HEAD.replace("cluster = \"app\"\n", "protocol = \"tcp\"\n"),
            "listener[0].cluster",
            1,
        ),
        (
            tcp.replace("name = \"app\"\n", "name = \"app\"\nprotocol = \"h2c\"\n"),
            "listener[0].cluster",
            3,
        ),
        (
            format!("{HEAD}proxy_protocol = \"v2\"\n"),
            "cluster[0].proxy_protocol",
            8,
        ),
        (
            format!("{HEAD}proxy_protocol = \"v3\"\n"),
            "cluster[0].proxy_protocol",
            8,
        ),
        (
            format!("{HEAD}protocol = \"h2\"\n"),
            "cluster[0].protocol",
            8,
        ),
        (
            format!("{HEAD}protocol = \"h2c\"\n[cluster.retry]\nretry_on_grpc_status = [8, 0]\n"),
            "cluster[0].retry.retry_on_grpc_status[1]",
            10,
        ),
        (
            format!("{HEAD}[cluster.retry]\nretry_on_grpc_status = [17]\n"),
            "cluster[0].retry.retry_on_grpc_status[0]",
            9,
        ),
        (
            format!("{HEAD}[cluster.health_check]\nkind = \"udp\"\n"),
            "cluster[0].health_check.kind",
            9,
        ),
        (
            format!("{HEAD}[cluster.health_check]\nkind = \"tcp\"\nservice = \"x\"\n"),
            "cluster[0].health_check.service",
            10,
        ),
        (
            format!("{HEAD}protocol = \"h2c\"\nstrategy = \"prequal\"\n"),
            "cluster[0].strategy",
            9,
        ),
    ];
    for (text, key, line) in &cases {
        let e = err(text);
        assert_eq!(e.key.as_deref(), Some(*key), "{text}: {e}");
        assert_eq!(e.line, Some(*line), "{text}: {e}");
    }
    // Hedging applies to HTTP/2 clusters too.
    let hedged_h2 = format!("{HEAD}protocol = \"h2c\"\n[cluster.hedge]\ndelay = \"p95\"\n");
    assert!(ProxyConfig::from_toml_str(&hedged_h2, "t.toml").is_ok());
    // A TCP listener on a plain cluster with the PROXY header loads.
    ProxyConfig::from_toml_str(&format!("{tcp}proxy_protocol = \"v1\"\n"), "ok.toml").unwrap();
}

#[test]
fn hash_on_parses() {
    assert_eq!("path".parse::<HashOn>().unwrap(), HashOn::Path);
    assert_eq!("client-ip".parse::<HashOn>().unwrap(), HashOn::ClientIp);
    assert_eq!(
        "header:X-User".parse::<HashOn>().unwrap().to_string(),
        "header:x-user"
    );
    let e = "cookie".parse::<HashOn>().unwrap_err();
    assert!(
        matches!(&e, HashOnError::Unknown(s) if s == "cookie"),
        "{e:?}"
    );
    assert!(e.to_string().contains("client-ip"), "{e}");
    assert!(matches!(
        "header:a b".parse::<HashOn>(),
        Err(HashOnError::HeaderName { .. })
    ));
}

#[test]
fn zone_priority_and_orca_keys_reach_the_balancer() {
    let text = format!(
        "zone = \"a\"\n{}",
        HEAD.replace(
            "endpoints = [{ address = \"127.0.0.1:9001\" }]",
            "strategy = \"orca-wrr\"\nblackout_period = \"2s\"\nerror_utilization_penalty = 0.5\n\
             overprovisioning_factor = 2\nendpoints = [{ address = \"127.0.0.1:9001\", zone = \"a\" }, \
             { address = \"127.0.0.1:9002\", zone = \"b\", priority = 1 }]\n\
             zone_routing = { mode = \"host-count\" }",
        )
    );
    let c = ProxyConfig::from_toml_str(&text, "z.toml").unwrap();
    let bc = c.clusters[0].balancer_config();
    assert_eq!(bc.strategy, StrategyKind::OrcaWrr);
    assert_eq!(bc.zone.as_deref(), Some("a"));
    assert_eq!(
        bc.zone_routing.as_ref().map(|z| z.mode),
        Some(keel_balance::ZoneMode::HostCount)
    );
    assert_eq!(bc.options.blackout_period, Duration::from_secs(2));
    assert_eq!(bc.options.error_utilization_penalty, 0.5);
    assert_eq!(bc.overprovisioning_factor, 2.0);
    assert_eq!(c.clusters[0].endpoints[1].priority, 1);
    // Without the proxy's zone, zone routing is refused at its key and line.
    let err = ProxyConfig::from_toml_str(text.trim_start_matches("zone = \"a\"\n"), "z.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("zone_routing") && err.contains("top-level `zone`"),
        "{err}"
    );
    // orca-wrr needs the HTTP/1.1 leg.
    let h2 = text.replace(
        "strategy = \"orca-wrr\"",
        "strategy = \"orca-wrr\"\nprotocol = \"h2c\"",
    );
    let err = ProxyConfig::from_toml_str(&h2, "z.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("orca-wrr needs ORCA reports"), "{err}");
}

/// A keel built without the `etcd` feature refuses etcd discovery at its key, saying why.
#[cfg(not(feature = "etcd"))]
#[test]
fn etcd_discovery_without_the_feature_is_refused_at_its_key() {
    let disc = "[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\ndiscovery = { etcd = \"/keel/clusters/app/\" }\n";
    let e = err(disc);
    assert_eq!(e.key.as_deref(), Some("cluster[0].discovery.etcd"), "{e}");
    assert!(e.message.contains("built without etcd"), "{e}");
}

/// `[etcd]`, etcd discovery and shared evidence: what each needs, refused at the key's path.
#[cfg(feature = "etcd")]
#[test]
fn etcd_discovery_and_shared_evidence_need_etcd_and_a_name() {
    const ETCD: &str = "[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n";
    let disc = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\ndiscovery = { etcd = \"/keel/clusters/app/\" }\n";
    let e = err(disc);
    assert_eq!(e.key.as_deref(), Some("cluster[0].discovery.etcd"), "{e}");
    assert!(e.message.contains("[etcd]"), "{e}");
    let c = ProxyConfig::from_toml_str(&format!("{ETCD}{disc}"), "ok.toml").unwrap();
    assert_eq!(
        c.clusters[0].discovery,
        Some(DiscoveryConfig::Etcd {
            prefix: "/keel/clusters/app/".into()
        })
    );
    assert_eq!(
        c.etcd.as_ref().unwrap().dial_timeout,
        Duration::from_secs(2)
    );
    let e = err(&disc.replace("/app/\"", "/app\""));
    assert_eq!(e.key.as_deref(), Some("cluster[0].discovery.etcd"), "{e}");

    let shared = format!("{HEAD}[cluster.outlier_detection]\nshared = {{ quorum = 1 }}\n");
    let e = err(&shared);
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].outlier_detection.shared"),
        "{e}"
    );
    assert!(e.message.contains("[etcd]"), "{e}");
    let e = err(&format!("{ETCD}{shared}"));
    assert!(e.message.contains("`name`"), "{e}");
    let c = ProxyConfig::from_toml_str(&format!("name = \"keel-1\"\n{ETCD}{shared}"), "ok.toml")
        .unwrap();
    let od = c.clusters[0]
        .protections
        .outlier_detection
        .as_ref()
        .unwrap();
    assert_eq!(od.shared, Some(keel_balance::SharedEvidence { quorum: 1 }));
    let e = err(&format!("name = \"a/b\"\n{ETCD}{shared}"));
    assert_eq!(e.key.as_deref(), Some("name"), "{e}");
    let e = err(&format!(
        "name = \"k\"\n{ETCD}{}",
        shared.replace("quorum = 1", "quorum = 9")
    ));
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].outlier_detection.shared.quorum"),
        "{e}"
    );
}

/// `[[cluster]]` and `[[listener.route]]` are flat tables read into groups: every key of the
/// table's list belongs to exactly one reader (the table's own keys or one group), so that
/// the "unknown field" list and what is read stay in step.
#[test]
fn every_flat_key_has_exactly_one_owner() {
    use crate::config::cluster::{BalanceConfig, ProtectionsConfig, TimeoutsConfig, CLUSTER_KEYS};
    use crate::config::route::ROUTE_KEYS;
    let cluster_own = [
        "name",
        "endpoints",
        "discovery",
        "protocol",
        "proxy_protocol",
        "tls",
        "probe",
        "engine_signals",
        "inference",
        "token_budget",
        "max_buffered_response",
        "pool_max_idle_per_endpoint",
        "sticky",
    ];
    let route_own = [
        "host",
        "path_prefix",
        "path",
        "methods",
        "headers",
        "path_regex",
        "query",
        "name",
        "cluster",
        "split",
        "models",
        "split_by",
        "mirror",
        "request_timeout",
        "retry_attempts",
        "redirect",
        "allow",
        "deny",
    ];
    let check = |all: &[&str], owners: &[&[&str]]| {
        let mut owned: Vec<&str> = owners.iter().flat_map(|o| o.iter().copied()).collect();
        let n = owned.len();
        owned.sort_unstable();
        owned.dedup();
        assert_eq!(owned.len(), n, "a key has two owners");
        let mut listed = all.to_vec();
        listed.sort_unstable();
        assert_eq!(listed, owned);
    };
    check(
        CLUSTER_KEYS,
        &[
            &cluster_own,
            BalanceConfig::KEYS,
            TimeoutsConfig::KEYS,
            ProtectionsConfig::KEYS,
            RequestPolicy::KEYS,
        ],
    );
    check(ROUTE_KEYS, &[&route_own, RequestPolicy::KEYS]);
}

/// Each flat key lands in its group; the keys left out keep the defaults of before.
#[test]
fn flat_keys_land_in_their_groups() {
    let text = format!(
        "{HEAD}connect_timeout = \"2s\"\nrequest_timeout = \"3s\"\nupstream_idle_timeout = \"4s\"\nmax_duration = \"5s\"\npool_idle_timeout = \"6s\"\nstrategy = \"maglev\"\nhash_on = \"path\"\nseed = 9\noutlier_detection = false\nmax_in_flight = 7\nmax_amplification = 4\nrate_limit = {{ rate = 5 }}\nstrip_prefix = \"/a\"\nrewrite_location = true\n[cluster.retry]\nattempts = 2\n"
    );
    let c = ProxyConfig::from_toml_str(&text, "ok.toml").unwrap();
    let c = &c.clusters[0];
    assert_eq!(c.timeouts.connect, Duration::from_secs(2));
    assert_eq!(c.timeouts.request, Duration::from_secs(3));
    assert_eq!(c.timeouts.upstream_idle, Duration::from_secs(4));
    assert_eq!(c.timeouts.max_duration, Some(Duration::from_secs(5)));
    assert_eq!(c.timeouts.pool_idle, Duration::from_secs(6));
    assert_eq!(c.balance.strategy, StrategyKind::Maglev);
    assert_eq!(c.balance.hash_on, Some(HashOn::Path));
    assert_eq!(c.balance.seed, Some(9));
    assert_eq!(c.protections.outlier_detection, None);
    assert_eq!(c.protections.max_in_flight, 7);
    assert_eq!(c.protections.max_amplification, Some(4));
    assert_eq!(c.protections.retry.attempts, 2);
    assert_eq!(c.policy.rate_limit.as_ref().map(|r| r.rate), Some(5.0));
    assert_eq!(c.policy.strip_prefix.as_deref(), Some("/a"));
    assert!(c.policy.rewrite_location);
    // A cluster without them: the defaults, as a cluster built in code.
    let plain = ProxyConfig::from_toml_str(HEAD, "ok.toml").unwrap();
    let defaults = ClusterConfig {
        name: "app".into(),
        endpoints: plain.clusters[0].endpoints.clone(),
        ..ClusterConfig::new("", Vec::new())
    };
    assert_eq!(plain.clusters[0], defaults);
    assert_eq!(
        defaults.protections.outlier_detection,
        Some(OutlierConfig::default())
    );
    assert_eq!(defaults.timeouts.connect, Duration::from_secs(1));
    assert_eq!(defaults.timeouts.request, Duration::from_secs(15));
    assert_eq!(defaults.timeouts.upstream_idle, Duration::from_secs(60));
    assert_eq!(defaults.timeouts.pool_idle, Duration::from_secs(90));
    assert_eq!(defaults.protections.max_in_flight, 10_000);
    assert_eq!(defaults.max_buffered_response, 65536);
    assert_eq!(defaults.pool_max_idle_per_endpoint, 256);
    // A route's policy keys land in its policy.
    let route = HEAD.replace(
        "cluster = \"app\"\n\n[[cluster]]",
        "cluster = \"app\"\n\n[[listener.route]]\ncluster = \"app\"\nstrip_prefix = \"/b\"\nrewrite_location = true\nrequest_timeout = \"2s\"\n\n[[cluster]]",
    );
    let r = &ProxyConfig::from_toml_str(&route, "ok.toml")
        .unwrap()
        .listeners[0]
        .routes[0];
    assert_eq!(r.policy.strip_prefix.as_deref(), Some("/b"));
    assert!(r.policy.rewrite_location);
    assert_eq!(r.request_timeout, Some(Duration::from_secs(2)));
}
