//! `keel proxy` as a process: `--check`, exit 2 on an invalid file, serving examples/proxy.toml
//! with one endpoint failed while SIGHUP reloads it, and SIGTERM draining.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_model::{FailureMode, Latency};
use keel_testbed::backend::{self, BackendConfig};
use keel_testbed::loadgen::{self, LoadSpec, Target};

const KEEL: &str = env!("CARGO_BIN_EXE_keel");
const EXAMPLE_CONFIG: &str = include_str!("../../../examples/proxy.toml");

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("keel-proxy-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn check_accepts_the_example_file() {
    let out = Command::new(KEEL)
        .args(["proxy", "--check", "--config"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/proxy.toml"
        ))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(": ok"), "{stdout}");
    assert!(
        stdout.contains("least-connections over 5 endpoint(s)"),
        "{stdout}"
    );
    // attempts = 2, budget_percent = 20, no hedging.
    assert!(
        stdout.contains("upstream tries per request: at most 3; in the long run at most 1.20"),
        "{stdout}"
    );
}

#[test]
fn an_invalid_file_exits_2_naming_file_line_and_key() {
    let bad = EXAMPLE_CONFIG.replace("attempts = 2", "attempts = 2\nbudget = 20");
    let path = temp_file("bad.toml", &bad);
    for check in [true, false] {
        let mut cmd = Command::new(KEEL);
        cmd.arg("proxy");
        if check {
            cmd.arg("--check");
        }
        let out = cmd.arg("--config").arg(&path).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("bad.toml:23:1"), "file and line: {stderr}");
        assert!(stderr.contains("cluster[0].retry.budget"), "key: {stderr}");
        assert!(
            stderr.contains("budget_percent"),
            "what is allowed: {stderr}"
        );
    }
    let out = Command::new(KEEL)
        .args(["proxy", "--config", "/nonexistent/keel.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// `--check` opens the access log as the start would: a path it cannot open for appending is
/// an error at its line and key (exit 2); one it can leaves no file behind and an existing
/// file untouched.
#[test]
fn check_refuses_an_access_log_it_cannot_open() {
    let config = |path: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"127.0.0.1:9\" }}]\n\n[access_log]\npath = \"{path}\"\n"
        )
    };
    let check = |file: &std::path::Path| {
        Command::new(KEEL)
            .args(["proxy", "--check", "--config"])
            .arg(file)
            .output()
            .unwrap()
    };
    let bad = temp_file("log-bad.toml", &config("no-such-dir/access.log"));
    let out = check(&bad);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("log-bad.toml:10:"),
        "file and line: {stderr}"
    );
    assert!(stderr.contains("access_log.path"), "key: {stderr}");
    assert!(
        stderr.contains("no-such-dir/access.log"),
        "the path: {stderr}"
    );

    let good = temp_file("log-good.toml", &config("check-access.log"));
    let log = good.with_file_name("check-access.log");
    let _ = std::fs::remove_file(&log);
    let out = check(&good);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!log.exists(), "--check left a new access log behind");
    std::fs::write(&log, "kept\n").unwrap();
    assert!(check(&good).status.success());
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "kept\n");
    let _ = std::fs::remove_file(&log);
}

