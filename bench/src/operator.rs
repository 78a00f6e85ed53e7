//! The operator at scale: how long until N ForwardingRules are Accepted and rendered, then
//! what it costs while real forwarders report on every rule under steady traffic: rule status
//! writes, API server requests and reconciles per minute, the operator's CPU and peak memory.
//!
//! No kubelet runs here, so the bench does its part for the pods the StatefulSet controller
//! created (as `operator/tests/dataplane.rs` does): it runs the release `ferry-forwarder` with
//! the group's rendered config and the pod's environment, on a loopback address of its own
//! (the operator polls `<podIP>:8080`), and reports the pod Running and Ready with that IP.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use ferry_e2e::kube::ControlPlane;
use ferry_e2e::manifests::{Connection, Rule};
use ferry_e2e::{
    Kafka, KafkaOptions, Mosquitto, WAIT_POLL, free_port, http_get, http_get_at, http_get_ok,
    metrics, wait_until,
};

use crate::report::{NoBudget, OperatorFigures};

const NS: &str = "bench";
/// Rules per group (one connection; 1,000 rules are 10 groups, 10,000 are 100).
pub const RULES_PER_GROUP: usize = 100;
/// The `kubectl create` processes creating the rules at once.
const CREATORS: usize = 10;
/// The operator's defaults, passed explicitly so the report says what was measured.
pub const STATUS_INTERVAL_SECONDS: u64 = 10;
pub const WRITE_INTERVAL_SECONDS: u64 = 60;
pub const WRITES_PER_SECOND: f64 = 20.0;
/// Every rule's topic gets a message this often: more than once per poll, so every rule's
/// counters move at every poll (the case the write budget is for), at a total rate (250 msg/s
/// for 1,000 rules) far below what would load the 2 cores the brokers share with the operator.
const TRAFFIC_PERIOD_SECONDS: u64 = 4;
/// After every rule is Forwarding and Ready: lets the reconciles those flips asked for finish.
const SETTLE: Duration = Duration::from_secs(15);
/// The forwarders' pod IPs: 127.88.0.<group + 1>, away from the tests' 127.77.0.x.
const POD_NET: [u8; 3] = [127, 88, 0];

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A forwarder process standing in for one pod; killed on drop.
struct Pod {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Pod {
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// A metric of the operator; fails when `/metrics` does not answer 200 (never a silent 0).
fn operator_metric(port: u16, name: &str, labels: &[&str]) -> Result<f64> {
    match http_get(port, "/metrics") {
        Ok((200, body)) => Ok(metrics::sum(&body, name, labels)),
        Ok((code, _)) => bail!("the operator's /metrics answered {code}"),
        Err(e) => Err(e.context("the operator's /metrics does not answer")),
    }
}

/// `apiserver_request_total` from the API server's own `/metrics`: every request, and those
/// on `forwardingrules/status` (the operator's data-plane writes; it reads through watches).
fn apiserver_requests(cp: &ControlPlane) -> Result<(f64, f64)> {
    let body = cp.run_kubectl(["get", "--raw", "/metrics", "--request-timeout=10s"])?;
    if !body.contains("apiserver_request_total{") {
        bail!("the API server's /metrics has no apiserver_request_total");
    }
    let all = metrics::sum(&body, "apiserver_request_total", &[]);
    let rule_status = metrics::sum(
        &body,
        "apiserver_request_total",
        &["resource=\"forwardingrules\"", "subresource=\"status\""],
    );
    Ok((all, rule_status))
}

fn kafka_topic(group: usize) -> String {
    format!("bench.g{group}")
}

/// How often to read every rule's conditions while waiting on them: a read of them all costs
/// the API server (and kubectl, on the same cores) in proportion to their number, so 250 ms
/// per 1,000 rules keeps the bench's own load from being what it measures.
fn rules_poll(rules: usize) -> Duration {
    Duration::from_millis(250 * (rules as u64).div_ceil(1000).max(1))
}

/// How many rules have condition `type_` True.
fn rules_with(cp: &ControlPlane, type_: &str) -> Result<usize> {
    let out = cp.run_kubectl([
        "get",
        "fr",
        "-n",
        NS,
        "-o",
        &format!(
            "jsonpath={{range .items[*]}}{{.status.conditions[?(@.type==\"{type_}\")].status}}{{\"\\n\"}}{{end}}"
        ),
    ])?;
    Ok(out.lines().filter(|l| *l == "True").count())
}

/// The operator with status write interval `write_interval` and budget `writes_per_second`,
/// logging to `<log>.log`.
fn start_operator(
    cp: &ControlPlane,
    bin: &Path,
    (write_interval, writes_per_second): (u64, f64),
    log: &str,
) -> Result<(Operator, u16)> {
    let port = free_port()?;
    let log = std::fs::File::create(cp.dir().join(format!("{log}.log")))?;
    let child = Command::new(bin)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--leader-elect", "false", "--log-format", "json"])
        .args([
            "--status-interval-seconds",
            &STATUS_INTERVAL_SECONDS.to_string(),
            "--status-write-interval-seconds",
            &write_interval.to_string(),
            "--status-writes-per-second",
            &writes_per_second.to_string(),
        ])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("FERRY_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let operator = Operator(child);
    wait_until(
        "the operator serving /metrics",
        Duration::from_secs(30),
        WAIT_POLL,
        || Ok(operator_metric(port, "ferry_operator_reconciles_total", &[]).is_ok()),
    )?;
    Ok((operator, port))
}

/// What creating the rules took: (all created, all Accepted and rendered), seconds from the
/// first create.
fn create_rules(
    cp: &ControlPlane,
    (rules, groups): (usize, usize),
    mqtt: u16,
    kafka: &str,
) -> Result<(f64, f64)> {
    let connection = Connection::new("plant", "127.0.0.1", &[kafka])
        .namespace(NS)
        .mqtt_port(mqtt);
    cp.run_kubectl_with_stdin(["create", "-f", "-"], &connection.yaml())?;
    // Created by CREATORS kubectl processes at once: kubectl sends one request per object, and
    // one process alone would measure kubectl, not the operator. Rule i is in group i % groups
    // and forwards MQTT topic plant/t<i> (where the traffic goes) to its group's topic.
    let manifests: Vec<String> = (0..CREATORS)
        .map(|c| {
            (0..rules)
                .filter(|i| i % CREATORS == c)
                .map(|i| {
                    let g = i % groups;
                    Rule::new(&format!("rule-{i}"), "plant")
                        .namespace(NS)
                        .group(&format!("g{g}"))
                        .topics(&[&format!("plant/t{i}")])
                        .kafka_topic(&kafka_topic(g))
                        .yaml()
                })
                .collect()
        })
        .collect();
    let applied = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let creates: Vec<_> = manifests
            .iter()
            .map(|yaml| s.spawn(|| cp.run_kubectl_with_stdin(["create", "-f", "-"], yaml)))
            .collect();
        for c in creates {
            c.join()
                .map_err(|_| anyhow::anyhow!("a kubectl thread panicked"))??;
        }
        Ok(())
    })?;
    let apply_seconds = applied.elapsed().as_secs_f64();
    wait_until(
        "every rule Accepted",
        Duration::from_secs(300),
        rules_poll(rules),
        || Ok(rules_with(cp, "Accepted")? >= rules),
    )?;
    let all_accepted_seconds = applied.elapsed().as_secs_f64();
    // Rendered too: every group's config holds its rules.
    let configs = cp.run_kubectl([
        "get",
        "configmaps",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/name=ferry-forwarder",
        "-o",
        "jsonpath={range .items[*]}{.data.config\\.yaml}{end}",
    ])?;
    let rendered = configs.matches("- name: rule-").count();
    if rendered != rules {
        bail!("{rendered} of {rules} rules rendered into forwarder configs");
    }
    Ok((apply_seconds, all_accepted_seconds))
}

/// Runs pod 0 of group `g`'s StatefulSet as a forwarder on its own loopback IP, waits until it
/// is ready (subscribed, Kafka reached), and reports the pod Running and Ready with that IP.
fn run_pod(cp: &ControlPlane, bin: &Path, g: usize) -> Result<Pod> {
    let workload = format!("plant-g{g}");
    let name = format!("{workload}-0");
    // 127.88.<g / 200>.<g % 200 + 1>: up to 200 groups a /24.
    let ip = Ipv4Addr::new(
        POD_NET[0],
        POD_NET[1],
        POD_NET[2] + (g / 200) as u8,
        (g % 200) as u8 + 1,
    );
    let addr = SocketAddr::from((ip, 8080));
    if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
        bail!("something else listens on {addr}, the address of pod {name}");
    }
    wait_until(
        &format!("pod {name} created"),
        Duration::from_secs(60),
        WAIT_POLL,
        || Ok(cp.run_kubectl(["get", "pod", &name, "-n", NS]).is_ok()),
    )?;
    let config = cp.run_kubectl([
        "get",
        "configmap",
        &workload,
        "-n",
        NS,
        "-o",
        "jsonpath={.data.config\\.yaml}",
    ])?;
    if config.is_empty() {
        bail!("ConfigMap {workload} has no config.yaml");
    }
    // The connection's `status.sessionPrefix` starts its pods' client ids.
    let prefix = cp.run_kubectl([
        "get",
        "bc",
        "plant",
        "-n",
        NS,
        "-o",
        "jsonpath={.status.sessionPrefix}",
    ])?;
    let dir = cp.dir().join(&name);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.yaml"), config)?;
    let log = dir.join("forwarder.log");
    let out = std::fs::File::create(&log)?;
    let child = Command::new(bin)
        .arg("--config")
        .arg(dir.join("config.yaml"))
        .args(["--http-listen", &addr.to_string()])
        // As the pod template's arguments have it, with Kubernetes' `$(VAR)` expanded.
        .arg("--no-env-substitution")
        .args(["--mqtt-client-id", &format!("{prefix}{name}")])
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let mut pod = Pod { child, addr, log };
    wait_until(
        &format!("forwarder {name} ready"),
        Duration::from_secs(60),
        WAIT_POLL,
        || {
            if let Some(status) = pod.child.try_wait()? {
                bail!("forwarder {name} exited with {status}: {}", pod.log_tail());
            }
            Ok(http_get_at(addr, "/readyz").is_ok_and(|(code, _)| code == 200))
        },
    )?;
    cp.report_pod(NS, &name, Some("Running"), Some(ip.into()), true)?;
    Ok(pod)
}

