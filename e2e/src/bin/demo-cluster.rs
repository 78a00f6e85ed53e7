//! `make demo`: Ferry's whole path on a real single-node Kubernetes cluster, narrated for a
//! newcomer. The cluster of `e2e/cluster/up.sh` with its default settings comes up (netns
//! `ferry`, node 10.77.0.2, state and kubeconfig in `$FERRY_CLUSTER_DIR`, default
//! `/tmp/ferry-cluster`), the Ferry images are imported, Mosquitto and Kafka start inside the
//! cluster's network namespace, `helm install` installs the chart, a BrokerConnection and two
//! ForwardingRules are applied, sample messages are published and read back from Kafka. A schema
//! registry (Apicurio, basic auth) runs next to the brokers: a third rule writes Avro records
//! with the schema registered there, read back with confluent-kafka's own AvroDeserializer.
//!
//! The brokers are child processes of this demo, so the cluster lives as long as the demo: with
//! a terminal on stdin it waits for Enter (or Ctrl-C) before tearing down, otherwise it tears
//! down at once. The cluster is always torn down (`down.sh`), also on error (its component
//! logs are then kept and their path printed). If a cluster with these settings already exists,
//! the demo refuses to start and leaves it alone.
//!
//! Needs root, `make deps k8s helm images` (the Makefile target `demo` runs them).

use std::io::BufRead as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use ferry_e2e::cluster::{
    BrokerOptions, Brokers, CLUSTER_POLL, Cluster, METRIC_AVRO, METRICS_SUBJECT, METRICS_TOPIC,
    MqttEndpoint, cel_example_messages, e2e_dir, ensure_helm, ensure_root, example_rules,
    ferry_images, metric_messages, metrics_rule_yaml, plant_connection_yaml, publish_to,
    read_metrics_decoded, unique,
};
use ferry_e2e::kube::Kubectl as _;
use ferry_e2e::{
    Kafka, Mosquitto, SchemaRegistry, SchemaRegistryOptions, SchemaType, wait_until_some,
};

const RELEASE_NS: &str = "ferry-system";
const NS: &str = "plant";
/// The schema registry's user; its password is made up per run and kept in the Secret
/// `REGISTRY_SECRET` (never printed).
const REGISTRY_USER: &str = "ferry";
const REGISTRY_SECRET: &str = "schema-registry-credentials";
/// Avro readings published to the rule `metrics`.
const METRICS: usize = 4;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted (Ctrl-C)");
    }
    Ok(())
}

