//! `make soak`: a long QoS 1 stream over 100 MQTT topics through one release forwarder while a
//! fault hits every few seconds, each kind in turn, on real processes: a 3-node Kafka cluster
//! (replication 3, `min.insync.replicas` 2) reached through fault proxies, Mosquitto with
//! persistence behind a fault proxy of its own. Per fault it reports what was lost, replayed
//! and reordered, and how long until the forwarder had caught up; results go to
//! `bench/results/soak.md` and `soak.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use ferry_e2e::{ClusterOptions, FaultProxy, KafkaCluster, Mosquitto, MosquittoOptions, ProxyMode};
use serde::Serialize;

use crate::load::{self, now_ns};
use crate::procs::Forwarder;

const TOPIC: &str = "soak";
const PARTITIONS: i32 = 6;
const MQTT_TOPICS: u64 = 100;
const SIZE: usize = 200;
/// The forwarder's keep-alive: short, so an MQTT partition outlasts it and ends the session's
/// connection (the broker drops a client silent for 1.5 × keep-alive).
const KEEP_ALIVE_SECS: u64 = 5;
/// A first arrival slower than this (publish → produced) means the forwarder is still
/// catching up on a fault; steady state is far below it.
const CAUGHT_UP_MS: u64 = 1_000;

#[derive(Debug, Clone)]
pub struct SoakArgs {
    pub messages: u64,
    pub rate: u64,
    pub every: Duration,
    pub window: u32,
}

/// The faults, applied in this order, round and round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Fault {
    /// Every Kafka node's proxy holds all bytes for 10 s (no reset).
    KafkaPartition,
    /// The forwarder SIGKILLed and started again at once.
    ForwarderKill,
    /// The forwarder's MQTT proxy holds all bytes for 15 s: 3 × keep-alive, so the broker
    /// drops the connection and the forwarder reconnects once it heals.
    MqttPartition,
    /// Mosquitto stopped (SIGTERM, persistence on) and started again.
    MosquittoRestart,
    /// The leader of a partition SIGKILLed; started again 10 s later.
    LeaderKill,
}

const CYCLE: [Fault; 5] = [
    Fault::KafkaPartition,
    Fault::ForwarderKill,
    Fault::MqttPartition,
    Fault::MosquittoRestart,
    Fault::LeaderKill,
];

/// One fault as it happened: when (ns since the epoch), and how far publishing had got.
#[derive(Debug, Clone, Serialize)]
pub struct Applied {
    pub fault: Fault,
    pub started_ns: u64,
    pub healed_ns: u64,
    /// Messages published (acknowledged by the broker) when it started.
    pub published_before: u64,
}

/// One record read back: its message's sequence number and publish time, and when the
/// forwarder produced it (the record's CreateTime, set by librdkafka at produce).
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub seq: u64,
    pub sent_ns: u64,
    pub produced_ms: i64,
    pub partition: i32,
    pub offset: i64,
}

/// What one fault cost, judged from every record in Kafka.
#[derive(Debug, Clone, Serialize)]
pub struct FaultFigures {
    pub fault: Fault,
    pub at_s: f64,
    pub lasted_s: f64,
    /// Messages published during its interval (until the next fault) that never arrived.
    pub lost: u64,
    /// Extra copies produced during its interval: the broker's redelivery after it.
    pub replayed: u64,
    /// First arrivals behind a later message of the same MQTT topic.
    pub out_of_order: u64,
    /// From the fault's start until the last first arrival slower than [`CAUGHT_UP_MS`]
    /// in its interval (0 if none was).
    pub caught_up_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub machine: String,
    pub messages: u64,
    pub rate: u64,
    pub every_s: u64,
    pub window: u32,
    pub duration_s: f64,
    pub records: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
    pub mqtt_connections: usize,
    pub steady_p99_ms: f64,
    pub faults: Vec<FaultFigures>,
}

