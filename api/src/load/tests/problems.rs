//! Validation problems, each named by its field path.

use super::{FERRY, no_env, problems_of, with_kafka_config};
use crate::config::ConfigError;
use crate::load::load_str;

#[test]
fn every_problem_is_listed_with_its_path() {
    let text = r#"
mqtt: { host: "", port: 0, client_id: "" , max_inflight: 0}
kafka: { bootstrap_servers: "nohost" }
rules:
  - name: a
    mqtt: { topics: ["a/#/b", "ok/+"], qos: 3 }
    kafka: { topic: "a b" }
  - name: a
    mqtt: { topics: [] }
    kafka: { topic: ok }
"#;
    let Err(ConfigError::Invalid(problems)) = load_str(text, no_env) else {
        panic!("expected invalid")
    };
    let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
    for expected in [
        "mqtt.host",
        "mqtt.port",
        "mqtt.client_id",
        "mqtt.max_inflight",
        "kafka.bootstrap_servers",
        "rules[0].mqtt.topics[0]",
        "rules[0].mqtt.qos",
        "rules[0].kafka.topic",
        "rules[1].name",
        "rules[1].mqtt.topics",
    ] {
        assert!(
            paths.contains(&expected),
            "missing {expected} in {problems:#?}"
        );
    }
    let topic = problems
        .iter()
        .find(|p| p.path == "rules[0].kafka.topic")
        .unwrap();
    assert_eq!(
        topic.to_string(),
        r#"rules[0].kafka.topic: "a b" is not a valid Kafka topic name or template: it may contain only ASCII letters, digits, '.', '_' and '-'"#
    );
}

/// A production config with a problem in each section.
const PRODUCTION_PROBLEMS: &str = r#"
mqtt:
  host: broker
  client_id: ferry-0
  shared_group: "a/b"
  tls: { cert_file: /c.pem }
kafka:
  bootstrap_servers: kafka:9093
  sasl: { mechanism: PLAIN, username: "", password: "" }
  config: { security.protocol: plaintext }
dead_letter: { topic: "no good" }
rules:
  - name: r
    mqtt: { topics: ["plant/+"] }
    kafka: { topic: "t.{2}" }
    dead_letter: { topic: ".." }
  - name: s
    mqtt: { topics: ["plant/#"] }
    kafka: { topic: "t.{2" }
"#;

#[test]
fn production_settings_problems_name_their_fields() {
    let text = PRODUCTION_PROBLEMS;
    let Err(ConfigError::Invalid(problems)) = load_str(text, no_env) else {
        panic!("expected invalid")
    };
    let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
    for expected in [
        "mqtt.shared_group",
        "mqtt.tls.key_file",
        "kafka.sasl.username",
        "kafka.sasl.password",
        "kafka.sasl.mechanism",
        "kafka.config.security.protocol",
        "dead_letter.topic",
        "rules[0].kafka.topic",
        "rules[0].dead_letter.topic",
        "rules[1].kafka.topic",
    ] {
        assert!(
            paths.contains(&expected),
            "missing {expected} in {problems:#?}"
        );
    }
    let level = problems
        .iter()
        .find(|p| p.path == "rules[0].kafka.topic")
        .unwrap();
    assert!(level.message.contains("have only 2 level(s)"), "{level}");
}

#[test]
fn an_unsupported_mqtt_version_names_its_field() {
    let text = PRODUCTION_PROBLEMS;
    let bad = load_str(
        &text.replace("shared_group: \"a/b\"", "protocol: 4"),
        no_env,
    );
    assert!(matches!(bad, Err(ConfigError::Invalid(p)) if p[0].path == "mqtt.protocol"));
}

#[test]
fn hosts_and_bootstrap_servers_are_checked() {
    for (host, ok) in crate::addr::HOST_VECTORS {
        let text = FERRY.replace("host: localhost", &format!("host: {host:?}"));
        let result = load_str(&text, no_env);
        assert_eq!(result.is_ok(), *ok, "{host:?}: {result:?}");
    }
    let problems = problems_of(&FERRY.replace("host: localhost", "host: mqtt://broker"));
    assert_eq!(
        problems[0].to_string(),
        r#"mqtt.host: "mqtt://broker" is not a host name or IP address (a DNS name, an IPv4 address or an IPv6 address without brackets; no scheme, port or spaces)"#
    );
    let servers = FERRY.replace("localhost:9092", "\"[::1]:9092, kafka:0,kafka:9093\"");
    let problems = problems_of(&servers);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(
        problems[0].to_string(),
        r#"kafka.bootstrap_servers: "kafka:0" has a port outside 1-65535"#
    );
}

