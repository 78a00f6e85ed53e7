//! The Kafka record a message becomes for one target: its key, value and headers, for its own
//! topic or for its dead-letter topic, and its size as Kafka counts it. No partition is set:
//! the partitioner places it by key. Pure: the producer's types appear only in the
//! conversion at the edge (`owned_headers`).

use std::borrow::Cow;
use std::sync::Arc;

use ferry_api::{KafkaTopic, KeyStrategy, PayloadFormat};
use rdkafka::message::OwnedHeaders;

use crate::eval::Evaluated;
use crate::mqtt::Message;
use crate::route::{Target, header, record_key, wrap_json};
use crate::schemas::{NotYet, Ready};

/// One Kafka record, borrowing from the message and its evaluation where it can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'m> {
    pub key: Option<&'m [u8]>,
    pub value: Cow<'m, [u8]>,
    /// In order; a name may repeat (MQTT 5 user properties may).
    pub headers: Vec<(Cow<'m, str>, Cow<'m, [u8]>)>,
}

/// Why a record's value could not be encoded with its target's schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unencoded {
    /// The schema is not known yet (the registry did not give it): the record waits.
    Waiting(String),
    /// The value does not fit the schema: never will, as it is.
    Mismatch(String),
}

/// What one target made of one message: the inputs of its records.
#[derive(Debug, Clone, Copy)]
pub struct Source<'m> {
    pub target: &'m Target,
    /// What the target's expressions made of the message; `None` for a target without any.
    pub evaluated: Option<&'m Evaluated>,
    pub message: &'m Message,
}

/// Kafka's record batch header (v2, with the log's offset and length): every produce request
/// carries at least one, and the topic's `max.message.bytes` counts it.
pub const BATCH_OVERHEAD: usize = 61;

impl<'m> Source<'m> {
    /// The record for the target's own topic.
    pub fn primary(self) -> Record<'m> {
        Record {
            key: self.key(),
            value: self.value(),
            headers: self.headers(),
        }
    }

    /// The record for the target's own topic with `value` as its value: the one its schema
    /// encoded ([`Source::encode`]).
    pub fn primary_valued(self, value: &'m [u8]) -> Record<'m> {
        Record {
            key: self.key(),
            value: Cow::Borrowed(value),
            headers: self.headers(),
        }
    }

    /// The value as the target makes it, before any schema.
    fn value(self) -> Cow<'m, [u8]> {
        match (&self.target.payload, self.evaluated) {
            (PayloadFormat::Transform(_), Some(e)) => {
                Cow::Borrowed(e.value.as_deref().unwrap_or_default())
            }
            (PayloadFormat::WrappedJson, _) => {
                Cow::Owned(wrap_json(&self.message.topic, &self.message.payload))
            }
            _ => Cow::Borrowed(&self.message.payload[..]),
        }
    }

    /// The schema the target encodes its values with (`kafka.value`), `None` when it has
    /// none, or why there is none yet.
    pub fn schema(self) -> Result<Option<Arc<Ready>>, Unencoded> {
        let Some(slot) = &self.target.value else {
            return Ok(None);
        };
        slot.ready().map(Some).map_err(|not| match not {
            NotYet::Waiting(why) => Unencoded::Waiting(why),
            NotYet::Retired(why) => Unencoded::Mismatch(why),
        })
    }

    /// The value encoded by `schema`.
    pub fn encode(self, schema: &Ready) -> Result<Vec<u8>, Unencoded> {
        let value = self.value();
        let mut out = Vec::with_capacity(value.len() + 16);
        schema.encoder.encode(&value, &mut out).map_err(|e| {
            Unencoded::Mismatch(format!(
                "does not fit the schema of subject {:?} version {} (id {}): {e}",
                schema.subject, schema.version, schema.id
            ))
        })?;
        Ok(out)
    }

    /// The record for the dead-letter topic: the message's payload as it came, the original
    /// record's key and headers, and where it came from, where it was going (`rules`, the
    /// target's matched rules), and why it could not get there.
    pub fn dead_letter(self, rules: &str, error: &str) -> Record<'m> {
        let mut headers = self.headers();
        for (name, value) in [
            ("ferry.mqtt.topic", self.message.topic.clone()),
            ("ferry.kafka.topic", self.intended_topic()),
            ("ferry.rule", rules.to_owned()),
            ("ferry.error", error.to_owned()),
        ] {
            headers.push((Cow::Borrowed(name), Cow::Owned(value.into_bytes())));
        }
        Record {
            key: self.key(),
            value: Cow::Borrowed(&self.message.payload[..]),
            headers,
        }
    }

    pub fn key(self) -> Option<&'m [u8]> {
        match (&self.target.key, self.evaluated) {
            (KeyStrategy::Expression(_), Some(e)) => e.key.as_deref(),
            (strategy, _) => record_key(strategy, &self.message.topic).map(str::as_bytes),
        }
    }

    /// The header plan's (MQTT metadata, user properties), then the expressions'.
    fn headers(self) -> Vec<(Cow<'m, str>, Cow<'m, [u8]>)> {
        let mut planned = Vec::new();
        self.target.header_plan.add(self.message, &mut planned);
        let evaluated = self.evaluated.map(|e| &e.headers[..]).unwrap_or_default();
        planned
            .into_iter()
            .chain(
                evaluated
                    .iter()
                    .map(|(name, value)| (name.as_str(), &value[..])),
            )
            .map(|(name, value)| (Cow::Borrowed(name), Cow::Borrowed(value)))
            .collect()
    }

    /// The topic its record was meant for, for the dead-letter record's headers.
    pub fn intended_topic(self) -> String {
        if let Some(Evaluated {
            topic: Some(name), ..
        }) = self.evaluated
        {
            return name.clone();
        }
        match &self.target.topic {
            KafkaTopic::Template(t) => t
                .resolve(&self.message.topic)
                .map_or_else(|_| t.to_string(), Cow::into_owned),
            KafkaTopic::Expression(_) => self.target.topic_text(),
        }
    }
}

