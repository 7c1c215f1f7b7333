#!/usr/bin/env bash
# HTTP/2 benchmark: h2load's HTTP/2 clients through keel, NGINX, HAProxy, Envoy and the floor
# (crates/keel-grpc-tests/src/bin/h2-floor.rs: a bare pass-through proxy on the crates keel
# uses, hyper's HTTP/2 server and h2's client, one thread: what keel's cost cannot go under
# without changing those crates), in one run, to
#   h1    four HTTP/1.1 endpoints (NGINX, a fixed body from memory): the common edge;
#   h2c   four h2c endpoints (crates/keel-grpc-tests/src/bin/h2-backend.rs);
#   grpc  gRPC unary calls (grpc.health.v1.Health/Check) to the same h2c endpoints
#         (NGINX: grpc_pass; HAProxy: proto h2; keel: protocol = "h2c").
# Reports req/s, p99 (from h2load's per-request log) and CPU per request (the proxy's user +
# system time from /proc over the run, divided by the requests).
#
#   bench/proxy/h2.sh
#
# Environment (all optional):
#   KEEL_BIN, BACKEND_BIN, FLOOR_BIN  binaries to use instead of `cargo build --release`
#   KEEL_BEFORE  another keel binary (an older build: "before"); it runs as one more proxy,
#              keel-before, with keel's configuration on its own ports (PORT_BASE + 27-29), in
#              the same rounds, measured right after keel in each scenario; the table gains its
#              rows and a last one gives, per scenario, keel's req/s and CPU per request over
#              keel-before's (after/before: medians of the per-round ratios, with their range)
#   ROUNDS     rounds per point (default 3)
#   REQUESTS   requests per h2load run (default 200000)
#   CLIENTS STREAMS  h2load -c and -m (default 16 and 10)
#   PROXY_CPUS LOAD_CPUS   CPUs of the proxies, and of h2load and the backends (default 0 and 1)
#   OUT        where raw results go (default target/proxy-bench-h2)
#   KEEP_WORK  set: keep the work directory (configurations, the proxies' logs) in /tmp
#   PORT_BASE  ports are PORT_BASE + 1-8, 10-18, 21-23 and 24-26, and 27-29 with KEEL_BEFORE
#              (default 21100)
#   ENVOY_BIN  the envoy binary (default: on PATH, else installed by scripts/install-peers.sh)
#   PEER_HEADERS  1 (default): NGINX and HAProxy add to each request what keel adds by default
#              (X-Forwarded-For, -Proto, -Host and a fresh X-Request-ID), so that the three do
#              the same work; 0: the peers add nothing (the runs before 2026-12-02). The floor
#              never adds any: it is the least a proxy can cost.
#
# Ports 21101-21108, 21110-21118 and 21121-21126 (21121-21129 with KEEL_BEFORE) on 127.0.0.1
# (with the default PORT_BASE);
# none may be in use when it starts; everything started here is stopped on exit.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
ROUNDS="${ROUNDS:-3}"
REQUESTS="${REQUESTS:-200000}"
CLIENTS="${CLIENTS:-16}"
STREAMS="${STREAMS:-10}"
PROXY_CPUS="${PROXY_CPUS:-0}"
LOAD_CPUS="${LOAD_CPUS:-1}"
OUT="${OUT:-$REPO/target/proxy-bench-h2}"
PEER_HEADERS="${PEER_HEADERS:-1}"
P="${PORT_BASE:-21100}"
H1_PORTS=($((P + 1)) $((P + 2)) $((P + 3)) $((P + 4)))
H2_PORTS=($((P + 5)) $((P + 6)) $((P + 7)) $((P + 8)))
# Proxy ports, per scenario: h1 = +0, h2c = +1, grpc = +2.
KEEL_BASE=$((P + 10))
NGINX_BASE=$((P + 13))
HAPROXY_BASE=$((P + 16))
FLOOR_BASE=$((P + 21))
ENVOY_BASE=$((P + 24))
KEEL_BEFORE_BASE=$((P + 27))
KEEL_BEFORE="${KEEL_BEFORE:-}"

