//! The schema-registry fixture works: a real Apicurio Registry answers the Confluent API for
//! Avro, Protobuf and JSON Schema; its TLS and basic-auth variant refuses what it should; and
//! records in the Confluent wire format round-trip through Kafka and confluent-kafka's own
//! serializers and deserializers (the independent decoder the encoding tests use).

use std::time::{Duration, Instant};

use ferry_e2e::{
    HttpOptions, Kafka, KeyType, Pki, SchemaRegistry, SchemaRegistryOptions, SchemaType,
    http_request,
};
use serde_json::{Value, json};

const AVRO: &str = r#"{"type":"record","name":"Reading","namespace":"ferry.test","fields":[{"name":"device","type":"string"},{"name":"celsius","type":"double"}]}"#;
/// AVRO plus a field with a default: a backward-compatible second version.
const AVRO_V2: &str = r#"{"type":"record","name":"Reading","namespace":"ferry.test","fields":[{"name":"device","type":"string"},{"name":"celsius","type":"double"},{"name":"site","type":"string","default":"plant"}]}"#;
/// Two messages: records of the second carry the message index [1].
const PROTOBUF: &str = "syntax = \"proto3\";\npackage ferry.test;\n\nmessage Other {\n  int32 x = 1;\n}\n\nmessage Reading {\n  string device = 1;\n  double celsius = 2;\n}\n";
const JSON_SCHEMA: &str = r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"object","properties":{"device":{"type":"string"},"celsius":{"type":"number"}},"required":["device","celsius"]}"#;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Registers, reads back by id and by subject, re-registers (same id) and evolves (version 2),
/// for each schema type, through the Confluent API.
#[test]
fn confluent_api_registers_and_reads_back_each_schema_type() {
    let started = Instant::now();
    let registry = SchemaRegistry::start().expect("schema registry");
    eprintln!(
        "schema registry answered {:?} after the start",
        started.elapsed()
    );
    assert!(
        registry.url().starts_with("http://127.0.0.1:")
            && registry.url().ends_with("/apis/ccompat/v7"),
        "{}",
        registry.url()
    );

    let cases = [
        ("readings-avro-value", SchemaType::Avro, AVRO),
        ("readings-proto-value", SchemaType::Protobuf, PROTOBUF),
        ("readings-json-value", SchemaType::Json, JSON_SCHEMA),
    ];
    let mut ids = Vec::new();
    for (subject, schema_type, schema) in cases {
        let id = registry
            .register(subject, schema_type, schema)
            .unwrap_or_else(|e| panic!("register {schema_type}: {e:#}"));
        ids.push(id);

        let by_id = registry
            .request_ok("GET", &format!("/schemas/ids/{id}"), None)
            .expect("schema by id");
        assert_eq!(by_id["schema"], schema, "{schema_type} by id: {by_id}");
        // The Confluent API leaves schemaType out for Avro.
        let expected_type = (schema_type != SchemaType::Avro).then(|| schema_type.api_name());
        assert_eq!(by_id["schemaType"].as_str(), expected_type, "{by_id}");

        let latest = registry
            .request_ok("GET", &format!("/subjects/{subject}/versions/latest"), None)
            .expect("latest version");
        assert_eq!(latest["id"], id, "{latest}");
        assert_eq!(latest["version"], 1, "{latest}");
        assert_eq!(latest["subject"], subject, "{latest}");
        assert_eq!(latest["schema"], schema, "{latest}");

        // The same schema again: the same id, no new version.
        assert_eq!(registry.register(subject, schema_type, schema).unwrap(), id);
    }
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3, "one id per schema: {ids:?}");

    let subjects = registry.request_ok("GET", "/subjects", None).unwrap();
    let mut subjects: Vec<&str> = subjects
        .as_array()
        .expect("subjects list")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    subjects.sort_unstable();
    assert_eq!(
        subjects,
        [
            "readings-avro-value",
            "readings-json-value",
            "readings-proto-value"
        ]
    );

    let v2 = registry
        .register("readings-avro-value", SchemaType::Avro, AVRO_V2)
        .expect("second version");
    assert!(
        !ids.contains(&v2),
        "a new schema gets a new id: {v2} in {ids:?}"
    );
    let latest = registry
        .request_ok("GET", "/subjects/readings-avro-value/versions/latest", None)
        .unwrap();
    assert_eq!(
        (latest["id"].clone(), latest["version"].clone()),
        (json!(v2), json!(2))
    );
    let first = registry
        .request_ok("GET", "/subjects/readings-avro-value/versions/1", None)
        .unwrap();
    assert_eq!(first["schema"], AVRO, "{first}");

    // An unknown id is the Confluent API's 404 with error code 40403.
    let (status, body) = registry.request("GET", "/schemas/ids/9999", None).unwrap();
    assert_eq!(status, 404, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error_code"],
        40403,
        "{body}"
    );
}

