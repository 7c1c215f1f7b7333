#!/usr/bin/env bash
# gzip's cost in keel and in NGINX: both proxies, one worker each on the same CPU, serve the
# same 100 KB text page from one NGINX endpoint (which never compresses) to wrk, which asks
# with `Accept-Encoding: gzip`; keel with `compression = { algorithms = ["gzip"],
# gzip_level = 1 }`, NGINX with `gzip on; gzip_comp_level 1`. Runs alternate (keel, nginx,
# keel, ...) so that the machine's drift hits both alike. For each run: the proxy's CPU
# seconds (utime + stime from /proc/PID/stat) per MB of page compressed, the bytes a
# response took on the wire, and requests a second; then the medians and keel/NGINX ratios.
# A last run of each without `Accept-Encoding` gives the cost of proxying alone.
#
#   bench/compress.sh
#
# Environment (all optional):
#   KEEL_BIN          keel binary (default: `cargo build --release -p keel`, from CARGO_TARGET_DIR)
#   ROUNDS DURATION   rounds (one keel and one NGINX run each) and seconds per run (default 3, 5)
#   CONNS             wrk connections (default 16)
#   PROXY_CPUS LOAD_CPUS  CPU of the proxies, and of wrk and the endpoint (default 0 and 1)
#   LEVEL             gzip level of both (default 1)
#
# Listens on 127.0.0.1 ports 21201-21203; everything is stopped on exit.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-5}"
CONNS="${CONNS:-16}"
PROXY_CPUS="${PROXY_CPUS:-0}"
LOAD_CPUS="${LOAD_CPUS:-1}"
LEVEL="${LEVEL:-1}"
ENDPOINT=21201 KEEL=21202 NGINX=21203

want_pkg nginx nginx
want_pkg wrk wrk
want_pkg curl curl
install_wanted
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
ports_free "$ENDPOINT" "$KEEL" "$NGINX"
bench_workdir keel-compress-bench

# The page: 100,000 bytes of HTML-like lines that differ (as a page's do), not one repeated.
mkdir -p "$WORK/www" "$WORK/endpoint" "$WORK/nginx" "$WORK/keel"
awk 'BEGIN { while (n < 100000) { l = sprintf("<p>line %d: the quick brown fox %d</p>\n", i, (i * 7919) % 1000); printf "%s", l; n += length(l); i++ } }' |
    head -c 100000 >"$WORK/www/page.html"
PAGE_BYTES="$(wc -c <"$WORK/www/page.html")"

cat >"$WORK/endpoint/nginx.conf" <<EOF
daemon off; master_process off; worker_processes 1; pid $WORK/endpoint/nginx.pid;
error_log $WORK/endpoint/error.log warn;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 10000000; keepalive_timeout 120s; gzip off;
  types { text/html html; }
  server { listen 127.0.0.1:$ENDPOINT backlog=4096; root $WORK/www; } }
EOF
taskset -c "$LOAD_CPUS" nginx -p "$WORK/endpoint" -c "$WORK/endpoint/nginx.conf" -e "$WORK/endpoint/error.log" &
STARTED+=("$!")
wait_port "$ENDPOINT" 5

