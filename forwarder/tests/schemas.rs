//! Schema-registry encodings against a real registry (Apicurio Registry, through its
//! Confluent-compatible API) and real Mosquitto and Kafka: records in each format decode with
//! confluent-kafka's own deserializers (Python), a value that does not fit its schema goes to
//! the dead-letter topic naming the field, and records wait, unacknowledged, while the
//! registry is unreachable, refuses the credentials or lacks the subject, then all arrive once
//! it has it.

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::{Brokers, Forwarder, wait_until};
use ferry_e2e::schema_registry::{SchemaRegistry, SchemaRegistryOptions, SchemaType};
use ferry_e2e::{KeyType, Pki, Record};
use serde_json::{Value, json};

/// Per rule and format; enough to see order and no loss, cheap to decode in Python.
const MESSAGES: usize = 40;
/// The schema lookup retries at most every 30 s (`schemas::RETRY_MAX`); Kafka's first
/// produce to a new topic takes a few seconds here.
const SETTLE: Duration = Duration::from_secs(60);

const AVRO: &str = r#"{"type":"record","name":"Reading","namespace":"acme","fields":[
  {"name":"device","type":"string"},
  {"name":"temp","type":"double"},
  {"name":"ok","type":"boolean"},
  {"name":"tags","type":{"type":"array","items":"string"}},
  {"name":"note","type":["null","string"],"default":null}]}"#;

const PROTO: &str = r#"syntax = "proto3";
package acme;
message Reading {
  string device = 1;
  double temp = 2;
  bool ok = 3;
  repeated string tags = 4;
}
"#;

const JSON_SCHEMA: &str = r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"object",
  "properties":{"device":{"type":"string"},"temp":{"type":"number"},"ok":{"type":"boolean"},
  "tags":{"type":"array","items":{"type":"string"}}},
  "required":["device","temp","ok"]}"#;

fn reading(n: usize) -> Value {
    json!({
        "device": format!("plant-7/line-3/sensor-{n}"),
        "temp": 20.0 + n as f64 / 4.0,
        "ok": n.is_multiple_of(2),
        "tags": ["a", format!("n{n}")],
    })
}

fn messages(prefix: &str, n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| (format!("{prefix}/{i}"), reading(i).to_string().into_bytes()))
        .collect()
}

/// Topics are not created automatically on the test's Kafka.
fn create_topics(brokers: &Brokers, topics: &[&str]) {
    let rt = common::runtime();
    for topic in topics {
        rt.block_on(brokers.kafka.create_topic(topic, 1))
            .unwrap_or_else(|e| panic!("create {topic}: {e}"));
    }
}

fn header<'r>(r: &'r Record, name: &str) -> Option<&'r str> {
    r.headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

fn registry_settings(registry: &SchemaRegistry, password_file: &std::path::Path) -> String {
    let tls = registry
        .ca_cert()
        .map(|ca| format!("\n  tls: {{ ca_file: {} }}", ca.display()))
        .unwrap_or_default();
    format!(
        "schema_registry:\n  url: {}{tls}\n  basic_auth: {{ username: ferry, password_file: {} }}\n",
        registry.url(),
        password_file.display()
    )
}

fn rule(name: &str, mqtt: &str, topic: &str, value: &str, extra: &str) -> String {
    format!(
        "  - name: {name}\n    mqtt: {{ topics: [\"{mqtt}\"] }}\n    kafka: {{ topic: {topic}, key: none, value: {value} }}\n    dead_letter: {{ topic: readings.dlq }}\n{extra}"
    )
}

/// The decoded values of `count` records of `topic`, by confluent-kafka's deserializer.
fn decoded(
    registry: &SchemaRegistry,
    brokers: &Brokers,
    topic: &str,
    count: usize,
    format: SchemaType,
) -> Vec<(u32, Value)> {
    registry
        .confluent_consume(&brokers.kafka.bootstrap(), topic, count, format, SETTLE)
        .unwrap_or_else(|e| panic!("decode {topic} as {format}: {e}"))
        .into_iter()
        .map(|r| {
            let id = r["schema_id"].as_u64().and_then(|i| u32::try_from(i).ok());
            (
                id.unwrap_or_else(|| panic!("no schema id: {r}")),
                r["value"].clone(),
            )
        })
        .collect()
}

