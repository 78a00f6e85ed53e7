//! Two operator replicas share a Lease: one reconciles, the other waits and takes over when
//! the leader stops or dies. An object this operator cannot read (here: a CRD loosened by
//! hand, as with a newer CRD version) is reported on that object and stops nothing else.

use std::time::{Duration, Instant};

use common::{Operator, condition, jsonpath};
use ferry_e2e::manifests::{Connection, Rule};
use serde_json::json;

mod common;

const NS: &str = "ferry";
const WAIT: Duration = Duration::from_secs(60);
const LEASE: &[&str] = &["--lease-duration-seconds", "6"];

fn connection(name: &str) -> Connection {
    Connection::new(name, "mqtt.example", &["kafka.example:9092"]).namespace(NS)
}

/// Rule `name` of `connection` in `group`: `<name>/#` to Kafka topic `name`.
fn rule(name: &str, connection: &str, group: &str) -> Rule {
    Rule::new(name, connection)
        .namespace(NS)
        .group(group)
        .topics(&[&format!("{name}/#")])
        .kafka_topic(name)
}

fn connection_and_rule(connection_name: &str, rule_name: &str, group: &str) -> String {
    connection(connection_name).yaml() + &rule(rule_name, connection_name, group).yaml()
}

fn leading(op: &Operator) -> bool {
    op.metric("ferry_operator_leader", "") == Some(1.0)
}

fn standing_by(op: &Operator) -> bool {
    op.metric("ferry_operator_leader", "") == Some(0.0)
}

#[test]
fn one_of_two_replicas_leads_and_the_other_takes_over_when_it_stops_or_dies() {
    let cp = common::control_plane_with_crds(NS);
    let mut alpha = Operator::start(&cp, "alpha", LEASE);
    let mut bravo = Operator::start(&cp, "bravo", LEASE);
    let exists = |name: &str| {
        cp.run_kubectl(["get", "statefulset", name, "-n", NS])
            .is_ok()
    };
    alpha.wait_for("one leader", WAIT, || {
        (leading(&alpha) && standing_by(&bravo)) || (leading(&bravo) && standing_by(&alpha))
    });
    if leading(&bravo) {
        std::mem::swap(&mut alpha, &mut bravo);
    }
    let (leader, standby) = (alpha, bravo);
    common::apply(&cp, &connection_and_rule("one", "first", "default"));
    leader.wait_for("the leader to render", WAIT, || exists("one-default"));
    // Give the standby every chance to (wrongly) act too.
    std::thread::sleep(Duration::from_secs(3));
    assert!(leading(&leader) && standing_by(&standby));
    assert_eq!(
        standby.metric("ferry_operator_reconciles_total", ""),
        Some(0.0),
        "the standby reconciles nothing"
    );
    let holder = jsonpath(
        &cp,
        "default",
        "lease",
        "ferry-operator",
        "{.spec.holderIdentity}",
    );

    // SIGTERM: the leader releases the Lease on its way out.
    let mut leader = leader;
    let standby_name = if holder == "alpha" { "bravo" } else { "alpha" };
    let stopped = Instant::now();
    assert_eq!(leader.terminate(), Some(0), "a clean stop exits 0");
    standby.wait_for("the standby to take over", WAIT, || leading(&standby));
    let takeover = stopped.elapsed();
    common::apply(&cp, &connection_and_rule("two", "second", "default"));
    standby.wait_for("the new leader to render", WAIT, || exists("two-default"));
    assert_eq!(
        jsonpath(
            &cp,
            "default",
            "lease",
            "ferry-operator",
            "{.spec.holderIdentity}"
        ),
        standby_name
    );

    // SIGKILL: nobody releases; the Lease must expire first.
    let restarted = Operator::start(&cp, &holder, LEASE);
    restarted.wait_for("the restarted replica to stand by", WAIT, || {
        standing_by(&restarted)
    });
    let mut standby = standby;
    let killed = Instant::now();
    let status = standby
        .terminate_hard()
        .expect("the standby-turned-leader was running");
    assert!(!status.success(), "SIGKILL is not a clean exit: {status}");
    restarted.wait_for("the restarted replica to take over", WAIT, || {
        leading(&restarted)
    });
    let crash_takeover = killed.elapsed();
    common::apply(&cp, &connection_and_rule("three", "third", "default"));
    restarted.wait_for("the third leader to render", WAIT, || {
        exists("three-default")
    });
    eprintln!(
        "takeover after SIGTERM: {takeover:.1?}; after SIGKILL (Lease 6 s): {crash_takeover:.1?}"
    );
    assert!(takeover < Duration::from_secs(8), "{takeover:?}");
    // Nobody released the Lease: it must run out (renewed with 2 s of 6 s left) before the
    // other replica may lead.
    assert!(
        crash_takeover >= Duration::from_secs(1) && crash_takeover < Duration::from_secs(20),
        "{crash_takeover:?}"
    );
}

