//! Ferry's whole user path on a real single-node Kubernetes cluster (`e2e/cluster/up.sh`:
//! kubelet, containerd, runc), with a private state dir, network namespace and subnets:
//!
//! 1. the cluster comes up; a private registry (Debian's `docker-registry`, HTTPS with its own
//!    CA, which the cluster's containerd trusts through a `hosts.toml`) starts on the node
//!    address, and the release is mirrored into it as a platform team would: the
//!    `ferry-operator` and `ferry-forwarder` images with `skopeo copy oci-archive:…`, the chart
//!    with `helm package` and `helm push` (nothing is imported into containerd);
//! 2. Mosquitto, Kafka and a schema registry (Apicurio, HTTPS, basic auth) run inside the cluster's
//!    namespace on the node address, so pods reach them (and so does this test, through the
//!    veth);
//! 3. README.md's install command ([`readme_install`]) against that registry: `helm install` of
//!    the `oci://` chart with `--set image.registry=` and `--set forwarder.image.registry=` (2
//!    operator replicas, leader election); the operator pods, and later the forwarder pods, run
//!    the images pulled from the registry (their image IDs are the digests skopeo pushed);
//! 4. a `BrokerConnection` (MQTT 5, persistent sessions, 2 forwarder replicas, an MQTT password
//!    made of YAML's special characters and a newline, from a Secret; the schema registry over
//!    HTTPS with its CA and basic-auth login from another Secret) and three `ForwardingRule`s are applied; the
//!    rules become Ready (time measured);
//! 5. messages published over MQTT arrive in Kafka with the expected topics and keys, none lost;
//!    `kubectl get fr` shows Ready and the forwarded counts; the Avro rule's records all decode
//!    with confluent-kafka's AvroDeserializer, carrying the id of the schema registered for the
//!    topic's subject, and its `.status.schema` shows that id and version 1;
//! 6. Kafka is stopped for 60 s while messages keep coming, then Mosquitto for 60 s: each
//!    time `kubectl get fr` turns Ready False with the reason (`KafkaUnreachable`,
//!    `MqttDisconnected`) within 30 s, and True again once the broker is back; nothing
//!    published during the Kafka outage is lost;
//! 7. a rule is edited live (new Kafka topic and key) while messages keep coming: every forwarder
//!    pod applies the new config without a restart, nothing is lost, and what is published
//!    afterwards follows the new mapping; meanwhile a rule is added to the running group,
//!    `kubectl wait --for=condition=Ready` on it returns only once the pods subscribed it, and
//!    100 messages published at once then all reach Kafka;
//! 8. a forwarder pod is deleted under load: the StatefulSet recreates it with the same name (so
//!    the same MQTT client id and persistent session), nothing is lost (time to come back
//!    measured, duplicates counted); its reconnect (same client id, clean start off) is checked
//!    in Mosquitto's log. Then the other pod is force-deleted (`--grace-period=0 --force`: the
//!    API object goes at once and the replacement starts while the old container is killed):
//!    nothing lost either. Then the connection's forwarder replicas are patched from 2 to 1
//!    under load: the operator has pod 1 drain its session into Kafka before the StatefulSet
//!    shrinks (a Normal `Draining` Event), then ends that session; nothing is lost, duplicates
//!    stay within the window, the broker holds no session for pod 1, the rules are Ready 1/1;
//! 9. deleting the rules and the connection removes everything they owned, and the operator
//!    ends the forwarders' MQTT sessions (the broker holds none for them afterwards);
//! 10. `helm uninstall` leaves nothing of the release but the CRDs (and, printed as a NOTE, not
//!     failed on, the leader-election Lease the operator created at run time).
//!
//! A rule edit reaches the pods through the kubelet's refresh of the mounted ConfigMap, about a
//! minute here (the kubelet's default `syncFrequency`), which is most of the ~2.5 min this test
//! takes once the cluster's binaries and images are cached.
//!
//! Needs root, `e2e/install.sh` (Mosquitto, Kafka, docker-registry, skopeo), `e2e/tools/build.sh`
//! (helm) and the images of `e2e/images/build.sh`. The cluster is always torn down (`down.sh`, also on failure; the
//! component logs are then kept and their path printed).

use std::collections::BTreeMap;
use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, ensure};
use ferry_e2e::cluster::{
    BrokerOptions, Brokers, CLUSTER_POLL, Cluster, METRIC_AVRO, METRICS_SUBJECT, METRICS_TOPIC,
    MqttEndpoint, cel_example_messages, ensure_helm, ensure_root, example_rules, ferry_images,
    metric_messages, metrics_rule_yaml, plant_connection_yaml, publish_paced, publish_to,
    read_metrics_decoded,
};
use ferry_e2e::cluster::{VERSION, repo_dir};
use ferry_e2e::kube::Kubectl as _;
use ferry_e2e::{
    Kafka, Mosquitto, MosquittoOptions, Record, Registry, SchemaRegistry, SchemaRegistryOptions,
    SchemaType, http_get_ok, wait_until_some,
};

/// README.md's install command: its first line that starts with `helm install `. This test
/// runs it against a local registry, with only the `ghcr.io` of the chart reference replaced by
/// that registry and flags appended, so the README's command is the one tested.
fn readme_install() -> Result<&'static str> {
    include_str!("../../README.md")
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("helm install "))
        .ok_or_else(|| anyhow!("README.md has no `helm install` command"))
}
/// Where releases publish (`.github/workflows/release.yml`); a mirror keeps the paths under it.
const PUBLISHED_REGISTRY: &str = "ghcr.io";
const CHART_REPOSITORY: &str = "ferry-dev/charts";
/// The images (`e2e/images/build.sh` names) and their repositories under a registry.
const IMAGE_REPOSITORIES: [(&str, &str); 2] = [
    ("ferry-operator", "ferry-dev/ferry-operator"),
    ("ferry-forwarder", "ferry-dev/ferry-forwarder"),
];
const NS: &str = "plant";
const RELEASE_NS: &str = "ferry-system";
const STS: &str = "plant-default";
/// The forwarders' MQTT login, through the operator: the password holds every character with a
/// meaning in YAML, a newline and a trailing space, and is accepted only if it reaches Mosquitto
/// byte for byte (the operator mounts it as a file; it never passes through config text).
const FORWARDER_USER: &str = "ferry";
const FORWARDER_PASSWORD: &str = "p: a #b 'c\" {d} [e] *f &g !h |i >j %k @l `m ,n ?o -\n${P} ";
/// The test's own publishers log in as this user.
const PUBLISHER: (&str, &str) = ("e2e-publisher", "publisher-pw");
/// The schema registry's login, in the Secret `registry-credentials` with its CA: a password of YAML's and
/// the shell's special characters, as the MQTT one (but not what Quarkus's config changes: `${`
/// and spaces at the ends).
const REGISTRY_LOGIN: (&str, &str) = ("ferry-registry", "r: a #b 'c\" {d} *f &g !h |i %k @l `m $P");
/// Avro readings published to the rule `metrics`.
const METRICS: usize = 20;
/// How long each broker outage lasts.
const OUTAGE: Duration = Duration::from_secs(60);
/// From a broker going away to `kubectl get fr` saying so: the forwarder notices at once (MQTT)
/// or within its Kafka probe (every 5 s, 3 s timeout), the operator reads the pods' `/status`
/// every 10 s (the chart's default) and then reconciles the rule's `Ready`.
const READY_FOLLOWS_OUTAGE: Duration = Duration::from_secs(30);

fn temp_topic(n: usize) -> String {
    format!("plant/{}/temp", n % 5 + 1)
}

/// The forwarder's in-flight window: the connection leaves `spec.mqtt.maxInflight` at its
/// default.
const FORWARDER_WINDOW: usize = 1000;

fn alarm_topic(n: usize) -> String {
    format!("plant/{}/alarm", n % 3 + 1)
}

/// How many of `expected` are missing from `records` and how many records are duplicates,
/// counting only records whose payload starts with `prefix-`.
fn lost_and_duplicates(
    records: &[&Record],
    prefix: &str,
    expected: &[String],
) -> (Vec<String>, usize) {
    let mut seen = std::collections::HashMap::<&str, usize>::new();
    let p = format!("{prefix}-");
    for r in records.iter().filter(|r| r.value_str().starts_with(&p)) {
        *seen.entry(r.value_str()).or_default() += 1;
    }
    let lost = expected
        .iter()
        .filter(|e| !seen.contains_key(e.as_str()))
        .cloned()
        .collect();
    let dups = seen.values().map(|c| c - 1).sum();
    (lost, dups)
}

