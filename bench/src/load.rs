//! Load and measurement: MQTT publishers (backlog and fixed rate) and a Kafka reader that
//! checks what arrived.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Result, anyhow, bail};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, QoS};

/// Payload layout: sequence number (8 bytes, big endian), send time in ns since the epoch
/// (8 bytes), then random filler up to the message size.
pub const HEADER: usize = 16;

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

pub fn payload(seq: u64, size: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(size.max(HEADER) + 8);
    p.extend_from_slice(&seq.to_be_bytes());
    p.extend_from_slice(&now_ns().to_be_bytes());
    // Incompressible filler (xorshift64 seeded by the sequence number): a repeated byte would
    // let lz4 shrink every record a hundredfold and flatter both Kafka and the forwarder.
    let mut x = seed(seq);
    while p.len() < size {
        p.extend_from_slice(&xorshift(&mut x).to_le_bytes());
    }
    p.truncate(size.max(HEADER));
    p
}

fn seed(seq: u64) -> u64 {
    seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// What the publishers send.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Payload {
    /// [`payload`]: the binary header and filler.
    #[default]
    Binary,
    /// [`json_payload`]: a JSON reading for the expression drains.
    Json,
    /// [`json_payload`] published, read back as the Avro record the forwarder encoded it to
    /// ([`AVRO_READING`], Confluent wire format): the encodings section.
    Avro,
}

impl Payload {
    pub fn make(self, seq: u64, size: usize) -> Vec<u8> {
        match self {
            Payload::Binary => payload(seq, size),
            Payload::Json | Payload::Avro => json_payload(seq, size),
        }
    }
}

/// The Avro schema of [`json_payload`]'s readings, field for field: what the encodings section
/// registers, and what [`decode_avro`] reads back.
pub const AVRO_READING: &str = r#"{"type": "record", "name": "Reading", "namespace": "bench",
  "fields": [
    {"name": "seq", "type": "long"},
    {"name": "sent", "type": "long"},
    {"name": "device", "type": "string"},
    {"name": "type", "type": {"type": "enum", "name": "Kind", "symbols": ["reading", "heartbeat"]}},
    {"name": "temp", "type": "double"},
    {"name": "filler", "type": "string"}
  ]}"#;

/// `seq`, `sent` and `device` of an [`AVRO_READING`] record in Confluent's wire format (byte 0,
/// a 4-byte schema id, the Avro binary encoding), decoded here by hand rather than by the
/// forwarder's code: zig-zag varint longs, a string as its length (a long) and its bytes.
pub fn decode_avro(record: &[u8]) -> Option<(u64, u64, String)> {
    let (&magic, rest) = record.split_first()?;
    if magic != 0 {
        return None;
    }
    let mut body = rest.get(4..)?;
    let mut long = || -> Option<i64> {
        let mut n = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, tail) = body.split_first()?;
            body = tail;
            n |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some((n >> 1) as i64 ^ -((n & 1) as i64));
            }
        }
        None
    };
    let seq = u64::try_from(long()?).ok()?;
    let sent = u64::try_from(long()?).ok()?;
    let len = usize::try_from(long()?).ok()?;
    let device = std::str::from_utf8(body.get(..len)?).ok()?.to_owned();
    Some((seq, sent, device))
}

/// The devices the JSON readings come from (one Kafka key each when keyed by device).
pub const DEVICES: u64 = 16;
/// Every this-many-th JSON message (sequence numbers 0, 10, 20, ...) is a heartbeat.
pub const HEARTBEAT_EVERY: u64 = 10;

pub fn is_heartbeat(seq: u64) -> bool {
    seq.is_multiple_of(HEARTBEAT_EVERY)
}

/// Messages of `0..n` that are not heartbeats.
pub fn readings(n: u64) -> u64 {
    n - n.div_ceil(HEARTBEAT_EVERY)
}

/// The device of message `seq`: mixed rather than `seq % 16`, so a device's messages are spread
/// over the MQTT topics (`seq % 16`) and keying by device reorders what each key holds.
pub fn device_of(seq: u64) -> String {
    let mut x = seed(seq);
    format!("dev-{:02}", xorshift(&mut x) % DEVICES)
}

