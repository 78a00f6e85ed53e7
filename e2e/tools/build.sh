#!/usr/bin/env bash
# Builds the chart tools of Ferry's tests from the Go module proxy, and the JSON schemas that
# kubeconform validates against, without any other download:
#
#   helm         helm.sh/helm/v3/cmd/helm                        (lint, template)
#   kubeconform  github.com/yannh/kubeconform/cmd/kubeconform    (validates rendered manifests)
#   schemas      kubeconform normally downloads its schemas from GitHub, which is out of reach
#                here. They are generated instead, the way openapi2jsonschema does ("standalone",
#                "standalone-strict"), by a small Go program written below:
#                - built-in kinds from the OpenAPI v2 document `api/openapi-spec/swagger.json`
#                  that ships in the k8s.io/kubernetes module, at the version of the control
#                  plane the tests run (e2e/k8s/VERSION): exactly the API the server serves;
#                - ServiceMonitor, PodMonitor and the other monitoring.coreos.com kinds from the
#                  CRDs in the github.com/prometheus-operator/prometheus-operator module
#                  (example/prometheus-operator-crd/), in the layout of the CRDs catalog.
#
# Output, in ${FERRY_CACHE:-~/.cache/ferry}/tools:
#   bin/helm, bin/kubeconform, bin/ferry-openapi2jsonschema
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
# module and build caches): ~2.5 min on 2 cores, nearly all of it helm; ~1.5 GB in the Go caches.
set -euo pipefail

# The pinned versions: the only place they are written.
HELM_VERSION=v3.22.0
KUBECONFORM_VERSION=v0.8.0
PROMETHEUS_OPERATOR_VERSION=v0.85.0 # the newest version of the root module on the proxy
# GitOps CRDs for examples/gitops (Argo CD Application, Flux GitRepository and Kustomization).
ARGOCD_VERSION=v3.5.7
FLUX_KUSTOMIZE_VERSION=v1.10.1
FLUX_SOURCE_VERSION=v1.10.1

here=$(cd "$(dirname "$0")" && pwd)
k8s_version=$(tr -d ' \t\r\n' < "$here/../k8s/VERSION")
cache=${FERRY_CACHE:-$HOME/.cache/ferry}
root="$cache/tools"
bin="$root/bin"
schemas="$root/schemas"
# The stamp also names this script's checksum: editing the schema generator regenerates them
# (helm and kubeconform are only rebuilt when their version changes).
stamp="helm $HELM_VERSION kubeconform $KUBECONFORM_VERSION kubernetes $k8s_version \
prometheus-operator $PROMETHEUS_OPERATOR_VERSION argo-cd $ARGOCD_VERSION \
flux $FLUX_KUSTOMIZE_VERSION/$FLUX_SOURCE_VERSION script $(sha256sum "$here/build.sh" | cut -c1-12)"

complete() {
  [ "$(cat "$root/.complete" 2>/dev/null)" = "$stamp" ] || return 1
  local b
  for b in helm kubeconform ferry-openapi2jsonschema; do [ -x "$bin/$b" ] || return 1; done
  [ -f "$schemas/$k8s_version-standalone-strict/deployment-apps-v1.json" ] &&
    [ -f "$schemas/crds/monitoring.coreos.com/servicemonitor_v1.json" ] &&
    [ -f "$root/crds/monitoring.coreos.com_podmonitors.yaml" ] &&
    [ -f "$root/crds/monitoring.coreos.com_prometheusrules.yaml" ] &&
    [ -f "$root/crds/argoproj.io_applications.yaml" ] &&
    [ -f "$root/crds/kustomize.toolkit.fluxcd.io_kustomizations.yaml" ]
}
complete && exit 0

mkdir -p "$root"
# One build at a time; the second waits, then finds the stamp.
exec 9>"$root/.lock"
if ! flock -n 9; then
  echo "ferry: tools: another build.sh is building them, waiting for it"
  flock 9
fi
complete && exit 0

