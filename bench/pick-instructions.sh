#!/usr/bin/env bash
# User-space instructions per pick-and-finish of each strategy, counted by valgrind's cachegrind
# (a count that does not move with the machine's load, unlike a timing on shared cores), here
# and, with --base REV, at another revision side by side: the check that a change to the
# balancer's hot path costs what it says.
#
#   bench/pick-instructions.sh [--base REV] [--picks N]
#
# Each strategy runs `examples/pick_loop.rs` (10 endpoints, one call in flight at a time, a new
# hash key per call): N picks (default 200,000) minus a run of 0 picks, divided by N.
# --base REV builds the same example at REV in a temporary git worktree (target/pick-base) and
# prints both columns. Needs valgrind (apt install valgrind).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
cd "$HERE/.."
base="" picks=200000
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage_from_header; exit 0 ;;
        --base) base=$2; shift 2 ;;
        --picks) picks=$2; shift 2 ;;
        *) echo "pick-instructions.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
    esac
done
command -v valgrind >/dev/null || { echo "pick-instructions.sh: needs valgrind (apt install valgrind)" >&2; exit 1; }

cargo build --release --quiet -p keel-balance --example pick_loop
here_bin=target/release/examples/pick_loop
base_bin=""
if [ -n "$base" ]; then
    wt=target/pick-base
    git worktree remove --force "$wt" 2>/dev/null || true
    git worktree add --quiet --detach "$wt" "$base"
    # The example may be newer than REV: the same file is used on both sides.
    mkdir -p "$wt/crates/keel-balance/examples"
    cp crates/keel-balance/examples/pick_loop.rs "$wt/crates/keel-balance/examples/"
    (cd "$wt" && CARGO_TARGET_DIR="$PWD/../pick-base-target" cargo build --release --quiet -p keel-balance --example pick_loop)
    base_bin=target/pick-base-target/release/examples/pick_loop
    trap 'git worktree remove --force "$wt" 2>/dev/null || true' EXIT
fi

count() { # binary strategy picks -> instructions
    valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null "$1" "$2" "$3" 2>&1 >/dev/null \
        | awk '/I *refs/ { gsub(",", "", $NF); print $NF }'
}
per_pick() { # binary strategy
    local n0 n
    n0=$(count "$1" "$2" 0)
    n=$(count "$1" "$2" "$picks")
    echo $(( (n - n0) / picks ))
}

if [ -n "$base_bin" ]; then
    printf '%-20s %10s %10s %7s\n' strategy "$base" here ratio
else
    printf '%-20s %10s\n' strategy here
fi
for s in round-robin weighted-round-robin random least-connections least-request least-time \
         peak-ewma ring-hash maglev rendezvous prequal; do
    h=$(per_pick "$here_bin" "$s")
    if [ -n "$base_bin" ]; then
        b=$(per_pick "$base_bin" "$s")
        printf '%-20s %10s %10s %7s\n' "$s" "$b" "$h" "$(awk -v h="$h" -v b="$b" 'BEGIN { printf "%.3f", h / b }')"
    else
        printf '%-20s %10s\n' "$s" "$h"
    fi
done
