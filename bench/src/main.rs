//! `ferry-bench` (`make bench`): what the forwarder costs beside the brokers it sits between,
//! measured per process in the same runs (drains, low rates, windows, replicas, latency), plus
//! the operator at 1,000 and 10,000 rules.
//!
//! Every scenario runs on real processes: Mosquitto, Kafka (KRaft), the release
//! `ferry-forwarder`, and for the operator a real etcd + kube-apiserver + controller-manager
//! with the release `ferry-operator`. Results go to `bench/results/` as a markdown table,
//! JSON, and PNG plots.

mod encode;
mod encodings;
mod expressions;
mod flood;
mod load;
mod operator;
mod plot;
mod procs;
mod report;
mod rules;
mod soak;
mod startup;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use ferry_e2e::{Kafka, KafkaOptions, Mosquitto, MosquittoOptions};

use crate::expressions::ExprRule;
use crate::load::{Arrivals, Judge, percentile};
use crate::procs::{Forwarder, Usage, sched, usage};
use crate::report::{Drain, Latency, LowRate, OperatorFigures, Report};

#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Messages per drain scenario.
    #[arg(long, default_value_t = 100_000)]
    messages: u64,
    /// Seconds per fixed-rate latency run.
    #[arg(long, default_value_t = 15)]
    latency_seconds: u64,
    /// Seconds per low-rate run (idle, 100 and 1,000 msg/s).
    #[arg(long, default_value_t = 20)]
    low_rate_seconds: u64,
    /// A short run (10k messages, 3 s latency runs, 100 rules) to check the tool itself.
    #[arg(long)]
    quick: bool,
    /// Skip the operator figures (they need the Kubernetes binaries of e2e/k8s/build.sh).
    #[arg(long)]
    no_operator: bool,
    /// Measure nothing: write results.md again from results.json (after merging two runs'
    /// JSON, or a change to the report's layout).
    #[arg(long)]
    render: bool,
    /// Only these sections (for experiments): drains, expressions, encodings, lowrate, windows, replicas,
    /// latency, rules, operator.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The forwarder's max_inflight outside the window sweep.
    #[arg(long, default_value_t = 1000)]
    window: u32,
    /// Extra librdkafka properties for the forwarder (KEY=VALUE, repeatable), for experiments.
    #[arg(long = "kafka-config", value_name = "KEY=VALUE")]
    kafka_config: Vec<String>,
    /// Run the soak instead (`make soak`): a long stream through faults, one after another.
    #[arg(long)]
    soak: bool,
    /// Messages of the soak.
    #[arg(long, default_value_t = 1_000_000)]
    soak_messages: u64,
    /// The soak's publish rate, messages per second: below what the forwarder sustains on the
    /// 3-node cluster, so it can catch up after each fault.
    #[arg(long, default_value_t = 2_500)]
    soak_rate: u64,
    /// Seconds between the starts of two faults in the soak.
    #[arg(long, default_value_t = 20)]
    soak_every: u64,
    /// Let Mosquitto send each client any number of unacknowledged messages
    /// (`max_inflight_messages 0`) instead of the run's window, to compare (experiments).
    #[arg(long)]
    broker_unbounded: bool,
    /// Seconds of the operator's steady window (forwarders reporting, traffic on every rule):
    /// two write intervals by default, so every rule's moving counters are written in it.
    #[arg(long, default_value_t = 120)]
    operator_seconds: u64,
    /// The operator's rule counts, one run each (100 rules a group, one connection).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    operator_rules: Vec<usize>,
    /// Measure only what encoding a reading as an Avro, Protobuf or JSON Schema record costs
    /// per message (no brokers), and print it.
    #[arg(long)]
    encode_cost: bool,
    /// Where results go.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    out: PathBuf,
}

/// The MQTT topics a run spreads its messages over (one Kafka key each).
const TOPICS: u64 = 16;
const PARTITIONS: i32 = 4;
/// The payload size of the live runs (low rates, latency).
const LIVE_SIZE: usize = 300;
/// The per-replica window of the scaling runs (see `main`).
pub const REPLICA_WINDOW: u32 = 250;

struct Bench {
    forwarder_bin: PathBuf,
    mqtt: Mosquitto,
    kafka: Kafka,
    rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
    runs: u32,
    messages: u64,
    kafka_config: String,
    /// The broker's `max_inflight_messages` now: the window of the run, as docs/guarantees.md
    /// tells users to set it (see [`Bench::broker_inflight`]).
    broker_inflight: u32,
    /// The window outside the window sweep.
    window: u32,
    broker_unbounded: bool,
    /// The schema registry's URL while the encodings section runs (its drains' configs name it).
    registry_url: Option<String>,
}

