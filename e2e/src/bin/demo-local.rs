//! `make demo` (first form): real Mosquitto and Kafka on loopback, `ferry-forwarder` on
//! `examples/forwarder.yaml`, sample messages in, records out, narrated for a newcomer.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use ferry_e2e::rumqttc::QoS;
use ferry_e2e::{Kafka, Mosquitto, Record, free_port, http_get};

fn say(text: &str) {
    println!("\n==> {text}");
}

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let forwarder_bin = forwarder_bin()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;

    let (mqtt, kafka) = start_brokers(&rt)?;
    let mut forwarder = start_forwarder(
        &forwarder_bin,
        &root.join("examples/forwarder.yaml"),
        &mqtt,
        &kafka,
    )?;
    publish_samples(&rt, &mqtt)?;
    let (telemetry, alarms) = read_back(&kafka)?;
    show_metrics(forwarder.http_port);
    show_status(forwarder.http_port);

    let status = stop_forwarder(&mut forwarder)?;
    drop(kafka);
    drop(mqtt);
    println!(
        "    brokers stopped; forwarder log: {}",
        forwarder.log_path.display()
    );

    explain(telemetry.len(), alarms.len());
    if telemetry.len() != 9 || alarms.len() != 1 || !status.success() {
        bail!("the demo did not see what it expected");
    }
    Ok(())
}

/// `make demo` builds the forwarder into the same directory as this demo.
fn forwarder_bin() -> Result<PathBuf> {
    std::env::current_exe()?
        .parent()
        .map(|d| d.join("ferry-forwarder"))
        .filter(|p| p.is_file())
        .context("ferry-forwarder binary not found next to the demo (run `make demo`)")
}

/// Mosquitto and Kafka on loopback, with the Kafka topics of `examples/forwarder.yaml`.
fn start_brokers(rt: &tokio::runtime::Runtime) -> Result<(Mosquitto, Kafka)> {
    say("Starting a real Mosquitto and a real Apache Kafka (KRaft) on free loopback ports");
    let mqtt = Mosquitto::start()?;
    let kafka = Kafka::start()?;
    println!("    mosquitto  127.0.0.1:{}", mqtt.port());
    println!(
        "    kafka      {}  (Apache Kafka {})",
        kafka.bootstrap(),
        ferry_e2e::KAFKA_VERSION
    );
    rt.block_on(kafka.create_topic("telemetry", 3))?;
    rt.block_on(kafka.create_topic("alarms", 1))?;
    println!("    created Kafka topics: telemetry (3 partitions), alarms (1 partition)");
    Ok((mqtt, kafka))
}

/// The forwarder process of the demo, its HTTP port and where its output goes.
struct Forwarder {
    child: Child,
    http_port: u16,
    log_path: PathBuf,
}