impl Record<'_> {
    /// The record's size as Kafka counts it against a topic's `max.message.bytes`, sent alone
    /// and uncompressed: a record batch (v2) of this one record.
    pub fn kafka_size(&self) -> usize {
        let bytes = |b: Option<&[u8]>| match b {
            Some(b) => varint_len(b.len() as i64) + b.len(),
            None => varint_len(-1),
        };
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, value)| bytes(Some(name.as_bytes())) + bytes(Some(value)))
            .sum();
        // Attributes, then timestamp and offset deltas (0: one byte each).
        let body = 1
            + 1
            + 1
            + bytes(self.key)
            + bytes(Some(&self.value))
            + varint_len(self.headers.len() as i64)
            + headers;
        BATCH_OVERHEAD + varint_len(body as i64) + body
    }

    /// Whether a topic whose `max.message.bytes` is `limit` may refuse the record: its
    /// uncompressed size, plus what a codec may add to bytes it cannot shrink (LZ4 and
    /// gzip add a few bytes per block; 1/64 and 64 bytes are well above either).
    pub fn may_exceed(&self, limit: usize) -> bool {
        let size = self.kafka_size();
        size.saturating_add(size / 64 + 64) > limit
    }

    /// The headers as librdkafka takes them; `None` when there are none.
    pub fn owned_headers(&self) -> Option<OwnedHeaders> {
        if self.headers.is_empty() {
            return None;
        }
        Some(self.headers.iter().fold(
            OwnedHeaders::new_with_capacity(self.headers.len()),
            |h, (name, value)| h.insert(header(name, value)),
        ))
    }
}

