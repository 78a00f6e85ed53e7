//! Real Mosquitto and Apache Kafka processes for Ferry's integration tests, demo and benchmarks.
//!
//! Each broker runs on a free loopback port with its own data dir and is stopped when its value
//! is dropped — also when a test panics — and, through `PR_SET_PDEATHSIG`, when the process that
//! started it dies. `e2e/install.sh` installs Mosquitto and fetches Kafka's jars (cached).

use std::fs;
use std::io::Write as _;
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers as _, Message};
use rdkafka::{Offset, TopicPartitionList};

pub use rumqttc;

/// Mosquitto's flow-control settings used everywhere, printed by the tests and benchmarks:
/// 1000 unacknowledged messages in flight toward a client (as a production broker serving a
/// forwarder would be set; the default of 20 caps throughput at 20 per Kafka round trip), and
/// a queue large enough to hold every test's backlog for an offline or slow persistent session.
pub const MOSQUITTO_MAX_INFLIGHT: u32 = 1000;
pub const MOSQUITTO_MAX_QUEUED: u32 = 2_000_000;

pub fn cache_dir() -> PathBuf {
    std::env::var_os("FERRY_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
                .join(".cache/ferry")
        })
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for a test run).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_for_port(
    port: u16,
    timeout: Duration,
    child: &mut Child,
    what: &str,
    log: &Path,
) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "{what} exited with {status} before listening; log {}:\n{}",
                log.display(),
                tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "{what} did not listen on {port} within {timeout:?}; log {}:\n{}",
        log.display(),
        tail(log)
    )
}

fn tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Starts `cmd` so that it dies with the process that started it.
fn spawn_tied(cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = fs::File::create(log)?;
    cmd.stdout(out.try_clone()?)
        .stderr(out)
        .stdin(Stdio::null());
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().with_context(|| format!("cannot start {cmd:?}"))
}

fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let start = Instant::now();
    while start.elapsed() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A Mosquitto broker on a free loopback port, in-memory sessions.
pub struct Mosquitto {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

impl Mosquitto {
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("ferry-mosquitto-")
            .tempdir()?;
        let port = free_port()?;
        let conf = dir.path().join("mosquitto.conf");
        let mut f = fs::File::create(&conf)?;
        writeln!(f, "listener {port} 127.0.0.1")?;
        writeln!(f, "allow_anonymous true")?;
        writeln!(f, "persistence false")?;
        writeln!(f, "max_inflight_messages {MOSQUITTO_MAX_INFLIGHT}")?;
        writeln!(f, "max_queued_messages {MOSQUITTO_MAX_QUEUED}")?;
        writeln!(f, "max_queued_bytes 0")?;
        writeln!(f, "log_type error")?;
        writeln!(f, "log_type warning")?;
        let mut m = Self {
            child: None,
            port,
            dir,
        };
        m.resume()?;
        Ok(m)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the broker (SIGTERM). Sessions are in memory, so they are lost with it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            terminate(&mut c, Duration::from_secs(5));
        }
    }

    /// Starts it again on the same port.
    pub fn resume(&mut self) -> Result<()> {
        let bin = which("mosquitto")
            .ok_or_else(|| anyhow!("mosquitto not installed: run e2e/install.sh"))?;
        let log = self.dir.path().join("mosquitto.log");
        let mut child = spawn_tied(
            Command::new(bin)
                .arg("-c")
                .arg(self.dir.path().join("mosquitto.conf")),
            &log,
        )?;
        wait_for_port(
            self.port,
            Duration::from_secs(10),
            &mut child,
            "mosquitto",
            &log,
        )?;
        self.child = Some(child);
        Ok(())
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        self.stop();
    }
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/bin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A single-node Kafka (KRaft, broker+controller) on free loopback ports.
pub struct Kafka {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    libs: PathBuf,
}

pub const KAFKA_VERSION: &str = "4.1.1";

