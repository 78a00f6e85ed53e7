//! Runs the real `ferry-forwarder` binary against the e2e brokers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ferry_e2e::{Kafka, KafkaCluster, Mosquitto, Record, free_port};

/// The forwarder's window in [`config`]: `mqtt.max_inflight`.
pub const WINDOW: usize = 1000;

pub struct Brokers {
    pub mqtt: Mosquitto,
    pub kafka: Kafka,
}

impl Brokers {
    pub fn start() -> Brokers {
        let mqtt = Mosquitto::start().expect("start mosquitto");
        let kafka = Kafka::start().expect("start kafka");
        eprintln!(
            "brokers: mosquitto 127.0.0.1:{} (max_inflight_messages={}, max_queued_messages={}), kafka {}",
            mqtt.port(),
            ferry_e2e::MOSQUITTO_MAX_INFLIGHT,
            ferry_e2e::MOSQUITTO_MAX_QUEUED,
            kafka.bootstrap()
        );
        Brokers { mqtt, kafka }
    }

    /// A Ferry-format config for these brokers; `rules` is the YAML list under `rules:`.
    pub fn config(&self, client_id: &str, rules: &str) -> String {
        config(&self.mqtt, &self.kafka.bootstrap(), client_id, rules)
    }

    /// Up to `n` records of `topic`: waits `timeout` at most, then `settle` of quiet.
    pub fn read(&self, topic: &str, n: usize, settle: Duration, timeout: Duration) -> Vec<Record> {
        self.kafka
            .read_all(topic, n, settle, timeout)
            .unwrap_or_else(|e| panic!("read {topic}: {e}"))
    }

    /// Publishes `msgs` at QoS 1 as `client`, then waits (at most `timeout`) until `fwd` has
    /// acknowledged `acked` messages in all.
    pub fn publish_acked(
        &self,
        fwd: &Forwarder,
        client: &str,
        msgs: Vec<(String, Vec<u8>)>,
        acked: usize,
        timeout: Duration,
    ) {
        runtime()
            .block_on(ferry_e2e::publish(
                self.mqtt.port(),
                client,
                rumqttc::QoS::AtLeastOnce,
                msgs,
            ))
            .expect("publish");
        wait_until(fwd, timeout, "every message acked", || {
            fwd.metric("ferry_mqtt_acked_messages_total") >= acked as f64
        });
    }
}

/// A Ferry-format config for `mqtt` and the Kafka at `bootstrap` (one broker or a cluster);
/// `rules` is the YAML list under `rules:`.
pub fn config(mqtt: &Mosquitto, bootstrap: &str, client_id: &str, rules: &str) -> String {
    format!(
        "mqtt:\n  host: 127.0.0.1\n  port: {}\n  client_id: {client_id}\n  max_inflight: {WINDOW}\n  reconnect_max_ms: 1000\n\
         kafka:\n  bootstrap_servers: {bootstrap}\n\
         shutdown_timeout_secs: 20\n\
         rules:\n{rules}",
        mqtt.port(),
    )
}

pub struct Forwarder {
    child: Option<Child>,
    pub http_port: u16,
    dir: tempfile::TempDir,
    config: PathBuf,
    runs: usize,
    env: Vec<(String, String)>,
}

