#!/usr/bin/env bash
# Two keel builds side by side on HTTP/2 clients: CPU per request (the proxy's user + system
# time from /proc) and req/s, rounds alternated A, B, A, B... in one run; with CALLGRIND=1,
# instructions per request instead (valgrind's callgrind: exact, immune to a loaded machine,
# but it counts memcpy per byte, so it overweights copies).
#
#   bench/proxy/h2-ab.sh OLD_KEEL NEW_KEEL
#
# Scenarios: h2c (h2load's HTTP/2 clients -> keel -> two h2c endpoints, h2-backend) and h1
# (-> one HTTP/1.1 endpoint, NGINX). One keel worker pinned to CPU 0; h2load and the endpoints
# on CPU 1. Environment (optional): ROUNDS (3), REQUESTS (200000; 20000 with CALLGRIND),
# BACKEND_BIN (else built), PORT_BASE (22100: ports +1, +5, +6, +10, +11). Loopback only;
# everything started here is stopped on exit.
set -euo pipefail

[ $# -eq 2 ] || { echo "usage: $0 OLD_KEEL NEW_KEEL" >&2; exit 2; }
A="$1"; B="$2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
ROUNDS="${ROUNDS:-3}"
CALLGRIND="${CALLGRIND:-}"
REQUESTS="${REQUESTS:-$([ -n "$CALLGRIND" ] && echo 20000 || echo 200000)}"
PB="${PORT_BASE:-22100}"
NGINX_PORT=$((PB + 1)); H2_PORTS=($((PB + 5)) $((PB + 6))); H1_LISTEN=$((PB + 10)); H2_LISTEN=$((PB + 11))

missing=()
command -v h2load >/dev/null || missing+=(nghttp2-client)
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null || missing+=(nginx)
[ -z "$CALLGRIND" ] || command -v valgrind >/dev/null || missing+=(valgrind)
if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
export PATH="$PATH:/usr/sbin:/sbin"
if [ -z "${BACKEND_BIN:-}" ]; then
    (cd "$REPO" && cargo build --release -p keel-grpc-tests --bin h2-backend --quiet)
    BACKEND_BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/h2-backend"
fi

WORK="$(mktemp -d /tmp/keel-h2-ab.XXXXXX)"
STARTED=()
cleanup() {
    set +e
    for pid in "${STARTED[@]}"; do kill "$pid" 2>/dev/null; done
    sleep 0.3
    for pid in "${STARTED[@]}"; do kill -9 "$pid" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
wait_port() {
    local deadline=$((SECONDS + 30))
    until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "h2-ab.sh: nothing listens on port $1" >&2; exit 1; }
        sleep 0.1
    done
}

cat >"$WORK/nginx.conf" <<EOF
daemon off; master_process off; worker_processes 1; pid $WORK/nginx.pid;
error_log $WORK/nginx.err warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 10000000; keepalive_timeout 120s; default_type text/plain;
  server { listen 127.0.0.1:$NGINX_PORT backlog=4096; location / { return 200 "backend 0: ok\n"; } } }
EOF
taskset -c 1 nginx -p "$WORK" -c "$WORK/nginx.conf" -e "$WORK/nginx.err" & STARTED+=("$!")
for p in "${H2_PORTS[@]}"; do taskset -c 1 "$BACKEND_BIN" "$p" >/dev/null 2>&1 & STARTED+=("$!"); done
for p in "$NGINX_PORT" "${H2_PORTS[@]}"; do wait_port "$p"; done
cat >"$WORK/keel.toml" <<EOF
[[listener]]
listen = "127.0.0.1:$H2_LISTEN"
cluster = "h2c"
[[listener]]
listen = "127.0.0.1:$H1_LISTEN"
cluster = "h1"
[[cluster]]
name = "h2c"
protocol = "h2c"
endpoints = [{ address = "127.0.0.1:${H2_PORTS[0]}" }, { address = "127.0.0.1:${H2_PORTS[1]}" }]
[[cluster]]
name = "h1"
endpoints = [{ address = "127.0.0.1:$NGINX_PORT" }]
EOF

load() { taskset -c 1 h2load -c 16 -m 10 -n "$2" "http://127.0.0.1:$1/"; }

run_cpu() { # bin label
    taskset -c 0 "$1" proxy --config "$WORK/keel.toml" --workers 1 >"$WORK/keel-$2.log" 2>&1 &
    local pid=$! s port before after rps
    wait_port "$H2_LISTEN"
    for s in h2c h1; do
        port=$([ "$s" = h2c ] && echo "$H2_LISTEN" || echo "$H1_LISTEN")
        load "$port" 5000 >/dev/null 2>&1
        before=$(awk '{print $14 + $15}' "/proc/$pid/stat")
        rps=$(load "$port" "$REQUESTS" | awk '/finished in/ {print $4}')
        after=$(awk '{print $14 + $15}' "/proc/$pid/stat")
        awk -v b="$before" -v a="$after" -v t="$(getconf CLK_TCK)" -v n="$REQUESTS" -v l="$2" -v s="$s" -v r="$rps" \
            'BEGIN { printf "%s\t%s\t%s\t%.2f\n", l, s, r, (a - b) * 1e6 / t / n }' 
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
}

run_callgrind() { # bin label
    local s port out ir
    for s in h2c h1; do
        port=$([ "$s" = h2c ] && echo "$H2_LISTEN" || echo "$H1_LISTEN")
        out="$WORK/cg-$2-$s.out"
        valgrind --tool=callgrind --callgrind-out-file="$out" "$1" proxy --config "$WORK/keel.toml" \
            --workers 1 >"$WORK/keel-$2.log" 2>&1 &
        local pid=$!
        wait_port "$port"
        load "$port" 2000 >/dev/null 2>&1
        callgrind_control -z "$pid" >/dev/null 2>&1
        load "$port" "$REQUESTS" >/dev/null 2>&1
        callgrind_control -d "$pid" >/dev/null 2>&1
        kill "$pid"; wait "$pid" 2>/dev/null || true
        ir=$(callgrind_annotate "$(ls -t "$out".* | head -1)" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
        printf '%s\t%s\t%d\n' "$2" "$s" "$((ir / REQUESTS))"
    done
}

if [ -n "$CALLGRIND" ]; then
    printf 'build\tscenario\tinstructions_per_request\n'
    for r in $(seq "$ROUNDS"); do run_callgrind "$A" old; run_callgrind "$B" new; done
else
    printf 'build\tscenario\treq_per_s\tcpu_us_per_request\n'
    for r in $(seq "$ROUNDS"); do run_cpu "$A" old; run_cpu "$B" new; done
fi
