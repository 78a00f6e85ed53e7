//! The forwarding task: routes each MQTT message, hands the ordered window (`window.rs`, which
//! decides what to produce, retry and acknowledge) its targets, and carries out the window's
//! actions against librdkafka and the MQTT client.
//!
//! One task, no task per message, no unbounded queue: the window holds at most `max_inflight`
//! messages and the pipeline stops taking PUBLISHes while it is full.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::ValidConfig;
use ferry_api::config::{KafkaConfig, SchemaRegistry, SubscriptionPlan};
use ferry_api::status::{BlockedBy, Held};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseRecord, Producer};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::eval::{self, EvalError, Evaluated};
use crate::handover;
use crate::kafka::{self, Classified, Fatal, KafkaProducer, ProducerWiring, Replacement, Report};
use crate::limits::{self, Learned, TopicLimits};
use crate::metrics::Metrics;
use crate::mqtt::{Link, Message, Outbound, Subscriptions};
use crate::path::{INLINE_STEPS, Inflight, Judged, Leg, judge};
use crate::record::Unencoded;
use crate::route::{Routed, Router, RuleSet, Target};
use crate::schemas::{self, RegistryCell};
use crate::window::{
    Action, Alone, Backoff, BlockReason, Dest, HeldRecord, Outcome, PermanentReason, Policy, Seq,
    TargetRef, Window,
};

/// How often records waiting on a refusing topic are checked against their stall budget
/// (`Window::expire_stalled`), while any waits: the precision of the budget.
const STALL_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// How often rules' `held` and `blocked_by` are brought up to date while any record is held.
const HOLDS_REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// A held message's MQTT topic is cut to this many bytes in `/status` (MQTT allows 65,535).
const HELD_TOPIC_MAX: usize = 256;

// A delivery opaque packs (producer generation, message sequence, target position). A message
// has at most one target per rule: 14 bits hold `MAX_RULES`. The generation wraps at 64: a
// replaced producer's reports stop within its flush, long before 64 more replacements.
const POS_BITS: u32 = 14;
const SEQ_BITS: u32 = 44;
const GEN_SHIFT: u32 = POS_BITS + SEQ_BITS;
const GENERATIONS: u8 = 1 << (usize::BITS - GEN_SHIFT);
const _: () = assert!(ferry_api::config::MAX_RULES <= 1 << POS_BITS);

fn opaque(generation: u8, seq: u64, pos: usize) -> usize {
    ((generation as usize) << GEN_SHIFT)
        | (((seq as usize) & ((1 << SEQ_BITS) - 1)) << POS_BITS)
        | pos
}

fn unpack(opaque: usize) -> (u8, u64, usize) {
    (
        (opaque >> GEN_SHIFT) as u8,
        ((opaque >> POS_BITS) & ((1 << SEQ_BITS) - 1)) as u64,
        opaque & ((1 << POS_BITS) - 1),
    )
}

/// A new set of rules for the running pipeline (config reload).
pub struct Reload {
    pub router: Router,
    pub subscriptions: SubscriptionPlan,
    /// The new config lists this forwarder in `drain`.
    pub draining: bool,
    /// The rules the new config lists in `retiring`.
    pub retiring: Vec<String>,
    /// The new config subscribes through `$share/<group>/`.
    pub shared: bool,
    /// Where the new rules' schemas are looked up.
    pub schema_registry: Option<SchemaRegistry>,
}

impl Reload {
    pub fn new(config: &ValidConfig, metrics: &Metrics) -> Self {
        Self {
            router: Router::new(config, metrics),
            subscriptions: config.subscription_plan(),
            draining: config.draining(),
            retiring: config.retiring.clone(),
            shared: config.shares_subscriptions(),
            schema_registry: config.schema_registry.clone(),
        }
    }
}

/// How the pipeline ended.
#[derive(Debug, PartialEq, Eq)]
pub struct PipelineExit {
    /// Messages still unconfirmed when the drain bound passed; left unacknowledged, so the
    /// broker redelivers them.
    pub abandoned: usize,
    /// Kafka failed permanently before it was ever reached: the pipeline stopped for it.
    pub kafka_permanent: Option<kafka::PermanentError>,
}