/// Reads `topics` from the beginning (again and again, at most `timeout`) until every one of
/// `expected` (payloads starting with `prefix-`) is there; returns what it read last.
fn read_complete(
    kafka: &Kafka,
    topics: &[&str],
    prefix: &str,
    expected: &[String],
    timeout: Duration,
) -> Result<Vec<Record>> {
    let start = Instant::now();
    loop {
        let mut records = Vec::new();
        for topic in topics {
            records.extend(kafka.read_all(
                topic,
                0,
                Duration::from_secs(3),
                Duration::from_secs(30),
            )?);
        }
        let refs: Vec<&Record> = records.iter().collect();
        if lost_and_duplicates(&refs, prefix, expected).0.is_empty() || start.elapsed() > timeout {
            return Ok(records);
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// [`read_complete`] of `topic` (at most 90 s), then [`lost_and_duplicates`] of what it read.
fn read_lost_and_duplicates(
    kafka: &Kafka,
    topic: &str,
    prefix: &str,
    expected: &[String],
) -> Result<(Vec<String>, usize)> {
    let records = read_complete(kafka, &[topic], prefix, expected, Duration::from_secs(90))?;
    let refs: Vec<&Record> = records.iter().collect();
    Ok(lost_and_duplicates(&refs, prefix, expected))
}

fn n_of(payload: &str) -> usize {
    payload
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX)
}

// ---------------------------------------------------------------------------------------------
// Kubernetes objects

fn connection_yaml(node: IpAddr, brokers: (&Mosquitto, &Kafka), registry_url: &str) -> String {
    let connection = plant_connection_yaml(
        NS,
        node,
        (brokers.0.port(), brokers.1.port()),
        2,
        Some("mqtt-credentials"),
        Some((registry_url, "registry-credentials")),
    );
    let metrics = metrics_rule_yaml(NS);
    format!(
        r#"{connection}---
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata:
  name: temps
  namespace: {NS}
spec:
  connectionRef: {{ name: plant }}
  mqtt:
    topics: ["plant/+/temp"]
  kafka:
    topic: temps
    key: {{ strategy: topicLevel, level: 1 }}
---
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata:
  name: alarms
  namespace: {NS}
spec:
  connectionRef: {{ name: plant }}
  mqtt:
    topics: ["plant/+/alarm"]
  kafka:
    topic: alarms
---
{metrics}"#
    )
}

fn publisher_endpoint(node: IpAddr, mqtt: &Mosquitto) -> MqttEndpoint {
    MqttEndpoint {
        host: node,
        port: mqtt.port(),
        login: Some((PUBLISHER.0.to_owned(), PUBLISHER.1.to_owned())),
    }
}

/// The rule's `Ready` condition: (status, reason).
fn ready_condition(c: &Cluster, rule: &str) -> Result<(String, String)> {
    let out = c.kubectl(&[
        "get",
        "fr",
        rule,
        "-n",
        NS,
        "-o",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].status} {.status.conditions[?(@.type=="Ready")].reason}"#,
    ])?;
    let (status, reason) = out.split_once(' ').unwrap_or((out.as_str(), ""));
    Ok((status.to_owned(), reason.to_owned()))
}

