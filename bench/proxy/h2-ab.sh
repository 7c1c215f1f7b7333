#!/usr/bin/env bash
# Two keel builds side by side on HTTP/2 clients: CPU per request (the proxy's user + system
# time from /proc) and req/s, rounds alternated A, B, A, B... in one run; with CALLGRIND=1,
# instructions per request instead (valgrind's callgrind: exact, immune to a loaded machine,
# but it counts memcpy per byte, so it overweights copies).
#
#   bench/proxy/h2-ab.sh OLD_KEEL NEW_KEEL
#
# Scenarios: h2c (h2load's HTTP/2 clients -> keel -> two h2c endpoints, h2-backend), h1
# (-> one HTTP/1.1 endpoint, NGINX) and h1-h2c (h2load's HTTP/1.1 clients, `--h1`, -> the h2c
# endpoints: an HTTP/1.1 client's head turned into HTTP/2). One keel worker pinned to CPU 0; h2load and the endpoints
# on CPU 1. Environment (optional): ROUNDS (3), REQUESTS (200000; 20000 with CALLGRIND),
# BACKEND_BIN (else built), PORT_BASE (22100: ports +1, +5, +6, +10, +11). Loopback only;
# none of those may be in use when it starts; everything started here is stopped on exit.
set -euo pipefail

[ $# -eq 2 ] || { echo "usage: $0 OLD_KEEL NEW_KEEL" >&2; exit 2; }
A="$1"; B="$2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
ROUNDS="${ROUNDS:-3}"
CALLGRIND="${CALLGRIND:-}"
REQUESTS="${REQUESTS:-$([ -n "$CALLGRIND" ] && echo 20000 || echo 200000)}"
PB="${PORT_BASE:-22100}"
NGINX_PORT=$((PB + 1)); H2_PORTS=($((PB + 5)) $((PB + 6))); H1_LISTEN=$((PB + 10)); H2_LISTEN=$((PB + 11))

want_pkg h2load nghttp2-client
want_pkg nginx nginx
[ -z "$CALLGRIND" ] || want_pkg valgrind valgrind
install_wanted
BACKEND_BIN="$(binary_or_build "${BACKEND_BIN:-}" keel-grpc-tests h2-backend)"
ports_free "$NGINX_PORT" "${H2_PORTS[@]}" "$H1_LISTEN" "$H2_LISTEN"

bench_workdir keel-h2-ab
nginx_backend "$WORK/nginx" "$NGINX_PORT" 'backend 0: ok\n'
taskset -c 1 nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" & STARTED+=("$!")
for p in "${H2_PORTS[@]}"; do taskset -c 1 "$BACKEND_BIN" "$p" >/dev/null 2>&1 & STARTED+=("$!"); done
for p in "$NGINX_PORT" "${H2_PORTS[@]}"; do wait_port "$p" 30; done
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

SCENARIOS="h2c h1 h1-h2c"
port_of() { case "$1" in h1) echo "$H1_LISTEN" ;; *) echo "$H2_LISTEN" ;; esac; }
# HTTP/1.1 clients pipeline nothing: one request at a time on each of 16 connections.
load() { # scenario requests
    case "$1" in
        h1-h2c) taskset -c 1 h2load --h1 -c 16 -m 1 -n "$2" "http://127.0.0.1:$(port_of "$1")/" ;;
        *) taskset -c 1 h2load -c 16 -m 10 -n "$2" "http://127.0.0.1:$(port_of "$1")/" ;;
    esac
}

run_cpu() { # bin label
    taskset -c 0 "$1" proxy --config "$WORK/keel.toml" --workers 1 >"$WORK/keel-$2.log" 2>&1 &
    local pid=$! s before after rps
    wait_port "$H2_LISTEN" 30
    for s in $SCENARIOS; do
        load "$s" 5000 >/dev/null 2>&1
        before=$(cpu_ticks "$pid")
        rps=$(load "$s" "$REQUESTS" | awk '/finished in/ {print $4}')
        after=$(cpu_ticks "$pid")
        awk -v b="$before" -v a="$after" -v t="$CLK_TCK" -v n="$REQUESTS" -v l="$2" -v s="$s" -v r="$rps" \
            'BEGIN { printf "%s\t%s\t%s\t%.2f\n", l, s, r, (a - b) * 1e6 / t / n }'
    done
    stop_pid "$pid"
}

run_callgrind() { # bin label
    local s out ir
    for s in $SCENARIOS; do
        out="$WORK/cg-$2-$s.out"
        valgrind --tool=callgrind --callgrind-out-file="$out" "$1" proxy --config "$WORK/keel.toml" \
            --workers 1 >"$WORK/keel-$2.log" 2>&1 &
        local pid=$!
        wait_port "$(port_of "$s")" 30
        load "$s" 2000 >/dev/null 2>&1
        callgrind_control -z "$pid" >/dev/null 2>&1
        load "$s" "$REQUESTS" >/dev/null 2>&1
        callgrind_control -d "$pid" >/dev/null 2>&1
        stop_pid "$pid" 60 # valgrind writes its last dump on the way out
        ir=$(callgrind_annotate "$(ls -t "$out".* | head -1)" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
        printf '%s\t%s\t%d\n' "$2" "$s" "$((ir / REQUESTS))"
    done
}

if [ -n "$CALLGRIND" ]; then
    printf 'build\tscenario\tinstructions_per_request\n'
    for _ in $(seq "$ROUNDS"); do run_callgrind "$A" old; run_callgrind "$B" new; done
else
    printf 'build\tscenario\treq_per_s\tcpu_us_per_request\n'
    for _ in $(seq "$ROUNDS"); do run_cpu "$A" old; run_cpu "$B" new; done
fi