#[test]
fn each_format_decodes_with_confluents_own_deserializers_and_a_misfit_is_dead_lettered() {
    let brokers = Brokers::start();
    create_topics(
        &brokers,
        &[
            "readings.avro",
            "readings.pb",
            "readings.json",
            "readings.tx",
            "readings.dlq",
        ],
    );
    let pki = Pki::generate(KeyType::Ecdsa).expect("pki");
    let registry = SchemaRegistry::start_with(SchemaRegistryOptions {
        tls: Some(&pki),
        basic_auth: Some(("ferry".into(), "s3cret: #pass".into())),
    })
    .expect("start the schema registry");
    let avro = registry
        .register("readings.avro-value", SchemaType::Avro, AVRO)
        .expect("register avro");
    let proto = registry
        .register("readings.pb-value", SchemaType::Protobuf, PROTO)
        .expect("register protobuf");
    let json_schema = registry
        .register("readings.json-value", SchemaType::Json, JSON_SCHEMA)
        .expect("register json");
    // A later version the rule does not pin: it must not be used.
    let json_v2 = registry
        .register(
            "readings.json-value",
            SchemaType::Json,
            &JSON_SCHEMA.replace("\"required\"", "\"title\":\"v2\",\"required\""),
        )
        .expect("register json v2");
    assert_ne!(json_v2, json_schema);
    let dir = tempfile::tempdir().expect("tempdir");
    let password = dir.path().join("registry-password");
    std::fs::write(&password, "s3cret: #pass").expect("password file");
    let rules = [
        rule(
            "avro",
            "r/avro/+",
            "readings.avro",
            "{ format: avro, subject: readings.avro-value }",
            "",
        ),
        rule(
            "protobuf",
            "r/pb/+",
            "readings.pb",
            "{ format: protobuf, subject: readings.pb-value, message: acme.Reading }",
            "",
        ),
        rule(
            "json",
            "r/json/+",
            "readings.json",
            "{ format: json_schema, subject: readings.json-value, version: 1 }",
            "",
        ),
        // A transform's result is what gets encoded.
        rule(
            "reshaped",
            "r/tx/+",
            "readings.tx",
            "{ format: avro, subject: readings.avro-value }",
            "    payload: { transform: \"{'device': levels[2], 'temp': json.t, 'ok': true, 'tags': []}\" }\n",
        ),
    ]
    .concat();
    let config = format!(
        "{}{}",
        registry_settings(&registry, &password),
        brokers.config("schemas-formats", &rules)
    );
    let mut fwd = Forwarder::start(&config);
    fwd.wait_ready(Duration::from_secs(30));
    let mut msgs = Vec::new();
    for prefix in ["r/avro", "r/pb", "r/json"] {
        msgs.extend(messages(prefix, MESSAGES));
        // `temp` a string: fits none of the schemas.
        msgs.push((
            format!("{prefix}/misfit"),
            br#"{"device":"d","temp":"hot","ok":true,"tags":[]}"#.to_vec(),
        ));
    }
    msgs.extend((0..MESSAGES).map(|i| {
        (
            format!("r/tx/d{i}"),
            format!("{{\"t\": {i}.5}}").into_bytes(),
        )
    }));
    let total = msgs.len();
    brokers.publish_acked(&fwd, "schemas-publisher", msgs, total, SETTLE);

    let expected: Vec<Value> = (0..MESSAGES).map(reading).collect();
    let with_note: Vec<Value> = expected
        .iter()
        .map(|v| {
            let mut v = v.clone();
            v["note"] = Value::Null;
            v
        })
        .collect();
    // Protobuf's JSON form leaves out proto3 fields at their default (`ok: false`).
    let proto3: Vec<Value> = expected
        .iter()
        .map(|v| {
            let mut v = v.clone();
            if v["ok"] == json!(false) {
                v.as_object_mut().map(|o| o.remove("ok"));
            }
            v
        })
        .collect();
    for (topic, format, id, want) in [
        ("readings.avro", SchemaType::Avro, avro, &with_note),
        ("readings.pb", SchemaType::Protobuf, proto, &proto3),
        ("readings.json", SchemaType::Json, json_schema, &expected),
    ] {
        let got = decoded(&registry, &brokers, topic, MESSAGES, format);
        let ids: Vec<u32> = got.iter().map(|(i, _)| *i).collect();
        assert_eq!(
            ids,
            vec![id; MESSAGES],
            "{topic}: the registered schema's id"
        );
        let values: Vec<Value> = got.into_iter().map(|(_, v)| v).collect();
        assert_eq!(
            &values, want,
            "{topic}: every value, in order, as published"
        );
    }
    let reshaped: Vec<Value> = decoded(
        &registry,
        &brokers,
        "readings.tx",
        MESSAGES,
        SchemaType::Avro,
    )
    .into_iter()
    .map(|(_, v)| v)
    .collect();
    let want: Vec<Value> = (0..MESSAGES)
        .map(|i| json!({"device": format!("d{i}"), "temp": i as f64 + 0.5, "ok": true, "tags": [], "note": null}))
        .collect();
    assert_eq!(reshaped, want, "the transform's result, encoded");

    let dlq = brokers.read("readings.dlq", 3, Duration::from_secs(2), SETTLE);
    assert_eq!(dlq.len(), 3, "one misfit per format: {dlq:?}");
    for r in &dlq {
        let error = header(r, "ferry.error").unwrap_or_default();
        assert!(
            error.contains("/temp") && error.contains("does not fit the schema of subject"),
            "the dead-letter record names the field: {error}"
        );
        assert_eq!(
            r.value,
            br#"{"device":"d","temp":"hot","ok":true,"tags":[]}"#
        );
    }
    let status = fwd.status().expect("status");
    for (name, id) in [("avro", avro), ("protobuf", proto), ("json", json_schema)] {
        let rule = status.rules.iter().find(|r| r.name == name).expect("rule");
        let schema = rule.schema.as_ref().map(|s| (s.id, s.version));
        assert_eq!(schema, Some((id, 1)), "{name}: the schema in use");
        assert_eq!(rule.forwarded, MESSAGES as u64, "{name}");
        assert_eq!(rule.dead_lettered, 1, "{name}");
    }
    let token = base64::engine::general_purpose::STANDARD.encode("ferry:s3cret: #pass");
    let log = fwd.log();
    assert!(
        !log.contains("s3cret") && !log.contains(&token),
        "the registry password is never logged, plain or as a basic-auth token"
    );
}

