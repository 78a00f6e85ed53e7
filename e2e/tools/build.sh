#!/usr/bin/env bash
# Builds the chart tools of Ferry's tests from the Go module proxy, and the JSON schemas that
# kubeconform validates against, without any other download:
#
#   helm         helm.sh/helm/v3/cmd/helm                        (lint, template)
#   kubeconform  github.com/yannh/kubeconform/cmd/kubeconform    (validates rendered manifests)
#   actionlint   github.com/rhysd/actionlint/cmd/actionlint      (lints .github/workflows and,
#                through shellcheck, their scripts: e2e/tools/vet.sh)
#   lychee       the link checker of `make lint` (e2e/tools/linkcheck.sh): a crate, so it is
#                `cargo install`ed (pinned version, `--locked`) from crates.io, not from the Go
#                module proxy. Once: about 9 CPU-minutes (measured 7m49s user + 52s system;
#                23 min of wall time while other builds shared the 2 cores), ~0.9 GB of objects
#                in a temporary target dir that is removed; then cached like the others
#   cargo-nextest  the test runner of `make test` and `make check` (.config/nextest.toml), also
#                `cargo install`ed, pinned and `--locked`, the same way as lychee
#   gungraun-runner  runs the cost benchmark (bench/src/cost, the ferry-cost binary) under callgrind for
#                `make cost`; `cargo install`ed the same way, at the version of the gungraun
#                crate in Cargo.lock (the two must match)
#   schemas      kubeconform normally downloads its schemas from GitHub, which is out of reach
#                here. They are generated instead, the way openapi2jsonschema does ("standalone",
#                "standalone-strict"), by the small Go program in openapi2jsonschema/:
#                - built-in kinds from the OpenAPI v2 document `api/openapi-spec/swagger.json`
#                  that ships in the k8s.io/kubernetes module, at the version of the control
#                  plane the tests run (e2e/k8s/VERSION): exactly the API the server serves;
#                - ServiceMonitor, PodMonitor and the other monitoring.coreos.com kinds from the
#                  CRDs in the github.com/prometheus-operator/prometheus-operator module
#                  (example/prometheus-operator-crd/), in the layout of the CRDs catalog.
#
# Output, in ${FERRY_CACHE:-~/.cache/ferry}/tools:
#   bin/helm, bin/kubeconform, bin/actionlint, bin/ferry-openapi2jsonschema, bin/lychee,
#   bin/cargo-nextest, bin/gungraun-runner
#   schemas/v<k8s>-standalone-strict/<kind>-<group>-<version>.json (and -standalone/)
#   schemas/crds/<group>/<kind>_<version>.json
#   crds/monitoring.coreos.com_{servicemonitors,podmonitors,prometheusrules}.yaml (the CRDs
#   themselves)
# Validate offline with:
#   kubeconform -strict -summary -kubernetes-version <k8s without v> \
#     -schema-location "$S/{{.NormalizedKubernetesVersion}}-standalone{{.StrictSuffix}}/{{.ResourceKind}}{{.KindSuffix}}.json" \
#     -schema-location "$S/crds/{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json"
# (S=${FERRY_CACHE:-~/.cache/ferry}/tools/schemas; operator/tests/chart.rs does exactly that.)
#
# GOPATH, GOMODCACHE and GOCACHE live in ${FERRY_CACHE}/go (shared with e2e/k8s/build.sh).
# Idempotent; silent and instant when the `.complete` stamp names the versions below. Cold (empty
# module and build caches): ~2.5 min on 2 cores, nearly all of it helm; ~1.5 GB in the Go caches;
# lychee's build comes on top (above).
#
# Usage: e2e/tools/build.sh [helm|nextest]
#   no argument  everything above (`make tools`: what `make lint` and `make test` run)
#   helm         only helm (`make demo` needs nothing else)
#   nextest      only cargo-nextest (`make check`)
set -euo pipefail
only=${1:-}
case $only in
  ''|helm|nextest) ;;
  *) echo "ferry: tools: unknown part '$only' (helm, nextest or nothing for all)" >&2; exit 2 ;;