want_pkg h2load nghttp2-client
want_pkg nginx nginx
want_pkg haproxy haproxy
install_wanted
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
BACKEND_BIN="$(binary_or_build "${BACKEND_BIN:-}" keel-grpc-tests h2-backend)"
FLOOR_BIN="$(binary_or_build "${FLOOR_BIN:-}" keel-grpc-tests h2-floor)"
ENVOY_BIN="${ENVOY_BIN:-$(bash "$REPO/scripts/install-peers.sh" envoy 2>/dev/null | sed -n 's/^envoy: \(\/[^ ]*\).*/\1/p' | tail -1)}"
[ -x "$ENVOY_BIN" ] || { echo "h2.sh: no envoy binary (scripts/install-peers.sh envoy failed)" >&2; exit 1; }
LAST_PORT=$((ENVOY_BASE + 2))
if [ -n "$KEEL_BEFORE" ]; then
    [ -x "$KEEL_BEFORE" ] || { echo "h2.sh: KEEL_BEFORE=$KEEL_BEFORE is not an executable" >&2; exit 1; }
    LAST_PORT=$((KEEL_BEFORE_BASE + 2))
fi
# shellcheck disable=SC2046  # seq's numbers, one word each
ports_free "${H1_PORTS[@]}" "${H2_PORTS[@]}" $(seq "$KEEL_BASE" $((HAPROXY_BASE + 2))) $(seq "$FLOOR_BASE" "$LAST_PORT")

bench_workdir keel-h2-bench
mkdir -p "$OUT"

# ---------------------------------------------------------------- backends
for i in 0 1 2 3; do
    dir="$WORK/b$i"
    nginx_backend "$dir" "${H1_PORTS[$i]}" "backend $i: ok\n"
    taskset -c "$LOAD_CPUS" nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" & STARTED+=("$!")
    taskset -c "$LOAD_CPUS" "$BACKEND_BIN" "${H2_PORTS[$i]}" & STARTED+=("$!")
done
for p in "${H1_PORTS[@]}" "${H2_PORTS[@]}"; do wait_port "$p"; done

# ---------------------------------------------------------------- proxies
eps() { local out=() p; for p in "$@"; do out+=("{ address = \"127.0.0.1:$p\" }"); done; local IFS=,; echo "${out[*]}"; }
keel_toml() { # base: keel's configuration, listening on base + 0-2
    cat <<EOF
[[listener]]
listen = "127.0.0.1:$(($1 + 0))"
cluster = "h1"
[[listener]]
listen = "127.0.0.1:$(($1 + 1))"
cluster = "h2c"
[[listener]]
listen = "127.0.0.1:$(($1 + 2))"
cluster = "grpc"

[[cluster]]
name = "h1"
endpoints = [$(eps "${H1_PORTS[@]}")]
[[cluster]]
name = "h2c"
protocol = "h2c"
endpoints = [$(eps "${H2_PORTS[@]}")]
[[cluster]]
name = "grpc"
protocol = "h2c"
endpoints = [$(eps "${H2_PORTS[@]}")]
EOF
}
keel_toml "$KEEL_BASE" >"$WORK/keel.toml"
taskset -c "$PROXY_CPUS" "$KEEL_BIN" proxy --config "$WORK/keel.toml" --workers 1 >"$WORK/keel.log" 2>&1 &
KEEL_PID=$!; STARTED+=("$KEEL_PID")
KEEL_BEFORE_PID=""
if [ -n "$KEEL_BEFORE" ]; then
    keel_toml "$KEEL_BEFORE_BASE" >"$WORK/keel-before.toml"
    taskset -c "$PROXY_CPUS" "$KEEL_BEFORE" proxy --config "$WORK/keel-before.toml" --workers 1 >"$WORK/keel-before.log" 2>&1 &
    KEEL_BEFORE_PID=$!; STARTED+=("$KEEL_BEFORE_PID")
fi

