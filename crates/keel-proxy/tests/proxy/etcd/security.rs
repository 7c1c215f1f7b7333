//! `[etcd]` against an etcd that asks for credentials: client TLS (the members' certificate
//! checked against `ca`, keel's own certificate required by `--client-cert-auth`) and user and
//! password (`auth enable`). keel connects and discovers in both; a wrong password, or no
//! client certificate, leaves the cluster without endpoints and says why in `/status`.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use keel_proxy::{ProxyConfig, ProxyHandle};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

use super::*;

const PREFIX: &str = "/keel/clusters/api/";

/// One etcd member started with `extra` flags (TLS, ...), in its own directory; killed and
/// removed on drop.
struct Member {
    dir: PathBuf,
    client: SocketAddr,
    child: Child,
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

impl Member {
    fn start(dir: &Path, scheme: &str, extra: &[String]) -> Member {
        let client = free_port();
        let peer = free_port();
        let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new("etcd")
            .arg("--name=s0")
            .arg(format!("--data-dir={}", dir.join("data").display()))
            .arg(format!("--listen-client-urls={scheme}://{client}"))
            .arg(format!("--advertise-client-urls={scheme}://{client}"))
            .arg(format!("--listen-peer-urls=http://{peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://{peer}"))
            .arg(format!("--initial-cluster=s0=http://{peer}"))
            .arg("--log-level=warn")
            .arg("--logger=zap")
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run etcd ({e}): run scripts/test-etcd.sh"));
        Member {
            dir: dir.to_path_buf(),
            client,
            child,
        }
    }

