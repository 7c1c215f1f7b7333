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

. scripts/install-lib.sh
log() { printf '[check-metrics] %s\n' "$*" >&2; }

command -v promtool >/dev/null || apt_install prometheus

out=$(mktemp)
trap 'rm -f "$out"' EXIT
KEEL_METRICS_OUT="$out" cargo test --release --quiet --workspace --test proxy \
    route_split::metrics_by_listener_and_route_are_well_formed_text -- --exact
[ -s "$out" ] || { log "the test wrote no /metrics text"; exit 1; }
grep -q '^keel_route_requests_total{' "$out" || { log "no keel_route_requests_total in /metrics"; exit 1; }
promtool check metrics <"$out"
log "promtool: /metrics ($(grep -vc '^#' "$out") series, route metrics included) passes format and lint"