esac

# The pinned versions: the only place they are written.
HELM_VERSION=v3.22.0
KUBECONFORM_VERSION=v0.8.0
ACTIONLINT_VERSION=v1.7.12
LYCHEE_VERSION=0.24.2
NEXTEST_VERSION=0.9.151
# The runner must be the gungraun library's version: read from the lock file, not written twice.
GUNGRAUN_VERSION=$(sed -n '/^name = "gungraun"$/{n;s/^version = "\(.*\)"$/\1/p;}' "$(dirname "$0")/../../Cargo.lock")
[ -n "$GUNGRAUN_VERSION" ] || { echo "ferry: tools: no gungraun in Cargo.lock" >&2; exit 1; }
PROMETHEUS_OPERATOR_VERSION=v0.85.0 # the newest version of the root module on the proxy
# GitOps CRDs for examples/gitops (Argo CD Application, Flux GitRepository and Kustomization,
# External Secrets ExternalSecret).
ARGOCD_VERSION=v3.5.7
FLUX_KUSTOMIZE_VERSION=v1.10.1
FLUX_SOURCE_VERSION=v1.10.1
# The ExternalSecret CRD, for examples/gitops/external-secrets.yaml.
EXTERNAL_SECRETS_VERSION=v1.3.2

here=$(cd "$(dirname "$0")" && pwd)
k8s_version=$(tr -d ' \t\r\n' < "$here/../k8s/VERSION")
cache=${FERRY_CACHE:-$HOME/.cache/ferry}
root="$cache/tools"
bin="$root/bin"
schemas="$root/schemas"
# The stamp also names the checksums of this script and the schema generator: editing either
# regenerates the schemas (helm, kubeconform, actionlint and lychee are only rebuilt when their
# version changes).
stamp="helm $HELM_VERSION kubeconform $KUBECONFORM_VERSION actionlint $ACTIONLINT_VERSION lychee $LYCHEE_VERSION nextest $NEXTEST_VERSION gungraun $GUNGRAUN_VERSION kubernetes $k8s_version \
prometheus-operator $PROMETHEUS_OPERATOR_VERSION argo-cd $ARGOCD_VERSION \
flux $FLUX_KUSTOMIZE_VERSION/$FLUX_SOURCE_VERSION external-secrets $EXTERNAL_SECRETS_VERSION script $(cat "$here/build.sh" "$here"/openapi2jsonschema/{go.mod,go.sum,main.go} | sha256sum | cut -c1-12)"

complete() {
  [ "$(cat "$root/.complete" 2>/dev/null)" = "$stamp" ] || return 1
  local b
  for b in helm kubeconform actionlint ferry-openapi2jsonschema lychee cargo-nextest gungraun-runner; do [ -x "$bin/$b" ] || return 1; done
  [ -f "$schemas/$k8s_version-standalone-strict/deployment-apps-v1.json" ] &&
    [ -f "$schemas/crds/monitoring.coreos.com/servicemonitor_v1.json" ] &&
    [ -f "$root/crds/monitoring.coreos.com_podmonitors.yaml" ] &&
    [ -f "$root/crds/monitoring.coreos.com_prometheusrules.yaml" ] &&
    [ -f "$root/crds/argoproj.io_applications.yaml" ] &&
    [ -f "$root/crds/kustomize.toolkit.fluxcd.io_kustomizations.yaml" ] &&
    [ -f "$root/crds/external-secrets.io_externalsecrets.yaml" ]
}
helm_current() { [ "$("$bin/helm" version --template '{{.Version}}' 2>/dev/null)" = "$HELM_VERSION" ]; }
# Its first line: "cargo-nextest 0.9.151 (<commit> <date>)".
nextest_current() { [ "$("$bin/cargo-nextest" nextest --version 2>/dev/null | head -1 | cut -d' ' -f1-2)" = "cargo-nextest $NEXTEST_VERSION" ]; }
# A part is done when its binary is there at its version; everything, when the stamp says so.
done_already() {
  case $only in
    helm) helm_current ;;
    nextest) nextest_current ;;
    *) complete ;;
  esac
}
done_already && exit 0

