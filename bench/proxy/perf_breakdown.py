#!/usr/bin/env python3
"""Groups a keel perf profile's self time by component (kernel, allocator, hyper, tokio, ...).

  perf_breakdown.py PERF.DATA

Runs `perf report --no-children --sort dso,symbol` on the file written by
`bench/proxy/run.sh --profile` and prints, per component, its share of all samples and of the
user-space samples, with the two hottest symbols. The first matching rule wins.
"""

import collections
import re
import subprocess
import sys

RULES = [
    ("kernel (syscalls, TCP/IP, wakeups)", lambda d, s: d.startswith("[kernel")),
    ("glibc malloc/free", lambda d, s: "libc" in d and re.search(r"malloc|free|_int_|unlink_chunk|realloc|tcache|consolidate", s)),
    ("memcpy/memmove", lambda d, s: re.search(r"mem(move|cpy|set)", s)),
    ("libc syscall wrappers", lambda d, s: "libc" in d),
    ("clock_gettime (vdso)", lambda d, s: "vdso" in d),
    ("tokio timers", lambda d, s: "tokio::runtime::time" in s or "tokio::time" in s),
    ("tokio mpsc/oneshot", lambda d, s: "tokio::sync" in s),
    ("tokio I/O driver", lambda d, s: re.search(r"tokio::runtime::io|tokio::io|tokio::net|mio::", s)),
    ("tokio scheduler, tasks, spawn", lambda d, s: "tokio::" in s),
    ("hyper-util legacy client + pool", lambda d, s: "hyper_util::client" in s),
    ("hyper client dispatch/parse", lambda d, s: "hyper::client" in s or "role::Client" in s),
    ("hyper h1 server + codec", lambda d, s: "hyper" in s or "httparse" in s),
    ("http HeaderMap/Uri", lambda d, s: s.startswith("http::") or "<http::" in s),
    ("bytes refcounts", lambda d, s: "bytes::" in s),
    ("keel-proxy", lambda d, s: "keel_proxy" in s),
    ("keel-balance", lambda d, s: "keel_balance" in s),
    ("other", lambda d, s: True),
]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = subprocess.run(
        ["perf", "report", "-i", sys.argv[1], "--stdio", "--no-children", "-g", "none", "--sort", "dso,symbol"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total = collections.Counter()
    top = collections.defaultdict(list)
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*?)\s*$", line)
        if not m:
            continue
        pct, dso = float(m.group(1)), m.group(2)
        sym = re.sub(r"(\s+-)+$", "", m.group(3)).strip()  # perf pads and appends "-" columns
        for name, rule in RULES:
            if rule(dso, sym):
                total[name] += pct
                top[name].append((pct, sym))
                break
    kernel = RULES[0][0]
    user = sum(v for k, v in total.items() if k != kernel) or 1.0
    print("| component | % of samples | % of user-space samples | hottest symbols |")
    print("| --- | ---: | ---: | --- |")
    for name, _ in RULES:
        if not total[name]:
            continue
        share = "-" if name == kernel else f"{total[name] / user * 100:.1f}"
        hot = "; ".join(f"`{s.strip()[:70]}` {p:.1f}" for p, s in sorted(top[name], reverse=True)[:2])
        print(f"| {name} | {total[name]:.1f} | {share} | {hot} |")


if __name__ == "__main__":
    main()
