# shellcheck shell=bash
# The prologue the bench scripts share; sourced (`. "$HERE/../lib.sh"`), never run. Each
# script keeps its own options and measurements; this is only their common plumbing:
#
#   log MSG...               a time-stamped line on stderr
#   now                      the time in seconds, with nanoseconds
#   usage_from_header        prints the calling script's header comment (its --help)
#   want_pkg CMD PKG         queues the Debian package PKG when the command CMD is missing
#   install_wanted           apt-get installs the queued packages (scripts/install-lib.sh's
#                            apt_install; make_venv is there too)
#   install_each_wanted      the same one package at a time, a failure only logged (for tools a
#                            script can do without)
#   binary_or_build GIVEN PKG [BIN]  prints GIVEN, or else builds PKG's binary BIN (default PKG)
#                            with `cargo build --profile P -p PKG [--bin BIN]` (CARGO_TARGET_DIR
#                            honoured) and prints its path; status 1 if it is not executable.
#                            P is `ship` for keel (the shipped binary's profile, deploy/build.sh;
#                            KEEL_PROFILE=release for a quicker, unshipped build), `release`
#                            for the test servers
#   bench_workdir PREFIX     WORK = a new /tmp/PREFIX.XXXXXX; on exit (or INT/TERM) every pid in
#                            STARTED is stopped (TERM, then KILL 0.3 s later) and WORK removed,
#                            unless KEEP_WORK is set (bench_cleanup does that)
#   wait_port PORT [SECS]    waits until 127.0.0.1:PORT accepts (default 10 s); else status 1
#   ports_free PORT...       status 1, saying so, if anything already accepts on one of them
#                            (a second run, or a stray process, would mix into the results)
#   alive PID                the process exists
#   stop_pid PID [SECS]      TERM, up to SECS (default 10) for it to go, then KILL; reaped
#   pids_of PID              the process and its children (nginx's workers)
#   cpu_ticks PID            user + system time of pids_of PID, in clock ticks (CLK_TCK a second)
#   cpu_split PID            "user system" of the same, in clock ticks
#   peak_rss_kb PID          the sum of VmHWM over the same
#   nginx_backend DIR PORT BODY  DIR/nginx.conf: one NGINX process on 127.0.0.1:PORT answering
#                            200 BODY from memory (the scripts' HTTP/1.1 endpoint); start it with
#                            nginx -p DIR -c DIR/nginx.conf -e DIR/error.log
#
# Sets BENCH (the script's name, for messages), REPO (the repository), CLK_TCK and STARTED=();
# PATH gains /usr/sbin and /sbin, where Debian puts nginx and haproxy.

BENCH="$(basename "$0")"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC2034  # for the scripts' CPU arithmetic
CLK_TCK="$(getconf CLK_TCK)"
STARTED=()
BENCH_WANT=()
export PATH="$PATH:/usr/sbin:/sbin"
. "$REPO/scripts/install-lib.sh"

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
now() { date +%s.%N; }
usage_from_header() { sed -n '2,/^set -euo/p' "$0" | sed '$d'; }

want_pkg() { command -v "$1" >/dev/null || BENCH_WANT+=("$2"); }

install_wanted() {
    [ "${#BENCH_WANT[@]}" -gt 0 ] || return 0
    log "installing ${BENCH_WANT[*]} (apt-get)"
    apt_install "${BENCH_WANT[@]}"
    BENCH_WANT=()
}

install_each_wanted() {
    [ "${#BENCH_WANT[@]}" -gt 0 ] || return 0
    local p
    log "installing ${BENCH_WANT[*]} (apt-get)"
    for p in "${BENCH_WANT[@]}"; do
        apt_install "$p" || log "cannot install $p"
    done
    BENCH_WANT=()
}

# In a command substitution errexit is off: every failure returns here by hand.
binary_or_build() { # GIVEN PKG [BIN]
    local bin="${1:-}" profile=release
    # keel is measured as it ships: the profile deploy/build.sh builds.
    [ "$2" != keel ] || profile="${KEEL_PROFILE:-ship}"
    local args=(--profile "$profile" -p "$2" --quiet)
    if [ -z "$bin" ]; then
        [ $# -lt 3 ] || args+=(--bin "$3")
        log "building ${3:-$2} (cargo build ${args[*]})"
        (cd "$REPO" && cargo build "${args[@]}" >&2) || return 1
        bin="${CARGO_TARGET_DIR:-$REPO/target}/$profile/${3:-$2}"
    fi
    [ -x "$bin" ] || { echo "$BENCH: no binary at $bin" >&2; return 1; }
    echo "$bin"
}

bench_workdir() { # PREFIX
    WORK="$(mktemp -d "/tmp/$1.XXXXXX")"
    trap bench_cleanup EXIT
    trap 'exit 130' INT TERM
}

bench_cleanup() {
    set +e
    local pid
    if [ "${#STARTED[@]}" -gt 0 ]; then
        for pid in "${STARTED[@]}"; do kill "$pid" 2>/dev/null; done
        sleep 0.3
        for pid in "${STARTED[@]}"; do kill -9 "$pid" 2>/dev/null; done
    fi
    wait 2>/dev/null
    [ -n "${KEEP_WORK:-}" ] || rm -rf "$WORK"
}

wait_port() { # PORT [SECS]
    local deadline=$((SECONDS + ${2:-10}))
    until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "$BENCH: nothing listens on port $1" >&2; return 1; }
        sleep 0.05
    done
}