#[test]
fn records_wait_while_the_registry_is_unreachable_refuses_or_lacks_their_schema_then_all_arrive() {
    let brokers = Brokers::start();
    create_topics(
        &brokers,
        &["readings.late", "readings.plain", "readings.dlq"],
    );
    let pki = Pki::generate(KeyType::Ecdsa).expect("pki");
    let registry = SchemaRegistry::start_with(SchemaRegistryOptions {
        tls: Some(&pki),
        basic_auth: Some(("ferry".into(), "right-pass".into())),
    })
    .expect("start the schema registry");
    let dir = tempfile::tempdir().expect("tempdir");
    let password = dir.path().join("registry-password");
    std::fs::write(&password, "wrong-pass").expect("password file");
    let rules = [
        rule(
            "late",
            "late/+",
            "readings.late",
            "{ format: avro, subject: readings.late-value }",
            "",
        ),
        "  - name: plain\n    mqtt: { topics: [\"plain/+\"] }\n    kafka: { topic: readings.plain }\n".to_owned(),
    ]
    .concat();
    let config = |pw: &std::path::Path| {
        format!(
            "{}{}",
            registry_settings(&registry, pw),
            brokers.config("schemas-late", &rules)
        )
    };
    // First a registry address where nothing listens.
    let closed = ferry_e2e::free_port().expect("a free port");
    let unreachable = config(&password).replace(
        &registry.url(),
        &format!("https://127.0.0.1:{closed}/apis/ccompat/v7"),
    );
    let mut fwd = Forwarder::start_configmap(&unreachable);
    fwd.wait_ready(Duration::from_secs(30));
    let mut msgs = messages("late", MESSAGES);
    msgs.extend(messages("plain", MESSAGES));
    common::runtime()
        .block_on(ferry_e2e::publish(
            brokers.mqtt.port(),
            "schemas-late-publisher",
            ferry_e2e::rumqttc::QoS::AtLeastOnce,
            msgs,
        ))
        .expect("publish");
    // The plain rule's records reach Kafka; the encoded rule's wait, unacknowledged.
    let plain = brokers.read("readings.plain", MESSAGES, Duration::from_secs(1), SETTLE);
    assert_eq!(plain.len(), MESSAGES);
    let waiting = |fwd: &Forwarder, what: &str| {
        wait_until(fwd, SETTLE, what, || {
            fwd.status().is_some_and(|s| {
                s.rules.iter().any(|r| {
                    r.name == "late"
                        && r.acked == 0
                        && r.forwarded == 0
                        && r.waiting.as_ref().is_some_and(|w| {
                            w.reason == "schema_unavailable" && w.message.contains(what)
                        })
                }) && s
                    .rule("plain")
                    .and_then(|r| r.blocked_by.clone())
                    .is_some_and(|b| {
                        // In Kafka, not acknowledged: behind `late`'s records in the order of acks.
                        b.rules == ["late"]
                            && b.waiting.as_deref() == Some("schema_unavailable")
                            && b.messages == MESSAGES as u64
                    })
            })
        });
    };
    waiting(
        &fwd,
        &format!("127.0.0.1:{closed}/apis/ccompat/v7 unreachable"),
    );
    // The registry's address, by a live reload, with the wrong password.
    fwd.swap_config(&config(&password));
    waiting(&fwd, "refused the credentials (HTTP 401)");
    // The right password, by a live reload: now the subject is missing.
    let right = dir.path().join("right-password");
    std::fs::write(&right, "right-pass").expect("password file");
    fwd.swap_config(&config(&right));
    waiting(&fwd, "has no subject \"readings.late-value\"");
    let id = registry
        .register("readings.late-value", SchemaType::Avro, AVRO)
        .expect("register");
    let got = decoded(
        &registry,
        &brokers,
        "readings.late",
        MESSAGES,
        SchemaType::Avro,
    );
    let values: Vec<Value> = got.iter().map(|(_, v)| v.clone()).collect();
    let mut want: Vec<Value> = (0..MESSAGES).map(reading).collect();
    for v in &mut want {
        v["note"] = Value::Null;
    }
    assert_eq!(values, want, "every waiting record, in order, none lost");
    assert!(got.iter().all(|(i, _)| *i == id));
    wait_until(&fwd, SETTLE, "all acknowledged", || {
        fwd.metric("ferry_mqtt_acked_messages_total") >= (2 * MESSAGES) as f64
    });
    let status = fwd.status().expect("status");
    let late = status
        .rules
        .iter()
        .find(|r| r.name == "late")
        .expect("rule");
    assert_eq!(
        (late.forwarded, late.waiting.clone()),
        (MESSAGES as u64, None)
    );
    let plain = status.rule("plain").expect("rule");
    assert_eq!(
        (plain.acked, plain.forwarded),
        (MESSAGES as u64, MESSAGES as u64)
    );
    wait_until(
        &fwd,
        Duration::from_secs(3),
        "plain no longer blocked",
        || {
            fwd.status()
                .and_then(|s| s.rule("plain").map(|r| r.blocked_by.is_none()))
                .unwrap_or(false)
        },
    );
}

