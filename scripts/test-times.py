#!/usr/bin/env python3
"""Passes `cargo test` output through unchanged, then prints each test binary's time, longest
first (`ci-time-binary: NAME SECONDS s`), so that CI shows where its minutes go.

    cargo test ... 2>&1 | python3 scripts/test-times.py
"""
import re
import sys

running = re.compile(r"^\s*Running (?:unittests )?(\S+) \(")
finished = re.compile(r"^test result: .* finished in ([0-9.]+)s")
times, current = [], None
for line in sys.stdin:
    sys.stdout.write(line)
    sys.stdout.flush()
    if m := running.match(line):
        current = m.group(1)
    elif (m := finished.match(line)) and current:
        times.append((float(m.group(1)), current))
        current = None
for secs, name in sorted(times, reverse=True):
    print(f"ci-time-binary: {name} {secs:.1f} s")
print(f"ci-time-binary: {len(times)} binaries, {sum(s for s, _ in times):.0f} s of tests in all")
