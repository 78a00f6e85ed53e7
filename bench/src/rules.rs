//! The rules section: what a rule costs the forwarder. The same QoS 1 backlog spread over the
//! rules' topics (rule *i* forwards `r<run>/d<i>/+` to one of 8 Kafka topics) drained at 10,
//! 1,000 and 10,000 rules, round after round; at 10,000 rules the forwarder's start, the
//! work of a reload timed in this process, and a live reload under a steady stream.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use ferry_forwarder::load::{LoadSettings, load};
use ferry_forwarder::metrics::Metrics;
use ferry_forwarder::pipeline::Reload;
use serde::{Deserialize, Serialize};

use crate::load::{self, Arrivals, Judge, now_ns, percentile};
use crate::procs::{Forwarder, sched};
use crate::report::verdict;
use crate::{Bench, PARTITIONS};

/// The rule counts the drains run at.
const RULE_COUNTS: [usize; 3] = [10, 1_000, 10_000];
/// The largest: the group the start and reload figures are taken at.
const MOST_RULES: usize = 10_000;
/// Kafka topics the rules write to (rule *i* to topic *i* mod 8).
const KAFKA_TOPICS: usize = 8;
/// The backlog of each drain: the table's 50k messages.
const BACKLOG: u64 = 50_000;
const SIZE: usize = 300;
/// MQTT topics (so Kafka keys) per rule: with one, 10 rules would fill 10 of the 32
/// partitions and 1,000 rules all of them, and the drains would compare how librdkafka
/// batches rather than what a rule costs.
const KEYS_PER_RULE: u64 = 16;
/// Rounds of the three drains, interleaved: a drain lasts a couple of seconds, on cores shared
/// with both brokers.
const ROUNDS: usize = 3;
/// The live stream across a reload: its rate, and how long it runs before and after the new
/// file is written.
const RELOAD_STREAM_RATE: u64 = 1_000;
const RELOAD_STREAM_BEFORE: Duration = Duration::from_secs(3);
const RELOAD_STREAM_AFTER: Duration = Duration::from_secs(7);
/// How often the CPU sampler reads the forwarder's scheduler time.
const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// The median round of drains at one rule count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuleDrain {
    pub rules: usize,
    pub messages: u64,
    /// The forwarder's CPU from the first record read back from Kafka to the last, over the
    /// messages between: routing, producing and acking, not start-up.
    pub cpu_us_per_message: f64,
    /// Each round's figure, in the order run.
    pub rounds_cpu_us: Vec<f64>,
    pub msgs_per_sec: f64,
    pub peak_rss_mib: f64,
    pub lost: u64,
    pub duplicates: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RuleFigures {
    pub drains: Vec<RuleDrain>,
    /// Process start until `/readyz` (config read, routing table built, connected, every filter
    /// subscribed, Kafka reached), median of the rounds: at 10 and at 10,000 rules.
    pub start_seconds_few: f64,
    pub start_seconds_most: f64,
    /// Reading, validating and building the routing table of 10,000 rules: the work of a
    /// reload (and of a start), timed in this process, fastest of three.
    pub reload_work_seconds: f64,
    /// A live reload of 10,000 rules (every rule renamed and given a second filter): from the
    /// new file's rename until the forwarder logs it applied. Includes up to 1 s of the
    /// watcher's polling.
    pub reload_applied_seconds: f64,
    /// A stream at [`RELOAD_STREAM_RATE`] msg/s across that reload: end-to-end latency.
    pub reload_stream_messages: u64,
    pub reload_stream_p50_ms: f64,
    pub reload_stream_p99_ms: f64,
    pub reload_stream_max_ms: f64,
    pub reload_stream_lost: u64,
}

impl RuleFigures {
    fn drain(&self, rules: usize) -> Option<&RuleDrain> {
        self.drains.iter().find(|d| d.rules == rules)
    }