pub struct Pipeline {
    router: Arc<Router>,
    /// The schema registry client of the latest config, for every schema lookup.
    registry: Arc<RegistryCell>,
    metrics: Arc<Metrics>,
    /// Dropped when the pipeline ends: the MQTT driver then disconnects.
    link: Link,
    subscriptions: Subscriptions,
    kafka: KafkaConfig,
    producer: KafkaProducer,
    generation: u8,
    producer_wiring: ProducerWiring,
    reports: mpsc::UnboundedReceiver<Report>,
    fatal: mpsc::UnboundedReceiver<Fatal>,
    /// The backoff of producer replacement after librdkafka's fatal errors.
    replacement: Replacement,
    /// The producer is lost: when to create the next one.
    replace_at: Option<Instant>,
    window: Window<Inflight>,
    max_inflight: usize,
    scratch: Vec<Routed>,
    /// When `held`/`blocked_by` were last brought up to date, if they say anything now.
    holds_reported: Option<Instant>,
    /// A record was held or released since the last report.
    holds_changed: bool,
    /// When records were last checked against their stall budget.
    stalls_checked: Instant,
    /// The identifiers of the filters the broker refused, as of `refused_seen`
    /// (`Metrics::refused_generation`): routing skips them.
    refused_ids: HashSet<u32>,
    refused_seen: u64,
    /// The producer's `message.max.bytes`: what a record's expressions may build.
    record_max_bytes: usize,
    /// The target topics' `max.message.bytes`, as far as learned.
    limits: TopicLimits,
    /// To the task that asks Kafka about topics' limits (`limits::learn`), and its answers.
    limit_asks: mpsc::UnboundedSender<Vec<Arc<str>>>,
    limit_answers: mpsc::UnboundedReceiver<(Arc<str>, Learned)>,
    /// The learning task's ends, until `run` starts it.
    learner: Option<(limits::Asks, limits::Answers)>,
}

/// What the pipeline is connected to.
pub struct Wiring {
    pub metrics: Arc<Metrics>,
    pub link: Link,
    pub subscriptions: Subscriptions,
    /// The fatal channel (`kafka::Fatal`): its sender goes to every producer's callbacks and
    /// to the reachability probe.
    pub fatal: (kafka::FatalSender, mpsc::UnboundedReceiver<Fatal>),
    /// Where rules' schemas are looked up (`kafka.value`).
    pub schema_registry: Option<SchemaRegistry>,
}

impl Pipeline {
    pub fn new(
        router: Router,
        kafka: KafkaConfig,
        wiring: Wiring,
        max_inflight: usize,
    ) -> Result<Self, KafkaError> {
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let (fatal_tx, fatal) = wiring.fatal;
        let producer_wiring = ProducerWiring {
            metrics: Arc::clone(&wiring.metrics),
            reports: reports_tx,
            fatal: fatal_tx,
        };
        let producer = kafka::producer(&kafka, &producer_wiring, 0)?;
        let record_max_bytes = eval::record_max_bytes(&kafka.config);
        let (limit_asks, asks) = mpsc::unbounded_channel();
        let (answers, limit_answers) = mpsc::unbounded_channel();
        let registry = RegistryCell::new(wiring.schema_registry.as_ref());
        schemas::resolve(router.schemas(), &[], &registry, true);
        Ok(Self {
            router: Arc::new(router),
            registry,
            metrics: wiring.metrics,
            link: wiring.link,
            subscriptions: wiring.subscriptions,
            kafka,
            producer,
            generation: 0,
            producer_wiring,
            reports,
            fatal,
            replacement: Replacement::default(),
            replace_at: None,
            window: Window::new(Backoff::default()),
            max_inflight,
            scratch: Vec::new(),
            holds_reported: None,
            holds_changed: false,
            stalls_checked: Instant::now(),
            refused_ids: HashSet::new(),
            refused_seen: 0,
            record_max_bytes,
            limits: TopicLimits::new(record_max_bytes),
            limit_asks,
            limit_answers,
            learner: Some((asks, answers)),
        })
    }

