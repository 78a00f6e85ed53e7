//! The data plane through the operator, with real Mosquitto, Kafka and forwarder processes.
//! No kubelet runs here, so the test does its part for the pods the StatefulSet controller
//! created: it runs the container's program with the pod's config and environment, on a
//! loopback address of its own, and reports the pod Ready with that address as its IP. The
//! operator then reads each pod's `/status` into the rules' status; under steady traffic it
//! reconciles nothing and writes each rule's status at most once per write interval, while a
//! condition change (Kafka stopped) is written at once.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_e2e::kube::ControlPlane;
use ferry_e2e::manifests::{Connection, Rule};
use ferry_e2e::{Kafka, Mosquitto};
use serde_json::json;

use common::{Operator, condition, jsonpath};

mod common;

const NS: &str = "ferry";
const WAIT: Duration = Duration::from_secs(90);
/// The operator's `--status-write-interval-seconds` here: short enough to see several writes in
/// a minute, long against the 1 s poll, so a budget that does not hold shows.
const WRITE_INTERVAL: Duration = Duration::from_secs(30);
/// A rule's `Ready` follows its `Forwarding` within one reconcile of the connection (which the
/// poller asks for when the data plane changes whether data flows): seconds, not the resync.
const READY_FOLLOWS: Duration = Duration::from_secs(10);
/// Two of the operator's drain polls (5 s): long enough for a scale-down that did not wait to
/// show.
const DRAIN_WAITS_FOR_A_DEAD_POD: Duration = Duration::from_secs(10);

/// A forwarder process standing in for one pod.
struct Pod {
    child: Child,
    log: std::path::PathBuf,
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- {} ---\n{}",
                self.log.display(),
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// Runs pod `name` of StatefulSet `workload` as a forwarder on `ip`, and reports it Ready.
fn run_pod(cp: &ControlPlane, workload: &str, name: &str, ip: Ipv4Addr) -> Pod {
    start_pod(cp, workload, name, ip, true)
}

/// Runs pod `name` of StatefulSet `workload` as a forwarder on `ip`; once it listens, reports
/// it Running with that IP, and Ready as `ready` says.
fn start_pod(cp: &ControlPlane, workload: &str, name: &str, ip: Ipv4Addr, ready: bool) -> Pod {
    let config = jsonpath(cp, NS, "configmap", workload, "{.data.config\\.yaml}");
    assert!(!config.is_empty(), "ConfigMap {workload} has a config");
    let dir = cp.dir().join(name);
    std::fs::create_dir_all(&dir).expect("pod dir");
    std::fs::write(dir.join("config.yaml"), config).expect("config");
    let log = dir.join("forwarder.log");
    let file = std::fs::File::create(&log).expect("log");
    // The container's arguments, with what Kubernetes expands in them and the config where
    // this stand-in pod has it.
    let args = common::forwarder_args(cp, NS, workload, name, &dir.join("config.yaml"));
    let child = Command::new(common::forwarder_binary())
        .args(args)
        .args(["--http-listen", &format!("{ip}:8080")])
        // What the pod template's fieldRefs give the container.
        .env("POD_NAME", name)
        .env("POD_NAMESPACE", NS)
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("log"))
        .stderr(file)
        .spawn()
        .expect("spawn forwarder");
    let start = Instant::now();
    while TcpStream::connect(SocketAddr::from((ip, 8080))).is_err() {
        assert!(start.elapsed() < WAIT, "forwarder {name} never listened");
        std::thread::sleep(Duration::from_millis(100));
    }
    cp.report_pod(NS, name, Some("Running"), Some(ip.into()), ready)
        .expect("report the pod Running");
    Pod { child, log }
}

/// Once the StatefulSet controller has created pod 0 of the new `workload`, runs it on `ip`.
fn run_new_pod(cp: &ControlPlane, op: &Operator, workload: &str, ip: Ipv4Addr) -> Pod {
    let name = format!("{workload}-0");
    op.wait_for(&format!("{workload}'s pod"), WAIT, || {
        cp.run_kubectl(["get", "pod", &name, "-n", NS]).is_ok()
    });
    run_pod(cp, workload, &name, ip)
}

/// Reports the pods Ready or NotReady, as their kubelet would from the readiness probe.
fn set_ready(cp: &ferry_e2e::kube::ControlPlane, names: &[&str], ready: bool) {
    for name in names {
        cp.report_pod(NS, name, None, None, ready)
            .expect("report the pod's readiness");
    }
}

/// Publishes to both rules' topics, 20 messages a second, until `stop`; returns how many.
fn steady_traffic(
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    publish_until(port, stop, Duration::from_secs(1), |round| {
        (0..20)
            .map(|i| {
                let kind = if i % 4 == 0 { "alarm" } else { "temp" };
                (
                    format!("plant/{i}/{kind}"),
                    format!("s{round}-{i}").into_bytes(),
                )
            })
            .collect()
    })
}

/// Numbers the publishers' client ids, each connection its own.
static PUBLISHERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Publishes `batch(round)` at QoS 1 for round 0, 1, … with `pause` between, until `stop`;
/// returns how many messages the broker acknowledged.
fn publish_until(
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pause: Duration,
    batch: impl Fn(usize) -> Vec<(String, Vec<u8>)> + Send + 'static,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let mut sent = 0;
        for round in 0.. {
            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            let messages = batch(round);
            let n = messages.len();
            rt.block_on(ferry_e2e::publish(
                port,
                format!(
                    "traffic-{}",
                    PUBLISHERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                ),
                rumqttc::QoS::AtLeastOnce,
                messages,
            ))
            .expect("publish");
            sent += n;
            std::thread::sleep(pause);
        }
        sent
    })
}

/// A control plane, Mosquitto, and Kafka with the rules' topics `temps` and `alarms`.
fn brokers_and_control_plane() -> (ControlPlane, Mosquitto, Kafka, tokio::runtime::Runtime) {
    let cp = common::control_plane_with_crds(NS);
    let mosquitto = Mosquitto::start().expect("mosquitto");
    let kafka = Kafka::start().expect("kafka");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    for topic in ["temps", "alarms"] {
        rt.block_on(kafka.create_topic(topic, 1)).expect("topic");
    }
    (cp, mosquitto, kafka, rt)
}

/// The stand-in pods' IPs: `127.77.<net>.<n>`, a /24 of loopback for each test. The operator
/// polls a pod's `/status` on port 8080 of its IP, as in a cluster, so tests that run side by
/// side need pod IPs of their own.
const STEPS_NET: u8 = 0;
const HELD_NET: u8 = 1;
const BUDGET_NET: u8 = 2;
const ORPHAN_NET: u8 = 3;

#[test]
fn rules_report_what_their_forwarder_pods_forward_and_steady_state_reconciles_nothing() {
    let (cp, mosquitto, mut kafka, rt) = brokers_and_control_plane();
    let write_interval = WRITE_INTERVAL.as_secs().to_string();
    let op = Operator::start(
        &cp,
        "operator",
        &[
            "--status-interval-seconds",
            "1",
            "--status-write-interval-seconds",
            &write_interval,
        ],
    );
    let pods = rules_become_ready_with_their_pods(&cp, &op, &mosquitto, &kafka, STEPS_NET);
    forwarded_counts_reach_the_rules_status(&cp, &op, &mosquitto, &kafka, &rt);
    steady_traffic_reconciles_nothing_and_writes_within_budget(&op, &mosquitto);
    kafka_outage_is_reported_at_once(&cp, &op, &mut kafka);
    not_ready_pods_still_report_until_kafka_is_back(&cp, &op, &mut kafka);
    scaling_down_drains_the_leaving_pod_and_loses_nothing(&cp, &op, &mosquitto, &kafka, pods);
}

