#!/usr/bin/env python3
"""Load clients and the WebSocket echo backend of bench/lifecycle/chaos.sh (stdlib only).

  clients.py ws-backend --port P
      WebSocket echo server (RFC 6455 text/binary frames echoed, pings answered); any other
      request gets 200 `ok`.
  clients.py h1 --port P --conns N --path /x --term-file F --out OUT.json [--deadline S]
      N keep-alive HTTP/1.1 connections, each sending its next request as soon as the last
      answer arrived, until F exists (it holds the time the stop signal was sent: clients send
      nothing after it). Every request is accounted for: sent before the stop signal, it must
      get a 2xx; a failure is recorded with its time, kind and the connection's history.
  clients.py ws --port P --n 20 --interval 0.2 --term-file F --out OUT.json
      N WebSockets that send a text message every interval and wait for its echo; a connection
      that ends is recorded (time, how) and opened again (not after the stop signal).
  clients.py report --dir DIR --proxy NAME --drain-timeout S
      Reads DIR's results (h1*.json, ws.json, h2load*.txt, events.txt, serials.txt,
      extra.txt), writes DIR/summary.json and prints the counts.
  clients.py table SUMMARY.json...
      The side-by-side table (markdown).
"""

import argparse
import asyncio
import base64
import glob
import hashlib
import json
import os
import re
import struct
import sys
import time

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


# ------------------------------------------------------------------ WebSocket frames
async def read_frame(reader):
    """One frame: (opcode, payload). Fragmented messages are not used here."""
    b0, b1 = await reader.readexactly(2)
    op = b0 & 0x0F
    n = b1 & 0x7F
    if n == 126:
        (n,) = struct.unpack("!H", await reader.readexactly(2))
    elif n == 127:
        (n,) = struct.unpack("!Q", await reader.readexactly(8))
    mask = await reader.readexactly(4) if b1 & 0x80 else None
    payload = await reader.readexactly(n)
    if mask:
        payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
    return op, payload