mkdir -p "$root"
# One build at a time; the second waits, then finds the stamp.
exec 9>"$root/.lock"
if ! flock -n 9; then
  echo "ferry: tools: another build.sh is building them, waiting for it"
  flock 9
fi
done_already && exit 0

step() { printf 'ferry: tools: %s\n' "$*"; }
mkdir -p "$bin"

# `cargo install` of a pinned crate into a temp root, then moved into bin/: its own target dir,
# removed afterwards (never the workspace's: the Makefile exports CARGO_TARGET_DIR).
cargo_install() {
  local crate=$1 version=$2 binary=$3 s=$SECONDS tmp
  step "building $crate $version (cargo install --locked)"
  tmp=$(mktemp -d "$root/$crate.XXXXXX")
  env -u CARGO_TARGET_DIR -u CARGO_BUILD_BUILD_DIR cargo install "$crate" --version "$version" \
    --locked --root "$tmp/root" --target-dir "$tmp/target" >"$root/$crate.log" 2>&1 ||
    { cat "$root/$crate.log" >&2; rm -rf "$tmp"; exit 1; }
  mv -f "$tmp/root/bin/$binary" "$bin/$binary"
  rm -rf "$tmp"
  step "  $crate built in $((SECONDS - s)) s"
}

if [ "$only" = nextest ]; then
  nextest_current || cargo_install cargo-nextest "$NEXTEST_VERSION" cargo-nextest
  exit 0
fi

# shellcheck source=../go-env.sh
. "$here/../go-env.sh"
ferry_go_env tools
t0=$SECONDS
step "using $("$go" version | cut -d' ' -f3), caches in $cache/go"
[ -z "$only" ] && rm -f "$root/.complete"

# Prints the module's directory in the module cache, downloading it once.
module_dir() {
  local dir
  dir=$("$go" mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -d "$dir" ] || { echo "ferry: tools: cannot download $1" >&2; return 1; }
  printf '%s\n' "$dir"
}

# `go install` into a temp dir, then rename: an interrupted build never leaves a broken binary.
go_install() {
  local name=$1 pkg=$2 ldflags=$3 s=$SECONDS tmp
  step "building $name ($pkg)"
  tmp=$(mktemp -d "$root/gobin.XXXXXX")
  GOBIN="$tmp" "$go" install -trimpath -ldflags "$ldflags" "$pkg" >"$root/$name.log" 2>&1 ||
    { cat "$root/$name.log" >&2; exit 1; }
  mv -f "$tmp/$name" "$bin/$name"
  rmdir "$tmp"
  step "  $name built in $((SECONDS - s)) s"
}

if ! helm_current; then
  # What helm's Makefile stamps: its version, and the Kubernetes version of the client-go it
  # is built with, which `helm template`/`lint` report as .Capabilities.KubeVersion (the
  # default would be v1.20, and charts asking for more would not render).
  helm_dir=$(module_dir "helm.sh/helm/v3@$HELM_VERSION")
  client_go=$(sed -n 's:^[[:space:]]*k8s\.io/client-go v0\.\([0-9]*\)\..*:\1:p' "$helm_dir/go.mod" | head -1)
  [ -n "$client_go" ] || { echo "ferry: tools: no k8s.io/client-go in $helm_dir/go.mod" >&2; exit 1; }
  go_install helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" "-s -w \
-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
-X helm.sh/helm/v3/internal/version.gitTreeState=clean \
-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 \
-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$client_go \
-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$client_go"
fi

[ "$only" = helm ] && exit 0

if [ "$("$bin/kubeconform" -v 2>/dev/null)" != "$KUBECONFORM_VERSION" ]; then
  go_install kubeconform "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION" \
    "-s -w -X main.version=$KUBECONFORM_VERSION"
fi

if [ "$("$bin/actionlint" -version 2>/dev/null | head -1)" != "$ACTIONLINT_VERSION" ]; then
  go_install actionlint "github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION" \
    "-s -w -X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION"