/// The length of `v` as a zigzag varint (Kafka's record fields).
fn varint_len(v: i64) -> usize {
    let mut zigzag = ((v << 1) ^ (v >> 63)) as u64;
    let mut len = 1;
    while zigzag >= 0x80 {
        zigzag >>= 7;
        len += 1;
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::Router;

    fn target_of(rule_kafka: &str) -> std::sync::Arc<Target> {
        let yaml = format!(
            "mqtt: {{ host: h, client_id: c }}\nkafka: {{ bootstrap_servers: \"k:9092\" }}\n\
             rules:\n  - name: r\n    mqtt: {{ topics: [\"#\"] }}\n    kafka: {rule_kafka}\n"
        );
        let config = ferry_api::load_str(&yaml, |_| None)
            .map(|l| l.config)
            .unwrap_or_else(|e| panic!("{e}"));
        let router = Router::new(&config, &crate::metrics::Metrics::new());
        let mut routed = Vec::new();
        router.route("plant/7/temp", &[], &Default::default(), &mut routed);
        std::sync::Arc::clone(&routed.first().expect("routed").target)
    }

    fn message(payload: &[u8]) -> Message {
        Message {
            user_properties: vec![("trace".into(), "t1".into())],
            ..Message::new("plant/7/temp", bytes::Bytes::copy_from_slice(payload))
        }
    }

    fn names(r: &Record<'_>) -> Vec<String> {
        r.headers.iter().map(|(n, _)| n.to_string()).collect()
    }

    #[test]
    fn the_primary_record_has_the_key_value_and_headers_its_rule_says() {
        let t = target_of(
            "{ topic: t, key: { topic_level: 1 }, headers: { metadata: true, user_properties: true } }",
        );
        let m = message(b"21.5");
        let r = Source {
            target: &t,
            evaluated: None,
            message: &m,
        }
        .primary();
        assert_eq!(r.key, Some(&b"7"[..]));
        assert_eq!(&r.value[..], b"21.5");
        assert!(
            matches!(r.value, Cow::Borrowed(_)),
            "the payload is not copied"
        );
        assert_eq!(
            names(&r),
            ["mqtt.topic", "mqtt.qos", "mqtt.retain", "trace"],
            "no content type was sent: none invented"
        );
        assert_eq!(&r.headers[1].1[..], b"1");
    }

    #[test]
    fn evaluated_key_headers_and_value_are_used_after_the_planned_headers() {
        let t = target_of(
            "{ topic: t, key: { expression: \"'k'\" }, headers: { user_properties: true } }",
        );
        let m = message(b"raw");
        let evaluated = Evaluated {
            key: None,
            headers: vec![("site".into(), b"north".to_vec())],
            value: Some(b"transformed".to_vec()),
            ..Evaluated::default()
        };
        let r = Source {
            target: &t,
            evaluated: Some(&evaluated),
            message: &m,
        }
        .primary();
        assert_eq!(r.key, None, "the expression said null: no key");
        assert_eq!(&r.value[..], b"raw", "no transform configured: the payload");
        assert_eq!(names(&r), ["trace", "site"]);
    }

    #[test]
    fn the_dead_letter_record_carries_the_payload_and_why() {
        let t = target_of("{ topic: \"plant.{1}\" }");
        let m = message(b"payload");
        let r = Source {
            target: &t,
            evaluated: None,
            message: &m,
        }
        .dead_letter("r", "too large");
        assert_eq!(r.key, Some(&b"plant/7/temp"[..]), "the original key");
        assert_eq!(&r.value[..], b"payload");
        let got: Vec<(String, String)> = r
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v).into_owned()))
            .collect();
        assert_eq!(
            got,
            [
                ("ferry.mqtt.topic", "plant/7/temp"),
                ("ferry.kafka.topic", "plant.7"),
                ("ferry.rule", "r"),
                ("ferry.error", "too large"),
            ]
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
        );
        assert!(r.owned_headers().is_some());
    }

    /// Sizes as Kafka's `DefaultRecordBatch` counts them: 61 bytes of batch header, then the
    /// record's varint length, attributes, deltas, key, value and headers.
    #[test]
    fn kafka_size_counts_a_batch_of_one_record() {
        let record = |key: Option<&'static [u8]>, value: usize, headers: usize| Record {
            key,
            value: Cow::Owned(vec![0; value]),
            headers: (0..headers)
                .map(|_| (Cow::Borrowed("h"), Cow::Borrowed(&b"v"[..])))
                .collect(),
        };
        // No key (-1: one byte), empty value (0: one byte), no headers (one byte): a body of 6.
        assert_eq!(record(None, 0, 0).kafka_size(), 61 + 1 + 6);
        // Key "k": 1 + 1 more; one header "h"="v": 4 more.
        assert_eq!(record(Some(b"k"), 0, 1).kafka_size(), 61 + 1 + 6 + 1 + 4);
        // A 100-byte value: its length takes two bytes (zigzag 200), so the body is 107, whose
        // own length takes two (zigzag 214).
        assert_eq!(record(None, 100, 0).kafka_size(), 61 + 2 + 107);
        assert_eq!(varint_len(63), 1);
        assert_eq!(varint_len(64), 2);
        assert_eq!(varint_len(-64), 1);
        assert_eq!(varint_len(-65), 2);
        let big = record(None, 64 * 1024, 0);
        assert!(big.may_exceed(64 * 1024));
        assert!(!record(None, 60 * 1024, 0).may_exceed(64 * 1024));
        assert!(
            record(None, 64 * 1024 - 200, 0).may_exceed(64 * 1024),
            "near: alone"
        );
    }
}
