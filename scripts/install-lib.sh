# shellcheck shell=bash
# How the scripts install the outside programs they test and measure against; sourced
# (`. scripts/install-lib.sh`), never run:
#
#   apt_install PKG...   installs Debian packages with apt-get (through sudo when not root),
#                        quietly, without recommends, without starting their services (Debian
#                        starts a package's service unless policy-rc.d forbids it: the tests
#                        start their own); `apt-get update` once a shell. Status 1, saying
#                        why, when there is no apt-get or the install fails.
#   make_venv DIR        a Python virtual environment at DIR unless one is there (Debian's
#                        python3 makes them only with its python3-venv package: installed then)

apt_updated=0

apt_install() {
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    if ! command -v apt-get >/dev/null; then
        echo "no apt-get here: install $* with the system's package manager" >&2
        return 1
    fi
    if [ "$apt_updated" = 0 ]; then
        "${sudo[@]}" apt-get update -qq || { echo "apt-get update failed" >&2; return 1; }
        apt_updated=1
    fi
    local policy=/usr/sbin/policy-rc.d created=0 rc=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
        "${sudo[@]}" chmod +x "$policy"
        created=1
    fi
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null || rc=$?
    [ "$created" = 0 ] || "${sudo[@]}" rm -f "$policy"
    [ "$rc" = 0 ] || echo "apt-get install $* failed (exit $rc)" >&2
    return "$rc"
}

make_venv() {
    [ -x "$1/bin/python" ] && return 0
    python3 -m venv "$1" 2>/dev/null && return 0
    apt_install python3-venv && python3 -m venv "$1"
}
