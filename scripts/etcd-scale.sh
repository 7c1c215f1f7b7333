#!/usr/bin/env bash
# What a fleet of keel proxies costs etcd, measured on a three-member etcd on loopback: N = 1, 5,
# 10, 25, 50 proxies, each watching a discovery prefix and sharing outlier evidence (two
# watchers and a lease each). Per N: etcd's idle CPU and memory, watch events per change, etcd
# CPU per change, and the time until every proxy follows a change; then the etcd CPU of a lease
# keep-alive (1,000 leases kept alive each second). About three minutes; prints `scale | ...`
# lines (docs/configuration.md's fleet section has the results and the arithmetic beyond).
# Needs etcd-server (scripts/test-etcd.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v etcd >/dev/null || { echo "etcd-scale: etcd missing: apt-get install etcd-server (or run scripts/test-etcd.sh once)" >&2; exit 1; }
cargo test --release -p keel-proxy --features etcd --test proxy etcd::scale:: -- --include-ignored --nocapture --test-threads=1
