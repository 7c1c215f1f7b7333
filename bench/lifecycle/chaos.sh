#!/usr/bin/env bash
# shellcheck disable=SC2317  # the per-proxy functions are called by name ("${p}_reload")
# Lifecycle chaos run: a proxy's reloads, binary upgrade and stop under load, counted request
# by request. For keel, then NGINX and HAProxy where they are installed (or installable):
#
#   load, for DURATION seconds (default 30):
#     64 keep-alive HTTP/1.1 connections on the plain listener (clients.py h1: each sends its
#        next request as soon as the last answer arrived; every request accounted for),
#     4 more looping on /slow (1.5 s answers, so that requests are in flight at every event),
#     HTTP/2 over TLS (ALPN h2): h2load -c 8 -m 8 on the TLS listener (runs of 2,000
#        requests one after another),
#     20 WebSockets through the plain listener to an echo backend, one message each 200 ms;
#   events:
#     10 reloads, each rotating the TLS certificate (two certificates with serials 1001 and
#        2002, the files overwritten in place) and adding or removing an extra listener;
#        after each, a new handshake's certificate serial and the extra listener are checked;
#     one binary upgrade after the fifth reload (the binary file replaced by a copy of itself);
#     at the end, a graceful stop with requests in flight (HTTP/1.1 /slow, and 16 HTTP/2
#        /slow requests started 0.5 s before it); clients send nothing after the stop signal.
#
# Counted (per proxy): failed requests (sent before the stop and not answered: reset, closed,
# timed out), refused connections (connects to the plain listener and WebSocket opens that
# failed while the proxy was meant to serve), non-2xx answers, tunnels cut before the drain
# timeout (and those cut at it), certificate rotations seen by a new handshake, the extra
# listener served after being added and refused after being removed. Exit status 1 if keel's
# run counts any failure (STRICT=1: any proxy's).
#
# How each maps:
#   reload    keel: POST /reload on admin (as SIGHUP); NGINX: nginx -s reload;
#             HAProxy: master-worker (-W), SIGUSR2 to the master; the stats socket has
#             `expose-fd listeners` so the new worker takes the listening sockets over.
#   upgrade   keel: SIGUSR2 (re-exec with the listening sockets; --pid-file rewritten);
#             NGINX: USR2, then WINCH and QUIT to the old master;
#             HAProxy: the master re-execs its binary on SIGUSR2 (the reload above).
#   stop      keel: SIGTERM; NGINX: SIGQUIT (graceful; its SIGTERM is a fast stop);
#             HAProxy: SIGUSR1 to the master (soft stop; its SIGTERM is a hard stop).
#   drain     keel: drain_timeout = 5s; NGINX: worker_shutdown_timeout 5s;
#             HAProxy: hard-stop-after 5s.
#
#   bench/lifecycle/chaos.sh                 # keel, nginx, haproxy
#   PROXIES="keel haproxy-icor" ...          # haproxy-icor: with option idle-close-on-response
#   PROXIES="keel" bench/lifecycle/chaos.sh
#
# Environment (all optional): KEEL_BIN (else cargo build --release -p keel), PROXIES,
# DURATION (default 30), WORKERS (keel --workers, NGINX worker_processes, HAProxy nbthread;
# default 2), OUT (results; default target/lifecycle-chaos), KEEP_WORK (keep /tmp work dir),
# STRICT. Ports 21301-21313 on 127.0.0.1 only (none may be in use when it starts); every
# process started here is stopped by PID.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
CLIENTS="$HERE/clients.py"
PROXIES="${PROXIES:-keel nginx haproxy}"
DURATION="${DURATION:-30}"
WORKERS="${WORKERS:-2}"
OUT="${OUT:-$REPO/target/lifecycle-chaos}"
DRAIN=5
B1=21301 B2=21302 SLOW=21303 WSB=21304
PLAIN=21310 TLS=21311 EXTRA=21312 ADMIN=21313

# ---------------------------------------------------------------- tools
want_pkg h2load nghttp2-client
want_pkg openssl openssl
want_pkg curl curl
case " $PROXIES " in *" nginx "*) want_pkg nginx nginx ;; esac
case " $PROXIES " in *" haproxy"*) want_pkg haproxy haproxy ;; esac
install_each_wanted
for t in h2load openssl curl python3; do
    command -v "$t" >/dev/null || { echo "chaos.sh: $t is required" >&2; exit 2; }
done
run_list=()
for p in $PROXIES; do
    if [ "$p" = keel ] || command -v "${p%%-*}" >/dev/null; then run_list+=("$p"); else log "skipping $p: not installed"; fi
