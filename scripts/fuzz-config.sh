#!/usr/bin/env bash
# Fuzzes keel's proxy configuration loading (parse + validate + balancer build) for a bounded
# time with cargo-fuzz (libFuzzer). Not part of `cargo test`.
#
#   scripts/fuzz-config.sh [SECONDS]      # default 300: the total, split between the targets
#
# Targets (fuzz/fuzz_targets/):
#   config_parse       arbitrary bytes as TOML text (with a dictionary of the option names)
#   config_structured  random documents built from the real option names, values of the right
#                      and of wrong types, so that inputs reach validation and the balancer
#
# Exits 0 when no target found anything; 1 on a finding (panic, timeout, out of memory), after
# printing where the input that triggers it was written. Reproduce one with
#   cargo +nightly fuzz run --fuzz-dir fuzz -s none TARGET PATH/TO/INPUT
#
# Needs a nightly toolchain (`rustup toolchain install nightly`); without one it tries the
# stable toolchain with RUSTC_BOOTSTRAP=1. Installs cargo-fuzz if missing.
# Environment: FUZZ_TARGET_DIR (build directory, default $CARGO_TARGET_DIR/fuzz or target/fuzz),
# FUZZ_WORK (corpora, findings and logs, default $FUZZ_TARGET_DIR/work), FUZZ_TARGETS (names).
set -euo pipefail

total=${1:-300}
if ! [[ $total =~ ^[0-9]+$ ]] || ((total < 2)); then
    echo "usage: $0 [SECONDS]   (total fuzzing time, at least 2; default 300)" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
root=$(pwd)
targets=(${FUZZ_TARGETS:-config_parse config_structured})
per=$((total / ${#targets[@]}))
target_dir=${FUZZ_TARGET_DIR:-${CARGO_TARGET_DIR:-$root/target}/fuzz}
work=${FUZZ_WORK:-$target_dir/work}
mkdir -p "$work"

# Toolchain: libFuzzer's instrumentation flags need nightly (or a stable compiler told to
# accept them).
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    cargo=(cargo +nightly)
else
    echo "fuzz-config: no nightly toolchain; trying stable with RUSTC_BOOTSTRAP=1" >&2
    export RUSTC_BOOTSTRAP=1
    cargo=(cargo)
fi
if ! "${cargo[@]}" fuzz --version >/dev/null 2>&1; then
    echo "fuzz-config: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

# No sanitizer: the code under test is safe Rust, so AddressSanitizer would only halve the
# executions; panics, overflow checks (debug assertions are on) and libFuzzer's timeout and
# memory limit are what this looks for.
fuzz=("${cargo[@]}" fuzz run --fuzz-dir fuzz --target-dir "$target_dir" --sanitizer none)

echo "fuzz-config: building ${targets[*]} in $target_dir" >&2
"${cargo[@]}" fuzz build --fuzz-dir fuzz --target-dir "$target_dir" --sanitizer none >&2

# Seeds: the example, the scenarios and the configurations of the proxy's tests.
seeds="$work/seeds"
rm -rf "$seeds"
mkdir -p "$seeds"
cp fuzz/seeds/*.toml examples/*.toml "$seeds/"
for f in scenarios/*.toml; do cp "$f" "$seeds/scenario-$(basename "$f")"; done

status=0
summary=()
for t in "${targets[@]}"; do
    corpus="$work/corpus/$t"
    artifacts="$work/artifacts/$t"
    log="$work/$t.log"
    mkdir -p "$corpus" "$artifacts"
    echo "fuzz-config: $t for ${per}s (corpus $corpus, log $log)" >&2
    set +e
    "${fuzz[@]}" "$t" "$corpus" "$seeds" -- \
        -max_total_time="$per" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
        -dict=fuzz/config.dict -artifact_prefix="$artifacts/" -print_final_stats=1 \
        >"$log" 2>&1
    rc=$?
    set -e
    # libFuzzer's last status line: "#RUNS ... cov: N ft: N corp: N/SIZE ... exec/s: N".
    last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
    runs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}' || true)
    cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
    ft=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$last")
    corp=$(sed -nE 's/.* corp: ([0-9]+\/[0-9A-Za-z]+).*/\1/p' <<<"$last")
    found=$(find "$artifacts" -type f | wc -l)
    summary+=("$t: ${runs:-?} executions in ${per}s, cov ${cov:-?}, ft ${ft:-?}, corpus ${corp:-?}, findings $found, exit $rc")
    if ((rc != 0)) || ((found > 0)); then
        status=1
        echo "fuzz-config: FINDING in $t (exit $rc); the end of its log:" >&2
        tail -40 "$log" >&2
        echo "fuzz-config: inputs that trigger it:" >&2
        find "$artifacts" -type f >&2
    fi
done

echo "fuzz-config: summary (${total}s total)"
printf '  %s\n' "${summary[@]}"
if ((status != 0)); then
    echo "fuzz-config: findings above; reproduce with: ${cargo[*]} fuzz run --fuzz-dir fuzz -s none TARGET INPUT"
fi
exit $status
