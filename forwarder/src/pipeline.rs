//! The forwarding core: a window of in-flight messages in arrival order. Each message is produced
//! to every target at once; it is acknowledged to MQTT only when all its targets are confirmed
//! (or can never be), and only after every message that arrived before it — MQTT requires acks
//! in PUBLISH order (3.1.1 and 5, §4.6).
//!
//! One task, no task per message, no unbounded queue: the window holds at most `max_inflight`
//! messages and the pipeline stops taking PUBLISHes while it is full.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::PayloadFormat;
use ferry_api::config::KafkaConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::BaseRecord;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::kafka::{self, Failure, KafkaProducer, Report};
use crate::metrics::{FailureReason, Metrics};
use crate::mqtt::{Link, Message, Outbound, Subscriptions, backoff};
use crate::route::{Router, Target, header, record_key, wrap_json};

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(10);

// A delivery opaque packs (producer generation, message sequence, target position).
const POS_BITS: u32 = 12;
const SEQ_BITS: u32 = 44;
const GEN_SHIFT: u32 = POS_BITS + SEQ_BITS;

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

#[derive(Debug, Clone, PartialEq, Eq)]
enum TargetState {
    Pending {
        attempts: u32,
    },
    /// Kafka can never take the record; writing it to the dead-letter topic.
    DeadLettering {
        attempts: u32,
        error: String,
    },
    Done,
}

struct TargetSlot {
    target: Arc<Target>,
    /// The resolved name when the topic is a template with placeholders.
    resolved: Option<String>,
    state: TargetState,
    sent_at: Instant,
}

impl TargetSlot {
    fn kafka_topic(&self) -> &str {
        self.resolved
            .as_deref()
            .or(self.target.topic.as_static())
            .unwrap_or_default()
    }
}

struct Slot {
    message: Message,
    received_at: Instant,
    targets: Vec<TargetSlot>,
    remaining: usize,
}

/// A new set of rules for the running pipeline (config reload).
pub struct Reload {
    pub router: Router,
    pub subscriptions: Vec<(String, u8)>,
}

/// How the pipeline ended.
#[derive(Debug, PartialEq, Eq)]
pub struct PipelineExit {
    /// Messages still unconfirmed when the drain bound passed; left unacknowledged, so the
    /// broker redelivers them.
    pub abandoned: usize,
}

pub struct Pipeline {
    router: Arc<Router>,
    metrics: Arc<Metrics>,
    /// Dropped when the pipeline ends: the MQTT driver then disconnects.
    link: Link,
    subscriptions: Subscriptions,
    kafka: KafkaConfig,
    producer: KafkaProducer,
    generation: u8,
    reports_tx: mpsc::UnboundedSender<Report>,
    reports: mpsc::UnboundedReceiver<Report>,
    window: VecDeque<Slot>,
    /// Sequence number of `window[0]`.
    head_seq: u64,
    max_inflight: usize,
    retries: BinaryHeap<Reverse<(Instant, u64, usize)>>,
    scratch: Vec<Arc<Target>>,
}

/// What the pipeline is connected to.
pub struct Wiring {
    pub metrics: Arc<Metrics>,
    pub link: Link,
    pub subscriptions: Subscriptions,
}