#[test]
fn an_unreadable_object_is_reported_on_itself_and_stops_nothing_else() {
    let cp = common::control_plane_with_crds(NS);
    // As a newer CRD could: allow values this operator's types do not know.
    for (crd, path) in [
        (
            "brokerconnections.ferry.dev",
            "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/mqtt/properties/protocol/enum",
        ),
        (
            "forwardingrules.ferry.dev",
            "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/payload/enum",
        ),
    ] {
        cp.run_kubectl([
            "patch",
            "crd",
            crd,
            "--type=json",
            "-p",
            &format!(r#"[{{"op":"remove","path":"{path}"}}]"#),
        ])
        .expect("loosen CRD");
    }
    common::apply(
        &cp,
        &(connection("odd").mqtt_protocol("6").yaml() + &rule("odd-rule", "odd", "default").yaml()),
    );
    common::apply(
        &cp,
        &(connection("good").yaml()
            + &Rule::new("odd-payload", "good")
                .namespace(NS)
                .group("default")
                .topics(&["good-rule/#"])
                .kafka_topic("good-rule")
                .set("/spec/payload", json!("zipped"))
                .yaml()),
    );
    common::apply(&cp, &connection_and_rule("good", "good-rule", "default"));
    let op = Operator::start(&cp, "operator", &["--leader-elect", "false"]);
    op.wait_for("the readable connection's forwarder", WAIT, || {
        cp.run_kubectl(["get", "statefulset", "good-default", "-n", NS])
            .is_ok()
    });
    let cond = |kind: &str, name: &str, type_: &str| {
        condition(&cp, NS, kind, name, type_).unwrap_or_default()
    };
    op.wait_for("the unreadable objects' conditions", WAIT, || {
        cond("bc", "odd", "Ready").1 == "InvalidSpec"
            && cond("fr", "odd-payload", "Accepted").1 == "InvalidSpec"
            && cond("fr", "odd-rule", "Accepted").1 == "ConnectionNotFound"
    });
    let (_, _, message) = cond("bc", "odd", "Ready");
    assert!(
        message.contains('6'),
        "says what it could not read: {message}"
    );
    assert!(cond("fr", "odd-payload", "Accepted").2.contains("zipped"));
    assert!(
        cond("fr", "odd-rule", "Accepted")
            .2
            .contains("cannot be read"),
        "{:?}",
        cond("fr", "odd-rule", "Accepted")
    );
    assert_eq!(cond("fr", "good-rule", "Accepted").0, "True");
    let config = jsonpath(
        &cp,
        NS,
        "configmap",
        "good-default",
        "{.data.config\\.yaml}",
    );
    assert!(
        config.contains("good-rule") && !config.contains("odd-payload"),
        "{config}"
    );
    assert!(
        cp.run_kubectl(["get", "statefulset", "odd-default", "-n", NS])
            .is_err(),
        "nothing rendered from an unreadable connection"
    );
    // Writing their status must not fail on reading the answer back (the same unreadable spec).
    let log = op.log();
    assert!(
        !log.contains("reconcile failed"),
        "no reconcile failed on the unreadable objects:\n{log}"
    );
}