fi

if [ "$("$bin/lychee" --version 2>/dev/null)" != "lychee $LYCHEE_VERSION" ]; then
  cargo_install lychee "$LYCHEE_VERSION" lychee
fi
nextest_current || cargo_install cargo-nextest "$NEXTEST_VERSION" cargo-nextest
if [ "$("$bin/gungraun-runner" --version 2>/dev/null)" != "gungraun-runner $GUNGRAUN_VERSION" ]; then
  cargo_install gungraun-runner "$GUNGRAUN_VERSION" gungraun-runner
fi

# The schema generator: its own Go module beside this script (go.mod and go.sum pinned, so the
# build only reads the repository; its objects go to GOCACHE).
"$go" -C "$here/openapi2jsonschema" build -mod=readonly -trimpath -ldflags "-s -w" \
  -o "$bin/ferry-openapi2jsonschema.tmp" .
mv -f "$bin/ferry-openapi2jsonschema.tmp" "$bin/ferry-openapi2jsonschema"

step "generating JSON schemas for Kubernetes $k8s_version and prometheus-operator $PROMETHEUS_OPERATOR_VERSION"
k8s_dir=$(module_dir "k8s.io/kubernetes@$k8s_version")
swagger="$k8s_dir/api/openapi-spec/swagger.json"
[ -f "$swagger" ] || { echo "ferry: tools: no $swagger" >&2; exit 1; }
promop_dir=$(module_dir "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION")
shopt -s nullglob
promop_crds=("$promop_dir"/example/prometheus-operator-crd/monitoring.coreos.com_*.yaml)
[ ${#promop_crds[@]} -gt 0 ] || { echo "ferry: tools: no CRDs in $promop_dir/example/prometheus-operator-crd" >&2; exit 1; }
argocd_crd="$(module_dir "github.com/argoproj/argo-cd/v3@$ARGOCD_VERSION")/manifests/crds/application-crd.yaml"
flux_kustomization_crd="$(module_dir "github.com/fluxcd/kustomize-controller@$FLUX_KUSTOMIZE_VERSION")/config/crd/bases/kustomize.toolkit.fluxcd.io_kustomizations.yaml"
flux_gitrepository_crd="$(module_dir "github.com/fluxcd/source-controller@$FLUX_SOURCE_VERSION")/config/crd/bases/source.toolkit.fluxcd.io_gitrepositories.yaml"
externalsecret_crd="$(module_dir "github.com/external-secrets/external-secrets@$EXTERNAL_SECRETS_VERSION")/config/crds/bases/external-secrets.io_externalsecrets.yaml"
gitops_crds=("$argocd_crd" "$flux_kustomization_crd" "$flux_gitrepository_crd" "$externalsecret_crd")
for f in "${gitops_crds[@]}"; do
  [ -f "$f" ] || { echo "ferry: tools: no CRD $f" >&2; exit 1; }
done
rm -rf "$schemas.tmp"
mkdir -p "$schemas.tmp/crds"
"$bin/ferry-openapi2jsonschema" -swagger "$swagger" -out "$schemas.tmp/$k8s_version" \
  -crds "$schemas.tmp/crds" "${promop_crds[@]}" "${gitops_crds[@]}" | sed "s|$schemas.tmp|$schemas|; s/^/ferry: tools:   /"
rm -rf "$schemas"
mv "$schemas.tmp" "$schemas"
# The Prometheus Operator CRDs the chart can use, for tests that install it into a real API
# server with its monitors and alerts on.
mkdir -p "$root/crds"
for kind in servicemonitors podmonitors prometheusrules; do
  cp -f "$promop_dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$root/crds/"
done
# And the GitOps ones, for the test that applies examples/gitops.
cp -f "$argocd_crd" "$root/crds/argoproj.io_applications.yaml"
cp -f "$flux_kustomization_crd" "$flux_gitrepository_crd" "$externalsecret_crd" "$root/crds/"

printf '%s\n' "$stamp" > "$root/.complete"
step "done in $((SECONDS - t0)) s: $bin ($stamp)"
