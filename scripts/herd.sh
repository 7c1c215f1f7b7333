#!/usr/bin/env bash
# The herd on real traffic, next to the simulator: 10 `keel backend
# --concurrency 1` processes (exponential 10 ms), 3 `keel proxy` processes each with the same
# cluster of the 10 backends (one strategy per run), and open-loop Poisson arrivals split at random
# over the 3 proxies (crates/keel/examples/open_loop.rs, keel-testbed's openloop) at LOAD of the
# cluster's capacity. Prints, per load and strategy, the measured p50/p99/p99.9 (95 % batch-means
# intervals), what the backends actually served (mean service time, from their
# x-keel-service-us), the simulator's N = 3 row of `keel simulate --preset herd`, and the
# simulator's twin of the run (N = 3, the measured service mean and arrival rate).
#
#   cargo build --release -p keel --bin keel --example open_loop
#   KEEL=target/release/keel scripts/herd.sh
#
# Loopback only (127.0.0.1, ports 19811-19820 and 19831-19833); bounded: REQUESTS + WARMUP arrivals
# per run, each cut at 2 s, and every run under `timeout`. Kills what it starts, by PID.
#
# The rate: the preset's load is offered work over capacity at 10 ms per call. A backend asked
# for exponential 10 ms serves more than 10 ms on a loaded machine (the timer's millisecond
# granularity, the scheduler), so by default the rate is LOAD x 10 / S calls per second, with S
# the mean service time measured by a calibration run (RATE=... overrides it). Each run's own
# measured S then gives the load it really offered, and the twin simulates exactly that.
set -euo pipefail
KEEL=${KEEL:-target/release/keel}
LOADGEN=${LOADGEN:-$(dirname "$KEEL")/examples/open_loop}
LOADS=${LOADS:-0.8 0.9}
STRATEGIES=${STRATEGIES:-least-request peak-ewma prequal}
REQUESTS=${REQUESTS:-20000}
WARMUP=${WARMUP:-3000}
SEED=${SEED:-1}
RATE=${RATE:-}
OUT=${OUT:-}
# NICE=-10 (root only) runs everything this script starts ahead of other work on the machine:
# on shared cores a compiler's time slice stalls the backends' timers and the load generator
# (the table's send lag shows it), and stalls of 100-300 ms land in p99.
NICE=${NICE:-0}
pre=(nice -n "$NICE")   # nice execs the command: $! is its PID
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# CPU seconds (user + system) used so far by these PIDs.
tick=$(getconf CLK_TCK)
cpu() {
  local t=0 p
  for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
  python3 -c "print($t / $tick)"
}

endpoints=""
backends=()
bpids=()
for i in $(seq 1 10); do
  port=$((19810 + i))
  "${pre[@]}" "$KEEL" backend --listen "127.0.0.1:$port" --latency 10ms --latency-dist exponential \
    --concurrency 1 --seed "$i" --name "b$i" >"$work/backend$i.log" 2>&1 &
  pids+=($!)
  bpids+=($!)
  endpoints+="{ address = \"127.0.0.1:$port\" }, "
  backends+=("--target" "http://127.0.0.1:$port/")
done
sleep 1

# The calibration: what a backend serves for exponential 10 ms here, at half load straight to
# the backends (no proxy).
if [ -z "$RATE" ]; then
  "${pre[@]}" timeout 60 "$LOADGEN" "${backends[@]}" --rate 500 --requests 5000 --warmup 500 \
    --seed "$SEED" >"$work/calibration.json"
  service=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["service_ms"]["mean"])' \
    "$work/calibration.json")
  python3 - "$work/calibration.json" >&2 <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["service_ms"]
print(f"calibration (5000 calls at 500/s straight to the backends): exponential 10 ms served as "
      f"mean {s['mean']:.2f} ms, p50 {s['p50']:.2f}, p99 {s['p99']:.2f} (exponential 10 ms: 6.93, 46.05)")
PY
else
  service=""
fi

"$KEEL" simulate --preset herd --json --quiet >"$work/preset.json"

printf '| load | strategy | rate /s | served ms: mean (p50, p99) | offered load | measured p50 | p99 [95%% CI] | p99.9 | sim N=3 p99 [95%% CI] | twin p99 [95%% CI] | agrees (sim / twin) | send lag p99 / max ms | CPU cores: proxies / backends |\n'
printf '|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n'
for load in $LOADS; do
  if [ -n "$RATE" ]; then
    rate=$RATE
  else
    rate=$(python3 -c "print(round($load * 10 / ($service / 1000), 1))")
  fi
  for s in $STRATEGIES; do
    proxies=()
    for j in 1 2 3; do
      port=$((19830 + j))
      cat >"$work/proxy$j.toml" <<TOML
