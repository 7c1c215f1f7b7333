//! The admin listener: `/metrics` (Prometheus text), `/status` (JSON), `/` (an HTML page that
//! refreshes itself from `/status`), `POST /reload` (re-reads the configuration file), `/live`
//! and `/ready` (for probes: the process runs; it takes new work), and `POST
//! /endpoints/{cluster}/{address}/drain` and `/undrain` (one endpoint out of the picks and back).

pub(crate) mod recent;

use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin::recent::{Recent, SAMPLE_EVERY};
use crate::metrics::{self, ClusterView};
use crate::state::{wait_shutdown, Shared};

fn reply(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// An engine's load as keel sees it (`[cluster.engine_signals]`): the last report while it
/// is fresh (`null` fields otherwise), and the reports by what became of them; `null` for a
/// cluster without engine signals.
fn engine_json(
    c: &crate::upstream::cluster::Cluster,
    e: &crate::metrics::engine::EngineSignals,
) -> serde_json::Value {
    let Some(cfg) = &c.config.engine_signals else {
        return serde_json::Value::Null;
    };
    let view = e.view(c.now(), cfg.max_age);
    let field = |v: Option<f32>| v.filter(|v| v.is_finite()).map(f64::from);
    json!({
        "waiting": field(view.map(|(l, _)| l.waiting)),
        "running": field(view.map(|(l, _)| l.running)),
        "kv_cache_usage": field(view.map(|(l, _)| l.kv_cache)),
        "age_ms": view.map(|(_, age)| ms(age)),
        "reports": e.reports.load(Relaxed),
        "malformed": e.malformed.load(Relaxed),
        "stale": e.stale.load(Relaxed),
        "failed": e.failed.load(Relaxed),
    })
}

/// An `inference = true` cluster's answers by model (means since the start); `null` for
/// another cluster.
fn inference_json(c: &crate::upstream::cluster::Cluster) -> serde_json::Value {
    if !c.config.inference {
        return serde_json::Value::Null;
    }
    let models: Vec<_> = c
        .metrics
        .inference
        .get()
        .map(|m| m.view())
        .unwrap_or_default()
        .into_iter()
        .map(|v| {
            json!({
                "model": v.model,
                "answers": v.answers,
                "prompt_tokens": v.prompt_tokens,
                "completion_tokens": v.completion_tokens,
                "cached_tokens": v.cached_tokens,
                "ttft_mean_ms": v.ttft_ms,
                "itl_mean_ms": v.itl_ms,
            })
        })
        .collect();
    json!({ "models": models })
}

/// The `/status` document; `recent`: the last minute's samples.
pub(crate) fn status_json(shared: &Shared, recent: &Recent) -> serde_json::Value {
    let routing = shared.routing.load();
    let config = shared.config.load();
    let now = shared.epoch.elapsed();
    let clusters: Vec<_> = routing
        .clusters
        .iter()
        .map(|c| {
            let (requests, retries) = c.budget.counts(c.now());
            let endpoints: Vec<_> = c
                .balancer
                .status(c.now())
                .into_iter()
                .zip(&c.endpoints)
                .map(|(s, e)| {
                    json!({
                        "address": s.address,
                        "weight": s.weight,
                        "effective_weight": s.effective_weight,
                        "healthy": s.healthy,
                        "draining": s.draining,
                        "ejected": s.ejected_until.is_some(),
                        "ejected_for_ms": s.ejected_until.map(|u| ms(u.saturating_sub(now))),
                        "ejections_in_a_row": s.ejections,
                        "ejections_total": e.metrics.ejections.load(Relaxed),
                        "in_flight": s.in_flight,
                        "latency_estimate_ms": s.latency_estimate.map(ms),
                        "successes": s.successes,
                        "failures": s.failures,
                        "last_minute": recent.endpoint_json(c.name(), &s.address),
                        "engine": engine_json(c, &e.metrics.engine),
                    })
                })
                .collect();
            let m = &c.metrics;
            json!({
                "name": c.name(),
                "strategy": c.config.balance.strategy.name(),
                "panicking": c.balancer.is_panicking(c.now()),
                "in_flight": m.in_flight.load(Relaxed),
                "requests": m.latency.count(),
                "retries": m.retries.load(Relaxed),
                "retry_budget_refusals": m.budget_refusals.load(Relaxed),
                "retry_budget_window": { "requests": requests, "retries": retries },
                "health_check": c.config.protections.health_check.is_some(),
                "outlier_detection": c.config.protections.outlier_detection.is_some(),
                "discovery": discovery_json(shared, c.name()),
                "shared_evidence": evidence_json(shared, c.name()),
                "last_minute": recent.cluster_json(c.name()),
                "inference": inference_json(c),
                "endpoints": endpoints,
            })
        })
        .collect();
    let live = shared.listening.listeners.load();
    let listeners: Vec<_> = config
        .listeners
        .iter()
        .zip(live.iter())
        .map(|(l, slot)| {
            let (a, not_found) = (slot.addr, &slot.not_found);
            // Conditions as text (`v`, `~ regex`, `present`, `not ...`): an exact value shows as
            // written.
            let shown = |m: &std::collections::BTreeMap<String, crate::config::ValueMatch>| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.to_string()))
                    .collect::<std::collections::BTreeMap<_, _>>()
            };
            let routes: Vec<_> = l
                .routes
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    json!({
                        "index": i,
                        "host": r.host,
                        "path": r.path,
                        "path_prefix": r.path_prefix,
                        "methods": r.methods,
                        "headers": shown(&r.headers),
                        "path_regex": r.path_regex,
                        "query": shown(&r.query),
                        "name": r.name,
                        "split": r.split,
                        "split_by": r.split_by,
                        "mirror": r.mirror,
                        "cluster": r.cluster,
                        "request_timeout_ms": r.request_timeout.map(ms),
                        "retry_attempts": r.retry_attempts,
                    })
                })
                .collect();
            json!({
                "listen": a.to_string(),
                "cluster": l.cluster,
                "tls": l.tls.is_some(),
                "routes": routes,
                "not_found": not_found.load(Relaxed),
            })
        })
        .collect();
    let access_log = shared.access_log.load();
    let access_log = access_log.as_ref().map(|log| {
        json!({
            "path": log.path.as_ref().map_or("-".to_string(), |p| p.display().to_string()),
            "format": match log.format {
                crate::config::AccessLogFormat::Json => "json",
                crate::config::AccessLogFormat::Combined => "combined",
                crate::config::AccessLogFormat::Line(_) => "line",
            },
            "lines": log.written(),
            "dropped": log.dropped(),
        })
    });
    json!({
        "uptime_s": now.as_secs_f64(),
        "ready": not_ready(shared).is_none(),
        "access_log": access_log,
        "config_file": config.source.as_ref().map(|p| p.display().to_string()),
        "reloads": shared.control.reloads.load(Relaxed),
        "reload_failures": shared.control.reload_failures.load(Relaxed),
        "listeners": listeners,
        "clusters": clusters,
    })
}