/// A JSON reading of `size` bytes (at least its fields): `seq` and `sent` (ns since the epoch)
/// for the judge, `device`, `type` (`heartbeat` or `reading`), `temp` (always with a fraction,
/// so CEL sees a double), and base64 filler: random 6-bit digits, which lz4 cannot shrink.
pub fn json_payload(seq: u64, size: usize) -> Vec<u8> {
    const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let kind = if is_heartbeat(seq) {
        "heartbeat"
    } else {
        "reading"
    };
    let mut x = seed(seq);
    let temp = 15.0 + (xorshift(&mut x) % 300) as f64 / 10.0;
    let mut p = format!(
        r#"{{"seq":{seq},"sent":{},"device":"{}","type":"{kind}","temp":{temp:.1},"filler":""#,
        now_ns(),
        device_of(seq)
    )
    .into_bytes();
    let end = size.max(p.len() + 2) - 2;
    while p.len() < end {
        let mut r = xorshift(&mut x);
        for _ in 0..10 {
            p.push(BASE64[(r & 63) as usize]);
            r >>= 6;
        }
    }
    p.truncate(end);
    p.extend_from_slice(b"\"}");
    p
}

pub fn decode(p: &[u8]) -> Option<(u64, u64)> {
    let seq = u64::from_be_bytes(p.get(0..8)?.try_into().ok()?);
    let sent = u64::from_be_bytes(p.get(8..16)?.try_into().ok()?);
    Some((seq, sent))
}

/// Message `seq` goes to MQTT topic `<prefix>/t<seq % topics>`.
pub fn topic_of(prefix: &str, seq: u64, topics: u64) -> String {
    format!("{prefix}/t{}", seq % topics)
}

pub fn qos(level: u8) -> QoS {
    match level {
        0 => QoS::AtMostOnce,
        1 => QoS::AtLeastOnce,
        _ => QoS::ExactlyOnce,
    }
}

/// Publishes `n` messages as fast as the broker takes them; returns once it holds them all.
pub async fn publish_backlog(
    port: u16,
    prefix: &str,
    n: u64,
    size: usize,
    topics: u64,
    level: u8,
    kind: Payload,
) -> Result<()> {
    let messages = (0..n)
        .map(|seq| (topic_of(prefix, seq, topics), kind.make(seq, size)))
        .collect();
    ferry_e2e::publish(port, format!("{prefix}-publisher"), qos(level), messages).await
}

/// Publishes `rate` messages per second for `duration` at QoS 1, each stamped when handed
/// to the client; returns how many were sent.
pub async fn publish_at_rate(
    port: u16,
    prefix: &str,
    rate: u64,
    duration: Duration,
    size: usize,
    topics: u64,
) -> Result<u64> {
    let until = Arc::new(AtomicBool::new(false));
    let stopper = until.clone();
    let timer = tokio::spawn(async move {
        tokio::time::sleep(duration).await;
        stopper.store(true, Ordering::Relaxed);
    });
    let sent = publish_until(port, prefix, rate, size, topics, until).await;
    timer.abort();
    sent
}