fn say(text: &str) {
    println!("\n==> {text}");
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| {
            if l.is_empty() {
                String::new()
            } else {
                format!("    {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) if INTERRUPTED.load(Ordering::SeqCst) => {
            eprintln!("\nferry demo: interrupted (Ctrl-C); everything is torn down");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("\nferry demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let t0 = Instant::now();
    catch_sigint();
    ensure_root("the demo")?;
    let images = ferry_images()?;
    ensure_helm()?;
    let cluster = own_cluster()?;
    bring_up(&cluster)?;
    interrupted()?;
    let registry_password = format!("demo-{}", unique());
    let brokers = start_brokers(&cluster, &images, &registry_password)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = demo(&cluster, &brokers, &registry_password, &rt);
    hold_or_diagnose(&cluster, &result);
    drop(rt);
    drop(brokers);
    tear_down(cluster, result.is_ok(), t0)?;
    result
}

/// Ctrl-C: this process notes it and tears the cluster down; the commands it runs (and the
/// brokers) get the terminal's SIGINT and stop, so every step ends quickly.
fn catch_sigint() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// The demo's cluster (default settings), refused when one with those settings exists already:
/// that one belongs to someone else, so it is left alone (disarmed: not torn down on drop).
fn own_cluster() -> Result<Cluster> {
    let mut cluster = Cluster::default_settings("ferry-demo")?;
    if let Some(what) = cluster.existing() {
        cluster.disarm();
        bail!(
            "a cluster with the demo's settings already exists ({what}). The demo brings up and \
             tears down a cluster of its own, so it leaves that one alone: tear it down with \
             `sudo {}` and run `make demo` again.",
            e2e_dir().join("cluster/down.sh").display()
        );
    }
    Ok(cluster)
}

/// The single-node cluster up, and its node shown.
fn bring_up(cluster: &Cluster) -> Result<()> {
    say(&format!(
        "Bringing up a single-node Kubernetes cluster (e2e/cluster/up.sh): etcd, kube-apiserver, \
         controller-manager, scheduler, containerd and a kubelet in the network namespace `{}`, \
         node {}",
        cluster.netns(),
        cluster.node_ip()
    ));
    let t = Instant::now();
    cluster.up()?;
    println!(
        "    up in {:.0?}; kubeconfig {}",
        t.elapsed(),
        cluster.kubeconfig().display()
    );
    println!(
        "    {}",
        cluster
            .kubectl(&["get", "nodes", "-o", "wide"])?
            .lines()
            .collect::<Vec<_>>()
            .join("\n    ")
    );
    Ok(())
}

/// The Ferry images into the node's containerd, and the brokers and the schema registry on the
/// node address (the caller keeps them: they stop when dropped).
fn start_brokers(
    cluster: &Cluster,
    images: &[PathBuf],
    registry_password: &str,
) -> Result<Brokers> {
    say(&format!(
        "Importing the ferry-operator and ferry-forwarder images into the cluster's containerd, \
         and starting a real Mosquitto, a real Apache Kafka and a real schema registry (Apicurio \
         Registry, Confluent-compatible API, HTTPS with a CA of its own, basic auth) inside `{}` on the node address {} \
         (pods reach them there, and so does this demo)",
        cluster.netns(),
        cluster.node_ip()
    ));
    let t = Instant::now();
    // The registry's certificate, for the node address; its CA goes into the Secret.
    let pki = cluster.node_pki()?;
    let brokers = cluster.import_images_and_start_brokers(
        images,
        BrokerOptions {
            schema_registry: SchemaRegistryOptions {
                tls: Some(&pki),
                basic_auth: Some((REGISTRY_USER.to_owned(), registry_password.to_owned())),
            },
            ..BrokerOptions::default()
        },
    )?;
    for image in images {
        println!("    imported {}", image.display());
    }
    let Brokers {
        mqtt,
        kafka,
        schema_registry,
    } = &brokers;
    println!("    mosquitto  {}:{}", mqtt.host(), mqtt.port());
    println!(
        "    kafka      {}  (Apache Kafka {})",
        kafka.bootstrap(),
        ferry_e2e::KAFKA_VERSION
    );
    println!(
        "    registry   {}  (user {REGISTRY_USER})",
        schema_registry.url()
    );
    println!("    ready in {:.0?}", t.elapsed());
    Ok(brokers)
}

/// After a success the cluster stays up for the newcomer to look around; after a failure
/// (other than Ctrl-C) its state is printed while it is still there.
fn hold_or_diagnose(cluster: &Cluster, result: &Result<()>) {
    match result {
        Ok(()) => wait_for_enter(cluster),
        Err(e) if !INTERRUPTED.load(Ordering::SeqCst) => {
            eprintln!("\nferry demo: {e:#}");
            cluster.diagnose(RELEASE_NS, NS, "plant");
        }
        Err(_) => {}
    }
}

/// The cluster down (the brokers are stopped already). After a failure the cluster's drop
/// tears it down instead, keeping its component logs and printing their path.
fn tear_down(mut cluster: Cluster, demo_succeeded: bool, t0: Instant) -> Result<()> {
    say("Tearing down: brokers stopped, cluster down (e2e/cluster/down.sh)");
    if !demo_succeeded {
        drop(cluster);
        return Ok(());
    }
    let t = Instant::now();
    cluster.down(None)?;
    println!("    down in {:.0?}", t.elapsed());
    println!(
        "\nThe demo took {:.0?}. Next: `make test` runs every test (the full path with a rule \
         edited live and forwarder pods killed under load: e2e/tests/full_path.rs); \
         docs/configuration.md has the configuration reference.",
        t0.elapsed()
    );
    Ok(())
}

/// With a terminal on stdin: waits for Enter or Ctrl-C. Otherwise returns at once.
fn wait_for_enter(cluster: &Cluster) {
    // SAFETY: isatty(3) has no preconditions.
    if unsafe { libc::isatty(0) } != 1 {
        say("stdin is not a terminal: tearing down at once");
        return;
    }
    say(&format!(
        "The cluster stays up while this demo runs: in another terminal, `export KUBECONFIG={}` \
         and poke around (commands above); press Enter to tear down",
        cluster.kubeconfig().display()
    ));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
        let _ = tx.send(());
    });
    while rx.recv_timeout(Duration::from_millis(200)).is_err()
        && !INTERRUPTED.load(Ordering::SeqCst)
    {}
}

fn resources_yaml(cluster: &Cluster, brokers: &Brokers) -> String {
    let connection = plant_connection_yaml(
        NS,
        cluster.node_ip(),
        (brokers.mqtt.port(), brokers.kafka.port()),
        1,
        None,
        Some((&brokers.schema_registry.url(), REGISTRY_SECRET)),
    );
    let metrics = metrics_rule_yaml(NS);
    format!(
        r#"{connection}---
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata:
  name: telemetry
  namespace: {NS}
spec:
  connectionRef: {{ name: plant }}
  mqtt:
    topics: ["plant/+/telemetry/#"]     # + : one level (the plant), # : every level below
  kafka:
    topic: "telemetry.{{1}}"              # plant/2/telemetry/humidity -> telemetry.2
    key: {{ strategy: topicLevel, level: 3 }}  # -> key "humidity": one sensor stays in order
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
    topic: alarms                       # key: the MQTT topic (the default)
  payload: wrappedJson                  # {{"topic":"plant/2/alarm","payload":"<base64>"}}
---
{metrics}"#
    )
}

/// The user's path on the running cluster: topics, the chart, the resources, messages in,
/// records out, the rules' status.
fn demo(
    cluster: &Cluster,
    brokers: &Brokers,
    registry_password: &str,
    rt: &tokio::runtime::Runtime,
) -> Result<()> {
    let Brokers {
        mqtt,
        kafka,
        schema_registry,
    } = brokers;
    create_topics(kafka, rt)?;
    let schema_id = register_schema(schema_registry)?;
    interrupted()?;
    install_chart(cluster)?;
    interrupted()?;
    apply_resources(cluster, brokers, registry_password)?;
    let metrics = publish_samples(mqtt, rt)?;
    interrupted()?;
    read_back(kafka)?;
    read_back_avro(schema_registry, kafka, &metrics, schema_id)?;
    show_status(cluster)?;
    explain();
    show_where_to_look(cluster, brokers);
    Ok(())
}

/// The rules' Kafka topics: one per plant for telemetry, one for alarms.
fn create_topics(kafka: &Kafka, rt: &tokio::runtime::Runtime) -> Result<()> {
    let kafka_topics = [
        ("telemetry.1", 2),
        ("telemetry.2", 2),
        ("telemetry.3", 2),
        ("alarms", 1),
        ("devices", 2),
        ("readings.2", 1),
        ("ferry.dead-letters", 1),
        (METRICS_TOPIC, 1),
    ];
    for (topic, partitions) in kafka_topics {
        rt.block_on(kafka.create_topic(topic, partitions))?;
    }
    println!(
        "    created Kafka topics: telemetry.1, telemetry.2, telemetry.3 (2 partitions each), \
         alarms (1), for the CEL examples devices (2), readings.2 and ferry.dead-letters (1), \
         and {METRICS_TOPIC} (1) for the Avro records"
    );
    Ok(())
}

/// The Avro schema of a reading, registered under the subject the rule `metrics` derives from
/// its topic (TopicName strategy: `<topic>-value`), as a platform team would register it.
fn register_schema(registry: &SchemaRegistry) -> Result<u32> {
    say(&format!(
        "Registering an Avro schema for a reading under the subject {METRICS_SUBJECT} \
         (POST {}/subjects/{METRICS_SUBJECT}/versions)",
        registry.url()
    ));
    let id = registry.register(METRICS_SUBJECT, SchemaType::Avro, METRIC_AVRO)?;
    println!("    {METRIC_AVRO}");
    println!("    -> schema id {id}, version 1");
    Ok(id)
}

/// `helm install` of the chart, and the operator's pods it started.
fn install_chart(cluster: &Cluster) -> Result<()> {
    say(&format!(
        "helm install ferry charts/ferry --namespace {RELEASE_NS} --create-namespace --wait \
         (the CRDs, the operator: 2 replicas with leader election, its RBAC)"
    ));
    let t = Instant::now();
    cluster.helm_install_ferry(RELEASE_NS)?;
    println!("    installed in {:.0?}", t.elapsed());
    println!(
        "{}",
        indent(&cluster.kubectl(&["get", "pods", "-n", RELEASE_NS])?)
    );
    Ok(())
}

/// The registry's Secret, then `kubectl apply` of the BrokerConnection and the rules, until every
/// rule is Ready.
fn apply_resources(cluster: &Cluster, brokers: &Brokers, registry_password: &str) -> Result<()> {
    let yaml = resources_yaml(cluster, brokers);
    cluster.kubectl(&["create", "namespace", NS])?;
    say(&format!(
        "kubectl create secret generic {REGISTRY_SECRET} -n {NS} --from-file=username \
         --from-file=password --from-file=ca.crt, labelled ferry.dev/broker-credentials=true \
         (the mark a Secret needs before a BrokerConnection may use it): the schema registry's \
         login and the CA of its certificate"
    ));
    cluster.create_schema_registry_secret(
        NS,
        REGISTRY_SECRET,
        &brokers.schema_registry,
        (REGISTRY_USER, registry_password),
    )?;
    say(&format!(
        "kubectl apply: a BrokerConnection (the brokers and the schema registry above) and three \
         ForwardingRules, in namespace {NS}; the third, metrics, writes Avro records"
    ));
    println!("{}", indent(&yaml));
    let t = Instant::now();
    cluster.kubectl_in(&["apply", "-f", "-"], Some(&yaml))?;
    let examples = example_rules(&["devices", "readings"])?;
    say(&format!(
        "kubectl apply -n {NS}: the two CEL examples of examples/kubernetes/rules.yaml, as shipped \
         (a key from the JSON payload; heartbeats dropped, readings reshaped)"
    ));
    println!("{}", indent(&examples));
    cluster.kubectl_in(&["apply", "-n", NS, "-f", "-"], Some(&examples))?;
    wait_until_some(
        "every rule Ready",
        Duration::from_secs(180),
        CLUSTER_POLL,
        || {
            interrupted()?;
            let mut ready = true;
            for rule in ["telemetry", "alarms", "metrics", "devices", "readings"] {
                ready &= cluster.rule_ready(rule, NS)?;
            }
            Ok(ready.then_some(()))
        },
    )?;
    println!(
        "    every rule Ready {:.0?} after kubectl apply: the operator rendered each group's \
         forwarder config, created a StatefulSet per group, and its pods subscribed to MQTT and \
         reached Kafka",
        t.elapsed()
    );
    println!(
        "{}",
        indent(&cluster.kubectl(&["get", "pods", "-n", NS, "-o", "wide"])?)
    );
    Ok(())
}

/// Two readings per plant, one alarm, a message no rule subscribes to, the CEL examples' messages
/// and the Avro rule's readings, at QoS 1; returns the latter.
fn publish_samples(
    mqtt: &Mosquitto,
    rt: &tokio::runtime::Runtime,
) -> Result<Vec<(String, Vec<u8>)>> {
    say(&format!(
        "Publishing sample MQTT messages (QoS 1) to {}:{}",
        mqtt.host(),
        mqtt.port()
    ));
    let mut messages = Vec::new();
    for plant in 1..=3 {
        for (sensor, value) in [
            ("temperature", 20.0 + plant as f64),
            ("humidity", 40.0 + plant as f64),
        ] {
            let topic = format!("plant/{plant}/telemetry/{sensor}");
            let payload = format!(r#"{{"{sensor}":{value:.1}}}"#);
            println!("    {topic:<34} {payload}");
            messages.push((topic, payload.into_bytes()));
        }
    }
    let alarm = (
        "plant/2/alarm".to_string(),
        br#"{"code":"OVERHEAT"}"#.to_vec(),
    );
    println!("    {:<34} {}", alarm.0, String::from_utf8_lossy(&alarm.1));
    messages.push(alarm);
    messages.push(("office/coffee".into(), b"no rule subscribes to it".to_vec()));
    println!(
        "    {:<34} not forwarded: no rule subscribes to it",
        "office/coffee"
    );
    for (topic, payload) in cel_example_messages(2) {
        println!("    {topic:<34} {}", String::from_utf8_lossy(&payload));
        messages.push((topic, payload));
    }
    let metrics = metric_messages(1, METRICS);
    for (topic, payload) in &metrics {
        println!("    {topic:<34} {}", String::from_utf8_lossy(payload));
    }
    messages.extend(metrics.iter().cloned());
    let broker = MqttEndpoint {
        host: mqtt.host(),
        port: mqtt.port(),
        login: None,
    };
    rt.block_on(publish_to(&broker, "ferry-demo-publisher", messages))?;
    Ok(metrics)
}

/// Every record the rules produced, read from Kafka: the six readings, the alarm, and what the
/// CEL examples made of their messages.
fn read_back(kafka: &Kafka) -> Result<()> {
    say("Reading the records back from Kafka (topic[partition]@offset, key, value)");
    let mut records = Vec::new();
    for (topic, expect) in [
        ("telemetry.1", 2),
        ("telemetry.2", 2),
        ("telemetry.3", 2),
        ("alarms", 1),
        ("devices", 2),
        ("readings.2", 1),
        ("ferry.dead-letters", 2),
    ] {
        records.extend(kafka.read_all(
            topic,
            expect,
            Duration::from_millis(500),
            Duration::from_secs(60),
        )?);
    }
    for r in &records {
        println!(
            "    {:<22} key={:<16} value={}",
            format!("{}[{}]@{}", r.topic, r.partition, r.offset),
            r.key_str().unwrap_or("<none>"),
            r.value_str()
        );
        if let Some((_, error)) = r.headers.iter().find(|(k, _)| k == "ferry.error") {
            println!(
                "    {:<22} ferry.error: {}",
                "",
                String::from_utf8_lossy(error)
            );
        }
    }
    ensure!(
        records.len() == 12,
        "expected 6 telemetry records, 1 alarm, 2 device records, 1 reshaped reading and 2 \
         dead letters (the heartbeat filtered), read {}",
        records.len()
    );
    Ok(())
}

/// The Avro records of the rule `metrics`, decoded by confluent-kafka's own AvroDeserializer
/// (Python), which fetches the writer schema from the registry by the id in each record.
fn read_back_avro(
    registry: &SchemaRegistry,
    kafka: &Kafka,
    sent: &[(String, Vec<u8>)],
    schema_id: u32,
) -> Result<()> {
    say(&format!(
        "Reading the Avro records of {METRICS_TOPIC} back with confluent-kafka's own \
         AvroDeserializer (a standard Confluent-format consumer; the writer schema fetched from \
         the registry by the id each record carries)"
    ));
    for r in read_metrics_decoded(registry, kafka, sent, schema_id)? {
        println!(
            "    {:<22} key={:<16} schema id={} value={}",
            format!("{METRICS_TOPIC}[{}]@{}", r["partition"], r["offset"]),
            r["key"].as_str().unwrap_or("<none>"),
            r["schema_id"],
            r["value"]
        );
    }
    Ok(())
}

/// The rules' status once the operator has written the forwarded counts into it.
fn show_status(cluster: &Cluster) -> Result<()> {
    say(&format!(
        "kubectl get bc,fr -n {NS}: the operator writes each rule's Ready, rate and last \
         forwarded time from the forwarder pods' /status"
    ));
    wait_until_some(
        "status.forwarded of both rules",
        Duration::from_secs(60),
        CLUSTER_POLL,
        || {
            interrupted()?;
            let forwarded = |rule| -> Result<u64> {
                Ok(cluster
                    .jsonpath("fr", rule, NS, "{.status.forwarded}")?
                    .parse()
                    .unwrap_or(0))
            };
            Ok((forwarded("telemetry")? >= 6
                && forwarded("alarms")? >= 1
                && forwarded("metrics")? >= METRICS as u64
                && cluster.rule_schema("metrics", NS)?.is_some())
            .then_some(()))
        },
    )?;
    println!("{}", indent(&cluster.kubectl(&["get", "bc,fr", "-n", NS])?));
    println!(
        "\n    kubectl get fr -n {NS} -o wide: the schema id and version the Avro rule encodes with"
    );
    println!(
        "{}",
        indent(&cluster.kubectl(&["get", "fr", "-n", NS, "-o", "wide"])?)
    );
    println!(
        "{}",
        indent(&cluster.kubectl(&[
            "get",
            "fr",
            "-n",
            NS,
            "-o",
            "custom-columns=RULE:.metadata.name,READY PODS:.status.readyReplicas,\
             FORWARDED:.status.forwarded",
        ])?)
    );
    Ok(())
}

/// What the steps above showed, in words.
fn explain() {
    say("What happened");
    println!(
        "    Each telemetry reading went to the Kafka topic named after its plant (telemetry.{{1}}),\n    \
         keyed by its sensor (MQTT topic level 3), so one sensor's readings stay in one partition,\n    \
         in order. The alarm was wrapped as JSON with its MQTT topic. The forwarder acknowledged each\n    \
         message to MQTT only after Kafka confirmed it (at least once). office/coffee matched no rule.\n    \
         The CEL examples ran in their own pods (group json): device statuses keyed by the device\n    \
         inside the JSON; the reading reshaped into readings.2, the heartbeat filtered (acked, not\n    \
         forwarded), and the reading without temp and the payload that is not JSON dead-lettered\n    \
         with the error in their ferry.error header. The metrics rule validated each JSON reading\n    \
         against the Avro schema registered under metrics-value (its topic's subject), fetched over\n    \
         HTTPS with the login and CA from the Secret, and wrote it in the Confluent wire format\n    \
         (magic byte, schema id, Avro body): what confluent-kafka's deserializer, Kafka Connect or\n    \
         ksqlDB read."
    );
}

/// Commands to look around with while the cluster is up, and where the brokers are.
fn show_where_to_look(cluster: &Cluster, brokers: &Brokers) {
    say("Poke around (while the cluster is up)");
    println!("    export KUBECONFIG={}", cluster.kubeconfig().display());
    for (command, what) in [
        (
            format!("kubectl get pods -n {RELEASE_NS}"),
            "the operator (2 replicas, one leader)",
        ),
        (
            format!("kubectl get bc,fr,sts,cm,pods -n {NS}"),
            "the connection, the rules, what they own",
        ),
        (
            format!("kubectl describe fr telemetry -n {NS}"),
            "conditions, counts, events",
        ),
        (
            format!("kubectl logs -n {NS} plant-default-0"),
            "the forwarder pod",
        ),
        (
            format!("kubectl logs -n {RELEASE_NS} -l app.kubernetes.io/name=ferry"),
            "the operators",
        ),
        (
            format!("kubectl edit fr alarms -n {NS}"),
            "a live edit: the pod reloads it within ~10 s",
        ),
        (
            format!("kubectl get fr metrics -n {NS} -o jsonpath='{{.status.schema}}'"),
            "the schema the Avro rule encodes with",
        ),
    ] {
        println!("    {command:<62} # {what}");
    }
    println!(
        "    brokers: MQTT {}:{}, Kafka {}, schema registry {} (user {REGISTRY_USER}, password in \
         the Secret {REGISTRY_SECRET})",
        brokers.mqtt.host(),
        brokers.mqtt.port(),
        brokers.kafka.bootstrap(),
        brokers.schema_registry.url()
    );
}
