#!/usr/bin/env bash
# `make lint` for the Go in this repository (the schema generator): go vet and gofmt, with the
# caches build.sh uses (run after it: `make tools` provides Go and the modules).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${FERRY_CACHE:-$HOME/.cache/ferry}
go=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
export GOPATH="$cache/go" GOMODCACHE="$cache/go/pkg/mod" GOCACHE="$cache/go/cache"
export GOFLAGS=-mod=readonly GOTOOLCHAIN=auto CGO_ENABLED=0
"$go" -C "$here/openapi2jsonschema" vet ./...
unformatted=$("$(dirname "$go")/gofmt" -l "$here/openapi2jsonschema")
[ -z "$unformatted" ] || { echo "gofmt: not formatted: $unformatted" >&2; exit 1; }