/// Waits until every rule's `Ready` is `status` with `reason` (any reason when `None`); returns
/// how long that took.
fn wait_rules_ready(
    c: &Cluster,
    status: &str,
    reason: Option<&str>,
    within: Duration,
) -> Result<Duration> {
    let t = Instant::now();
    let what = format!("both rules Ready={status} ({reason:?})");
    wait_until_some(&what, within, CLUSTER_POLL, || {
        for rule in ["temps", "alarms"] {
            let (s, r) = ready_condition(c, rule)?;
            if s != status || reason.is_some_and(|want| want != r) {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })?;
    Ok(t.elapsed())
}

/// Kafka stopped for [`OUTAGE`] while messages keep coming: the rules say `KafkaUnreachable`
/// within [`READY_FOLLOWS_OUTAGE`], are Ready again once Kafka is back, and every message
/// published meanwhile reaches Kafka.
fn kafka_outage_is_reported(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &mut Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = rt.spawn(publish_paced(
        publisher_endpoint(c.node_ip(), mqtt),
        "kafka-outage".into(),
        temp_topic,
        usize::MAX,
        50,
        stop.clone(),
    ));
    let down = Instant::now();
    kafka.stop();
    wait_rules_ready(c, "False", Some("KafkaUnreachable"), READY_FOLLOWS_OUTAGE)?;
    // From the stop (a graceful one, which itself takes a few seconds).
    let noticed = down.elapsed();
    let table = c.kubectl(&["get", "fr", "-n", NS])?;
    log(format!(
        "Kafka stopped: both rules Ready=False KafkaUnreachable {noticed:.1?} after the stop began\n\
         $ kubectl get fr -n {NS}\n{table}"
    ));
    std::thread::sleep(OUTAGE.saturating_sub(down.elapsed()));
    kafka.resume()?;
    let outage = down.elapsed();
    let back = wait_rules_ready(c, "True", None, Duration::from_secs(90))?;
    stop.store(true, Ordering::SeqCst);
    let sent = rt.block_on(publisher)??;
    let (lost, dup) = read_lost_and_duplicates(kafka, "temps", "kafka-outage", &sent)?;
    log(format!(
        "Kafka back after {outage:.1?} away: rules Ready again {back:.1?} later; {} published \
         during and after the outage at 50/s: lost {}, duplicates {dup}",
        sent.len(),
        lost.len()
    ));
    ensure!(lost.is_empty(), "lost during the Kafka outage: {lost:?}");
    // The MQTT session stays up while Kafka is away: nothing is redelivered, and the
    // idempotent producer writes each record once.
    ensure!(dup == 0, "{dup} duplicates across a Kafka outage");
    Ok(())
}

/// Mosquitto stopped for [`OUTAGE`]: the rules say `MqttDisconnected` within
/// [`READY_FOLLOWS_OUTAGE`], are Ready again once it is back, and forward again.
fn mqtt_outage_is_reported(
    c: &Cluster,
    mqtt: &mut Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let down = Instant::now();
    mqtt.stop();
    wait_rules_ready(c, "False", Some("MqttDisconnected"), READY_FOLLOWS_OUTAGE)?;
    let noticed = down.elapsed();
    log(format!(
        "Mosquitto stopped: both rules Ready=False MqttDisconnected {noticed:.1?} after the stop began"
    ));
    std::thread::sleep(OUTAGE.saturating_sub(down.elapsed()));
    mqtt.resume()?;
    let back = wait_rules_ready(c, "True", None, Duration::from_secs(90))?;
    let sent = rt.block_on(publish_paced(
        publisher_endpoint(c.node_ip(), mqtt),
        "mqtt-outage".into(),
        temp_topic,
        200,
        0,
        Arc::new(AtomicBool::new(false)),
    ))?;
    read_complete(
        kafka,
        &["temps"],
        "mqtt-outage",
        &sent,
        Duration::from_secs(60),
    )?;
    log(format!(
        "Mosquitto back: rules Ready again {back:.1?} later; 200 published afterwards all forwarded"
    ));
    Ok(())
}

/// `kubectl get` of one JSON path.
/// The forwarder pods: (name, uid, IP, ready).
fn forwarder_pods(c: &Cluster) -> Result<Vec<(String, String, String, bool)>> {
    let out = c.kubectl(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        "ferry.dev/connection=plant",
        "-o",
        "json",
    ])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let mut pods = Vec::new();
    for p in v["items"].as_array().into_iter().flatten() {
        if !p["metadata"]["deletionTimestamp"].is_null() {
            continue;
        }
        let ready = p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        pods.push((
            p["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            p["metadata"]["uid"].as_str().unwrap_or_default().to_owned(),
            p["status"]["podIP"].as_str().unwrap_or_default().to_owned(),
            ready,
        ));
    }
    pods.sort();
    Ok(pods)
}

/// Each forwarder pod's `/status` `config.generation`.
fn config_generations(c: &Cluster) -> Result<Vec<(String, u64)>> {
    forwarder_pods(c)?
        .into_iter()
        .map(|(name, _, ip, _)| {
            let body = http_get_ok(SocketAddr::new(ip.parse()?, 8080), "/status")?;
            let v: serde_json::Value = serde_json::from_str(&body)?;
            let generation = v["config"]["generation"]
                .as_u64()
                .ok_or_else(|| anyhow!("{name}: no config.generation in {body}"))?;
            Ok((name, generation))
        })
        .collect()
}

/// Whether every forwarder pod runs the config its ConfigMap holds now (`/status`
/// `config.digest`): a reload of an earlier version (another change the kubelet brought
/// first) does not count.
fn pods_run_current_config(c: &Cluster) -> Result<bool> {
    let text = c.jsonpath("configmap", "plant-default", NS, "{.data.config\\.yaml}")?;
    let want = ferry_api::status::config_digest(&text);
    for (name, _, ip, _) in forwarder_pods(c)? {
        let body = http_get_ok(SocketAddr::new(ip.parse()?, 8080), "/status")?;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        if v["config"]["digest"].as_str() != Some(want.as_str()) {
            println!("{name} does not run the current config yet");
            return Ok(false);
        }
    }
    Ok(true)
}

/// Messages a second a step under load publishes.
const LOAD_PER_SECOND: u32 = 200;

/// QoS 1 messages (`<prefix>-<n>`) published at [`LOAD_PER_SECOND`] while a step changes
/// something.
struct SteadyLoad {
    stop: Arc<AtomicBool>,
    publisher: tokio::task::JoinHandle<Result<Vec<String>>>,
}

impl SteadyLoad {
    /// Starts publishing and lets it run 3 s before the change.
    fn start(
        c: &Cluster,
        mqtt: &Mosquitto,
        rt: &tokio::runtime::Runtime,
        prefix: &str,
        topic_of: fn(usize) -> String,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = rt.spawn(publish_paced(
            publisher_endpoint(c.node_ip(), mqtt),
            prefix.into(),
            topic_of,
            usize::MAX,
            LOAD_PER_SECOND,
            stop.clone(),
        ));
        std::thread::sleep(Duration::from_secs(3));
        Self { stop, publisher }
    }

    /// Publishes 3 s more after the change, then stops: what the broker acknowledged.
    fn finish(self, rt: &tokio::runtime::Runtime) -> Result<Vec<String>> {
        std::thread::sleep(Duration::from_secs(3));
        self.stop.store(true, Ordering::SeqCst);
        rt.block_on(self.publisher)?
    }
}

/// The IP of forwarder pod `name`.
/// The start of connection `plant`'s client ids, its `status.sessionPrefix`
/// (`ferry.<namespace>.<8 hex digits of its UID>.`).
fn session_prefix(c: &Cluster) -> Result<String> {
    let prefix = c.jsonpath("bc", "plant", NS, "{.status.sessionPrefix}")?;
    ensure!(
        prefix.starts_with(&format!("ferry.{NS}.")),
        "status.sessionPrefix {prefix:?}"
    );
    Ok(prefix)
}

fn pod_ip(c: &Cluster, name: &str) -> Result<String> {
    forwarder_pods(c)?
        .into_iter()
        .find(|p| p.0 == name)
        .map(|p| p.2)
        .ok_or_else(|| anyhow!("no pod {name}"))
}

/// `kubectl patch --type=merge` of one object in [`NS`].
fn merge_patch(c: &Cluster, kind: &str, name: &str, patch: &str) -> Result<()> {
    c.kubectl(&["patch", kind, name, "-n", NS, "--type=merge", "-p", patch])?;
    Ok(())
}

/// Deletes the forwarder pod `victim` (gracefully, or with `force` at once) while messages
/// are published at 200/s; checks that it comes back (same name, new uid, Ready), that it
/// reconnects with the same MQTT client id and clean start off, and that nothing is lost.
fn delete_pod_under_load(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
    victim: &str,
    force: bool,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let prefix = if force { "crash" } else { "kill" };
    let how = if force {
        "force-deleted (--grace-period=0 --force)"
    } else {
        "deleted"
    };
    let old_uid = forwarder_pods(c)?
        .into_iter()
        .find(|p| p.0 == victim)
        .map(|p| p.1)
        .ok_or_else(|| anyhow!("no pod {victim}"))?;
    let load = SteadyLoad::start(c, mqtt, rt, prefix, temp_topic);
    let t = Instant::now();
    let mut delete = vec!["delete", "pod", victim, "-n", NS, "--wait=false"];
    if force {
        delete.extend(["--grace-period=0", "--force"]);
    }
    c.kubectl(&delete)?;
    let new_ip = wait_until_some(
        &format!("{victim} recreated and Ready"),
        Duration::from_secs(120),
        CLUSTER_POLL,
        || {
            Ok(forwarder_pods(c)?
                .into_iter()
                .find(|p| p.0 == victim && p.1 != old_uid && p.3)
                .map(|p| p.2))
        },
    )?;
    let back = t.elapsed();
    let kill_sent = load.finish(rt)?;
    let (lost_kill, dup_kill) = read_lost_and_duplicates(kafka, "temps.v2", prefix, &kill_sent)?;
    // The recreated pod has the same name, so the same MQTT client id: check its /status.
    let status = http_get_ok(SocketAddr::new(new_ip.parse()?, 8080), "/status")?;
    let status: serde_json::Value = serde_json::from_str(&status)?;
    log(format!(
        "{how} {victim} under load (200/s): back Ready with a new uid at {new_ip} after \
         {back:.1?}; {} published: lost {}, duplicates {dup_kill}; the new pod's /status: mqtt \
         {}, temps forwarded {}",
        kill_sent.len(),
        lost_kill.len(),
        status["mqtt"],
        status["rules"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["name"] == "temps"))
            .map(|r| r["forwarded"].to_string())
            .unwrap_or_default()
    ));
    ensure!(
        lost_kill.is_empty(),
        "lost after {how} {victim}: {lost_kill:?}"
    );
    // A graceful delete drains: every ack is written and read before the pod exits, so
    // nothing is redelivered. A forced one replays what the broker had not seen acked: at
    // most the forwarder's window (maxInflight, the default 1000).
    let replay_bound = if force { FORWARDER_WINDOW } else { 0 };
    ensure!(
        dup_kill <= replay_bound,
        "{dup_kill} duplicates after {how} {victim}: more than {replay_bound}"
    );
    // Same name, so the same client id; clean start off (c0), so the broker resumed the session.
    let client_id = format!("{}{victim}", session_prefix(c)?);
    let mqtt_log = fs::read_to_string(mqtt.dir().join("mosquitto.log"))?;
    let connects: Vec<&str> = mqtt_log
        .lines()
        .filter(|l| l.contains("New client connected") && l.contains(&format!(" as {client_id} ")))
        .collect();
    log(format!(
        "{client_id}'s connects in mosquitto.log:\n{}",
        connects.join("\n")
    ));
    ensure!(
        connects
            .iter()
            .any(|l| l.contains(&format!("from {new_ip}:")) && l.contains("(p5, c0,")),
        "the recreated {victim} ({new_ip}) did not reconnect as {client_id} with clean start \
         off:\n{}",
        connects.join("\n")
    );
    wait_until_some(
        "temps readyReplicas 2/2",
        Duration::from_secs(60),
        CLUSTER_POLL,
        || Ok((c.jsonpath("fr", "temps", NS, "{.status.readyReplicas}")? == "2/2").then_some(())),
    )?;
    Ok(())
}

/// How long an edited ConfigMap takes to reach a running forwarder here: the kubelet refreshes a
/// pod's mounted ConfigMaps when it syncs the pod, every `syncFrequency` (10 s in
/// `e2e/cluster/up.sh`) jittered by up to half of it (its pod workers'
/// `workerResyncIntervalJitterFactor`), its sync loop looks every second, and the forwarder
/// reads its config file every second.
const CONFIG_REACHES_POD: Duration = Duration::from_secs(10 * 3 / 2 + 1 + 1);
/// The operator's part of a scale-down: it looks at the leaving pods' `/status` every 5 s while
/// they drain (`DRAIN_POLL`), and once a pod is gone ends its session within 5 s
/// (`SESSIONS_POD_WAIT`); a forwarder says drained after its session delivered nothing for 2 s
/// (`DRAIN_QUIET`).
const DRAIN_POLL: Duration = Duration::from_secs(5);
const SESSIONS_POD_WAIT: Duration = Duration::from_secs(5);
const DRAIN_QUIET: Duration = Duration::from_secs(2);
/// Room for the API server, the controllers and the kubelet to act on what they watch (a
/// reconcile, the StatefulSet controller, the kubelet's SIGTERM) on this loaded 2-core machine.
const CONTROL_PLANE_SLACK: Duration = Duration::from_secs(10);

/// The connection's forwarder replicas patched from 2 to 1 while messages are published at
/// 200/s: the operator lists pod 1 in its config's `drain` (a Normal `Draining` Event), shrinks
/// the StatefulSet once pod 1 says drained, and ends pod 1's session once it is gone; pod 0
/// subscribes plainly. Every message the broker acknowledged is in Kafka, duplicates within the
/// forwarder's window, the broker holds no session for pod 1, and the rules are Ready with 1/1.
fn scale_down_under_load(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let leaving = format!("{STS}-1");
    let client_id = format!("{}{leaving}", session_prefix(c)?);
    let leaving_ip = pod_ip(c, &leaving)?;
    let grace: u64 = c
        .jsonpath("pod", &leaving, NS, "{.spec.terminationGracePeriodSeconds}")?
        .parse()?;
    let load = SteadyLoad::start(c, mqtt, rt, "scaledown", temp_topic);
    let t = Instant::now();
    merge_patch(c, "bc", "plant", r#"{"spec":{"forwarder":{"replicas":1}}}"#)?;
    // Pod 1 learns it leaves from its config, drains, says so; the operator sees it and shrinks.
    let mut drained_at = None;
    wait_until_some(
        "the StatefulSet shrunk to 1 replica once pod 1 drained",
        CONFIG_REACHES_POD + DRAIN_QUIET + DRAIN_POLL + CONTROL_PLANE_SLACK,
        CLUSTER_POLL,
        || {
            if drained_at.is_none() {
                // Best effort: the pod may already be stopping.
                let status = http_get_ok(SocketAddr::new(leaving_ip.parse()?, 8080), "/status")
                    .ok()
                    .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok());
                if status.is_some_and(|s| s["drain"]["drained"] == true) {
                    drained_at = Some(t.elapsed());
                }
            }
            Ok((c.jsonpath("statefulset", STS, NS, "{.spec.replicas}")? == "1").then_some(()))
        },
    )?;
    let shrunk = t.elapsed();
    // It stops at once (nothing left to forward), within its grace period at most; then the
    // operator ends its session with a clean start (pods resume theirs: clean start off).
    wait_until_some(
        &format!("{leaving} gone and its session ended by the operator"),
        Duration::from_secs(grace) + SESSIONS_POD_WAIT + CONTROL_PLANE_SLACK,
        CLUSTER_POLL,
        || {
            if forwarder_pods(c)?.iter().any(|p| p.0 == leaving) {
                return Ok(None);
            }
            let mqtt_log = fs::read_to_string(mqtt.dir().join("mosquitto.log"))?;
            let last = mqtt_log.lines().rev().find(|l| {
                l.contains("New client connected") && l.contains(&format!(" as {client_id} "))
            });
            Ok(last.is_some_and(|l| l.contains("(p5, c1,")).then_some(()))
        },
    )?;
    let gone = t.elapsed();
    // Pod 0, alone now, subscribes plainly (its config changed with pod 1's).
    let pod0 = pod_ip(c, &format!("{STS}-0"))?;
    wait_until_some(
        &format!("{STS}-0 subscribed plainly (/status mqtt.shared false)"),
        CONFIG_REACHES_POD + CONTROL_PLANE_SLACK,
        CLUSTER_POLL,
        || {
            let body = http_get_ok(SocketAddr::new(pod0.parse()?, 8080), "/status")?;
            let v: serde_json::Value = serde_json::from_str(&body)?;
            Ok((v["mqtt"]["subscribed"] == true && v["mqtt"]["shared"] == false).then_some(()))
        },
    )?;
    let sent = load.finish(rt)?;
    let (lost, dups) = read_lost_and_duplicates(kafka, "temps.v2", "scaledown", &sent)?;
    let (present, queued) = rt.block_on(ferry_e2e::probe_session(
        c.node_ip(),
        mqtt.port(),
        Some(PUBLISHER),
        &client_id,
        false,
    ))?;
    let events = c.kubectl(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        "involvedObject.kind=BrokerConnection,involvedObject.name=plant,reason=Draining",
        "-o",
        "jsonpath={range .items[*]}{.type} {.reason}: {.message}{\"\\n\"}{end}",
    ])?;
    wait_until_some(
        "the rules Ready with 1/1",
        CONTROL_PLANE_SLACK,
        CLUSTER_POLL,
        || {
            for rule in ["temps", "alarms"] {
                if ready_condition(c, rule)?.0 != "True"
                    || c.jsonpath("fr", rule, NS, "{.status.readyReplicas}")? != "1/1"
                {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )?;
    let table = c.kubectl(&["get", "fr", "-n", NS])?;
    log(format!(
        "scaled {STS} 2 -> 1 under load (200/s): {leaving} said drained {drained_at:.1?} after \
         the patch, the StatefulSet shrunk after {shrunk:.1?}, {leaving} gone and its session \
         ended after {gone:.1?}, {STS}-0 subscribed plainly; step {:.1?}; {} published: lost \
         {}, duplicates {dups}; the broker holds a session for {client_id}: {present} \
         ({queued} queued)\nEvents: {events}$ kubectl get fr -n {NS}\n{table}",
        t.elapsed(),
        sent.len(),
        lost.len()
    ));
    ensure!(lost.is_empty(), "lost scaling down: {lost:?}");
    ensure!(
        dups <= FORWARDER_WINDOW,
        "{dups} duplicates scaling down: more than the window ({FORWARDER_WINDOW})"
    );
    ensure!(
        !present && queued == 0,
        "the broker still holds a session for {client_id} ({queued} queued)"
    );
    ensure!(
        events.contains("Normal Draining") && events.contains(&leaving),
        "no Normal Draining Event naming {leaving}: {events:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------

#[test]
fn full_user_path_on_a_real_cluster() -> Result<()> {
    let t0 = Instant::now();
    ensure_root("this test")?;
    let images = ferry_images()?;
    for image in &images {
        let age = fs::metadata(image)?
            .modified()?
            .elapsed()
            .unwrap_or_default();
        println!(
            "image {} (built {:.0?} ago; rebuild with e2e/images/build.sh after changing the code)",
            image.display(),
            Duration::from_secs(age.as_secs())
        );
    }
    ensure_helm()?;

    let mut cluster = Cluster::private("ferry-full-path", "fp")?;
    println!(
        "cluster: state {}, netns {}, node {}, pods {}.0/24",
        cluster.dir().display(),
        cluster.netns(),
        cluster.node_ip(),
        cluster.pod_net()
    );
    let t = Instant::now();
    cluster.up()?;
    let up_time = t.elapsed();
    println!("[{:6.1?}] cluster up in {up_time:.1?}", t0.elapsed());

    // The registry on the node address, trusted by the cluster's containerd; the brokers,
    // inside the netns on the node address, while the release is mirrored into the registry.
    let t = Instant::now();
    let registry = Registry::start_placed(cluster.placement())?;
    registry.write_containerd_hosts(&cluster.registry_hosts_dir())?;
    // (The brokers are started by this thread: they are tied to it by PR_SET_PDEATHSIG.)
    let registry_pki = cluster.node_pki()?;
    let options = BrokerOptions {
        mqtt: MosquittoOptions {
            log_connections: true,
            users: vec![
                (FORWARDER_USER.into(), FORWARDER_PASSWORD.into()),
                (PUBLISHER.0.into(), PUBLISHER.1.into()),
            ],
            ..MosquittoOptions::default()
        },
        schema_registry: SchemaRegistryOptions {
            tls: Some(&registry_pki),
            basic_auth: Some((REGISTRY_LOGIN.0.into(), REGISTRY_LOGIN.1.into())),
        },
        ..BrokerOptions::default()
    };
    let (brokers, mirror) =
        cluster.start_brokers_while(options, || mirror_release(&cluster, &registry, &images))?;
    let Brokers {
        mut mqtt,
        mut kafka,
        schema_registry,
    } = brokers;
    println!(
        "[{:6.1?}] release mirrored into the registry {} ({mirror:?}), brokers up (MQTT {}:{}, \
         Kafka {}, schema registry {}) in {:.1?}",
        t0.elapsed(),
        registry.address(),
        mqtt.host(),
        mqtt.port(),
        kafka.bootstrap(),
        schema_registry.url(),
        t.elapsed()
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = run(
        &cluster,
        &mirror,
        (&mut mqtt, &mut kafka, &schema_registry),
        &rt,
        t0,
    );
    if let Err(e) = &result {
        eprintln!("ferry: the full-path test failed: {e:#}");
        cluster.diagnose(RELEASE_NS, NS, "plant");
        for (name, path) in [
            ("mosquitto", mqtt.dir().join("mosquitto.log")),
            ("kafka", kafka.dir().join("kafka.log")),
            ("registry", mirror.registry.log()),
            ("schema registry", schema_registry.log()),
        ] {
            let text = fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!(
                "--- {name} log (tail):\n{}",
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
    }
    drop(rt);
    drop(schema_registry);
    drop(kafka);
    drop(mqtt);
    drop(mirror);
    let t = Instant::now();
    if result.is_ok() {
        cluster.down(None)?;
        println!(
            "[{:6.1?}] cluster down in {:.1?}",
            t0.elapsed(),
            t.elapsed()
        );
    }
    result
}

fn run(
    c: &Cluster,
    mirror: &Mirror<'_>,
    (mqtt, kafka, schema_registry): (&mut Mosquitto, &mut Kafka, &SchemaRegistry),
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    for topic in [
        "temps",
        "alarms",
        "temps.v2",
        "devices",
        "readings.3",
        "ferry.dead-letters",
        ADDED_TOPIC,
        METRICS_TOPIC,
    ] {
        rt.block_on(kafka.create_topic(topic, 2))?;
    }
    // The platform team's schema for the Avro rule's subject (topic name strategy).
    let schema_id = schema_registry.register(METRICS_SUBJECT, SchemaType::Avro, METRIC_AVRO)?;
    install_operator(c, mirror, t0)?;
    apply_connection_and_rules(c, (mqtt, kafka, schema_registry), t0)?;
    pods_run_the_mirrored_image(
        c,
        mirror,
        NS,
        "ferry.dev/connection=plant",
        "ferry-forwarder",
    )?;
    let (temps_sent, alarms_sent) = publish_and_read_back(c, mqtt, kafka, rt, t0)?;
    status_shows_forwarded(c, &temps_sent, &alarms_sent, t0)?;
    avro_records_decode_with_the_registered_schema(
        c,
        mqtt,
        kafka,
        schema_registry,
        schema_id,
        rt,
        t0,
    )?;
    // The status tells the truth in broker outages.
    kafka_outage_is_reported(c, mqtt, kafka, rt, t0)?;
    mqtt_outage_is_reported(c, mqtt, kafka, rt, t0)?;
    let (mqtt, kafka): (&Mosquitto, &Kafka) = (mqtt, kafka);
    live_rule_edit_under_load(c, mqtt, kafka, rt, t0)?;
    // Delete a forwarder pod under load, then kill one abruptly.
    delete_pod_under_load(c, mqtt, kafka, rt, t0, &format!("{STS}-0"), false)?;
    delete_pod_under_load(c, mqtt, kafka, rt, t0, &format!("{STS}-1"), true)?;
    // The group goes from 2 replicas to 1 the way a user does it, under load; the CEL
    // example rules' group then starts with one pod.
    scale_down_under_load(c, mqtt, kafka, rt, t0)?;
    cel_examples_forward_as_documented(c, mqtt, kafka, rt, t0)?;
    moving_a_rule_to_another_group_under_load(c, mqtt, kafka, rt, t0)?;
    deleting_the_connection_removes_its_children_and_sessions(c, mqtt, rt, t0)?;
    let depot = a_connection_holds_the_finalizer(c, t0)?;
    helm_uninstall_leaves_only_the_crds(c, t0)?;
    the_uninstall_released_the_finalizer(c, &depot, t0)?;
    println!("[{:6.1?}] full path passed", t0.elapsed());
    Ok(())
}

/// The release in the private registry: the images' digests there, by image name.
struct Mirror<'a> {
    registry: &'a Registry,
    digests: BTreeMap<&'static str, String>,
}

impl std::fmt::Debug for Mirror<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(&self.digests).finish()
    }
}

/// What a platform team does to install from its own registry: both images pushed with
/// skopeo from the OCI archives, the chart packaged and pushed as an OCI artifact.
fn mirror_release<'a>(
    c: &Cluster,
    registry: &'a Registry,
    images: &[PathBuf],
) -> Result<Mirror<'a>> {
    let mut digests = BTreeMap::new();
    for (name, repository) in IMAGE_REPOSITORIES {
        let archive = images
            .iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|f| f.to_string_lossy().starts_with(name))
            })
            .ok_or_else(|| anyhow!("no {name} image among {images:?}"))?;
        digests.insert(
            name,
            registry.push_oci_archive(archive, repository, VERSION)?,
        );
    }
    let packaged = tempfile::tempdir()?;
    c.helm(&[
        "package",
        &repo_dir().join("charts/ferry").display().to_string(),
        "--destination",
        &packaged.path().display().to_string(),
    ])?;
    let chart = packaged
        .path()
        .join(format!("ferry-{}.tgz", chart_version()?));
    let pushed = c.helm(&[
        "push",
        &chart.display().to_string(),
        &format!("oci://{}/{CHART_REPOSITORY}", registry.address()),
        "--ca-file",
        &registry.ca_cert().display().to_string(),
    ])?;
    ensure!(
        pushed.contains("Digest: sha256:"),
        "helm push printed no digest:\n{pushed}"
    );
    Ok(Mirror { registry, digests })
}