done
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
ulimit -n 65536 2>/dev/null || true
ports_free "$B1" "$B2" "$SLOW" "$WSB" "$PLAIN" "$TLS" "$EXTRA" "$ADMIN"

bench_workdir keel-chaos
mkdir -p "$OUT" "$WORK/bin"
PIDFILES=()
VARIANT=""
# The processes named by PID files are stopped too: an upgrade's new process is no child of ours.
chaos_cleanup() {
    set +e
    local f
    for f in "${PIDFILES[@]}"; do [ -s "$f" ] && ours "$(cat "$f")" && STARTED+=("$(cat "$f")"); done
    bench_cleanup
}
trap chaos_cleanup EXIT
# A PID read from a PID file names a process of this run (and not one that reused the PID).
ours() { alive "$1" && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF "$WORK"; }
wait_gone() { # pid seconds
    local deadline=$((SECONDS + $2))
    while alive "$1"; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.05
    done
}

# ---------------------------------------------------------------- certificates
for n in 1 2; do
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -subj "/CN=localhost" -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
        -set_serial "0x${n}00${n}" -keyout "$WORK/key$n.pem" -out "$WORK/cert$n.pem" 2>/dev/null
done
# Copies the certificate n over the served files (overwritten in place, as a renewal does).
rotate_cert() { # dir n
    cat "$WORK/cert$2.pem" >"$1/cert.pem"
    cat "$WORK/key$2.pem" >"$1/key.pem"
    cat "$WORK/cert$2.pem" "$WORK/key$2.pem" >"$1/combined.pem"
}
serial_seen() {
    timeout 5 openssl s_client -connect "127.0.0.1:$TLS" -servername localhost </dev/null 2>/dev/null \
        | openssl x509 -noout -serial 2>/dev/null | cut -d= -f2
}

# ---------------------------------------------------------------- backends
"$KEEL_BIN" backend --latency 2ms --listen "127.0.0.1:$B1" --listen "127.0.0.1:$B2" >"$WORK/backend.log" 2>&1 &
STARTED+=("$!")
"$KEEL_BIN" backend --latency 1500ms --listen "127.0.0.1:$SLOW" >"$WORK/slow.log" 2>&1 &
STARTED+=("$!")
python3 "$CLIENTS" ws-backend --port "$WSB" >"$WORK/ws-backend.log" 2>&1 &
STARTED+=("$!")
for p in $B1 $B2 $SLOW $WSB; do wait_port "$p" 15; done

# ---------------------------------------------------------------- keel
keel_config() { # dir extra(0|1)
    local d="$1"
    cat >"$d/keel.toml" <<EOF
drain_timeout = "${DRAIN}s"

[admin]
listen = "127.0.0.1:$ADMIN"

[[listener]]
listen = "127.0.0.1:$PLAIN"
cluster = "app"
[[listener.route]]
path_prefix = "/ws"
cluster = "ws"
[[listener.route]]
path_prefix = "/slow"
cluster = "slow"

[[listener]]
listen = "127.0.0.1:$TLS"
cluster = "app"
[[listener.route]]
path_prefix = "/slow"
cluster = "slow"
[listener.tls]
cert = "cert.pem"
key = "key.pem"
EOF
    if [ "$2" = 1 ]; then
        printf '\n[[listener]]\nlisten = "127.0.0.1:%s"\ncluster = "app"\n' "$EXTRA" >>"$d/keel.toml"
    fi
    cat >>"$d/keel.toml" <<EOF

[[cluster]]
name = "app"
endpoints = [{ address = "127.0.0.1:$B1" }, { address = "127.0.0.1:$B2" }]
request_timeout = "10s"

[[cluster]]
name = "slow"
endpoints = [{ address = "127.0.0.1:$SLOW" }]
request_timeout = "10s"

[[cluster]]
name = "ws"
endpoints = [{ address = "127.0.0.1:$WSB" }]
EOF
}
keel_start() {
    local d="$1"
    cp "$KEEL_BIN" "$WORK/bin/keel"
    "$WORK/bin/keel" proxy --config "$d/keel.toml" --workers "$WORKERS" --pid-file "$d/keel.pid" \
        >"$d/proxy.log" 2>&1 &
    STARTED+=("$!")
    PIDFILES+=("$d/keel.pid")
}
keel_reload() {
    local code
    code="$(curl -s -o "$1/reload.out" -w '%{http_code}' -X POST "http://127.0.0.1:$ADMIN/reload")"
    [ "$code" = 200 ] || log "keel reload answered $code: $(cat "$1/reload.out")"
}
# The PID an upgrade writes over OLD in PIDFILE (up to 30 s).
new_pid() { # name pidfile old
    local new deadline=$((SECONDS + 30))
    while new="$(cat "$2" 2>/dev/null)"; [ "$new" = "$3" ] || [ -z "$new" ]; do
        [ "$SECONDS" -lt "$deadline" ] || { log "$1 upgrade: no new PID"; return 1; }
        sleep 0.01
    done
    echo "$new"
}
keel_upgrade() {
    local d="$1" old new
    old="$(cat "$d/keel.pid")"
    cp "$KEEL_BIN" "$WORK/bin/keel.new" && mv -f "$WORK/bin/keel.new" "$WORK/bin/keel"
    kill -USR2 "$old"
    new="$(new_pid keel "$d/keel.pid" "$old")" || return 1
    echo "$(now) drain upgrade (old $old, new $new)" >>"$d/events.txt"
    STARTED+=("$new")
}
keel_stop() { kill -TERM "$(cat "$1/keel.pid")"; }
keel_pid() { cat "$1/keel.pid"; }

