//! Loading end to end: config text in, a validated config or every problem out. Ferry's format
//! here; the replaced forwarder's format, credential files and validation problems in the
//! submodules.

mod credentials;
mod legacy;
mod problems;

use crate::config::{
    ConfigError, KeyStrategy, LogFormat, MqttProtocol, PayloadFormat, Problem, SaslMechanism,
    Secret,
};
use crate::load::{LoadOptions, SourceFormat, load_str, load_with};

fn no_env(_: &str) -> Option<String> {
    None
}

const FERRY: &str = r#"
mqtt:
  host: localhost
  client_id: ferry-1
kafka:
  bootstrap_servers: localhost:9092
  config:
    linger.ms: 10
    enable.idempotence: true
rules:
  - name: telemetry
    mqtt:
      topics: ["plant/+/telemetry"]
    kafka:
      topic: telemetry
      key: { topic_level: 1 }
    payload: wrapped_json
"#;

fn problems_of(text: &str) -> Vec<Problem> {
    match load_str(text, no_env) {
        Err(ConfigError::Invalid(problems)) => problems,
        other => panic!("expected invalid, got {other:?}"),
    }
}

fn with_kafka_config(entries: &str) -> String {
    FERRY.replace(
        "    enable.idempotence: true\n",
        &format!("    enable.idempotence: true\n{entries}"),
    )
}

#[test]
fn ferry_format_with_defaults() {
    let loaded = load_str(FERRY, no_env).unwrap();
    let c = loaded.config;
    assert_eq!(loaded.format, SourceFormat::Ferry);
    assert_eq!(c.mqtt.port, 1883);
    assert!(!c.mqtt.clean_session);
    assert_eq!(c.mqtt.max_inflight, 1000);
    assert_eq!(c.kafka.config["linger.ms"], "10");
    assert_eq!(c.kafka.config["enable.idempotence"], "true");
    assert_eq!(c.rules[0].mqtt.qos, 1);
    assert_eq!(c.rules[0].kafka.key, KeyStrategy::TopicLevel(1));
    assert_eq!(c.rules[0].payload, PayloadFormat::WrappedJson);
    assert_eq!(c.http.listen.port(), 8080);
}

#[test]
fn type_errors_name_the_field() {
    let text = FERRY.replace("client_id: ferry-1", "client_id: ferry-1\n  port: lots");
    let Err(ConfigError::Invalid(problems)) = load_str(&text, no_env) else {
        panic!("expected invalid")
    };
    assert_eq!(problems[0].path, "mqtt.port");
}

#[test]
fn unknown_fields_are_rejected_in_ferry_format() {
    let text = FERRY.replace("client_id: ferry-1", "client_id: ferry-1\n  clientid: typo");
    let Err(ConfigError::Invalid(problems)) = load_str(&text, no_env) else {
        panic!("expected invalid")
    };
    assert!(problems[0].message.contains("clientid"), "{problems:?}");
}

#[test]
fn unset_variables_fail_ferry_format() {
    let text = FERRY.replace("host: localhost", "host: ${MQTT_HOST}");
    let Err(ConfigError::Invalid(problems)) = load_str(&text, no_env) else {
        panic!("expected invalid")
    };
    assert_eq!(problems[0].path, "${MQTT_HOST}");
    let ok = load_str(&text, |n| (n == "MQTT_HOST").then(|| "broker".to_string())).unwrap();
    assert_eq!(ok.config.mqtt.host, "broker");
}

#[test]
fn without_variables_the_text_means_what_it_says() {
    let text = FERRY.replace("plant/+/telemetry", "c/${HOME}/x").replace(
        "linger.ms: 10",
        "linger.ms: 10\n    client.rack: \"${TENANT_X}\"",
    );
    let literal = LoadOptions {
        variables: None,
        mqtt_client_id: None,
    };
    let loaded = load_with(&text, &literal, |_| Ok(Vec::new())).expect("loads as written");
    assert_eq!(loaded.config.rules[0].mqtt.topics, ["c/${HOME}/x"]);
    assert_eq!(loaded.config.kafka.config["client.rack"], "${TENANT_X}");
    // The same text as a standalone file is a template, and TENANT_X is not set.
    let home = |n: &str| (n == "HOME").then(|| "/root".to_owned());
    let Err(ConfigError::Invalid(problems)) = crate::load_str(&text, home) else {
        panic!("expected invalid")
    };
    assert_eq!(problems[0].path, "${TENANT_X}");
}

