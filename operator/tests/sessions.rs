//! The forwarders' MQTT sessions at a real Mosquitto, through the operator binary on a real
//! kube-apiserver + controller-manager: when the connection is deleted, the broker ends up
//! holding no session, and queueing nothing, for the client ids that will never come back; a
//! group that goes away keeps its sessions until its pods drained. (Scaling down and renaming
//! a group with real forwarders that drain: `dataplane.rs`.)
//!
//! No kubelet runs here: the StatefulSet controller creates the pods, and the test plays what a
//! kubelet and the forwarder in each pod would do: it marks the pods Running and connects to
//! Mosquitto with each pod's client id, leaving a persistent session, as a forwarder does.

use std::time::{Duration, Instant};

use common::{Operator, jsonpath};
use ferry_e2e::manifests::{Connection, Rule};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};

mod common;

const NS: &str = "plant";
/// The operator retries every 5 s while a removed pod is still terminating; a pod that was
/// never bound to a node goes at once. Reconciles follow the StatefulSet's changes.
const WAIT: Duration = Duration::from_secs(60);
/// Topic the "forwarders" subscribe to: messages published to it while they are away are what
/// the broker queues for their sessions.
const FILTER: &str = "sensors/#";

/// Connection `name` to the Mosquitto on `mqtt_port`; its Kafka is never reached here.
fn connection(name: &str, mqtt_port: u16, protocol: &str, replicas: u32) -> String {
    Connection::new(name, "127.0.0.1", &["127.0.0.1:9"])
        .namespace(NS)
        .mqtt_port(mqtt_port)
        .mqtt_protocol(protocol)
        .replicas(replicas)
        .yaml()
}

/// Rule `name` of `connection` in `group`: [`FILTER`] to Kafka topic `name`.
fn rule(name: &str, connection: &str, group: &str) -> String {
    Rule::new(name, connection)
        .namespace(NS)
        .group(group)
        .topics(&[FILTER])
        .kafka_topic(name)
        .yaml()
}

/// The client id of connection `plant`'s pod `pod`: its `status.sessionPrefix` (waited for)
/// and the pod's name.
fn client_id(cp: &ferry_e2e::kube::ControlPlane, pod: &str) -> String {
    format!("{}{pod}", session_prefix(cp, "plant"))
}

