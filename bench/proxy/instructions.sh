#!/usr/bin/env bash
# User-space instructions per proxied request of keel, NGINX and HAProxy, counted by valgrind's
# callgrind: a count that does not depend on what else the machine is doing (unlike CPU time on
# a shared machine), for comparing the proxies' own code. The kernel's share (system calls,
# TCP) is not counted here: see `bench/proxy/run.sh --strace` for system calls per request.
#
#   bench/proxy/instructions.sh
#
# Plain HTTP only: over TLS, a proxy runs so slowly under callgrind (OpenSSL's and ring's
# assembly emulated) that the handshakes of wrk's connections outweigh the requests counted.
#
# Each proxy runs alone under callgrind, one worker/thread, in front of one NGINX backend that
# answers a small body; wrk sends keep-alive GETs over 16 connections: 3 s of warm-up, then the
# counters are zeroed, 10 s measured, dumped. Instructions per request = the dump's total /
# requests wrk completed in those 10 s. Under callgrind each proxy runs about 50x slower than
# natively; the count per request is what matters.
#
# Environment: KEEL_BIN (else `cargo build --release -p keel`), OUT (default
# target/proxy-instructions). Ports 22001 and 22010-22012 on 127.0.0.1 (none may be in use
# when it starts).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage_from_header; exit 0 ;;
        *) echo "instructions.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
want_pkg valgrind valgrind
want_pkg nginx nginx
want_pkg haproxy haproxy
want_pkg wrk wrk
install_wanted
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
OUT="${OUT:-$REPO/target/proxy-instructions}"
mkdir -p "$OUT"
ports_free 22001 22010 22011 22012
bench_workdir keel-instr
W="$WORK"

plain_proxy_setup "$W"

count() { # name port command...
    local name="$1" port="$2"; shift 2
    rm -f "$OUT/$name.callgrind"*
    valgrind --tool=callgrind --callgrind-out-file="$OUT/$name.callgrind" "$@" >"$OUT/$name.log" 2>&1 &
    local vp=$!
    STARTED+=("$vp")
    # Under valgrind a proxy takes seconds to start.
    wait_port "$port" 120 || { cat "$OUT/$name.log" >&2; return 1; }
    wrk -t1 -c16 -d3s "http://127.0.0.1:$port/" >/dev/null
    callgrind_control -z "$vp" >/dev/null
    wrk -t1 -c16 -d10s "http://127.0.0.1:$port/" >"$OUT/$name.wrk"
    callgrind_control -d "$vp" >/dev/null
    sleep 1
    stop_pid "$vp" 60
    local req ir
    req="$(grep -oP '\d+(?= requests in)' "$OUT/$name.wrk")"
    ir="$(grep -h '^totals:' "$OUT/$name.callgrind.1" | awk '{print $2}')"
    printf '%s\t%s\t%s\t%s\n' "$name" "$req" "$ir" "$((ir / req))"
}

echo "# user-space instructions per request (http, 1 worker, wrk -c16, callgrind); columns: proxy, requests, instructions, per request" | tee "$OUT/instructions.tsv"
count keel 22010 "$KEEL_BIN" proxy --config "$W/keel.toml" --workers 1 --log warn | tee -a "$OUT/instructions.tsv"
count nginx 22011 nginx -p "$W" -c "$W/nginx.conf" | tee -a "$OUT/instructions.tsv"
count haproxy 22012 haproxy -db -f "$W/haproxy.cfg" | tee -a "$OUT/instructions.tsv"
awk -F'\t' 'NR > 1 { n[$1] = $4 } END { printf "keel / NGINX %.2f, keel / HAProxy %.2f\n", n["keel"] / n["nginx"], n["keel"] / n["haproxy"] }' "$OUT/instructions.tsv"