ups() { local p; for p in "$@"; do echo "    server 127.0.0.1:$p;"; done; }
# What keel adds to every request by default, as each peer says it (PEER_HEADERS=1).
nginx_adds() { # proxy|grpc
    [ "$PEER_HEADERS" = 1 ] || return 0
    local d="${1}_set_header"
    echo "$d X-Forwarded-For \$proxy_add_x_forwarded_for; $d X-Forwarded-Proto \$scheme; $d X-Forwarded-Host \$host; $d X-Request-ID \$request_id;"
}
haproxy_adds() {
    [ "$PEER_HEADERS" = 1 ] || return 0
    echo "    option forwardfor"
    echo "    http-request set-header X-Forwarded-Proto http"
    echo "    http-request set-header X-Forwarded-Host %[req.hdr(host)]"
    echo "    unique-id-format %[uuid()]"
    echo "    unique-id-header X-Request-ID"
}
mkdir -p "$WORK/nginx"
cat >"$WORK/nginx/nginx.conf" <<EOF
daemon off; master_process off; worker_processes 1; pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 8192; }
http {
  access_log off; keepalive_requests 10000000; http2_max_concurrent_streams 128;
  upstream h1 {
$(ups "${H1_PORTS[@]}")
    keepalive 256;
  }
  upstream h2 {
$(ups "${H2_PORTS[@]}")
    keepalive 256;
  }
  server { listen 127.0.0.1:$((NGINX_BASE + 0)) http2; location / { proxy_pass http://h1; proxy_http_version 1.1; proxy_set_header Connection ""; $(nginx_adds proxy) } }
  server { listen 127.0.0.1:$((NGINX_BASE + 1)) http2; location / { grpc_pass grpc://h2; $(nginx_adds grpc) } }
  server { listen 127.0.0.1:$((NGINX_BASE + 2)) http2; location / { grpc_pass grpc://h2; $(nginx_adds grpc) } }
}
EOF
taskset -c "$PROXY_CPUS" nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" &
NGINX_PID=$!; STARTED+=("$NGINX_PID")

{
    echo "global"
    echo "    nbthread 1"
    echo "    maxconn 8000"
    echo "defaults"
    echo "    mode http"
    echo "    timeout connect 1s"
    echo "    timeout client 60s"
    echo "    timeout server 60s"
    echo "    http-reuse always"
    for s in 0 1 2; do
        echo "frontend f$s"
        echo "    bind 127.0.0.1:$((HAPROXY_BASE + s)) proto h2"
        echo "    default_backend b$s"
        haproxy_adds
        echo "backend b$s"
        echo "    balance roundrobin"
        if [ "$s" = 0 ]; then
            i=0; for p in "${H1_PORTS[@]}"; do echo "    server s$i 127.0.0.1:$p"; i=$((i + 1)); done
        else
            i=0; for p in "${H2_PORTS[@]}"; do echo "    server s$i 127.0.0.1:$p proto h2"; i=$((i + 1)); done
        fi
    done
} >"$WORK/haproxy.cfg"
taskset -c "$PROXY_CPUS" haproxy -f "$WORK/haproxy.cfg" -db >"$WORK/haproxy.log" 2>&1 &
HAPROXY_PID=$!; STARTED+=("$HAPROXY_PID")
# Envoy: three listeners (AUTO codec: h2load's prior-knowledge HTTP/2), round robin to the same
# endpoints (HTTP/1.1 for h1, HTTP/2 for h2c and gRPC). With PEER_HEADERS=1 it adds what keel
# adds: X-Forwarded-For and -Proto (use_remote_address), X-Request-ID (generate_request_id,
# Envoy's default) and X-Forwarded-Host; with 0 it adds no X-Forwarded-For, -Host or request id
# (X-Forwarded-Proto it always sets).
envoy_listener() { # port cluster
    local hdrs="" remote=false genid=false
    if [ "$PEER_HEADERS" = 1 ]; then
        remote=true; genid=true
        hdrs='              request_headers_to_add: [ { header: { key: x-forwarded-host, value: "%REQ(:AUTHORITY)%" } } ]'
    fi
    cat <<EOF
  - name: l$1
    address: { socket_address: { address: 127.0.0.1, port_value: $1 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: l$1
          codec_type: AUTO
          use_remote_address: $remote
          generate_request_id: $genid
          http2_protocol_options: { max_concurrent_streams: 128 }
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
$hdrs
              routes: [ { match: { prefix: "/" }, route: { cluster: $2, timeout: 60s } } ]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
EOF
}
envoy_cluster() { # name h1|h2 ports...
    local name="$1" proto="$2"; shift 2
    echo "  - name: $name"
    echo "    type: STATIC"
    echo "    connect_timeout: 1s"
    echo "    lb_policy: ROUND_ROBIN"
    echo "    circuit_breakers: { thresholds: [ { max_connections: 100000, max_pending_requests: 100000, max_requests: 100000 } ] }"
    if [ "$proto" = h2 ]; then
        echo "    typed_extension_protocol_options:"
        echo "      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:"
        echo "        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        echo "        explicit_http_config: { http2_protocol_options: {} }"
    fi
    echo "    load_assignment:"
    echo "      cluster_name: $name"
    echo "      endpoints:"
    echo "      - lb_endpoints:"
    local p; for p in "$@"; do echo "        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $p } } }"; done
}
{
    echo "static_resources:"
    echo "  listeners:"
    envoy_listener $((ENVOY_BASE + 0)) h1
    envoy_listener $((ENVOY_BASE + 1)) h2
    envoy_listener $((ENVOY_BASE + 2)) h2
    echo "  clusters:"
    envoy_cluster h1 h1 "${H1_PORTS[@]}"
    envoy_cluster h2 h2 "${H2_PORTS[@]}"
} >"$WORK/envoy.yaml"
taskset -c "$PROXY_CPUS" "$ENVOY_BIN" -c "$WORK/envoy.yaml" --concurrency 1 --disable-hot-restart -l warn \
    --log-path "$WORK/envoy.log" >"$WORK/envoy.out" 2>&1 &
ENVOY_PID=$!; STARTED+=("$ENVOY_PID")
# The floor serves one kind of endpoint per process: one process per scenario.
taskset -c "$PROXY_CPUS" "$FLOOR_BIN" "$((FLOOR_BASE + 0))" h1 "${H1_PORTS[@]}" >"$WORK/floor-h1.log" 2>&1 &
FLOOR_H1_PID=$!; STARTED+=("$FLOOR_H1_PID")
taskset -c "$PROXY_CPUS" "$FLOOR_BIN" "$((FLOOR_BASE + 1))" h2c "${H2_PORTS[@]}" >"$WORK/floor-h2c.log" 2>&1 &
FLOOR_H2C_PID=$!; STARTED+=("$FLOOR_H2C_PID")
taskset -c "$PROXY_CPUS" "$FLOOR_BIN" "$((FLOOR_BASE + 2))" h2c "${H2_PORTS[@]}" >"$WORK/floor-grpc.log" 2>&1 &
FLOOR_GRPC_PID=$!; STARTED+=("$FLOOR_GRPC_PID")
floor_pid() { case "$1" in h1) echo "$FLOOR_H1_PID" ;; h2c) echo "$FLOOR_H2C_PID" ;; grpc) echo "$FLOOR_GRPC_PID" ;; esac; }
for s in 0 1 2; do
    wait_port $((KEEL_BASE + s)); wait_port $((NGINX_BASE + s)); wait_port $((HAPROXY_BASE + s)); wait_port $((FLOOR_BASE + s)); wait_port $((ENVOY_BASE + s))
    [ -z "$KEEL_BEFORE" ] || wait_port $((KEEL_BEFORE_BASE + s))
done

# A gRPC unary call's request body: HealthCheckRequest {} in one uncompressed frame.
printf '\x00\x00\x00\x00\x00' >"$WORK/grpc-body.bin"

run_point() { # proxy pid base scenario round
    local proxy="$1" pid="$2" base="$3" scenario="$4" round="$5" port extra=()
    case "$scenario" in
        h1) port=$base ;;
        h2c) port=$((base + 1)) ;;
        grpc) port=$((base + 2))
              extra=(-d "$WORK/grpc-body.bin" -H 'content-type: application/grpc' -H 'te: trailers') ;;
    esac
    local url="http://127.0.0.1:$port/"
    [ "$scenario" = grpc ] && url="http://127.0.0.1:$port/grpc.health.v1.Health/Check"
    local logf="$WORK/lat-$proxy-$scenario-$round.log"
    local before after
    before="$(cpu_ticks "$pid")"
    taskset -c "$LOAD_CPUS" h2load -c "$CLIENTS" -m "$STREAMS" -n "$REQUESTS" "${extra[@]}" \
        --log-file="$logf" "$url" >"$WORK/h2load.out" 2>&1
    after="$(cpu_ticks "$pid")"
    cp "$WORK/h2load.out" "$OUT/h2load-$proxy-$scenario-$round.txt"
    python3 - "$WORK/h2load.out" "$logf" "$before" "$after" "$CLK_TCK" "$proxy" "$scenario" "$round" <<'PY'
import re, sys
out = open(sys.argv[1]).read()
rps = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))
m = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed", out)
done, ok = int(m.group(2)), int(m.group(3))
lat = sorted(int(l.split()[2]) for l in open(sys.argv[2]) if l.strip() and l.split()[1] in ("200",))
p99 = lat[int(0.99 * (len(lat) - 1))] / 1000 if lat else float("nan")
cpu_us = (int(sys.argv[4]) - int(sys.argv[3])) / int(sys.argv[5]) * 1e6 / max(done, 1)
print(f"{sys.argv[6]}\t{sys.argv[7]}\t{sys.argv[8]}\t{rps:.0f}\t{p99:.2f}\t{cpu_us:.1f}\t{ok}/{done}")
PY
}

