//! The secured fixtures work: Mosquitto with TLS, client certificates and passwords, and Kafka
//! with a SASL_SSL listener (SCRAM-SHA-512 and PLAIN), both with RSA and ECDSA certificates
//! made at test time. Each test starts its own brokers on 127.0.0.1 and stops them on drop.

use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_e2e::rumqttc::QoS;
use ferry_e2e::{
    Kafka, KafkaOptions, KeyType, Mosquitto, MosquittoOptions, Pki, SaslSsl, TlsListener,
};
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn users(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(u, p)| ((*u).to_owned(), (*p).to_owned()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Mosquitto, through the mosquitto_pub / mosquitto_sub CLI (libmosquitto + OpenSSL).

struct CliResult {
    success: bool,
    stdout: String,
    stderr: String,
}

/// Runs a command, killing it after `timeout`.
fn run(cmd: &mut Command, timeout: Duration) -> CliResult {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut stdout, mut stderr) = (String::new(), String::new());
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut stdout);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    CliResult {
        success: status.is_some_and(|s| s.success()),
        stdout,
        stderr: if status.is_none() {
            format!("{stderr}(killed after {timeout:?})")
        } else {
            stderr
        },
    }
}

/// How a CLI client connects.
#[derive(Clone, Copy)]
struct MqttClient<'a> {
    port: u16,
    /// `--cafile`: connect with TLS, verifying the server against this CA.
    ca: Option<&'a Path>,
    /// `--cert`, `--key`.
    cert: Option<(&'a Path, &'a Path)>,
    /// `-u`, `-P`.
    login: Option<(&'a str, &'a str)>,
}

impl MqttClient<'_> {
    fn command(&self, bin: &str) -> Command {
        let mut cmd = Command::new(bin);
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q", "1"]);
        if let Some(ca) = self.ca {
            cmd.arg("--cafile").arg(ca);
        }
        if let Some((cert, key)) = self.cert {
            cmd.arg("--cert").arg(cert).arg("--key").arg(key);
        }
        if let Some((user, password)) = self.login {
            cmd.args(["-u", user, "-P", password]);
        }
        cmd
    }

    /// Publishes a retained message (so a later subscriber gets it).
    fn publish_retained(&self, topic: &str, message: &str) -> CliResult {
        run(
            self.command("mosquitto_pub")
                .args(["-t", topic, "-m", message, "-r"]),
            Duration::from_secs(10),
        )
    }

    /// Subscribes and returns the first message (the retained one).
    fn receive_one(&self, topic: &str) -> CliResult {
        run(
            self.command("mosquitto_sub")
                .args(["-t", topic, "-C", "1", "-W", "5"]),
            Duration::from_secs(10),
        )
    }

    /// Publishes, then reads the message back with a subscriber. Returns what it read.
    fn round_trip(&self, topic: &str, message: &str) -> Result<String, String> {
        let p = self.publish_retained(topic, message);
        if !p.success {
            return Err(format!("mosquitto_pub failed: {}", one_line(&p.stderr)));
        }
        let s = self.receive_one(topic);
        if !s.success {
            return Err(format!("mosquitto_sub failed: {}", one_line(&s.stderr)));
        }
        Ok(s.stdout.trim_end().to_owned())
    }
}

fn one_line(text: &str) -> String {
    text.trim().lines().collect::<Vec<_>>().join(" | ")
}

fn expect_refused(what: &str, result: Result<String, String>, hint: &str) {
    match result {
        Ok(got) => panic!("{what}: expected a failure, but the round trip worked ({got:?})"),
        Err(e) => {
            println!("    {what}: refused as expected: {e}");
            assert!(
                e.to_lowercase().contains(&hint.to_lowercase()),
                "{what}: expected an error mentioning {hint:?}, got {e:?}"
            );
        }
    }
}