/// A time as RFC 3339 (UTC, milliseconds).
fn rfc3339(t: std::time::SystemTime) -> String {
    let mut out = Vec::with_capacity(24);
    crate::observe::access_log::push_rfc3339(&mut out, t);
    String::from_utf8(out).unwrap_or_default()
}

/// A cluster's shared outlier evidence (`null` without `shared`): whether it is exchanged
/// through etcd now or the proxy judges on its own outcomes only, and why.
fn evidence_json(shared: &Shared, cluster: &str) -> serde_json::Value {
    let found = shared
        .control
        .evidence
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(cluster)
        .cloned();
    let Some(e) = found else {
        return serde_json::Value::Null;
    };
    let st = e.state();
    json!({
        "mode": if st.connected { "shared" } else { "local only (etcd unreachable)" },
        "connected": st.connected,
        "last_error": st.last_error,
        "peers": st.peers,
        "published": e.published.load(Relaxed),
        "received": e.received.load(Relaxed),
        "remote_ejections": e.remote_ejections.load(Relaxed),
    })
}

/// A cluster's discovery: its source and how its refreshes went (`null` without discovery).
fn discovery_json(shared: &Shared, cluster: &str) -> serde_json::Value {
    let found = shared
        .control
        .discovery
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(cluster)
        .cloned();
    let Some(d) = found else {
        return serde_json::Value::Null;
    };
    let st = d.state();
    let ago = |t: Option<std::time::SystemTime>| {
        t.and_then(|t| t.elapsed().ok()).map(|e| e.as_secs_f64())
    };
    json!({
        "kind": d.config.kind().as_str(),
        "source": d.config.describe(),
        "refresh_s": (d.config.kind() != crate::config::DiscoveryKind::File)
            .then(|| d.config.refresh().as_secs_f64()),
        "endpoints": st.endpoints.as_ref().map(Vec::len),
        "last_refresh": st.last_refresh.map(rfc3339),
        "last_refresh_ago_s": ago(st.last_refresh),
        "last_change": st.last_change.map(rfc3339),
        // The source's last answer failed and the endpoints are those it gave before.
        "stale": st.last_error.is_some(),
        "last_error": st.last_error.map(|e| e.to_string()),
        "errors": d.errors.load(Relaxed),
    })
}