/// Connection `name`'s `status.sessionPrefix`, once written.
fn session_prefix(cp: &ferry_e2e::kube::ControlPlane, name: &str) -> String {
    let prefix = || jsonpath(cp, NS, "brokerconnection", name, "{.status.sessionPrefix}");
    ferry_e2e::wait_until("status.sessionPrefix", WAIT, ferry_e2e::WAIT_POLL, || {
        !prefix().is_empty()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    prefix()
}

/// What the broker holds for `client_id` (see [`ferry_e2e::probe_session`]).
async fn probe_session(port: u16, client_id: &str, keep: bool) -> (bool, usize) {
    ferry_e2e::probe_session(
        std::net::IpAddr::from([127, 0, 0, 1]),
        port,
        None,
        client_id,
        keep,
    )
    .await
    .expect("probe the broker")
}

/// What a forwarder with client id `id` leaves at the broker: a persistent session subscribed
/// to [`FILTER`] (MQTT 5, expiry 1 h as the operator's default would give a day).
async fn leave_session(port: u16, id: &str) {
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options.set_clean_start(true);
    options.set_session_expiry_interval(Some(3600));
    let (client, mut events) = AsyncClient::new(options, 10);
    client
        .subscribe(FILTER, QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    loop {
        match tokio::time::timeout(Duration::from_secs(5), events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
            Ok(Ok(_)) => {}
            other => panic!("session for {id}: {other:?}"),
        }
    }
    client.disconnect().await.expect("disconnect");
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while events.poll().await.is_ok() {}
    })
    .await;
}

/// Marks `pod` Running and Ready, as its kubelet would once the forwarder started.
fn mark_running(cp: &ferry_e2e::kube::ControlPlane, pod: &str) {
    let start = Instant::now();
    while let Err(e) = cp.report_pod(NS, pod, Some("Running"), None, true) {
        assert!(start.elapsed() < WAIT, "pod {pod} never appeared: {e}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn recorded(cp: &ferry_e2e::kube::ControlPlane) -> String {
    jsonpath(
        cp,
        NS,
        "brokerconnection",
        "plant",
        "{.status.mqttSessions[*]}",
    )
}

fn wait_recorded(op: &Operator, cp: &ferry_e2e::kube::ControlPlane, pods: &[&str]) {
    let want: Vec<String> = pods.iter().map(|p| client_id(cp, p)).collect();
    let want = want.join(" ");
    op.wait_for(
        &format!("status.mqttSessions = {want:?} (is {:?})", recorded(cp)),
        WAIT,
        || recorded(cp) == want,
    );
}

/// Deletes connection `plant` and waits until its finalizer has released it.
fn delete_plant(op: &Operator, cp: &ferry_e2e::kube::ControlPlane) {
    cp.run_kubectl([
        "delete",
        "brokerconnection",
        "plant",
        "-n",
        NS,
        "--wait=false",
    ])
    .expect("delete connection");
    op.wait_for("the connection to be released and gone", WAIT, || {
        cp.run_kubectl(["get", "brokerconnection", "plant", "-n", NS])
            .is_err_and(|e| e.to_string().contains("NotFound"))
    });
}

#[test]
fn sessions_of_removed_pods_groups_and_connections_are_ended_at_the_broker() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mqtt = ferry_e2e::Mosquitto::start().expect("mosquitto");
    let port = mqtt.port();
    let cp = common::control_plane_with_crds(NS);
    let op = Operator::start(&cp, "operator", &[]);
    common::apply(&cp, &connection("plant", port, "5", 3));
    common::apply(&cp, &rule("telemetry", "plant", "default"));
    common::apply(&cp, &rule("bulk", "plant", "bulk"));

    let default_pods = ["plant-default-0", "plant-default-1", "plant-default-2"];
    let bulk_pods = ["plant-bulk-0", "plant-bulk-1", "plant-bulk-2"];
    let mut all: Vec<&str> = bulk_pods.iter().chain(&default_pods).copied().collect();
    all.sort_unstable();
    // Pending pods never ran, so they left nothing at the broker: nothing recorded yet.
    op.wait_for("the StatefulSets' pods", WAIT, || {
        cp.run_kubectl(["get", "pod", "plant-bulk-2", "-n", NS])
            .is_ok()
    });
    assert_eq!(recorded(&cp), "", "pods that never ran are not recorded");
    // The operator bounds the sessions it starts (MQTT 5) when the connection sets no expiry.
    let config = jsonpath(
        &cp,
        NS,
        "configmap",
        "plant-default",
        "{.data.config\\.yaml}",
    );
    assert!(config.contains("session_expiry_secs: 86400"), "{config}");

    // Named after the connection's UID: one created again under this name is a new client.
    let uid = jsonpath(&cp, NS, "brokerconnection", "plant", "{.metadata.uid}");
    assert_eq!(
        session_prefix(&cp, "plant"),
        format!("ferry.{NS}.{}.", &uid[..8])
    );
    let ids: Vec<String> = all.iter().map(|p| client_id(&cp, p)).collect();
    for (pod, id) in all.iter().zip(&ids) {
        rt.block_on(leave_session(port, id));
        mark_running(&cp, pod);
    }
    wait_recorded(&op, &cp, &all);
    // While they are away, the broker queues for every session.
    let messages = (0..3)
        .map(|i| ("sensors/a".to_owned(), format!("m{i}").into_bytes()))
        .collect();
    rt.block_on(ferry_e2e::publish(
        port,
        "publisher",
        rumqttc::QoS::AtLeastOnce,
        messages,
    ))
    .expect("publish");

    // The bulk group goes away with its only rule. Its pods are told to drain once the served
    // groups' pods run their rules, and it stays until they report drained; these stand-in
    // pods never answer, so it waits, visibly, and their sessions keep what the broker queued.
    cp.run_kubectl(["delete", "forwardingrule", "bulk", "-n", NS])
        .expect("delete rule");
    op.wait_for(
        "a Normal Event saying the removed group waits",
        WAIT,
        || {
            common::Scene::new(&cp, &op, NS)
                .events("plant")
                .contains("Normal Draining")
        },
    );
    std::thread::sleep(Duration::from_secs(6));
    assert!(
        cp.run_kubectl(["get", "statefulset", "plant-bulk", "-n", NS])
            .is_ok(),
        "kept until its pods drained"
    );
    assert_eq!(
        rt.block_on(probe_session(port, &client_id(&cp, "plant-bulk-0"), true)),
        (true, 3),
        "a session not drained is not ended"
    );
    wait_recorded(&op, &cp, &all);

    // The connection: its finalizer holds it until its forwarders are gone and their sessions
    // ended.
    assert_eq!(
        jsonpath(
            &cp,
            NS,
            "brokerconnection",
            "plant",
            "{.metadata.finalizers[*]}"
        ),
        "ferry.dev/mqtt-sessions"
    );
    delete_plant(&op, &cp);
    for id in &ids {
        assert_eq!(
            rt.block_on(probe_session(port, id, false)),
            (false, 0),
            "{id}: a deleted connection's sessions are ended"
        );
    }
    assert_eq!(
        op.metric(
            "ferry_operator_mqtt_sessions_ended_total",
            "result=\"ended\""
        ),
        Some(6.0),
        "a deleted connection's sessions are ended, drained or not"
    );
}

/// MQTT 3.1.1 has no session expiry: ending the session is the only way it goes. (Scaling
/// down drains the leaving pods first: `dataplane.rs` runs it with real forwarders.)
#[test]
fn mqtt_311_sessions_of_a_deleted_connection_are_ended() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mqtt = ferry_e2e::Mosquitto::start().expect("mosquitto");
    let port = mqtt.port();
    let cp = common::control_plane_with_crds(NS);
    let op = Operator::start(&cp, "operator", &[]);
    common::apply(&cp, &connection("plant", port, "3.1.1", 2));
    common::apply(&cp, &rule("telemetry", "plant", "default"));
    let pods = ["plant-default-0", "plant-default-1"];
    let ids = pods.map(|p| client_id(&cp, p));
    for (pod, id) in pods.iter().zip(&ids) {
        mark_running(&cp, pod);
        rt.block_on(leave_session_311(port, id));
    }
    wait_recorded(&op, &cp, &pods);
    delete_plant(&op, &cp);
    for id in &ids {
        assert!(
            !rt.block_on(session_present_311(port, id)),
            "{id}: the deleted connection's session is ended"
        );
    }
}

async fn leave_session_311(port: u16, id: &str) {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options.set_clean_session(false);
    let (client, mut events) = AsyncClient::new(options, 10);
    client
        .subscribe(FILTER, QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    loop {
        match tokio::time::timeout(Duration::from_secs(5), events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
            Ok(Ok(_)) => {}
            other => panic!("session for {id}: {other:?}"),
        }
    }
    ferry_e2e::disconnect(&client, &mut events)
        .await
        .expect("disconnect");
}

/// MQTT 3.1.1 CONNACK's session present, connecting without a clean session (which leaves a
/// session behind: call it last for an id).
async fn session_present_311(port: u16, id: &str) -> bool {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet};
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options.set_clean_session(false);
    let (client, mut events) = AsyncClient::new(options, 10);
    let present = loop {
        match tokio::time::timeout(Duration::from_secs(5), events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => break ack.session_present,
            Ok(Ok(_)) => {}
            other => panic!("probing {id}: {other:?}"),
        }
    };
    ferry_e2e::disconnect(&client, &mut events)
        .await
        .expect("disconnect");
    present
}

/// Writes `ids` as connection `name`'s `status.mqttSessions`.
fn set_recorded(cp: &ferry_e2e::kube::ControlPlane, name: &str, ids: &[String]) {
    let record = serde_json::json!({ "status": { "mqttSessions": ids } }).to_string();
    cp.run_kubectl([
        "patch",
        "brokerconnection",
        name,
        "-n",
        NS,
        "--subresource=status",
        "--type=merge",
        "-p",
        &record,
    ])
    .expect("patch the record");
}

/// Connections an operator from before `status.sessionPrefix` ran (their status records
/// sessions under `ferry.<namespace>.<pod>`) keep those ids after the upgrade: their pods are
/// rendered with the arguments they had, and the prefix recorded is the old one. With such ids,
/// one recorded by one connection whose pod is now another connection's (as after an upgrade
/// renamed the groups, or two names once collided) is that pod's live session: deleting the
/// first connection ends its own sessions and leaves that one, and what it queued, alone.
#[test]
fn upgraded_connections_keep_their_ids_and_never_end_another_connections_session() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mqtt = ferry_e2e::Mosquitto::start().expect("mosquitto");
    let port = mqtt.port();
    let cp = common::control_plane_with_crds(NS);
    let legacy = |pod: &str| format!("ferry.{NS}.{pod}");
    // What the earlier operator left: the connections, their rules and their records.
    common::apply(&cp, &connection("plant", port, "5", 1));
    common::apply(&cp, &connection("other", port, "5", 1));
    common::apply(&cp, &rule("telemetry", "plant", "default"));
    common::apply(&cp, &rule("telemetry-other", "other", "default"));
    for name in ["plant", "other"] {
        set_recorded(&cp, name, &[legacy(&format!("{name}-default-0"))]);
    }
    let op = Operator::start(&cp, "operator", &[]);
    for name in ["plant", "other"] {
        assert_eq!(session_prefix(&cp, name), format!("ferry.{NS}."));
        let args = jsonpath(
            &cp,
            NS,
            "statefulset",
            &format!("{name}-default"),
            "{.spec.template.spec.containers[0].args}",
        );
        assert!(
            args.contains("\"ferry.$(POD_NAMESPACE).$(POD_NAME)\""),
            "the pods' arguments of before, so they are not restarted: {args}"
        );
    }
    for pod in ["plant-default-0", "other-default-0"] {
        op.wait_for(&format!("pod {pod}"), WAIT, || {
            cp.run_kubectl(["get", "pod", pod, "-n", NS]).is_ok()
        });
        rt.block_on(leave_session(port, &legacy(pod)));
        mark_running(&cp, pod);
    }
    wait_recorded(&op, &cp, &["plant-default-0"]);
    // `plant`'s record also names the other connection's pod.
    set_recorded(
        &cp,
        "plant",
        &[legacy("other-default-0"), legacy("plant-default-0")],
    );
    rt.block_on(ferry_e2e::publish(
        port,
        "publisher",
        rumqttc::QoS::AtLeastOnce,
        vec![("sensors/a".to_owned(), b"m".to_vec())],
    ))
    .expect("publish");

    delete_plant(&op, &cp);
    assert_eq!(
        rt.block_on(probe_session(port, &legacy("plant-default-0"), false)),
        (false, 0),
        "the deleted connection's own session is ended"
    );
    assert_eq!(
        rt.block_on(probe_session(port, &legacy("other-default-0"), true)),
        (true, 1),
        "the other connection's live session keeps what was queued for it"
    );
    assert!(
        cp.run_kubectl(["get", "statefulset", "other-default", "-n", NS])
            .is_ok()
    );
    assert_eq!(
        op.metric(
            "ferry_operator_mqtt_sessions_ended_total",
            "result=\"ended\""
        ),
        Some(1.0)
    );
}