/// One forwarder per group, [`CREATORS`] started at once.
fn run_pods(cp: &ControlPlane, bin: &Path, groups: usize) -> Result<Vec<Pod>> {
    let mut pods = Vec::with_capacity(groups);
    for first in (0..groups).step_by(CREATORS) {
        let batch = std::thread::scope(|s| {
            let started: Vec<_> = (first..(first + CREATORS).min(groups))
                .map(|g| s.spawn(move || run_pod(cp, bin, g)))
                .collect();
            started
                .into_iter()
                .map(|t| {
                    t.join()
                        .map_err(|_| anyhow::anyhow!("a forwarder thread panicked"))?
                })
                .collect::<Result<Vec<Pod>>>()
        })?;
        pods.extend(batch);
    }
    Ok(pods)
}

/// Counters read at both ends of the steady window.
struct Sample {
    at: Instant,
    rule_writes: f64,
    reconciles: f64,
    poll_errors: f64,
    apiserver: f64,
    apiserver_rule_status: f64,
    operator: crate::procs::Usage,
    forwarded: f64,
}

impl Sample {
    fn take(cp: &ControlPlane, port: u16, pid: u32, pods: &[Pod]) -> Result<Self> {
        let (apiserver, apiserver_rule_status) = apiserver_requests(cp)?;
        let mut forwarded = 0.0;
        for pod in pods {
            let body = http_get_ok(pod.addr, "/metrics")?;
            // The forwarder's own count: the per-rule counters credit every rule of a shared
            // Kafka target with each of its messages (the rules here share one topic per group).
            forwarded += metrics::sum(&body, "ferry_mqtt_acked_messages_total", &[]);
        }
        Ok(Self {
            at: Instant::now(),
            rule_writes: operator_metric(
                port,
                "ferry_operator_status_writes_total",
                &["kind=\"forwarding_rule\""],
            )?,
            reconciles: operator_metric(port, "ferry_operator_reconciles_total", &[])?,
            poll_errors: operator_metric(
                port,
                "ferry_operator_forwarder_status_polls_total",
                &["result=\"error\""],
            )?,
            apiserver,
            apiserver_rule_status,
            operator: crate::procs::usage(pid)?,
            forwarded,
        })
    }
}

