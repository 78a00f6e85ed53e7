//! The Helm chart `charts/ferry`: its CRDs are the generated ones (rendered as templates, with
//! the chart's labels, upgraded by `helm upgrade` and kept by `helm uninstall`), its README's
//! values table is the one `values.yaml` documents, its alerts use only metrics that exist,
//! `helm lint --strict` passes,
//! what it renders is valid Kubernetes for the version the tests run (kubeconform, strict, with
//! schemas generated offline by `e2e/tools/build.sh`), its values schema refuses bad values by
//! name, and, installed into a real API server, its ServiceAccount may do what the operator
//! needs (the operator runs with exactly those rights) and nothing more. Installed with both
//! images from a private registry, the operator pods pull by digest with the pull secrets, and
//! the operator, run with the chart's flags, gives its forwarder pods that image and those
//! secrets.
//!
//! helm and kubeconform come from `bash e2e/tools/build.sh` (`$FERRY_CACHE/tools/bin`); without
//! them these tests fail and say so.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry_e2e::kube::{ControlPlane, Kubectl as _};
use ferry_e2e::manifests::{Connection, Rule};
use ferry_e2e::{WAIT_POLL, wait_until};
use ferry_operator::image::DEFAULT_FORWARDER_IMAGE;
use serde_json::{Value, json};

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/ferry");
const RELEASE: &str = "ferry";
/// What discovery lists on an API server serving ValidatingAdmissionPolicy (GA in 1.30):
/// `helm template` knows only group/versions, so the tests pass it as `--api-versions`.
const VAP_API: &str = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy";
const NAMESPACE: &str = "ferry-system";
/// The ServiceAccount (and Deployment, ClusterRole) of release `ferry` with default names.
const OPERATOR: &str = "ferry-operator";

/// Every optional feature on, and every other value away from its default.
const ALL_OPTIONS: &str = r#"
replicaCount: 3
image: { registry: "", repository: registry.example/ferry/ferry-operator, tag: "0.1.0-rc1", pullPolicy: Always }
imagePullSecrets: [{ name: regcred }]
serviceAccount: { annotations: { team: iot } }
leaderElection: { leaseName: ferry-leader, leaseDurationSeconds: 20 }
watchNamespaces: [plant, factory]
statusIntervalSeconds: 5
logging: { format: text, level: "info,ferry_operator=debug" }
extraEnv: [{ name: RUST_BACKTRACE, value: "1" }]
podAnnotations: { example.com/scrape: "false" }
podLabels: { team: iot }
resources: { requests: { cpu: 100m, memory: 128Mi }, limits: { cpu: 1, memory: 512Mi } }
nodeSelector: { kubernetes.io/os: linux }
tolerations: [{ key: dedicated, operator: Equal, value: ferry, effect: NoSchedule }]
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector: { matchLabels: { app.kubernetes.io/name: ferry } }
priorityClassName: system-cluster-critical
terminationGracePeriodSeconds: 45
service: { port: 9090, annotations: { example.com/owner: iot } }
metrics:
  serviceMonitor: { enabled: true, interval: 15s, scrapeTimeout: 10s, labels: { release: prometheus } }
  podMonitor: { enabled: true, interval: 15s, scrapeTimeout: 10s, labels: { release: prometheus }, namespaces: [plant, factory] }
networkPolicy:
  enabled: true
  metricsFrom: [{ namespaceSelector: { matchLabels: { kubernetes.io/metadata.name: monitoring } } }]
  apiServer: { cidrs: [10.0.0.1/32, "fd00::1/128"], ports: [443, 6443] }
  extraEgress: [{ to: [{ ipBlock: { cidr: 192.0.2.0/24 } }], ports: [{ port: 4318, protocol: TCP }] }]
dashboard: { namespace: monitoring, labels: { grafana_dashboard: "1", team: iot }, annotations: { grafana_folder: Ferry } }
crds: { keep: false }
admissionPolicy: { enabled: true }
uninstall: { releaseFinalizers: true, stopTimeoutSeconds: 60 }
prometheusRule: { enabled: true, namespace: monitoring, labels: { release: prometheus }, alertLabels: { team: iot }, runbookBaseUrl: "https://wiki.example.com/ferry/runbooks", noData: { enabled: true, afterSeconds: 900, rules: "telemetry-.*", namespaces: "plant|factory", excludeRules: "telemetry-nightly", lookback: 12h } }
forwarder:
  networkPolicy: { enabled: true, metricsFrom: [{ namespaceSelector: { matchLabels: { kubernetes.io/metadata.name: monitoring } } }] }
"#;

// ---------------------------------------------------------------------------------------------
// (a) The CRDs

#[test]
fn chart_crds_are_the_generated_ones() {
    let dir = Path::new(CHART).join("crd-files");
    let mut expected = Vec::new();
    for (name, yaml) in ferry_operator::crdgen::render().expect("render") {
        let shipped = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        assert!(
            shipped == yaml,
            "charts/ferry/crd-files/{name} differs from what api/src/crd.rs generates: run \
             `make crds` (it writes crds/ and charts/ferry/crd-files/) and commit the result"
        );
        expected.push(name.to_owned());
    }
    let mut present: Vec<String> = std::fs::read_dir(&dir)
        .expect("charts/ferry/crd-files")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    present.sort();
    expected.sort();
    assert_eq!(
        present, expected,
        "charts/ferry/crd-files holds exactly the generated CRDs"
    );
    assert!(
        !Path::new(CHART).join("crds").exists(),
        "charts/ferry/crds/ is back: Helm would install those CRDs once and never upgrade them"
    );
}

/// The CRDs `helm template` renders: exactly the generated ones plus the chart's labels and,
/// with `crds.keep`, Helm's and Argo CD's keep annotations; none with `crds.enabled=false`.
#[test]
fn rendered_crds_are_the_generated_ones_labelled_and_kept() {
    let generated: BTreeMap<String, Value> = ferry_operator::crdgen::crds()
        .into_iter()
        .map(|(_, crd)| {
            let json = serde_json::to_value(&crd).expect("CRD as JSON");
            (
                json["metadata"]["name"].as_str().expect("name").to_owned(),
                json,
            )
        })
        .collect();
    for (values, keep) in [(&[][..], true), (&["--set", "crds.keep=false"][..], false)] {
        let rendered = template(values);
        let docs = documents(&rendered);
        let crds: Vec<&Value> = docs
            .iter()
            .filter(|d| d["kind"] == "CustomResourceDefinition")
            .collect();
        assert_eq!(crds.len(), generated.len(), "{values:?}");
        for crd in crds {
            let name = crd["metadata"]["name"].as_str().expect("name");
            let mut bare = crd.clone();
            let meta = bare["metadata"].as_object_mut().expect("metadata");
            let labels = meta.remove("labels").unwrap_or_default();
            let annotations = meta.remove("annotations").unwrap_or_default();
            assert_eq!(
                &bare, &generated[name],
                "{name} as rendered, without labels"
            );
            for (label, value) in [
                ("app.kubernetes.io/name", "ferry"),
                ("app.kubernetes.io/instance", RELEASE),
                ("app.kubernetes.io/version", "0.1.0"),
                ("app.kubernetes.io/managed-by", "Helm"),
                ("helm.sh/chart", "ferry-0.1.0"),
            ] {
                assert_eq!(labels[label], value, "{name}: label {label}");
            }
            let policy = &annotations["helm.sh/resource-policy"];
            // Argo CD ignores Helm's policy: without its own options, syncing the chart would
            // prune a CRD that left the desired state, or delete it with the Application, and
            // every BrokerConnection and ForwardingRule with it.
            let argo = &annotations["argocd.argoproj.io/sync-options"];
            if keep {
                assert_eq!(policy, "keep", "{name} with crds.keep");
                let options: Vec<&str> = argo
                    .as_str()
                    .unwrap_or_default()
                    .split(',')
                    .map(str::trim)
                    .collect();
                assert!(
                    options.contains(&"Prune=false") && options.contains(&"Delete=false"),
                    "{name} with crds.keep: Argo CD's sync options {argo}"
                );
            } else {
                assert!(
                    policy.is_null() && argo.is_null(),
                    "{name} with crds.keep=false: {annotations}"
                );
            }
        }
    }
    let without = documents(&template(&["--set", "crds.enabled=false"]));
    assert!(
        !kinds(&without).contains(&"CustomResourceDefinition".to_owned()),
        "crds.enabled=false renders no CRD"
    );
    // The rendered CRDs are valid for the API server's own schema of a CRD.
    let rendered = template(&[]);
    kubeconform(&rendered, documents(&rendered).len());
}

// ---------------------------------------------------------------------------------------------
// (b) helm lint

