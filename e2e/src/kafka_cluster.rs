//! A Kafka cluster of combined broker+controller nodes (KRaft) on loopback, for failover
//! tests: a node can be killed and restarted while clients keep working with the others.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::metadata::{Metadata, MetadataPartition, MetadataTopic};

use crate::fault_proxy::FaultProxy;
use crate::kafka_node::{self, Listener, NodeProps};
use crate::messages::Record;
use crate::process::{Placement, free_port, terminate, wait_for_port};

/// Heartbeats every second and a 5 s session (defaults 2 s and 9 s): a killed broker is fenced,
/// and its partitions get new leaders, within about 5 s, without fencing live brokers that a
/// loaded 2-core machine slows down.
const FAILOVER_PROPS: &str = "broker.heartbeat.interval.ms=1000\nbroker.session.timeout.ms=5000\n";

/// Each node's JVM options: three JVMs start at once on two cores, so a smaller heap, the C1
/// compiler only and the serial collector, which cut the cluster's start from 25 s to 16 s
/// here (at the cost of peak throughput, which failover tests do not need).
const NODE_JVM: &[&str] = &[
    "-Xms128m",
    "-Xmx512m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
];

/// How long a start or restart may take: three JVMs starting at once on two cores.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// A KRaft cluster of `n` combined broker+controller nodes (ids `1..=n`) on 127.0.0.1, each
/// with its own `PLAINTEXT` and `CONTROLLER` ports and data dir, all voters of the controller
/// quorum and formatted with the same cluster id.
///
/// New topics and Kafka's internal topics get a replication factor of `min(n, 3)` and
/// `min.insync.replicas` one less (at least 1): with 3 nodes, RF 3 and min ISR 2, so an
/// `acks=all` producer keeps working while one node is down. Topics are never created
/// automatically. Dropping the cluster kills every node (SIGKILL: the data is thrown away).
///
/// As with [`crate::Kafka`], the JVMs die with the thread that started them: start, kill and
/// restart nodes from the test's own thread.
pub struct KafkaCluster {
    nodes: Vec<Node>,
    replication: u32,
    libs: PathBuf,
    dir: tempfile::TempDir,
}

/// How to start a [`KafkaCluster`]. `ClusterOptions::default()` is what
/// [`KafkaCluster::start`] runs.
#[derive(Debug, Default, Clone)]
pub struct ClusterOptions {
    /// Puts every node behind a [`FaultProxy`] of its own for clients, as
    /// [`crate::KafkaOptions::proxy`] does for a single broker: each node gets a plaintext
    /// `PROXIED` listener advertising its proxy's address. A client bootstrapping on
    /// [`KafkaCluster::proxied_bootstrap`] reaches each node only through that node's proxy
    /// ([`KafkaCluster::proxy`]), so a test can cut it off from one node (the leader, say)
    /// while the nodes keep replicating to each other directly.
    pub proxies: bool,
}

struct Node {
    id: i32,
    port: u16,
    cport: u16,
    /// The `PROXIED` listener's port and the proxy in front of it.
    proxied: Option<(u16, FaultProxy)>,
    dir: PathBuf,
    child: Option<Child>,
}

impl Node {
    fn props(&self) -> PathBuf {
        self.dir.join("server.properties")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("kafka.log")
    }
}

impl KafkaCluster {
    /// Starts `nodes` nodes (1 to 9) and waits until every broker is registered and serves
    /// metadata.
    pub fn start(nodes: usize) -> Result<Self> {
        Self::start_with(nodes, ClusterOptions::default())
    }

