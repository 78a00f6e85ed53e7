//! The committed CRD YAML is exactly what the Rust types generate.

#[test]
fn committed_crds_match_the_types() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/");
    for (name, yaml) in ferry_operator::crdgen::render().expect("render") {
        let committed = std::fs::read_to_string(format!("{dir}{name}")).unwrap_or_default();
        assert!(
            committed == yaml,
            "crds/{name} is out of date with api/src/crd.rs: run `make crds` (it also writes charts/ferry/crd-files/) and commit the result"
        );
    }
}

#[test]
fn crds_have_what_kubectl_users_rely_on() {
    for (_, crd) in ferry_operator::crdgen::crds() {
        let names = &crd.spec.names;
        assert_eq!(crd.spec.group, "ferry.dev");
        assert_eq!(crd.spec.scope, "Namespaced");
        assert_eq!(
            names.categories.as_deref(),
            Some(&["ferry".to_string()][..])
        );
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(
            version
                .subresources
                .as_ref()
                .is_some_and(|s| s.status.is_some()),
            "status subresource"
        );
        let columns: Vec<&str> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert!(
            columns.contains(&"Ready") && columns.contains(&"Age"),
            "{columns:?}"
        );
    }
}
