//! What one message costs the forwarder, in instructions counted by callgrind (through
//! gungraun): routed, judged by its rule's expressions, taken into the window, its record built
//! and encoded, confirmed and acknowledged — `ferry_forwarder::path`, the steps the pipeline runs
//! between the MQTT socket and librdkafka, without either. One bench per kind of rule: plain,
//! CEL (filter and key), Avro, Protobuf. Each fails when the count passes its budget (`budget.rs`), so a
//! change that makes the hot path costlier fails `make test` with the figures. Instruction
//! counts do not depend on the machine's load, unlike times.

mod budget;

use std::collections::HashSet;
use std::hint::black_box;
use std::sync::Arc;

use ferry_api::config::SchemaFormat;
use ferry_forwarder::limits::{Learned, TopicLimits};
use ferry_forwarder::metrics::Metrics;
use ferry_forwarder::mqtt::Message;
use ferry_forwarder::path::{INLINE_STEPS, Inflight, judge};
use ferry_forwarder::registry::Fetched;
use ferry_forwarder::route::{Routed, Router};
use ferry_forwarder::schemas;
use ferry_forwarder::window::{Action, Backoff, Outcome, Window};
use gungraun::prelude::*;
use gungraun::{Callgrind, EventKind};

/// Messages per count: the budget is per message, the count over this many.
const MESSAGES: u64 = 1000;
/// Messages through the path before the count: the window's and the scratch buffers' first
/// allocations are not what each message costs.
const WARM_UP: u64 = 100;
const PAYLOAD_BYTES: usize = 300;
const TOPIC: &str = "telemetry";

const AVRO_SCHEMA: &str = r#"{"type": "record", "name": "Reading", "namespace": "plant",
  "fields": [
    {"name": "seq", "type": "long"},
    {"name": "sent", "type": "long"},
    {"name": "device", "type": "string"},
    {"name": "type", "type": "string"},
    {"name": "temp", "type": "double"},
    {"name": "filler", "type": "string"}
  ]}"#;

const PROTOBUF_SCHEMA: &str = r#"syntax = "proto3";
package plant;
message Reading {
  int64 seq = 1;
  int64 sent = 2;
  string device = 3;
  string type = 4;
  double temp = 5;
  string filler = 6;
}
"#;

#[derive(Debug, Clone, Copy)]
enum Rule {
    /// The payload as it came, to one topic.
    Plain,
    /// Heartbeats (one in ten) filtered out, records keyed by device.
    Cel,
    /// Each value encoded as an Avro record (the schema given, as the registry would).
    Avro,
    /// Each value encoded as a Protobuf message, the same way.
    Protobuf,
}

impl Rule {
    fn yaml(self) -> String {
        let rule = match self {
            Rule::Plain => String::new(),
            Rule::Cel => format!(
                "    filter: \"json.type != 'heartbeat'\"\n    kafka: {{ topic: {TOPIC}, key: {{ expression: \"json.device\" }} }}\n"
            ),
            Rule::Avro | Rule::Protobuf => {
                let format = if matches!(self, Rule::Avro) {
                    "avro"
                } else {
                    "protobuf"
                };
                format!(
                    "    on_unwritable: drop\n    kafka: {{ topic: {TOPIC}, value: {{ format: {format}, subject: readings }} }}\n"
                )
            }
        };
        let kafka = if rule.is_empty() {
            format!("    kafka: {{ topic: {TOPIC} }}\n")
        } else {
            rule
        };
        format!(
            "mqtt: {{ host: h, client_id: c }}\n\
             kafka: {{ bootstrap_servers: \"k:9092\" }}\n\
             schema_registry: {{ url: \"http://registry:8081\" }}\n\
             rules:\n  - name: sensors\n    mqtt: {{ topics: [\"sensors/+/data\"] }}\n{kafka}"
        )
    }

    fn budget(self) -> u64 {
        match self {
            Rule::Plain => budget::PLAIN,
            Rule::Cel => budget::CEL,
            Rule::Avro => budget::AVRO,
            Rule::Protobuf => budget::PROTOBUF,
        }
    }
}

/// The pipeline's state for one group, as `Pipeline` holds it, and the messages to forward.
struct Path {
    router: Router,
    scratch: Vec<Routed>,
    refused: HashSet<u32>,
    window: Window<Inflight>,
    limits: TopicLimits,
    record_max_bytes: usize,
    messages: Vec<Message>,
}