impl Pipeline {
    pub fn new(
        router: Router,
        kafka: KafkaConfig,
        wiring: Wiring,
        max_inflight: usize,
    ) -> Result<Self, KafkaError> {
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let producer = kafka::producer(&kafka, Arc::clone(&wiring.metrics), reports_tx.clone())?;
        Ok(Self {
            router: Arc::new(router),
            metrics: wiring.metrics,
            link: wiring.link,
            subscriptions: wiring.subscriptions,
            kafka,
            producer,
            generation: 0,
            reports_tx,
            reports,
            window: VecDeque::with_capacity(max_inflight),
            head_seq: 0,
            max_inflight,
            retries: BinaryHeap::new(),
            scratch: Vec::new(),
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
        let mut drain_deadline: Option<Instant> = None;
        let mut batch = Vec::with_capacity(256);
        loop {
            let retry_at = self.retries.peek().map(|Reverse((at, _, _))| *at);
            let has_room = self.window.len() < self.max_inflight;
            tokio::select! {
                biased;
                n = self.reports.recv_many(&mut batch, 256) => {
                    for report in batch.drain(..n) {
                        self.on_report(report);
                    }
                }
                _ = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if retry_at.is_some() => {
                    self.retry_due();
                }
                _ = tokio::time::sleep_until(drain_deadline.unwrap_or_else(Instant::now)), if drain_deadline.is_some() => {
                    warn!(abandoned = self.window.len(), "drain bound passed; leaving unconfirmed messages unacknowledged for redelivery");
                    break;
                }
                () = &mut shutdown, if accepting => {
                    accepting = false;
                    drain_deadline = Some(Instant::now() + drain_bound);
                    // Closing makes the reader stop handing over messages; those it still held
                    // were never acked and will be redelivered.
                    inbound.close();
                    info!(inflight = self.window.len(), "shutting down: finishing in-flight messages");
                }
                Some(reload) = reloads.recv(), if accepting => self.apply(reload),
                msg = inbound.recv(), if accepting && has_room => match msg {
                    Some(message) => self.accept(message),
                    None => {
                        // The reader is gone: nothing more will arrive.
                        accepting = false;
                        drain_deadline = Some(Instant::now() + drain_bound);
                    }
                },
            }
            self.ack_completed();
            if !accepting && self.window.is_empty() {
                break;
            }
        }
        // Returning drops `self.link`, which tells the MQTT driver to disconnect.
        PipelineExit {
            abandoned: self.window.len(),
        }
    }

    /// Swaps in new rules. In-flight messages keep the targets they were routed to. The new
    /// router is in place before new filters are subscribed, so nothing arrives unrouted.
    fn apply(&mut self, reload: Reload) {
        self.router = Arc::new(reload.router);
        let old = {
            let mut subs = self
                .subscriptions
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            std::mem::replace(&mut *subs, reload.subscriptions.clone())
        };
        let added: Vec<(String, u8)> = reload
            .subscriptions
            .iter()
            .filter(|s| !old.contains(s))
            .cloned()
            .collect();
        let removed: Vec<String> = old
            .iter()
            .filter(|(f, _)| !reload.subscriptions.iter().any(|(n, _)| n == f))
            .map(|(f, _)| f.clone())
            .collect();
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

    fn accept(&mut self, message: Message) {
        let seq = self.head_seq + self.window.len() as u64;
        self.router.route(&message.topic, &mut self.scratch);
        if self.scratch.is_empty() {
            self.metrics.unmatched.inc();
        }
        let now = Instant::now();
        let mut targets = Vec::with_capacity(self.scratch.len());
        for target in self.scratch.drain(..) {
            // A static name resolves without allocating; only templates keep their result.
            let (resolved, state) = match target.topic.resolve(&message.topic) {
                Ok(Cow::Borrowed(_)) => (None, TargetState::Pending { attempts: 0 }),
                Ok(Cow::Owned(name)) => (Some(name), TargetState::Pending { attempts: 0 }),
                Err(e) => {
                    let error = format!("kafka topic {}: {e}", target.topic);
                    (None, TargetState::DeadLettering { attempts: 0, error })
                }
            };
            targets.push(TargetSlot {
                target,
                resolved,
                state,
                sent_at: now,
            });
        }
        let remaining = targets.len();
        self.window.push_back(Slot {
            message,
            received_at: now,
            targets,
            remaining,
        });
        self.metrics.inflight.set(self.window.len() as i64);
        for pos in 0..remaining {
            // An unresolvable topic with nowhere to dead-letter it is given up at once.
            let give_up = self.window.back().is_some_and(|s| {
                let t = &s.targets[pos];
                matches!(t.state, TargetState::DeadLettering { .. })
                    && t.target.dead_letter.is_none()
            });
            if give_up {
                self.fail(seq, pos, FailureReason::InvalidTopic, None);
            } else {
                self.produce(seq, pos);
            }
        }
    }

    fn index_of(&self, seq: u64) -> Option<usize> {
        let idx = usize::try_from(seq.checked_sub(self.head_seq)?).ok()?;
        (idx < self.window.len()).then_some(idx)
    }

    fn produce(&mut self, seq: u64, pos: usize) {
        let Some(idx) = self.index_of(seq) else {
            return;
        };
        let opaque = opaque(self.generation, seq, pos);
        let slot = &mut self.window[idx];
        let Some(ts) = slot.targets.get_mut(pos) else {
            return;
        };
        ts.sent_at = Instant::now();
        let ts = &slot.targets[pos];
        let target = &ts.target;
        let message = &slot.message;
        let key = record_key(target.key, &message.topic);
        let result = match &ts.state {
            TargetState::Done => return,
            TargetState::Pending { .. } => {
                let wrapped;
                let value: &[u8] = match target.payload {
                    PayloadFormat::Raw => &message.payload,
                    PayloadFormat::WrappedJson => {
                        wrapped = wrap_json(&message.topic, &message.payload);
                        &wrapped
                    }
                };
                let mut record =
                    BaseRecord::<str, [u8], usize>::with_opaque_to(ts.kafka_topic(), opaque)
                        .payload(value);
                if let Some(key) = key {
                    record = record.key(key);
                }
                if let Some(h) = target.header_plan.build(message) {
                    record = record.headers(h);
                }
                self.producer.send(record).map_err(|(e, _)| e)
            }
            TargetState::DeadLettering { error, .. } => {
                let Some(dlq) = target.dead_letter.as_deref() else {
                    return;
                };
                let intended = match &ts.resolved {
                    Some(name) => name.clone(),
                    None => target.topic.to_string(),
                };
                let headers = dead_letter_headers(
                    target.header_plan.build(message),
                    &message.topic,
                    &intended,
                    &target.rule_names(),
                    error,
                );
                let mut record = BaseRecord::<str, [u8], usize>::with_opaque_to(dlq, opaque)
                    .payload(&message.payload[..])
                    .headers(headers);
                if let Some(key) = key {
                    record = record.key(key);
                }
                self.producer.send(record).map_err(|(e, _)| e)
            }
        };
        // Refused before reaching librdkafka's queue (queue full, size over message.max.bytes):
        // handled exactly like a failed delivery.
        if let Err(e) = result {
            self.on_delivery(seq, pos, Err(e));
        }
    }

    fn on_report(&mut self, report: Report) {
        let (generation, seq, pos) = unpack(report.opaque);
        if generation != self.generation {
            return; // From a producer replaced after a fatal error; its records were re-sent.
        }
        self.on_delivery(seq, pos, report.result);
    }

    fn on_delivery(&mut self, seq: u64, pos: usize, result: Result<(), KafkaError>) {
        let Some(idx) = self.index_of(seq) else {
            return;
        };
        let Some(ts) = self.window[idx].targets.get_mut(pos) else {
            return;
        };
        let (attempts, dead_lettering) = match &ts.state {
            TargetState::Pending { attempts } => (*attempts, false),
            TargetState::DeadLettering { attempts, .. } => (*attempts, true),
            TargetState::Done => return,
        };
        let failure = match &result {
            Ok(()) => None,
            Err(e) => Some(kafka::classify(e)),
        };
        match failure {
            None => {
                self.metrics
                    .produce_latency
                    .observe(ts.sent_at.elapsed().as_secs_f64());
                let state = std::mem::replace(&mut ts.state, TargetState::Done);
                self.window[idx].remaining -= 1;
                let ts = &self.window[idx].targets[pos];
                if let TargetState::DeadLettering { error, .. } = state {
                    warn!(
                        rule = %ts.target.rule_names(),
                        mqtt_topic = %self.window[idx].message.topic,
                        dead_letter_topic = ts.target.dead_letter.as_deref().unwrap_or_default(),
                        error = %error,
                        "kafka can never take this message; written to the dead-letter topic"
                    );
                    for rule in &ts.target.rules {
                        rule.on_dead_lettered(error.clone());
                    }
                } else {
                    for rule in &ts.target.rules {
                        rule.on_forwarded();
                    }
                }
            }
            Some(Failure::Permanent(reason)) => {
                let has_dlq = ts.target.dead_letter.is_some();
                if !dead_lettering && has_dlq {
                    let error = format!(
                        "kafka topic {}: {} ({})",
                        ts.kafka_topic(),
                        reason.as_str(),
                        error_text(&result)
                    );
                    ts.state = TargetState::DeadLettering { attempts: 0, error };
                    self.produce(seq, pos);
                } else {
                    self.fail(seq, pos, reason, Some(&result));
                }
            }
            Some(Failure::Retry) => {
                let attempts = attempts + 1;
                match &mut ts.state {
                    TargetState::Pending { attempts: a }
                    | TargetState::DeadLettering { attempts: a, .. } => *a = attempts,
                    TargetState::Done => {}
                }
                // QueueFull is librdkafka saying "not now"; retry soon and quietly.
                let queue_full = matches!(&result, Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull));
                let delay = if queue_full {
                    Duration::from_millis(10)
                } else {
                    backoff(RETRY_MIN, RETRY_MAX, attempts)
                };
                if !queue_full && (attempts == 1 || attempts % 10 == 0) {
                    warn!(kafka_topic = %ts.kafka_topic(), attempts, error = %error_text(&result), "kafka produce failed; retrying");
                    self.metrics.kafka_error(error_text(&result));
                }
                self.metrics.produce_retries.inc();
                self.retries
                    .push(Reverse((Instant::now() + delay, seq, pos)));
            }
            Some(Failure::Fatal) => {
                error!(error = %error_text(&result), "kafka producer hit a fatal error; replacing it and re-sending unconfirmed records");
                self.metrics.kafka_error(error_text(&result));
                self.replace_producer();
            }
        }
    }

    /// Gives up on one target of a message: counted per rule, logged, and the message can be
    /// acknowledged.
    fn fail(
        &mut self,
        seq: u64,
        pos: usize,
        reason: FailureReason,
        result: Option<&Result<(), KafkaError>>,
    ) {
        let Some(idx) = self.index_of(seq) else {
            return;
        };
        let slot = &mut self.window[idx];
        let Some(ts) = slot.targets.get_mut(pos) else {
            return;
        };
        let previous = std::mem::replace(&mut ts.state, TargetState::Done);
        if previous == TargetState::Done {
            return;
        }
        slot.remaining -= 1;
        let error = match (&previous, result) {
            (TargetState::DeadLettering { error, .. }, None) => error.clone(),
            (TargetState::DeadLettering { error, .. }, Some(r)) => format!(
                "{error}; dead-letter topic {} refused it too: {}",
                ts.target.dead_letter.as_deref().unwrap_or_default(),
                error_text(r)
            ),
            (_, Some(r)) => format!(
                "kafka topic {}: {} ({})",
                ts.kafka_topic(),
                reason.as_str(),
                error_text(r)
            ),
            (_, None) => format!("kafka topic {}: {}", ts.kafka_topic(), reason.as_str()),
        };
        error!(
            rule = %ts.target.rule_names(),
            mqtt_topic = %slot.message.topic,
            reason = reason.as_str(),
            error = %error,
            "kafka can never take this message and no dead-letter topic took it; counted and acknowledged"
        );
        for rule in &ts.target.rules {
            rule.on_failed(reason, error.clone());
        }
    }

    fn retry_due(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, seq, pos))) = self.retries.peek().copied() {
            if at > now {
                break;
            }
            self.retries.pop();
            self.produce(seq, pos);
        }
    }

    fn replace_producer(&mut self) {
        match kafka::producer(
            &self.kafka,
            Arc::clone(&self.metrics),
            self.reports_tx.clone(),
        ) {
            Ok(fresh) => {
                let old = std::mem::replace(&mut self.producer, fresh);
                // Dropping purges and flushes for up to 500 ms: keep it off the runtime.
                tokio::task::spawn_blocking(move || drop(old));
                self.generation = self.generation.wrapping_add(1);
                self.retries.clear();
                let pending: Vec<(u64, usize)> = self
                    .window
                    .iter()
                    .enumerate()
                    .flat_map(|(i, slot)| {
                        let seq = self.head_seq + i as u64;
                        slot.targets
                            .iter()
                            .enumerate()
                            .filter(|(_, t)| t.state != TargetState::Done)
                            .map(move |(pos, _)| (seq, pos))
                    })
                    .collect();
                for (seq, pos) in pending {
                    self.produce(seq, pos);
                }
            }
            Err(e) => error!(error = %e, "cannot create a new kafka producer"),
        }
    }

    fn ack_completed(&mut self) {
        while self.window.front().is_some_and(|s| s.remaining == 0) {
            let Some(slot) = self.window.pop_front() else {
                break;
            };
            self.head_seq += 1;
            self.metrics
                .ack_latency
                .observe(slot.received_at.elapsed().as_secs_f64());
            for ts in &slot.targets {
                for rule in &ts.target.rules {
                    rule.on_acked();
                }
            }
            // Every message, QoS 0 too: a completion frees its slot in the driver's window.
            let m = &slot.message;
            self.send_mqtt(Outbound::Complete {
                epoch: m.epoch,
                qos: m.qos,
                pkid: m.pkid,
            });
        }
        self.metrics.inflight.set(self.window.len() as i64);
    }

    fn send_mqtt(&self, item: Outbound) {
        // Fails only once the driver has ended: the broker redelivers what was not acked, and a
        // new connection subscribes afresh.
        if self.link.outbound.send(item).is_err() {
            debug!("mqtt driver gone; request dropped");
        }
    }
}

/// The dead-letter record's headers: the original record's (if any) and where it came from,
/// where it was going, and why it could not get there.
fn dead_letter_headers(
    original: Option<OwnedHeaders>,
    mqtt_topic: &str,
    kafka_topic: &str,
    rules: &str,
    error: &str,
) -> OwnedHeaders {
    original
        .unwrap_or_default()
        .insert(header("ferry.mqtt.topic", mqtt_topic.as_bytes()))
        .insert(header("ferry.kafka.topic", kafka_topic.as_bytes()))
        .insert(header("ferry.rule", rules.as_bytes()))
        .insert(header("ferry.error", error.as_bytes()))
}

fn error_text(result: &Result<(), KafkaError>) -> String {
    match result {
        Ok(()) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opaque_round_trips() {
        for (g, s, p) in [
            (0u8, 0u64, 0usize),
            (255, (1 << 44) - 1, 4095),
            (7, 123_456_789, 17),
        ] {
            assert_eq!(unpack(opaque(g, s, p)), (g, s, p));
        }
    }
}
