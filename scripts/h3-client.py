#!/usr/bin/env python3
"""A real HTTP/3 client (aioquic) for keel's HTTP/3 front end, and the loopback servers its
checks need. Run by scripts/test-h3.sh and bench/h3.sh, in a venv they make (aioquic, httpx[h2]).

  h3-client.py backends ECHO_PORT_FILE FLAKY_PORT_FILE
      An echo server (answers with the request's method, path, headers and body length) and
      a server that drops its first connection unanswered (an endpoint that fails once), on
      loopback ports written to the two files; runs until killed.
  h3-client.py compare PORT CA [ACCESS_LOG]
      The same requests over HTTP/3 (aioquic) and HTTP/2 (httpx): status, headers (but `date`
      and `alt-svc`) and body must be equal; HTTP/2 answers must carry Alt-Svc. With ACCESS_LOG,
      keel's access log must have every HTTP/3 request, the retried one with 2 attempts.
  h3-client.py load PORT CA CONNECTIONS REQUESTS [CONCURRENCY] [PATH]
      REQUESTS GETs over CONNECTIONS HTTP/3 connections, CONCURRENCY in flight on each (10);
      prints one JSON line: requests, errors, seconds, req/s, client CPU seconds.
"""

import asyncio
import json
import os
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, StreamReset