/// Judges what arrived against what was published, fault by fault. Each fault owns the
/// interval from its start to the next one's: a replay is counted where its copy was produced,
/// a lost message where it was published, a reordering where the late record was produced.
pub fn judge(published: u64, faults: &[Applied], arrivals: &[Arrival]) -> Vec<FaultFigures> {
    let owner_by_time = |ns: u64| faults.iter().rposition(|f| f.started_ns <= ns);
    let owner_by_seq = |seq: u64| faults.iter().rposition(|f| f.published_before <= seq);
    let mut figures: Vec<FaultFigures> = faults
        .iter()
        .map(|f| FaultFigures {
            fault: f.fault,
            at_s: f.started_ns.saturating_sub(faults[0].started_ns) as f64 / 1e9,
            lasted_s: f.healed_ns.saturating_sub(f.started_ns) as f64 / 1e9,
            lost: 0,
            replayed: 0,
            out_of_order: 0,
            caught_up_s: 0.0,
        })
        .collect();
    let produced_ns = |a: &Arrival| u64::try_from(a.produced_ms).unwrap_or(0) * 1_000_000;
    // The earliest-produced copy of each message is the original; the others are replays.
    let mut by_time: Vec<&Arrival> = arrivals.iter().collect();
    by_time.sort_by_key(|a| (a.produced_ms, a.partition, a.offset));
    let mut first: HashMap<u64, &Arrival> = HashMap::new();
    for a in by_time {
        match first.entry(a.seq) {
            std::collections::hash_map::Entry::Occupied(_) => {
                if let Some(i) = owner_by_time(produced_ns(a)) {
                    figures[i].replayed += 1;
                }
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(a);
            }
        }
    }
    for seq in (0..published).filter(|s| !first.contains_key(s)) {
        if let Some(i) = owner_by_seq(seq) {
            figures[i].lost += 1;
        }
    }
    // Per MQTT topic, first arrivals in log order must have rising sequence numbers.
    let mut in_log: Vec<&Arrival> = first.values().copied().collect();
    in_log.sort_by_key(|a| (a.partition, a.offset));
    let mut last_per_topic: HashMap<u64, u64> = HashMap::new();
    for a in in_log {
        let last = last_per_topic.entry(a.seq % MQTT_TOPICS).or_insert(a.seq);
        if a.seq < *last
            && let Some(i) = owner_by_time(produced_ns(a))
        {
            figures[i].out_of_order += 1;
        }
        *last = (*last).max(a.seq);
    }
    for a in first.values() {
        let produced = produced_ns(a);
        let slow = produced.saturating_sub(a.sent_ns) > CAUGHT_UP_MS * 1_000_000;
        if let (true, Some(i)) = (slow, owner_by_time(produced)) {
            let after = produced.saturating_sub(faults[i].started_ns) as f64 / 1e9;
            figures[i].caught_up_s = figures[i].caught_up_s.max(after);
        }
    }
    figures
}

/// The processes under test and the faults' levers.
struct Rig {
    cluster: KafkaCluster,
    mqtt: Mosquitto,
    mqtt_proxy: FaultProxy,
    forwarder: Forwarder,
    forwarder_bin: PathBuf,
    config: String,
    dir: tempfile::TempDir,
    starts: u32,
}

impl Rig {
    fn start(forwarder_bin: &Path, window: u32) -> Result<Self> {
        let cluster = KafkaCluster::start_with(3, ClusterOptions { proxies: true })?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(cluster.create_topic(TOPIC, PARTITIONS))?;
        cluster.wait_for_full_isr(TOPIC, Duration::from_secs(60))?;
        let mqtt = Mosquitto::start_with(MosquittoOptions {
            persistence: true,
            log_connections: true,
            max_inflight_messages: Some(window),
            ..MosquittoOptions::default()
        })?;
        let mqtt_proxy = FaultProxy::start(std::net::SocketAddr::from((
            std::net::Ipv4Addr::LOCALHOST,
            mqtt.port(),
        )))?;
        let config = format!(
            "mqtt:\n  host: 127.0.0.1\n  port: {port}\n  client_id: ferry-soak\n  clean_session: false\n  \
             keep_alive_secs: {KEEP_ALIVE_SECS}\n  max_inflight: {window}\n\
             kafka:\n  bootstrap_servers: \"{bootstrap}\"\n\
             rules:\n  - name: soak\n    mqtt:\n      topics: [\"soak/#\"]\n      qos: 1\n    kafka:\n      topic: {TOPIC}\n\
             log:\n  level: warn\n",
            port = mqtt_proxy.port(),
            bootstrap = cluster.proxied_bootstrap()?,
        );
        let dir = tempfile::Builder::new().prefix("ferry-soak-").tempdir()?;
        let mut forwarder = Forwarder::start(forwarder_bin, dir.path(), "forwarder-0", &config)?;
        forwarder.wait_ready(Duration::from_secs(60))?;
        Ok(Self {
            cluster,
            mqtt,
            mqtt_proxy,
            forwarder,
            forwarder_bin: forwarder_bin.to_owned(),
            config,
            dir,
            starts: 1,
        })
    }

