//! A real control plane with Ferry's CRDs installed, for the operator's tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use ferry_e2e::kube::ControlPlane;

/// Starts etcd, kube-apiserver and kube-controller-manager, installs `crds/`, waits until they
/// are established, and creates `namespace`.
pub fn control_plane_with_crds(namespace: &str) -> ControlPlane {
    let cp = ControlPlane::start().expect("control plane (run e2e/k8s/build.sh once)");
    let crds = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/");
    cp.run_kubectl(["apply", "--server-side", "-f", crds])
        .expect("CRDs install");
    cp.run_kubectl([
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        "crd/forwardingrules.ferry.dev",
        "crd/brokerconnections.ferry.dev",
    ])
    .expect("established");
    cp.run_kubectl(["create", "namespace", namespace])
        .expect("namespace");
    cp
}

/// `kubectl apply` of `yaml`, retried while discovery has not caught up with new CRDs yet.
pub fn apply(cp: &ControlPlane, yaml: &str) {
    let start = Instant::now();
    while let Err(e) = cp.run_kubectl_with_stdin(["apply", "-f", "-"], yaml) {
        assert!(
            start.elapsed() < Duration::from_secs(20)
                && e.to_string().contains("no matches for kind"),
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