    /// CPU per message at 10,000 rules over that at 10.
    fn ratio(&self) -> Option<f64> {
        let few = self.drain(RULE_COUNTS[0])?;
        let most = self.drain(MOST_RULES)?;
        Some(most.cpu_us_per_message / few.cpu_us_per_message.max(1e-9))
    }

    pub fn target_rows(&self, s: &mut String) {
        if let Some(ratio) = self.ratio() {
            let _ = writeln!(
                s,
                "| forwarder CPU per message at 10,000 rules ≤ 1.2× at 10 | {ratio:.2}× ({:.2} µs vs {:.2} µs) | {} |",
                self.drain(MOST_RULES)
                    .map_or(f64::NAN, |d| d.cpu_us_per_message),
                self.drain(RULE_COUNTS[0])
                    .map_or(f64::NAN, |d| d.cpu_us_per_message),
                verdict(ratio <= 1.2)
            );
        }
        let _ = writeln!(
            s,
            "| a reload's work at 10,000 rules ≤ 1 s (the watcher's poll interval: reloads never queue) | {:.3} s | {} |",
            self.reload_work_seconds,
            verdict(self.reload_work_seconds <= 1.0)
        );
        let extra = self.start_seconds_most - self.start_seconds_few;
        let _ = writeln!(
            s,
            "| start at 10,000 rules ≤ 1 s more than at 10 | {:.2} s vs {:.2} s | {} |",
            self.start_seconds_most,
            self.start_seconds_few,
            verdict(extra <= 1.0)
        );
    }

    pub fn section(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n### Rules in a group (1 forwarder, QoS 1, {SIZE} B, window 1000)\n\n\
             Rule *i* forwards `r<run>/d<i>/+` to one of {KAFKA_TOPICS} Kafka topics ({PARTITIONS} partitions each); a {BACKLOG}-message backlog spread over the rules, {KEYS_PER_RULE} MQTT topics (Kafka keys) each. \
             CPU per message: the forwarder's scheduler time from the first record read back from Kafka to the last, over the messages between (start-up apart); the median of {ROUNDS} rounds.\n\n\
             | rules | forwarder µs/msg | each round | msg/s | peak RSS MiB | lost | dup |\n|---|---|---|---|---|---|---|"
        );
        for d in &self.drains {
            let rounds: Vec<String> = d.rounds_cpu_us.iter().map(|r| format!("{r:.2}")).collect();
            let _ = writeln!(
                s,
                "| {} | {:.2} | {} | {:.0} | {:.1} | {} | {} |",
                d.rules,
                d.cpu_us_per_message,
                rounds.join(", "),
                d.msgs_per_sec,
                d.peak_rss_mib,
                d.lost,
                d.duplicates
            );
        }
        let _ = writeln!(
            s,
            "\nAt {MOST_RULES} rules: start to ready {:.2} s (at 10 rules {:.2} s); a reload's work (read, validate, build the routing table; on a blocking thread) {:.3} s; \
             a live reload (every rule renamed and given a second filter) applied {:.2} s after the file changed (the watcher polls every second). \
             A {RELOAD_STREAM_RATE} msg/s stream across that reload: {} messages, end-to-end p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, lost {}.",
            self.start_seconds_most,
            self.start_seconds_few,
            self.reload_work_seconds,
            self.reload_applied_seconds,
            self.reload_stream_messages,
            self.reload_stream_p50_ms,
            self.reload_stream_p99_ms,
            self.reload_stream_max_ms,
            self.reload_stream_lost
        );
    }
}

