#!/usr/bin/env bash
# Access log on vs off: keel's throughput in front of two loopback backends, with [access_log]
# (JSON lines to a file) and without, in alternating wrk runs (off, on, off, on, ...), so that
# the machine's drift hits both alike. Prints each run and the ratio of the medians.
#
#   bench/proxy/access-log.sh
#
# Environment (all optional):
#   KEEL_BIN          keel binary (default: `cargo build --release -p keel`, from CARGO_TARGET_DIR)
#   ROUNDS DURATION   rounds (each one off and one on run) and seconds per run (default 3 and 8)
#   CONNS             wrk connections (default 64)
#   PROXY_CPUS LOAD_CPUS  CPUs of keel, and of wrk and the backends (default 0 and 1)
#
# Listens on 127.0.0.1 ports 21101-21103; everything is stopped on exit.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-8}"
CONNS="${CONNS:-64}"
PROXY_CPUS="${PROXY_CPUS:-0}"
LOAD_CPUS="${LOAD_CPUS:-1}"

KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
bench_workdir keel-access-log-bench

taskset -c "$LOAD_CPUS" "$KEEL_BIN" backend --listen 127.0.0.1:21101 --listen 127.0.0.1:21102 \
    >"$WORK/backend.out" 2>&1 &
STARTED+=("$!")
wait_port 21101 5
wait_port 21102 5

for mode in off on; do
    mkdir -p "$WORK/$mode"
    {
        if [ "$mode" = on ]; then
            printf '[access_log]\npath = "access.log"\nformat = "json"\n\n'
        fi
        printf '[[listener]]\nlisten = "127.0.0.1:21103"\ncluster = "app"\n\n'
        printf '[[cluster]]\nname = "app"\nstrategy = "round-robin"\n'
        printf 'endpoints = [{ address = "127.0.0.1:21101" }, { address = "127.0.0.1:21102" }]\n'
    } >"$WORK/$mode/keel.toml"
done

run() { # mode -> prints requests/s
    local mode="$1"
    taskset -c "$PROXY_CPUS" "$KEEL_BIN" proxy --config "$WORK/$mode/keel.toml" --workers 1 \
        --log warn >"$WORK/$mode/keel.out" 2>&1 &
    local pid="$!"
    STARTED+=("$pid")
    wait_port 21103 5 || exit 1 # in $(run ...): errexit is off there
    taskset -c "$LOAD_CPUS" wrk -t1 -c"$CONNS" -d1s http://127.0.0.1:21103/ >/dev/null # warm-up
    local rps
    rps="$(taskset -c "$LOAD_CPUS" wrk -t1 -c"$CONNS" -d"${DURATION}s" http://127.0.0.1:21103/ |
        awk '/^Requests\/sec/ {print $2}')"
    stop_pid "$pid"
    echo "$rps"
}

median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

: >"$WORK/off.txt"
: >"$WORK/on.txt"
for r in $(seq "$ROUNDS"); do
    off="$(run off)"
    on="$(run on)"
    lines="$(wc -l <"$WORK/on/access.log")"
    echo "round $r: off ${off} req/s, on ${on} req/s (log: ${lines} lines so far)"
    echo "$off" >>"$WORK/off.txt"
    echo "$on" >>"$WORK/on.txt"
done
off_m="$(median <"$WORK/off.txt")"
on_m="$(median <"$WORK/on.txt")"
awk -v off="$off_m" -v on="$on_m" 'BEGIN {
    printf "median: off %.0f req/s, on %.0f req/s, on/off = %.3f\n", off, on, on / off }'
