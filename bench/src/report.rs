//! The figures, the targets they are held to, and the markdown written to `bench/results/`.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Drain {
    pub qos: u8,
    pub size: usize,
    pub window: u32,
    pub replicas: u32,
    pub messages: u64,
    /// Process start until the first ack: connections, subscriptions, Kafka metadata.
    pub startup_seconds: f64,
    /// From the first ack to the last.
    pub msgs_per_sec: f64,
    /// Mean time from the produce call to Kafka's confirmation (forwarder histogram).
    pub mean_produce_ms: f64,
    /// Mean time from reading a message off MQTT to queueing its ack (forwarder histogram).
    pub mean_ack_ms: f64,
    pub mb_per_sec: f64,
    pub cpu_seconds: f64,
    pub msgs_per_cpu_second: f64,
    /// The forwarders' CPU per message in µs from the first ack of a record Kafka confirmed to
    /// the last (start-up apart), from the scheduler (ns precision). `serde(default)`: results
    /// written before it was measured.
    #[serde(default)]
    pub steady_us_per_message: f64,
    /// CPU of Mosquitto and of the Kafka broker over the same span as the forwarders' (their
    /// start until the last ack). `serde(default)`: results written before they were measured.
    #[serde(default)]
    pub mosquitto_cpu_seconds: f64,
    #[serde(default)]
    pub kafka_cpu_seconds: f64,
    pub peak_rss_mib: f64,
    pub lost: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
}

impl Drain {
    /// Microseconds of CPU per message: the forwarder's, Mosquitto's, Kafka's.
    pub fn cpu_us_per_message(&self) -> (f64, f64, f64) {
        let per = |cpu: f64| cpu / self.messages.max(1) as f64 * 1e6;
        (
            per(self.cpu_seconds),
            per(self.mosquitto_cpu_seconds),
            per(self.kafka_cpu_seconds),
        )
    }

    /// The forwarder's share of the pipeline's CPU (forwarder, Mosquitto and Kafka).
    pub fn forwarder_share(&self) -> f64 {
        let all = self.cpu_seconds + self.mosquitto_cpu_seconds + self.kafka_cpu_seconds;
        self.cpu_seconds / all.max(1e-9)
    }

    pub fn line(&self) -> String {
        format!(
            "drain qos {} {} B window {} x{}: {:.0} msg/s ({:.1} MB/s) after {:.2} s start-up (mean produce {:.1} ms, read-to-ack {:.1} ms), {:.2} CPU s ({:.0} msg/CPU-s; Mosquitto {:.2} s, Kafka {:.2} s), peak RSS {:.1} MiB, lost {}, dup {}, out of order {}",
            self.qos,
            self.size,
            self.window,
            self.replicas,
            self.msgs_per_sec,
            self.mb_per_sec,
            self.startup_seconds,
            self.mean_produce_ms,
            self.mean_ack_ms,
            self.cpu_seconds,
            self.msgs_per_cpu_second,
            self.mosquitto_cpu_seconds,
            self.kafka_cpu_seconds,
            self.peak_rss_mib,
            self.lost,
            self.duplicates,
            self.out_of_order
        )
    }
}

/// A rule's expressions evaluated alone, in process, as the pipeline evaluates them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvaluationCost {
    /// `filter + key` or `transform`.
    pub rule: String,
    pub payload_bytes: usize,
    /// With `json` holding only what the expressions read.
    pub us_per_message: f64,
    /// With `json` holding the whole payload.
    pub us_per_message_whole: f64,
}

/// A drain of the expressions section: JSON readings through a rule with `expressions`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExpressionDrain {
    /// `plain`, `filter + key` or `transform`.
    pub rule: String,
    pub expressions: String,
    /// Records that had to reach Kafka: every message, or all but the heartbeats if filtered.
    pub expected: u64,
    /// Records read back (duplicates and heartbeats included).
    pub records: u64,
    /// Heartbeats read back where the filter drops them: must be 0.
    pub heartbeats: u64,
    /// Records whose key is not their payload's device (where the key is `json.device`) or
    /// whose device is not the one sent with their sequence number: must be 0.
    pub mismatched: u64,
    /// `messages` counts every message drained, filtered ones included; so do the rates. The
    /// round with the median rate; its loss counts are every round's, summed.
    pub drain: Drain,
    /// Each round's rate, in the order run (drains of one second are noisy on shared cores).
    #[serde(default)]
    pub rounds_msgs_per_sec: Vec<f64>,
}

/// One drain of the encodings section: JSON readings forwarded as they are, or encoded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EncodingDrain {
    /// `plain` or `avro`.
    pub format: String,
    /// The rule's `kafka.value` as written in the results (empty: plain).
    pub value: String,
    /// Records that had to reach Kafka, and records read back (duplicates included).
    pub expected: u64,
    pub records: u64,
    /// Records whose device (decoded from the Avro record by the bench's own decoder, or read
    /// from the JSON) is not the one sent with their sequence number: must be 0.
    pub mismatched: u64,
    /// The round it ran in (from 0).
    pub round: usize,
    pub drain: Drain,
}