fn mosquitto_tls_with_client_cert_and_password(key_type: KeyType) {
    let start = Instant::now();
    let pki = Pki::generate(key_type).expect("pki");
    let other = Pki::generate(key_type).expect("second, unrelated pki");
    println!("  {key_type:?} PKIs generated in {:?}", start.elapsed());
    let mut mqtt = Mosquitto::start_with(MosquittoOptions {
        tls: Some(TlsListener {
            pki: &pki,
            require_client_cert: true,
        }),
        users: users(&[("ferry", "s3cret-pw"), ("other", "other-pw")]),
        ..MosquittoOptions::default()
    })
    .expect("mosquitto");
    println!(
        "  mosquitto plain port {} tls port {}",
        mqtt.port(),
        mqtt.tls_port()
    );
    let good = MqttClient {
        port: mqtt.tls_port(),
        ca: Some(pki.ca_cert()),
        cert: Some((pki.client_cert(), pki.client_key())),
        login: Some(("ferry", "s3cret-pw")),
    };
    let msg = format!("hello over TLS ({key_type:?})");
    assert_eq!(good.round_trip("secure/a", &msg), Ok(msg.clone()));

    // The server is verified: another CA does not trust it.
    expect_refused(
        "server checked against the wrong CA",
        MqttClient {
            ca: Some(other.ca_cert()),
            ..good
        }
        .round_trip("secure/b", "x"),
        "TLS",
    );
    // The client is verified: no certificate, or one from another CA, is refused.
    expect_refused(
        "no client certificate",
        MqttClient { cert: None, ..good }.round_trip("secure/b", "x"),
        "",
    );
    expect_refused(
        "client certificate from another CA",
        MqttClient {
            cert: Some((other.client_cert(), other.client_key())),
            ..good
        }
        .round_trip("secure/b", "x"),
        "",
    );
    // The password is checked, on TLS and on the plaintext listener.
    expect_refused(
        "wrong password over TLS",
        MqttClient {
            login: Some(("ferry", "wrong")),
            ..good
        }
        .round_trip("secure/b", "x"),
        "not authorised",
    );
    expect_refused(
        "no login over TLS",
        MqttClient {
            login: None,
            ..good
        }
        .round_trip("secure/b", "x"),
        "not authorised",
    );
    let plain = MqttClient {
        port: mqtt.port(),
        ca: None,
        cert: None,
        login: Some(("other", "other-pw")),
    };
    expect_refused(
        "anonymous on the plaintext port",
        MqttClient {
            login: None,
            ..plain
        }
        .round_trip("secure/b", "x"),
        "not authorised",
    );
    assert_eq!(plain.round_trip("secure/a", "plain"), Ok("plain".into()));

    // The library's own publisher logs in too.
    let rt = runtime();
    let message = vec![("secure/c".to_owned(), b"via rumqttc".to_vec())];
    rt.block_on(ferry_e2e::publish_as(
        mqtt.port(),
        "ferry-e2e-pub",
        Some(("ferry", "s3cret-pw")),
        QoS::AtLeastOnce,
        message.clone(),
    ))
    .expect("publish_as with the right password");
    let refused = rt.block_on(ferry_e2e::publish_as(
        mqtt.port(),
        "ferry-e2e-pub",
        Some(("ferry", "wrong")),
        QoS::AtLeastOnce,
        message.clone(),
    ));
    println!(
        "    publish_as with a wrong password: {:#}",
        refused
            .as_ref()
            .expect_err("publish_as with a wrong password must fail")
    );
    assert!(
        rt.block_on(ferry_e2e::publish(
            mqtt.port(),
            "ferry-e2e-pub",
            QoS::AtLeastOnce,
            message
        ))
        .is_err(),
        "anonymous publish must be refused"
    );

    // Same ports, same settings after a restart.
    mqtt.stop();
    mqtt.resume().expect("resume");
    assert_eq!(
        good.round_trip("secure/d", "after resume"),
        Ok("after resume".into())
    );
    println!("  done in {:?}", start.elapsed());
}

#[test]
fn mosquitto_tls_client_cert_and_password_rsa() {
    mosquitto_tls_with_client_cert_and_password(KeyType::Rsa);
}

#[test]
fn mosquitto_tls_client_cert_and_password_ecdsa() {
    mosquitto_tls_with_client_cert_and_password(KeyType::Ecdsa);
}