fn metrics_text(shared: &Shared) -> String {
    let routing = shared.routing.load();
    let config = shared.config.load();
    let views: Vec<ClusterView<'_>> = routing
        .clusters
        .iter()
        .map(|c| ClusterView {
            name: c.name(),
            metrics: &c.metrics,
            panicking: c.balancer.is_panicking(c.now()),
            max_amplification: config.worst_amplification(&c.config),
            engine_signals: c
                .config
                .engine_signals
                .as_ref()
                .map(|s| (c.now(), s.max_age)),
            endpoints: c
                .balancer
                .status(c.now())
                .into_iter()
                .zip(&c.endpoints)
                .map(|(s, e)| (s, e.metrics.clone()))
                .collect(),
        })
        .collect();
    let mut out = metrics::render(
        &views,
        shared.control.reloads.load(Relaxed),
        shared.control.reload_failures.load(Relaxed),
    );
    // A listener is labelled by its bound address (a port 0 is the one it got), from its slot:
    // the route tables are by slot index.
    let slots = shared.listening.all_listeners.load();
    let bound: Vec<String> = (0..routing.listeners.len())
        .map(|i| {
            slots
                .get(i)
                .map_or_else(String::new, |s| s.addr.to_string())
        })
        .collect();
    let routes: Vec<metrics::RouteView<'_>> = routing
        .listeners
        .iter()
        .zip(&bound)
        .flat_map(|(l, addr)| l.targets().map(move |t| (addr, t)))
        .map(|(addr, t)| metrics::RouteView {
            listener: addr,
            route: &t.route.label,
            cluster: t.cluster.name(),
            metrics: &t.route.metrics,
            mirrors: t.route.mirror.is_some(),
        })
        .collect();
    metrics::render_routes(&mut out, &routes);
    metrics::render_process(&mut out);
    if routing.tracing.as_ref().is_some_and(|t| t.export.is_some()) {
        metrics::render_trace_spans(&mut out, &shared.registry.trace_spans);
    }
    {
        use std::fmt::Write as _;
        let discovery = shared
            .control
            .discovery
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !discovery.is_empty() {
            out.push_str("# HELP keel_discovery_errors_total Discovery refreshes that failed (resolver error, timeout, NXDOMAIN, empty answer, unreadable file); the last known endpoints stayed.\n# TYPE keel_discovery_errors_total counter\n");
            let mut names: Vec<_> = discovery.iter().collect();
            names.sort_by(|a, b| a.0.cmp(b.0));
            for (name, d) in &names {
                let _ = writeln!(
                    out,
                    "keel_discovery_errors_total{{cluster=\"{}\"}} {}",
                    metrics::label(name),
                    d.errors.load(Relaxed)
                );
            }
            out.push_str("# HELP keel_discovery_stale 1 while a cluster's discovery source fails (etcd unreachable, DNS error, ...) and the cluster serves the last endpoints it found.\n# TYPE keel_discovery_stale gauge\n");
            for (name, d) in &names {
                let _ = writeln!(
                    out,
                    "keel_discovery_stale{{cluster=\"{}\"}} {}",
                    metrics::label(name),
                    u8::from(d.state().last_error.is_some())
                );
            }
        }
    }
    {
        use std::fmt::Write as _;
        let evidence = shared
            .control
            .evidence
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !evidence.is_empty() {
            out.push_str("# HELP keel_shared_evidence_connected 1 while a cluster's outlier evidence is exchanged through etcd; 0 while the proxy judges on its own outcomes only.\n# TYPE keel_shared_evidence_connected gauge\n");
            let mut names: Vec<_> = evidence.iter().collect();
            names.sort_by(|a, b| a.0.cmp(b.0));
            for (name, e) in &names {
                let _ = writeln!(
                    out,
                    "keel_shared_evidence_connected{{cluster=\"{}\"}} {}",
                    metrics::label(name),
                    u8::from(e.state().connected)
                );
            }
            out.push_str("# HELP keel_shared_evidence_remote_ejections_total Ejections completed by other proxies' evidence.\n# TYPE keel_shared_evidence_remote_ejections_total counter\n");
            for (name, e) in &names {
                let _ = writeln!(
                    out,
                    "keel_shared_evidence_remote_ejections_total{{cluster=\"{}\"}} {}",
                    metrics::label(name),
                    e.remote_ejections.load(Relaxed)
                );
            }
        }
    }
    if !shared.listening.worker_connections.is_empty() {
        use std::fmt::Write as _;
        out.push_str("# HELP keel_worker_connections Client connections open on each worker thread (new ones go to the worker with the fewest).\n# TYPE keel_worker_connections gauge\n");
        for (w, n) in shared.listening.worker_connections.iter().enumerate() {
            let _ = writeln!(
                out,
                "keel_worker_connections{{worker=\"{w}\"}} {}",
                n.load(Relaxed)
            );
        }
    }
    let config = shared.config.load();
    {
        use std::fmt::Write as _;
        out.push_str("# HELP keel_no_route_total Requests answered 404 because no route matched on a listener without a cluster.\n# TYPE keel_no_route_total counter\n");
        for l in shared.listening.listeners.load().iter() {
            let _ = writeln!(
                out,
                "keel_no_route_total{{listener=\"{}\"}} {}",
                l.addr,
                l.not_found.load(Relaxed)
            );
        }
        out.push_str("# HELP keel_connections_parked HTTP/1.1 connections waiting for a request past the quiet spell, holding no buffer or request state.\n# TYPE keel_connections_parked gauge\n");
        for l in shared.listening.listeners.load().iter() {
            let _ = writeln!(
                out,
                "keel_connections_parked{{listener=\"{}\"}} {}",
                l.addr,
                l.parked.load(Relaxed)
            );
        }
    }
    if let Some(log) = &*shared.access_log.load() {
        use std::fmt::Write as _;
        let _ = write!(
            out,
            "# HELP keel_access_log_lines_total Access-log lines written.\n# TYPE keel_access_log_lines_total counter\nkeel_access_log_lines_total {}\n\
             # HELP keel_access_log_dropped_total Access-log lines dropped: the buffer was full (the disk too slow) or the write failed.\n# TYPE keel_access_log_dropped_total counter\nkeel_access_log_dropped_total {}\n",
            log.written(),
            log.dropped()
        );
    }
    let live = shared.listening.listeners.load();
    let tls: Vec<_> = config
        .listeners
        .iter()
        .zip(live.iter())
        .filter(|(c, _)| c.tls.is_some())
        .map(|(_, l)| l)
        .collect();
    if !tls.is_empty() {
        use std::fmt::Write as _;
        out.push_str("# HELP keel_tls_handshake_failures_total TLS handshakes with clients that failed or timed out, by listener.\n# TYPE keel_tls_handshake_failures_total counter\n");
        for l in tls {
            let _ = writeln!(
                out,
                "keel_tls_handshake_failures_total{{listener=\"{}\"}} {}",
                l.addr,
                l.tls_handshake_failures.load(Relaxed)
            );
        }
    }
    let proxied: Vec<_> = config
        .listeners
        .iter()
        .zip(live.iter())
        .filter(|(c, _)| c.proxy_protocol)
        .map(|(_, l)| l)
        .collect();
    if !proxied.is_empty() {
        use std::fmt::Write as _;
        out.push_str("# HELP keel_proxy_protocol_refused_total Connections a proxy_protocol listener closed for their PROXY header, by listener and reason (untrusted peer, malformed, timeout).\n# TYPE keel_proxy_protocol_refused_total counter\n");
        for l in proxied {
            for (k, reason) in crate::state::PROXY_REFUSALS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "keel_proxy_protocol_refused_total{{listener=\"{}\",reason=\"{reason}\"}} {}",
                    l.addr,
                    l.proxy_refused[k].load(Relaxed)
                );
            }
        }
    }
    out
}

