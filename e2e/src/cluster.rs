//! Driving the single-node cluster of `e2e/cluster/up.sh` from Rust: the full-path test and
//! `make demo` (`src/bin/demo-cluster.rs`) share these helpers.
//!
//! [`Cluster`] is a guard: `up.sh` brings the cluster up, and the cluster is torn down
//! (`down.sh`) when the value is dropped unless [`Cluster::down`] already ran — also on error
//! or panic, then keeping the component logs and printing their path. Brokers are placed in the
//! cluster's network namespace on the node address ([`Cluster::placement`]), so pods and this
//! process both reach them.

use std::fs;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail, ensure};

use crate::kafka::{Kafka, KafkaOptions};
use crate::kube::Kubectl;
use crate::messages::disconnect;
use crate::mosquitto::{Mosquitto, MosquittoOptions};
use crate::pki::{KeyType, Pki};
use crate::process::{Placement, cache_dir, run_logged};
use crate::schema_registry::{SchemaRegistry, SchemaRegistryOptions, SchemaType};

pub const KUBECTL: &str = "/usr/bin/kubectl";
/// The images' tag (`e2e/images/build.sh`): the workspace version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub fn e2e_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn repo_dir() -> PathBuf {
    e2e_dir().parent().expect("repo root").to_path_buf()
}

pub fn helm_bin() -> PathBuf {
    cache_dir().join("tools/bin/helm")
}

/// Where `e2e/images/build.sh` writes this checkout's images: `$FERRY_IMAGES_DIR`, else
/// `images/` in the target dir (`$CARGO_TARGET_DIR`, else cargo's default `<repo>/target`).
/// Never a directory other checkouts write: their images would be another build's binaries.
pub fn images_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERRY_IMAGES_DIR") {
        return PathBuf::from(dir);
    }
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_dir().join("target"))
        .join("images")
}

/// `<pid>-<nanoseconds>`: unique file names.
pub fn unique() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    )
}

/// Fails unless this process runs as root (network namespaces, mounts, `nsenter`).
pub fn ensure_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "{what} needs root (network namespaces, mounts); run it as root"
    );
    Ok(())
}

/// The `ferry-operator` and `ferry-forwarder` OCI tarballs of `e2e/images/build.sh`; fails with
/// how to build them when one is missing.
pub fn ferry_images() -> Result<Vec<PathBuf>> {
    let images: Vec<PathBuf> = ["ferry-operator", "ferry-forwarder"]
        .iter()
        .map(|n| images_dir().join(format!("{n}-{VERSION}.oci.tar")))
        .collect();
    for image in &images {
        ensure!(
            image.is_file(),
            "{} is missing: build the images with `bash e2e/images/build.sh` (release build of \
             ferry-operator and ferry-forwarder, packed as OCI tarballs into {})",
            image.display(),
            images_dir().display()
        );
    }
    Ok(images)
}

/// Fails with how to build helm when it is missing.
pub fn ensure_helm() -> Result<()> {
    ensure!(
        helm_bin().is_file(),
        "{} is missing: run `bash e2e/tools/build.sh`",
        helm_bin().display()
    );
    Ok(())
}

/// In a private cluster's temp dir: the pid of the test process it belongs to.
const OWNER_FILE: &str = "owner.pid";