/// One group's forwarder config: `rules` rules, rule *i* named `<name>-<i>` forwarding
/// `r<run>/d<i>/+` (and `r<run>/n<i>/+` when `second_filter`) to `rules.<run>.<i mod 8>`.
fn config(
    bench: &Bench,
    run: u32,
    rules: usize,
    name: &str,
    second_filter: bool,
    log: &str,
) -> String {
    let mut c = format!(
        "mqtt:\n  host: 127.0.0.1\n  port: {port}\n  client_id: rules-{run}\n  clean_session: false\n  max_inflight: {window}\n\
         kafka:\n  bootstrap_servers: \"{bootstrap}\"\n{kafka_config}\
         log:\n  level: {log}\nrules:\n",
        port = bench.mqtt.port(),
        window = bench.window,
        bootstrap = bench.kafka.bootstrap(),
        kafka_config = bench.kafka_config,
    );
    for i in 0..rules {
        let second = if second_filter {
            format!(", \"r{run}/n{i}/+\"")
        } else {
            String::new()
        };
        let _ = writeln!(
            c,
            "  - {{ name: {name}-{i}, mqtt: {{ topics: [\"r{run}/d{i}/+\"{second}], qos: 1 }}, kafka: {{ topic: rules.{run}.{} }} }}",
            i % KAFKA_TOPICS
        );
    }
    c
}

