#!/usr/bin/env bash
# Does `keel advise --log-format nginx` predict what NGINX then does? In front of five
# `keel backend`s, one of them failing (FAULT), NGINX runs as first written (its defaults: round
# robin, `max_fails=1 fail_timeout=10s`, `proxy_next_upstream error timeout`) and logs in the
# format docs/advise.md recommends; advise reads that log and recommends an NGINX configuration
# with a predicted success interval; NGINX then runs that configuration under the same client and
# the measured success is set beside the prediction.
#
#   scripts/advise-nginx-check.sh
#
# Environment (all optional):
#   KEEL_BIN   keel binary (default: target/release/keel, built when missing)
#   FAULT      the failing backend's --fault (default server-error: a 500 at once; fail-fast is
#              a 503, hang hangs)
#   REQUESTS   requests per run (default 4000); CLIENTS concurrent keep-alive clients (default 4)
#   PORT_BASE  backends on PORT_BASE+1..5, NGINX on PORT_BASE+10 (default 21200)
# NGINX comes from scripts/install-peers.sh when it is not installed. Traffic stays on 127.0.0.1.
# Last line: one JSON object; the exit status is 1 when the measurement falls outside the
# prediction (the two 95 % intervals do not overlap).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
FAULT="${FAULT:-server-error}"
REQUESTS="${REQUESTS:-4000}"
CLIENTS="${CLIENTS:-4}"
P="${PORT_BASE:-21200}"
NGINX_PORT=$((P + 10))
log() { printf '[advise-nginx] %s\n' "$*" >&2; }

KEEL_BIN="${KEEL_BIN:-target/release/keel}"
if [ ! -x "$KEEL_BIN" ]; then
    log "building keel (cargo build --release)"
    cargo build --release -q
fi
command -v nginx >/dev/null || bash scripts/install-peers.sh nginx >/dev/null
command -v nginx >/dev/null || { log "no nginx (scripts/install-peers.sh nginx failed)"; exit 1; }

WORK="$(mktemp -d /tmp/keel-advise-nginx.XXXXXX)"
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
    for i in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    log "nothing listens on port $1"; return 1
}

# Four healthy backends (4 ms, exponential) and one failing.
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
write_conf() { # upstream-block location-directives log
    mkdir -p "$WORK/nginx"
    cat >"$WORK/nginx/nginx.conf" <<EOF
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
        listen 127.0.0.1:$NGINX_PORT;
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
$2
        }
    }
}
EOF
}

run_nginx() { # label: starts NGINX on the written conf, runs the client, stops NGINX; prints ok total
    nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" &
    local pid=$!
    wait_port "$NGINX_PORT"
    python3 - "$NGINX_PORT" "$REQUESTS" "$CLIENTS" <<'PY'
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
    kill "$pid"; wait "$pid" 2>/dev/null || true
}

UPSTREAM_FIRST="    upstream app {
$(for i in 1 2 3 4 5; do echo "        server 127.0.0.1:$((P + i));"; done)
        keepalive 16;
    }"
write_conf "$UPSTREAM_FIRST" "" "$WORK/first.log"
log "NGINX as first written (round robin, max_fails=1 fail_timeout=10s, proxy_next_upstream error timeout), one backend --fault $FAULT: $REQUESTS requests, $CLIENTS clients"
read -r ok1 n1 < <(run_nginx)
log "  measured: $ok1 of $n1 succeeded"

log "keel advise --log-format nginx on that log"
"$KEEL_BIN" advise --log-format nginx --access-log "$WORK/first.log" --nginx-log-format "$FORMAT" \
    --json --quiet >"$WORK/advice.json" 2>"$WORK/advise.err" \
    || "$KEEL_BIN" advise --log-format nginx --access-log "$WORK/first.log" --nginx-log-format "$FORMAT" \
        --json >"$WORK/advice.json" 2>"$WORK/advise.err" \
    || { cat "$WORK/advise.err" >&2; exit 1; }

# The recommendation: its upstream block (up to the comment after it) and its location lines.
python3 - "$WORK/advice.json" "$WORK" <<'PY'
import json, sys, os
a = json.load(open(sys.argv[1]))
best = a["ranking"][0]
text = best.get("config") or best["cluster_toml"]
head, _, rest = text.partition("# in each location")
rest = rest.split("\n", 1)[1] if "\n" in rest else ""
upstream = "\n".join("    " + l for l in head.splitlines() if not l.startswith("#"))
location = "\n".join("            " + l for l in rest.splitlines() if l.strip())
open(os.path.join(sys.argv[2], "upstream.conf"), "w").write(upstream + "\n")
open(os.path.join(sys.argv[2], "location.conf"), "w").write(location + "\n")
open(os.path.join(sys.argv[2], "recommended.txt"), "w").write(
    f"{best['strategy']} / {best['protections']}\t{best['success'][0]}\t{best['success'][1]}\t{best['success'][2]}\n")
PY
IFS=$'\t' read -r label pred lo hi <"$WORK/recommended.txt"
log "  recommends: $label, predicted success $pred [$lo, $hi]"
sed 's/^/    | /' "$WORK/upstream.conf" "$WORK/location.conf" >&2

write_conf "$(cat "$WORK/upstream.conf")" "$(cat "$WORK/location.conf")" "$WORK/second.log"
nginx -t -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" 2>"$WORK/nginx-t.log" \
    || { cat "$WORK/nginx-t.log" >&2; log "the recommended configuration does not load in NGINX"; exit 1; }
log "NGINX with the recommended configuration: $REQUESTS requests, $CLIENTS clients"
read -r ok2 n2 < <(run_nginx)

python3 - "$ok1" "$n1" "$ok2" "$n2" "$pred" "$lo" "$hi" "$label" "$FAULT" <<'PY'
import json, math, sys
ok1, n1, ok2, n2 = map(int, sys.argv[1:5])
pred, lo, hi = map(float, sys.argv[5:8])
label, fault = sys.argv[8], sys.argv[9]
def wilson(k, n, z=1.96):
    if n == 0:
        return (0.0, 1.0)
    p = k / n; d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d; h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))
m1, m2 = ok1 / n1, ok2 / n2
w2 = wilson(ok2, n2)
agree = w2[0] <= hi and lo <= w2[1]
print(f"{'Agrees' if agree else 'Disagrees'}: advise predicted {pred:.4f} [{lo:.4f}, {hi:.4f}] for NGINX with "
      f"{label}; NGINX measured {m2:.4f} [{w2[0]:.4f}, {w2[1]:.4f}] ({ok2} of {n2}), up from {m1:.4f} as first "
      f"written (one backend of five: {fault}).")
print(json.dumps({"fault": fault, "first_written": m1, "recommended": label, "predicted": [pred, lo, hi],
                  "measured": [m2, w2[0], w2[1]], "requests": n2, "agrees": agree}))
sys.exit(0 if agree else 1)
PY