/// deploy/keel.service's `ExecReload=` commands, run as systemd runs them (in order, the
/// first failure fails the reload and skips the rest): a file `--check` refuses fails
/// `systemctl reload` and signals nothing; a valid one signals the main process.
#[test]
fn the_units_reload_fails_on_a_refused_file_and_signals_nothing() {
    let unit = include_str!("../../../deploy/keel.service");
    let reload: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("ExecReload="))
        .collect();
    assert!(reload.len() >= 2, "{reload:?}");
    let run_reload = |config: &std::path::Path, main_pid: u32| {
        reload.iter().all(|line| {
            let line = line
                .replace("/usr/local/bin/keel", KEEL)
                .replace("/etc/keel/keel.toml", config.to_str().unwrap())
                .replace("$MAINPID", &main_pid.to_string());
            let mut words = line.split_whitespace();
            let program = words.next().unwrap();
            Command::new(program)
                .args(words)
                .stderr(Stdio::null())
                .status()
                .unwrap()
                .success()
        })
    };
    // The main process: anything SIGHUP ends, with SIGHUP's default action even when this test
    // runs under `nohup` (an ignored signal is inherited, and sleep would outlive the signal).
    let mut main = Command::new("sleep");
    main.arg("600");
    // SAFETY: between fork and exec only signal(2), which is async-signal-safe.
    unsafe {
        use std::os::unix::process::CommandExt;
        main.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut main = main.spawn().unwrap();
    let started = Instant::now();
    let bad = temp_file(
        "reload-bad.toml",
        &EXAMPLE_CONFIG.replace("attempts = 2", "attempts = 2\nbudget = 20"),
    );
    assert!(
        !run_reload(&bad, main.id()),
        "systemctl reload succeeded on a refused file"
    );
    assert!(
        main.try_wait().unwrap().is_none(),
        "the main process was signalled"
    );
    let good = temp_file("reload-good.toml", EXAMPLE_CONFIG);
    assert!(run_reload(&good, main.id()));
    let mut status = None;
    for _ in 0..100 {
        status = main.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let Some(status) = status else {
        let _ = main.kill();
        panic!(
            "no SIGHUP reached the main process ({:?} after it started)",
            started.elapsed()
        );
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(1),
        "SIGHUP sent: {status:?}, {:?} after it started",
        started.elapsed()
    );
}

/// A GET on a fresh connection; the whole response as text.
fn get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

#[test]
fn serves_the_example_config_with_one_endpoint_failed_through_sighup_reloads_and_drains_on_sigterm()
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut backends = Vec::new();
    for i in 0..5 {
        let cfg = BackendConfig {
            latency: Latency::fixed(Duration::from_millis(1)),
            name: format!("b{i}"),
            ..BackendConfig::default()
        };
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        backends.push(rt.block_on(backend::spawn(addr, cfg)).unwrap());
    }
    rt.block_on(backends[2].apply_fault(FailureMode::FAIL_AT_ONCE))
        .unwrap();
    let mut text = EXAMPLE_CONFIG
        .replace("127.0.0.1:9901", "127.0.0.1:0")
        .replace("127.0.0.1:8080", "127.0.0.1:0");
    for (i, b) in backends.iter().enumerate() {
        text = text.replace(&format!("127.0.0.1:900{}", i + 1), &b.addr().to_string());
    }
    let path = temp_file("proxy.toml", &text);

    let mut child = Command::new(KEEL)
        .args(["proxy", "--config"])
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let logs = Arc::new(Mutex::new(String::new()));
    {
        let logs = logs.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = logs.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
    }
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let listen = loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("keel proxy ended early:\n{}", logs.lock().unwrap());
        }
        if let Some(rest) = line.trim().strip_prefix("keel proxy: listening on http://") {
            break rest.split(' ').next().unwrap().to_string();
        }
    };
    line.clear();
    stdout.read_line(&mut line).unwrap();
    let admin = line
        .trim()
        .strip_prefix("keel proxy: admin on http://")
        .unwrap_or_else(|| panic!("no admin line: {line}"))
        .to_string();

    let mut spec = LoadSpec::new(Target::Url(format!("http://{listen}/work")), 5_000);
    spec.concurrency = 32;
    spec.timeout = Duration::from_secs(3);
    let load = rt.spawn(loadgen::run(spec));
    let mut hups = 0;
    while !load.is_finished() {
        std::thread::sleep(Duration::from_millis(150));
        signal(pid, "-HUP");
        hups += 1;
    }
    let report = rt.block_on(load).unwrap();
    println!("through `keel proxy`, b2 answering 503, {hups} SIGHUP reloads:\n{report}");
    assert!(
        report.success_rate() >= 0.999,
        "{report}\n{}",
        logs.lock().unwrap()
    );

    // A file that no longer parses: the SIGHUP reload is refused, logged and counted like a
    // refused `POST /reload`.
    let refused = |metrics: &str| -> u64 {
        let key = "keel_config_reloads_total{result=\"refused\"} ";
        let at = metrics.find(key).expect("the counter is exported") + key.len();
        metrics[at..]
            .lines()
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    // The load's last SIGHUPs may still be on their way: let them land on the valid file.
    std::thread::sleep(Duration::from_millis(500));
    let before = refused(&get(&admin, "/metrics"));
    std::fs::write(&path, "[[listener]\nnot toml").unwrap();
    signal(pid, "-HUP");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = get(&admin, "/metrics");
        if refused(&metrics) == before + 1 {
            break;
        }
        assert!(Instant::now() < deadline, "not counted:\n{metrics}");
        std::thread::sleep(Duration::from_millis(50));
    }

    let t = Instant::now();
    signal(pid, "-TERM");
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("keel proxy did not stop on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status:?}");
    let logs = logs.lock().unwrap().clone();
    let reloads = logs.matches("configuration reloaded").count();
    assert!(
        reloads >= 1 && reloads <= hups,
        "{reloads} of {hups} reloads logged:\n{logs}"
    );
    assert!(logs.contains("shutting down"), "{logs}");
    assert!(logs.contains("configuration reload refused"), "{logs}");
    // b2's 503s are retried, and each failed try is visible at the default level.
    assert!(
        logs.contains("try failed") && logs.contains("answered 503"),
        "{logs}"
    );
    assert!(
        !logs.contains('\x1b'),
        "no colour codes when stderr is not a terminal:\n{logs}"
    );
    for b in backends {
        rt.block_on(b.shutdown());
    }
}

