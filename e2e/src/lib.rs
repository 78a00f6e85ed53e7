//! Real Mosquitto and Apache Kafka processes for Ferry's integration tests, demo and benchmarks.
//!
//! Each broker runs on a free loopback port with its own data dir and is stopped when its value
//! is dropped — also when a test panics — and, through `PR_SET_PDEATHSIG`, when the process that
//! started it dies. `e2e/install.sh` installs Mosquitto and fetches Kafka's jars (cached).
//!
//! For fault injection: [`FaultProxy`] breaks and heals the network between a client and a
//! broker ([`KafkaOptions::proxy`] puts a Kafka behind one), [`KafkaOptions::acls`] lets a test
//! grant and revoke a user's rights, and [`KafkaCluster`] runs several Kafka nodes to kill.

use std::fs;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use rdkafka::ClientConfig;
use rustls::pki_types::pem::PemObject as _;

pub use rumqttc;

pub mod cluster;
pub mod fault_proxy;
mod kafka_cluster;
mod kafka_node;
pub mod kube;
pub mod metrics;
mod pki;
pub mod registry;
pub mod schema_registry;
pub use fault_proxy::{FaultProxy, ProxyMode};
pub use kafka_cluster::{ClusterOptions, KafkaCluster};
use kafka_node::{Listener, NodeProps};
pub use pki::{CLIENT_CN, KeyType, Pki};
pub use registry::Registry;
pub use schema_registry::{SchemaRegistry, SchemaRegistryOptions, SchemaType};

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

/// A free TCP port on 127.0.0.1 for a broker or server a test starts.
///
/// Taken below the kernel's ephemeral range: a port from that range, bound and released, can be
/// handed to any outgoing connection (a client of the Kafka started a moment before) before the
/// server binds it ("Address already in use"). Below the range only other `free_port` calls compete:
/// a process-wide counter keeps this process's ports distinct, and the start is spread by pid.
pub fn free_port() -> Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (low, high) = listen_port_range();
    let span = u32::from(high - low);
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let port = low + ((start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        // One at a time: a listener on 127.0.0.1 would make the wildcard bind fail.
        let free = |ip: Ipv4Addr| TcpListener::bind((ip, port)).is_ok();
        if free(Ipv4Addr::LOCALHOST) && free(Ipv4Addr::UNSPECIFIED) {
            return Ok(port);
        }
    }
    bail!("no free TCP port in {low}..{high}")
}

/// Ports for listeners: 12000..30000, clear of the kubelet's and control plane's fixed ports
/// (10248–10259), Kubernetes' NodePort range (30000–32767) and, unless the kernel was set
/// otherwise, the ephemeral range (32768 up).
fn listen_port_range() -> (u16, u16) {
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    (12_000, ephemeral_low.clamp(20_000, 30_000))
}

fn wait_for_port(
    port: u16,
    timeout: Duration,
    child: &mut Child,
    what: &str,
    log: &Path,
) -> Result<()> {
    wait_for_addr(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        port,
        timeout,
        child,
        what,
        log,
    )
}

/// [`wait_for_port`] on `host` instead of 127.0.0.1.
fn wait_for_addr(
    host: IpAddr,
    port: u16,
    timeout: Duration,
    child: &mut Child,
    what: &str,
    log: &Path,
) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if TcpStream::connect((host, port)).is_ok() {
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
        "{what} did not listen on {host}:{port} within {timeout:?}; log {}:\n{}",
        log.display(),
        tail(log)
    )
}

fn tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Starts `cmd` so that it dies with the process that started it. Its output is appended to
/// `log`, so a restarted broker's log keeps what happened before the restart.
fn spawn_tied(cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = fs::OpenOptions::new().create(true).append(true).open(log)?;
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

/// Runs `cmd` to its end with its output in `log`, killing it after `timeout`; fails unless it
/// exits 0, with the output. Returns the output.
fn run_logged(cmd: &mut Command, what: &str, log: &Path, timeout: Duration) -> Result<String> {
    let out = fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    let mut child = cmd.spawn().with_context(|| format!("cannot run {what}"))?;
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{what} did not finish within {timeout:?}; output:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = fs::read_to_string(log).unwrap_or_default();
    if !status.success() {
        bail!("{what} failed ({status}):\n{output}");
    }
    Ok(output)
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

/// Where a broker runs and listens. `Placement::default()` is what `start`/`start_with` do:
/// in this process's network namespace, on 127.0.0.1.
///
/// With `netns` and `bind`, a broker can serve the pods of the single-node cluster of
/// `e2e/cluster/up.sh`: started inside the cluster's namespace and bound to the node address,
/// pods reach it at that address, and so does this process (through the veth), so the helpers
/// ([`Kafka::read_all`], [`Kafka::create_topic`], …) keep working.
///
/// As with every start here, the broker gets `PR_SET_PDEATHSIG`, which fires when the *thread*
/// that started it ends: start brokers from the test's own thread, not a short-lived one.
#[derive(Debug, Default, Clone)]
pub struct Placement {
    /// A named network namespace (`/var/run/netns/<name>`): the broker is started with
    /// `nsenter --net=/var/run/netns/<name> <command>` (needs root).
    pub netns: Option<String>,
    /// The address every listener binds to (and Kafka advertises) instead of 127.0.0.1. This
    /// process must be able to connect to it (the start waits until the broker listens).
    pub bind: Option<IpAddr>,
}

impl Placement {
    fn host(&self) -> IpAddr {
        self.bind.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// `program` as a command, run inside the namespace when there is one.
    fn command(&self, program: &Path) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut cmd = Command::new("nsenter");
                cmd.arg(format!("--net=/var/run/netns/{ns}")).arg(program);
                cmd
            }
            None => Command::new(program),
        }
    }
}

