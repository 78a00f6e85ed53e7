//! The binary's contract for bad flags: exit code 2 and the flag and what is wrong with its
//! value named, before it contacts any API server.

use std::process::Command;

/// Runs `ferry-operator` with `args` and `env` and no kubeconfig; (exit code, stderr).
fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-operator"))
        .args(args)
        .envs(env.iter().copied())
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("run ferry-operator");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_bad_forwarder_image_flag_exits_2_naming_the_flag_and_the_problem() {
    let digest = "sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef";
    for (args, env, expected) in [
        (
            vec![
                "--forwarder-image",
                "registry.example.com:5000/Team/ferry-forwarder:1.0",
            ],
            vec![],
            "invalid value 'registry.example.com:5000/Team/ferry-forwarder:1.0' for \
             '--forwarder-image <REFERENCE>': the repository \"Team/ferry-forwarder\" must be \
             lower-case",
        ),
        (
            vec![],
            vec![(
                "FERRY_FORWARDER_IMAGE",
                format!("registry.example.com:5000/team/ferry-forwarder@{digest}"),
            )],
            "for '--forwarder-image <REFERENCE>': the digest \"sha256:0123456789ABCDEF",
        ),
        (
            vec!["--forwarder-image", "registry.example.com:port/ferry"],
            vec![],
            "the registry \"registry.example.com:port\" is not a host name with an optional :port",
        ),
        (
            vec!["--forwarder-image-pull-policy", "Sometimes"],
            vec![],
            "invalid value 'Sometimes' for '--forwarder-image-pull-policy <POLICY>': must be \
             Always, IfNotPresent or Never",
        ),
        (
            vec![],
            vec![(
                "FERRY_FORWARDER_IMAGE_PULL_SECRETS",
                "regcred,Reg_Cred".to_owned(),
            )],
            "invalid value 'Reg_Cred' for '--forwarder-image-pull-secrets <NAMES>'",
        ),
    ] {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (code, stderr) = run(&args, &env);
        assert_eq!(code, Some(2), "{args:?} {env:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?} {env:?}: expected {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn help_lists_the_forwarder_image_and_namespace_flags_with_their_environment_variables() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry-operator"))
        .arg("--help")
        .output()
        .expect("run ferry-operator --help");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    for expected in [
        "--forwarder-image <REFERENCE>",
        "[env: FERRY_FORWARDER_IMAGE=]",
        concat!("[default: ferry-forwarder:", env!("CARGO_PKG_VERSION"), "]"),
        "--forwarder-image-pull-policy <POLICY>",
        "[env: FERRY_FORWARDER_IMAGE_PULL_POLICY=]",
        "--forwarder-image-pull-secrets <NAMES>",
        "[env: FERRY_FORWARDER_IMAGE_PULL_SECRETS=]",
        "--watch-namespaces <NAMESPACES>",
        "[env: FERRY_WATCH_NAMESPACES=]",
    ] {
        assert!(help.contains(expected), "{expected:?} in:\n{help}");
    }
}

#[test]
fn json_logs_are_one_flat_object_per_line() {
    // No API server: the operator logs why it stops, then exits.
    let (code, stderr) = run(&["--log-format", "json"], &[]);
    assert_eq!(code, Some(1), "{stderr}");
    let lines = ferry_e2e::flat_json_log(stderr.lines().filter(|l| l.starts_with('{')))
        .unwrap_or_else(|e| panic!("{e:#}\n{stderr}"));
    let stopping = lines
        .iter()
        .find(|l| l["message"] == "stopping")
        .unwrap_or_else(|| panic!("a top-level message in:\n{stderr}"));
    assert_eq!(stopping["level"], "ERROR");
    assert_eq!(stopping["target"], "ferry_operator");
    assert!(stopping["timestamp"].is_string(), "{stopping}");
    assert!(
        stopping["error"]
            .as_str()
            .is_some_and(|e| e.contains("Kubernetes API")),
        "the event's own field at the top level: {stopping}"
    );
}

#[test]
fn a_bad_watch_namespaces_flag_exits_2_naming_the_flag_and_the_name() {
    for (args, env, expected) in [
        (
            vec!["--watch-namespaces", "plant,Factory"],
            vec![],
            "invalid value 'plant,Factory' for '--watch-namespaces <NAMESPACES>': \"Factory\" \
             is not a namespace name",
        ),
        (
            vec![],
            vec![("FERRY_WATCH_NAMESPACES", "plant,,factory")],
            "for '--watch-namespaces <NAMESPACES>': \"\" is not a namespace name",
        ),
        (
            vec!["--watch-namespaces", "plant_2"],
            vec![],
            "\"plant_2\" is not a namespace name: 1 to 63 lower-case letters, digits and '-'",
        ),
    ] {
        let (code, stderr) = run(&args, &env);
        assert_eq!(code, Some(2), "{args:?} {env:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?} {env:?}: expected {expected:?} in:\n{stderr}"
        );
    }
    // Valid, or empty (every namespace): accepted, and the operator goes on to the API server.
    for (args, env) in [
        (vec!["--watch-namespaces", "plant, factory-2"], vec![]),
        (vec![], vec![("FERRY_WATCH_NAMESPACES", "")]),
    ] {
        let (code, stderr) = run(&args, &env);
        assert_eq!(code, Some(1), "{args:?} {env:?}: {stderr}");
        assert!(
            stderr.contains("cannot reach the Kubernetes API"),
            "{args:?} {env:?}: {stderr}"
        );
    }
}

/// The uninstall hook's command: stopping the operator needs both its Deployment and its pods'
/// selector (waiting on nothing would let a running operator undo the release), and a bad
/// `--watch-namespaces` after the subcommand is refused as before it.
#[test]
fn release_finalizers_refuses_half_an_operator_and_bad_namespaces() {
    let (code, stderr) = run(
        &[
            "release-finalizers",
            "--operator-deployment",
            "ferry-operator",
        ],
        &[],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--operator-selector"), "{stderr}");
    let (code, stderr) = run(&["release-finalizers", "--watch-namespaces", "Plant"], &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--watch-namespaces") && stderr.contains("\"Plant\""),
        "{stderr}"
    );
    // Flags right, no API server: it says so and fails.
    let (code, stderr) = run(&["release-finalizers"], &[]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot reach the Kubernetes API"),
        "{stderr}"
    );
}