/// One drain: `replicas` forwarders, each with a persistent session that the broker filled
/// with its share of `messages` while they were away.
#[derive(Debug, Clone, Copy)]
struct DrainSpec {
    qos: u8,
    size: usize,
    window: u32,
    replicas: u32,
    /// The rule's expressions (JSON payloads) in the expressions section; `None` elsewhere.
    rule: Option<ExprRule>,
}

impl DrainSpec {
    /// A drain of ~300 B JSON readings through `rule` (QoS 1, 1 replica): the expressions' and
    /// the encodings' sections.
    fn json(rule: ExprRule, window: u32) -> Self {
        DrainSpec {
            qos: 1,
            size: 300,
            window,
            replicas: 1,
            rule: Some(rule),
        }
    }

    fn judge(&self) -> Judge {
        self.rule.map(ExprRule::judge).unwrap_or_default()
    }

    /// The records that must arrive in Kafka of the `n` messages published.
    fn expected(&self, n: u64) -> u64 {
        self.rule.map_or(n, |r| r.expected(n))
    }
}

/// What a drain measured before reading Kafka back.
struct Measured {
    startup: Duration,
    rate: f64,
    /// The forwarders' CPU (scheduler time) per message from the first ack of a record Kafka
    /// confirmed to the last, over the messages acked between, in µs.
    steady_us_per_message: f64,
    produce_ms: f64,
    ack_ms: f64,
    usage: Vec<Usage>,
    /// Mosquitto's and Kafka's CPU seconds over the drain.
    brokers: (f64, f64),
}

impl Measured {
    fn drain(self, spec: DrainSpec, n: u64, arrivals: &Arrivals) -> Drain {
        let cpu: f64 = self.usage.iter().map(|u| u.cpu_seconds).sum();
        let peak = self
            .usage
            .iter()
            .map(|u| u.peak_rss_mib)
            .fold(0.0, f64::max);
        Drain {
            startup_seconds: self.startup.as_secs_f64(),
            mean_produce_ms: self.produce_ms,
            mean_ack_ms: self.ack_ms,
            qos: spec.qos,
            size: spec.size,
            window: spec.window,
            replicas: spec.replicas,
            messages: n,
            msgs_per_sec: self.rate,
            steady_us_per_message: self.steady_us_per_message,
            mb_per_sec: self.rate * spec.size as f64 / 1_000_000.0,
            cpu_seconds: cpu,
            msgs_per_cpu_second: n as f64 / cpu.max(0.001),
            mosquitto_cpu_seconds: self.brokers.0,
            kafka_cpu_seconds: self.brokers.1,
            peak_rss_mib: peak,
            lost: arrivals.lost,
            duplicates: arrivals.duplicates,
            out_of_order: arrivals.out_of_order,
        }
    }
}

impl Bench {
    fn next_run(&mut self) -> u32 {
        self.runs += 1;
        self.runs
    }

    fn forwarder_config(&self, run: u32, replica: u32, spec: DrainSpec, shared: bool) -> String {
        let shared_group = if shared {
            format!("  shared_group: bench{run}\n")
        } else {
            String::new()
        };
        let [filter, key, payload] = spec.rule.map(ExprRule::yaml).unwrap_or_default();
        let registry = match (spec.rule, &self.registry_url) {
            (Some(ExprRule::Avro), Some(url)) => format!("schema_registry:\n  url: \"{url}\"\n"),
            _ => String::new(),
        };
        format!(
            "{registry}mqtt:\n  host: 127.0.0.1\n  port: {port}\n  client_id: bench-{run}-{replica}\n  clean_session: false\n  max_inflight: {window}\n{shared_group}\
             kafka:\n  bootstrap_servers: \"{bootstrap}\"\n{kafka_config}\
             rules:\n  - name: bench\n    mqtt:\n      topics: [\"b{run}/#\"]\n      qos: {qos}\n{filter}    kafka:\n      topic: bench.{run}\n{key}{payload}\
             log:\n  level: warn\n",
            port = self.mqtt.port(),
            window = spec.window,
            bootstrap = self.kafka.bootstrap(),
            qos = spec.qos,
            kafka_config = self.kafka_config,
        )
    }