def frame(op, payload, mask):
    head = bytes([0x80 | op])
    n = len(payload)
    bit = 0x80 if mask else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 65536:
        head += bytes([bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", n)
    if mask:
        key = os.urandom(4)
        payload = bytes(c ^ key[i % 4] for i, c in enumerate(payload))
        head += key
    return head + payload


async def ws_backend(port):
    async def handle(reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            key = None
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"sec-websocket-key":
                    key = v.strip()
            if key is None:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                await writer.drain()
                return
            accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
            )
            await writer.drain()
            while True:
                op, payload = await read_frame(reader)
                if op == 8:
                    writer.write(frame(8, payload[:2], False))
                    await writer.drain()
                    return
                writer.write(frame(10 if op == 9 else op, payload, False))
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ------------------------------------------------------------------ the stop signal
class Term:
    """The time the stop signal was sent, once the driver wrote it to the term file."""

    def __init__(self, path):
        self.path = path
        self.at = None

    async def watch(self):
        while self.at is None:
            try:
                with open(self.path) as f:
                    text = f.read().strip()
                if text:
                    self.at = float(text)
                    return
            except (OSError, ValueError):
                pass
            await asyncio.sleep(0.002)

    def stopped(self):
        return self.at is not None


# ------------------------------------------------------------------ HTTP/1.1 clients
class H1Stats:
    def __init__(self):
        self.sent = 0
        self.ok = 0
        self.non2xx = {}
        self.failed = {}
        self.refused = 0
        self.connects = 0
        self.closed_by_server = 0  # answers with Connection: close (fine: the next opens anew)
        self.idle_closed_seen = 0  # idle connections seen closed before the next request
        self.after_term = {"sent": 0, "ok": 0, "failed": 0, "refused": 0}
        self.in_flight_at_term = {"total": 0, "ok": 0}
        self.failures = []  # details of the first failures
        self.latencies = []


async def read_response(reader):
    """(status, close): reads one whole response (content-length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = None
    chunked = False
    close = False
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        k = k.strip().lower()
        v = v.strip().lower()
        if k == b"content-length":
            length = int(v)
        elif k == b"transfer-encoding" and b"chunked" in v:
            chunked = True
        elif k == b"connection" and b"close" in v:
            close = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length is not None:
        await reader.readexactly(length)
    elif close:
        await reader.read()
    return status, close


def kind_of(exc, got_bytes):
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, BrokenPipeError):
        return "broken-pipe"
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "eof-mid-response" if got_bytes else "eof-before-response"
    return type(exc).__name__


class Counting:
    """A StreamReader wrapper that tells whether any byte of the answer arrived."""

    def __init__(self, reader):
        self.reader = reader
        self.got = False

    async def readuntil(self, sep):
        try:
            data = await self.reader.readuntil(sep)
        except asyncio.IncompleteReadError as e:
            self.got = self.got or bool(e.partial)
            raise
        self.got = True
        return data

    async def readexactly(self, n):
        data = await self.reader.readexactly(n)
        self.got = True
        return data

    async def read(self):
        return await self.reader.read()


async def h1_client(i, port, path, stats, term, timeout):
    req = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: chaos-h1/{i}\r\n\r\n").encode()
    writer = None
    reader = None
    on_conn = 0
    last_done = None
    while not term.stopped():
        if writer is None:
            t0 = time.time()
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            except (OSError, asyncio.TimeoutError) as e:
                k = kind_of(e, False)
                if term.stopped() and t0 >= term.at:
                    stats.after_term["refused" if k == "refused" else "failed"] += 1
                    break
                if k == "refused":
                    stats.refused += 1
                else:
                    stats.failed[k] = stats.failed.get(k, 0) + 1
                if len(stats.failures) < 200:
                    stats.failures.append({"t": t0, "kind": k, "phase": "connect"})
                await asyncio.sleep(0.02)
                continue
            stats.connects += 1
            on_conn = 0
            last_done = None
        if term.stopped():
            break
        if reader.at_eof():
            # The server closed this idle connection and the close already arrived: a client
            # reconnects then (urllib3 checks the same before reusing a connection).
            stats.idle_closed_seen += 1
            writer.close()
            writer = None
            continue
        t = time.time()
        stats.sent += 1
        counting = Counting(reader)
        try:
            writer.write(req)
            await writer.drain()
            status, close = await asyncio.wait_for(read_response(counting), timeout)
            err = None
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, IndexError) as e:
            err = e
        done = time.time()
        before_term = term.at is None or t < term.at
        if before_term and term.at is not None and done > term.at:
            stats.in_flight_at_term["total"] += 1
        if err is None:
            if not before_term:
                stats.after_term["sent"] += 1
                stats.after_term["ok"] += 1 if 200 <= status < 300 else 0
            elif 200 <= status < 300:
                stats.ok += 1
                if len(stats.latencies) < 200000:
                    stats.latencies.append(done - t)
                if term.at is not None and done > term.at:
                    stats.in_flight_at_term["ok"] += 1
            else:
                stats.non2xx[str(status)] = stats.non2xx.get(str(status), 0) + 1
                if len(stats.failures) < 200:
                    stats.failures.append({"t": t, "kind": f"status {status}", "phase": "request",
                                           "on_conn": on_conn})
            on_conn += 1
            last_done = done
            if close:
                stats.closed_by_server += 1
                writer.close()
                writer = None
            continue
        k = kind_of(err, counting.got)
        if not before_term:
            stats.after_term["sent"] += 1
            stats.after_term["failed"] += 1
        else:
            stats.failed[k] = stats.failed.get(k, 0) + 1
            if len(stats.failures) < 200:
                stats.failures.append({
                    "t": t, "done": done, "kind": k, "phase": "request",
                    # requests this connection had answered before (0: a fresh connection)
                    "on_conn": on_conn,
                    # how long the connection sat idle (client side) before this request
                    "idle_ms": None if last_done is None else round((t - last_done) * 1000, 3),
                })
        try:
            writer.close()
        except OSError:
            pass
        writer = None
    if writer is not None:
        writer.close()


async def run_h1(args):
    stats = H1Stats()
    term = Term(args.term_file)
    watcher = asyncio.ensure_future(term.watch())
    tasks = [asyncio.ensure_future(h1_client(i, args.port, args.path, stats, term, args.timeout))
             for i in range(args.conns)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), args.deadline)
    except asyncio.TimeoutError:
        stats.failed["still-running-at-deadline"] = sum(1 for t in tasks if not t.done())
    watcher.cancel()
    lat = sorted(stats.latencies)
    out = {k: v for k, v in vars(stats).items() if k != "latencies"}
    out["term_at"] = term.at
    out["p50_ms"] = round(lat[len(lat) // 2] * 1000, 2) if lat else None
    out["p99_ms"] = round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else None
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


# ------------------------------------------------------------------ WebSocket clients
async def ws_client(i, port, interval, rec, term):
    n = 0
    while not term.stopped():
        t0 = time.time()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            key = base64.b64encode(os.urandom(16))
            writer.write(b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                         b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                         b"Sec-WebSocket-Key: " + key + b"\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            status = int(head.split()[1])
            if status != 101:
                raise ValueError(f"status {status}")
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, IndexError) as e:
            if term.stopped() and t0 >= term.at:
                break
            rec["open_failed"].append({"t": t0, "kind": kind_of(e, False) if not isinstance(e, ValueError) else str(e)})
            await asyncio.sleep(0.1)
            continue
        opened = time.time()
        rec["opened"] += 1
        how = None
        try:
            while True:
                payload = f"{i}-{n}".encode()
                n += 1
                writer.write(frame(1, payload, True))
                await writer.drain()
                op, got = await asyncio.wait_for(read_frame(reader), 5)
                if op != 1 or got != payload:
                    how = "wrong echo"
                    break
                rec["echoes"] += 1
                await asyncio.sleep(interval)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            how = kind_of(e, True)
        rec["ended"].append({"t": time.time(), "opened": opened, "how": how})
        writer.close()


async def run_ws(args):
    rec = {"opened": 0, "echoes": 0, "ended": [], "open_failed": []}
    term = Term(args.term_file)
    watcher = asyncio.ensure_future(term.watch())
    tasks = [asyncio.ensure_future(ws_client(i, args.port, args.interval, rec, term)) for i in range(args.n)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), args.deadline)
    except asyncio.TimeoutError:
        rec["still_open_at_deadline"] = sum(1 for t in tasks if not t.done())
    watcher.cancel()
    rec["term_at"] = term.at
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


# ------------------------------------------------------------------ report
def read_events(path):
    events = []
    if os.path.exists(path):
        for line in open(path):
            parts = line.split(None, 1)
            if len(parts) == 2:
                events.append((float(parts[0]), parts[1].strip()))
    return events


def h2load_counts(path):
    text = open(path).read()
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored, (\d+) timeout", text)
    s = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text)
    if not m:
        return {"parsed": False, "tail": text[-300:]}
    total, started, done, ok, failed, errored, timeout = map(int, m.groups())
    # h2load's "failed" includes non-2xx answers and "errored" (no answer: reset, refused,
    # closed), which includes "timeout"; requests never done are errors too.
    return {"parsed": True, "total": total, "started": started, "done": done, "succeeded": ok,
            "failed": failed, "errored": errored, "timeout": timeout,
            "status_2xx": int(s.group(1)) if s else 0,
            "non2xx": (sum(map(int, s.groups()[1:])) if s else 0)}


def report(args):
    d = args.dir
    events = read_events(os.path.join(d, "events.txt"))
    drains = [t for t, name in events if name.startswith("drain")]
    start = events[0][0] if events else 0.0
    start_t = start

    def near(t):
        before = [(et, name) for et, name in events if et <= t]
        if not before:
            return None
        et, name = before[-1]
        return f"{name} +{(t - et) * 1000:.0f} ms"

    s = {"proxy": args.proxy, "failed": 0, "refused": 0, "non2xx": 0, "requests_ok": 0,
         "tunnels_cut_early": 0, "tunnels_cut_at_drain": 0, "notes": []}
    for path in sorted(glob.glob(os.path.join(d, "h1*.json"))):
        name = os.path.basename(path)[:-5]
        h = json.load(open(path))
        failed = sum(h["failed"].values())
        non2xx = sum(h["non2xx"].values())
        s["failed"] += failed
        s["refused"] += h["refused"]
        s["non2xx"] += non2xx
        s["requests_ok"] += h["ok"]
        s[name] = {"ok": h["ok"], "failed": h["failed"], "refused": h["refused"], "non2xx": h["non2xx"],
                   "connects": h["connects"], "idle_closed_seen": h["idle_closed_seen"], "in_flight_at_stop": h["in_flight_at_term"],
                   "after_stop": h["after_term"], "p50_ms": h["p50_ms"], "p99_ms": h["p99_ms"]}
        s[name]["failures"] = [dict(f, t=round(f["t"] - start, 3), near=near(f["t"]),
                                    **({"done": round(f["done"] - start, 3)} if "done" in f else {}))
                               for f in h["failures"][:40]]
    for group in ("load", "stop"):
        # Per request, from h2load's --log-file: start (us since the epoch; 0 when the request
        # was never sent), status (-1: no answer), duration.
        h2 = {"runs": 0, "sent": 0, "ok": 0, "non2xx": 0, "sent_not_answered": 0, "never_sent": 0,
              "runs_not_understood": 0, "not_answered": []}
        for path in sorted(glob.glob(os.path.join(d, f"h2load-{group}*.txt"))):
            h2["runs"] += 1
            c = h2load_counts(path)
            tsv = path.replace("h2load-", "h2log-").replace(".txt", ".tsv")
            if not c.get("parsed") or not os.path.exists(tsv):
                h2["runs_not_understood"] += 1
                continue
            logged = 0
            for line in open(tsv):
                p = line.split()
                if len(p) < 3:
                    continue
                logged += 1
                sent_us, status = int(p[0]), int(p[1])
                if sent_us == 0:
                    h2["never_sent"] += 1
                    continue
                h2["sent"] += 1
                if status == -1:
                    h2["sent_not_answered"] += 1
                    if len(h2["not_answered"]) < 20:
                        t = sent_us / 1e6
                        h2["not_answered"].append({"t": round(t - start_t, 3), "near": near(t)})
                elif 200 <= status < 300:
                    h2["ok"] += 1
                else:
                    h2["non2xx"] += 1
            # Requests h2load sent that neither got an answer nor were logged: their connection
            # was closed under them (e.g. accepted just before a drain and then dropped).
            lost = max(0, c["started"] - c["done"])
            h2["sent_not_answered"] += lost
            if lost and len(h2["not_answered"]) < 20:
                h2["not_answered"].append({"run": os.path.basename(path), "started": c["started"],
                                           "done": c["done"], "mtime": round(os.path.getmtime(path) - start_t, 3),
                                           "near": near(os.path.getmtime(path))})
            # Requests h2load counted but neither sent nor logged (it stopped early): never sent.
            h2["never_sent"] += max(0, c["total"] - logged - lost)
        s[f"h2-{group}"] = h2
        s["failed"] += h2["sent_not_answered"] + h2["runs_not_understood"]
        s["non2xx"] += h2["non2xx"]
        s["requests_ok"] += h2["ok"]
    ws_path = os.path.join(d, "ws.json")
    if os.path.exists(ws_path):
        w = json.load(open(ws_path))
        ends = []
        for e in w["ended"]:
            # At the drain timeout: drain_timeout (within the tolerance) after a drain began.
            # Any drain, not only the first after the tunnel opened: NGINX and HAProxy apply a
            # reload asynchronously, so an old worker may take a connection after the signal
            # and cut it drain_timeout after its own drain began, which the script cannot see.
            lo, hi = args.drain_timeout - args.tolerance, args.drain_timeout + 1.5
            fits = [e["t"] - t for t in drains if lo <= e["t"] - t <= hi]
            began = [t for t in drains if t <= e["t"] + 0.05]
            after = fits[0] if fits else (e["t"] - began[-1] if began else None)
            if fits:
                verdict = "at drain_timeout"
                s["tunnels_cut_at_drain"] += 1
            else:
                verdict = "early"
                s["tunnels_cut_early"] += 1
            ends.append({"t": round(e["t"] - start, 3), "how": e["how"], "verdict": verdict,
                         "after_drain_s": None if after is None else round(after, 3), "near": near(e["t"])})
        s["ws"] = {"opened": w["opened"], "echoes": w["echoes"], "open_failed": len(w["open_failed"]),
                   "open_failures": [dict(f, t=round(f["t"] - start, 3), near=near(f["t"])) for f in w["open_failed"][:20]],
                   "ends": ends, "still_open_at_deadline": w.get("still_open_at_deadline", 0)}
        # A WebSocket that could not be opened while the proxy served is a refused connection.
        s["refused"] += len(w["open_failed"])
    serials = os.path.join(d, "serials.txt")
    s["rotations"] = {"done": 0, "seen": 0, "rows": []}
    if os.path.exists(serials):
        for line in open(serials):
            p = line.split()
            if len(p) >= 3:
                s["rotations"]["done"] += 1
                s["rotations"]["seen"] += p[1] == p[2]
                s["rotations"]["rows"].append({"expected": p[1], "seen": p[2], "after_s": p[3] if len(p) > 3 else None})
    extra = os.path.join(d, "extra.txt")
    s["extra_listener"] = {"rows": [], "ok": 0, "total": 0}
    if os.path.exists(extra):
        for line in open(extra):
            p = line.split()
            if len(p) >= 3:
                s["extra_listener"]["total"] += 1
                s["extra_listener"]["ok"] += p[1] == p[2]
                s["extra_listener"]["rows"].append({"state": p[0], "expected": p[1], "got": p[2]})
    s["events"] = [(round(t - start, 3), name) for t, name in events]
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    rot = s["rotations"]
    ex = s["extra_listener"]
    print(f"{args.proxy}: ok {s['requests_ok']}, failed {s['failed']}, refused {s['refused']}, "
          f"non-2xx {s['non2xx']}, tunnels cut early {s['tunnels_cut_early']} "
          f"(at drain_timeout {s['tunnels_cut_at_drain']}), new certificate seen {rot['seen']}/{rot['done']}, "
          f"extra listener as expected {ex['ok']}/{ex['total']}")
    for g in ("h2-load", "h2-stop"):
        h2 = s[g]
        print(f"  {g}: {h2['runs']} h2load run(s), {h2['sent']} sent, {h2['ok']} 2xx, "
              f"{h2['sent_not_answered']} sent and not answered, {h2['never_sent']} never sent "
              f"(h2load stops a client at a GOAWAY)")
    for name in [k for k in s if k.startswith("h1")]:
        h = s[name]
        print(f"  {name}: {h['ok']} 2xx, failed {h['failed']}, refused {h['refused']}, "
              f"in flight at the stop {h['in_flight_at_stop']['ok']}/{h['in_flight_at_stop']['total']} answered")
    for name in [k for k in s if k.startswith("h1")]:
        for f in s[name]["failures"][:12]:
            print(f"  {name} failure: {f}")
    for e in s.get("ws", {}).get("ends", []):
        if e["verdict"] == "early":
            print(f"  tunnel cut early: {e}")
    bad = s["failed"] + s["refused"] + s["non2xx"] + s["tunnels_cut_early"] + (rot["done"] - rot["seen"]) + (ex["total"] - ex["ok"])
    return 1 if bad else 0


def table(args):
    rows = [json.load(open(p)) for p in args.summaries]
    cols = ["proxy", "requests ok", "failed (HTTP/1.1 + HTTP/2)", "refused", "non-2xx",
            "in flight at the stop, answered", "tunnels cut early", "tunnels cut at drain_timeout",
            "new cert seen", "extra listener"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for s in rows:
        rot = s["rotations"]
        ex = s["extra_listener"]
        h1 = [v for k, v in s.items() if k.startswith("h1")]
        f1 = sum(sum(h["failed"].values()) for h in h1)
        f2 = s["failed"] - f1
        fl_ok = sum(h["in_flight_at_stop"]["ok"] for h in h1) + s["h2-stop"]["ok"]
        fl = sum(h["in_flight_at_stop"]["total"] for h in h1) + s["h2-stop"]["sent"]
        print(f"| {s['proxy']} | {s['requests_ok']} | {s['failed']} ({f1} + {f2}) | {s['refused']} | "
              f"{s['non2xx']} | {fl_ok}/{fl} | {s['tunnels_cut_early']} | {s['tunnels_cut_at_drain']} | "
              f"{rot['seen']}/{rot['done']} | {ex['ok']}/{ex['total']} |")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("ws-backend")
    b.add_argument("--port", type=int, required=True)
    h = sub.add_parser("h1")
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--conns", type=int, default=64)
    h.add_argument("--path", default="/")
    h.add_argument("--term-file", required=True)
    h.add_argument("--out", required=True)
    h.add_argument("--timeout", type=float, default=15.0)
    h.add_argument("--deadline", type=float, default=120.0)
    w = sub.add_parser("ws")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--n", type=int, default=20)
    w.add_argument("--interval", type=float, default=0.2)
    w.add_argument("--term-file", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--deadline", type=float, default=120.0)
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    r.add_argument("--proxy", required=True)
    r.add_argument("--drain-timeout", type=float, required=True)
    # NGINX's timers may fire up to 300 ms early (NGX_TIMER_LAZY_DELAY) and run on a cached
    # clock: a cut within this of the drain timeout counts as at it.
    r.add_argument("--tolerance", type=float, default=1.0)
    t = sub.add_parser("table")
    t.add_argument("summaries", nargs="+")
    args = p.parse_args()
    if args.cmd == "ws-backend":
        asyncio.run(ws_backend(args.port))
    elif args.cmd == "h1":
        asyncio.run(run_h1(args))
    elif args.cmd == "ws":
        asyncio.run(run_ws(args))
    elif args.cmd == "report":
        sys.exit(report(args))
    elif args.cmd == "table":
        sys.exit(table(args))


if __name__ == "__main__":
    main()