pub fn run(bench: &mut Bench) -> Result<RuleFigures> {
    println!(
        "\n== Rules in a group: QoS 1, {SIZE} B, {BACKLOG} messages over the rules' topics, {RULE_COUNTS:?} rules, {ROUNDS} rounds"
    );
    bench.broker_inflight(bench.window)?;
    let mut rounds: Vec<Vec<(RuleDrain, f64)>> = vec![Vec::new(); RULE_COUNTS.len()];
    for _ in 0..ROUNDS {
        for (i, rules) in RULE_COUNTS.into_iter().enumerate() {
            let (drain, start) = drain(bench, rules)?;
            println!(
                "{rules} rules: {:.2} µs/msg forwarder CPU, {:.0} msg/s, start to ready {start:.2} s, peak RSS {:.1} MiB, lost {}, dup {}",
                drain.cpu_us_per_message,
                drain.msgs_per_sec,
                drain.peak_rss_mib,
                drain.lost,
                drain.duplicates
            );
            rounds[i].push((drain, start));
        }
    }
    let mut figures = RuleFigures::default();
    let mut starts = Vec::new();
    for runs in rounds {
        starts.push(median(runs.iter().map(|(_, s)| *s).collect()));
        figures.drains.extend(median_drain(runs));
    }
    figures.start_seconds_few = starts.first().copied().unwrap_or(f64::NAN);
    figures.start_seconds_most = starts.last().copied().unwrap_or(f64::NAN);
    figures.reload_work_seconds = reload_work(bench)?;
    live_reload(bench, &mut figures)?;
    let mut s = String::new();
    figures.target_rows(&mut s);
    print!("{s}");
    Ok(figures)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The round with the median CPU per message, carrying every round's figure and losses.
fn median_drain(mut runs: Vec<(RuleDrain, f64)>) -> Option<RuleDrain> {
    let rounds: Vec<f64> = runs.iter().map(|(d, _)| d.cpu_us_per_message).collect();
    let lost = runs.iter().map(|(d, _)| d.lost).sum();
    let duplicates = runs.iter().map(|(d, _)| d.duplicates).sum();
    runs.sort_by(|a, b| a.0.cpu_us_per_message.total_cmp(&b.0.cpu_us_per_message));
    let mid = runs.len() / 2;
    let (mut chosen, _) = runs.into_iter().nth(mid)?;
    chosen.rounds_cpu_us = rounds;
    chosen.lost = lost;
    chosen.duplicates = duplicates;
    Some(chosen)
}

/// The Kafka topics of run `run`, created, and a reader on each.
fn topics_and_readers(bench: &Bench, run: u32, timeout: Duration) -> Result<Vec<load::Reader>> {
    (0..KAFKA_TOPICS)
        .map(|k| {
            let topic = format!("rules.{run}.{k}");
            bench
                .rt
                .block_on(bench.kafka.create_topic(&topic, PARTITIONS))?;
            load::read_topic(
                bench.kafka.bootstrap(),
                topic,
                Duration::from_secs(1),
                timeout,
                Judge::default(),
            )
        })
        .collect()
}

/// One drain at `rules` rules; and how long the forwarder took from start to ready on the
/// session-making start (every filter subscribed anew).
fn drain(bench: &mut Bench, rules: usize) -> Result<(RuleDrain, f64)> {
    let run = bench.next_run();
    let config = config(bench, run, rules, "rule", false, "warn");
    let dir = bench.dir.path();
    // The session first (subscribe, leave), so the broker queues the backlog for it.
    let started = Instant::now();
    let mut f = Forwarder::start(
        &bench.forwarder_bin,
        dir,
        &format!("rules{run}-session"),
        &config,
    )?;
    f.wait_ready(Duration::from_secs(60))?;
    let start_seconds = started.elapsed().as_secs_f64();
    f.stop()?;
    let messages: Vec<(String, Vec<u8>)> = (0..BACKLOG)
        .map(|seq| {
            let rule = seq % rules as u64;
            let key = (seq / rules as u64) % KEYS_PER_RULE;
            (format!("r{run}/d{rule}/v{key}"), load::payload(seq, SIZE))
        })
        .collect();
    bench.rt.block_on(ferry_e2e::publish(
        bench.mqtt.port(),
        format!("rules{run}-publisher"),
        load::qos(1),
        messages,
    ))?;
    let readers = topics_and_readers(bench, run, Duration::from_secs(120 + BACKLOG / 1000))?;
    let mut f = Forwarder::start(&bench.forwarder_bin, dir, &format!("rules{run}"), &config)?;
    let sampler = CpuSampler::start(f.pid());
    let mut arrivals = Vec::new();
    for (k, reader) in readers.into_iter().enumerate() {
        arrivals.push(reader.finish(expected_on(k, rules, BACKLOG))?);
    }
    let samples = sampler.stop();
    let peak_rss_mib = f.usage()?.peak_rss_mib;
    f.stop()?;
    let first = arrivals
        .iter()
        .map(|a| a.first_read_ns)
        .filter(|t| *t > 0)
        .min();
    let last = arrivals.iter().map(|a| a.last_read_ns).max();
    let (Some(first), Some(last)) = (first, last) else {
        bail!("{rules} rules: nothing arrived in Kafka");
    };
    let cpu = cpu_at(&samples, last)? - cpu_at(&samples, first)?;
    let span = (last - first) as f64 / 1e9;
    let between = BACKLOG.saturating_sub(1).max(1) as f64;
    Ok((
        RuleDrain {
            rules,
            messages: BACKLOG,
            cpu_us_per_message: cpu / between * 1e6,
            rounds_cpu_us: Vec::new(),
            msgs_per_sec: between / span.max(1e-9),
            peak_rss_mib,
            lost: arrivals.iter().map(|a| a.lost).sum(),
            duplicates: arrivals.iter().map(|a| a.duplicates).sum(),
        },
        start_seconds,
    ))
}

/// Messages of `0..n` that Kafka topic `k` receives: those of the rules `i` with `i mod 8 == k`.
fn expected_on(k: usize, rules: usize, n: u64) -> u64 {
    (0..n)
        .filter(|seq| (*seq % rules as u64) as usize % KAFKA_TOPICS == k)
        .count() as u64
}

/// The forwarder's scheduler time, sampled from `/proc` by a thread of this process: what
/// the forwarder spent between two instants, without asking it (rendering `/metrics` of
/// 10,000 rules would cost it more than what is measured).
struct CpuSampler {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Vec<(u64, f64)>>,
}

impl CpuSampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                if let Ok(s) = sched(pid) {
                    samples.push((now_ns(), s.cpu_seconds));
                }
                std::thread::sleep(SAMPLE_EVERY);
            }
            samples
        });
        Self { stop, handle }
    }

    /// The samples: (ns since the epoch, CPU seconds so far).
    fn stop(self) -> Vec<(u64, f64)> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