#[test]
fn helm_lint_strict_passes_with_defaults_and_with_every_option() {
    let values = values_file("lint-all-options", ALL_OPTIONS);
    for extra in [
        vec![],
        vec!["--values".to_owned(), values.display().to_string()],
    ] {
        let mut args = vec![
            "lint".to_owned(),
            "--strict".to_owned(),
            "--kube-version".to_owned(),
            ferry_e2e::kube::k8s_version().to_owned(),
            CHART.to_owned(),
        ];
        args.extend(extra);
        let out = helm(&args, None);
        let text = output_text(&out);
        eprintln!("{text}");
        assert!(
            out.status.success(),
            "helm {} failed:\n{text}",
            args.join(" ")
        );
        assert!(
            text.contains("1 chart(s) linted, 0 chart(s) failed"),
            "helm lint: {text}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (c) What the chart renders, validated by kubeconform

#[test]
fn default_render_is_strictly_valid_and_least_privileged() {
    let rendered = template(&[]);
    let docs = documents(&rendered);
    assert_eq!(
        kinds(&docs),
        [
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "ConfigMap",
            "CustomResourceDefinition",
            "CustomResourceDefinition",
            "Deployment",
            "Job",
            "PodDisruptionBudget",
            "Role",
            "Role",
            "RoleBinding",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "ServiceAccount",
        ],
        "the default install: no monitors and no NetworkPolicy; the uninstall hook"
    );
    // Two replicas: a drain takes one at a time, and they prefer different nodes.
    let pdb = find(&docs, "PodDisruptionBudget", OPERATOR);
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    let spread = &find(&docs, "Deployment", OPERATOR)["spec"]["template"]["spec"]["topologySpreadConstraints"]
        [0];
    assert_eq!(spread["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(spread["whenUnsatisfiable"], "ScheduleAnyway");
    assert_eq!(
        spread["labelSelector"]["matchLabels"],
        find(&docs, "Deployment", OPERATOR)["spec"]["selector"]["matchLabels"],
        "it counts the operator's own pods"
    );
    let single = documents(&template(&[
        "--set",
        "replicaCount=1",
        "--set",
        "leaderElection.enabled=false",
    ]));
    assert!(
        !kinds(&single).contains(&"PodDisruptionBudget".to_owned()),
        "no budget for a single replica (it would block every drain)"
    );
    // Two of the ClusterRoles are the application teams' (aggregated to admin/edit/view).
    for (name, aggregate_to) in [
        ("ferry-edit", vec!["admin", "edit"]),
        ("ferry-view", vec!["view"]),
    ] {
        let labels = &find(&docs, "ClusterRole", name)["metadata"]["labels"];
        for role in aggregate_to {
            assert_eq!(
                labels[format!("rbac.authorization.k8s.io/aggregate-to-{role}")],
                "true",
                "{name} aggregates to {role}"
            );
        }
    }
    kubeconform(&rendered, docs.len());

    // The operator Deployment: what the brief of the image and the operator's flags ask for.
    let deployment = find(&docs, "Deployment", OPERATOR);
    assert_eq!(deployment["metadata"]["namespace"], NAMESPACE);
    assert_eq!(deployment["spec"]["replicas"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], OPERATOR);
    let container = &pod["containers"][0];
    // The project's registry path, tagged with the chart's appVersion.
    assert_eq!(container["image"], "ghcr.io/ferry-dev/ferry-operator:0.1.0");
    let sc = &container["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["ports"][0]["containerPort"], 8080);
    assert_eq!(container["ports"][0]["name"], "http-metrics");
    let env: BTreeMap<String, Value> = container["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (e["name"].as_str().expect("name").to_owned(), e.clone()))
        .collect();
    for (name, field) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        assert_eq!(
            env[name]["valueFrom"]["fieldRef"]["fieldPath"], field,
            "{name}"
        );
    }
    for (name, value) in [
        ("FERRY_OPERATOR_LISTEN", "0.0.0.0:8080"),
        ("FERRY_LEADER_ELECT", "true"),
        ("FERRY_LEASE_NAME", "ferry-operator"),
        ("FERRY_LEASE_DURATION_SECONDS", "15"),
        ("FERRY_STATUS_INTERVAL_SECONDS", "10"),
        ("FERRY_STATUS_WRITE_INTERVAL_SECONDS", "60"),
        ("FERRY_STATUS_WRITES_PER_SECOND", "20"),
        ("FERRY_LOG_FORMAT", "json"),
        ("FERRY_LOG", "info"),
        // The operator's own default: a chart and an operator run alone name the same image.
        ("FERRY_FORWARDER_IMAGE", DEFAULT_FORWARDER_IMAGE),
        ("FERRY_FORWARDER_IMAGE_PULL_POLICY", "IfNotPresent"),
    ] {
        assert_eq!(env[name]["value"], value, "{name}");
    }
    assert!(
        !env.contains_key("FERRY_FORWARDER_IMAGE_PULL_SECRETS")
            && pod["imagePullSecrets"].is_null(),
        "no pull secrets by default"
    );
    assert!(
        !env.contains_key("FERRY_WATCH_NAMESPACES"),
        "every namespace by default"
    );

    let service = find(&docs, "Service", "ferry-operator-metrics");
    assert_eq!(service["spec"]["ports"][0]["name"], "http-metrics");
    assert_eq!(service["spec"]["ports"][0]["port"], 8080);

    // RBAC: no wildcards, no pod writes, no RBAC or node access; leases only in the Role.
    let cluster_role = find(&docs, "ClusterRole", OPERATOR);
    for rule in cluster_role["rules"].as_array().expect("rules") {
        let list = |key: &str| -> Vec<String> {
            rule[key]
                .as_array()
                .expect(key)
                .iter()
                .map(|v| v.as_str().expect("string").to_owned())
                .collect()
        };
        let (groups, resources, verbs) = (list("apiGroups"), list("resources"), list("verbs"));
        assert!(
            !groups
                .iter()
                .chain(&resources)
                .chain(&verbs)
                .any(|s| s.contains('*')),
            "no wildcards: {rule}"
        );
        assert!(
            !verbs
                .iter()
                .any(|v| ["escalate", "bind", "impersonate", "deletecollection"]
                    .contains(&v.as_str())),
            "{rule}"
        );
        assert!(
            !groups
                .iter()
                .any(|g| g == "rbac.authorization.k8s.io" || g == "coordination.k8s.io"),
            "{rule}"
        );
        if resources.iter().any(|r| r == "pods") {
            assert_eq!(verbs, ["list", "watch"], "pods are only read: {rule}");
        }
    }
    let role = find(&docs, "Role", "ferry-operator-leader-election");
    assert_eq!(role["metadata"]["namespace"], NAMESPACE);
    assert_eq!(role["rules"][0]["resources"], serde_json::json!(["leases"]));

    // Every RBAC rule says why (a comment line right above each `- apiGroups:`).
    let rbac_source =
        std::fs::read_to_string(Path::new(CHART).join("templates/rbac.yaml")).expect("rbac.yaml");
    let lines: Vec<&str> = rbac_source.lines().collect();
    let mut rules = 0;
    for (i, line) in lines.iter().enumerate() {
        if line.trim_start().starts_with("- apiGroups:") {
            rules += 1;
            assert!(
                i > 0 && lines[i - 1].trim_start().starts_with('#'),
                "templates/rbac.yaml line {}: a rule without a comment saying why",
                i + 1
            );
        }
    }
    assert!(rules >= 10, "{rules} rules found in templates/rbac.yaml");

    // The dashboard: labelled for the Grafana sidecar, valid JSON, only metrics that exist.
    let dashboard = find(&docs, "ConfigMap", "ferry-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value = serde_json::from_str(
        dashboard["data"]["ferry.json"]
            .as_str()
            .expect("data ferry.json"),
    )
    .expect("the dashboard is JSON");
    check_dashboard_metrics(&json);
}

#[test]
fn render_with_every_option_is_strictly_valid() {
    let values = values_file("all-options", ALL_OPTIONS);
    let rendered = template(&[
        "--values",
        &values.display().to_string(),
        "--api-versions",
        VAP_API,
    ]);
    let docs = documents(&rendered);
    let kinds = kinds(&docs);
    for kind in [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "Job",
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
        "CustomResourceDefinition",
        "NetworkPolicy",
        "Deployment",
        "ConfigMap",
    ] {
        assert!(kinds.contains(&kind.to_owned()), "{kind} in {kinds:?}");
    }
    kubeconform(&rendered, docs.len());

    let deployment = find(&docs, "Deployment", OPERATOR);
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        "registry.example/ferry/ferry-operator:0.1.0-rc1"
    );
    let dashboard = find(&docs, "ConfigMap", "ferry-dashboard");
    assert_eq!(dashboard["metadata"]["namespace"], "monitoring");
    let rule = find(&docs, "PrometheusRule", "ferry");
    assert_eq!(rule["metadata"]["namespace"], "monitoring");
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    let alerts = alert_rules(&docs);
    assert!(
        alerts.iter().all(|a| a["labels"]["team"] == "iot"),
        "alertLabels on every alert: {alerts:?}"
    );
    assert!(
        docs.iter()
            .filter(|d| d["kind"] == "CustomResourceDefinition")
            .all(|d| d["metadata"]["annotations"].is_null()),
        "crds.keep=false: neither Helm's nor Argo CD's keep annotation"
    );
    let pod_monitor = find(&docs, "PodMonitor", "ferry-forwarders");
    assert_eq!(
        pod_monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        "ferry-forwarder"
    );
    assert_eq!(
        pod_monitor["spec"]["podMetricsEndpoints"][0]["port"],
        "http"
    );
    let policy = find(&docs, "NetworkPolicy", OPERATOR);
    assert_eq!(policy["spec"]["ingress"][0]["ports"][0]["port"], 8080);
    let egress = policy["spec"]["egress"].as_array().expect("egress");
    assert_eq!(
        egress.len(),
        4,
        "API server, forwarders, DNS, the extra rule: {egress:?}"
    );
    assert_eq!(egress[0]["to"][0]["ipBlock"]["cidr"], "10.0.0.1/32");
    assert_eq!(
        egress[1]["to"][0]["namespaceSelector"]["matchExpressions"][0]["values"],
        serde_json::json!(["plant", "factory"]),
        "forwarders' /status only in the watched namespaces"
    );
    for ns in ["plant", "factory"] {
        assert!(
            docs.iter().any(|d| d["kind"] == "Role"
                && d["metadata"]["name"] == OPERATOR
                && d["metadata"]["namespace"] == ns),
            "a Role in {ns}"
        );
    }
    // forwarder.networkPolicy: the operator's flags (its own pods' labels, the metrics
    // sources as JSON) and the rights on NetworkPolicies where it renders forwarders.
    let env = &deployment["spec"]["template"]["spec"]["containers"][0]["env"];
    let var = |name: &str| {
        env.as_array()
            .expect("env")
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{name} in {env}"))
            .to_owned()
    };
    assert_eq!(var("FERRY_FORWARDER_NETWORK_POLICY"), "true");
    let selector = &deployment["spec"]["selector"]["matchLabels"];
    let labels: BTreeMap<String, String> = var("FERRY_OPERATOR_POD_LABELS")
        .split(',')
        .map(|kv| kv.split_once('=').expect("key=value"))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    assert_eq!(
        serde_json::to_value(&labels).expect("JSON"),
        *selector,
        "the operator pods' own selector"
    );
    let metrics: Value = serde_json::from_str(&var("FERRY_FORWARDER_METRICS_FROM")).expect("JSON");
    assert_eq!(
        metrics[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "monitoring"
    );
    let role = docs
        .iter()
        .find(|d| d["kind"] == "Role" && d["metadata"]["namespace"] == "plant")
        .expect("a Role in plant");
    assert!(
        role["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .any(|r| r["resources"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|x| x == "networkpolicies"))),
        "{role}"
    );
}

/// Namespace mode: the operator's rules in a Role per watched namespace, nothing cluster-wide,
/// and the flag that keeps the operator inside them.
#[test]
fn watch_namespaces_renders_a_role_per_namespace_instead_of_the_cluster_role() {
    let values = values_file(
        "watch-namespaces",
        "watchNamespaces: [plant, factory]\nmetrics: { podMonitor: { enabled: true } }\n",
    );
    let rendered = template(&["--values", &values.display().to_string()]);
    let docs = documents(&rendered);
    // The uninstall hook's objects, which exist only while it runs, are checked apart.
    let installed: Vec<Value> = docs.iter().filter(|d| !is_hook(d)).cloned().collect();
    assert_eq!(
        kinds(&installed),
        [
            "ClusterRole",
            "ClusterRole",
            "ConfigMap",
            "CustomResourceDefinition",
            "CustomResourceDefinition",
            "Deployment",
            "PodDisruptionBudget",
            "PodMonitor",
            "Role",
            "Role",
            "Role",
            "RoleBinding",
            "RoleBinding",
            "RoleBinding",
            "Service",
            "ServiceAccount",
        ],
        "the operator's rights in Roles only: no ClusterRoleBinding"
    );
    let cluster_roles: Vec<&str> = docs
        .iter()
        .filter(|d| d["kind"] == "ClusterRole")
        .filter_map(|d| d["metadata"]["name"].as_str())
        .collect();
    assert_eq!(
        cluster_roles,
        ["ferry-edit", "ferry-view"],
        "only the application teams' aggregated roles are cluster-wide"
    );
    kubeconform(&rendered, docs.len());

    let cluster_wide = documents(&template(&[]));
    let cluster_rules = &find(&cluster_wide, "ClusterRole", OPERATOR)["rules"];
    for ns in ["plant", "factory"] {
        let in_ns = |kind: &str| {
            docs.iter()
                .find(|d| {
                    d["kind"] == kind
                        && d["metadata"]["name"] == OPERATOR
                        && d["metadata"]["namespace"] == ns
                })
                .unwrap_or_else(|| panic!("no {kind} {OPERATOR} in {ns}"))
        };
        assert_eq!(
            &in_ns("Role")["rules"],
            cluster_rules,
            "the same rules as the ClusterRole, in {ns}"
        );
        let binding = in_ns("RoleBinding");
        assert_eq!(
            binding["roleRef"],
            serde_json::json!({
                "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": OPERATOR
            })
        );
        assert_eq!(
            binding["subjects"],
            serde_json::json!([
                { "kind": "ServiceAccount", "name": OPERATOR, "namespace": NAMESPACE }
            ])
        );
    }
    let lease_role = find(&docs, "Role", "ferry-operator-leader-election");
    assert_eq!(lease_role["metadata"]["namespace"], NAMESPACE);

    let env =
        &find(&docs, "Deployment", OPERATOR)["spec"]["template"]["spec"]["containers"][0]["env"];
    let watch = env
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "FERRY_WATCH_NAMESPACES")
        .expect("FERRY_WATCH_NAMESPACES");
    assert_eq!(watch["value"], "plant,factory");
    assert_eq!(
        find(&docs, "PodMonitor", "ferry-forwarders")["spec"]["namespaceSelector"],
        serde_json::json!({ "matchNames": ["plant", "factory"] }),
        "forwarders scraped where they can be"
    );
}

#[test]
fn kubeconform_rejects_what_the_api_server_would() {
    // The schemas are strict: a misspelt field and a wrong type are both found, with their path.
    let bad = template(&[])
        .replacen(
            "readOnlyRootFilesystem: true",
            "readOnlyRootFilesytem: true",
            1,
        )
        .replacen("containerPort: 8080", "containerPort: \"8080\"", 1);
    let out = run(kubeconform_command(), Some(&bad));
    let text = output_text(&out);
    eprintln!("{text}");
    assert!(!out.status.success(), "kubeconform accepted:\n{bad}");
    assert!(
        text.contains("additional properties 'readOnlyRootFilesytem' not allowed")
            && text.contains("containerPort': got string, want integer"),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------------
// (d) values.schema.json

#[test]
fn values_schema_refuses_bad_values_by_name() {
    for (set, message) in [
        (
            "replicaCount=two",
            "at '/replicaCount': got string, want integer",
        ),
        ("replicas=2", "additional properties 'replicas' not allowed"),
        (
            "logging.format=xml",
            "at '/logging/format': value must be one of 'json', 'text'",
        ),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
        ("image.digest=sha256:abc", "at '/image/digest'"),
        (
            "image.registry=https://registry.example",
            "at '/image/registry'",
        ),
        ("forwarder.image.tag=.1", "at '/forwarder/image/tag'"),
        (
            "forwarder.image.pullPolicy=Sometimes",
            "at '/forwarder/image/pullPolicy'",
        ),
        (
            "forwarder.replicas=2",
            "additional properties 'replicas' not allowed",
        ),
        (
            "imagePullSecrets[0].name=Reg_Cred",
            "at '/imagePullSecrets/0/name'",
        ),
        ("service.port=0", "at '/service/port'"),
        (
            "metrics.serviceMonitor.interval=soon",
            "at '/metrics/serviceMonitor/interval'",
        ),
        (
            "networkPolicy.apiServer.cidrs={10.0.0.1}",
            "at '/networkPolicy/apiServer/cidrs/0'",
        ),
        (
            "dashboard.enable=true",
            "additional properties 'enable' not allowed",
        ),
        ("watchNamespaces={plant,Factory}", "at '/watchNamespaces/1'"),
        (
            "watchNamespaces={plant,plant}",
            "at '/watchNamespaces': items at 0 and 1 are equal",
        ),
        (
            "watchNamespaces=plant",
            "at '/watchNamespaces': got string, want array",
        ),
        (
            "leaderElection.enabled=false",
            "replicaCount > 1 needs leaderElection.enabled",
        ),
    ] {
        let out = helm(
            &[
                "template",
                RELEASE,
                CHART,
                "--namespace",
                NAMESPACE,
                "--set",
                set,
            ],
            None,
        );
        let text = output_text(&out);
        assert!(!out.status.success(), "--set {set} was accepted");
        assert!(
            text.contains(message),
            "--set {set}: expected {message:?} in:\n{text}"
        );
    }
    // One replica without leader election is fine.
    let out = helm(
        &[
            "template",
            RELEASE,
            CHART,
            "--set",
            "leaderElection.enabled=false,replicaCount=1",
        ],
        None,
    );
    assert!(out.status.success(), "{}", output_text(&out));
}

// ---------------------------------------------------------------------------------------------
// (e) Private registries

const OPERATOR_DIGEST: &str =
    "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// Both images from a private registry with a port, the operator's pinned by digest, and two
/// pull secrets.
const PRIVATE_REGISTRY: &str = r#"
image:
  registry: "registry.example.com:5000"
  repository: team/ferry-operator
  tag: "ignored-when-a-digest-is-set"
  digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
imagePullSecrets: [{ name: regcred }, { name: team-cred }]
forwarder:
  image:
    registry: "registry.example.com:5000"
    repository: team/ferry-forwarder
    tag: "0.1.0-hardened"
    pullPolicy: Always
"#;

#[test]
fn a_private_registry_install_pulls_the_operator_and_hands_the_forwarder_image_to_it() {
    let values = values_file("private-registry", PRIVATE_REGISTRY);
    let values = values.display().to_string();
    let rendered = template(&["--values", &values]);
    let docs = documents(&rendered);
    kubeconform(&rendered, docs.len());
    let deployment = find(&docs, "Deployment", OPERATOR);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(
        pod["containers"][0]["image"],
        format!("registry.example.com:5000/team/ferry-operator@{OPERATOR_DIGEST}"),
        "the digest pins the image; the tag is not used"
    );
    assert_eq!(
        pod["imagePullSecrets"],
        serde_json::json!([{ "name": "regcred" }, { "name": "team-cred" }])
    );
    // The operator's flags as the chart sets them (each flag is also an environment variable).
    let flags: BTreeMap<String, String> = pod["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_owned(),
                e["value"].as_str()?.to_owned(),
            ))
        })
        .collect();
    let forwarder = "registry.example.com:5000/team/ferry-forwarder:0.1.0-hardened";
    for (name, value) in [
        ("FERRY_FORWARDER_IMAGE", forwarder),
        ("FERRY_FORWARDER_IMAGE_PULL_POLICY", "Always"),
        ("FERRY_FORWARDER_IMAGE_PULL_SECRETS", "regcred,team-cred"),
    ] {
        assert_eq!(flags.get(name).map(String::as_str), Some(value), "{name}");
    }

    // Installed: the API server takes the Deployment as rendered.
    let cp = ControlPlane::start().expect("control plane (run `bash e2e/k8s/build.sh` once)");
    for ns in [NAMESPACE, "plant"] {
        cp.run_kubectl(["create", "namespace", ns])
            .expect("namespace");
    }
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let text = helm_install(&cp, &["--values", &values]);
    assert!(
        text.contains(&format!(
            "Forwarder pods run {forwarder} (pull secrets regcred, team-cred"
        )),
        "NOTES name the forwarder image:\n{text}"
    );
    let installed = |path: &str| {
        cp.jsonpath("deployment", OPERATOR, NAMESPACE, path)
            .unwrap_or_default()
    };
    assert_eq!(
        installed("{.spec.template.spec.containers[0].image}"),
        format!("registry.example.com:5000/team/ferry-operator@{OPERATOR_DIGEST}")
    );
    assert_eq!(
        installed("{.spec.template.spec.imagePullSecrets[*].name}"),
        "regcred team-cred"
    );

    // The operator with exactly the chart's flags gives a connection's forwarders that image.
    let port = ferry_e2e::free_port().expect("port");
    let log = cp.dir().join("private-registry-operator.log");
    let _operator = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_ferry-operator"))
            .envs(&flags)
            .env("FERRY_OPERATOR_LISTEN", format!("127.0.0.1:{port}"))
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAME", "ferry-operator-test")
            .env("POD_NAMESPACE", NAMESPACE)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn ferry-operator"),
    );
    cp.run_kubectl_with_stdin(
        ["apply", "-n", "plant", "-f", "-"],
        &(Connection::svc("plant", "plant").yaml() + &telemetry_rule().yaml()),
    )
    .expect("apply a connection and a rule");
    let forwarder_pods = |path: &str| {
        cp.jsonpath("statefulset", "plant-default", "plant", path)
            .unwrap_or_default()
    };
    let operator_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let started = Instant::now();
    while forwarder_pods("{.metadata.name}").is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no forwarder StatefulSet within 60 s:\n{}",
            operator_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        (
            forwarder_pods("{.spec.template.spec.containers[0].image}"),
            forwarder_pods("{.spec.template.spec.containers[0].imagePullPolicy}"),
            forwarder_pods("{.spec.template.spec.imagePullSecrets[*].name}"),
        ),
        (
            forwarder.to_owned(),
            "Always".to_owned(),
            "regcred team-cred".to_owned()
        ),
        "{}",
        operator_log()
    );
}

// ---------------------------------------------------------------------------------------------
// (f) Installed into a real API server

#[test]
fn installed_chart_gives_the_operator_exactly_the_rights_it_uses() {
    let cp = ControlPlane::start().expect("control plane (run `bash e2e/k8s/build.sh` once)");
    // The Prometheus Operator CRDs, so the monitors install too.
    let monitoring_crds = tools_dir().join("crds");
    assert!(
        monitoring_crds
            .join("monitoring.coreos.com_podmonitors.yaml")
            .is_file(),
        "{} is missing: run `bash e2e/tools/build.sh`",
        monitoring_crds.display()
    );
    for (file, name) in [
        (
            "monitoring.coreos.com_servicemonitors.yaml",
            "servicemonitors.monitoring.coreos.com",
        ),
        (
            "monitoring.coreos.com_podmonitors.yaml",
            "podmonitors.monitoring.coreos.com",
        ),
        (
            "monitoring.coreos.com_prometheusrules.yaml",
            "prometheusrules.monitoring.coreos.com",
        ),
    ] {
        assert!(
            monitoring_crds.join(file).is_file(),
            "{file} is missing: run `bash e2e/tools/build.sh`"
        );
        cp.install_crds(&monitoring_crds.join(file), &[name])
            .unwrap_or_else(|e| panic!("install {file}: {e}"));
    }
    // The release namespace enforces the `restricted` Pod Security Standard: the operator pods
    // are only created if their security context meets it.
    for ns in [NAMESPACE, "monitoring", "plant"] {
        cp.run_kubectl(["create", "namespace", ns])
            .expect("namespace");
    }
    cp.run_kubectl([
        "label",
        "namespace",
        NAMESPACE,
        "pod-security.kubernetes.io/enforce=restricted",
    ])
    .expect("label");

    // helm install, every option on (the NetworkPolicy, monitors, dashboard elsewhere).
    let values = values_file(
        "installed",
        "metrics: { serviceMonitor: { enabled: true }, podMonitor: { enabled: true } }\n\
         prometheusRule: { enabled: true }\n\
         networkPolicy: { enabled: true }\n\
         dashboard: { namespace: monitoring }\n",
    );
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let text = helm_install(&cp, &["--values", &values.display().to_string()]);
    assert!(
        text.contains("kubectl apply -n <ns> -f examples/kubernetes/")
            && text.contains("kubectl get -n <ns> brokerconnections,fr"),
        "NOTES say how to apply the examples:\n{text}"
    );
    assert!(!text.contains("would violate PodSecurity"), "{text}");
    for crd in ["forwardingrules.ferry.dev", "brokerconnections.ferry.dev"] {
        cp.run_kubectl(["get", "crd", crd])
            .expect("helm installed the CRDs");
    }
    for (kind, ns, name) in [
        ("servicemonitor", NAMESPACE, OPERATOR),
        ("podmonitor", NAMESPACE, "ferry-forwarders"),
        ("prometheusrule", NAMESPACE, "ferry"),
        ("networkpolicy", NAMESPACE, OPERATOR),
        ("configmap", "monitoring", "ferry-dashboard"),
    ] {
        cp.run_kubectl(["get", kind, name, "-n", ns])
            .unwrap_or_else(|e| panic!("{kind} {ns}/{name}: {e}"));
    }
    // Two operator pods, admitted under `restricted` (no kubelet here: they stay Pending).
    wait_until(
        "the Deployment's 2 pods",
        Duration::from_secs(60),
        WAIT_POLL,
        || {
            cp.run_kubectl([
                "get",
                "pods",
                "-n",
                NAMESPACE,
                "-l",
                "app.kubernetes.io/name=ferry",
                "-o",
                "name",
            ])
            .is_ok_and(|o| o.lines().count() == 2)
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));

    // What the ServiceAccount may and may not do.
    let sa = format!("system:serviceaccount:{NAMESPACE}:{OPERATOR}");
    let can = |args: &[&str]| -> bool {
        let mut all = vec!["auth", "can-i", "--as", &sa];
        all.extend_from_slice(args);
        let out = cp.kubectl(&all).output().expect("kubectl auth can-i");
        match String::from_utf8_lossy(&out.stdout).trim() {
            "yes" => true,
            "no" => false,
            other => panic!(
                "kubectl auth can-i {args:?}: {other} {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    };
    for args in [
        &["watch", "forwardingrules.ferry.dev", "--all-namespaces"][..],
        &["list", "brokerconnections.ferry.dev", "--all-namespaces"],
        &[
            "patch",
            "forwardingrules.ferry.dev",
            "--subresource=status",
            "-n",
            "plant",
        ],
        &[
            "update",
            "brokerconnections.ferry.dev",
            "--subresource=status",
            "-n",
            "plant",
        ],
        &["patch", "brokerconnections.ferry.dev", "-n", "plant"],
        &["create", "statefulsets.apps", "-n", "plant"],
        &["delete", "statefulsets.apps", "-n", "plant"],
        &["patch", "configmaps", "-n", "plant"],
        &["create", "services", "-n", "plant"],
        &["create", "poddisruptionbudgets.policy", "-n", "plant"],
        &["get", "secrets", "-n", "plant"],
        &["watch", "secrets", "--all-namespaces"],
        &["create", "secrets", "-n", "plant"],
        &["watch", "pods", "--all-namespaces"],
        &["create", "events.events.k8s.io", "-n", "plant"],
        &["update", "leases.coordination.k8s.io", "-n", NAMESPACE],
        &["create", "leases.coordination.k8s.io", "-n", NAMESPACE],
    ] {
        assert!(can(args), "the operator needs: {args:?}");
    }
    for args in [
        &["delete", "pods", "-n", "plant"][..],
        &["create", "pods", "-n", "plant"],
        &["create", "pods/exec", "-n", "plant"],
        &["update", "forwardingrules.ferry.dev", "-n", "plant"],
        &["delete", "brokerconnections.ferry.dev", "-n", "plant"],
        &["create", "deployments.apps", "-n", "plant"],
        // Only with forwarder.networkPolicy.enabled.
        &["create", "networkpolicies.networking.k8s.io", "-n", "plant"],
        &["create", "clusterroles.rbac.authorization.k8s.io"],
        &[
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            "-n",
            "plant",
        ],
        &["get", "nodes"],
        &["create", "leases.coordination.k8s.io", "-n", "plant"],
        &["deletecollection", "secrets", "-n", "plant"],
        &["create", "customresourcedefinitions.apiextensions.k8s.io"],
    ] {
        assert!(!can(args), "the operator must not be allowed: {args:?}");
    }

    // The operator itself, with the ServiceAccount's token and nothing else: it takes the
    // Lease, renders a connection's forwarders and writes statuses without a single refusal.
    let mut operator = SaOperator::start(
        &cp,
        "chart-operator",
        &[("FERRY_LEASE_NAME", "ferry-operator")],
    );
    let port = operator.port;
    let operator_log = operator.log_reader();
    let secret = r#"
apiVersion: v1
kind: Secret
metadata: { name: mqtt-credentials, labels: { ferry.dev/broker-credentials: "true" } }
stringData: { username: ferry, password: secret }
"#;
    let objects = [
        secret.to_owned(),
        Connection::svc("plant", "plant")
            .credentials_secret("mqtt-credentials")
            .yaml(),
        telemetry_rule().yaml(),
        // Its connection does not exist: a Warning Event, recorded with the chart's rights.
        Rule::new("stray", "elsewhere")
            .topics(&["plant/+/stray"])
            .kafka_topic("stray")
            .yaml(),
    ]
    .concat();
    cp.run_kubectl_with_stdin(["apply", "-n", "plant", "-f", "-"], &objects)
        .expect("apply a connection and rules");
    let get = |args: &[&str]| cp.run_kubectl(args).unwrap_or_default();
    let deadline = Duration::from_secs(90);
    let started = Instant::now();
    while !(get(&["get", "statefulsets", "-n", "plant", "-o", "name"]).contains("statefulset")
        && get(&[
            "get",
            "fr",
            "telemetry",
            "-n",
            "plant",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Accepted\")].status}",
        ]) == "True")
    {
        if let Ok(Some(status)) = operator.child.0.try_wait() {
            panic!("ferry-operator exited ({status}):\n{}", operator_log());
        }
        let so_far = operator_log();
        assert!(
            !so_far.contains("forbidden"),
            "the operator was refused something with the chart's rights:\n{so_far}"
        );
        assert!(
            started.elapsed() < deadline,
            "the operator, with the chart's rights, did not render the rule within \
             {deadline:?}:\n{}",
            operator_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    // A few status rounds, so pod polls and Events happen too.
    std::thread::sleep(Duration::from_secs(3));
    let metrics = ferry_e2e::http_get_ok(([127, 0, 0, 1], port).into(), "/metrics")
        .expect("the operator's /metrics");
    assert!(
        metrics.lines().any(|l| l == "ferry_operator_leader 1"),
        "the operator holds the Lease in {NAMESPACE}:\n{metrics}"
    );
    let kinds = get(&[
        "get",
        "statefulsets,configmaps,services,secrets,poddisruptionbudgets",
        "-n",
        "plant",
        "-l",
        "app.kubernetes.io/name=ferry-forwarder",
        "-o",
        "jsonpath={range .items[*]}{.kind}{\"\\n\"}{end}",
    ]);
    eprintln!(
        "ferry-operator with the chart's ServiceAccount rendered: {}",
        kinds.split_whitespace().collect::<Vec<_>>().join(", ")
    );
    assert!(
        kinds.contains("StatefulSet"),
        "rendered forwarder objects: {kinds}"
    );
    let events = get(&[
        "get",
        "events.events.k8s.io",
        "-n",
        "plant",
        "-o",
        "jsonpath={.items[*].reportingController}",
    ]);
    assert!(
        events.contains("ferry-operator"),
        "Events recorded: {events:?}"
    );
    let log_text = operator_log();
    for refused in ["forbidden", "Forbidden"] {
        assert!(
            !log_text.contains(refused),
            "the operator was refused something ({refused}):\n{log_text}"
        );
    }
    drop(operator);

    // The pre-delete hook's Job cannot run without a kubelet (its command is tested apart).
    let out = helm(
        &[
            "uninstall",
            RELEASE,
            "--no-hooks",
            "--kubeconfig",
            &kubeconfig,
            "--namespace",
            NAMESPACE,
        ],
        None,
    );
    assert!(
        out.status.success(),
        "helm uninstall: {}",
        output_text(&out)
    );
}

// ---------------------------------------------------------------------------------------------
// (g) Namespace mode (watchNamespaces) in a real API server

/// A BrokerConnection `plant` and its rule `telemetry` in `ns`, with their MQTT credentials
/// Secret unless `secret` is false.
fn connection_in(ns: &str, secret: bool) -> String {
    let mut yaml =
        secured_connection_in("plant", ns).yaml() + &telemetry_rule().namespace(ns).yaml();
    if secret {
        yaml.push_str(&mqtt_secret(ns));
    }
    yaml
}

/// BrokerConnection `name` in `ns`, its MQTT credentials in Secret `mqtt-credentials`.
fn secured_connection_in(name: &str, ns: &str) -> Connection {
    Connection::svc(name, ns)
        .namespace(ns)
        .credentials_secret("mqtt-credentials")
}

/// ForwardingRule `telemetry` of connection `plant`: `plant/+/telemetry` to Kafka topic
/// `telemetry`.
fn telemetry_rule() -> Rule {
    Rule::new("telemetry", "plant")
        .topics(&["plant/+/telemetry"])
        .kafka_topic("telemetry")
}

fn mqtt_secret(ns: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{ name: mqtt-credentials, namespace: {ns}, labels: {{ ferry.dev/broker-credentials: \"true\" }} }}\n\
         stringData: {{ username: ferry, password: secret }}\n"
    )
}

/// `kubectl auth can-i --as <user> ARGS`: a SelfSubjectAccessReview impersonating `user`.
fn can_i(cp: &ControlPlane, user: &str, args: &[&str]) -> bool {
    let mut all = vec!["auth", "can-i", "--as", user];
    all.extend_from_slice(args);
    let out = cp.kubectl(&all).output().expect("kubectl auth can-i");
    match String::from_utf8_lossy(&out.stdout).trim() {
        "yes" => true,
        "no" => false,
        other => panic!(
            "kubectl auth can-i {args:?}: {other} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// The chart's ServiceAccount and RBAC objects of `docs`, applied.
fn apply_rbac(cp: &ControlPlane, docs: &[Value]) {
    let items: Vec<&Value> = docs
        .iter()
        .filter(|d| {
            let kind = d["kind"].as_str().unwrap_or_default();
            kind == "ServiceAccount" || kind.ends_with("Role") || kind.ends_with("RoleBinding")
        })
        .collect();
    let list = serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": items });
    cp.run_kubectl_with_stdin(["apply", "-f", "-"], &list.to_string())
        .expect("apply the chart's RBAC");
}

#[test]
fn watch_namespaces_confines_the_operator_and_its_rights_to_those_namespaces() {
    let cp = ControlPlane::start().expect("control plane (run `bash e2e/k8s/build.sh` once)");
    cp.install_crds(
        &Path::new(CHART).join("crd-files"),
        &["forwardingrules.ferry.dev", "brokerconnections.ferry.dev"],
    )
    .expect("CRDs");
    for ns in [NAMESPACE, "plant", "factory", "elsewhere"] {
        cp.run_kubectl(["create", "namespace", ns])
            .expect("namespace");
    }

    // The RBAC of both modes, as the chart renders it: release `ferry` watching plant and
    // factory, and (named `wide`) one watching every namespace.
    let scoped = values_file("scoped", "watchNamespaces: [plant, factory]\n");
    let scoped_docs = documents(&template(&["--values", &scoped.display().to_string()]));
    apply_rbac(&cp, &scoped_docs);
    apply_rbac(
        &cp,
        &documents(&template(&["--set", "fullnameOverride=wide"])),
    );

    let sa = format!("system:serviceaccount:{NAMESPACE}:{OPERATOR}");
    for args in [
        &["get", "secrets", "-n", "plant"][..],
        &["list", "secrets", "-n", "plant"],
        &["watch", "secrets", "-n", "factory"],
        &["watch", "brokerconnections.ferry.dev", "-n", "plant"],
        &["list", "forwardingrules.ferry.dev", "-n", "factory"],
        &[
            "patch",
            "forwardingrules.ferry.dev",
            "--subresource=status",
            "-n",
            "factory",
        ],
        &["create", "statefulsets.apps", "-n", "plant"],
        &["delete", "configmaps", "-n", "factory"],
        &["watch", "pods", "-n", "plant"],
        &["create", "events.events.k8s.io", "-n", "factory"],
        &["update", "leases.coordination.k8s.io", "-n", NAMESPACE],
    ] {
        assert!(can_i(&cp, &sa, args), "namespace mode needs: {args:?}");
    }
    for args in [
        &["list", "secrets", "--all-namespaces"][..],
        &["watch", "secrets", "--all-namespaces"],
        &["get", "secrets", "-n", "elsewhere"],
        &["list", "secrets", "-n", "elsewhere"],
        &["list", "secrets", "-n", NAMESPACE],
        &["watch", "brokerconnections.ferry.dev", "--all-namespaces"],
        &["watch", "forwardingrules.ferry.dev", "-n", "elsewhere"],
        &["watch", "pods", "--all-namespaces"],
        &["create", "statefulsets.apps", "-n", "elsewhere"],
        &["create", "events.events.k8s.io", "-n", "elsewhere"],
    ] {
        assert!(
            !can_i(&cp, &sa, args),
            "namespace mode must not allow: {args:?}"
        );
    }
    let wide = format!("system:serviceaccount:{NAMESPACE}:wide-operator");
    for args in [
        &["list", "secrets", "--all-namespaces"][..],
        &["watch", "secrets", "--all-namespaces"],
        &["get", "secrets", "-n", "elsewhere"],
        &["watch", "brokerconnections.ferry.dev", "--all-namespaces"],
        &["create", "statefulsets.apps", "-n", "elsewhere"],
    ] {
        assert!(can_i(&cp, &wide, args), "cluster mode needs: {args:?}");
    }

    // Application teams: Kubernetes' own edit and view roles carry Ferry's kinds (aggregated
    // by the controller-manager from the chart's two ClusterRoles); status stays the
    // operator's, and nothing reaches past the namespace of the binding.
    for (binding, role, user) in [
        ("team-edit", "edit", "team-dev"),
        ("team-view", "view", "team-viewer"),
    ] {
        cp.run_kubectl([
            "create",
            "rolebinding",
            binding,
            &format!("--clusterrole={role}"),
            &format!("--user={user}"),
            "-n",
            "plant",
        ])
        .expect("rolebinding");
    }
    wait_until(
        "edit and view to aggregate Ferry's kinds",
        Duration::from_secs(30),
        WAIT_POLL,
        || {
            can_i(
                &cp,
                "team-dev",
                &["create", "forwardingrules.ferry.dev", "-n", "plant"],
            ) && can_i(
                &cp,
                "team-viewer",
                &["list", "brokerconnections.ferry.dev", "-n", "plant"],
            )
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    for args in [
        &["create", "brokerconnections.ferry.dev", "-n", "plant"][..],
        &["patch", "forwardingrules.ferry.dev", "-n", "plant"],
        &["delete", "brokerconnections.ferry.dev", "-n", "plant"],
    ] {
        assert!(can_i(&cp, "team-dev", args), "edit gives: {args:?}");
    }
    for args in [
        &[
            "get",
            "forwardingrules.ferry.dev",
            "--subresource=status",
            "-n",
            "plant",
        ][..],
        &["watch", "forwardingrules.ferry.dev", "-n", "plant"],
    ] {
        assert!(can_i(&cp, "team-viewer", args), "view gives: {args:?}");
    }
    for (user, args) in [
        (
            "team-dev",
            &[
                "patch",
                "forwardingrules.ferry.dev",
                "--subresource=status",
                "-n",
                "plant",
            ][..],
        ),
        (
            "team-dev",
            &["create", "forwardingrules.ferry.dev", "-n", "factory"],
        ),
        (
            "team-viewer",
            &["create", "forwardingrules.ferry.dev", "-n", "plant"],
        ),
        (
            "team-viewer",
            &["delete", "brokerconnections.ferry.dev", "-n", "plant"],
        ),
        (
            "someone",
            &["list", "forwardingrules.ferry.dev", "-n", "plant"],
        ),
    ] {
        assert!(!can_i(&cp, user, args), "{user} must not: {args:?}");
    }

    // The operator with the namespace-mode ServiceAccount's token and the Deployment's
    // FERRY_WATCH_NAMESPACES: it serves plant and factory and leaves elsewhere alone.
    let env = &find(&scoped_docs, "Deployment", OPERATOR)["spec"]["template"]["spec"]["containers"]
        [0]["env"];
    let watch = env
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "FERRY_WATCH_NAMESPACES")
        .and_then(|e| e["value"].as_str())
        .expect("the Deployment sets FERRY_WATCH_NAMESPACES")
        .to_owned();
    // In place before the operator starts: its first lists of plant and factory must both
    // end up in its view (one namespace's list replacing the other's would lose one).
    for ns in ["factory", "elsewhere"] {
        cp.run_kubectl_with_stdin(["apply", "-f", "-"], &connection_in(ns, true))
            .expect("apply");
    }
    cp.run_kubectl_with_stdin(["apply", "-f", "-"], &connection_in("plant", false))
        .expect("apply");
    let mut operator = SaOperator::start(
        &cp,
        "scoped-operator",
        &[("FERRY_WATCH_NAMESPACES", &watch)],
    );
    let port = operator.port;
    let operator_log = operator.log_reader();
    let get = |args: &[&str]| cp.run_kubectl(args).unwrap_or_default();
    let status_of = |kind: &str, ns: &str, type_: &str| {
        get(&[
            "get",
            kind,
            "plant",
            "-n",
            ns,
            "-o",
            &format!("jsonpath={{.status.conditions[?(@.type==\"{type_}\")].status}}"),
        ])
    };
    let rule_accepted = |ns: &str| {
        get(&[
            "get",
            "fr",
            "telemetry",
            "-n",
            ns,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Accepted\")].status}",
        ]) == "True"
    };
    let forwarders = |ns: &str| {
        get(&[
            "get",
            "statefulsets,configmaps,secrets,services",
            "-n",
            ns,
            "-l",
            "app.kubernetes.io/name=ferry-forwarder",
            "-o",
            "name",
        ])
    };
    let mut wait = |what: &str, cond: &dyn Fn() -> bool| {
        let started = Instant::now();
        while !cond() {
            if let Ok(Some(status)) = operator.child.0.try_wait() {
                panic!("ferry-operator exited ({status}):\n{}", operator_log());
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}:\n{}",
                operator_log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };

    // plant's connection names a Secret that does not exist yet; creating it (a watch of
    // Secrets in plant only) renders the forwarders.
    wait("factory's forwarders", &|| {
        forwarders("factory").contains("statefulset") && rule_accepted("factory")
    });
    wait("plant's missing Secret as a condition", &|| {
        status_of("bc", "plant", "SecretsResolved") == "False"
    });
    cp.run_kubectl_with_stdin(["apply", "-f", "-"], &mqtt_secret("plant"))
        .expect("secret");
    wait("plant's forwarders", &|| {
        forwarders("plant").contains("statefulset") && rule_accepted("plant")
    });
    // A rule deleted in a watched namespace: its group's forwarders are pruned.
    cp.run_kubectl(["delete", "fr", "telemetry", "-n", "factory"])
        .expect("delete");
    wait("factory's forwarders pruned", &|| {
        !forwarders("factory").contains("statefulset")
    });

    // By now elsewhere's connection, there from the start, would long have been rendered.
    assert_eq!(
        forwarders("elsewhere"),
        "",
        "children in an unwatched namespace"
    );
    for kind in ["bc", "fr"] {
        let name = if kind == "bc" { "plant" } else { "telemetry" };
        assert_eq!(
            get(&[
                "get",
                kind,
                name,
                "-n",
                "elsewhere",
                "-o",
                "jsonpath={.status}"
            ]),
            "",
            "{kind} status written in an unwatched namespace"
        );
    }
    assert_eq!(
        get(&["get", "events", "-n", "elsewhere", "-o", "name"]),
        "",
        "Events in an unwatched namespace"
    );
    let metrics = ferry_e2e::http_get_ok(([127, 0, 0, 1], port).into(), "/metrics")
        .expect("the operator's /metrics");
    assert!(
        metrics.lines().any(|l| l == "ferry_operator_leader 1"),
        "the operator holds the Lease in {NAMESPACE}:\n{metrics}"
    );
    let log_text = operator_log();
    assert!(
        log_text.contains(r#""scope":"namespaces factory, plant""#),
        "{log_text}"
    );
    for refused in ["forbidden", "Forbidden"] {
        assert!(
            !log_text.contains(refused),
            "the operator was refused something ({refused}):\n{log_text}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (h) The values table and the alerts

/// The README's values table is what `valuesdoc` makes of values.yaml's `# --` comments, every
/// value is documented, and values.schema.json knows exactly the keys values.yaml has.
#[test]
fn readme_values_table_is_generated_from_values_yaml() {
    let chart = Path::new(CHART);
    let values_yaml = std::fs::read_to_string(chart.join("values.yaml")).expect("values.yaml");
    let table = ferry_operator::valuesdoc::table(&values_yaml)
        .unwrap_or_else(|e| panic!("{e}: document it with a `# --` comment above the key"));
    let (readme, updated) =
        ferry_operator::valuesdoc::chart_readme(chart).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        updated == readme,
        "charts/ferry/README.md's values table or Argo CD checks differ from values.yaml or \
         argocd/: run `make chart-docs` and commit the result"
    );
    assert!(readme.contains("resource.customizations.health.ferry.dev_ForwardingRule: |"));
    let rows = table.lines().count() - 2;
    assert!(rows >= 60, "{rows} values documented:\n{table}");
    for key in [
        "crds.enabled",
        "crds.keep",
        "prometheusRule.enabled",
        "image.digest",
    ] {
        assert!(
            table.contains(&format!("| `{key}` |")),
            "{key} in:\n{table}"
        );
    }

    let values: Value = serde_saphyr::from_str(&values_yaml).expect("values.yaml");
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart.join("values.schema.json")).expect("schema"),
    )
    .expect("values.schema.json is JSON");
    let documented = ferry_operator::valuesdoc::documented(&values_yaml);
    let drift = ferry_operator::valuesdoc::schema_drift(&values, &schema, &documented);
    assert!(
        drift.is_empty(),
        "values.yaml vs values.schema.json: {drift:#?}"
    );
}

/// The rows of docs/metrics.md's metrics tables, by metric name.
fn documented_metric_rows() -> BTreeMap<String, String> {
    let readme = include_str!("../../docs/metrics.md");
    let mut rows = BTreeMap::new();
    for line in readme.lines().map(str::trim) {
        let Some(first) = line.strip_prefix("| `").and_then(|l| l.split(" |").next()) else {
            continue;
        };
        for name in first.split(", ").map(|n| n.trim_matches('`')) {
            if name.starts_with("ferry_") {
                rows.insert(name.to_owned(), line.to_owned());
            }
        }
    }
    rows
}

/// The `label="value"` matchers right after each `ferry_*` name of `expr`, and the labels of
/// its `by (...)` clauses.
fn matchers_and_groupings(expr: &str) -> (Vec<(String, String, String)>, Vec<String>) {
    let mut matchers = Vec::new();
    for name in ferry_metrics_in(expr) {
        let Some(start) = expr.find(&format!("{name}{{")) else {
            continue;
        };
        let inside = &expr[start + name.len() + 1..];
        let inside = &inside[..inside.find('}').expect("closing brace")];
        for m in inside.split(',').filter(|m| !m.trim().is_empty()) {
            // `=`, `!=`, `=~` or `!~`.
            let (label, value) = m.split_once(['=', '~']).expect("label=value");
            let label = label.trim_end_matches('!');
            let value = value.trim_start_matches('~').trim().trim_matches('"');
            matchers.push((name.clone(), label.trim().to_owned(), value.to_owned()));
        }
    }
    let mut groupings = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("by (") {
        let list = &rest[i + 4..];
        let end = list.find(')').expect("by (...)");
        groupings.extend(list[..end].split(',').map(|l| l.trim().to_owned()));
        rest = &list[end..];
    }
    (matchers, groupings)
}

/// Every metric an alert uses is one the forwarder or the operator registers and docs/metrics.md
/// documents, with label names and values from its row (or target labels the monitors add).
#[test]
fn alerts_use_only_metrics_and_label_values_that_exist() {
    let values = values_file(
        "alerts",
        "prometheusRule: { enabled: true, noData: { enabled: true, excludeRules: nightly-.* } }\n\
         metrics: { serviceMonitor: { enabled: true }, podMonitor: { enabled: true } }\n",
    );
    let rendered = template(&["--values", &values.display().to_string()]);
    let docs = documents(&rendered);
    kubeconform(&rendered, docs.len());
    let rules = alert_rules(&docs);
    let names: Vec<&str> = rules.iter().filter_map(|r| r["alert"].as_str()).collect();
    for promised in [
        "FerryRuleStalled",
        "FerryRecordsWaiting",
        "FerryKafkaUnreachable",
        "FerryMessagesDeadLettered",
        "FerryForwarderDown",
        "FerryOperatorNotLeading",
        "FerryRuleNotReady",
        "FerryRuleNoData",
    ] {
        assert!(names.contains(&promised), "{promised} in {names:?}");
    }
    let rows = documented_metric_rows();
    for rule in &rules {
        check_alert(rule, &rows);
    }
    // The up-based alerts name the jobs of the chart's own monitors.
    let exprs: Vec<&str> = rules.iter().filter_map(|r| r["expr"].as_str()).collect();
    assert!(
        exprs.contains(&r#"up{job="ferry-system/ferry-forwarders"} == 0"#),
        "{exprs:?}"
    );
    assert!(
        exprs.contains(&r#"up{job="ferry-operator-metrics", namespace="ferry-system"} == 0"#),
        "{exprs:?}"
    );
    // Without the monitors there is no job to name: those two alerts are left out.
    let plain = documents(&template(&["--set", "prometheusRule.enabled=true"]));
    let plain_names: Vec<String> = alert_rules(&plain)
        .iter()
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect();
    assert!(
        !plain_names.iter().any(|n| n.ends_with("Down")),
        "{plain_names:?}"
    );
    assert!(
        !plain_names.iter().any(|n| n == "FerryRuleNoData"),
        "the no-data alert is opt-in: {plain_names:?}"
    );
    assert!(
        !kinds(&documents(&template(&[]))).contains(&"PrometheusRule".to_owned()),
        "no PrometheusRule by default"
    );
}

/// Every alert links its runbook: `runbook_url` is the chart's base URL (a value) and `#` an
/// anchor that a heading of docs/runbooks.md makes (GitHub's rule: lower case, spaces to `-`,
/// other punctuation dropped), so the on-call lands on the alert's own section.
#[test]
fn every_alert_links_a_runbook_section_that_exists() {
    let runbooks = include_str!("../../docs/runbooks.md");
    let anchors: BTreeSet<String> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("## ").or_else(|| l.strip_prefix("### ")))
        .map(github_anchor)
        .collect();
    let values = values_file(
        "runbooks",
        "prometheusRule: { enabled: true, noData: { enabled: true } }\n\
         metrics: { serviceMonitor: { enabled: true }, podMonitor: { enabled: true } }\n",
    );
    let default_base = "https://github.com/ferry-dev/ferry/blob/main/docs/runbooks.md";
    for (base, extra) in [
        (default_base, vec![]),
        (
            "https://wiki.example.com/ferry",
            vec![
                "--set",
                "prometheusRule.runbookBaseUrl=https://wiki.example.com/ferry",
            ],
        ),
    ] {
        let mut args = vec!["--values", values.to_str().expect("path")];
        args.extend(extra);
        let rules = alert_rules(&documents(&template(&args)));
        assert!(rules.len() >= 13, "every alert rendered: {}", rules.len());
        for rule in &rules {
            let alert = rule["alert"].as_str().expect("alert");
            let url = rule["annotations"]["runbook_url"]
                .as_str()
                .unwrap_or_else(|| panic!("{alert}: no runbook_url"));
            let anchor = url
                .strip_prefix(&format!("{base}#"))
                .unwrap_or_else(|| panic!("{alert}: {url} is not under {base}"));
            assert_eq!(anchor, alert.to_lowercase(), "{alert}: its own section");
            assert!(
                anchors.contains(anchor),
                "{alert}: docs/runbooks.md has no heading for #{anchor}"
            );
        }
    }
}

/// The anchor GitHub makes of a Markdown heading.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// One alerting rule: a severity, a balanced expression, and only metrics, label names and
/// label values that exist (docs/metrics.md's rows, or the target labels the monitors add).
fn check_alert(rule: &Value, rows: &BTreeMap<String, String>) {
    let target_labels = ["namespace", "pod", "job"];
    // Labels whose values are object names: any value (a regular expression) is fine.
    let name_labels = ["rule", "connection"];
    let alert = rule["alert"].as_str().expect("alert name");
    let expr = rule["expr"].as_str().expect("expr");
    assert!(
        ["critical", "warning"].contains(&rule["labels"]["severity"].as_str().unwrap_or("")),
        "{alert}: severity"
    );
    check_balanced(alert, expr);
    let used = ferry_metrics_in(expr);
    assert!(
        !used.is_empty() || expr.starts_with("up{"),
        "{alert} uses no Ferry metric: {expr}"
    );
    for name in &used {
        assert!(is_registered(name), "{alert}: {name} is not registered");
        assert!(
            rows.contains_key(name),
            "{alert}: {name} is not in docs/metrics.md"
        );
    }
    let (matchers, groupings) = matchers_and_groupings(expr);
    for (name, label, value) in matchers {
        if target_labels.contains(&label.as_str()) {
            continue;
        }
        if name_labels.contains(&label.as_str()) {
            let row = &rows[&name];
            assert!(
                row.contains(&format!("`{label}`")),
                "{alert}: {name} has no {label}"
            );
            continue;
        }
        let row = &rows[&name];
        assert!(
            row.contains(&format!("`{label}`")) && row.contains(&format!("`{value}`")),
            "{alert}: {name}{{{label}=\"{value}\"}}: not a label value docs/metrics.md lists:\n{row}"
        );
    }
    for label in groupings {
        assert!(
            target_labels.contains(&label.as_str())
                || used.iter().any(|n| rows[n].contains(&format!("`{label}`"))),
            "{alert}: by ({label}): no metric of the expression has that label"
        );
    }
}

/// Parentheses, braces and brackets nest and quotes pair (no PromQL parser here: promtool is
/// not among the test tools).
fn check_balanced(alert: &str, expr: &str) {
    let mut stack = Vec::new();
    let mut quoted = false;
    for c in expr.chars() {
        match c {
            '"' => quoted = !quoted,
            _ if quoted => {}
            '(' | '{' | '[' => stack.push(c),
            ')' | '}' | ']' => {
                let open = stack.pop();
                let want = match c {
                    ')' => '(',
                    '}' => '{',
                    _ => '[',
                };
                assert_eq!(open, Some(want), "{alert}: unbalanced {c} in {expr}");
            }
            _ => {}
        }
    }
    assert!(stack.is_empty() && !quoted, "{alert}: unclosed in {expr}");
}

// ---------------------------------------------------------------------------------------------
// (i) CRD upgrades on a real API server

/// Copies the chart to a temp dir as version 0.1.1, with a short name added to the
/// ForwardingRule CRD: the next chart, whose CRD changed.
fn next_chart() -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("chart-next-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = run(
        {
            let mut cmd = Command::new("cp");
            cmd.arg("-r").arg(CHART).arg(&dir);
            cmd
        },
        None,
    );
    assert!(out.status.success(), "cp: {}", output_text(&out));
    let edit = |file: &str, from: &str, to: &str| {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path).expect(file);
        assert!(text.contains(from), "{file} has no {from:?}");
        std::fs::write(&path, text.replacen(from, to, 1)).expect(file);
    };
    edit("Chart.yaml", "version: 0.1.0", "version: 0.1.1");
    edit(
        "crd-files/forwardingrules.ferry.dev.yaml",
        "    shortNames:\n    - fr\n",
        "    shortNames:\n    - fr\n    - ferryrule\n",
    );
    dir
}

/// Release `ferry` in a control plane: helm verbs and the ForwardingRule CRD as served.
struct Release<'a> {
    cp: &'a ControlPlane,
    kubeconfig: String,
}

impl Release<'_> {
    /// `helm VERB ferry [CHART] --namespace ferry-system`, which must succeed.
    fn helm(&self, verb: &str, chart: &Path) {
        let out = self.try_helm(verb, chart);
        assert!(out.status.success(), "helm {verb}: {}", output_text(&out));
    }

    fn try_helm(&self, verb: &str, chart: &Path) -> Output {
        let chart = chart.display().to_string();
        let mut args = vec![verb, RELEASE];
        if verb == "uninstall" {
            // The pre-delete hook's Job cannot run without a kubelet; its command is tested
            // on its own (uninstall_hook_releases_finalizers_...).
            args.push("--no-hooks");
        } else {
            args.push(&chart);
        }
        args.extend(["--kubeconfig", &self.kubeconfig, "--namespace", NAMESPACE]);
        let out = helm(&args, None);
        eprintln!("helm {verb}: {}", output_text(&out));
        out
    }

    /// A JSONPath of the ForwardingRule CRD; empty if there is none.
    fn crd(&self, path: &str) -> String {
        self.cp
            .run_kubectl([
                "get",
                "crd",
                "forwardingrules.ferry.dev",
                "-o",
                &format!("jsonpath={path}"),
            ])
            .unwrap_or_default()
    }

    fn crd_label(&self, label: &str) -> String {
        self.crd(&format!(
            "{{.metadata.labels.{}}}",
            label.replace('.', r"\.")
        ))
    }

    fn crd_kept(&self) -> bool {
        self.crd(r"{.metadata.annotations.helm\.sh/resource-policy}") == "keep"
    }

    /// `helm uninstall`, which leaves the CRDs and the connection and rule in `plant`.
    fn uninstall_keeping_the_crds(&self) {
        self.helm("uninstall", Path::new(CHART));
        assert_eq!(
            self.crd("{.metadata.name}"),
            "forwardingrules.ferry.dev",
            "CRD kept"
        );
        let objects = self
            .cp
            .run_kubectl(["get", "bc,fr", "-n", "plant", "-o", "name"])
            .unwrap_or_default();
        assert!(
            objects.contains("brokerconnection.ferry.dev/plant")
                && objects.contains("forwardingrule.ferry.dev/telemetry"),
            "the connection and the rule outlive the release: {objects:?}"
        );
    }
}

#[test]
fn helm_upgrade_upgrades_the_crds_and_uninstall_keeps_them() {
    let cp = ControlPlane::start().expect("control plane (run `bash e2e/k8s/build.sh` once)");
    for ns in [NAMESPACE, "plant"] {
        cp.run_kubectl(["create", "namespace", ns])
            .expect("namespace");
    }
    let release = Release {
        cp: &cp,
        kubeconfig: cp.kubeconfig_path().display().to_string(),
    };

    // A fresh install: the CRDs with the chart's labels and the keep annotation.
    release.helm("install", Path::new(CHART));
    for (label, value) in [
        ("helm.sh/chart", "ferry-0.1.0"),
        ("app.kubernetes.io/name", "ferry"),
        ("app.kubernetes.io/instance", RELEASE),
        ("app.kubernetes.io/version", "0.1.0"),
        ("app.kubernetes.io/managed-by", "Helm"),
    ] {
        assert_eq!(release.crd_label(label), value, "label {label}");
    }
    assert!(release.crd_kept(), "crds.keep by default");
    assert_eq!(release.crd("{.spec.names.shortNames}"), r#"["fr"]"#);
    // Discovery may lag the new CRDs by a moment.
    wait_until(
        "a connection and a rule applied",
        Duration::from_secs(30),
        WAIT_POLL,
        || {
            cp.run_kubectl_with_stdin(["apply", "-f", "-"], &connection_in("plant", true))
                .is_ok()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));

    // helm upgrade to a chart whose CRD changed: the API server serves the new CRD.
    release.helm("upgrade", &next_chart());
    assert_eq!(release.crd_label("helm.sh/chart"), "ferry-0.1.1");
    assert_eq!(
        release.crd("{.spec.names.shortNames}"),
        r#"["fr","ferryrule"]"#
    );
    wait_until(
        "the new short name served",
        Duration::from_secs(30),
        WAIT_POLL,
        || {
            cp.run_kubectl(["get", "ferryrule", "telemetry", "-n", "plant", "-o", "name"])
                .is_ok_and(|o| o.trim() == "forwardingrule.ferry.dev/telemetry")
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));

    // helm uninstall keeps the CRDs and so the objects; installing again takes them over and
    // updates them to the chart's.
    release.uninstall_keeping_the_crds();
    release.helm("install", Path::new(CHART));
    assert_eq!(release.crd_label("helm.sh/chart"), "ferry-0.1.0");
    assert_eq!(release.crd("{.spec.names.shortNames}"), r#"["fr"]"#);
    release.uninstall_keeping_the_crds();

    take_over_crds_helm_did_not_create(&release);
}

/// CRDs Helm did not create (as a chart with crds/ left them): Helm refuses to take them over
/// until they carry the release's ownership, which the chart README's commands add.
fn take_over_crds_helm_did_not_create(release: &Release) {
    let crds = ["brokerconnections.ferry.dev", "forwardingrules.ferry.dev"];
    let kubectl = |args: &[&str]| {
        release
            .cp
            .run_kubectl(args)
            .unwrap_or_else(|e| panic!("kubectl {args:?}: {e}"));
    };
    for name in crds {
        kubectl(&["label", "crd", name, "app.kubernetes.io/managed-by-"]);
        kubectl(&[
            "label",
            "crd",
            name,
            "app.kubernetes.io/instance-",
            "helm.sh/chart-",
        ]);
        kubectl(&["annotate", "crd", name, "meta.helm.sh/release-name-"]);
        kubectl(&["annotate", "crd", name, "meta.helm.sh/release-namespace-"]);
        kubectl(&["annotate", "crd", name, "helm.sh/resource-policy-"]);
    }
    let out = release.try_helm("install", Path::new(CHART));
    assert!(
        !out.status.success() && output_text(&out).contains("invalid ownership metadata"),
        "helm install over CRDs it did not create: {}",
        output_text(&out)
    );
    let release_name = format!("meta.helm.sh/release-name={RELEASE}");
    let release_namespace = format!("meta.helm.sh/release-namespace={NAMESPACE}");
    for name in crds {
        kubectl(&[
            "label",
            "crd",
            name,
            "app.kubernetes.io/managed-by=Helm",
            "--overwrite",
        ]);
        kubectl(&[
            "annotate",
            "crd",
            name,
            &release_name,
            &release_namespace,
            "--overwrite",
        ]);
    }
    release.helm("install", Path::new(CHART));
    // Helm updates what it took over to the chart's CRDs: labels and keep annotation are back.
    assert_eq!(release.crd_label("app.kubernetes.io/instance"), RELEASE);
    assert_eq!(release.crd_label("helm.sh/chart"), "ferry-0.1.0");
    assert!(release.crd_kept(), "the keep annotation after the takeover");
}

// ---------------------------------------------------------------------------------------------
// Helpers

fn tools_dir() -> PathBuf {
    ferry_e2e::cache_dir().join("tools")
}

/// A tool built by `e2e/tools/build.sh`; fails the test, saying how to build it, if missing.
fn tool(name: &str) -> PathBuf {
    let path = tools_dir().join("bin").join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `bash e2e/tools/build.sh` (builds helm, kubeconform and the offline \
         Kubernetes JSON schemas from the Go module proxy into $FERRY_CACHE/tools, a few \
         minutes once; `make test` runs it)",
        path.display()
    );
    path
}

fn run(mut cmd: Command, stdin: Option<&str>) -> Output {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    let writer = stdin.map(|input| {
        let mut pipe = child.stdin.take().expect("piped stdin");
        let input = input.to_owned();
        std::thread::spawn(move || pipe.write_all(input.as_bytes()))
    });
    let out = child.wait_with_output().expect("wait");
    if let Some(w) = writer {
        w.join().expect("stdin writer").expect("write stdin");
    }
    out
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `helm install ferry charts/ferry --namespace ferry-system EXTRA...` into `cp`, which must
/// succeed; its output.
fn helm_install(cp: &ControlPlane, extra: &[&str]) -> String {
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let mut args = vec![
        "install",
        RELEASE,
        CHART,
        "--kubeconfig",
        &kubeconfig,
        "--namespace",
        NAMESPACE,
    ];
    args.extend_from_slice(extra);
    let out = helm(&args, None);
    let text = output_text(&out);
    eprintln!("{text}");
    assert!(out.status.success(), "helm install failed:\n{text}");
    text
}

/// helm with its config, cache and data dirs in the test's temp dir (nothing in $HOME).
fn helm<S: AsRef<str>>(args: &[S], stdin: Option<&str>) -> Output {
    let home = Path::new(env!("CARGO_TARGET_TMPDIR")).join("helm");
    let mut cmd = Command::new(tool("helm"));
    cmd.args(args.iter().map(|a| a.as_ref()))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"));
    run(cmd, stdin)
}

/// `helm template ferry charts/ferry --namespace ferry-system EXTRA...`, which must succeed.
fn template(extra: &[&str]) -> String {
    let version = ferry_e2e::kube::k8s_version();
    let mut args = vec![
        "template",
        RELEASE,
        CHART,
        "--namespace",
        NAMESPACE,
        "--kube-version",
        version,
    ];
    args.extend_from_slice(extra);
    let out = helm(&args, None);
    assert!(
        out.status.success(),
        "helm {} failed:\n{}",
        args.join(" "),
        output_text(&out)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn values_file(name: &str, yaml: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chart-values-{name}-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml).expect("values file");
    path
}

/// kubeconform, strict, against the offline schemas of `e2e/tools/build.sh` for the Kubernetes
/// version the tests run, reading stdin.
fn kubeconform_command() -> Command {
    let schemas = tools_dir().join("schemas");
    let version = ferry_e2e::kube::k8s_version();
    assert!(
        schemas
            .join(format!(
                "{version}-standalone-strict/deployment-apps-v1.json"
            ))
            .is_file(),
        "the Kubernetes {version} JSON schemas are missing in {}: run `bash e2e/tools/build.sh`",
        schemas.display()
    );
    let mut cmd = Command::new(tool("kubeconform"));
    cmd.args(["-strict", "-summary", "-output", "text", "-kubernetes-version"])
        .arg(version.trim_start_matches('v'))
        .arg("-schema-location")
        .arg(format!(
            "{}/{{{{.NormalizedKubernetesVersion}}}}-standalone{{{{.StrictSuffix}}}}/{{{{.ResourceKind}}}}{{{{.KindSuffix}}}}.json",
            schemas.display()
        ))
        .arg("-schema-location")
        .arg(format!(
            "{}/crds/{{{{.Group}}}}/{{{{.ResourceKind}}}}_{{{{.ResourceAPIVersion}}}}.json",
            schemas.display()
        ))
        .arg("-");
    cmd
}

/// Validates `rendered`, which must hold `expected` objects, all valid (none skipped).
fn kubeconform(rendered: &str, expected: usize) {
    let out = run(kubeconform_command(), Some(rendered));
    let text = output_text(&out);
    eprintln!("kubeconform: {}", text.trim());
    assert!(out.status.success(), "kubeconform failed:\n{text}");
    let summary = format!(
        "{expected} resources found parsing stdin - Valid: {expected}, Invalid: 0, Errors: 0, Skipped: 0"
    );
    assert!(text.contains(&summary), "expected «{summary}» in:\n{text}");
}

/// The YAML documents of a rendered chart, as JSON values (empty ones left out).
fn documents(rendered: &str) -> Vec<Value> {
    rendered
        .split("\n---")
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.starts_with('#'))
        })
        .map(|d| {
            serde_saphyr::from_str::<Value>(d)
                .unwrap_or_else(|e| panic!("rendered YAML does not parse: {e}\n{d}"))
        })
        .collect()
}

fn kinds(docs: &[Value]) -> Vec<String> {
    let mut kinds: Vec<String> = docs
        .iter()
        .map(|d| d["kind"].as_str().expect("kind").to_owned())
        .collect();
    kinds.sort();
    kinds
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

/// Each metric a dashboard query uses is one the forwarder or the operator registers, and the
/// panels cover what the chart promises.
fn check_dashboard_metrics(dashboard: &Value) {
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    let used: std::collections::BTreeSet<String> =
        exprs.iter().flat_map(|e| ferry_metrics_in(e)).collect();
    for name in &used {
        assert!(
            is_registered(name),
            "the dashboard uses {name}, which nothing registers"
        );
    }
    for promised in [
        "ferry_rule_forwarded_messages_total",
        "ferry_rule_dead_lettered_messages_total",
        "ferry_rule_failed_messages_total",
        "ferry_inflight_messages",
        "ferry_kafka_produce_latency_seconds_bucket",
        "ferry_message_ack_latency_seconds_bucket",
        "ferry_mqtt_connected",
        "ferry_kafka_reachable",
        "ferry_operator_reconciles_total",
        "ferry_operator_reconcile_errors_total",
        "ferry_operator_leader",
        "ferry_rule_ready",
        "ferry_rule_last_forwarded_timestamp_seconds",
    ] {
        assert!(
            used.contains(promised),
            "no dashboard panel shows {promised}"
        );
    }
}

/// The `ferry_*` metric names in a PromQL expression.
fn ferry_metrics_in(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("ferry_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + name.len()..];
        names.push(name);
    }
    names
}

/// Whether the forwarder (forwarder/src/metrics.rs) or the operator (src/metrics.rs) registers
/// this metric (a counter's `_total`, a histogram's series taken off).
fn is_registered(name: &str) -> bool {
    let forwarder = include_str!("../../forwarder/src/metrics.rs");
    let operator = include_str!("../src/metrics.rs");
    // The per-object series the operator serves from its stores.
    if include_str!("../src/readiness.rs").contains(&format!("\"{name}\"")) {
        return true;
    }
    let base = ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    match base.strip_prefix("ferry_operator_") {
        Some(op) => operator.contains(&format!("\"{op}\"")),
        None => base
            .strip_prefix("ferry_")
            .is_some_and(|f| forwarder.contains(&format!("\"{f}\""))),
    }
}

/// The alerting rules of the rendered PrometheusRule.
fn alert_rules(docs: &[Value]) -> Vec<Value> {
    let rule = docs
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .expect("a PrometheusRule rendered");
    rule["spec"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").clone())
        .collect()
}

/// The operator binary run with nothing but a token of the chart's ServiceAccount, as its pod
/// would: every request it makes is checked against the chart's RBAC.
struct SaOperator {
    child: ChildGuard,
    log: PathBuf,
    port: u16,
}

impl SaOperator {
    /// Starts it as pod `name` (logs `<name>.log` and `.stderr` in the control plane's dir)
    /// with `env` added to the chart's settings.
    fn start(cp: &ControlPlane, name: &str, env: &[(&str, &str)]) -> Self {
        let kubeconfig = sa_kubeconfig(cp, OPERATOR, name);
        let port = ferry_e2e::free_port().expect("port");
        let log = cp.dir().join(format!("{name}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_ferry-operator"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAME", format!("ferry-{name}"))
            .env("POD_NAMESPACE", NAMESPACE)
            .envs(env.iter().copied())
            .env("FERRY_STATUS_INTERVAL_SECONDS", "1")
            .env("FERRY_LOG", "info,ferry_operator=debug")
            .env("FERRY_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(std::fs::File::create(log.with_extension("stderr")).expect("log"))
            .spawn()
            .expect("spawn ferry-operator");
        Self {
            child: ChildGuard(child),
            log,
            port,
        }
    }

    /// Reads its stdout and stderr so far, without borrowing it (the test still waits on it).
    fn log_reader(&self) -> impl Fn() -> String + use<> {
        let log = self.log.clone();
        move || {
            format!(
                "{}{}",
                std::fs::read_to_string(&log).unwrap_or_default(),
                std::fs::read_to_string(log.with_extension("stderr")).unwrap_or_default()
            )
        }
    }
}

/// A kubeconfig `<name>-kubeconfig` in the control plane's dir with nothing but a token of
/// ServiceAccount `sa` of the release namespace, as a pod of that account has.
fn sa_kubeconfig(cp: &ControlPlane, sa: &str, name: &str) -> PathBuf {
    let token = cp
        .run_kubectl(["create", "token", sa, "-n", NAMESPACE, "--duration=1h"])
        .expect("token");
    let kubeconfig = cp.dir().join(format!("{name}-kubeconfig"));
    cp.write_kubeconfig(&kubeconfig, sa, token.trim(), NAMESPACE)
        .expect("kubeconfig");
    kubeconfig
}

/// Kills the child when dropped (also when the test panics).
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// The GitOps examples: an Argo CD Application and a Flux GitRepository + Kustomization
// ---------------------------------------------------------------------------------------------

#[test]
fn gitops_examples_are_valid_for_argo_cd_and_flux() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gitops");
    let mut all = String::new();
    for file in [
        "argocd-application.yaml",
        "flux.yaml",
        "external-secrets.yaml",
    ] {
        let text = std::fs::read_to_string(dir.join(file)).expect("example");
        all.push_str("---\n");
        all.push_str(&text);
    }
    // Offline schemas generated from the Argo CD, Flux and External Secrets CRDs
    // (e2e/tools/build.sh).
    kubeconform(&all, 5);

    // What they sync holds no Secret (self-heal would put a placeholder back over the real
    // password); the ExternalSecrets make exactly the Secrets the connection references,
    // labelled so that it may use them.
    let synced = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kubernetes");
    let mut referenced = Vec::new();
    for entry in std::fs::read_dir(&synced).expect("examples/kubernetes") {
        let text = std::fs::read_to_string(entry.expect("entry").path()).expect("example");
        for doc in documents(&text) {
            assert_ne!(
                doc["kind"], "Secret",
                "a Secret in examples/kubernetes: {doc}"
            );
            let spec = &doc["spec"];
            for secret in [
                &spec["mqtt"]["credentialsSecretRef"]["name"],
                &spec["kafka"]["sasl"]["credentialsSecretRef"]["name"],
            ] {
                if let Some(name) = secret.as_str() {
                    referenced.push(name.to_owned());
                }
            }
        }
    }
    referenced.sort();
    let docs = documents(&all);
    let mut made: Vec<String> = docs
        .iter()
        .filter(|d| d["kind"] == "ExternalSecret")
        .map(|d| {
            let target = &d["spec"]["target"];
            assert_eq!(
                target["template"]["metadata"]["labels"]["ferry.dev/broker-credentials"], "true",
                "{d}"
            );
            target["name"].as_str().expect("target name").to_owned()
        })
        .collect();
    made.sort();
    assert_eq!(
        made, referenced,
        "the ExternalSecrets make the referenced Secrets"
    );
    // Flux waits on health, with expressions for Ferry's kinds (evaluated against the
    // operator's own statuses in tests/reconcile.rs).
    let kustomization = find(&docs, "Kustomization", "ferry-plant");
    assert_eq!(
        kustomization["spec"]["wait"], true,
        "healthCheckExprs apply only with wait"
    );
    let checked: Vec<&str> = kustomization["spec"]["healthCheckExprs"]
        .as_array()
        .expect("healthCheckExprs")
        .iter()
        .map(|c| c["kind"].as_str().expect("kind"))
        .collect();
    assert_eq!(checked, ["BrokerConnection", "ForwardingRule"]);

    // And a real API server with those CRDs, refusing unknown fields.
    let cp = ControlPlane::start().expect("control plane (run e2e/k8s/build.sh once)");
    let crds = tools_dir().join("crds");
    for (file, name) in [
        ("argoproj.io_applications.yaml", "applications.argoproj.io"),
        (
            "source.toolkit.fluxcd.io_gitrepositories.yaml",
            "gitrepositories.source.toolkit.fluxcd.io",
        ),
        (
            "kustomize.toolkit.fluxcd.io_kustomizations.yaml",
            "kustomizations.kustomize.toolkit.fluxcd.io",
        ),
        (
            "external-secrets.io_externalsecrets.yaml",
            "externalsecrets.external-secrets.io",
        ),
    ] {
        cp.install_crds(&crds.join(file), &[name])
            .unwrap_or_else(|e| panic!("install {file}: {e}"));
    }
    for ns in ["argocd", "flux-system"] {
        cp.run_kubectl(["create", "namespace", ns])
            .expect("namespace");
    }
    let start = Instant::now();
    loop {
        match cp.run_kubectl_with_stdin(["apply", "--validate=strict", "-f", "-"], &all) {
            Ok(out) => {
                eprintln!("{}", out.trim());
                assert_eq!(out.lines().count(), 5, "{out}");
                break;
            }
            // Discovery may lag the CRDs by a moment.
            Err(e) if e.to_string().contains("no matches for kind") => {
                assert!(start.elapsed() < Duration::from_secs(20), "{e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("the GitOps examples are refused: {e}"),
        }
    }
    let path = cp
        .run_kubectl([
            "get",
            "kustomization",
            "ferry-plant",
            "-n",
            "flux-system",
            "-o",
            "jsonpath={.spec.path}",
        ])
        .expect("kustomization");
    assert_eq!(
        path, "./examples/kubernetes",
        "points at the Ferry examples"
    );
}

// ---------------------------------------------------------------------------------------------
// Namespace mode refused at admission: a ValidatingAdmissionPolicy from watchNamespaces
// ---------------------------------------------------------------------------------------------

/// The policy and its binding render only in namespace mode, and only where the API server
/// serves ValidatingAdmissionPolicy (what `helm install` finds by discovery; `helm template`
/// without `--api-versions` stands for an older cluster).
#[test]
fn admission_policy_renders_only_in_namespace_mode_on_api_servers_that_serve_it() {
    let policy_kinds = |docs: &[Value]| -> Vec<String> {
        kinds(docs)
            .into_iter()
            .filter(|k| k.starts_with("ValidatingAdmissionPolicy"))
            .collect()
    };
    let scoped = ["--set", "watchNamespaces={plant,factory}"];
    let rendered = template(&[scoped[0], scoped[1], "--api-versions", VAP_API]);
    let docs = documents(&rendered);
    assert_eq!(
        policy_kinds(&docs),
        [
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding"
        ]
    );
    kubeconform(&rendered, docs.len());
    let policy = find(
        &docs,
        "ValidatingAdmissionPolicy",
        "ferry-watched-namespaces",
    );
    assert!(
        policy["spec"]["validations"][0]["expression"]
            .as_str()
            .expect("expression")
            .contains("request.namespace in ['plant','factory']"),
        "{policy}"
    );
    assert_eq!(
        find(
            &docs,
            "ValidatingAdmissionPolicyBinding",
            "ferry-watched-namespaces"
        )["spec"]["validationActions"],
        serde_json::json!(["Deny"])
    );
    for (what, args) in [
        ("cluster mode", &["--api-versions", VAP_API][..]),
        ("an API server without the API", &scoped[..]),
        (
            "admissionPolicy.enabled=false",
            &[
                scoped[0],
                scoped[1],
                "--api-versions",
                VAP_API,
                "--set",
                "admissionPolicy.enabled=false",
            ][..],
        ),
    ] {
        assert!(
            policy_kinds(&documents(&template(args))).is_empty(),
            "nothing rendered for {what}"
        );
    }
}

/// Installed by `helm install` into a real API server (v1.34) watching plant and factory: a
/// connection or rule elsewhere is refused with a message naming the watched namespaces; in a
/// watched one it is accepted; one created before the policy can still be cleaned up and
/// deleted, but its spec no longer changed.
#[test]
fn watch_namespaces_refuses_connections_and_rules_elsewhere_at_admission() {
    let cp = ControlPlane::start().expect("control plane (run `bash e2e/k8s/build.sh` once)");
    for ns in [NAMESPACE, "plant", "factory", "elsewhere", "legacy"] {
        cp.run_kubectl(["create", "namespace", ns])
            .expect("namespace");
    }
    cp.install_crds(
        &Path::new(CHART).join("crd-files"),
        &["forwardingrules.ferry.dev", "brokerconnections.ferry.dev"],
    )
    .expect("CRDs");
    // Created before the policy, with a finalizer of someone else's.
    let legacy = secured_connection_in("plant", "legacy")
        .set("/metadata/finalizers", json!(["example.com/hold"]))
        .yaml()
        + &telemetry_rule().namespace("legacy").yaml();
    cp.run_kubectl_with_stdin(["apply", "-f", "-"], &legacy)
        .expect("a connection in legacy before the policy");

    // The CRDs are already there (installed by hand): the chart leaves them alone.
    let values = values_file(
        "admission",
        "watchNamespaces: [plant, factory]\ncrds: { enabled: false }\n",
    );
    helm_install(&cp, &["--values", &values.display().to_string()]);
    for kind in [
        "validatingadmissionpolicy",
        "validatingadmissionpolicybinding",
    ] {
        cp.run_kubectl(["get", kind, "ferry-watched-namespaces"])
            .unwrap_or_else(|e| panic!("helm installed the {kind} (discovery has the API): {e}"));
    }

    // The API server loads a new policy asynchronously: the first refusal shows it in force.
    let mut refusal = String::new();
    wait_until(
        "the policy to refuse a connection in elsewhere",
        Duration::from_secs(30),
        WAIT_POLL,
        || match cp.run_kubectl_with_stdin(["apply", "-f", "-"], &connection_in("elsewhere", false))
        {
            Ok(_) => {
                for kind in ["fr/telemetry", "bc/plant"] {
                    let _ = cp.run_kubectl(["delete", kind, "-n", "elsewhere", "--wait=false"]);
                }
                false
            }
            Err(e) => {
                refusal = e.to_string();
                true
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("refused: {refusal}");
    for expected in [
        "ferry-watched-namespaces",
        "BrokerConnection plant in namespace elsewhere would never be served",
        "watches only the namespaces plant, factory",
        "add elsewhere to the chart value watchNamespaces",
    ] {
        assert!(refusal.contains(expected), "«{expected}» in: {refusal}");
    }
    let rule_alone = telemetry_rule().namespace("elsewhere").yaml();
    let refused = cp
        .run_kubectl_with_stdin(["apply", "-f", "-"], &rule_alone)
        .expect_err("a rule in elsewhere is refused too");
    assert!(
        refused
            .to_string()
            .contains("ForwardingRule telemetry in namespace elsewhere"),
        "{refused}"
    );
    let listed = cp
        .run_kubectl(["get", "bc,fr", "-n", "elsewhere", "-o", "name"])
        .expect("list");
    assert!(listed.trim().is_empty(), "nothing was created: {listed}");

    // Watched namespaces: accepted.
    for ns in ["plant", "factory"] {
        cp.run_kubectl_with_stdin(["apply", "-f", "-"], &connection_in(ns, true))
            .unwrap_or_else(|e| panic!("a connection and rule in {ns}: {e}"));
    }

    // The connection from before: its spec is frozen, its metadata not, and it deletes.
    let patch_legacy = |patch: &str| {
        cp.run_kubectl([
            "patch",
            "bc",
            "plant",
            "-n",
            "legacy",
            "--type=merge",
            "-p",
            patch,
        ])
    };
    let spec_change = patch_legacy(r#"{"spec":{"mqtt":{"host":"other.legacy.svc"}}}"#)
        .expect_err("a spec change outside the watched namespaces is refused");
    assert!(
        spec_change.to_string().contains("would never be served"),
        "{spec_change}"
    );
    patch_legacy(r#"{"metadata":{"finalizers":null,"labels":{"team":"iot"}}}"#)
        .expect("a metadata-only change (a finalizer removed) is allowed");
    cp.run_kubectl(["delete", "bc", "plant", "-n", "legacy", "--timeout=30s"])
        .expect("and it deletes");
}

// ---------------------------------------------------------------------------------------------
// Uninstalling: the pre-delete hook that releases the operator's finalizers
// ---------------------------------------------------------------------------------------------

const HOOK_SA: &str = "ferry-uninstall";

fn is_hook(doc: &Value) -> bool {
    doc["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
}

/// The hook's objects: all `pre-delete` hooks, removed once it succeeded; the Job runs the
/// operator image's `release-finalizers` and waits for exactly the operator's pods (not its
/// own); its RBAC follows the operator's scope.
#[test]
fn uninstall_hook_renders_a_release_finalizers_job_with_rbac_of_its_own() {
    let docs = documents(&template(&[]));
    let hooks: Vec<&Value> = docs.iter().filter(|d| is_hook(d)).collect();
    let mut hook_kinds: Vec<String> = hooks
        .iter()
        .map(|d| d["kind"].as_str().expect("kind").to_owned())
        .collect();
    hook_kinds.sort();
    assert_eq!(
        hook_kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "Job",
            "Role",
            "RoleBinding",
            "ServiceAccount"
        ]
    );
    for hook in &hooks {
        let annotations = &hook["metadata"]["annotations"];
        assert_eq!(
            annotations["helm.sh/hook-delete-policy"], "before-hook-creation,hook-succeeded",
            "{hook}"
        );
        let weight: i32 = annotations["helm.sh/hook-weight"]
            .as_str()
            .expect("weight")
            .parse()
            .expect("a number");
        assert_eq!(
            weight < 0,
            hook["kind"] != "Job",
            "the ServiceAccount and RBAC before the Job: {hook}"
        );
    }
    let job = find(&docs, "Job", HOOK_SA);
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], HOOK_SA);
    assert_eq!(pod["restartPolicy"], "Never");
    let container = &pod["containers"][0];
    let deployment = find(&docs, "Deployment", OPERATOR);
    assert_eq!(
        container["image"],
        deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    );
    assert_eq!(
        container["securityContext"],
        deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"],
        "admitted wherever the operator is (restricted)"
    );
    let args = hook_args(job);
    assert_eq!(args[0], "release-finalizers");
    let selector = args
        .iter()
        .find_map(|a| a.strip_prefix("--operator-selector="))
        .expect("--operator-selector");
    let mut expected: Vec<String> = deployment["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().expect("label")))
        .collect();
    expected.sort();
    assert_eq!(selector, expected.join(","), "the operator's own pods");
    let own_labels = &job["spec"]["template"]["metadata"]["labels"];
    assert!(
        !expected.iter().all(|kv| {
            let (k, v) = kv.split_once('=').expect("k=v");
            own_labels[k] == v
        }),
        "the hook's pod must not match the selector it waits on: {own_labels}"
    );
    assert!(args.contains(&format!("--operator-deployment={OPERATOR}")));

    // Namespace mode: a Role per watched namespace, nothing cluster-wide.
    let scoped = documents(&template(&["--set", "watchNamespaces={plant,factory}"]));
    let scoped_hooks: Vec<&Value> = scoped.iter().filter(|d| is_hook(d)).collect();
    assert!(
        scoped_hooks
            .iter()
            .all(|d| !d["kind"].as_str().expect("kind").starts_with("Cluster")),
        "namespace mode: no cluster-wide rights for the hook"
    );
    for ns in ["plant", "factory"] {
        assert!(scoped_hooks.iter().any(|d| d["kind"] == "Role"
            && d["metadata"]["name"] == "ferry-uninstall-connections"
            && d["metadata"]["namespace"] == ns));
    }
    let env = &find(&scoped, "Job", HOOK_SA)["spec"]["template"]["spec"]["containers"][0]["env"];
    assert!(
        env.as_array()
            .expect("env")
            .iter()
            .any(|e| e["name"] == "FERRY_WATCH_NAMESPACES" && e["value"] == "plant,factory"),
        "{env}"
    );
    let off = documents(&template(&["--set", "uninstall.releaseFinalizers=false"]));
    assert!(
        !off.iter().any(is_hook),
        "uninstall.releaseFinalizers=false"
    );
}

fn hook_args(job: &Value) -> Vec<String> {
    job["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("arg").to_owned())
        .collect()
}

/// `release-finalizers` run as the hook's pod would (the Job's arguments, nothing but a token
/// of the hook's ServiceAccount with the chart's RBAC) against a real API server after `helm
/// install`: it stops the operator Deployment, then releases every connection, so that one
/// whose deletion hung without an operator completes; the forwarders stay until their
/// connection is deleted, then the garbage collector removes them; an operator started again
/// puts its finalizer back.
#[test]
fn uninstall_hook_releases_finalizers_so_connections_delete_without_the_operator() {
    let cp = ControlPlane::start().expect("control plane (run `bash e2e/k8s/build.sh` once)");
    for ns in [NAMESPACE, "plant"] {
        cp.run_kubectl(["create", "namespace", ns])
            .expect("namespace");
    }
    helm_install(&cp, &[]);
    let depot = secured_connection_in("depot", "plant").yaml();
    cp.run_kubectl_with_stdin(
        ["apply", "-f", "-"],
        &(connection_in("plant", true) + &depot),
    )
    .expect("connections plant and depot");

    // The operator (as the chart's ServiceAccount) takes both: finalizer and forwarders.
    let has_finalizer = |name: &str| {
        cp.run_kubectl([
            "get",
            "bc",
            name,
            "-n",
            "plant",
            "-o",
            "jsonpath={.metadata.finalizers}",
        ])
        .is_ok_and(|f| f.contains("ferry.dev/mqtt-sessions"))
    };
    let annotation = || {
        cp.run_kubectl([
            "get",
            "bc",
            "plant",
            "-n",
            "plant",
            "-o",
            "jsonpath={.metadata.annotations.ferry\\.dev/finalizer-released-at}",
        ])
        .expect("get bc")
    };
    let exists =
        |kind: &str, name: &str| cp.run_kubectl(["get", kind, name, "-n", "plant"]).is_ok();
    {
        let operator =
            SaOperator::start(&cp, "before-uninstall", &[("FERRY_LEADER_ELECT", "false")]);
        let log = operator.log_reader();
        wait_until(
            "the finalizers and forwarders",
            Duration::from_secs(60),
            WAIT_POLL,
            || {
                has_finalizer("plant")
                    && has_finalizer("depot")
                    && exists("statefulset", "plant-default")
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        drop(operator);
        eprintln!(
            "operator stopped; its log ends:\n{}",
            log().lines().rev().take(3).collect::<Vec<_>>().join("\n")
        );
    }
    // No operator: a deletion waits on the finalizer for ever (what the hook exists for).
    cp.run_kubectl(["delete", "bc", "depot", "-n", "plant", "--wait=false"])
        .expect("delete depot");
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        exists("bc", "depot"),
        "depot's deletion hangs without the operator"
    );

    // The hook's ServiceAccount and RBAC, as rendered; it may do what it does and no more.
    let docs = documents(&template(&[]));
    let hooks: Vec<Value> = docs.iter().filter(|d| is_hook(d)).cloned().collect();
    apply_rbac(&cp, &hooks);
    let sa = format!("system:serviceaccount:{NAMESPACE}:{HOOK_SA}");
    for args in [
        &["list", "brokerconnections.ferry.dev", "--all-namespaces"][..],
        &["patch", "brokerconnections.ferry.dev", "-n", "plant"],
        &[
            "patch",
            "deployments.apps/ferry-operator",
            "--subresource=scale",
            "-n",
            NAMESPACE,
        ],
        &["list", "pods", "-n", NAMESPACE],
    ] {
        assert!(can_i(&cp, &sa, args), "the hook needs: {args:?}");
    }
    for args in [
        &["get", "secrets", "-n", "plant"][..],
        &["list", "secrets", "-n", NAMESPACE],
        &["delete", "brokerconnections.ferry.dev", "-n", "plant"],
        &["update", "brokerconnections.ferry.dev", "-n", "plant"],
        &[
            "patch",
            "brokerconnections.ferry.dev",
            "--subresource=status",
            "-n",
            "plant",
        ],
        &["patch", "forwardingrules.ferry.dev", "-n", "plant"],
        &["patch", "deployments.apps/ferry-operator", "-n", NAMESPACE],
        &[
            "patch",
            "deployments.apps/other",
            "--subresource=scale",
            "-n",
            NAMESPACE,
        ],
        &["delete", "statefulsets.apps", "-n", "plant"],
        &["list", "pods", "-n", "plant"],
    ] {
        assert!(
            !can_i(&cp, &sa, args),
            "the hook must not be allowed: {args:?}"
        );
    }

    let job = find(&docs, "Job", HOOK_SA);
    let run_hook = |name: &str| {
        let config = sa_kubeconfig(&cp, HOOK_SA, name);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry-operator"));
        cmd.args(hook_args(job))
            .env("KUBECONFIG", &config)
            .env("POD_NAMESPACE", NAMESPACE)
            .env("FERRY_LOG", "info");
        let started = Instant::now();
        let out = run(cmd, None);
        let text = output_text(&out);
        eprintln!("release-finalizers in {:.1?}:\n{text}", started.elapsed());
        assert!(out.status.success(), "release-finalizers failed:\n{text}");
        text
    };
    let text = run_hook("hook");
    assert!(
        text.contains("plant/plant") && text.contains("plant/depot"),
        "{text}"
    );
    assert_eq!(
        cp.run_kubectl([
            "get",
            "deployment",
            OPERATOR,
            "-n",
            NAMESPACE,
            "-o",
            "jsonpath={.spec.replicas}",
        ])
        .expect("deployment"),
        "0",
        "the operator is stopped first"
    );
    wait_until(
        "depot's deletion to complete",
        Duration::from_secs(30),
        WAIT_POLL,
        || !exists("bc", "depot"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(!has_finalizer("plant"), "released");
    assert!(
        annotation().parse::<jiff::Timestamp>().is_ok(),
        "marked with the time: {:?}",
        annotation()
    );
    assert!(
        exists("statefulset", "plant-default"),
        "the forwarders keep running until their connection is deleted"
    );

    // An operator installed again takes the connection back.
    {
        let _operator = SaOperator::start(&cp, "reinstalled", &[("FERRY_LEADER_ELECT", "false")]);
        wait_until(
            "the finalizer back and the mark gone",
            Duration::from_secs(60),
            WAIT_POLL,
            || has_finalizer("plant") && annotation().is_empty(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    run_hook("hook-again");
    assert!(!has_finalizer("plant"));

    // Deleting the connection now completes with no operator. Its forwarders then go through
    // their owner references (reconcile.rs's deleting_the_connection_collects_its_children
    // waits for the garbage collector; here it would add its 30 s discovery resync).
    cp.run_kubectl(["delete", "bc", "plant", "-n", "plant", "--timeout=30s"])
        .expect("the released connection deletes without an operator");
}
