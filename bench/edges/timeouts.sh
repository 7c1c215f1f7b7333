#!/usr/bin/env bash
# Timeouts on three slow inputs: keel with its default settings (a config with only
# a listener and a cluster's endpoints) and NGINX with its default proxy settings, one after
# the other, on loopback:
#
#   1. slow upload   a 1 MB POST body (1,000,000 bytes) sent at 100 KB/s by
#                    curl --limit-rate 100K --data-binary @file (about 10 s); the endpoint reads
#                    the whole body and answers 200. Recorded: status, time, bytes the endpoint got.
#   2. event stream  the endpoint answers GET /sse with text/event-stream (chunked), one event a
#                    second for 60 s; curl -N reads it all. Recorded: events received, curl's
#                    exit code, duration, the time of the first event and the longest gap.
#   3. zero window   2 HTTP/2 prior-knowledge (h2c) connections x 100 streams, each a GET of a
#                    64 KiB body, with SETTINGS_INITIAL_WINDOW_SIZE = 0 and no WINDOW_UPDATE
#                    (timeouts.py h2zero, python h2); meanwhile a normal HTTP/2 client does one
#                    GET a second on a new connection. Recorded: when each stream was reset
#                    (RST_STREAM), refused (GOAWAY) or closed with its connection; the wait is
#                    capped at CAP seconds (default 90).
#
# The endpoint is one python http.server (timeouts.py backend) for the three inputs.
#
# keel: [[listener]] listen + cluster, [[cluster]] name + endpoints; nothing else (its plain
#   listener speaks HTTP/1.1 and h2c prior knowledge).
# NGINX (Debian's 1.22): per server only `proxy_pass http://127.0.0.1:B;` and
#   `proxy_http_version 1.1;` (so that the chunked SSE answer is HTTP/1.1 upstream); the h2c
#   input goes to a second server with `listen ... http2` (prior knowledge, as NGINX 1.22 does
#   on a plain listener); worker_processes auto, error_log at info (so that its timeouts are
#   logged), its own pid/log paths. Everything else NGINX's defaults: proxy_buffering on,
#   proxy_request_buffering on, client_max_body_size 1m, send_timeout 60s, proxy_read_timeout
#   60s, keepalive_timeout 75s, http2_max_concurrent_streams 128.
#
#   bench/edges/timeouts.sh
#   PROXIES=keel CAP=30 bench/edges/timeouts.sh
#
# Environment (all optional): KEEL_BIN (else cargo build --release -p keel), PROXIES (default
# "keel nginx"), CAP (default 90), OUT (default target/edges-timeouts), KEEP_WORK.
# Ports 21501-21512 on 127.0.0.1 only (those it uses may not be in use when it starts); every
# process started here is stopped by PID.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../lib.sh"
HELPER="$HERE/timeouts.py"
PROXIES="${PROXIES:-keel nginx}"
CAP="${CAP:-90}"
OUT="${OUT:-$REPO/target/edges-timeouts}"
BACKEND=21501 PLAIN=21510 H2=21511
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# ---------------------------------------------------------------- tools
want_pkg curl curl
case " $PROXIES " in *" nginx "*) want_pkg nginx nginx ;; esac
install_each_wanted
python3 -c 'import h2' 2>/dev/null || { log "installing the python package h2 (pip)"; python3 -m pip install -q h2 || true; }
for t in curl python3; do
    command -v "$t" >/dev/null || { echo "timeouts.sh: $t is required" >&2; exit 2; }
done
python3 -c 'import h2' 2>/dev/null || { echo "timeouts.sh: the python package h2 is required" >&2; exit 2; }
run_list=()
for p in $PROXIES; do
    if [ "$p" = keel ] || command -v "$p" >/dev/null; then run_list+=("$p"); else log "skipping $p: not installed"; fi
done
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
ports_free "$BACKEND" "$PLAIN" "$H2"

bench_workdir keel-timeouts
chmod 755 "$WORK"
mkdir -p "$OUT"

head -c 1000000 /dev/urandom >"$WORK/upload.bin"

