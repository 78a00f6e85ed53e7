//! The ordered window: the forwarder's core as a pure state machine. Messages go in, and
//! actions come out (produce this record, this message is complete and may be acked), driven
//! by produce outcomes and the clock. No I/O, no broker types: unit and property tests drive it.
//!
//! The rules it enforces:
//! - A message completes only when every target is in Kafka (its topic, or its dead-letter
//!   topic), or was dropped by an explicit `on_unwritable: drop`. Messages complete in arrival
//!   order, each exactly once (MQTT requires acks in PUBLISH order, §4.6).
//! - Only a record Kafka can never take *as that record* (too large, an illegal resolved topic
//!   name, rejected as invalid: a permanent failure) leaves the normal path. Everything else (authorization, unknown
//!   topic, outages, a full queue) is retried with capped backoff and holds the window.
//! - Per Kafka topic, records are produced in arrival order, retries included: once a record
//!   of a topic must be produced again, later records of that topic queue behind it in a *lane*.
//!   The lane re-produces its head alone (the probe) once nothing else of the topic is in
//!   flight, and opens again when the probe is through. A "too large" or "invalid record"
//!   error for a record that was not alone may be its batch-mate's fault, so it is judged
//!   again as a probe.
//!   A record refused synchronously (the producer's queue is full) is a failure like any
//!   other: the `Produce` actions of its topic not yet carried out are taken back into the
//!   lane, so nothing queued behind it goes first.
//! - A record its topic may refuse (`TargetSpec::alone`: the pipeline judges it too large for
//!   the topic's limit, or keyless on a compacted topic) never shares a batch: it goes as a
//!   probe, alone, with nothing else of its topic in flight before or after it. So Kafka
//!   never refuses a batch that holds later records of the topic, and no record lands ahead
//!   of an earlier one.
//! - A stall budget bounds how long a rule's records wait on their topic for a reason of the
//!   rule's own (authorization, an unknown topic, a schema not available): once a topic has
//!   refused records that long without taking one (`expire_stalled`), its queued records whose
//!   rule has a dead-letter topic and a budget go there, with the reason, and the window moves
//!   on. Outages and a full queue never count: every rule waits on them alike.
//! - A producer lost to librdkafka's fatal error (`producer_lost`) gets no more records: its
//!   failures say nothing about them, only its deliveries count, and once a new producer is in
//!   place (`reset_producer`) every record not confirmed is produced again, once, in order.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use ferry_api::config::OnUnwritable;

pub type Seq = u64;

/// One target of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TargetRef {
    pub seq: Seq,
    pub pos: usize,
}

/// Where one target of a message goes, as routing resolved it.
#[derive(Debug, Clone)]
pub struct TargetSpec {
    /// The Kafka topic, or why the message cannot be written there as it is (its topic
    /// resolves to no legal name, or an expression failed on it).
    pub topic: Result<Arc<str>, (PermanentReason, String)>,
    pub dead_letter: Option<Arc<str>>,
    pub on_unwritable: OnUnwritable,
    /// Whether its topic may refuse the record (too large, invalid): then it is produced
    /// alone (see the module's rules).
    pub alone: Alone,
    /// How long it may wait on its topic for a reason of its rule's own before it takes the
    /// dead-letter topic (see [`Window::expire_stalled`]); `None`: as long as it takes.
    pub stall_budget: Option<Duration>,
}

/// How the pipeline judged whether a record's topic may refuse it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alone {
    /// It cannot, or nobody knows (Kafka would not tell): it may share a batch.
    No,
    /// It may: it goes alone.
    Yes,
    /// Its topic's limit is being asked: it goes alone unless [`Window::limit_known`] judges
    /// it again first.
    UntilLimitKnown,
}

/// Why a record waits: Kafka may take it later, without anyone changing the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockReason {
    Unauthorized,
    UnknownTopic,
    /// The producer's local queue is full: not an error, retried within milliseconds.
    QueueFull,
    /// Broker down, timeouts, and any error not known to be permanent.
    Unavailable,
    /// The schema registry has not (yet) given the schema its value is encoded with.
    Schema,
}

impl BlockReason {
    /// A reason of the rule's own (its topic, its ACL, its schema), not one every rule meets
    /// alike (an outage, a full queue): only these count against a stall budget.
    pub const fn is_the_rules(self) -> bool {
        matches!(self, Self::Unauthorized | Self::UnknownTopic | Self::Schema)
    }

    pub const ALL: [Self; 5] = [
        Self::Unauthorized,
        Self::UnknownTopic,
        Self::QueueFull,
        Self::Unavailable,
        Self::Schema,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::UnknownTopic => "unknown_topic",
            Self::QueueFull => "queue_full",
            Self::Unavailable => "unavailable",
            Self::Schema => "schema_unavailable",
        }
    }
}

/// Why Kafka can never take a record as it is: its permanent failure (also the `reason` label
/// of dropped messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PermanentReason {
    TooLarge,
    InvalidTopic,
    InvalidRecord,
    /// A rule's expression reads `json`, and the payload does not parse.
    InvalidJson,
    /// A rule's expression failed on the message (a missing field, a wrong type) or returned
    /// what its field cannot use.
    Expression,
    /// The value does not fit the rule's registered schema (`kafka.value`).
    SchemaMismatch,
    /// It waited on its topic longer than its rule's stall budget.
    Stalled,
}

impl PermanentReason {
    pub const ALL: [Self; 7] = [
        Self::TooLarge,
        Self::InvalidTopic,
        Self::InvalidRecord,
        Self::InvalidJson,
        Self::Expression,
        Self::SchemaMismatch,
        Self::Stalled,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::TooLarge => "too_large",
            Self::InvalidTopic => "invalid_topic",
            Self::InvalidRecord => "invalid_record",
            Self::InvalidJson => "invalid_json",
            Self::Expression => "expression_failed",
            Self::SchemaMismatch => "schema_mismatch",
            Self::Stalled => "stalled",
        }
    }
}

/// How one produce attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Delivered,
    /// Kafka may take it later: retried.
    Blocked {
        reason: BlockReason,
        error: String,
    },
    /// Kafka can never take the record as it is.
    Permanent {
        reason: PermanentReason,
        error: String,
    },
}

/// Where a produce goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    /// The target's own topic.
    Primary,
    /// The dead-letter topic, with the error that sent it there.
    DeadLetter { error: String },
}

/// A record held by `on_unwritable: hold`, as `Window::held` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldRecord<'w> {
    pub target: TargetRef,
    pub reason: PermanentReason,
    /// Kafka's error, with the topic that refused it.
    pub error: &'w str,
    /// The Kafka topic that refused it (`None`: its topic resolved to no legal name).
    pub topic: Option<Arc<str>>,
    /// The dead-letter copy was refused too.
    pub dead_letter: bool,
}

/// What a target's rules say about a record Kafka can never take, after a reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    Rule {
        dead_letter: Option<Arc<str>>,
        on_unwritable: OnUnwritable,
    },
    /// Every rule it was routed for is gone: it is written if Kafka takes it, and released
    /// (acknowledged unwritten) if Kafka can never take it.
    Orphaned,
}

impl Policy {
    fn is_of(&self, t: &Target) -> bool {
        match self {
            Self::Rule {
                dead_letter,
                on_unwritable,
            } => !t.orphaned && t.dead_letter == *dead_letter && t.on_unwritable == *on_unwritable,
            Self::Orphaned => t.orphaned,
        }
    }
}

#[derive(Debug)]
pub enum Action<M> {
    /// Hand this record to the producer and report its outcome to `on_outcome`.
    Produce {
        target: TargetRef,
        topic: Arc<str>,
        dest: Dest,
    },
    /// In Kafka: in its topic, or in its dead-letter topic (with the error that sent it there).
    Delivered {
        target: TargetRef,
        dead_letter: Option<String>,
    },
    /// A produce failed and will be retried; the lane of `topic` holds until it succeeds.
    /// `failures` counts the lane's consecutive failed probes (1 for the first failure).
    Blocked {
        target: TargetRef,
        topic: Arc<str>,
        reason: BlockReason,
        error: String,
        failures: u32,
        /// This failure is news for the lane (it just closed, or its probe failed), not one
        /// of many records in flight failing for the same reason: worth a log line.
        news: bool,
    },
    /// Kafka can never take it, it has no dead-letter topic that took it, and its rule says
    /// hold: it waits (retried with backoff where a broker-side fix can help) and holds the
    /// window. Reported once per record.
    Held {
        target: TargetRef,
        reason: PermanentReason,
        error: String,
    },
    /// Every rule it was routed for was removed (config reload) and Kafka can never take it:
    /// given up, for nobody.
    Released { target: TargetRef },
    /// Kafka can never take it and its rule says drop: given up, counted.
    Dropped {
        target: TargetRef,
        reason: PermanentReason,
        error: String,
    },
    /// Every target is done and every earlier message completed: acknowledge it now.
    /// (`message` is always set when returned by `next_action`.)
    Complete { seq: Seq, message: Option<M> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// To its own topic: queued in its lane or out at the producer.
    Primary,
    /// To a dead-letter topic (`topic`), because its own topic refused it for `reason`.
    DeadLettering {
        reason: PermanentReason,
        error: String,
        topic: Arc<str>,
    },
    Done,
}

#[derive(Debug)]
struct Target {
    topic: Option<Arc<str>>,
    dead_letter: Option<Arc<str>>,
    on_unwritable: OnUnwritable,
    state: State,
    /// Out at the producer (a report is due).
    in_flight: bool,
    /// Held (reported once): the refusal that holds it, from its own topic or, when the
    /// dead-letter copy was refused too, from the dead-letter topic.
    held: Option<(PermanentReason, String)>,
    /// Every rule it was routed for is gone (config reload): a permanent failure releases it
    /// instead of holding it.
    orphaned: bool,
    /// Whether its next produce must go alone: its topic may refuse it (judged by the
    /// pipeline, or refused in a batch already), or its topic's limit is not known yet.
    alone: Alone,
    stall_budget: Option<Duration>,
}

impl Target {
    /// Where its next (or current) produce goes.
    fn dest(&self) -> Dest {
        match &self.state {
            State::DeadLettering { error, .. } => Dest::DeadLetter {
                error: error.clone(),
            },
            _ => Dest::Primary,
        }
    }