    /// Applies `fault` and returns once it is healed.
    fn apply(&mut self, fault: Fault, publisher: &Publisher) -> Result<()> {
        match fault {
            Fault::KafkaPartition => {
                let nodes = self.cluster.node_ids();
                self.set_kafka_proxies(&nodes, ProxyMode::Blackhole)?;
                std::thread::sleep(Duration::from_secs(10));
                self.set_kafka_proxies(&nodes, ProxyMode::Pass)?;
            }
            Fault::ForwarderKill => {
                self.forwarder.kill()?;
                let name = format!("forwarder-{}", self.starts);
                self.starts += 1;
                self.forwarder =
                    Forwarder::start(&self.forwarder_bin, self.dir.path(), &name, &self.config)?;
            }
            Fault::MqttPartition => {
                self.mqtt_proxy.set_mode(ProxyMode::Blackhole);
                std::thread::sleep(Duration::from_secs(3 * KEEP_ALIVE_SECS));
                self.mqtt_proxy.set_mode(ProxyMode::Pass);
            }
            Fault::MosquittoRestart => {
                // The publisher pauses: what is under test is the forwarder's session, not a
                // publisher losing its unacknowledged messages with the connection.
                publisher.pause()?;
                self.mqtt.stop();
                let resumed = self.mqtt.resume();
                publisher.resume();
                resumed?;
            }
            Fault::LeaderKill => {
                let leader = self.cluster.leader_of(TOPIC, 0)?;
                self.cluster.kill(leader)?;
                std::thread::sleep(Duration::from_secs(10));
                self.cluster.restart(leader)?;
            }
        }
        if !self.forwarder.running() {
            bail!("the forwarder exited after {fault:?}");
        }
        Ok(())
    }

    fn set_kafka_proxies(&self, nodes: &[i32], mode: ProxyMode) -> Result<()> {
        for &node in nodes {
            self.cluster.proxy(node)?.set_mode(mode);
        }
        Ok(())
    }

    fn mqtt_connections(&self) -> Result<usize> {
        let log = std::fs::read_to_string(self.mqtt.dir().join("mosquitto.log"))
            .context("mosquitto log")?;
        Ok(log
            .lines()
            .filter(|l| l.contains("New client connected") && l.contains(" as ferry-soak "))
            .count())
    }
}

/// Publishes `total` numbered messages at `rate` per second in batches, each batch on a
/// connection of its own and acknowledged by the broker before the next; can be paused
/// between batches.
struct Publisher {
    published: Arc<AtomicU64>,
    paused: Arc<AtomicBool>,
    idle: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Result<u64>>,
}

impl Publisher {
    fn start(port: u16, total: u64, rate: u64) -> Self {
        let published = Arc::new(AtomicU64::new(0));
        let paused = Arc::new(AtomicBool::new(false));
        let idle = Arc::new(AtomicBool::new(false));
        let (count, pause, idling) = (published.clone(), paused.clone(), idle.clone());
        let handle = std::thread::spawn(move || -> Result<u64> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            // Ten batches a second.
            let batch = (rate / 10).max(1);
            let start = Instant::now();
            let mut seq = 0u64;
            let mut batches = 0u64;
            while seq < total {
                while pause.load(Ordering::SeqCst) {
                    idling.store(true, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(10));
                }
                idling.store(false, Ordering::SeqCst);
                let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
                if seq >= due.min(total) {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                let end = (seq + batch).min(total);
                let messages = (seq..end)
                    .map(|s| {
                        (
                            load::topic_of("soak", s, MQTT_TOPICS),
                            load::payload(s, SIZE),
                        )
                    })
                    .collect();
                rt.block_on(ferry_e2e::publish(
                    port,
                    format!("soak-publisher-{batches}"),
                    rumqttc::QoS::AtLeastOnce,
                    messages,
                ))
                .with_context(|| format!("publishing messages {seq}..{end}"))?;
                batches += 1;
                seq = end;
                count.store(seq, Ordering::SeqCst);
            }
            Ok(seq)
        });
        Self {
            published,
            paused,
            idle,
            handle,
        }
    }

    fn published(&self) -> u64 {
        self.published.load(Ordering::SeqCst)
    }