# ---------------------------------------------------------------- NGINX
nginx_config() { # dir extra(0|1)
    local d="$1" extra=""
    [ "$2" = 1 ] && extra="server { listen 127.0.0.1:$EXTRA; location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
    cat >"$d/nginx.conf" <<EOF
daemon on; master_process on; worker_processes $WORKERS; pid $d/nginx.pid;
worker_shutdown_timeout ${DRAIN}s; worker_rlimit_nofile 65536;
error_log $d/error.log notice;
events { worker_connections 8192; }
http {
  access_log off; keepalive_timeout 65s; keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$B1; server 127.0.0.1:$B2; keepalive 64; }
  upstream slow { server 127.0.0.1:$SLOW; keepalive 16; }
  upstream ws { server 127.0.0.1:$WSB; }
  server {
    listen 127.0.0.1:$PLAIN;
    listen 127.0.0.1:$TLS ssl http2;
    ssl_certificate $d/cert.pem; ssl_certificate_key $d/key.pem;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }
    location /slow { proxy_pass http://slow; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_read_timeout 10s; }
    location /ws { proxy_pass http://ws; proxy_http_version 1.1; proxy_set_header Upgrade \$http_upgrade;
                   proxy_set_header Connection "upgrade"; proxy_read_timeout 1h; }
  }
  $extra
}
EOF
}
nginx_start() {
    local d="$1"
    cp "$(command -v nginx)" "$WORK/bin/nginx"
    # Daemon mode: NGINX ignores USR2 while its master's parent is the one it started with
    # ("the changing binary signal is ignored"), which is always so in the foreground.
    "$WORK/bin/nginx" -p "$d" -c "$d/nginx.conf" -e "$d/error.log" >"$d/proxy.log" 2>&1
    PIDFILES+=("$d/nginx.pid" "$d/nginx.pid.oldbin")
    local deadline=$((SECONDS + 10))
    until [ -s "$d/nginx.pid" ]; do [ "$SECONDS" -lt "$deadline" ] || return 1; sleep 0.05; done
}
nginx_reload() {
    "$WORK/bin/nginx" -p "$1" -c "$1/nginx.conf" -e "$1/error.log" -s reload
    echo "$(now) drain reload (old workers)" >>"$1/events.txt"
}
nginx_upgrade() {
    local d="$1" old new
    old="$(cat "$d/nginx.pid")"
    cp "$(command -v nginx)" "$WORK/bin/nginx.new" && mv -f "$WORK/bin/nginx.new" "$WORK/bin/nginx"
    kill -USR2 "$old"
    new="$(new_pid nginx "$d/nginx.pid" "$old")" || return 1
    STARTED+=("$new")
    # The new master's workers accept next to the old ones; then the old workers stop (WINCH)
    # and the old master leaves (QUIT), as nginx's documentation gives the sequence.
    sleep 1
    kill -WINCH "$old"
    echo "$(now) drain upgrade (WINCH old master $old, new $new)" >>"$d/events.txt"
    sleep 0.5
    kill -QUIT "$old"
}
nginx_stop() { kill -QUIT "$(cat "$1/nginx.pid")"; }
nginx_pid() { cat "$1/nginx.pid"; }