go=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
if [ ! -x "$go" ]; then
  # Any Go will do: with GOTOOLCHAIN=auto it fetches the release the tools' go.mod ask for.
  echo "ferry: tools: installing Debian's golang-go"
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends golang-go >/dev/null
  go=$(command -v go)
fi
export GOPATH="$cache/go" GOMODCACHE="$cache/go/pkg/mod" GOCACHE="$cache/go/cache"
export GOFLAGS=-mod=mod GOTOOLCHAIN=auto CGO_ENABLED=0 GO111MODULE=on
step() { printf 'ferry: tools: %s\n' "$*"; }
t0=$SECONDS
rm -f "$root/.complete"
mkdir -p "$bin"
step "using $("$go" version | cut -d' ' -f3), caches in $cache/go"

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

if [ "$("$bin/helm" version --template '{{.Version}}' 2>/dev/null)" != "$HELM_VERSION" ]; then
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

if [ "$("$bin/kubeconform" -v 2>/dev/null)" != "$KUBECONFORM_VERSION" ]; then
  go_install kubeconform "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION" \
    "-s -w -X main.version=$KUBECONFORM_VERSION"
fi

# The schema generator: a wrapper module in the cache (sigs.k8s.io/yaml reads the CRDs).
src="$root/openapi2jsonschema"
mkdir -p "$src"
cat > "$src/go.mod" <<'GOMOD'
module ferry.local/openapi2jsonschema

go 1.24.0

require sigs.k8s.io/yaml v1.4.0
GOMOD
cat > "$src/main.go" <<'GOSRC'
// ferry-openapi2jsonschema writes kubeconform's JSON schemas, like openapi2jsonschema:
//
//	ferry-openapi2jsonschema -swagger swagger.json -out DIR/vX.Y.Z   (built-in kinds)
//	ferry-openapi2jsonschema [-swagger swagger.json] -crds DIR crd.yaml...  (custom resources)
//
// Built-in kinds go to DIR/vX.Y.Z-standalone-strict/<kind><suffix>.json and
// DIR/vX.Y.Z-standalone/, named as kubeconform's {{.ResourceKind}}{{.KindSuffix}}; custom
// resources to DIR/<group>/<kind>_<version>.json (always strict), their metadata checked as
// ObjectMeta when -swagger is given. Each file is self-contained: the kind's schema plus, under
// "definitions", every definition it references (so recursive types need no inlining).
//
// Conversions, as the API server sees things: int-or-string accepts both, a Quantity a string
// or a number, an optional field null (an omitted value); strict schemas refuse properties the
// API does not know (additionalProperties: false) except where x-kubernetes-preserve-unknown-
// fields says otherwise; `format` is dropped (draft 4 has no int32, byte, ...).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"
)

type obj = map[string]any

const refPrefix = "#/definitions/"

func main() {
	swaggerPath := flag.String("swagger", "", "Kubernetes OpenAPI v2 document (swagger.json)")
	out := flag.String("out", "", "write built-in kinds to OUT-standalone[-strict]/")
	crdOut := flag.String("crds", "", "write the custom resources of the CRD files given as arguments to this directory")
	flag.Parse()
	var defs obj
	if *swaggerPath != "" {
		raw, err := os.ReadFile(*swaggerPath)
		check(err)
		var doc obj
		check(json.Unmarshal(raw, &doc))
		defs, _ = doc["definitions"].(obj)
		if defs == nil {
			fail("%s has no definitions", *swaggerPath)
		}
	}
	if *out != "" {
		if defs == nil {
			fail("-out needs -swagger")
		}
		n := 0
		for _, strict := range []bool{true, false} {
			dir := *out + "-standalone"
			if strict {
				dir += "-strict"
			}
			check(os.MkdirAll(dir, 0o755))
			n = writeBuiltins(defs, dir, strict)
		}
		fmt.Printf("%d built-in kinds in %s-standalone{,-strict}\n", n, *out)
	}
	if *crdOut != "" {
		n := 0
		for _, file := range flag.Args() {
			n += writeCRDs(defs, file, *crdOut)
		}
		fmt.Printf("%d custom resource versions in %s\n", n, *crdOut)
	}
}

