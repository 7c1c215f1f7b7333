#!/usr/bin/env bash
# Runs keel-balance's criterion benches and the keel vs pingora-load-balancing comparison in one
# sequence, then prints the combined tables (Markdown, as in BENCHMARKS.md).
#
#   bash bench/balance.sh            # both benches, then the tables (~15 min on 2 busy cores, plus the first build)
#   BENCH_ONLY=compare bash bench/balance.sh   # only the pingora comparison
#   BENCH_ONLY=pick bash bench/balance.sh      # only keel-balance's own bench
#
# Time is this process's CPU time (other processes' load stays out of the numbers);
# KEEL_BENCH_CLOCK=wall measures wall time instead.
# Results: $CARGO_TARGET_DIR/criterion-balance/ (criterion's JSON) and report.md beside it.
# The run prints the machine it ran on; paste the whole output into BENCHMARKS.md.
set -euo pipefail

# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
out=$CARGO_TARGET_DIR/criterion-balance
only=${BENCH_ONLY:-all}
case $only in all | pick | compare) ;; *)
    echo "BENCH_ONLY must be all, pick or compare, got '$only'" >&2
    exit 2
    ;;
esac

# pingora-core's compression dependencies build C code: zlib-ng through cmake (the build fails
# with "is `cmake` not installed?" without it; its makefiles want make), zstd and brotli with
# the C compiler.
want_pkg cc build-essential
want_pkg cmake cmake
want_pkg make make
install_wanted

echo "== machine"
echo "cores: $(nproc); cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "$(rustc --version); commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "clock: ${KEEL_BENCH_CLOCK:-cpu} (KEEL_BENCH_CLOCK=cpu|wall)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
date -u +"%Y-%m-%d %H:%M UTC"

rm -rf "$out"
mkdir -p "$out"
# Both benches write their results into the same fresh directory: one run, one report.
export CRITERION_HOME=$out

if [ "$only" != compare ]; then
    echo "== keel-balance bench (cargo bench -p keel-balance --bench pick)"
    (cd "$REPO" && cargo bench -p keel-balance --bench pick)
fi
if [ "$only" != pick ]; then
    echo "== keel vs pingora bench (bench/pingora-compare: cargo bench --locked --bench compare)"
    (cd "$REPO/bench/pingora-compare" && cargo bench --locked --bench compare)
fi

echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== tables (criterion medians)"
(cd "$REPO/bench/pingora-compare" &&
    cargo run --locked --release --quiet --bin bench-report -- "$out") | tee "$out/report.md"