impl Kafka {
    pub fn libs_dir() -> PathBuf {
        cache_dir()
            .join(format!("kafka-{KAFKA_VERSION}"))
            .join("libs")
    }

    pub fn start() -> Result<Self> {
        let libs = Self::libs_dir();
        if !libs.join(".complete").exists() {
            bail!(
                "Kafka jars not found in {}: run e2e/install.sh",
                libs.display()
            );
        }
        let dir = tempfile::Builder::new().prefix("ferry-kafka-").tempdir()?;
        let port = free_port()?;
        let cport = free_port()?;
        let data = dir.path().join("data");
        let props = dir.path().join("server.properties");
        fs::write(
            &props,
            format!(
                "process.roles=broker,controller\n\
                 node.id=1\n\
                 controller.quorum.voters=1@127.0.0.1:{cport}\n\
                 listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}\n\
                 advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
                 controller.listener.names=CONTROLLER\n\
                 inter.broker.listener.name=PLAINTEXT\n\
                 listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
                 log.dirs={data}\n\
                 num.partitions=1\n\
                 offsets.topic.replication.factor=1\n\
                 transaction.state.log.replication.factor=1\n\
                 transaction.state.log.min.isr=1\n\
                 share.coordinator.state.topic.replication.factor=1\n\
                 share.coordinator.state.topic.min.isr=1\n\
                 group.initial.rebalance.delay.ms=0\n\
                 auto.create.topics.enable=false\n",
                data = data.display()
            ),
        )?;
        let classpath = format!("{}/*", libs.display());
        let uuid = Command::new("java")
            .args(["-cp", &classpath, "kafka.tools.StorageTool", "random-uuid"])
            .output()?;
        let uuid = String::from_utf8_lossy(&uuid.stdout).trim().to_owned();
        if uuid.is_empty() {
            bail!("kafka StorageTool random-uuid printed nothing");
        }
        let format = Command::new("java")
            .args([
                "-cp",
                &classpath,
                "kafka.tools.StorageTool",
                "format",
                "-t",
                &uuid,
                "-c",
            ])
            .arg(&props)
            .output()?;
        if !format.status.success() {
            bail!(
                "kafka storage format failed: {}",
                String::from_utf8_lossy(&format.stderr)
            );
        }
        let mut k = Self {
            child: None,
            port,
            dir,
            libs,
        };
        k.resume()?;
        Ok(k)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops the broker (SIGTERM, then SIGKILL after 20 s); its data stays for `resume`.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            terminate(&mut c, Duration::from_secs(20));
        }
    }

    /// Starts the broker again, same ports and data, and waits until it serves metadata.
    pub fn resume(&mut self) -> Result<()> {
        let log = self.dir.path().join("kafka.log");
        let classpath = format!("{}/*", self.libs.display());
        let mut child = spawn_tied(
            Command::new("java")
                .args([
                    "-Xms256m",
                    "-Xmx1g",
                    "-XX:+UseG1GC",
                    "-Djava.awt.headless=true",
                    "-cp",
                    &classpath,
                    "kafka.Kafka",
                ])
                .arg(self.dir.path().join("server.properties")),
            &log,
        )?;
        wait_for_port(
            self.port,
            Duration::from_secs(60),
            &mut child,
            "kafka",
            &log,
        )?;
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(60))
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let consumer: BaseConsumer = self.client_config().create()?;
        let start = Instant::now();
        loop {
            match consumer.fetch_metadata(None, Duration::from_secs(2)) {
                Ok(md) if !md.brokers().is_empty() => return Ok(()),
                other if start.elapsed() > timeout => bail!("kafka not ready: {:?}", other.err()),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    pub fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", self.bootstrap());
        cc
    }

    pub async fn create_topic(&self, name: &str, partitions: i32) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.client_config().create()?;
        let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        let results = admin
            .create_topics(
                [&topic],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?;
        for r in results {
            r.map_err(|(t, e)| anyhow!("create topic {t}: {e}"))?;
        }
        Ok(())
    }

    /// Reads a topic from the beginning until `expect` records arrived and then `settle` passed
    /// with nothing new (to catch extra duplicates), or `timeout` passed.
    pub fn read_all(
        &self,
        topic: &str,
        expect: usize,
        settle: Duration,
        timeout: Duration,
    ) -> Result<Vec<Record>> {
        let consumer: BaseConsumer = self
            .client_config()
            .set("group.id", format!("ferry-test-{}", std::process::id()))
            .set("enable.auto.commit", "false")
            .create()?;
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        let partitions = md
            .topics()
            .first()
            .map(|t| t.partitions().iter().map(|p| p.id()).collect::<Vec<_>>())
            .unwrap_or_default();
        if partitions.is_empty() {
            bail!("topic {topic} has no partitions");
        }
        let mut tpl = TopicPartitionList::new();
        for p in partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        let mut records = Vec::new();
        let start = Instant::now();
        let mut last_new = Instant::now();
        while start.elapsed() < timeout {
            if records.len() >= expect && last_new.elapsed() >= settle {
                break;
            }
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    last_new = Instant::now();
                    let headers = m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| {
                                    (
                                        h.key.to_owned(),
                                        h.value.map(<[u8]>::to_vec).unwrap_or_default(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    records.push(Record {
                        topic: m.topic().to_owned(),
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                        headers,
                    });
                }
                Some(Err(e)) => bail!("consume {topic}: {e}"),
                None => {}
            }
        }
        Ok(records)
    }
}

impl Drop for Kafka {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug, Clone)]
pub struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Record {
    pub fn key_str(&self) -> Option<&str> {
        self.key
            .as_deref()
            .and_then(|k| std::str::from_utf8(k).ok())
    }
    pub fn value_str(&self) -> &str {
        std::str::from_utf8(&self.value).unwrap_or("<binary>")
    }
}