/// Starts `keel proxy --config path` and returns it with its first listener's address.
fn start_proxy(path: &std::path::Path) -> (std::process::Child, String) {
    let mut child = Command::new(KEEL)
        .args(["proxy", "--config"])
        .arg(path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let listen = loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("keel proxy ended early");
        }
        if let Some(rest) = line.trim().strip_prefix("keel proxy: listening on http://") {
            break rest.split(' ').next().unwrap().to_string();
        }
    };
    (child, listen)
}

#[test]
fn sigusr1_reopens_the_access_log_after_it_was_moved() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let b = rt
        .block_on(backend::spawn(addr, BackendConfig::default()))
        .unwrap();
    let dir = std::env::temp_dir().join(format!("keel-usr1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("keel.toml");
    std::fs::write(
        &config,
        format!(
            "[access_log]\npath = \"access.log\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\n\
             [[listener.route]]\npath_prefix = \"/\"\ncluster = \"app\"\n\n\
             [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
            b.addr()
        ),
    )
    .unwrap();
    let (mut child, listen) = start_proxy(&config);
    let log = dir.join("access.log");
    let moved = dir.join("access.log.1");
    let lines = |p: &std::path::Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let wait_for = |p: &std::path::Path, n: usize| {
        let start = Instant::now();
        while lines(p) < n && start.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(20));
        }
        lines(p)
    };
    assert!(get(&listen, "/first").starts_with("HTTP/1.1 200"));
    assert_eq!(wait_for(&log, 1), 1);
    std::fs::rename(&log, &moved).unwrap();
    signal(child.id(), "-USR1");
    std::thread::sleep(Duration::from_millis(300));
    assert!(get(&listen, "/second").starts_with("HTTP/1.1 200"));
    assert_eq!(wait_for(&log, 1), 1, "a new file after SIGUSR1");
    assert!(std::fs::read_to_string(&log)
        .unwrap()
        .contains("\"/second\""));
    assert_eq!(lines(&moved), 1);
    signal(child.id(), "-TERM");
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_validates_discovery_without_resolving() {
    // No DNS server answers at this address: --check must not ask it.
    let text = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"api\"\n\n[[cluster]]\nname = \"api\"\ndiscovery = { dns = \"api.internal.test\", port = 9000, resolver = \"127.0.0.1:9\", refresh = \"1s\" }\n";
    let path = temp_file("discovery.toml", text);
    let started = Instant::now();
    let out = Command::new(KEEL)
        .args(["proxy", "--check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(
        stdout.contains(
            "endpoints from dns api.internal.test:9000 via 127.0.0.1:9 (not resolved by --check)"
        ),
        "{stdout}"
    );
    let bad = temp_file(
        "bad-discovery.toml",
        &text.replace(
            "dns = \"api.internal.test\", port = 9000",
            "srv = \"api.internal.test\"",
        ),
    );
    let out = Command::new(KEEL)
        .args(["proxy", "--check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("`cluster[0].discovery.srv`"), "{stderr}");
}

/// The PID a `--pid-file` names.
fn read_pid(path: &std::path::Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (a zombie does not: once its parent is gone nobody here reaps it).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

#[test]
fn sigusr2_replaces_the_binary_under_load_without_a_failed_request() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut backends = Vec::new();
    for i in 0..2 {
        let cfg = BackendConfig {
            latency: Latency::fixed(Duration::from_millis(2)),
            name: format!("b{i}"),
            ..BackendConfig::default()
        };
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        backends.push(rt.block_on(backend::spawn(addr, cfg)).unwrap());
    }
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}, {{ address = \"{}\" }}]\n",
        backends[0].addr(),
        backends[1].addr()
    );
    let path = temp_file("upgrade.toml", &text);
    let pid_file = path.with_extension("pid");
    let _ = std::fs::remove_file(&pid_file);
    let mut old = Command::new(KEEL)
        .args(["proxy", "--workers", "2", "--config"])
        .arg(&path)
        .arg("--pid-file")
        .arg(&pid_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(old.stdout.take().unwrap());
    let mut line = String::new();
    let listen = loop {
        line.clear();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "keel proxy ended early"
        );
        if let Some(rest) = line.trim().strip_prefix("keel proxy: listening on http://") {
            break rest.split(' ').next().unwrap().to_string();
        }
    };
    // The new process writes to the same stdout; keep the pipe drained.
    std::thread::spawn(move || for _ in stdout.lines() {});
    let waited = Instant::now();
    while read_pid(&pid_file) != Some(old.id()) {
        assert!(waited.elapsed() < Duration::from_secs(10), "no PID file");
        std::thread::sleep(Duration::from_millis(20));
    }

    // A bounded load on fresh and kept-alive connections, with the upgrade in the middle.
    let mut spec = LoadSpec::new(Target::Url(format!("http://{listen}/")), 6000);
    spec.concurrency = 8;
    spec.timeout = Duration::from_secs(5);
    let load = rt.spawn(loadgen::run(spec));
    std::thread::sleep(Duration::from_millis(400));
    signal(old.id(), "-USR2");
    let waited = Instant::now();
    let new_pid = loop {
        match read_pid(&pid_file) {
            Some(p) if p != old.id() => break p,
            _ => {}
        }
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "no new process took over"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Stopped by PID even if an assertion below fails (it is not this test's child).
    struct KillOnDrop(u32);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if alive(self.0) {
                let _ = Command::new("kill")
                    .args(["-KILL", &self.0.to_string()])
                    .status();
            }
        }
    }
    let _successor = KillOnDrop(new_pid);
    let status = old.wait().unwrap();
    assert!(
        status.success(),
        "the old process drained and exited: {status}"
    );
    let report = rt.block_on(load).unwrap();
    println!("{report}");
    assert_eq!(report.requests, 6000);
    assert_eq!(report.succeeded, 6000, "{report}");
    assert_eq!(report.transport_errors, 0, "{report}");
    assert!(alive(new_pid));
    assert!(get(&listen, "/").starts_with("HTTP/1.1 200"));
    // The new process is the same kind of keel: it drains on SIGTERM and removes its PID file.
    signal(new_pid, "-TERM");
    let waited = Instant::now();
    while alive(new_pid) {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "the new process did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !pid_file.exists(),
        "PID file removed by the process it names"
    );
}

/// With `ulimit -n 256` and 400 idle client connections open, the data listener sheds what it
/// cannot take and the admin listener still answers (at the fd limit the admin was once
/// unreachable); once the clients are gone, the data listener serves again.
#[test]
fn the_admin_answers_at_the_open_file_limit() {
    let text = "[admin]\nlisten = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9\" }]\n";
    let path = temp_file("fd-limit.toml", text);
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -n 256 && exec \"$0\" proxy --config \"$1\""])
        .arg(KEEL)
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let (mut listen, mut admin) = (None, None);
    let mut line = String::new();
    while listen.is_none() || admin.is_none() {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("keel proxy ended early");
        }
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("keel proxy: listening on http://") {
            listen = rest.split(' ').next().map(str::to_string);
        }
        if let Some(rest) = l.strip_prefix("keel proxy: admin on http://") {
            admin = rest.split(['/', ' ']).next().map(str::to_string);
        }
    }
    let (listen, admin) = (listen.unwrap(), admin.unwrap());
    let stderr = child.stderr.take().unwrap();
    let warnings = std::thread::spawn(move || {
        let mut all = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut all);
        all
    });
    // The proxy has 256 descriptors; 400 connections want more than that.
    let idle: Vec<std::net::TcpStream> = (0..400)
        .filter_map(|_| std::net::TcpStream::connect(&listen).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let status = get(&admin, "/status");
    let data_during = std::net::TcpStream::connect(&listen).map(|mut s| {
        use std::io::{Read, Write};
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    });
    drop(idle);
    std::thread::sleep(Duration::from_millis(500));
    let after = get(&listen, "/");
    signal(child.id(), "-TERM");
    let _ = child.wait();
    let log = warnings.join().unwrap();
    assert!(
        status.starts_with("HTTP/1.1 200"),
        "admin at the limit: {status:?}\n{log}"
    );
    assert!(
        log.contains("near the open-file limit"),
        "the shedding is logged: {log}"
    );
    // While full, a new data connection is closed at once (not left hanging).
    assert!(
        data_during.as_deref().map_or(true, |a| a.is_empty()),
        "{data_during:?}"
    );
    // The endpoint (port 9) refuses: keel answers for it, so the listener serves again.
    assert!(after.starts_with("HTTP/1.1 502"), "{after:?}");
}

