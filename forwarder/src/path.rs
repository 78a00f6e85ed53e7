//! One message's way through the forwarder without I/O: routed (`route.rs`), judged by its
//! rules' expressions, taken into the window with its targets' specs, its records built and
//! encoded, and its rules credited once acknowledged. The pipeline does the I/O around it; the
//! cost benchmark (`bench/src/cost`, `make cost`) counts the instructions of exactly these steps.

use std::sync::Arc;
use std::time::SystemTime;

use ferry_api::KafkaTopic;
use ferry_api::expr::JsonReads;
use tokio::time::Instant;

use crate::eval::{self, EvalError, Evaluated, Scope};
use crate::limits::{Judgement, TopicLimits};
use crate::metrics::RuleStats;
use crate::mqtt::Message;
use crate::record::{Record, Source, Unencoded};
use crate::route::{Routed, RuleSet, Target};
use crate::schemas::Ready;
use crate::window::{Alone, PermanentReason, TargetSpec};

/// Steps a message's expressions may take on the runtime's only thread (about a millisecond's
/// worth). A message that needs more is evaluated again, from the start, on a blocking thread:
/// the MQTT keep-alive, the acks and the probes never wait for an evaluation longer than this.
pub const INLINE_STEPS: u64 = 20_000;

/// A message in the window, with what the pipeline needs to build its records.
pub struct Inflight {
    pub(crate) message: Message,
    /// One per target, in the window's target order.
    pub(crate) legs: Vec<Leg>,
    /// Rules the message settled without a record of theirs (their filter was false, or
    /// failed while another rule of the target wrote it): acknowledged with the message.
    pub(crate) settled: Vec<Arc<RuleStats>>,
    pub(crate) received_at: Instant,
}

/// One target of a message.
pub struct Leg {
    pub(crate) target: Arc<Target>,
    /// Which of the target's rules the message matched and passed the filter of: only those
    /// are credited.
    pub(crate) matched: RuleSet,
    /// When its current produce was handed to the producer.
    pub(crate) sent_at: Instant,
    /// What the target's expressions made of the message; `None` for a target without any.
    pub(crate) evaluated: Option<Box<Evaluated>>,
    /// Its value as its schema encoded it, and the schema: a retry under the same schema
    /// produces these bytes again instead of encoding anew.
    pub(crate) encoded: Option<(Arc<Ready>, Vec<u8>)>,
}

impl Inflight {
    /// A judged message as the window holds it, and its targets' specs, in the same order. The
    /// rules it settled without a record are counted now.
    pub fn new(
        judged: Judged,
        message: Message,
        limits: &mut TopicLimits,
        now: Instant,
    ) -> (Inflight, Vec<TargetSpec>) {
        let settled = judged.verdicts.into_iter().map(Verdict::count).collect();
        let legs = judged.legs;
        let specs = legs.iter().map(|leg| leg.spec(&message, limits)).collect();
        let inflight = Inflight {
            message,
            legs,
            settled,
            received_at: now,
        };
        (inflight, specs)
    }

    /// The record of its target at `pos` for that target's own topic, its value encoded once
    /// per schema.
    pub fn primary_record(&mut self, pos: usize) -> Option<Result<Record<'_>, Unencoded>> {
        let Inflight { message, legs, .. } = self;
        Some(legs.get_mut(pos)?.primary_record(message))
    }

    /// Credits every rule it went through: its records were confirmed or settled.
    pub fn credit_acked(&self) {
        for leg in &self.legs {
            for rule in leg.target.matched(&leg.matched) {
                rule.on_acked();
            }
        }
        for rule in &self.settled {
            rule.on_acked();
        }
    }
}

