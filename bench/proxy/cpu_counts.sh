#!/usr/bin/env bash
# Where each proxy's CPU per plain HTTP/1.1 request goes, counted rather than timed: keel, NGINX
# and HAProxy in one run, one worker/thread each, the same backend and client as
# bench/proxy/instructions.sh.
#
#   bench/proxy/cpu_counts.sh
#
# This machine is a VM without hardware performance counters (`perf stat -e cycles` is "not
# supported"), so cycles, instructions per cycle and the caches are counted two other ways:
#
# - Simulated (load-independent): callgrind with its cache and branch simulators over 10 s of
#   wrk traffic after 3 s of warm-up: instructions, L1 instruction and data misses, last-level
#   misses and mispredicted branches per request (the simulator models this CPU's caches, read
#   by cpuid). Only user space is counted.
# - Native, over 10 s of wrk traffic (-c16) after 2 s of warm-up: user and system CPU time per
#   request (/proc/PID/stat of every thread), voluntary and involuntary context switches per
#   request (/proc/PID/task/*/status), CPU migrations and page faults (perf stat's software
#   events), and the requests per second. These move with the machine's load: read them as
#   ratios between proxies of the same run.
# - The kernel's floor: each proxy pinned to CPU 0, the endpoint and wrk to CPU 1, the whole
#   machine sampled (`perf record -a -e cpu-clock`, 4 kHz) over DURATION s of wrk at each of
#   CONNS: per request, the proxy's user-space and kernel time (a sample is 250 us; the kernel's
#   includes the loopback receive path it runs for the other end of each send), CPU 0's idle
#   time, the client's and the endpoint's CPU on CPU 1, and the TCP segments sent
#   (/proc/net/snmp OutSegs, both ends; 4 is the least a proxied request can take: request in,
#   request out, response in, response out). This is the half that says how far user-space
#   work can move a proxy's CPU per request: not past its kernel time.
#
# Environment: KEEL_BIN (else `cargo build --release -p keel`), OUT (default
# target/proxy-cpu-counts), DURATION (10), ONLY (`simulated`, `native` or `floor`: one part),
# PROXIES (default "keel nginx haproxy": those measured, in that order), CONNS (the floor's
# connection counts, default "16 128"). Ports 22001 and 22010-22012 on 127.0.0.1.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage_from_header; exit 0 ;;
        *) echo "cpu_counts.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
ONLY="${ONLY:-}"
case "$ONLY" in ""|simulated|native|floor) ;; *) echo "cpu_counts.sh: ONLY must be simulated, native or floor, not $ONLY" >&2; exit 2 ;; esac
want_pkg valgrind valgrind
want_pkg nginx nginx
want_pkg haproxy haproxy
want_pkg wrk wrk
want_pkg perf linux-perf
install_wanted
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
OUT="${OUT:-$REPO/target/proxy-cpu-counts}"
DURATION="${DURATION:-10}"
mkdir -p "$OUT"
ports_free 22001 22010 22011 22012
bench_workdir keel-cpu
W="$WORK"

plain_proxy_setup "$W"

