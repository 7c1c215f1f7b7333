//! Admin safety: loopback unless a token is set, bearer token checked on
//! every request when set, `/reload` POST only.

use std::time::Duration;

use crate::support::*;
use hyper::{Method, StatusCode};
use keel_proxy::ProxyConfig;

const TOKEN: &str = "test-token-0123456789abcdef";

fn with_admin(admin: &str) -> String {
    format!("{admin}\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"127.0.0.1:9\" }}]\n")
}

#[test]
fn a_non_loopback_admin_listener_requires_a_token() {
    for listen in ["0.0.0.0:9901", "[::]:9901", "192.0.2.1:9901"] {
        let text = with_admin(&format!("[admin]\nlisten = \"{listen}\""));
        let e = ProxyConfig::from_toml_str(&text, "t.toml").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("admin.token"), "{e}");
        assert!(
            e.message.contains("token") && e.message.contains("loopback"),
            "{e}"
        );
        assert_eq!(e.line, Some(1), "{e}");
        let ok = with_admin(&format!(
            "[admin]\nlisten = \"{listen}\"\ntoken = \"{TOKEN}\""
        ));
        ProxyConfig::from_toml_str(&ok, "t.toml").unwrap();
    }
    // Loopback needs none; the default address is loopback.
    ProxyConfig::from_toml_str(&with_admin("[admin]"), "t.toml").unwrap();
    ProxyConfig::from_toml_str(&with_admin("[admin]\nlisten = \"[::1]:9901\""), "t.toml").unwrap();
    let short = with_admin("[admin]\nlisten = \"0.0.0.0:9901\"\ntoken = \"short\"");
    let e = ProxyConfig::from_toml_str(&short, "t.toml").unwrap_err();
    assert_eq!(e.key.as_deref(), Some("admin.token"), "{e}");
    assert_eq!(e.line, Some(3), "{e}");
    // The token never shows in debug output (configurations get logged).
    let c = ProxyConfig::from_toml_str(
        &with_admin(&format!(
            "[admin]\nlisten = \"0.0.0.0:9901\"\ntoken = \"{TOKEN}\""
        )),
        "t.toml",
    )
    .unwrap();
    assert!(!format!("{c:?}").contains(TOKEN));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_every_admin_request_is_checked() {
    let text = with_admin(&format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\""
    ));
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let c = client();
    let good = format!("Bearer {TOKEN}");
    let wrong_last = format!("Bearer {}X", &TOKEN[..TOKEN.len() - 1]);
    let longer = format!("Bearer {TOKEN}0");
    let lower = format!("bearer {TOKEN}");
    let mut figures = Vec::new();
    for path in ["/status", "/metrics", "/", "/nowhere"] {
        let url = format!("http://{admin}{path}");
        for (auth, want_ok) in [
            (None, false),
            (Some("Bearer"), false),
            (Some("Basic dXNlcjpwYXNz"), false),
            (Some(TOKEN), false),
            (Some(wrong_last.as_str()), false),
            (Some(longer.as_str()), false),
            (Some(good.as_str()), true),
            (Some(lower.as_str()), true),
        ] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let r = send(&c, Method::GET, &url, &headers, b"").await.unwrap();
            if want_ok {
                assert_ne!(r.status, StatusCode::UNAUTHORIZED, "{path} {auth:?}");
            } else {
                assert_eq!(
                    r.status,
                    StatusCode::UNAUTHORIZED,
                    "{path} {auth:?}: {}",
                    r.text()
                );
                assert_eq!(
                    r.header("www-authenticate"),
                    Some("Bearer realm=\"keel admin\"")
                );
                assert!(!r.text().contains(TOKEN));
            }
            figures.push(r.status.as_u16());
        }
    }
    let status = send(
        &c,
        Method::GET,
        &format!("http://{admin}/status"),
        &[("authorization", &good)],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(status.status, StatusCode::OK);
    assert!(status.text().contains("\"clusters\""));

    // /reload: POST only; the token is checked first.
    let reload = format!("http://{admin}/reload");
    let r = send(&c, Method::POST, &reload, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    for m in [Method::GET, Method::PUT, Method::DELETE, Method::HEAD] {
        let r = send(&c, m.clone(), &reload, &[("authorization", &good)], b"")
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{m}");
        assert_eq!(r.header("allow"), Some("POST"), "{m}");
    }
    // Authorized POST gets through (409: this proxy was not started from a file).
    let r = send(&c, Method::POST, &reload, &[("authorization", &good)], b"")
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    eprintln!(
        "admin with token: {} requests, answers {figures:?}",
        figures.len()
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_reload_is_still_post_only() {
    let proxy = keel_proxy::start(
        ProxyConfig::from_toml_str(&with_admin("[admin]\nlisten = \"127.0.0.1:0\""), "t.toml")
            .unwrap(),
    )
    .await
    .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let r = get(&format!("http://{admin}/reload")).await.unwrap();
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        get(&format!("http://{admin}/status")).await.unwrap().status,
        StatusCode::OK
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}
