//! What encoding a record through a registry schema costs the forwarder per message, without
//! brokers: a ~300 B sensor reading encoded as Avro, Protobuf and JSON Schema records, beside
//! the plain path (the payload copied as it is) and, for scale, parsing it into a JSON tree.

use std::hint::black_box;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use ferry_forwarder::encode::{Encoder, RegisteredSchema, SchemaKind};

/// Messages per timed run, and runs per format (the median is reported: the machine is shared).
pub const MESSAGES: usize = 200_000;
pub const RUNS: usize = 7;

const AVRO: &str = r#"{"type": "record", "name": "Reading", "namespace": "plant",
  "fields": [
    {"name": "device", "type": "string"},
    {"name": "seq", "type": "long"},
    {"name": "temp", "type": "double"},
    {"name": "humidity", "type": ["null", "double"], "default": null},
    {"name": "pressure", "type": "double"},
    {"name": "battery", "type": "float"},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["ok", "degraded", "failed"]}},
    {"name": "firmware", "type": "string"},
    {"name": "site", "type": "string"},
    {"name": "gateway", "type": ["null", "string"], "default": null},
    {"name": "location", "type": {"type": "record", "name": "Location",
      "fields": [{"name": "lat", "type": "double"}, {"name": "lon", "type": "double"}]}},
    {"name": "tags", "type": {"type": "array", "items": "string"}}
  ]}"#;

const PROTOBUF: &str = r#"syntax = "proto3";
package plant;
message Reading {
  string device = 1;
  int64 seq = 2;
  double temp = 3;
  optional double humidity = 4;
  double pressure = 5;
  float battery = 6;
  int64 ts = 7;
  Status status = 8;
  string firmware = 9;
  string site = 10;
  Location location = 11;
  repeated string tags = 12;
  string gateway = 13;
  enum Status { ok = 0; degraded = 1; failed = 2; }
  message Location { double lat = 1; double lon = 2; }
}"#;

const JSON_SCHEMA: &str = r#"{"type": "object",
  "required": ["device", "seq", "temp", "ts", "status"],
  "properties": {
    "device": {"type": "string"}, "seq": {"type": "integer"}, "temp": {"type": "number"},
    "humidity": {"type": ["number", "null"]}, "pressure": {"type": "number"},
    "battery": {"type": "number", "minimum": 0, "maximum": 1}, "ts": {"type": "integer"},
    "status": {"enum": ["ok", "degraded", "failed"]}, "firmware": {"type": "string"},
    "site": {"type": "string"}, "gateway": {"type": "string"},
    "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
    "tags": {"type": "array", "items": {"type": "string"}}
  }}"#;

/// A sensor reading of about 300 bytes; `seq` varies the values.
pub fn reading(seq: u64) -> Vec<u8> {
    let temp = 15.0 + (seq % 300) as f64 / 10.0;
    let humidity = 30.0 + (seq % 500) as f64 / 10.0;
    let status = ["ok", "ok", "ok", "degraded"][(seq % 4) as usize];
    format!(
        r#"{{"device":"plant-7/line-{}/sensor-{:02}","seq":{seq},"temp":{temp:.2},"humidity":{humidity:.1},"pressure":1013.25,"battery":0.87,"ts":{},"status":"{status}","firmware":"2.4.1-rc3","site":"munich-north","gateway":"gw-munich-north-02","location":{{"lat":48.13513,"lon":11.58198}},"tags":["calibrated","outdoor","phase-b"]}}"#,
        seq % 8,
        seq % 64,
        1_732_600_000_123 + seq,
    )
    .into_bytes()
}

/// One format's cost per message.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EncodeCost {
    pub format: String,
    pub payload_bytes: usize,
    pub record_bytes: usize,
    /// Median over [`RUNS`] runs of [`MESSAGES`] messages.
    pub ns_per_message: f64,
}

/// Times each format and prints a line per format.
pub fn encode_cost() -> Result<Vec<EncodeCost>> {
    let payloads: Vec<Vec<u8>> = (0..1000).map(reading).collect();
    let mean_size = payloads.iter().map(Vec::len).sum::<usize>() / payloads.len();
    let compile = |kind, text: &str| -> Result<Encoder> {
        let schema = RegisteredSchema {
            id: 1,
            kind,
            text: text.to_owned(),
        };
        Encoder::compile(&schema, None).with_context(|| format!("the {kind:?} schema"))
    };
    let encoders = [
        ("avro", compile(SchemaKind::Avro, AVRO)?),
        ("protobuf", compile(SchemaKind::Protobuf, PROTOBUF)?),
        ("json-schema", compile(SchemaKind::JsonSchema, JSON_SCHEMA)?),
    ];
    let mut costs = Vec::new();
    // The plain path forwards the payload's bytes; a copy into a new buffer is its upper bound.
    costs.push(time("plain (copied)", &payloads, |p| Ok(p.to_vec()))?);
    costs.push(time("serde_json::Value", &payloads, |p| {
        let v: serde_json::Value = serde_json::from_slice(p)?;
        black_box(&v);
        Ok(Vec::new())
    })?);
    for (name, encoder) in &encoders {
        costs.push(time(name, &payloads, |p| {
            let mut out = Vec::with_capacity(p.len() + 8);
            encoder.encode(p, &mut out)?;
            Ok(out)
        })?);
    }
    println!(
        "encoding a {mean_size} B reading (the first: {} B), median of {RUNS} runs of {MESSAGES} messages \
         (a new record buffer per message):",
        costs.first().map_or(0, |c| c.payload_bytes)
    );
    for c in &costs {
        println!(
            "  {:<18} {:>7.0} ns/message  ({} B record)",
            c.format, c.ns_per_message, c.record_bytes
        );
    }
    Ok(costs)
}

fn time(
    format: &'static str,
    payloads: &[Vec<u8>],
    mut encode: impl FnMut(&[u8]) -> Result<Vec<u8>>,
) -> Result<EncodeCost> {
    let record_bytes = encode(&payloads[0])?.len();
    let mut runs = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = Instant::now();
        for p in payloads.iter().cycle().take(MESSAGES) {
            black_box(encode(black_box(p))?);
        }
        runs.push(start.elapsed().as_secs_f64() * 1e9 / MESSAGES as f64);
    }
    runs.sort_by(f64::total_cmp);
    let Some(&median) = runs.get(RUNS / 2) else {
        bail!("no runs");
    };
    Ok(EncodeCost {
        format: format.to_owned(),
        payload_bytes: payloads[0].len(),
        record_bytes,
        ns_per_message: median,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reading_is_about_300_bytes_and_every_format_encodes_it() {
        for seq in [0, 7, 999] {
            let p = reading(seq);
            assert!((280..=320).contains(&p.len()), "{} B", p.len());
        }
        let costs = encode_cost_once().unwrap();
        assert_eq!(costs, ["avro", "protobuf", "json-schema"]);
    }

    /// Each encoder accepts the reading (the bench would fail on its first message otherwise).
    fn encode_cost_once() -> Result<Vec<&'static str>> {
        let mut ok = Vec::new();
        for (name, kind, text) in [
            ("avro", SchemaKind::Avro, AVRO),
            ("protobuf", SchemaKind::Protobuf, PROTOBUF),
            ("json-schema", SchemaKind::JsonSchema, JSON_SCHEMA),
        ] {
            let schema = RegisteredSchema {
                id: 1,
                kind,
                text: text.to_owned(),
            };
            let encoder = Encoder::compile(&schema, None)?;
            let mut out = Vec::new();
            encoder.encode(&reading(5), &mut out)?;
            ok.push(name);
        }
        Ok(ok)
    }
}