/// A Mosquitto broker on a free loopback port, in-memory sessions.
///
/// [`Mosquitto::start`] gives a plaintext listener with anonymous access.
/// [`Mosquitto::start_with`] can add a TLS listener and require a user name and password.
pub struct Mosquitto {
    child: Option<Child>,
    port: u16,
    tls_port: Option<u16>,
    dir: tempfile::TempDir,
    placement: Placement,
}

/// How to secure a [`Mosquitto`]. `MosquittoOptions::default()` is what [`Mosquitto::start`]
/// runs: one plaintext listener, anonymous access.
///
/// The plaintext listener ([`Mosquitto::port`]) is always there. Mosquitto's
/// `per_listener_settings` is off, so `users` apply to every listener, the plaintext one too.
#[derive(Debug, Default, Clone)]
pub struct MosquittoOptions<'a> {
    /// Adds a TLS listener ([`Mosquitto::tls_port`]) using the PKI's server certificate.
    pub tls: Option<TlsListener<'a>>,
    /// `(user name, password)` pairs. When not empty, anonymous clients are refused
    /// (`allow_anonymous false`) and these users are written to a `password_file` with
    /// `mosquitto_passwd`. Names and passwords: see [`check_credential`].
    pub users: Vec<(String, String)>,
    /// `max_inflight_messages` instead of [`MOSQUITTO_MAX_INFLIGHT`] (0: unlimited).
    pub max_inflight_messages: Option<u32>,
    /// `queue_qos0_messages true`: QoS 0 messages are queued for offline persistent sessions
    /// too (Mosquitto drops them by default).
    pub queue_qos0_messages: bool,
    /// `log_type notice` too: `mosquitto.log` then has a line per client connect
    /// (`New client connected from <ip>:<port> as <client id> (p<protocol>, c<clean>,
    /// k<keep-alive>).`) and disconnect.
    pub log_connections: bool,
    /// `persistence true` in the broker's dir: sessions and their queued messages are saved on
    /// a graceful stop and survive [`Mosquitto::stop`]/[`Mosquitto::resume`].
    pub persistence: bool,
    /// Topic filter patterns no client may subscribe to, as an ACL does it: Mosquitto's
    /// dynamic-security plugin with a `subscribePattern` deny per pattern for the anonymous
    /// group, so its SUBACK refuses them (0x80 in MQTT 3.1.1, 0x87 not authorized in MQTT 5).
    /// A shared subscription is judged by its whole filter: deny `$share/+/secret/#` too. Only
    /// with anonymous access (no `users`).
    pub deny_subscribe: Vec<String>,
}

/// Where Debian's `mosquitto` package puts the dynamic-security plugin.
const DYNSEC_PLUGIN: &str = "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so";

/// The dynamic-security plugin, denying `patterns` to anonymous clients and allowing the rest.
fn write_subscribe_denials(f: &mut fs::File, dir: &Path, patterns: &[String]) -> Result<()> {
    if !Path::new(DYNSEC_PLUGIN).exists() {
        bail!("{DYNSEC_PLUGIN} not found (package mosquitto 2.0): run e2e/install.sh");
    }
    let acls: Vec<serde_json::Value> = patterns
        .iter()
        .map(|p| {
            serde_json::json!({"acltype": "subscribePattern", "topic": p, "priority": 0, "allow": false})
        })
        .collect();
    let config = serde_json::json!({
        "defaultACLAccess": {
            "publishClientSend": true, "publishClientReceive": true,
            "subscribe": true, "unsubscribe": true
        },
        "clients": [],
        "groups": [{"groupname": "anonymous", "roles": [{"rolename": "denied"}]}],
        "roles": [{"rolename": "denied", "acls": acls}],
        "anonymousGroup": "anonymous"
    });
    let path = dir.join("dynamic-security.json");
    fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    writeln!(f, "plugin {DYNSEC_PLUGIN}")?;
    writeln!(f, "plugin_opt_config_file {}", path.display())?;
    Ok(())
}

/// A TLS listener of [`Mosquitto`].
#[derive(Debug, Clone, Copy)]
pub struct TlsListener<'a> {
    /// The server certificate and key, and the CA client certificates are checked against. The
    /// files are copied into the broker's dir, so the `Pki` may be dropped after the start.
    pub pki: &'a Pki,
    /// `require_certificate true`: clients must present a certificate signed by the PKI's CA.
    pub require_client_cert: bool,
}

/// Checks a password given to [`MosquittoOptions::users`] or [`SaslSsl::plain_users`]: 1 to 64
/// ASCII characters, printable or a newline, tab or space; the fixtures pass it as an argument
/// (`mosquitto_passwd -b`) or escape it (Kafka's JAAS config), so any such character works.
pub fn check_password(what: &str, value: &str) -> Result<()> {
    let bad = |c: char| !(c.is_ascii_graphic() || matches!(c, ' ' | '\n' | '\t'));
    if value.is_empty() || value.len() > 64 || value.chars().any(bad) {
        bail!("{what} is not allowed by the test fixtures: use 1-64 printable ASCII characters");
    }
    Ok(())
}