# ---------------------------------------------------------------- proxies
keel_start() {
    local d="$1"
    cat >"$d/keel.toml" <<EOF
[[listener]]
listen = "127.0.0.1:$PLAIN"
cluster = "app"

[[cluster]]
name = "app"
endpoints = [{ address = "127.0.0.1:$BACKEND" }]
EOF
    "$KEEL_BIN" proxy --config "$d/keel.toml" >"$d/proxy.log" 2>&1 &
    PROXY_PID="$!"
    STARTED+=("$PROXY_PID")
    wait_port "$PLAIN" 15
    H2_PORT="$PLAIN"
}
nginx_start() {
    local d="$1"
    mkdir -p "$d/logs"
    cat >"$d/nginx.conf" <<EOF
daemon off; master_process on; worker_processes auto; pid $d/nginx.pid;
error_log $d/error.log info;
events {}
http {
  access_log $d/access.log;
  server {
    listen 127.0.0.1:$PLAIN;
    location / { proxy_pass http://127.0.0.1:$BACKEND; proxy_http_version 1.1; }
  }
  server {
    listen 127.0.0.1:$H2 http2;
    location / { proxy_pass http://127.0.0.1:$BACKEND; proxy_http_version 1.1; }
  }
}
EOF
    nginx -p "$d" -c "$d/nginx.conf" -e "$d/error.log" >"$d/proxy.log" 2>&1 &
    PROXY_PID="$!"
    STARTED+=("$PROXY_PID")
    wait_port "$PLAIN" 15; wait_port "$H2" 15
    H2_PORT="$H2"
}

# ---------------------------------------------------------------- one proxy
run_proxy() {
    local p="$1" d="$OUT/$1" t0 rc code bpid
    rm -rf "$d"; mkdir -p "$d"
    python3 "$HELPER" backend --port "$BACKEND" >"$d/backend.jsonl" 2>"$d/backend.err" &
    bpid="$!"; STARTED+=("$bpid")
    wait_port "$BACKEND" 15
    "${p}_start" "$d"
    sleep 0.5
    log "$p: serving (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    cut -d' ' -f1-3 /proc/loadavg >"$d/loadavg-start.txt"

    # 1. slow upload
    log "$p: 1 MB upload at 100 KB/s"
    t0="$(now)"; rc=0
    code="$(curl -sS -o "$d/upload.out" -w '%{http_code}' --max-time 60 --limit-rate 100K \
        -H 'content-type: application/octet-stream' --data-binary @"$WORK/upload.bin" \
        "http://127.0.0.1:$PLAIN/upload" 2>"$d/upload.err")" || rc=$?
    local up_s; up_s="$(since "$t0")"
    sleep 0.3
    # What the endpoint got, and how long it spent reading it (streamed, or sent whole).
    local got; got="$(grep '"POST"' "$d/backend.jsonl" | tail -1 | python3 -c 'import json,sys; l=sys.stdin.read().strip(); j=json.loads(l) if l else {}; print(j.get("received", 0), j.get("seconds", "null"))')"
    log "$p: upload $code in ${up_s}s (curl exit $rc), endpoint got/read-seconds $got: $(head -c 200 "$d/upload.out" | tr '\n' ' ')"
    printf '{"status": "%s", "seconds": %s, "exit": %s, "backend_bytes": %s, "backend_read_s": %s}\n' \
        "$code" "$up_s" "$rc" "${got% *}" "${got#* }" >"$d/upload.json"

    # 2. event stream
    log "$p: 60 s event stream"
    t0="$(now)"
    set +e
    curl -sS -N --max-time 90 -o - -w '\nHTTP_CODE %{http_code}\n' "http://127.0.0.1:$PLAIN/sse" 2>"$d/sse.err" \
        | python3 "$HELPER" stamp --t0 "$t0" >"$d/sse.txt"
    rc="${PIPESTATUS[0]}"
    set -e
    local sse_s; sse_s="$(since "$t0")"
    code="$(awk '$2 == "HTTP_CODE" { print $3 }' "$d/sse.txt")"
    python3 "$HELPER" sse-summary "$d/sse.txt" >"$d/sse-summary.json"
    python3 - "$d" "$rc" "$sse_s" "${code:-none}" <<'EOF'
import json, sys
d, rc, secs, code = sys.argv[1:]
s = json.load(open(f"{d}/sse-summary.json"))
s.update(exit=int(rc), seconds=float(secs), status=code)
json.dump(s, open(f"{d}/sse.json", "w"))
EOF
    log "$p: sse $(cat "$d/sse.json")"

    # 3. zero window
    log "$p: HTTP/2 zero window, 2 x 100 streams (cap ${CAP}s)"
    python3 "$HELPER" h2zero --port "$H2_PORT" --conns 2 --streams 100 --cap "$CAP" --out "$d/h2zero.json" \
        >"$d/h2zero.txt" 2>&1 || log "$p: h2zero failed: $(tail -3 "$d/h2zero.txt")"
    log "$p: h2zero $(cat "$d/h2zero.txt")"

    cut -d' ' -f1-3 /proc/loadavg >"$d/loadavg-end.txt"
    stop_pid "$PROXY_PID"
    stop_pid "$bpid"
    python3 - "$d" "$p" <<'EOF'
import json, sys
d, p = sys.argv[1:]
z = json.load(open(f"{d}/h2zero.json"))
# The endpoint's side of the zero-window streams: answers it finished writing, and those cut
# (its write failed), with the time (from the start of the input) of the last one.
lines = [json.loads(l) for l in open(f"{d}/backend.jsonl") if '"/body?zero"' in l]
done = [l for l in lines if "sent" in l]
cut = [l for l in lines if "error" in l]
z["backend"] = {"requests": len(lines), "answered": len(done), "cut": len(cut),
                "last_s": round(max(l["t"] for l in lines) - z["t0_epoch"], 2) if lines else None}
json.dump({"proxy": p,
           "upload": json.load(open(f"{d}/upload.json")),
           "sse": json.load(open(f"{d}/sse.json")),
           "h2zero": z},
          open(f"{d}/summary.json", "w"), indent=1)
EOF
}

summaries=()
for p in "${run_list[@]}"; do
    run_proxy "$p"
    summaries+=("$OUT/$p/summary.json")
done
echo
python3 "$HELPER" table "${summaries[@]}" | tee "$OUT/table.md"
echo "results: $OUT (per proxy: summary.json, h2zero.json, sse.txt, backend.jsonl, proxy and error logs)"