    /// Its next produce must go alone: its record may be too large for its topic, or it is the
    /// dead-letter copy of a record too large (as large, to a topic that may refuse it too).
    fn goes_alone(&self) -> bool {
        match &self.state {
            State::Primary => self.alone != Alone::No,
            State::DeadLettering { reason, .. } => {
                self.alone != Alone::No || *reason == PermanentReason::TooLarge
            }
            State::Done => false,
        }
    }

    /// The topic its next (or current) produce goes to.
    fn lane_topic(&self) -> Option<&Arc<str>> {
        match &self.state {
            State::Primary => self.topic.as_ref(),
            State::DeadLettering { topic, .. } => Some(topic),
            State::Done => None,
        }
    }
}

#[derive(Debug)]
struct Slot<M> {
    message: Option<M>,
    targets: Vec<Target>,
    remaining: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// Produces go straight to the producer; the queue is empty.
    Open,
    /// The queue waits; at `at`, once nothing of the topic is in flight, its head goes alone.
    Waiting { at: Instant, failures: u32 },
    /// The queue's head is out alone; nothing else of the topic is in flight.
    InFlight { target: TargetRef, failures: u32 },
}

#[derive(Debug)]
struct Lane {
    outstanding: usize,
    queue: BTreeSet<TargetRef>,
    probe: Probe,
    /// Since when the topic refuses records for a reason of the rule's own
    /// ([`BlockReason::is_the_rules`]) without having taken one, with the latest refusal.
    /// Kept while the lane is open again and empty: only a record taken ends it.
    refusing: Option<Refusing>,
}

#[derive(Debug)]
struct Refusing {
    since: Instant,
    reason: BlockReason,
    error: String,
}

impl Lane {
    fn new() -> Self {
        Self {
            outstanding: 0,
            queue: BTreeSet::new(),
            probe: Probe::Open,
            refusing: None,
        }
    }
}

/// Capped exponential backoff for failed probes.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
    /// For `BlockReason::QueueFull`.
    pub queue_full: Duration,
}

impl Backoff {
    fn delay(&self, reason: Option<BlockReason>, failures: u32) -> Duration {
        if reason == Some(BlockReason::QueueFull) {
            return self.queue_full;
        }
        capped_exponential(self.min, self.max, failures)
    }
}

/// min·2^(failures-1), capped at max.
pub fn capped_exponential(min: Duration, max: Duration, failures: u32) -> Duration {
    min.saturating_mul(1u32 << failures.saturating_sub(1).min(20))
        .min(max)
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            min: Duration::from_millis(100),
            max: Duration::from_secs(10),
            queue_full: Duration::from_millis(10),
        }
    }
}

/// Lanes are kept while open and idle to avoid churn; past this many they are pruned.
const IDLE_LANES_KEPT: usize = 256;

pub struct Window<M> {
    slots: VecDeque<Slot<M>>,
    /// Sequence number of `slots[0]`.
    head: Seq,
    /// Slots at the front that are finished and have a `Complete` queued.
    completing: usize,
    lanes: HashMap<Arc<str>, Lane>,
    /// Lanes not `Open`; lets `next_deadline` skip the scan in the common case.
    closed_lanes: usize,
    actions: VecDeque<Action<M>>,
    backoff: Backoff,
    /// Targets held now; lets `held` skip the scan in the common case.
    held_count: usize,
    /// The producer was lost (`producer_lost`) and not yet replaced (`reset_producer`).
    producer_lost: bool,
}

impl<M> Window<M> {
    pub fn new(backoff: Backoff) -> Self {
        Self {
            slots: VecDeque::new(),
            head: 0,
            completing: 0,
            lanes: HashMap::new(),
            closed_lanes: 0,
            actions: VecDeque::new(),
            backoff,
            held_count: 0,
            producer_lost: false,
        }
    }

    /// Messages accepted and not yet completed.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The next action to carry out, in order.
    pub fn next_action(&mut self) -> Option<Action<M>> {
        let mut action = self.actions.pop_front()?;
        // Without a producer a record stays in flight unsent: `reset_producer` sends it.
        while self.producer_lost && matches!(action, Action::Produce { .. }) {
            action = self.actions.pop_front()?;
        }
        let Action::Complete { seq, .. } = action else {
            return Some(action);
        };
        // Completions are queued in order, so this is the front slot.
        let slot = self.slots.pop_front()?;
        self.head += 1;
        self.completing = self.completing.saturating_sub(1);
        Some(Action::Complete {
            seq,
            message: slot.message,
        })
    }

    pub fn message(&self, seq: Seq) -> Option<&M> {
        self.slot(seq).and_then(|s| s.message.as_ref())
    }

    pub fn message_mut(&mut self, seq: Seq) -> Option<&mut M> {
        let idx = usize::try_from(seq.checked_sub(self.head)?).ok()?;
        self.slots.get_mut(idx)?.message.as_mut()
    }

    /// Takes a message with where each of its targets goes.
    pub fn accept(&mut self, message: M, targets: Vec<TargetSpec>, now: Instant) -> Seq {
        let seq = self.head + self.slots.len() as Seq;
        // Positions that cannot be produced; empty (no allocation) for nearly every message.
        let mut invalid: Vec<(usize, (PermanentReason, String))> = Vec::new();
        let targets: Vec<Target> = targets
            .into_iter()
            .enumerate()
            .map(|(pos, spec)| {
                let topic = match spec.topic {
                    Ok(t) => Some(t),
                    Err(e) => {
                        invalid.push((pos, e));
                        None
                    }
                };
                Target {
                    topic,
                    dead_letter: spec.dead_letter,
                    on_unwritable: spec.on_unwritable,
                    state: State::Primary,
                    in_flight: false,
                    held: None,
                    orphaned: false,
                    alone: spec.alone,
                    stall_budget: spec.stall_budget,
                }
            })
            .collect();
        let count = targets.len();
        self.slots.push_back(Slot {
            message: Some(message),
            remaining: count,
            targets,
        });
        let mut invalid = invalid.into_iter().peekable();
        for pos in 0..count {
            let target = TargetRef { seq, pos };
            match invalid.next_if(|(p, _)| *p == pos) {
                None => self.dispatch(target, now),
                Some((_, (reason, error))) => {
                    self.on_permanent(target, reason, error, now);
                }
            }
        }
        self.complete_ready();
        seq
    }

    /// The outcome of a `Produce` action. Outcomes for targets not in flight are ignored, and
    /// so are the failures a lost producer reports (the record is produced again anyway).
    pub fn on_outcome(&mut self, target: TargetRef, outcome: Outcome, now: Instant) {
        if self.producer_lost && outcome != Outcome::Delivered {
            return;
        }
        let Some(t) = self.target_mut(target) else {
            return;
        };
        if !t.in_flight {
            return;
        }
        t.in_flight = false;
        let Some(topic) = t.lane_topic().cloned() else {
            return;
        };
        let dead_letter = match &t.state {
            State::DeadLettering { error, .. } => Some(error.clone()),
            _ => None,
        };
        let Some(lane) = self.lanes.get_mut(&topic) else {
            return;
        };
        lane.outstanding = lane.outstanding.saturating_sub(1);
        let probe_failures = match lane.probe {
            Probe::InFlight {
                target: p,
                failures,
            } if p == target => Some(failures),
            _ => None,
        };
        match &outcome {
            Outcome::Delivered => lane.refusing = None,
            Outcome::Blocked { reason, error } if reason.is_the_rules() => {
                let since = lane.refusing.as_ref().map_or(now, |r| r.since);
                lane.refusing = Some(Refusing {
                    since,
                    reason: *reason,
                    error: error.clone(),
                });
            }
            _ => {}
        }
        match outcome {
            Outcome::Delivered => {
                self.finish(target);
                self.actions.push_back(Action::Delivered {
                    target,
                    dead_letter,
                });
                if probe_failures.is_some() {
                    self.open(&topic, now);
                }
            }
            Outcome::Blocked { reason, error } => {
                let failures = probe_failures.map_or(1, |f| f + 1);
                let closed = self.requeue(&topic, target, Some(reason), failures, now);
                self.actions.push_back(Action::Blocked {
                    target,
                    topic: Arc::clone(&topic),
                    reason,
                    error,
                    failures,
                    news: closed || probe_failures.is_some(),
                });
            }
            Outcome::Permanent {
                reason: PermanentReason::TooLarge | PermanentReason::InvalidRecord,
                ..
            } if probe_failures.is_none() => {
                // Maybe only its batch's fault: judge it again, alone, at once. Alone from now
                // on: were it sent again with the records queued behind it, it could fail
                // them again, each time.
                if let Some(t) = self.target_mut(target) {
                    t.alone = Alone::Yes;
                }
                self.requeue(&topic, target, None, 0, now);
            }
            Outcome::Permanent { reason, error } => {
                let error = format!("kafka topic {topic}: {error}");
                let held = self.on_permanent(target, reason, error, now);
                if probe_failures.is_some() && !held {
                    self.open(&topic, now);
                }
            }
        }
        self.start_probe(&topic, now);
        self.complete_ready();
    }

    /// The producer is unusable (librdkafka's "fatal" error, met in a report, an error callback
    /// or the produce call itself): no record goes out until `reset_producer`, not even the
    /// `Produce` actions already queued, which would otherwise overtake the records before
    /// them or, re-sent by the new producer, be written twice. Its deliveries still count.
    pub fn producer_lost(&mut self) {
        self.producer_lost = true;
        self.retract(None);
    }

    /// The producer was lost, and no new one is in place yet.
    pub fn is_producer_lost(&self) -> bool {
        self.producer_lost
    }

