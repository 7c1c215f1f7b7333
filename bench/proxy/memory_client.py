#!/usr/bin/env python3
"""Holds N keep-alive HTTP/1.1 connections open to 127.0.0.1:PORT, for bench/proxy/memory.sh.

    memory_client.py PORT N idle|active|open

open:   each connection is only opened (no request): what a connection costs before its first.
idle:   each connection sends one GET and reads its whole answer, then waits (keep-alive).
active: each connection sends one GET whose answer the endpoint holds back: a request in
        flight on every connection.

Connections are opened in batches of 250 (the requests of a batch in flight together, so that no
proxy's accept queue overflows). Then one line goes to stdout, `ready OPENED ANSWERED FAILED`,
and the connections stay open until stdin closes (or 600 s pass). Plain blocking sockets, no
event loop: the client's own memory is not measured, and 10,000 sockets need no more than this.
"""
import select
import socket
import sys
import time

BATCH = 250
REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"


def read_answer(s):
    """Reads one answer with a Content-Length body; True if it was a 200."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            return False
        body += chunk
    return head.startswith(b"HTTP/1.1 200")


def main():
    port, n, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    assert mode in ("idle", "active", "open"), mode
    held, answered, failed = [], 0, 0
    for start in range(0, n, BATCH):
        batch = []
        for _ in range(min(BATCH, n - start)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(30)
            try:
                s.connect(("127.0.0.1", port))
                if mode != "open":
                    s.sendall(REQUEST)
                batch.append(s)
            except OSError:
                failed += 1
                s.close()
        if mode == "idle":
            for s in batch:
                try:
                    ok = read_answer(s)
                except OSError:
                    ok = False
                answered += ok
                failed += not ok
        held.extend(batch)
    print(f"ready {len(held)} {answered} {failed}", flush=True)
    # Wait for stdin to close (the script is done measuring), bounded.
    select.select([sys.stdin], [], [], 600)
    for s in held:
        s.close()
    time.sleep(0.1)


if __name__ == "__main__":
    main()