# ---------------------------------------------------------------- HAProxy
haproxy_config() { # dir extra(0|1)
    local d="$1"
    {
        echo "global"
        echo "    master-worker"
        echo "    nbthread $WORKERS"
        echo "    maxconn 8000"
        echo "    hard-stop-after ${DRAIN}s"
        echo "    stats socket $d/haproxy.sock mode 600 level admin expose-fd listeners"
        echo "defaults"
        echo "    mode http"
        echo "    option http-keep-alive"
        # haproxy-icor: idle keep-alive connections are not closed at the soft stop; each gets
        # one more answer, with Connection: close (HAProxy's behaviour before 2.4).
        [ "$VARIANT" = icor ] && echo "    option idle-close-on-response"
        echo "    timeout connect 1s"
        echo "    timeout client 30s"
        echo "    timeout server 30s"
        echo "    timeout http-request 10s"
        echo "    timeout http-keep-alive 60s"
        echo "    timeout tunnel 1h"
        echo "frontend plain"
        echo "    bind 127.0.0.1:$PLAIN"
        echo "    bind 127.0.0.1:$TLS ssl crt $d/combined.pem alpn h2,http/1.1"
        echo "    use_backend ws if { path_beg /ws }"
        echo "    use_backend slow if { path_beg /slow }"
        echo "    default_backend app"
        if [ "$2" = 1 ]; then
            echo "frontend extra"
            echo "    bind 127.0.0.1:$EXTRA"
            echo "    default_backend app"
        fi
        echo "backend app"
        echo "    server s1 127.0.0.1:$B1"
        echo "    server s2 127.0.0.1:$B2"
        echo "backend slow"
        echo "    server s1 127.0.0.1:$SLOW"
        echo "backend ws"
        echo "    server s1 127.0.0.1:$WSB"
    } >"$d/haproxy.cfg"
}
haproxy_start() {
    local d="$1"
    cp "$(command -v haproxy)" "$WORK/bin/haproxy"
    "$WORK/bin/haproxy" -W -db -f "$d/haproxy.cfg" -p "$d/haproxy.pid" >"$d/proxy.log" 2>&1 &
    STARTED+=("$!")
    echo "$!" >"$d/master.pid"
}
haproxy_reload() {
    kill -USR2 "$(cat "$1/master.pid")"
    echo "$(now) drain reload (old worker)" >>"$1/events.txt"
}
haproxy_upgrade() {
    cp "$(command -v haproxy)" "$WORK/bin/haproxy.new" && mv -f "$WORK/bin/haproxy.new" "$WORK/bin/haproxy"
    kill -USR2 "$(cat "$1/master.pid")"
    echo "$(now) drain upgrade (master re-exec)" >>"$1/events.txt"
}
haproxy_stop() { kill -USR1 "$(cat "$1/master.pid")"; }
haproxy_pid() { cat "$1/master.pid"; }

# ---------------------------------------------------------------- one run
# After a reload: the serial a new handshake sees, and the extra listener's state (the peers
# apply reloads asynchronously: up to 3 s is allowed, and the delay is recorded).
check_after_reload() { # dir expected_serial extra(0|1) started_at
    local d="$1" seen="" i code
    for i in $(seq 1 30); do
        seen="$(serial_seen)"
        [ "$seen" = "$2" ] && break
        sleep 0.1
    done
    echo "reload $2 ${seen:-none} $(awk -v a="$4" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }')" >>"$d/serials.txt"
    for i in $(seq 1 30); do
        if code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$EXTRA/")"; then :; else code="refused"; fi
        if [ "$3" = 1 ]; then [ "$code" = 200 ] && break; else [ "$code" = refused ] && break; fi
        sleep 0.1
    done
    if [ "$3" = 1 ]; then echo "added 200 $code" >>"$d/extra.txt"; else echo "removed refused $code" >>"$d/extra.txt"; fi
}

