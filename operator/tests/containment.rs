//! One rule or setting cannot break its group or its connection: the operator binary against
//! a real kube-apiserver + controller-manager, and the real forwarder binary's `--check` on
//! what it rendered. `${...}` in a rule is rendered as written and means just that; a
//! librdkafka setting the forwarder could not start with is refused on the connection naming
//! the field, and what runs keeps its config; rules that do not fit their group (the
//! ConfigMap's 1 MiB) are refused on themselves while the group and the connection's other
//! groups are served; a group the API refuses to create fails alone.

use std::process::Command;
use std::time::Duration;

use common::{Operator, Scene, WAIT};
use ferry_e2e::manifests::{Connection, Rule};
use serde_json::json;

mod common;

const NS: &str = "ferry";
/// A failed reconcile is retried after at most 5 minutes (the operator's backoff cap), plus
/// one reconcile.
const RETRY_CAP: Duration = Duration::from_secs(330);
/// The CRD's longest expression (`ferry_api::expr::MAX_LEN`).
const MAX_EXPRESSION: usize = 4096;

/// Connection `plant`, its MQTT credentials in Secret `mqtt-credentials`.
fn connection() -> Connection {
    Connection::svc("plant", NS)
        .namespace(NS)
        .credentials_secret("mqtt-credentials")
}

fn rule(name: &str, group: &str, filters: &[&str], topic: &str) -> String {
    Rule::new(name, "plant")
        .namespace(NS)
        .group(group)
        .topics(filters)
        .kafka_topic(topic)
        .yaml()
}

/// A rule whose expressions are all of the CRD's maximum length: filter, topic, key and
/// transform, and 25 headers. About 119 KB in the config: 8 fit a 1 MiB ConfigMap, a 9th
/// does not.
fn maximum_size_rule(name: &str, group: &str) -> String {
    let literal = |fill: &str, rest: &str| {
        format!("'{}'{rest}", fill.repeat(MAX_EXPRESSION - rest.len() - 2))
    };
    let headers: serde_json::Map<String, serde_json::Value> = (0..25)
        .map(|i| (format!("h{i:02}"), json!(literal("h", " + topic"))))
        .collect();
    let rule = Rule::new(name, "plant")
        .namespace(NS)
        .group(group)
        .topics(&[&format!("{name}/#")])
        .filter(&literal("f", " != topic"))
        .set(
            "/spec/kafka",
            json!({
                "topicExpression": literal("t", " + topic"),
                "key": { "strategy": "expression", "expression": literal("k", " + topic") },
                "headers": { "expressions": headers },
            }),
        )
        .set("/spec/payloadTransform", json!(literal("p", " + topic")));
    // Plain JSON, not a YAML document: kubectl's JSON decoder reads the ~119 KB object.
    rule.json().to_string()
}

#[test]
fn one_rule_or_setting_breaks_neither_its_group_nor_its_connection() {
    let cp = common::control_plane_with_crds(NS);
    let op = Operator::start(&cp, "operator", &[]);
    let s = Scene::new(&cp, &op, NS);
    s.apply(
        "apiVersion: v1\nkind: Secret\nmetadata: { name: mqtt-credentials, namespace: ferry, labels: { ferry.dev/broker-credentials: \"true\" } }\n\
         stringData: { username: ferry, password: pw }\n",
    );
    s.apply(&connection().yaml());
    s.apply(&rule("temps", "default", &["plant/+/temp"], "temps"));
    s.apply(&rule("audit", "analytics", &["plant/#"], "audit"));
    s.wait_accepted("temps", "True");
    s.wait_accepted("audit", "True");

    dollar_braces_are_rendered_as_written_and_the_forwarder_accepts_them(&s);
    a_setting_librdkafka_refuses_is_refused_on_the_connection(&s);
    rules_past_the_configmaps_bytes_are_refused_on_themselves(&s);
    a_group_the_api_refuses_fails_alone(&s);
}

