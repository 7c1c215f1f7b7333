#!/usr/bin/env bash
# The container's build step, as a script so that CI runs the very same step without a container
# daemon (.ci/run): the keel binary built from the lock file with the `ship` profile (release
# with fat LTO and one codegen unit, see the root Cargo.toml: fewer instructions and cache misses
# per request, a longer build), with nothing but the Rust toolchain (no `protoc`: etcd-client's
# .proto files are compiled by protox, see vendor/etcd-client/README.keel.md), copied to OUT
# (default dist/) and stripped. The bench scripts measure this profile's binary.
# KEEL_PROFILE=release builds the same way without LTO: CI does, so that its container step and
# its tests share one build (the ship profile's fat LTO takes about 12 CPU-minutes more).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
profile=${KEEL_PROFILE:-ship}
cargo build --profile "$profile" --locked -p keel
mkdir -p "$out"
cp "${CARGO_TARGET_DIR:-target}/$profile/keel" "$out/keel"
strip "$out/keel"
"$out/keel" --version