fn reload_from_file(shared: &Shared) -> Response<Full<Bytes>> {
    match shared.reload_from_file() {
        Ok(()) => reply(StatusCode::OK, "text/plain; charset=utf-8", "reloaded\n"),
        Err(crate::state::ReloadError::NoFile) => reply(
            StatusCode::CONFLICT,
            "text/plain; charset=utf-8",
            "this proxy was not started from a file; nothing to reload\n",
        ),
        Err(crate::state::ReloadError::Refused(e)) => reply(
            StatusCode::BAD_REQUEST,
            "text/plain; charset=utf-8",
            format!("reload refused, the old configuration keeps serving: {e:#}\n"),
        ),
    }
}

/// Compares in time that depends only on the lengths, not on where the bytes differ, so that
/// a client cannot find the token byte by byte from response times.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for (i, x) in a.iter().enumerate() {
        diff |= u64::from(x ^ b.get(i).copied().unwrap_or(!x));
    }
    diff == 0
}

/// True if the request carries `Authorization: Bearer TOKEN` with the configured token.
fn authorized(token: &str, req: &Request<Incoming>) -> bool {
    let Some(v) = req.headers().get(header::AUTHORIZATION) else {
        return false;
    };
    let v = v.as_bytes();
    let presented = match v.get(..7) {
        Some(p) if p.eq_ignore_ascii_case(b"bearer ") => &v[7..],
        _ => return false,
    };
    constant_time_eq(token.as_bytes(), presented)
}