/// `${HOME}` and an unset `${TENANT_X}` in filters: accepted, rendered as written, and the
/// real forwarder, started as the pod template starts it, accepts the group's config with them
/// as written (before, the pods substituted them: another filter, or a refused config and a
/// crash loop).
fn dollar_braces_are_rendered_as_written_and_the_forwarder_accepts_them(s: &Scene) {
    s.apply(&rule(
        "tenant",
        "default",
        &["c/${HOME}/x", "c/${TENANT_X}/x"],
        "tenant",
    ));
    s.wait_accepted("tenant", "True");
    s.op.wait_for("the filters in group default's config", WAIT, || {
        s.get("configmap", "plant-default", "{.data.config\\.yaml}")
            .contains("c/${TENANT_X}/x")
    });
    let config = s.get("configmap", "plant-default", "{.data.config\\.yaml}");
    assert!(config.contains("c/${HOME}/x"), "{config}");
    assert!(!config.contains("${POD_"), "no template: {config}");
    let (code, stdout, stderr) = forwarder_check(s, "plant-default", "plant-default-0", &config);
    assert_eq!(code, Some(0), "the forwarder refuses it: {stderr}");
    assert!(stdout.contains("valid (2 rules)"), "{stdout}");
}

/// Runs the forwarder binary with `--check` and the arguments of StatefulSet `workload`'s
/// container (Kubernetes' `$(VAR)` expanded for pod `pod`), on `config`; its environment has
/// `HOME` and not `TENANT_X`, as a pod's might, and the credential files where the pod's
/// Secret volume has them. Returns (exit code, stdout, stderr).
fn forwarder_check(
    s: &Scene,
    workload: &str,
    pod: &str,
    config: &str,
) -> (Option<i32>, String, String) {
    let dir = s.cp.dir().join(pod);
    std::fs::create_dir_all(&dir).expect("dir");
    // The credentials where the pod's Secret volume would put them (the test's Secret).
    let credentials = dir.join("credentials");
    std::fs::create_dir_all(&credentials).expect("dir");
    std::fs::write(credentials.join("mqtt-username"), "ferry").expect("username");
    std::fs::write(credentials.join("mqtt-password"), "pw").expect("password");
    let config = config.replace(
        "/etc/ferry/credentials/",
        &format!("{}/", credentials.display()),
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, config).expect("config");
    let args = common::forwarder_args(s.cp, NS, workload, pod, &path);
    assert!(
        args.iter().any(|a| a == "--no-env-substitution"),
        "{args:?}"
    );
    let out = Command::new(common::forwarder_binary())
        .arg("--check")
        .args(args)
        .env("HOME", "/home/nonroot")
        .env_remove("TENANT_X")
        .output()
        .expect("run the forwarder");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `max.in.flight.requests.per.connection: 6` passes the CRD but librdkafka refuses to create
/// an idempotent producer with it: the connection says so naming the field, an Event too, and
/// the running groups keep their config; taking it out heals the connection.
fn a_setting_librdkafka_refuses_is_refused_on_the_connection(s: &Scene) {
    let before = s.get("configmap", "plant-default", "{.data.config\\.yaml}");
    let bad = connection().set(
        "/spec/kafka/config",
        json!({ "max.in.flight.requests.per.connection": "6" }),
    );
    s.apply(&bad.yaml());
    s.op.wait_for("the connection refused", WAIT, || {
        s.cond("bc", "plant", "Ready").1 == "InvalidSpec"
    });
    let (status, _, message) = s.cond("bc", "plant", "Ready");
    assert_eq!(status, "False");
    assert!(
        message.contains(
            "spec.kafka.config.max.in.flight.requests.per.connection: librdkafka refuses to create a producer with it"
        ) && message.contains("enable.idempotence"),
        "{message}"
    );
    let events = s.events("plant");
    assert!(
        events.contains("InvalidSpec: ")
            && events.contains("spec.kafka.config.max.in.flight.requests.per.connection"),
        "{events}"
    );
    assert_eq!(
        s.get("configmap", "plant-default", "{.data.config\\.yaml}"),
        before,
        "nothing is rendered from a refused spec"
    );
    assert_eq!(s.cond("fr", "temps", "Accepted").0, "True");
    s.apply(&connection().yaml());
    s.op.wait_for("the connection healed", WAIT, || {
        let (_, reason, _) = s.cond("bc", "plant", "Ready");
        !reason.is_empty() && reason != "InvalidSpec"
    });
}

/// Nine rules of maximum size in group `big`: 8 fit its ConfigMap and are served, the newest
/// is refused on itself (GroupFull, an Event), and the connection's other groups keep being
/// reconciled: a rule added to group `default` afterwards is rendered and accepted.
fn rules_past_the_configmaps_bytes_are_refused_on_themselves(s: &Scene) {
    for i in 1..=9 {
        s.apply(&maximum_size_rule(&format!("big{i}"), "big"));
        // Creation order decides which rules keep their place: one second apart.
        std::thread::sleep(Duration::from_millis(1100));
    }
    for i in 1..=8 {
        s.wait_accepted(&format!("big{i}"), "True");
    }
    s.wait_accepted("big9", "False");
    let (_, reason, message) = s.cond("fr", "big9", "Accepted");
    assert_eq!(reason, "GroupFull", "{message}");
    assert!(
        message.contains("its 8 older rules take") && message.contains("spec.group"),
        "{message}"
    );
    assert!(
        s.events("big9").contains("GroupFull: "),
        "{}",
        s.events("big9")
    );
    let config = s.get("configmap", "plant-big", "{.data.config\\.yaml}");
    assert!(
        config.len() <= 1024 * 1024 && config.contains("name: big8") && !config.contains("big9"),
        "{} bytes",
        config.len()
    );
    s.apply(&rule("late", "default", &["plant/+/late"], "late"));
    s.wait_accepted("late", "True");
    for neighbour in ["temps", "tenant", "audit", "big1"] {
        assert_eq!(s.cond("fr", neighbour, "Accepted").0, "True", "{neighbour}");
    }
    s.op.wait_for("group default's config with the new rule", WAIT, || {
        s.get("configmap", "plant-default", "{.data.config\\.yaml}")
            .contains("name: late")
    });
}

/// A quota leaves room for no more ConfigMaps: a new group's children are refused by the API.
/// That group's rule says so; the connection's other groups, their rules and new rules in
/// them are still reconciled.
fn a_group_the_api_refuses_fails_alone(s: &Scene) {
    let used =
        s.cp.run_kubectl(["get", "configmaps", "-n", NS, "-o", "name"])
            .expect("configmaps")
            .lines()
            .count();
    s.apply(&format!(
        "apiVersion: v1\nkind: ResourceQuota\nmetadata: {{ name: configmaps, namespace: ferry }}\n\
         spec: {{ hard: {{ count/configmaps: \"{used}\" }} }}\n"
    ));
    s.op.wait_for("the quota's usage counted", WAIT, || {
        !s.get("resourcequota", "configmaps", "{.status.used}")
            .is_empty()
    });
    s.apply(&rule("extra", "extra", &["extra/#"], "extra"));
    s.op.wait_for("rule extra refused by its group's apply", WAIT, || {
        s.cond("fr", "extra", "Accepted").1 == "GroupNotApplied"
    });
    let (_, _, message) = s.cond("fr", "extra", "Accepted");
    assert!(
        message.contains("group \"extra\"") && message.contains("exceeded quota"),
        "{message}"
    );
    // Counted under the step that failed, on the connection's reconcile.
    let apply_errors =
        s.op.metric("ferry_operator_reconcile_errors_total", "reason=\"apply\"");
    assert!(
        apply_errors.is_some_and(|n| n >= 1.0),
        "the refused apply counted as reason apply: {apply_errors:?}"
    );
    s.apply(&rule("later", "default", &["plant/+/later"], "later"));
    s.wait_accepted("later", "True");
    s.op.wait_for(
        "group default's config with the rule added after",
        WAIT,
        || {
            s.get("configmap", "plant-default", "{.data.config\\.yaml}")
                .contains("name: later")
        },
    );
    for neighbour in ["temps", "tenant", "late", "audit", "big8"] {
        assert_eq!(s.cond("fr", neighbour, "Accepted").0, "True", "{neighbour}");
    }
    // The quota lifted, the group is created on the retry.
    s.cp.run_kubectl(["delete", "resourcequota", "configmaps", "-n", NS])
        .expect("delete the quota");
    s.op.wait_for(
        "rule extra accepted once its group is applied, on the retry",
        RETRY_CAP,
        || s.cond("fr", "extra", "Accepted").0 == "True",
    );
    assert!(
        !s.get("statefulset", "plant-extra", "{.metadata.name}")
            .is_empty()
    );
}
