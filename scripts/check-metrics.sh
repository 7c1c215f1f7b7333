#!/usr/bin/env bash
# Checks keel's /metrics with Prometheus' own checker: the test
# `route_split::metrics_by_listener_and_route_are_well_formed_text` (keel-proxy's `proxy` test
# binary) starts a proxy on loopback with every label set of the route metrics (a named route,
# an unnamed one, a `split`, a `mirror`, listeners' own clusters), sends requests, checks the
# text's structure itself and writes /metrics to a file; this runs `promtool check metrics`
# (format and lint) on that file. promtool comes from Debian's `prometheus` package (its service
# is not started), installed when it is not on PATH.
#
# Usage: bash scripts/check-metrics.sh   (from anywhere; after `cargo test --release` it only
# links nothing new)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[check-metrics] %s\n' "$*" >&2; }
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v promtool >/dev/null; then
    command -v apt-get >/dev/null || { log "no promtool and no apt-get: install Prometheus' promtool"; exit 1; }
    sudo_ apt-get update -qq
    # Debian starts a package's service unless policy-rc.d forbids it.
    policy=/usr/sbin/policy-rc.d created=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | sudo_ tee "$policy" >/dev/null
        sudo_ chmod +x "$policy"
        created=1
    fi
    rc=0
    sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null || rc=$?
    [ "$created" = 0 ] || sudo_ rm -f "$policy"
    [ "$rc" = 0 ] || { log "apt-get install prometheus failed"; exit 1; }
fi

out=$(mktemp)
trap 'rm -f "$out"' EXIT
KEEL_METRICS_OUT="$out" cargo test --release --quiet --workspace --test proxy \
    route_split::metrics_by_listener_and_route_are_well_formed_text -- --exact
[ -s "$out" ] || { log "the test wrote no /metrics text"; exit 1; }
grep -q '^keel_route_requests_total{' "$out" || { log "no keel_route_requests_total in /metrics"; exit 1; }
promtool check metrics <"$out"
log "promtool: /metrics ($(grep -vc '^#' "$out") series, route metrics included) passes format and lint"