/// True if `host` (a `Host` value or an `Origin`'s authority, port optional) names the admin
/// listener: an IP address, `localhost`, or one of `[admin] hosts`. A DNS name that merely
/// resolves here (DNS rebinding) is none of those.
fn admin_host(host: &str, names: &[String]) -> bool {
    let name = match host.strip_prefix('[') {
        // `[::1]:9901`
        Some(rest) => {
            return rest
                .split(']')
                .next()
                .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok())
        }
        None => host.rsplit_once(':').map_or(host, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host
            }
        }),
    };
    name.parse::<std::net::IpAddr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || names.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// True if a POST's `Origin` authority is the admin's own site: the `Host` it was sent to
/// (the admin's own page), a loopback name (`localhost`, `127.0.0.0/8`, `::1`), or one of
/// `[admin] hosts`. Any other IP address is another site: a page on `http://10.0.0.5` must
/// not post to the admin.
fn same_site(origin: &str, host: Option<&str>, names: &[String]) -> bool {
    if host.is_some_and(|h| h.eq_ignore_ascii_case(origin)) {
        return true;
    }
    let name = match origin.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => origin.rsplit_once(':').map_or(origin, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
        || names.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// Why a request is refused before it is routed: without a token, `Host` not the admin's (with
/// one, a rebinding page has no token to send); for `POST /reload`, a request a browser could
/// send cross-site (a form, or one whose `Origin` or `Sec-Fetch-Site` says it came from another
/// site).
fn refuse(req: &Request<Incoming>, names: &[String], token: bool) -> Option<&'static str> {
    let text = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
    if let Some(host) = req
        .uri()
        .authority()
        .map(|a| a.as_str())
        .or(text(header::HOST))
    {
        if !token && !admin_host(host, names) {
            return Some("403 Forbidden: Host is not this admin listener (an IP address, localhost, or one of [admin] hosts)\n");
        }
    }
    if req.method() != Method::POST {
        return None;
    }
    if let Some(origin) = text(header::ORIGIN) {
        let authority = origin.split_once("://").map_or(origin, |(_, a)| a);
        let host = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or(text(header::HOST));
        if origin == "null" || !same_site(authority, host, names) {
            return Some("403 Forbidden: cross-site POST refused (Origin is another site)\n");
        }
    }
    if text(header::HeaderName::from_static("sec-fetch-site"))
        .is_some_and(|s| s != "same-origin" && s != "none")
    {
        return Some("403 Forbidden: cross-site POST refused (Sec-Fetch-Site)\n");
    }
    // The content types an HTML form can send cross-site without a CORS preflight.
    let form = text(header::CONTENT_TYPE).is_some_and(|t| {
        let t = t.split(';').next().unwrap_or("").trim();
        [
            "application/x-www-form-urlencoded",
            "multipart/form-data",
            "text/plain",
        ]
        .iter()
        .any(|f| t.eq_ignore_ascii_case(f))
    });
    form.then_some(
        "403 Forbidden: POST with a form content type refused (cross-site request forgery guard); send it with no body: curl -X POST http://ADMIN/reload\n",
    )
}

/// `%XX` escapes decoded (an IPv6 endpoint's brackets may come escaped); `None` if one is
/// malformed or the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `POST /endpoints/{cluster}/{address}/drain` and `/undrain`: keeps one endpoint out of new
/// picks (its requests in flight finish) or puts it back. The drain is keel-balance's
/// ([`keel_balance::Balancer::set_draining`]): it lives with the endpoint, so a reload or a
/// discovery refresh that keeps the endpoint keeps it drained, and it is gone with the
/// endpoint once the endpoint leaves the configuration or discovery (back as new: undrained).
/// `None` if the path is not of this form.
fn drain_endpoint(shared: &Shared, req: &Request<Incoming>) -> Option<Response<Full<Bytes>>> {
    let rest = req.uri().path().strip_prefix("/endpoints/")?;
    let (target, action) = rest.rsplit_once('/')?;
    let on = match action {
        "drain" => true,
        "undrain" => false,
        _ => return None,
    };
    let text = |status, body: String| Some(reply(status, "text/plain; charset=utf-8", body));
    if req.method() != Method::POST {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            format!("use POST /endpoints/CLUSTER/ADDRESS/{action}\n"),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return Some(r);
    }
    let Some((cluster, address)) = target
        .split_once('/')
        .and_then(|(c, a)| Some((percent_decode(c)?, percent_decode(a)?)))
    else {
        return text(
            StatusCode::BAD_REQUEST,
            format!("write POST /endpoints/CLUSTER/ADDRESS/{action} (ADDRESS as in /status)\n"),
        );
    };
    let routing = shared.routing.load();
    let Some(c) = routing.clusters.iter().find(|c| c.name() == cluster) else {
        return text(
            StatusCode::NOT_FOUND,
            format!("no cluster named {cluster:?}\n"),
        );
    };
    let endpoints = c.balancer.endpoints();
    let Some(e) = endpoints.iter().find(|e| e.address() == address) else {
        let known: Vec<_> = endpoints.iter().map(|e| e.address()).collect();
        return text(
            StatusCode::NOT_FOUND,
            format!(
                "cluster {cluster:?} has no endpoint {address:?}; its endpoints: {}\n",
                known.join(", ")
            ),
        );
    };
    c.balancer.set_draining(e.id(), on, c.now());
    if on {
        tracing::info!(cluster = %cluster, endpoint = %address, in_flight = e.in_flight(), "endpoint drained by the admin: no new requests");
    } else {
        tracing::info!(cluster = %cluster, endpoint = %address, "endpoint undrained by the admin: back in the picks");
    }
    Some(reply(
        StatusCode::OK,
        "application/json",
        serde_json::to_vec(&json!({
            "cluster": cluster,
            "address": address,
            "draining": on,
            "in_flight": e.in_flight(),
        }))
        .unwrap_or_default(),
    ))
}

/// `/live`: 200 while the process runs (the admin answers). `/ready`: 200 while it takes new
/// work: 503 until every discovery source delivered its first set of endpoints (before that,
/// its cluster answers every request 503), and from the moment a stop is asked for (SIGTERM:
/// `drain_delay` before the listeners stop accepting; shutdown, upgrade) until it stops, so
/// that a load balancer in front takes this instance out while its requests in flight finish.
fn probe(shared: &Shared, req: &Request<Incoming>) -> Option<Response<Full<Bytes>>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return None;
    }
    let text = "text/plain; charset=utf-8";
    match req.uri().path() {
        "/live" => Some(reply(StatusCode::OK, text, "live\n")),
        "/ready" => Some(match not_ready(shared) {
            Some(why) => reply(StatusCode::SERVICE_UNAVAILABLE, text, why),
            None => reply(StatusCode::OK, text, "ready\n"),
        }),
        _ => None,
    }
}