impl Path {
    fn new(rule: Rule) -> Path {
        let config = ferry_api::load_str(&rule.yaml(), |_| None)
            .unwrap_or_else(|e| panic!("the bench's config: {e}"))
            .config;
        let router = Router::new(&config, &Metrics::new());
        for slot in router.schemas() {
            let fetched = Fetched {
                subject: slot.spec.subject.clone(),
                version: 1,
                id: 1,
                format: slot.spec.format,
                text: match slot.spec.format {
                    SchemaFormat::Protobuf => PROTOBUF_SCHEMA,
                    _ => AVRO_SCHEMA,
                }
                .to_owned(),
            };
            let ready = schemas::compile(fetched, &slot.spec).expect("the bench's schema");
            slot.set_ready(Arc::new(ready));
        }
        let record_max_bytes = 1_000_000;
        let mut limits = TopicLimits::new(record_max_bytes);
        // Known, as after the first seconds: records are not produced one at a time.
        limits.learned(
            Arc::from(TOPIC),
            Learned::Known {
                max_bytes: record_max_bytes,
                compacted: false,
            },
        );
        let mut path = Path {
            router,
            scratch: Vec::new(),
            refused: HashSet::new(),
            window: Window::new(Backoff::default()),
            limits,
            record_max_bytes,
            messages: (WARM_UP..WARM_UP + MESSAGES).map(message).collect(),
        };
        for seq in 0..WARM_UP {
            path.forward(message(seq));
        }
        path
    }

    fn forward_all(&mut self) {
        for message in std::mem::take(&mut self.messages) {
            self.forward(message);
        }
    }

    /// What `Pipeline::accept`, `produce` and the delivery reports do with a message whose
    /// record Kafka confirms at once.
    fn forward(&mut self, message: Message) {
        self.router.route(
            &message.topic,
            &message.subscription_ids,
            &self.refused,
            &mut self.scratch,
        );
        let now = tokio::time::Instant::now();
        let judged = judge(
            &self.scratch,
            &message,
            now,
            self.record_max_bytes,
            Some(INLINE_STEPS),
        )
        .expect("judged inline");
        self.scratch.clear();
        let (inflight, specs) = Inflight::new(judged, message, &mut self.limits, now);
        self.window.accept(inflight, specs, now.into_std());
        while let Some(action) = self.window.next_action() {
            match action {
                Action::Produce { target, .. } => {
                    let record = self
                        .window
                        .message_mut(target.seq)
                        .and_then(|m| m.primary_record(target.pos))
                        .expect("the target produced")
                        .expect("encoded");
                    black_box((&record.value, record.key, record.owned_headers()));
                    self.window
                        .on_outcome(target, Outcome::Delivered, std::time::Instant::now());
                }
                Action::Complete {
                    message: Some(done),
                    ..
                } => done.credit_acked(),
                Action::Delivered { .. } | Action::Complete { message: None, .. } => {}
                _ => panic!("a bench message was not simply delivered"),
            }
        }
    }
}

/// A reading of [`PAYLOAD_BYTES`] on one of 50 topics; one in ten is a heartbeat.
fn message(seq: u64) -> Message {
    let kind = if seq.is_multiple_of(10) {
        "heartbeat"
    } else {
        "reading"
    };
    let mut payload = format!(
        r#"{{"seq":{seq},"sent":{},"device":"dev-{}","type":"{kind}","temp":{}.5,"filler":""#,
        1_700_000_000_000u64 + seq,
        seq % 97,
        15 + seq % 20
    );
    while payload.len() < PAYLOAD_BYTES - 2 {
        payload.push(char::from(b'a' + (payload.len() % 26) as u8));
    }
    payload.push_str("\"}");
    Message {
        size: payload.len() + 20,
        pkid: (seq % 65_535 + 1) as u16,
        ..Message::new(format!("sensors/{}/data", seq % 50), payload)
    }
}

fn counted(rule: Rule) -> LibraryBenchmarkConfig {
    LibraryBenchmarkConfig::default()
        .tool(Callgrind::default().hard_limits([(EventKind::Ir, rule.budget() * MESSAGES)]))
        .clone()
}

#[library_benchmark]
#[bench::plain(args = (Rule::Plain), setup = Path::new, config = counted(Rule::Plain))]
#[bench::cel(args = (Rule::Cel), setup = Path::new, config = counted(Rule::Cel))]
#[bench::avro(args = (Rule::Avro), setup = Path::new, config = counted(Rule::Avro))]
#[bench::protobuf(args = (Rule::Protobuf), setup = Path::new, config = counted(Rule::Protobuf))]
fn thousand_messages(mut path: Path) -> Path {
    path.forward_all();
    path
}

library_benchmark_group!(name = per_message, benchmarks = [thousand_messages]);

main!(library_benchmark_groups = per_message);
