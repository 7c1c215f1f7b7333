#!/usr/bin/env bash
# E12, measured: N = 1-4 keel proxies on a three-member etcd (loopback), one endpoint of three
# failing at once; the fleet's failed tries with local detection and with shared evidence
# (quorum 1), next to keel-model's closed form and simulation, and the evidence records each
# failed try costs etcd. This is `keel lab --experiments e12` (about six minutes; `--quick` for
# two sizes and three runs a cell), writing its page to lab-e12/. `bash scripts/lab-e12.sh
# faults_` runs etcd's faults under traffic instead (`faults | ...` lines). Needs etcd-server
# (scripts/test-etcd.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v etcd >/dev/null || { echo "lab-e12: etcd missing: apt-get install etcd-server (or run scripts/test-etcd.sh once)" >&2; exit 1; }
if [ "${1:-}" = "faults_" ]; then
    exec cargo test --release -p keel-proxy --features etcd --test proxy etcd::faults:: -- --include-ignored --nocapture --test-threads=1
fi
exec cargo run --release -p keel -- lab --experiments e12 --out "${OUT:-lab-e12}" "$@"
