//! The forwarders' MQTT sessions at the broker, and ending the ones nobody will resume.
//!
//! Each forwarder pod has a persistent session under a client id of its own
//! (`<prefix><pod>`, see [`SessionPrefix`]), so a replaced pod picks up what the broker held
//! for it. When a pod goes for good (its group removed, its connection deleted, replicas scaled
//! down), the broker would keep queueing for that id until it runs out of memory. The operator
//! records every client id it started in the connection's status and, once such a pod is gone,
//! connects with that id and a clean start, which makes the broker discard the session, then
//! disconnects. What decides which ids to end is [`plan`], pure; [`end_session`] is the I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_api::crd::{BrokerConnection, MqttEndpoint, MqttProtocolVersion};
use k8s_openapi::ByteString;
use kube::ResourceExt;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use crate::render::{ENV_POD_NAME, ENV_POD_NAMESPACE, keys};

/// On the BrokerConnection while its forwarders may hold sessions at the broker.
pub const FINALIZER: &str = "ferry.dev/mqtt-sessions";

/// The longest one session's ending may take (connect, CONNACK, DISCONNECT).
const END_TIMEOUT: Duration = Duration::from_secs(10);

/// How many hex digits of the connection's UID its prefix carries. The API server's UIDs are
/// random (version 4) UUIDs, so these are 32 random bits: two connections of one name in one
/// namespace get the same prefix with a chance of about k²/2³³ over k incarnations (1 in 86
/// million for 10), and only incarnations whose sessions coexist count (an orphaned MQTT 5
/// session expires, after a day by default). Short enough to keep client ids readable.
const UID_DIGITS: usize = 8;

/// The start of a connection's MQTT client ids (`<prefix><pod>`) and shared-subscription group
/// names (`<prefix><workload>`), as its `status.sessionPrefix` records it.
///
/// `ferry.<namespace>.<8 hex digits of the UID>.`: a connection deleted without its sessions
/// ended (the operator absent, e.g. after `helm uninstall`) and created again under the same
/// name neither resumes the old sessions nor joins their share group, where an offline member
/// would take its share of every message and hold it. `ferry.<namespace>.` (legacy): a
/// connection whose forwarders had sessions before the UID was part of the name keeps them,
/// and the messages they hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionPrefix {
    prefix: String,
    /// Without the UID: another connection's pod of the same name would use the same id.
    legacy: bool,
}

impl SessionPrefix {
    /// The connection's prefix: the one its status records; else legacy when its status
    /// records client ids, none of them with its UID (sessions of an operator from before
    /// `sessionPrefix`); else with its UID. The same after an operator restart, from the
    /// object alone.
    pub fn of(connection: &BrokerConnection) -> SessionPrefix {
        let ns = connection.namespace().unwrap_or_default();
        let legacy = Self::legacy(&ns);
        // Only an object that never went through an API server has no UID.
        let Some(with_uid) = connection
            .uid()
            .as_deref()
            .and_then(|u| Self::with_uid(&ns, u))
        else {
            return legacy;
        };
        let status = connection.status.as_ref();
        if let Some(recorded) = status.and_then(|s| s.session_prefix.as_deref()) {
            return SessionPrefix {
                legacy: recorded == legacy.prefix,
                prefix: recorded.to_owned(),
            };
        }
        let sessions = status
            .map(|s| s.mqtt_sessions.as_slice())
            .unwrap_or_default();
        if !sessions.is_empty() && !sessions.iter().any(|id| with_uid.pod_of(id).is_some()) {
            return legacy;
        }
        with_uid
    }

    fn legacy(namespace: &str) -> SessionPrefix {
        SessionPrefix {
            prefix: format!("ferry.{namespace}."),
            legacy: true,
        }
    }