class H3Client(QuicConnectionProtocol):
    """One HTTP/3 connection: requests on their own streams, answers gathered per stream."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._http = H3Connection(self._quic)
        self._waiting = {}

    def quic_event_received(self, event):
        if isinstance(event, ConnectionTerminated):
            for fut, _ in self._waiting.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"connection closed: {event.reason_phrase}"))
            self._waiting.clear()
            return
        if isinstance(event, StreamReset) and event.stream_id in self._waiting:
            fut, _ = self._waiting.pop(event.stream_id)
            fut.set_exception(ConnectionError(f"stream reset: {event.error_code}"))
            return
        for ev in self._http.handle_event(event):
            entry = self._waiting.get(getattr(ev, "stream_id", None))
            if entry is None:
                continue
            fut, got = entry
            got.append(ev)
            if ev.stream_ended:
                del self._waiting[ev.stream_id]
                fut.set_result(got)

    async def request(self, method, authority, path, headers=(), body=b""):
        sid = self._quic.get_next_available_stream_id()
        head = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ] + [(k.lower().encode(), v.encode()) for k, v in headers]
        if body:
            head.append((b"content-length", str(len(body)).encode()))
        self._http.send_headers(sid, head, end_stream=not body)
        if body:
            self._http.send_data(sid, body, end_stream=True)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[sid] = (fut, [])
        self.transmit()
        events = await asyncio.wait_for(fut, 10)
        status, fields, data = None, [], b""
        for ev in events:
            if isinstance(ev, HeadersReceived) and status is None:
                for k, v in ev.headers:
                    if k == b":status":
                        status = int(v)
                    else:
                        fields.append((k.decode(), v.decode()))
            elif isinstance(ev, DataReceived):
                data += ev.data
        return status, fields, data


def quic_config(ca):
    c = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    c.load_verify_locations(ca)
    c.server_name = "localhost"
    return c


# --- backends ---------------------------------------------------------------------------


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            body = self.rfile.read(n)
        lines = [f"method: {self.command}", f"path: {self.path}", f"body-length: {len(body)}"]
        lines += sorted(f"{k.lower()}: {v}" for k, v in self.headers.items())
        out = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("x-backend", "echo")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


def flaky_server(sock):
    """Drops its first connection unanswered; answers `ok` on every later one."""
    first = True
    while True:
        conn, _ = sock.accept()
        if first:
            first = False
            conn.recv(65536)
            conn.close()
            continue
        threading.Thread(target=answer_ok, args=(conn,), daemon=True).start()


def answer_ok(conn):
    buf = b""
    with conn:
        while True:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
            while b"\r\n\r\n" in buf:
                _, buf = buf.split(b"\r\n\r\n", 1)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-backend: flaky\r\n\r\nok")


class EchoServer(ThreadingHTTPServer):
    # keel opens a connection per request in flight: socketserver's backlog of 5 would drop
    # their SYNs under load.
    request_queue_size = 1024
    daemon_threads = True


def backends(echo_file, flaky_file):
    echo = EchoServer(("127.0.0.1", 0), Echo)
    flaky = socket.socket()
    flaky.bind(("127.0.0.1", 0))
    flaky.listen(64)
    threading.Thread(target=flaky_server, args=(flaky,), daemon=True).start()
    with open(echo_file + ".tmp", "w") as f:
        f.write(str(echo.server_address[1]))
    os.rename(echo_file + ".tmp", echo_file)
    with open(flaky_file + ".tmp", "w") as f:
        f.write(str(flaky.getsockname()[1]))
    os.rename(flaky_file + ".tmp", flaky_file)
    echo.serve_forever()


# --- compare ----------------------------------------------------------------------------

HEADERS = [
    ("accept", "*/*"),
    ("accept-encoding", "identity"),
    ("user-agent", "keel-h3-check"),
]

CASES = [
    ("GET", "/echo?x=1", [("x-request-id", "check-1")], b""),
    ("GET", "/flaky", [("x-request-id", "check-2")], b""),
    ("POST", "/echo/upload", [("x-request-id", "check-3"), ("content-type", "application/octet-stream")], b"y" * 200_000),
    ("PUT", "/echo/small", [("x-request-id", "check-4")], b"hello"),
]


def shown(fields):
    return sorted((k, v) for k, v in fields if k not in ("date", "alt-svc"))


async def compare(port, ca, access_log):
    import httpx

    authority = f"localhost:{port}"
    h3 = []
    async with connect("127.0.0.1", port, configuration=quic_config(ca), create_protocol=H3Client) as client:
        for method, path, extra, body in CASES:
            h3.append(await client.request(method, authority, path, HEADERS + extra, body))
    h2 = []
    context = ssl.create_default_context(cafile=ca)
    async with httpx.AsyncClient(http2=True, verify=context, headers=dict(HEADERS)) as client:
        for method, path, extra, body in CASES:
            r = await client.request(method, f"https://{authority}{path}", headers=dict(extra), content=body or None)
            assert r.http_version == "HTTP/2", r.http_version
            h2.append((r.status_code, list(r.headers.multi_items()), r.content, r.headers.get("alt-svc")))
    failures = 0
    for (method, path, _, _), a, b in zip(CASES, h3, h2):
        same = a[0] == b[0] and shown(a[1]) == shown(b[1]) and a[2] == b[2]
        alt = b[3] == f'h3=":{port}"; ma=86400'
        ok = same and alt and a[0] == 200
        failures += not ok
        print(f"{'same' if ok else 'DIFFERENT'}: {method} {path}: HTTP/3 {a[0]}, {len(a[2])} bytes; HTTP/2 {b[0]}, {len(b[2])} bytes, alt-svc {b[3]}")
        if not ok:
            print(f"  HTTP/3 headers {shown(a[1])}\n  HTTP/2 headers {shown(b[1])}")
            print(f"  HTTP/3 body {a[2][:400]!r}\n  HTTP/2 body {b[2][:400]!r}")
    if access_log:
        await asyncio.sleep(0.5)  # the log is written every 100 ms
        lines = [json.loads(l) for l in open(access_log)]
        h3_lines = [l for l in lines if l.get("protocol") == "HTTP/3.0"]
        flaky = [l for l in h3_lines if l["path"] == "/flaky"]
        logged = len(h3_lines) == len(CASES) and flaky and flaky[0]["attempts"] == 2
        failures += not logged
        print(f"{'logged' if logged else 'NOT LOGGED'}: {len(h3_lines)} HTTP/3 lines in the access log, /flaky with {flaky[0]['attempts'] if flaky else None} attempts")
    return failures


# --- load -------------------------------------------------------------------------------


async def load(port, ca, connections, requests, concurrency, path):
    authority = f"localhost:{port}"
    per_conn = [requests // connections + (i < requests % connections) for i in range(connections)]
    errors = 0
    done = 0
    first_error = None

    async def one_connection(n):
        nonlocal errors, done, first_error
        async with connect("127.0.0.1", port, configuration=quic_config(ca), create_protocol=H3Client) as client:
            left = n

            async def worker():
                nonlocal left, errors, done, first_error
                while left > 0:
                    left -= 1
                    try:
                        status, _, _ = await client.request("GET", authority, path, HEADERS)
                        if status == 200:
                            done += 1
                        else:
                            errors += 1
                            first_error = first_error or f"status {status}"
                    except Exception as e:  # noqa: BLE001 (counted, not raised)
                        errors += 1
                        first_error = first_error or repr(e)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    cpu = time.process_time()
    start = time.monotonic()
    await asyncio.gather(*(one_connection(n) for n in per_conn))
    seconds = time.monotonic() - start
    cpu = time.process_time() - cpu
    print(json.dumps({
        "requests": done + errors, "ok": done, "errors": errors, "first_error": first_error,
        "connections": connections, "concurrency": concurrency,
        "seconds": round(seconds, 3), "req_per_s": round((done + errors) / seconds, 1),
        "client_cpu_s": round(cpu, 3),
    }))
    return errors


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "backends":
        backends(*args)
    elif cmd == "compare":
        failures = asyncio.run(compare(int(args[0]), args[1], args[2] if len(args) > 2 else None))
        sys.exit(1 if failures else 0)
    elif cmd == "load":
        conc = int(args[4]) if len(args) > 4 else 10
        path = args[5] if len(args) > 5 else "/"
        errors = asyncio.run(load(int(args[0]), args[1], int(args[2]), int(args[3]), conc, path))
        sys.exit(1 if errors else 0)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
