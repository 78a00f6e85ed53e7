//! What a single [`crate::Kafka`] and the nodes of a [`crate::KafkaCluster`] share: their
//! `server.properties`, the storage format, the JVM, and the admin helpers the tests use.

use std::fs;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use base64::Engine as _;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers as _, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::kafka::Kafka;
use crate::messages::Record;
use crate::process::{Placement, run_logged, spawn_tied};

/// The Kafka jars fetched by `e2e/install.sh`, checked to be complete.
pub(crate) fn libs() -> Result<PathBuf> {
    let libs = Kafka::libs_dir();
    if !libs.join(".complete").exists() {
        bail!(
            "Kafka jars not found in {}: run e2e/install.sh",
            libs.display()
        );
    }
    Ok(libs)
}

/// One listener of a node: `name://bind`, advertised as `name://advertise` when set.
pub(crate) struct Listener {
    pub name: &'static str,
    pub protocol: &'static str,
    pub bind: String,
    pub advertise: Option<String>,
}

/// The `server.properties` of a combined broker+controller node.
pub(crate) struct NodeProps<'a> {
    pub node_id: u32,
    /// `controller.quorum.voters`: `<id>@<host>:<port>,…`.
    pub voters: &'a str,
    pub listeners: &'a [Listener],
    pub data: &'a Path,
    /// The replication factor of new topics and of Kafka's internal topics.
    pub replication: u32,
    /// `min.insync.replicas` of new topics and of the transaction log.
    pub min_isr: u32,
    /// More lines, each ending with a newline.
    pub extra: &'a str,
}

impl NodeProps<'_> {
    pub fn render(&self) -> String {
        let join = |f: &dyn Fn(&Listener) -> Option<String>| {
            self.listeners
                .iter()
                .filter_map(f)
                .collect::<Vec<_>>()
                .join(",")
        };
        let listeners = join(&|l| Some(format!("{}://{}", l.name, l.bind)));
        let advertised = join(&|l| l.advertise.as_ref().map(|a| format!("{}://{a}", l.name)));
        let protocols = join(&|l| Some(format!("{}:{}", l.name, l.protocol)));
        let (rf, isr) = (self.replication, self.min_isr);
        format!(
            "process.roles=broker,controller\n\
             node.id={id}\n\
             controller.quorum.voters={voters}\n\
             listeners={listeners}\n\
             advertised.listeners={advertised}\n\
             controller.listener.names=CONTROLLER\n\
             inter.broker.listener.name=PLAINTEXT\n\
             listener.security.protocol.map={protocols}\n\
             log.dirs={data}\n\
             num.partitions=1\n\
             default.replication.factor={rf}\n\
             min.insync.replicas={isr}\n\
             offsets.topic.replication.factor={rf}\n\
             transaction.state.log.replication.factor={rf}\n\
             transaction.state.log.min.isr={isr}\n\
             share.coordinator.state.topic.replication.factor={rf}\n\
             share.coordinator.state.topic.min.isr={isr}\n\
             group.initial.rebalance.delay.ms=0\n\
             auto.create.topics.enable=false\n\
             metadata.max.idle.interval.ms=0\n\
             {extra}",
            id = self.node_id,
            voters = self.voters,
            data = self.data.display(),
            extra = self.extra,
        )
    }
}