/// The CPU seconds at `at` (ns since the epoch), from the sample nearest before it.
fn cpu_at(samples: &[(u64, f64)], at: u64) -> Result<f64> {
    samples
        .iter()
        .take_while(|(t, _)| *t <= at)
        .last()
        .map(|(_, cpu)| *cpu)
        .context("no CPU sample before the first record")
}

/// Reading, validating and building the routing table of [`MOST_RULES`] rules, as a reload
/// (on its blocking thread) and a start do: the fastest of three, in this process.
fn reload_work(bench: &Bench) -> Result<f64> {
    let text = config(bench, 0, MOST_RULES, "rule", true, "warn");
    let metrics = Metrics::new();
    let mut fastest = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let loaded = load(&text, &LoadSettings::default())
            .map_err(|e| anyhow::anyhow!("the {MOST_RULES}-rule config: {e}"))?;
        let reload = Reload::new(&loaded.config, &metrics);
        fastest = fastest.min(start.elapsed().as_secs_f64());
        std::hint::black_box(reload);
    }
    println!("a reload's work at {MOST_RULES} rules: {fastest:.3} s");
    Ok(fastest)
}

/// A forwarder of [`MOST_RULES`] rules under a steady stream (to rule 0's topic), its config
/// replaced mid-stream by one renaming every rule and giving each a second filter: when the
/// reload applied, and what the stream's latency shows of it.
fn live_reload(bench: &mut Bench, figures: &mut RuleFigures) -> Result<()> {
    let run = bench.next_run();
    let before = config(bench, run, MOST_RULES, "rule", false, "info");
    let after = config(bench, run, MOST_RULES, "renamed", true, "info");
    let total = RELOAD_STREAM_BEFORE + RELOAD_STREAM_AFTER;
    let mut readers = topics_and_readers(bench, run, total + Duration::from_secs(60))?;
    let reader = readers.swap_remove(0); // Rule 0 writes to topic 0.
    drop(readers);
    let mut f = Forwarder::start_reloading(
        &bench.forwarder_bin,
        bench.dir.path(),
        &format!("rules{run}-reload"),
        &before,
    )?;
    f.wait_ready(Duration::from_secs(60))?;
    let port = bench.mqtt.port();
    let prefix = format!("r{run}/d0");
    let stream = bench.rt.spawn(async move {
        load::publish_at_rate(port, &prefix, RELOAD_STREAM_RATE, total, SIZE, 1).await
    });
    std::thread::sleep(RELOAD_STREAM_BEFORE);
    let written = Instant::now();
    f.rewrite_config(&after)?;
    let applied = loop {
        if f.log().contains("config reloaded") {
            break written.elapsed();
        }
        if written.elapsed() > Duration::from_secs(60) {
            bail!("the reload of {MOST_RULES} rules did not apply in 60 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let sent = bench
        .rt
        .block_on(stream)
        .context("the stream's publisher panicked")??;
    let arrivals: Arrivals = reader.finish(sent)?;
    f.stop()?;
    let mut ms = arrivals.latencies_ms.clone();
    ms.sort_by(f64::total_cmp);
    figures.reload_applied_seconds = applied.as_secs_f64();
    figures.reload_stream_messages = sent;
    figures.reload_stream_p50_ms = percentile(&ms, 50.0);
    figures.reload_stream_p99_ms = percentile(&ms, 99.0);
    figures.reload_stream_max_ms = ms.last().copied().unwrap_or(f64::NAN);
    figures.reload_stream_lost = arrivals.lost;
    println!(
        "live reload of {MOST_RULES} rules: applied {:.2} s after the file changed; {sent} messages at {RELOAD_STREAM_RATE} msg/s across it: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, lost {}",
        figures.reload_applied_seconds,
        figures.reload_stream_p50_ms,
        figures.reload_stream_p99_ms,
        figures.reload_stream_max_ms,
        figures.reload_stream_lost
    );
    Ok(())
}
