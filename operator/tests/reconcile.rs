//! The operator binary against a real kube-apiserver + controller-manager: rules become
//! forwarder StatefulSets per group, edits change the config, emptied groups are pruned, a
//! missing Secret is a condition naming it until it exists, refused rules say why.

use std::time::{Duration, Instant};

use common::{Operator, Scene, WAIT, condition, jsonpath};
use ferry_e2e::manifests::{Connection, Rule};
use serde_json::json;

mod common;

/// The garbage collector may wait for its discovery resync (30 s) to learn a CRD that was
/// installed moments before.
const GC_WAIT: Duration = Duration::from_secs(120);

/// Connection `plant`, its MQTT credentials in Secret `mqtt-credentials`.
fn connection() -> Connection {
    Connection::svc("plant", "ferry")
        .namespace("ferry")
        .credentials_secret("mqtt-credentials")
}

/// Rule `name` of connection `plant` in `group`: `filter` to Kafka topic `topic`.
fn rule(name: &str, group: &str, filter: &str, topic: &str) -> Rule {
    Rule::new(name, "plant")
        .namespace("ferry")
        .group(group)
        .topics(&[filter])
        .kafka_topic(topic)
}

#[test]
fn rules_become_one_forwarder_per_group_and_follow_edits_deletions_and_secrets() {
    let cp = common::control_plane_with_crds("ferry");
    let op = Operator::start(&cp, "operator", &[]);
    let s = Scene::new(&cp, &op, "ferry");
    missing_secret_is_a_condition_and_nothing_renders(&s);
    an_unmarked_secret_is_not_used(&s);
    the_secret_renders_one_forwarder_per_group(&s);
    let temps_accepted_at = conditions_heal(&s);
    refused_rules_say_why(&s, &temps_accepted_at);
    let restart_checksum = an_edit_is_reloaded_live(&s);
    an_emptied_group_is_pruned(&s);
    a_rotated_secret_rolls_the_forwarders(&s, &restart_checksum);
    argo_cd_reads_scaled_to_zero_ready_and_deleting(&s);
    deleting_the_connection_collects_its_children(&s);
}

/// The control plane and operator of one scenario, and what its steps ask of them.
/// What these tests ask of the objects besides [`Scene`]'s.
trait ReconcileScene {
    fn argo_health(&self, kind: &str, name: &str) -> (String, String);
    fn config(&self, name: &str) -> String;
    fn restart_checksum(&self) -> String;
    fn accepted_at(&self, rule: &str) -> String;
}

impl ReconcileScene for Scene<'_> {
    /// What the chart's Argo CD health check makes of the object as the API server has it.
    fn argo_health(&self, kind: &str, name: &str) -> (String, String) {
        let json = self
            .cp
            .run_kubectl(["get", kind, name, "-n", self.ns, "-o", "json"])
            .unwrap_or_else(|e| panic!("get {kind} {name}: {e}"));
        let object: serde_json::Value = serde_json::from_str(&json).expect("JSON");
        argo_health(&object)
    }

    /// A forwarder group's rendered config.
    fn config(&self, name: &str) -> String {
        self.get("configmap", name, "{.data.config\\.yaml}")
    }

    /// The pod template's restart checksum of group default (never empty).
    fn restart_checksum(&self) -> String {
        let checksum = self.get(
            "statefulset",
            "plant-default",
            "{.spec.template.metadata.annotations.ferry\\.dev/restart-checksum}",
        );
        assert!(
            !checksum.is_empty(),
            "plant-default has no restart checksum"
        );
        checksum
    }

    /// When a rule's Accepted condition last changed.
    fn accepted_at(&self, rule: &str) -> String {
        self.get(
            "fr",
            rule,
            "{.status.conditions[?(@.type==\"Accepted\")].lastTransitionTime}",
        )
    }
}