# Warm-up: a short run through each.
WARM_BASES="$KEEL_BASE $FLOOR_BASE $NGINX_BASE $HAPROXY_BASE $ENVOY_BASE"
[ -z "$KEEL_BEFORE" ] || WARM_BASES="$KEEL_BASE $KEEL_BEFORE_BASE $FLOOR_BASE $NGINX_BASE $HAPROXY_BASE $ENVOY_BASE"
for s in h1 h2c grpc; do
    for b in $WARM_BASES; do
        REQ_SAVE=$REQUESTS; REQUESTS=2000
        run_point warm "$KEEL_PID" "$b" "$s" 0 >/dev/null
        REQUESTS=$REQ_SAVE
    done
done
RESULTS="$OUT/results.tsv"
printf 'proxy\tscenario\tround\treq_per_s\tp99_ms\tcpu_us_per_req\tsucceeded\n' >"$RESULTS"
for round in $(seq 1 "$ROUNDS"); do
    for s in h1 h2c grpc; do
        run_point keel "$KEEL_PID" "$KEEL_BASE" "$s" "$round" | tee -a "$RESULTS"
        [ -z "$KEEL_BEFORE" ] || run_point keel-before "$KEEL_BEFORE_PID" "$KEEL_BEFORE_BASE" "$s" "$round" | tee -a "$RESULTS"
        run_point floor "$(floor_pid "$s")" "$FLOOR_BASE" "$s" "$round" | tee -a "$RESULTS"
        run_point nginx "$NGINX_PID" "$NGINX_BASE" "$s" "$round" | tee -a "$RESULTS"
        run_point haproxy "$HAPROXY_PID" "$HAPROXY_BASE" "$s" "$round" | tee -a "$RESULTS"
        run_point envoy "$ENVOY_PID" "$ENVOY_BASE" "$s" "$round" | tee -a "$RESULTS"
    done
