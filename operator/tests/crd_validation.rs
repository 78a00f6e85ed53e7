//! The CRDs on a real kube-apiserver: they install, valid objects are accepted, and each
//! invalid object is refused with the human message of its CEL rule.

use std::time::{Duration, Instant};

use ferry_api::addr::{HOST_VECTORS, SERVER_VECTORS};
use ferry_api::topic::{FILTER_VECTORS, FilterError};

mod common;

const CONNECTION: &str = r#"
apiVersion: ferry.dev/v1alpha1
kind: BrokerConnection
metadata: { name: plant, namespace: ferry }
spec:
  mqtt:
    host: mqtt.example
    port: 8883
    protocol: "5"
    sessionExpirySeconds: 3600
    tls: { caSecretRef: { name: mqtt-ca, key: ca.crt } }
    credentialsSecretRef: { name: mqtt-credentials }
  kafka:
    bootstrapServers: ["kafka-0.kafka:9093", "kafka-1.kafka:9093"]
    tls: { useSystemRoots: true }
    sasl: { mechanism: PLAIN, credentialsSecretRef: { name: kafka-credentials } }
    config: { linger.ms: "10" }
  forwarder:
    replicas: 2
    image: registry.example.com:5000/team/ferry-forwarder@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
    imagePullPolicy: Always
    imagePullSecrets: [{ name: regcred }]
"#;

const RULE: &str = r#"
apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata: { name: telemetry, namespace: ferry }
spec:
  connectionRef: { name: plant }
  mqtt: { topics: ["plant/+/telemetry", "plant/+/alarm/#", "$share/g/x/#"], qos: 1 }
  kafka:
    topic: "telemetry.{1}"
    key: { strategy: topicLevel, level: 1 }
    headers: { metadata: true, userProperties: true }
  payload: wrappedJson
  deadLetter: { topic: telemetry.dlq }
"#;

