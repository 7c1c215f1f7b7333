#!/usr/bin/env bash
# Per-endpoint shares of requests through the proxy, one request in flight: N `keel backend`s on
# loopback answering in --latency, one `keel proxy` in front of them with the given weights, and
# sequential keep-alive GETs (one curl, one connection). Each response's x-backend header says
# which endpoint answered.
#
#   bash bench/shares.sh                                   # the weight-aware strategies, weights 2,1,1,1,1
#   bash bench/shares.sh least-connections peak-ewma       # some strategies
#   WEIGHTS=1,1,1 REQUESTS=300 bash bench/shares.sh peak-ewma   # the cold-start check
#   KEEL=/path/to/keel LATENCY=10ms bash bench/shares.sh
#
# Prints one line per strategy: requests per endpoint and shares, next to the weights' shares.
# Traffic stays on 127.0.0.1; every process started here is stopped on exit.
set -euo pipefail

# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
keel=${KEEL:-${CARGO_TARGET_DIR:-$REPO/target}/release/keel}
weights=${WEIGHTS:-2,1,1,1,1}
requests=${REQUESTS:-1000}
latency=${LATENCY:-10ms}
base_port=${BASE_PORT:-19100}
if [ $# -gt 0 ]; then
    strategies=("$@")
else
    strategies=(least-connections least-request least-time peak-ewma weighted-round-robin weighted-random)
fi
[ -x "$keel" ] || {
    echo "no keel binary at $keel (cargo build --release -p keel, or set KEEL)" >&2
    exit 2
}

IFS=, read -r -a ws <<<"$weights"
n=${#ws[@]}
total=0
for w in "${ws[@]}"; do total=$((total + w)); done
bench_workdir keel-shares
work=$WORK

# The backends: one process, n listeners named be-1 .. be-n.
listen=()
for i in $(seq 1 "$n"); do listen+=(--listen "127.0.0.1:$((base_port + i))"); done
"$keel" backend "${listen[@]}" --latency "$latency" --name be >"$work/backend.log" 2>&1 &
STARTED+=($!)

proxy_port=$base_port
wait_for() {
    for _ in $(seq 1 100); do
        curl -s -o /dev/null "$1" && return 0
        sleep 0.05
    done
    echo "nothing answers at $1" >&2
    exit 1
}
wait_for "http://127.0.0.1:$((base_port + 1))/"

echo "weights $weights, $requests sequential keep-alive GETs, backends answering in $latency"
printf 'expected:'
for w in "${ws[@]}"; do printf ' %5.1f%%' "$(echo "100 * $w / $total" | bc -l)"; done
echo
for strategy in "${strategies[@]}"; do
    {
        echo "[[listener]]"
        echo "listen = \"127.0.0.1:$proxy_port\""
        echo "cluster = \"app\""
        echo "[[cluster]]"
        echo "name = \"app\""
        echo "strategy = \"$strategy\""
        echo "endpoints = ["
        for i in $(seq 1 "$n"); do
            echo "  { address = \"127.0.0.1:$((base_port + i))\", weight = ${ws[$((i - 1))]} },"
        done
        echo "]"
    } >"$work/proxy.toml"
    "$keel" proxy --config "$work/proxy.toml" --workers 1 --log warn >"$work/proxy.log" 2>&1 &
    proxy=$!
    STARTED+=("$proxy")
    wait_for "http://127.0.0.1:$proxy_port/"
    # One curl with many URLs: one keep-alive connection, one request at a time.
    for _ in $(seq 1 "$requests"); do
        echo "url = \"http://127.0.0.1:$proxy_port/\""
        echo "output = \"/dev/null\""
    done >"$work/urls"
    curl -s -K "$work/urls" -w '%header{x-backend}\n' >"$work/answers"
    stop_pid "$proxy"
    printf '%-21s' "$strategy:"
    for i in $(seq 1 "$n"); do
        c=$(grep -cx "be-$i" "$work/answers" || true)
        printf ' %5.1f%% (%d)' "$(echo "100 * $c / $requests" | bc -l)" "$c"
    done
    echo
done