impl Leg {
    /// Its record for its own topic. The encoded value is kept while the target's schema is
    /// the one that encoded it; a reload that replaced the schema encodes it again.
    fn primary_record<'m>(&'m mut self, message: &'m Message) -> Result<Record<'m>, Unencoded> {
        let Some(schema) = self.source(message).schema()? else {
            return Ok(self.source(message).primary());
        };
        let (_, value) = match self.encoded.take() {
            Some(kept) if Arc::ptr_eq(&kept.0, &schema) => self.encoded.insert(kept),
            _ => {
                let value = self.source(message).encode(&schema)?;
                self.encoded.insert((schema, value))
            }
        };
        // Built from the fields: `value` borrows `encoded`, the rest borrow the others.
        let source = Source {
            target: &self.target,
            evaluated: self.evaluated.as_deref(),
            message,
        };
        Ok(source.primary_valued(value))
    }

    /// What its records are built from.
    pub fn source<'m>(&'m self, message: &'m Message) -> Source<'m> {
        Source {
            target: &self.target,
            evaluated: self.evaluated.as_deref(),
            message,
        }
    }

    /// Its Kafka topic, or why it has none.
    pub(crate) fn topic(&self, mqtt_topic: &str) -> Result<Arc<str>, (PermanentReason, String)> {
        let t = &self.target;
        match (self.evaluated.as_deref(), &t.static_topic, &t.topic) {
            (Some(Evaluated { error: Some(e), .. }), _, _) => Err((e.reason, e.message.clone())),
            (
                Some(Evaluated {
                    topic: Some(name), ..
                }),
                _,
                _,
            ) => Ok(Arc::from(name.as_str())),
            (_, Some(name), _) => Ok(Arc::clone(name)),
            (_, None, KafkaTopic::Template(template)) => template
                .resolve(mqtt_topic)
                .map(|name| Arc::from(name.as_ref()))
                .map_err(|e| {
                    (
                        PermanentReason::InvalidTopic,
                        format!("kafka topic {template}: {e}"),
                    )
                }),
            // A topic expression is always evaluated: `evaluated` is there.
            (_, None, KafkaTopic::Expression(e)) => Err((
                PermanentReason::Expression,
                format!("kafka.topic_expression {:?} was not evaluated", e.source()),
            )),
        }
    }

    /// Where the window is to produce it, or why it cannot be; and whether its topic may
    /// refuse its record (too large, or keyless on a compacted topic): then it goes alone.
    fn spec(&self, message: &Message, limits: &mut TopicLimits) -> TargetSpec {
        let topic = self.topic(&message.topic);
        let alone = match &topic {
            Ok(name) => self.alone(message, limits.judge(name)),
            Err(_) => Alone::No,
        };
        TargetSpec {
            topic,
            dead_letter: self.target.dead_letter.clone(),
            on_unwritable: self.target.on_unwritable,
            alone,
            stall_budget: self.target.stall_budget,
        }
    }

    pub(crate) fn alone(&self, message: &Message, judgement: Judgement) -> Alone {
        let may_be_refused = match judgement {
            Judgement::Never => false,
            Judgement::Always => return Alone::UntilLimitKnown,
            Judgement::Check { above, compacted } => {
                (compacted && self.source(message).key().is_none())
                    || above.is_some_and(|limit| self.source(message).primary().may_exceed(limit))
            }
        };
        if may_be_refused {
            Alone::Yes
        } else {
            Alone::No
        }
    }
}

/// What evaluating a message's targets made of it: its legs, and what to count against rules.
pub struct Judged {
    pub(crate) legs: Vec<Leg>,
    pub(crate) verdicts: Vec<Verdict>,
}

/// What a message's evaluation counts against one rule, once the evaluation is final.
pub(crate) enum Verdict {
    Filtered(Arc<RuleStats>),
    Failed(Arc<RuleStats>, EvalError),
}

impl Verdict {
    /// Counts it against its rule; the rule, which the message settled without a record.
    pub(crate) fn count(self) -> Arc<RuleStats> {
        match self {
            Verdict::Filtered(rule) => {
                rule.on_filtered();
                rule
            }
            Verdict::Failed(rule, e) => {
                rule.on_failed(e.reason, e.message);
                rule
            }
        }
    }
}