/// (what is wrong, the valid object with one edit, the message the apiserver must give).
fn invalid_objects() -> Vec<(&'static str, String, &'static str)> {
    let rule = |from: &str, to: &str| {
        assert!(RULE.contains(from), "{from}");
        RULE.replacen(from, to, 1)
    };
    let conn = |from: &str, to: &str| {
        assert!(CONNECTION.contains(from), "{from}");
        CONNECTION.replacen(from, to, 1)
    };
    let hash = "'#' may only be the last level of a topic filter";
    let plus = "'+' must be a whole level of a topic filter";
    let chars = "may contain only letters, digits";
    let level = "key.level is set with strategy topicLevel, and only then";
    let port = "port must be between 1 and 65535";
    let one_topic = "set exactly one of kafka.topic and kafka.topicExpression";
    let key_expression = "key.expression is set with strategy expression, and only then";
    let image = "image must be [registry[:port]/]repository[:tag][@sha256:<64 hex digits>], the repository in lower case";
    vec![
        ("# in the middle", rule("plant/+/telemetry", "a/#/b"), hash),
        ("# inside a level", rule("plant/+/telemetry", "a/b#"), hash),
        (
            "+ inside a level",
            rule("plant/+/telemetry", "a/b+/c"),
            plus,
        ),
        ("qos 3", rule("qos: 1", "qos: 3"), "qos must be 0, 1 or 2"),
        ("space in topic", rule("telemetry.{1}", "tele metry"), chars),
        ("bad placeholder", rule("telemetry.{1}", "t.{x}"), chars),
        (
            "topic ..",
            rule("\"telemetry.{1}\"", "\"..\""),
            "may not be '.' or '..'",
        ),
        (
            "topic too long",
            rule("telemetry.{1}", &"t".repeat(250)),
            "the Kafka topic must be 1 to 249 characters",
        ),
        (
            "topicLevel without level",
            rule("strategy: topicLevel, level: 1", "strategy: topicLevel"),
            level,
        ),
        (
            "level without topicLevel",
            rule("strategy: topicLevel", "strategy: none"),
            level,
        ),
        (
            "bad group",
            rule(
                "connectionRef: { name: plant }",
                "connectionRef: { name: plant }\n  group: Bad_Group",
            ),
            "group must be a DNS label",
        ),
        (
            "bad dead-letter topic",
            rule("telemetry.dlq", "\"bad topic\""),
            "deadLetter.topic must be a Kafka topic name",
        ),
        ("port 0", conn("port: 8883", "port: 0"), port),
        ("port 70000", conn("port: 8883", "port: 70000"), port),
        (
            "session expiry on 3.1.1",
            conn("protocol: \"5\"", "protocol: \"3.1.1\""),
            "sessionExpirySeconds is an MQTT 5 setting",
        ),
        (
            "window 0",
            conn("port: 8883", "port: 8883\n    maxInflight: 0"),
            "maxInflight must be between 1 and 65535",
        ),
        (
            "a message limit below 1 KiB",
            conn("port: 8883", "port: 8883\n    maxMessageBytes: 100"),
            "maxMessageBytes must be between 1024 and 268435455",
        ),
        (
            "a message limit over the default window",
            conn("port: 8883", "port: 8883\n    maxMessageBytes: 33554432"),
            "maxInflightBytes must be at least maxMessageBytes",
        ),
        (
            "a window smaller than the default message limit",
            conn("port: 8883", "port: 8883\n    maxInflightBytes: 4096"),
            "maxInflightBytes must be at least maxMessageBytes",
        ),
        (
            "a rule's message limit over MQTT's",
            rule("qos: 1", "qos: 1, maxMessageBytes: 300000000"),
            "mqtt.maxMessageBytes must be between 1024 and 268435455",
        ),
        (
            "PLAIN without TLS",
            conn("    tls: { useSystemRoots: true }\n", ""),
            "SASL PLAIN sends the password in clear text",
        ),
        (
            "security.protocol in config",
            conn("linger.ms: \"10\"", "security.protocol: plaintext"),
            "are set from bootstrapServers, tls and sasl",
        ),
        (
            "bootstrap without port",
            conn("\"kafka-0.kafka:9093\"", "\"kafka-0.kafka\""),
            "every bootstrap server must be host:port",
        ),
        (
            "empty tls",
            conn("tls: { useSystemRoots: true }", "tls: {}"),
            "tls needs caSecretRef, clientCertSecretRef or useSystemRoots",
        ),
        (
            "too many replicas",
            conn("replicas: 2", "replicas: 100"),
            "replicas must be between 0 and 64",
        ),
        (
            "a literal username and a usernameKey",
            conn(
                "credentialsSecretRef: { name: kafka-credentials }",
                "credentialsSecretRef: { name: kafka-credentials, username: forwarder, usernameKey: user }",
            ),
            "username is given literally: remove usernameKey",
        ),
        (
            "a group with replicas and autoscaled",
            conn(
                "replicas: 2\n",
                "replicas: 2\n    groups: [{ name: bulk, replicas: 3, autoscaled: true }]\n",
            ),
            "replicas and autoscaled: true both decide the group's replicas: set one",
        ),
        (
            "a group name that is no group",
            conn(
                "replicas: 2\n",
                "replicas: 2\n    groups: [{ name: Bulk_1, replicas: 3 }]\n",
            ),
            "name must be a group name",
        ),
        (
            "a group's replicas out of range",
            conn(
                "replicas: 2\n",
                "replicas: 2\n    groups: [{ name: bulk, replicas: 65 }]\n",
            ),
            "replicas must be between 0 and 64",
        ),
        (
            "upper-case repository",
            conn("team/ferry-forwarder", "Team/ferry-forwarder"),
            image,
        ),
        (
            "short digest",
            conn("@sha256:0123456789abcdef", "@sha256:"),
            image,
        ),
        (
            "space in the image",
            conn("ferry-forwarder@", "ferry forwarder@"),
            image,
        ),
        (
            "unknown pull policy",
            conn("imagePullPolicy: Always", "imagePullPolicy: Sometimes"),
            "supported values: \"Always\", \"IfNotPresent\", \"Never\"",
        ),
        (
            "a session that ends at every disconnect",
            conn("sessionExpirySeconds: 3600", "sessionExpirySeconds: 0"),
            "sessionExpirySeconds 0 ends the session at every disconnect",
        ),
        (
            "session expiry above MQTT 5's largest",
            conn(
                "sessionExpirySeconds: 3600",
                "sessionExpirySeconds: 4294967296",
            ),
            "sessionExpirySeconds must be between 0 and 4294967295",
        ),
        (
            "a placeholder of 4 digits",
            rule("telemetry.{1}", "t.{1000}"),
            chars,
        ),
        (
            "a control character in the header prefix",
            rule(
                "userProperties: true }",
                "userProperties: true, prefix: \"mqtt\\t\" }",
            ),
            "headers.prefix must not contain control characters",
        ),
        (
            "topic filter longer than 1024 characters",
            rule("plant/+/telemetry", &"t".repeat(1025)),
            "1024",
        ),
        (
            "topic and topicExpression",
            rule(
                "topic: \"telemetry.{1}\"",
                "topic: \"telemetry.{1}\"\n    topicExpression: \"'t.' + levels[1]\"",
            ),
            one_topic,
        ),
        (
            "neither topic nor topicExpression",
            rule("    topic: \"telemetry.{1}\"\n", ""),
            one_topic,
        ),
        (
            "strategy expression without expression",
            rule("strategy: topicLevel, level: 1", "strategy: expression"),
            key_expression,
        ),
        (
            "key expression without strategy expression",
            rule("level: 1", "level: 1, expression: json.device"),
            key_expression,
        ),
        (
            "payloadTransform with wrappedJson",
            rule(
                "payload: wrappedJson",
                "payload: wrappedJson\n  payloadTransform: \"{'t': json.t}\"",
            ),
            "payloadTransform makes the record's value itself: it needs payload raw",
        ),
        (
            "a control character in a header expression's name",
            rule(
                "userProperties: true }",
                "userProperties: true, expressions: { \"a\\tb\": topic } }",
            ),
            "headers.expressions names must be non-empty, without control characters",
        ),
        (
            "an environment variable reference in a filter",
            rule(
                "connectionRef: { name: plant }",
                "connectionRef: { name: plant }\n  filter: \"json.site == '${SITE}'\"",
            ),
            "an expression may not contain '${'",
        ),
        (
            "an environment variable reference in a header expression",
            rule(
                "userProperties: true }",
                "userProperties: true, expressions: { site: \"'${SITE}'\" } }",
            ),
            "an expression may not contain '${'",
        ),
        (
            "a schema-encoded value in wrappedJson",
            rule(
                "headers: { metadata: true, userProperties: true }",
                "headers: { metadata: true, userProperties: true }\n    value: { format: avro, subject: t-value }",
            ),
            "kafka.value encodes the payload or payloadTransform's result: it needs payload raw",
        ),
        (
            "a topic name strategy over a template",
            rule("payload: wrappedJson", "payload: raw").replacen(
                "headers: { metadata: true, userProperties: true }",
                "headers: { metadata: true, userProperties: true }\n    value: { format: avro }",
                1,
            ),
            "the topic name strategies need kafka.topic to be one name",
        ),
        (
            "a record name strategy without a record name",
            rule(
                "headers: { metadata: true, userProperties: true }",
                "headers: { metadata: true, userProperties: true }\n    value: { format: avro, subjectNameStrategy: RecordName }",
            ),
            "value.recordName is needed by the RecordName and TopicRecordName strategies",
        ),
        (
            "a Protobuf message name on an Avro value",
            rule(
                "headers: { metadata: true, userProperties: true }",
                "headers: { metadata: true, userProperties: true }\n    value: { format: avro, subject: s, message: a.B }",
            ),
            "value.message names a Protobuf message",
        ),
        (
            "schema version 0",
            rule(
                "headers: { metadata: true, userProperties: true }",
                "headers: { metadata: true, userProperties: true }\n    value: { format: jsonSchema, subject: s, version: 0 }",
            ),
            "value.version must be between 1 and 4294967295",
        ),
        (
            "registry credentials in the URL",
            conn(
                "  forwarder:\n",
                "  schemaRegistry: { url: \"https://user:pw@registry:8081\" }\n  forwarder:\n",
            ),
            "schemaRegistry.url must be an http:// or https:// URL with a host, without credentials",
        ),
        (
            "registry credentials over plain HTTP",
            conn(
                "  forwarder:\n",
                "  schemaRegistry: { url: \"http://registry:8081\", credentialsSecretRef: { name: r } }\n  forwarder:\n",
            ),
            "schemaRegistry.credentialsSecretRef sends the password in clear text over http://",
        ),
        (
            "registry TLS on an http URL",
            conn(
                "  forwarder:\n",
                "  schemaRegistry: { url: \"http://registry:8081\", tls: { useSystemRoots: true } }\n  forwarder:\n",
            ),
            "schemaRegistry.tls needs an https:// url",
        ),
        (
            "a registry URL without a scheme",
            conn(
                "  forwarder:\n",
                "  schemaRegistry: { url: \"registry.kafka:8081\" }\n  forwarder:\n",
            ),
            "schemaRegistry.url must be an http:// or https:// URL",
        ),
        (
            "a negative stall budget",
            conn("  forwarder:\n", "  stallBudgetSeconds: -1\n  forwarder:\n"),
            "stallBudgetSeconds must be between 0 (as long as it takes) and 604800 (a week)",
        ),
        (
            "a stall budget over a week",
            conn(
                "  forwarder:\n",
                "  stallBudgetSeconds: 604801\n  forwarder:\n",
            ),
            "stallBudgetSeconds must be between 0 (as long as it takes) and 604800 (a week)",
        ),
        (
            "a rule's negative stall budget",
            rule(
                "  payload: wrappedJson\n",
                "  payload: wrappedJson\n  stallBudgetSeconds: -1\n",
            ),
            "stallBudgetSeconds must be between 0 (as long as it takes) and 604800 (a week)",
        ),
        (
            "a rule's stall budget over a week",
            rule(
                "  payload: wrappedJson\n",
                "  payload: wrappedJson\n  stallBudgetSeconds: 604801\n",
            ),
            "stallBudgetSeconds must be between 0 (as long as it takes) and 604800 (a week)",
        ),
        (
            "a connection's dead-letter topic that is no Kafka topic name",
            conn(
                "  forwarder:\n",
                "  deadLetter: { topic: \"dead letters\" }\n  forwarder:\n",
            ),
            "deadLetter.topic must be a Kafka topic name",
        ),
        (
            "a filter longer than 4096 characters",
            rule(
                "connectionRef: { name: plant }",
                &format!(
                    "connectionRef: {{ name: plant }}\n  filter: \"{}\"",
                    "t".repeat(4097)
                ),
            ),
            "4096",
        ),
    ]
}