/// Tears down the private clusters named `name` whose test process is gone. A test killed by
/// nextest's timeout or a SIGKILL never runs its drop, and its cluster (a control plane,
/// containerd, the kubelet and their pods) would run on and take the CPU of every later test.
/// A pid that is alive, even reused by another process, keeps its cluster. Best effort: what
/// `down.sh` cannot remove is said and left.
fn reap_orphans(name: &str) {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    let prefix = format!("{name}-");
    for entry in entries.flatten() {
        let tmp = entry.path();
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let owner = fs::read_to_string(tmp.join(OWNER_FILE)).ok();
        let Some(pid) = owner.and_then(|o| o.trim().parse::<u32>().ok()) else {
            continue;
        };
        // Without its cluster.env, down.sh would take the default cluster's settings.
        if Path::new(&format!("/proc/{pid}")).exists() || !tmp.join("state/cluster.env").exists() {
            continue;
        }
        eprintln!(
            "tearing down the cluster in {} left by a test that is gone (pid {pid})",
            tmp.display()
        );
        let down = Command::new("bash")
            .arg(e2e_dir().join("cluster").join("down.sh"))
            .env("FERRY_CLUSTER_DIR", tmp.join("state"))
            .output();
        match down {
            Ok(out) if out.status.success() => {
                if let Err(e) = fs::remove_dir_all(&tmp) {
                    eprintln!("could not remove {}: {e}", tmp.display());
                }
            }
            Ok(out) => eprintln!(
                "down.sh could not tear down {}:\n{}",
                tmp.display(),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("down.sh for {}: {e}", tmp.display()),
        }
    }
}

/// A cluster of `e2e/cluster/up.sh` with its settings (state dir, netns, subnets); torn down
/// with `down.sh` on drop unless [`Cluster::down`] ran.
pub struct Cluster {
    tmp: tempfile::TempDir,
    dir: PathBuf,
    netns: String,
    net: String,
    pod_net: String,
    down_ran: bool,
    /// Prefix of the dir the component logs are kept in when the drop tears the cluster down.
    logs_prefix: String,
}

impl Kubectl for Cluster {
    fn run_kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl(args)
    }
}

impl Cluster {
    /// Private settings (state dir in a temp dir, netns `ferry-<tag><pid>`, subnets derived from
    /// the pid), so that it runs next to any other cluster. Nothing is started yet.
    pub fn private(name: &str, tag: &str) -> Result<Self> {
        reap_orphans(name);
        let tmp = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir()?;
        let id = std::process::id();
        fs::write(tmp.path().join(OWNER_FILE), id.to_string())?;
        let k = 20 + id % 200;
        Ok(Self {
            dir: tmp.path().join("state"),
            tmp,
            netns: format!("ferry-{tag}{}", id % 100_000),
            net: format!("10.81.{k}"),
            pod_net: format!("10.82.{k}"),
            down_ran: false,
            logs_prefix: format!("{name}-logs"),
        })
    }

    /// The same cluster on other subnets (`<net>.<k>.0/24` for the node, `<pod>.<k>.0/24` for the
    /// pods): for a test that may run next to another private cluster.
    pub fn with_subnets(mut self, net: &str, pod_net: &str) -> Self {
        let k = 20 + std::process::id() % 200;
        self.net = format!("{net}.{k}");
        self.pod_net = format!("{pod_net}.{k}");
        self
    }

