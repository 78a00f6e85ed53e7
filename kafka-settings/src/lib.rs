//! The librdkafka settings Ferry makes of a `kafka` config (its producer defaults, TLS, SASL,
//! the user's `kafka.config`, the queue bounded in bytes), and what librdkafka refuses in them.
//! A crate of its own so that the operator, which asks librdkafka the forwarder's question
//! before it renders a connection, links these and not the whole data plane. Which settings
//! Ferry sets itself or refuses is `ferry_api::kafka_props`, read by both sides' validation.

use ferry_api::config::{KafkaConfig, Problem, ProblemKind};
use ferry_api::kafka_props::QUEUE_MAX_KBYTES;
use rdkafka::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, DeliveryResult, ProducerContext};

/// Ferry's producer defaults; anything in `kafka.config` overrides them.
pub const DEFAULTS: &[(&str, &str)] = &[
    ("acks", "all"),
    ("enable.idempotence", "true"),
    ("compression.type", "lz4"),
    // The forwarder holds at most `max_inflight` messages, so its throughput is the window
    // divided by the produce round trip, of which linger is most: 2 ms instead of 5 raised a
    // 1000-message window's drain from ~130k to ~210k msg/s (ferry-bench); 1 ms made requests
    // so small that the five in flight per connection (idempotence) became the limit.
    ("linger.ms", "2"),
    // Never give up on a record inside librdkafka: a Kafka outage must hold messages (and so
    // the MQTT acks) rather than fail them. librdkafka keeps retrying with capped backoff and,
    // with idempotence, keeps per-partition order.
    ("message.timeout.ms", "0"),
    ("retry.backoff.ms", "100"),
    ("retry.backoff.max.ms", "5000"),
    ("socket.keepalive.enable", "true"),
];

/// librdkafka's queue bounded in bytes by the window's bytes (`mqtt.max_inflight_bytes`),
/// unless `kafka.config` sets it: its default (1 GiB) would let the records of one window of
/// large messages, once per target, pass any pod's memory. A full queue holds the records
/// (`queue_full`), as a full window holds the messages.
pub fn with_queue_bound(kafka: &KafkaConfig, max_inflight_bytes: u64) -> KafkaConfig {
    let mut kafka = kafka.clone();
    kafka
        .config
        .entry(QUEUE_MAX_KBYTES.to_owned())
        .or_insert_with(|| max_inflight_bytes.div_ceil(1024).max(1).to_string());
    kafka
}

/// The librdkafka client settings of `kafka`: Ferry's defaults, TLS (its files) and SASL,
/// then `kafka.config` over all of them.
pub fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &kafka.bootstrap_servers);
    for (k, v) in DEFAULTS {
        cc.set(*k, *v);
    }
    if let Some(p) = kafka.security_protocol() {
        cc.set("security.protocol", p);
    }
    if let Some(tls) = &kafka.tls {
        // Verify the broker's name against its certificate, not only the chain.
        cc.set("ssl.endpoint.identification.algorithm", "https");
        if let Some(ca) = &tls.ca_file {
            cc.set("ssl.ca.location", ca);
        }
        if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
            cc.set("ssl.certificate.location", cert);
            cc.set("ssl.key.location", key);
        }
    }
    if let Some(sasl) = &kafka.sasl {
        cc.set("sasl.mechanism", sasl.mechanism.as_str());
        cc.set("sasl.username", &sasl.username);
        cc.set("sasl.password", sasl.password.expose());
    }
    for (k, v) in &kafka.config {
        cc.set(k, v);
    }
    // librdkafka's `debug` contexts only log at Debug level: honour them when asked for.
    cc.set_log_level(if kafka.config.contains_key("debug") {
        RDKafkaLogLevel::Debug
    } else {
        RDKafkaLogLevel::Warning
    });
    cc
}

/// What librdkafka itself refuses in `kafka.config`: an unknown property or a value out of
/// range (found by configuring a client), then what it checks only when it creates one
/// (`max.in.flight.requests.per.connection` above 5 or `retries` 0 with idempotence, ...),
/// found by creating a producer with no broker to connect to, dropped at once. Without this,
/// such a config passed `--check` and failed only when the forwarder started.
pub fn config_problem(kafka: &KafkaConfig) -> Option<Problem> {
    match client_config(kafka).create_native_config() {
        Ok(_) => {}
        // The value is left out: it may be a credential.
        Err(KafkaError::ClientConfig(_, description, key, _)) => {
            return Some(Problem {
                path: format!("kafka.config.{key}"),
                message: format!("librdkafka refuses it: {description}"),
                kind: ProblemKind::Setting,
            });
        }
        Err(other) => {
            return Some(Problem {
                path: "kafka.config".into(),
                message: format!("librdkafka refuses it: {other}"),
                kind: ProblemKind::Setting,
            });
        }
    }
    // `kafka.config` over the defaults, without `tls` and `sasl`: their files are the
    // environment's (the pod's Secret), checked when the forwarder starts, and this check must
    // also run where they are not (the operator). No bootstrap server: librdkafka starts no
    // broker thread and so connects to nothing.
    let mut config = client_config(&KafkaConfig {
        tls: None,
        sasl: None,
        ..kafka.clone()
    });
    config.set("bootstrap.servers", "");
    match config.create_with_context::<_, BaseProducer<Unconnected>>(Unconnected) {
        Ok(_) => None,
        Err(KafkaError::ClientCreation(reason)) => Some(Problem {
            path: property_named(&reason, kafka),
            message: format!("librdkafka refuses to create a producer with it: {reason}"),
            kind: ProblemKind::Setting,
        }),
        Err(other) => Some(Problem {
            path: "kafka.config".into(),
            message: format!("librdkafka refuses to create a producer with it: {other}"),
            kind: ProblemKind::Setting,
        }),
    }
}

