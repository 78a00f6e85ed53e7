//! The expressions section: the same backlog drain of ~300 B JSON readings (QoS 1, 1 replica)
//! with no expression, with a filter and a key expression, and with a transform, back to back,
//! so what CEL costs shows beside a like-for-like plain drain.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use anyhow::{Context as _, Result, bail};
use ferry_api::expr::{Expression, JsonReads, compile};
use ferry_forwarder::eval::Scope;
use ferry_forwarder::mqtt::Message;

use crate::encodings::SUBJECT;
use crate::load::{self, Judge, Payload};
use crate::report::{EvaluationCost, ExpressionDrain, Report};
use crate::{Bench, DrainSpec};

pub const FILTER: &str = "json.type != 'heartbeat'";
pub const KEY: &str = "json.device";
/// `seq` and `sent` are carried through so the judge can identify and time each record.
pub const TRANSFORM: &str =
    "{'seq': json.seq, 'sent': json.sent, 'device': json.device, 'temp': json.temp}";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExprRule {
    /// The JSON payloads forwarded as they are: the baseline.
    Plain,
    /// Heartbeats filtered out, records keyed by device.
    FilterKey,
    /// Every message reshaped by `payload.transform`.
    Transform,
    /// No expression; each value encoded as an Avro record through the schema registry
    /// (`kafka.value`, subject [`crate::encodings::SUBJECT`]): the encodings section, not this one.
    Avro,
}

impl ExprRule {
    pub const ALL: [ExprRule; 3] = [ExprRule::Plain, ExprRule::FilterKey, ExprRule::Transform];

    pub fn name(self) -> &'static str {
        match self {
            ExprRule::Plain => "plain",
            ExprRule::FilterKey => "filter + key",
            ExprRule::Transform => "transform",
            ExprRule::Avro => "avro",
        }
    }

    /// The rule's expressions as written in the results.
    pub fn expressions(self) -> String {
        match self {
            ExprRule::Plain => String::new(),
            ExprRule::Avro => format!("value: {{format: avro, subject: {SUBJECT}}}"),
            ExprRule::FilterKey => format!("filter: {FILTER}; key: {KEY}"),
            ExprRule::Transform => format!("transform: {TRANSFORM}"),
        }
    }

    /// The rule's lines in the forwarder config: its `filter`, its `kafka.key` (or
    /// `kafka.value`), its `payload` (each empty when unset), at their indentation in [`Bench::forwarder_config`].
    pub fn yaml(self) -> [String; 3] {
        match self {
            ExprRule::Plain => Default::default(),
            ExprRule::FilterKey => [
                format!("    filter: \"{FILTER}\"\n"),
                format!("      key: {{ expression: \"{KEY}\" }}\n"),
                String::new(),
            ],
            ExprRule::Transform => [
                String::new(),
                String::new(),
                format!("    payload: {{ transform: \"{TRANSFORM}\" }}\n"),
            ],
            // Every reading fits the schema; a rule that encodes needs a way out all the same.
            ExprRule::Avro => [
                String::new(),
                format!("      value: {{ format: avro, subject: {SUBJECT} }}\n"),
                "    on_unwritable: drop\n".to_owned(),
            ],
        }
    }

    pub fn judge(self) -> Judge {
        Judge {
            payload: if self == ExprRule::Avro {
                Payload::Avro
            } else {
                Payload::Json
            },
            no_heartbeats: self == ExprRule::FilterKey,
            key_is_device: self == ExprRule::FilterKey,
        }
    }

    /// The records that must reach Kafka of `n` messages: all but the heartbeats if filtered.
    pub fn expected(self, n: u64) -> u64 {
        match self {
            ExprRule::FilterKey => load::readings(n),
            ExprRule::Plain | ExprRule::Transform | ExprRule::Avro => n,
        }
    }
}

/// Rounds of the three drains: one drain lasts about a second, and on cores shared with both
/// brokers a single one can be off by half.
const ROUNDS: usize = 5;

pub fn run(bench: &mut Bench, window: u32, report: &mut Report) -> Result<()> {
    println!("\n== Expressions: evaluation alone, in this process");
    for size in EVALUATED_SIZES {
        for rule in [ExprRule::FilterKey, ExprRule::Transform] {
            let cost = evaluation_cost(rule, size)?;
            println!(
                "{} on {size} B JSON: {:.2} µs/msg ({:.2} µs/msg building the whole payload)",
                cost.rule, cost.us_per_message, cost.us_per_message_whole
            );
            report.evaluation.push(cost);
        }
    }
    println!("\n== Expressions: QoS 1, ~300 B JSON, window {window}, 1 replica, {ROUNDS} rounds");
    let mut runs: Vec<Vec<ExpressionDrain>> = vec![Vec::new(); ExprRule::ALL.len()];
    for _ in 0..ROUNDS {
        for (i, rule) in ExprRule::ALL.into_iter().enumerate() {
            let spec = DrainSpec::json(rule, window);
            let (drain, arrivals) = bench.drain_judged(spec)?;
            runs[i].push(ExpressionDrain {
                rule: rule.name().to_owned(),
                expressions: rule.expressions(),
                expected: spec.expected(drain.messages),
                records: arrivals.records,
                heartbeats: arrivals.heartbeats,
                mismatched: arrivals.mismatched,
                rounds_msgs_per_sec: Vec::new(),
                drain,
            });
        }
    }
    report
        .expressions
        .extend(runs.into_iter().filter_map(median));
    Ok(())
}