#[test]
fn a_client_id_from_outside_replaces_the_files_and_is_validated() {
    let with = |id: &str| LoadOptions {
        variables: None,
        mqtt_client_id: Some(id.to_owned()),
    };
    let loaded = load_with(FERRY, &with("ferry.ns.pod-0"), |_| Ok(Vec::new())).expect("loads");
    assert_eq!(loaded.config.mqtt.client_id, "ferry.ns.pod-0");
    let Err(ConfigError::Invalid(problems)) = load_with(FERRY, &with(""), |_| Ok(Vec::new()))
    else {
        panic!("an empty id with a persistent session is refused")
    };
    assert_eq!(problems[0].path, "mqtt.client_id");
}

#[test]
fn password_is_never_debug_printed() {
    let text = FERRY.replace(
        "client_id: ferry-1",
        "client_id: ferry-1\n  username: u\n  password: hunter2",
    );
    let loaded = load_str(&text, no_env).unwrap();
    assert!(!format!("{loaded:?}").contains("hunter2"));
    assert_eq!(
        loaded.config.mqtt.password.as_ref().map(Secret::expose),
        Some("hunter2")
    );
}

#[test]
fn production_settings_load() {
    let text = r#"
mqtt:
  host: broker
  client_id: ferry-0
  protocol: 5
  session_expiry_secs: 3600
  shared_group: ferry
  tls: { ca_file: /etc/ferry/ca.pem, cert_file: /etc/ferry/tls.crt, key_file: /etc/ferry/tls.key }
kafka:
  bootstrap_servers: kafka:9093
  tls: { ca_file: /etc/ferry/kafka-ca.pem }
  sasl: { mechanism: SCRAM-SHA-512, username: ferry, password: s3cret }
dead_letter: { topic: ferry.dlq }
log: { level: debug, format: json }
rules:
  - name: telemetry
    mqtt: { topics: ["plant/+/telemetry", "$share/other/x/#"] }
    kafka:
      topic: "telemetry.{1}"
      headers: { metadata: true, user_properties: true }
    dead_letter: { topic: telemetry.dlq }
  - name: other
    mqtt: { topics: ["x/y"] }
    kafka: { topic: other }
"#;
    let c = load_str(text, no_env).unwrap().config;
    assert_eq!(c.mqtt.protocol, MqttProtocol::V5);
    assert_eq!(
        c.kafka.sasl.as_ref().unwrap().mechanism,
        SaslMechanism::ScramSha512
    );
    assert_eq!(c.log.format, LogFormat::Json);
    assert_eq!(c.rules[0].kafka.headers.prefix, "mqtt.");
    assert_eq!(
        c.dead_letter_of(&c.rules[0]).unwrap().topic,
        "telemetry.dlq"
    );
    assert_eq!(c.dead_letter_of(&c.rules[1]).unwrap().topic, "ferry.dlq");
    assert_eq!(
        c.subscriptions(),
        vec![
            ("$share/ferry/plant/+/telemetry".to_string(), 1),
            ("$share/ferry/x/y".to_string(), 1),
            ("$share/other/x/#".to_string(), 1),
        ]
    );
    assert!(!format!("{c:?}").contains("s3cret"));
    let v311 = load_str(&text.replace("protocol: 5", "protocol: \"3.1.1\""), no_env);
    let Err(ConfigError::Invalid(problems)) = v311 else {
        panic!("session expiry needs MQTT 5")
    };
    assert_eq!(problems[0].path, "mqtt.session_expiry_secs");
}

#[test]
fn subscriptions_merge_filters() {
    let mut c = load_str(FERRY, no_env).unwrap().config.into_inner();
    let mut second = c.rules[0].clone();
    second.name = "again".into();
    second.mqtt.qos = 2;
    c.rules.push(second);
    assert_eq!(
        c.subscriptions(),
        vec![("plant/+/telemetry".to_string(), 2)]
    );
}