    /// Returns once the publisher sits between batches (everything it sent acknowledged).
    fn pause(&self) -> Result<()> {
        self.paused.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while !self.idle.load(Ordering::SeqCst) {
            if self.handle.is_finished() {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("the publisher did not pause within 60 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    fn finished(&self) -> bool {
        self.handle.is_finished()
    }

    fn join(self) -> Result<u64> {
        self.handle
            .join()
            .map_err(|_| anyhow!("the publisher panicked"))?
    }
}

/// What arrived, read back from the beginning once the publisher is done: until every
/// published message's record is in and 5 s passed with nothing new.
fn read_arrivals(cluster: &KafkaCluster, published: u64) -> Result<Vec<Arrival>> {
    let records = cluster.read_all(
        TOPIC,
        usize::try_from(published)?,
        Duration::from_secs(5),
        Duration::from_secs(600),
    )?;
    records
        .iter()
        .map(|r| {
            let (seq, sent_ns) = load::decode(&r.value)
                .ok_or_else(|| anyhow!("a record without a bench header in {TOPIC}"))?;
            Ok(Arrival {
                seq,
                sent_ns,
                produced_ms: r.timestamp_ms.unwrap_or(0),
                partition: r.partition,
                offset: r.offset,
            })
        })
        .collect()
}

pub fn run(forwarder_bin: &Path, machine: String, args: &SoakArgs) -> Result<SoakReport> {
    println!(
        "== Soak: {} QoS 1 messages over {MQTT_TOPICS} topics at {}/s, a fault every {:?}: {CYCLE:?} in turn",
        args.messages, args.rate, args.every
    );
    let mut rig = Rig::start(forwarder_bin, args.window)?;
    let publisher = Publisher::start(rig.mqtt.port(), args.messages, args.rate);
    let started = Instant::now();
    let run_ns = now_ns();
    let mut applied: Vec<Applied> = Vec::new();
    for fault in CYCLE.iter().cycle() {
        let next = args.every * (applied.len() as u32 + 1);
        while started.elapsed() < next && !publisher.finished() {
            std::thread::sleep(Duration::from_millis(100));
        }
        if publisher.finished() {
            break;
        }
        let started_ns = now_ns();
        let at = started.elapsed();
        let published_before = publisher.published();
        rig.apply(*fault, &publisher)?;
        let done = Applied {
            fault: *fault,
            started_ns,
            healed_ns: now_ns(),
            published_before,
        };
        println!(
            "  {:>6.1} s  {:?} (healed after {:.1} s), {published_before} published",
            at.as_secs_f64(),
            fault,
            (done.healed_ns - started_ns) as f64 / 1e9
        );
        applied.push(done);
    }
    let published = publisher.join()?;
    let arrivals = read_arrivals(&rig.cluster, published)?;
    let duration_s = started.elapsed().as_secs_f64();
    if !rig.forwarder.running() {
        bail!("the forwarder exited at the end of the soak");
    }
    let faults = judge(published, &applied, &arrivals);
    let distinct: std::collections::HashSet<u64> = arrivals.iter().map(|a| a.seq).collect();
    let mut steady: Vec<f64> = arrivals
        .iter()
        .filter(|a| {
            // The second half before the first fault: past the start-up and the JVMs' warm-up.
            let first = applied
                .first()
                .map_or(run_ns + args.every.as_nanos() as u64, |f| f.started_ns);
            a.sent_ns < first && a.sent_ns >= first.saturating_sub(args.every.as_nanos() as u64 / 2)
        })
        .map(|a| {
            (u64::try_from(a.produced_ms).unwrap_or(0) * 1_000_000).saturating_sub(a.sent_ns) as f64
                / 1e6
        })
        .collect();
    steady.sort_by(f64::total_cmp);
    Ok(SoakReport {
        machine,
        messages: published,
        rate: args.rate,
        every_s: args.every.as_secs(),
        window: args.window,
        duration_s,
        records: arrivals.len() as u64,
        lost: published.saturating_sub(distinct.len() as u64),
        duplicates: (arrivals.len() - distinct.len()) as u64,
        out_of_order: faults.iter().map(|f| f.out_of_order).sum(),
        mqtt_connections: rig.mqtt_connections()?,
        steady_p99_ms: load::percentile(&steady, 99.0),
        faults,
    })
}

impl SoakReport {
    pub fn markdown(&self) -> String {
        let mut md = format!(
            "# Soak\n\nOn {}: {} QoS 1 messages of {SIZE} B over {MQTT_TOPICS} MQTT topics at {}/s, \
             one forwarder (window {}), a 3-node Kafka cluster (replication 3, min.insync.replicas 2, \
             {PARTITIONS} partitions) and Mosquitto with persistence, each behind a fault proxy; a fault \
             every {} s, in turn. Produced from `make soak`.\n\n\
             Total: {} records, **{} lost**, {} duplicates, {} out of order, {} MQTT connections \
             by the forwarder, {:.0} s. Steady-state p99 publish→produce latency before the first \
             fault: {:.0} ms.\n\n\
             | # | at (s) | fault | lasted (s) | lost | replayed | ≤ window | out of order | caught up after (s) |\n\
             |---|---|---|---|---|---|---|---|---|\n",
            self.machine,
            self.messages,
            self.rate,
            self.window,
            self.every_s,
            self.records,
            self.lost,
            self.duplicates,
            self.out_of_order,
            self.mqtt_connections,
            self.duration_s,
            self.steady_p99_ms,
        );
        for (i, f) in self.faults.iter().enumerate() {
            md.push_str(&format!(
                "| {} | {:.0} | {:?} | {:.1} | {} | {} | {} | {} | {:.1} |\n",
                i + 1,
                f.at_s,
                f.fault,
                f.lasted_s,
                f.lost,
                f.replayed,
                if f.replayed <= u64::from(self.window) {
                    "yes"
                } else {
                    "**no**"
                },
                f.out_of_order,
                f.caught_up_s,
            ));
        }
        md
    }
}

pub fn write(out: &Path, report: &SoakReport) -> Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("soak.md"), report.markdown())?;
    std::fs::write(out.join("soak.json"), serde_json::to_string_pretty(report)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn arrival(seq: u64, sent_s: u64, produced_s: u64, partition: i32, offset: i64) -> Arrival {
        Arrival {
            seq,
            sent_ns: sent_s * S,
            produced_ms: (produced_s * 1000) as i64,
            partition,
            offset,
        }
    }

    fn faults() -> Vec<Applied> {
        vec![
            Applied {
                fault: Fault::ForwarderKill,
                started_ns: 10 * S,
                healed_ns: 11 * S,
                published_before: 100,
            },
            Applied {
                fault: Fault::KafkaPartition,
                started_ns: 30 * S,
                healed_ns: 40 * S,
                published_before: 300,
            },
        ]
    }

    #[test]
    fn each_fault_owns_the_replays_losses_and_slow_arrivals_of_its_interval() {
        // 400 messages over topics of 100 (seq % 100): seq n and n + 100 share a topic.
        let mut arrivals: Vec<Arrival> = (0..400)
            .filter(|&s| s != 150 && s != 350)
            .map(|s| arrival(s, s / 10, s / 10, 0, s as i64))
            .collect();
        // Replayed after the kill: 90..=99 again at 12 s.
        arrivals.extend((90..100).map(|s| arrival(s, s / 10, 12, 0, 1000 + s as i64)));
        // After the partition, message 310 (published at 31 s) produced at 41 s: 10 s late.
        arrivals.retain(|a| a.seq != 310);
        arrivals.push(arrival(310, 31, 41, 0, 2000));
        let figures = judge(400, &faults(), &arrivals);
        assert_eq!(
            (figures[0].replayed, figures[0].lost),
            (10, 1),
            "the kill's replays and message 150"
        );
        assert_eq!(
            (figures[1].replayed, figures[1].lost),
            (0, 1),
            "message 350"
        );
        assert_eq!(
            figures[1].caught_up_s, 11.0,
            "the last slow arrival, 41 s − 30 s"
        );
        assert_eq!(figures[0].caught_up_s, 0.0, "no first arrival was late");
        // 310 arrives behind 311..=399 of other topics only: its own topic (10) saw 210 before.
        assert_eq!(figures[1].out_of_order, 0);
    }

    #[test]
    fn a_message_behind_a_later_one_of_its_topic_is_out_of_order_where_it_was_produced() {
        let arrivals = vec![arrival(105, 10, 35, 0, 0), arrival(5, 1, 36, 0, 1)];
        let figures = judge(0, &faults(), &arrivals);
        assert_eq!((figures[0].out_of_order, figures[1].out_of_order), (0, 1));
    }
}
