//! The operator binary against a real kube-apiserver + controller-manager: rules become
//! forwarder StatefulSets per group, edits change the config, emptied groups are pruned, and a
//! missing Secret blocks rendering until it exists.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_e2e::kube::ControlPlane;

mod common;

struct Operator(Child, std::path::PathBuf);

impl Operator {
    fn start(cp: &ControlPlane) -> Operator {
        let log = cp.dir().join("operator.log");
        let file = std::fs::File::create(&log).expect("log");
        let child = Command::new(env!("CARGO_BIN_EXE_ferry-operator"))
            .env("KUBECONFIG", cp.kubeconfig_path())
            .env("FERRY_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .expect("spawn ferry-operator");
        Operator(child, log)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        if std::thread::panicking() {
            eprintln!("operator log:\n{}", self.log());
        }
    }
}

fn wait_for(op: &Operator, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}\n{}",
            op.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

const CONNECTION: &str = r#"
apiVersion: ferry.dev/v1alpha1
kind: BrokerConnection
metadata: { name: plant, namespace: ferry }
spec:
  mqtt:
    host: mqtt.ferry.svc
    credentialsSecretRef: { name: mqtt-credentials }
  kafka:
    bootstrapServers: ["kafka.ferry.svc:9092"]
"#;

fn rule(name: &str, group: &str, filter: &str, topic: &str) -> String {
    format!(
        "apiVersion: ferry.dev/v1alpha1\nkind: ForwardingRule\nmetadata: {{ name: {name}, namespace: ferry }}\n\
         spec:\n  connectionRef: {{ name: plant }}\n  group: {group}\n  mqtt: {{ topics: [\"{filter}\"] }}\n  kafka: {{ topic: {topic} }}\n"
    )
}

#[test]
fn rules_become_one_forwarder_per_group_and_follow_edits_deletions_and_secrets() {
    let cp = common::control_plane_with_crds("ferry");
    let op = Operator::start(&cp);
    let apply = |yaml: &str| common::apply(&cp, yaml);
    let exists = |kind: &str, name: &str| {
        cp.run_kubectl(["get", kind, name, "-n", "ferry", "-o", "name"])
            .is_ok()
    };
    let config = |name: &str| {
        cp.run_kubectl([
            "get",
            "configmap",
            name,
            "-n",
            "ferry",
            "-o",
            "jsonpath={.data.config\\.yaml}",
        ])
        .unwrap_or_default()
    };

    // The connection names a Secret that does not exist yet: nothing may be rendered.
    apply(CONNECTION);
    apply(&rule("temps", "default", "plant/+/temp", "temps"));
    apply(&rule("alarms", "default", "plant/+/alarm", "alarms"));
    apply(&rule("audit", "analytics", "plant/#", "audit"));
    wait_for(&op, "the missing Secret to be reported", || {
        op.log().contains("mqtt-credentials")
    });
    assert!(
        !exists("statefulset", "plant-default"),
        "rendered without its Secret"
    );

    let started = Instant::now();
    cp.run_kubectl([
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
    wait_for(&op, "two forwarder StatefulSets", || {
        exists("statefulset", "plant-default") && exists("statefulset", "plant-analytics")
    });
    eprintln!(
        "Secret created → 2 StatefulSets in {:.1?}",
        started.elapsed()
    );
    let listed = cp
        .run_kubectl(["get", "statefulsets", "-n", "ferry", "-o", "name"])
        .expect("list");
    assert_eq!(listed.lines().count(), 2, "{listed}");
    let default = config("plant-default");
    assert!(
        default.contains("plant/+/temp")
            && default.contains("plant/+/alarm")
            && !default.contains("plant/#"),
        "{default}"
    );
    assert!(config("plant-analytics").contains("plant/#"));
    assert!(
        !default.contains("s3cret"),
        "credentials stay in the Secret"
    );

    // An edit changes the config but not the pod template's restart checksum.
    let checksum = || {
        cp.run_kubectl([
            "get",
            "statefulset",
            "plant-default",
            "-n",
            "ferry",
            "-o",
            "jsonpath={.spec.template.metadata.annotations.ferry\\.dev/restart-checksum}",
        ])
        .expect("checksum")
    };
    let before = checksum();
    apply(&rule("temps", "default", "plant/+/temp", "temperatures"));
    wait_for(&op, "the edited config", || {
        config("plant-default").contains("temperatures")
    });
    assert_eq!(
        checksum(),
        before,
        "a rule edit is reloaded live, not rolled"
    );

    // Emptying a group removes its forwarder and everything it owned.
    cp.run_kubectl(["delete", "fr", "audit", "-n", "ferry"])
        .expect("delete rule");
    wait_for(&op, "the emptied group to be pruned", || {
        !exists("statefulset", "plant-analytics") && !exists("configmap", "plant-analytics")
    });
    assert!(exists("statefulset", "plant-default"));
}