    /// Runs until `shutdown` resolves and the window is drained (or `drain_bound` passes), or
    /// until the reader stops. Then drops the MQTT link: the driver writes the last acks and
    /// disconnects.
    pub async fn run(
        mut self,
        mut inbound: mpsc::Receiver<Message>,
        mut reloads: mpsc::Receiver<Reload>,
        shutdown: impl Future<Output = ()>,
        drain_bound: Duration,
    ) -> PipelineExit {
        tokio::pin!(shutdown);
        let mut accepting = true;
        // None while reading, and for a bound past the clock's end: the drain then ends only
        // when the window is empty.
        let mut drain_deadline: Option<Instant> = None;
        let mut kafka_permanent = None;
        let mut batch = Vec::with_capacity(256);
        let learner = self
            .learner
            .take()
            .map(|(asks, answers)| tokio::spawn(limits::learn(self.kafka.clone(), asks, answers)));
        let mut limits_refresh_at = Instant::now() + limits::REFRESH_INTERVAL;
        loop {
            let replace_at = self.replace_at;
            let retry_at = self.window.next_deadline().map(Instant::from_std);
            let holds_at = self.holds_reported.map(|at| at + HOLDS_REPORT_INTERVAL);
            let stalls_at = self
                .window
                .is_waiting()
                .then(|| self.stalls_checked + STALL_CHECK_INTERVAL);
            let has_room = self.window.len() < self.max_inflight;
            tokio::select! {
                biased;
                n = self.reports.recv_many(&mut batch, 256) => {
                    for report in batch.drain(..n) {
                        self.on_report(report);
                    }
                }
                Some(fatal) = self.fatal.recv() => match fatal {
                    Fatal::Producer { generation, error } => {
                        if generation == self.generation && self.producer.client().fatal_error().is_some() {
                            self.lose_producer(&error);
                        }
                    }
                    Fatal::Permanent(e) => {
                        error!(error = %e, "cannot use kafka, and retrying will not help");
                        kafka_permanent = Some(e);
                    }
                },
                _ = tokio::time::sleep_until(replace_at.unwrap_or_else(Instant::now)), if replace_at.is_some() => {
                    self.replace_producer();
                }
                _ = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if retry_at.is_some() => {
                    self.window.tick(std::time::Instant::now());
                }
                _ = tokio::time::sleep_until(holds_at.unwrap_or_else(Instant::now)), if holds_at.is_some() => {
                    self.report_holds();
                }
                _ = tokio::time::sleep_until(stalls_at.unwrap_or_else(Instant::now)), if stalls_at.is_some() => {
                    self.stalls_checked = Instant::now();
                    self.window.expire_stalled(std::time::Instant::now());
                }
                Some((topic, learned)) = self.limit_answers.recv() => self.limit_learned(topic, learned),
                _ = tokio::time::sleep_until(limits_refresh_at) => {
                    self.limits.refresh();
                    limits_refresh_at = Instant::now() + limits::REFRESH_INTERVAL;
                }
                _ = tokio::time::sleep_until(drain_deadline.unwrap_or_else(Instant::now)), if drain_deadline.is_some() => {
                    warn!(abandoned = self.window.len(), "drain bound passed; leaving unconfirmed messages unacknowledged for redelivery");
                    break;
                }
                () = &mut shutdown, if accepting => {
                    accepting = false;
                    drain_deadline = Instant::now().checked_add(drain_bound);
                    // Closing makes the reader stop handing over messages; those it still held
                    // were never acked and will be redelivered.
                    inbound.close();
                    info!(inflight = self.window.len(), "shutting down: finishing in-flight messages");
                }
                Some(reload) = reloads.recv(), if accepting => self.apply(reload),
                msg = inbound.recv(), if accepting && has_room => match msg {
                    Some(message) => self.accept(message).await,
                    None => {
                        // The reader is gone: nothing more will arrive.
                        accepting = false;
                        drain_deadline = Instant::now().checked_add(drain_bound);
                    }
                },
            }
            if accepting && kafka_permanent.is_some() {
                // Stops like a signal.
                accepting = false;
                drain_deadline = Instant::now().checked_add(drain_bound);
                inbound.close();
            }
            self.run_actions();
            let asks = self.limits.take_asks();
            // Fails only if the learning task ended: the topics stay unknown, judged after the fact.
            if !asks.is_empty() && self.limit_asks.send(asks).is_err() {
                debug!("topic limit learner gone");
            }
            if !accepting && self.window.is_empty() {
                break;
            }
        }
        if let Some(learner) = learner {
            learner.abort();
        }
        // Returning drops `self.link`, which tells the MQTT driver to write the last acks and
        // disconnect.
        PipelineExit {
            abandoned: self.window.len(),
            kafka_permanent,
        }
    }

    /// Swaps in new rules. In-flight messages keep the targets they were routed to, under what
    /// their rules now say about a record Kafka can never take (a held record is judged again
    /// at once). The new router is in place before new filters are subscribed, so nothing
    /// arrives unrouted.
    fn apply(&mut self, reload: Reload) {
        let same_registry = !self.registry.set(reload.schema_registry.as_ref());
        schemas::resolve(
            reload.router.schemas(),
            self.router.schemas(),
            &self.registry,
            same_registry,
        );
        self.router = Arc::new(reload.router);
        self.rejudge();
        let was_draining = self.metrics.handover(|h| {
            let was = h.draining();
            h.set_draining(reload.draining);
            // Listed now: its UNSUBSCRIBE, below, goes out now.
            h.set_retiring(
                reload.retiring.iter().map(String::as_str),
                Instant::now().into_std(),
            );
            was
        });
        if reload.draining && !was_draining {
            info!("listed in drain: unsubscribing, forwarding what the session still holds");
        }
        self.metrics.set_subscribed_shared(reload.shared);
        let wanted = reload.subscriptions.subscribe.clone();
        let old = {
            let mut subs = self
                .subscriptions
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            std::mem::replace(&mut *subs, reload.subscriptions).subscribe
        };
        let (added, removed) = handover::subscription_changes(&old, &wanted);
        let (subscribed, unsubscribed) = (added.len(), removed.len());
        // Queued behind the acks already sent, so they keep their order.
        if !added.is_empty() {
            self.send_mqtt(Outbound::Subscribe(added));
        }
        if !removed.is_empty() {
            self.send_mqtt(Outbound::Unsubscribe(removed));
        }
        info!(subscribed, unsubscribed, "rules reloaded");
    }