/// Runs the chart's Argo CD health check of `object`'s kind (`charts/ferry/argocd/`) with Lua
/// 5.4, as Argo CD does: the script's body with `obj` bound. Returns (status, message).
fn argo_health(object: &serde_json::Value) -> (String, String) {
    let kind = object["kind"].as_str().expect("kind");
    let path = format!(
        "{}/../charts/ferry/argocd/ferry.dev_{kind}.lua",
        env!("CARGO_MANIFEST_DIR")
    );
    let check = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let script = format!(
        "local function health(obj)\n{check}\nend\nlocal hs = health({})\nio.write(hs.status, '\\n', hs.message or '')\n",
        lua_value(object)
    );
    let mut lua = std::process::Command::new("lua5.4")
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("lua5.4 (make deps installs it)");
    use std::io::Write as _;
    lua.stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("write the script");
    let out = lua.wait_with_output().expect("lua5.4 runs");
    assert!(
        out.status.success(),
        "{path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (status, message) = text.split_once('\n').expect("status and message");
    // The Flux example's health expressions say the same of every object Argo CD is asked
    // about (Suspended is stopped on purpose: Current for Flux, which has no such state). A
    // deletion is Argo CD's alone: Flux does not health-check what it is deleting.
    if object["metadata"]["deletionTimestamp"].is_null() {
        let expected = match status {
            "Healthy" | "Suspended" => "Current",
            "Progressing" => "InProgress",
            "Degraded" => "Failed",
            other => panic!("Argo CD health {other}"),
        };
        assert_eq!(
            flux_health(object),
            expected,
            "examples/gitops/flux.yaml's healthCheckExprs disagree with Argo CD's {status} ({message}) on {object}"
        );
    }
    (status.to_owned(), message.to_owned())
}

/// What Flux's kustomize-controller makes of `object` with the `healthCheckExprs` of
/// `examples/gitops/flux.yaml` (RFC 0009, fluxcd/pkg runtime/cel): InProgress while
/// `status.observedGeneration` lags `metadata.generation`; then the first of inProgress,
/// failed, current that is true; else InProgress. The object's top-level fields are the
/// variables, as there. Evaluated with the workspace's CEL (the `cel` crate; Flux uses cel-go).
fn flux_health(object: &serde_json::Value) -> &'static str {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/gitops/flux.yaml");
    let text = std::fs::read_to_string(path).expect("examples/gitops/flux.yaml");
    let kustomization = text
        .split("\n---")
        .map(|d| serde_saphyr::from_str::<serde_json::Value>(d).expect("flux.yaml parses"))
        .find(|d| d["kind"] == "Kustomization")
        .expect("a Kustomization in flux.yaml");
    let check = kustomization["spec"]["healthCheckExprs"]
        .as_array()
        .expect("healthCheckExprs")
        .iter()
        .find(|c| c["kind"] == object["kind"] && c["apiVersion"] == object["apiVersion"])
        .unwrap_or_else(|| panic!("no healthCheckExprs for {}", object["kind"]));
    if object["status"].is_null() {
        // No status yet: cel-go cannot resolve `status`, and Flux keeps waiting (Unknown).
        return "InProgress";
    }
    let observed = &object["status"]["observedGeneration"];
    if !observed.is_null() && *observed != object["metadata"]["generation"] {
        return "InProgress";
    }
    let mut context = cel::Context::default();
    for (name, value) in object.as_object().expect("an object") {
        context
            .add_variable(name.as_str(), value)
            .expect("a CEL variable");
    }
    for (field, health) in [
        ("inProgress", "InProgress"),
        ("failed", "Failed"),
        ("current", "Current"),
    ] {
        let Some(expr) = check[field].as_str() else {
            continue;
        };
        let program =
            cel::Program::compile(expr).unwrap_or_else(|e| panic!("{field}: {expr}: {e}"));
        match program.execute(&context) {
            Ok(cel::Value::Bool(true)) => return health,
            Ok(cel::Value::Bool(false)) => {}
            other => panic!("{field}: {expr} on {object}: {other:?}"),
        }
    }
    "InProgress"
}

/// `value` as a Lua table constructor, as Argo CD hands an object to a health check (JSON null
/// is nil: the key is absent).
fn lua_value(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "nil".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        // Rust's escapes (\", \\, \n, \u{..}) are Lua 5.4's too.
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(lua_value).collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("[{k:?}] = {}", lua_value(v)))
                .collect();
            format!("{{{}}}", fields.join(", "))
        }
    }
}

/// The connection names a Secret that does not exist yet: nothing is rendered, and the connection
/// and its rules say which Secret and field.
fn missing_secret_is_a_condition_and_nothing_renders(s: &Scene) {
    s.apply(&connection().yaml());
    s.apply(&rule("temps", "default", "plant/+/temp", "temps").yaml());
    s.apply(&rule("alarms", "default", "plant/+/alarm", "alarms").yaml());
    s.apply(&rule("audit", "analytics", "plant/#", "audit").yaml());
    s.op.wait_for("the missing Secret as a condition", WAIT, || {
        s.cond("bc", "plant", "SecretsResolved").0 == "False"
    });
    let (_, reason, message) = s.cond("bc", "plant", "SecretsResolved");
    assert_eq!(reason, "SecretMissing");
    assert!(
        message.contains("\"mqtt-credentials\"")
            && message.contains("spec.mqtt.credentialsSecretRef"),
        "the condition names the Secret and the field: {message}"
    );
    s.op.wait_for("the rules to say why they are not rendered", WAIT, || {
        s.cond("fr", "audit", "Accepted").1 == "SecretMissing"
    });
    assert!(
        s.cond("fr", "temps", "Accepted")
            .2
            .contains("mqtt-credentials")
    );
    let events =
        s.cp.run_kubectl([
            "get",
            "events",
            "-n",
            "ferry",
            "--field-selector",
            "involvedObject.name=plant",
            "-o",
            "jsonpath={range .items[*]}{.type} {.reason};{end}",
        ])
        .expect("events");
    assert!(events.contains("Warning SecretMissing"), "{events}");
    assert!(
        !s.exists("statefulset", "plant-default"),
        "rendered without its Secret"
    );
    s.op.wait_for("the rules' Ready to follow", WAIT, || {
        s.cond("fr", "temps", "Ready").1 == "NotAccepted"
            && s.cond("bc", "plant", "Ready").1 == "SecretMissing"
    });
    for (kind, name) in [("fr", "temps"), ("bc", "plant")] {
        let (health, message) = s.argo_health(kind, name);
        assert_eq!(health, "Degraded", "{kind} {name}: {message}");
        assert!(
            message.contains("mqtt-credentials"),
            "{kind} {name}: {message}"
        );
    }
}