/// A new cluster id, as `kafka-storage random-uuid` prints it (16 random bytes in unpadded
/// base64url), made here to save a JVM start.
pub(crate) fn new_cluster_id() -> Result<String> {
    let mut bytes = [0u8; 16];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("read /dev/urandom")?;
    // Kafka refuses ids starting with '-' (62 in base64url): keep the first 6 bits below 32.
    bytes[0] &= 0x7f;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// Runs a Kafka tool class from the jars, its output in `log`; fails with that output when it
/// exits non-zero or runs longer than `timeout`.
pub(crate) fn run_tool(
    libs: &Path,
    class: &str,
    args: &[String],
    log: &Path,
    timeout: Duration,
) -> Result<String> {
    let mut cmd = Command::new("java");
    // A short run: the C1 compiler and the serial collector start faster (2.0 s instead of
    // 2.7 s for `StorageTool random-uuid` here).
    cmd.args(["-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"])
        .args(class_data_archive(libs))
        .args(["-cp", &format!("{}/*", libs.display()), class])
        .args(args);
    run_logged(&mut cmd, &format!("{class} {args:?}"), log, timeout)
}

/// `kafka-storage format` of one node's data dir.
pub(crate) fn format_storage(
    libs: &Path,
    props: &Path,
    cluster_id: &str,
    extra_args: &[String],
) -> Result<()> {
    let mut args = vec![
        "format".to_owned(),
        "-t".to_owned(),
        cluster_id.to_owned(),
        "-c".to_owned(),
        props.display().to_string(),
    ];
    args.extend_from_slice(extra_args);
    let log = props.with_file_name("format.log");
    run_tool(
        libs,
        "kafka.tools.StorageTool",
        &args,
        &log,
        Duration::from_secs(60),
    )
    .context("kafka storage format")?;
    Ok(())
}

/// The JVM options of a single broker in the benchmarks: room for their load, and the full
/// JIT. The serial collector: on two cores G1's concurrent threads take CPU from everything
/// else a test runs. `e2e/kafka/cds.sh` makes its class-data archive with these options (a
/// JIT setting does not matter to it, the collector does).
pub(crate) const BROKER_JVM_PEAK: &[&str] = &["-Xms256m", "-Xmx1g", "-XX:+UseSerialGC"];

/// A test's single broker: the C1 compiler only, which a test's traffic does not miss. Measured
/// on one idle broker here: 2.2 CPU-s to start instead of 3.7, and with
/// `metadata.max.idle.interval.ms=0` (no no-op records in the metadata log every 500 ms)
/// 0.7 CPU-s per idle half minute instead of 1.4. A test run starts about a hundred.
pub(crate) const BROKER_JVM: &[&str] = &[
    "-Xms256m",
    "-Xmx1g",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
];

/// `-XX:SharedArchiveFile=` of the archive `e2e/kafka/cds.sh` made (`make deps`) next to the
/// jars, when it is there: the broker's classes mapped instead of parsed and verified anew,
/// which is most of a start's CPU. A JVM that cannot use it ignores it.
fn class_data_archive(libs: &Path) -> Option<String> {
    let archive = libs.parent()?.join("cds/kafka.jsa");
    archive
        .is_file()
        .then(|| format!("-XX:SharedArchiveFile={}", archive.display()))
}

/// Starts a Kafka JVM with `jvm` options on `props`, its output in `log`, tied to this thread
/// (see [`spawn_tied`]).
pub(crate) fn spawn_kafka(
    placement: &Placement,
    libs: &Path,
    props: &Path,
    log: &Path,
    jvm: &[&str],
) -> Result<Child> {
    let classpath = format!("{}/*", libs.display());
    spawn_tied(
        placement
            .command(Path::new("java"))
            .args(jvm)
            .args(class_data_archive(libs))
            .args(["-Djava.awt.headless=true", "-cp", &classpath, "kafka.Kafka"])
            .arg(props),
        log,
    )
}

/// Waits until a broker reachable with `cc` serves metadata listing at least `brokers`
/// brokers.
pub(crate) fn wait_for_brokers(cc: &ClientConfig, brokers: usize, timeout: Duration) -> Result<()> {
    let consumer: BaseConsumer = cc.create().context("metadata client")?;
    let start = Instant::now();
    loop {
        let got = consumer.fetch_metadata(None, Duration::from_secs(2));
        match got {
            Ok(md) if md.brokers().len() >= brokers => return Ok(()),
            other if start.elapsed() > timeout => bail!(
                "kafka not ready within {timeout:?} (want {brokers} brokers): {}",
                match other {
                    Ok(md) => format!("metadata lists {} brokers", md.brokers().len()),
                    Err(e) => e.to_string(),
                }
            ),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

pub(crate) async fn create_topic(
    cc: &ClientConfig,
    name: &str,
    partitions: i32,
    replication: i32,
) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = cc.create().context("admin client")?;
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(replication));
    let results = admin
        .create_topics(
            [&topic],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .with_context(|| format!("create topic {name}"))?;
    for r in results {
        r.map_err(|(t, e)| anyhow!("create topic {t}: {e}"))?;
    }
    Ok(())
}

/// See [`crate::Kafka::read_all`].
pub(crate) fn read_all(
    cc: &ClientConfig,
    topic: &str,
    expect: usize,
    settle: Duration,
    timeout: Duration,
) -> Result<Vec<Record>> {
    let consumer: BaseConsumer = cc
        .clone()
        .set("group.id", format!("ferry-test-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .create()
        .context("consumer")?;
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .with_context(|| format!("metadata of {topic}"))?;
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
    // A node of a cluster being down shows as transport failures, which librdkafka retries.
    let mut transport_error = None;
    while start.elapsed() < timeout {
        if records.len() >= expect && last_new.elapsed() >= settle {
            return Ok(records);
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                last_new = Instant::now();
                records.push(record(&m));
            }
            Some(Err(KafkaError::MessageConsumption(RDKafkaErrorCode::BrokerTransportFailure))) => {
                transport_error = Some(RDKafkaErrorCode::BrokerTransportFailure);
            }
            Some(Err(e)) => bail!("consume {topic}: {e}"),
            None => {}
        }
    }
    match transport_error {
        Some(e) if records.len() < expect => bail!(
            "consume {topic}: {} of {expect} records within {timeout:?}, and {e}",
            records.len()
        ),
        _ => Ok(records),
    }
}

fn record(m: &BorrowedMessage<'_>) -> Record {
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
    Record {
        topic: m.topic().to_owned(),
        partition: m.partition(),
        offset: m.offset(),
        key: m.key().map(<[u8]>::to_vec),
        value: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        headers,
        timestamp_ms: m.timestamp().to_millis(),
    }
}