/// [`publish_at_rate`] until `until` is set, for load that must outlast a measurement whose
/// length is not known in advance (the operator's warm-up waits on the rules' status).
pub async fn publish_until(
    port: u16,
    prefix: &str,
    rate: u64,
    size: usize,
    topics: u64,
    until: Arc<AtomicBool>,
) -> Result<u64> {
    let mut opts = MqttOptions::new(format!("{prefix}-rate-publisher"), "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_inflight(u16::MAX)
        .set_max_packet_size(1 << 24, 1 << 24);
    let (client, mut eventloop) = AsyncClient::new(opts, 10_000);
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let poller = tokio::spawn(async move {
        loop {
            match eventloop.poll().await {
                Ok(Event::Outgoing(Outgoing::Disconnect)) => return Ok(()),
                Ok(_) => {}
                Err(e) if stopped.load(Ordering::Relaxed) => {
                    let _ = e;
                    return Ok(());
                }
                Err(e) => return Err(anyhow!("rate publisher: {e}")),
            }
        }
    });
    let prefix = prefix.to_owned();
    let start = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut seq = 0u64;
    while !until.load(Ordering::Relaxed) {
        tick.tick().await;
        // Catch up to where the schedule says we should be.
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        while seq < due {
            client
                .publish(
                    topic_of(&prefix, seq, topics),
                    QoS::AtLeastOnce,
                    false,
                    payload(seq, size),
                )
                .await?;
            seq += 1;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    client.disconnect().await?;
    // A connection that failed before the stop is a failed run, not a short one.
    if let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(5), poller).await {
        return Err(e);
    }
    Ok(seq)
}

/// What arrived in Kafka, judged against what was published.
#[derive(Debug, Clone, Default)]
pub struct Arrivals {
    pub records: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
    /// Heartbeats read back where the rule filters them out ([`Judge::no_heartbeats`]).
    pub heartbeats: u64,
    /// Records whose device is not the one sent with their sequence number, or whose key is
    /// not their device where [`Judge::key_is_device`].
    pub mismatched: u64,
    /// End-to-end latency of each first arrival, in ms (publish call → read from Kafka).
    pub latencies_ms: Vec<f64>,
    /// When the first and the last record were read (ns since the epoch; 0: none was).
    pub first_read_ns: u64,
    pub last_read_ns: u64,
}

/// How the reader reads and judges the records.
#[derive(Debug, Clone, Copy, Default)]
pub struct Judge {
    pub payload: Payload,
    /// A filter dropped the heartbeats: any that arrives is counted, and none is waited for.
    pub no_heartbeats: bool,
    /// The rule keys records by `json.device`.
    pub key_is_device: bool,
}

/// One record as the judge sees it: sequence number, send time, and device (JSON only).
fn decode_record(payload: &[u8], kind: Payload) -> Option<(u64, u64, Option<String>)> {
    match kind {
        Payload::Binary => decode(payload).map(|(seq, sent)| (seq, sent, None)),
        Payload::Avro => decode_avro(payload).map(|(seq, sent, device)| (seq, sent, Some(device))),
        Payload::Json => {
            let v: serde_json::Value = serde_json::from_slice(payload).ok()?;
            let device = v.get("device")?.as_str()?.to_owned();
            Some((
                v.get("seq")?.as_u64()?,
                v.get("sent")?.as_u64()?,
                Some(device),
            ))
        }
    }
}

/// The reader's running verdict.
#[derive(Default)]
struct Tally {
    seen: HashSet<u64>,
    last_per_key: HashMap<Vec<u8>, u64>,
    a: Arrivals,
}

impl Tally {
    /// Judges one record read at `received` (ns since the epoch).
    fn take(&mut self, key: Option<&[u8]>, payload: &[u8], judge: Judge, received: u64) -> bool {
        self.a.records += 1;
        if self.a.first_read_ns == 0 {
            self.a.first_read_ns = received;
        }
        self.a.last_read_ns = received;
        let Some((seq, sent, device)) = decode_record(payload, judge.payload) else {
            return false;
        };
        if judge.no_heartbeats && is_heartbeat(seq) {
            // Not inserted in `seen`: `lost` counts the readings that did not arrive.
            self.a.heartbeats += 1;
            return true;
        }
        if let Some(device) = &device {
            let wrong_key = judge.key_is_device && key != Some(device.as_bytes());
            if wrong_key || *device != device_of(seq) {
                self.a.mismatched += 1;
            }
        }
        if !self.seen.insert(seq) {
            self.a.duplicates += 1;
            return true;
        }
        self.a
            .latencies_ms
            .push(received.saturating_sub(sent) as f64 / 1_000_000.0);
        let key = key.map(<[u8]>::to_vec).unwrap_or_default();
        let last = self.last_per_key.entry(key).or_insert(seq);
        if seq < *last {
            self.a.out_of_order += 1;
        }
        *last = (*last).max(seq);
        true
    }
}

/// Reads `topic` from the beginning in a thread until `expect` distinct sequence numbers
/// arrived and `settle` passed with nothing new, or `timeout` passed. `stop` ends it early
/// (e.g. when the caller knows how many were sent only later).
pub fn read_topic(
    bootstrap: String,
    topic: String,
    settle: Duration,
    timeout: Duration,
    judge: Judge,
) -> Result<Reader> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", format!("ferry-bench-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "50")
        .create()?;
    let md = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
    let partitions: Vec<i32> = md
        .topics()
        .first()
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if partitions.is_empty() {
        bail!("topic {topic} has no partitions");
    }
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        tpl.add_partition_offset(&topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let expect = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    let want = expect.clone();
    let handle = std::thread::spawn(move || -> Result<Arrivals> {
        let mut tally = Tally::default();
        let start = Instant::now();
        let mut last_new = Instant::now();
        while start.elapsed() < timeout {
            let target = want.load(Ordering::Relaxed);
            if tally.seen.len() as u64 >= target && last_new.elapsed() >= settle {
                break;
            }
            match consumer.poll(Duration::from_millis(50)) {
                Some(Ok(m)) => {
                    let received = now_ns();
                    last_new = Instant::now();
                    let payload = m.payload().unwrap_or_default();
                    if !tally.take(m.key(), payload, judge, received) {
                        bail!("a record without a bench header in {topic}");
                    }
                }
                Some(Err(e)) => bail!("consume {topic}: {e}"),
                None => {}
            }
        }
        let target = want.load(Ordering::Relaxed);
        tally.a.lost = target.saturating_sub(tally.seen.len() as u64);
        Ok(tally.a)
    });
    Ok(Reader { expect, handle })
}

pub struct Reader {
    expect: Arc<std::sync::atomic::AtomicU64>,
    handle: std::thread::JoinHandle<Result<Arrivals>>,
}

impl Reader {
    /// Tells the reader how many distinct messages to wait for, and waits for its verdict.
    pub fn finish(self, expect: u64) -> Result<Arrivals> {
        self.expect.store(expect, Ordering::Relaxed);
        self.handle
            .join()
            .map_err(|_| anyhow!("the Kafka reader panicked"))?
    }
}

/// The p-th percentile (0–100) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_payloads_are_the_size_asked_and_judged_from_their_fields() {
        for seq in [0u64, 7, 10, 99_999] {
            let p = json_payload(seq, 300);
            assert_eq!(p.len(), 300);
            let v: serde_json::Value = serde_json::from_slice(&p).unwrap();
            let kind = if seq.is_multiple_of(10) {
                "heartbeat"
            } else {
                "reading"
            };
            assert_eq!(v["type"], kind);
            assert!(v["temp"].is_f64());
            let (s, _, device) = decode_record(&p, Payload::Json).unwrap();
            assert_eq!((s, device), (seq, Some(device_of(seq))));
        }
        assert_eq!(readings(100_000), 90_000);
        assert_eq!(readings(11), 9);
    }

    /// An Avro record as Confluent's serializers write it (hand-encoded here: zig-zag varints),
    /// and what is not one.
    #[test]
    fn avro_records_are_judged_from_their_first_fields() {
        let zigzag = |v: i64, out: &mut Vec<u8>| {
            let mut n = ((v << 1) ^ (v >> 63)) as u64;
            while n >= 0x80 {
                out.push((n as u8) | 0x80);
                n >>= 7;
            }
            out.push(n as u8);
        };
        let sent = 1_764_150_000_123_456_789i64;
        let mut r = vec![0, 0, 0, 0, 7];
        zigzag(12_345, &mut r);
        zigzag(sent, &mut r);
        zigzag(6, &mut r);
        r.extend_from_slice(b"dev-03");
        r.extend_from_slice(&[0, 0x9a]);
        assert_eq!(
            decode_avro(&r),
            Some((12_345, sent as u64, "dev-03".to_owned()))
        );
        assert_eq!(decode_avro(&r[..r.len() - 10]), None, "cut short");
        r[0] = 1;
        assert_eq!(decode_avro(&r), None, "not the wire format's magic byte");
        assert_eq!(decode_avro(&json_payload(1, 300)), None);
    }

    #[test]
    fn the_judge_counts_heartbeats_and_keys_not_their_device() {
        let judge = Judge {
            payload: Payload::Json,
            no_heartbeats: true,
            key_is_device: true,
        };
        let mut t = Tally::default();
        let key = device_of(1);
        assert!(t.take(Some(key.as_bytes()), &json_payload(1, 300), judge, 0));
        assert!(t.take(Some(b"other"), &json_payload(2, 300), judge, 0));
        assert!(t.take(None, &json_payload(10, 300), judge, 0));
        assert!(!t.take(None, b"not json", judge, 0));
        assert_eq!((t.a.heartbeats, t.a.mismatched, t.seen.len()), (1, 1, 2));
    }
}