    /// Takes `message` into the window.
    async fn accept(&mut self, message: Message) {
        let refused = self.metrics.refused_generation();
        if refused != self.refused_seen {
            self.refused_seen = refused;
            self.refused_ids = (self.metrics.mqtt_refused().keys())
                .map(|f| crate::mqtt::subscription_id(f))
                .collect();
        }
        let alone_for = self.router.route(
            &message.topic,
            &message.subscription_ids,
            &self.refused_ids,
            &mut self.scratch,
        );
        self.metrics.handover(|h| h.routed(alone_for));
        if self.scratch.is_empty() {
            self.metrics.unmatched.inc();
        }
        let now = Instant::now();
        let judged = judge(
            &self.scratch,
            &message,
            now,
            self.record_max_bytes,
            Some(INLINE_STEPS),
        );
        let (judged, message) = match judged {
            Some(judged) => (judged, message),
            None => self.judge_off_thread(message, now).await,
        };
        self.scratch.clear();
        let (inflight, specs) = Inflight::new(judged, message, &mut self.limits, now);
        // The gauge is set once the window's actions are carried out.
        self.window.accept(inflight, specs, now.into_std());
    }

    /// Judges a message whose expressions need more than [`INLINE_STEPS`] on a blocking
    /// thread, while this one keeps the MQTT session and the probes answered. The pipeline
    /// waits for it: messages keep their order.
    async fn judge_off_thread(&mut self, message: Message, now: Instant) -> (Judged, Message) {
        let routed: Vec<Routed> = self.scratch.iter().map(Routed::clone).collect();
        let record_max_bytes = self.record_max_bytes;
        let kept = message.clone();
        let evaluation = tokio::task::spawn_blocking(move || {
            let judged = judge(&routed, &message, now, record_max_bytes, None);
            (judged, message)
        });
        match evaluation.await {
            Ok((Some(judged), message)) => (judged, message),
            // Without a limit, judging always comes to an end.
            Ok((None, message)) => (self.unjudged(now, "was stopped unfinished"), message),
            // A panic in an evaluation: the message fails on each of its rules, not the group.
            Err(error) => (self.unjudged(now, &error.to_string()), kept),
        }
    }

    /// Every routed target of a message whose evaluation did not finish: failed on its rules,
    /// so that the message takes their dead-letter path (or is held) in their name.
    fn unjudged(&self, now: Instant, why: &str) -> Judged {
        error!(error = %why, "a message's evaluation did not finish");
        let legs = self
            .scratch
            .iter()
            .map(|r| Leg {
                target: Arc::clone(&r.target),
                matched: r.matched.clone(),
                sent_at: now,
                evaluated: Some(Box::new(Evaluated::failed(EvalError {
                    reason: PermanentReason::Expression,
                    message: format!("the evaluation {why}"),
                }))),
                encoded: None,
            })
            .collect();
        Judged {
            legs,
            verdicts: Vec::new(),
        }
    }

    /// Carries out what the window asks for, until it asks for nothing more.
    fn run_actions(&mut self) {
        while let Some(action) = self.window.next_action() {
            match action {
                Action::Produce {
                    target,
                    topic,
                    dest,
                } => self.produce(target, &topic, &dest),
                Action::Delivered {
                    target,
                    dead_letter,
                } => self.on_delivered(target, dead_letter),
                Action::Blocked {
                    target,
                    topic,
                    reason,
                    error,
                    failures,
                    news,
                } => self.on_blocked(target, &topic, reason, &error, (failures, news)),
                Action::Held {
                    target,
                    reason,
                    error,
                } => self.on_held(target, reason, &error),
                Action::Dropped {
                    target,
                    reason,
                    error,
                } => self.on_dropped(target, reason, &error),
                Action::Released { target } => self.on_released(target),
                Action::Complete {
                    message: Some(message),
                    ..
                } => self.on_complete(message),
                Action::Complete { message: None, .. } => {}
            }
        }
        self.metrics.inflight.set(self.window.len() as i64);
        if self.holds_changed
            && self
                .holds_reported
                .is_none_or(|at| at.elapsed() >= HOLDS_REPORT_INTERVAL / 4)
        {
            self.report_holds();
        }
    }

