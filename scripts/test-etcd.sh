#!/usr/bin/env bash
# keel's etcd tests: a real three-member etcd cluster on loopback (discovery from a key prefix,
# outages, leases, shared outlier evidence between three proxies). A plain `cargo test` skips
# them as ignored (they need Debian's etcd-server); this script installs etcd-server when `etcd`
# is not on PATH, then runs them.
# Usage: bash scripts/test-etcd.sh [FILTER]   (default `etcd::`, all of them; e.g. `etcd::faults::`)
# They are the `etcd` module of keel-proxy's `proxy` test binary: the filter keeps the rest of
# that binary's ignored tests out.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install-lib.sh
need=()
command -v etcd >/dev/null || need+=(etcd-server)
# etcdctl: the snapshot-restore test restores a store with it.
command -v etcdctl >/dev/null || need+=(etcd-client)
if [ ${#need[@]} -gt 0 ]; then
    apt_install "${need[@]}"
fi
etcd --version | sed -n 1p  # sed reads it all: head would leave etcd a SIGPIPE, failing the script under pipefail
# One at a time: each test starts its own three members, and the fleet test measures. The
# faults under traffic (leader killed, a member stopped, all down for 30 s, a lease expiring,
# 200 endpoints at once: about 40 s) run here too, so that their 0 failed
# requests is checked in CI. E12's measurement is scripts/lab-e12.sh's; the cost at scale is
# scripts/etcd-scale.sh's.
# --workspace: the test step's feature set (keel turns on etcd and otlp; every crate's dev
# dependencies), so that its build is reused rather than made again.
filter=${1:-etcd::}
case "$filter" in
    etcd::*) ;;
    *) echo "test-etcd: the filter must start with etcd:: (got $filter)" >&2; exit 2 ;;
esac
cargo test --release --workspace --test proxy -- "$filter" --include-ignored --test-threads=1 --skip e12_ --skip scale_