/// The steady window's figures (the caller fills in the creation phase).
fn steady(
    cp: &ControlPlane,
    port: u16,
    pid: u32,
    pods: &[Pod],
    (rules, groups): (usize, usize),
    window: Duration,
) -> Result<OperatorFigures> {
    let warm = Instant::now();
    // The first report of each rule is a condition change (Forwarding True), written at once;
    // Ready follows within a reconcile of the connection.
    wait_until(
        "every rule Forwarding and Ready",
        Duration::from_secs(600),
        rules_poll(rules),
        || Ok(rules_with(cp, "Forwarding")? >= rules && rules_with(cp, "Ready")? >= rules),
    )?;
    let warmup_seconds = warm.elapsed().as_secs_f64();
    std::thread::sleep(SETTLE);
    let s0 = Sample::take(cp, port, pid, pods)?;
    std::thread::sleep(window);
    let s1 = Sample::take(cp, port, pid, pods)?;
    let seconds = s1.at.duration_since(s0.at).as_secs_f64();
    Ok(OperatorFigures {
        rules,
        groups,
        forwarders: pods.len(),
        status_interval_seconds: STATUS_INTERVAL_SECONDS,
        write_interval_seconds: WRITE_INTERVAL_SECONDS,
        writes_per_second: WRITES_PER_SECOND,
        traffic_msgs_per_sec: rules as f64 / TRAFFIC_PERIOD_SECONDS as f64,
        warmup_seconds,
        steady_seconds: seconds,
        steady_reconciles: s1.reconciles - s0.reconciles,
        steady_status_writes: s1.rule_writes - s0.rule_writes,
        steady_poll_errors: s1.poll_errors - s0.poll_errors,
        apiserver_requests: s1.apiserver - s0.apiserver,
        apiserver_rule_status_requests: s1.apiserver_rule_status - s0.apiserver_rule_status,
        operator_cpu_seconds: s1.operator.cpu_seconds - s0.operator.cpu_seconds,
        messages_forwarded: s1.forwarded - s0.forwarded,
        rules_forwarding_after: rules_with(cp, "Forwarding")?,
        peak_rss_mib: s1.operator.peak_rss_mib,
        rss_window_start_mib: s0.operator.rss_mib,
        rss_end_mib: s1.operator.rss_mib,
        ..OperatorFigures::default()
    })
}