    /// Every target of the window takes what its rules (of the new router) say about a record
    /// Kafka can never take. The rules of a target are matched by name; rules that now
    /// disagree leave it as it was, and a target none of whose rules is left is orphaned.
    fn rejudge(&mut self) {
        let policies = self.router.policies();
        let mut rejudged = 0usize;
        self.window.rejudge(
            |target, inflight| {
                let leg = inflight.legs.get(target.pos)?;
                let mut now: Option<&Policy> = None;
                for rule in leg.target.matched(&leg.matched) {
                    match (policies.get(rule.name.as_str()), now) {
                        (None, _) => {}
                        (Some(p), None) => now = Some(p),
                        (Some(p), Some(q)) if p != q => return None,
                        (Some(_), Some(_)) => {}
                    }
                }
                rejudged += 1;
                Some(now.cloned().unwrap_or(Policy::Orphaned))
            },
            std::time::Instant::now(),
        );
        debug!(
            targets = rejudged,
            "in-flight targets judged under the new rules"
        );
        self.holds_changed = true;
    }

    /// Kafka told `topic`'s limit: records of it met first, judged alone until now, are
    /// judged again, so a restart's backlog does not go one record at a time.
    fn limit_learned(&mut self, topic: Arc<str>, learned: Learned) {
        let first = self.limits.learned(Arc::clone(&topic), learned);
        if !first {
            return;
        }
        let judgement = self.limits.judge(&topic);
        self.window.limit_known(&topic, |target, inflight| {
            inflight
                .legs
                .get(target.pos)
                .is_some_and(|leg| leg.alone(&inflight.message, judgement) != Alone::No)
        });
    }

    /// Brings every rule's `held` and `blocked_by` (in `/status` and the metrics) up to date
    /// from the window. The rules of each held record hold. The order of acknowledgements is
    /// stopped by the first held record or, when none is held, by the oldest message while
    /// its records wait on Kafka (a missing topic, a refused ACL, no schema yet): every other
    /// rule with a message at or after it is blocked by the rules that stop it, and says why.
    fn report_holds(&mut self) {
        self.holds_changed = false;
        let (mut held, first_held) = self.held_by_rule();
        let stall = first_held.or_else(|| self.waiting_head());
        let blocked = stall
            .as_ref()
            .map(|stall| self.blocked_behind(stall, &held))
            .unwrap_or_default();
        let mut any = false;
        for rule in self.router.rules() {
            let (record, per_reason) = match held.remove(rule.name.as_str()) {
                Some((record, per_reason)) => (Some(record), per_reason),
                None => (None, [0; PermanentReason::ALL.len()]),
            };
            let blocked_by = stall.as_ref().and_then(|stall| {
                let messages = *blocked.get(rule.name.as_str())?;
                Some(BlockedBy {
                    rules: stall.rules.clone(),
                    messages,
                    since: jiff::Timestamp::now(),
                    waiting: stall.waiting.clone(),
                })
            });
            any |= record.is_some() || blocked_by.is_some();
            rule.set_held(record, &per_reason);
            rule.set_blocked_by(blocked_by);
        }
        self.holds_reported = any.then(Instant::now);
    }

    /// What each rule holds (its first held record, and how many per reason), and the stall
    /// the first held record makes.
    fn held_by_rule(&self) -> (HeldByRule<'_>, Option<Stall>) {
        let mut held: HeldByRule<'_> = HashMap::new();
        let mut first: Option<Stall> = None;
        for h in self.window.held() {
            let Some(m) = self.window.message(h.target.seq) else {
                continue;
            };
            let Some(leg) = m.legs.get(h.target.pos) else {
                continue;
            };
            let reason_index = PermanentReason::ALL
                .iter()
                .position(|r| *r == h.reason)
                .unwrap_or_default();
            for rule in leg.target.matched(&leg.matched) {
                let (record, per_reason) = held.entry(rule.name.as_str()).or_insert_with(|| {
                    (held_record(&h, &m.message), [0; PermanentReason::ALL.len()])
                });
                record.records += 1;
                per_reason[reason_index] += 1;
            }
            let names = leg.target.matched_names_vec(&leg.matched);
            match &mut first {
                None => first = Some(Stall::new(h.target.seq, names, None)),
                Some(stall) if stall.seq == h.target.seq => stall.add(names),
                Some(_) => {}
            }
        }
        (held, first)
    }

    /// The stall the oldest message makes while records of it wait on Kafka (their rules say
    /// `waiting`): its rules that wait, and why the first of them does.
    fn waiting_head(&self) -> Option<Stall> {
        let (seq, unfinished) = self.window.oldest_unfinished()?;
        let m = self.window.message(seq)?;
        let mut stall: Option<Stall> = None;
        for leg in unfinished.iter().filter_map(|pos| m.legs.get(*pos)) {
            for rule in leg.target.matched(&leg.matched) {
                let Some(reason) = rule.waiting_reason() else {
                    continue;
                };
                match &mut stall {
                    None => stall = Some(Stall::new(seq, vec![rule.name.clone()], Some(reason))),
                    Some(stall) => stall.add(vec![rule.name.clone()]),
                }
            }
        }
        stall
    }

