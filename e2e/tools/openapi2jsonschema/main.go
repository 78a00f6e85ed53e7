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
