#!/usr/bin/env python3
"""Helpers of bench/edges/timeouts.sh (loopback only).

  backend  --port P             HTTP/1.1 origin: POST reads the whole body and answers 200;
                                GET /sse streams N Server-Sent Events (chunked, one a second);
                                GET /body answers a 64 KiB body. One JSON line per request on
                                stdout (what it received, whether the response was cut).
  stamp [--t0 EPOCH]            reads lines on stdin, writes "<seconds since t0> <line>".
  sse-summary FILE              summary of a stamped SSE capture (events, first/last, gaps).
  h2zero   --port P ...         HTTP/2 prior-knowledge clients with SETTINGS_INITIAL_WINDOW_SIZE
                                = 0 and no WINDOW_UPDATE; meanwhile a normal HTTP/2 client.
  table    A.json B.json        the markdown table of two proxies' summaries.
"""

import argparse
import json
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


# ---------------------------------------------------------------- backend
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sse_events = 60
    body = b"x" * 65536

    def log_message(self, *args):  # one JSON line per request instead
        pass

    def note(self, **kw):
        kw.update(t=round(time.time(), 3), method=self.command, path=self.path)
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    def do_POST(self):
        t0 = time.monotonic()
        n = 0
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    n += len(self.rfile.read(size))
                    self.rfile.readline()
            else:
                left = int(self.headers.get("content-length", "0"))
                while left > 0:
                    chunk = self.rfile.read(min(left, 65536))
                    if not chunk:
                        break
                    n += len(chunk)
                    left -= len(chunk)
        except (OSError, ValueError) as e:
            self.note(received=n, error=str(e), seconds=round(time.monotonic() - t0, 3))
            self.close_connection = True
            return
        answer = f"received {n} bytes\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
        self.note(received=n, seconds=round(time.monotonic() - t0, 3), status=200)

    def do_GET(self):
        if self.path.startswith("/sse"):
            return self.sse()
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        try:
            self.wfile.write(self.body)
            self.note(status=200, sent=len(self.body))
        except OSError as e:
            self.note(status=200, error=str(e))

    def sse(self):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        sent = 0
        try:
            for i in range(1, self.sse_events + 1):
                ev = f"id: {i}\ndata: event {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                self.wfile.flush()
                sent = i
                if i < self.sse_events:
                    time.sleep(1)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            self.note(status=200, events=sent, complete=True)
        except OSError as e:
            self.note(status=200, events=sent, complete=False, error=str(e))
            self.close_connection = True


def backend(args):
    Handler.sse_events = args.sse_events
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 1024
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.serve_forever()


# ---------------------------------------------------------------- SSE capture
def stamp(args):
    t0 = args.t0 if args.t0 is not None else time.time()
    for line in sys.stdin.buffer:
        sys.stdout.write("%.3f %s\n" % (time.time() - t0, line.decode(errors="replace").rstrip("\n")))
        sys.stdout.flush()


def sse_summary(args):
    times = []
    with open(args.file) as f:
        for line in f:
            t, _, rest = line.partition(" ")
            if rest.startswith("data:"):
                times.append(float(t))
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(json.dumps({
        "events": len(times),
        "first_event_s": round(times[0], 2) if times else None,
        "last_event_s": round(times[-1], 2) if times else None,
        "max_gap_s": round(max(gaps), 2) if gaps else None,
    }))


# ---------------------------------------------------------------- HTTP/2 zero window
def h2_imports():
    try:
        import h2.config  # noqa: F401
        import h2.connection  # noqa: F401
        import h2.events  # noqa: F401
        import h2.settings  # noqa: F401
    except ImportError:
        sys.exit("timeouts.py: the python package h2 is needed (pip install h2)")
    import h2
    return h2