done
log "raw results: $RESULTS"
python3 - "$RESULTS" <<'PY'
import csv, sys, statistics
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print("| scenario | proxy | req/s (min-max) | p99 ms (median) | CPU us/req (min-max) | ok |")
print("|---|---|---|---|---|---|")
for s in ("h1", "h2c", "grpc"):
    for p in ("keel", "keel-before", "floor", "nginx", "haproxy", "envoy"):
        r = [x for x in rows if x["scenario"] == s and x["proxy"] == p]
        if not r: continue
        rps = [float(x["req_per_s"]) for x in r]; cpu = [float(x["cpu_us_per_req"]) for x in r]
        p99 = statistics.median(float(x["p99_ms"]) for x in r)
        print(f"| {s} | {p} | {min(rps)/1e3:.1f}-{max(rps)/1e3:.1f} k | {p99:.2f} | {min(cpu):.1f}-{max(cpu):.1f} | {r[-1]['succeeded']} |")
def med(s, p, k):
    v = [float(x[k]) for x in rows if x["scenario"] == s and x["proxy"] == p]
    return statistics.median(v) if v else float("nan")
print()
print("| scenario | req/s keel/floor | CPU/req keel/floor | req/s floor/haproxy | CPU/req floor/haproxy | req/s keel/envoy | CPU/req keel/envoy |")
print("|---|---|---|---|---|---|---|")
for s in ("h1", "h2c", "grpc"):
    r = lambda a, b, k: med(s, a, k) / med(s, b, k)
    print(f"| {s} | {r('keel', 'floor', 'req_per_s'):.2f} | {r('keel', 'floor', 'cpu_us_per_req'):.2f} "
          f"| {r('floor', 'haproxy', 'req_per_s'):.2f} | {r('floor', 'haproxy', 'cpu_us_per_req'):.2f} "
          f"| {r('keel', 'envoy', 'req_per_s'):.2f} | {r('keel', 'envoy', 'cpu_us_per_req'):.2f} |")
if any(x["proxy"] == "keel-before" for x in rows):
    def ratios(s, k):
        xs = []
        for a in rows:
            if a["scenario"] != s or a["proxy"] != "keel":
                continue
            b = [x for x in rows if x["scenario"] == s and x["proxy"] == "keel-before" and x["round"] == a["round"]]
            if b and float(b[0][k]) > 0:
                xs.append(float(a[k]) / float(b[0][k]))
        return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]" if xs else "-"
    print()
    print("Before and after: keel (KEEL_BIN) over keel-before (KEEL_BEFORE), medians of the per-round ratios, their range in brackets")
    print("(req/s above 1 and CPU per request below 1 mean keel is faster).")
    print()
    print("| scenario | req/s after/before | CPU/req after/before |")
    print("|---|---|---|")
    for s in ("h1", "h2c", "grpc"):
        print(f"| {s} | {ratios(s, 'req_per_s')} | {ratios(s, 'cpu_us_per_req')} |")
PY