/// `ferry-forwarder --config <config>` pointed at the brokers by environment variables (as the
/// example config expects), its output in a log file; returns once it is ready.
fn start_forwarder(
    bin: &Path,
    config: &Path,
    mqtt: &Mosquitto,
    kafka: &Kafka,
) -> Result<Forwarder> {
    let http_port = free_port()?;
    say(&format!(
        "Running ferry-forwarder --config {}",
        config.display()
    ));
    println!(
        "    with MQTT_PORT={} KAFKA_BOOTSTRAP={} FERRY_HTTP_LISTEN=127.0.0.1:{http_port}",
        mqtt.port(),
        kafka.bootstrap()
    );
    let log_path =
        std::env::temp_dir().join(format!("ferry-demo-forwarder-{}.log", std::process::id()));
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new(bin)
        .arg("--config")
        .arg(config)
        .env("MQTT_PORT", mqtt.port().to_string())
        .env("KAFKA_BOOTSTRAP", kafka.bootstrap())
        .env("FERRY_HTTP_LISTEN", format!("127.0.0.1:{http_port}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let mut forwarder = Forwarder {
        child,
        http_port,
        log_path,
    };
    wait_ready(&mut forwarder)?;
    Ok(forwarder)
}

/// Until `/readyz` answers 200; a forwarder that exits or is not ready within 30 s is killed
/// and its log shown.
fn wait_ready(forwarder: &mut Forwarder) -> Result<()> {
    let start = Instant::now();
    while http_get(forwarder.http_port, "/readyz")
        .ok()
        .map(|(s, _)| s)
        != Some(200)
    {
        if start.elapsed() > Duration::from_secs(30) || forwarder.child.try_wait()?.is_some() {
            let _ = forwarder.child.kill();
            bail!(
                "forwarder did not become ready; its log:\n{}",
                std::fs::read_to_string(&forwarder.log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "    ready after {:.1} s: GET /readyz -> 200 (subscribed to MQTT, Kafka reachable)",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Three readings per plant, one alarm, and a message no rule subscribes to, at QoS 1.
fn publish_samples(rt: &tokio::runtime::Runtime, mqtt: &Mosquitto) -> Result<()> {
    say("Publishing sample MQTT messages (QoS 1)");
    let mut messages = Vec::new();
    for plant in 1..=3 {
        for i in 0..3 {
            let topic = format!("plant/{plant}/telemetry/temperature");
            let payload = format!(
                r#"{{"celsius":{:.1},"n":{i}}}"#,
                20.0 + plant as f64 + i as f64 / 10.0
            );
            println!("    {topic:<36} {payload}");
            messages.push((topic, payload.into_bytes()));
        }
    }
    let alarm = (
        "plant/2/alarm".to_string(),
        br#"{"code":"OVERHEAT"}"#.to_vec(),
    );
    println!("    {:<36} {}", alarm.0, String::from_utf8_lossy(&alarm.1));
    messages.push(alarm);
    messages.push((
        "office/coffee".into(),
        b"not forwarded: no rule subscribes to it".to_vec(),
    ));
    println!(
        "    {:<36} not forwarded: no rule subscribes to it",
        "office/coffee"
    );
    rt.block_on(ferry_e2e::publish(
        mqtt.port(),
        "ferry-demo-publisher",
        QoS::AtLeastOnce,
        messages,
    ))
}

/// The telemetry and alarm records from Kafka, printed; the caller checks their counts.
fn read_back(kafka: &Kafka) -> Result<(Vec<Record>, Vec<Record>)> {
    say("Reading back from Kafka");
    let telemetry = kafka.read_all(
        "telemetry",
        9,
        Duration::from_millis(500),
        Duration::from_secs(30),
    )?;
    let alarms = kafka.read_all(
        "alarms",
        1,
        Duration::from_millis(500),
        Duration::from_secs(30),
    )?;
    for r in telemetry.iter().chain(&alarms) {
        println!(
            "    {}[{}]@{:<3} key={:<32} value={}",
            r.topic,
            r.partition,
            r.offset,
            r.key_str().unwrap_or("<none>"),
            r.value_str()
        );
    }
    Ok((telemetry, alarms))
}

/// The forwarder's per-rule and MQTT counters from `/metrics` (best effort: the demo's
/// verdict rests on the records read back).
fn show_metrics(http_port: u16) {
    say("The forwarder's own view (GET /metrics, per rule)");
    if let Ok((_, body)) = http_get(http_port, "/metrics") {
        for line in body.lines().filter(|l| {
            l.starts_with("ferry_rule_forwarded")
                || l.starts_with("ferry_mqtt_acked")
                || l.starts_with("ferry_mqtt_unmatched")
        }) {
            println!("    {line}");
        }
    }
}

/// `/status` as a table, one row per rule (best effort, like [`show_metrics`]).
fn show_status(http_port: u16) {
    say("Per rule, as the operator will read it (GET /status, JSON; summarized)");
    if let Ok((_, body)) = http_get(http_port, "/status")
        && let Ok(status) = serde_json::from_str::<serde_json::Value>(&body)
    {
        println!(
            "    {:<18} {:>8} {:>9} {:>6} {:>13} {:>6}  last forwarded",
            "RULE", "RECEIVED", "FORWARDED", "ACKED", "DEAD-LETTERED", "FAILED"
        );
        for r in status["rules"].as_array().into_iter().flatten() {
            println!(
                "    {:<18} {:>8} {:>9} {:>6} {:>13} {:>6}  {}",
                r["name"].as_str().unwrap_or_default(),
                r["received"].as_u64().unwrap_or(0),
                r["forwarded"].as_u64().unwrap_or(0),
                r["acked"].as_u64().unwrap_or(0),
                r["deadLettered"].as_u64().unwrap_or(0),
                r["failed"].as_u64().unwrap_or(0),
                r["lastForwardedAt"].as_str().unwrap_or("-")
            );
        }
    }
}

/// SIGTERM, the graceful stop: the forwarder drains what is in flight, acks it and disconnects.
fn stop_forwarder(forwarder: &mut Forwarder) -> Result<ExitStatus> {
    say("Stopping: SIGTERM to the forwarder (drains in-flight messages, acks, disconnects)");
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(forwarder.child.id() as i32, libc::SIGTERM);
    }
    let status = forwarder.child.wait()?;
    println!("    ferry-forwarder exited with {status}");
    Ok(status)
}

/// What the steps above showed, in words, with the counts read back.
fn explain(telemetry: usize, alarms: usize) {
    say("What happened");
    println!(
        "    {} telemetry records and {} alarm record reached Kafka. Each telemetry record is keyed by its MQTT\n    \
         topic, so one sensor's readings stay in one partition, in order. The alarm was wrapped as JSON with\n    \
         its MQTT topic and keyed by plant id. Every message was acknowledged to MQTT only after Kafka\n    \
         confirmed it. No rule subscribes to office/coffee, so the broker never sent it to the forwarder.\n\n    \
         Next: `make test` runs every test against real brokers; docs/configuration.md has the configuration reference.",
        telemetry, alarms
    );
}
