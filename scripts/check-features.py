#!/usr/bin/env python3
"""One feature set for every CI step: the features `cargo build -p keel` (the shipped binary,
`cargo run`) turns on in each shared dependency must be those `cargo test --workspace` turns on,
or CI compiles the heavy crates twice. Compares `cargo tree` of both and names what differs."""
import subprocess
import sys


def features(args):
    out = subprocess.run(
        ["cargo", "tree", "--locked", "-f", "{p} {f}", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    seen = {}
    for line in out.splitlines():
        line = line.lstrip("│├└─ ").replace(" (*)", "").strip()
        parts = line.split(" ")
        if len(parts) < 2 or not parts[1].startswith("v"):
            continue
        rest = [p for p in parts[2:] if not p.startswith("(")]
        feats = {f for f in ",".join(rest).split(",") if f}
        seen.setdefault(f"{parts[0]} {parts[1]}", set()).update(feats)
    return seen


shipped = features(["-p", "keel", "-e", "normal,build"])
tests = features(["--workspace", "-e", "normal,build,dev"])
differ = [
    (name, sorted(tests[name] - shipped[name]), sorted(shipped[name] - tests[name]))
    for name in sorted(shipped)
    if name in tests and shipped[name] != tests[name]
]
for name, only_tests, only_shipped in differ:
    print(f"check-features: {name}: only in the test build {only_tests}, only in the shipped build {only_shipped}")
if differ:
    sys.exit(
        f"check-features: {len(differ)} shared crates are built with two feature sets; turn the "
        "test build's features on in crates/keel/Cargo.toml (its last lines say how)"
    )
print(f"check-features: ok ({len(shipped)} crates of the shipped build, one feature set)")