    /// Restarts Mosquitto (without persistence: every run makes its own sessions) with
    /// `max_inflight_messages` = `window` (0 with `--broker-unbounded`) unless it runs with it already: the broker bounds what
    /// it sends a client unacknowledged to the client's window, as in production.
    fn broker_inflight(&mut self, window: u32) -> Result<()> {
        let limit = if self.broker_unbounded { 0 } else { window };
        if self.broker_inflight != limit {
            self.mqtt.stop();
            self.mqtt = start_mosquitto(limit)?;
            self.broker_inflight = limit;
        }
        Ok(())
    }

    fn drain(&mut self, spec: DrainSpec) -> Result<Drain> {
        Ok(self.drain_judged(spec)?.0)
    }

    /// A drain, and the reader's verdict on what arrived.
    fn drain_judged(&mut self, spec: DrainSpec) -> Result<(Drain, Arrivals)> {
        self.broker_inflight(spec.window)?;
        let run = self.next_run();
        // A small window is slow by design: 200 windows' worth is plenty to measure it.
        let n = self.messages.min(u64::from(spec.window) * 200);
        let topic = format!("bench.{run}");
        self.rt
            .block_on(self.kafka.create_topic(&topic, PARTITIONS))?;
        let shared = spec.replicas > 1;
        let configs: Vec<String> = (0..spec.replicas)
            .map(|i| self.forwarder_config(run, i, spec, shared))
            .collect();
        self.queue_backlog(run, spec, n, &configs)?;
        let measured = self.measure(run, spec, n, &configs)?;
        let arrivals = load::read_topic(
            self.kafka.bootstrap(),
            topic,
            Duration::from_secs(1),
            Duration::from_secs(120),
            spec.judge(),
        )?
        .finish(spec.expected(n))?;
        let d = measured.drain(spec, n, &arrivals);
        match spec.rule {
            Some(rule) => println!("{}: {}", rule.name(), d.line()),
            None => println!("{}", d.line()),
        }
        Ok((d, arrivals))
    }

    /// A new session for `config` (run `run`), filled with a backlog of `n` QoS 1 binary
    /// messages of `size` bytes over `topics` MQTT topics while its forwarder is away, and a
    /// reader of `topic` from the start: what a drain of one forwarder needs before it starts.
    fn filled_session(
        &self,
        run: u32,
        config: &str,
        (n, size, topics): (u64, usize, u64),
        topic: String,
    ) -> Result<load::Reader> {
        let mut session = Forwarder::start(
            &self.forwarder_bin,
            self.dir.path(),
            &format!("run{run}-session"),
            config,
        )?;
        session.wait_ready(Duration::from_secs(30))?;
        session.stop()?;
        self.rt.block_on(load::publish_backlog(
            self.mqtt.port(),
            &format!("b{run}"),
            n,
            size,
            topics,
            1,
            load::Payload::Binary,
        ))?;
        load::read_topic(
            self.kafka.bootstrap(),
            topic,
            Duration::from_secs(1),
            Duration::from_secs(120),
            Judge::default(),
        )
    }

    /// Starts run `run`'s forwarder on `config` (its session filled by
    /// [`Bench::filled_session`]) and reads its acks every `poll` until `n` were acked, giving
    /// `sample` the seconds since the start and the acks each time (2 minutes at most). The
    /// forwarder, still running, and the seconds it took.
    fn until_acked(
        &self,
        run: u32,
        config: &str,
        n: u64,
        poll: Duration,
        mut sample: impl FnMut(f64, u64),
    ) -> Result<(Forwarder, f64)> {
        let start = Instant::now();
        let fwd = Forwarder::start(
            &self.forwarder_bin,
            self.dir.path(),
            &format!("run{run}"),
            config,
        )?;
        let deadline = Duration::from_secs(120);
        loop {
            let t = start.elapsed().as_secs_f64();
            let acked = fwd.metric("ferry_mqtt_acked_messages_total").unwrap_or(0.0) as u64;
            sample(t, acked);
            if acked >= n {
                return Ok((fwd, t));
            }
            if start.elapsed() > deadline {
                bail!("run {run}: {acked} of {n} acked after {deadline:?}");
            }
            std::thread::sleep(poll);
        }
    }