ports_free() { # PORT...
    local port
    for port in "$@"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$BENCH: 127.0.0.1:$port is already in use (another benchmark run?); stop it first" >&2
            return 1
        fi
    done
}

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }

stop_pid() { # PID [SECS]
    alive "$1" || return 0
    kill "$1" 2>/dev/null || true
    local deadline=$((SECONDS + ${2:-10}))
    while alive "$1" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.05; done
    if alive "$1"; then kill -9 "$1" 2>/dev/null || true; fi
    wait "$1" 2>/dev/null || true
}

pids_of() {
    echo "$1"
    pgrep -P "$1" 2>/dev/null || true
}

# Fields 14 and 15 of /proc/PID/stat (utime, stime), counted after the command name, which
# may hold spaces; a process's fields sum all of its threads.
cpu_split() {
    local u=0 k=0 p s f
    for p in $(pids_of "$1"); do
        s="$(cat "/proc/$p/stat" 2>/dev/null)" || continue
        read -r -a f <<<"${s##*) }"
        u=$((u + f[11])); k=$((k + f[12]))
    done
    echo "$u $k"
}

cpu_ticks() {
    local u k
    read -r u k < <(cpu_split "$1")
    echo $((u + k))
}

peak_rss_kb() {
    local t=0 p v
    for p in $(pids_of "$1"); do
        v="$(awk '/^VmHWM:/ {print $2}' "/proc/$p/status" 2>/dev/null)" || continue
        t=$((t + ${v:-0}))
    done
    echo "$t"
}

nginx_backend() { # DIR PORT BODY
    mkdir -p "$1"
    cat >"$1/nginx.conf" <<EOF
daemon off; master_process off; worker_processes 1; pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 10000000; keepalive_timeout 120s; default_type text/plain;
  server { listen 127.0.0.1:$2 backlog=4096; location / { return 200 "$3"; } } }
EOF
}

# The plain HTTP/1.1 setup that instructions.sh and cpu_counts.sh count alike, in DIR: an NGINX
# backend on 22001 answering a small body (started, in STARTED), and keel.toml, nginx.conf and
# haproxy.cfg for keel, NGINX and HAProxy on 22010-22012 in front of it (one worker each, the
# same work: X-Forwarded-* and an upstream header).
plain_proxy_setup() { # DIR
    local W="$1"
    nginx_backend "$W/backend" 22001 "backend: ok\n"
    nginx -p "$W/backend" -c "$W/backend/nginx.conf" -e "$W/backend/error.log" &
    STARTED+=("$!")
    wait_port 22001

    {
        echo '[[listener]]'; echo 'listen = "127.0.0.1:22010"'; echo 'cluster = "app"'
        echo '[[cluster]]'; echo 'name = "app"'; echo 'endpoints = [{ address = "127.0.0.1:22001" }]'
    } >"$W/keel.toml"
    cat >"$W/nginx.conf" <<EOF
daemon off; master_process off; worker_processes 1; pid $W/nginx.pid; error_log $W/nginx.err warn;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 10000000;
  upstream app { server 127.0.0.1:22001; keepalive 256; }
  server { listen 127.0.0.1:22011 backlog=4096;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for; proxy_set_header X-Forwarded-Proto \$scheme;
      proxy_set_header X-Forwarded-Host \$host; add_header X-Upstream \$upstream_addr; } } }
EOF
    cat >"$W/haproxy.cfg" <<EOF
global
    nbthread 1
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    option http-keep-alive
    http-reuse always
frontend fe
    bind 127.0.0.1:22012
    option forwardfor
    http-request set-header X-Forwarded-Host %[req.hdr(host)]
    http-response set-header X-Upstream %[srv_name]
    default_backend app
backend app
    server b1 127.0.0.1:22001
EOF
}
