//! A real single-node Apache Kafka (KRaft): `PLAINTEXT`, `SASL_SSL` and proxied listeners,
//! ACLs, and the admin helpers the tests use.

use std::fs;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use rdkafka::ClientConfig;

use crate::credentials::{check_credential, check_password};
use crate::fault_proxy::FaultProxy;
use crate::kafka_node::{self, Listener, NodeProps};
use crate::messages::Record;
use crate::pki::Pki;
use crate::process::{Placement, cache_dir, free_port, terminate, wait_for_addr};

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
    jvm: &'static [&'static str],
}

/// The Apache Kafka whose jars `install.sh` fetches: `<kafka.version>` of `e2e/kafka/pom.xml`,
/// read by `build.rs`.
pub const KAFKA_VERSION: &str = env!("FERRY_KAFKA_VERSION");

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
    /// The JVM's full JIT ([`kafka_node::BROKER_JVM_PEAK`]), for the benchmarks' load; a test's
    /// broker runs the C1 compiler only, which costs less CPU to start and to idle.
    pub peak_throughput: bool,
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
            jvm: if options.peak_throughput {
                kafka_node::BROKER_JVM_PEAK
            } else {
                kafka_node::BROKER_JVM
            },
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
        let mut child =
            kafka_node::spawn_kafka(&self.placement, &self.libs, &props, &log, self.jvm)?;
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

#[cfg(test)]
mod tests {
    use super::KAFKA_VERSION;

    #[test]
    fn kafka_version_is_the_poms_and_looks_like_a_release() {
        let parts: Vec<&str> = KAFKA_VERSION.split('.').collect();
        assert!(
            parts.len() == 3 && parts.iter().all(|p| p.parse::<u32>().is_ok()),
            "KAFKA_VERSION {KAFKA_VERSION:?} is not a release version like 4.1.1"
        );
        let pom = include_str!("../kafka/pom.xml");
        assert!(pom.contains(&format!("<kafka.version>{KAFKA_VERSION}</kafka.version>")));
    }
}