impl Forwarder {
    pub fn bin() -> &'static str {
        env!("CARGO_BIN_EXE_ferry-forwarder")
    }

    pub fn start(config: &str) -> Forwarder {
        Self::start_with(config, &[])
    }

    /// Starts with extra environment variables (e.g. `FERRY_LOG`).
    pub fn start_with(config: &str, env: &[(&str, &str)]) -> Forwarder {
        let mut f = Self::prepare(env);
        fs::write(&f.config, config).expect("write config");
        f.restart();
        f
    }

    /// Starts with the config laid out as Kubernetes mounts a ConfigMap: `config.yaml` is a
    /// symlink into `..data`, itself a symlink to a timestamped directory. `swap_config`
    /// replaces it the way the kubelet does.
    pub fn start_configmap(config: &str) -> Forwarder {
        let mut f = Self::prepare(&[]);
        let mount = f.dir.path().join("mount");
        fs::create_dir(&mount).expect("mount dir");
        f.config = mount.join("config.yaml");
        f.swap_config(config);
        std::os::unix::fs::symlink("..data/config.yaml", &f.config).expect("symlink");
        f.restart();
        f
    }

    /// Atomically replaces the ConfigMap-style config (see `start_configmap`).
    pub fn swap_config(&mut self, config: &str) {
        let mount = self.dir.path().join("mount");
        // A name not used yet, as the kubelet's timestamped ones.
        let mut n = self.swaps();
        while mount.join(format!("..{n}")).exists() {
            n += 1;
        }
        let version = format!("..{n}");
        let versioned = mount.join(&version);
        fs::create_dir(&versioned).expect("version dir");
        fs::write(versioned.join("config.yaml"), config).expect("write config");
        let tmp = mount.join("..data_tmp");
        let _ = fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&version, &tmp).expect("symlink");
        fs::rename(&tmp, mount.join("..data")).expect("swap ..data");
    }

    fn swaps(&self) -> usize {
        fs::read_dir(self.dir.path().join("mount"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    fn prepare(env: &[(&str, &str)]) -> Forwarder {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("config.yaml");
        Forwarder {
            child: None,
            http_port: free_port().expect("port"),
            dir,
            config,
            runs: 0,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    /// The forwarder's `/status`.
    pub fn status(&self) -> Option<ferry_api::status::ForwarderStatus> {
        let (code, body) = http_get(self.http_port, ferry_api::status::STATUS_PATH).ok()?;
        assert_eq!(code, 200, "/status: {body}");
        Some(serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status {e}: {body}")))
    }

    /// Starts the binary again with the same config (after a kill or exit).
    pub fn restart(&mut self) {
        self.runs += 1;
        let log = fs::File::create(self.dir.path().join(format!("forwarder-{}.log", self.runs)))
            .expect("log");
        let child = Command::new(Self::bin())
            .arg("--config")
            .arg(&self.config)
            .env("FERRY_HTTP_LISTEN", format!("127.0.0.1:{}", self.http_port))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn ferry-forwarder");
        self.child = Some(child);
    }

    pub fn log(&self) -> String {
        (1..=self.runs)
            .map(|i| {
                fs::read_to_string(self.dir.path().join(format!("forwarder-{i}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n--- restart ---\n")
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Waits until `/readyz` answers 200 (subscribed to MQTT, Kafka reachable).
    pub fn wait_ready(&mut self, timeout: Duration) {
        let start = Instant::now();
        while start.elapsed() < timeout {
            assert!(
                self.running(),
                "forwarder exited while starting:\n{}",
                self.log()
            );
            if http_get(self.http_port, "/readyz").is_ok_and(|(status, _)| status == 200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("forwarder not ready after {timeout:?}:\n{}", self.log());
    }

    pub fn ready_status(&self) -> Option<u16> {
        http_get(self.http_port, "/readyz").ok().map(|(s, _)| s)
    }

    /// Sum of every sample of a metric family (e.g. `ferry_rule_forwarded_messages_total`).
    /// Fails the test when the forwarder does not answer: a check must not pass on nothing.
    pub fn metric(&self, name: &str) -> f64 {
        match http_get(self.http_port, "/metrics") {
            Ok((_, body)) => ferry_e2e::metrics::sum(&body, name, &[]),
            Err(e) => panic!("{e:#}; forwarder log:\n{}", self.log()),
        }
    }

    /// The sum of `name`'s samples whose labels include every one of `labels`
    /// (`rule="a"`); fails if the metric is not exposed at all.
    pub fn metric_with(&self, name: &str, labels: &[&str]) -> f64 {
        match http_get(self.http_port, "/metrics") {
            Ok((_, body)) => {
                assert!(body.contains(name), "{name} is not exposed:\n{body}");
                ferry_e2e::metrics::sum(&body, name, labels)
            }
            Err(e) => panic!("{e:#}; forwarder log:\n{}", self.log()),
        }
    }

    pub fn signal(&mut self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// SIGKILLs the forwarder mid-stream, as a crash, and returns what the crash may replay
    /// at most: its `window` (messages taken and not acknowledged) plus the acks it had written
    /// that the broker had not read yet, which the connection's reset discards. Those are
    /// counted from the kernel's socket queues while the forwarder is stopped (SIGSTOP): its
    /// send queue and the broker's receive queue on its MQTT connection, a PUBACK being at
    /// least 4 bytes. Panics if the connection cannot be found.
    pub fn crash(&mut self, mqtt_port: u16, window: usize) -> usize {
        self.signal(libc::SIGSTOP);
        let pid = self
            .child
            .as_ref()
            .map(|c| c.id())
            .expect("running forwarder");
        let unread = unread_ack_bytes(pid, mqtt_port)
            .unwrap_or_else(|e| panic!("the forwarder's MQTT connection: {e}\n{}", self.log()));
        self.signal(libc::SIGKILL);
        let status = self.wait_exit(Duration::from_secs(5)).expect("killed");
        eprintln!("forwarder crashed ({status}) with {unread} bytes of acks unread by the broker");
        window + unread.div_ceil(4)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("forwarder log:\n{}", self.log());
        }
    }
}

pub use ferry_e2e::http_get;

/// Messages `"<topic index>:<seq>"` on `topics` topics `sensors/<i>/data`, round-robin.
pub fn numbered_messages(topics: usize, total: usize) -> Vec<(String, Vec<u8>)> {
    (0..total)
        .map(|n| {
            let t = n % topics;
            let seq = n / topics;
            (
                format!("sensors/{t}/data"),
                format!("{t}:{seq}").into_bytes(),
            )
        })
        .collect()
}

/// What arrived in Kafka, judged against what was published.
#[derive(Debug)]
pub struct Delivery {
    pub records: usize,
    pub distinct: usize,
    pub missing: usize,
    pub duplicates: usize,
    /// Records whose sequence went backwards within their MQTT topic, other than the replay of
    /// already-seen messages after a redelivery.
    pub out_of_order: usize,
}

/// Checks records of numbered messages: per MQTT topic (the key), read in partition order.
pub fn judge(records: &[Record], total: usize) -> Delivery {
    let mut seen = std::collections::BTreeSet::new();
    let mut by_topic: BTreeMap<String, Vec<(i32, i64, u64)>> = BTreeMap::new();
    for r in records {
        let (t, seq) = r.value_str().split_once(':').expect("numbered payload");
        let (t, seq): (usize, u64) = (t.parse().expect("topic index"), seq.parse().expect("seq"));
        assert_eq!(
            r.key_str(),
            Some(format!("sensors/{t}/data").as_str()),
            "key is the MQTT topic"
        );
        seen.insert((t, seq));
        by_topic
            .entry(format!("sensors/{t}/data"))
            .or_default()
            .push((r.partition, r.offset, seq));
    }
    let mut out_of_order = 0;
    for recs in by_topic.values_mut() {
        recs.sort();
        // The highest sequence seen so far; a lower one is either a replayed duplicate (fine,
        // at-least-once) or a message that overtook an earlier one (a reorder).
        let mut max_seen: Option<u64> = None;
        let mut seen_here = std::collections::BTreeSet::new();
        for &(_, _, seq) in recs.iter() {
            if let Some(m) = max_seen
                && seq < m
                && !seen_here.contains(&seq)
            {
                out_of_order += 1;
            }
            seen_here.insert(seq);
            max_seen = Some(max_seen.map_or(seq, |m| m.max(seq)));
        }
    }
    Delivery {
        records: records.len(),
        distinct: seen.len(),
        missing: total - seen.len().min(total),
        duplicates: records.len() - seen.len(),
        out_of_order,
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Where records are read back from: one broker or a cluster.
pub trait ReadAll {
    /// Reads `topic` from the beginning until `expect` records arrived and then `settle` passed
    /// with nothing new, or `timeout` passed.
    fn read_all(
        &self,
        topic: &str,
        expect: usize,
        settle: Duration,
        timeout: Duration,
    ) -> anyhow::Result<Vec<Record>>;
}

impl ReadAll for Kafka {
    fn read_all(
        &self,
        topic: &str,
        expect: usize,
        settle: Duration,
        timeout: Duration,
    ) -> anyhow::Result<Vec<Record>> {
        Kafka::read_all(self, topic, expect, settle, timeout)
    }
}

impl ReadAll for KafkaCluster {
    fn read_all(
        &self,
        topic: &str,
        expect: usize,
        settle: Duration,
        timeout: Duration,
    ) -> anyhow::Result<Vec<Record>> {
        KafkaCluster::read_all(self, topic, expect, settle, timeout)
    }
}

/// Reads the numbered messages back from `topic` (waiting for `total`, then 3 s more for late
/// duplicates) and judges them.
pub fn read_judged(kafka: &impl ReadAll, topic: &str, total: usize, timeout: Duration) -> Delivery {
    let records = kafka
        .read_all(topic, total, Duration::from_secs(3), timeout)
        .expect("read");
    judge(&records, total)
}

/// Waits until `cond` holds, looking every 50 ms (the forwarder's states can be brief), or
/// panics with `what` and the forwarder's log.
pub fn wait_until(fwd: &Forwarder, timeout: Duration, what: &str, cond: impl FnMut() -> bool) {
    ferry_e2e::wait_until(what, timeout, Duration::from_millis(50), cond)
        .unwrap_or_else(|e| panic!("{e}:\n{}", fwd.log()));
}

/// An MQTT 5 message: topic, payload, content type, user properties.
pub type V5Message = (String, Vec<u8>, Option<String>, Vec<(String, String)>);

/// Publishes with MQTT 5 at QoS 1 and waits for every PUBACK.
pub async fn publish_v5(port: u16, client_id: &str, messages: Vec<V5Message>) {
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};
    let mut opts = MqttOptions::new(client_id, "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30));
    let (client, mut eventloop) = AsyncClient::new(opts, 100);
    let total = messages.len();
    let sender = tokio::spawn(async move {
        for (topic, payload, content_type, user_properties) in messages {
            let props = PublishProperties {
                content_type,
                user_properties,
                ..Default::default()
            };
            client
                .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, props)
                .await
                .expect("publish");
        }
        client
    });
    let mut acked = 0;
    while acked < total {
        match tokio::time::timeout(Duration::from_secs(30), eventloop.poll()).await {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) => {}
            other => panic!("mqtt 5 publisher failed after {acked}/{total}: {other:?}"),
        }
    }
    let client = sender.await.expect("sender");
    let _ = client.disconnect().await;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while eventloop.poll().await.is_ok() {}
    })
    .await;
}

/// Creates a one-partition topic whose `max.message.bytes` is `max_bytes`.
pub async fn create_topic_with_limit(bootstrap: &str, name: &str, max_bytes: usize) {
    let limit = max_bytes.to_string();
    create_topic_with_config(bootstrap, name, &[("max.message.bytes", &limit)]).await;
}

/// Creates a one-partition topic with `config` (topic-level settings).
pub async fn create_topic_with_config(bootstrap: &str, name: &str, config: &[(&str, &str)]) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin");
    let topic = config.iter().fold(
        NewTopic::new(name, 1, TopicReplication::Fixed(1)),
        |t, (k, v)| t.set(k, v),
    );
    for r in admin
        .create_topics([&topic], &AdminOptions::new())
        .await
        .expect("create")
    {
        r.expect("topic created");
    }
}

/// Sets `key` to `value` in `topic`'s config at the broker.
pub async fn alter_topic_config(bootstrap: &str, topic: &str, key: &str, value: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin");
    let config = AlterConfig::new(ResourceSpecifier::Topic(topic)).set(key, value);
    for r in admin
        .alter_configs([&config], &AdminOptions::new())
        .await
        .expect("alter configs")
    {
        r.unwrap_or_else(|e| panic!("{topic}: {key} not set: {e:?}"));
    }
}

/// Publishes numbered messages ([`numbered_messages`]) at QoS 1 in slices, one after the other,
/// until stopped: steady traffic whose every counted message the broker acknowledged.
pub struct SteadyPublisher {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl SteadyPublisher {
    /// Up to `cap` messages over 10 topics, `slice` at a time with `pause` between slices.
    pub fn start(port: u16, client: &str, cap: usize, slice: usize, pause: Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let client = client.to_owned();
        let thread = std::thread::spawn(move || {
            let rt = runtime();
            let all = numbered_messages(10, cap);
            let mut acked = 0;
            for (i, chunk) in all.chunks(slice).enumerate() {
                if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                rt.block_on(ferry_e2e::publish(
                    port,
                    format!("{client}-{i}"),
                    ferry_e2e::rumqttc::QoS::AtLeastOnce,
                    chunk.to_vec(),
                ))
                .unwrap_or_else(|e| panic!("publish slice {i}: {e}"));
                acked += chunk.len();
                std::thread::sleep(pause);
            }
            acked
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops after the slice being published; how many messages the broker acknowledged.
    pub fn stop(mut self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .map(|t| t.join().expect("publisher thread"))
            .unwrap_or(0)
    }
}

/// Ends the session of `client_id` as the operator does for a pod gone for good: connects with
/// a clean start, which makes the broker discard the session and what it holds, and
/// disconnects.
pub fn end_session(port: u16, client_id: &str) {
    use ferry_e2e::rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet};
    runtime().block_on(async {
        let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
        options.set_clean_session(true);
        let (client, mut events) = AsyncClient::new(options, 4);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            assert!(
                Instant::now() < deadline,
                "ending session {client_id} timed out"
            );
            match tokio::time::timeout(Duration::from_secs(10), events.poll()).await {
                Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                    client.disconnect().await.expect("disconnect");
                }
                Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) => return,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("ending session {client_id}: {e}"),
                Err(_) => panic!("ending session {client_id}: no answer"),
            }
        }
    });
}

/// Bytes written on `pid`'s connection to 127.0.0.1:`port` that the peer has not read:
/// `pid`'s send queue plus the peer's receive queue, from `/proc/net/tcp`.
fn unread_ack_bytes(pid: u32, port: u16) -> Result<usize, String> {
    let inodes: Vec<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(|e| format!("/proc/{pid}/fd: {e}"))?
        .filter_map(|fd| fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let table = fs::read_to_string("/proc/net/tcp").map_err(|e| format!("/proc/net/tcp: {e}"))?;
    // sl local rem st tx_queue:rx_queue tr tm->when retrnsmt uid timeout inode
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .filter(|r: &Vec<&str>| r.len() > 9)
        .collect();
    let port_of = |addr: &str| {
        addr.rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
    };
    let queues = |row: &Vec<&str>| -> Result<(usize, usize), String> {
        let (tx, rx) = row[4].split_once(':').ok_or("queues")?;
        let hex = |q| usize::from_str_radix(q, 16).map_err(|e| format!("{q}: {e}"));
        Ok((hex(tx)?, hex(rx)?))
    };
    let ours = rows
        .iter()
        .find(|r| port_of(r[2]) == Some(port) && inodes.iter().any(|i| i == r[9]))
        .ok_or_else(|| format!("no socket of pid {pid} connected to port {port}"))?;
    let local = port_of(ours[1]).ok_or("local port")?;
    let peer = rows
        .iter()
        .find(|r| port_of(r[1]) == Some(port) && port_of(r[2]) == Some(local))
        .ok_or_else(|| format!("no broker socket for port {local}"))?;
    Ok(queues(ours)?.0 + queues(peer)?.1)
}