/// The round with the median rate, carrying every round's rate and every round's losses.
fn median(mut rounds: Vec<ExpressionDrain>) -> Option<ExpressionDrain> {
    let rates: Vec<f64> = rounds.iter().map(|r| r.drain.msgs_per_sec).collect();
    let sum = |f: fn(&ExpressionDrain) -> u64, rounds: &[ExpressionDrain]| -> u64 {
        rounds.iter().map(f).sum()
    };
    let (lost, dup, late) = (
        sum(|r| r.drain.lost, &rounds),
        sum(|r| r.drain.duplicates, &rounds),
        sum(|r| r.drain.out_of_order, &rounds),
    );
    let (heartbeats, mismatched) = (
        sum(|r| r.heartbeats, &rounds),
        sum(|r| r.mismatched, &rounds),
    );
    rounds.sort_by(|a, b| a.drain.msgs_per_sec.total_cmp(&b.drain.msgs_per_sec));
    let mid = rounds.len() / 2;
    let mut chosen = rounds.into_iter().nth(mid)?;
    chosen.rounds_msgs_per_sec = rates;
    chosen.drain.lost = lost;
    chosen.drain.duplicates = dup;
    chosen.drain.out_of_order = late;
    chosen.heartbeats = heartbeats;
    chosen.mismatched = mismatched;
    Some(chosen)
}

/// The JSON readings' sizes the evaluation alone is timed on: the drains' and a larger one.
const EVALUATED_SIZES: [usize; 2] = [300, 2048];
/// Messages per timing, and timings (the fastest is kept: the others measured the neighbours).
const EVALUATIONS: u64 = 100_000;
const TIMINGS: usize = 3;

/// What a rule's expressions cost the forwarder per message, evaluated as the pipeline does
/// (a fresh scope per message, `json` holding what the expressions read), without brokers;
/// beside it, the same with `json` built whole, as before the forwarder knew what was read.
fn evaluation_cost(rule: ExprRule, size: usize) -> Result<EvaluationCost> {
    let sources: &[&str] = match rule {
        ExprRule::FilterKey => &[FILTER, KEY],
        ExprRule::Transform => &[TRANSFORM],
        ExprRule::Plain | ExprRule::Avro => bail!("the {} rule evaluates nothing", rule.name()),
    };
    let compiled = sources
        .iter()
        .map(|s| compile(s).with_context(|| format!("{s} does not compile")))
        .collect::<Result<Vec<Expression>>>()?;
    let reads = JsonReads::union(&compiled).context("the rule reads json")?;
    // A thousand different readings (devices, heartbeats), cycled.
    let messages: Vec<Message> = (0..1000u64)
        .map(|seq| Message::new(load::topic_of("b1", seq, 16), load::json_payload(seq, size)))
        .collect();
    // Shared as the pipeline shares a target's: one reference count per message.
    let time = |reads: &Arc<JsonReads>| -> Result<f64> {
        let mut fastest = f64::INFINITY;
        for _ in 0..TIMINGS {
            let start = Instant::now();
            for m in messages.iter().cycle().take(EVALUATIONS as usize) {
                let mut scope = Scope::new(m, Some(Arc::clone(reads)), SystemTime::now());
                evaluate(rule, &compiled, &mut scope)?;
            }
            fastest = fastest.min(start.elapsed().as_secs_f64());
        }
        Ok(fastest * 1e6 / EVALUATIONS as f64)
    };
    Ok(EvaluationCost {
        rule: rule.name().to_owned(),
        payload_bytes: size,
        us_per_message: time(&Arc::new(reads))?,
        us_per_message_whole: time(&Arc::new(JsonReads::Whole))?,
    })
}

/// What the pipeline evaluates for a message of `rule`: the filter, and the key if it passed;
/// or the transform.
fn evaluate(rule: ExprRule, compiled: &[Expression], scope: &mut Scope<'_>) -> Result<()> {
    let failed = |e: ferry_forwarder::eval::EvalError| anyhow::anyhow!("{}", e.message);
    match (rule, compiled) {
        (ExprRule::FilterKey, [filter, key]) => {
            if scope.filter(filter).map_err(failed)? {
                black_box(scope.bytes(key, "kafka.key.expression").map_err(failed)?);
            }
        }
        (ExprRule::Transform, [transform]) => {
            black_box(scope.transform(transform).map_err(failed)?);
        }
        _ => bail!("{} has no such expressions", rule.name()),
    }
    Ok(())
}
