#!/usr/bin/env bash
# Renders a keel lab report in headless Chromium and saves a full-page PNG screenshot, to check
# that the page, its charts and its table display (issue 5). Installs Debian's chromium if
# missing. Usage: scripts/render-report.sh [REPORT_DIR] [OUT.png]
set -euo pipefail
dir=${1:-keel-lab-report}
out=${2:-$dir/screenshot.png}
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
page="file://$(cd "$dir" && pwd)/index.html"
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --hide-scrollbars --window-size=1280,4200 \
  --screenshot="$out" "$page" 2>/dev/null
# The DOM after rendering: the charts and the table must be in it.
dom=$(chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --dump-dom "$page" 2>/dev/null)
svgs=$(grep -o '<svg' <<<"$dom" | wc -l)
rows=$(grep -o '<tr' <<<"$dom" | wc -l)
echo "rendered $page: $svgs charts, $((rows - 1)) table rows, screenshot $out"
[ "$svgs" -ge 1 ] && [ "$rows" -ge 2 ]