/// `schema_registry.url` changed by a live reload: the records after it carry the new
/// registry's schema id. The two registries give the same subject different ids; before, the
/// rule kept encoding with the old registry's id, which the new one does not have or gives
/// another schema.
#[test]
fn a_registry_switched_live_encodes_with_the_new_registrys_ids() {
    let brokers = Brokers::start();
    create_topics(&brokers, &["switch.readings", "readings.dlq"]);
    let old = SchemaRegistry::start().expect("the old registry");
    let new = SchemaRegistry::start().expect("the new registry");
    new.register("other-value", SchemaType::Json, JSON_SCHEMA)
        .expect("register another subject first");
    let old_id = old
        .register("switch-value", SchemaType::Avro, AVRO)
        .expect("register");
    let new_id = new
        .register("switch-value", SchemaType::Avro, AVRO)
        .expect("register");
    assert_ne!(old_id, new_id, "the registries give different ids");
    let rules = rule(
        "switch",
        "switch/+",
        "switch.readings",
        "{ format: avro, subject: switch-value }",
        "",
    );
    let config = |registry: &SchemaRegistry| {
        format!(
            "schema_registry:\n  url: {}\n{}",
            registry.url(),
            brokers.config("schemas-switch", &rules)
        )
    };
    let mut fwd = Forwarder::start_configmap(&config(&old));
    fwd.wait_ready(Duration::from_secs(30));
    let id_in_use = |fwd: &Forwarder| {
        fwd.status()
            .and_then(|s| s.rule("switch").and_then(|r| r.schema.clone()))
            .map(|s| s.id)
    };
    wait_until(&fwd, SETTLE, "the old registry's schema in use", || {
        id_in_use(&fwd) == Some(old_id)
    });
    let half = MESSAGES / 2;
    brokers.publish_acked(&fwd, "switch-1", messages("switch", half), half, SETTLE);
    fwd.swap_config(&config(&new));
    wait_until(&fwd, SETTLE, "the new registry's schema in use", || {
        id_in_use(&fwd) == Some(new_id)
    });
    brokers.publish_acked(&fwd, "switch-2", messages("switch", half), 2 * half, SETTLE);
    let records = brokers.read("switch.readings", 2 * half, Duration::from_secs(1), SETTLE);
    // Confluent's wire format: a zero byte, then the schema id, big-endian.
    let ids: Vec<u32> = records
        .iter()
        .map(|r| match r.value.get(..5) {
            Some([0, a, b, c, d]) => u32::from_be_bytes([*a, *b, *c, *d]),
            _ => panic!("not Confluent's wire format: {:?}", r.value),
        })
        .collect();
    let want: Vec<u32> = std::iter::repeat_n(old_id, half)
        .chain(std::iter::repeat_n(new_id, half))
        .collect();
    assert_eq!(ids, want, "each record with its registry's id, in order");
}