/// `version:` of charts/ferry/Chart.yaml.
fn chart_version() -> Result<String> {
    let chart = fs::read_to_string(repo_dir().join("charts/ferry/Chart.yaml"))?;
    chart
        .lines()
        .find_map(|l| l.strip_prefix("version:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .ok_or_else(|| anyhow!("charts/ferry/Chart.yaml has no version"))
}

/// [`readme_install`]'s arguments with the chart taken from `registry` instead of ghcr.io;
/// fails unless it installs charts/ferry's version into [`RELEASE_NS`].
fn readme_install_from(registry: &str) -> Result<Vec<String>> {
    let readme_install = readme_install()?;
    let mut words = readme_install.split_whitespace();
    ensure!(
        words.next() == Some("helm"),
        "{readme_install:?} is not a helm command"
    );
    let published = format!("oci://{PUBLISHED_REGISTRY}/{CHART_REPOSITORY}/ferry");
    let args: Vec<String> = words
        .map(|w| {
            if w == published {
                format!("oci://{registry}/{CHART_REPOSITORY}/ferry")
            } else {
                w.to_owned()
            }
        })
        .collect();
    let value_of = |flag: &str| args.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
    ensure!(
        args.iter().filter(|a| a.starts_with("oci://")).count() == 1
            && !args.iter().any(|a| a == &published),
        "{readme_install:?} should install the chart {published}"
    );
    ensure!(
        value_of("--version") == Some(chart_version()?),
        "{readme_install:?} does not install charts/ferry's version {}",
        chart_version()?
    );
    ensure!(
        value_of("--namespace").as_deref() == Some(RELEASE_NS),
        "{readme_install:?} should install into {RELEASE_NS}"
    );
    Ok(args)
}

/// Every pod of `selector` in `ns` runs `image` from the registry, pulled there by the digest
/// skopeo pushed (containerd records the repository digest it pulled as the image ID).
fn pods_run_the_mirrored_image(
    c: &Cluster,
    mirror: &Mirror<'_>,
    ns: &str,
    selector: &str,
    image: &str,
) -> Result<()> {
    let (_, repository) = IMAGE_REPOSITORIES
        .iter()
        .find(|(name, _)| *name == image)
        .ok_or_else(|| anyhow!("no repository for {image}"))?;
    let address = mirror.registry.address();
    let digest = mirror
        .digests
        .get(image)
        .ok_or_else(|| anyhow!("{image} was not pushed"))?;
    let out = c.kubectl(&[
        "get",
        "pods",
        "-n",
        ns,
        "-l",
        selector,
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.spec.containers[0].image} \
         {.status.containerStatuses[0].imageID}{\"\\n\"}{end}",
    ])?;
    let pods: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    ensure!(!pods.is_empty(), "no pods of {selector} in {ns}");
    let want = format!("{address}/{repository}:{VERSION} {address}/{repository}@{digest}");
    for pod in &pods {
        let (name, rest) = pod.split_once(' ').unwrap_or((pod, ""));
        ensure!(
            rest == want,
            "pod {ns}/{name} runs `{rest}`, expected `{want}` (image, imageID) from the registry"
        );
    }
    println!("{} {image} pods run {want}", pods.len());
    Ok(())
}

/// README.md's `helm install` ([`readme_install`]) from the registry, with `--wait`; the
/// operator pods run the mirrored image; then one operator replica holds the Lease.
fn install_operator(c: &Cluster, mirror: &Mirror<'_>, t0: Instant) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let t = Instant::now();
    let registry = mirror.registry.address();
    let mut args = readme_install_from(&registry)?;
    args.extend(
        [
            "--ca-file",
            &mirror.registry.ca_cert().display().to_string(),
            "--set",
            &format!("image.registry={registry}"),
            "--set",
            &format!("forwarder.image.registry={registry}"),
            // The test's own: status every 2 s, and wait for the operator pods.
            "--set",
            "statusIntervalSeconds=2",
            "--wait",
            "--timeout",
            "3m",
        ]
        .map(str::to_owned),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    c.helm(&args)?;
    pods_run_the_mirrored_image(
        c,
        mirror,
        RELEASE_NS,
        "app.kubernetes.io/name=ferry",
        "ferry-operator",
    )?;
    let operators = c.kubectl(&[
        "get",
        "pods",
        "-n",
        RELEASE_NS,
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.status.phase}{\"\\n\"}{end}",
    ])?;
    log(format!(
        "helm install (--wait) done in {:.1?}; operator pods:\n{operators}",
        t.elapsed()
    ));
    let holder = wait_until_some(
        "the operator's Lease",
        Duration::from_secs(60),
        CLUSTER_POLL,
        || {
            Ok(c.kubectl(&[
                "get",
                "lease",
                "ferry-operator",
                "-n",
                RELEASE_NS,
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])
            .ok()
            .filter(|h| !h.is_empty()))
        },
    )?;
    log(format!("leader: {holder}"));

    Ok(())
}

/// The Secrets, the connection and the three rules: the rules become Ready with two forwarder
/// pods.
fn apply_connection_and_rules(
    c: &Cluster,
    (mqtt, kafka, schema_registry): (&Mosquitto, &Kafka, &SchemaRegistry),
    t0: Instant,
) -> Result<()> {
    let node = c.node_ip();
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    c.kubectl(&["create", "namespace", NS])?;
    c.create_marked_secret(
        NS,
        "mqtt-credentials",
        &[
            ("username", FORWARDER_USER.as_bytes()),
            ("password", FORWARDER_PASSWORD.as_bytes()),
        ],
    )?;
    c.create_schema_registry_secret(NS, "registry-credentials", schema_registry, REGISTRY_LOGIN)?;
    let t = Instant::now();
    c.kubectl_in(
        &["apply", "-f", "-"],
        Some(&connection_yaml(
            node,
            (mqtt, kafka),
            &schema_registry.url(),
        )),
    )?;
    // Ready once the pods serving the group subscribed the rules, which may be before both
    // pods are (a rule's Ready waits for data to flow, not for every pod).
    wait_until_some(
        "the rules Ready and both forwarder pods ready",
        Duration::from_secs(150),
        CLUSTER_POLL,
        || {
            Ok((c.rule_ready("temps", NS)?
                && c.rule_ready("alarms", NS)?
                && c.rule_ready("metrics", NS)?
                && forwarder_pods(c)?.iter().filter(|p| p.3).count() == 2)
                .then_some(()))
        },
    )?;
    let to_ready = t.elapsed();
    let pods = forwarder_pods(c)?;
    log(format!(
        "rules Ready {to_ready:.1?} after kubectl apply; forwarder pods {:?}",
        pods.iter().map(|p| (&p.0, &p.2, p.3)).collect::<Vec<_>>()
    ));
    ensure!(
        pods.len() == 2 && pods.iter().all(|p| p.3),
        "expected 2 ready forwarder pods: {pods:?}"
    );
    let names: Vec<&str> = pods.iter().map(|p| p.0.as_str()).collect();
    ensure!(
        names == [format!("{STS}-0"), format!("{STS}-1")],
        "pod names {names:?}"
    );

    Ok(())
}

/// What is published reaches Kafka with the rules' topics and keys, none lost; returns what
/// was sent (temps, alarms).
fn publish_and_read_back(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<(Vec<String>, Vec<String>)> {
    let node = c.node_ip();
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let stop = Arc::new(AtomicBool::new(false));
    let t = Instant::now();
    let temps_sent = rt.block_on(publish_paced(
        publisher_endpoint(node, mqtt),
        "basic".into(),
        temp_topic,
        1000,
        0,
        stop.clone(),
    ))?;
    let alarms_sent = rt.block_on(publish_paced(
        publisher_endpoint(node, mqtt),
        "alarm".into(),
        alarm_topic,
        300,
        0,
        stop.clone(),
    ))?;
    let temps = read_complete(
        kafka,
        &["temps"],
        "basic",
        &temps_sent,
        Duration::from_secs(60),
    )?;
    let alarms = read_complete(
        kafka,
        &["alarms"],
        "alarm",
        &alarms_sent,
        Duration::from_secs(60),
    )?;
    let all_temps: Vec<&Record> = temps.iter().collect();
    let all_alarms: Vec<&Record> = alarms.iter().collect();
    let (lost_t, dup_t) = lost_and_duplicates(&all_temps, "basic", &temps_sent);
    let (lost_a, dup_a) = lost_and_duplicates(&all_alarms, "alarm", &alarms_sent);
    log(format!(
        "published {} temps + {} alarms, read back {} + {} records in {:.1?}: lost {} + {}, \
         duplicates {dup_t} + {dup_a}",
        temps_sent.len(),
        alarms_sent.len(),
        temps.len(),
        alarms.len(),
        t.elapsed(),
        lost_t.len(),
        lost_a.len()
    ));
    ensure!(
        lost_t.is_empty() && lost_a.is_empty(),
        "lost temps {lost_t:?}, alarms {lost_a:?}"
    );
    ensure!(
        dup_t + dup_a == 0,
        "duplicates without any fault: {dup_t} temps, {dup_a} alarms"
    );
    for r in &temps {
        let line = n_of(r.value_str()) % 5 + 1;
        ensure!(
            r.key_str() == Some(line.to_string().as_str()),
            "temps record {:?}: key {:?}, want the line {line} (topicLevel 1)",
            r.value_str(),
            r.key_str()
        );
    }
    for r in &alarms {
        let want = alarm_topic(n_of(r.value_str()));
        ensure!(
            r.key_str() == Some(want.as_str()),
            "alarms record {:?}: key {:?}, want the MQTT topic {want}",
            r.value_str(),
            r.key_str()
        );
    }

    Ok((temps_sent, alarms_sent))
}

/// `kubectl get fr` shows Ready and the forwarded counts.
fn status_shows_forwarded(
    c: &Cluster,
    temps_sent: &[String],
    alarms_sent: &[String],
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let t = Instant::now();
    wait_until_some(
        "status.forwarded of both rules",
        Duration::from_secs(60),
        CLUSTER_POLL,
        || {
            let ft: u64 = c
                .jsonpath("fr", "temps", NS, "{.status.forwarded}")?
                .parse()
                .unwrap_or(0);
            let fa: u64 = c
                .jsonpath("fr", "alarms", NS, "{.status.forwarded}")?
                .parse()
                .unwrap_or(0);
            Ok((ft >= temps_sent.len() as u64 && fa >= alarms_sent.len() as u64).then_some(()))
        },
    )?;
    let table = c.kubectl(&["get", "bc,fr", "-n", NS])?;
    let forwarded = c.kubectl(&[
        "get",
        "fr",
        "-n",
        NS,
        "-o",
        "custom-columns=NAME:.metadata.name,READY:.status.readyReplicas,FORWARDED:.status.forwarded",
    ])?;
    log(format!(
        "status caught up {:.1?} after the records were read:\n\
         $ kubectl get bc,fr -n {NS}\n{table}\n{forwarded}",
        t.elapsed()
    ));
    ensure!(
        table.lines().filter(|l| l.contains("True")).count() >= 3,
        "kubectl get bc,fr should show the connection and both rules Ready:\n{table}"
    );

    Ok(())
}

/// The Avro rule through the registry, with the basic-auth login the pods read from the Secret:
/// every reading published arrives as a record that confluent-kafka's AvroDeserializer decodes
/// to that reading, carrying the id of the schema registered for `metrics-value`; the rule's
/// `.status.schema` (and so `kubectl get fr -o wide`) shows that id and version 1.
fn avro_records_decode_with_the_registered_schema(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &Kafka,
    schema_registry: &SchemaRegistry,
    schema_id: u32,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let t = Instant::now();
    let sent = metric_messages(4, METRICS);
    let broker = publisher_endpoint(c.node_ip(), mqtt);
    rt.block_on(publish_to(&broker, "e2e-pub-metrics", sent.clone()))?;
    let decoded = read_metrics_decoded(schema_registry, kafka, &sent, schema_id)?;
    let want = (METRICS_SUBJECT.to_owned(), 1, u64::from(schema_id));
    wait_until_some(
        "the metrics rule's .status.schema",
        Duration::from_secs(30),
        CLUSTER_POLL,
        || Ok((c.rule_schema("metrics", NS)?.as_ref() == Some(&want)).then_some(())),
    )?;
    let wide = c.kubectl(&["get", "fr", "metrics", "-n", NS, "-o", "wide"])?;
    log(format!(
        "{} Avro records decoded by confluent-kafka's AvroDeserializer, schema id {schema_id} \
         (first {}); {:.1?}:\n$ kubectl get fr metrics -n {NS} -o wide\n{wide}",
        decoded.len(),
        decoded
            .first()
            .map(|r| r["value"].to_string())
            .unwrap_or_default(),
        t.elapsed()
    ));
    Ok(())
}

/// A rule edited under load: every pod applies it without a restart, nothing is lost, and what
/// is published afterwards follows the new mapping.
fn live_rule_edit_under_load(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    // A rule added to the running group meanwhile: the same kubelet sync brings both.
    c.kubectl_in(&["apply", "-f", "-"], Some(&added_rule_yaml()))?;
    let (edit, added) = std::thread::scope(|s| {
        let added = s.spawn(|| wait_ready_then_publish(c, mqtt, rt));
        let edit = edit_rule_under_load(c, mqtt, rt);
        let added = added
            .join()
            .unwrap_or_else(|_| Err(anyhow!("kubectl wait thread panicked")));
        (edit, added)
    });
    edited_rule_lost_nothing_and_follows_the_new_mapping(kafka, &edit?, t0)?;
    let (ready, sent) = added?;
    let (lost, _) = read_lost_and_duplicates(kafka, ADDED_TOPIC, "added", &sent)?;
    println!(
        "[{:6.1?}] rule {ADDED_TOPIC} added to the running group: kubectl wait \
         --for=condition=Ready returned {ready:.1?} after kubectl apply; {} published at once \
         then, lost {}",
        t0.elapsed(),
        sent.len(),
        lost.len()
    );
    ensure!(
        lost.is_empty(),
        "published once the rule was Ready, lost: {lost:?}"
    );
    Ok(())
}

/// The rule added to the running group by [`live_rule_edit_under_load`], and its Kafka topic.
const ADDED_TOPIC: &str = "added";

fn added_rule_yaml() -> String {
    format!(
        r#"apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata:
  name: {ADDED_TOPIC}
  namespace: {NS}
spec:
  connectionRef: {{ name: plant }}
  mqtt:
    topics: ["plant/+/{ADDED_TOPIC}"]
  kafka:
    topic: {ADDED_TOPIC}
"#
    )
}

/// As a user would (issue 35): `kubectl wait --for=condition=Ready` on the added rule, then at
/// once 100 QoS 1 messages to it; how long the wait took, and what was published.
fn wait_ready_then_publish(
    c: &Cluster,
    mqtt: &Mosquitto,
    rt: &tokio::runtime::Runtime,
) -> Result<(Duration, Vec<String>)> {
    let t = Instant::now();
    let rule = format!("fr/{ADDED_TOPIC}");
    c.kubectl(&[
        "wait",
        "--for=condition=Ready",
        &rule,
        "-n",
        NS,
        "--timeout=150s",
    ])?;
    let ready = t.elapsed();
    let sent: Vec<String> = (0..100).map(|i| format!("added-{i}")).collect();
    let messages = sent
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                format!("plant/{}/{ADDED_TOPIC}", i % 5 + 1),
                p.clone().into_bytes(),
            )
        })
        .collect();
    let broker = publisher_endpoint(c.node_ip(), mqtt);
    rt.block_on(publish_to(&broker, "e2e-added", messages))?;
    Ok((ready, sent))
}

/// What [`edit_rule_under_load`] published and saw.
struct RuleEdit {
    /// Published at 100/s while the edit was applied.
    during: Vec<String>,
    /// Published once every pod had applied it.
    after: Vec<String>,
    /// How the pods applied it: generations before and after, and how long it took.
    applied: String,
}

/// Patches rule `temps` (new Kafka topic and key) while publishing at 100/s, waits until every
/// forwarder pod applied it (`/status` config.generation) without a restart, then publishes more.
fn edit_rule_under_load(
    c: &Cluster,
    mqtt: &Mosquitto,
    rt: &tokio::runtime::Runtime,
) -> Result<RuleEdit> {
    let node = c.node_ip();
    let gens_before = config_generations(c)?;
    let uids_before: Vec<String> = forwarder_pods(c)?.into_iter().map(|p| p.1).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = rt.spawn(publish_paced(
        publisher_endpoint(node, mqtt),
        "edit".into(),
        temp_topic,
        usize::MAX,
        100,
        stop.clone(),
    ));
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    c.kubectl(&[
        "patch",
        "fr",
        "temps",
        "-n",
        NS,
        "--type=merge",
        "-p",
        r#"{"spec":{"kafka":{"topic":"temps.v2","key":{"strategy":"mqttTopic","level":null}}}}"#,
    ])?;
    let gens_after = wait_until_some(
        "every forwarder pod applied the edited rule (/status config.generation and digest)",
        Duration::from_secs(150),
        CLUSTER_POLL,
        || {
            let now = config_generations(c)?;
            let all = now.len() == gens_before.len()
                && now
                    .iter()
                    .zip(&gens_before)
                    .all(|(a, b)| a.0 == b.0 && a.1 > b.1)
                && pods_run_current_config(c)?;
            Ok(all.then_some(now))
        },
    )?;
    let reload_time = t.elapsed();
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    let edit_sent = rt.block_on(publisher)??;
    let uids_after: Vec<String> = forwarder_pods(c)?.into_iter().map(|p| p.1).collect();
    ensure!(
        uids_after == uids_before,
        "the rule edit restarted forwarder pods ({uids_before:?} -> {uids_after:?})"
    );
    let after_sent = rt.block_on(publish_paced(
        publisher_endpoint(node, mqtt),
        "after".into(),
        temp_topic,
        500,
        0,
        Arc::new(AtomicBool::new(false)),
    ))?;
    Ok(RuleEdit {
        during: edit_sent,
        after: after_sent,
        applied: format!(
            "rule edit applied by every pod {reload_time:.1?} after kubectl patch \
             (generations {gens_before:?} -> {gens_after:?}, pods not restarted)"
        ),
    })
}

/// Nothing published during the edit is lost (old or new topic); what came after is all on the
/// new topic, keyed by the MQTT topic.
fn edited_rule_lost_nothing_and_follows_the_new_mapping(
    kafka: &Kafka,
    edit: &RuleEdit,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let (edit_sent, after_sent) = (&edit.during, &edit.after);
    read_complete(
        kafka,
        &["temps.v2"],
        "after",
        after_sent,
        Duration::from_secs(60),
    )?;
    read_complete(
        kafka,
        &["temps", "temps.v2"],
        "edit",
        edit_sent,
        Duration::from_secs(60),
    )?;
    let v1 = kafka.read_all("temps", 0, Duration::from_secs(3), Duration::from_secs(30))?;
    let v2 = kafka.read_all(
        "temps.v2",
        0,
        Duration::from_secs(3),
        Duration::from_secs(30),
    )?;
    let union: Vec<&Record> = v1.iter().chain(&v2).collect();
    let (lost_edit, dup_edit) = lost_and_duplicates(&union, "edit", edit_sent);
    let v2_refs: Vec<&Record> = v2.iter().collect();
    let (lost_after, dup_after) = lost_and_duplicates(&v2_refs, "after", after_sent);
    let edit_old = v1
        .iter()
        .filter(|r| r.value_str().starts_with("edit-"))
        .count();
    let edit_new = v2
        .iter()
        .filter(|r| r.value_str().starts_with("edit-"))
        .count();
    let after_in_old = v1
        .iter()
        .filter(|r| r.value_str().starts_with("after-"))
        .count();
    log(format!(
        "{}; during the edit {} published at 100/s: {edit_old} on temps, {edit_new} on temps.v2, lost {}, \
         duplicates {dup_edit}; afterwards {} published: lost {} on temps.v2, {after_in_old} \
         still on temps, duplicates {dup_after}",
        edit.applied,
        edit_sent.len(),
        lost_edit.len(),
        after_sent.len(),
        lost_after.len()
    ));
    ensure!(lost_edit.is_empty(), "lost during the edit: {lost_edit:?}");
    // A live reload keeps the session and the window: nothing is sent twice.
    ensure!(
        dup_edit + dup_after == 0,
        "duplicates across a live edit: {dup_edit} during, {dup_after} after"
    );
    ensure!(
        edit_new > 0,
        "nothing published during the edit reached temps.v2"
    );
    ensure!(
        lost_after.is_empty() && after_in_old == 0,
        "after the edit: lost on temps.v2 {lost_after:?}, {after_in_old} on the old topic"
    );
    for r in v2.iter() {
        let want = temp_topic(n_of(r.value_str()));
        ensure!(
            r.key_str() == Some(want.as_str()),
            "temps.v2 record {:?}: key {:?}, want the MQTT topic {want}",
            r.value_str(),
            r.key_str()
        );
    }

    Ok(())
}

/// The CEL examples of `examples/kubernetes/rules.yaml` (`devices`, `readings`), applied as
/// shipped: their group's pods come up, and each published message ends up where the examples'
/// comments say: keyed by the device in the payload, reshaped into `readings.<plant>`, a
/// heartbeat nowhere, the reading without `temp` and the payload that is not JSON in the
/// dead-letter topic with the error.
fn cel_examples_forward_as_documented(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let t = Instant::now();
    let rules = example_rules(&["devices", "readings"])?;
    c.kubectl_in(&["apply", "-n", NS, "-f", "-"], Some(&rules))?;
    wait_until_some(
        "the CEL example rules Ready",
        Duration::from_secs(180),
        CLUSTER_POLL,
        || Ok((c.rule_ready("devices", NS)? && c.rule_ready("readings", NS)?).then_some(())),
    )?;
    log(format!(
        "CEL example rules Ready {:.1?} after kubectl apply (group json, pods of its own)",
        t.elapsed()
    ));
    let broker = publisher_endpoint(c.node_ip(), mqtt);
    rt.block_on(publish_to(&broker, "e2e-pub-cel", cel_example_messages(3)))?;
    let read = |topic: &str, n: usize| {
        kafka.read_all(topic, n, Duration::from_secs(3), Duration::from_secs(60))
    };
    let json = |r: &Record| -> Result<serde_json::Value> { Ok(serde_json::from_slice(&r.value)?) };
    let header = |r: &Record, name: &str| {
        r.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    let devices = read("devices", 2)?;
    ensure!(devices.len() == 2, "devices: {} records", devices.len());
    for r in &devices {
        let v = json(r)?;
        ensure!(
            r.key_str() == v["device"].as_str(),
            "devices record {v}: key {:?}, want the payload's device",
            r.key_str()
        );
    }
    let readings = read("readings.3", 1)?;
    ensure!(
        readings.len() == 1,
        "readings.3: {} records, want the one reading (the heartbeat filtered)",
        readings.len()
    );
    let v = json(&readings[0])?;
    let fields: Vec<&str> = v
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    ensure!(
        fields == ["celsius", "device", "plant", "receivedAt"]
            && v["celsius"] == 21.5
            && v["device"] == "d-31"
            && v["plant"] == "3"
            && v["receivedAt"].as_str().is_some_and(|t| t.contains('T')),
        "the reshaped reading: {v}"
    );
    ensure!(header(&readings[0], "device").as_deref() == Some("d-31"));
    let dead = read("ferry.dead-letters", 2)?;
    let errors: Vec<String> = dead
        .iter()
        .map(|r| header(r, "ferry.error").unwrap_or_default())
        .collect();
    let has = |what: &[&str]| errors.iter().any(|e| what.iter().all(|w| e.contains(w)));
    ensure!(
        errors.len() == 2
            && has(&["payload.transform", "No such key: temp"])
            && has(&["filter", "reads json, but the payload is not JSON"]),
        "dead letters: {errors:?}"
    );
    log(format!(
        "CEL examples: 2 device records keyed by the payload's device, 1 reshaped reading in \
         readings.3, the heartbeat filtered, 2 dead letters with their errors; {:.1?}",
        t.elapsed()
    ));
    Ok(())
}

/// Whether the forwarder at `ip` runs `rule` (its `/status`): `None` if not, else whether it
/// lists the rule as retiring (moved away: unsubscribed, handing over what its session holds).
fn rule_state(ip: &str, rule: &str) -> Result<Option<bool>> {
    let body = http_get_ok(SocketAddr::new(ip.parse()?, 8080), "/status")?;
    let v: serde_json::Value = serde_json::from_str(&body)?;
    Ok(v["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["name"] == rule)
        .map(|r| !r["retiring"].is_null()))
}

/// Rule `alarms` moved from group `default` to group `json` (the CEL examples' pods) while its
/// topics get 200 messages a second: the operator keeps it in `default` until `json`'s pod runs
/// it, then lists it in `default`'s `retiring` until pod 0 says it handed the rule over, then
/// drops it there. Every message the broker acknowledged is in Kafka. Both groups are
/// subscribed from the new pod's subscription until the old pod reads its config with the rule
/// retiring (the operator's poll, then a ConfigMap sync): what is published meanwhile reaches
/// Kafka twice, so the duplicates are bounded by that overlap, not by the window.
fn moving_a_rule_to_another_group_under_load(
    c: &Cluster,
    mqtt: &Mosquitto,
    kafka: &Kafka,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let (old_ip, new_ip) = (pod_ip(c, &format!("{STS}-0"))?, pod_ip(c, "plant-json-0")?);
    let load = SteadyLoad::start(c, mqtt, rt, "move", alarm_topic);
    let t = Instant::now();
    merge_patch(c, "fr", "alarms", r#"{"spec":{"group":"json"}}"#)?;
    // Three configs reach pods: the new group's with the rule; once the operator saw it run
    // there (it looks every DRAIN_POLL while a move is under way), the old group's with the
    // rule retiring; once its pod said handed over (nothing for the rule for DRAIN_QUIET) and
    // the operator saw it, the old group's without the rule.
    let (mut taken_over, mut retiring) = (None, None);
    wait_until_some(
        "rule alarms runs in plant-json-0 and no more in plant-default-0",
        CONFIG_REACHES_POD * 3 + DRAIN_POLL * 2 + DRAIN_QUIET + CONTROL_PLANE_SLACK,
        CLUSTER_POLL,
        || {
            let new = rule_state(&new_ip, "alarms")? == Some(false);
            if new && taken_over.is_none() {
                taken_over = Some(t.elapsed());
            }
            let old = rule_state(&old_ip, "alarms")?;
            if old == Some(true) && retiring.is_none() {
                retiring = Some(t.elapsed());
            }
            Ok((new && old.is_none()).then_some(()))
        },
    )?;
    let moved = t.elapsed();
    let sent = load.finish(rt)?;
    let (lost, dups) = read_lost_and_duplicates(kafka, "alarms", "move", &sent)?;
    let workload = c.jsonpath("fr", "alarms", NS, "{.status.workload}")?;
    log(format!(
        "rule alarms moved from group default to json under load (200/s): plant-json-0 ran it \
         {taken_over:.1?} after the patch, plant-default-0 listed it retiring after \
         {retiring:.1?} and dropped it after {moved:.1?}; its \
         status.workload {workload}; {} published: lost {}, duplicates {dups}",
        sent.len(),
        lost.len()
    ));
    ensure!(lost.is_empty(), "lost moving rule alarms: {lost:?}");
    let overlap = DRAIN_POLL + CONFIG_REACHES_POD + CONTROL_PLANE_SLACK;
    let dup_bound = overlap.as_secs() as usize * LOAD_PER_SECOND as usize + FORWARDER_WINDOW;
    ensure!(
        dups <= dup_bound,
        "{dups} duplicates moving rule alarms: more than both groups subscribed for {overlap:?} \
         plus a window ({dup_bound})"
    );
    wait_until_some(
        "rule alarms Ready in its new group",
        CONTROL_PLANE_SLACK,
        CLUSTER_POLL,
        || Ok(c.rule_ready("alarms", NS)?.then_some(())),
    )?;
    Ok(())
}

/// Deleting the rules and the connection removes everything they owned, and the operator ends
/// the forwarders' MQTT sessions.
fn deleting_the_connection_removes_its_children_and_sessions(
    c: &Cluster,
    mqtt: &Mosquitto,
    rt: &tokio::runtime::Runtime,
    t0: Instant,
) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let owned = || -> Result<String> {
        c.kubectl(&[
            "get",
            "statefulsets,configmaps,secrets,services,poddisruptionbudgets,pods",
            "-n",
            NS,
            "-l",
            "ferry.dev/connection=plant",
            "-o",
            "name",
        ])
    };
    let before = owned()?;
    // The forwarders running now (the scale-down already ended pod 1's session).
    let running: Vec<String> = forwarder_pods(c)?.into_iter().map(|p| p.0).collect();
    ensure!(
        !running.is_empty(),
        "no forwarder pod runs before the deletion"
    );
    log(format!(
        "owned by the connection before deleting it:\n{before}"
    ));
    let prefix = session_prefix(c)?;
    let t = Instant::now();
    c.kubectl(&[
        "delete",
        "fr",
        "--all",
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    c.kubectl(&[
        "delete",
        "bc",
        "plant",
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    wait_until_some(
        "everything the connection owned gone",
        Duration::from_secs(120),
        CLUSTER_POLL,
        || Ok(owned()?.trim().is_empty().then_some(())),
    )?;
    let left = c.kubectl(&["get", "all,cm,secret,pdb", "-n", NS, "-o", "name"])?;
    log(format!(
        "rules and connection deleted; their children gone {:.1?} later; left in {NS}:\n{left}",
        t.elapsed()
    ));
    // The forwarders are gone for good: the operator (from its pod) ended their sessions with a
    // clean start, so the broker holds none for them and queues nothing.
    let mqtt_log = fs::read_to_string(mqtt.dir().join("mosquitto.log"))?;
    for pod in &running {
        let client_id = format!("{prefix}{pod}");
        let last_connect = mqtt_log
            .lines()
            .rev()
            .find(|l| {
                l.contains("New client connected") && l.contains(&format!(" as {client_id} "))
            })
            .unwrap_or_default();
        ensure!(
            last_connect.contains("(p5, c1,"),
            "{client_id}'s last connect should be the operator's clean start: {last_connect:?}"
        );
        let (present, _) = rt.block_on(ferry_e2e::probe_session(
            c.node_ip(),
            mqtt.port(),
            Some(PUBLISHER),
            &client_id,
            false,
        ))?;
        ensure!(!present, "the broker still holds a session for {client_id}");
    }
    log("the forwarders' MQTT sessions were ended by the operator: none left at the broker".into());
    // The user's own Secret stays: the operator only copied from it.
    let theirs = [
        "configmap/kube-root-ca.crt",
        "secret/mqtt-credentials",
        "secret/registry-credentials",
    ];
    ensure!(
        left.lines()
            .all(|l| l.trim().is_empty() || theirs.contains(&l)),
        "left in namespace {NS}:\n{left}"
    );

    Ok(())
}

/// The operator's finalizer on a BrokerConnection, as on every one it serves.
const SESSIONS_FINALIZER: &str = "ferry.dev/mqtt-sessions";

/// A connection left in place through the uninstall; once the operator holds it (its
/// finalizer), returns its name.
fn a_connection_holds_the_finalizer(c: &Cluster, t0: Instant) -> Result<String> {
    let depot = "depot";
    c.kubectl_in(
        &["apply", "-f", "-"],
        Some(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: BrokerConnection\nmetadata: {{ name: {depot}, namespace: {NS} }}\n\
             spec:\n  mqtt: {{ host: mqtt.invalid }}\n  kafka: {{ bootstrapServers: [\"kafka.invalid:9092\"] }}\n"
        )),
    )?;
    wait_until_some(
        "the operator's finalizer on the connection",
        Duration::from_secs(60),
        CLUSTER_POLL,
        || {
            let finalizers = c.jsonpath("bc", depot, NS, "{.metadata.finalizers}")?;
            Ok(finalizers.contains(SESSIONS_FINALIZER).then_some(()))
        },
    )?;
    println!(
        "[{:6.1?}] connection {depot} held by the operator's finalizer",
        t0.elapsed()
    );
    Ok(depot.to_owned())
}

/// The chart's pre-delete hook released the finalizer of the connection left in place and
/// marked it, so deleting it completes without an operator.
fn the_uninstall_released_the_finalizer(c: &Cluster, depot: &str, t0: Instant) -> Result<()> {
    let meta = c.jsonpath("bc", depot, NS, "{.metadata}")?;
    ensure!(
        !meta.contains(SESSIONS_FINALIZER) && meta.contains("ferry.dev/finalizer-released-at"),
        "the uninstall hook released and marked {depot}: {meta}"
    );
    let t = Instant::now();
    c.kubectl(&["delete", "bc", depot, "-n", NS, "--timeout=60s"])?;
    println!(
        "[{:6.1?}] {depot} deleted without an operator in {:.1?}",
        t0.elapsed(),
        t.elapsed()
    );
    Ok(())
}

/// `helm uninstall` leaves nothing of the release but the CRDs.
fn helm_uninstall_leaves_only_the_crds(c: &Cluster, t0: Instant) -> Result<()> {
    let log = |msg: String| println!("[{:6.1?}] {msg}", t0.elapsed());
    let t = Instant::now();
    // The pre-delete hook's Job stops the operator (up to its 120 s) before releasing.
    c.helm(&[
        "uninstall",
        "ferry",
        "--namespace",
        RELEASE_NS,
        "--wait",
        "--timeout",
        "5m",
    ])?;
    let left = wait_until_some(
        "the release's objects gone after helm uninstall",
        Duration::from_secs(90),
        CLUSTER_POLL,
        || {
            let left = c.kubectl(&[
                "get",
                "all,cm,secret,sa,role,rolebinding,networkpolicy",
                "-n",
                RELEASE_NS,
                "-o",
                "name",
            ])?;
            let left: Vec<String> = left
                .lines()
                .filter(|l| {
                    !l.trim().is_empty()
                        && *l != "configmap/kube-root-ca.crt"
                        && *l != "serviceaccount/default"
                })
                .map(str::to_owned)
                .collect();
            Ok(left.is_empty().then_some(left))
        },
    );
    let cluster_wide = c.kubectl(&[
        "get",
        "clusterroles,clusterrolebindings",
        "-l",
        "app.kubernetes.io/instance=ferry",
        "-o",
        "name",
    ])?;
    let leases = c.kubectl(&["get", "leases", "-n", RELEASE_NS, "-o", "name"])?;
    let crds = c.kubectl(&["get", "crds", "-o", "name"])?;
    log(format!(
        "helm uninstall in {:.1?}; left: namespaced {left:?}, cluster-wide {cluster_wide:?}, \
         leases {leases:?}; CRDs:\n{crds}",
        t.elapsed()
    ));
    left?;
    ensure!(
        cluster_wide.trim().is_empty(),
        "cluster-wide objects left: {cluster_wide}"
    );
    ensure!(
        crds.contains("brokerconnections.ferry.dev") && crds.contains("forwardingrules.ferry.dev"),
        "the CRDs should stay after helm uninstall: {crds}"
    );
    if !leases.trim().is_empty() {
        log(format!(
            "NOTE: left after helm uninstall, not by the chart: the operator's leader-election \
             Lease ({}) in {RELEASE_NS}",
            leases.trim()
        ));
    }
    Ok(())
}

/// The README's install command is one this test can run: checked without a cluster, so a
/// README edit that breaks it fails at once, not only on the kubelet cluster.
#[test]
fn the_readme_install_command_installs_this_chart_version() -> Result<()> {
    let args = readme_install_from("registry.test:5000")?;
    ensure!(
        args.iter()
            .any(|a| a == "oci://registry.test:5000/ferry-dev/charts/ferry"),
        "{args:?}"
    );
    Ok(())
}