    fn url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.client)
    }

    /// A client with `options`, retried until the member answers (at most 20 s).
    async fn client(&self, scheme: &str, options: ConnectOptions) -> Client {
        let start = std::time::Instant::now();
        loop {
            let attempt = async {
                let mut c = Client::connect([self.url(scheme)], Some(options.clone())).await?;
                c.status().await?;
                Ok::<_, etcd_client::Error>(c)
            };
            match tokio::time::timeout(Duration::from_secs(2), attempt).await {
                Ok(Ok(c)) => return c,
                other => {
                    let other = other.map(|r| r.map(|_| ()));
                    assert!(
                        start.elapsed() < Duration::from_secs(20),
                        "etcd not answering: {other:?}\n{}",
                        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("keel-etcd-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A proxy whose `[etcd]` section is `etcd_lines`, discovering cluster `api` under PREFIX.
async fn proxy_with(etcd_lines: &str) -> ProxyHandle {
    let text = format!(
        "name = \"p0\"\n\n[etcd]\ndial_timeout = \"1s\"\n{etcd_lines}\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"api\"\n\n[[cluster]]\nname = \"api\"\nresponse_headers = {{ endpoint = true }}\ndiscovery = {{ etcd = \"{PREFIX}\" }}\n"
    );
    let config = ProxyConfig::from_toml_str(&text, "etcd.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"));
    keel_proxy::start(config).await.unwrap()
}

/// Waits until `/status` reports a discovery error for `api`; returns it.
async fn discovery_error(proxy: &ProxyHandle) -> String {
    for _ in 0..100 {
        let st = status(proxy).await;
        if let Some(e) = st["clusters"][0]["discovery"]["last_error"].as_str() {
            return e.to_string();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no discovery error in {}", status(proxy).await);
}

/// One request through the proxy answered 200 by `want`.
async fn served_by(proxy: &ProxyHandle, want: SocketAddr) {
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let r = send(&client(), hyper::Method::GET, &url, &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-keel-endpoint"), Some(want.to_string().as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn client_tls_with_a_client_certificate_connects_and_discovers() {
    let dir = temp_dir("tls");
    // A CA, the member's certificate (127.0.0.1 and localhost), and keel's client certificate.
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "keel etcd test CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca.self_signed(&ca_key).unwrap();
    let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose, file: &str| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(names).unwrap();
        p.extended_key_usages = vec![usage];
        let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.join(format!("{file}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem()).unwrap();
    };
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    leaf(
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
        "server",
    );
    leaf(
        vec!["keel".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
        "client",
    );
    let file = |name: &str| dir.join(name).display().to_string();
    let member = Member::start(
        &dir,
        "https",
        &[
            format!("--cert-file={}", file("server.pem")),
            format!("--key-file={}", file("server.key")),
            format!("--trusted-ca-file={}", file("ca.pem")),
            "--client-cert-auth".into(),
        ],
    );
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let tls = TlsOptions::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")))
        .identity(Identity::from_pem(read("client.pem"), read("client.key")));
    let mut c = member
        .client("https", ConnectOptions::new().with_tls(tls))
        .await;
    let bs = backends(1, Duration::ZERO).await;
    put(&mut c, &format!("{PREFIX}b0"), &value(bs[0].addr()), None).await;

    let url = member.url("https");
    let proxy = proxy_with(&format!(
        "endpoints = [\"{url}\"]\n[etcd.tls]\nca = {:?}\ncert = {:?}\nkey = {:?}",
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    ))
    .await;
    follows(&proxy, "api", &[bs[0].addr()], Duration::from_secs(10)).await;
    served_by(&proxy, bs[0].addr()).await;
    assert_eq!(
        status(&proxy).await["clusters"][0]["discovery"]["stale"],
        false
    );
    proxy.shutdown(Duration::from_secs(1)).await;

    // Without a client certificate the member refuses keel: no endpoint, and the reason shown.
    let proxy = proxy_with(&format!(
        "endpoints = [\"{url}\"]\n[etcd.tls]\nca = {:?}",
        file("ca.pem")
    ))
    .await;
    let e = discovery_error(&proxy).await;
    println!("etcd TLS without a client certificate: {e}");
    // The member's alert, or (TLS 1.3: the alert can lose the race with the first request) the
    // connection it closes: both name the missing client certificate.
    assert!(
        (e.contains("etcd refused the TLS handshake") || e.contains("etcd closed the connection"))
            && e.contains("[etcd.tls] cert and key"),
        "{e}"
    );
    assert!(endpoints(&proxy, "api").is_empty());
    proxy.shutdown(Duration::from_secs(1)).await;
    drop(member);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn user_and_password_connect_and_discover_a_wrong_password_is_said_plainly() {
    let dir = temp_dir("auth");
    let member = Member::start(&dir, "http", &[]);
    let mut c = member.client("http", ConnectOptions::new()).await;
    // etcdctl user add root; etcdctl user grant-role root root; etcdctl auth enable.
    c.user_add("root", "s3cret", None).await.unwrap();
    c.user_grant_role("root", "root").await.unwrap();
    c.auth_enable().await.unwrap();
    let mut c = member
        .client("http", ConnectOptions::new().with_user("root", "s3cret"))
        .await;
    let bs = backends(1, Duration::ZERO).await;
    put(&mut c, &format!("{PREFIX}b0"), &value(bs[0].addr()), None).await;
    // Without credentials etcd now refuses a read.
    let mut anonymous = Client::connect([member.url("http")], None).await.unwrap();
    assert!(anonymous.get(PREFIX, None).await.is_err());

    let url = member.url("http");
    let proxy = proxy_with(&format!(
        "endpoints = [\"{url}\"]\nuser = \"root\"\npassword = \"s3cret\""
    ))
    .await;
    follows(&proxy, "api", &[bs[0].addr()], Duration::from_secs(10)).await;
    served_by(&proxy, bs[0].addr()).await;
    proxy.shutdown(Duration::from_secs(1)).await;

    let proxy = proxy_with(&format!(
        "endpoints = [\"{url}\"]\nuser = \"root\"\npassword = \"wrong\""
    ))
    .await;
    let e = discovery_error(&proxy).await;
    println!("etcd with a wrong password: {e}");
    assert!(
        e.contains("etcd refused access")
            && e.contains("authentication failed")
            && e.contains("[etcd] user and password"),
        "{e}"
    );
    assert!(!e.contains("s3cret") && !e.contains("wrong"), "{e}");
    assert!(endpoints(&proxy, "api").is_empty());
    proxy.shutdown(Duration::from_secs(1)).await;

    // No credentials at all: refused as plainly.
    let proxy = proxy_with(&format!("endpoints = [\"{url}\"]")).await;
    let e = discovery_error(&proxy).await;
    println!("etcd without credentials: {e}");
    assert!(e.contains("etcd refused access"), "{e}");
    proxy.shutdown(Duration::from_secs(1)).await;
    drop(member);
}