    /// up.sh's default settings: state dir `$FERRY_CLUSTER_DIR` (default `/tmp/ferry-cluster`),
    /// netns `ferry`, node 10.77.0.2, pods 10.78.0.0/24 — the cluster `e2e/cluster/README.md`
    /// describes, with its kubeconfig at a stable path. Nothing is started yet.
    pub fn default_settings(name: &str) -> Result<Self> {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir()?;
        let dir = std::env::var_os("FERRY_CLUSTER_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/tmp/ferry-cluster"));
        Ok(Self {
            tmp,
            dir,
            netns: "ferry".into(),
            net: "10.77.0".into(),
            pod_net: "10.78.0".into(),
            down_ran: false,
            logs_prefix: format!("{name}-logs"),
        })
    }

    /// What of a cluster with these settings exists already: its state (`cluster.env`) or its
    /// network namespace. `None` when there is nothing.
    pub fn existing(&self) -> Option<String> {
        let env = self.dir.join("cluster.env");
        let ns = Path::new("/var/run/netns").join(&self.netns);
        match (env.exists(), ns.exists()) {
            (false, false) => None,
            (true, _) => Some(format!("state {}", env.display())),
            (false, true) => Some(format!("network namespace {}", ns.display())),
        }
    }

    /// Marks the cluster as not ours: the drop will not tear it down.
    pub fn disarm(&mut self) {
        self.down_ran = true;
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn netns(&self) -> &str {
        &self.netns
    }

    pub fn pod_net(&self) -> &str {
        &self.pod_net
    }

    pub fn node_ip(&self) -> IpAddr {
        format!("{}.2", self.net).parse().expect("node IP")
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// containerd's registry hosts directory (`config_path` in `up.sh`): a
    /// `<host:port>/hosts.toml` there applies from the next pull on.
    pub fn registry_hosts_dir(&self) -> PathBuf {
        self.dir.join("containerd/certs.d")
    }

    /// Brokers started with this placement run inside the cluster's netns on the node address.
    pub fn placement(&self) -> Placement {
        Placement {
            netns: Some(self.netns.clone()),
            bind: Some(self.node_ip()),
        }
    }

    fn settings(&self, cmd: &mut Command) {
        cmd.env("FERRY_CLUSTER_DIR", &self.dir)
            .env("FERRY_CLUSTER_NETNS", &self.netns)
            .env("FERRY_CLUSTER_NET", &self.net)
            .env("FERRY_CLUSTER_POD_NET", &self.pod_net);
    }

    /// Runs a script with this cluster's settings, output into a file; fails unless it exits 0.
    pub fn script(&self, script: &Path, args: &[&str], timeout: Duration) -> Result<String> {
        let logs = self.tmp.path().join("script-logs");
        fs::create_dir_all(&logs)?;
        let name = script.file_name().unwrap_or_default().to_string_lossy();
        let out_path = logs.join(format!("{name}.{}.out", unique()));
        let mut cmd = Command::new("bash");
        cmd.arg(script).args(args);
        self.settings(&mut cmd);
        run_logged(&mut cmd, &name, &out_path, timeout)
    }

    /// [`Cluster::script`] of `e2e/cluster/<name>`.
    pub fn cluster_script(&self, name: &str, args: &[&str], timeout: Duration) -> Result<String> {
        self.script(&e2e_dir().join("cluster").join(name), args, timeout)
    }

    /// `up.sh` (at most 20 min: the first run builds and caches the cluster's images).
    pub fn up(&self) -> Result<String> {
        self.cluster_script("up.sh", &[], Duration::from_secs(20 * 60))
    }

    /// Imports the images into the cluster's containerd while Mosquitto, Kafka and the schema
    /// registry start in the cluster's netns on the node address (at once: it saves half a
    /// minute).
    ///
    /// The brokers are started by the calling thread, which they are tied to by
    /// `PR_SET_PDEATHSIG`: call this from the thread that keeps them.
    pub fn import_images_and_start_brokers(
        &self,
        images: &[PathBuf],
        options: BrokerOptions<'_>,
    ) -> Result<Brokers> {
        let (brokers, ()) = self.start_brokers_while(options, || {
            for image in images {
                self.cluster_script(
                    "import-image.sh",
                    &[&image.display().to_string()],
                    Duration::from_secs(300),
                )?;
            }
            Ok(())
        })?;
        Ok(brokers)
    }

    /// Starts Mosquitto, Kafka and the schema registry in the cluster's netns on the node
    /// address while `meanwhile` runs on another thread (e.g. getting images into place); fails
    /// if either fails.
    ///
    /// The brokers are started by the calling thread, which they are tied to by
    /// `PR_SET_PDEATHSIG`: call this from the thread that keeps them.
    pub fn start_brokers_while<T: Send>(
        &self,
        options: BrokerOptions<'_>,
        meanwhile: impl FnOnce() -> Result<T> + Send,
    ) -> Result<(Brokers, T)> {
        let placement = self.placement();
        std::thread::scope(|s| -> Result<(Brokers, T)> {
            let side = s.spawn(meanwhile);
            let brokers = (|| -> Result<Brokers> {
                Ok(Brokers {
                    mqtt: Mosquitto::start_placed(options.mqtt, placement.clone())?,
                    kafka: Kafka::start_placed(options.kafka, placement.clone())?,
                    schema_registry: SchemaRegistry::start_placed(
                        options.schema_registry,
                        placement.clone(),
                    )?,
                })
            })();
            let value = side
                .join()
                .map_err(|_| anyhow!("the work beside the brokers' start panicked"))??;
            Ok((brokers?, value))
        })
    }

    /// `down.sh`; with `keep_logs`, the component logs are moved there first.
    pub fn down(&mut self, keep_logs: Option<&Path>) -> Result<()> {
        self.down_ran = true;
        let mut cmd = Command::new("bash");
        cmd.arg(e2e_dir().join("cluster/down.sh"));
        self.settings(&mut cmd);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(keep) = keep_logs {
            cmd.env("FERRY_CLUSTER_KEEP_LOGS", keep);
        }
        let out = cmd.output().context("cannot run down.sh")?;
        ensure!(
            out.status.success(),
            "down.sh failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// `kubectl --kubeconfig <this cluster's> ARGS`: its stdout; fails unless it exits 0.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_in(args, None)
    }

    /// [`Cluster::kubectl`] with `stdin` as its input.
    pub fn kubectl_in(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut cmd = Command::new(KUBECTL);
        cmd.arg("--kubeconfig")
            .arg(self.kubeconfig())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        let mut child = cmd.spawn().context("cannot run /usr/bin/kubectl")?;
        if let Some(input) = stdin {
            child
                .stdin
                .take()
                .expect("piped stdin")
                .write_all(input.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "kubectl {} failed ({}): {stdout}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }

    /// Whether the ForwardingRule's `Ready` condition is `True`.
    pub fn rule_ready(&self, rule: &str, ns: &str) -> Result<bool> {
        Ok(self.jsonpath(
            "fr",
            rule,
            ns,
            "{.status.conditions[?(@.type==\"Ready\")].status}",
        )? == "True")
    }

    /// The rule's `.status.schema`: (subject, version, id) of the schema its values are
    /// encoded with, once a forwarder pod reported one.
    pub fn rule_schema(&self, rule: &str, ns: &str) -> Result<Option<(String, u64, u64)>> {
        let text = self.jsonpath("fr", rule, ns, "{.status.schema}")?;
        if text.is_empty() {
            return Ok(None);
        }
        let schema: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{rule}'s .status.schema is not JSON: {text}"))?;
        match (
            schema["subject"].as_str(),
            schema["version"].as_u64(),
            schema["id"].as_u64(),
        ) {
            (Some(subject), Some(version), Some(id)) => Ok(Some((subject.to_owned(), version, id))),
            _ => bail!("{rule}'s .status.schema lacks subject, version or id: {text}"),
        }
    }

    /// A Secret `name` in `ns` with `entries` (key, value), created from files so the values'
    /// bytes pass through neither YAML nor a shell, and labelled
    /// `ferry.dev/broker-credentials=true` (only Secrets so marked may be used by a
    /// BrokerConnection).
    pub fn create_marked_secret(
        &self,
        ns: &str,
        name: &str,
        entries: &[(&str, &[u8])],
    ) -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut args = vec![
            "create".to_owned(),
            "secret".to_owned(),
            "generic".to_owned(),
            name.to_owned(),
            "-n".to_owned(),
            ns.to_owned(),
        ];
        for (key, value) in entries {
            let file = dir.path().join(key);
            fs::write(&file, value)?;
            args.push(format!("--from-file={key}={}", file.display()));
        }
        self.kubectl(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        self.kubectl(&[
            "label",
            "secret",
            name,
            "-n",
            ns,
            "ferry.dev/broker-credentials=true",
        ])?;
        Ok(())
    }

    /// The Secret of [`plant_connection_yaml`]'s `schemaRegistry`: the basic-auth `login`
    /// (`username`, `password`) and the CA of the registry's certificate (`ca.crt`).
    pub fn create_schema_registry_secret(
        &self,
        ns: &str,
        name: &str,
        registry: &SchemaRegistry,
        (user, password): (&str, &str),
    ) -> Result<()> {
        let ca = registry
            .ca_cert()
            .ok_or_else(|| anyhow!("the schema registry serves no TLS: basic auth needs https"))?;
        let ca = fs::read(ca).with_context(|| format!("read {}", ca.display()))?;
        self.create_marked_secret(
            ns,
            name,
            &[
                ("username", user.as_bytes()),
                ("password", password.as_bytes()),
                ("ca.crt", &ca),
            ],
        )
    }

    /// A PKI whose server certificate is valid for the node address: for a schema registry
    /// (or a broker) with TLS next to the cluster.
    pub fn node_pki(&self) -> Result<Pki> {
        Pki::generate_for(KeyType::Ecdsa, &[self.node_ip()])
    }

    /// `helm ARGS --kubeconfig <this cluster's>` with private helm config, cache and data dirs:
    /// its output; fails unless it exits 0.
    /// `helm install ferry charts/ferry` into `namespace` (created), the operator reading the
    /// forwarders' `/status` every 2 s, and waits until its pods are ready.
    pub fn helm_install_ferry(&self, namespace: &str) -> Result<String> {
        let chart = repo_dir().join("charts/ferry");
        self.helm(&[
            "install",
            "ferry",
            &chart.display().to_string(),
            "--namespace",
            namespace,
            "--create-namespace",
            "--set",
            "statusIntervalSeconds=2",
            "--wait",
            "--timeout",
            "3m",
        ])
    }

    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let home = self.tmp.path().join("helm");
        let out = Command::new(helm_bin())
            .args(args)
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_DATA_HOME", home.join("data"))
            .stdin(Stdio::null())
            .output()
            .context("cannot run helm")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(
            out.status.success(),
            "helm {} failed ({}):\n{text}",
            args.join(" "),
            out.status
        );
        Ok(text)
    }

    /// Prints what helps to understand a failure: objects, events, the operator's logs (in
    /// `release_ns`) and those of the forwarders of `connection` (in `ns`).
    pub fn diagnose(&self, release_ns: &str, ns: &str, connection: &str) {
        let show = |args: &[&str]| match self.kubectl(args) {
            Ok(out) => eprintln!("$ kubectl {}\n{out}", args.join(" ")),
            Err(e) => eprintln!("$ kubectl {}: {e:#}", args.join(" ")),
        };
        show(&["get", "pods", "-A", "-o", "wide"]);
        show(&["get", "bc,fr,sts,cm,secret,svc,pdb", "-n", ns, "-o", "wide"]);
        show(&["get", "fr", "-n", ns, "-o", "yaml"]);
        show(&["get", "events", "-A", "--sort-by=.lastTimestamp"]);
        show(&[
            "logs",
            "-n",
            release_ns,
            "-l",
            "app.kubernetes.io/name=ferry",
            "--tail=60",
            "--all-containers",
            "--prefix",
        ]);
        show(&[
            "logs",
            "-n",
            ns,
            "-l",
            &format!("ferry.dev/connection={connection}"),
            "--tail=40",
            "--prefix",
        ]);
    }
}

/// How to start the services of [`Cluster::start_brokers_while`].
#[derive(Default)]
pub struct BrokerOptions<'a> {
    pub mqtt: MosquittoOptions<'a>,
    pub kafka: KafkaOptions<'a>,
    pub schema_registry: SchemaRegistryOptions<'a>,
}

/// What runs next to the cluster, in its netns on the node address; each stops when dropped.
pub struct Brokers {
    pub mqtt: Mosquitto,
    pub kafka: Kafka,
    pub schema_registry: SchemaRegistry,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.down_ran {
            return;
        }
        let keep = std::env::temp_dir().join(format!("{}-{}", self.logs_prefix, unique()));
        eprintln!(
            "ferry: tearing the cluster down (component logs kept in {})",
            keep.display()
        );
        if let Err(e) = self.down(Some(&keep)) {
            eprintln!("ferry: {e:#}");
        }
    }
}

/// How often a test looks at the cluster while it waits ([`crate::wait_until_some`]): every
/// look runs kubectl (or asks a pod), on the cores the cluster runs on.
pub const CLUSTER_POLL: Duration = Duration::from_millis(500);

/// The ForwardingRules named `names` from `examples/kubernetes/rules.yaml`, as they are
/// shipped (they reference the connection `plant`), for `kubectl apply -n <ns> -f -`.
pub fn example_rules(names: &[&str]) -> Result<String> {
    let path = repo_dir().join("examples/kubernetes/rules.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let docs: Vec<&str> = text
        .split("\n---\n")
        .filter(|doc| {
            names
                .iter()
                .any(|n| doc.contains(&format!("\n  name: {n}\n")))
        })
        .collect();
    ensure!(
        docs.len() == names.len(),
        "{} has {} of the rules {names:?}",
        path.display(),
        docs.len()
    );
    Ok(docs.join("\n---\n"))
}

/// Messages for the CEL examples (`devices`, `readings`) from plant `plant`: two device
/// statuses, a reading, a heartbeat, a reading without `temp` and a payload that is not JSON.
pub fn cel_example_messages(plant: usize) -> Vec<(String, Vec<u8>)> {
    let device = |d: usize| format!("d-{plant}{d}");
    [
        (
            format!("plant/{plant}/devices/status"),
            format!(r#"{{"device":"{}","battery":80}}"#, device(1)),
        ),
        (
            format!("plant/{plant}/devices/status"),
            format!(r#"{{"device":"{}","battery":64}}"#, device(2)),
        ),
        (
            format!("plant/{plant}/readings"),
            format!(
                r#"{{"type":"reading","device":"{}","temp":21.5,"fw":"1.2"}}"#,
                device(1)
            ),
        ),
        (
            format!("plant/{plant}/readings"),
            format!(r#"{{"type":"heartbeat","device":"{}"}}"#, device(1)),
        ),
        (
            format!("plant/{plant}/readings"),
            format!(r#"{{"type":"reading","device":"{}"}}"#, device(2)),
        ),
        (format!("plant/{plant}/readings"), "temp=21.5".to_owned()),
    ]
    .into_iter()
    .map(|(topic, payload)| (topic, payload.into_bytes()))
    .collect()
}

/// The BrokerConnection `plant` of the demo and the full-path test, in namespace `ns`: MQTT 5
/// with a persistent session to the Mosquitto at `node:mqtt_port`, Kafka at `node:kafka_port`,
/// `replicas` forwarder pods, the MQTT login from the Secret `credentials` if given, and the
/// schema registry at the https `url` with the basic-auth login and the CA from the Secret
/// `secret` ([`Cluster::create_schema_registry_secret`]) if `schema_registry` is
/// `Some((url, secret))`.
pub fn plant_connection_yaml(
    ns: &str,
    node: IpAddr,
    (mqtt_port, kafka_port): (u16, u16),
    replicas: u32,
    credentials: Option<&str>,
    schema_registry: Option<(&str, &str)>,
) -> String {
    let credentials = credentials
        .map(|name| format!("\n    credentialsSecretRef: {{ name: {name} }}"))
        .unwrap_or_default();
    let schema_registry = schema_registry
        .map(|(url, secret)| {
            format!(
                "  schemaRegistry:\n    url: \"{url}\"\n    tls: {{ caSecretRef: {{ name: {secret}, key: ca.crt }} }}\n    credentialsSecretRef: {{ name: {secret} }}\n"
            )
        })
        .unwrap_or_default();
    format!(
        r#"apiVersion: ferry.dev/v1alpha1
kind: BrokerConnection
metadata:
  name: plant
  namespace: {ns}
spec:
  mqtt:
    host: "{node}"
    port: {mqtt_port}
    protocol: "5"
    sessionExpirySeconds: 3600     # persistent session: the broker keeps messages while a pod restarts{credentials}
  kafka:
    bootstrapServers: ["{node}:{kafka_port}"]
  forwarder:
    replicas: {replicas}
{schema_registry}"#
    )
}

// ---------------------------------------------------------------------------------------------
// The Avro rule of the demo and the full-path test: `metrics`, plant/+/metrics as Avro records
// in the Kafka topic `metrics`, the schema of the subject `metrics-value` (topic name strategy).

/// The Kafka topic of the rule `metrics`.
pub const METRICS_TOPIC: &str = "metrics";
/// The subject of its records' schema: the topic name strategy's `<topic>-value`.
pub const METRICS_SUBJECT: &str = "metrics-value";
/// The Avro schema registered under [`METRICS_SUBJECT`].
pub const METRIC_AVRO: &str = r#"{"type":"record","name":"Metric","namespace":"plant","fields":[{"name":"device","type":"string"},{"name":"celsius","type":"double"}]}"#;

/// The ForwardingRule `metrics` in namespace `ns` (connection `plant`): JSON readings from
/// `plant/+/metrics`, encoded as Avro with the latest schema of [`METRICS_SUBJECT`]; a reading
/// that does not fit it goes to `ferry.dead-letters` (a rule that encodes needs a way out).
pub fn metrics_rule_yaml(ns: &str) -> String {
    format!(
        r#"apiVersion: ferry.dev/v1alpha1
kind: ForwardingRule
metadata:
  name: metrics
  namespace: {ns}
spec:
  connectionRef: {{ name: plant }}
  mqtt:
    topics: ["plant/+/metrics"]
  kafka:
    topic: {METRICS_TOPIC}
    value: {{ format: avro }}           # subject metrics-value (TopicName strategy), its latest version
  deadLetter:
    topic: ferry.dead-letters
"#
    )
}

/// `count` JSON readings from plant `plant` for the rule `metrics`, each from its own device
/// (`d-<plant>-<n>`), temperatures exact in binary so that they compare equal once decoded.
pub fn metric_messages(plant: usize, count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|n| {
            let reading = serde_json::json!({
                "device": format!("d-{plant}-{n}"),
                "celsius": 20.0 + n as f64 / 4.0,
            });
            (
                format!("plant/{plant}/metrics"),
                reading.to_string().into_bytes(),
            )
        })
        .collect()
}

/// The `metrics` records of `kafka`, decoded by confluent-kafka's AvroDeserializer against
/// `registry` ([`SchemaRegistry::confluent_consume`]): one per message of `sent`; fails unless
/// each carries the schema id `id` and the decoded values are the readings sent (in any order:
/// two pods may share the topic's messages). Returns the decoded records.
pub fn read_metrics_decoded(
    registry: &SchemaRegistry,
    kafka: &Kafka,
    sent: &[(String, Vec<u8>)],
    id: u32,
) -> Result<Vec<serde_json::Value>> {
    let records = registry.confluent_consume(
        &kafka.bootstrap(),
        METRICS_TOPIC,
        sent.len(),
        SchemaType::Avro,
        Duration::from_secs(60),
    )?;
    let device = |v: &serde_json::Value| v["device"].as_str().unwrap_or_default().to_owned();
    let mut decoded: Vec<serde_json::Value> = records.iter().map(|r| r["value"].clone()).collect();
    let mut want = sent
        .iter()
        .map(|(_, payload)| serde_json::from_slice(payload))
        .collect::<Result<Vec<serde_json::Value>, _>>()?;
    decoded.sort_by_key(device);
    want.sort_by_key(device);
    ensure!(
        decoded == want,
        "the decoded metrics differ from the readings sent:\ndecoded {decoded:?}\nsent    {want:?}"
    );
    for r in &records {
        ensure!(
            r["schema_id"] == id,
            "a metrics record carries schema id {}, want {id}: {r}",
            r["schema_id"]
        );
    }
    Ok(records)
}

/// Where a test client reaches Mosquitto, and the user it logs in as.
#[derive(Debug, Clone)]
pub struct MqttEndpoint {
    pub host: IpAddr,
    pub port: u16,
    pub login: Option<(String, String)>,
}

/// Publishes, as client `e2e-pub-{prefix}`, `topic_of(n)` / `"{prefix}-{n}"` for n = 0, 1, …
/// at `per_second` (0: as fast as the window allows) until `count` messages or until `stop` is
/// set, and returns the payloads, once the broker acknowledged every one (QoS 1): each of them
/// must then reach Kafka.
pub async fn publish_paced(
    broker: MqttEndpoint,
    prefix: String,
    topic_of: fn(usize) -> String,
    count: usize,
    per_second: u32,
    stop: Arc<AtomicBool>,
) -> Result<Vec<String>> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet, QoS};
    let mut opts = MqttOptions::new(
        format!("e2e-pub-{prefix}"),
        broker.host.to_string(),
        broker.port,
    );
    if let Some((user, password)) = &broker.login {
        opts.set_credentials(user, password);
    }
    // A short keep-alive: the loop below sees an event at least every 5 s, so it notices the
    // sender's end even when every acknowledgement came before it.
    opts.set_keep_alive(Duration::from_secs(5))
        .set_inflight(100);
    let (client, mut eventloop) = AsyncClient::new(opts, 200);
    let sender = {
        let client = client.clone();
        tokio::spawn(async move {
            let mut sent = Vec::new();
            let mut tick = (per_second > 0).then(|| {
                let mut i = tokio::time::interval(Duration::from_secs(1) / per_second);
                i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                i
            });
            for n in 0..count {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                if let Some(t) = tick.as_mut() {
                    t.tick().await;
                }
                let payload = format!("{prefix}-{n}");
                client
                    .publish(topic_of(n), QoS::AtLeastOnce, false, payload.clone())
                    .await?;
                sent.push(payload);
            }
            anyhow::Ok(sent)
        })
    };
    let mut acked = 0usize;
    let mut published = 0usize;
    let mut sender = Some(sender);
    let mut sent = None;
    loop {
        if let Some(s) = sender.as_ref()
            && s.is_finished()
        {
            sent = Some(sender.take().expect("sender").await??);
        }
        if let Some(sent) = &sent
            && acked >= sent.len()
        {
            break;
        }
        match tokio::time::timeout(Duration::from_secs(30), eventloop.poll()).await {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Ok(Event::Outgoing(Outgoing::Publish(_)))) => published += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!("publisher: connection failed after {acked} acks: {e}"),
            Err(_) => bail!("publisher stalled ({published} sent, {acked} acknowledged)"),
        }
    }
    disconnect(&client, &mut eventloop).await?;
    Ok(sent.unwrap_or_default())
}

/// Publishes `messages` (topic, payload) at QoS 1 to `broker` as `client_id` and returns once
/// the broker acknowledged every one.
pub async fn publish_to(
    broker: &MqttEndpoint,
    client_id: &str,
    messages: Vec<(String, Vec<u8>)>,
) -> Result<()> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let mut opts = MqttOptions::new(client_id, broker.host.to_string(), broker.port);
    opts.set_keep_alive(Duration::from_secs(30));
    if let Some((user, password)) = &broker.login {
        opts.set_credentials(user, password);
    }
    let (client, mut eventloop) = AsyncClient::new(opts, 100);
    let total = messages.len();
    let sender = {
        let client = client.clone();
        tokio::spawn(async move {
            for (topic, payload) in messages {
                client
                    .publish(topic, QoS::AtLeastOnce, false, payload)
                    .await?;
            }
            anyhow::Ok(())
        })
    };
    let mut acked = 0usize;
    while acked < total {
        match tokio::time::timeout(Duration::from_secs(30), eventloop.poll()).await {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!("publisher: connection failed after {acked}/{total} acks: {e}"),
            Err(_) => bail!("publisher stalled after {acked}/{total} acks"),
        }
    }
    sender.await??;
    disconnect(&client, &mut eventloop).await
}