cat >"$WORK/nginx/nginx.conf" <<EOF
daemon off; master_process off; worker_processes 1; pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 10000000; keepalive_timeout 120s;
  gzip on; gzip_comp_level $LEVEL; gzip_proxied any; gzip_min_length 256;
  upstream app { server 127.0.0.1:$ENDPOINT; keepalive 64; }
  server { listen 127.0.0.1:$NGINX backlog=4096;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
EOF
cat >"$WORK/keel/keel.toml" <<EOF
[[listener]]
listen = "127.0.0.1:$KEEL"
cluster = "app"

[[cluster]]
name = "app"
endpoints = [{ address = "127.0.0.1:$ENDPOINT" }]
compression = { algorithms = ["gzip"], gzip_level = $LEVEL }
EOF

start_proxy() { # keel|nginx -> sets PID, PORT
    if [ "$1" = keel ]; then
        taskset -c "$PROXY_CPUS" "$KEEL_BIN" proxy --config "$WORK/keel/keel.toml" --workers 1 \
            --log warn >"$WORK/keel/keel.out" 2>&1 &
        PID="$!" PORT="$KEEL"
    else
        taskset -c "$PROXY_CPUS" nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" \
            -e "$WORK/nginx/error.log" &
        PID="$!" PORT="$NGINX"
    fi
    STARTED+=("$PID")
    wait_port "$PORT" 5
}

# One run: "cpu_s_per_mb wire_bytes_per_response requests_per_s"; `plain` sends no
# Accept-Encoding.
run() { # keel|nginx [plain]
    local header=(-H "Accept-Encoding: gzip") wire
    [ "${2:-}" != plain ] || header=()
    start_proxy "$1"
    # The page as the client gets it, checked whole: decoded, it is the endpoint's.
    if [ "${2:-}" != plain ]; then
        curl -sf "${header[@]}" -o "$WORK/$1.gz" "http://127.0.0.1:$PORT/page.html"
        gzip -dc <"$WORK/$1.gz" | cmp -s - "$WORK/www/page.html" ||
            { echo "$BENCH: $1's gzip does not decode to the page" >&2; exit 1; }
        wire="$(wc -c <"$WORK/$1.gz")"
    else
        wire="$PAGE_BYTES"
    fi
    taskset -c "$LOAD_CPUS" wrk -t1 -c"$CONNS" -d1s "${header[@]}" "http://127.0.0.1:$PORT/page.html" >/dev/null
    local before after out
    before="$(cpu_ticks "$PID")"
    out="$(taskset -c "$LOAD_CPUS" wrk -t1 -c"$CONNS" -d"${DURATION}s" "${header[@]}" \
        "http://127.0.0.1:$PORT/page.html")"
    after="$(cpu_ticks "$PID")"
    stop_pid "$PID"
    local requests
    requests="$(awk '/requests in/ {print $1}' <<<"$out")"
    awk -v t=$((after - before)) -v hz="$CLK_TCK" -v n="$requests" -v page="$PAGE_BYTES" \
        -v wire="$wire" -v d="$DURATION" \
        'BEGIN { printf "%.5f %d %.0f\n", (t / hz) / (n * page / 1e6), wire, n / d }'
}

median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

: >"$WORK/keel.txt"
: >"$WORK/nginx.txt"
for r in $(seq "$ROUNDS"); do
    for p in keel nginx; do
        read -r cpu wire rps < <(run "$p")
        printf 'round %d: %-5s gzip %d: %.4f CPU s/MB, %d bytes a response, %.0f req/s\n' \
            "$r" "$p" "$LEVEL" "$cpu" "$wire" "$rps"
        echo "$cpu $wire $rps" >>"$WORK/$p.txt"
    done
done
for p in keel nginx; do
    read -r cpu wire rps < <(run "$p" plain)
    printf 'plain: %-5s no gzip: %.4f CPU s/MB, %.0f req/s\n' "$p" "$cpu" "$rps"
    echo "$cpu" >"$WORK/$p.plain"
done
k_cpu="$(cut -d' ' -f1 "$WORK/keel.txt" | median)"
n_cpu="$(cut -d' ' -f1 "$WORK/nginx.txt" | median)"
k_wire="$(cut -d' ' -f2 "$WORK/keel.txt" | median)"
n_wire="$(cut -d' ' -f2 "$WORK/nginx.txt" | median)"
awk -v kc="$k_cpu" -v nc="$n_cpu" -v kw="$k_wire" -v nw="$n_wire" -v page="$PAGE_BYTES" \
    -v kp="$(cat "$WORK/keel.plain")" -v np="$(cat "$WORK/nginx.plain")" 'BEGIN {
    printf "median CPU s per MB compressed: keel %.4f, nginx %.4f, keel/nginx = %.2f\n", kc, nc, kc / nc
    printf "without compression:            keel %.4f, nginx %.4f\n", kp, np
    printf "compression alone (difference):  keel %.4f, nginx %.4f, keel/nginx = %.2f\n", kc - kp, nc - np, (kc - kp) / (nc - np)
    printf "bytes a response: keel %d, nginx %d (page %d; keel/nginx = %.3f)\n", kw, nw, page, kw / nw }'
