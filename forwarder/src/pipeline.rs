//! The forwarding core: a window of in-flight messages in arrival order. Each message is produced
//! to every target at once; it is acknowledged to MQTT only when all its targets are confirmed
//! (or can never be), and only after every message that arrived before it — MQTT requires acks
//! in PUBLISH order (3.1.1 and 5, §4.6).
//!
//! One task, no task per message, no unbounded queue: the window holds at most `max_inflight`
//! messages and the pipeline stops taking PUBLISHes while it is full.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry_api::PayloadFormat;
use ferry_api::config::KafkaConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::BaseRecord;
use rumqttc::{AsyncClient, Publish, QoS};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::kafka::{self, Failure, KafkaProducer, Report};
use crate::metrics::{FailureReason, Metrics};
use crate::mqtt::backoff;
use crate::route::{Router, record_key, wrap_json};

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(10);
const ACK_RETRY: Duration = Duration::from_millis(5);

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TargetState {
    Pending { attempts: u32 },
    Done,
}

struct Slot {
    publish: Publish,
    /// (target index in the router, state), in rule order.
    targets: Vec<(usize, TargetState)>,
    remaining: usize,
}

/// How the pipeline ended.
#[derive(Debug, PartialEq, Eq)]
pub struct PipelineExit {
    /// Messages still unconfirmed when the drain bound passed; left unacknowledged, so the
    /// broker redelivers them.
    pub abandoned: usize,
}

pub struct Pipeline {
    router: Router,
    metrics: Arc<Metrics>,
    client: AsyncClient,
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
    /// Acks rumqttc's request channel had no room for, oldest first. rumqttc takes one request
    /// per poll and prefers reading, so a broker that sends without an in-flight limit can
    /// outrun it; the acks wait here, in order, instead of being lost.
    unsent_acks: VecDeque<(QoS, u16)>,
    /// Set when the MQTT reader (and with it rumqttc's event loop) has ended.
    reader_gone: Arc<AtomicBool>,
    scratch: Vec<usize>,
}

impl Pipeline {
    pub fn new(
        router: Router,
        kafka: KafkaConfig,
        metrics: Arc<Metrics>,
        client: AsyncClient,
        reader_gone: Arc<AtomicBool>,
        max_inflight: usize,
    ) -> Result<Self, KafkaError> {
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let producer = kafka::producer(&kafka, Arc::clone(&metrics), reports_tx.clone())?;
        Ok(Self {
            router,
            metrics,
            client,
            kafka,
            producer,
            generation: 0,
            reports_tx,
            reports,
            window: VecDeque::with_capacity(max_inflight),
            head_seq: 0,
            max_inflight,
            retries: BinaryHeap::new(),
            unsent_acks: VecDeque::new(),
            reader_gone,
            scratch: Vec::new(),
        })
    }