/// A message's legs: its routed targets less those whose every matched rule's filter was
/// false, each with what its expressions made of the message. `None` when `inline_steps` is
/// given and the expressions needed more: nothing was counted, judge it again without.
pub fn judge(
    routed: &[Routed],
    message: &Message,
    now: Instant,
    record_max_bytes: usize,
    inline_steps: Option<u64>,
) -> Option<Judged> {
    // `json` is parsed once for all of them, with what they read together.
    let json_reads = json_reads(routed);
    let mut scope: Option<Scope<'_>> = None;
    let mut legs = Vec::with_capacity(routed.len());
    let mut verdicts = Vec::new();
    for Routed { target, matched } in routed {
        let target = Arc::clone(target);
        if let Some(error) = too_large(message, &target) {
            // Before any expression: its rules declared they never see such a message.
            legs.push(Leg {
                target,
                matched: matched.clone(),
                sent_at: now,
                evaluated: Some(Box::new(Evaluated::failed(error))),
                encoded: None,
            });
            continue;
        }
        if !target.evaluates {
            legs.push(Leg {
                target,
                matched: matched.clone(),
                sent_at: now,
                evaluated: None,
                encoded: None,
            });
            continue;
        }
        let scope = scope.get_or_insert_with(|| {
            let scope = Scope::new(message, json_reads.clone(), SystemTime::now());
            match inline_steps {
                Some(steps) => scope.inline_only(steps),
                None => scope,
            }
        });
        scope.begin_target();
        let (matched, failed) = filter_rules(scope, &target, matched.clone(), &mut verdicts);
        let evaluated = match failed {
            _ if matched.is_empty() => None,
            Some(error) => Some(Evaluated::failed(error)),
            None => {
                let topic = match &target.topic {
                    KafkaTopic::Expression(e) => Some(e),
                    KafkaTopic::Template(_) => None,
                };
                Some(eval::record(
                    scope,
                    topic,
                    &target.expressions,
                    record_max_bytes,
                ))
            }
        };
        if scope.overran() {
            return None;
        }
        if let Some(evaluated) = evaluated {
            legs.push(Leg {
                target,
                matched,
                sent_at: now,
                evaluated: Some(Box::new(evaluated)),
                encoded: None,
            });
        }
    }
    Some(Judged { legs, verdicts })
}

/// A message over its target's rules' `mqtt.max_message_bytes`, or one the driver did not
/// read (over the connection's): it fails on those rules, as a record Kafka cannot take.
fn too_large(message: &Message, target: &Target) -> Option<EvalError> {
    if let Some(size) = message.unread {
        return Some(EvalError {
            reason: PermanentReason::TooLarge,
            message: format!(
                "the MQTT message is {size} bytes, over the connection's mqtt.max_message_bytes: its payload was skipped unread and is not in this record"
            ),
        });
    }
    (message.size > target.max_message_bytes).then(|| EvalError {
        reason: PermanentReason::TooLarge,
        message: format!(
            "the MQTT message is {} bytes, over its rule's mqtt.max_message_bytes ({})",
            message.size, target.max_message_bytes
        ),
    })
}

/// What the targets a message was routed to read of `json`, together: only what its own
/// targets read is built, whatever other targets of the group read.
fn json_reads(routed: &[Routed]) -> Option<Arc<JsonReads>> {
    let readers = || routed.iter().filter_map(|r| r.target.json_reads.as_ref());
    match (readers().next(), readers().nth(1)) {
        // The usual case, a message with one target: shared, not copied.
        (Some(only), None) => Some(Arc::clone(only)),
        _ => JsonReads::merged(readers().map(|r| &**r)).map(Arc::new),
    }
}

