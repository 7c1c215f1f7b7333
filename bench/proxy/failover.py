#!/usr/bin/env python3
"""Failover probe: keeps a proxy busy with keep-alive GETs from a few client threads, kills one
backend after `--before` seconds (SIGKILL: it dies, its port refuses connections; or SIGSTOP: it
hangs, connections are accepted by the kernel and never answered, until SIGCONT at the end),
keeps going for `--after` seconds, and prints one JSON object: requests and errors before/after
the kill, the time from the kill to the last error the clients saw, and the worst latency after
the kill.

The kill and every client timestamp are taken on the same monotonic clock in this process, so
"last error - kill" needs no clock synchronisation. Only 127.0.0.1; bounded in time.
"""

import argparse
import http.client
import json
import os
import signal
import threading
import time


def client(host, port, stop_at, out, timeout):
    """One client: sequential GETs on a keep-alive connection; reconnects after an error."""
    conn = None
    while True:
        start = time.monotonic()
        if start >= stop_at:
            break
        ok = False
        try:
            if conn is None:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            conn.request("GET", "/", headers={"Host": "bench"})
            resp = conn.getresponse()
            resp.read()
            ok = 200 <= resp.status < 300
            if resp.getheader("connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException):
            if conn is not None:
                conn.close()
            conn = None
        end = time.monotonic()
        out.append((end, ok, end - start))
        if not ok:
            # Do not spin on a proxy that refuses connections.
            time.sleep(0.001)
    if conn is not None:
        conn.close()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True, help="proxy port on 127.0.0.1")
    p.add_argument("--kill-pid", type=int, required=True, help="backend process to SIGKILL")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--before", type=float, default=2.0, help="seconds of load before the kill")
    p.add_argument("--after", type=float, default=6.0, help="seconds of load after the kill")
    p.add_argument("--timeout", type=float, default=3.0, help="client socket timeout, seconds")
    p.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    p.add_argument(
        "--slow-ms",
        type=float,
        default=250.0,
        help="a request slower than this after the kill counts as slowed by the failover",
    )
    a = p.parse_args()
    sig = signal.SIGKILL if a.signal == "KILL" else signal.SIGSTOP

    t0 = time.monotonic()
    stop_at = t0 + a.before + a.after
    results = [[] for _ in range(a.clients)]
    threads = [
        threading.Thread(
            target=client, args=("127.0.0.1", a.port, stop_at, results[i], a.timeout), daemon=True
        )
        for i in range(a.clients)
    ]
    for t in threads:
        t.start()
    time.sleep(a.before)
    kill_at = time.monotonic()
    os.kill(a.kill_pid, sig)
    try:
        for t in threads:
            t.join(a.after + a.timeout + 5)
    finally:
        if sig == signal.SIGSTOP:
            os.kill(a.kill_pid, signal.SIGCONT)

    samples = sorted(s for r in results for s in r)
    before = [s for s in samples if s[0] < kill_at]
    after = [s for s in samples if s[0] >= kill_at]
    errors_after = [s for s in after if not s[1]]
    slow_after = [s for s in after if s[2] * 1000.0 > a.slow_ms]
    lat_after = sorted(s[2] for s in after)
    first_second = sorted(s[2] for s in after if s[0] < kill_at + 1.0)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000.0 if xs else None

    print(
        json.dumps(
            {
                "requests_before": len(before),
                "errors_before": sum(1 for s in before if not s[1]),
                "requests_after": len(after),
                "errors_after": len(errors_after),
                # Time from the kill to the END of the last failed request (0 = none failed).
                "last_error_ms": round((errors_after[-1][0] - kill_at) * 1000.0, 1)
                if errors_after
                else 0.0,
                # Requests slowed by the failover (e.g. waited for the per-try timeout on the
                # hung backend before a retry), and when the last of them ended: roughly when
                # the proxy stopped sending requests to the dead backend.
                "slow_after": len(slow_after),
                "last_slow_ms": round((slow_after[-1][0] - kill_at) * 1000.0, 1)
                if slow_after
                else 0.0,
                "max_latency_after_ms": round(lat_after[-1] * 1000.0, 1) if lat_after else None,
                "p99_first_second_ms": round(pct(first_second, 0.99), 2)
                if first_second
                else None,
                "rps": round(len(samples) / (samples[-1][0] - t0), 0) if samples else 0,
            }
        )
    )


if __name__ == "__main__":
    main()
