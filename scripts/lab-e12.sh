#!/usr/bin/env bash
# E12, measured: N = 1-4 keel proxies on a three-member etcd (loopback), one endpoint of three
# failing at once; the fleet's failed tries with local detection and with shared evidence
# (quorum 1), next to keel-model's closed form and simulation of the same setting. About seven
# minutes. Needs etcd-server and protoc (scripts/test-etcd.sh installs them). Prints one
# `E12 | ...` line per row. `bash scripts/lab-e12.sh faults_` runs etcd's faults instead.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v etcd >/dev/null || { echo "lab-e12: etcd missing: apt-get install etcd-server (or run scripts/test-etcd.sh once)" >&2; exit 1; }
# The first argument picks the measurement: e12_ (default) or faults_ (`faults | ...` lines).
cargo test --release -p keel-proxy --features etcd --test etcd "${1:-e12_}" -- --include-ignored --nocapture --test-threads=1