fn config(entries: &str) -> String {
    CONNECTION.replacen(
        "config: { linger.ms: \"10\" }",
        &format!("config: {{ {entries} }}"),
        1,
    )
}

/// librdkafka settings the forwarder or the guarantee cannot live with (`ferry_api::kafka_props`).
fn refused_kafka_settings() -> Vec<(&'static str, String, &'static str)> {
    let acks = "config acks / request.required.acks must be all (or -1)";
    let idempotence = "config enable.idempotence must be true";
    let timeout = "config message.timeout.ms / delivery.timeout.ms must be 0 (never time out)";
    let queue = "kafka.config queue.buffering.max.messages must be 0 (no limit) or a whole number at least mqtt.maxInflight";
    vec![
        ("acks 1", config("acks: \"1\""), acks),
        (
            "acks 0 by its alias",
            config("request.required.acks: \"0\""),
            acks,
        ),
        (
            "idempotence off",
            config("enable.idempotence: \"false\""),
            idempotence,
        ),
        (
            "a message timeout",
            config("message.timeout.ms: \"30000\""),
            timeout,
        ),
        (
            "a delivery timeout",
            config("delivery.timeout.ms: \"5000\""),
            timeout,
        ),
        (
            "a random partitioner",
            config("partitioner: random"),
            "config partitioner must be a partitioner that hashes the key",
        ),
        (
            "transactional.id",
            config("transactional.id: ferry"),
            "config transactional.id cannot be used: it makes a transactional producer",
        ),
        (
            "only error reports",
            config("delivery.report.only.error: \"true\""),
            "config delivery.report.only.error cannot be used: it stops the delivery reports",
        ),
        (
            "a consumer property",
            config("group.id: ferry"),
            "cannot be used: it is a consumer property",
        ),
        (
            "not a property name",
            config("Linger.MS: \"5\""),
            "config keys are librdkafka property names",
        ),
        (
            "a queue smaller than the window",
            config("queue.buffering.max.messages: \"999\""),
            queue,
        ),
        (
            "a queue of no number",
            config("queue.buffering.max.messages: lots"),
            queue,
        ),
        (
            "a value longer than 4096 characters",
            config(&format!("client.id: {}", "x".repeat(4097))),
            "4096",
        ),
    ]
}