/// The encodings section: a plain and an Avro drain of the same readings, in paired rounds,
/// and the encoders alone.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EncodingFigures {
    pub subject: String,
    pub schema_id: u32,
    /// Every round's drain, in round order.
    pub plain: Vec<EncodingDrain>,
    pub avro: Vec<EncodingDrain>,
    /// Medians over the rounds: forwarder CPU µs per message ([`Drain::steady_us_per_message`])
    /// and msg/s.
    pub plain_us_per_message: f64,
    pub avro_us_per_message: f64,
    pub plain_msgs_per_sec: f64,
    pub avro_msgs_per_sec: f64,
    /// The median over the rounds of (Avro − plain) forwarder CPU µs per message, each round's
    /// pair run back to back.
    pub extra_us_per_message: f64,
    /// `ferry-bench --encode-cost`: each encoder alone on a ~300 B reading, in this process.
    pub encode_cost: Vec<crate::encode::EncodeCost>,
}

/// The median of `values` (the mean of the middle two for an even count; NaN for none).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

impl EncodingFigures {
    pub fn new(
        subject: String,
        schema_id: u32,
        plain: Vec<EncodingDrain>,
        avro: Vec<EncodingDrain>,
        encode_cost: Vec<crate::encode::EncodeCost>,
    ) -> Self {
        let us = |d: &EncodingDrain| d.drain.steady_us_per_message;
        let of = |runs: &[EncodingDrain], f: &dyn Fn(&EncodingDrain) -> f64| {
            median(runs.iter().map(f).collect())
        };
        let extra = median(
            plain
                .iter()
                .zip(&avro)
                .map(|(p, a)| us(a) - us(p))
                .collect(),
        );
        Self {
            plain_us_per_message: of(&plain, &us),
            avro_us_per_message: of(&avro, &us),
            plain_msgs_per_sec: of(&plain, &|d| d.drain.msgs_per_sec),
            avro_msgs_per_sec: of(&avro, &|d| d.drain.msgs_per_sec),
            extra_us_per_message: extra,
            subject,
            schema_id,
            plain,
            avro,
            encode_cost,
        }
    }

    /// Every drain of the section.
    pub fn drains(&self) -> impl Iterator<Item = &EncodingDrain> + Clone {
        self.plain.iter().chain(&self.avro)
    }

    pub fn line(&self) -> String {
        format!(
            "encodings, medians of {} paired rounds: plain {:.2} µs/msg {:.0} msg/s, avro {:.2} µs/msg {:.0} msg/s; avro − plain {:+.2} µs/msg",
            self.plain.len(),
            self.plain_us_per_message,
            self.plain_msgs_per_sec,
            self.avro_us_per_message,
            self.avro_msgs_per_sec,
            self.extra_us_per_message
        )
    }

    /// The encoder alone: `format`'s ns per message, if measured.
    fn alone_ns(&self, format: &str) -> Option<f64> {
        self.encode_cost
            .iter()
            .find(|c| c.format == format)
            .map(|c| c.ns_per_message)
    }

    pub fn target_rows(&self, s: &mut String) {
        let alone = match (self.alone_ns("avro"), self.alone_ns("plain (copied)")) {
            (Some(avro), Some(plain)) => {
                format!("; the encoder alone {:+.2} µs", (avro - plain) / 1000.0)
            }
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "| Avro encoding of a ~300 B reading costs ≤ 1 µs more forwarder CPU per message than the plain path (drain, QoS 1) | {:+.2} µs ({:.2} vs {:.2} µs/msg, medians of {} paired rounds{alone}) | {} |",
            self.extra_us_per_message,
            self.avro_us_per_message,
            self.plain_us_per_message,
            self.plain.len(),
            verdict(self.extra_us_per_message <= 1.0)
        );
        let (mismatched, records) = self
            .avro
            .iter()
            .fold((0, 0), |(m, r), d| (m + d.mismatched, r + d.records));
        let _ = writeln!(
            s,
            "| avro: every record in Kafka is the registered schema's encoding of its reading (decoded by the bench) | {mismatched} mismatched of {records} records | {} |",
            verdict(mismatched == 0 && records > 0)
        );
    }