    /// A new producer is in place: every record the old one had (those out at it and those
    /// whose `Produce` was never carried out) is produced again, once, in order.
    pub fn reset_producer(&mut self, now: Instant) {
        self.producer_lost = false;
        // Their targets are in flight: they are dispatched again below.
        self.retract(None);
        for lane in self.lanes.values_mut() {
            lane.outstanding = 0;
            if let Probe::InFlight { target, failures } = lane.probe {
                lane.queue.insert(target);
                lane.probe = Probe::Waiting { at: now, failures };
            }
        }
        let mut pending = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            for (pos, t) in slot.targets.iter_mut().enumerate() {
                if t.in_flight {
                    t.in_flight = false;
                    pending.push(TargetRef {
                        seq: self.head + i as Seq,
                        pos,
                    });
                }
            }
        }
        for target in pending {
            self.dispatch(target, now);
        }
        let topics: Vec<Arc<str>> = self.lanes.keys().cloned().collect();
        for topic in topics {
            self.start_probe(&topic, now);
        }
    }

    /// Whether records wait on a topic (a lane is closed): only then can `expire_stalled` or
    /// `tick` have anything to do.
    pub fn is_waiting(&self) -> bool {
        self.closed_lanes > 0
    }

    /// When `tick` next has something to do, if ever.
    pub fn next_deadline(&self) -> Option<Instant> {
        if self.closed_lanes == 0 {
            return None;
        }
        self.lanes
            .values()
            .filter(|l| l.outstanding == 0)
            .filter_map(|l| match l.probe {
                Probe::Waiting { at, .. } => Some(at),
                _ => None,
            })
            .min()
    }

    /// Starts the probes that are due.
    pub fn tick(&mut self, now: Instant) {
        if self.closed_lanes == 0 {
            return;
        }
        let due: Vec<Arc<str>> = self
            .lanes
            .iter()
            .filter(|(_, l)| {
                l.outstanding == 0 && matches!(l.probe, Probe::Waiting { at, .. } if at <= now)
            })
            .map(|(t, _)| Arc::clone(t))
            .collect();
        for topic in due {
            self.start_probe(&topic, now);
        }
    }

    /// Every record queued on a topic that has refused records for a reason of the rule's own
    /// for longer than the record's stall budget, with a dead-letter topic to go to, goes there
    /// now, with the reason (`PermanentReason::Stalled`), and its place in the topic's order
    /// is given up. Without a dead-letter topic it waits on, shown as waiting: nothing else
    /// can take it without losing it. Called on a timer; the lanes refusing are few.
    pub fn expire_stalled(&mut self, now: Instant) {
        if self.closed_lanes == 0 {
            return;
        }
        let mut expired: Vec<(Arc<str>, TargetRef, String)> = Vec::new();
        for (topic, lane) in &self.lanes {
            let Some(refusing) = &lane.refusing else {
                continue;
            };
            let waited = now.saturating_duration_since(refusing.since);
            for &q in &lane.queue {
                let Some(t) = self.slot(q.seq).and_then(|s| s.targets.get(q.pos)) else {
                    continue;
                };
                let over = t.stall_budget.is_some_and(|b| waited >= b);
                // An orphaned one has no rule, so no budget: it is written when Kafka takes it.
                let eligible = t.state == State::Primary
                    && t.dead_letter.is_some()
                    && t.held.is_none()
                    && !t.orphaned;
                if over && eligible {
                    let error = format!(
                        "kafka topic {topic} refused it for {} s, over its rule's stall budget ({} s): {}: {}",
                        waited.as_secs(),
                        t.stall_budget.unwrap_or_default().as_secs(),
                        refusing.reason.as_str(),
                        refusing.error
                    );
                    expired.push((Arc::clone(topic), q, error));
                }
            }
        }
        let mut topics: Vec<Arc<str>> = Vec::new();
        for (topic, target, error) in expired {
            self.withdraw(&topic, target, now);
            self.on_permanent(target, PermanentReason::Stalled, error, now);
            if !topics.contains(&topic) {
                topics.push(topic);
            }
        }
        for topic in topics {
            self.start_probe(&topic, now);
        }
        self.complete_ready();
    }

    /// The records held now, in arrival order (the first one holds everything after it).
    pub fn held(&self) -> impl Iterator<Item = HeldRecord<'_>> {
        let slots = if self.held_count == 0 {
            self.slots.range(0..0)
        } else {
            self.slots.range(..)
        };
        slots.enumerate().flat_map(move |(i, slot)| {
            let seq = self.head + i as Seq;
            slot.targets.iter().enumerate().filter_map(move |(pos, t)| {
                let (reason, error) = t.held.as_ref()?;
                Some(HeldRecord {
                    target: TargetRef { seq, pos },
                    reason: *reason,
                    error,
                    topic: t.lane_topic().cloned(),
                    dead_letter: matches!(t.state, State::DeadLettering { .. }),
                })
            })
        })
    }

    /// The oldest message not complete yet, and the positions of its targets not done:
    /// acknowledgements go out in order, so every later message waits for it.
    pub fn oldest_unfinished(&self) -> Option<(Seq, Vec<usize>)> {
        let (i, slot) = self
            .slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.message.is_some() && s.remaining > 0)?;
        let unfinished = slot
            .targets
            .iter()
            .enumerate()
            .filter(|(_, t)| t.state != State::Done)
            .map(|(pos, _)| pos)
            .collect();
        Some((self.head + i as Seq, unfinished))
    }

    /// The messages in the window, in arrival order.
    pub fn messages(&self) -> impl Iterator<Item = (Seq, &M)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((self.head + i as Seq, s.message.as_ref()?)))
    }

    /// A reload changed the rules: every unfinished target takes the policy `policy` gives it
    /// now (`None`: unchanged), and a held one is judged again at once under it, so a fix
    /// (a dead-letter topic, `on_unwritable: drop`, the rule removed) releases it. Its place
    /// is kept: a record that goes on to its dead-letter topic is queued there in order.
    pub fn rejudge(
        &mut self,
        mut policy: impl FnMut(TargetRef, &M) -> Option<Policy>,
        now: Instant,
    ) {
        let mut changed: Vec<(TargetRef, Policy)> = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(message) = slot.message.as_ref() else {
                continue;
            };
            let seq = self.head + i as Seq;
            for (pos, t) in slot.targets.iter().enumerate() {
                if t.state == State::Done {
                    continue;
                }
                let target = TargetRef { seq, pos };
                if let Some(p) = policy(target, message).filter(|p| !p.is_of(t)) {
                    changed.push((target, p));
                }
            }
        }
        for (target, p) in changed {
            self.apply_policy(target, p, now);
        }
        self.complete_ready();
    }

    /// `topic`'s limit is known now: each of its records judged alone only until then takes
    /// what `alone` judges. Those queued in its lane go out together once the lane's current
    /// probe is through, up to the first that still must go alone (so the order holds); one
    /// out at the producer already stays as it went.
    pub fn limit_known(&mut self, topic: &str, mut alone: impl FnMut(TargetRef, &M) -> bool) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(message) = slot.message.as_ref() else {
                continue;
            };
            let seq = self.head + i as Seq;
            for (pos, t) in slot.targets.iter_mut().enumerate() {
                if t.alone != Alone::UntilLimitKnown
                    || t.state != State::Primary
                    || t.topic.as_deref() != Some(topic)
                {
                    continue;
                }
                // One out already went alone; were it sent again, it goes alone again.
                t.alone = if t.in_flight || alone(TargetRef { seq, pos }, message) {
                    Alone::Yes
                } else {
                    Alone::No
                };
            }
        }
    }

    fn apply_policy(&mut self, target: TargetRef, policy: Policy, now: Instant) {
        let Some(t) = self.target_mut(target) else {
            return;
        };
        match policy {
            Policy::Rule {
                dead_letter,
                on_unwritable,
            } => {
                t.dead_letter = dead_letter;
                t.on_unwritable = on_unwritable;
                t.orphaned = false;
            }
            Policy::Orphaned => t.orphaned = true,
        }
        // Out at the producer: its outcome is judged under the new policy when it comes.
        if t.in_flight {
            return;
        }
        let Some((reason, error)) = t.held.take() else {
            return;
        };
        let lane_topic = t.lane_topic().cloned();
        self.held_count -= 1;
        if let Some(topic) = &lane_topic {
            self.withdraw(topic, target, now);
        }
        self.on_permanent(target, reason, error, now);
        if let Some(topic) = &lane_topic {
            self.start_probe(topic, now);
        }
    }

    /// Takes a target out of its lane's queue; a lane it headed probes its next head at once
    /// (the held record was what kept it waiting).
    fn withdraw(&mut self, topic: &Arc<str>, target: TargetRef, now: Instant) {
        let Some(lane) = self.lanes.get_mut(topic) else {
            return;
        };
        let was_head = lane.queue.first() == Some(&target);
        if !lane.queue.remove(&target) {
            return;
        }
        if was_head && let Probe::Waiting { .. } = lane.probe {
            lane.probe = Probe::Waiting {
                at: now,
                failures: 0,
            };
        }
    }

    fn slot(&self, seq: Seq) -> Option<&Slot<M>> {
        let idx = usize::try_from(seq.checked_sub(self.head)?).ok()?;
        self.slots.get(idx)
    }

    fn target_mut(&mut self, target: TargetRef) -> Option<&mut Target> {
        let idx = usize::try_from(target.seq.checked_sub(self.head)?).ok()?;
        self.slots.get_mut(idx)?.targets.get_mut(target.pos)
    }

    /// Removes the `Produce` actions not yet taken (of `topic`, or all): they never reached the
    /// producer. Returns their targets, which are still marked in flight.
    fn retract(&mut self, topic: Option<&Arc<str>>) -> Vec<TargetRef> {
        let mut taken = Vec::new();
        self.actions.retain(|a| match a {
            Action::Produce {
                target, topic: t, ..
            } if topic.is_none_or(|topic| topic == t) => {
                taken.push(*target);
                false
            }
            _ => true,
        });
        taken
    }

    /// Sends the target to the producer now, or queues it behind its lane's failure.
    fn dispatch(&mut self, target: TargetRef, now: Instant) {
        let Some(t) = self.target_mut(target) else {
            return;
        };
        let Some(topic) = t.lane_topic().cloned() else {
            return;
        };
        let dest = t.dest();
        let alone = t.goes_alone();
        if self.lanes.len() > IDLE_LANES_KEPT {
            self.lanes
                .retain(|_, l| l.outstanding > 0 || l.probe != Probe::Open || l.refusing.is_some());
        }
        let lane = self
            .lanes
            .entry(Arc::clone(&topic))
            .or_insert_with(Lane::new);
        if lane.probe == Probe::Open && !alone {
            lane.outstanding += 1;
            if let Some(t) = self.target_mut(target) {
                t.in_flight = true;
            }
            self.actions.push_back(Action::Produce {
                target,
                topic,
                dest,
            });
        } else {
            lane.queue.insert(target);
            if lane.probe == Probe::Open {
                // Alone: once what is in flight of the topic is through, as a probe.
                self.closed_lanes += 1;
                lane.probe = Probe::Waiting {
                    at: now,
                    failures: 0,
                };
            }
            self.start_probe(&topic, now);
        }
    }

    /// Puts a failed target back in its lane; the lane waits `reason`'s backoff (none for a
    /// record to judge again alone) before probing. Returns true when the lane was open.
    fn requeue(
        &mut self,
        topic: &Arc<str>,
        target: TargetRef,
        reason: Option<BlockReason>,
        failures: u32,
        now: Instant,
    ) -> bool {
        let delay = match reason {
            None => Duration::ZERO,
            Some(_) => self.backoff.delay(reason, failures),
        };
        // Records of the topic handed out after it but not yet produced (a lane opening sends
        // its whole queue at once, and a synchronous refusal comes back before the rest is
        // carried out) wait behind it instead of overtaking it.
        let untaken = self.retract(Some(topic));
        for t in &untaken {
            if let Some(t) = self.target_mut(*t) {
                t.in_flight = false;
            }
        }
        let Some(lane) = self.lanes.get_mut(topic) else {
            return false;
        };
        lane.outstanding = lane.outstanding.saturating_sub(untaken.len());
        lane.queue.extend(untaken);
        lane.queue.insert(target);
        let was_open = lane.probe == Probe::Open;
        let at = now + delay;
        lane.probe = match lane.probe {
            Probe::Open => {
                self.closed_lanes += 1;
                Probe::Waiting { at, failures }
            }
            // Another record of the lane failed first: keep its schedule.
            Probe::Waiting {
                at: earlier,
                failures: f,
            } => Probe::Waiting {
                at: earlier.min(at),
                failures: f.max(failures),
            },
            Probe::InFlight { .. } => Probe::Waiting { at, failures },
        };
        was_open
    }

    /// The probe went through: everything queued goes out, in order, up to the first record
    /// that must go alone; that one is the lane's next probe, once the others are through.
    fn open(&mut self, topic: &Arc<str>, now: Instant) {
        let first_alone = self.lanes.get(topic).and_then(|lane| {
            lane.queue.iter().copied().find(|&q| {
                self.slot(q.seq)
                    .and_then(|s| s.targets.get(q.pos))
                    .is_some_and(Target::goes_alone)
            })
        });
        let Some(lane) = self.lanes.get_mut(topic) else {
            return;
        };
        let mut queued = std::mem::take(&mut lane.queue);
        if let Some(alone) = first_alone {
            lane.queue = queued.split_off(&alone);
        }
        if lane.queue.is_empty() {
            if lane.probe != Probe::Open {
                self.closed_lanes -= 1;
            }
            lane.probe = Probe::Open;
        } else {
            if lane.probe == Probe::Open {
                self.closed_lanes += 1;
            }
            lane.probe = Probe::Waiting {
                at: now,
                failures: 0,
            };
        }
        let queued: Vec<TargetRef> = queued.into_iter().collect();
        lane.outstanding += queued.len();
        for target in queued {
            let Some(t) = self.target_mut(target) else {
                continue;
            };
            t.in_flight = true;
            let dest = t.dest();
            self.actions.push_back(Action::Produce {
                target,
                topic: Arc::clone(topic),
                dest,
            });
        }
    }

    /// Sends the lane's head alone, if the lane waits, is due, and nothing else of its topic
    /// is in flight.
    fn start_probe(&mut self, topic: &Arc<str>, now: Instant) {
        let Some(lane) = self.lanes.get_mut(topic) else {
            return;
        };
        let Probe::Waiting { at, failures } = lane.probe else {
            return;
        };
        if at > now || lane.outstanding > 0 {
            return;
        }
        let Some(head) = lane.queue.pop_first() else {
            self.closed_lanes -= 1;
            lane.probe = Probe::Open;
            return;
        };
        lane.probe = Probe::InFlight {
            target: head,
            failures,
        };
        lane.outstanding = 1;
        let Some(t) = self.target_mut(head) else {
            return;
        };
        t.in_flight = true;
        let dest = t.dest();
        self.actions.push_back(Action::Produce {
            target: head,
            topic: Arc::clone(topic),
            dest,
        });
    }

    /// Kafka can never take this record as it is: to the dead-letter topic if it has one
    /// (and is not there yet), else as its rule says. Returns true when the record is held.
    fn on_permanent(
        &mut self,
        target: TargetRef,
        reason: PermanentReason,
        error: String,
        now: Instant,
    ) -> bool {
        let Some(t) = self.target_mut(target) else {
            return false;
        };
        if t.orphaned {
            self.finish(target);
            self.actions.push_back(Action::Released { target });
            return false;
        }
        let next_dead_letter = match (&t.state, &t.dead_letter) {
            (State::Primary, Some(d)) => Some((reason, error.clone(), Arc::clone(d))),
            // A reload named another dead-letter topic than the one that refused the copy.
            (
                State::DeadLettering {
                    reason,
                    error,
                    topic,
                },
                Some(d),
            ) if topic != d => Some((*reason, error.clone(), Arc::clone(d))),
            _ => None,
        };
        if let Some((reason, error, topic)) = next_dead_letter {
            t.state = State::DeadLettering {
                reason,
                error,
                topic,
            };
            // What its own topic refused says nothing of the dead-letter topic.
            t.alone = Alone::No;
            self.dispatch(target, now);
            return false;
        }
        // A reload took the dead-letter topic away: back to its own topic, where a broker-side
        // fix can still help.
        if matches!(t.state, State::DeadLettering { .. }) && t.dead_letter.is_none() {
            t.state = State::Primary;
        }
        match t.on_unwritable {
            OnUnwritable::Drop => {
                self.finish(target);
                self.actions.push_back(Action::Dropped {
                    target,
                    reason,
                    error,
                });
                false
            }
            OnUnwritable::Hold => {
                let first = t.held.is_none();
                t.held = Some((reason, error.clone()));
                // Without a lane topic (an illegal name, nowhere to dead-letter it) nothing
                // can help but a new rule: the target stays put, never produced, until a reload
                // re-judges it (`rejudge`). Otherwise a broker-side fix (a larger limit) can
                // help too: keep trying, slowly.
                if let Some(topic) = t.lane_topic().cloned() {
                    let failures = match self.lanes.get(&topic).map(|l| l.probe) {
                        Some(Probe::InFlight { failures, .. }) => failures + 1,
                        _ => 1,
                    };
                    self.requeue(
                        &topic,
                        target,
                        Some(BlockReason::Unavailable),
                        failures,
                        now,
                    );
                }
                if first {
                    self.held_count += 1;
                    self.actions.push_back(Action::Held {
                        target,
                        reason,
                        error,
                    });
                }
                true
            }
        }
    }

    fn finish(&mut self, target: TargetRef) {
        let Some(idx) = target
            .seq
            .checked_sub(self.head)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return;
        };
        let Some(slot) = self.slots.get_mut(idx) else {
            return;
        };
        let Some(t) = slot.targets.get_mut(target.pos) else {
            return;
        };
        if t.state != State::Done {
            t.state = State::Done;
            slot.remaining -= 1;
        }
        if t.held.take().is_some() {
            self.held_count -= 1;
        }
    }

    /// Queues the completion of every finished message at the front, in order. The slot stays
    /// until its `Complete` is taken, so the actions queued before it can still look it up.
    fn complete_ready(&mut self) {
        while self
            .slots
            .get(self.completing)
            .is_some_and(|s| s.remaining == 0)
        {
            self.completing += 1;
            self.actions.push_back(Action::Complete {
                seq: self.head + self.completing as Seq - 1,
                message: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};

    use proptest::prelude::*;

    use super::*;

    const LIMIT: usize = 5;
    /// Every target's stall budget in the model: within reach of a few `Advance`s.
    const STALL_BUDGET: Duration = Duration::from_millis(500);

    /// A message of the model: per target (topic index or invalid, has a dead letter, drop?),
    /// and the record's size (over `LIMIT` is too large for every primary topic).
    #[derive(Debug, Clone)]
    struct Msg {
        targets: Vec<(Option<u8>, bool, bool)>,
        size: usize,
        /// The pipeline knew the topic's limit and judged the record's size: it goes alone
        /// when too large. (Not judged: Kafka would not tell the limit, or it was lowered
        /// since it was learned.)
        judged: bool,
        /// Judged, but its topic's limit is being asked: alone until `Op::Learn`.
        until_known: bool,
    }

    #[derive(Debug, Clone)]
    enum Op {
        Accept(Msg),
        /// Kafka answers the first `n` outstanding records of a topic as one batch.
        Batch(u8, usize),
        /// A topic starts or stops refusing everything (authorization, unknown topic).
        Toggle(u8),
        Advance(u64),
        /// A config reload: every rule now says this about a record Kafka can never take.
        Reload(Rejudged),
        /// The producer's queue is full for the next `n` produce calls: each is refused
        /// synchronously (`QueueFull`), the calls after them are taken.
        QueueFull(u8),
        /// The topic's limit is known: its records judged alone until then are judged by
        /// their size.
        Learn(u8),
        /// The pipeline's timer: records over their stall budget take their dead-letter topic.
        Expire,
        /// librdkafka's fatal error: from the next produce call itself (`sync`), or from a
        /// callback. Of what is out at the producer, the first `landed` of each topic land
        /// (and are reported delivered), the rest are purged. A new producer replaces it at
        /// the next `Advance`.
        Fatal {
            sync: bool,
            landed: usize,
        },
    }

    /// A rule's policy in the model: (dead-letter topic, drop), or the rule was removed.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Rejudged {
        Rule { dlq: bool, drop: bool },
        Removed,
    }

    impl Rejudged {
        fn policy(self) -> Policy {
            match self {
                Self::Rule { dlq, drop } => Policy::Rule {
                    dead_letter: dlq.then(|| Arc::from("dlq")),
                    on_unwritable: if drop {
                        OnUnwritable::Drop
                    } else {
                        OnUnwritable::Hold
                    },
                },
                Self::Removed => Policy::Orphaned,
            }
        }
    }

    fn rejudged() -> impl Strategy<Value = Rejudged> {
        prop_oneof![
            3 => (any::<bool>(), any::<bool>()).prop_map(|(dlq, drop)| Rejudged::Rule { dlq, drop }),
            1 => Just(Rejudged::Removed),
        ]
    }

    const TOPICS: [&str; 4] = ["a", "b", "c", "dlq"];

    fn msg() -> impl Strategy<Value = Msg> {
        let target = (
            prop_oneof![9 => (0u8..3).prop_map(Some), 1 => Just(None)],
            any::<bool>(),
            any::<bool>(),
        );
        (
            proptest::collection::vec(target, 0..3),
            prop_oneof![8 => Just(1usize), 1 => Just(LIMIT * 2)],
            prop_oneof![3 => Just(true), 1 => Just(false)],
            any::<bool>(),
        )
            .prop_map(|(targets, size, judged, until_known)| Msg {
                targets,
                size,
                judged,
                until_known: judged && until_known,
            })
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => msg().prop_map(Op::Accept),
            4 => (0u8..4, 1usize..4).prop_map(|(t, n)| Op::Batch(t, n)),
            1 => (0u8..4).prop_map(Op::Toggle),
            1 => (0u64..300).prop_map(Op::Advance),
            1 => rejudged().prop_map(Op::Reload),
            1 => (1u8..4).prop_map(Op::QueueFull),
            1 => (0u8..3).prop_map(Op::Learn),
            1 => Just(Op::Expire),
            1 => (any::<bool>(), 0usize..3).prop_map(|(sync, landed)| Op::Fatal { sync, landed }),
        ]
    }

    /// A model of Kafka behind librdkafka: per topic, records in flight in produce order,
    /// answered in batches.
    struct Sim {
        window: Window<usize>,
        now: Instant,
        msgs: Vec<Msg>,
        outstanding: BTreeMap<usize, VecDeque<(TargetRef, bool)>>,
        refusing: HashSet<usize>,
        logs: BTreeMap<usize, Vec<TargetRef>>,
        completed: Vec<Seq>,
        dropped: HashSet<TargetRef>,
        held: HashSet<TargetRef>,
        released: HashSet<TargetRef>,
        /// Targets finished (delivered, dropped, released): a reload no longer changes them.
        finished: HashSet<TargetRef>,
        /// Every policy each target had after a reload (its own at accept time aside).
        policies: BTreeMap<TargetRef, Vec<Rejudged>>,
        /// Records that were refused in a batch too large: records already in flight behind
        /// them may land first. Only a record too large that the pipeline did not judge (its
        /// topic's limit unknown) can make such a batch: the check asserts so.
        in_too_large_batch: HashSet<TargetRef>,
        /// Produce calls still to be refused as `QueueFull`.
        queue_full: u8,
        /// Targets sent to the dead-letter topic over their stall budget.
        stalled: HashSet<TargetRef>,
        /// The next produce call meets a fatal error: (records of each topic that land).
        fatal_on_produce: Option<usize>,
    }

    impl Sim {
        fn new() -> Self {
            Self {
                window: Window::new(Backoff::default()),
                now: Instant::now(),
                msgs: Vec::new(),
                outstanding: BTreeMap::new(),
                refusing: HashSet::new(),
                logs: BTreeMap::new(),
                completed: Vec::new(),
                dropped: HashSet::new(),
                held: HashSet::new(),
                released: HashSet::new(),
                finished: HashSet::new(),
                policies: BTreeMap::new(),
                in_too_large_batch: HashSet::new(),
                queue_full: 0,
                stalled: HashSet::new(),
                fatal_on_produce: None,
            }
        }

        fn topic_index(name: &str) -> usize {
            TOPICS.iter().position(|t| *t == name).unwrap_or(0)
        }

        fn apply(&mut self, op: Op) {
            match op {
                Op::Accept(m) => {
                    let alone = if m.until_known {
                        Alone::UntilLimitKnown
                    } else if m.judged && m.size > LIMIT {
                        Alone::Yes
                    } else {
                        Alone::No
                    };
                    let specs = m
                        .targets
                        .iter()
                        .map(|(topic, dlq, drop)| TargetSpec {
                            topic: topic.map(|t| Arc::from(TOPICS[usize::from(t)])).ok_or_else(
                                || (PermanentReason::InvalidTopic, "bad template".to_owned()),
                            ),
                            dead_letter: dlq.then(|| Arc::from("dlq")),
                            on_unwritable: if *drop {
                                OnUnwritable::Drop
                            } else {
                                OnUnwritable::Hold
                            },
                            alone,
                            stall_budget: Some(STALL_BUDGET),
                        })
                        .collect();
                    let id = self.msgs.len();
                    self.msgs.push(m);
                    self.window.accept(id, specs, self.now);
                }
                Op::Batch(t, n) => self.batch(usize::from(t), n),
                Op::Toggle(t) => {
                    let t = usize::from(t);
                    if !self.refusing.remove(&t) {
                        self.refusing.insert(t);
                    }
                }
                Op::Advance(ms) => {
                    self.now += Duration::from_millis(ms);
                    if self.window.is_producer_lost() {
                        self.window.reset_producer(self.now);
                    }
                    self.window.tick(self.now);
                }
                Op::Reload(r) => self.reload(r),
                Op::QueueFull(n) => self.queue_full = n,
                Op::Learn(t) => {
                    let msgs = &self.msgs;
                    self.window
                        .limit_known(TOPICS[usize::from(t)], |_, &id| msgs[id].size > LIMIT);
                }
                Op::Expire => self.window.expire_stalled(self.now),
                Op::Fatal { sync: true, landed } => self.fatal_on_produce = Some(landed),
                Op::Fatal {
                    sync: false,
                    landed,
                } => self.lose_producer(landed),
            }
            self.drain();
        }

        /// The producer meets a fatal error: of what is out at it, the first `landed` of each
        /// topic land, the rest are purged.
        fn lose_producer(&mut self, landed: usize) {
            self.window.producer_lost();
            for (topic, queue) in std::mem::take(&mut self.outstanding) {
                // Up to the first too large (its batch fails).
                let fits = |(t, dl): &(TargetRef, bool)| {
                    *dl || topic == 3 || self.msgs[self.msg_of(*t)].size <= LIMIT
                };
                let landing: Vec<TargetRef> = queue
                    .iter()
                    .take(landed)
                    .take_while(|r| fits(r))
                    .map(|(t, _)| *t)
                    .collect();
                for t in landing {
                    self.logs.entry(topic).or_default().push(t);
                    self.window.on_outcome(t, Outcome::Delivered, self.now);
                }
            }
            // Its purged records are reported as failed: they say nothing.
            let purged = Outcome::Blocked {
                reason: BlockReason::Unavailable,
                error: "purged".into(),
            };
            let in_flight: Vec<TargetRef> = self
                .window
                .slots
                .iter()
                .enumerate()
                .flat_map(|(i, s)| {
                    let seq = self.window.head + i as Seq;
                    s.targets
                        .iter()
                        .enumerate()
                        .filter(|(_, t)| t.in_flight)
                        .map(move |(pos, _)| TargetRef { seq, pos })
                })
                .collect();
            for t in in_flight {
                self.window.on_outcome(t, purged.clone(), self.now);
            }
        }

        fn reload(&mut self, r: Rejudged) {
            let first = self.completed.len() as Seq;
            for (seq, m) in self.msgs.iter().enumerate().skip(first as usize) {
                for pos in 0..m.targets.len() {
                    let t = TargetRef {
                        seq: seq as Seq,
                        pos,
                    };
                    if !self.finished.contains(&t) {
                        self.policies.entry(t).or_default().push(r);
                    }
                }
            }
            self.window.rejudge(|_, _| Some(r.policy()), self.now);
        }

        /// The policy a target has now, and whether it ever had a dead-letter topic, `drop`,
        /// or was orphaned.
        fn policy_of(&self, t: TargetRef) -> (Rejudged, bool, bool, bool) {
            let (_, dlq, drop) = self.msgs[t.seq as usize].targets[t.pos];
            let own = Rejudged::Rule { dlq, drop };
            let all: Vec<Rejudged> = std::iter::once(own)
                .chain(self.policies.get(&t).into_iter().flatten().copied())
                .collect();
            let last = all.last().copied().unwrap_or(own);
            let ever = |f: fn(&Rejudged) -> bool| all.iter().any(f);
            (
                last,
                ever(|p| matches!(p, Rejudged::Rule { dlq: true, .. })),
                ever(|p| matches!(p, Rejudged::Rule { drop: true, .. })),
                ever(|p| *p == Rejudged::Removed),
            )
        }

        fn batch(&mut self, topic: usize, n: usize) {
            let Some(queue) = self.outstanding.get_mut(&topic) else {
                return;
            };
            let batch: Vec<(TargetRef, bool)> = queue.drain(..n.min(queue.len())).collect();
            if batch.is_empty() {
                return;
            }
            let too_large = topic != 3
                && batch
                    .iter()
                    .any(|(t, dl)| !dl && self.msgs[self.msg_of(*t)].size > LIMIT);
            let failure = if self.refusing.contains(&topic) {
                Some(Outcome::Blocked {
                    reason: BlockReason::Unauthorized,
                    error: "denied".into(),
                })
            } else if too_large {
                Some(Outcome::Permanent {
                    reason: PermanentReason::TooLarge,
                    error: "too large".into(),
                })
            } else {
                None
            };
            // A refusing topic refuses everything in flight; a batch too large fails alone, and
            // later batches of the partition may still land before its records are sent again.
            let refused = matches!(failure, Some(Outcome::Blocked { .. }));
            let behind: Vec<(TargetRef, bool)> = match self.outstanding.get_mut(&topic) {
                Some(queue) if refused => queue.drain(..).collect(),
                _ => Vec::new(),
            };
            if !refused && too_large {
                assert!(
                    batch.len() == 1
                        || batch
                            .iter()
                            .any(|(t, dl)| !dl && !self.msgs[self.msg_of(*t)].judged),
                    "a record judged too large shared a batch: {batch:?}"
                );
                self.in_too_large_batch
                    .extend(batch.iter().map(|(t, _)| *t));
            }
            for (t, _) in &batch {
                match &failure {
                    None => {
                        self.logs.entry(topic).or_default().push(*t);
                        self.window.on_outcome(*t, Outcome::Delivered, self.now);
                    }
                    Some(f) => self.window.on_outcome(*t, f.clone(), self.now),
                }
            }
            for (t, _) in behind {
                let gap = Outcome::Blocked {
                    reason: BlockReason::Unavailable,
                    error: "out of order sequence".into(),
                };
                self.window.on_outcome(t, gap, self.now);
            }
        }

        fn msg_of(&self, t: TargetRef) -> usize {
            *self.window.message(t.seq).unwrap_or(&0)
        }

        fn drain(&mut self) {
            while let Some(action) = self.window.next_action() {
                match action {
                    Action::Produce {
                        target,
                        topic,
                        dest,
                    } => {
                        if let Some(landed) = self.fatal_on_produce.take() {
                            self.lose_producer(landed);
                            continue;
                        }
                        if self.queue_full > 0 {
                            self.queue_full -= 1;
                            let full = Outcome::Blocked {
                                reason: BlockReason::QueueFull,
                                error: "queue full".into(),
                            };
                            self.window.on_outcome(target, full, self.now);
                            continue;
                        }
                        if let Dest::DeadLetter { error } = &dest
                            && error.contains("stall budget")
                        {
                            self.stalled.insert(target);
                        }
                        let t = Self::topic_index(&topic);
                        let q = self.outstanding.entry(t).or_default();
                        q.push_back((target, matches!(dest, Dest::DeadLetter { .. })));
                    }
                    Action::Complete { seq, message } => {
                        assert_eq!(
                            message.map(|m| m as Seq),
                            Some(seq),
                            "message and sequence agree"
                        );
                        self.completed.push(seq);
                    }
                    Action::Dropped { target, .. } => {
                        assert!(self.dropped.insert(target), "dropped twice");
                        assert!(self.finished.insert(target), "finished twice");
                    }
                    Action::Released { target } => {
                        assert!(self.released.insert(target), "released twice");
                        assert!(self.finished.insert(target), "finished twice");
                    }
                    Action::Delivered { target, .. } => {
                        assert!(self.finished.insert(target), "finished twice");
                    }
                    Action::Held { target, .. } => {
                        self.held.insert(target);
                    }
                    Action::Blocked { .. } => {}
                }
            }
        }

        /// Heals every fault and lets the model run until nothing moves.
        fn settle(&mut self) {
            self.refusing.clear();
            self.queue_full = 0;
            self.fatal_on_produce = None;
            for _ in 0..10_000 {
                self.now += Duration::from_secs(11);
                if self.window.is_producer_lost() {
                    self.window.reset_producer(self.now);
                }
                self.window.tick(self.now);
                self.drain();
                let busy: Vec<usize> = self
                    .outstanding
                    .iter()
                    .filter(|(_, q)| !q.is_empty())
                    .map(|(t, _)| *t)
                    .collect();
                if busy.is_empty() && self.window.next_deadline().is_none() {
                    return;
                }
                for t in busy {
                    self.batch(t, 1);
                    self.drain();
                }
            }
        }
    }

    fn check(sim: &Sim) {
        // Complete in arrival order, each once.
        let expected: Vec<Seq> = (0..sim.completed.len() as Seq).collect();
        assert_eq!(sim.completed, expected, "completions in order, each once");
        let mut in_topic: HashSet<(usize, TargetRef)> = HashSet::new();
        for (topic, log) in &sim.logs {
            for t in log {
                assert!(
                    in_topic.insert((*topic, *t)),
                    "{t:?} written twice to {topic}"
                );
            }
            // Per-topic order across every retry: a record lands after a later one only if
            // it was refused in a batch too large.
            if *topic == 3 {
                continue;
            }
            for (i, later_landed) in log.iter().enumerate() {
                for earlier in &log[i + 1..] {
                    assert!(
                        earlier.seq >= later_landed.seq || sim.in_too_large_batch.contains(earlier),
                        "topic {topic}: {earlier:?} landed after {later_landed:?}: {log:?}"
                    );
                }
            }
        }
        let first_stuck = sim.completed.len();
        for (seq, m) in sim.msgs.iter().enumerate() {
            let done = seq < first_stuck;
            let mut held = false;
            for (pos, (topic, _, _)) in m.targets.iter().enumerate() {
                let t = TargetRef {
                    seq: seq as Seq,
                    pos,
                };
                let (now, ever_dlq, ever_drop, ever_removed) = sim.policy_of(t);
                let permanent = topic.is_none() || m.size > LIMIT;
                let in_primary = topic.is_some_and(|x| in_topic.contains(&(usize::from(x), t)));
                let in_dlq = in_topic.contains(&(3, t));
                let dropped = sim.dropped.contains(&t);
                let released = sim.released.contains(&t);
                assert!(!in_dlq || ever_dlq, "{t:?} dead-lettered, never told to");
                assert!(!dropped || ever_drop, "{t:?} dropped, never told to");
                assert!(!released || ever_removed, "{t:?} released, never orphaned");
                if !permanent {
                    // Or its topic refused it past its stall budget: dead-lettered, once.
                    let stalled = sim.stalled.contains(&t);
                    assert!(
                        in_primary || (stalled && in_dlq) || !done,
                        "{t:?} completed but not in its topic"
                    );
                    assert!(
                        !(in_primary && in_dlq),
                        "{t:?} in its topic and dead-lettered"
                    );
                    assert!(
                        !in_dlq || stalled,
                        "{t:?} valid yet dead-lettered, not stalled"
                    );
                    assert!(!dropped && !released, "{t:?} valid yet given up");
                    continue;
                }
                assert!(!in_primary, "{t:?} too large yet in its topic");
                assert!(
                    in_dlq || dropped || released || !done,
                    "{t:?} completed but neither dead-lettered, dropped nor released"
                );
                if !(in_dlq || dropped || released) && sim.held.contains(&t) {
                    // Still held: only a policy that says hold keeps it.
                    assert_eq!(
                        now,
                        Rejudged::Rule {
                            dlq: false,
                            drop: false
                        },
                        "{t:?} still held under {now:?}"
                    );
                    held = true;
                }
            }
            // After healing, only a held record keeps a message (and those after it) back.
            if seq == first_stuck {
                assert!(
                    held,
                    "message {seq} not completed after healing, and none held"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn window_keeps_the_failure_rule_and_order(ops in proptest::collection::vec(op(), 1..120)) {
            let mut sim = Sim::new();
            for op in ops {
                sim.apply(op);
                let expected: Vec<Seq> = (0..sim.completed.len() as Seq).collect();
                prop_assert_eq!(&sim.completed, &expected);
            }
            sim.settle();
            check(&sim);
        }

        /// A reload that gives every rule a way out (a dead-letter topic, drop, or the rule
        /// removed) releases everything held, keeping the order and the failure rule.
        #[test]
        fn a_reload_with_a_way_out_releases_every_held_record(
            ops in proptest::collection::vec(op(), 1..120),
            way_out in prop_oneof![
                Just(Rejudged::Rule { dlq: true, drop: false }),
                Just(Rejudged::Rule { dlq: false, drop: true }),
                Just(Rejudged::Removed),
            ],
        ) {
            let mut sim = Sim::new();
            for op in ops {
                sim.apply(op);
            }
            sim.settle();
            sim.reload(way_out);
            sim.drain();
            sim.settle();
            check(&sim);
            prop_assert_eq!(sim.completed.len(), sim.msgs.len(), "everything completed");
            prop_assert!(sim.window.is_empty());
            prop_assert_eq!(sim.window.held().count(), 0);
        }
    }

    fn spec(topic: &str) -> TargetSpec {
        TargetSpec {
            topic: Ok(Arc::from(topic)),
            dead_letter: None,
            on_unwritable: OnUnwritable::Hold,
            alone: Alone::No,
            stall_budget: None,
        }
    }

    fn produces(w: &mut Window<u32>) -> Vec<(TargetRef, String)> {
        let mut out = Vec::new();
        while let Some(a) = w.next_action() {
            if let Action::Produce { target, topic, .. } = a {
                out.push((target, topic.to_string()));
            }
        }
        out
    }

    fn t(seq: Seq) -> TargetRef {
        TargetRef { seq, pos: 0 }
    }

    /// Every action, with a Produce's destination and a Complete's sequence, in order.
    fn actions(w: &mut Window<u32>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(a) = w.next_action() {
            out.push(match a {
                Action::Produce {
                    target,
                    topic,
                    dest,
                } => match dest {
                    Dest::Primary => format!("produce {} to {topic}", target.seq),
                    Dest::DeadLetter { error } => {
                        format!("dead-letter {} to {topic}: {error}", target.seq)
                    }
                },
                Action::Complete { seq, .. } => format!("complete {seq}"),
                Action::Delivered { target, .. } => format!("delivered {}", target.seq),
                Action::Blocked { target, .. } => format!("blocked {}", target.seq),
                other => format!("{other:?}"),
            });
        }
        out
    }

    /// A topic that refuses records for a reason of the rule's own past the budget: its queued
    /// records take the dead-letter topic, with the reason, and the messages behind them
    /// complete; a later record of the topic waits no new budget; one taken ends the refusal.
    /// Outages never count, and without a dead-letter topic the record waits on.
    #[test]
    fn records_refused_past_their_stall_budget_take_the_dead_letter_topic() {
        let budget = Duration::from_secs(60);
        let with_dlq = |topic: &str| TargetSpec {
            dead_letter: Some(Arc::from("dlq")),
            stall_budget: Some(budget),
            ..spec(topic)
        };
        let missing = |w: &mut Window<u32>, seq, now| {
            let refused = Outcome::Blocked {
                reason: BlockReason::UnknownTopic,
                error: "Broker: Unknown topic or partition".into(),
            };
            w.on_outcome(t(seq), refused, now);
        };
        let start = Instant::now();
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![with_dlq("missing")], start);
        w.accept(1, vec![with_dlq("missing")], start);
        w.accept(2, vec![spec("fine")], start);
        assert_eq!(produces(&mut w).len(), 3);
        missing(&mut w, 0, start);
        missing(&mut w, 1, start);
        w.on_outcome(t(2), Outcome::Delivered, start);
        assert!(w.is_waiting());
        let just_before = start + budget - Duration::from_secs(1);
        w.expire_stalled(just_before);
        assert_eq!(actions(&mut w), ["blocked 0", "blocked 1", "delivered 2"]);
        let after = start + budget;
        w.expire_stalled(after);
        let reason = "kafka topic missing refused it for 60 s, over its rule's stall budget (60 s): unknown_topic: Broker: Unknown topic or partition";
        assert_eq!(
            actions(&mut w),
            [
                format!("dead-letter 0 to dlq: {reason}"),
                format!("dead-letter 1 to dlq: {reason}"),
            ]
        );
        w.on_outcome(t(0), Outcome::Delivered, after);
        w.on_outcome(t(1), Outcome::Delivered, after);
        assert_eq!(
            actions(&mut w),
            [
                "delivered 0",
                "complete 0",
                "delivered 1",
                "complete 1",
                "complete 2"
            ]
        );
        // The topic never took a record: a later one refused goes at the next check.
        let later = after + Duration::from_secs(5);
        w.accept(3, vec![with_dlq("missing")], later);
        assert_eq!(produces(&mut w), [(t(3), "missing".into())]);
        missing(&mut w, 3, later);
        w.expire_stalled(later + Duration::from_secs(1));
        let actions_later = actions(&mut w);
        assert!(
            actions_later.len() == 2
                && actions_later[1]
                    .starts_with("dead-letter 3 to dlq: kafka topic missing refused it for 66 s"),
            "{actions_later:?}"
        );
        w.on_outcome(t(3), Outcome::Delivered, later);
        assert_eq!(actions(&mut w), ["delivered 3", "complete 3"]);

        // Taken once: a new refusal has the whole budget again.
        let created = later + Duration::from_secs(10);
        w.accept(4, vec![with_dlq("missing")], created);
        produces(&mut w);
        w.on_outcome(t(4), Outcome::Delivered, created);
        w.accept(5, vec![with_dlq("missing")], created);
        produces(&mut w);
        missing(&mut w, 5, created);
        w.expire_stalled(created + budget - Duration::from_secs(1));
        assert!(!actions(&mut w).iter().any(|a| a.starts_with("dead-letter")));

        // An outage is everyone's: never expired.
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![with_dlq("down")], start);
        produces(&mut w);
        let down = Outcome::Blocked {
            reason: BlockReason::Unavailable,
            error: "all brokers down".into(),
        };
        w.on_outcome(t(0), down, start);
        w.expire_stalled(start + budget * 10);
        assert!(!actions(&mut w).iter().any(|a| a.starts_with("dead-letter")));

        // Without a dead-letter topic, nothing else can take it: it waits on.
        let mut w = Window::new(Backoff::default());
        let no_dlq = TargetSpec {
            stall_budget: Some(budget),
            ..spec("missing")
        };
        w.accept(0, vec![no_dlq], start);
        produces(&mut w);
        missing(&mut w, 0, start);
        w.expire_stalled(start + budget * 10);
        assert_eq!(actions(&mut w), ["blocked 0"]);
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn a_queue_full_record_keeps_its_place_ahead_of_later_ones() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![spec("a")], now);
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())]);
        let full = Outcome::Blocked {
            reason: BlockReason::QueueFull,
            error: "queue full".into(),
        };
        w.on_outcome(t(0), full, now);
        // Later records of the topic wait behind it instead of overtaking it.
        w.accept(1, vec![spec("a")], now);
        w.accept(2, vec![spec("b")], now);
        assert_eq!(produces(&mut w), vec![(t(2), "b".into())]);
        assert_eq!(w.next_deadline(), Some(now + Duration::from_millis(10)));
        w.tick(now + Duration::from_millis(10));
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())], "the head alone");
        w.on_outcome(t(0), Outcome::Delivered, now);
        assert_eq!(produces(&mut w), vec![(t(1), "a".into())]);
    }

    /// A lane that opens sends its queue at once; the first of them refused synchronously
    /// (the producer's queue is full) takes the rest back: none of them goes first.
    #[test]
    fn a_synchronous_refusal_takes_back_the_records_queued_behind_it() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        for id in 0..4 {
            w.accept(id, vec![spec("a")], now);
        }
        w.accept(4, vec![spec("b")], now);
        let first = produces(&mut w);
        assert_eq!(first.len(), 5);
        let denied = Outcome::Blocked {
            reason: BlockReason::Unavailable,
            error: "broker down".into(),
        };
        for id in 0..4 {
            w.on_outcome(t(id), denied.clone(), now);
        }
        let later = now + Duration::from_millis(100);
        w.tick(later);
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())], "the probe");
        w.on_outcome(t(0), Outcome::Delivered, later);
        w.accept(5, vec![spec("a")], later);
        // The lane opened: 1, 2, 3 and then 5 are handed out. 1 is refused as the producer's
        // queue is full, before 2 is carried out.
        let Some(Action::Delivered { .. }) = w.next_action() else {
            panic!("the probe's delivery first");
        };
        let Some(Action::Produce { target, .. }) = w.next_action() else {
            panic!("a produce");
        };
        assert_eq!(target, t(1));
        let full = Outcome::Blocked {
            reason: BlockReason::QueueFull,
            error: "queue full".into(),
        };
        w.on_outcome(t(1), full, later);
        assert_eq!(produces(&mut w), vec![], "nothing behind 1 overtakes it");
        let retry = later + Duration::from_millis(10);
        w.tick(retry);
        assert_eq!(produces(&mut w), vec![(t(1), "a".into())], "1 alone");
        w.on_outcome(t(1), Outcome::Delivered, retry);
        let rest: Vec<TargetRef> = produces(&mut w).into_iter().map(|(t, _)| t).collect();
        assert_eq!(rest, vec![t(2), t(3), t(5)]);
    }

    /// A fatal error from the produce call itself: the `Produce` actions queued behind it are
    /// not carried out by the old producer, nor twice by the new one.
    #[test]
    fn after_a_fatal_error_every_unconfirmed_record_is_produced_once_in_order_by_the_new_producer()
    {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![spec("a")], now);
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())]);
        for id in 1..4 {
            w.accept(id, vec![spec("a")], now);
        }
        // 1 is produced (and lost with the producer), 2's produce call meets the fatal error.
        let Some(Action::Produce { target, .. }) = w.next_action() else {
            panic!("a produce");
        };
        assert_eq!(target, t(1));
        let Some(Action::Produce { target, .. }) = w.next_action() else {
            panic!("a produce");
        };
        assert_eq!(target, t(2));
        w.producer_lost();
        assert_eq!(
            produces(&mut w),
            vec![],
            "3 is not produced by a lost producer"
        );
        // 0 landed; its report still counts. The purge of 1 says nothing.
        w.on_outcome(t(0), Outcome::Delivered, now);
        let purged = Outcome::Blocked {
            reason: BlockReason::Unavailable,
            error: "purged".into(),
        };
        w.on_outcome(t(1), purged, now);
        w.accept(4, vec![spec("a")], now);
        assert_eq!(
            produces(&mut w),
            vec![],
            "nothing while no producer is in place"
        );
        w.reset_producer(now);
        let again: Vec<TargetRef> = produces(&mut w).into_iter().map(|(t, _)| t).collect();
        assert_eq!(again, vec![t(1), t(2), t(3), t(4)], "each once, in order");
    }

    #[test]
    fn unauthorized_is_retried_with_capped_backoff_and_never_completes_until_written() {
        let start = Instant::now();
        let mut now = start;
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![spec("a")], now);
        let mut delays = Vec::new();
        for _ in 0..12 {
            let produced = produces(&mut w);
            assert_eq!(produced, vec![(t(0), "a".into())]);
            let denied = Outcome::Blocked {
                reason: BlockReason::Unauthorized,
                error: "denied".into(),
            };
            w.on_outcome(t(0), denied, now);
            let at = w.next_deadline().unwrap_or(now);
            delays.push(at - now);
            now = at;
            w.tick(now);
            assert_eq!(w.len(), 1, "not given up");
        }
        assert_eq!(delays[0], Duration::from_millis(100));
        assert_eq!(delays[1], Duration::from_millis(200));
        assert_eq!(delays[11], Duration::from_secs(10), "capped");
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())]);
        w.on_outcome(t(0), Outcome::Delivered, now);
        let completed: Vec<Seq> = std::iter::from_fn(|| w.next_action())
            .filter_map(|a| match a {
                Action::Complete { seq, .. } => Some(seq),
                _ => None,
            })
            .collect();
        assert_eq!(completed, vec![0]);
    }

    #[test]
    fn too_large_in_a_batch_is_judged_again_alone_before_it_is_dead_lettered() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        let with_dlq = || TargetSpec {
            dead_letter: Some(Arc::from("dlq")),
            ..spec("a")
        };
        w.accept(0, vec![with_dlq()], now);
        w.accept(1, vec![with_dlq()], now);
        assert_eq!(produces(&mut w).len(), 2);
        let too_large = || Outcome::Permanent {
            reason: PermanentReason::TooLarge,
            error: "batch too large".into(),
        };
        // One batch of both failed: neither is condemned yet.
        w.on_outcome(t(0), too_large(), now);
        assert_eq!(produces(&mut w), vec![]);
        w.on_outcome(t(1), too_large(), now);
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())], "0 alone");
        w.on_outcome(t(0), Outcome::Delivered, now);
        assert_eq!(produces(&mut w), vec![(t(1), "a".into())], "then 1, alone");
        // Alone and still too large: now it is.
        w.on_outcome(t(1), too_large(), now);
        assert_eq!(produces(&mut w), vec![(t(1), "dlq".into())]);
    }

    /// A record judged too large for its topic goes alone: after everything of its topic
    /// before it is through, and nothing after it goes out until it is through or refused; so
    /// Kafka never refuses a batch holding later records and nothing lands ahead of it.
    #[test]
    fn a_record_that_may_be_too_large_never_shares_a_batch() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        let with_dlq = |alone| TargetSpec {
            dead_letter: Some(Arc::from("dlq")),
            alone,
            stall_budget: None,
            ..spec("a")
        };
        w.accept(0, vec![with_dlq(Alone::No)], now);
        w.accept(1, vec![with_dlq(Alone::Yes)], now);
        w.accept(2, vec![with_dlq(Alone::No)], now);
        w.accept(3, vec![with_dlq(Alone::No)], now);
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())], "1 waits for 0");
        w.on_outcome(t(0), Outcome::Delivered, now);
        assert_eq!(produces(&mut w), vec![(t(1), "a".into())], "1 alone");
        w.on_outcome(
            t(1),
            Outcome::Permanent {
                reason: PermanentReason::TooLarge,
                error: "Broker: Message size too large".into(),
            },
            now,
        );
        assert_eq!(
            produces(&mut w),
            vec![(t(1), "dlq".into()), (t(2), "a".into()), (t(3), "a".into())],
            "refused alone: final at once; its copy goes to the dead-letter topic, the rest follow"
        );
        // Too large and yet taken (compression brought it under the limit): the lane opens.
        w.accept(4, vec![with_dlq(Alone::Yes)], now);
        w.accept(5, vec![with_dlq(Alone::No)], now);
        assert_eq!(produces(&mut w), vec![], "4 waits for 2 and 3");
        w.on_outcome(t(2), Outcome::Delivered, now);
        w.on_outcome(t(3), Outcome::Delivered, now);
        assert_eq!(produces(&mut w), vec![(t(4), "a".into())]);
        w.on_outcome(t(4), Outcome::Delivered, now);
        assert_eq!(produces(&mut w), vec![(t(5), "a".into())]);
    }

    /// A compacted topic refuses a whole batch as invalid when one record in it has no key:
    /// its batch-mates are judged again alone and land; only the invalid one is dead-lettered.
    /// Records met before their topic's limit is known go one at a time; once it is known,
    /// those still queued go out together behind the probe in flight, except one that may
    /// still be refused, which waits alone as the next probe.
    #[test]
    fn records_alone_until_their_topics_limit_is_known_then_go_together() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        let until_known = TargetSpec {
            alone: Alone::UntilLimitKnown,
            stall_budget: None,
            ..spec("a")
        };
        for m in 0..5 {
            w.accept(m, vec![until_known.clone()], now);
        }
        w.accept(5, vec![spec("b")], now);
        assert_eq!(
            produces(&mut w),
            vec![(t(0), "a".into()), (t(5), "b".into())],
            "a's first alone; b's limit is known"
        );
        let big = 3;
        w.limit_known("a", |target, &m| {
            assert_ne!(target, t(0), "the one out is not judged again");
            m == big
        });
        assert!(produces(&mut w).is_empty(), "nothing passes the probe");
        w.on_outcome(t(0), Outcome::Delivered, now);
        assert_eq!(
            produces(&mut w),
            vec![(t(1), "a".into()), (t(2), "a".into())],
            "together, up to the one that may be refused"
        );
        w.on_outcome(t(1), Outcome::Delivered, now);
        w.on_outcome(t(2), Outcome::Delivered, now);
        assert_eq!(produces(&mut w), vec![(t(3), "a".into())], "3 alone");
        w.on_outcome(t(3), Outcome::Delivered, now);
        assert_eq!(produces(&mut w), vec![(t(4), "a".into())]);
    }

    #[test]
    fn invalid_record_in_a_batch_is_judged_again_alone_before_it_is_dead_lettered() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        let with_dlq = || TargetSpec {
            dead_letter: Some(Arc::from("dlq")),
            ..spec("a")
        };
        for m in 0..3 {
            w.accept(m, vec![with_dlq()], now);
        }
        assert_eq!(produces(&mut w).len(), 3);
        let invalid = || Outcome::Permanent {
            reason: PermanentReason::InvalidRecord,
            error: "Broker: Invalid record".into(),
        };
        for m in 0..3 {
            w.on_outcome(t(m), invalid(), now);
        }
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())], "0 alone");
        w.on_outcome(t(0), Outcome::Delivered, now);
        assert_eq!(
            produces(&mut w),
            vec![(t(1), "a".into())],
            "then 1 alone: refused in a batch, it is never batched again"
        );
        w.on_outcome(t(1), invalid(), now);
        assert_eq!(
            produces(&mut w),
            vec![(t(1), "dlq".into()), (t(2), "a".into())]
        );
        w.on_outcome(t(2), Outcome::Delivered, now);
        w.on_outcome(t(1), Outcome::Delivered, now);
        assert_eq!(
            completions(&mut w),
            vec![1, 2],
            "0 completed when it landed"
        );
    }

    /// Drives a target of topic `topic` through "too large" twice (once in flight with
    /// others, once alone), as Kafka answers a record over the topic's limit.
    fn refuse_too_large(w: &mut Window<u32>, target: TargetRef, topic: &str, now: Instant) {
        let too_large = || Outcome::Permanent {
            reason: PermanentReason::TooLarge,
            error: "Broker: Message size too large".into(),
        };
        w.on_outcome(target, too_large(), now);
        assert!(
            produces(w).contains(&(target, topic.to_owned())),
            "judged again alone"
        );
        w.on_outcome(target, too_large(), now);
    }

    fn completions(w: &mut Window<u32>) -> Vec<Seq> {
        std::iter::from_fn(|| w.next_action())
            .filter_map(|a| match a {
                Action::Complete { seq, .. } => Some(seq),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_held_record_is_released_in_order_when_a_reload_gives_it_a_dead_letter_topic() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![spec("a")], now);
        w.accept(1, vec![spec("a")], now);
        w.accept(2, vec![spec("b")], now);
        assert_eq!(produces(&mut w).len(), 3);
        w.on_outcome(
            t(1),
            Outcome::Blocked {
                reason: BlockReason::Unavailable,
                error: "gap".into(),
            },
            now,
        );
        w.on_outcome(t(2), Outcome::Delivered, now);
        refuse_too_large(&mut w, t(0), "a", now);
        let held: Vec<_> = w
            .held()
            .map(|h| (h.target, h.reason, h.topic, h.dead_letter))
            .collect();
        assert_eq!(
            held,
            vec![(t(0), PermanentReason::TooLarge, Some(Arc::from("a")), false)]
        );
        assert!(
            completions(&mut w).is_empty(),
            "everything waits behind the held record"
        );
        w.rejudge(
            |_, _| {
                Some(Policy::Rule {
                    dead_letter: Some(Arc::from("dlq")),
                    on_unwritable: OnUnwritable::Hold,
                })
            },
            now,
        );
        assert_eq!(
            produces(&mut w),
            vec![(t(0), "dlq".into()), (t(1), "a".into())],
            "dead-lettered at once; the topic's next record is probed without waiting"
        );
        assert_eq!(w.held().count(), 0);
        w.on_outcome(t(1), Outcome::Delivered, now);
        w.on_outcome(t(0), Outcome::Delivered, now);
        assert_eq!(completions(&mut w), vec![0, 1, 2]);
    }

    #[test]
    fn a_dead_letter_copy_refused_too_is_held_visibly_and_released_by_drop() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        let with_dlq = TargetSpec {
            dead_letter: Some(Arc::from("dlq")),
            ..spec("a")
        };
        w.accept(0, vec![with_dlq], now);
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())]);
        refuse_too_large(&mut w, t(0), "a", now);
        assert_eq!(produces(&mut w), vec![(t(0), "dlq".into())]);
        // A copy of a record too large goes alone: its first refusal is final.
        w.on_outcome(
            t(0),
            Outcome::Permanent {
                reason: PermanentReason::TooLarge,
                error: "Broker: Message size too large".into(),
            },
            now,
        );
        let held: Vec<_> = w
            .held()
            .map(|h| (h.topic, h.dead_letter, h.error.to_owned()))
            .collect();
        assert_eq!(
            held,
            vec![(
                Some(Arc::from("dlq")),
                true,
                "kafka topic dlq: Broker: Message size too large".to_owned()
            )]
        );
        // The same dead-letter topic, now with drop.
        w.rejudge(
            |_, _| {
                Some(Policy::Rule {
                    dead_letter: Some(Arc::from("dlq")),
                    on_unwritable: OnUnwritable::Drop,
                })
            },
            now,
        );
        // The dead-letter topic refused it already: dropped at once.
        let dropped = std::iter::from_fn(|| w.next_action())
            .filter(|a| matches!(a, Action::Dropped { .. } | Action::Complete { .. }))
            .count();
        assert_eq!(dropped, 2, "dropped, then completed");
        assert!(w.is_empty());
    }

    #[test]
    fn a_held_record_out_at_the_producer_is_judged_under_the_new_rules_when_it_comes_back() {
        let start = Instant::now();
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![spec("a")], start);
        produces(&mut w);
        refuse_too_large(&mut w, t(0), "a", start);
        // The slow retry of a held record (a raised limit would let it through).
        let at = w.next_deadline().unwrap_or(start);
        w.tick(at);
        assert_eq!(produces(&mut w), vec![(t(0), "a".into())]);
        w.rejudge(|_, _| Some(Policy::Orphaned), at);
        assert_eq!(produces(&mut w), vec![], "nothing while it is out");
        w.on_outcome(
            t(0),
            Outcome::Permanent {
                reason: PermanentReason::TooLarge,
                error: "too large".into(),
            },
            at,
        );
        let actions: Vec<_> = std::iter::from_fn(|| w.next_action()).collect();
        assert!(
            matches!(
                actions[..],
                [Action::Released { .. }, Action::Complete { seq: 0, .. }]
            ),
            "{actions:?}"
        );
    }

    #[test]
    fn a_reload_that_still_says_hold_keeps_it_held_and_reports_nothing_new() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![spec("a")], now);
        produces(&mut w);
        refuse_too_large(&mut w, t(0), "a", now);
        std::iter::from_fn(|| w.next_action()).for_each(drop);
        w.rejudge(
            |_, _| {
                Some(Policy::Rule {
                    dead_letter: None,
                    on_unwritable: OnUnwritable::Hold,
                })
            },
            now,
        );
        assert_eq!(
            w.next_action().map(|_| ()),
            None,
            "unchanged policy: untouched"
        );
        assert_eq!(w.held().count(), 1);
    }

    #[test]
    fn an_outcome_for_a_target_not_in_flight_is_ignored() {
        let now = Instant::now();
        let mut w = Window::new(Backoff::default());
        w.accept(0, vec![spec("a")], now);
        produces(&mut w);
        w.on_outcome(t(0), Outcome::Delivered, now);
        w.on_outcome(t(0), Outcome::Delivered, now);
        w.on_outcome(t(7), Outcome::Delivered, now);
        let completed = std::iter::from_fn(|| w.next_action())
            .filter(|a| matches!(a, Action::Complete { .. }))
            .count();
        assert_eq!(completed, 1);
        assert!(w.is_empty());
    }
}