/// The CEL message for each way `TopicFilter::parse` refuses a filter.
fn filter_message(e: &FilterError) -> &'static str {
    match e {
        FilterError::Empty => "should be at least 1 chars long",
        FilterError::TooLong => "1024",
        FilterError::Nul => "a topic filter may not contain the NUL character",
        FilterError::MultiLevelMisplaced => "'#' may only be the last level of a topic filter",
        FilterError::SingleLevelMisplaced => "'+' must be a whole level of a topic filter",
        FilterError::BadShare => "a shared subscription must be $share/<group>/<filter>",
    }
}

const TOPICS: &str = "[\"plant/+/telemetry\", \"plant/+/alarm/#\", \"$share/g/x/#\"]";

/// The shared vectors (`ferry_api::topic::FILTER_VECTORS`, `ferry_api::addr::*_VECTORS`):
/// each one the forwarder refuses, with the message the apiserver must refuse it with.
fn refused_vectors() -> Vec<(String, String, &'static str)> {
    let mut cases = Vec::new();
    for (filter, error) in FILTER_VECTORS {
        if let Some(e) = error {
            let topics = format!("[{filter:?}]");
            cases.push((
                format!("filter {filter:?}"),
                RULE.replacen(TOPICS, &topics, 1),
                filter_message(e),
            ));
        }
    }
    for (host, ok) in HOST_VECTORS.iter().filter(|(_, ok)| !ok) {
        let message = if host.is_empty() {
            "should be at least 1 chars long"
        } else {
            "host must be a DNS name, an IPv4 address or an IPv6 address without brackets"
        };
        let _ = ok;
        let object = CONNECTION.replacen("host: mqtt.example", &format!("host: {host:?}"), 1);
        cases.push((format!("host {host:?}"), object, message));
    }
    for (server, _) in SERVER_VECTORS.iter().filter(|(_, ok)| !ok) {
        let object = CONNECTION.replacen("\"kafka-0.kafka:9093\"", &format!("{server:?}"), 1);
        cases.push((
            format!("bootstrap server {server:?}"),
            object,
            "every bootstrap server must be host:port",
        ));
    }
    cases
}

