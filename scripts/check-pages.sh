#!/usr/bin/env bash
# The pages a newcomer reads stay short and true:
# - README.md under 1,000 words (about five minutes);
# - every cell of BENCHMARKS.md's verdict table (its first table) at most 40 words;
# - every in-page link (#anchor) of README.md and BENCHMARKS.md names a heading that exists;
# - every source path a comment or a page cites (src/..., tests/..., crates/..., scripts/...,
#   docs/..., bench/...) exists, from the repository root, the citing file's folder or crate,
#   or any crate (pages cite `tests/no_alloc.rs` for keel-balance's). bench/history/ is a
#   record of earlier runs and vendor/ holds published crates as they are: neither is checked.
# Usage: bash scripts/check-pages.sh   (from anywhere)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - <<'PY'
import glob, os, re, sys

errors = []

def words(text):
    text = re.sub(r"```.*?```", " ", text, flags=re.S)     # code blocks are commands, not prose
    text = re.sub(r"\]\([^)]*\)", "]", text)                # a link's target is not read
    return len(re.findall(r"[A-Za-z0-9][\w'.,/%-]*", text))

readme = open("README.md").read()
n = words(readme)
if n >= 1000:
    errors.append(f"README.md: {n} words (under 1,000 wanted)")

bench = open("BENCHMARKS.md").read().splitlines()
rows, seen = [], False
for line in bench:
    if line.startswith("|"):
        seen = True
        rows.append(line)
    elif seen:
        break
for line in rows[2:]:
    for cell in line.strip().strip("|").split("|"):
        if len(cell.split()) > 40:
            errors.append(f"BENCHMARKS.md verdict cell of {len(cell.split())} words (at most 40): {cell.strip()[:60]}...")

def anchor(heading):
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")

for page in ["README.md", "BENCHMARKS.md"]:
    text = open(page).read()
    heads = {anchor(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}
    for a in re.findall(r"\]\(#([^)]+)\)", text):
        if a not in heads:
            errors.append(f"{page}: link to #{a}, no such heading")

crates = sorted(glob.glob("crates/*"))
cite = re.compile(r"\b((?:src|tests|crates|scripts|docs|bench|examples|scenarios)/[A-Za-z0-9_./-]+\.(?:rs|sh|md|toml|py))")
files = [f for pat in ["**/*.rs", "**/*.md", "**/*.sh", "**/*.toml"] for f in glob.glob(pat, recursive=True)]
for f in files:
    if f.startswith(("target/", "bench/history/", "vendor/")) or "/target/" in f:
        continue
    crate = next((c for c in crates if f.startswith(c + "/")), None)
    for ln, line in enumerate(open(f, errors="replace"), 1):
        if f.endswith(".rs") and "//" not in line:
            continue
        for p in cite.findall(line):
            bases = [".", os.path.dirname(f)] + ([crate] if crate else []) + crates
            if not any(os.path.exists(os.path.join(b, p)) for b in bases):
                errors.append(f"{f}:{ln}: cites {p}, which does not exist")

for e in errors:
    print("check-pages:", e, file=sys.stderr)
if errors:
    sys.exit(1)
print(f"check-pages: ok (README.md {n} words, {len(rows) - 2} verdict rows)")
PY