#[test]
fn weaker_kafka_settings_need_the_opt_out() {
    for (entry, path, expected) in [
        ("acks: 1", "kafka.config.acks", "all (or -1)"),
        (
            "request.required.acks: 0",
            "kafka.config.request.required.acks",
            "all (or -1)",
        ),
        (
            "message.timeout.ms: 30000",
            "kafka.config.message.timeout.ms",
            "0 (never time out)",
        ),
        (
            "delivery.timeout.ms: 5000",
            "kafka.config.delivery.timeout.ms",
            "0 (never time out)",
        ),
        (
            "partitioner: random",
            "kafka.config.partitioner",
            "a partitioner that hashes the key",
        ),
    ] {
        let text = with_kafka_config(&format!("    {entry}\n"));
        let problems = problems_of(&text);
        assert_eq!(problems.len(), 1, "{entry}: {problems:?}");
        assert_eq!(problems[0].path, path);
        assert!(
            problems[0]
                .message
                .contains(&format!("it must be {expected}"))
                && problems[0]
                    .message
                    .contains("set kafka.allow_weaker_delivery: true to accept that"),
            "{}",
            problems[0]
        );
        let allowed = text.replace(
            "  bootstrap_servers: localhost:9092\n",
            "  bootstrap_servers: localhost:9092\n  allow_weaker_delivery: true\n",
        );
        let loaded = load_str(&allowed, no_env).unwrap_or_else(|e| panic!("{entry}: {e}"));
        assert!(loaded.config.kafka.allow_weaker_delivery);
    }
    let off = FERRY.replace("enable.idempotence: true", "enable.idempotence: false");
    assert_eq!(problems_of(&off)[0].path, "kafka.config.enable.idempotence");
    for safe in [
        "acks: all",
        "acks: \"-1\"",
        "acks: ALL",
        "message.timeout.ms: 0",
        "enable.gapless.guarantee: true",
        "partitioner: murmur2_random",
    ] {
        let text = with_kafka_config(&format!("    {safe}\n"));
        assert!(load_str(&text, no_env).is_ok(), "{safe}");
    }
}

#[test]
fn unsupported_kafka_settings_are_refused_even_with_the_opt_out() {
    for (entry, path, why) in [
        (
            "transactional.id: ferry",
            "kafka.config.transactional.id",
            "the forwarder runs no transactions",
        ),
        (
            "delivery.report.only.error: true",
            "kafka.config.delivery.report.only.error",
            "nothing would ever be acknowledged",
        ),
        (
            "group.id: ferry",
            "kafka.config.group.id",
            "is a consumer property",
        ),
    ] {
        let text = with_kafka_config(&format!("    {entry}\n")).replace(
            "  bootstrap_servers: localhost:9092\n",
            "  bootstrap_servers: localhost:9092\n  allow_weaker_delivery: true\n",
        );
        let problems = problems_of(&text);
        assert_eq!(problems[0].path, path, "{problems:?}");
        assert!(problems[0].message.contains(why), "{}", problems[0]);
    }
}

#[test]
fn the_producer_queue_must_hold_the_window() {
    let queue = |n: &str| with_kafka_config(&format!("    queue.buffering.max.messages: {n}\n"));
    let problems = problems_of(&queue("999"));
    assert_eq!(
        problems[0].path,
        "kafka.config.queue.buffering.max.messages"
    );
    assert!(
        problems[0]
            .message
            .contains("smaller than the in-flight window (1000)")
    );
    assert!(load_str(&queue("1000"), no_env).is_ok());
    assert!(load_str(&queue("0"), no_env).is_ok());
}

#[test]
fn sessions_that_lose_messages_need_the_opt_out() {
    let v5 = FERRY.replace("client_id: ferry-1", "client_id: ferry-1\n  protocol: 5");
    for (text, path) in [
        (
            FERRY.replace(
                "client_id: ferry-1",
                "client_id: ferry-1\n  clean_session: true",
            ),
            "mqtt.clean_session",
        ),
        (
            v5.replace("protocol: 5", "protocol: 5\n  clean_session: true"),
            "mqtt.clean_session",
        ),
        (
            v5.replace("protocol: 5", "protocol: 5\n  session_expiry_secs: 0"),
            "mqtt.session_expiry_secs",
        ),
    ] {
        let problems = problems_of(&text);
        assert_eq!(problems.len(), 1, "{text}: {problems:?}");
        assert_eq!(problems[0].path, path);
        assert!(
            problems[0]
                .message
                .contains("weakens the delivery guarantee")
                && problems[0]
                    .message
                    .contains("set mqtt.allow_weaker_delivery: true to accept that"),
            "{}",
            problems[0]
        );
        let allowed = text.replace(
            "client_id: ferry-1",
            "client_id: ferry-1\n  allow_weaker_delivery: true",
        );
        let loaded = load_str(&allowed, no_env).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(loaded.config.mqtt.allow_weaker_delivery);
    }
    // A session that outlives a disconnect keeps the guarantee.
    let kept = v5.replace("protocol: 5", "protocol: 5\n  session_expiry_secs: 1");
    assert!(load_str(&kept, no_env).is_ok());
}

#[test]
fn a_shutdown_timeout_beyond_a_day_is_refused_by_name() {
    let at = |secs: u64| format!("{FERRY}shutdown_timeout_secs: {secs}\n");
    assert!(load_str(&at(86_400), no_env).is_ok());
    for secs in [86_401, u64::MAX] {
        let problems = problems_of(&at(secs));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(
            problems[0].to_string(),
            format!("shutdown_timeout_secs: {secs} is over the bound of 86400 (a day)")
        );
    }
}