func writeBuiltins(defs obj, dir string, strict bool) int {
	names := make([]string, 0, len(defs))
	for name := range defs {
		names = append(names, name)
	}
	sort.Strings(names)
	written := map[string]bool{}
	for _, name := range names {
		def := defs[name].(obj)
		gvks, _ := def["x-kubernetes-group-version-kind"].([]any)
		if len(gvks) != 1 { // none: not a kind; several: DeleteOptions, WatchEvent
			continue
		}
		gvk := gvks[0].(obj)
		group, version, kind := gvk["group"].(string), gvk["version"].(string), gvk["kind"].(string)
		apiVersion := version
		if group != "" {
			apiVersion = group + "/" + version
		}
		file := filepath.Join(dir, strings.ToLower(kind)+kindSuffix(apiVersion)+".json")
		if written[file] { // kubeconform's name keeps only a group's first label
			continue
		}
		written[file] = true
		c := converter{defs: defs, strict: strict, used: obj{}}
		schema := c.convertNode(def).(obj)
		pinKind(schema, apiVersion, kind)
		schema["definitions"] = c.used
		writeJSON(file, schema)
	}
	return len(written)
}

// kubeconform's {{.KindSuffix}}: "-<first label of the group>-<version>", or "-<version>".
func kindSuffix(apiVersion string) string {
	groupParts := strings.Split(apiVersion, "/")
	suffix := "-" + strings.ToLower(strings.Split(groupParts[0], ".")[0])
	if len(groupParts) > 1 {
		suffix += "-" + strings.ToLower(groupParts[1])
	}
	return suffix
}