/// The same two rules and pods under an operator with a tight status-write budget for the
/// whole operator. A control plane of its own: the steps of the test above go on to scale
/// down and rename with Kafka as they left it, which this one stops.
#[test]
fn under_the_operators_write_budget_counters_wait_and_condition_changes_do_not() {
    let (cp, mosquitto, mut kafka, _rt) = brokers_and_control_plane();
    let budget = WRITES_PER_SECOND.to_string();
    let op = Operator::start(
        &cp,
        "operator-budget",
        &[
            "--status-interval-seconds",
            "1",
            "--status-write-interval-seconds",
            "0",
            "--status-writes-per-second",
            &budget,
        ],
    );
    let _pods = rules_become_ready_with_their_pods(&cp, &op, &mosquitto, &kafka, BUDGET_NET);
    the_write_budget_defers_counters_but_not_a_condition_change(&cp, &op, &mosquitto, &mut kafka);
}

/// `--status-writes-per-second` of the budget step: one write every 10 s for the whole
/// operator, where the two rules' moving counters would be written at every 1 s poll.
const WRITES_PER_SECOND: f64 = 0.1;

/// Under the operator's status-write budget, moving counters wait for room (each rule in
/// turn, the one written longest ago first) while a condition change is written at once.
fn the_write_budget_defers_counters_but_not_a_condition_change(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &mut Kafka,
) {
    let writes = || {
        op.metric("ferry_operator_status_writes_total", "forwarding_rule")
            .expect("metrics")
    };
    let forwarded = |rule: &str| -> u64 {
        jsonpath(cp, NS, "fr", rule, "{.status.forwarded}")
            .parse()
            .unwrap_or(0)
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = steady_traffic(mosquitto.port(), stop.clone());
    // The window starts at a write of counters alone, which happens only once the budget has
    // room: the rules' condition changes at start-up are written at once and may leave it in
    // debt (up to `MAX_DEBT`, a minute), during which no counters are written.
    op.wait_for("counters written under traffic", WAIT, || {
        forwarded("temps") > 0 || forwarded("alarms") > 0
    });
    let after_start_up = writes();
    op.wait_for("a write of counters alone", WAIT, || {
        writes() > after_start_up
    });
    let (w0, temps0, alarms0) = (writes(), forwarded("temps"), forwarded("alarms"));
    // Two refills of the budget: the other rule's turn, then the first's again.
    let window = Duration::from_secs_f64(2.0 / WRITES_PER_SECOND + 1.0);
    std::thread::sleep(window);
    let (w1, temps1, alarms1) = (writes(), forwarded("temps"), forwarded("alarms"));
    let budget = (window.as_secs_f64() * WRITES_PER_SECOND).floor() + 1.0;
    eprintln!(
        "budget {WRITES_PER_SECOND}/s over {window:?}: {} rule status writes (at most {budget}; \
         without the budget about 2 a second); forwarded temps {temps0} -> {temps1}, alarms \
         {alarms0} -> {alarms1}",
        w1 - w0
    );
    assert!(
        w1 - w0 <= budget,
        "{} status writes in {window:?}: over {WRITES_PER_SECOND} a second",
        w1 - w0
    );
    assert!(
        temps1 > temps0 && alarms1 > alarms0,
        "each rule's counters still reach its status in turn: temps {temps0} -> {temps1}, \
         alarms {alarms0} -> {alarms1}"
    );

    // Kafka stops: both rules' Forwarding flips at the same poll, not a budget refill apart.
    kafka.stop();
    let mut flipped = [None, None];
    op.wait_for("both rules KafkaUnreachable", WAIT, || {
        for (rule, at) in ["temps", "alarms"].iter().zip(flipped.iter_mut()) {
            if at.is_none() && cond(cp, "fr", rule, "Forwarding").1 == "KafkaUnreachable" {
                *at = Some(Instant::now());
            }
        }
        flipped.iter().all(Option::is_some)
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    traffic.join().expect("traffic thread");
    let [Some(a), Some(b)] = flipped else {
        unreachable!("waited for both")
    };
    let apart = if a > b { a - b } else { b - a };
    let refill = Duration::from_secs_f64(1.0 / WRITES_PER_SECOND);
    eprintln!("both rules KafkaUnreachable {apart:?} apart (a budget refill: {refill:?})");
    assert!(
        apart < refill / 2,
        "a condition change waited for the budget: {apart:?} between the rules' flips"
    );
}

/// A BrokerConnection `name` in {NS} to these brokers, with `replicas` forwarder pods.
fn connection_yaml(name: &str, replicas: u32, mosquitto: &Mosquitto, kafka: &Kafka) -> String {
    Connection::new(name, "127.0.0.1", &[&kafka.bootstrap()])
        .namespace(NS)
        .mqtt_port(mosquitto.port())
        .replicas(replicas)
        .yaml()
}

/// A ForwardingRule `name` in {NS} of `connection` from `filter` to `topic`.
fn rule(name: &str, connection: &str, filter: &str, topic: &str) -> Rule {
    Rule::new(name, connection)
        .namespace(NS)
        .topics(&[filter])
        .kafka_topic(topic)
}

/// The filter of rule `alarms`: every message whose payload does not end in 0.
const ALARMS_FILTER: &str = "!string(payload).endsWith('0')";

/// Publishes `messages` at QoS 1, in order, and waits for the broker's acks.
fn publish(rt: &tokio::runtime::Runtime, mosquitto: &Mosquitto, messages: Vec<(String, Vec<u8>)>) {
    rt.block_on(ferry_e2e::publish(
        mosquitto.port(),
        "publisher",
        rumqttc::QoS::AtLeastOnce,
        messages,
    ))
    .expect("publish");
}

/// A condition of an object in {NS}: (status, reason, message), empty while it has none.
fn cond(cp: &ControlPlane, kind: &str, name: &str, type_: &str) -> (String, String, String) {
    condition(cp, NS, kind, name, type_).unwrap_or_default()
}

/// Connection `plant` (2 replicas) with rules temps and alarms; the test runs the pods the
/// StatefulSet controller creates, and the rules become Ready and Forwarding.
fn rules_become_ready_with_their_pods(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
    net: u8,
) -> Vec<Pod> {
    common::apply(
        cp,
        &[
            connection_yaml("plant", 2, mosquitto, kafka),
            rule("temps", "plant", "plant/+/temp", "temps").yaml(),
            rule("alarms", "plant", "plant/+/alarm", "alarms")
                .filter(ALARMS_FILTER)
                .yaml(),
        ]
        .concat(),
    );
    // The StatefulSet controller creates the pods; the test runs them.
    let names = ["plant-default-0", "plant-default-1"];
    op.wait_for("the StatefulSet's pods", WAIT, || {
        names
            .iter()
            .all(|p| cp.run_kubectl(["get", "pod", p, "-n", NS]).is_ok())
    });
    let pods: Vec<Pod> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            run_pod(
                cp,
                "plant-default",
                name,
                Ipv4Addr::new(127, 77, net, i as u8 + 1),
            )
        })
        .collect();
    op.wait_for("Ready and Forwarding", WAIT, || {
        cond(cp, "fr", "temps", "Ready").0 == "True"
            && cond(cp, "fr", "temps", "Forwarding").0 == "True"
    });
    assert_eq!(
        jsonpath(cp, NS, "fr", "temps", "{.status.readyReplicas}"),
        "2/2"
    );
    assert_eq!(cond(cp, "bc", "plant", "Ready").1, "ForwardersReady");
    pods
}

/// What both pods forwarded, summed per rule, reaches the rules' status with a rate.
fn forwarded_counts_reach_the_rules_status(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
) {
    let (temps, alarms) = (3000, 1000);
    let messages: Vec<(String, Vec<u8>)> = (0..temps)
        .map(|i| {
            (
                format!("plant/{}/temp", i % 10),
                format!("t{i}").into_bytes(),
            )
        })
        .chain((0..alarms).map(|i| {
            (
                format!("plant/{}/alarm", i % 10),
                format!("a{i}").into_bytes(),
            )
        }))
        .collect();
    publish(rt, mosquitto, messages);
    let records = kafka
        .read_all("temps", temps, Duration::from_secs(1), WAIT)
        .expect("read temps");
    assert_eq!(records.len(), temps);

    // Both pods' counters, summed per rule; the alarms rule's filter drops every tenth.
    let (alarms_filtered, alarms_forwarded) = (alarms / 10, alarms - alarms / 10);
    let field =
        |rule: &str, field: &str| jsonpath(cp, NS, "fr", rule, &format!("{{.status.{field}}}"));
    op.wait_for("the forwarded counts in the rules' status", WAIT, || {
        field("temps", "forwarded") == temps.to_string()
            && field("alarms", "forwarded") == alarms_forwarded.to_string()
            && field("alarms", "filtered") == alarms_filtered.to_string()
    });
    for rule in ["temps", "alarms"] {
        assert_eq!(field(rule, "deadLettered"), "0");
        assert_eq!(field(rule, "failed"), "0");
        assert_eq!(field(rule, "kafkaTopic"), rule, "the Kafka Topic column");
    }
    let rate: f64 = jsonpath(cp, NS, "fr", "temps", "{.status.ratePerSecond}")
        .parse()
        .expect("ratePerSecond");
    assert!(rate > 0.0, "a rate over the last minute: {rate}");
    assert!(!jsonpath(cp, NS, "fr", "temps", "{.status.lastForwardedAt}").is_empty());
    let shown = cp
        .run_kubectl(["get", "bc,fr", "-n", NS])
        .expect("kubectl get");
    eprintln!("kubectl get bc,fr -n {NS}\n{shown}");
    assert!(shown.contains("True"), "{shown}");
}

/// Steady traffic: counters and rates move at every 1 s poll, yet each rule's status is written
/// at most once per write interval (plus one for where the window starts), and nothing
/// reconciles.
fn steady_traffic_reconciles_nothing_and_writes_within_budget(
    op: &Operator,
    mosquitto: &Mosquitto,
) {
    let reconciles = || {
        op.metric("ferry_operator_reconciles_total", "")
            .expect("metrics")
    };
    let writes = || {
        op.metric("ferry_operator_status_writes_total", "forwarding_rule")
            .expect("metrics")
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = steady_traffic(mosquitto.port(), stop.clone());
    std::thread::sleep(Duration::from_secs(3));
    let (r0, w0) = (reconciles(), writes());
    let window = Duration::from_secs(60);
    std::thread::sleep(window);
    let (r1, w1) = (reconciles(), writes());
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = traffic.join().expect("traffic thread");
    let rules = 2.0;
    let per_rule = (window.as_secs_f64() / WRITE_INTERVAL.as_secs_f64()).ceil() + 1.0;
    eprintln!(
        "steady traffic ({sent} messages in {window:?}): {} reconciles, {} rule status writes \
         (budget {} = {rules} rules x {per_rule})",
        r1 - r0,
        w1 - w0,
        rules * per_rule
    );
    assert_eq!(r1, r0, "no reconcile at steady state");
    assert!(sent > 100, "traffic flowed: {sent}");
    assert!(
        w1 - w0 <= rules * per_rule,
        "{} status writes in {window:?}: more than one per rule per {WRITE_INTERVAL:?}",
        w1 - w0
    );
    assert!(
        w1 - w0 >= rules,
        "the moving counters are still written, once an interval"
    );
}

/// Kafka going away is reported on the rule with the pod and the reason, at once: within the
/// forwarder's probe (every 5 s, 3 s timeout) and a poll, not after the write interval; Ready
/// follows within one reconcile.
fn kafka_outage_is_reported_at_once(cp: &ControlPlane, op: &Operator, kafka: &mut Kafka) {
    let stopped = Instant::now();
    kafka.stop();
    op.wait_for("Forwarding False while Kafka is down", WAIT, || {
        cond(cp, "fr", "temps", "Forwarding").1 == "KafkaUnreachable"
    });
    let noticed = stopped.elapsed();
    eprintln!("Kafka stopped: KafkaUnreachable on the rule after {noticed:.1?}");
    assert!(
        noticed < WRITE_INTERVAL,
        "a condition change waited on the write budget: {noticed:?}"
    );
    let (_, _, message) = cond(cp, "fr", "temps", "Forwarding");
    assert!(
        message.contains("plant-default-"),
        "names the pod: {message}"
    );
    // RATE says 0 with the condition, not the pods' average of the minute before the outage
    // (the steady traffic just before made it well above 0).
    let rate = jsonpath(cp, NS, "fr", "temps", "{.status.ratePerSecond}");
    assert_eq!(
        rate.parse::<f64>().ok(),
        Some(0.0),
        "RATE while Kafka is down: {rate:?}"
    );
    let events = events(
        cp,
        "involvedObject.name=temps",
        "{range .items[*]}{.type} {.reason};{end}",
    );
    assert!(events.contains("Warning KafkaUnreachable"), "{events}");
    // Data is not flowing, so the rule is not Ready, for the same reason (what `kubectl get fr`
    // prints): one reconcile after the poller saw it.
    let flipped = Instant::now();
    op.wait_for("Ready False with KafkaUnreachable", READY_FOLLOWS, || {
        let (status, reason, _) = cond(cp, "fr", "temps", "Ready");
        status == "False" && reason == "KafkaUnreachable"
    });
    eprintln!(
        "Ready False (KafkaUnreachable) {:.1?} after Forwarding",
        flipped.elapsed()
    );
}

/// A forwarder that (re)starts while Kafka is down never becomes Ready; the operator keeps
/// reading such pods, so the rule keeps saying why instead of falling back to NoReport. Once
/// Kafka is back the rule forwards and is Ready again.
fn not_ready_pods_still_report_until_kafka_is_back(
    cp: &ControlPlane,
    op: &Operator,
    kafka: &mut Kafka,
) {
    let names = ["plant-default-0", "plant-default-1"];
    set_ready(cp, &names, false);
    // Three polls after the pods' change is in the operator's pod store.
    std::thread::sleep(Duration::from_secs(5));
    let (status, reason, message) = cond(cp, "fr", "temps", "Forwarding");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "KafkaUnreachable"),
        "NotReady pods still report: {message}"
    );

    // Kafka back: the rule forwards and is Ready again.
    kafka.resume().expect("restart kafka");
    set_ready(cp, &names, true);
    op.wait_for("Ready True once Kafka is back", WAIT, || {
        cond(cp, "fr", "temps", "Ready").0 == "True"
            && cond(cp, "fr", "temps", "Forwarding").0 == "True"
    });
}