/// Every line of `text` as JSON; panics naming the first that is not.
fn json_lines(what: &str, text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{what} line is not JSON ({e}): {l}\n{text}"))
        })
        .collect()
}

/// Runs `keel proxy --log-format json` with the access log on stdout until SIGTERM; returns
/// (stdout, stderr) after the process ended.
fn run_json_proxy(config: &std::path::Path, requests: usize) -> (String, String) {
    let mut child = Command::new(KEEL)
        .args(["proxy", "--log-format", "json", "--config"])
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut BufReader::new(stdout), &mut s).unwrap();
        s
    });
    // The listener's address comes in the process log: a `listening` event on stderr.
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut err = String::new();
    let listen = loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("keel proxy ended early:\n{err}");
        }
        err.push_str(&line);
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("stderr line is not JSON ({e}): {line}"));
        if v["message"] == "listening" {
            let addr = v["addr"].as_str().unwrap();
            break addr.strip_prefix("http://").unwrap().to_string();
        }
    };
    for i in 0..requests {
        assert!(get(&listen, &format!("/r{i}")).starts_with("HTTP/1.1 200"));
    }
    // The access log's writer flushes every 100 ms.
    std::thread::sleep(Duration::from_millis(300));
    signal(child.id(), "-TERM");
    std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
    assert!(child.wait().unwrap().success(), "{err}");
    (out.join().unwrap(), err)
}