/// A Secret without the mark `ferry.dev/broker-credentials: "true"` is not used: the connection
/// names it and the missing label, nothing is rendered, and its value appears in no status, Event
/// or ConfigMap. (Whoever may create a BrokerConnection must not be able to send a Secret to a
/// host of their choosing.)
fn an_unmarked_secret_is_not_used(s: &Scene) {
    s.cp.run_kubectl([
        "create",
        "secret",
        "generic",
        "mqtt-credentials",
        "-n",
        "ferry",
        "--from-literal=username=ferry",
        "--from-literal=password=s3cret",
    ])
    .expect("secret");
    s.op.wait_for("the unmarked Secret as a condition", WAIT, || {
        s.cond("bc", "plant", "SecretsResolved").1 == "SecretNotMarked"
    });
    let (status, _, message) = s.cond("bc", "plant", "SecretsResolved");
    assert_eq!(status, "False");
    assert!(
        message.contains("\"mqtt-credentials\"")
            && message.contains("spec.mqtt.credentialsSecretRef")
            && message.contains("ferry.dev/broker-credentials=\"true\""),
        "names the Secret, the field and the mark: {message}"
    );
    s.op.wait_for("the rules to say why they are not rendered", WAIT, || {
        s.cond("fr", "temps", "Accepted").2.contains("not marked")
    });
    let everything = [
        s.cp.run_kubectl(["get", "bc,fr", "-n", "ferry", "-o", "yaml"]),
        s.cp.run_kubectl(["get", "events,configmaps", "-n", "ferry", "-o", "yaml"]),
    ]
    .map(|r| r.expect("read back"))
    .join("\n");
    assert!(everything.contains("SecretNotMarked"), "{everything}");
    // The value, and its base64 as a Secret's data would carry it.
    for value in ["s3cret", "czNjcmV0"] {
        assert!(!everything.contains(value), "{value} leaked:\n{everything}");
    }
    assert!(!s.exists("statefulset", "plant-default"));
    assert!(!s.exists("secret", "plant-default"), "nothing copied");
}

/// Once the Secret is marked: one StatefulSet per group, each with its rules; no credentials in
/// the config.
fn the_secret_renders_one_forwarder_per_group(s: &Scene) {
    let started = Instant::now();
    s.cp.run_kubectl([
        "label",
        "secret",
        "mqtt-credentials",
        "-n",
        "ferry",
        "ferry.dev/broker-credentials=true",
    ])
    .expect("mark the secret");
    s.op.wait_for("two forwarder StatefulSets", WAIT, || {
        s.exists("statefulset", "plant-default") && s.exists("statefulset", "plant-analytics")
    });
    eprintln!(
        "Secret marked → 2 StatefulSets in {:.1?}",
        started.elapsed()
    );
    let listed =
        s.cp.run_kubectl(["get", "statefulsets", "-n", "ferry", "-o", "name"])
            .expect("list");
    assert_eq!(listed.lines().count(), 2, "{listed}");
    let default = s.config("plant-default");
    assert!(
        default.contains("plant/+/temp")
            && default.contains("plant/+/alarm")
            && !default.contains("plant/#"),
        "{default}"
    );
    assert!(s.config("plant-analytics").contains("plant/#"));
    assert!(
        !default.contains("s3cret"),
        "credentials stay in the Secret"
    );
}

/// Healed: the Secret resolves and every rule is accepted; Ready counts the forwarder pods. Returns
/// rule temps' Accepted transition time.
fn conditions_heal(s: &Scene) -> String {
    s.op.wait_for("the healed conditions", WAIT, || {
        s.cond("bc", "plant", "SecretsResolved").0 == "True"
            && s.cond("fr", "temps", "Accepted").0 == "True"
            && s.cond("fr", "audit", "Accepted").0 == "True"
    });
    let (status, reason, message) = s.cond("fr", "temps", "Ready");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ForwarderNotReady")
    );
    assert_eq!(message, "0/1 forwarder pods ready");
    assert_eq!(s.get("fr", "temps", "{.status.workload}"), "plant-default");
    assert_eq!(s.get("fr", "audit", "{.status.readyReplicas}"), "0/1");
    assert_eq!(s.cond("bc", "plant", "Ready").1, "ForwardersNotReady");
    // Pods starting: Argo CD waits, it does not call the rule or the connection broken.
    for (kind, name) in [("fr", "temps"), ("bc", "plant")] {
        assert_eq!(s.argo_health(kind, name).0, "Progressing", "{kind} {name}");
    }
    s.accepted_at("temps")
}