/// Edge cases that must be accepted: every valid shared vector, the limits, and the opt-out.
fn accepted_objects() -> Vec<(String, String)> {
    let valid_filters: Vec<String> = FILTER_VECTORS
        .iter()
        .filter(|(_, e)| e.is_none())
        .map(|(f, _)| format!("{f:?}"))
        .chain([format!("{:?}", "t".repeat(1024))])
        .collect();
    let mut cases = vec![(
        "Strimzi-shaped Secrets, groups of their own".to_owned(),
        CONNECTION
            .replacen(
                "credentialsSecretRef: { name: kafka-credentials }",
                "credentialsSecretRef: { name: forwarder, username: forwarder }",
                1,
            )
            .replacen(
                "tls: { useSystemRoots: true }",
                "tls: { caSecretRef: { name: c-cluster-ca-cert, key: ca.crt }, clientCertSecretRef: { name: forwarder, certKey: user.crt, keyKey: user.key } }",
                1,
            )
            .replacen(
                "replicas: 2\n",
                "replicas: 2\n    groups: [{ name: bulk, replicas: 0 }, { name: scaled, autoscaled: true }, { name: same }]\n",
                1,
            ),
    )];
    cases.push((
        "a registry with TLS and basic auth, rules encoding through it".to_owned(),
        CONNECTION.replacen(
            "  forwarder:\n",
            "  schemaRegistry:\n    url: https://apicurio.kafka:8080/apis/ccompat/v7\n    tls: { caSecretRef: { name: registry-ca, key: ca.crt } }\n    credentialsSecretRef: { name: registry-credentials }\n  forwarder:\n",
            1,
        ),
    ));
    for value in [
        "{ format: avro }",
        "{ format: protobuf, message: acme.Reading, version: 3 }",
        "{ format: jsonSchema, subjectNameStrategy: TopicRecordName, recordName: acme.Reading }",
    ] {
        cases.push((
            format!("kafka.value {value}"),
            RULE.replacen("  payload: wrappedJson\n", "", 1)
                .replacen("telemetry.{1}", "telemetry", 1)
                .replacen(
                    "headers: { metadata: true, userProperties: true }",
                    &format!(
                        "headers: {{ metadata: true, userProperties: true }}\n    value: {value}"
                    ),
                    1,
                ),
        ));
    }
    cases.push((
        "every valid filter".to_owned(),
        RULE.replacen(TOPICS, &format!("[{}]", valid_filters.join(", ")), 1),
    ));
    cases.push((
        "a larger window and message limit".to_owned(),
        CONNECTION.replacen(
            "port: 8883",
            "port: 8883\n    maxInflightBytes: 67108864\n    maxMessageBytes: 33554432",
            1,
        ),
    ));
    cases.push((
        "a connection's dead-letter topic and stall budget at their bounds".to_owned(),
        CONNECTION.replacen(
            "  forwarder:\n",
            "  deadLetter: { topic: ferry.dead-letters }\n  stallBudgetSeconds: 604800\n  forwarder:\n",
            1,
        ),
    ));
    for budget in [0, 604800] {
        cases.push((
            format!("a rule's own stall budget of {budget}"),
            RULE.replacen(
                "  payload: wrappedJson\n",
                &format!("  payload: wrappedJson\n  stallBudgetSeconds: {budget}\n"),
                1,
            ),
        ));
    }
    cases.push((
        "a connection stall budget of 0 (as long as it takes)".to_owned(),
        CONNECTION.replacen(
            "  forwarder:\n",
            "  stallBudgetSeconds: 0\n  forwarder:\n",
            1,
        ),
    ));
    cases.push((
        "a rule's own message limit".to_owned(),
        RULE.replacen("qos: 1", "qos: 1, maxMessageBytes: 2048", 1),
    ));
    cases.push((
        "a 3-digit placeholder and a header prefix".to_owned(),
        RULE.replacen("telemetry.{1}", "t.{999}", 1).replacen(
            "userProperties: true }",
            "userProperties: true, prefix: \"ferry-\" }",
            1,
        ),
    ));
    cases.push((
        "every CEL expression field".to_owned(),
        RULE.replacen(
            "connectionRef: { name: plant }",
            "connectionRef: { name: plant }\n  filter: \"json.temp > 50.0\"\n  payloadTransform: \"{'t': json.temp}\"",
            1,
        )
        .replacen(
            "topic: \"telemetry.{1}\"",
            "topicExpression: \"'t.' + levels[1]\"",
            1,
        )
        .replacen(
            "{ strategy: topicLevel, level: 1 }",
            "{ strategy: expression, expression: json.device }",
            1,
        )
        .replacen(
            "userProperties: true }",
            "userProperties: true, expressions: { site: \"levels[1]\" } }",
            1,
        )
        .replacen("payload: wrappedJson", "payload: raw", 1),
    ));
    for (host, _) in HOST_VECTORS.iter().filter(|(_, ok)| *ok) {
        let object = CONNECTION.replacen("host: mqtt.example", &format!("host: {host:?}"), 1);
        cases.push((format!("host {host:?}"), object));
    }
    let servers: Vec<String> = SERVER_VECTORS
        .iter()
        .filter(|(_, ok)| *ok)
        .map(|(s, _)| format!("{s:?}"))
        .collect();
    cases.push((
        "every valid bootstrap server".to_owned(),
        CONNECTION.replacen(
            "[\"kafka-0.kafka:9093\", \"kafka-1.kafka:9093\"]",
            &format!("[{}]", servers.join(", ")),
            1,
        ),
    ));
    for (what, entries) in [
        (
            "the safe values",
            "acks: all, enable.idempotence: \"true\", message.timeout.ms: \"0\"",
        ),
        (
            "the safe values, other spellings",
            "request.required.acks: \"-1\", acks: ALL, enable.idempotence: \"True\"",
        ),
        (
            "a queue of the window",
            "queue.buffering.max.messages: \"1000\"",
        ),
        ("an unlimited queue", "queue.buffering.max.messages: \"0\""),
        (
            "other librdkafka settings",
            "linger.ms: \"5\", compression.type: zstd, socket.keepalive.enable: \"true\"",
        ),
    ] {
        cases.push((what.to_owned(), config(entries)));
    }
    cases.push((
        "weaker settings with the opt-out".to_owned(),
        config("acks: \"1\", enable.idempotence: \"false\", message.timeout.ms: \"30000\", partitioner: random")
            .replacen(
                "    tls: { useSystemRoots: true }\n",
                "    tls: { useSystemRoots: true }\n    allowWeakerDelivery: true\n",
                1,
            ),
    ));
    cases.push((
        "a session ending at disconnect with the opt-out".to_owned(),
        CONNECTION.replacen(
            "sessionExpirySeconds: 3600",
            "sessionExpirySeconds: 0\n    allowWeakerDelivery: true",
            1,
        ),
    ));
    cases.push((
        "the largest session expiry".to_owned(),
        CONNECTION.replacen(
            "sessionExpirySeconds: 3600",
            "sessionExpirySeconds: 4294967295",
            1,
        ),
    ));
    cases.push((
        "the README's first connection and rule".to_owned(),
        readme_first_objects(),
    ));
    cases
}