    /// [`KafkaCluster::start`] set up as `options` say.
    pub fn start_with(nodes: usize, options: ClusterOptions) -> Result<Self> {
        if !(1..=9).contains(&nodes) {
            bail!("a KafkaCluster has 1 to 9 nodes, not {nodes}");
        }
        let libs = kafka_node::libs()?;
        let dir = tempfile::Builder::new()
            .prefix("ferry-kafka-cluster-")
            .tempdir()?;
        let ports = (0..nodes)
            .map(|_| Ok((free_port()?, free_port()?)))
            .collect::<Result<Vec<_>>>()?;
        let voters = ports
            .iter()
            .zip(1..)
            .map(|((_, cport), id)| format!("{id}@127.0.0.1:{cport}"))
            .collect::<Vec<_>>()
            .join(",");
        let replication = nodes.min(3) as u32;
        let mut list = Vec::new();
        for ((port, cport), id) in ports.into_iter().zip(1..) {
            let proxied = match options.proxies {
                true => Some((free_port()?, FaultProxy::start_without_upstream()?)),
                false => None,
            };
            let node = Node {
                id,
                port,
                cport,
                proxied,
                dir: dir.path().join(format!("node-{id}")),
                child: None,
            };
            fs::create_dir_all(&node.dir)?;
            write_props(&node, &voters, replication)?;
            list.push(node);
        }
        format_all(&libs, &list)?;
        let mut cluster = Self {
            nodes: list,
            replication,
            libs,
            dir,
        };
        // Every JVM first, then the waits: the voters need each other to elect a controller.
        for id in cluster.node_ids() {
            cluster.spawn(id)?;
        }
        for id in cluster.node_ids() {
            cluster.wait_listening(id)?;
        }
        kafka_node::wait_for_brokers(&cluster.client_config(), nodes, START_TIMEOUT)?;
        Ok(cluster)
    }

    /// The node ids, `1..=n`.
    pub fn node_ids(&self) -> Vec<i32> {
        self.nodes.iter().map(|n| n.id).collect()
    }