    /// How many messages of each rule that neither makes the stall nor holds a record wait
    /// behind it. A message counts once per rule, however many of its targets the rule has.
    fn blocked_behind(&self, stall: &Stall, held: &HeldByRule<'_>) -> HashMap<&str, u64> {
        let mut blocked: HashMap<&str, u64> = HashMap::new();
        let mut rules_of_message: Vec<&str> = Vec::new();
        for (_, m) in self.window.messages().filter(|(seq, _)| *seq >= stall.seq) {
            rules_of_message.clear();
            for leg in &m.legs {
                for rule in leg.target.matched(&leg.matched) {
                    if stall.rules.binary_search(&rule.name).is_err()
                        && !held.contains_key(rule.name.as_str())
                    {
                        rules_of_message.push(rule.name.as_str());
                    }
                }
            }
            rules_of_message.sort_unstable();
            rules_of_message.dedup();
            for rule in &rules_of_message {
                *blocked.entry(rule).or_default() += 1;
            }
        }
        // The window is full (in messages or bytes): no message of any rule is read until the
        // stall ends, so every other rule is stopped, those whose messages wait at the broker
        // included.
        if !self.metrics.mqtt_reading() {
            for rule in self.router.rules() {
                if stall.rules.binary_search(&rule.name).is_err()
                    && !held.contains_key(rule.name.as_str())
                {
                    blocked.entry(rule.name.as_str()).or_default();
                }
            }
        }
        blocked
    }

    fn produce(&mut self, target: TargetRef, topic: &str, dest: &Dest) {
        let TargetRef { seq, pos } = target;
        let opaque = opaque(self.generation, seq, pos);
        let Some(inflight) = self.window.message_mut(seq) else {
            return;
        };
        if let Some(leg) = inflight.legs.get_mut(pos) {
            leg.sent_at = Instant::now();
        }
        let record = match dest {
            Dest::Primary => match inflight.primary_record(pos) {
                None => return,
                Some(Ok(record)) => record,
                Some(Err(unencoded)) => {
                    let outcome = match unencoded {
                        Unencoded::Waiting(error) => Outcome::Blocked {
                            reason: BlockReason::Schema,
                            error,
                        },
                        Unencoded::Mismatch(error) => Outcome::Permanent {
                            reason: PermanentReason::SchemaMismatch,
                            error,
                        },
                    };
                    self.window
                        .on_outcome(target, outcome, std::time::Instant::now());
                    return;
                }
            },
            Dest::DeadLetter { error } => {
                let Some(leg) = inflight.legs.get(pos) else {
                    return;
                };
                let rules = leg.target.matched_names(&leg.matched);
                leg.source(&inflight.message).dead_letter(&rules, error)
            }
        };
        let mut base =
            BaseRecord::<[u8], [u8], usize>::with_opaque_to(topic, opaque).payload(&record.value);
        if let Some(key) = record.key {
            base = base.key(key);
        }
        if let Some(h) = record.owned_headers() {
            base = base.headers(h);
        }
        // Refused before reaching librdkafka's queue (queue full, size over message.max.bytes):
        // handled exactly like a failed delivery.
        if let Err((e, _)) = self.producer.send(base) {
            self.on_result(target, Err(e));
        }
    }

    fn on_report(&mut self, report: Report) {
        let (generation, seq, pos) = unpack(report.opaque);
        if generation != self.generation {
            return; // From a producer replaced (librdkafka's "fatal" error); its records were re-sent.
        }
        self.on_result(TargetRef { seq, pos }, report.result);
    }

    fn on_result(&mut self, target: TargetRef, result: Result<(), KafkaError>) {
        let outcome = match &result {
            Ok(()) => Outcome::Delivered,
            Err(e) => match kafka::classify(e) {
                Classified::Outcome(outcome) => {
                    if let Outcome::Permanent {
                        reason: PermanentReason::TooLarge | PermanentReason::InvalidRecord,
                        ..
                    } = outcome
                        && let Some(topic) = self.primary_topic(target)
                    {
                        // Its limit or policy may have changed since they were learned.
                        self.limits.refused(&topic);
                    }
                    outcome
                }
                Classified::ReplaceProducer => {
                    // The window takes its record, and every other not confirmed, to the next
                    // producer.
                    self.lose_producer(&e.to_string());
                    return;
                }
            },
        };
        if outcome == Outcome::Delivered && !self.window.is_producer_lost() {
            self.replacement.delivered();
        }
        if outcome == Outcome::Delivered
            && let Some(at) = self
                .window
                .message(target.seq)
                .and_then(|m| m.legs.get(target.pos))
                .map(|leg| leg.sent_at)
        {
            self.metrics
                .produce_latency
                .observe(at.elapsed().as_secs_f64());
        }
        self.window
            .on_outcome(target, outcome, std::time::Instant::now());
    }