    pub fn section(&self, s: &mut String) {
        let Some(first) = self.plain.first() else {
            return;
        };
        let d = &first.drain;
        let _ = writeln!(
            s,
            "\n### Encodings (QoS 1, ~300 B JSON, window {})\n\n\
             The expressions section's JSON readings (`seq`, `sent`, `device`, `type`, `temp`, base64 `filler`), \
             drained through a plain rule and through one with `kafka.value: {{format: avro, subject: {}}}` \
             against a real registry (Apicurio, started by the bench; schema id {}, the readings' six fields), \
             in {} rounds of one drain each, back to back, the order alternating by round. \
             Forwarder µs/msg: its scheduler CPU time (ns precision) from the first record Kafka confirmed to the last ack, \
             over the messages acked between (start-up and the registry lookup apart; the whole process, in 10 ms ticks, beside it); \
             each figure is the median over the rounds, and avro − plain the median of each round's difference. \
             Every Avro record read back was decoded by the bench's own decoder and checked against its reading.\n\n\
             | value | msg/s | × plain | forwarder µs/msg | whole process µs/msg | Mosquitto µs/msg | Kafka µs/msg | peak RSS MiB | lost | dup | out of order |\n|---|---|---|---|---|---|---|---|---|---|---|",
            d.window,
            self.subject,
            self.schema_id,
            self.plain.len(),
        );
        for (name, runs, rate, us) in [
            (
                "plain",
                &self.plain,
                self.plain_msgs_per_sec,
                self.plain_us_per_message,
            ),
            (
                "avro",
                &self.avro,
                self.avro_msgs_per_sec,
                self.avro_us_per_message,
            ),
        ] {
            let sum = |f: fn(&EncodingDrain) -> u64| runs.iter().map(f).sum::<u64>();
            let whole = |i: usize| {
                median(
                    runs.iter()
                        .map(|d| {
                            let (f, m, k) = d.drain.cpu_us_per_message();
                            [f, m, k][i]
                        })
                        .collect(),
                )
            };
            let _ = writeln!(
                s,
                "| {name} | {rate:.0} | {:.2} | {us:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {} | {} | {} |",
                rate / self.plain_msgs_per_sec.max(1e-9),
                whole(0),
                whole(1),
                whole(2),
                runs.iter()
                    .map(|d| d.drain.peak_rss_mib)
                    .fold(0.0, f64::max),
                sum(|d| d.drain.lost),
                sum(|d| d.drain.duplicates),
                sum(|d| d.drain.out_of_order)
            );
        }
        let rounds = |runs: &[EncodingDrain]| {
            runs.iter()
                .map(|d| format!("{:.2}", d.drain.steady_us_per_message))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            s,
            "\nAvro − plain: **{:+.2} µs** of forwarder CPU per message (median of the rounds' differences). \
             Rounds, forwarder µs/msg: plain {}; avro {}.",
            self.extra_us_per_message,
            rounds(&self.plain),
            rounds(&self.avro)
        );
        if self.encode_cost.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\nThe encoders alone (`ferry-bench --encode-cost`), in the bench's process, on a ~{} B sensor reading \
             of 13 fields (nested record, array, union, enum): the median of {} runs of {} messages, a new record buffer per message.\n\n\
             | encoding | ns/msg | record |\n|---|---|---|",
            self.encode_cost[0].payload_bytes,
            crate::encode::RUNS,
            crate::encode::MESSAGES
        );
        for c in &self.encode_cost {
            let _ = writeln!(
                s,
                "| {} | {:.0} | {} B |",
                c.format, c.ns_per_message, c.record_bytes
            );
        }
    }
}

/// One forwarder at a fixed low rate (0: idle, subscribed), QoS 1, 300 B.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LowRate {
    pub rate: u64,
    pub seconds: f64,
    pub messages: u64,
    /// The forwarder's CPU over the window, % of one core (scheduler time, ns precision).
    pub cpu_percent: f64,
    /// Times the forwarder's threads were put on a CPU, per second.
    pub wakeups_per_sec: f64,
    /// Mosquitto's CPU over the same window, % of one core, for scale.
    pub mosquitto_cpu_percent: f64,
    pub lost: u64,
}

