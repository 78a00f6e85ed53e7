//! The forwarders' MQTT sessions at the broker, and ending the ones nobody will resume.
//!
//! Each forwarder pod has a persistent session under a client id of its own
//! (`ferry.<namespace>.<pod>`), so a replaced pod picks up what the broker held for it. When a
//! pod goes for good (its group removed, its connection deleted, replicas scaled down), the
//! broker would keep queueing for that id until it runs out of memory. The operator records
//! every client id it started in the connection's status and, once such a pod is gone, connects
//! with that id and a clean start, which makes the broker discard the session, then
//! disconnects. What decides which ids to end is [`plan`], pure; [`end_session`] is the I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_api::crd::{MqttEndpoint, MqttProtocolVersion};
use k8s_openapi::ByteString;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use crate::render::keys;

/// On the BrokerConnection while its forwarders may hold sessions at the broker.
pub const FINALIZER: &str = "ferry.dev/mqtt-sessions";

/// The longest one session's ending may take (connect, CONNACK, DISCONNECT).
const END_TIMEOUT: Duration = Duration::from_secs(10);

/// The MQTT client id of forwarder pod `pod` in `namespace`.
pub fn client_id(namespace: &str, pod: &str) -> String {
    format!("ferry.{namespace}.{pod}")
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

/// A forwarder pod of the connection as the API server has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodState {
    /// Its container has started (phase other than `Pending`), so it may have connected and
    /// left a session at the broker. A pod that never ran left nothing to end.
    pub started: bool,
    /// Labelled with this connection. Another's pod of a recorded name runs that session now:
    /// the connection neither ends nor records it.
    pub ours: bool,
}

/// Which client ids to record and which to end, from the `recorded` ones, the groups that
/// exist now (`workload` → wanted replicas) and the connection's forwarder pods by name.
///
/// A group scaled to zero (or whose rules are all paused) keeps its sessions: it is expected
/// back and the broker holds its messages meanwhile. An id is ended only once no forwarder pod
/// of that name exists, this connection's or another's, so the operator never takes a session
/// over from a running forwarder.
pub fn plan(
    namespace: &str,
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
    let mut out = Plan::default();
    for (pod, state) in pods {
        if state.started && state.ours {
            out.keep.insert(client_id(namespace, pod));
        }
    }
    let prefix = client_id(namespace, "");
    for id in recorded {
        let pod = id.strip_prefix(&prefix);
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

    fn ids(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|p| client_id("ns", p)).collect()
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
            "ns",
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
            "ns",
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
        let gone = plan("ns", &all, &groups, &pods(&["plant-default-0"], &[]));
        assert_eq!(gone.end, ids(&["plant-default-1", "plant-default-2"]));
        assert_eq!(gone.keep, ids(&["plant-default-0"]));
        assert!(!gone.waiting_for_pods);
        // Ordinal 10 of a group scaled to 2 is gone too (numbers, not text).
        let p = plan(
            "ns",
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
        let p = plan("ns", &all, &groups, &pods(&[], &[]));
        assert_eq!(p.end, ids(&["plant-bulk-0", "plant-bulk-1"]));
        assert_eq!(p.keep, ids(&["plant-a-1-0", "plant-slow-0"]));
    }

    #[test]
    fn a_deleted_connection_ends_every_session_once_the_pods_are_gone() {
        let all = recorded(&["plant-default-0", "plant-default-1"]);
        let draining = plan(
            "ns",
            &all,
            &BTreeMap::new(),
            &pods(&["plant-default-1"], &[]),
        );
        assert_eq!(draining.end, ids(&["plant-default-0"]));
        assert!(draining.waiting_for_pods);
        let gone = plan("ns", &all, &BTreeMap::new(), &pods(&[], &[]));
        assert_eq!(gone.end, ids(&["plant-default-0", "plant-default-1"]));
        assert!(gone.keep.is_empty());
    }

    #[test]
    fn ids_of_other_shapes_are_ended_not_misread() {
        // Recorded by this connection, so ours to end, whatever they look like.
        let all = vec!["ferry.other.plant-default-0".to_owned(), "odd".to_owned()];
        let groups = BTreeMap::from([("plant-default".to_owned(), 1)]);
        let p = plan("ns", &all, &groups, &pods(&["plant-default-0"], &[]));
        assert_eq!(p.end, all.iter().cloned().collect());
    }

    #[test]
    fn a_session_whose_name_another_connections_pod_runs_is_neither_ended_nor_recorded() {
        let all = recorded(&["plant-east-bulk-0", "plant-default-0"]);
        let mut pods = pods(&["plant-default-0"], &[]);
        pods.insert(
            "plant-east-bulk-0".to_owned(),
            PodState {
                started: true,
                ours: false,
            },
        );
        // Deleting this connection: its own session ends, the other's live one is left alone.
        let p = plan("ns", &all, &BTreeMap::new(), &pods);
        assert!(p.end.is_empty(), "{p:?}");
        assert_eq!(p.keep, ids(&["plant-default-0"]));
        assert!(p.waiting_for_pods);
    }
}