    /// Starts the drain's forwarders on their filled sessions and times them until all `n`
    /// messages were acked; stops them.
    fn measure(&self, run: u32, spec: DrainSpec, n: u64, configs: &[String]) -> Result<Measured> {
        let brokers_before = self.broker_cpu()?;
        let start = Instant::now();
        let mut forwarders = self.start_forwarders(run, configs)?;
        let (first_at, first_acked, first_cpu) = wait_all_acked(&forwarders, spec, n, start)?;
        let steady_cpu = sched_cpu(&forwarders)? - first_cpu;
        let brokers_after = self.broker_cpu()?;
        let steady = first_at.elapsed().max(Duration::from_millis(1));
        let usage: Vec<Usage> = forwarders
            .iter()
            .map(Forwarder::usage)
            .collect::<Result<_>>()?;
        let measured = Measured {
            startup: first_at.duration_since(start),
            rate: (n - first_acked.min(n)) as f64 / steady.as_secs_f64(),
            steady_us_per_message: steady_cpu * 1e6 / (n - first_acked.min(n)).max(1) as f64,
            produce_ms: mean_ms(&forwarders, "ferry_kafka_produce_latency_seconds"),
            ack_ms: mean_ms(&forwarders, "ferry_message_ack_latency_seconds"),
            usage,
            brokers: (
                brokers_after.0 - brokers_before.0,
                brokers_after.1 - brokers_before.1,
            ),
        };
        for f in &mut forwarders {
            f.stop()?;
        }
        Ok(measured)
    }

    /// Makes each forwarder's session and has the broker queue the drain's `n` messages in it
    /// while the forwarders are away.
    fn queue_backlog(&self, run: u32, spec: DrainSpec, n: u64, configs: &[String]) -> Result<()> {
        // Sessions first (subscribe, leave), so the broker queues the backlog for them.
        for (i, config) in configs.iter().enumerate() {
            let mut f = Forwarder::start(
                &self.forwarder_bin,
                self.dir.path(),
                &format!("run{run}-{i}-session"),
                config,
            )?;
            f.wait_ready(Duration::from_secs(30))?;
            f.stop()?;
        }
        self.rt.block_on(load::publish_backlog(
            self.mqtt.port(),
            &format!("b{run}"),
            n,
            spec.size,
            TOPICS,
            spec.qos,
            spec.rule
                .map_or(load::Payload::Binary, |_| load::Payload::Json),
        ))
    }

    /// The drain's forwarders, one per config, back on the sessions [`Bench::queue_backlog`]
    /// filled.
    fn start_forwarders(&self, run: u32, configs: &[String]) -> Result<Vec<Forwarder>> {
        configs
            .iter()
            .enumerate()
            .map(|(i, config)| {
                Forwarder::start(
                    &self.forwarder_bin,
                    self.dir.path(),
                    &format!("run{run}-{i}"),
                    config,
                )
            })
            .collect()
    }

    /// CPU seconds Mosquitto and the Kafka broker have used so far.
    fn broker_cpu(&self) -> Result<(f64, f64)> {
        let mqtt = self.mqtt.pid().context("Mosquitto is not running")?;
        let kafka = self.kafka.pid().context("Kafka is not running")?;
        Ok((usage(mqtt)?.cpu_seconds, usage(kafka)?.cpu_seconds))
    }

    /// A ready forwarder (QoS 1, `window`) on a new run's topic, and a reader of that topic
    /// giving up after `read_seconds`: what the live runs share.
    fn live_forwarder(
        &mut self,
        window: u32,
        read_seconds: u64,
    ) -> Result<(u32, Forwarder, load::Reader)> {
        self.broker_inflight(window)?;
        let run = self.next_run();
        let topic = format!("bench.{run}");
        self.rt
            .block_on(self.kafka.create_topic(&topic, PARTITIONS))?;
        let spec = DrainSpec {
            qos: 1,
            size: LIVE_SIZE,
            window,
            replicas: 1,
            rule: None,
        };
        let mut f = Forwarder::start(
            &self.forwarder_bin,
            self.dir.path(),
            &format!("run{run}"),
            &self.forwarder_config(run, 0, spec, false),
        )?;
        f.wait_ready(Duration::from_secs(30))?;
        let reader = load::read_topic(
            self.kafka.bootstrap(),
            topic,
            Duration::from_secs(1),
            Duration::from_secs(read_seconds),
            Judge::default(),
        )?;
        Ok((run, f, reader))
    }

    /// Publishes to run `run`'s topics at `rate` msg/s for `seconds`; returns how many were sent.
    fn publish_live(&self, run: u32, rate: u64, seconds: u64) -> Result<u64> {
        self.rt.block_on(load::publish_at_rate(
            self.mqtt.port(),
            &format!("b{run}"),
            rate,
            Duration::from_secs(seconds),
            LIVE_SIZE,
            TOPICS,
        ))
    }

