module ferry.local/openapi2jsonschema

go 1.24.0

require sigs.k8s.io/yaml v1.4.0
