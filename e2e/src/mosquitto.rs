//! A real Mosquitto broker: plaintext or TLS listeners, users, persistence, denied filters.

use std::fs;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};

use crate::credentials::{check_credential, check_password};
use crate::pki::Pki;
use crate::process::{Placement, free_port, spawn_tied, terminate, wait_for_addr, which};

/// Mosquitto's flow-control settings used everywhere, printed by the tests and benchmarks:
/// 1000 unacknowledged messages in flight toward a client (as a production broker serving a
/// forwarder would be set; the default of 20 caps throughput at 20 per Kafka round trip), and
/// a queue large enough to hold every test's backlog for an offline or slow persistent session.
pub const MOSQUITTO_MAX_INFLIGHT: u32 = 1000;
pub const MOSQUITTO_MAX_QUEUED: u32 = 2_000_000;

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
