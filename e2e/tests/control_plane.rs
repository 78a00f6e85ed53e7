//! The Kubernetes control plane fixture is real: kube-apiserver serves the built-in API over
//! TLS with the CA the kubeconfig trusts, and kube-controller-manager runs — its garbage
//! collector deletes a dependent once its owner is deleted, and its service-account controller
//! fills new namespaces. Needs `e2e/k8s/build.sh` to have run (it fails, saying so, otherwise).

use std::time::{Duration, Instant};

use ferry_e2e::kube::{ControlPlane, k8s_version};
use ferry_e2e::{WAIT_POLL, wait_until};
use serde_json::Value;

#[test]
fn garbage_collector_deletes_dependents_of_a_deleted_owner() -> anyhow::Result<()> {
    let test_start = Instant::now();
    let mut cp = ControlPlane::start()?;
    let start_time = test_start.elapsed();
    let result = exercise(&cp, test_start, start_time);
    if result.is_err() {
        cp.keep_logs();
    }
    result
}

fn exercise(cp: &ControlPlane, test_start: Instant, start_time: Duration) -> anyhow::Result<()> {
    println!(
        "control plane {} started in {start_time:.1?}: {} (kubeconfig {})",
        k8s_version(),
        cp.server_url(),
        cp.kubeconfig_path().display()
    );
    let kubeconfig = std::fs::read_to_string(cp.kubeconfig_path())?;
    assert!(
        cp.ca_pem().starts_with("-----BEGIN CERTIFICATE-----")
            && kubeconfig.contains("certificate-authority-data:")
            && !kubeconfig.contains("insecure-skip-tls-verify"),
        "the kubeconfig should trust the API server's own CA, not skip TLS verification"
    );

    let version: Value = serde_json::from_str(&cp.run_kubectl(["version", "-o", "json"])?)?;
    assert_eq!(
        version["serverVersion"]["gitVersion"].as_str(),
        Some(k8s_version()),
        "{version}"
    );

    let resources = cp.run_kubectl(["api-resources", "-o", "name"])?;
    for expected in [
        "configmaps",
        "namespaces",
        "customresourcedefinitions.apiextensions.k8s.io",
        "deployments.apps",
        "leases.coordination.k8s.io",
    ] {
        assert!(
            resources.lines().any(|l| l == expected),
            "api-resources lacks {expected}:\n{resources}"
        );
    }

    cp.run_kubectl(["create", "namespace", "t"])?;
    let owner: Value = serde_json::from_str(&cp.run_kubectl([
        "create",
        "configmap",
        "owner",
        "-n",
        "t",
        "--from-literal=role=owner",
        "-o",
        "json",
    ])?)?;
    let uid = owner["metadata"]["uid"]
        .as_str()
        .expect("created ConfigMap has a uid");
    let child = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "namespace": "t",
            "ownerReferences": [{
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": "owner",
                "uid": uid,
            }],
        },
        "data": {"role": "child"},
    });
    cp.run_kubectl_with_stdin(["create", "-f", "-"], &child.to_string())?;
    let got: Value = serde_json::from_str(&cp.run_kubectl([
        "get",
        "configmap",
        "child",
        "-n",
        "t",
        "-o",
        "json",
    ])?)?;
    assert_eq!(got["metadata"]["ownerReferences"][0]["uid"], uid);

    // The service-account controller gives every namespace a `default` ServiceAccount.
    wait_until(
        "serviceaccount t/default",
        Duration::from_secs(30),
        WAIT_POLL,
        || Ok(!get_name(cp, "serviceaccount", "default")?.is_empty()),
    )?;

    // While its owner exists, the garbage collector leaves the child alone.
    assert!(
        !get_name(cp, "configmap", "child")?.is_empty(),
        "child vanished while its owner exists"
    );

    // Default propagation (kubectl: background): the owner goes, then the GC deletes the child.
    let deleted = Instant::now();
    cp.run_kubectl(["delete", "configmap", "owner", "-n", "t", "--wait=true"])?;
    wait_until(
        "the GC to delete configmap t/child",
        Duration::from_secs(30),
        WAIT_POLL,
        || Ok(get_name(cp, "configmap", "child")?.is_empty()),
    )?;
    println!(
        "garbage collector deleted the child {:.1?} after the owner's delete; test took {:.1?} \
         (control plane start {start_time:.1?})",
        deleted.elapsed(),
        test_start.elapsed()
    );
    Ok(())
}

/// `kind/name` in namespace `t`, or "" when it does not exist.
fn get_name(cp: &ControlPlane, kind: &str, name: &str) -> anyhow::Result<String> {
    Ok(cp
        .run_kubectl([
            "get",
            kind,
            name,
            "-n",
            "t",
            "--ignore-not-found",
            "-o",
            "name",
        ])?
        .trim()
        .to_owned())
}