impl LowRate {
    pub fn line(&self) -> String {
        format!(
            "low rate {} msg/s for {:.0} s ({} messages): forwarder {:.3} % of a core, {:.0} wakeups/s; Mosquitto {:.3} % of a core; lost {}",
            self.rate,
            self.seconds,
            self.messages,
            self.cpu_percent,
            self.wakeups_per_sec,
            self.mosquitto_cpu_percent,
            self.lost
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Latency {
    pub target_rate: u64,
    pub achieved_rate: f64,
    pub messages: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub lost: u64,
    pub duplicates: u64,
    pub cpu_seconds: f64,
    pub peak_rss_mib: f64,
    #[serde(skip)]
    pub sorted_ms: Vec<f64>,
}

impl Latency {
    pub fn line(&self) -> String {
        format!(
            "latency at {} msg/s (sent {:.0}/s, {} msgs): p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms; lost {}, dup {}; forwarder {:.2} CPU s, peak RSS {:.1} MiB",
            self.target_rate,
            self.achieved_rate,
            self.messages,
            self.p50_ms,
            self.p90_ms,
            self.p99_ms,
            self.max_ms,
            self.lost,
            self.duplicates,
            self.cpu_seconds,
            self.peak_rss_mib
        )
    }
}

/// The operator at `rules` rules: creating them, then a steady window with real forwarders
/// reporting and traffic on every rule. `serde(default)`: a results.json written before a
/// field existed still loads (see `--only`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct OperatorFigures {
    pub rules: usize,
    pub groups: usize,
    pub apply_seconds: f64,
    /// From the first create until every rule is Accepted and rendered.
    pub all_accepted_seconds: f64,
    /// From the last create returning until then: the operator's own lag.
    pub after_last_create_seconds: f64,
    /// Forwarder processes standing in for the pods (one per group).
    pub forwarders: usize,
    /// `--status-interval-seconds` and `--status-write-interval-seconds` of the run.
    pub status_interval_seconds: u64,
    pub write_interval_seconds: u64,
    /// `--status-writes-per-second` of the run: the whole operator's status-write budget.
    pub writes_per_second: f64,
    /// The publisher's rate, spread over one MQTT topic per rule.
    pub traffic_msgs_per_sec: f64,
    /// From the forwarders' start until every rule was Forwarding and Ready.
    pub warmup_seconds: f64,
    /// The steady window, measured between its two samples.
    pub steady_seconds: f64,
    pub steady_reconciles: f64,
    /// `ferry_operator_status_writes_total{kind="forwarding_rule"}` over the window.
    pub steady_status_writes: f64,
    /// Failed `/status` reads over the window.
    pub steady_poll_errors: f64,
    /// `apiserver_request_total` over the window: every client (operator, controller-manager,
    /// the bench's two reads of `/metrics`).
    pub apiserver_requests: f64,
    /// Of which on `forwardingrules/status`.
    pub apiserver_rule_status_requests: f64,
    /// User + system CPU of the operator over the window.
    pub operator_cpu_seconds: f64,
    /// Acked by the forwarders over the window.
    pub messages_forwarded: f64,
    /// Published in all (warm-up and window).
    pub messages_published: u64,
    /// Rules with Forwarding True after the window.
    pub rules_forwarding_after: usize,
    pub peak_rss_mib: f64,
    /// The peak once every rule was Accepted, before any forwarder reported.
    pub peak_rss_accepted_mib: f64,
    /// Resident at the start and the end of the steady window: growth there is not a peak.
    pub rss_window_start_mib: f64,
    pub rss_end_mib: f64,
    /// The same steady state under a fresh operator without the budget (write interval 0).
    pub no_budget: Option<NoBudget>,
}

/// A window under an operator with `--status-write-interval-seconds 0`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct NoBudget {
    pub seconds: f64,
    pub status_writes: f64,
    pub reconciles: f64,
    pub apiserver_requests: f64,
    pub apiserver_rule_status_requests: f64,
    pub operator_cpu_seconds: f64,
    /// Of the fresh operator, start included.
    pub peak_rss_mib: f64,
}

impl NoBudget {
    fn per_minute(&self, n: f64) -> f64 {
        n * 60.0 / self.seconds.max(1.0)
    }
}

impl OperatorFigures {
    fn per_minute(&self, n: f64) -> f64 {
        n * 60.0 / self.steady_seconds.max(1.0)
    }
    pub fn reconciles_per_minute(&self) -> f64 {
        self.per_minute(self.steady_reconciles)
    }
    pub fn writes_per_minute(&self) -> f64 {
        self.per_minute(self.steady_status_writes)
    }
    pub fn apiserver_per_minute(&self) -> f64 {
        self.per_minute(self.apiserver_requests)
    }
    pub fn cpu_percent(&self) -> f64 {
        self.operator_cpu_seconds / self.steady_seconds.max(1.0) * 100.0
    }
    /// Without the budget every moving rule is written at every poll: measured when the run
    /// had that window, else that projection.
    pub fn unbudgeted_writes_per_minute(&self) -> f64 {
        match &self.no_budget {
            Some(n) => n.per_minute(n.status_writes),
            None => self.rules as f64 * 60.0 / self.status_interval_seconds.max(1) as f64,
        }
    }
    pub fn writes_per_second(&self) -> f64 {
        self.steady_status_writes / self.steady_seconds.max(1.0)
    }
    /// The budgets hold: at most ~one write per rule per write interval and ~the operator's
    /// writes per second (5 % for "~"), data flowed through every rule, and (when the window is
    /// long enough to see it) the moving counters still reached the rules' status: every rule's,
    /// or as many as the budget had room for.
    pub fn budget_met(&self) -> bool {
        let per_interval = self.steady_status_writes * self.write_interval_seconds as f64
            / self.steady_seconds.max(1.0);
        let long_enough = self.steady_seconds
            >= (self.write_interval_seconds + self.status_interval_seconds) as f64;
        let total = self.writes_per_second * self.steady_seconds;
        let within_total = self.writes_per_second <= 0.0
            || self.writes_per_second() <= self.writes_per_second * 1.05;
        let reached = if self.writes_per_second > 0.0 && total < self.rules as f64 {
            self.steady_status_writes >= total * 0.9
        } else {
            self.steady_status_writes >= self.rules as f64
        };
        per_interval <= self.rules as f64 * 1.05
            && within_total
            && (!long_enough || reached)
            && self.rules_forwarding_after == self.rules
            && self.messages_forwarded > 0.0
    }
    /// The targets: all Accepted within 30 s at 1,000 rules, 60 s at 10,000; peak RSS
    /// 64 MiB at 1,000, 128 MiB at 10,000.
    fn accepted_target(&self) -> f64 {
        if self.rules > 1000 { 60.0 } else { 30.0 }
    }
    fn rss_target(&self) -> f64 {
        if self.rules > 1000 { 128.0 } else { 64.0 }
    }
    fn target_rows(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "| operator: {} rules in {} groups Accepted ≤ {:.0} s | {:.1} s | {} |",
            self.rules,
            self.groups,
            self.accepted_target(),
            self.all_accepted_seconds,
            verdict(self.all_accepted_seconds <= self.accepted_target())
        );
        let _ = writeln!(
            s,
            "| operator: ~0 reconciles/min at steady state (forwarders reporting, traffic on every rule) | {:.1}/min | {} |",
            self.reconciles_per_minute(),
            verdict(self.reconciles_per_minute() < 1.0)
        );
        let _ = writeln!(
            s,
            "| operator: ≤ ~1 status write per rule per minute and ≤ {} writes/s in all under steady traffic ({} rules, forwarders reporting) | {:.0}/min = {:.1}/s (without the budgets: {:.0}/min) | {} |",
            self.writes_per_second,
            self.rules,
            self.writes_per_minute(),
            self.writes_per_second(),
            self.unbudgeted_writes_per_minute(),
            verdict(self.budget_met())
        );
        let _ = writeln!(
            s,
            "| operator RSS ≤ {:.0} MiB at {} rules | {:.1} MiB | {} |",
            self.rss_target(),
            self.rules,
            self.peak_rss_mib,
            verdict(self.peak_rss_mib <= self.rss_target())
        );
        let _ = writeln!(
            s,
            "| operator at steady state: API server requests/min (all clients), operator CPU | {:.0}/min ({:.0}/min on forwardingrules/status); {:.1} % of a core | figures |",
            self.apiserver_per_minute(),
            self.per_minute(self.apiserver_rule_status_requests),
            self.cpu_percent()
        );
    }