    fn with_uid(namespace: &str, uid: &str) -> Option<SessionPrefix> {
        let digits: String = uid
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(UID_DIGITS)
            .map(|c| c.to_ascii_lowercase())
            .collect();
        (digits.len() == UID_DIGITS).then(|| SessionPrefix {
            prefix: format!("ferry.{namespace}.{digits}."),
            legacy: false,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.prefix
    }

    /// Whether another connection's pod of a name this connection uses would have the same
    /// client id (only without the UID).
    pub fn is_legacy(&self) -> bool {
        self.legacy
    }

    /// The shared-subscription group of StatefulSet `workload`.
    pub fn shared_group(&self, workload: &str) -> String {
        format!("{}{workload}", self.prefix)
    }

    /// The pod whose client id `client_id` is, if it has this prefix.
    pub fn pod_of<'a>(&self, client_id: &'a str) -> Option<&'a str> {
        client_id.strip_prefix(&self.prefix)
    }

    /// The pod template's `--mqtt-client-id`, for Kubernetes to expand. The legacy one is the
    /// argument forwarders had before, so an upgrade does not restart their pods.
    pub fn client_id_arg(&self) -> String {
        if self.legacy {
            format!("ferry.$({ENV_POD_NAMESPACE}).$({ENV_POD_NAME})")
        } else {
            format!("{}$({ENV_POD_NAME})", self.prefix)
        }
    }
}

/// What `status.sessionPrefix` records.
impl From<SessionPrefix> for String {
    fn from(p: SessionPrefix) -> String {
        p.prefix
    }
}

/// The MQTT client id of the connection's forwarder pod `pod`.
pub fn client_id(prefix: &SessionPrefix, pod: &str) -> String {
    format!("{}{pod}", prefix.prefix)
}

/// What to do with the recorded sessions of one connection.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Client ids to record from now on: those of pods that have run, and those not ended yet.
    pub keep: BTreeSet<String>,
    /// Client ids whose pods are gone for good: end their sessions now.
    pub end: BTreeSet<String>,
    /// Some ids will be ended once their pods have gone (still terminating).
    pub waiting_for_pods: bool,
}

/// A forwarder pod of the namespace as the API server has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodState {
    /// Its container has started (phase other than `Pending`), so it may have connected and
    /// left a session at the broker. A pod that never ran left nothing to end.
    pub started: bool,
    /// Labelled with this connection. Another's pod of a recorded name runs that session now
    /// when the prefix is legacy (the same name gives the same id): the connection neither
    /// ends nor records it.
    pub ours: bool,
}

/// Which client ids to record and which to end, from the `recorded` ones, the groups that
/// exist now (`workload` → wanted replicas) and the connection's forwarder pods by name.
///
/// A group scaled to zero (or whose rules are all paused) keeps its sessions: it is expected
/// back and the broker holds its messages meanwhile. An id is ended only once no forwarder pod
/// of that name exists, this connection's or (with a legacy `prefix`) another's, so the
/// operator never takes a session over from a running forwarder.
pub fn plan(
    prefix: &SessionPrefix,
    recorded: &[String],
    groups: &BTreeMap<String, i32>,
    pods: &BTreeMap<String, PodState>,
) -> Plan {
    let wanted = |pod: &str| {
        workload_of(pod).is_some_and(|(w, ordinal)| {
            groups
                .get(w)
                .is_some_and(|replicas| *replicas == 0 || ordinal < replicas.unsigned_abs())
        })
    };
    // With the UID in the ids, another connection's pod never runs a session of ours.
    let pods: BTreeMap<&str, &PodState> = pods
        .iter()
        .filter(|(_, state)| state.ours || prefix.is_legacy())
        .map(|(pod, state)| (pod.as_str(), state))
        .collect();
    let mut out = Plan::default();
    for (pod, state) in &pods {
        if state.started && state.ours {
            out.keep.insert(client_id(prefix, pod));
        }
    }
    for id in recorded {
        let pod = prefix.pod_of(id);
        match pod.and_then(|p| pods.get(p)) {
            Some(state) if !state.ours => {}
            _ if pod.is_some_and(wanted) => {
                out.keep.insert(id.clone());
            }
            Some(_) => {
                out.keep.insert(id.clone());
                out.waiting_for_pods = true;
            }
            None => {
                out.end.insert(id.clone());
            }
        }
    }
    out
}