    /// The Kafka topic of a target of a message, if it resolves to one.
    fn primary_topic(&self, target: TargetRef) -> Option<Arc<str>> {
        let m = self.window.message(target.seq)?;
        m.legs.get(target.pos)?.topic(&m.message.topic).ok()
    }

    /// A target of a message, the rules of it the message matched, and its MQTT topic.
    fn rules_of(&self, target: TargetRef) -> Option<(Arc<Target>, RuleSet, &str)> {
        let m = self.window.message(target.seq)?;
        let leg = m.legs.get(target.pos)?;
        Some((
            Arc::clone(&leg.target),
            leg.matched.clone(),
            &m.message.topic,
        ))
    }

    fn on_delivered(&mut self, target: TargetRef, dead_letter: Option<String>) {
        let Some((t, matched, mqtt_topic)) = self.rules_of(target) else {
            return;
        };
        let Some(error) = dead_letter else {
            for rule in t.matched(&matched) {
                rule.on_forwarded();
            }
            return;
        };
        warn!(
            rule = %t.matched_names(&matched),
            mqtt_topic,
            dead_letter_topic = t.dead_letter.as_deref().unwrap_or_default(),
            error = %error,
            "kafka can never take this message; written to the dead-letter topic"
        );
        for rule in t.matched(&matched) {
            rule.on_dead_lettered(error.clone());
        }
    }

    fn on_blocked(
        &mut self,
        target: TargetRef,
        topic: &str,
        reason: BlockReason,
        error: &str,
        (failures, news): (u32, bool),
    ) {
        // Its rule waits now: if its message is the oldest, the others wait behind it.
        self.holds_changed = true;
        self.metrics.produce_retries.inc();
        let Some((t, matched, _)) = self.rules_of(target) else {
            return;
        };
        // The registry's answer says what waits; it is not Kafka's error.
        let message = match reason {
            BlockReason::Schema => error.to_owned(),
            _ => format!("kafka topic {topic}: {error}"),
        };
        for rule in t.matched(&matched) {
            rule.on_retry(reason.as_str(), message.clone());
        }
        if reason == BlockReason::Schema {
            // The lookup task logs the registry's failures; here only that records wait.
            if news && failures == 1 {
                warn!(
                    rule = %t.matched_names(&matched),
                    kafka_topic = topic,
                    error,
                    "no schema to encode with yet; holding this rule's records"
                );
            }
            return;
        }
        // Once when a topic starts failing, then every 10th failed attempt: a full window
        // failing at once must not log a thousand lines.
        if reason != BlockReason::QueueFull && news && failures % 10 == 1 {
            warn!(
                rule = %t.matched_names(&matched),
                kafka_topic = topic,
                reason = reason.as_str(),
                failures,
                error,
                "kafka produce failed; holding this topic's records and retrying"
            );
            self.metrics.kafka_error(message);
        }
    }

    fn on_held(&mut self, target: TargetRef, reason: PermanentReason, error: &str) {
        self.holds_changed = true;
        let Some((t, matched, mqtt_topic)) = self.rules_of(target) else {
            return;
        };
        error!(
            rule = %t.matched_names(&matched),
            mqtt_topic,
            reason = reason.as_str(),
            error,
            "kafka can never take this message as it is and no dead-letter topic took it; holding it unacknowledged (on_unwritable: hold)"
        );
        let message = format!("{}: {error}", reason.as_str());
        for rule in t.matched(&matched) {
            rule.on_retry(reason.as_str(), message.clone());
        }
    }

    fn on_released(&mut self, target: TargetRef) {
        self.holds_changed = true;
        let Some((t, matched, mqtt_topic)) = self.rules_of(target) else {
            return;
        };
        warn!(
            rule = %t.matched_names(&matched),
            mqtt_topic,
            "the rules of a message Kafka can never take were removed; acknowledged unwritten"
        );
    }

    fn on_dropped(&mut self, target: TargetRef, reason: PermanentReason, error: &str) {
        self.holds_changed = true;
        let Some((t, matched, mqtt_topic)) = self.rules_of(target) else {
            return;
        };
        error!(
            rule = %t.matched_names(&matched),
            mqtt_topic,
            reason = reason.as_str(),
            error,
            "kafka can never take this message and no dead-letter topic took it; dropped (on_unwritable: drop)"
        );
        for rule in t.matched(&matched) {
            rule.on_failed(reason, error.to_owned());
            // Held until now, maybe (the rule was changed to drop): it waits no more.
            rule.stop_waiting_for(reason.as_str());
        }
    }