/// Publishes messages over MQTT at `qos` and returns once the broker acknowledged every one
/// (QoS 1/2), so the caller knows the broker holds them.
pub async fn publish(
    port: u16,
    client_id: impl Into<String>,
    qos: rumqttc::QoS,
    messages: Vec<(String, Vec<u8>)>,
) -> Result<()> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet};
    let mut opts = MqttOptions::new(client_id, "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_inflight(200)
        .set_max_packet_size(1 << 24, 1 << 24);
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    let total = messages.len();
    let sender = tokio::spawn(async move {
        for (topic, payload) in messages {
            client.publish(topic, qos, false, payload).await?;
        }
        anyhow::Ok(client)
    });
    let mut done = 0usize;
    let mut sent = 0usize;
    let deadline = Instant::now() + Duration::from_secs(300);
    while done < total {
        if Instant::now() > deadline {
            bail!("publishing timed out after {done}/{total} acknowledged");
        }
        match tokio::time::timeout(Duration::from_secs(30), eventloop.poll()).await {
            Ok(Ok(Event::Incoming(Packet::PubAck(_) | Packet::PubComp(_)))) => done += 1,
            Ok(Ok(Event::Outgoing(Outgoing::Publish(_)))) if qos == rumqttc::QoS::AtMostOnce => {
                sent += 1;
                done = sent;
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!("publisher connection failed after {done}/{total}: {e}"),
            Err(_) => bail!("publisher stalled after {done}/{total}"),
        }
    }
    let client = sender.await??;
    client.disconnect().await?;
    // Let the DISCONNECT go out.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Ok(ev) = eventloop.poll().await {
            if matches!(ev, Event::Outgoing(Outgoing::Disconnect)) {
                break;
            }
        }
    })
    .await;
    Ok(())
}

/// A minimal HTTP/1.0 GET on loopback: (status, body). Enough for `/readyz` and `/metrics`.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::Read as _;
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split(' ').nth(1)?.parse().ok()?;
    Some((
        status,
        buf.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    ))
}
