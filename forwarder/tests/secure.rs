//! Security on both sides, on real brokers with certificates generated for each test: MQTT over
//! TLS with client certificates (RSA and ECDSA) and a password, Kafka over SASL_SSL (SCRAM and
//! PLAIN); a certificate that does not verify or refused credentials stop the forwarder with an
//! error naming the host; secrets never reach logs, metrics or `/status`.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Forwarder, runtime};
use ferry_e2e::{
    Kafka, KafkaOptions, KeyType, Mosquitto, MosquittoOptions, Pki, SaslSsl, TlsListener,
};
use rumqttc::QoS;

const MQTT_USER: &str = "ferry";
const MQTT_PASSWORD: &str = "mqtt-Secret-4711";
const SCRAM_USER: &str = "ferry-scram";
const SCRAM_PASSWORD: &str = "scram-Secret-0815";
const PLAIN_USER: &str = "ferry-plain";
/// Every character with a meaning in YAML, a newline and a trailing space: it works only
/// because the forwarder reads it from a file (`password_file`), never from config text.
const PLAIN_PASSWORD: &str = "p: a #b 'c\" {d} [e] *f &g !h |i >j %k @l `m ,n ?o -\n${P} ";
/// The MQTT user whose password comes from a file, the same hostile one.
const FILE_USER: &str = "ferry-files";
const FILE_PASSWORD: &str = PLAIN_PASSWORD;

struct SecureBrokers {
    mqtt: Mosquitto,
    kafka: Kafka,
}

fn start(mqtt_pki: &Pki, kafka_pki: &Pki) -> SecureBrokers {
    let mqtt = Mosquitto::start_with(MosquittoOptions {
        tls: Some(TlsListener {
            pki: mqtt_pki,
            require_client_cert: true,
        }),
        users: vec![
            (MQTT_USER.into(), MQTT_PASSWORD.into()),
            (FILE_USER.into(), FILE_PASSWORD.into()),
        ],
        ..MosquittoOptions::default()
    })
    .expect("mosquitto");
    let kafka = Kafka::start_with(KafkaOptions {
        sasl_ssl: Some(SaslSsl {
            pki: kafka_pki,
            scram_sha512_users: vec![(SCRAM_USER.into(), SCRAM_PASSWORD.into())],
            plain_users: vec![(PLAIN_USER.into(), PLAIN_PASSWORD.into())],
            require_client_cert: false,
        }),
        ..Default::default()
    })
    .expect("kafka");
    SecureBrokers { mqtt, kafka }
}

struct Settings<'a> {
    client_id: &'a str,
    protocol: &'a str,
    mqtt_pki: &'a Pki,
    mqtt_ca: &'a Pki,
    mqtt_login: (&'a str, &'a str),
    kafka_ca: &'a Pki,
    sasl: (&'a str, &'a str, &'a str),
    topic: &'a str,
    /// Write the credentials into files in this directory and give the config their paths.
    credential_files: Option<&'a Path>,
}

/// The config's MQTT credential lines and the `sasl` mapping: inline, or as files.
fn credentials(s: &Settings<'_>) -> (String, String) {
    let (mechanism, user, password) = s.sasl;
    let (mqtt_user, mqtt_password) = s.mqtt_login;
    let Some(dir) = s.credential_files else {
        return (
            format!("  username: {mqtt_user}\n  password: {mqtt_password}\n"),
            format!("{{ mechanism: {mechanism}, username: {user}, password: {password} }}"),
        );
    };
    let file = |name: &str, value: &str| {
        let path = dir.join(name);
        std::fs::write(&path, value).expect("write a credential file");
        path.display().to_string()
    };
    (
        format!(
            "  username_file: {}\n  password_file: {}\n",
            file("mqtt-username", mqtt_user),
            file("mqtt-password", mqtt_password)
        ),
        format!(
            "{{ mechanism: {mechanism}, username_file: {}, password_file: {} }}",
            file("kafka-username", user),
            file("kafka-password", password)
        ),
    )
}

fn config(b: &SecureBrokers, s: &Settings<'_>) -> String {
    let (mqtt_credentials, sasl) = credentials(s);
    format!(
        "mqtt:\n  host: 127.0.0.1\n  port: {mqtt_port}\n  protocol: {protocol}\n  client_id: {client_id}\n  reconnect_max_ms: 500\n\
         {mqtt_credentials}\
         \x20 tls: {{ ca_file: {mqtt_ca}, cert_file: {cert}, key_file: {key} }}\n\
         kafka:\n  bootstrap_servers: {kafka}\n  tls: {{ ca_file: {kafka_ca} }}\n\
         \x20 sasl: {sasl}\n\
         \x20 config: {{ debug: \"security,broker,protocol\" }}\n\
         rules:\n  - name: secure\n    mqtt: {{ topics: [\"secure/#\"] }}\n    kafka: {{ topic: {topic} }}\n",
        mqtt_port = b.mqtt.tls_port(),
        protocol = s.protocol,
        client_id = s.client_id,
        mqtt_ca = s.mqtt_ca.ca_cert().display(),
        cert = s.mqtt_pki.client_cert().display(),
        key = s.mqtt_pki.client_key().display(),
        kafka = b.kafka.sasl_ssl_bootstrap(),
        kafka_ca = s.kafka_ca.ca_cert().display(),
        topic = s.topic,
    )
}