/// The StatefulSet and ordinal of pod `<workload>-<ordinal>`.
pub(crate) fn workload_of(pod: &str) -> Option<(&str, u32)> {
    let (workload, ordinal) = pod.rsplit_once('-')?;
    if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((workload, ordinal.parse().ok()?))
}

/// Whether `pod`'s container has started (a phase past `Pending`), so it may have connected
/// and left a session at the broker.
pub(crate) fn started(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    !matches!(phase, None | Some("Pending"))
}

/// Why a session could not be ended (the operator retries, then gives up with an Event).
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("the MQTT {what} in the referenced Secret is not UTF-8 text")]
    NotUtf8 { what: &'static str },
    #[error("spec.mqtt.tls: {0}")]
    Tls(String),
    #[error("MQTT broker {host}:{port}: {reason}")]
    Broker {
        host: String,
        port: u16,
        reason: String,
    },
    #[error("MQTT broker {host}:{port}: no answer within {timeout:?}")]
    Timeout {
        host: String,
        port: u16,
        timeout: Duration,
    },
}

/// How the operator reaches a connection's MQTT broker: its spec with the credentials and
/// certificates resolved from the referenced Secrets (the group Secret's keys).
#[derive(Clone)]
pub struct Broker {
    host: String,
    port: u16,
    protocol: MqttProtocolVersion,
    credentials: Option<(String, String)>,
    tls: Option<Arc<ClientConfig>>,
}

impl Broker {
    pub fn new(
        mqtt: &MqttEndpoint,
        secret_data: &BTreeMap<String, ByteString>,
    ) -> Result<Broker, SessionError> {
        let text = |key: &str, what: &'static str| -> Result<Option<String>, SessionError> {
            secret_data
                .get(key)
                .map(|v| String::from_utf8(v.0.clone()).map_err(|_| SessionError::NotUtf8 { what }))
                .transpose()
        };
        let credentials = match (
            text(keys::MQTT_USERNAME, "username")?,
            text(keys::MQTT_PASSWORD, "password")?,
        ) {
            (Some(user), Some(password)) => Some((user, password)),
            _ => None,
        };
        let tls = match &mqtt.tls {
            None => None,
            Some(t) => Some(Arc::new(tls_config(
                secret_data.get(keys::MQTT_CA).map(|v| v.0.as_slice()),
                t.use_system_roots,
                secret_data.get(keys::MQTT_CERT).map(|v| v.0.as_slice()),
                secret_data.get(keys::MQTT_KEY).map(|v| v.0.as_slice()),
            )?)),
        };
        Ok(Broker {
            host: mqtt.host.clone(),
            port: u16::try_from(mqtt.port).unwrap_or(ferry_api::defaults::MQTT_PORT),
            protocol: mqtt.protocol,
            credentials,
            tls,
        })
    }

    fn error(&self, reason: impl ToString) -> SessionError {
        SessionError::Broker {
            host: self.host.clone(),
            port: self.port,
            reason: reason.to_string(),
        }
    }
}

/// Ends the session of `client_id` at the broker: connects with it and a clean start (MQTT
/// 3.1.1: clean session), which discards the stored session and its queued messages, and
/// disconnects, which ends the new, empty one.
pub async fn end_session(broker: &Broker, client_id: &str) -> Result<(), SessionError> {
    let ended = async {
        match broker.protocol {
            MqttProtocolVersion::V311 => end_v311(broker, client_id).await,
            MqttProtocolVersion::V5 => end_v5(broker, client_id).await,
        }
    };
    tokio::time::timeout(END_TIMEOUT, ended)
        .await
        .map_err(|_| SessionError::Timeout {
            host: broker.host.clone(),
            port: broker.port,
            timeout: END_TIMEOUT,
        })?
}

