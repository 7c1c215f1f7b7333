#!/usr/bin/env python3
"""Summarises bench/proxy/run.sh results.

  report.py RAW.tsv FAILOVER.tsv        tables (Markdown) and, last, one JSON line
  report.py --parse-wrk FILE w r c target cpu_s peak_rss_kb load1
                                        one raw.tsv row from a `wrk --latency` output file

Figures are medians over rounds; ratios are medians of the per-round ratios (each taken from
points measured minutes apart at most, so that slow drift of the machine cancels out).
"""

import csv
import json
import re
import statistics
import sys

PROXIES = ["keel", "nginx", "haproxy", "envoy"]
TARGETS = PROXIES + ["direct"]


def parse_wrk(argv):
    path, w, r, c, t, cpu, rss, load = argv
    out = open(path).read()

    def ms(v):
        m = re.match(r"([\d.]+)(us|ms|s)$", v)
        return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    errs = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errs += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errs += sum(int(x) for x in m.groups())
    row = [w, r, c, t, f"{rps:.0f}", f"{p50:.3f}", f"{p99:.3f}", str(reqs), str(errs), cpu, rss, load]
    print("\t".join(row))


def read_tsv(path):
    with open(path) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v, nd=0):
    if v is None:
        return "-"
    return f"{v:,.{nd}f}"


def report(raw_path, fo_path):
    rows = read_tsv(raw_path)
    for r in rows:
        for k in ("rps", "p50_ms", "p99_ms", "cpu_s", "load1"):
            r[k] = float(r[k])
        for k in ("workers", "round", "conns", "requests", "errors", "peak_rss_kb"):
            r[k] = int(r[k])
    point = {(r["workers"], r["round"], r["conns"], r["target"]): r for r in rows}
    workers = sorted({r["workers"] for r in rows})
    conns = sorted({r["conns"] for r in rows})
    rounds = sorted({r["round"] for r in rows})
    loads = [r["load1"] for r in rows]
    summary = {}

    print()
    if loads:  # none with --only-failover
        print(f"Load average (1 min) during the measurements: {min(loads):.2f} .. {max(loads):.2f}")
    for w in workers:
        for c in conns:
            print()
            print(f"### {w} worker(s), {c} connections ({len(rounds)} round(s), medians)")
            print()
            print("| target | req/s | p50 ms | p99 ms | CPU s / 100k req | peak RSS MB | errors | req/s vs NGINX | req/s vs HAProxy | req/s vs Envoy | CPU vs NGINX |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for t in TARGETS:
                pts = [point[(w, r, c, t)] for r in rounds if (w, r, c, t) in point]
                if not pts:
                    continue
                rps = med([p["rps"] for p in pts])
                p50 = med([p["p50_ms"] for p in pts])
                p99 = med([p["p99_ms"] for p in pts])
                cpu = None
                if t != "direct":
                    cpu = med([p["cpu_s"] / p["requests"] * 1e5 for p in pts if p["requests"]])
                rss = max(p["peak_rss_kb"] for p in pts) / 1024.0 if t != "direct" else None
                errs = sum(p["errors"] for p in pts)

                def ratio(other, key="rps", per_req=False):
                    xs = []
                    for r in rounds:
                        a, b = point.get((w, r, c, t)), point.get((w, r, c, other))
                        if not a or not b:
                            continue
                        if per_req:
                            if a["requests"] and b["requests"] and b["cpu_s"] > 0:
                                xs.append((a["cpu_s"] / a["requests"]) / (b["cpu_s"] / b["requests"]))
                        elif b[key]:
                            xs.append(a[key] / b[key])
                    return med(xs)

                rn, rh, re_ = ratio("nginx"), ratio("haproxy"), ratio("envoy")
                cn = ratio("nginx", per_req=True) if t in PROXIES else None
                summary[(w, c, t)] = dict(rps=rps, p50=p50, p99=p99, cpu=cpu, rss=rss)
                print(
                    f"| {t} | {fmt(rps)} | {fmt(p50, 3)} | {fmt(p99, 3)} | {fmt(cpu, 3)} | {fmt(rss, 1)} | {errs} "
                    f"| {fmt(rn, 2)} | {fmt(rh, 2)} | {fmt(re_, 2)} | {fmt(cn, 2)} |"
                )

    fo = read_tsv(fo_path) if fo_path else []
    if fo:
        print()
        print("### Failover: backend 2 of 4 dies (SIGKILL) or hangs (SIGSTOP) under load, 8 keep-alive clients")
        print()
        print("| proxy | backend | trial | client req/s | errors after | last error after (ms) | requests > 250 ms after | last such request ended after (ms) | max latency after (ms) | p99 in the first second (ms) |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in sorted(fo, key=lambda r: (r["signal"], PROXIES.index(r["proxy"]), r["trial"])):
            print(
                f"| {r['proxy']} | {'killed' if r['signal'] == 'KILL' else 'hung'} | {r['trial']} | {r['rps']} | {r['errors_after']} | {r['last_error_ms']} | {r['slow_after']} | {r['last_slow_ms']} "
                f"| {r['max_latency_after_ms']} | {r['p99_first_second_ms']} |"
            )

    if not rows:  # --only-failover: no throughput point to sum up
        return
    w, c = workers[0], conns[-1]

    def get(t, k):
        v = summary.get((w, c, t), {}).get(k)
        return round(v, 3) if v is not None else None

    print()
    print(f"(JSON: {w} worker(s), {c} connections, medians over rounds; CPU in seconds per 100k requests)")
    print(
        json.dumps(
            {
                "keel_rps": get("keel", "rps"),
                "nginx_rps": get("nginx", "rps"),
                "haproxy_rps": get("haproxy", "rps"),
                "envoy_rps": get("envoy", "rps"),
                "direct_rps": get("direct", "rps"),
                "keel_p99_ms": get("keel", "p99"),
                "nginx_p99_ms": get("nginx", "p99"),
                "haproxy_p99_ms": get("haproxy", "p99"),
                "envoy_p99_ms": get("envoy", "p99"),
                "keel_cpu_per_100k": get("keel", "cpu"),
                "nginx_cpu_per_100k": get("nginx", "cpu"),
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--parse-wrk":
        parse_wrk(sys.argv[2:])
    elif len(sys.argv) in (2, 3):
        report(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None)
    else:
        sys.exit(__doc__)
