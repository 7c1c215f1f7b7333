#!/usr/bin/env bash
# E8 on real traffic, reduced to one machine's loopback, next to the simulator's number for the
# same setting (scenarios/e8-loopback.toml): 8 `keel backend --concurrency 1` processes
# (exponential 10 ms; the first 2 with --fault slow --slow-factor 3), one `keel proxy` per
# strategy in front (server-side placement), and wrk with 8 connections (a closed loop of 8
# requests in flight) for DURATION. Prints, per strategy, the measured mean/p50/p90/p99 (wrk)
# and the simulated mean/p50/p99.
#
#   KEEL=target/release/keel DURATION=8s scripts/lab-e8.sh
#
# Needs wrk. Uses ports 19511-19518 and 19600 on 127.0.0.1. Not part of `keel lab` yet.
set -euo pipefail
KEEL=${KEEL:-keel}
DURATION=${DURATION:-8s}
STRATEGIES=${STRATEGIES:-random least-request peak-ewma prequal}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
endpoints=""
for i in 1 2 3 4 5 6 7 8; do
  port=$((19510 + i))
  slow=()
  if [ "$i" -le 2 ]; then slow=(--fault slow --slow-factor 3); fi
  "$KEEL" backend --listen "127.0.0.1:$port" --latency 10ms --latency-dist exponential \
    --concurrency 1 --seed "$i" --name "b$i" "${slow[@]}" >"$work/backend$i.log" 2>&1 &
  pids+=($!)
  endpoints+="{ address = \"127.0.0.1:$port\" }, "
done
sleep 1
printf '| strategy | measured mean ms | p50 | p90 | p99 | req/s | simulated mean ms | p50 | p99 |\n'
printf '|---|---:|---:|---:|---:|---:|---:|---:|---:|\n'
for s in $STRATEGIES; do
  cat >"$work/proxy.toml" <<TOML
[[listener]]
listen = "127.0.0.1:19600"
cluster = "app"

[[cluster]]
name = "app"
strategy = "$s"
request_timeout = "2s"
endpoints = [$endpoints]
TOML
  "$KEEL" proxy --config "$work/proxy.toml" >"$work/proxy-$s.log" 2>&1 &
  proxy=$!
  sleep 1
  wrk -t 2 -c 8 -d "$DURATION" --latency http://127.0.0.1:19600/ >"$work/wrk-$s.txt"
  kill "$proxy"
  wait "$proxy" 2>/dev/null || true
  sed "s/^strategy = .*/strategy = \"$s\"/" "$here/scenarios/e8-loopback.toml" >"$work/sim.toml"
  "$KEEL" simulate --scenario "$work/sim.toml" --quiet --json >"$work/sim-$s.json"
  python3 - "$s" "$work/wrk-$s.txt" "$work/sim-$s.json" <<'PY'
import json, re, sys
s, wrk, sim = sys.argv[1:]
text = open(wrk).read()
def ms(v):
    n, unit = re.match(r"([\d.]+)(us|ms|s)", v).groups()
    return float(n) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
mean = ms(re.search(r"Latency\s+(\S+)", text).group(1))
q = {p: ms(re.search(rf"\s{p}%\s+(\S+)", text).group(1)) for p in ("50", "90", "99")}
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
l = json.load(open(sim))["results"][0]["latency_ms"]
print(f"| {s} | {mean:.1f} | {q['50']:.1f} | {q['90']:.1f} | {q['99']:.1f} | {rps:.0f} "
      f"| {l['mean']:.1f} | {l['p50']:.1f} | {l['p99']:.1f} |")
PY
done