#[test]
fn mosquitto_tls_server_only_anonymous() {
    let pki = Pki::generate(KeyType::Ecdsa).expect("pki");
    let mqtt = Mosquitto::start_with(MosquittoOptions {
        tls: Some(TlsListener {
            pki: &pki,
            require_client_cert: false,
        }),
        users: vec![],
        ..MosquittoOptions::default()
    })
    .expect("mosquitto");
    let client = MqttClient {
        port: mqtt.tls_port(),
        ca: Some(pki.ca_cert()),
        cert: None,
        login: None,
    };
    assert_eq!(client.round_trip("open/a", "tls"), Ok("tls".into()));
    // Plaintext to the TLS port does not work.
    expect_refused(
        "plaintext to the TLS port",
        MqttClient { ca: None, ..client }.round_trip("open/a", "x"),
        "",
    );
    // And the plaintext port is as with Mosquitto::start.
    runtime()
        .block_on(ferry_e2e::publish(
            mqtt.port(),
            "anon",
            QoS::AtLeastOnce,
            vec![("open/b".into(), b"x".to_vec())],
        ))
        .expect("anonymous publish");
}

#[test]
fn bad_credentials_are_rejected_before_starting() {
    let err = Mosquitto::start_with(MosquittoOptions {
        tls: None,
        users: users(&[("a:b", "pw")]),
        ..MosquittoOptions::default()
    })
    .err()
    .expect("a ':' in a user name is refused");
    assert!(err.to_string().contains("not allowed"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Kafka, through rdkafka (librdkafka with OpenSSL).

/// Records librdkafka's client errors and the delivery results.
#[derive(Default)]
struct Watch {
    errors: Mutex<Vec<String>>,
    deliveries: Mutex<Vec<Result<(), String>>>,
}

#[derive(Clone, Default)]
struct Ctx(Arc<Watch>);

impl ClientContext for Ctx {
    fn error(&self, error: KafkaError, reason: &str) {
        self.0
            .errors
            .lock()
            .unwrap()
            .push(format!("{error}: {reason}"));
    }
}

impl ProducerContext for Ctx {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        self.0
            .deliveries
            .lock()
            .unwrap()
            .push(result.as_ref().map(|_| ()).map_err(|(e, _)| e.to_string()));
    }
}

/// Produces one record; Ok once Kafka acknowledged it.
fn produce(mut cc: ClientConfig, topic: &str, key: &str, value: &str) -> Result<(), String> {
    let ctx = Ctx::default();
    let producer: BaseProducer<Ctx> = cc
        .set("message.timeout.ms", "10000")
        .set("acks", "all")
        .create_with_context(ctx.clone())
        .map_err(|e| format!("create producer: {e}"))?;
    producer
        .send(BaseRecord::to(topic).key(key).payload(value))
        .map_err(|(e, _)| format!("send: {e}"))?;
    producer
        .flush(Duration::from_secs(15))
        .map_err(|e| format!("flush: {e}; errors {:?}", ctx.0.errors.lock().unwrap()))?;
    let deliveries = ctx.0.deliveries.lock().unwrap().clone();
    match deliveries.as_slice() {
        [Ok(())] => Ok(()),
        other => Err(format!(
            "deliveries {other:?}; errors {:?}",
            ctx.0.errors.lock().unwrap()
        )),
    }
}

/// Expects that a client with `cc` is refused: librdkafka reports an error containing `hint`
/// (within 10 s), and it cannot fetch metadata. Returns how long until the error came.
fn expect_kafka_refused(what: &str, cc: &ClientConfig, hint: &str) -> Duration {
    let ctx = Ctx::default();
    let producer: BaseProducer<Ctx> = cc
        .create_with_context(ctx.clone())
        .expect("create producer");
    let start = Instant::now();
    // Metadata is requested at once; errors come through the error callback, served by poll.
    let error = loop {
        producer.poll(Duration::from_millis(50));
        let errors = ctx.0.errors.lock().unwrap().clone();
        if let Some(e) = errors.iter().find(|e| e.contains(hint)) {
            break e.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what}: no client error containing {hint:?} within 10 s; errors: {errors:?}"
        );
    };
    let took = start.elapsed();
    let md = producer
        .client()
        .fetch_metadata(None, Duration::from_secs(1));
    assert!(
        md.is_err(),
        "{what}: metadata was served: expected a failure"
    );
    println!("    {what}: refused as expected after {took:?}: {error}");
    took
}

fn librdkafka_features() -> String {
    ClientConfig::new()
        .create_native_config()
        .and_then(|c| c.get("builtin.features"))
        .expect("builtin.features")
}

#[test]
fn librdkafka_is_built_with_scram_and_ssl() {
    let features = librdkafka_features();
    println!(
        "  librdkafka {} builtin.features={features}",
        rdkafka::util::get_rdkafka_version().1
    );
    for f in ["ssl", "sasl_scram", "sasl_plain"] {
        assert!(
            features.split(',').any(|x| x == f),
            "librdkafka lacks {f}: {features}"
        );
    }
}

#[test]
fn kafka_sasl_ssl_scram_and_plain_rsa() {
    let start = Instant::now();
    let pki = Pki::generate(KeyType::Rsa).expect("pki");
    let other = Pki::generate(KeyType::Rsa).expect("second, unrelated pki");
    let mut kafka = Kafka::start_with(KafkaOptions {
        sasl_ssl: Some(SaslSsl {
            pki: &pki,
            scram_sha512_users: users(&[("ferry", "scram-pw"), ("second", "second-pw")]),
            plain_users: users(&[("plainuser", "plain-pw")]),
            require_client_cert: false,
        }),
        ..Default::default()
    })
    .expect("kafka");
    println!(
        "  kafka plain {} sasl_ssl {} started in {:?}",
        kafka.bootstrap(),
        kafka.sasl_ssl_bootstrap(),
        start.elapsed()
    );
    let rt = runtime();
    rt.block_on(kafka.create_topic("secure", 1)).expect("topic");

    produce(
        kafka.sasl_ssl_client_config("SCRAM-SHA-512", "ferry", "scram-pw"),
        "secure",
        "k1",
        "scram",
    )
    .expect("SCRAM-SHA-512 over SASL_SSL");
    produce(
        kafka.sasl_ssl_client_config("PLAIN", "plainuser", "plain-pw"),
        "secure",
        "k2",
        "plain",
    )
    .expect("PLAIN over SASL_SSL");
    // The same settings by hand, with the PKI's own CA file (what a forwarder config would say).
    let mut by_hand = ClientConfig::new();
    by_hand
        .set("bootstrap.servers", kafka.sasl_ssl_bootstrap())
        .set("security.protocol", "SASL_SSL")
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .set("sasl.username", "second")
        .set("sasl.password", "second-pw")
        .set("ssl.ca.location", pki.ca_cert().display().to_string());
    produce(by_hand, "secure", "k3", "by hand").expect("second SCRAM user");

    let records = kafka
        .read_all(
            "secure",
            3,
            Duration::from_millis(500),
            Duration::from_secs(20),
        )
        .expect("read back on PLAINTEXT");
    let got: Vec<(Option<&str>, &str)> = records
        .iter()
        .map(|r| (r.key_str(), r.value_str()))
        .collect();
    assert_eq!(
        got,
        [
            (Some("k1"), "scram"),
            (Some("k2"), "plain"),
            (Some("k3"), "by hand")
        ]
    );

    let auth_failed = "Authentication failed";
    let t = expect_kafka_refused(
        "SCRAM with a wrong password",
        &kafka.sasl_ssl_client_config("SCRAM-SHA-512", "ferry", "wrong"),
        auth_failed,
    );
    assert!(t < Duration::from_secs(5), "took {t:?}");
    expect_kafka_refused(
        "SCRAM with an unknown user",
        &kafka.sasl_ssl_client_config("SCRAM-SHA-512", "nobody", "scram-pw"),
        auth_failed,
    );
    expect_kafka_refused(
        "PLAIN with a wrong password",
        &kafka.sasl_ssl_client_config("PLAIN", "plainuser", "wrong"),
        auth_failed,
    );
    expect_kafka_refused(
        "a PLAIN user over SCRAM",
        &kafka.sasl_ssl_client_config("SCRAM-SHA-512", "plainuser", "plain-pw"),
        auth_failed,
    );
    let mut wrong_ca = kafka.sasl_ssl_client_config("SCRAM-SHA-512", "ferry", "scram-pw");
    wrong_ca.set("ssl.ca.location", other.ca_cert().display().to_string());
    expect_kafka_refused(
        "server checked against the wrong CA",
        &wrong_ca,
        "certificate verify failed",
    );

    // The SCRAM credentials live in the metadata log: they survive a restart.
    kafka.stop();
    kafka.resume().expect("resume");
    produce(
        kafka.sasl_ssl_client_config("SCRAM-SHA-512", "ferry", "scram-pw"),
        "secure",
        "k4",
        "after resume",
    )
    .expect("SCRAM after resume");
    let records = kafka
        .read_all(
            "secure",
            4,
            Duration::from_millis(500),
            Duration::from_secs(20),
        )
        .expect("read back");
    assert_eq!(records.len(), 4);
    assert_eq!(records[3].value_str(), "after resume");
    println!("  done in {:?}", start.elapsed());
}

#[test]
fn kafka_sasl_ssl_with_client_cert_ecdsa() {
    let start = Instant::now();
    let pki = Pki::generate(KeyType::Ecdsa).expect("pki");
    let other = Pki::generate(KeyType::Ecdsa).expect("second, unrelated pki");
    let kafka = Kafka::start_with(KafkaOptions {
        sasl_ssl: Some(SaslSsl {
            pki: &pki,
            scram_sha512_users: users(&[("ferry", "scram-pw")]),
            plain_users: vec![],
            require_client_cert: true,
        }),
        ..Default::default()
    })
    .expect("kafka");
    println!("  kafka started in {:?}", start.elapsed());
    let rt = runtime();
    rt.block_on(kafka.create_topic("mtls", 1)).expect("topic");
    let with_cert = |pki: &Pki| {
        let mut cc = kafka.sasl_ssl_client_config("SCRAM-SHA-512", "ferry", "scram-pw");
        cc.set(
            "ssl.certificate.location",
            pki.client_cert().display().to_string(),
        )
        .set("ssl.key.location", pki.client_key().display().to_string());
        cc
    };
    produce(with_cert(&pki), "mtls", "k", "ecdsa client cert").expect("SCRAM + client cert");
    let records = kafka
        .read_all(
            "mtls",
            1,
            Duration::from_millis(500),
            Duration::from_secs(20),
        )
        .expect("read");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].value_str(), "ecdsa client cert");

    // Without a client certificate, or with one from another CA: the TLS handshake fails.
    expect_kafka_refused(
        "no client certificate",
        &kafka.sasl_ssl_client_config("SCRAM-SHA-512", "ferry", "scram-pw"),
        "SSL",
    );
    expect_kafka_refused(
        "client certificate from another CA",
        &with_cert(&other),
        "SSL",
    );
    println!("  done in {:?}", start.elapsed());
}

#[test]
fn plain_kafka_is_unchanged() {
    let kafka = Kafka::start().expect("kafka");
    let props = std::fs::read_to_string(kafka.dir().join("server.properties")).expect("props");
    let listeners = format!(
        "\nlisteners=PLAINTEXT://{},CONTROLLER://127.0.0.1:",
        kafka.bootstrap()
    );
    assert!(props.contains(&listeners), "{props}");
    assert!(!props.contains("SASL") && !props.contains("ssl"), "{props}");
    runtime()
        .block_on(kafka.create_topic("plain", 1))
        .expect("topic");
    produce(kafka.client_config(), "plain", "k", "v").expect("plain produce");
    assert_eq!(
        kafka
            .read_all("plain", 1, Duration::ZERO, Duration::from_secs(20))
            .expect("read")
            .len(),
        1
    );
}
