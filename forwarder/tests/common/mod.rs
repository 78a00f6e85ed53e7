//! Runs the real `ferry-forwarder` binary against the e2e brokers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ferry_e2e::{Kafka, Mosquitto, Record, free_port};

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
        format!(
            "mqtt:\n  host: 127.0.0.1\n  port: {}\n  client_id: {client_id}\n  max_inflight: 1000\n  reconnect_max_ms: 1000\n\
             kafka:\n  bootstrap_servers: {}\n\
             shutdown_timeout_secs: 20\n\
             rules:\n{rules}",
            self.mqtt.port(),
            self.kafka.bootstrap()
        )
    }
}

pub struct Forwarder {
    child: Option<Child>,
    pub http_port: u16,
    dir: tempfile::TempDir,
    config: PathBuf,
    runs: usize,
}

impl Forwarder {
    pub fn bin() -> &'static str {
        env!("CARGO_BIN_EXE_ferry-forwarder")
    }

    pub fn start(config: &str) -> Forwarder {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config.yaml");
        fs::write(&path, config).expect("write config");
        let mut f = Forwarder {
            child: None,
            http_port: free_port().expect("port"),
            dir,
            config: path,
            runs: 0,
        };
        f.restart();
        f
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
            .env("RUST_LOG", "info")
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
            if http_get(self.http_port, "/readyz").is_some_and(|(status, _)| status == 200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("forwarder not ready after {timeout:?}:\n{}", self.log());
    }

    pub fn ready_status(&self) -> Option<u16> {
        http_get(self.http_port, "/readyz").map(|(s, _)| s)
    }

    /// Sum of every sample of a metric family (e.g. `ferry_rule_forwarded_messages_total`).
    pub fn metric(&self, name: &str) -> f64 {
        let Some((_, body)) = http_get(self.http_port, "/metrics") else {
            return 0.0;
        };
        body.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
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