    /// Every node's `PLAINTEXT` address, comma-separated.
    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", self.bootstrap());
        cc
    }

    /// Every node's proxy address, comma-separated: the bootstrap of a cluster started with
    /// [`ClusterOptions::proxies`], through the proxies.
    pub fn proxied_bootstrap(&self) -> Result<String> {
        let proxies = self
            .nodes
            .iter()
            .map(|n| self.proxy(n.id).map(|p| p.addr().to_string()))
            .collect::<Result<Vec<_>>>()?;
        Ok(proxies.join(","))
    }

    /// A client configuration that reaches the nodes only through their proxies.
    pub fn proxied_client_config(&self) -> Result<ClientConfig> {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", self.proxied_bootstrap()?);
        Ok(cc)
    }

    /// The proxy in front of the node (with [`ClusterOptions::proxies`]).
    pub fn proxy(&self, node: i32) -> Result<&FaultProxy> {
        match &self.node(node)?.proxied {
            Some((_, proxy)) => Ok(proxy),
            None => bail!("kafka node {node} has no proxy: start with ClusterOptions::proxies"),
        }
    }

    /// Creates a topic with the cluster's replication factor (`min(n, 3)`) and waits until every
    /// partition has a leader and all its replicas in sync (so a test can read
    /// [`KafkaCluster::leader_of`] right away).
    pub async fn create_topic(&self, name: &str, partitions: i32) -> Result<()> {
        let rf = self.replication as i32;
        kafka_node::create_topic(&self.client_config(), name, partitions, rf).await?;
        self.wait_for_full_isr(name, Duration::from_secs(30))
    }

    /// Waits until every partition of `topic` has a leader and [`KafkaCluster::replication`]
    /// in-sync replicas: after a [`KafkaCluster::restart`], when the node caught up.
    pub fn wait_for_full_isr(&self, topic: &str, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            let lagging = self.metadata(topic).and_then(|md| {
                let t = find_topic(&md, topic)?;
                Ok(t.partitions()
                    .iter()
                    .filter(|p| p.leader() < 0 || p.isr().len() < self.replication as usize)
                    .map(|p| format!("{}: leader {} isr {:?}", p.id(), p.leader(), p.isr()))
                    .collect::<Vec<_>>())
            });
            match lagging {
                Ok(l) if l.is_empty() => return Ok(()),
                _ if start.elapsed() > timeout => {
                    bail!("{topic} not fully in sync within {timeout:?}: {lagging:?}")
                }
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// The id of the node leading `partition` of `topic`, as the metadata says now (it lags a
    /// killed leader by up to the 5 s broker session).
    pub fn leader_of(&self, topic: &str, partition: i32) -> Result<i32> {
        let md = self.metadata(topic)?;
        let leader = find_partition(&md, topic, partition)?.leader();
        if leader < 0 {
            bail!("{topic}/{partition} has no leader");
        }
        Ok(leader)
    }

    /// The in-sync replicas of `partition` of `topic`, as the metadata says now.
    pub fn isr_of(&self, topic: &str, partition: i32) -> Result<Vec<i32>> {
        let md = self.metadata(topic)?;
        Ok(find_partition(&md, topic, partition)?.isr().to_vec())
    }

    /// The node that is the active controller (the leader of the KRaft quorum), as Kafka's
    /// `kafka-metadata-quorum describe --status` says. Killing it costs a controller election
    /// on top of a broker's failover. Takes a JVM start (2-3 s).
    pub fn active_controller(&self) -> Result<i32> {
        let args = [
            "--bootstrap-server",
            &self.bootstrap(),
            "describe",
            "--status",
        ];
        let out = kafka_node::run_tool(
            &self.libs,
            "org.apache.kafka.tools.MetadataQuorumCommand",
            &args.map(String::from),
            &self.dir.path().join("quorum.log"),
            Duration::from_secs(60),
        )?;
        out.lines()
            .find_map(|l| l.strip_prefix("LeaderId:"))
            .and_then(|id| id.trim().parse().ok())
            .ok_or_else(|| anyhow!("no LeaderId in the quorum status:\n{out}"))
    }

    /// Waits until `partition` of `topic` is led by a node other than `old`; returns it.
    pub fn wait_for_new_leader(
        &self,
        topic: &str,
        partition: i32,
        old: i32,
        timeout: Duration,
    ) -> Result<i32> {
        let start = Instant::now();
        loop {
            let now = self.leader_of(topic, partition);
            match now {
                Ok(leader) if leader != old => return Ok(leader),
                _ if start.elapsed() > timeout => bail!(
                    "{topic}/{partition} still without a leader other than {old} after \
                     {timeout:?}: {now:?}"
                ),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// Kills the node with SIGKILL, as a crash or a power loss would, and reaps it. Does
    /// nothing to a node that is not running.
    pub fn kill(&mut self, node: i32) -> Result<()> {
        if let Some(mut child) = self.node_mut(node)?.child.take() {
            child
                .kill()
                .with_context(|| format!("SIGKILL kafka node {node}"))?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts a killed node again, same ports and data, and waits until it is
    /// registered again (listed in the metadata). It catches up on its replicas afterwards:
    /// see [`KafkaCluster::isr_of`].
    pub fn restart(&mut self, node: i32) -> Result<()> {
        if self.node(node)?.child.is_some() {
            bail!("kafka node {node} is running: kill or stop it first");
        }
        self.spawn(node)?;
        self.wait_listening(node)?;
        self.wait_registered(node, START_TIMEOUT)
    }

    /// Whether the node's JVM runs (it may still be starting).
    pub fn is_running(&self, node: i32) -> bool {
        self.node(node).is_ok_and(|n| n.child.is_some())
    }

    /// Reads a topic from the beginning, as [`crate::Kafka::read_all`] does.
    pub fn read_all(
        &self,
        topic: &str,
        expect: usize,
        settle: Duration,
        timeout: Duration,
    ) -> Result<Vec<Record>> {
        kafka_node::read_all(&self.client_config(), topic, expect, settle, timeout)
    }

    fn node(&self, id: i32) -> Result<&Node> {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .ok_or_else(|| anyhow!("no kafka node {id} (nodes are 1..={})", self.nodes.len()))
    }

    fn node_mut(&mut self, id: i32) -> Result<&mut Node> {
        let count = self.nodes.len();
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .ok_or_else(|| anyhow!("no kafka node {id} (nodes are 1..={count})"))
    }

    fn spawn(&mut self, id: i32) -> Result<()> {
        let libs = self.libs.clone();
        let node = self.node_mut(id)?;
        let child = kafka_node::spawn_kafka(
            &Placement::default(),
            &libs,
            &node.props(),
            &node.log(),
            NODE_JVM,
        )?;
        node.child = Some(child);
        Ok(())
    }

    /// Waits until the node listens on all its ports; kills it if it cannot.
    fn wait_listening(&mut self, id: i32) -> Result<()> {
        let node = self.node_mut(id)?;
        let proxied = node.proxied.as_ref().map(|(port, _)| *port);
        let ports = [Some(node.port), Some(node.cport), proxied];
        let log = node.log();
        let Some(child) = node.child.as_mut() else {
            bail!("kafka node {id} is not running");
        };
        for port in ports.into_iter().flatten() {
            let what = format!("kafka node {id}");
            if let Err(e) = wait_for_port(port, START_TIMEOUT, child, &what, &log) {
                terminate(child, Duration::from_secs(5));
                node.child = None;
                return Err(e);
            }
        }
        Ok(())
    }

    fn wait_registered(&self, id: i32, timeout: Duration) -> Result<()> {
        let consumer: BaseConsumer = self.client_config().create()?;
        let start = Instant::now();
        loop {
            let md = consumer.fetch_metadata(None, Duration::from_secs(2));
            match md {
                Ok(md) if md.brokers().iter().any(|b| b.id() == id) => return Ok(()),
                _ if start.elapsed() > timeout => bail!(
                    "kafka node {id} not registered within {timeout:?}; log {}",
                    self.node(id)?.log().display()
                ),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    fn metadata(&self, topic: &str) -> Result<Metadata> {
        let consumer: BaseConsumer = self.client_config().create()?;
        consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .with_context(|| format!("metadata of {topic}"))
    }
}

impl Drop for KafkaCluster {
    fn drop(&mut self) {
        // SIGKILL rather than a controlled shutdown: the data is thrown away, and the last
        // nodes would wait for a controller quorum that is already gone.
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

fn write_props(node: &Node, voters: &str, replication: u32) -> Result<()> {
    let mut listeners = vec![
        Listener {
            name: "PLAINTEXT",
            protocol: "PLAINTEXT",
            bind: format!("127.0.0.1:{}", node.port),
            advertise: Some(format!("127.0.0.1:{}", node.port)),
        },
        Listener {
            name: "CONTROLLER",
            protocol: "PLAINTEXT",
            bind: format!("127.0.0.1:{}", node.cport),
            advertise: None,
        },
    ];
    if let Some((port, proxy)) = &node.proxied {
        listeners.push(Listener {
            name: "PROXIED",
            protocol: "PLAINTEXT",
            bind: format!("127.0.0.1:{port}"),
            advertise: Some(proxy.addr().to_string()),
        });
        proxy.set_upstream(SocketAddr::from((Ipv4Addr::LOCALHOST, *port)));
    }
    let props = NodeProps {
        node_id: node.id as u32,
        voters,
        listeners: &listeners,
        data: &node.dir.join("data"),
        replication,
        min_isr: replication.saturating_sub(1).max(1),
        extra: FAILOVER_PROPS,
    };
    let path = node.props();
    fs::write(&path, props.render()).with_context(|| format!("write {}", path.display()))
}

/// Formats every node's storage with one cluster id, in parallel (each is a JVM start).
fn format_all(libs: &Path, nodes: &[Node]) -> Result<()> {
    let cluster_id = kafka_node::new_cluster_id()?;
    std::thread::scope(|s| {
        let jobs: Vec<_> = nodes
            .iter()
            .map(|n| {
                let (props, id) = (n.props(), &cluster_id);
                s.spawn(move || kafka_node::format_storage(libs, &props, id, &[]))
            })
            .collect();
        for (job, node) in jobs.into_iter().zip(nodes) {
            job.join()
                .map_err(|_| anyhow!("formatting kafka node {} panicked", node.id))?
                .with_context(|| format!("kafka node {}", node.id))?;
        }
        Ok(())
    })
}

fn find_topic<'a>(md: &'a Metadata, topic: &str) -> Result<&'a MetadataTopic> {
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| anyhow!("no topic {topic} in the metadata"))?;
    if let Some(e) = t.error() {
        bail!("metadata of {topic}: {e:?}");
    }
    Ok(t)
}

fn find_partition<'a>(
    md: &'a Metadata,
    topic: &str,
    partition: i32,
) -> Result<&'a MetadataPartition> {
    find_topic(md, topic)?
        .partitions()
        .iter()
        .find(|p| p.id() == partition)
        .ok_or_else(|| anyhow!("no partition {partition} in topic {topic}"))
}