/// Every secret the forwarder was given must be absent from everything it shows.
fn assert_no_secrets(fwd: &Forwarder, what: &str) {
    let answer = |path| {
        common::http_get(fwd.http_port, path)
            .map(|(_, b)| b)
            .unwrap_or_else(|e| panic!("{what}: {path} did not answer: {e:#}"))
    };
    let log = fwd.log();
    // The check is only worth something if librdkafka's own debugging was really logged.
    assert!(
        log.lines()
            .any(|l| l.contains("DEBUG") && l.contains("librdkafka") && l.contains("SASL")),
        "{what}: no librdkafka SASL debug line in the log"
    );
    for (surface, text) in [
        ("log", log),
        ("/metrics", answer("/metrics")),
        ("/status", answer("/status")),
    ] {
        for secret in [MQTT_PASSWORD, SCRAM_PASSWORD, PLAIN_PASSWORD] {
            assert!(
                !text.contains(secret),
                "{what}: a secret appears in the {surface}"
            );
        }
    }
}

#[test]
fn tls_client_certificates_and_sasl_forward_end_to_end_without_leaking_secrets() {
    let rsa = Pki::generate(KeyType::Rsa).expect("rsa pki");
    let ecdsa = Pki::generate(KeyType::Ecdsa).expect("ecdsa pki");
    // The MQTT broker's certificate chain is RSA; client certificates of both kinds are
    // accepted only because their CA is the broker's, so the ECDSA client gets an RSA-CA-signed
    // ECDSA certificate from a second broker below.
    let b = start(&rsa, &rsa);
    let rt = runtime();
    for t in ["scram", "plain"] {
        rt.block_on(b.kafka.create_topic(t, 1)).expect("topic");
    }
    let credential_dir = tempfile::tempdir().expect("credential dir");
    // Trace level, and librdkafka's own security debugging: the most a log can say.
    let trace = [("FERRY_LOG", "trace")];
    let mut scram = Forwarder::start_with(
        &config(
            &b,
            &Settings {
                client_id: "ferry-rsa-v311",
                protocol: "\"3.1.1\"",
                mqtt_pki: &rsa,
                mqtt_ca: &rsa,
                mqtt_login: (MQTT_USER, MQTT_PASSWORD),
                kafka_ca: &rsa,
                sasl: ("SCRAM-SHA-512", SCRAM_USER, SCRAM_PASSWORD),
                credential_files: None,
                topic: "scram",
            },
        ),
        &trace,
    );
    let mut plain = Forwarder::start_with(
        &config(
            &b,
            &Settings {
                client_id: "ferry-rsa-v5",
                protocol: "5",
                mqtt_pki: &rsa,
                mqtt_ca: &rsa,
                mqtt_login: (FILE_USER, FILE_PASSWORD),
                kafka_ca: &rsa,
                sasl: ("PLAIN", PLAIN_USER, PLAIN_PASSWORD),
                topic: "plain",
                credential_files: Some(credential_dir.path()),
            },
        ),
        &trace,
    );
    scram.wait_ready(Duration::from_secs(30));
    plain.wait_ready(Duration::from_secs(30));
    let msgs: Vec<(String, Vec<u8>)> = (0..200)
        .map(|i| (format!("secure/{}", i % 4), format!("m{i}").into_bytes()))
        .collect();
    rt.block_on(ferry_e2e::publish_as(
        b.mqtt.port(),
        "pub-secure",
        Some((MQTT_USER, MQTT_PASSWORD)),
        QoS::AtLeastOnce,
        msgs,
    ))
    .expect("publish");
    for (fwd, topic) in [(&scram, "scram"), (&plain, "plain")] {
        let records = b
            .kafka
            .read_all(topic, 200, Duration::from_secs(2), Duration::from_secs(60))
            .expect("read");
        assert_eq!(records.len(), 200, "{topic}:\n{}", fwd.log());
        assert_no_secrets(fwd, topic);
    }
    drop((scram, plain));

    // An ECDSA client certificate against a broker with an ECDSA PKI, over MQTT 5.
    let e = start(&ecdsa, &rsa);
    rt.block_on(e.kafka.create_topic("ecdsa", 1))
        .expect("topic");
    let ec = Forwarder::start_with(
        &config(
            &e,
            &Settings {
                client_id: "ferry-ecdsa",
                protocol: "5",
                mqtt_pki: &ecdsa,
                mqtt_ca: &ecdsa,
                mqtt_login: (MQTT_USER, MQTT_PASSWORD),
                kafka_ca: &rsa,
                sasl: ("SCRAM-SHA-512", SCRAM_USER, SCRAM_PASSWORD),
                credential_files: None,
                topic: "ecdsa",
            },
        ),
        &trace,
    );
    let mut ec = ec;
    ec.wait_ready(Duration::from_secs(30));
    rt.block_on(ferry_e2e::publish_as(
        e.mqtt.port(),
        "pub-ecdsa",
        Some((MQTT_USER, MQTT_PASSWORD)),
        QoS::AtLeastOnce,
        vec![("secure/ec".into(), b"ec".to_vec())],
    ))
    .expect("publish");
    let records = e
        .kafka
        .read_all("ecdsa", 1, Duration::from_secs(1), Duration::from_secs(30))
        .expect("read");
    assert_eq!(records.len(), 1, "{}", ec.log());
    assert_no_secrets(&ec, "ecdsa");
}

