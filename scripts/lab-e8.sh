#!/usr/bin/env bash
# Retired: E8 (and E9) on real traffic are part of `keel lab` now, which measures them with
# open-loop Poisson arrivals, measures what the backends actually served (x-keel-service-us),
# simulates that, and compares p50/p99/p99.9 with 95 % intervals (and queueing theory for
# random placement): see docs/tail-latency.md, "E8 and E9 in the lab". This script now runs
# that, in process (no wrk, no fixed ports):
#
#   KEEL=target/release/keel scripts/lab-e8.sh [--quick] [--out DIR]
#   STRATEGIES="random prequal" scripts/lab-e8.sh
#
# The closed-loop wrk run it used to make (8 `keel backend` processes, 2 of them 3x slower,
# one `keel proxy`, scenarios/e8-loopback.toml for the simulator) is in git history; its numbers
# departed from the simulator's because the backends served exponential 10 ms as about 13.4 ms.
set -euo pipefail
KEEL=${KEEL:-keel}
args=(lab --experiments e8)
if [ -n "${STRATEGIES:-}" ]; then
  args+=(--strategies "$(tr ' ' ',' <<<"$STRATEGIES")")
fi
exec "$KEEL" "${args[@]}" "$@"
