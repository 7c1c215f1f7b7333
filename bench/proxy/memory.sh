#!/usr/bin/env bash
# Memory per connection: the resident memory of keel, NGINX and HAProxy (2 workers / threads
# each) holding 1,000, 4,000 and 10,000 keep-alive client connections, in one run.
#
#   bench/proxy/memory.sh
#
# Two kinds of connection:
#   idle    each connection made one request, read its answer, and waits for the next (the
#           endpoint: one NGINX answering a small body from memory);
#   active  each connection has a request in flight: the endpoint (`keel backend --latency
#           600s`) holds every answer back, so the proxy also holds one endpoint connection
#           per request.
# For each kind, connection count and proxy, the proxy is started afresh, warmed with a few
# requests, measured empty, then measured again with the connections open (SETTLE seconds after
# the last one was made). Memory is the sum over the proxy's processes (NGINX: its master and
# workers) of VmRSS (/proc/PID/status) and of Pss (/proc/PID/smaps_rollup: shared pages split
# between the processes that share them, so NGINX's three processes count their code once); per
# connection is (with - empty) / connections.
#
# The client is bench/proxy/memory_client.py (blocking sockets, python3 only): its own memory is
# not measured, so it needs no event loop.
#
# Environment (all optional):
#   KEEL_BIN     keel binary (else `cargo build --release -p keel`)
#   KEEL_BEFORE  another keel binary, measured as one more proxy, keel-before, in the same run
#   CONNS        connection counts (default "1000 4000 10000")
#   MODES        default "idle active"
#   PEERS        default "keel nginx haproxy" (keel-before is added with KEEL_BEFORE)
#   WORKERS      worker processes / threads of each proxy (default 2)
#   SETTLE       seconds between the last connection and the measurement (default 3)
#   OUT          where the raw table goes (default target/proxy-memory)
#
# Loopback only: 127.0.0.1 ports 23001-23002 (endpoints) and 23010-23014 (proxies), which must
# be free. The open-file limit is raised to 65,536 for every process started here where the hard
# limit allows (else see below). Everything started is stopped on exit.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage_from_header; exit 0 ;;
        *) echo "memory.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
CONNS="${CONNS:-1000 4000 10000}"
MODES="${MODES:-idle active}"
PEERS="${PEERS:-keel nginx haproxy}"
WORKERS="${WORKERS:-2}"
SETTLE="${SETTLE:-3}"
OUT="${OUT:-$REPO/target/proxy-memory}"
KEEL_BEFORE="${KEEL_BEFORE:-}"
IDLE_BACKEND=23001
HOLD_BACKEND=23002
if [ -n "$KEEL_BEFORE" ]; then
    [ -x "$KEEL_BEFORE" ] || { echo "memory.sh: KEEL_BEFORE=$KEEL_BEFORE is not an executable" >&2; exit 1; }
    PEERS="$PEERS keel-before"
fi

want_pkg nginx nginx
want_pkg haproxy haproxy
want_pkg python3 python3
want_pkg ss iproute2
install_wanted
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"

# Each client connection may hold an endpoint connection too: 2 x 10,000 and some. keel and
# HAProxy serve every connection in one process: where the hard limit cannot be raised (no
# CAP_SYS_RESOURCE in a container), a count above (limit - 400) / 2 is lowered to it, for
# every proxy alike, and said so (the tables show the connections opened).
ulimit -Hn 65536 2>/dev/null || true
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
FDS="$(ulimit -n)"
MAX_CONNS=$(((FDS - 400) / 2))
COUNTS=""
for n in $CONNS; do
    if [ "$n" -gt "$MAX_CONNS" ]; then
        log "open-file limit $FDS: $n connections lowered to $MAX_CONNS"
        n="$MAX_CONNS"
    fi
    COUNTS="$COUNTS $n"
done
HAPROXY_MAXCONN=$((MAX_CONNS + 100))