    /// Runs until `shutdown` resolves and the window is drained (or `drain_bound` passes), or
    /// until the reader stops. Then queues the MQTT DISCONNECT behind the last acks.
    pub async fn run(
        mut self,
        mut inbound: mpsc::Receiver<Publish>,
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
                _ = tokio::time::sleep(ACK_RETRY), if !self.unsent_acks.is_empty() => {}
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
                msg = inbound.recv(), if accepting && has_room => match msg {
                    Some(publish) => self.accept(publish),
                    None => {
                        // The reader is gone: nothing more will arrive.
                        accepting = false;
                        drain_deadline = Some(Instant::now() + drain_bound);
                    }
                },
            }
            self.ack_completed();
            if !accepting && self.window.is_empty() && self.unsent_acks.is_empty() {
                break;
            }
        }
        let abandoned = self.window.len();
        if let Err(e) = self.client.try_disconnect() {
            debug!(error = %e, "mqtt disconnect not queued (connection already gone)");
        }
        PipelineExit { abandoned }
    }

    fn accept(&mut self, publish: Publish) {
        let seq = self.head_seq + self.window.len() as u64;
        self.router.route(&publish.topic, &mut self.scratch);
        if self.scratch.is_empty() {
            self.metrics.unmatched.inc();
        }
        let targets: Vec<(usize, TargetState)> = self
            .scratch
            .iter()
            .map(|&t| (t, TargetState::Pending { attempts: 0 }))
            .collect();
        let remaining = targets.len();
        self.window.push_back(Slot {
            publish,
            targets,
            remaining,
        });
        self.metrics.inflight.set(self.window.len() as i64);
        for pos in 0..remaining {
            self.produce(seq, pos);
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
        let slot = &self.window[idx];
        let Some(&(target_idx, _)) = slot.targets.get(pos) else {
            return;
        };
        let target = &self.router.targets()[target_idx];
        let publish = &slot.publish;
        let wrapped;
        let value: &[u8] = match target.payload {
            PayloadFormat::Raw => &publish.payload,
            PayloadFormat::WrappedJson => {
                wrapped = wrap_json(&publish.topic, &publish.payload);
                &wrapped
            }
        };
        let mut record = BaseRecord::<str, [u8], usize>::with_opaque_to(
            &target.kafka_topic,
            opaque(self.generation, seq, pos),
        )
        .payload(value);
        if let Some(key) = record_key(target.key, &publish.topic) {
            record = record.key(key);
        }
        // Refused before reaching librdkafka's queue (queue full, size over message.max.bytes):
        // handled exactly like a failed delivery.
        if let Err(e) = self.producer.send(record).map_err(|(e, _)| e) {
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
        let slot = &mut self.window[idx];
        let Some(&mut (target_idx, TargetState::Pending { attempts })) = slot.targets.get_mut(pos)
        else {
            return;
        };
        let failure = match &result {
            Ok(()) => None,
            Err(e) => Some(kafka::classify(e)),
        };
        match failure {
            None => {
                slot.targets[pos].1 = TargetState::Done;
                slot.remaining -= 1;
                for &rule in &self.router.targets()[target_idx].rules {
                    self.metrics.rules[rule].forwarded.inc();
                }
            }
            Some(Failure::Permanent(reason)) => {
                slot.targets[pos].1 = TargetState::Done;
                slot.remaining -= 1;
                let topic = slot.publish.topic.clone();
                self.count_failure(target_idx, reason, &topic, &result);
            }
            Some(Failure::Retry) => {
                let attempts = attempts + 1;
                slot.targets[pos].1 = TargetState::Pending { attempts };
                // QueueFull is librdkafka saying "not now"; retry soon and quietly.
                let queue_full = matches!(&result, Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull));
                let delay = if queue_full {
                    Duration::from_millis(10)
                } else {
                    backoff(RETRY_MIN, RETRY_MAX, attempts)
                };
                if !queue_full && (attempts == 1 || attempts % 10 == 0) {
                    let target = &self.router.targets()[target_idx];
                    warn!(kafka_topic = %target.kafka_topic, attempts, error = ?result.as_ref().err(), "kafka produce failed; retrying");
                }
                self.metrics.produce_retries.inc();
                self.retries
                    .push(Reverse((Instant::now() + delay, seq, pos)));
            }
            Some(Failure::Fatal) => {
                error!(error = ?result.as_ref().err(), "kafka producer hit a fatal error; replacing it and re-sending unconfirmed records");
                self.replace_producer();
            }
        }
    }

    fn count_failure(
        &self,
        target_idx: usize,
        reason: FailureReason,
        mqtt_topic: &str,
        result: &Result<(), KafkaError>,
    ) {
        let target = &self.router.targets()[target_idx];
        for &rule in &target.rules {
            self.metrics.rules[rule].failed(reason);
            error!(
                rule = %self.router.rule_names()[rule],
                mqtt_topic,
                kafka_topic = %target.kafka_topic,
                reason = reason.as_str(),
                error = ?result.as_ref().err(),
                "kafka can never take this message; counted and acknowledged"
            );
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
                            .filter(|(_, (_, s))| matches!(s, TargetState::Pending { .. }))
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
            if slot.publish.qos != QoS::AtMostOnce {
                self.unsent_acks
                    .push_back((slot.publish.qos, slot.publish.pkid));
            }
        }
        self.flush_acks();
        self.metrics.inflight.set(self.window.len() as i64);
    }

    fn flush_acks(&mut self) {
        while let Some(&(qos, pkid)) = self.unsent_acks.front() {
            let mut ack = Publish::new("", qos, Vec::new());
            ack.pkid = pkid;
            match self.client.try_ack(&ack) {
                Ok(()) => {
                    self.unsent_acks.pop_front();
                    self.metrics.acked.inc();
                }
                Err(_) if !self.reader_gone.load(Ordering::Relaxed) => {
                    break; // Full: try again shortly.
                }
                Err(e) => {
                    // The event loop is gone (shutting down): the broker redelivers these.
                    debug!(error = %e, unsent = self.unsent_acks.len(), "mqtt acks not sent");
                    self.unsent_acks.clear();
                }
            }
        }
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