# Context switches of every thread of a process: voluntary, then involuntary.
switches() {
    local v=0 n=0 t a b
    for t in /proc/"$1"/task/*/status; do
        a="$(awk '/^voluntary_ctxt_switches:/ {print $2}' "$t" 2>/dev/null)" || continue
        b="$(awk '/^nonvoluntary_ctxt_switches:/ {print $2}' "$t" 2>/dev/null)" || continue
        v=$((v + ${a:-0})); n=$((n + ${b:-0}))
    done
    echo "$v $n"
}

simulated() { # name port command...
    local name="$1" port="$2"; shift 2
    rm -f "$OUT/$name.cachesim"*
    valgrind --tool=callgrind --cache-sim=yes --branch-sim=yes \
        --callgrind-out-file="$OUT/$name.cachesim" "$@" >"$OUT/$name.sim.log" 2>&1 &
    local vp=$!
    STARTED+=("$vp")
    wait_port "$port" 120 || { cat "$OUT/$name.sim.log" >&2; return 1; }
    wrk -t1 -c16 -d3s "http://127.0.0.1:$port/" >/dev/null
    callgrind_control -z "$vp" >/dev/null 2>&1
    wrk -t1 -c16 -d"${DURATION}s" "http://127.0.0.1:$port/" >"$OUT/$name.sim.wrk"
    callgrind_control -d "$vp" >/dev/null 2>&1
    sleep 1
    stop_pid "$vp" 60
    local req
    req="$(grep -oP '\d+(?= requests in)' "$OUT/$name.sim.wrk")"
    # events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim
    grep -h '^events:\|^totals:' "$OUT/$name.cachesim.1" | awk -v n="$name" -v r="$req" '
        /^events:/ { for (i = 2; i <= NF; i++) ev[i] = $i }
        /^totals:/ { for (i = 2; i <= NF; i++) t[ev[i]] = $i
            printf "%s\t%d\t%.0f\t%.1f\t%.1f\t%.1f\t%.1f\n", n, r, t["Ir"] / r,
                t["I1mr"] / r, (t["D1mr"] + t["D1mw"]) / r,
                (t["ILmr"] + t["DLmr"] + t["DLmw"]) / r, (t["Bcm"] + t["Bim"]) / r }'
}

native() { # name port command...
    local name="$1" port="$2"; shift 2
    "$@" >"$OUT/$name.native.log" 2>&1 &
    local p=$!
    STARTED+=("$p")
    wait_port "$port" 30
    wrk -t1 -c16 -d2s "http://127.0.0.1:$port/" >/dev/null
    local u0 k0 v0 n0 u1 k1 v1 n1
    read -r u0 k0 < <(cpu_split "$p")
    read -r v0 n0 < <(switches "$p")
    perf stat -x, -e task-clock,context-switches,cpu-migrations,page-faults -p "$p" \
        -o "$OUT/$name.perfstat" -- sleep "$((DURATION + 1))" &
    local ps=$!
    wrk -t1 -c16 -d"${DURATION}s" "http://127.0.0.1:$port/" >"$OUT/$name.native.wrk"
    read -r u1 k1 < <(cpu_split "$p")
    read -r v1 n1 < <(switches "$p")
    wait "$ps" || true
    stop_pid "$p" 10
    local req hz mig
    req="$(grep -oP '\d+(?= requests in)' "$OUT/$name.native.wrk")"
    hz="$(getconf CLK_TCK)"
    mig="$(awk -F, '$3 == "cpu-migrations" {print $1}' "$OUT/$name.perfstat")"
    awk -v n="$name" -v r="$req" -v d="$DURATION" -v hz="$hz" -v u="$((u1 - u0))" -v k="$((k1 - k0))" \
        -v vv="$((v1 - v0))" -v nv="$((n1 - n0))" -v mig="${mig:-0}" 'BEGIN {
        printf "%s\t%.0f\t%.2f\t%.2f\t%.3f\t%.3f\t%.4f\n", n, r / d, u / hz / r * 1e6,
            k / hz / r * 1e6, vv / r, nv / r, mig / r }'
}

PROXIES="${PROXIES:-keel nginx haproxy}"
# Each proxy's port and command line.
each() { # simulated|native
    local p
    for p in $PROXIES; do
        case "$p" in
            keel) "$1" keel 22010 "$KEEL_BIN" proxy --config "$W/keel.toml" --workers 1 --log warn ;;
            nginx) "$1" nginx 22011 nginx -p "$W" -c "$W/nginx.conf" ;;
            haproxy) "$1" haproxy 22012 haproxy -db -f "$W/haproxy.cfg" ;;
            *) echo "cpu_counts.sh: unknown proxy $p (PROXIES)" >&2; return 1 ;;
        esac
    done
}
if [ -z "$ONLY" ] || [ "$ONLY" = simulated ]; then
{
    echo "# simulated (callgrind --cache-sim=yes --branch-sim=yes, user space, 1 worker, wrk -c16), per request"
    printf 'proxy\trequests\tinstructions\tL1i misses\tL1d misses\tLL misses\tbranch mispredicts\n'
} | tee "$OUT/simulated.tsv"
each simulated | tee -a "$OUT/simulated.tsv"
fi
if [ -z "$ONLY" ] || [ "$ONLY" = native ]; then
{
    echo "# native (1 worker, wrk -c16, ${DURATION} s), per request; load average at start: $(cut -d' ' -f1 /proc/loadavg)"
    printf 'proxy\treq/s\tuser us\tsystem us\tvoluntary switches\tinvoluntary switches\tmigrations\n'
} | tee "$OUT/native.tsv"
each native | tee -a "$OUT/native.tsv"
fi

# TCP segments sent so far, on every socket of the machine (loopback counts both ends).
out_segs() { awk '/^Tcp:/ { if (++n == 1) { for (i = 1; i <= NF; i++) if ($i == "OutSegs") c = i } else print $c }' /proc/net/snmp; }

floor() { # name port command...
    local name="$1" port="$2"; shift 2
    taskset -c 0 "$@" >"$OUT/$name.floor.log" 2>&1 &
    local p=$!
    STARTED+=("$p")
    wait_port "$port" 30
    local c s0 s1 req
    for c in $CONNS; do
        taskset -c 1 wrk -t1 -c"$c" -d2s "http://127.0.0.1:$port/" >/dev/null
        s0="$(out_segs)"
        perf record -q -a -e cpu-clock -F 4000 -o "$OUT/$name.floor-c$c.data" -- sleep "$DURATION" 2>/dev/null &
        local pr=$!
        taskset -c 1 wrk -t1 -c"$c" -d"${DURATION}s" "http://127.0.0.1:$port/" >"$OUT/$name.floor-c$c.wrk"
        wait "$pr" || true
        s1="$(out_segs)"
        req="$(grep -oP '\d+(?= requests in)' "$OUT/$name.floor-c$c.wrk")"
        perf report -i "$OUT/$name.floor-c$c.data" --stdio -n --no-children --sort cpu,comm,dso -g none 2>/dev/null |
            awk -v n="$name" -v c="$c" -v r="$req" -v d="$DURATION" -v segs="$((s1 - s0))" '
            /^#/ || NF < 5 { next }
            { cpu = $3 + 0; comm = $4; k = ($5 == "[kernel.kallsyms]"); us = $2 * 250 / r
              if (cpu == 0 && comm == "swapper") idle += us
              else if (cpu == 0 && comm != "perf") { if (k) kern += us; else user += us }
              else if (cpu == 1 && comm != "swapper" && comm != "perf") load += us }
            END { printf "%s\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.3f\n", n, c, r / d, user, kern,
                  user + kern, idle, load, segs / r }'
    done
    stop_pid "$p" 10
}
if [ -z "$ONLY" ] || [ "$ONLY" = floor ]; then
    CONNS="${CONNS:-16 128}"
    for p in $(pids_of "${STARTED[0]}"); do taskset -pc 1 "$p" >/dev/null; done
    {
        echo "# the kernel's floor (proxy on CPU 0; wrk and the endpoint on CPU 1; perf record -a -e cpu-clock, ${DURATION} s a point), per request, us"
        printf 'proxy\tconnections\treq/s\tuser\tkernel\tproxy CPU\tCPU 0 idle\tclient + endpoint\tTCP segments\n'
    } | tee "$OUT/floor.tsv"
    each floor | tee -a "$OUT/floor.tsv"
fi