/// Writes the group's current ConfigMap into pod `name`'s config file, as the kubelet updates
/// a mounted ConfigMap (the forwarder polls the file and reloads).
fn sync_config(cp: &ControlPlane, workload: &str, name: &str) -> String {
    let config = jsonpath(cp, NS, "configmap", workload, "{.data.config\\.yaml}");
    assert!(!config.is_empty(), "ConfigMap {workload} has a config");
    std::fs::write(cp.dir().join(name).join("config.yaml"), &config).expect("config");
    config
}

/// The REASON column of `kubectl get fr` per rule: the third column (NAME and READY are one
/// word each).
fn reason_column(cp: &ControlPlane) -> Vec<(String, String)> {
    let table = cp
        .run_kubectl(["get", "fr", "-n", NS])
        .expect("kubectl get fr");
    let mut lines = table.lines();
    let header = lines.next().unwrap_or_default();
    assert!(
        header
            .split_whitespace()
            .take(3)
            .eq(["NAME", "READY", "REASON"]),
        "{table}"
    );
    lines
        .filter_map(|l| {
            let mut cols = l.split_whitespace();
            let name = cols.next()?.to_owned();
            Some((name, cols.nth(1)?.to_owned()))
        })
        .collect()
}

/// A record Kafka can never take, on a rule without a dead-letter topic (the default
/// `onUnwritable: hold`), holds the group: the holding rule's Ready is False with `Held`
/// naming the record, its neighbour's with `BlockedByRule` naming the rule, and `kubectl get fr`
/// shows both reasons. Changing the rule to `onUnwritable: drop` releases it: both Ready again,
/// the neighbour's messages all forwarded.
#[test]
fn a_held_record_makes_its_rule_held_and_its_neighbour_blocked_by_it() {
    let cp = common::control_plane_with_crds(NS);
    let mosquitto = Mosquitto::start().expect("mosquitto");
    let kafka = Kafka::start().expect("kafka");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    for topic in ["images", "telemetry"] {
        rt.block_on(kafka.create_topic(topic, 1)).expect("topic");
    }
    let op = Operator::start(&cp, "operator", &["--status-interval-seconds", "1"]);
    let images = rule("images", "depot", "images/#", "images");
    // Messages up to 2 MiB are read (1 MiB by default): the one below is read, and Kafka
    // refuses it.
    let connection = Connection::new("depot", "127.0.0.1", &[&kafka.bootstrap()])
        .namespace(NS)
        .mqtt_port(mosquitto.port())
        .replicas(1)
        .set("/spec/mqtt/maxMessageBytes", json!(2 * 1024 * 1024))
        .yaml();
    let rules = |images: &Rule| {
        [
            connection.clone(),
            images.yaml(),
            rule("telemetry", "depot", "sensors/+/data", "telemetry").yaml(),
        ]
        .concat()
    };
    common::apply(&cp, &rules(&images));
    let pod = "depot-default-0";
    op.wait_for("the StatefulSet's pod", WAIT, || {
        cp.run_kubectl(["get", "pod", pod, "-n", NS]).is_ok()
    });
    let _pod = run_pod(
        &cp,
        "depot-default",
        pod,
        Ipv4Addr::new(127, 77, HELD_NET, 1),
    );
    op.wait_for("both rules Ready", WAIT, || {
        ["images", "telemetry"]
            .iter()
            .all(|r| cond(&cp, "fr", r, "Ready").0 == "True")
    });

    // Over librdkafka's message.max.bytes (1,000,000): Kafka can never take it as it is.
    let big: Vec<u8> = (0..1_200_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let stream = 100;
    let mut messages = vec![("images/cam1".to_owned(), big)];
    messages.extend((0..stream).map(|i| {
        (
            format!("sensors/{}/data", i % 4),
            format!("s{i}").into_bytes(),
        )
    }));
    publish(&rt, &mosquitto, messages);

    op.wait_for("Held and BlockedByRule", WAIT, || {
        cond(&cp, "fr", "images", "Ready").1 == "Held"
            && cond(&cp, "fr", "telemetry", "Ready").1 == "BlockedByRule"
    });
    let (status, _, message) = cond(&cp, "fr", "images", "Ready");
    assert_eq!(status, "False");
    for part in [
        pod,
        "too_large",
        "images/cam1",
        "1200000 bytes",
        "Kafka topic images",
    ] {
        assert!(
            message.contains(part),
            "{part} in the Held message: {message}"
        );
    }
    let (status, _, message) = cond(&cp, "fr", "telemetry", "Ready");
    assert_eq!(status, "False");
    assert!(message.contains("rule images"), "{message}");
    let forwarded = |rule: &str| jsonpath(&cp, NS, "fr", rule, "{.status.forwarded}");
    op.wait_for("the blocked rule's records in Kafka", WAIT, || {
        forwarded("telemetry") == stream.to_string()
    });
    let mut columns = reason_column(&cp);
    columns.sort();
    assert_eq!(
        columns,
        [
            ("images".to_owned(), "Held".to_owned()),
            ("telemetry".to_owned(), "BlockedByRule".to_owned())
        ]
    );
    eprintln!(
        "{}",
        cp.run_kubectl(["get", "fr", "-n", NS])
            .expect("kubectl get fr")
    );

    // The fix, live: the rule drops what Kafka can never take.
    let before = jsonpath(
        &cp,
        NS,
        "configmap",
        "depot-default",
        "{.data.config\\.yaml}",
    );
    common::apply(
        &cp,
        &rules(&images.set("/spec/onUnwritable", json!("Drop"))),
    );
    op.wait_for("the group's config rendered anew", WAIT, || {
        jsonpath(
            &cp,
            NS,
            "configmap",
            "depot-default",
            "{.data.config\\.yaml}",
        ) != before
    });
    sync_config(&cp, "depot-default", pod);
    op.wait_for("both rules Ready again", WAIT, || {
        ["images", "telemetry"]
            .iter()
            .all(|r| cond(&cp, "fr", r, "Ready").0 == "True")
    });
    assert_eq!(jsonpath(&cp, NS, "fr", "images", "{.status.failed}"), "1");
    let mut columns = reason_column(&cp);
    columns.sort();
    assert_eq!(
        columns,
        [
            ("images".to_owned(), "ForwarderReady".to_owned()),
            ("telemetry".to_owned(), "ForwarderReady".to_owned())
        ]
    );
    let records = kafka
        .read_all("telemetry", stream, Duration::from_secs(1), WAIT)
        .expect("read telemetry");
    assert_eq!(
        records.len(),
        stream,
        "every blocked message forwarded once"
    );
}

/// 2 → 1 replicas under steady QoS 1 traffic. The operator lists the leaving pod in its
/// config's `drain` and keeps the StatefulSet at 2 until that pod's `/status` says drained; then
/// it scales down and ends the pod's session, which by then holds nothing. Every message the
/// broker acknowledged to the publisher is in Kafka, and the pod that stays now subscribes
/// plainly (a group of one).
fn scaling_down_drains_the_leaving_pod_and_loses_nothing(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
    mut pods: Vec<Pod>,
) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(kafka.create_topic("handover", 1))
        .expect("topic");
    common::apply(
        cp,
        &rule("handover", "plant", "handover/#", "handover").yaml(),
    );
    let names = ["plant-default-0", "plant-default-1"];
    op.wait_for("both pods forward rule handover", WAIT, || {
        for name in names {
            sync_config(cp, "plant-default", name);
        }
        (0..2).all(|i| pod_status(i).contains("\"handover\""))
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = numbered_traffic(mosquitto.port(), "h", std::sync::Arc::clone(&stop));
    std::thread::sleep(Duration::from_secs(3));

    hold_pod(cp, "plant-default-1");
    // Pod 1's forwarder is SIGKILLed under traffic, and the group scaled down while it is dead:
    // what the broker queues for its session meanwhile waits there, so the StatefulSet waits too.
    drop(pods.pop());
    common::apply(cp, &connection_yaml("plant", 1, mosquitto, kafka));
    let down = Instant::now();
    while down.elapsed() < DRAIN_WAITS_FOR_A_DEAD_POD {
        sync_config(cp, "plant-default", "plant-default-0");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        jsonpath(cp, NS, "statefulset", "plant-default", "{.spec.replicas}"),
        "2",
        "no scale-down while the leaving pod cannot drain"
    );
    // The kubelet restarts its container (the config it mounts lists it in drain): it resumes
    // its session, forwards what was queued there, and says drained.
    pods.push(run_pod(
        cp,
        "plant-default",
        "plant-default-1",
        Ipv4Addr::new(127, 77, STEPS_NET, 2),
    ));
    // The kubelet's part: the mounted ConfigMap follows, here at once.
    op.wait_for(
        "the StatefulSet scaled to 1 once pod 1 drained",
        WAIT,
        || {
            for name in names {
                sync_config(cp, "plant-default", name);
            }
            jsonpath(cp, NS, "statefulset", "plant-default", "{.spec.replicas}") == "1"
        },
    );
    assert!(
        pod_status(1).contains("\"drained\":true"),
        "scaled down only once pod 1 said drained: {}",
        pod_status(1)
    );
    let events = common::Scene::new(cp, op, NS).events("plant");
    assert!(events.contains("Normal Draining"), "{events}");
    let leaving = pods.pop().expect("pod 1");
    release_pod(cp, op, "plant-default-1", leaving);
    let prefix = session_prefix(cp, op, "plant");
    op.wait_for("pod 1's session ended", WAIT, || {
        sessions(cp) == format!("{prefix}plant-default-0")
    });
    op.wait_for("pod 0 subscribes plainly", WAIT, || {
        sync_config(cp, "plant-default", "plant-default-0");
        pod_status(0).contains("\"shared\":false")
    });
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = traffic.join().expect("traffic");
    assert_all_in_kafka(kafka, sent);
    assert_session_gone(&rt, mosquitto, &format!("{prefix}plant-default-1"));
    renaming_the_group_drains_the_old_workload_and_loses_nothing(
        cp, op, mosquitto, kafka, pods, sent,
    );
}

/// Every rule of group `default` moves to group `east` under steady traffic: the operator
/// starts `plant-east`, and once it is ready lists `plant-default`'s pod in its `drain`, keeps
/// the old workload until that pod says drained, then removes it and ends its session. Every
/// acknowledged message is in Kafka.
fn renaming_the_group_drains_the_old_workload_and_loses_nothing(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
    mut pods: Vec<Pod>,
    sent_before: usize,
) {
    hold_pod(cp, "plant-default-0");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = numbered_traffic(mosquitto.port(), "r", std::sync::Arc::clone(&stop));
    std::thread::sleep(Duration::from_secs(2));
    common::apply(
        cp,
        &[
            rule("temps", "plant", "plant/+/temp", "temps").group("east"),
            rule("alarms", "plant", "plant/+/alarm", "alarms")
                .filter(ALARMS_FILTER)
                .group("east"),
            rule("handover", "plant", "handover/#", "handover").group("east"),
        ]
        .map(|r| r.yaml())
        .concat(),
    );
    let east_pod = run_new_pod(cp, op, "plant-east", Ipv4Addr::new(127, 77, STEPS_NET, 3));
    op.wait_for("the old workload drained and removed", WAIT, || {
        sync_config(cp, "plant-east", "plant-east-0");
        let config = jsonpath(
            cp,
            NS,
            "configmap",
            "plant-default",
            "{.data.config\\.yaml}",
        );
        if !config.is_empty() {
            std::fs::write(
                cp.dir().join("plant-default-0").join("config.yaml"),
                &config,
            )
            .expect("config");
        }
        cp.run_kubectl(["get", "statefulset", "plant-default", "-n", NS])
            .is_err_and(|e| e.to_string().contains("NotFound"))
    });
    let events = common::Scene::new(cp, op, NS).events("plant");
    assert!(events.contains("Normal Draining"), "{events}");
    let old = pods.pop().expect("pod 0");
    release_pod(cp, op, "plant-default-0", old);
    let prefix = session_prefix(cp, op, "plant");
    op.wait_for("the old pod's session ended", WAIT, || {
        sessions(cp) == format!("{prefix}plant-east-0")
    });
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = sent_before + traffic.join().expect("traffic");
    assert_all_in_kafka(kafka, sent);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    assert_session_gone(&rt, mosquitto, &format!("{prefix}plant-default-0"));
    moving_a_rule_between_two_running_groups_loses_nothing(
        cp, op, mosquitto, kafka, east_pod, sent,
    );
}

/// How long after the old group's pod the new group's pod sees its changed ConfigMap here:
/// kubelets sync mounted ConfigMaps independently, up to a minute apart by default.
const NEW_GROUP_LAG: Duration = Duration::from_secs(5);

/// Rule handover moves from group `east` to group `west` (which serves another rule) under
/// steady traffic, the new group's pod seeing its config NEW_GROUP_LAG after the old one's:
/// the operator keeps the rule in `east` until `west`'s pod runs it, so one of them is
/// subscribed throughout, then lists it in `east`'s `retiring` until `east`'s pod has handed
/// over what its session held for it. Every acknowledged message is in Kafka.
fn moving_a_rule_between_two_running_groups_loses_nothing(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
    east_pod: Pod,
    sent_before: usize,
) {
    common::apply(
        cp,
        &rule("anchor", "plant", "west/anchor", "temps")
            .group("west")
            .yaml(),
    );
    let west_pod = run_new_pod(cp, op, "plant-west", Ipv4Addr::new(127, 77, STEPS_NET, 4));
    op.wait_for("west runs its rule", WAIT, || {
        sync_config(cp, "plant-west", "plant-west-0");
        pod_status(3).contains("\"anchor\"")
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = numbered_traffic(mosquitto.port(), "m", std::sync::Arc::clone(&stop));
    std::thread::sleep(Duration::from_secs(2));
    common::apply(
        cp,
        &rule("handover", "plant", "handover/#", "handover")
            .group("west")
            .yaml(),
    );
    let moved = Instant::now();
    let mut dropped_early = false;
    let (mut listed_retiring, mut reported_handed_over, mut dropped_before_report) =
        (false, false, false);
    op.wait_for("handover served by west alone", WAIT, || {
        let east = sync_config(cp, "plant-east", "plant-east-0");
        listed_retiring |= east.contains("retiring:");
        reported_handed_over |= east_handed_over(&pod_status(2));
        dropped_before_report |=
            listed_retiring && !reported_handed_over && !east.contains("name: handover");
        if moved.elapsed() >= NEW_GROUP_LAG {
            sync_config(cp, "plant-west", "plant-west-0");
        } else {
            dropped_early |= !east.contains("name: handover");
        }
        pod_status(3).contains("\"handover\"") && !pod_status(2).contains("\"handover\"")
    });
    eprintln!("handover moved east → west in {:.1?}", moved.elapsed());
    assert!(
        pod_status(2).contains("\"temps\""),
        "east keeps its other rules"
    );
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = sent_before + traffic.join().expect("traffic");
    assert_all_in_kafka(kafka, sent);
    assert!(
        !dropped_early,
        "east's config kept the rule while west did not run it"
    );
    assert!(
        listed_retiring && reported_handed_over && !dropped_before_report,
        "east's config listed the rule in retiring, and dropped it only once east's pod reported \
         it handed over (listed {listed_retiring}, reported {reported_handed_over}, dropped \
         before {dropped_before_report})"
    );
    let events = events(cp, "reason=MovingRule", "{.items[*].message}");
    assert!(
        events.contains("\"handover\" moves to group \"west\": served by group \"east\"")
            && events.contains("group \"east\" hands over what its sessions still hold"),
        "a Normal Event for each step of the move: {events}"
    );
    reversing_a_move_half_way_loses_nothing(cp, op, mosquitto, kafka, [east_pod, west_pod], sent);
}

/// The rule moves back to east and is reverted to west half-way: east runs it, and west's pod
/// has read `retiring` (it unsubscribed) when the rule's group is set back to west. West
/// serves it again, and east keeps it until west's pod runs it again: with east's pod reading
/// each config at once and west's [`NEW_GROUP_LAG`] later, no message published meanwhile is
/// lost (before, east dropped it at once and nothing subscribed its filter until west's pod
/// read its config).
fn reversing_a_move_half_way_loses_nothing(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
    pods: [Pod; 2],
    sent_before: usize,
) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = numbered_traffic(mosquitto.port(), "v", std::sync::Arc::clone(&stop));
    std::thread::sleep(Duration::from_secs(2));
    let group = |g: &str| {
        rule("handover", "plant", "handover/#", "handover")
            .group(g)
            .yaml()
    };
    common::apply(cp, &group("east"));
    op.wait_for("east runs handover and west retires it", WAIT, || {
        sync_config(cp, "plant-east", "plant-east-0");
        jsonpath(cp, NS, "configmap", "plant-west", "{.data.config\\.yaml}").contains("retiring:")
    });
    // West's pod reads it: it unsubscribes the rule's filter and starts handing over.
    sync_config(cp, "plant-west", "plant-west-0");
    common::apply(cp, &group("west"));
    let reverted = Instant::now();
    let mut dropped_early = false;
    op.wait_for("handover served by west alone again", WAIT, || {
        let east = sync_config(cp, "plant-east", "plant-east-0");
        if reverted.elapsed() >= NEW_GROUP_LAG {
            sync_config(cp, "plant-west", "plant-west-0");
        } else {
            dropped_early |= !east.contains("name: handover");
        }
        pod_status(3).contains("\"handover\"") && !pod_status(2).contains("\"handover\"")
    });
    eprintln!(
        "move reverted half-way settled in {:.1?}",
        reverted.elapsed()
    );
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = sent_before + traffic.join().expect("traffic");
    assert_all_in_kafka(kafka, sent);
    assert!(
        !dropped_early,
        "east kept the rule while west's pod did not run it again"
    );
    drop(pods);
}

/// The Events of the test's namespace chosen by `selector`, as `jsonpath` prints them.
fn events(cp: &ControlPlane, selector: &str, jsonpath: &str) -> String {
    cp.run_kubectl([
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        selector,
        "-o",
        &format!("jsonpath={jsonpath}"),
    ])
    .expect("kubectl get events")
}

/// Whether a pod's `/status` reports the rule `handover` retiring and handed over.
fn east_handed_over(status: &str) -> bool {
    serde_json::from_str::<ferry_api::status::ForwarderStatus>(status).is_ok_and(|s| {
        s.rules
            .iter()
            .any(|r| r.name == "handover" && r.retiring.is_some_and(|h| h.drained))
    })
}

/// `/status` of the stand-in pod on 127.77.<STEPS_NET>.<i + 1>; empty when it does not answer.
fn pod_status(i: u8) -> String {
    ferry_e2e::http_get_at(
        SocketAddr::from((Ipv4Addr::new(127, 77, STEPS_NET, i + 1), 8080)),
        "/status",
    )
    .map(|(_, body)| body)
    .unwrap_or_default()
}

/// The client ids the connection's status records.
fn sessions(cp: &ControlPlane) -> String {
    jsonpath(
        cp,
        NS,
        "brokerconnection",
        "plant",
        "{.status.mqttSessions[*]}",
    )
}

/// Every distinct message published on `handover/#` (`sent` of them) is in Kafka.
fn assert_all_in_kafka(kafka: &Kafka, sent: usize) {
    let records = kafka
        .read_all(
            "handover",
            sent,
            Duration::from_secs(3),
            Duration::from_secs(60),
        )
        .expect("read handover");
    let distinct: std::collections::BTreeSet<&str> =
        records.iter().map(|r| r.value_str()).collect();
    assert_eq!(
        distinct.len(),
        sent,
        "every message the broker acknowledged is in Kafka ({} records)",
        records.len()
    );
}

/// The broker holds no session, and queues nothing, for `client_id`.
fn assert_session_gone(rt: &tokio::runtime::Runtime, mosquitto: &Mosquitto, client_id: &str) {
    let probed = rt
        .block_on(ferry_e2e::probe_session(
            std::net::IpAddr::from([127, 0, 0, 1]),
            mosquitto.port(),
            None,
            client_id,
            false,
        ))
        .expect("probe the broker");
    assert_eq!(probed, (false, 0), "{client_id}'s session is gone");
}

/// As a kubelet would, the pod's object stays (Terminating) until its container stopped.
fn hold_pod(cp: &ControlPlane, name: &str) {
    set_finalizers(cp, name, r#"["ferry.test/kubelet"]"#);
}

/// The kubelet's part once the pod is deleted: stops its container, then lets the object go.
fn release_pod(cp: &ControlPlane, op: &Operator, name: &str, pod: Pod) {
    op.wait_for(&format!("{name} terminating"), WAIT, || {
        !jsonpath(cp, NS, "pod", name, "{.metadata.deletionTimestamp}").is_empty()
    });
    drop(pod);
    set_finalizers(cp, name, "null");
}

/// Sets pod `name`'s finalizers to `json`.
fn set_finalizers(cp: &ControlPlane, name: &str, json: &str) {
    let patch = format!(r#"{{"metadata":{{"finalizers":{json}}}}}"#);
    cp.run_kubectl(["patch", "pod", name, "-n", NS, "--type=merge", "-p", &patch])
        .unwrap_or_else(|e| panic!("set {name}'s finalizers to {json}: {e}"));
}

/// Publishes `handover/<i>` messages with distinct payloads (starting with `tag`), 50 every
/// 100 ms, until `stop`; returns how many the broker acknowledged.
fn numbered_traffic(
    port: u16,
    tag: &'static str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    publish_until(port, stop, Duration::from_millis(100), move |round| {
        (0..50)
            .map(|i| {
                (
                    format!("handover/{}", i % 5),
                    format!("{tag}{round}-{i}").into_bytes(),
                )
            })
            .collect()
    })
}

/// Issue 35, as found on a cluster: `helm uninstall` (the operator gone, the connection's
/// finalizer released), then the connection deleted, leaves its forwarders' sessions at the
/// broker, members of their group's share group. The same manifests applied again (a GitOps
/// re-sync) create it anew with group `b` at 2: every message the broker acknowledges reaches
/// Kafka, because the new pods neither resume the old sessions nor join their share group. (With
/// the ids of before, `ferry.<namespace>.<pod>`, the orphan `hub-b-2` was a third member of the
/// new group and held every third message.)
#[test]
fn a_connection_created_again_shares_no_session_with_the_one_deleted_without_an_operator() {
    let (cp, mosquitto, kafka, rt) = brokers_and_control_plane();
    let mut op = Operator::start(&cp, "operator", &[]);
    let hub = |replicas| connection_yaml("hub", replicas, &mosquitto, &kafka);
    let lines = rule("lines", "hub", "line1/#", "temps").group("b").yaml();
    common::apply(&cp, &[hub(3), lines].concat());
    let old = run_group(&cp, &op, "hub-b", 3);
    let old_prefix = session_prefix(&cp, &op, "hub");

    // The uninstall: the operator stops, the chart's hook releases the finalizer; then the
    // connection is deleted, its forwarders stop, and their sessions stay at the broker.
    op.terminate();
    cp.run_kubectl([
        "patch",
        "bc",
        "hub",
        "-n",
        NS,
        "--type=merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ])
    .expect("release the finalizer");
    drop(old);
    cp.run_kubectl(["delete", "bc", "hub", "-n", NS])
        .expect("delete the connection");
    // The garbage collector's part, done here at once: in a control plane this new, its first
    // pass over a new kind takes half a minute.
    let (children, of_hub) = ("sts,cm,secret,svc,pdb,pod", "ferry.dev/connection=hub");
    cp.run_kubectl(["delete", children, "-n", NS, "-l", of_hub])
        .expect("delete the connection's children");

    // The reinstall, and the same manifests with group b at 2.
    let op = Operator::start(&cp, "operator-reinstalled", &[]);
    common::apply(&cp, &hub(2));
    let _new = run_group(&cp, &op, "hub-b", 2);
    let n = 900;
    let messages = (0..n)
        .map(|i| (format!("line1/{}", i % 10), format!("o{i}").into_bytes()))
        .collect();
    publish(&rt, &mosquitto, messages);
    let records = kafka
        .read_all("temps", n, Duration::from_secs(1), Duration::from_secs(30))
        .expect("read temps");
    let distinct: std::collections::BTreeSet<&str> =
        records.iter().map(|r| r.value_str()).collect();
    assert_eq!(
        distinct.len(),
        n,
        "every message the broker acknowledged is in Kafka"
    );
    // The new connection's names carry its UID, its group subscribes through a share group of
    // its own, and the orphan was there all along, in the old one, holding its share of copies.
    let new_prefix = session_prefix(&cp, &op, "hub");
    let uid = jsonpath(&cp, NS, "bc", "hub", "{.metadata.uid}");
    assert_eq!(new_prefix, format!("ferry.{NS}.{}.", &uid[..8]));
    assert_ne!(new_prefix, old_prefix, "a new connection, new names");
    let config = jsonpath(&cp, NS, "configmap", "hub-b", "{.data.config\\.yaml}");
    assert!(
        config.contains(&format!("shared_group: {new_prefix}hub-b\n"))
            && !config.contains("subscribe_shared: false"),
        "the new group's own share group:\n{config}"
    );
    let orphan = format!("{old_prefix}hub-b-2");
    let (present, queued) = rt
        .block_on(ferry_e2e::probe_session(
            std::net::IpAddr::from([127, 0, 0, 1]),
            mosquitto.port(),
            None,
            &orphan,
            false,
        ))
        .expect("probe the broker");
    eprintln!("{orphan}: session present {present}, {queued} of {n} messages queued");
    assert!(present && queued > 0, "the orphaned session stayed");
}

/// Once the StatefulSet controller has created `workload`'s `replicas` pods, runs them on
/// `127.77.<ORPHAN_NET>.<ordinal + 1>` and waits until each is ready (subscribed, Kafka
/// reached).
fn run_group(cp: &ControlPlane, op: &Operator, workload: &str, replicas: u8) -> Vec<Pod> {
    let names: Vec<String> = (0..replicas).map(|o| format!("{workload}-{o}")).collect();
    op.wait_for(&format!("{workload}'s pods"), WAIT, || {
        names
            .iter()
            .all(|p| cp.run_kubectl(["get", "pod", p, "-n", NS]).is_ok())
    });
    let ip = |o: u8| Ipv4Addr::new(127, 77, ORPHAN_NET, o + 1);
    let pods = (0..replicas)
        .map(|o| run_pod(cp, workload, &names[usize::from(o)], ip(o)))
        .collect();
    op.wait_for(&format!("{workload}'s pods subscribed"), WAIT, || {
        (0..replicas).all(|o| {
            ferry_e2e::http_get_at(SocketAddr::from((ip(o), 8080)), "/readyz")
                .is_ok_and(|(code, _)| code == 200)
        })
    });
    pods
}

/// Connection `name`'s `status.sessionPrefix` (the start of its client ids), once written.
fn session_prefix(cp: &ControlPlane, op: &Operator, name: &str) -> String {
    let prefix = || jsonpath(cp, NS, "bc", name, "{.status.sessionPrefix}");
    op.wait_for("status.sessionPrefix", WAIT, || !prefix().is_empty());
    prefix()
}

/// The stand-in pods' IPs of the test below (see [`STEPS_NET`]).
const SUBSCRIBE_NET: u8 = 4;

/// How long after the operator renders a rule the stand-in kubelet syncs the group's
/// ConfigMap into its pods (a real kubelet takes up to about a minute): long against the 1 s
/// poll and a reconcile, so that a `Ready` that does not wait for the pods shows.
const KUBELET_SYNC: Duration = Duration::from_secs(5);

/// Issue 35, as found on a cluster: `kubectl wait --for=condition=Ready` on a rule just added
/// to a running group, then publishing at once: every message reaches Kafka, because `Ready`
/// waited until every pod of the group had subscribed the rule's filters. And a scale-up under
/// traffic, the new pod starting and then joining: the running pods' rules stay Ready, with
/// no Warning Event, and every message reaches Kafka.
#[test]
fn a_rule_is_ready_once_its_pods_subscribed_it_and_stays_so_through_a_scale_up() {
    let (cp, mosquitto, kafka, rt) = brokers_and_control_plane();
    let op = Operator::start(&cp, "operator", &["--status-interval-seconds", "1"]);
    common::apply(
        &cp,
        &[
            connection_yaml("plant", 2, &mosquitto, &kafka),
            rule("temps", "plant", "plant/+/temp", "temps").yaml(),
        ]
        .concat(),
    );
    let mut pods: Vec<Pod> = (0..2u8)
        .map(|o| {
            let name = format!("plant-default-{o}");
            op.wait_for(&format!("pod {name}"), WAIT, || {
                cp.run_kubectl(["get", "pod", &name, "-n", NS]).is_ok()
            });
            let pod = start_pod(&cp, "plant-default", &name, subscribe_ip(o), false);
            probe_until_ready(&cp, &name, o);
            pod
        })
        .collect();
    op.wait_for("rule temps Ready", WAIT, || {
        cond(&cp, "fr", "temps", "Ready").0 == "True"
    });
    kubectl_wait_then_publish_loses_nothing(&cp, &mosquitto, &kafka, &rt);
    pods.push(a_scale_up_leaves_the_rules_ready(
        &cp, &op, &mosquitto, &kafka,
    ));
}

/// `127.77.<SUBSCRIBE_NET>.<ordinal + 1>`.
fn subscribe_ip(ordinal: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 77, SUBSCRIBE_NET, ordinal + 1)
}

/// The forwarder container's readiness probe period (`periodSeconds` in `children.rs`).
const READINESS_PERIOD: Duration = Duration::from_secs(5);

/// The kubelet's readiness probe of pod `name` (on [`subscribe_ip`] of `ordinal`), from its
/// start and every [`READINESS_PERIOD`]: reports it Ready once its `/readyz` says so (it
/// subscribed and reached Kafka).
fn probe_until_ready(cp: &ControlPlane, name: &str, ordinal: u8) {
    let addr = SocketAddr::from((subscribe_ip(ordinal), 8080));
    let start = Instant::now();
    while !ferry_e2e::http_get_at(addr, "/readyz").is_ok_and(|(code, _)| code == 200) {
        assert!(start.elapsed() < WAIT, "{name} never ready");
        std::thread::sleep(READINESS_PERIOD);
    }
    set_ready(cp, &[name], true);
}

/// Rule alarms added to the running group: `kubectl wait --for=condition=Ready` returns only
/// once both pods have loaded and subscribed it (the stand-in kubelet syncs their config
/// [`KUBELET_SYNC`] after the render); 100 QoS 1 messages published at once then all reach
/// Kafka.
fn kubectl_wait_then_publish_loses_nothing(
    cp: &ControlPlane,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
) {
    common::apply(
        cp,
        &rule("alarms", "plant", "plant/+/alarm", "alarms").yaml(),
    );
    let applied = Instant::now();
    let timeout = format!("--timeout={}s", WAIT.as_secs());
    let mut wait = cp
        .kubectl([
            "wait",
            "--for=condition=Ready",
            "fr/alarms",
            "-n",
            NS,
            &timeout,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl wait");
    // The stand-in kubelet syncs the pods' config KUBELET_SYNC after the apply (once the
    // operator rendered the rule); whenever kubectl wait returns, the messages go at once, as a
    // user's would. Its exit is looked at every 100 ms, well within the operator's 1 s poll.
    let mut synced = None;
    let waited = loop {
        if let Some(status) = wait.try_wait().expect("kubectl wait") {
            break status;
        }
        let config = || {
            jsonpath(
                cp,
                NS,
                "configmap",
                "plant-default",
                "{.data.config\\.yaml}",
            )
        };
        if synced.is_none()
            && applied.elapsed() >= KUBELET_SYNC
            && config().contains("name: alarms")
        {
            for o in 0..2 {
                sync_config(cp, "plant-default", &format!("plant-default-{o}"));
            }
            synced = Some(applied.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let ready = applied.elapsed();
    let mut stderr = String::new();
    if let Some(mut e) = wait.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut stderr).expect("kubectl wait's stderr");
    }
    assert!(waited.success(), "kubectl wait: {stderr}");
    let n = 100;
    let messages: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| {
            (
                format!("plant/{}/alarm", i % 10),
                format!("w{i}").into_bytes(),
            )
        })
        .collect();
    publish(rt, mosquitto, messages);
    let records = kafka
        .read_all("alarms", n, Duration::from_secs(1), Duration::from_secs(30))
        .expect("read alarms");
    let arrived: std::collections::BTreeSet<&str> = records.iter().map(|r| r.value_str()).collect();
    let synced = synced.map_or("not yet".to_owned(), |at| format!("{at:.1?} after it"));
    eprintln!(
        "rule alarms: kubectl wait returned {ready:.1?} after kubectl apply, the pods' config \
         synced {synced}; {} of {n} published then reached Kafka",
        arrived.len()
    );
    assert_eq!(arrived.len(), n, "every message published once Ready");
}

/// The connection's replicas 2 → 3 under steady traffic: the stand-in kubelet starts pod 2,
/// reports it Running and not Ready, and Ready once its `/readyz` says so (its readiness
/// probe). Sampled at every 1 s poll until pod 2 serves both rules, neither rule leaves Ready
/// True; no rule gets a Warning Event meanwhile; every message reaches Kafka. Returns pod 2.
fn a_scale_up_leaves_the_rules_ready(
    cp: &ControlPlane,
    op: &Operator,
    mosquitto: &Mosquitto,
    kafka: &Kafka,
) -> Pod {
    let rule_warnings = || {
        let warnings = events(
            cp,
            "involvedObject.kind=ForwardingRule,type=Warning",
            "{range .items[*]}{.involvedObject.name} {.reason} x{.count}: {.message}\n{end}",
        );
        warnings
            .lines()
            .map(str::to_owned)
            .collect::<std::collections::BTreeSet<_>>()
    };
    let warned_before = rule_warnings();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = steady_traffic(mosquitto.port(), stop.clone());
    common::apply(cp, &connection_yaml("plant", 3, mosquitto, kafka));
    let scaled = Instant::now();
    let new = "plant-default-2";
    // One read of every rule per sample: name, Ready, readyReplicas, Forwarding's message.
    let each_rule = "jsonpath={range .items[*]}{.metadata.name}|\
        {.status.conditions[?(@.type==\"Ready\")].status}|\
        {.status.conditions[?(@.type==\"Ready\")].reason}|{.status.readyReplicas}|\
        {.status.conditions[?(@.type==\"Forwarding\")].message}{\"\\n\"}{end}";
    let sampling = std::sync::atomic::AtomicBool::new(true);
    let (pod, samples) = std::thread::scope(|scope| {
        // Sampled at the operator's poll interval here, while the kubelet's part goes on.
        let sampler = scope.spawn(|| {
            let mut samples = Vec::new();
            let mut tick = Instant::now();
            while sampling.load(std::sync::atomic::Ordering::SeqCst) {
                let rules = cp
                    .run_kubectl(["get", "fr", "-n", NS, "-o", each_rule])
                    .expect("kubectl get fr");
                samples.push((scaled.elapsed(), rules));
                tick += Duration::from_secs(1);
                std::thread::sleep(tick.saturating_duration_since(Instant::now()));
            }
            samples
        });
        op.wait_for("pod 2 created", WAIT, || {
            cp.run_kubectl(["get", "pod", new, "-n", NS]).is_ok()
        });
        let pod = start_pod(cp, "plant-default", new, subscribe_ip(2), false);
        probe_until_ready(cp, new, 2);
        // Until it serves both rules: counted in readyReplicas, and found subscribed.
        op.wait_for("pod 2 serving both rules", WAIT, || {
            let rules = cp
                .run_kubectl(["get", "fr", "-n", NS, "-o", each_rule])
                .expect("kubectl get fr");
            rules
                .lines()
                .filter(|l| l.contains("|3/3|") && l.contains("serving its group (3)"))
                .count()
                == 2
        });
        sampling.store(false, std::sync::atomic::Ordering::SeqCst);
        (pod, sampler.join().expect("sampler"))
    });
    let served = scaled.elapsed();
    let not_ready: Vec<String> = samples
        .iter()
        .flat_map(|(at, rules)| {
            rules
                .lines()
                .filter(|l| l.split('|').nth(1) != Some("True"))
                .map(move |l| format!("{at:.1?} {l}"))
        })
        .collect();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sent = traffic.join().expect("traffic");
    let warnings: Vec<String> = rule_warnings()
        .difference(&warned_before)
        .cloned()
        .collect();
    let mut arrived = std::collections::BTreeSet::new();
    for (topic, share) in [("temps", 15), ("alarms", 5)] {
        let records = kafka
            .read_all(topic, sent * share / 20, Duration::from_secs(3), WAIT)
            .expect("read");
        arrived.extend(
            records
                .into_iter()
                .map(|r| r.value_str().to_owned())
                .filter(|v| v.starts_with('s')),
        );
    }
    eprintln!(
        "scaled 2 -> 3 under traffic: pod 2 served both rules {served:.1?} after the patch; {} \
         samples of both rules' Ready, not True: {not_ready:?}; Warning Events on rules: \
         {warnings:?}; {} of {sent} messages in Kafka",
        samples.len(),
        arrived.len()
    );
    assert!(not_ready.is_empty(), "Ready left True: {not_ready:?}");
    assert!(
        warnings.is_empty(),
        "Warning Events of the scale-up: {warnings:?}"
    );
    assert_eq!(arrived.len(), sent, "every message published meanwhile");
    pod
}
