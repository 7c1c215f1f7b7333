#!/usr/bin/env bash
# vendor/etcd-client must be the published etcd-client, byte for byte, except build.rs,
# Cargo.toml and README.keel.md (see that file). Fetches the published crate with cargo into
# cargo's own cache (a scratch project outside this workspace, so the patch does not apply) and
# compares src/, proto/ and the licences.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.21.1
grep -q "^version = \"$version\"" vendor/etcd-client/Cargo.toml ||
    { echo "check-vendor: vendor/etcd-client/Cargo.toml is not version $version" >&2; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/src"
printf '[package]\nname = "vendor-check"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\netcd-client = { version = "=%s", default-features = false }\n' "$version" >"$scratch/Cargo.toml"
: >"$scratch/src/lib.rs"
cargo fetch --quiet --manifest-path "$scratch/Cargo.toml"
published=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/etcd-client-$version | head -n1)
for part in src proto LICENSE-APACHE LICENSE-MIT README.md; do
    diff -r "$published/$part" "vendor/etcd-client/$part" >/dev/null ||
        { echo "check-vendor: vendor/etcd-client/$part differs from etcd-client $version" >&2; exit 1; }
done
echo "check-vendor: vendor/etcd-client is etcd-client $version (build.rs: protox instead of protoc)"

# vendor/h2: the published h2, byte for byte, but the two files its README.keel.md names.
h2_version=0.4.20
grep -q "^version = \"$h2_version\"" vendor/h2/Cargo.toml ||
    { echo "check-vendor: vendor/h2/Cargo.toml is not version $h2_version" >&2; exit 1; }
printf '[package]\nname = "vendor-check"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nh2 = "=%s"\n' "$h2_version" >"$scratch/Cargo.toml"
cargo fetch --quiet --manifest-path "$scratch/Cargo.toml"
published=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/h2-$h2_version | head -n1)
diff -r -x decoder.rs -x headers.rs "$published/src" vendor/h2/src >/dev/null &&
    diff -q "$published/Cargo.toml" vendor/h2/Cargo.toml >/dev/null &&
    diff -q "$published/LICENSE" vendor/h2/LICENSE >/dev/null ||
    { echo "check-vendor: vendor/h2 differs from h2 $h2_version beyond its README.keel.md" >&2; exit 1; }
echo "check-vendor: vendor/h2 is h2 $h2_version (malformed fields as stream errors)"