/// A JAAS option value in a `server.properties` line: quoted and escaped for JAAS's tokenizer,
/// then every backslash doubled for the properties file, which unescapes once.
fn jaas_quoted_in_properties(value: &str) -> String {
    let mut jaas = String::from("\"");
    for c in value.chars() {
        match c {
            '\\' => jaas.push_str("\\\\"),
            '"' => jaas.push_str("\\\""),
            '\n' => jaas.push_str("\\n"),
            '\t' => jaas.push_str("\\t"),
            c => jaas.push(c),
        }
    }
    jaas.push('"');
    jaas.replace('\\', "\\\\")
}

/// Checks a user name or password given to [`MosquittoOptions`] or [`SaslSsl`]: 1 to 64
/// printable ASCII characters, none of them space, `"`, `\`, `,`, `=`, `[`, `]` or `:` (they
/// would need quoting in Mosquitto's password file, Kafka's JAAS config or `--add-scram`).
pub fn check_credential(what: &str, value: &str) -> Result<()> {
    let bad = |c: char| !c.is_ascii_graphic() || "\"\\,=[]:".contains(c);
    if value.is_empty() || value.len() > 64 || value.chars().any(bad) {
        bail!(
            "{what} {value:?} is not allowed by the test fixtures: use 1-64 printable ASCII \
             characters without space, '\"', '\\', ',', '=', '[', ']' or ':'"
        );
    }
    Ok(())
}

/// The TLS listener of Mosquitto's config, with copies of the certificates in `dir`.
fn write_tls_listener(
    f: &mut fs::File,
    dir: &Path,
    host: IpAddr,
    tls_port: u16,
    tls: TlsListener<'_>,
) -> Result<()> {
    let pki = tls.pki;
    let copy = |from: &Path, name: &str| -> Result<PathBuf> {
        let to = dir.join(name);
        fs::copy(from, &to).with_context(|| format!("copy {}", from.display()))?;
        Ok(to)
    };
    writeln!(f, "listener {tls_port} {host}")?;
    writeln!(f, "cafile {}", copy(pki.ca_cert(), "ca.pem")?.display())?;
    writeln!(
        f,
        "certfile {}",
        copy(pki.server_cert(), "server.pem")?.display()
    )?;
    writeln!(
        f,
        "keyfile {}",
        copy(pki.server_key(), "server.key")?.display()
    )?;
    writeln!(f, "require_certificate {}", tls.require_client_cert)?;
    Ok(())
}