#[test]
fn log_format_json_writes_json_process_logs_on_stderr_and_only_access_log_lines_on_stdout() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let b = rt
        .block_on(backend::spawn(addr, BackendConfig::default()))
        .unwrap();
    let config = temp_file(
        "json-logs.toml",
        &format!(
            "[access_log]\npath = \"-\"\nformat = \"json\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n\
             [[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n\
             [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
            b.addr()
        ),
    );
    let (stdout, stderr) = run_json_proxy(&config, 3);

    // stdout: the access log and nothing else, one line per request.
    let access = json_lines("stdout", &stdout);
    assert_eq!(access.len(), 3, "{stdout}");
    // Workers' lines may come in any order.
    let mut paths: Vec<&str> = access
        .iter()
        .inspect(|v| assert_eq!(v["status"], 200, "{v}"))
        .map(|v| v["path"].as_str().unwrap())
        .collect();
    paths.sort_unstable();
    assert_eq!(paths, ["/r0", "/r1", "/r2"], "{stdout}");

    // stderr: keel's own logs, each a JSON object with the usual fields.
    let logs = json_lines("stderr", &stderr);
    for v in &logs {
        for field in ["timestamp", "level", "target", "message"] {
            assert!(v[field].is_string(), "{field} missing: {v}");
        }
    }
    let messages: Vec<&str> = logs
        .iter()
        .map(|v| v["message"].as_str().unwrap())
        .collect();
    for m in [
        "listening",
        "admin listening",
        "keel proxy started",
        "stopped",
    ] {
        assert!(messages.contains(&m), "no {m:?} in {messages:?}");
    }
    let started = logs
        .iter()
        .find(|v| v["message"] == "keel proxy started")
        .unwrap();
    assert_eq!(started["level"], "INFO");
    assert_eq!(started["config"], config.display().to_string(), "{started}");

    // An error that ends the process is a JSON line too.
    let out = Command::new(KEEL)
        .args([
            "proxy",
            "--log-format",
            "json",
            "--config",
            "/nonexistent/keel.toml",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines = json_lines("stderr", &err);
    assert_eq!(lines.len(), 1, "{err}");
    assert_eq!(lines[0]["level"], "ERROR");
    assert!(lines[0]["message"]
        .as_str()
        .unwrap()
        .contains("/nonexistent/keel.toml"));
    rt.block_on(b.shutdown());
}

#[test]
fn with_the_access_log_on_stdout_the_text_startup_lines_go_to_stderr() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let b = rt
        .block_on(backend::spawn(addr, BackendConfig::default()))
        .unwrap();
    let config = temp_file(
        "stdout-log.toml",
        &format!(
            "[access_log]\npath = \"-\"\nformat = \"json\"\n\n\
             [[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n\
             [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
            b.addr()
        ),
    );
    let mut child = Command::new(KEEL)
        .args(["proxy", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut BufReader::new(stdout), &mut s).unwrap();
        s
    });
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut err = String::new();
    let listen = loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("keel proxy ended early:\n{err}");
        }
        err.push_str(&line);
        if let Some(rest) = line.trim().strip_prefix("keel proxy: listening on http://") {
            break rest.split(' ').next().unwrap().to_string();
        }
    };
    for i in 0..2 {
        assert!(get(&listen, &format!("/t{i}")).starts_with("HTTP/1.1 200"));
    }
    std::thread::sleep(Duration::from_millis(300));
    signal(child.id(), "-TERM");
    std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
    assert!(child.wait().unwrap().success(), "{err}");
    let stdout = out.join().unwrap();
    let access = json_lines("stdout", &stdout);
    assert_eq!(access.len(), 2, "only the access log on stdout:\n{stdout}");
    assert!(err.contains("keel proxy started"), "{err}");
    rt.block_on(b.shutdown());
}