/// Rules that cannot be served say why; the rest of their group keeps its config.
fn refused_rules_say_why(s: &Scene, temps_accepted_at: &str) {
    s.apply(&rule("temps-copy", "default", "plant/+/temp", "temps").yaml());
    s.apply(&rule("deep", "default", "plant/x", "t.{5}").yaml());
    s.apply(
        &rule("resting", "quiet", "plant/quiet", "quiet")
            .set("/spec/paused", json!(true))
            .yaml(),
    );
    s.apply(
        &rule("stray", "default", "x/y", "stray")
            .set("/spec/connectionRef/name", json!("nowhere"))
            .yaml(),
    );
    s.apply(
        &rule("hot", "default", "plant/+/hot", "hot")
            .filter("json.temp >")
            .yaml(),
    );
    // Larger messages than its connection's (1 MiB by default) would never be read.
    s.apply(
        &rule("huge", "default", "plant/+/huge", "huge")
            .set("/spec/mqtt/maxMessageBytes", json!(2_097_152))
            .yaml(),
    );
    // A schema-encoded value without a dead-letter topic (its own or the connection's) or
    // onUnwritable: Drop: a value that does not fit the schema would hold the whole group.
    s.apply(
        &rule("encoded", "default", "plant/+/encoded", "encoded")
            .set("/spec/kafka/value", json!({ "format": "avro" }))
            .yaml(),
    );
    s.op.wait_for("the refused rules' conditions", WAIT, || {
        s.cond("fr", "temps-copy", "Accepted").1 == "Conflict"
            && s.cond("fr", "deep", "Accepted").1 == "Invalid"
            && s.cond("fr", "huge", "Accepted").1 == "Invalid"
            && s.cond("fr", "encoded", "Accepted").1 == "Invalid"
            && s.cond("fr", "hot", "Accepted").1 == "InvalidExpression"
            && s.cond("fr", "stray", "Accepted").1 == "ConnectionNotFound"
            && s.cond("fr", "resting", "Ready").1 == "Paused"
    });
    let conflict = s.cond("fr", "temps-copy", "Accepted").2;
    assert!(
        conflict.contains("temps"),
        "names the rule it conflicts with: {conflict}"
    );
    let invalid = s.cond("fr", "deep", "Accepted").2;
    assert!(
        invalid.contains("kafka.topic"),
        "names the field: {invalid}"
    );
    let huge = s.cond("fr", "huge", "Accepted").2;
    assert!(
        huge.contains("spec.mqtt.maxMessageBytes: 2097152 is over BrokerConnection \"plant\"'s spec.mqtt.maxMessageBytes (1048576)"),
        "names the field and the connection's limit: {huge}"
    );
    let encoded = s.cond("fr", "encoded", "Accepted").2;
    assert!(
        encoded.contains("spec.deadLetter: must be set (or BrokerConnection \"plant\"'s spec.deadLetter, or spec.onUnwritable: Drop) when spec.kafka.value is set")
            && encoded.contains("would otherwise hold every rule"),
        "names the field and why: {encoded}"
    );
    assert!(s.cond("fr", "stray", "Accepted").2.contains("\"nowhere\""));
    let (status, _, expression) = s.cond("fr", "hot", "Accepted");
    let e = ferry_api::expr::compile("json.temp >").expect_err("does not compile");
    let at = format!("line {}, column {}", e.line, e.column);
    assert!(
        status == "False" && expression.contains("spec.filter") && expression.contains(&at),
        "names the field and the position ({at}): {expression}"
    );
    // Paused on purpose: a Normal Event, never a Warning.
    s.op.wait_for("the paused rule's Event", WAIT, || {
        s.events("resting").contains("Normal Paused")
    });
    let resting = s.events("resting");
    assert!(!resting.contains("Warning"), "{resting}");
    events_sort_by_last_timestamp(s);
    assert_eq!(s.cond("fr", "deep", "Ready").1, "NotAccepted");
    assert_eq!(s.argo_health("fr", "deep").0, "Degraded");
    assert_eq!(s.argo_health("fr", "hot").0, "Degraded");
    assert_eq!(
        s.argo_health("fr", "resting").0,
        "Suspended",
        "paused on purpose"
    );
    let default = s.config("plant-default");
    assert!(
        !default.contains("t.{5}")
            && !default.contains("plant/+/huge")
            && !default.contains("plant/+/encoded")
            && !default.contains("temps-copy")
            && !default.contains("json.temp"),
        "{default}"
    );
    // A group whose only rule is paused runs no pods (a forwarder needs a rule).
    assert_eq!(s.get("statefulset", "plant-quiet", "{.spec.replicas}"), "0");
    assert_eq!(
        s.accepted_at("temps"),
        temps_accepted_at,
        "a condition that did not change keeps its transition time"
    );
}

/// Ferry's Events carry core/v1 `firstTimestamp`, `lastTimestamp` and `count`, so that
/// `kubectl get events --sort-by=.lastTimestamp` places them among everyone else's.
fn events_sort_by_last_timestamp(s: &Scene) {
    let listed = s
        .cp
        .run_kubectl([
            "get",
            "events",
            "-n",
            s.ns,
            "--sort-by=.lastTimestamp",
            "-o",
            "jsonpath={range .items[*]}{.lastTimestamp}|{.firstTimestamp}|{.count}|{.reportingComponent}|{.involvedObject.name}|{.reason}{\"\\n\"}{end}",
        ])
        .expect("kubectl get events --sort-by=.lastTimestamp");
    let rows: Vec<Vec<&str>> = listed.lines().map(|l| l.split('|').collect()).collect();
    let ours: Vec<&Vec<&str>> = rows.iter().filter(|r| r[3] == "ferry-operator").collect();
    assert!(ours.len() >= 3, "Ferry's Events:\n{listed}");
    for row in &ours {
        assert!(
            row[0].parse::<jiff::Timestamp>().is_ok()
                && row[1].parse::<jiff::Timestamp>().is_ok()
                && row[2].parse::<u32>().is_ok_and(|n| n >= 1),
            "lastTimestamp, firstTimestamp and count set: {row:?}\n{listed}"
        );
    }
    let times: Vec<jiff::Timestamp> = rows.iter().filter_map(|r| r[0].parse().ok()).collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "sorted by lastTimestamp:\n{listed}"
    );
    assert!(
        ours.iter()
            .any(|r| r[4] == "plant" && r[5] == "SecretMissing"),
        "{listed}"
    );
}

/// An edit changes the config, not the restart checksum; returns that checksum.
fn an_edit_is_reloaded_live(s: &Scene) -> String {
    let before = s.restart_checksum();
    s.apply(&rule("temps", "default", "plant/+/temp", "temperatures").yaml());
    s.op.wait_for("the edited config", WAIT, || {
        s.config("plant-default").contains("temperatures")
    });
    assert_eq!(
        s.restart_checksum(),
        before,
        "a rule edit is reloaded live, not rolled"
    );
    before
}

/// Emptying a group removes its forwarder and everything it owned.
fn an_emptied_group_is_pruned(s: &Scene) {
    s.cp.run_kubectl(["delete", "fr", "audit", "-n", "ferry"])
        .expect("delete rule");
    s.op.wait_for("the emptied group to be pruned", WAIT, || {
        !s.exists("statefulset", "plant-analytics") && !s.exists("configmap", "plant-analytics")
    });
    assert!(s.exists("statefulset", "plant-default"));
}