/// A registry with TLS and basic auth: anonymous and wrong credentials get 401, plain HTTP gets
/// nothing; with the credentials, records written with confluent-kafka's serializers to a
/// real Kafka decode with its deserializers, carrying the registered ids in the wire header.
#[test]
fn tls_basic_auth_and_the_confluent_kafka_round_trip() {
    let pki = Pki::generate(KeyType::Ecdsa).expect("pki");
    let registry = SchemaRegistry::start_with(SchemaRegistryOptions {
        tls: Some(&pki),
        basic_auth: Some(("ferry".to_owned(), "s3cret pass".to_owned())),
    })
    .expect("schema registry with TLS and basic auth");
    assert!(
        registry.url().starts_with("https://127.0.0.1:"),
        "{}",
        registry.url()
    );

    // The API's path at the registry's address, as any client would ask for it.
    let subjects = |tls_ca, basic_auth| {
        let options = HttpOptions {
            tls_ca,
            basic_auth,
            ..HttpOptions::default()
        };
        http_request(
            registry.address(),
            "GET",
            "/apis/ccompat/v7/subjects",
            &options,
        )
    };
    let ca = registry.ca_cert();
    let anonymous = subjects(ca, None).unwrap();
    assert_eq!(anonymous.0, 401, "anonymous: {anonymous:?}");
    let wrong = subjects(ca, Some(("ferry", "wrong"))).unwrap();
    assert_eq!(wrong.0, 401, "wrong password: {wrong:?}");
    let right = subjects(ca, Some(("ferry", "s3cret pass"))).unwrap();
    assert_eq!(right, (200, "[]".to_owned()));
    let plain = subjects(None, Some(("ferry", "s3cret pass")));
    assert!(
        !matches!(plain, Ok((200, _))),
        "plain HTTP to the TLS port must not be served: {plain:?}"
    );

    let kafka = Kafka::start().expect("kafka");
    let rt = runtime();
    let cases = [
        ("wire-avro", SchemaType::Avro, AVRO, None),
        (
            "wire-proto",
            SchemaType::Protobuf,
            PROTOBUF,
            Some("ferry.test.Reading"),
        ),
        ("wire-json", SchemaType::Json, JSON_SCHEMA, None),
    ];
    let values = [
        json!({"device": "pump-1", "celsius": 21.5}),
        json!({"device": "pump-2", "celsius": -3.25}),
    ];
    for (topic, schema_type, schema, message) in cases {
        rt.block_on(kafka.create_topic(topic, 1)).expect("topic");
        let id = registry
            .register(&format!("{topic}-value"), schema_type, schema)
            .expect("register");
        let used = registry
            .confluent_produce(&kafka.bootstrap(), topic, schema_type, message, &values)
            .unwrap_or_else(|e| panic!("produce {schema_type}: {e:#}"));
        assert_eq!(used, id, "{schema_type}");

        // The wire format, read raw: magic byte 0, then the id big-endian.
        let records = kafka
            .read_all(topic, values.len(), Duration::ZERO, Duration::from_secs(20))
            .expect("read back");
        for record in &records {
            assert_eq!(record.value[0], 0, "{schema_type}: magic byte");
            assert_eq!(
                record.value[1..5],
                id.to_be_bytes(),
                "{schema_type}: schema id"
            );
        }

        let decoded = registry
            .confluent_consume(
                &kafka.bootstrap(),
                topic,
                values.len(),
                schema_type,
                Duration::from_secs(20),
            )
            .unwrap_or_else(|e| panic!("decode {schema_type}: {e:#}"));
        let got: Vec<(Value, Value)> = decoded
            .iter()
            .map(|r| (r["schema_id"].clone(), r["value"].clone()))
            .collect();
        let want: Vec<(Value, Value)> = values.iter().map(|v| (json!(id), v.clone())).collect();
        assert_eq!(got, want, "{schema_type}");
    }
}