    fn on_complete(&mut self, done: Inflight) {
        self.metrics
            .ack_latency
            .observe(done.received_at.elapsed().as_secs_f64());
        done.credit_acked();
        // QoS 0 too: the driver frees the message's window slot.
        self.send_mqtt(Outbound::Complete {
            epoch: done.message.epoch,
            qos: done.message.qos,
            pkid: done.message.pkid,
            bytes: done.message.size,
        });
    }

    /// librdkafka's fatal error, from a report, the produce call or the error callback: no
    /// record goes to this producer any more, and a new one is created after the backoff.
    fn lose_producer(&mut self, error: &str) {
        if self.window.is_producer_lost() {
            return;
        }
        self.window.producer_lost();
        self.metrics.producer_fatal_errors.inc();
        self.schedule_replacement(
            &format!("kafka producer unusable (fatal error): {error}"),
            "kafka producer hit a fatal error; holding its unconfirmed records for a new producer",
        );
    }

    /// The next attempt at a producer, after the backoff; says why in the log and `/status`.
    fn schedule_replacement(&mut self, error: &str, what: &'static str) {
        let delay = self.replacement.failed();
        self.replace_at = Some(Instant::now() + delay);
        let retry_in_ms = delay.as_millis() as u64;
        error!(
            error,
            in_a_row = self.replacement.failures(),
            retry_in_ms,
            "{what}"
        );
        self.metrics
            .kafka_error(format!("{error}; next producer in {retry_in_ms} ms"));
    }

    /// Creates the producer that takes over every record not confirmed; if that fails, tries
    /// again after the backoff, the records held meanwhile.
    fn replace_producer(&mut self) {
        self.replace_at = None;
        let generation = (self.generation + 1) % GENERATIONS;
        match kafka::producer(&self.kafka, &self.producer_wiring, generation) {
            Ok(fresh) => {
                let old = std::mem::replace(&mut self.producer, fresh);
                // Dropping purges and flushes for up to 500 ms: keep it off the runtime.
                tokio::task::spawn_blocking(move || drop(old));
                self.generation = generation;
                self.metrics.producer_replaced(true);
                info!(
                    inflight = self.window.len(),
                    "new kafka producer in place; producing every unconfirmed record again"
                );
                self.window.reset_producer(std::time::Instant::now());
            }
            Err(e) => {
                self.metrics.producer_replaced(false);
                self.schedule_replacement(
                    &format!("cannot create a new kafka producer: {e}"),
                    "cannot create a new kafka producer; the records stay held for the next attempt",
                );
            }
        }
    }

    fn send_mqtt(&self, item: Outbound) {
        // Fails only once the driver has ended: the broker redelivers what was not acked, and a
        // new connection subscribes afresh.
        if self.link.outbound.send(item).is_err() {
            debug!("mqtt driver gone; request dropped");
        }
    }
}

/// What `/status` says of a held record (`records` counted by the caller).
/// Per rule: its first held record, and how many it holds per reason.
type HeldByRule<'a> = HashMap<&'a str, (Held, [u64; PermanentReason::ALL.len()])>;

/// What stops the order of acknowledgements: the message at `seq`, for `rules` (sorted, so
/// that a neighbour's `blocked_by` reads the same at every report: a stable condition).
struct Stall {
    seq: Seq,
    rules: Vec<String>,
    /// Why its records wait on Kafka; `None`: a record is held.
    waiting: Option<String>,
}

impl Stall {
    fn new(seq: Seq, rules: Vec<String>, waiting: Option<String>) -> Self {
        let mut stall = Self {
            seq,
            rules: Vec::new(),
            waiting,
        };
        stall.add(rules);
        stall
    }

    fn add(&mut self, rules: Vec<String>) {
        self.rules.extend(rules);
        self.rules.sort_unstable();
        self.rules.dedup();
    }
}

fn held_record(h: &HeldRecord<'_>, message: &Message) -> Held {
    Held {
        reason: h.reason.as_str().to_owned(),
        mqtt_topic: cut(&message.topic, HELD_TOPIC_MAX),
        size: message.payload.len() as u64,
        kafka_topic: h.topic.as_deref().map(str::to_owned),
        dead_letter: h.dead_letter,
        error: h.error.to_owned(),
        records: 0,
        since: jiff::Timestamp::now(),
    }
}

/// `text` cut to at most `max` bytes at a character boundary, marked with `…`.
fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opaque_round_trips() {
        for (g, s, p) in [
            (0u8, 0u64, 0usize),
            (GENERATIONS - 1, (1 << SEQ_BITS) - 1, (1 << POS_BITS) - 1),
            (3, 77, ferry_api::config::MAX_RULES - 1),
            (7, 123_456_789, 17),
        ] {
            assert_eq!(unpack(opaque(g, s, p)), (g, s, p));
        }
    }
}