async fn end_v311(broker: &Broker, client_id: &str) -> Result<(), SessionError> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Outgoing, Packet, Transport};
    let mut options = MqttOptions::new(client_id, &broker.host, broker.port);
    options.set_clean_session(true);
    options.set_keep_alive(Duration::from_secs(10));
    if let Some((user, password)) = &broker.credentials {
        options.set_credentials(user, password);
    }
    if let Some(tls) = &broker.tls {
        options.set_transport(Transport::tls_with_config(
            rumqttc::TlsConfiguration::Rustls(tls.clone()),
        ));
    }
    let (client, mut events) = AsyncClient::new(options, 4);
    loop {
        match events.poll().await.map_err(|e| broker.error(e))? {
            Event::Incoming(Packet::ConnAck(_)) => {
                client.disconnect().await.map_err(|e| broker.error(e))?;
            }
            Event::Outgoing(Outgoing::Disconnect) => return Ok(()),
            _ => {}
        }
    }
}

async fn end_v5(broker: &Broker, client_id: &str) -> Result<(), SessionError> {
    use rumqttc::Outgoing;
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};
    let mut options = MqttOptions::new(client_id, &broker.host, broker.port);
    options.set_clean_start(true);
    // Expiry 0: the new session ends with the connection.
    options.set_session_expiry_interval(Some(0));
    options.set_keep_alive(Duration::from_secs(10));
    if let Some((user, password)) = &broker.credentials {
        options.set_credentials(user, password);
    }
    if let Some(tls) = &broker.tls {
        options.set_transport(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Rustls(tls.clone()),
        ));
    }
    let (client, mut events) = AsyncClient::new(options, 4);
    loop {
        match events.poll().await.map_err(|e| broker.error(e))? {
            Event::Incoming(Packet::ConnAck(_)) => {
                client.disconnect().await.map_err(|e| broker.error(e))?;
            }
            Event::Outgoing(Outgoing::Disconnect) => return Ok(()),
            _ => {}
        }
    }
}