/// Anonymous access, or a password file made by `mosquitto_passwd` for `users`.
fn write_users(f: &mut fs::File, dir: &Path, users: &[(String, String)]) -> Result<()> {
    if users.is_empty() {
        writeln!(f, "allow_anonymous true")?;
    } else {
        let passwords = dir.join("passwords");
        let bin = which("mosquitto_passwd").ok_or_else(|| {
            anyhow!("mosquitto_passwd not installed (package mosquitto): run e2e/install.sh")
        })?;
        // One `-b` call per user: the password is an argument, never a line of the file,
        // so it may hold any character (`:`, quotes, a newline).
        for (i, (user, password)) in users.iter().enumerate() {
            check_credential("mosquitto user name", user)?;
            check_password("mosquitto password", password)?;
            let mut cmd = Command::new(&bin);
            if i == 0 {
                cmd.arg("-c");
            }
            let out = cmd
                .arg("-b")
                .arg(&passwords)
                .arg(user)
                .arg(password)
                .output()?;
            if !out.status.success() {
                bail!(
                    "mosquitto_passwd -b failed for user {user}: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        writeln!(f, "allow_anonymous false")?;
        writeln!(f, "password_file {}", passwords.display())?;
    }
    Ok(())
}

impl Mosquitto {
    /// A broker with one plaintext listener ([`Mosquitto::port`]) and anonymous access.
    pub fn start() -> Result<Self> {
        Self::start_with(MosquittoOptions::default())
    }

    /// A broker secured as `options` say. Its configuration (`mosquitto.conf`, next to
    /// `mosquitto.log`) is: a plaintext `listener <port> 127.0.0.1`; with `tls`, a second
    /// `listener <tls_port> 127.0.0.1` with `cafile`, `certfile`, `keyfile` and
    /// `require_certificate true|false`; with `users`, `allow_anonymous false` and
    /// `password_file`; `persistence false` (or `true` with `persistence`), `max_inflight_messages`
    /// [`MOSQUITTO_MAX_INFLIGHT`] (unless overridden), `max_queued_messages` [`MOSQUITTO_MAX_QUEUED`],
    /// `max_queued_bytes 0`. With `tls` or `users`, when run as root, it stays root (`user root`)
    /// so it can still read its password file in the private temp dir after the start.
    pub fn start_with(options: MosquittoOptions<'_>) -> Result<Self> {
        Self::start_placed(options, Placement::default())
    }

    /// [`Mosquitto::start_with`], run and listening where `placement` says (the listeners on
    /// `placement.bind` instead of 127.0.0.1; see [`Mosquitto::host`]).
    pub fn start_placed(options: MosquittoOptions<'_>, placement: Placement) -> Result<Self> {
        let host = placement.host();
        let dir = tempfile::Builder::new()
            .prefix("ferry-mosquitto-")
            .tempdir()?;
        let port = free_port()?;
        let tls_port = options.tls.map(|_| free_port()).transpose()?;
        let conf = dir.path().join("mosquitto.conf");
        let mut f = fs::File::create(&conf)?;
        if !options.deny_subscribe.is_empty() && !options.users.is_empty() {
            bail!("MosquittoOptions::deny_subscribe works with anonymous access only");
        }
        let secured = options.tls.is_some()
            || !options.users.is_empty()
            || options.persistence
            || !options.deny_subscribe.is_empty();
        // SAFETY: geteuid(2) has no preconditions.
        if secured && unsafe { libc::geteuid() } == 0 {
            // Otherwise Mosquitto, started as root, drops to the `mosquitto` user before it
            // reads the password file, and that user cannot enter this (0700) temp dir.
            writeln!(f, "user root")?;
        }
        writeln!(f, "listener {port} {host}")?;
        if let (Some(tls), Some(tls_port)) = (options.tls, tls_port) {
            write_tls_listener(&mut f, dir.path(), host, tls_port, tls)?;
        }
        write_users(&mut f, dir.path(), &options.users)?;
        if !options.deny_subscribe.is_empty() {
            write_subscribe_denials(&mut f, dir.path(), &options.deny_subscribe)?;
        }
        if options.persistence {
            writeln!(f, "persistence true")?;
            writeln!(f, "persistence_location {}/", dir.path().display())?;
        } else {
            writeln!(f, "persistence false")?;
        }
        writeln!(
            f,
            "max_inflight_messages {}",
            options
                .max_inflight_messages
                .unwrap_or(MOSQUITTO_MAX_INFLIGHT)
        )?;
        if options.queue_qos0_messages {
            writeln!(f, "queue_qos0_messages true")?;
        }
        writeln!(f, "max_queued_messages {MOSQUITTO_MAX_QUEUED}")?;
        writeln!(f, "max_queued_bytes 0")?;
        writeln!(f, "log_type error")?;
        writeln!(f, "log_type warning")?;
        if options.log_connections {
            writeln!(f, "log_type notice")?;
            writeln!(f, "connection_messages true")?;
        }
        drop(f);
        let mut m = Self {
            child: None,
            port,
            tls_port,
            dir,
            placement,
        };
        m.resume()?;
        Ok(m)
    }

    /// The process id of Mosquitto while it runs (for CPU accounting).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The plaintext listener's port (on [`Mosquitto::host`], by default 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address the listeners are bound to: 127.0.0.1 unless started with
    /// [`Mosquitto::start_placed`] and a [`Placement::bind`].
    pub fn host(&self) -> IpAddr {
        self.placement.host()
    }

    /// The TLS listener's port (on [`Mosquitto::host`], by default 127.0.0.1).
    ///
    /// # Panics
    /// If the broker was started without [`MosquittoOptions::tls`].
    pub fn tls_port(&self) -> u16 {
        self.tls_port
            .expect("this Mosquitto has no TLS listener: start it with MosquittoOptions::tls")
    }

    /// The broker's dir: `mosquitto.conf`, `mosquitto.log`, the password file and certificates.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops the broker (SIGTERM). Sessions are lost with it, unless it runs with
    /// [`MosquittoOptions::persistence`].
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            terminate(&mut c, Duration::from_secs(5));
        }
    }

    /// Starts it again on the same port(s).
    pub fn resume(&mut self) -> Result<()> {
        let bin = which("mosquitto")
            .ok_or_else(|| anyhow!("mosquitto not installed: run e2e/install.sh"))?;
        let log = self.dir.path().join("mosquitto.log");
        let mut child = spawn_tied(
            self.placement
                .command(&bin)
                .arg("-c")
                .arg(self.dir.path().join("mosquitto.conf")),
            &log,
        )?;
        let host = self.host();
        for port in std::iter::once(self.port).chain(self.tls_port) {
            if let Err(e) = wait_for_addr(
                host,
                port,
                Duration::from_secs(10),
                &mut child,
                "mosquitto",
                &log,
            ) {
                terminate(&mut child, Duration::from_secs(1));
                return Err(e);
            }
        }
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
///
/// It always has a `PLAINTEXT` listener ([`Kafka::bootstrap`]), which the test helpers
/// ([`Kafka::client_config`], [`Kafka::create_topic`], [`Kafka::read_all`]) use, and a
/// `CONTROLLER` listener. [`Kafka::start_with`] can add a `SASL_SSL` listener.
pub struct Kafka {
    child: Option<Child>,
    port: u16,
    sasl_ssl_port: Option<u16>,
    /// The `PROXIED` listener's own port and the port of the proxy it advertises.
    proxied: Option<(u16, u16)>,
    acls: bool,
    dir: tempfile::TempDir,
    libs: PathBuf,
    placement: Placement,
}

pub const KAFKA_VERSION: &str = "4.1.1";

/// The SASL mechanisms enabled on the `SASL_SSL` listener.
pub const KAFKA_SASL_MECHANISMS: [&str; 2] = ["SCRAM-SHA-512", "PLAIN"];

/// How to start a [`Kafka`]. `KafkaOptions::default()` is what [`Kafka::start`] runs.
#[derive(Debug, Default, Clone)]
pub struct KafkaOptions<'a> {
    /// Adds a `SASL_SSL` listener ([`Kafka::sasl_ssl_bootstrap`]).
    pub sasl_ssl: Option<SaslSsl<'a>>,
    /// Puts the broker behind this proxy for clients: adds a plaintext listener `PROXIED` on
    /// a port of its own that advertises the proxy's address (`127.0.0.1:<proxy port>`), and
    /// sets the proxy's upstream to that listener. A client bootstrapping on
    /// [`Kafka::proxied_bootstrap`] then reaches the broker only through the proxy, also when
    /// it reconnects to the address the metadata gave it; the test helpers keep using the
    /// direct `PLAINTEXT` listener, so they work whatever the proxy's mode.
    pub proxy: Option<&'a FaultProxy>,
    /// Turns authorization on ([`KAFKA_ACL_PROPS`]): only `ANONYMOUS` (the `PLAINTEXT`,
    /// `PROXIED` and `CONTROLLER` listeners, so the broker itself and the test helpers) is a
    /// super user; the users of `sasl_ssl` may do only what ACLs allow
    /// ([`Kafka::grant_produce`]).
    pub acls: bool,
}

/// A `SASL_SSL` listener of [`Kafka`] with mechanisms `SCRAM-SHA-512` and `PLAIN`.
///
/// Users of both lists may only use their own mechanism. Names and passwords: see
/// [`check_credential`]. SCRAM credentials are written into the cluster metadata when the
/// storage is formatted, so they survive [`Kafka::stop`]/[`Kafka::resume`].
#[derive(Debug, Clone)]
pub struct SaslSsl<'a> {
    /// The server certificate and key (a PEM keystore), and with `require_client_cert` the CA
    /// client certificates are checked against. The files are copied into the broker's dir.
    pub pki: &'a Pki,
    /// `(user name, password)` pairs for `SCRAM-SHA-512`.
    pub scram_sha512_users: Vec<(String, String)>,
    /// `(user name, password)` pairs for `PLAIN`.
    pub plain_users: Vec<(String, String)>,
    /// `ssl.client.auth=required`: clients must also present a certificate signed by the CA.
    pub require_client_cert: bool,
}

impl Kafka {
    pub fn libs_dir() -> PathBuf {
        cache_dir()
            .join(format!("kafka-{KAFKA_VERSION}"))
            .join("libs")
    }

    /// A broker with only the `PLAINTEXT` (and `CONTROLLER`) listener.
    pub fn start() -> Result<Self> {
        Self::start_with(KafkaOptions::default())
    }

    /// A broker set up as `options` say; `server.properties` and `kafka.log` are in
    /// [`Kafka::dir`]. With `sasl_ssl` it adds to the plain configuration:
    ///
    /// ```properties
    /// listeners=PLAINTEXT://127.0.0.1:<port>,CONTROLLER://127.0.0.1:<cport>,SASL_SSL://127.0.0.1:<sport>
    /// advertised.listeners=PLAINTEXT://127.0.0.1:<port>,SASL_SSL://127.0.0.1:<sport>
    /// listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL
    /// listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512,PLAIN
    /// listener.name.sasl_ssl.ssl.keystore.type=PEM
    /// listener.name.sasl_ssl.ssl.keystore.location=<dir>/keystore.pem   (key, cert, CA cert)
    /// listener.name.sasl_ssl.ssl.client.auth=none|required
    /// listener.name.sasl_ssl.ssl.truststore.type=PEM                      (if required)
    /// listener.name.sasl_ssl.ssl.truststore.location=<dir>/ca.pem         (if required)
    /// listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
    /// listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_<name>="<password>" ...;
    /// ```
    ///
    /// and formats the storage with `--add-scram 'SCRAM-SHA-512=[name=<name>,password=<pw>]'`
    /// for each SCRAM user. With `proxy` it adds `PROXIED://127.0.0.1:<own port>` advertised as
    /// `PROXIED://127.0.0.1:<proxy port>` (protocol `PLAINTEXT`); with `acls`,
    /// [`KAFKA_ACL_PROPS`].
    pub fn start_with(options: KafkaOptions<'_>) -> Result<Self> {
        Self::start_placed(options, Placement::default())
    }

    /// [`Kafka::start_with`], run where `placement` says, every listener (the controller's
    /// too) bound to and advertised on `placement.bind` instead of 127.0.0.1:
    /// [`Kafka::bootstrap`] is then `<bind>:<port>`.
    pub fn start_placed(options: KafkaOptions<'_>, placement: Placement) -> Result<Self> {
        let host = placement.host();
        let libs = kafka_node::libs()?;
        let dir = tempfile::Builder::new().prefix("ferry-kafka-").tempdir()?;
        let port = free_port()?;
        let cport = free_port()?;
        let sasl_ssl_port = options.sasl_ssl.as_ref().map(|_| free_port()).transpose()?;
        let proxied_port = options.proxy.map(|_| free_port()).transpose()?;
        let listener = |name, protocol, port: u16, advertise: Option<String>| Listener {
            name,
            protocol,
            bind: format!("{host}:{port}"),
            advertise,
        };
        let mut listeners = vec![
            listener(
                "PLAINTEXT",
                "PLAINTEXT",
                port,
                Some(format!("{host}:{port}")),
            ),
            listener("CONTROLLER", "PLAINTEXT", cport, None),
        ];
        let mut extra = String::new();
        let mut format_args: Vec<String> = Vec::new();
        if let (Some(sasl), Some(sport)) = (&options.sasl_ssl, sasl_ssl_port) {
            let advertise = Some(format!("{host}:{sport}"));
            listeners.push(listener("SASL_SSL", "SASL_SSL", sport, advertise));
            (extra, format_args) = sasl_ssl_props(sasl, dir.path())?;
        }
        if let (Some(proxy), Some(pport)) = (options.proxy, proxied_port) {
            // Clients that bootstrap through the proxy learn the proxy's address from the
            // metadata, so their reconnections go through it too.
            let advertise = Some(proxy.addr().to_string());
            listeners.push(listener("PROXIED", "PLAINTEXT", pport, advertise));
        }
        if options.acls {
            extra.push_str(KAFKA_ACL_PROPS);
        }
        let props = dir.path().join("server.properties");
        let node = NodeProps {
            node_id: 1,
            voters: &format!("1@{host}:{cport}"),
            listeners: &listeners,
            data: &dir.path().join("data"),
            replication: 1,
            min_isr: 1,
            extra: &extra,
        };
        fs::write(&props, node.render())?;
        kafka_node::format_storage(&libs, &props, &kafka_node::new_cluster_id()?, &format_args)?;
        if let (Some(proxy), Some(pport)) = (options.proxy, proxied_port) {
            proxy.set_upstream(SocketAddr::new(host, pport));
        }
        let mut k = Self {
            child: None,
            port,
            sasl_ssl_port,
            proxied: options
                .proxy
                .zip(proxied_port)
                .map(|(p, own)| (own, p.port())),
            acls: options.acls,
            dir,
            libs,
            placement,
        };
        k.resume()?;
        Ok(k)
    }

    /// The `SASL_SSL` listener's port (on [`Kafka::host`], by default 127.0.0.1).
    ///
    /// # Panics
    /// If the broker was started without [`KafkaOptions::sasl_ssl`].
    pub fn sasl_ssl_port(&self) -> u16 {
        self.sasl_ssl_port
            .expect("this Kafka has no SASL_SSL listener: start it with KafkaOptions::sasl_ssl")
    }

    /// `<host>:<port>` of the `SASL_SSL` listener (by default `127.0.0.1:<port>`).
    ///
    /// # Panics
    /// If the broker was started without [`KafkaOptions::sasl_ssl`].
    pub fn sasl_ssl_bootstrap(&self) -> String {
        format!("{}:{}", self.host(), self.sasl_ssl_port())
    }

    /// A client configuration for the `SASL_SSL` listener: `bootstrap.servers`,
    /// `security.protocol=SASL_SSL`, `sasl.mechanism`, `sasl.username`, `sasl.password` and
    /// `ssl.ca.location` (the broker's copy of the PKI's CA). Add `ssl.certificate.location` and
    /// `ssl.key.location` for a broker that requires client certificates.
    ///
    /// # Panics
    /// If the broker was started without [`KafkaOptions::sasl_ssl`].
    pub fn sasl_ssl_client_config(
        &self,
        mechanism: &str,
        username: &str,
        password: &str,
    ) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", self.sasl_ssl_bootstrap())
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanism", mechanism)
            .set("sasl.username", username)
            .set("sasl.password", password)
            .set(
                "ssl.ca.location",
                self.dir.path().join("ca.pem").display().to_string(),
            );
        cc
    }

    /// The broker's dir: `server.properties`, `kafka.log`, the keystore and the data.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The process id of the Kafka broker (its JVM) while it runs (for CPU accounting).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn bootstrap(&self) -> String {
        format!("{}:{}", self.host(), self.port)
    }

    /// The address the listeners are bound to and advertise: 127.0.0.1 unless started with
    /// [`Kafka::start_placed`] and a [`Placement::bind`].
    pub fn host(&self) -> IpAddr {
        self.placement.host()
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
        let props = self.dir.path().join("server.properties");
        let mut child = kafka_node::spawn_kafka(
            &self.placement,
            &self.libs,
            &props,
            &log,
            kafka_node::BROKER_JVM,
        )?;
        let host = self.host();
        let own_proxied = self.proxied.map(|(own, _)| own);
        for port in [Some(self.port), self.sasl_ssl_port, own_proxied]
            .into_iter()
            .flatten()
        {
            if let Err(e) = wait_for_addr(
                host,
                port,
                Duration::from_secs(60),
                &mut child,
                "kafka",
                &log,
            ) {
                terminate(&mut child, Duration::from_secs(5));
                return Err(e);
            }
        }
        self.child = Some(child);
        kafka_node::wait_for_brokers(&self.client_config(), 1, Duration::from_secs(60))
    }

    pub fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", self.bootstrap());
        cc
    }

    /// `127.0.0.1:<proxy port>`: the bootstrap of a broker started with [`KafkaOptions::proxy`],
    /// through its proxy.
    pub fn proxied_bootstrap(&self) -> Result<String> {
        let (_, proxy_port) = self.proxied.ok_or_else(|| {
            anyhow!("this Kafka has no PROXIED listener: start it with KafkaOptions::proxy")
        })?;
        Ok(format!("{}:{proxy_port}", Ipv4Addr::LOCALHOST))
    }

    /// A client configuration that reaches the broker only through its proxy (plaintext).
    pub fn proxied_client_config(&self) -> Result<ClientConfig> {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", self.proxied_bootstrap()?);
        Ok(cc)
    }

    /// Creates a topic (replication factor 1) through the `PLAINTEXT` listener.
    pub async fn create_topic(&self, name: &str, partitions: i32) -> Result<()> {
        kafka_node::create_topic(&self.client_config(), name, partitions, 1).await
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
        kafka_node::read_all(&self.client_config(), topic, expect, settle, timeout)
    }

    /// Allows `user` (a SCRAM or PLAIN user of [`KafkaOptions::sasl_ssl`]) to produce to
    /// `topic`: ACLs allowing `Write` and `Describe` on the literal topic, added with Kafka's
    /// `AclCommand` through the `PLAINTEXT` listener (rdkafka has no ACL admin API). Needs
    /// [`KafkaOptions::acls`]. Takes a JVM start (1-2 s).
    pub fn grant_produce(&self, user: &str, topic: &str) -> Result<()> {
        self.produce_acls("--add", user, topic)
    }

    /// Removes the ACLs [`Kafka::grant_produce`] added: `user`'s next produce request to
    /// `topic` fails with `TOPIC_AUTHORIZATION_FAILED`.
    pub fn revoke_produce(&self, user: &str, topic: &str) -> Result<()> {
        self.produce_acls("--remove", user, topic)
    }

    fn produce_acls(&self, action: &str, user: &str, topic: &str) -> Result<()> {
        if !self.acls {
            bail!("this Kafka has no authorizer: start it with KafkaOptions::acls");
        }
        check_credential("kafka ACL user name", user)?;
        let mut args: Vec<String> = vec!["--bootstrap-server".into(), self.bootstrap()];
        args.push(action.into());
        if action == "--remove" {
            // Otherwise it asks for a confirmation on stdin.
            args.push("--force".into());
        }
        for a in [
            "--allow-principal",
            &format!("User:{user}"),
            "--operation",
            "Write",
            "--operation",
            "Describe",
            "--topic",
            topic,
        ] {
            args.push(a.into());
        }
        kafka_node::run_tool(
            &self.libs,
            "org.apache.kafka.tools.AclCommand",
            &args,
            &self.dir.path().join("acl.log"),
            Duration::from_secs(60),
        )
        .with_context(|| format!("{action} produce ACLs of {user} on {topic}"))?;
        Ok(())
    }
}