    fn section(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n### Operator (real etcd + kube-apiserver + controller-manager, release build)\n\n\
             {} rules in {} groups of one connection created in {:.1} s (10 kubectl processes at once); all Accepted and rendered \
             {:.1} s after the first create, {:.1} s after the last. Then {} release forwarders (one per group, \
             standing in for the StatefulSets' pods, on real Mosquitto and Kafka) report on every rule while \
             {:.0} msg/s go to the rules' {} MQTT topics (a message per rule every {:.0} s); status read every {} s, \
             write interval {} s, status-write budget {} writes/s; every rule Forwarding and Ready {:.1} s after the forwarders started. \
             Steady window of {:.0} s, {}/{} rules Forwarding after it:\n",
            self.rules,
            self.groups,
            self.apply_seconds,
            self.all_accepted_seconds,
            self.after_last_create_seconds,
            self.forwarders,
            self.traffic_msgs_per_sec,
            self.rules,
            self.rules as f64 / self.traffic_msgs_per_sec.max(0.001),
            self.status_interval_seconds,
            self.write_interval_seconds,
            self.writes_per_second,
            self.warmup_seconds,
            self.steady_seconds,
            self.rules_forwarding_after,
            self.rules,
        );
        self.comparison(s);
        let _ = writeln!(
            s,
            "\nOperator CPU over the window {:.1} % of a core ({:.2} s); peak RSS {:.1} MiB ({:.1} MiB once the rules were Accepted, before any forwarder reported; resident {:.1} MiB at the start of the window, {:.1} MiB at its end).",
            self.cpu_percent(),
            self.operator_cpu_seconds,
            self.peak_rss_mib,
            self.peak_rss_accepted_mib,
            self.rss_window_start_mib,
            self.rss_end_mib
        );
        if let Some(n) = &self.no_budget {
            let _ = writeln!(
                s,
                "The restarted operator (the rules there already, forwarders reporting, no budget) peaked at {:.1} MiB.",
                n.peak_rss_mib
            );
        }
    }

    /// Per-minute figures of the steady window, beside those without the budget if measured.
    fn comparison(&self, s: &mut String) {
        let n = self.no_budget.clone().unwrap_or_default();
        let rows = [
            (
                "rule status writes",
                self.steady_status_writes,
                n.status_writes,
            ),
            (
                "API server requests (all clients)",
                self.apiserver_requests,
                n.apiserver_requests,
            ),
            (
                "of which on forwardingrules/status",
                self.apiserver_rule_status_requests,
                n.apiserver_rule_status_requests,
            ),
            ("reconciles", self.steady_reconciles, n.reconciles),
            (
                "CPU of the operator, % of a core",
                self.operator_cpu_seconds / 60.0 * 100.0,
                n.operator_cpu_seconds / 60.0 * 100.0,
            ),
            ("failed /status reads", self.steady_poll_errors, f64::NAN),
            ("messages forwarded", self.messages_forwarded, f64::NAN),
        ];
        let _ = writeln!(
            s,
            "| per minute at steady state | write interval {} s, {} writes/s ({:.0} s) | without the budgets: interval 0, no limit ({:.0} s, operator restarted) |\n|---|---|---|",
            self.write_interval_seconds, self.writes_per_second, self.steady_seconds, n.seconds
        );
        for (what, budget, none) in rows {
            let none = if self.no_budget.is_some() && none.is_finite() {
                format!("{:.1}", n.per_minute(none))
            } else {
                String::new()
            };
            let _ = writeln!(s, "| {what} | {:.1} | {none} |", self.per_minute(budget));
        }
    }

    pub fn line(&self) -> String {
        format!(
            "operator: {} rules in {} groups created in {:.1} s (10 kubectl processes at once); all Accepted and rendered {:.1} s after the first create, {:.1} s after the last; \
             then {} forwarders reporting (status read every {} s, write interval {} s), {:.0} msg/s on every rule's topic, all Forwarding and Ready {:.1} s after the forwarders started; \
             steady {:.0} s: {} rule status writes ({:.0}/min; without the budget {:.0}/min), {} reconciles, {} failed /status reads, \
             {} API server requests ({:.0}/min; {} on forwardingrules/status), {:.0} messages forwarded, {}/{} rules Forwarding after; \
             operator CPU {:.2} s = {:.1} % of a core, peak RSS {:.1} MiB",
            self.rules,
            self.groups,
            self.apply_seconds,
            self.all_accepted_seconds,
            self.after_last_create_seconds,
            self.forwarders,
            self.status_interval_seconds,
            self.write_interval_seconds,
            self.traffic_msgs_per_sec,
            self.warmup_seconds,
            self.steady_seconds,
            self.steady_status_writes,
            self.writes_per_minute(),
            self.unbudgeted_writes_per_minute(),
            self.steady_reconciles,
            self.steady_poll_errors,
            self.apiserver_requests,
            self.apiserver_per_minute(),
            self.apiserver_rule_status_requests,
            self.messages_forwarded,
            self.rules_forwarding_after,
            self.rules,
            self.operator_cpu_seconds,
            self.cpu_percent(),
            self.peak_rss_mib
        )
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub machine: String,
    pub messages: u64,
    pub took_seconds: f64,
    pub drains: Vec<Drain>,
    /// The flood section, if it ran.
    #[serde(default)]
    pub floods: Vec<crate::flood::Flood>,
    /// The first seconds after a start, if it ran.
    #[serde(default)]
    pub startup: Option<crate::startup::Startup>,
    #[serde(default)]
    pub expressions: Vec<ExpressionDrain>,
    #[serde(default)]
    pub evaluation: Vec<EvaluationCost>,
    /// The encodings section, if it ran.
    #[serde(default)]
    pub encodings: Option<EncodingFigures>,
    #[serde(default)]
    pub low_rates: Vec<LowRate>,
    pub windows: Vec<Drain>,
    pub replicas: Vec<Drain>,
    pub latencies: Vec<Latency>,
    #[serde(default)]
    pub rules: Option<crate::rules::RuleFigures>,
    /// The operator at each rule count measured.
    #[serde(default)]
    pub operators: Vec<OperatorFigures>,
    /// Sections measured again alone (`--only`) after the whole run, with when and how long.
    #[serde(default)]
    pub rerun: Vec<String>,
}

pub fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "**missed**" }
}

