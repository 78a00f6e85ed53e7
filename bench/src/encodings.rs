//! The encodings section: the same backlog drain of ~300 B JSON readings (QoS 1, 1 replica)
//! through a plain rule and through a rule encoding each value as an Avro record via a real
//! schema registry (Apicurio, started here), in paired rounds, so what encoding costs the
//! forwarder per message shows beside a like-for-like plain drain; and the encoders alone
//! (`--encode-cost`'s micro-benchmark) for scale.

use anyhow::{Context as _, Result};
use ferry_e2e::schema_registry::{SchemaRegistry, SchemaType};

use crate::expressions::ExprRule;
use crate::load::AVRO_READING;
use crate::report::{EncodingDrain, EncodingFigures};
use crate::{Bench, DrainSpec, encode};

/// The subject the Avro rule encodes with (its latest version).
pub const SUBJECT: &str = "bench-reading-value";

/// Paired rounds (a plain and an Avro drain each): a drain of 100k messages lasts about a
/// second, on 2 cores shared with both brokers, and the forwarder's CPU is read in 10 ms ticks.
const ROUNDS: usize = 7;
const QUICK_ROUNDS: usize = 3;

pub fn run(bench: &mut Bench, window: u32, quick: bool) -> Result<EncodingFigures> {
    println!("\n== Encodings: the encoders alone, in this process");
    let encode_cost = encode::encode_cost()?;
    let registry = SchemaRegistry::start().context(
        "the encodings section needs the schema registry `make deps` builds (e2e/install.sh)",
    )?;
    let schema_id = registry.register(SUBJECT, SchemaType::Avro, AVRO_READING)?;
    bench.registry_url = Some(registry.url());
    let rounds = if quick { QUICK_ROUNDS } else { ROUNDS };
    println!(
        "\n== Encodings: QoS 1, ~300 B JSON, window {window}, 1 replica, plain vs Avro (schema id {schema_id}), {rounds} paired rounds"
    );
    let measured = drains(bench, window, rounds);
    bench.registry_url = None;
    drop(registry);
    let [plain, avro] = measured?;
    let figures = EncodingFigures::new(SUBJECT.to_owned(), schema_id, plain, avro, encode_cost);
    println!("{}", figures.line());
    Ok(figures)
}

/// `rounds` pairs of drains, the plain one first in even rounds and the Avro one first in odd
/// ones (so a drift of the machine's load over the section weighs on both alike).
fn drains(bench: &mut Bench, window: u32, rounds: usize) -> Result<[Vec<EncodingDrain>; 2]> {
    let mut runs: [Vec<EncodingDrain>; 2] = Default::default();
    for round in 0..rounds {
        let mut order = [0, 1];
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let rule = [ExprRule::Plain, ExprRule::Avro][i];
            let spec = DrainSpec::json(rule, window);
            let (drain, arrivals) = bench.drain_judged(spec)?;
            runs[i].push(EncodingDrain {
                format: if rule == ExprRule::Avro {
                    "avro"
                } else {
                    "plain"
                }
                .to_owned(),
                value: rule.expressions(),
                expected: spec.expected(drain.messages),
                records: arrivals.records,
                mismatched: arrivals.mismatched,
                round,
                drain,
            });
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load;

    /// Every reading the drains publish is a record of the registered schema: the fields in
    /// its order and of its types, nothing the schema lacks (the encoder would ignore it, and
    /// the bench measure less than the payload).
    #[test]
    fn the_registered_schema_has_every_field_of_the_readings() {
        let schema: serde_json::Value = serde_json::from_str(AVRO_READING).unwrap();
        let fields: Vec<&str> = schema["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap())
            .collect();
        for seq in [0, 1, 99_999] {
            let reading: serde_json::Value =
                serde_json::from_slice(&load::json_payload(seq, 300)).unwrap();
            let keys: Vec<&str> = reading
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            let mut sorted = fields.clone();
            sorted.sort_unstable();
            let mut keys_sorted = keys.clone();
            keys_sorted.sort_unstable();
            assert_eq!(keys_sorted, sorted, "reading {seq}");
        }
    }

    /// The forwarder's encoder takes the readings against the schema, and the judge's own
    /// decoder reads back what it wrote.
    #[test]
    fn the_readings_encode_and_the_judge_decodes_them() {
        use ferry_forwarder::encode::{Encoder, RegisteredSchema, SchemaKind};
        let schema = RegisteredSchema {
            id: 42,
            kind: SchemaKind::Avro,
            text: AVRO_READING.to_owned(),
        };
        let encoder = Encoder::compile(&schema, None).unwrap();
        for seq in [0, 1, 99_999] {
            let reading = load::json_payload(seq, 300);
            let v: serde_json::Value = serde_json::from_slice(&reading).unwrap();
            let mut record = Vec::new();
            encoder.encode(&reading, &mut record).unwrap();
            assert_eq!(record[..5], [0, 0, 0, 0, 42]);
            assert_eq!(
                load::decode_avro(&record),
                Some((seq, v["sent"].as_u64().unwrap(), load::device_of(seq)))
            );
        }
    }
}