/// Applies the filters of a target's matched rules: the rules that pass (true, or no filter),
/// and the first error of a rule whose filter failed. A failing rule stays in the set only when
/// no rule passed: the message then goes to the dead-letter path in its name; otherwise the
/// record is written for the rules that passed, and the failure is counted against its rule.
fn filter_rules(
    scope: &mut Scope<'_>,
    target: &Target,
    matched: RuleSet,
    verdicts: &mut Vec<Verdict>,
) -> (RuleSet, Option<EvalError>) {
    let mut passed = matched.clone();
    let mut failed: Vec<(usize, EvalError)> = Vec::new();
    for i in matched.iter() {
        let Some(Some(filter)) = target.filters.get(i) else {
            continue;
        };
        match scope.filter(filter) {
            Ok(true) => {}
            Ok(false) => {
                passed.remove(i);
                if let Some(rule) = target.rules.get(i) {
                    verdicts.push(Verdict::Filtered(Arc::clone(rule)));
                }
            }
            Err(e) => {
                passed.remove(i);
                failed.push((i, e));
            }
        }
    }
    if passed.is_empty() {
        // Nothing to write: the failures go to the dead-letter path, in their rules' names.
        for (i, _) in &failed {
            passed.insert(*i);
        }
        return (passed, failed.into_iter().next().map(|(_, e)| e));
    }
    for (i, e) in failed {
        if let Some(rule) = target.rules.get(i) {
            verdicts.push(Verdict::Failed(Arc::clone(rule), e));
        }
    }
    (passed, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::Router;
    use std::collections::HashSet;

    fn router_of(yaml: &str) -> Router {
        let config = ferry_api::load_str(yaml, |_| None)
            .map(|l| l.config)
            .unwrap_or_else(|e| panic!("{e}"));
        Router::new(&config, &crate::metrics::Metrics::new())
    }

    #[test]
    fn a_message_builds_from_json_only_what_its_own_targets_read() {
        let yaml = r##"
mqtt: { host: h, client_id: c }
kafka: { bootstrap_servers: "k:9092" }
rules:
  - name: devices
    mqtt: { topics: ["plant/#"] }
    kafka: { topic: devices, key: { expression: "json.device" } }
  - name: traces
    mqtt: { topics: ["trace/#"] }
    filter: "size(json.trace) > 0"
    kafka: { topic: traces }
  - name: both
    mqtt: { topics: ["plant/trace"] }
    filter: "json.kind == 'x'"
    kafka: { topic: both }
  - name: raw
    mqtt: { topics: ["#"] }
    kafka: { topic: raw }
"##;
        let router = router_of(yaml);
        let reads = |topic: &str| {
            let mut routed = Vec::new();
            router.route(topic, &[], &HashSet::new(), &mut routed);
            json_reads(&routed).map(|r| JsonReads::clone(&r))
        };
        let fields = |names: &[&str]| {
            JsonReads::Fields(
                names
                    .iter()
                    .map(|n| ((*n).to_owned(), JsonReads::Whole))
                    .collect(),
            )
        };
        assert_eq!(reads("plant/1"), Some(fields(&["device"])));
        assert_eq!(reads("trace/1"), Some(fields(&["trace"])));
        assert_eq!(reads("plant/trace"), Some(fields(&["device", "kind"])));
        assert_eq!(reads("elsewhere"), None, "no target of it reads json");
    }

    /// A message whose expressions need more than the inline limit is not judged (and nothing
    /// is counted against its rules) until judged again without one; then it is judged as if
    /// it had never been tried.
    #[test]
    fn a_costly_message_is_judged_again_from_the_start_without_the_inline_limit() {
        let yaml = r##"
mqtt: { host: h, client_id: c }
kafka: { bootstrap_servers: "k:9092" }
rules:
  - name: cheap
    mqtt: { topics: ["#"] }
    filter: "topic == 'nope'"
    kafka: { topic: cheap }
  - name: costly
    mqtt: { topics: ["#"] }
    filter: "json.items.map(x, x * 2).size() > 0"
    kafka: { topic: costly }
"##;
        let router = router_of(yaml);
        let items = vec!["1"; 2_000].join(",");
        let message = Message::new("a/b", format!(r#"{{"items":[{items}]}}"#));
        let mut routed = Vec::new();
        router.route(&message.topic, &[], &HashSet::new(), &mut routed);
        let now = Instant::now();
        let judged = |limit| judge(&routed, &message, now, 1_000_000, limit);
        assert!(judged(Some(1_000)).is_none(), "stopped at the inline limit");
        let Some(whole) = judged(None) else {
            panic!("judged without a limit")
        };
        let topics: Vec<_> = whole
            .legs
            .iter()
            .filter_map(|leg| leg.target.static_topic.as_deref().map(str::to_owned))
            .collect();
        assert_eq!(topics, ["costly"]);
        let filtered: Vec<_> = whole
            .verdicts
            .iter()
            .map(|v| match v {
                Verdict::Filtered(rule) => format!("filtered {}", rule.name),
                Verdict::Failed(rule, e) => format!("failed {}: {}", rule.name, e.message),
            })
            .collect();
        assert_eq!(filtered, ["filtered cheap"], "counted once, when final");
        assert!(
            judged(Some(1_000_000)).is_some(),
            "within the limit: judged at once"
        );
    }

    #[test]
    fn a_record_is_encoded_once_per_schema() {
        let yaml = r##"
mqtt: { host: h, client_id: c }
kafka: { bootstrap_servers: "k:9092" }
schema_registry: { url: "http://registry:8081" }
rules:
  - name: readings
    mqtt: { topics: ["#"] }
    on_unwritable: drop
    kafka: { topic: readings, value: { format: avro, subject: readings } }
"##;
        let router = router_of(yaml);
        let slot = &router.schemas()[0];
        let ready = |id| {
            let fetched = crate::registry::Fetched {
                subject: "readings".to_owned(),
                version: 1,
                id,
                format: slot.spec.format,
                text: r#"{"type":"record","name":"R","fields":[{"name":"t","type":"double"}]}"#
                    .to_owned(),
            };
            Arc::new(crate::schemas::compile(fetched, &slot.spec).unwrap_or_else(|e| panic!("{e}")))
        };
        slot.set_ready(ready(7));
        let message = Message::new("a/b", r#"{"t": 21.5}"#);
        let mut routed = Vec::new();
        router.route(&message.topic, &[], &HashSet::new(), &mut routed);
        let now = Instant::now();
        let Some(judged) = judge(&routed, &message, now, 1_000_000, None) else {
            panic!("judged")
        };
        let mut limits = TopicLimits::new(1_000_000);
        let (mut inflight, _) = Inflight::new(judged, message, &mut limits, now);
        // The record borrows the bytes kept with its leg: a retry takes the same ones.
        let produced = |inflight: &mut Inflight| match inflight.primary_record(0) {
            Some(Ok(record)) => {
                assert!(matches!(record.value, std::borrow::Cow::Borrowed(_)));
                (record.value.to_vec(), record.value.as_ptr())
            }
            _ => panic!("no record"),
        };
        let kept = |inflight: &Inflight| inflight.legs[0].encoded.as_ref().map(|(_, v)| v.as_ptr());
        let (first, at) = produced(&mut inflight);
        assert_eq!(kept(&inflight), Some(at));
        assert_eq!(&first[..5], &[0, 0, 0, 0, 7], "the schema's id");
        assert_eq!(
            produced(&mut inflight),
            (first.clone(), at),
            "not encoded again"
        );
        assert_eq!(kept(&inflight), Some(at));
        // A reload replaced the schema: encoded again, under the new id.
        slot.set_ready(ready(8));
        let (second, _) = produced(&mut inflight);
        assert_eq!(&second[..5], &[0, 0, 0, 0, 8]);
        assert_eq!(second[5..], first[5..]);
    }
}
