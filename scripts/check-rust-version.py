#!/usr/bin/env python3
"""The workspace's `rust-version` must be at least what the locked dependencies declare.

Reads Cargo.lock, finds each registry package's own Cargo.toml in cargo's cache (run after a
build or `cargo fetch`), and fails if one needs a newer Rust than the workspace promises."""
import glob
import os
import re
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
os.chdir(root)


def version(text):
    parts = [int(x) for x in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


declared = re.search(r'(?m)^rust-version = "([^"]+)"', open("Cargo.toml").read())
if not declared:
    sys.exit("check-rust-version: no rust-version in Cargo.toml's [workspace.package]")
lock = open("Cargo.lock").read()
packages = re.findall(r'name = "([^"]+)"\nversion = "([^"]+)"\nsource = "registry', lock)
home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
caches = glob.glob(os.path.join(home, "registry", "src", "*"))
needs, unseen = [], 0
for name, ver in packages:
    found = [p for c in caches if os.path.exists(p := os.path.join(c, f"{name}-{ver}", "Cargo.toml"))]
    if not found:
        unseen += 1
        continue
    m = re.search(r'(?m)^rust-version = "([^"]+)"', open(found[0]).read())
    if m:
        needs.append((version(m.group(1)), f"{name} {ver}"))
if unseen:
    sys.exit(f"check-rust-version: {unseen} locked packages not in cargo's cache (run cargo fetch)")
top, who = max(needs)
if version(declared.group(1)) < top:
    sys.exit(
        f"check-rust-version: Cargo.toml says rust-version {declared.group(1)}, "
        f"but {who} needs {'.'.join(map(str, top))}"
    )
print(f"check-rust-version: rust-version {declared.group(1)} covers the lock file (most: {who}, {'.'.join(map(str, top))})")
