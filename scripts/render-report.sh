#!/usr/bin/env bash
# Renders a keel lab report in headless Chromium: a full-page PNG screenshot and 1280x1400 tiles
# of it (OUT-tile-NN.png, readable one at a time; cut by Chromium too), plus checks on the DOM
# after rendering: the charts, the table and its verdicts, E6's labelled axis and one E6
# paragraph. Installs Debian's chromium if missing.
#
# Usage: scripts/render-report.sh [REPORT_DIR] [OUT.png]   (default: the newest keel-lab-*/ here)
#   KEEL_SHOT_HEIGHT: height of the screenshot in pixels (default 8400: the whole default report;
#   much taller screenshots came out with misplaced stripes in Chromium 156)
set -euo pipefail
. "$(dirname "$0")/install-lib.sh"
dir=${1:-$(ls -d keel-lab-*/ 2>/dev/null | sort | tail -n 1)}
dir=${dir%/}
[ -n "$dir" ] || { echo "usage: $0 REPORT_DIR [OUT.png]" >&2; exit 2; }
out=${2:-$dir/screenshot.png}
height=${KEEL_SHOT_HEIGHT:-8400}
if ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium
fi
page="file://$(cd "$dir" && pwd)/index.html"
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run
  --disable-background-networking --disable-component-update --disable-sync
  --user-data-dir="$profile" --hide-scrollbars)
chromium "${flags[@]}" --window-size=1280,"$height" --screenshot="$out" "$page" 2>/dev/null
# Tiles: the screenshot shifted up in a 1400-px window, one window per tile.
rm -f "${out%.png}"-tile-*.png
shot="file://$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
tile_page="$profile/tile.html"
tiles=$(( (height + 1399) / 1400 ))
for ((i = 0; i < tiles; i++)); do
  printf '<!doctype html><body style="margin:0"><img src="%s" style="display:block;margin-top:-%dpx">' \
    "$shot" $((i * 1400)) >"$tile_page"
  chromium "${flags[@]}" --allow-file-access-from-files --window-size=1280,1400 \
    --screenshot="$(printf '%s-tile-%02d.png' "${out%.png}" "$i")" "file://$tile_page" 2>/dev/null
done
# The DOM after rendering.
dom=$(chromium "${flags[@]}" --dump-dom "$page" 2>/dev/null)
count() { grep -o "$1" <<<"$dom" | wc -l; }
svgs=$(count '<svg')
rows=$(count '<tr')
ok=$(count '<tr class="ok"')
amber=$(count '<tr class="model-off"')
red=$(count '<tr class="off"')
echo "rendered $page: $svgs charts, $((rows - 1)) table rows ($ok agree, $amber depart from the model" \
  "as the simulation does, $red differ from the simulation), screenshot $out ($tiles tiles)"
[ "$svgs" -ge 1 ] && [ "$rows" -ge 2 ]
if grep -q '<h3>E6</h3>' <<<"$dom"; then
  # E6: a categorical axis with the failure modes, and one paragraph, not one per row.
  for mode in hang fail-fast refuse reset; do
    grep -qzP "\n$mode\n</text>" <<<"$dom" || { echo "E6 chart: no axis label $mode" >&2; exit 1; }
  done
  e6=${dom#*<h3>E6</h3>}
  [[ $e6 != *"<li>"* ]] || { echo "E6 explained row by row" >&2; exit 1; }
fi