/// The same steady state under an operator started with `--status-write-interval-seconds 0`
/// and `--status-writes-per-second 0`: every rule whose counters moved is written at every
/// poll.
fn without_budget(
    cp: &ControlPlane,
    bin: &Path,
    pods: &[Pod],
    window: Duration,
) -> Result<NoBudget> {
    println!("operator: again without the write budget (interval 0), {window:?}");
    let (operator, port) = start_operator(cp, bin, (0, 0.0), "operator-no-budget")?;
    let pid = operator.0.id();
    // Its start: a reconcile of every object and the first polls.
    std::thread::sleep(SETTLE + Duration::from_secs(STATUS_INTERVAL_SECONDS));
    let s0 = Sample::take(cp, port, pid, pods)?;
    std::thread::sleep(window);
    let s1 = Sample::take(cp, port, pid, pods)?;
    Ok(NoBudget {
        seconds: s1.at.duration_since(s0.at).as_secs_f64(),
        status_writes: s1.rule_writes - s0.rule_writes,
        reconciles: s1.reconciles - s0.reconciles,
        apiserver_requests: s1.apiserver - s0.apiserver,
        apiserver_rule_status_requests: s1.apiserver_rule_status - s0.apiserver_rule_status,
        operator_cpu_seconds: s1.operator.cpu_seconds - s0.operator.cpu_seconds,
        peak_rss_mib: s1.operator.peak_rss_mib,
    })
}