/// The README's first BrokerConnection and ForwardingRule (its first YAML block), as a user
/// copies them, moved to this test's namespace: the README's first steps stay valid as the
/// CRDs change.
fn readme_first_objects() -> String {
    let readme = include_str!("../../README.md");
    let yaml = readme
        .split("```yaml\n")
        .nth(1)
        .and_then(|block| block.split("```").next())
        .expect("the README has a YAML block");
    assert!(
        yaml.contains("kind: BrokerConnection") && yaml.contains("kind: ForwardingRule"),
        "the README's first YAML block is a connection and a rule:\n{yaml}"
    );
    yaml.replace("namespace: plant", "namespace: ferry")
}

#[test]
fn shared_vectors_agree_with_the_forwarder() {
    // The apiserver test below relies on these being the forwarder's verdicts.
    for (filter, error) in FILTER_VECTORS {
        assert_eq!(
            ferry_api::TopicFilter::parse(filter).err(),
            error.clone(),
            "{filter:?}"
        );
    }
    for (host, ok) in HOST_VECTORS {
        assert_eq!(
            ferry_api::addr::host_problem(host).is_none(),
            *ok,
            "{host:?}"
        );
    }
    for (server, ok) in SERVER_VECTORS {
        assert_eq!(
            ferry_api::addr::server_problem(server).is_none(),
            *ok,
            "{server:?}"
        );
    }
}