/// Why `/ready` fails now, if it does.
fn not_ready(shared: &Shared) -> Option<String> {
    if shared.listening.stopping.load(Relaxed) || shared.listening.leaving.load(Relaxed) {
        return Some("draining\n".into());
    }
    let discovery = shared
        .control
        .discovery
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut waiting: Vec<&str> = discovery
        .iter()
        .filter(|(_, d)| d.state().endpoints.is_none())
        .map(|(cluster, _)| cluster.as_str())
        .collect();
    waiting.sort_unstable();
    (!waiting.is_empty()).then(|| {
        format!(
            "waiting for the first endpoints of discovery: cluster {}\n",
            waiting.join(", ")
        )
    })
}

fn route(
    shared: &Shared,
    recent: &Mutex<Recent>,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    let config = shared.config.load();
    let names = config
        .admin
        .as_ref()
        .map_or(&[][..], |a| a.hosts.as_slice());
    let token = config.admin.as_ref().is_some_and(|a| a.token.is_some());
    if let Some(why) = refuse(req, names, token) {
        return reply(StatusCode::FORBIDDEN, "text/plain; charset=utf-8", why);
    }
    // Probes answer without the token: they tell only whether the process runs and takes new
    // work, and a load balancer's or an orchestrator's health check rarely carries a secret.
    if let Some(r) = probe(shared, req) {
        return r;
    }
    if let Some(token) = config.admin.as_ref().and_then(|a| a.token.as_deref()) {
        if !authorized(token, req) {
            let mut r = reply(
                StatusCode::UNAUTHORIZED,
                "text/plain; charset=utf-8",
                "401 Unauthorized: send Authorization: Bearer TOKEN with the token of [admin]\n",
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"keel admin\""),
            );
            return r;
        }
    }
    drop(config);
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => reply(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics_text(shared),
        ),
        (&Method::GET, "/status") => reply(
            StatusCode::OK,
            "application/json",
            serde_json::to_vec_pretty(&status_json(
                shared,
                &recent.lock().unwrap_or_else(|e| e.into_inner()),
            ))
            .unwrap_or_default(),
        ),
        (&Method::GET, "/") => reply(StatusCode::OK, "text/html; charset=utf-8", PAGE),
        (&Method::POST, "/reload") => reload_from_file(shared),
        (_, path) if path.starts_with("/endpoints/") => {
            drain_endpoint(shared, req).unwrap_or_else(|| {
                reply(
                    StatusCode::NOT_FOUND,
                    "text/plain; charset=utf-8",
                    "not found; write POST /endpoints/CLUSTER/ADDRESS/drain or /undrain\n",
                )
            })
        }
        (_, "/reload") => {
            let mut r = reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain; charset=utf-8",
                "use POST /reload\n",
            );
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
            r
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found; try /, /status, /metrics, /live, /ready, POST /reload or POST /endpoints/CLUSTER/ADDRESS/drain\n",
        ),
    }
}

