#!/usr/bin/env bash
# keel's HTTP/3 front end against a real HTTP/3 client: Python's aioquic (and httpx for the
# HTTP/2 side), installed with pip in a venv under ~/.cache/keel/peers (kept between runs, the
# one scripts/advise-validate.sh makes for Envoy). A `keel proxy` with a TLS listener and
# `h3 = true` on loopback, in front of an echo server and an endpoint that fails once
# (scripts/h3-client.py): the same requests over HTTP/3 and HTTP/2 must get the same answers
# (status, headers, body) through a route, a retry and the access log; then 10,000 requests
# over 10 HTTP/3 connections must all succeed. Traffic stays on loopback.
# Usage: bash scripts/test-h3.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install-lib.sh
log() { echo "test-h3: $*" >&2; }
venv="${KEEL_PEERS_VENV:-$HOME/.cache/keel/peers}"
if ! "$venv/bin/python" -c 'import aioquic, httpx, h2' 2>/dev/null; then
    log "installing aioquic and httpx[http2] into $venv (pip, once)"
    make_venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check aioquic 'httpx[http2]'
fi
need=()
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]} (apt)"
    apt_install "${need[@]}"
fi
py="$venv/bin/python"
log "aioquic $("$py" -c 'import aioquic; print(aioquic.__version__)')"
cargo build --release -p keel >&2
keel=target/release/keel

dir="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT

# A CA and a certificate for localhost and 127.0.0.1.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=keel test CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
    -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$dir/ext"
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 2 -extfile "$dir/ext" -out "$dir/server.pem" 2>/dev/null

"$py" scripts/h3-client.py backends "$dir/echo.port" "$dir/flaky.port" &
pids+=($!)
for _ in $(seq 100); do [ -s "$dir/flaky.port" ] && break; sleep 0.05; done
echo_port="$(cat "$dir/echo.port")"
flaky_port="$(cat "$dir/flaky.port")"

# A free port for TCP and UDP alike (the listener takes both).
port="$("$py" -c '
import socket
while True:
    t = socket.socket(); t.bind(("127.0.0.1", 0)); p = t.getsockname()[1]
    u = socket.socket(type=socket.SOCK_DGRAM)
    try:
        u.bind(("127.0.0.1", p)); print(p); break
    except OSError:
        pass
')"
cat >"$dir/keel.toml" <<EOF
[access_log]
path = "$dir/access.log"
format = "json"

[[listener]]
listen = "127.0.0.1:$port"
cluster = "echo"
h3 = true

[listener.tls]
cert = "$dir/server.pem"
key = "$dir/server.key"

[[listener.route]]
path_prefix = "/flaky"
cluster = "flaky"

[[cluster]]
name = "echo"
response_headers = { endpoint = true }
endpoints = [{ address = "127.0.0.1:$echo_port" }]

[[cluster]]
name = "flaky"
response_headers = { endpoint = true }
endpoints = [{ address = "127.0.0.1:$flaky_port" }]
[cluster.retry]
attempts = 2
budget_percent = 100
EOF
"$keel" proxy --config "$dir/keel.toml" --log warn &
pids+=($!)
for _ in $(seq 100); do
    curl -sk -o /dev/null "https://127.0.0.1:$port/" && break
    sleep 0.05
done

log "the same requests over HTTP/3 (aioquic) and HTTP/2 (httpx)"
"$py" scripts/h3-client.py compare "$port" "$dir/ca.pem" "$dir/access.log"
log "10,000 requests over 10 HTTP/3 connections"
"$py" scripts/h3-client.py load "$port" "$dir/ca.pem" 10 10000 10 /echo
echo "1 passed, 0 failed"
