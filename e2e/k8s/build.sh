#!/usr/bin/env bash
# Builds Kubernetes for Ferry's tests from source through the Go module proxy: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and kubelet (the last two for the
# single-node cluster of e2e/cluster/up.sh), at the version pinned in e2e/k8s/VERSION (the only
# place it is written; e2e/src/kube.rs reads the same file).
#
# `k8s.io/kubernetes` cannot be `go install`ed (its go.mod replaces the k8s.io/* staging modules
# with ./staging paths), so this script generates a wrapper module in the cache dir: a go.mod that
# requires k8s.io/kubernetes and replaces every staging module (the list is taken from
# kubernetes' own go.mod in the module cache) with its published v0.Y.Z version, and a tools.go
# (build tag `tools`) importing the commands. etcd is the version kubernetes requires.
#
# Output: ${FERRY_CACHE:-~/.cache/ferry}/k8s-<version>/bin/{etcd,kube-apiserver,
# kube-controller-manager,kube-scheduler,kubelet} plus a `.complete` marker written once all of
# them exist. Each binary is built only if it is missing (written as NAME.tmp, then renamed), so
# adding a command to the list builds just that one. GOPATH, GOMODCACHE and GOCACHE live in
# ${FERRY_CACHE}/go, never in the repo. Idempotent; silent and instant when every binary is there.
# Cold: ~12 min on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(tr -d ' \t\r\n' < "$here/VERSION")
cache=${FERRY_CACHE:-$HOME/.cache/ferry}
root="$cache/k8s-$version"
bin="$root/bin"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet)
pkg_of() {
  case $1 in
    etcd) echo go.etcd.io/etcd/server/v3 ;;
    *) echo "k8s.io/kubernetes/cmd/$1" ;;
  esac
}

missing=()
find_missing() {
  missing=()
  local b
  for b in "${binaries[@]}"; do [ -x "$bin/$b" ] || missing+=("$b"); done
}
# Complete when every binary is there; (re)writes the marker that e2e/src/kube.rs checks.
complete() {
  find_missing
  [ ${#missing[@]} -eq 0 ] || return 1
  [ -f "$bin/.complete" ] || touch "$bin/.complete"
}
complete && exit 0

mkdir -p "$root"
# One build at a time (e.g. two `make test` started together); the second waits, then finds the marker.
exec 9>"$root/.lock"
if ! flock -n 9; then
  echo "ferry: k8s: another build.sh is building $version, waiting for it"
  flock 9
fi
complete && exit 0

# shellcheck source=../go-env.sh
. "$here/../go-env.sh"
ferry_go_env k8s
minor=${version#v1.}; minor=${minor%%.*}
staging_version="v0.${version#v1.}"
work="$root/wrapper"
mkdir -p "$work" "$bin"
step() { printf 'ferry: k8s %s: %s\n' "$version" "$*"; }
t0=$SECONDS

step "using $("$go" version | cut -d' ' -f3), caches in $cache/go"
cd "$work"
cat > go.mod <<GOMOD
module ferry.local/k8s-control-plane

go 1.24.0

require k8s.io/kubernetes $version
GOMOD
step "fetching k8s.io/kubernetes $version go.mod from the module proxy"
kmod=$("$go" mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
[ -f "$kmod" ] || { echo "ferry: k8s: cannot find kubernetes' go.mod (got '$kmod')" >&2; exit 1; }
mapfile -t staging < <(sed -n 's:^[[:space:]]*\(k8s\.io/[^[:space:]]*\) => \./staging/.*:\1:p' "$kmod")
[ ${#staging[@]} -gt 10 ] || { echo "ferry: k8s: no ./staging replace block in $kmod" >&2; exit 1; }
{
  echo
  echo "// Every ./staging replace of kubernetes' go.mod, pointed at the published $staging_version."
  echo "replace ("
  for m in "${staging[@]}"; do echo "	$m => $m $staging_version"; done
  echo ")"
} >> go.mod
{
  echo '//go:build tools'
  echo
  echo '// The commands built by e2e/k8s/build.sh; this file only makes `go mod tidy` keep their deps.'
  echo 'package tools'
  echo
  echo 'import ('
  for b in "${binaries[@]}"; do printf '\t_ "%s"\n' "$(pkg_of "$b")"; done
  echo ')'
} > tools.go
step "go mod tidy (${#staging[@]} staging modules replaced by $staging_version; downloads ~all deps once)"
s=$SECONDS
"$go" mod tidy >tidy.log 2>&1 || { cat tidy.log >&2; exit 1; }
step "  tidy took $((SECONDS - s)) s; etcd $("$go" list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)"

# What kubernetes' hack/lib/version.sh stamps, so `kubectl version` and /version report $version.
vpkg=k8s.io/component-base/version
ldflags="-s -w -X $vpkg.gitVersion=$version -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor \
-X $vpkg.gitTreeState=clean -X $vpkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
build() {
  local name=$1 pkg=$2 s=$SECONDS
  step "building $name ($pkg)"
  "$go" build -trimpath -ldflags "$ldflags" -o "$bin/$name.tmp" "$pkg"
  mv -f "$bin/$name.tmp" "$bin/$name"
  step "  $name built in $((SECONDS - s)) s"
}
step "missing: ${missing[*]}"
for b in "${missing[@]}"; do build "$b" "$(pkg_of "$b")"; done
complete || { echo "ferry: k8s: still missing after the build: ${missing[*]}" >&2; exit 1; }
step "done in $((SECONDS - t0)) s: $bin"
