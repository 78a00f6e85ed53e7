#!/usr/bin/env bash
# `make lint` for what is not Rust: the Go of the schema generator (go vet, gofmt), and the
# GitHub Actions workflows (actionlint, with shellcheck on their `run:` scripts). Run after
# e2e/tools/build.sh (`make tools`: Go, the modules, actionlint) and e2e/install.sh (shellcheck).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${FERRY_CACHE:-$HOME/.cache/ferry}
# shellcheck source=../go-env.sh
. "$here/../go-env.sh"
ferry_go_env vet
export GOFLAGS=-mod=readonly
"$go" -C "$here/openapi2jsonschema" vet ./...
unformatted=$("$(dirname "$go")/gofmt" -l "$here/openapi2jsonschema")
[ -z "$unformatted" ] || { echo "gofmt: not formatted: $unformatted" >&2; exit 1; }

actionlint="$cache/tools/bin/actionlint"
[ -x "$actionlint" ] || { echo "ferry: vet: no $actionlint: run bash e2e/tools/build.sh" >&2; exit 1; }
shellcheck=$(command -v shellcheck) ||
  { echo "ferry: vet: no shellcheck (Debian package shellcheck): run bash e2e/install.sh" >&2; exit 1; }
# The linter must still find mistakes, or a clean result below would mean nothing.
if "$actionlint" -shellcheck "$shellcheck" -no-color "$here/testdata/broken-workflow.yml" >/dev/null 2>&1; then
  echo "ferry: vet: actionlint accepted $here/testdata/broken-workflow.yml, which has three mistakes" >&2
  exit 1
fi
(cd "$repo" && "$actionlint" -shellcheck "$shellcheck" .github/workflows/*.yml)