[[listener]]
listen = "127.0.0.1:$port"
cluster = "app"

[[cluster]]
name = "app"
strategy = "$s"
request_timeout = "2s"
endpoints = [$endpoints]
TOML
      "${pre[@]}" "$KEEL" proxy --workers 1 --config "$work/proxy$j.toml" >"$work/proxy$j-$s.log" 2>&1 &
      proxies+=($!)
      pids+=($!)
    done
    sleep 1
    targets=()
    for j in 1 2 3; do targets+=("--target" "http://127.0.0.1:$((19830 + j))/"); done
    bcpu0=$(cpu "${bpids[@]}")
    budget=$(python3 -c "print(int(($REQUESTS + $WARMUP) / $rate * 2 + 30))")
    "${pre[@]}" timeout "$budget" "$LOADGEN" "${targets[@]}" --rate "$rate" --requests "$REQUESTS" \
      --warmup "$WARMUP" --seed "$SEED" >"$work/run-$load-$s.json"
    # CPU seconds the proxies and the backends used over the run (the machine is shared: what
    # prequal's probes cost shows here).
    pcpu=$(cpu "${proxies[@]}")
    bcpu=$(python3 -c "print($(cpu "${bpids[@]}") - $bcpu0)")
    for p in "${proxies[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${proxies[@]}"; do wait "$p" 2>/dev/null || true; done
    # The twin: N = 3 balancers, what the backends served in this run, the rate it sent.
    python3 - "$work/run-$load-$s.json" "$s" >"$work/twin.toml" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f'''name = "herd-twin"
label = "twin"
seed = 1
replications = 8
requests = 60000
warmup = "5s"
timeout = "2s"
placement = "client-side"

[load]
kind = "open"
rate = {r["rate"]:.3f}
clients = 3

[[clusters]]
name = "backend"
servers = 10
latency = {{ dist = "exponential", mean = "{r["service_ms"]["mean"] * 1000:.0f}us" }}
capacity = {{ concurrency = 1 }}

[clusters.balancer]
strategy = "{sys.argv[2]}"''')
if sys.argv[2] == "prequal":
    # As the proxy does: probes, and the x-keel-rif / x-keel-latency-us of every answer.
    print("\n[load_reports]\non_answers = true")
PY
    "$KEEL" simulate --scenario "$work/twin.toml" --json --quiet >"$work/twin-$load-$s.json"
    python3 - "$load" "$s" "$work/run-$load-$s.json" "$work/preset.json" "$work/twin-$load-$s.json" \
      "$pcpu" "$bcpu" <<'PY'
import json, sys
load, s, run, preset, twin, pcpu, bcpu = sys.argv[1:]
r = json.load(open(run))
rows = json.load(open(preset))["results"]
row = next(x for x in rows if x["strategy"] == s and x["label"] == f"load {float(load):.2f}, N=3 proxies")
t = json.load(open(twin))["results"][0]
m = r["latency_ms"]
ci = r["latency_ci95_ms"]
def within(sim):
    lo, hi = sim["latency_ci95_ms"]["p99"]
    p = sim["latency_ms"]["p99"]
    return lo <= m["p99"] <= hi or abs(m["p99"] / p - 1) <= 0.25
served = r["service_ms"]["mean"]
offered = r["rate"] * served / 1000 / 10
fails = r["requests"] - r["succeeded"]
note = "" if fails == 0 else f" ({fails} failed)"
verdict = ("yes" if within(row) else "no") + " / " + ("yes" if within(t) else "no")
def fmt(x):
    lo, hi = x["latency_ci95_ms"]["p99"]
    return f'{x["latency_ms"]["p99"]:.1f} [{lo:.1f}, {hi:.1f}]'
sv = r["service_ms"]
print(f'| {float(load):.2f} | {s} | {r["rate"]:.0f} | {served:.2f} ({sv["p50"]:.1f}, {sv["p99"]:.1f}) | {offered:.3f} | {m["p50"]:.1f} '
      f'| {m["p99"]:.1f} [{ci["p99"][0]:.1f}, {ci["p99"][1]:.1f}] | {m["p999"]:.1f} '
      f'| {fmt(row)} | {fmt(t)} | {verdict}{note} | {r["lag_ms"]["p99"]:.1f} / {r["lag_ms"]["max"]:.0f} '
      f'| {float(pcpu) / r["elapsed_s"]:.2f} / {float(bcpu) / r["elapsed_s"]:.2f} |')
PY
    if [ -n "$OUT" ]; then cp "$work/run-$load-$s.json" "$work/twin-$load-$s.json" "$OUT/"; fi
  done
done