/// A rotated Secret rolls the forwarders that use it: its checksum is on the pod template.
fn a_rotated_secret_rolls_the_forwarders(s: &Scene, restart_checksum: &str) {
    let secret_checksum = || {
        s.get(
            "statefulset",
            "plant-default",
            "{.spec.template.metadata.annotations.ferry\\.dev/secret-checksum}",
        )
    };
    let secret_before = secret_checksum();
    assert!(!secret_before.is_empty());
    s.cp.run_kubectl([
        "patch",
        "secret",
        "mqtt-credentials",
        "-n",
        "ferry",
        "-p",
        r#"{"stringData":{"password":"rotated"}}"#,
    ])
    .expect("rotate secret");
    s.op.wait_for("the rotated Secret to reach the pod template", WAIT, || {
        secret_checksum() != secret_before
    });
    assert_eq!(
        s.restart_checksum(),
        restart_checksum,
        "connection settings did not change"
    );
    assert_eq!(
        s.get("secret", "plant-default", "{.data.mqtt-password}"),
        "cm90YXRlZA==",
        "the rendered Secret holds the new password (base64 of \"rotated\")"
    );
}

/// Deleting the connection: the garbage collector removes everything its groups owned.
/// The Argo CD health checks on what is left to see: a connection scaled to zero suspends its
/// rules; and, on the objects as written with what this control plane cannot show (no kubelet:
/// no pod gets ready; a deletion here completes at once), Ready True is Healthy and a
/// connection waiting on its finalizer is Progressing.
fn argo_cd_reads_scaled_to_zero_ready_and_deleting(s: &Scene) {
    s.cp.run_kubectl([
        "patch",
        "bc",
        "plant",
        "-n",
        "ferry",
        "--type=merge",
        "-p",
        r#"{"spec":{"forwarder":{"replicas":0}}}"#,
    ])
    .expect("scale to zero");
    s.op.wait_for("rules ScaledToZero", WAIT, || {
        s.cond("fr", "temps", "Ready").1 == "ScaledToZero"
            && s.cond("bc", "plant", "Ready").1 == "ScaledToZero"
    });
    assert_eq!(s.argo_health("fr", "temps").0, "Suspended");
    assert_eq!(s.argo_health("bc", "plant").0, "Suspended");

    let get = |kind: &str, name: &str| -> serde_json::Value {
        let json =
            s.cp.run_kubectl(["get", kind, name, "-n", "ferry", "-o", "json"])
                .expect("get");
        serde_json::from_str(&json).expect("JSON")
    };
    let mut rule = get("fr", "temps");
    for c in rule["status"]["conditions"]
        .as_array_mut()
        .expect("conditions")
    {
        if c["type"] == "Ready" {
            c["status"] = "True".into();
            c["reason"] = "ForwarderReady".into();
            c["message"] = "1/1 forwarder pods ready".into();
        }
    }
    assert_eq!(
        argo_health(&rule),
        ("Healthy".to_owned(), "1/1 forwarder pods ready".to_owned())
    );
    let mut connection = get("bc", "plant");
    connection["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
    let (health, message) = argo_health(&connection);
    assert_eq!(health, "Progressing");
    assert!(message.contains("MQTT sessions"), "{message}");
}

fn deleting_the_connection_collects_its_children(s: &Scene) {
    let started = Instant::now();
    s.cp.run_kubectl(["delete", "bc", "plant", "-n", "ferry", "--wait=false"])
        .expect("delete connection");
    s.op.wait_for("the connection's children to be collected", GC_WAIT, || {
        [
            "statefulset",
            "configmap",
            "secret",
            "service",
            "poddisruptionbudget",
        ]
        .iter()
        .all(|kind| {
            s.cp.run_kubectl([
                "get",
                kind,
                "-n",
                "ferry",
                "-l",
                "ferry.dev/connection=plant",
                "-o",
                "name",
            ])
            .is_ok_and(|out| out.trim().is_empty())
        })
    });
    eprintln!(
        "connection deleted → its children collected in {:.1?}",
        started.elapsed()
    );
}

#[test]
fn the_kubernetes_examples_apply_and_render_as_documented() {
    let cp = common::control_plane_with_crds("ferry");
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/kubernetes/");
    // The Secrets are not among the examples (GitOps must never sync placeholders): created
    // out of band as connection.yaml says.
    for name in ["mqtt-credentials", "kafka-credentials"] {
        cp.run_kubectl([
            "create",
            "secret",
            "generic",
            name,
            "-n",
            "ferry",
            "--from-literal=username=ferry",
            "--from-literal=password=change-me",
        ])
        .expect("create secret");
        cp.run_kubectl([
            "label",
            "secret",
            name,
            "-n",
            "ferry",
            "ferry.dev/broker-credentials=true",
        ])
        .expect("label secret");
    }
    let start = Instant::now();
    while let Err(e) = cp.run_kubectl(["apply", "-n", "ferry", "-f", examples]) {
        assert!(
            start.elapsed() < Duration::from_secs(20) && e.to_string().contains("no matches"),
            "the examples apply: {e}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let op = Operator::start(&cp, "operator", &["--leader-elect", "false"]);
    let cond =
        |name: &str, type_: &str| condition(&cp, "ferry", "fr", name, type_).unwrap_or_default();
    op.wait_for("every example rule accepted", WAIT, || {
        [
            "telemetry",
            "alarms",
            "legacy-json",
            "audit",
            "devices",
            "readings",
            "readings-avro",
        ]
        .iter()
        .all(|r| cond(r, "Accepted").0 == "True")
    });
    assert_eq!(cond("audit", "Ready").1, "Paused");
    let config = jsonpath(
        &cp,
        "ferry",
        "configmap",
        "plant-default",
        "{.data.config\\.yaml}",
    );
    for expected in [
        "telemetry.{1}",
        "plant/+/alarm/#",
        "wrapped_json",
        "ferry.dead-letters",
        "zstd",
    ] {
        assert!(config.contains(expected), "{expected} in\n{config}");
    }
    assert!(!config.contains("change-me"), "no password in the config");
    // The CEL examples, in a group of their own, rendered into its forwarder config.
    let group_config = |group: &str| -> (String, ferry_api::ForwarderConfig) {
        let text = jsonpath(&cp, "ferry", "configmap", group, "{.data.config\\.yaml}");
        let parsed = serde_saphyr::from_str(&text)
            .unwrap_or_else(|e| panic!("the config of {group} parses: {e}\n{text}"));
        (text, parsed)
    };
    let (json_group, rendered) = group_config("plant-json");
    let rule = |name: &str| {
        rendered
            .rules
            .iter()
            .find(|r| r.name.ends_with(name))
            .unwrap_or_else(|| panic!("rule {name} in\n{json_group}"))
    };
    assert_eq!(
        rule("devices").kafka.key,
        ferry_api::KeyStrategy::Expression("json.device".into())
    );
    let readings = rule("readings");
    assert_eq!(readings.filter.as_deref(), Some("json.type != 'heartbeat'"));
    assert_eq!(
        readings.kafka.topic_expression.as_deref(),
        Some("'readings.' + levels[1]")
    );
    assert!(matches!(
        readings.payload,
        ferry_api::PayloadFormat::Transform(_)
    ));
    // The Avro example, in a group of its own, encodes through the connection's registry.
    let (_, rendered) = group_config("plant-avro");
    let value = rendered.rules.iter().find_map(|r| r.kafka.value.clone());
    assert_eq!(
        value.map(|v| (v.format, v.subject)),
        Some((
            ferry_api::SchemaFormat::Avro,
            "readings-avro-value".to_owned()
        ))
    );
    assert_eq!(
        rendered.schema_registry.map(|r| r.url),
        Some("http://schema-registry.kafka.svc.cluster.local:8081".to_owned())
    );
    // `kubectl get fr`'s Kafka Topic column: the topic, or the expression that names it.
    let column = |name: &str| jsonpath(&cp, "ferry", "fr", name, "{.status.kafkaTopic}");
    assert_eq!(column("readings"), "'readings.' + levels[1]");
    assert_eq!(column("devices"), "devices");
    let table = cp
        .run_kubectl(["get", "fr", "readings", "-n", "ferry"])
        .expect("kubectl get fr");
    assert!(
        table.contains("KAFKA TOPIC") && table.contains("'readings.' + levels[1]"),
        "{table}"
    );
    assert_eq!(
        jsonpath(
            &cp,
            "ferry",
            "statefulset",
            "plant-default",
            "{.spec.replicas}"
        ),
        "2"
    );
    assert_eq!(
        jsonpath(
            &cp,
            "ferry",
            "statefulset",
            "plant-audit",
            "{.spec.replicas}"
        ),
        "0",
        "a group of paused rules runs no pods"
    );
    let shown = cp
        .run_kubectl(["get", "bc,fr", "-n", "ferry"])
        .expect("kubectl get");
    eprintln!("kubectl get bc,fr -n ferry\n{shown}");
}

/// Private registries: the operator's `--forwarder-image*` flags apply to a connection that
/// names no image; a connection's `spec.forwarder.image`, `imagePullPolicy` and
/// `imagePullSecrets` win, and editing them rolls its forwarders onto the new image.
#[test]
fn forwarder_images_and_resources_come_from_the_operator_unless_the_connection_overrides_them() {
    let cp = common::control_plane_with_crds("ferry");
    let op = Operator::start(
        &cp,
        "operator",
        &[
            "--forwarder-image",
            "registry.example.com:5000/team/ferry-forwarder",
            "--forwarder-image-pull-secrets",
            "regcred",
        ],
    );
    let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
    let connection = |name: &str, forwarder: serde_json::Value| {
        Connection::svc(name, "ferry")
            .namespace("ferry")
            .set("/spec/forwarder", forwarder)
            .yaml()
    };
    common::apply(&cp, &connection("plant", json!({})));
    let mirrored = |image: &str| {
        let resources = json!({ "cpu": "100m", "memory": "128Mi" });
        connection(
            "mirror",
            json!({
                "image": image,
                "imagePullPolicy": "Always",
                "imagePullSecrets": [{ "name": "mirror-cred" }],
                "resources": { "requests": resources, "limits": resources },
            }),
        )
    };
    common::apply(
        &cp,
        &mirrored(&format!("mirror.example/iot/ferry-forwarder@{digest}")),
    );
    for connection in ["plant", "mirror"] {
        common::apply(
            &cp,
            &rule(connection, "default", "plant/+/temp", "temps")
                .set("/spec/connectionRef/name", json!(connection))
                .yaml(),
        );
    }
    // (image, imagePullPolicy, imagePullSecrets) of a forwarder StatefulSet's pods.
    let image_of = |sts: &str| {
        let get = |path: &str| jsonpath(&cp, "ferry", "statefulset", sts, path);
        (
            get("{.spec.template.spec.containers[0].image}"),
            get("{.spec.template.spec.containers[0].imagePullPolicy}"),
            get("{.spec.template.spec.imagePullSecrets[*].name}"),
        )
    };
    op.wait_for("both connections' forwarders", WAIT, || {
        !image_of("plant-default").0.is_empty() && !image_of("mirror-default").0.is_empty()
    });
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        image_of("plant-default"),
        (
            format!("registry.example.com:5000/team/ferry-forwarder:{version}"),
            // Not set by the operator: the API server's default for a tagged image.
            "IfNotPresent".to_owned(),
            "regcred".to_owned()
        ),
        "the operator's flags, its version as the tag"
    );
    assert_eq!(
        image_of("mirror-default"),
        (
            format!("mirror.example/iot/ferry-forwarder@{digest}"),
            "Always".to_owned(),
            "mirror-cred".to_owned()
        ),
        "the connection's override"
    );
    // The API server classes the pods the StatefulSet controller creates: the default requests
    // keep them out of BestEffort (evicted first); the connection's own resources win.
    let qos = |pod: &str| jsonpath(&cp, "ferry", "pod", pod, "{.status.qosClass}");
    op.wait_for("the forwarder pods", WAIT, || {
        !qos("plant-default-0").is_empty() && !qos("mirror-default-0").is_empty()
    });
    assert_eq!(qos("plant-default-0"), "Burstable");
    assert_eq!(qos("mirror-default-0"), "Guaranteed");

    common::apply(&cp, &mirrored("mirror.example/iot/ferry-forwarder:0.2.0"));
    op.wait_for("the edited image", WAIT, || {
        image_of("mirror-default").0 == "mirror.example/iot/ferry-forwarder:0.2.0"
    });
    assert_eq!(
        image_of("plant-default").0,
        format!("registry.example.com:5000/team/ferry-forwarder:{version}"),
        "another connection's edit leaves this one alone"
    );
}

/// `--forwarder-network-policy`: each group gets a NetworkPolicy selecting exactly its pods,
/// letting only the operator's pods (its namespace and labels) and the metrics sources reach
/// port 8080, egress left open; owned by the connection, and pruned with its group.
#[test]
fn forwarder_network_policies_admit_only_the_operator_and_the_metrics_sources() {
    let cp = common::control_plane_with_crds("ferry");
    let metrics_from =
        r#"[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#;
    let op = Operator::start(
        &cp,
        "operator",
        &[
            "--forwarder-network-policy",
            "true",
            "--operator-namespace",
            "ferry-system",
            "--operator-pod-labels",
            "app.kubernetes.io/name=ferry,app.kubernetes.io/component=operator",
            "--forwarder-metrics-from",
            metrics_from,
        ],
    );
    common::apply(
        &cp,
        &Connection::svc("plant", "ferry").namespace("ferry").yaml(),
    );
    common::apply(
        &cp,
        &rule("temps", "default", "plant/+/temp", "temps").yaml(),
    );
    common::apply(&cp, &rule("audit", "analytics", "plant/#", "audit").yaml());
    let get = |kind: &str, name: &str| -> Option<serde_json::Value> {
        let json = cp
            .run_kubectl(["get", kind, name, "-n", "ferry", "-o", "json"])
            .ok()?;
        serde_json::from_str(&json).ok()
    };
    op.wait_for("both groups' NetworkPolicies", WAIT, || {
        get("networkpolicy", "plant-default").is_some()
            && get("networkpolicy", "plant-analytics").is_some()
    });
    let policy = get("networkpolicy", "plant-default").expect("policy");
    let set = get("statefulset", "plant-default").expect("StatefulSet");
    assert_eq!(
        policy["spec"]["podSelector"], set["spec"]["selector"],
        "exactly the group's pods"
    );
    assert_eq!(
        policy["spec"]["policyTypes"],
        serde_json::json!(["Ingress"])
    );
    assert!(policy["spec"]["egress"].is_null(), "egress open: {policy}");
    let ingress = policy["spec"]["ingress"].as_array().expect("ingress");
    assert_eq!(ingress.len(), 1, "{policy}");
    assert_eq!(
        ingress[0]["ports"],
        serde_json::json!([{ "port": 8080, "protocol": "TCP" }])
    );
    let metrics: serde_json::Value = serde_json::from_str(metrics_from).expect("JSON");
    assert_eq!(
        ingress[0]["from"],
        serde_json::json!([
            {
                "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": "ferry-system" } },
                "podSelector": { "matchLabels": {
                    "app.kubernetes.io/name": "ferry",
                    "app.kubernetes.io/component": "operator"
                } }
            },
            metrics[0]
        ]),
        "the operator's pods and the metrics sources, nobody else"
    );
    let owner = &policy["metadata"]["ownerReferences"][0];
    assert_eq!(
        (&owner["kind"], &owner["name"], &owner["controller"]),
        (
            &serde_json::json!("BrokerConnection"),
            &serde_json::json!("plant"),
            &serde_json::json!(true)
        ),
        "owned by the connection: deleted with it"
    );

    cp.run_kubectl(["delete", "fr", "audit", "-n", "ferry"])
        .expect("delete the analytics group's rule");
    op.wait_for("the emptied group's policy pruned", WAIT, || {
        get("networkpolicy", "plant-analytics").is_none()
    });
    assert!(get("networkpolicy", "plant-default").is_some());
}