impl Report {
    /// Throughput of `replicas` forwarders over one, at the same window (both must have run).
    fn scaling(&self, window: u32, replicas: u32) -> Option<f64> {
        let one = self
            .replicas
            .iter()
            .find(|d| d.window == window && d.replicas == 1)?;
        let n = self
            .replicas
            .iter()
            .find(|d| d.window == window && d.replicas == replicas)?;
        Some(n.msgs_per_sec / one.msgs_per_sec)
    }

    /// The largest peak RSS of the single-replica runs (drains, window sweep, latency): the
    /// figure the per-forwarder RSS target is held to.
    fn forwarder_peak_rss_mib(&self) -> f64 {
        self.drains
            .iter()
            .chain(&self.windows)
            .chain(self.expressions.iter().map(|e| &e.drain))
            .chain(
                self.encodings
                    .iter()
                    .flat_map(|e| e.drains().map(|d| &d.drain)),
            )
            .filter(|d| d.replicas == 1)
            .map(|d| d.peak_rss_mib)
            .chain(self.latencies.iter().map(|l| l.peak_rss_mib))
            .fold(0.0, f64::max)
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        self.preamble(&mut s);
        self.cpu_table(&mut s);
        self.low_rate_table(&mut s);
        self.targets(&mut s);
        self.drain_table(&mut s);
        if let Some(st) = &self.startup {
            st.section(&mut s);
        }
        crate::flood::table(&self.floods, &mut s);
        self.expression_table(&mut s);
        if let Some(e) = &self.encodings {
            e.section(&mut s);
        }
        self.window_table(&mut s);
        self.replica_table(&mut s);
        self.latency_table(&mut s);
        if let Some(r) = &self.rules {
            r.section(&mut s);
        }
        for o in &self.operators {
            o.section(&mut s);
        }
        s
    }