/// What [`KafkaOptions::acls`] adds to `server.properties`. The `PLAINTEXT` and `CONTROLLER`
/// listeners authenticate nobody, so their principal is `ANONYMOUS`: as a super user it keeps
/// inter-broker and controller traffic and the tests' admin helpers working.
pub const KAFKA_ACL_PROPS: &str = "\
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:ANONYMOUS
allow.everyone.if.no.acl.found=false
";

/// The `server.properties` lines of the `SASL_SSL` listener and the `kafka-storage format`
/// arguments adding its SCRAM users; writes the keystore and the CA into `dir`.
fn sasl_ssl_props(sasl: &SaslSsl<'_>, dir: &Path) -> Result<(String, Vec<String>)> {
    let mut extra = String::new();
    let mut format_args = Vec::new();
    let keystore = dir.join("keystore.pem");
    let mut pem = String::new();
    for part in [
        sasl.pki.server_key(),
        sasl.pki.server_cert(),
        sasl.pki.ca_cert(),
    ] {
        pem.push_str(
            &fs::read_to_string(part).with_context(|| format!("read {}", part.display()))?,
        );
    }
    fs::write(&keystore, pem)?;
    let ca = dir.join("ca.pem");
    fs::copy(sasl.pki.ca_cert(), &ca)?;
    let l = "listener.name.sasl_ssl";
    extra.push_str(&format!(
        "{l}.sasl.enabled.mechanisms={mechanisms}\n\
         {l}.ssl.keystore.type=PEM\n\
         {l}.ssl.keystore.location={keystore}\n",
        mechanisms = KAFKA_SASL_MECHANISMS.join(","),
        keystore = keystore.display()
    ));
    if sasl.require_client_cert {
        extra.push_str(&format!(
            "{l}.ssl.client.auth=required\n\
             {l}.ssl.truststore.type=PEM\n\
             {l}.ssl.truststore.location={ca}\n",
            ca = ca.display()
        ));
    } else {
        extra.push_str(&format!("{l}.ssl.client.auth=none\n"));
    }
    extra.push_str(&format!(
        "{l}.scram-sha-512.sasl.jaas.config=\
         org.apache.kafka.common.security.scram.ScramLoginModule required;\n"
    ));
    let mut plain_users = String::new();
    for (user, password) in &sasl.plain_users {
        check_credential("kafka PLAIN user name", user)?;
        check_password("kafka PLAIN password", password)?;
        plain_users.push_str(&format!(
            " user_{user}={}",
            jaas_quoted_in_properties(password)
        ));
    }
    extra.push_str(&format!(
        "{l}.plain.sasl.jaas.config=\
         org.apache.kafka.common.security.plain.PlainLoginModule required{plain_users};\n"
    ));
    for (user, password) in &sasl.scram_sha512_users {
        check_credential("kafka SCRAM user name", user)?;
        check_credential("kafka SCRAM password", password)?;
        format_args.push("--add-scram".into());
        format_args.push(format!("SCRAM-SHA-512=[name={user},password={password}]"));
    }
    Ok((extra, format_args))
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
    /// The record's timestamp in ms since the epoch (CreateTime: when the producer produced it).
    pub timestamp_ms: Option<i64>,
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

    /// The first header of that name, as UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
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
    publish_as(port, client_id, None, qos, messages).await
}