def zero_window_conn(h2, port, path, streams, t0, cap, out):
    """One connection: window 0, `streams` GETs, then read until every stream is reset or the
    connection closed, or `cap` seconds."""
    rec = {"opened": 0, "heads": 0, "statuses": {}, "data_bytes": 0, "resets": [], "ended": 0,
           "goaway": None, "closed": None, "error": None}
    out.append(rec)
    done = {}  # stream id -> seconds at which it ended (reset, end, GOAWAY or close)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0,
                              h2.settings.SettingCodes.ENABLE_PUSH: 0})
        s.sendall(conn.data_to_send())
        # The server's SETTINGS first (its MAX_CONCURRENT_STREAMS bounds what is opened).
        deadline = time.monotonic() + 5
        got_settings = False
        pending = b""
        while not got_settings and time.monotonic() < deadline:
            r, _, _ = select.select([s], [], [], 0.5)
            if r:
                data = s.recv(65536)
                if not data:
                    raise ConnectionError("closed before SETTINGS")
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.RemoteSettingsChanged):
                        got_settings = True
                pending = conn.data_to_send()
                if pending:
                    s.setblocking(True)
                    s.sendall(pending)
                    s.setblocking(False)
        limit = min(streams, conn.remote_settings.max_concurrent_streams or streams)
        rec["server_max_concurrent_streams"] = conn.remote_settings.max_concurrent_streams
        ids = []
        for _ in range(limit):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(":method", "GET"), (":scheme", "http"),
                                    (":authority", f"127.0.0.1:{port}"), (":path", path)], end_stream=True)
            ids.append(sid)
        rec["opened"] = len(ids)
        rec["opened_at"] = round(time.monotonic() - t0, 3)
        s.setblocking(True)
        s.sendall(conn.data_to_send())
        s.setblocking(False)
        while time.monotonic() - t0 < cap and len(done) < len(ids):
            r, _, _ = select.select([s], [], [], 0.5)
            if not r:
                continue
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = None
                rec["error"] = "connection reset (TCP RST)"
            now = round(time.monotonic() - t0, 3)
            if not data:
                rec["closed"] = now
                for sid in ids:
                    done.setdefault(sid, now)
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    rec["heads"] += 1
                    st = dict(ev.headers).get(":status", "?")
                    rec["statuses"][st] = rec["statuses"].get(st, 0) + 1
                elif isinstance(ev, h2.events.DataReceived):
                    rec["data_bytes"] += len(ev.data)  # never acknowledged: no WINDOW_UPDATE
                elif isinstance(ev, h2.events.StreamReset):
                    rec["resets"].append((now, int(ev.error_code)))
                    done.setdefault(ev.stream_id, now)
                elif isinstance(ev, h2.events.StreamEnded):
                    rec["ended"] += 1
                    done.setdefault(ev.stream_id, now)
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    rec["goaway"] = {"t": now, "error_code": int(ev.error_code),
                                     "last_stream_id": ev.last_stream_id}
                    for sid in ids:  # streams past last_stream_id were never processed
                        if sid > (ev.last_stream_id or 0):
                            done.setdefault(sid, now)
            pending = conn.data_to_send()  # SETTINGS and PING acks only
            if pending:
                try:
                    s.setblocking(True)
                    s.sendall(pending)
                    s.setblocking(False)
                except OSError:
                    pass
        s.close()
    except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["streams_done"] = len(done)
    rec["last_done"] = max(done.values()) if done else None
    rec["first_done"] = min(done.values()) if done else None


def normal_get(h2, port, path, timeout):
    """One GET on a new HTTP/2 connection with default windows: (status or error, seconds)."""
    t = time.monotonic()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        s.settimeout(timeout)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "GET"), (":scheme", "http"),
                                (":authority", f"127.0.0.1:{port}"), (":path", path)], end_stream=True)
        s.sendall(conn.data_to_send())
        status, n = None, 0
        while time.monotonic() - t < timeout:
            data = s.recv(65536)
            if not data:
                return ("closed", time.monotonic() - t)
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    status = dict(ev.headers).get(":status")
                elif isinstance(ev, h2.events.DataReceived):
                    n += len(ev.data)
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    s.close()
                    return (f"{status}" if n else f"{status} (empty)", time.monotonic() - t)
                elif isinstance(ev, h2.events.StreamReset):
                    s.close()
                    return ("reset", time.monotonic() - t)
            s.sendall(conn.data_to_send())
        return ("timeout", time.monotonic() - t)
    except OSError as e:
        return (f"error {type(e).__name__}", time.monotonic() - t)


def h2zero(args):
    h2 = h2_imports()
    t0 = time.monotonic()
    t0_epoch = time.time()
    conns = []
    threads = [threading.Thread(target=zero_window_conn,
                                args=(h2, args.port, args.path + "?zero", args.streams, t0, args.cap, conns))
               for _ in range(args.conns)]
    for th in threads:
        th.start()
    normal = []
    time.sleep(1)
    while any(th.is_alive() for th in threads) and time.monotonic() - t0 < args.cap:
        st, dt = normal_get(h2, args.port, args.path + "?normal", 5)
        normal.append({"t": round(time.monotonic() - t0, 2), "status": st, "seconds": round(dt, 3)})
        time.sleep(max(0, args.normal_every - dt))
    for th in threads:
        th.join()
    opened = sum(c["opened"] for c in conns)
    done = sum(c.get("streams_done", 0) for c in conns)
    lasts = [c["last_done"] for c in conns if c.get("last_done") is not None]
    firsts = [c["first_done"] for c in conns if c.get("first_done") is not None]
    summary = {
        "t0_epoch": t0_epoch,
        "connections": conns,
        "opened": opened,
        "heads": sum(c["heads"] for c in conns),
        "data_bytes": sum(c["data_bytes"] for c in conns),
        "streams_done": done,
        "resets": sum(len(c["resets"]) for c in conns),
        "reset_codes": sorted({code for c in conns for _, code in c["resets"]}),
        "goaways": [c["goaway"] for c in conns if c["goaway"]],
        "closes": [c["closed"] for c in conns if c["closed"] is not None],
        "first_done_s": min(firsts) if firsts else None,
        "all_done_s": max(lasts) if (lasts and done == opened) else None,
        "cap_s": args.cap,
        "normal": normal,
        "normal_ok": sum(1 for n in normal if n["status"] == "200"),
        "normal_total": len(normal),
        "normal_max_s": max((n["seconds"] for n in normal), default=None),
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("connections", "normal")}))