    /// Where and how the figures were taken, and which sections were measured again since.
    fn preamble(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "Machine: {}. {} messages per drain; whole run {:.0} s.\n",
            self.machine, self.messages, self.took_seconds
        );
        for note in &self.rerun {
            let _ = writeln!(s, "Measured again alone since: {note}.\n");
        }
    }

    /// Each target beside its measured figure and verdict; a row whose runs are missing is left out.
    fn targets(&self, s: &mut String) {
        let _ = writeln!(s, "\n### Targets\n");
        let _ = writeln!(s, "| target | measured | |\n|---|---|---|");
        if let Some(d) = self.drains.iter().find(|d| d.qos == 1 && d.size == 300) {
            let (forwarder, mosquitto, _) = d.cpu_us_per_message();
            let _ = writeln!(
                s,
                "| forwarder CPU per message ≤ Mosquitto's, same drain (QoS 1, 300 B) | {forwarder:.2} µs vs {mosquitto:.2} µs | {} |",
                verdict(forwarder <= mosquitto)
            );
            let _ = writeln!(
                s,
                "| ≥ 500,000 messages per forwarder CPU-second (~2 µs; a guide: machines differ 2×) | {:.0} ({forwarder:.2} µs) | {} |",
                d.msgs_per_cpu_second,
                verdict(d.msgs_per_cpu_second >= 500_000.0)
            );
        }
        for (rate, limit, what) in [
            (1000, 2.0, "at 1,000 msg/s"),
            (0, 0.2, "idle (subscribed, no traffic)"),
        ] {
            if let Some(l) = self.low_rates.iter().find(|l| l.rate == rate) {
                let _ = writeln!(
                    s,
                    "| forwarder ≤ {limit} % of a core {what} | {:.3} % ({:.0} wakeups/s) | {} |",
                    l.cpu_percent,
                    l.wakeups_per_sec,
                    verdict(l.cpu_percent <= limit)
                );
            }
        }
        if let Some(l) = self.latencies.iter().find(|l| l.target_rate == 10_000) {
            let _ = writeln!(
                s,
                "| live p99 ≤ 20 ms at 10k msg/s | {:.1} ms | {} |",
                l.p99_ms,
                verdict(l.p99_ms <= 20.0)
            );
        }
        let peak = self.forwarder_peak_rss_mib();
        let _ = writeln!(
            s,
            "| forwarder peak RSS ≤ 32 MiB under load | {:.1} MiB (largest of every single-replica run) | {} |",
            peak,
            verdict(peak <= 32.0)
        );
        crate::flood::target_row(&self.floods, s);
        let (lost, out_of_order) = self.lost_and_out_of_order();
        let _ = writeln!(
            s,
            "| every run: 0 lost, 0 out of order | {lost} lost, {out_of_order} out of order | {} |",
            verdict(lost == 0 && out_of_order == 0)
        );
        if let Some(ratio) = self.scaling(crate::REPLICA_WINDOW, 2) {
            let _ = writeln!(
                s,
                "| 2 replicas ≥ 1.6× one where the broker is not the limit | {ratio:.2}× (window {}: one replica window-bound) | {} |",
                crate::REPLICA_WINDOW,
                verdict(ratio >= 1.6)
            );
        }
        self.expression_targets(s);
        if let Some(e) = &self.encodings {
            e.target_rows(s);
        }
        if let Some(r) = &self.rules {
            r.target_rows(s);
        }
        for o in &self.operators {
            o.target_rows(s);
        }
    }

    /// Each drain's rate, CPU and memory, and what arrived.
    fn drain_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n### Backlog drains (1 forwarder, window 1000)\n\n\
             | QoS | size | msg/s | MB/s | msg per CPU-s | peak RSS MiB | lost | dup | out of order |\n|---|---|---|---|---|---|---|---|---|"
        );
        for d in &self.drains {
            let _ = writeln!(
                s,
                "| {} | {} B | {:.0} | {:.1} | {:.0} | {:.1} | {} | {} | {} |",
                d.qos,
                d.size,
                d.msgs_per_sec,
                d.mb_per_sec,
                d.msgs_per_cpu_second,
                d.peak_rss_mib,
                d.lost,
                d.duplicates,
                d.out_of_order
            );
        }
    }

    /// What each process of the pipeline spent per message in the same drain: the first thing
    /// a reader sees, since on 2 shared cores throughput alone cannot say who costs what.
    fn cpu_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "### CPU per message, per process, in the same drain (1 forwarder, window 1000)\n\n\
             Each process's CPU over the same span (the forwarder's start until its last ack), divided by the messages.\n\n\
             | QoS | size | msg/s | forwarder µs/msg | Mosquitto µs/msg | Kafka µs/msg | forwarder's share | forwarder msg per CPU-s |\n|---|---|---|---|---|---|---|---|"
        );
        for d in &self.drains {
            let (f, m, k) = d.cpu_us_per_message();
            let _ = writeln!(
                s,
                "| {} | {} B | {:.0} | {f:.2} | {m:.2} | {k:.2} | {:.0} % | {:.0} |",
                d.qos,
                d.size,
                d.msgs_per_sec,
                d.forwarder_share() * 100.0,
                d.msgs_per_cpu_second
            );
        }
    }

    /// The forwarder at the rates most IoT groups see.
    fn low_rate_table(&self, s: &mut String) {
        if self.low_rates.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\n### Low rates (1 forwarder, QoS 1, 300 B, window 1000)\n\n\
             | msg/s | seconds | forwarder % of a core | forwarder wakeups/s | Mosquitto % of a core | lost |\n|---|---|---|---|---|---|"
        );
        for l in &self.low_rates {
            let _ = writeln!(
                s,
                "| {} | {:.0} | {:.3} | {:.0} | {:.3} | {} |",
                l.rate,
                l.seconds,
                l.cpu_percent,
                l.wakeups_per_sec,
                l.mosquitto_cpu_percent,
                l.lost
            );
        }
    }

    /// Lost and out-of-order messages over every forwarder run.
    fn lost_and_out_of_order(&self) -> (u64, u64) {
        let drains = self
            .drains
            .iter()
            .chain(&self.windows)
            .chain(&self.replicas)
            .chain(self.expressions.iter().map(|e| &e.drain))
            .chain(
                self.encodings
                    .iter()
                    .flat_map(|e| e.drains().map(|d| &d.drain)),
            );
        let lost = drains.clone().map(|d| d.lost).sum::<u64>()
            + self.latencies.iter().map(|l| l.lost).sum::<u64>()
            + self.low_rates.iter().map(|l| l.lost).sum::<u64>()
            + self.floods.iter().map(|f| f.lost).sum::<u64>()
            + self.startup.iter().map(|s| s.lost).sum::<u64>();
        (lost, drains.map(|d| d.out_of_order).sum())
    }

    /// The expression drain of rule `name`, if it ran.
    fn expression(&self, name: &str) -> Option<&ExpressionDrain> {
        self.expressions.iter().find(|e| e.rule == name)
    }

    /// Throughput of expression drain `e` over the plain one's.
    fn times_plain(&self, e: &ExpressionDrain) -> Option<f64> {
        let plain = self.expression("plain")?;
        Some(e.drain.msgs_per_sec / plain.drain.msgs_per_sec.max(1e-9))
    }

    fn expression_targets(&self, s: &mut String) {
        let Some(e) = self.expression("filter + key") else {
            return;
        };
        if let Some(ratio) = self.times_plain(e) {
            let _ = writeln!(
                s,
                "| filter + key expression costs ≤ 30 % of the plain drain's throughput (QoS 1, ~300 B JSON) | {:.0} % ({:.0} vs {:.0} msg/s: {ratio:.2}× plain) | {} |",
                (1.0 - ratio) * 100.0,
                e.drain.msgs_per_sec,
                e.drain.msgs_per_sec / ratio,
                verdict(ratio >= 0.70)
            );
        }
        let _ = writeln!(
            s,
            "| filter + key: no heartbeat in Kafka, every record keyed by its payload's device | {} heartbeats, {} mismatched of {} records | {} |",
            e.heartbeats,
            e.mismatched,
            e.records,
            verdict(e.heartbeats == 0 && e.mismatched == 0)
        );
    }

    /// The expression drains beside the plain one, and what the judge checked.
    fn expression_table(&self, s: &mut String) {
        if self.expressions.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\n### Expressions (QoS 1, ~300 B JSON, window 1000)\n\n\
             The same backlog drain of JSON readings (16 devices, every 10th message a heartbeat, base64 filler), \
             back to back: no expression, `filter` + `kafka.key.expression`, `payload.transform`, \
             in rounds; each row is the round with the median rate (lost, dup and out of order: every round's). \
             Rates count every message drained (filtered ones included), from the first record Kafka confirmed to the last ack.\n\n\
             | rule | msg/s | × plain | forwarder µs/msg | msg per CPU-s | peak RSS MiB | lost | dup | out of order |\n|---|---|---|---|---|---|---|---|---|"
        );
        for e in &self.expressions {
            let d = &e.drain;
            let _ = writeln!(
                s,
                "| {} | {:.0} | {:.2} | {:.2} | {:.0} | {:.1} | {} | {} | {} |",
                e.rule,
                d.msgs_per_sec,
                self.times_plain(e).unwrap_or(f64::NAN),
                d.cpu_us_per_message().0,
                d.msgs_per_cpu_second,
                d.peak_rss_mib,
                d.lost,
                d.duplicates,
                d.out_of_order
            );
        }
        self.evaluation_table(s);
        let _ = writeln!(s);
        for e in &self.expressions {
            let (_, mosquitto, kafka) = e.drain.cpu_us_per_message();
            let _ = writeln!(
                s,
                "- {}{}: {} records read back, {} expected ({} heartbeats, {} mismatched); Mosquitto {mosquitto:.2} µs/msg, Kafka {kafka:.2} µs/msg; rounds {} msg/s.",
                e.rule,
                if e.expressions.is_empty() {
                    String::new()
                } else {
                    format!(" (`{}`)", e.expressions)
                },
                e.records,
                e.expected,
                e.heartbeats,
                e.mismatched,
                e.rounds_msgs_per_sec
                    .iter()
                    .map(|r| format!("{r:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }

    /// The expressions' own cost, without the brokers' noise.
    fn evaluation_table(&self, s: &mut String) {
        if self.evaluation.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\nThe same rules' expressions evaluated alone, in the bench's process, as the pipeline does \
             (a scope per message, `json` holding the fields the expressions read), on JSON readings \
             of two sizes; the fastest of three timings of 100k messages. Beside it, `json` built \
             whole, as before the forwarder knew which fields are read.\n\n\
             | rule | payload | µs/msg | µs/msg with the whole payload built |\n|---|---|---|---|"
        );
        for c in &self.evaluation {
            let _ = writeln!(
                s,
                "| {} | {} B | {:.2} | {:.2} |",
                c.rule, c.payload_bytes, c.us_per_message, c.us_per_message_whole
            );
        }
    }

    fn window_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n### In-flight window (QoS 1, 300 B drain)\n\n| window | msg/s | msg per CPU-s | peak RSS MiB | lost | dup |\n|---|---|---|---|---|---|"
        );
        for d in &self.windows {
            let _ = writeln!(
                s,
                "| {} | {:.0} | {:.0} | {:.1} | {} | {} |",
                d.window,
                d.msgs_per_sec,
                d.msgs_per_cpu_second,
                d.peak_rss_mib,
                d.lost,
                d.duplicates
            );
        }
    }

    fn replica_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n### Replicas on a shared subscription (QoS 1, 300 B drain, all on the same 2 cores)\n\n\
             Every replica shares the same 2 cores with Mosquitto and Kafka, so more replicas add CPU demand, not CPU: \
             they can only help where one replica is bound by its own window, and 4 cannot scale here.\n\n| window per replica | replicas | msg/s | × one | CPU s (all) | lost | dup |\n|---|---|---|---|---|---|---|"
        );
        for d in &self.replicas {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.2} | {:.2} | {} | {} |",
                d.window,
                d.replicas,
                d.msgs_per_sec,
                self.scaling(d.window, d.replicas).unwrap_or(f64::NAN),
                d.cpu_seconds,
                d.lost,
                d.duplicates
            );
        }
    }

    fn latency_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n### End-to-end latency at a fixed rate (QoS 1, 300 B; publish call → read from Kafka)\n\n| rate | messages | p50 ms | p90 ms | p99 ms | max ms | lost | dup | forwarder CPU s | peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        for l in &self.latencies {
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {:.2} | {:.1} |",
                l.target_rate,
                l.messages,
                l.p50_ms,
                l.p90_ms,
                l.p99_ms,
                l.max_ms,
                l.lost,
                l.duplicates,
                l.cpu_seconds,
                l.peak_rss_mib
            );
        }
    }
}

/// CPU model and count, memory, kernel: enough to say where the figures came from.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    // SAFETY: sysconf(3) has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    format!("{cpus} × {model}, {mem_gib:.0} GiB; brokers, load and forwarders all on it")
}

pub fn mosquitto_version() -> String {
    std::process::Command::new("mosquitto")
        .arg("-h")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find_map(|l| l.strip_prefix("mosquitto version ").map(str::to_owned))
        })
        .unwrap_or_else(|| "?".into())
}