/// [`publish`] with a user name and password, for a [`Mosquitto`] started with
/// [`MosquittoOptions::users`] (use its plaintext [`Mosquitto::port`]). Fails if the broker
/// refuses the connection.
pub async fn publish_as(
    port: u16,
    client_id: impl Into<String>,
    credentials: Option<(&str, &str)>,
    qos: rumqttc::QoS,
    messages: Vec<(String, Vec<u8>)>,
) -> Result<()> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet};
    let mut opts = MqttOptions::new(client_id, "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30))
        .set_inflight(200)
        .set_max_packet_size(1 << 24, 1 << 24);
    if let Some((user, password)) = credentials {
        opts.set_credentials(user, password);
    }
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
    disconnect(&client, &mut eventloop).await
}

/// Sends DISCONNECT and polls until it went out (at most 2 s), so the broker keeps a
/// persistent session as it was and discards nothing in flight.
pub async fn disconnect(
    client: &rumqttc::AsyncClient,
    eventloop: &mut rumqttc::EventLoop,
) -> Result<()> {
    use rumqttc::{Event, Outgoing};
    client.disconnect().await?;
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

/// What an MQTT 5 broker holds for `client_id`: connects without a clean start and returns
/// CONNACK's session present and how many queued messages the broker then delivered (it sends
/// them right after the CONNACK; 3 s of quiet ends the count). `keep`: leave the session in
/// place (expiry 1 h) rather than let it end with this connection (expiry 0).
pub async fn probe_session(
    host: IpAddr,
    port: u16,
    login: Option<(&str, &str)>,
    client_id: &str,
    keep: bool,
) -> Result<(bool, usize)> {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};
    let mut options = MqttOptions::new(client_id, host.to_string(), port);
    options.set_clean_start(false);
    options.set_session_expiry_interval(Some(if keep { 3600 } else { 0 }));
    if let Some((user, password)) = login {
        options.set_credentials(user, password);
    }
    let (client, mut events) = AsyncClient::new(options, 10);
    let mut present = None;
    let mut delivered = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        match tokio::time::timeout_at(deadline, events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => present = Some(ack.session_present),
            Ok(Ok(Event::Incoming(Packet::Publish(_)))) => delivered += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!("probing {client_id}'s session at {host}:{port}: {e}"),
            Err(_) => break,
        }
    }
    let present =
        present.ok_or_else(|| anyhow!("probing {client_id}'s session: no CONNACK in 3 s"))?;
    client.disconnect().await?;
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while events.poll().await.is_ok() {}
    })
    .await;
    Ok((present, delivered))
}