func writeCRDs(defs obj, file, dir string) int {
	raw, err := os.ReadFile(file)
	check(err)
	n := 0
	for _, doc := range strings.Split("\n"+string(raw), "\n---") {
		j, err := yaml.YAMLToJSON([]byte(doc))
		check(err)
		var crd obj
		check(json.Unmarshal(j, &crd))
		if crd == nil || crd["kind"] != "CustomResourceDefinition" {
			continue
		}
		spec := crd["spec"].(obj)
		group := spec["group"].(string)
		kind := spec["names"].(obj)["kind"].(string)
		for _, v := range spec["versions"].([]any) {
			version := v.(obj)
			schema, _ := version["schema"].(obj)
			openAPI, _ := schema["openAPIV3Schema"].(obj)
			if openAPI == nil {
				continue
			}
			c := converter{defs: defs, strict: true, used: obj{}}
			out := c.convertNode(openAPI).(obj)
			props, _ := out["properties"].(obj)
			if props == nil {
				props = obj{}
				out["properties"] = props
			}
			if defs != nil {
				props["metadata"] = nullable(c.ref(refPrefix + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"))
			}
			pinKind(out, group+"/"+version["name"].(string), kind)
			if len(c.used) > 0 {
				out["definitions"] = c.used
			}
			path := filepath.Join(dir, group, strings.ToLower(kind)+"_"+version["name"].(string)+".json")
			check(os.MkdirAll(filepath.Dir(path), 0o755))
			writeJSON(path, out)
			n++
		}
	}
	return n
}

// pinKind makes apiVersion and kind accept only this kind's values.
func pinKind(schema obj, apiVersion, kind string) {
	props, _ := schema["properties"].(obj)
	if props == nil {
		return
	}
	props["apiVersion"] = obj{"type": "string", "enum": []any{apiVersion}}
	props["kind"] = obj{"type": "string", "enum": []any{kind}}
}

type converter struct {
	defs   obj
	strict bool
	used   obj // the definitions reached so far, converted
}

// ref returns a $ref to a swagger definition, converting it (and what it reaches) once.
func (c *converter) ref(ref string) obj {
	name := strings.TrimPrefix(ref, refPrefix)
	if _, done := c.used[name]; !done {
		def, ok := c.defs[name].(obj)
		if !ok {
			fail("unknown definition %s", ref)
		}
		c.used[name] = obj{} // placeholder: recursion ends here
		if name == "io.k8s.apimachinery.pkg.api.resource.Quantity" {
			c.used[name] = obj{"oneOf": []any{obj{"type": "string"}, obj{"type": "number"}}}
		} else {
			c.used[name] = c.convertNode(def)
		}
	}
	return obj{"$ref": refPrefix + name}
}

func (c *converter) convertNode(node any) any {
	switch n := node.(type) {
	case []any:
		out := make([]any, len(n))
		for i, v := range n {
			out[i] = c.convertNode(v)
		}
		return out
	case obj:
		if ref, ok := n["$ref"].(string); ok {
			return c.ref(ref)
		}
		if n["format"] == "int-or-string" || n["x-kubernetes-int-or-string"] == true {
			return obj{"oneOf": []any{obj{"type": "string"}, obj{"type": "integer"}}}
		}
		out := obj{}
		for k, v := range n {
			switch {
			case k == "format", strings.HasPrefix(k, "x-kubernetes-"), k == "nullable":
			case k == "properties":
				props := obj{}
				required := map[string]bool{}
				for _, r := range asList(n["required"]) {
					required[r.(string)] = true
				}
				for name, p := range v.(obj) {
					converted := c.convertNode(p)
					if !required[name] {
						converted = nullable(converted.(obj))
					}
					props[name] = converted
				}
				out[k] = props
			case k == "additionalProperties" || k == "items" || k == "not":
				if b, ok := v.(bool); ok {
					out[k] = b
				} else {
					out[k] = c.convertNode(v)
				}
			case k == "allOf" || k == "anyOf" || k == "oneOf":
				out[k] = c.convertNode(v)
			case k == "patternProperties" || k == "definitions":
				m := obj{}
				for name, p := range v.(obj) {
					m[name] = c.convertNode(p)
				}
				out[k] = m
			default:
				out[k] = v
			}
		}
		if n["nullable"] == true {
			out = nullable(out)
		}
		_, hasProps := n["properties"]
		_, hasAdditional := n["additionalProperties"]
		if c.strict && hasProps && !hasAdditional && n["x-kubernetes-preserve-unknown-fields"] != true {
			out["additionalProperties"] = false
		}
		return out
	default:
		return n
	}
}

func asList(v any) []any {
	l, _ := v.([]any)
	return l
}

// nullable also accepts null for a typed field (the API server takes a null optional field as
// omitted).
func nullable(s obj) obj {
	switch t := s["type"].(type) {
	case string:
		if t == "null" {
			return s
		}
		out := obj{}
		for k, v := range s {
			out[k] = v
		}
		out["type"] = []any{t, "null"}
		if enum, ok := s["enum"].([]any); ok {
			out["enum"] = append(append([]any{}, enum...), nil)
		}
		return out
	}
	return s // a $ref, oneOf, ... (as openapi2jsonschema: only typed fields take null)
}

func writeJSON(path string, v any) {
	raw, err := json.MarshalIndent(v, "", "  ")
	check(err)
	check(os.WriteFile(path+".tmp", append(raw, '\n'), 0o644))
	check(os.Rename(path+".tmp", path))
}

func check(err error) {
	if err != nil {
		fail("%v", err)
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "ferry-openapi2jsonschema: "+format+"\n", args...)
	os.Exit(1)
}
GOSRC
(
  cd "$src"
  "$go" mod tidy >tidy.log 2>&1 || { cat tidy.log >&2; exit 1; }
  "$go" build -trimpath -ldflags "-s -w" -o "$bin/ferry-openapi2jsonschema.tmp" .
  mv -f "$bin/ferry-openapi2jsonschema.tmp" "$bin/ferry-openapi2jsonschema"
)

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
gitops_crds=("$argocd_crd" "$flux_kustomization_crd" "$flux_gitrepository_crd")
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
cp -f "$flux_kustomization_crd" "$flux_gitrepository_crd" "$root/crds/"

printf '%s\n' "$stamp" > "$root/.complete"
step "done in $((SECONDS - t0)) s: $bin ($stamp)"