/// librdkafka's aliases of producer properties (`rdkafka_conf.c`): its messages use one name,
/// a config may use the other.
const ALIASES: &[(&str, &str)] = &[
    ("max.in.flight", "max.in.flight.requests.per.connection"),
    ("linger.ms", "queue.buffering.max.ms"),
    ("retries", "message.send.max.retries"),
    ("compression.type", "compression.codec"),
    ("acks", "request.required.acks"),
    ("delivery.timeout.ms", "message.timeout.ms"),
];

/// The `kafka.config` entry a producer-creation error names (librdkafka quotes properties in
/// backticks, by one of their aliases), else `kafka.config`.
fn property_named(reason: &str, kafka: &KafkaConfig) -> String {
    let same = |quoted: &str, key: &str| {
        quoted == key
            || ALIASES
                .iter()
                .any(|&(a, b)| (a, b) == (quoted, key) || (b, a) == (quoted, key))
    };
    reason
        .split('`')
        .skip(1)
        .step_by(2)
        .find_map(|quoted| kafka.config.keys().find(|key| same(quoted, key)))
        .map_or_else(
            || "kafka.config".to_owned(),
            |key| format!("kafka.config.{key}"),
        )
}

/// The context of the producer [`config_problem`] creates: it has nothing to say.
struct Unconnected;

impl ClientContext for Unconnected {
    fn log(&self, _: RDKafkaLogLevel, _: &str, _: &str) {}
}

impl ProducerContext for Unconnected {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &DeliveryResult<'_>, _: ()) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain_kafka() -> KafkaConfig {
        KafkaConfig {
            bootstrap_servers: "k:9092".into(),
            tls: None,
            sasl: None,
            config: Default::default(),
            allow_weaker_delivery: false,
        }
    }

    #[test]
    fn user_config_overrides_defaults() {
        let mut kafka = plain_kafka();
        kafka.config.insert("linger.ms".into(), "50".into());
        let cc = client_config(&kafka);
        assert_eq!(cc.get("linger.ms"), Some("50"));
        assert_eq!(cc.get("acks"), Some("all"));
        assert_eq!(cc.get("enable.idempotence"), Some("true"));
        assert_eq!(cc.get("bootstrap.servers"), Some("k:9092"));
        assert_eq!(cc.get("security.protocol"), None);
    }

    #[test]
    fn tls_and_sasl_set_the_security_protocol() {
        use ferry_api::config::{Sasl, SaslMechanism, Secret, Tls};
        let kafka = KafkaConfig {
            bootstrap_servers: "k:9093".into(),
            tls: Some(Tls {
                ca_file: Some("/ca.pem".into()),
                ..Tls::default()
            }),
            sasl: Some(Sasl {
                mechanism: SaslMechanism::ScramSha512,
                username: "ferry".into(),
                username_file: None,
                password: Secret("pw".into()),
                password_file: None,
            }),
            config: Default::default(),
            allow_weaker_delivery: false,
        };
        let cc = client_config(&kafka);
        assert_eq!(cc.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(cc.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(cc.get("ssl.ca.location"), Some("/ca.pem"));
        assert_eq!(
            cc.get("ssl.endpoint.identification.algorithm"),
            Some("https")
        );
    }

    #[test]
    fn librdkafka_refusals_name_the_property() {
        let mut kafka = plain_kafka();
        assert_eq!(config_problem(&kafka), None);
        kafka.config.insert("linger.ms".into(), "10".into());
        assert_eq!(config_problem(&kafka), None);
        kafka.config.insert("lingr.ms".into(), "10".into());
        let problem = config_problem(&kafka).expect("unknown property");
        assert_eq!(problem.path, "kafka.config.lingr.ms", "{problem}");
        kafka.config.remove("lingr.ms");
        kafka.config.insert("linger.ms".into(), "soon".into());
        let problem = config_problem(&kafka).expect("bad value");
        assert_eq!(problem.path, "kafka.config.linger.ms", "{problem}");
    }

    #[test]
    fn what_librdkafka_checks_only_when_creating_a_producer_is_refused_naming_the_property() {
        for (key, value) in [
            ("max.in.flight.requests.per.connection", "6"),
            ("retries", "0"),
            ("queue.buffering.backpressure.threshold", "2"),
        ] {
            let mut kafka = plain_kafka();
            kafka.config.insert(key.into(), value.into());
            let problem = config_problem(&kafka)
                .unwrap_or_else(|| panic!("{key}: {value} with idempotence is refused"));
            assert_eq!(problem.path, format!("kafka.config.{key}"), "{problem}");
            assert!(
                problem.message.contains("refuses to create a producer"),
                "{problem}"
            );
        }
        let mut kafka = plain_kafka();
        kafka
            .config
            .insert("max.in.flight.requests.per.connection".into(), "5".into());
        assert_eq!(config_problem(&kafka), None, "5 is idempotence's limit");
    }

    #[test]
    fn kafka_config_debug_turns_on_librdkafka_debug_logs() {
        let mut kafka = plain_kafka();
        assert!(matches!(
            client_config(&kafka).log_level,
            RDKafkaLogLevel::Warning
        ));
        kafka.config.insert("debug".into(), "broker,msg".into());
        assert!(matches!(
            client_config(&kafka).log_level,
            RDKafkaLogLevel::Debug
        ));
    }
}