/// `lines` of a JSON log, parsed: each must be one flat object (a top-level `message`, every
/// value a scalar), which is what log collectors index. Fails naming the first line that is not.
pub fn flat_json_log<'a>(
    lines: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<serde_json::Value>> {
    lines
        .into_iter()
        .map(|line| {
            let value: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("not JSON: {line}"))?;
            let flat = value.as_object().is_some_and(|o| {
                o.get("message").is_some_and(serde_json::Value::is_string)
                    && o.values().all(|v| !v.is_object() && !v.is_array())
            });
            if !flat {
                bail!("not one flat object with a message: {line}");
            }
            Ok(value)
        })
        .collect()
}

/// A minimal HTTP/1.0 GET to `addr`: (status, body). Fails when nothing answers there, so a
/// check never passes on an empty body.
pub fn http_get_at(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    http_request(addr, "GET", path, &HttpOptions::default())
}

/// How [`http_request`] talks to a server beyond method and path.
#[derive(Debug, Default, Clone, Copy)]
pub struct HttpOptions<'a> {
    /// Sent as `application/json` (the Confluent schema registry API takes it).
    pub body: Option<&'a str>,
    /// HTTPS, trusting only this CA (PEM); the name checked is `addr`'s IP.
    pub tls_ca: Option<&'a Path>,
    /// `(user, password)` for HTTP basic authentication.
    pub basic_auth: Option<(&'a str, &'a str)>,
}

