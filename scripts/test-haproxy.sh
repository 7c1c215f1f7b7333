#!/usr/bin/env bash
# keel behind a real HAProxy: HAProxy (TCP mode, `send-proxy-v2`) in front of a keel listener
# with `proxy_protocol = true`, clients on two loopback addresses; keel's endpoint, its `deny`
# and its access log must see each client's own address. A plain `cargo test` skips this test
# as ignored (it needs HAProxy); this script installs HAProxy (scripts/install-peers.sh, from
# the system's packages) when it is not there, then runs it. Traffic stays on loopback.
# Usage: bash scripts/test-haproxy.sh [extra cargo test arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
command -v haproxy >/dev/null || bash scripts/install-peers.sh haproxy >&2
command -v haproxy >/dev/null || { echo "test-haproxy: no haproxy (scripts/install-peers.sh haproxy failed)" >&2; exit 1; }
haproxy -v | sed -n 1p  # sed reads it all: head would leave haproxy a SIGPIPE under pipefail
# The workspace's feature set (as test-etcd.sh), so that the test step's build is reused.
KEEL_HAPROXY="$(command -v haproxy)" cargo test --release --workspace --test proxy "$@" \
    proxy_protocol::behind_haproxy -- --include-ignored --test-threads=1