run_proxy() {
    local name="$1" d="$OUT/$1" pid t0 extra=0 serial=1001 i p="${1%%-*}"
    VARIANT=""
    [ "$name" != "$p" ] && VARIANT="${name#*-}"
    rm -rf "$d"; mkdir -p "$d"
    rotate_cert "$d" 1
    "${p}_config" "$d" 0
    "${p}_start" "$d"
    wait_port "$PLAIN" 15; wait_port "$TLS" 15
    sleep 0.5
    log "$name: serving (load average $(cut -d' ' -f1-3 /proc/loadavg)); ${DURATION}s of load and events"
    cut -d' ' -f1-3 /proc/loadavg >"$d/loadavg-start.txt"
    t0="$(now)"
    echo "$t0 start" >"$d/events.txt"
    local term="$d/term" cpids=()
    : >"$term"
    python3 "$CLIENTS" h1 --port "$PLAIN" --conns 64 --path / --term-file "$term" --out "$d/h1.json" --deadline $((DURATION + 40)) &
    cpids+=("$!"); STARTED+=("$!")
    python3 "$CLIENTS" h1 --port "$PLAIN" --conns 4 --path /slow --term-file "$term" --out "$d/h1-slow.json" --deadline $((DURATION + 40)) &
    cpids+=("$!"); STARTED+=("$!")
    python3 "$CLIENTS" ws --port "$PLAIN" --n 20 --interval 0.2 --term-file "$term" --out "$d/ws.json" --deadline $((DURATION + 40)) &
    cpids+=("$!"); STARTED+=("$!")
    # h2load does not open a new connection after a GOAWAY (its client stops and counts the
    # requests it never sent as failed), so the HTTP/2 load is a chain of short runs, each
    # with fresh connections; --log-file tells requests sent and not answered (status -1
    # with a start time) from those never sent (start time 0).
    (
        b=0
        while [ "$(awk -v t0="$t0" -v d="$DURATION" -v n="$(now)" 'BEGIN { print (n < t0 + d - 3) }')" = 1 ]; do
            b=$((b + 1))
            timeout 20 h2load -n 2000 -c 8 -m 8 --log-file="$d/h2log-load-$b.tsv" "https://127.0.0.1:$TLS/" \
                >"$d/h2load-load-$b.txt" 2>&1 || true
        done
    ) &
    cpids+=("$!"); STARTED+=("$!")
    local step
    step="$(awk -v d="$DURATION" 'BEGIN { printf "%.3f", d / 14 }')"
    for i in $(seq 1 10); do
        sleep "$step"
        extra=$((1 - extra))
        serial=$([ "$serial" = 1001 ] && echo 2002 || echo 1001)
        rotate_cert "$d" "$([ "$serial" = 1001 ] && echo 1 || echo 2)"
        "${p}_config" "$d" "$extra"
        local at; at="$(now)"
        echo "$at reload $i (serial $serial, extra $extra)" >>"$d/events.txt"
        "${p}_reload" "$d"
        check_after_reload "$d" "$serial" "$extra" "$at"
        if [ "$i" = 5 ]; then
            sleep "$step"
            echo "$(now) upgrade signal" >>"$d/events.txt"
            "${p}_upgrade" "$d" || true
        fi
    done
    # The rest of the period, then the stop with requests in flight.
    local left
    left="$(awk -v t0="$t0" -v d="$DURATION" -v n="$(now)" 'BEGIN { l = t0 + d - n; printf "%.3f", (l > 0 ? l : 0) }')"
    sleep "$left"
    h2load -n 16 -c 2 -m 8 --log-file="$d/h2log-stop.tsv" "https://127.0.0.1:$TLS/slow" >"$d/h2load-stop.txt" 2>&1 &
    cpids+=("$!"); STARTED+=("$!")
    sleep 0.5
    pid="$("${p}_pid" "$d")"
    now >"$term"
    echo "$(cat "$term") drain term (graceful stop of $pid)" >>"$d/events.txt"
    "${p}_stop" "$d"
    wait_gone "$pid" $((DRAIN + 15)) || log "$name: PID $pid still running $((DRAIN + 15))s after the stop"
    echo "$(now) exited" >>"$d/events.txt"
    for i in "${cpids[@]}"; do wait "$i" || true; done
    cut -d' ' -f1-3 /proc/loadavg >"$d/loadavg-end.txt"
    # Nothing may outlive its stop (an upgrade leaves the new process as a grandchild).
    for i in "$d"/*.pid; do [ -s "$i" ] && ours "$(cat "$i")" && kill "$(cat "$i")" 2>/dev/null; done
    sleep 0.5
    local rc=0
    python3 "$CLIENTS" report --dir "$d" --proxy "$name" --drain-timeout "$DRAIN" || rc=$?
    return "$rc"
}

status=0
summaries=()
for p in "${run_list[@]}"; do
    rc=0
    run_proxy "$p" || rc=$?
    summaries+=("$OUT/$p/summary.json")
    if [ "$rc" != 0 ] && { [ "$p" = keel ] || [ -n "${STRICT:-}" ]; }; then status=1; fi
done
echo
python3 "$CLIENTS" table "${summaries[@]}" | tee "$OUT/table.md"
echo "results: $OUT (per proxy: summary.json, the clients' JSON, h2load output, proxy.log, events.txt)"
exit "$status"