/// A rustls client config from the PEM bytes of the connection's Secrets: the broker's
/// certificate is always verified, against the CA or else the system's roots.
fn tls_config(
    ca: Option<&[u8]>,
    system_roots: bool,
    cert: Option<&[u8]>,
    key: Option<&[u8]>,
) -> Result<ClientConfig, SessionError> {
    let tls = |what: &str, e: &dyn std::fmt::Display| SessionError::Tls(format!("{what}: {e}"));
    let mut roots = RootCertStore::empty();
    if let Some(ca) = ca {
        for cert in CertificateDer::pem_slice_iter(ca) {
            let cert = cert.map_err(|e| tls("caSecretRef", &e))?;
            roots.add(cert).map_err(|e| tls("caSecretRef", &e))?;
        }
    }
    if system_roots || ca.is_none() {
        for cert in rustls_native_certs::load_native_certs().certs {
            // A broken system certificate is not ours to fail on; the rest still count.
            let _ = roots.add(cert);
        }
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| tls("protocol versions", &e))?
            .with_root_certificates(roots);
    match (cert, key) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls("clientCertSecretRef tls.crt", &e))?;
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|e| tls("clientCertSecretRef tls.key", &e))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| tls("clientCertSecretRef", &e))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prefix of connection `plant` in namespace `ns` as its YAML `status` has it.
    fn prefix_of(status: &str) -> SessionPrefix {
        let yaml = format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: BrokerConnection\n\
             metadata: {{ name: plant, namespace: ns, uid: 3F1C2D9E-0000-4000-8000-000000000001 }}\n\
             spec: {{ mqtt: {{ host: m }}, kafka: {{ bootstrapServers: [\"k:9092\"] }} }}\n\
             status: {status}\n"
        );
        let connection: BrokerConnection =
            serde_saphyr::from_str(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
        SessionPrefix::of(&connection)
    }

    fn uid_prefix() -> SessionPrefix {
        prefix_of("{}")
    }

    fn ids(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|p| client_id(&uid_prefix(), p)).collect()
    }

    fn recorded(names: &[&str]) -> Vec<String> {
        ids(names).into_iter().collect()
    }

    fn pods(started: &[&str], pending: &[&str]) -> BTreeMap<String, PodState> {
        let state = |started| PodState {
            started,
            ours: true,
        };
        started
            .iter()
            .map(|p| ((*p).to_owned(), state(true)))
            .chain(pending.iter().map(|p| ((*p).to_owned(), state(false))))
            .collect()
    }

    #[test]
    fn pods_that_ran_are_recorded_and_pods_that_never_ran_are_not() {
        let groups = BTreeMap::from([("plant-default".to_owned(), 2)]);
        let p = plan(
            &uid_prefix(),
            &[],
            &groups,
            &pods(&["plant-default-0"], &["plant-default-1"]),
        );
        assert_eq!(p.keep, ids(&["plant-default-0"]));
        assert!(p.end.is_empty() && !p.waiting_for_pods);
    }

    #[test]
    fn scaling_down_ends_the_sessions_of_the_removed_ordinals_once_their_pods_are_gone() {
        let all = recorded(&["plant-default-0", "plant-default-1", "plant-default-2"]);
        let groups = BTreeMap::from([("plant-default".to_owned(), 1)]);
        let terminating = plan(
            &uid_prefix(),
            &all,
            &groups,
            &pods(&["plant-default-0", "plant-default-2"], &[]),
        );
        assert_eq!(terminating.end, ids(&["plant-default-1"]));
        assert!(terminating.waiting_for_pods);
        assert_eq!(
            terminating.keep,
            ids(&["plant-default-0", "plant-default-2"])
        );
        let gone = plan(
            &uid_prefix(),
            &all,
            &groups,
            &pods(&["plant-default-0"], &[]),
        );
        assert_eq!(gone.end, ids(&["plant-default-1", "plant-default-2"]));
        assert_eq!(gone.keep, ids(&["plant-default-0"]));
        assert!(!gone.waiting_for_pods);
        // Ordinal 10 of a group scaled to 2 is gone too (numbers, not text).
        let p = plan(
            &uid_prefix(),
            &recorded(&["plant-default-10"]),
            &BTreeMap::from([("plant-default".to_owned(), 2)]),
            &pods(&[], &[]),
        );
        assert_eq!(p.end, ids(&["plant-default-10"]));
    }

    #[test]
    fn a_removed_group_ends_all_its_sessions_and_a_paused_one_keeps_them() {
        let all = recorded(&[
            "plant-bulk-0",
            "plant-bulk-1",
            "plant-slow-0",
            "plant-a-1-0",
        ]);
        // "plant-a-1" is group "a-1": its pod is "plant-a-1-0", not ordinal "1-0" of "a".
        let groups = BTreeMap::from([("plant-slow".to_owned(), 0), ("plant-a-1".to_owned(), 1)]);
        let p = plan(&uid_prefix(), &all, &groups, &pods(&[], &[]));
        assert_eq!(p.end, ids(&["plant-bulk-0", "plant-bulk-1"]));
        assert_eq!(p.keep, ids(&["plant-a-1-0", "plant-slow-0"]));
    }

    #[test]
    fn a_deleted_connection_ends_every_session_once_the_pods_are_gone() {
        let all = recorded(&["plant-default-0", "plant-default-1"]);
        let draining = plan(
            &uid_prefix(),
            &all,
            &BTreeMap::new(),
            &pods(&["plant-default-1"], &[]),
        );
        assert_eq!(draining.end, ids(&["plant-default-0"]));
        assert!(draining.waiting_for_pods);
        let gone = plan(&uid_prefix(), &all, &BTreeMap::new(), &pods(&[], &[]));
        assert_eq!(gone.end, ids(&["plant-default-0", "plant-default-1"]));
        assert!(gone.keep.is_empty());
    }

    #[test]
    fn ids_of_other_shapes_are_ended_not_misread() {
        // Recorded by this connection, so ours to end, whatever they look like (the first is
        // the legacy id of the pod that runs).
        let all = vec![
            "ferry.ns.plant-default-0".to_owned(),
            "ferry.other.plant-default-0".to_owned(),
            "odd".to_owned(),
        ];
        let groups = BTreeMap::from([("plant-default".to_owned(), 1)]);
        let p = plan(
            &uid_prefix(),
            &all,
            &groups,
            &pods(&["plant-default-0"], &[]),
        );
        assert_eq!(p.end, all.iter().cloned().collect());
    }

    #[test]
    fn a_session_whose_name_another_connections_pod_runs_is_neither_ended_nor_recorded() {
        let legacy = prefix_of("{ mqttSessions: [ferry.ns.plant-default-0] }");
        let all: Vec<String> = ["plant-east-bulk-0", "plant-default-0"]
            .iter()
            .map(|p| client_id(&legacy, p))
            .collect();
        let mut pods = pods(&["plant-default-0"], &[]);
        let foreign = PodState {
            started: true,
            ours: false,
        };
        pods.insert("plant-east-bulk-0".to_owned(), foreign);
        // Deleting this connection: its own session ends, the other's live one is left alone.
        let p = plan(&legacy, &all, &BTreeMap::new(), &pods);
        assert!(p.end.is_empty(), "{p:?}");
        assert_eq!(
            p.keep,
            BTreeSet::from([client_id(&legacy, "plant-default-0")])
        );
        assert!(p.waiting_for_pods);

        // With the UID in the ids, the other connection's pod runs a session of its own.
        let p = plan(
            &uid_prefix(),
            &recorded(&["plant-east-bulk-0"]),
            &BTreeMap::new(),
            &pods,
        );
        assert_eq!(p.end, ids(&["plant-east-bulk-0"]));
    }

    #[test]
    fn a_new_connection_names_its_sessions_with_its_uid_and_keeps_the_name() {
        let p = uid_prefix();
        assert_eq!(p.as_str(), "ferry.ns.3f1c2d9e.");
        assert!(!p.is_legacy());
        assert_eq!(client_id(&p, "plant-b-1"), "ferry.ns.3f1c2d9e.plant-b-1");
        assert_eq!(p.shared_group("plant-b"), "ferry.ns.3f1c2d9e.plant-b");
        assert_eq!(p.client_id_arg(), "ferry.ns.3f1c2d9e.$(POD_NAME)");
        // Once it records sessions, and once it records the prefix.
        assert_eq!(
            prefix_of("{ mqttSessions: [ferry.ns.3f1c2d9e.plant-b-0] }"),
            p
        );
        assert_eq!(prefix_of("{ sessionPrefix: ferry.ns.3f1c2d9e. }"), p);
    }

    #[test]
    fn a_connection_with_sessions_of_the_older_scheme_keeps_their_ids() {
        // An operator from before `sessionPrefix` recorded these: the pods keep their sessions.
        let legacy = prefix_of("{ mqttSessions: [ferry.ns.plant-b-0, ferry.ns.plant-b-1] }");
        assert!(legacy.is_legacy());
        assert_eq!(legacy.as_str(), "ferry.ns.");
        assert_eq!(client_id(&legacy, "plant-b-1"), "ferry.ns.plant-b-1");
        assert_eq!(legacy.shared_group("plant-b"), "ferry.ns.plant-b");
        assert_eq!(
            legacy.client_id_arg(),
            "ferry.$(POD_NAMESPACE).$(POD_NAME)",
            "the argument the pods already run with: no restart on upgrade"
        );
        // Recorded, it stays legacy when every session has ended.
        assert_eq!(prefix_of("{ sessionPrefix: ferry.ns. }"), legacy);
    }
}