    /// One forwarder at `rate` msg/s (0: idle, subscribed) for `seconds`: its CPU and wakeups
    /// from the scheduler, and what arrived.
    fn low_rate(&mut self, rate: u64, seconds: u64) -> Result<LowRate> {
        let (run, mut f, reader) = self.live_forwarder(self.window, seconds + 60)?;
        // Start-up (connections, metadata, the first probe) is not what a quiet group costs.
        std::thread::sleep(Duration::from_secs(3));
        let mqtt = self.mqtt.pid().context("Mosquitto is not running")?;
        let (before, mqtt_before, t0) = (sched(f.pid())?, sched(mqtt)?, Instant::now());
        let sent = if rate == 0 {
            std::thread::sleep(Duration::from_secs(seconds));
            0
        } else {
            self.publish_live(run, rate, seconds)?
        };
        let (after, mqtt_after, took) = (sched(f.pid())?, sched(mqtt)?, t0.elapsed());
        let arrivals = reader.finish(sent)?;
        f.stop()?;
        let secs = took.as_secs_f64();
        let l = LowRate {
            rate,
            seconds: secs,
            messages: sent,
            cpu_percent: (after.cpu_seconds - before.cpu_seconds) / secs * 100.0,
            wakeups_per_sec: (after.wakeups - before.wakeups) as f64 / secs,
            mosquitto_cpu_percent: (mqtt_after.cpu_seconds - mqtt_before.cpu_seconds) / secs
                * 100.0,
            lost: arrivals.lost,
        };
        println!("{}", l.line());
        Ok(l)
    }

    /// One forwarder, a publisher at `rate` msg/s for `seconds`, and a Kafka reader timing
    /// every record from the publish call to its arrival.
    fn latency(&mut self, rate: u64, seconds: u64, window: u32) -> Result<Latency> {
        let (run, mut f, reader) = self.live_forwarder(window, seconds + 120)?;
        let sent = self.publish_live(run, rate, seconds)?;
        let arrivals: Arrivals = reader.finish(sent)?;
        let usage = f.usage()?;
        f.stop()?;
        let mut ms = arrivals.latencies_ms.clone();
        ms.sort_by(f64::total_cmp);
        let l = Latency {
            target_rate: rate,
            achieved_rate: sent as f64 / seconds as f64,
            messages: sent,
            p50_ms: percentile(&ms, 50.0),
            p90_ms: percentile(&ms, 90.0),
            p99_ms: percentile(&ms, 99.0),
            max_ms: ms.last().copied().unwrap_or(f64::NAN),
            lost: arrivals.lost,
            duplicates: arrivals.duplicates,
            cpu_seconds: usage.cpu_seconds,
            peak_rss_mib: usage.peak_rss_mib,
            sorted_ms: ms,
        };
        println!("{}", l.line());
        Ok(l)
    }
}

