#!/usr/bin/env bash
# `make lint` for the documentation: every relative link of the Markdown pages below must name
# a file or directory of the repository, and every `#anchor` a heading of the page it points to
# (lychee, built by build.sh; run after it). External http(s) links are not checked: this runs
# with no network (`--offline` skips them), so a dead external link goes unnoticed here.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
lychee=${FERRY_CACHE:-$HOME/.cache/ferry}/tools/bin/lychee
[ -x "$lychee" ] || { echo "ferry: linkcheck: no $lychee; run \`make tools\`" >&2; exit 1; }
cd "$repo"
pages=(README.md docs/*.md charts/ferry/README.md CHANGELOG.md SECURITY.md)
exec "$lychee" --offline --include-fragments --no-progress --root-dir "$repo" "${pages[@]}"