port_of() { case "$1" in keel) echo 23010 ;; nginx) echo 23011 ;; haproxy) echo 23012 ;; keel-before) echo 23014 ;; esac; }
# shellcheck disable=SC2046
ports_free "$IDLE_BACKEND" "$HOLD_BACKEND" $(for p in $PEERS; do port_of "$p"; done)
bench_workdir keel-memory
mkdir -p "$OUT"

# ---------------------------------------------------------------- endpoints
nginx_backend "$WORK/idle" "$IDLE_BACKEND" "backend: ok\n"
sed -i "s/worker_connections 8192/worker_connections $FDS/" "$WORK/idle/nginx.conf"
nginx -p "$WORK/idle" -c "$WORK/idle/nginx.conf" -e "$WORK/idle/error.log" &
STARTED+=("$!")
"$KEEL_BIN" backend --listen "127.0.0.1:$HOLD_BACKEND" --latency 600s >"$WORK/hold.log" 2>&1 &
STARTED+=("$!")
wait_port "$IDLE_BACKEND"
wait_port "$HOLD_BACKEND"

# ---------------------------------------------------------------- proxies
# The same for all three: one endpoint, up to 256 idle endpoint connections kept per worker
# (keel: per endpoint), no retries, every timeout 300 s (no connection or request is closed
# while it is measured), room for 20,000 client connections.
write_configs() { # endpoint port
    local up="$1" d="$WORK/conf" p
    mkdir -p "$d/nginx"
    for p in keel keel-before; do
        cat >"$d/$p.toml" <<EOF
[[listener]]
listen = "127.0.0.1:$(port_of "$p")"
cluster = "app"
max_connections = 20000
header_read_timeout = "300s"
idle_timeout = "300s"

[[cluster]]
name = "app"
endpoints = [{ address = "127.0.0.1:$up" }]
request_timeout = "300s"
max_in_flight = 20000
pool_max_idle_per_endpoint = 256

[cluster.retry]
attempts = 0
EOF
    done
    cat >"$d/nginx/nginx.conf" <<EOF
daemon off;
worker_processes $WORKERS;
pid $d/nginx/nginx.pid;
error_log $d/nginx/error.log warn;
events { worker_connections $FDS; }
http {
    access_log off;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    client_header_timeout 300s;
    upstream app { server 127.0.0.1:$up; keepalive 256; }
    server {
        listen 127.0.0.1:$(port_of nginx) backlog=4096;
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 300s;
            proxy_next_upstream off;
        }
    }
}
EOF
    cat >"$d/haproxy.cfg" <<EOF
global
    nbthread $WORKERS
    maxconn $HAPROXY_MAXCONN
defaults
    mode http
    maxconn $HAPROXY_MAXCONN
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout http-request 300s
    timeout http-keep-alive 300s
    option http-keep-alive
    http-reuse always
frontend fe
    bind 127.0.0.1:$(port_of haproxy) backlog 4096
    default_backend app
backend app
    server b1 127.0.0.1:$up
EOF
}

PROXY=""
start_proxy() { # name
    local d="$WORK/conf"
    case "$1" in
        keel) "$KEEL_BIN" proxy --config "$d/keel.toml" --workers "$WORKERS" --log warn >"$d/keel.log" 2>&1 & ;;
        keel-before) "$KEEL_BEFORE" proxy --config "$d/keel-before.toml" --workers "$WORKERS" --log warn >"$d/keel-before.log" 2>&1 & ;;
        nginx) nginx -p "$d/nginx" -c "$d/nginx/nginx.conf" -e "$d/nginx/error.log" & ;;
        haproxy) haproxy -db -f "$d/haproxy.cfg" >"$d/haproxy.log" 2>&1 & ;;
    esac
    PROXY=$!
    STARTED+=("$PROXY")
    wait_port "$(port_of "$1")" 20
}

mem_kb() { # pid: "rss pss" in KB, summed over the process and its children
    local rss=0 pss=0 p v
    for p in $(pids_of "$1"); do
        v="$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null)" || continue
        rss=$((rss + ${v:-0}))
        v="$(awk '/^Pss:/ {print $2}' "/proc/$p/smaps_rollup" 2>/dev/null)" || continue
        pss=$((pss + ${v:-0}))
    done
    echo "$rss $pss"
}