# ---------------------------------------------------------------- table
H2_CODES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
            5: "STREAM_CLOSED", 7: "REFUSED_STREAM", 8: "CANCEL", 11: "ENHANCE_YOUR_CALM"}


def cell(p, which):
    if which == "upload":
        u = p["upload"]
        return (f"{u['status']} in {u['seconds']:.1f} s (curl exit {u['exit']}); endpoint got {u['backend_bytes']} B, "
                f"read in {u['backend_read_s']} s")
    if which == "sse":
        s = p["sse"]
        first = "-" if s["first_event_s"] is None else f"{s['first_event_s']:.1f}"
        return (f"{s['events']}/60 events, curl exit {s['exit']}, {s['seconds']:.1f} s "
                f"(HTTP {s['status']}; first event at {first} s, longest gap {s['max_gap_s']} s)")
    z = p["h2zero"]
    codes = ", ".join(H2_CODES.get(c, str(c)) for c in z["reset_codes"])
    resets = f"{z['resets']} RST_STREAM {codes}" if z["resets"] else "no RST_STREAM"
    if z["all_done_s"] is not None:
        span = (f"{z['first_done_s']:.1f}" if z['all_done_s'] - z['first_done_s'] < 0.05
                else f"{z['first_done_s']:.1f}-{z['all_done_s']:.1f}")
        when = f"all {z['opened']} streams ended at {span} s"
    else:
        when = f"{z['streams_done']} of {z['opened']} streams ended within {z['cap_s']} s"
    ga = z["goaways"]
    goaway = (f"; GOAWAY ({H2_CODES.get(ga[0]['error_code'], ga[0]['error_code'])}) at "
              + ", ".join(f"{g['t']:.1f}" for g in ga) + " s") if ga else "; no GOAWAY"
    errors = [c["error"] for c in z["connections"] if c.get("error")]
    how = "" if errors else " (FIN)"
    closes = (f"; connections closed{how} at " + ", ".join(f"{c:.1f}" for c in z["closes"]) + " s") if z["closes"] else ""
    if errors:
        closes += "; " + ", ".join(errors)
    return (f"{when} ({resets}{goaway}{closes}); "
            f"{z['heads']} response heads, {z['data_bytes']} B of body; "
            f"normal client {z['normal_ok']}/{z['normal_total']} served (slowest {z['normal_max_s']} s); "
            f"endpoint: {z['backend']['answered']} answers written whole, {z['backend']['cut']} cut, "
            f"last at {z['backend']['last_s']} s")


def table(args):
    ps = [json.load(open(f)) for f in args.files]
    names = [p["proxy"] for p in ps]
    print("| input | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(ps))
    rows = [("slow upload: 1 MB POST at 100 KB/s", "upload"),
            ("event stream: 60 SSE events, 1/s", "sse"),
            ("HTTP/2 zero window: 2 conns x 100 streams, GET 64 KiB", "h2zero")]
    for label, which in rows:
        print(f"| {label} | " + " | ".join(cell(p, which) for p in ps) + " |")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("backend")
    b.add_argument("--port", type=int, required=True)
    b.add_argument("--sse-events", type=int, default=60)
    st = sub.add_parser("stamp")
    st.add_argument("--t0", type=float, help="seconds since the epoch to count from (default: now)")
    s = sub.add_parser("sse-summary")
    s.add_argument("file")
    z = sub.add_parser("h2zero")
    z.add_argument("--port", type=int, required=True)
    z.add_argument("--path", default="/body")
    z.add_argument("--conns", type=int, default=2)
    z.add_argument("--streams", type=int, default=100)
    z.add_argument("--cap", type=float, default=90)
    z.add_argument("--normal-every", type=float, default=1.0)
    z.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    a = ap.parse_args()
    {"backend": backend, "stamp": stamp, "sse-summary": sse_summary, "h2zero": h2zero, "table": table}[a.cmd](a)


if __name__ == "__main__":
    main()