/// One HTTP/1.0 request to `addr`: (status, body). The server closes the connection after its
/// answer, which is never chunked; fails when nothing answers.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    options: &HttpOptions<'_>,
) -> Result<(u16, String)> {
    use base64::Engine as _;
    use std::io::Read as _;
    let what = format!("{method} {addr}{path}");
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some((user, password)) = options.basic_auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        request.push_str(&format!("Authorization: Basic {token}\r\n"));
    }
    if let Some(body) = options.body {
        request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    request.push_str("\r\n");
    request.push_str(options.body.unwrap_or(""));
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        .with_context(|| format!("{what}: cannot connect"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut answer = Vec::new();
    match options.tls_ca {
        None => {
            let mut tcp = tcp;
            tcp.write_all(request.as_bytes())?;
            tcp.read_to_end(&mut answer)
                .with_context(|| format!("{what}: reading the answer"))?;
        }
        Some(ca) => {
            let conn = rustls::ClientConnection::new(
                tls_client_config(ca)?,
                rustls::pki_types::ServerName::from(addr.ip()),
            )?;
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            tls.write_all(request.as_bytes())
                .with_context(|| format!("{what}: TLS"))?;
            match tls.read_to_end(&mut answer) {
                Ok(_) => {}
                // A peer that closes without close_notify, after a whole answer.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {}
                Err(e) => return Err(e).with_context(|| format!("{what}: reading the answer")),
            }
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{what}: not an HTTP answer: {text:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("{what}: no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}

/// A rustls client configuration trusting only the certificates in the PEM file `ca`.
fn tls_client_config(ca: &Path) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("read {}", ca.display()))?
    {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// [`http_get_at`] on 127.0.0.1: enough for `/readyz`, `/status` and `/metrics`.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    http_get_at(SocketAddr::from((Ipv4Addr::LOCALHOST, port)), path)
}

/// The body of a 200 answer to `GET path` at `addr`; any other status is an error.
pub fn http_get_ok(addr: SocketAddr, path: &str) -> Result<String> {
    match http_get_at(addr, path)? {
        (200, body) => Ok(body),
        (status, body) => bail!("GET {addr}{path}: {status}\n{body}"),
    }
}
