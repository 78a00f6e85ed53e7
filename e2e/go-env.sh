# Sourced by e2e/k8s/build.sh, e2e/tools/build.sh and e2e/tools/vet.sh: finds Go (installs
# Debian's golang-go if there is none) into $go, and keeps every Go cache under
# ${FERRY_CACHE:-~/.cache/ferry}/go, never in the repository or $HOME/go.
# shellcheck shell=bash

# ferry_go_env WHO: WHO names the caller in the messages.
ferry_go_env() {
  local cache=${FERRY_CACHE:-$HOME/.cache/ferry}
  go=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
  if [ ! -x "$go" ]; then
    # Any Go will do: with GOTOOLCHAIN=auto it fetches the release a go.mod asks for from the
    # Go module proxy (into the cache below).
    echo "ferry: $1: installing Debian's golang-go"
    local sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends golang-go >/dev/null
    go=$(command -v go)
  fi
  export GOPATH="$cache/go" GOMODCACHE="$cache/go/pkg/mod" GOCACHE="$cache/go/cache"
  export GOFLAGS=-mod=mod GOTOOLCHAIN=auto CGO_ENABLED=0 GO111MODULE=on
}
