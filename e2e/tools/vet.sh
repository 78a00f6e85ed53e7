#!/usr/bin/env bash
# `make lint` for the Go in this repository (the schema generator): go vet and gofmt, with the
# caches build.sh uses (run after it: `make tools` provides Go and the modules).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../go-env.sh
. "$here/../go-env.sh"
ferry_go_env vet
export GOFLAGS=-mod=readonly
"$go" -C "$here/openapi2jsonschema" vet ./...
unformatted=$("$(dirname "$go")/gofmt" -l "$here/openapi2jsonschema")
[ -z "$unformatted" ] || { echo "gofmt: not formatted: $unformatted" >&2; exit 1; }