/// Runs the forwarder until it exits (it should, by itself); returns (exit code, stderr).
fn run_to_exit(config: &str) -> (Option<i32>, String, Duration) {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, config).expect("write");
    let http = ferry_e2e::free_port().expect("port");
    // A file, not a pipe: at trace level with librdkafka debugging the log outgrows a pipe's
    // buffer and the forwarder would block writing it.
    let log_path = dir.path().join("stderr.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let start = Instant::now();
    let mut child = Command::new(Forwarder::bin())
        .arg("--config")
        .arg(&path)
        .env("FERRY_HTTP_LISTEN", format!("127.0.0.1:{http}"))
        .env("FERRY_LOG", "trace")
        .stderr(log)
        .spawn()
        .expect("spawn");
    while start.elapsed() < Duration::from_secs(60) {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let status = child.wait().expect("wait");
    let stderr = std::fs::read(&log_path).expect("read log");
    (
        status.code(),
        String::from_utf8_lossy(&stderr).into_owned(),
        start.elapsed(),
    )
}

#[test]
fn unverifiable_certificates_and_refused_credentials_stop_the_forwarder_naming_the_host() {
    let pki = Pki::generate(KeyType::Rsa).expect("pki");
    let stranger = Pki::generate(KeyType::Ecdsa).expect("other ca");
    let b = start(&pki, &pki);
    let good = Settings {
        client_id: "ferry-bad",
        protocol: "\"3.1.1\"",
        mqtt_pki: &pki,
        mqtt_ca: &pki,
        mqtt_login: (MQTT_USER, MQTT_PASSWORD),
        kafka_ca: &pki,
        sasl: ("SCRAM-SHA-512", SCRAM_USER, SCRAM_PASSWORD),
        topic: "t",
        credential_files: None,
    };
    let mqtt_host = format!("127.0.0.1:{}", b.mqtt.tls_port());
    let cases: [(&str, Settings<'_>, Vec<&str>); 4] = [
        (
            "MQTT broker certificate from an unknown CA",
            Settings {
                mqtt_ca: &stranger,
                ..good
            },
            vec![mqtt_host.as_str(), "certificate"],
        ),
        (
            "MQTT password refused",
            Settings {
                mqtt_login: (MQTT_USER, "wrong-password"),
                ..good
            },
            vec![mqtt_host.as_str(), "refused"],
        ),
        (
            "Kafka broker certificate from an unknown CA",
            Settings {
                kafka_ca: &stranger,
                ..good
            },
            vec!["kafka", "certificate verification failed"],
        ),
        (
            "Kafka SCRAM password refused",
            Settings {
                sasl: ("SCRAM-SHA-512", SCRAM_USER, "wrong-password"),
                ..good
            },
            vec!["kafka", "authentication failed"],
        ),
    ];
    for (what, settings, expected) in cases {
        let (code, stderr, took) = run_to_exit(&config(&b, &settings));
        let last = stderr
            .lines()
            .find(|l| l.starts_with("ferry-forwarder: "))
            .unwrap_or_default()
            .to_owned();
        eprintln!("{what}: exit {code:?} after {took:.1?}: {last}");
        assert_eq!(code, Some(1), "{what}:\n{stderr}");
        for e in expected {
            assert!(
                last.contains(e),
                "{what}: {e:?} missing in the final error: {last}"
            );
        }
        if what.contains("Kafka") {
            assert!(last.contains(&b.kafka.sasl_ssl_bootstrap()), "{last}");
        }
        for secret in [MQTT_PASSWORD, SCRAM_PASSWORD, "wrong-password"] {
            assert!(!stderr.contains(secret), "{what}: a secret in the log");
        }
    }
}