/// Serves the admin listener until shutdown.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    listener: TcpListener,
    mut shutdown: watch::Receiver<Option<Duration>>,
) {
    let mut conns = JoinSet::new();
    // The last minute's figures come from samples of the counters taken here.
    let recent = Arc::new(Mutex::new(Recent::default()));
    let mut sampling = tokio::time::interval(SAMPLE_EVERY);
    sampling.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = wait_shutdown(&mut shutdown) => break,
            _ = sampling.tick() => {
                let routing = shared.routing.load();
                recent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .sample(&routing, std::time::Instant::now());
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let shared = shared.clone();
                let recent = recent.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| {
                        let r = route(&shared, &recent, &req);
                        async move { Ok::<_, Infallible>(r) }
                    });
                    // Bounded like the listeners: a client that never finishes its headers is
                    // closed, oversized headers get 431.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(Duration::from_secs(10))
                        .max_buf_size(crate::config::MIN_HEADER_BYTES * 2)
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        }
    }
    conns.abort_all();
}

const PAGE: &str = r##"<!doctype html>
<html><head><meta charset="utf-8"><title>keel proxy</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right;vertical-align:middle}
th{background:#f3f3f3}td:first-child,td.l{text-align:left}
.bad{background:#fdd}.ej{background:#ffe9b3}small{color:#777}
svg.spark{vertical-align:middle;margin-left:.4em}
code{font-size:13px}
</style></head>
<body>
<h1>keel proxy</h1>
<p><small id="meta">loading /status ...</small> &middot; <a href="/metrics">/metrics</a> &middot; <a href="/status">/status</a></p>
<h2>Listeners</h2>
<div id="listeners"></div>
<div id="clusters"></div>
<p><small>Rates, error rates and latencies cover the last minute (sampled every second; latencies
interpolated inside the histogram buckets of <code>keel_request_duration_seconds</code>). Sparklines:
one point a second, oldest on the left.</small></p>
<script>
function esc(v) { return String(v).replace(/[&<>"']/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;","'":"&#39;"})[c]); }
function f(v, d) { return v === null || v === undefined ? "-" : (typeof v === "number" ? v.toFixed(d) : esc(v)); }
function pct(v) { return v === null || v === undefined ? "-" : (100 * v).toFixed(1) + " %"; }
// A small inline SVG line of `vals` (nulls leave gaps), scaled to its maximum.
function spark(vals, color) {
  const w = 90, h = 20;
  if (!vals || vals.length < 2) return "";
  let max = 0;
  for (const v of vals) if (v !== null && v > max) max = v;
  const step = w / (vals.length - 1);
  let lines = [], cur = [];
  vals.forEach((v, i) => {
    if (v === null) { if (cur.length) lines.push(cur); cur = []; return; }
    const y = max > 0 ? h - 1 - (h - 2) * v / max : h - 1;
    cur.push((i * step).toFixed(1) + "," + y.toFixed(1));
  });
  if (cur.length) lines.push(cur);
  const title = "max " + max.toPrecision(3);
  return "<svg class='spark' width='" + w + "' height='" + h + "' viewBox='0 0 " + w + " " + h + "'><title>" + title + "</title>" +
    "<rect width='" + w + "' height='" + h + "' fill='#fafafa'/>" +
    lines.map(p => p.length === 1 ? "<circle cx='" + p[0].split(",")[0] + "' cy='" + p[0].split(",")[1] + "' r='1.2' fill='" + color + "'/>"
      : "<polyline fill='none' stroke='" + color + "' stroke-width='1.3' points='" + p.join(" ") + "'/>").join("") + "</svg>";
}
function minute(m) {
  if (!m) return "<td>-</td><td>-</td><td>-</td><td>-</td>";
  const s = m.series;
  return "<td>" + f(m.rate_per_s, 1) + spark(s.rate_per_s, "#2563eb") + "</td><td>" + pct(m.error_rate) + spark(s.error_rate, "#dc2626") +
    "</td><td>" + f(m.p50_ms, 1) + "</td><td>" + f(m.p99_ms, 1) + spark(s.p99_ms, "#7c3aed") + "</td>";
}
const MINUTE_HEAD = "<th>req/s</th><th>errors</th><th>p50 ms</th><th>p99 ms</th>";
function ago(s) { return s === null || s === undefined ? "never" : s.toFixed(1) + " s ago"; }
async function refresh() {
  try {
    const s = await (await fetch("/status", {cache: "no-store"})).json();
    document.getElementById("meta").textContent =
      "up " + s.uptime_s.toFixed(0) + " s, reloads " + s.reloads + " (refused " + s.reload_failures + "), config " + (s.config_file || "-") +
      (s.access_log ? ", access log " + s.access_log.path + " (" + s.access_log.lines + " lines, " + s.access_log.dropped + " dropped)" : "");
    let lh = "<table><tr><th>listener</th><th>route</th><th>host</th><th>path</th><th>methods</th><th>headers</th><th>cluster</th><th>overrides</th></tr>";
    for (const l of s.listeners) {
      const head = "<td class='l'>" + esc(l.listen) + (l.tls ? " <small>TLS</small>" : "") + "</td>";
      for (const r of l.routes) {
        const path = r.path !== null ? "= " + esc(r.path) : (r.path_prefix !== null ? esc(r.path_prefix) + "*" : "");
        const hdrs = r.headers ? Object.entries(r.headers).map(([k, v]) => esc(k) + ": " + esc(v)).join(", ") : "";
        const over = [r.request_timeout_ms !== null ? "timeout " + r.request_timeout_ms + " ms" : "", r.retry_attempts !== null ? "retries " + r.retry_attempts : ""].filter(x => x).join(", ");
        lh += "<tr>" + head + "<td>" + r.index + "</td><td class='l'>" + f(r.host) + "</td><td class='l'>" + path + "</td><td class='l'>" +
          (r.methods ? r.methods.map(esc).join(" ") : "") + "</td><td class='l'>" + hdrs + "</td><td class='l'>" + esc(r.cluster) + "</td><td class='l'>" + over + "</td></tr>";
      }
      lh += "<tr>" + head + "<td>" + (l.routes.length ? "otherwise" : "all") + "</td><td colspan='4'></td><td class='l'>" +
        (l.cluster ? esc(l.cluster) : "404 (" + l.not_found + " so far)") + "</td><td></td></tr>";
    }
    document.getElementById("listeners").innerHTML = lh + "</table>";
    let html = "";
    for (const c of s.clusters) {
      html += "<h2>" + esc(c.name) + " <small>" + esc(c.strategy) + (c.panicking ? ", PANIC (health ignored)" : "") +
        ", in flight " + c.in_flight + ", retries " + c.retries + ", budget refusals " + c.retry_budget_refusals + "</small></h2>";
      const d = c.discovery;
      if (d) {
        html += "<p>Endpoints from <code>" + esc(d.source) + "</code>" + (d.refresh_s ? " every " + d.refresh_s + " s" : "") +
          ": last refresh " + ago(d.last_refresh_ago_s) + (d.last_refresh ? " <small>(" + esc(d.last_refresh) + ")</small>" : "") +
          ", " + d.errors + " failed refreshes" + (d.last_error ? "; <b>failing: " + esc(d.last_error) + "</b> (last set kept)" : "") + "</p>";
      }
      html += "<table><tr><th></th>" + MINUTE_HEAD + "</tr><tr><td>cluster (answers to clients)</td>" + minute(c.last_minute) + "</tr></table>";
      html += "<table><tr><th>endpoint</th><th>weight</th><th>healthy</th><th>ejected for ms</th><th>in flight</th><th>latency est. ms</th>" +
        MINUTE_HEAD + "<th>successes</th><th>failures</th></tr>";
      if (!c.endpoints.length) html += "<tr><td colspan='12'>no endpoint: requests are answered 503</td></tr>";
      for (const e of c.endpoints) {
        const cls = !e.healthy ? "bad" : (e.ejected || e.draining ? "ej" : "");
        html += "<tr class='" + cls + "'><td>" + esc(e.address) + "</td><td>" + e.weight + (e.effective_weight !== e.weight ? " <small>(" + f(e.effective_weight, 2) + ")</small>" : "") +
          "</td><td>" + (e.healthy ? "yes" : "NO") + (e.draining ? " <small>(drained)</small>" : "") + "</td><td>" + f(e.ejected_for_ms, 0) +
          "</td><td>" + e.in_flight + "</td><td>" + f(e.latency_estimate_ms, 2) + "</td>" + minute(e.last_minute) + "<td>" + e.successes + "</td><td>" + e.failures + "</td></tr>";
      }
      html += "</table>";
    }
    document.getElementById("clusters").innerHTML = html;
  } catch (err) {
    document.getElementById("meta").textContent = "cannot read /status: " + err;
  }
}
refresh();
setInterval(refresh, 1000);
</script>
<noscript><meta http-equiv="refresh" content="2;url=/status"></noscript>
</body></html>
"##;

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn constant_time_eq_compares_whole_values() {
        assert!(constant_time_eq(b"secret-token-123", b"secret-token-123"));
        assert!(!constant_time_eq(b"secret-token-123", b"secret-token-124"));
        assert!(!constant_time_eq(b"secret-token-123", b"secret-token-12"));
        assert!(!constant_time_eq(b"secret-token-123", b"secret-token-1234"));
        assert!(!constant_time_eq(b"secret-token-123", b""));
    }
}