#[test]
fn admission_refuses_what_the_forwarder_refuses_and_accepts_its_edge_cases() {
    let cp = common::control_plane_with_crds("ferry");
    // Once these are in, discovery knows both kinds; the cases below are all creates.
    common::apply(
        &cp,
        &CONNECTION.replacen("name: plant", "name: discovery", 1),
    );
    common::apply(&cp, &RULE.replacen("name: telemetry", "name: discovery", 1));
    let accepted = accepted_objects();
    for (what, object) in &accepted {
        cp.run_kubectl_with_stdin(["apply", "--dry-run=server", "-f", "-"], object)
            .unwrap_or_else(|e| panic!("{what}: refused: {e}\n{object}"));
    }
    let refused: Vec<(String, String, &str)> = refused_vectors()
        .into_iter()
        .chain(
            refused_kafka_settings()
                .into_iter()
                .map(|(w, o, m)| (w.to_owned(), o, m)),
        )
        .collect();
    for (what, object, message) in &refused {
        let err = cp
            .run_kubectl_with_stdin(["apply", "--dry-run=server", "-f", "-"], object)
            .expect_err(what)
            .to_string();
        assert!(
            err.contains(message),
            "{what}: expected {message:?} in:\n{err}"
        );
    }
    eprintln!(
        "{} edge cases accepted, {} shared vectors and librdkafka settings refused with their messages",
        accepted.len(),
        refused.len()
    );
}