/// Polls the forwarders' metrics until they acked `n` messages in all (those a filter dropped
/// included: acked unforwarded); returns when the first ack of a message written to Kafka was
/// seen and how many were acked by then (`start` and 0 when there was nothing to ack).
fn wait_all_acked(
    forwarders: &[Forwarder],
    spec: DrainSpec,
    n: u64,
    start: Instant,
) -> Result<(Instant, u64, f64)> {
    let deadline = Duration::from_secs(60 + n / 1000);
    // Throughput counts from the first message Kafka confirmed, so process start, connections
    // and Kafka metadata (start-up, reported apart) do not dilute it; not from the first
    // filtered one, which is acked before Kafka is even connected.
    let mut first: Option<(Instant, u64, f64)> = None;
    loop {
        let (mut forwarded, mut acked) = (0, 0);
        for f in forwarders {
            if let Some([sent, filtered]) = f
                .metrics_each(&[
                    "ferry_rule_acked_messages_total",
                    "ferry_rule_filtered_messages_total",
                ])
                .as_deref()
            {
                forwarded += *sent as u64;
                acked += (*sent + *filtered) as u64;
            }
        }
        if forwarded > 0 && first.is_none() {
            first = Some((Instant::now(), acked, sched_cpu(forwarders)?));
        }
        if acked >= n {
            break;
        }
        if start.elapsed() > deadline {
            bail!("drain {spec:?}: {acked} of {n} acked after {deadline:?}");
        }
        // Each poll renders /metrics in the forwarder: often enough for ~1 % precision on
        // a drain of a second, rarely enough to cost it little.
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(first.unwrap_or((start, 0, 0.0)))
}

/// The forwarders' CPU seconds so far, from the scheduler (ns precision).
fn sched_cpu(forwarders: &[Forwarder]) -> Result<f64> {
    forwarders
        .iter()
        .map(|f| Ok(sched(f.pid())?.cpu_seconds))
        .sum()
}

/// The mean of a forwarder histogram over all `forwarders`, in milliseconds.
fn mean_ms(forwarders: &[Forwarder], metric: &str) -> f64 {
    let sum: f64 = forwarders
        .iter()
        .filter_map(|f| f.metric(&format!("{metric}_sum")))
        .sum();
    let count: f64 = forwarders
        .iter()
        .filter_map(|f| f.metric(&format!("{metric}_count")))
        .sum();
    sum / count.max(1.0) * 1000.0
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.render {
        let report = read_results(&args.out)?;
        return write_results(&args.out, &report, false);
    }
    if args.encode_cost {
        encode::encode_cost()?;
        return Ok(());
    }
    if args.quick {
        args.messages = args.messages.min(10_000);
        args.latency_seconds = args.latency_seconds.min(3);
        args.low_rate_seconds = args.low_rate_seconds.min(3);
        args.operator_seconds = args.operator_seconds.min(30);
    }
    let here = std::env::current_exe()?;
    let bin_dir = here.parent().context("bench binary has no directory")?;
    let forwarder_bin = bin_dir.join("ferry-forwarder");
    let operator_bin = bin_dir.join("ferry-operator");
    for b in [&forwarder_bin, &operator_bin] {
        if !b.is_file() {
            bail!(
                "{} not found next to ferry-bench: run `make bench` (it builds all three in release)",
                b.display()
            );
        }
    }
    const SECTIONS: [&str; 11] = [
        "drains",
        "startup",
        "flood",
        "expressions",
        "encodings",
        "lowrate",
        "windows",
        "replicas",
        "latency",
        "rules",
        "operator",
    ];
    if let Some(other) = args.only.iter().find(|o| !SECTIONS.contains(&o.as_str())) {
        bail!("--only {other}: not one of {SECTIONS:?}");
    }
    let started = Instant::now();
    let machine = report::machine();
    println!("ferry-bench on {machine}");
    if args.soak {
        return soak(&args, &forwarder_bin, machine, started);
    }
    let mut report = Report {
        machine,
        messages: args.messages,
        ..Report::default()
    };
    let wanted = |section: &str| args.only.is_empty() || args.only.iter().any(|o| o == section);
    // Their brokers are not started when only the operator runs: it starts its own.
    if SECTIONS.iter().any(|s| *s != "operator" && wanted(s)) {
        forwarder_sections(&args, forwarder_bin.clone(), &mut report)?;
    }
    if !args.no_operator && wanted("operator") {
        println!("\n== Operator");
        let counts = if args.quick {
            vec![100]
        } else {
            args.operator_rules.clone()
        };
        let window = Duration::from_secs(args.operator_seconds);
        for rules in counts {
            let figures: OperatorFigures =
                operator::measure(&operator_bin, &forwarder_bin, rules, window)?;
            println!("{}", figures.line());
            report.operators.push(figures);
        }
    }
    report.took_seconds = started.elapsed().as_secs_f64();
    if args.only.is_empty() {
        write_results(&args.out, &report, true)?;
    } else {
        // A partial run replaces only its own sections of the results there.
        let merged = merge(&args.out, report, &args.only)?;
        write_results(&args.out, &merged, false)?;
    }
    Ok(())
}

fn soak(args: &Args, forwarder_bin: &Path, machine: String, started: Instant) -> Result<()> {
    let soak_args = soak::SoakArgs {
        messages: args.soak_messages,
        rate: args.soak_rate,
        every: Duration::from_secs(args.soak_every),
        window: args.window,
    };
    let report = soak::run(forwarder_bin, machine, &soak_args)?;
    let md = report.markdown();
    println!("\n{md}");
    soak::write(&args.out, &report)?;
    println!(
        "soak done in {:.0?}; results in {}",
        started.elapsed(),
        args.out.display()
    );
    if report.lost > 0 || report.out_of_order > 0 {
        bail!(
            "the soak lost or reordered messages: {} lost, {} out of order",
            report.lost,
            report.out_of_order
        );
    }
    Ok(())
}

/// The forwarder beside its brokers: drains, low rates, window sweep, replicas, fixed-rate
/// latency (those of `--only`, all without it).
fn forwarder_sections(args: &Args, forwarder_bin: PathBuf, report: &mut Report) -> Result<()> {
    let mqtt = start_mosquitto(args.window)?;
    let kafka = Kafka::start_with(KafkaOptions {
        peak_throughput: true,
        ..KafkaOptions::default()
    })?;
    println!(
        "mosquitto {} (max_inflight_messages = each run's window unless --broker-unbounded, max_queued_messages {}, queue_qos0_messages true); kafka {} (KRaft, 1 node, -Xmx1g); {} partitions, {} MQTT topics = keys",
        report::mosquitto_version(),
        ferry_e2e::MOSQUITTO_MAX_QUEUED,
        ferry_e2e::KAFKA_VERSION,
        PARTITIONS,
        TOPICS
    );
    let mut bench = Bench {
        forwarder_bin,
        mqtt,
        kafka,
        rt: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
        dir: tempfile::Builder::new().prefix("ferry-bench-").tempdir()?,
        runs: 0,
        messages: args.messages,
        kafka_config: kafka_config(&args.kafka_config)?,
        broker_inflight: args.window,
        window: args.window,
        broker_unbounded: args.broker_unbounded,
        registry_url: None,
    };
    let wanted = |section: &str| args.only.is_empty() || args.only.iter().any(|o| o == section);
    warm_up(&mut bench, args.window)?;
    let window = args.window;
    if wanted("drains") {
        drains(&mut bench, window, report)?;
    }
    if wanted("startup") {
        report.startup = Some(startup::run(&mut bench)?);
    }
    if wanted("flood") {
        report.floods = flood::run(&mut bench)?;
    }
    if wanted("expressions") {
        expressions::run(&mut bench, window, report)?;
    }
    if wanted("encodings") {
        report.encodings = Some(encodings::run(&mut bench, window, args.quick)?);
    }
    if wanted("lowrate") {
        println!("\n== Low rates: QoS 1, 300 B, 1 replica, window {window}");
        for rate in [0, 100, 1_000] {
            report
                .low_rates
                .push(bench.low_rate(rate, args.low_rate_seconds)?);
        }
    }
    if wanted("windows") {
        println!("\n== Window sweep: QoS 1, 300 B");
        for window in [10, 50, 100, 250, 500, 1000, 2000, 5000] {
            report.windows.push(bench.drain(DrainSpec {
                qos: 1,
                size: 300,
                window,
                replicas: 1,
                rule: None,
            })?);
        }
    }
    if wanted("replicas") {
        replicas(&mut bench, window, report)?;
    }
    if wanted("latency") {
        println!("\n== Latency at a fixed rate: QoS 1, 300 B, 1 replica, window {window}");
        for rate in [1_000, 10_000] {
            report
                .latencies
                .push(bench.latency(rate, args.latency_seconds, window)?);
        }
    }
    if wanted("rules") {
        report.rules = Some(rules::run(&mut bench)?);
    }
    Ok(())
}

/// A fresh JVM spends its first minute compiling (perf showed Kafka's C1/C2 compiler threads
/// taking a third of both cores during the first drains): warm both brokers up with a full
/// round that is not reported.
fn warm_up(bench: &mut Bench, window: u32) -> Result<()> {
    println!("\n== Warm-up (not reported): three drains, QoS 1, 300 B");
    for _ in 0..3 {
        bench.drain(DrainSpec {
            qos: 1,
            size: 300,
            window,
            replicas: 1,
            rule: None,
        })?;
    }
    Ok(())
}

fn drains(bench: &mut Bench, window: u32, report: &mut Report) -> Result<()> {
    println!("\n== Drains: QoS x size, window {window}, 1 replica");
    for size in [300, 1024] {
        for qos in [0u8, 1, 2] {
            report.drains.push(bench.drain(DrainSpec {
                qos,
                size,
                window,
                replicas: 1,
                rule: None,
            })?);
        }
    }
    Ok(())
}

fn replicas(bench: &mut Bench, window: u32, report: &mut Report) -> Result<()> {
    // At window 250 one forwarder is bound by its own window (well below what the machine
    // can carry), which is where adding replicas can show; at the default window one
    // forwarder already takes the 2 cores that brokers and forwarders share.
    let replica_windows = [REPLICA_WINDOW, window];
    println!("\n== Replicas on a shared subscription: QoS 1, 300 B, windows {replica_windows:?}");
    for w in replica_windows {
        for replicas in [1, 2, 4] {
            report.replicas.push(bench.drain(DrainSpec {
                qos: 1,
                size: 300,
                window: w,
                replicas,
                rule: None,
            })?);
        }
    }
    Ok(())
}

/// Mosquitto sending each client at most `inflight` unacknowledged messages (the window of the
/// run, as in production), and queueing QoS 0 for offline sessions so QoS 0 can be drained like
/// the others.
fn start_mosquitto(inflight: u32) -> Result<Mosquitto> {
    Mosquitto::start_with(MosquittoOptions {
        max_inflight_messages: Some(inflight),
        queue_qos0_messages: true,
        ..MosquittoOptions::default()
    })
}

/// `KEY=VALUE` pairs as the forwarder config's `kafka.config` block.
fn kafka_config(pairs: &[String]) -> Result<String> {
    if pairs.is_empty() {
        return Ok(String::new());
    }
    let mut block = String::from("  config:\n");
    for pair in pairs {
        let (k, v) = pair
            .split_once('=')
            .with_context(|| format!("--kafka-config {pair:?} is not KEY=VALUE"))?;
        block.push_str(&format!("    {k}: \"{v}\"\n"));
    }
    Ok(block)
}

/// The results in `out/results.json` with the sections of `only` taken from `ran`. The whole
/// run's time and machine stay those of the full run the other figures come from.
fn merge(out: &Path, ran: Report, only: &[String]) -> Result<Report> {
    let path = out.join("results.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "--only merges into {}: run a full bench first",
            path.display()
        )
    })?;
    let mut merged: Report =
        serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
    for section in only {
        match section.as_str() {
            "drains" => merged.drains = ran.drains.clone(),
            "flood" => merged.floods = ran.floods.clone(),
            "startup" => merged.startup = ran.startup.clone(),
            "expressions" => {
                merged.expressions = ran.expressions.clone();
                merged.evaluation = ran.evaluation.clone();
            }
            "encodings" => merged.encodings = ran.encodings.clone(),
            "lowrate" => merged.low_rates = ran.low_rates.clone(),
            "windows" => merged.windows = ran.windows.clone(),
            "replicas" => merged.replicas = ran.replicas.clone(),
            "latency" => merged.latencies = ran.latencies.clone(),
            "rules" => merged.rules = ran.rules.clone(),
            "operator" => merged.operators = ran.operators.clone(),
            other => bail!("--only {other}: not a section"),
        }
    }
    let when = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let sections = only.join(", ");
    merged
        .rerun
        .retain(|note| !note.starts_with(&format!("{sections} ")));
    merged.rerun.push(format!(
        "{sections} ({when}, {:.0} s, `ferry-bench --only {}`)",
        ran.took_seconds,
        only.join(",")
    ));
    Ok(merged)
}

