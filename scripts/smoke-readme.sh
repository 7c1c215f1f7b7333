#!/usr/bin/env bash
# Runs the README's "Try the proxy" block as written, so that a README command that breaks fails CI.
#
# The block is taken from README.md itself (the first ```sh fence after "## Try the proxy"); each
# command runs in this shell in order. After a command that ends in `&`, the script waits until the
# addresses it names (or, for a command that names none, the addresses in the comment just above it)
# accept connections. Then it checks what the README promises: a 200 with `x-backend`, and the twenty
# parallel requests answered by the backends. Everything started is stopped by PID on exit.
#
# Usage: bash scripts/smoke-readme.sh   (from anywhere; runs in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."

pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

fail() { echo "smoke-readme: FAIL: $*" >&2; [ -n "${out:-}" ] && { echo "--- output:" >&2; cat "$out" "$out.bg" >&2 2>/dev/null; }; exit 1; }

# Lines of the block, with `\` continuations joined.
mapfile -t lines < <(awk '
    /^## Try the proxy/ { section = 1; next }
    section && /^## / { exit }
    section && /^```sh/ { inblock = 1; next }
    section && inblock && /^```/ { exit }
    inblock {
        if (sub(/\\$/, "")) { acc = acc $0; next }
        print acc $0; acc = ""
    }' README.md)
[ "${#lines[@]}" -gt 3 ] || fail "no command block under '## Try the proxy' in README.md"

wait_for() { # host:port ... ; each must accept a TCP connection within 20 s
    local a
    for a in "$@"; do
        local host=${a%:*} port=${a##*:} i
        for i in $(seq 200); do
            if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then continue 2; fi
            sleep 0.1
        done
        fail "nothing listens on $a 20 s after it was started"
    done
}

comment=""
out=$(mktemp)
for line in "${lines[@]}"; do
    trimmed=${line#"${line%%[![:space:]]*}"}
    case "$trimmed" in
        "") continue ;;
        \#*) comment+=" $trimmed"; continue ;;
    esac
    echo "+ $trimmed" >&2
    if [[ "$trimmed" == *"&" && "$trimmed" != *"done"* ]]; then
        eval "${trimmed%&} >>\"$out.bg\" 2>&1 &"
        pids+=("$!")
        mapfile -t addrs < <(grep -oE '127\.0\.0\.1:[0-9]+' <<<"$trimmed" || true)
        [ "${#addrs[@]}" -gt 0 ] || mapfile -t addrs < <(grep -oE '127\.0\.0\.1:[0-9]+' <<<"$comment" || true)
        [ "${#addrs[@]}" -gt 0 ] || fail "cannot tell which address to wait for after: $trimmed"
        wait_for "${addrs[@]}"
    else
        eval "$trimmed" >>"$out" 2>&1 || fail "command failed: $trimmed (output: $(tail -5 "$out"))"
    fi
    comment=""
done

# What the README says these commands show.
grep -q '^HTTP/1.1 200' "$out" || fail "the first curl did not get 200: $(head -5 "$out")"
# (`uniq -c` lines; the first curl's body ends without a newline, so they are not anchored.)
counts=$(grep -oE '[0-9]+ x-backend: b-[0-9]+' "$out" || true)
spread=$(grep -c . <<<"$counts" || true)
total=$(awk '{ s += $1 } END { print s + 0 }' <<<"$counts")
[ "$total" -eq 20 ] || fail "the twenty parallel requests: $total answered with x-backend, not 20"
[ "$spread" -ge 2 ] || fail "the twenty parallel requests all went to one backend"
code=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:9901/status)
[ "$code" = 200 ] || fail "admin /status answered $code"
echo "smoke-readme: ok (first curl 200; 20 parallel requests over $spread backends; admin 200)"
rm -f "$out" "$out.bg"