hold() { # port conns mode: opens the connections; CLIENT is the client's pid, fd 8 holds them
    rm -f "$WORK/hold.fifo" "$WORK/client.out"
    mkfifo "$WORK/hold.fifo"
    python3 "$HERE/memory_client.py" "$1" "$2" "$3" <"$WORK/hold.fifo" >"$WORK/client.out" &
    CLIENT=$!
    exec 8>"$WORK/hold.fifo"
    local deadline=$((SECONDS + 300))
    until grep -q '^ready' "$WORK/client.out" 2>/dev/null; do
        alive "$CLIENT" || { echo "memory.sh: the client failed" >&2; return 1; }
        [ "$SECONDS" -lt "$deadline" ] || { echo "memory.sh: the client is not ready after 300 s" >&2; return 1; }
        sleep 0.2
    done
}

release() { exec 8>&-; wait "$CLIENT" 2>/dev/null || true; }

RAW="$OUT/memory.tsv"
printf 'mode\tconns\tproxy\topened\tanswered\tfailed\tendpoint_conns\tempty_rss_kb\trss_kb\tempty_pss_kb\tpss_kb\n' >"$RAW"
log "keel: $KEEL_BIN (tree: $(git -C "$REPO" describe --always --dirty 2>/dev/null || echo unknown)); $(nginx -v 2>&1); $(haproxy -v 2>&1 | head -1); workers $WORKERS"
for mode in $MODES; do
    if [ "$mode" = idle ]; then write_configs "$IDLE_BACKEND"; up=$IDLE_BACKEND; else write_configs "$HOLD_BACKEND"; up=$HOLD_BACKEND; fi
    for n in $COUNTS; do
        for p in $PEERS; do
            start_proxy "$p"
            port="$(port_of "$p")"
            # Warm: a few requests answered (through the idle endpoint's proxy) and closed.
            if [ "$mode" = idle ]; then python3 "$HERE/memory_client.py" "$port" 8 idle </dev/null >/dev/null; fi
            sleep 1
            read -r e_rss e_pss < <(mem_kb "$PROXY")
            hold "$port" "$n" "$mode"
            sleep "$SETTLE"
            read -r rss pss < <(mem_kb "$PROXY")
            read -r _ opened answered failed <"$WORK/client.out"
            ups="$(ss -Htn state established "( sport = :$up )" | wc -l)"
            release
            stop_pid "$PROXY"
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$n" "$p" "$opened" "$answered" "$failed" "$ups" "$e_rss" "$rss" "$e_pss" "$pss" >>"$RAW"
            log "$mode $n $p: opened $opened, answered $answered, failed $failed, endpoint connections $ups; RSS $((e_rss / 1024)) -> $((rss / 1024)) MB, Pss $((e_pss / 1024)) -> $((pss / 1024)) MB"
        done
    done
done

# ---------------------------------------------------------------- the table
python3 - "$RAW" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print("| kind | connections | proxy | RSS MB (empty) | RSS MB | RSS KB / conn | Pss MB | Pss KB / conn | vs NGINX (RSS) | failed | endpoint conns |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
nginx = {(r["mode"], r["conns"]): int(r["rss_kb"]) for r in rows if r["proxy"] == "nginx"}
for r in rows:
    n = int(r["conns"])
    rss, e_rss, pss, e_pss = (int(r[k]) for k in ("rss_kb", "empty_rss_kb", "pss_kb", "empty_pss_kb"))
    ref = nginx.get((r["mode"], r["conns"]))
    vs = f"{rss / ref:.2f}" if ref else "-"
    print(f"| {r['mode']} | {n:,} | {r['proxy']} | {e_rss / 1024:.1f} | {rss / 1024:.1f} | {(rss - e_rss) / n:.1f} "
          f"| {pss / 1024:.1f} | {(pss - e_pss) / n:.1f} | {vs} | {r['failed']} | {r['endpoint_conns']} |")
PY
log "raw: $RAW"