/// The report in `out/results.json`.
fn read_results(out: &Path) -> Result<Report> {
    let path = out.join("results.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))
}

/// Writes the markdown and JSON, and the plots when `plots` (a merged report has no latency
/// samples to plot: they are not in the JSON).
fn write_results(out: &Path, report: &Report, plots: bool) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let md = report.markdown();
    std::fs::write(out.join("results.md"), &md)?;
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(report)?,
    )?;
    if plots {
        plot::throughput_vs_window(&out.join("throughput-vs-window.png"), &report.windows)?;
        plot::latency_cdf(&out.join("latency-cdf.png"), &report.latencies)?;
    }
    println!("\n{md}");
    println!(
        "wrote {}/results.md, results.json{}",
        out.display(),
        if plots {
            ", throughput-vs-window.png, latency-cdf.png"
        } else {
            " (plots kept: a partial run)"
        }
    );
    Ok(())
}

#[cfg(test)]
mod results_tests {
    use super::*;

    /// `bench/results/results.md` is what `ferry-bench --render` makes of `results.json`.
    #[test]
    fn the_committed_results_markdown_is_rendered_from_the_json() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
        let report = read_results(&dir).expect("results.json");
        let md = std::fs::read_to_string(dir.join("results.md")).expect("results.md");
        assert!(
            md == report.markdown(),
            "bench/results/results.md drifted from results.json: run `ferry-bench --render` (target/release/ferry-bench --render)"
        );
    }
}