#[test]
fn crds_install_accept_valid_objects_and_refuse_each_invalid_one_with_its_message() {
    let cp = common::control_plane_with_crds("ferry");
    common::apply(&cp, CONNECTION);
    cp.run_kubectl_with_stdin(["apply", "-f", "-"], RULE)
        .expect("valid ForwardingRule accepted");
    let got = cp
        .run_kubectl([
            "get",
            "fr",
            "-n",
            "ferry",
            "-o",
            "jsonpath={.items[0].spec.group}",
        ])
        .expect("get fr");
    assert_eq!(got, "default", "group defaults to default");
    let table = cp
        .run_kubectl(["get", "ferry", "-n", "ferry"])
        .expect("get by category");
    eprintln!("kubectl get ferry -n ferry:\n{table}");
    assert!(
        table.contains("telemetry") && table.contains("plant"),
        "{table}"
    );
    let explain = cp
        .run_kubectl(["explain", "forwardingrule.spec.kafka.topic"])
        .expect("explain");
    assert!(explain.contains("template"), "{explain}");

    let cases = invalid_objects();
    assert!(cases.len() >= 15);
    for (what, object, message) in &cases {
        // Dry-run: each case is judged on its own, against the same valid neighbours.
        let err = cp
            .run_kubectl_with_stdin(["apply", "--dry-run=server", "-f", "-"], object)
            .expect_err(what);
        let err = err.to_string();
        assert!(
            err.contains(message),
            "{what}: expected {message:?} in:\n{err}"
        );
    }
    eprintln!(
        "{} invalid objects refused, each with its own message",
        cases.len()
    );
}

/// What the build step produces is accepted by a real apiserver, and deleting the connection
/// removes all of it through the garbage collector.
#[test]
fn a_groups_children_apply_and_go_away_with_their_connection() {
    use ferry_api::crd::{BrokerConnection, ForwardingRule};
    use ferry_operator::children::{self, keys};
    use ferry_operator::render::{Group, render};
    use k8s_openapi::ByteString;

    let cp = common::control_plane_with_crds("ferry");
    common::apply(&cp, CONNECTION);
    // The stored object, with its uid, is what children point their owner reference at.
    let stored = cp
        .run_kubectl(["get", "bc", "plant", "-n", "ferry", "-o", "json"])
        .expect("get bc");
    let connection: BrokerConnection = serde_json::from_str(&stored).expect("parse bc");
    let rule: ForwardingRule = serde_saphyr::from_str(RULE).expect("parse rule");
    let rendered = render(&Group {
        connection: &connection,
        name: "default",
        rules: vec![&rule],
    })
    .expect("render");
    let secret = [
        keys::MQTT_USERNAME,
        keys::MQTT_PASSWORD,
        keys::KAFKA_USERNAME,
        keys::KAFKA_PASSWORD,
        keys::MQTT_CA,
    ]
    .into_iter()
    .map(|k| (k.to_owned(), ByteString(b"x".to_vec())))
    .collect();
    let c = children::build(
        &connection,
        "default",
        &rendered,
        secret,
        &ferry_operator::image::ForwarderImage::default()
            .for_connection(&connection.spec.forwarder)
            .expect("the connection's image"),
    );
    for json in [
        serde_json::to_string(&c.config_map),
        serde_json::to_string(&c.secret),
        serde_json::to_string(&c.stateful_set),
        serde_json::to_string(&c.service),
        serde_json::to_string(&c.pdb),
    ] {
        let json = json.expect("serialize");
        cp.run_kubectl_with_stdin(
            [
                "apply",
                "--server-side",
                "--field-manager=ferry-operator",
                "-f",
                "-",
            ],
            &json,
        )
        .unwrap_or_else(|e| panic!("apiserver refused a child: {e}\n{json}"));
    }
    let kinds = "statefulset,service,configmap,secret,poddisruptionbudget";
    let children = || {
        cp.run_kubectl([
            "get",
            kinds,
            "-n",
            "ferry",
            "-l",
            "ferry.dev/group=default",
            "-o",
            "name",
        ])
        .expect("list children")
    };
    let listed = children();
    assert_eq!(listed.lines().count(), 5, "{listed}");

    cp.run_kubectl(["delete", "bc", "plant", "-n", "ferry", "--wait=true"])
        .expect("delete connection");
    let start = Instant::now();
    loop {
        let left = children();
        if left.trim().is_empty() {
            break;
        }
        // The garbage collector learns new resource kinds on its discovery resync (every 30 s
        // by default); with a CRD installed moments ago it may take that long to act.
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "children outlived their connection:\n{left}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "5 children applied, and collected {:.1?} after their connection was deleted",
        start.elapsed()
    );
}