/// Brokers, control plane, operator, `rules` rules in groups of [`RULES_PER_GROUP`]; one
/// forwarder per group; steady traffic on every rule; `window` of measurement.
pub fn measure(
    operator_bin: &Path,
    forwarder_bin: &Path,
    rules: usize,
    window: Duration,
) -> Result<OperatorFigures> {
    let groups = rules.div_ceil(RULES_PER_GROUP).max(1);
    // The brokers first: the connection points at them from its creation, so the rendered
    // configs are the ones the forwarders run. Kafka does not create topics by itself here.
    let mqtt = Mosquitto::start()?;
    let kafka = Kafka::start_with(KafkaOptions {
        peak_throughput: true,
        ..KafkaOptions::default()
    })?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    for g in 0..groups {
        rt.block_on(kafka.create_topic(&kafka_topic(g), 1))?;
    }
    let cp = ControlPlane::start().context("control plane (run e2e/k8s/build.sh once)")?;
    cp.install_crds(
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/")),
        &["forwardingrules.ferry.dev", "brokerconnections.ferry.dev"],
    )?;
    cp.run_kubectl(["create", "namespace", NS])?;
    let budget = (WRITE_INTERVAL_SECONDS, WRITES_PER_SECOND);
    let (operator, port) = start_operator(&cp, operator_bin, budget, "operator")?;
    let (apply_seconds, all_accepted_seconds) =
        create_rules(&cp, (rules, groups), mqtt.port(), &kafka.bootstrap())?;
    // Where the peak comes from: the rules alone, or the data-plane status on top.
    let accepted_usage = crate::procs::usage(operator.0.id())?;
    println!(
        "operator: {rules} rules Accepted and rendered {all_accepted_seconds:.1} s after the first create (peak RSS {:.1} MiB); starting {groups} forwarders",
        accepted_usage.peak_rss_mib
    );
    let pods = run_pods(&cp, forwarder_bin, groups)?;
    let stop = Arc::new(AtomicBool::new(false));
    let rate = (rules as u64 / TRAFFIC_PERIOD_SECONDS).max(1);
    let traffic = rt.spawn(crate::load::publish_until(
        mqtt.port(),
        "plant",
        rate,
        100,
        rules as u64,
        stop.clone(),
    ));
    println!(
        "operator: {rate} msg/s over {rules} MQTT topics (one per rule); measuring {window:?} of steady state"
    );
    let measured =
        steady(&cp, port, operator.0.id(), &pods, (rules, groups), window).and_then(|mut f| {
            // One operator writes at a time, as with leader election.
            drop(operator);
            f.no_budget = Some(without_budget(&cp, operator_bin, &pods, window / 2)?);
            Ok(f)
        });
    stop.store(true, Ordering::Relaxed);
    let sent = rt.block_on(traffic)??;
    let mut figures = measured?;
    figures.apply_seconds = apply_seconds;
    figures.all_accepted_seconds = all_accepted_seconds;
    figures.after_last_create_seconds = all_accepted_seconds - apply_seconds;
    figures.messages_published = sent;
    figures.peak_rss_accepted_mib = accepted_usage.peak_rss_mib;
    Ok(figures)
}
