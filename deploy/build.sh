#!/usr/bin/env bash
# The container's build step, as a script so that CI runs the very same step without a container
# daemon (.ci/run): a release build of the keel binary from the lock file, with nothing but the
# Rust toolchain (no `protoc`: etcd-client's .proto files are compiled by protox, see
# vendor/etcd-client/README.keel.md), copied to OUT (default dist/) and stripped.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
cargo build --release --locked -p keel
mkdir -p "$out"
cp target/release/keel "$out/keel"
strip "$out/keel"
"$out/keel" --version