/// Neighbours' shapes. Secrets as Strimzi's User Operator writes them for a KafkaUser (SCRAM:
/// `password` and `sasl.jaas.config`, no username; TLS: `user.crt`, `user.key`, …) and its
/// cluster CA Secret (`ca.crt`) are used as they are, through a literal username and named
/// keys. Replicas per group: one group's own count, and an autoscaled group whose replicas the
/// operator leaves to the autoscaler (here `kubectl scale`, as a HorizontalPodAutoscaler writes
/// them) across later reconciles, with every pod but the first draining on SIGTERM.
#[test]
fn strimzi_shaped_secrets_and_replicas_per_group_without_a_fight_with_an_autoscaler() {
    let cp = common::control_plane_with_crds("ferry");
    let op = Operator::start(&cp, "operator", &[]);
    let marked = "ferry.dev/broker-credentials=true";
    for (name, literals) in [
        (
            "forwarder",
            vec![
                "--from-literal=password=scram-pw",
                "--from-literal=sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"forwarder\" password=\"scram-pw\";",
            ],
        ),
        (
            "forwarder-tls",
            vec![
                "--from-literal=ca.crt=CLIENTS-CA",
                "--from-literal=user.crt=USER-CERT",
                "--from-literal=user.key=USER-KEY",
                "--from-literal=user.p12=P12",
                "--from-literal=user.password=P12-PW",
            ],
        ),
        (
            "plant-cluster-ca-cert",
            vec!["--from-literal=ca.crt=CLUSTER-CA"],
        ),
    ] {
        let mut args = vec!["create", "secret", "generic", name, "-n", "ferry"];
        args.extend(literals);
        cp.run_kubectl(args).expect("secret");
        cp.run_kubectl(["label", "secret", name, "-n", "ferry", marked])
            .expect("mark");
    }
    let plant = Connection::new(
        "plant",
        "mqtt.ferry.svc",
        &["plant-kafka-bootstrap.kafka.svc:9093"],
    )
    .namespace("ferry")
    .set(
        "/spec/kafka/tls",
        json!({
            "caSecretRef": { "name": "plant-cluster-ca-cert", "key": "ca.crt" },
            "clientCertSecretRef": { "name": "forwarder-tls", "certKey": "user.crt", "keyKey": "user.key" },
        }),
    )
    .set(
        "/spec/kafka/sasl",
        json!({
            "mechanism": "SCRAM-SHA-512",
            "credentialsSecretRef": { "name": "forwarder", "username": "forwarder" },
        }),
    )
    .replicas(2)
    .set(
        "/spec/forwarder/groups",
        json!([{ "name": "bulk", "replicas": 3 }, { "name": "scaled", "autoscaled": true }]),
    );
    common::apply(&cp, &plant.yaml());
    for group in ["default", "bulk", "scaled"] {
        common::apply(
            &cp,
            &rule(group, group, &format!("plant/{group}/#"), group).yaml(),
        );
    }
    let replicas = |sts: &str| jsonpath(&cp, "ferry", "statefulset", sts, "{.spec.replicas}");
    op.wait_for("three forwarder StatefulSets", WAIT, || {
        ["plant-default", "plant-bulk", "plant-scaled"]
            .iter()
            .all(|s| !replicas(s).is_empty())
    });
    assert_eq!(
        ["plant-default", "plant-bulk", "plant-scaled"].map(replicas),
        ["2", "3", "1"].map(str::to_owned),
        "the connection's, the group's own, and the API server's default for the autoscaled one"
    );

    // The group Secret holds what the forwarder reads, under Ferry's keys.
    let copied = |key: &str| {
        cp.run_kubectl([
            "get",
            "secret",
            "plant-default",
            "-n",
            "ferry",
            "-o",
            &format!("go-template={{{{index .data \"{key}\" | base64decode}}}}"),
        ])
        .unwrap_or_else(|e| panic!("read {key} of the group Secret: {e}"))
    };
    assert_eq!(
        copied("kafka-username"),
        "forwarder",
        "the literal username"
    );
    assert_eq!(copied("kafka-password"), "scram-pw");
    assert_eq!(copied("kafka-tls.crt"), "USER-CERT");
    assert_eq!(copied("kafka-tls.key"), "USER-KEY");
    assert_eq!(copied("kafka-ca.crt"), "CLUSTER-CA");
    op.wait_for("the connection's Secrets resolved", WAIT, || {
        condition(&cp, "ferry", "bc", "plant", "SecretsResolved").is_some_and(|c| c.0 == "True")
    });

    // The autoscaled group: every pod but the first drains on SIGTERM, given the time to.
    let config = jsonpath(&cp, "ferry", "configmap", "plant-scaled", "{.data}");
    let prefix = jsonpath(&cp, "ferry", "bc", "plant", "{.status.sessionPrefix}");
    assert!(prefix.starts_with("ferry.ferry."), "{prefix:?}");
    assert!(
        config.contains("drain_on_shutdown") && config.contains(&format!("{prefix}plant-scaled-0")),
        "{config}"
    );
    assert!(
        !jsonpath(&cp, "ferry", "configmap", "plant-bulk", "{.data}").contains("drain_on_shutdown"),
        "only autoscaled groups"
    );
    let grace = |sts: &str| {
        jsonpath(
            &cp,
            "ferry",
            "statefulset",
            sts,
            "{.spec.template.spec.terminationGracePeriodSeconds}",
        )
    };
    assert!(
        grace("plant-scaled").parse::<u64>().expect("grace")
            > grace("plant-bulk").parse::<u64>().expect("grace"),
        "room for the drain before the stop's own"
    );

    // An autoscaler scales it; the operator's later reconciles (an edited rule, an edited
    // connection) leave its count alone and go on setting the others'.
    cp.run_kubectl([
        "scale",
        "statefulset",
        "plant-scaled",
        "-n",
        "ferry",
        "--replicas=4",
    ])
    .expect("scale as an autoscaler does");
    common::apply(
        &cp,
        &rule("scaled", "scaled", "plant/scaled/+/temp", "scaled").yaml(),
    );
    op.wait_for("the edited rule in the config", WAIT, || {
        jsonpath(&cp, "ferry", "configmap", "plant-scaled", "{.data}")
            .contains("plant/scaled/+/temp")
    });
    cp.run_kubectl([
        "patch",
        "bc",
        "plant",
        "-n",
        "ferry",
        "--type=merge",
        "-p",
        r#"{"spec":{"forwarder":{"groups":[{"name":"bulk","replicas":1},{"name":"scaled","autoscaled":true}]}}}"#,
    ])
    .expect("edit the connection");
    op.wait_for("bulk scaled to its new count", WAIT, || {
        replicas("plant-bulk") == "1"
    });
    assert_eq!(
        replicas("plant-scaled"),
        "4",
        "the autoscaler's count stands"
    );
    let owners = jsonpath(
        &cp,
        "ferry",
        "statefulset",
        "plant-scaled",
        "{range .metadata.managedFields[*]}{.manager}={.fieldsV1.f:spec}{\"\\n\"}{end}",
    );
    assert!(
        owners
            .lines()
            .filter(|l| l.starts_with("ferry-operator="))
            .all(|l| !l.contains("f:replicas")),
        "the operator does not own the autoscaled replicas:\n{owners}"
    );
}
