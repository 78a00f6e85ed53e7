//! The MQTT side: one task owns rumqttc's event loop (MQTT 3.1.1 or 5) and hands PUBLISHes to
//! the pipeline through a bounded channel. Acks travel back through rumqttc's request channel
//! (`try_ack` from the pipeline task), never from this task, so neither side can wait on the
//! other in a cycle.
//!
//! Backpressure: this task takes a channel permit *before* it polls for the next packet. While
//! the pipeline is full it stops reading the socket, and the broker holds the messages. With
//! MQTT 5 the window is also announced as Receive Maximum, so the broker itself stops sending.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_api::config::{MqttConfig, MqttProtocol};
use rand::Rng as _;
use rumqttc::v5::mqttbytes::v5 as m5;
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::metrics::Metrics;
use crate::tls::{self, TlsSetupError};

/// MQTT's own maximum packet size: never refuse to read a message (an oversize message would
/// otherwise drop the connection, be redelivered, and wedge the session); Kafka's size limit is
/// handled as a permanent produce failure instead.
const MAX_PACKET_SIZE: usize = 268_435_455;
/// How long to wait, after DISCONNECT, for the broker to close the connection.
const LINGER_BOUND: Duration = Duration::from_secs(2);

/// One PUBLISH as the pipeline sees it, whatever the protocol version.
#[derive(Debug, Clone)]
pub struct Message {
    pub topic: String,
    pub payload: Bytes,
    pub qos: u8,
    pub pkid: u16,
    pub retain: bool,
    /// MQTT 5 only.
    pub content_type: Option<String>,
    /// MQTT 5 only.
    pub user_properties: Vec<(String, String)>,
}

/// The handle the pipeline acks and (re)subscribes through.
#[derive(Clone)]
pub enum Client {
    V4(rumqttc::AsyncClient),
    V5(rumqttc::v5::AsyncClient),
}

#[derive(Debug, thiserror::Error)]
#[error("mqtt request not queued: {0}")]
pub struct RequestError(String);

impl Client {
    /// PUBACK (QoS 1) or PUBREC (QoS 2); QoS 0 needs none.
    pub fn try_ack(&self, qos: u8, pkid: u16) -> Result<(), RequestError> {
        match self {
            Self::V4(c) => {
                let mut p = rumqttc::Publish::new("", v4_qos(qos), Vec::new());
                p.pkid = pkid;
                c.try_ack(&p).map_err(|e| RequestError(e.to_string()))
            }
            Self::V5(c) => {
                let mut p = m5::Publish::new("", v5_qos(qos), Vec::new(), None);
                p.pkid = pkid;
                c.try_ack(&p).map_err(|e| RequestError(e.to_string()))
            }
        }
    }

    pub fn try_subscribe(&self, filters: &[(String, u8)]) -> Result<(), RequestError> {
        if filters.is_empty() {
            return Ok(());
        }
        match self {
            Self::V4(c) => c
                .try_subscribe_many(
                    filters
                        .iter()
                        .map(|(f, q)| rumqttc::SubscribeFilter::new(f.clone(), v4_qos(*q))),
                )
                .map_err(|e| RequestError(e.to_string())),
            Self::V5(c) => c
                .try_subscribe_many(filters.iter().map(|(f, q)| m5::Filter::new(f, v5_qos(*q))))
                .map_err(|e| RequestError(e.to_string())),
        }
    }

    pub fn try_unsubscribe(&self, filter: &str) -> Result<(), RequestError> {
        match self {
            Self::V4(c) => c
                .try_unsubscribe(filter)
                .map_err(|e| RequestError(e.to_string())),
            Self::V5(c) => c
                .try_unsubscribe(filter)
                .map_err(|e| RequestError(e.to_string())),
        }
    }

    pub fn try_disconnect(&self) -> Result<(), RequestError> {
        match self {
            Self::V4(c) => c.try_disconnect().map_err(|e| RequestError(e.to_string())),
            Self::V5(c) => c.try_disconnect().map_err(|e| RequestError(e.to_string())),
        }
    }
}

fn v4_qos(level: u8) -> rumqttc::QoS {
    match level {
        0 => rumqttc::QoS::AtMostOnce,
        1 => rumqttc::QoS::AtLeastOnce,
        _ => rumqttc::QoS::ExactlyOnce,
    }
}

fn v5_qos(level: u8) -> rumqttc::v5::mqttbytes::QoS {
    match level {
        0 => rumqttc::v5::mqttbytes::QoS::AtMostOnce,
        1 => rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        _ => rumqttc::v5::mqttbytes::QoS::ExactlyOnce,
    }
}

/// What the reader needs from an event, whatever the protocol version.
#[derive(Debug)]
pub enum SessionEvent {
    Publish(Message),
    ConnAck {
        session_present: bool,
    },
    /// Per filter, in subscribe order: whether the broker granted it.
    SubAck(Vec<bool>),
    PubRecSent(u16),
    PubCompSent(u16),
    DisconnectSent,
    Other,
}

/// Why a connection attempt or connection failed.
#[derive(Debug)]
pub enum SessionError {
    /// A PUBREL for a QoS 2 id rumqttc forgot (see `Reader::owed_pubcomp`).
    UnsolicitedPubRel(u16),
    /// The broker's certificate did not verify: retrying cannot fix it.
    Certificate(String),
    /// The broker refused the CONNECT (credentials, client id, authorization).
    Refused(String),
    Other(String),
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnsolicitedPubRel(pkid) => write!(f, "pubrel for unknown packet id {pkid}"),
            Self::Certificate(e) => write!(f, "TLS certificate verification failed: {e}"),
            Self::Refused(code) => write!(f, "connection refused: {code}"),
            Self::Other(e) => f.write_str(e),
        }
    }
}

/// One of rumqttc's two event loops.
pub trait Session: Send + 'static {
    fn poll(&mut self) -> impl Future<Output = Result<SessionEvent, SessionError>> + Send;
    /// Makes rumqttc expect the PUBREL of an incoming QoS 2 message it has forgotten.
    fn expect_pubrel(&mut self, pkid: u16);
}

pub struct V4Session(rumqttc::EventLoop);
pub struct V5Session(rumqttc::v5::EventLoop);

impl Session for V4Session {
    async fn poll(&mut self) -> Result<SessionEvent, SessionError> {
        use rumqttc::{ConnectionError, Event, Outgoing, Packet, StateError, SubscribeReasonCode};
        match self.0.poll().await {
            Ok(Event::Incoming(Packet::Publish(p))) => Ok(SessionEvent::Publish(Message {
                topic: p.topic,
                payload: p.payload,
                qos: p.qos as u8,
                pkid: p.pkid,
                retain: p.retain,
                content_type: None,
                user_properties: Vec::new(),
            })),
            Ok(Event::Incoming(Packet::ConnAck(a))) => Ok(SessionEvent::ConnAck {
                session_present: a.session_present,
            }),
            Ok(Event::Incoming(Packet::SubAck(a))) => Ok(SessionEvent::SubAck(
                a.return_codes
                    .iter()
                    .map(|c| matches!(c, SubscribeReasonCode::Success(_)))
                    .collect(),
            )),
            Ok(Event::Outgoing(Outgoing::PubRec(pkid))) => Ok(SessionEvent::PubRecSent(pkid)),
            Ok(Event::Outgoing(Outgoing::PubComp(pkid))) => Ok(SessionEvent::PubCompSent(pkid)),
            Ok(Event::Outgoing(Outgoing::Disconnect)) => Ok(SessionEvent::DisconnectSent),
            Ok(_) => Ok(SessionEvent::Other),
            Err(ConnectionError::MqttState(StateError::Unsolicited(pkid))) => {
                Err(SessionError::UnsolicitedPubRel(pkid))
            }
            Err(ConnectionError::ConnectionRefused(code)) => {
                Err(SessionError::Refused(format!("{code:?}")))
            }
            Err(ConnectionError::Tls(e)) => Err(tls_error(&e)),
            Err(e) => Err(SessionError::Other(e.to_string())),
        }
    }

    fn expect_pubrel(&mut self, pkid: u16) {
        let mut marker = rumqttc::Publish::new("", rumqttc::QoS::ExactlyOnce, Vec::new());
        marker.pkid = pkid;
        if self
            .0
            .state
            .handle_incoming_packet(rumqttc::Incoming::Publish(marker))
            .is_ok()
        {
            self.0.state.events.pop_back();
        }
    }
}

impl Session for V5Session {
    async fn poll(&mut self) -> Result<SessionEvent, SessionError> {
        use rumqttc::Outgoing;
        use rumqttc::v5::mqttbytes::v5::Packet;
        use rumqttc::v5::{ConnectionError, Event, StateError};
        match self.0.poll().await {
            Ok(Event::Incoming(Packet::Publish(p))) => {
                let props = p.properties.unwrap_or_default();
                Ok(SessionEvent::Publish(Message {
                    // MQTT requires UTF-8 topics; rumqttc hands them over as bytes.
                    topic: String::from_utf8_lossy(&p.topic).into_owned(),
                    payload: p.payload,
                    qos: p.qos as u8,
                    pkid: p.pkid,
                    retain: p.retain,
                    content_type: props.content_type,
                    user_properties: props.user_properties,
                }))
            }
            Ok(Event::Incoming(Packet::ConnAck(a))) => Ok(SessionEvent::ConnAck {
                session_present: a.session_present,
            }),
            Ok(Event::Incoming(Packet::SubAck(a))) => Ok(SessionEvent::SubAck(
                a.return_codes
                    .iter()
                    .map(|c| matches!(c, m5::SubscribeReasonCode::Success(_)))
                    .collect(),
            )),
            Ok(Event::Outgoing(Outgoing::PubRec(pkid))) => Ok(SessionEvent::PubRecSent(pkid)),
            Ok(Event::Outgoing(Outgoing::PubComp(pkid))) => Ok(SessionEvent::PubCompSent(pkid)),
            Ok(Event::Outgoing(Outgoing::Disconnect)) => Ok(SessionEvent::DisconnectSent),
            Ok(_) => Ok(SessionEvent::Other),
            Err(ConnectionError::MqttState(StateError::Unsolicited(pkid))) => {
                Err(SessionError::UnsolicitedPubRel(pkid))
            }
            Err(ConnectionError::ConnectionRefused(code)) => {
                Err(SessionError::Refused(format!("{code:?}")))
            }
            Err(ConnectionError::Tls(e)) => Err(tls_error(&e)),
            Err(e) => Err(SessionError::Other(e.to_string())),
        }
    }

    fn expect_pubrel(&mut self, pkid: u16) {
        let mut marker = m5::Publish::new("", v5_qos(2), Vec::new(), None);
        marker.pkid = pkid;
        if self
            .0
            .state
            .handle_incoming_packet(m5::Packet::Publish(marker))
            .is_ok()
        {
            self.0.state.events.pop_back();
        }
    }
}

fn tls_error(e: &rumqttc::TlsError) -> SessionError {
    match tls::certificate_error(e) {
        Some(reason) => SessionError::Certificate(reason),
        None => SessionError::Other(format!("TLS: {e}")),
    }
}

/// A connected client handle and the session to drive, for the configured protocol.
pub enum Connection {
    V4(Client, Box<V4Session>),
    V5(Client, Box<V5Session>),
}

/// `unacked_bound` is the most messages that can be read and not yet acknowledged (window plus
/// hand-over); the request channel gets room for all their acks plus control requests, so the
/// pipeline's `try_ack` never finds it full.
pub fn connect(cfg: &MqttConfig, unacked_bound: usize) -> Result<Connection, TlsSetupError> {
    let cap = unacked_bound + 64;
    let keep_alive = Duration::from_secs(u64::from(cfg.keep_alive_secs));
    let password = || {
        cfg.password
            .as_ref()
            .map(|p| p.expose().to_owned())
            .unwrap_or_default()
    };
    let transport = match &cfg.tls {
        Some(t) => Some(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Rustls(Arc::new(tls::client_config(t)?)),
        )),
        None => None,
    };
    Ok(match cfg.protocol {
        MqttProtocol::V311 => {
            let mut o =
                rumqttc::MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
            o.set_keep_alive(keep_alive)
                .set_clean_session(cfg.clean_session)
                .set_manual_acks(true)
                .set_max_packet_size(MAX_PACKET_SIZE, MAX_PACKET_SIZE);
            if let Some(user) = &cfg.username {
                o.set_credentials(user.clone(), password());
            }
            if let Some(t) = transport {
                o.set_transport(t);
            }
            let (client, eventloop) = rumqttc::AsyncClient::new(o, cap);
            Connection::V4(Client::V4(client), Box::new(V4Session(eventloop)))
        }
        MqttProtocol::V5 => {
            let mut o =
                rumqttc::v5::MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
            let expiry =
                cfg.session_expiry_secs
                    .unwrap_or(if cfg.clean_session { 0 } else { u32::MAX });
            o.set_keep_alive(keep_alive)
                .set_clean_start(cfg.clean_session)
                .set_manual_acks(true)
                .set_session_expiry_interval(Some(expiry))
                .set_receive_maximum(Some(cfg.max_inflight))
                .set_max_packet_size(Some(MAX_PACKET_SIZE as u32))
                .set_request_channel_capacity(cap);
            if let Some(user) = &cfg.username {
                o.set_credentials(user.clone(), password());
            }
            if let Some(t) = transport {
                o.set_transport(t);
            }
            let (client, eventloop) = rumqttc::v5::AsyncClient::new(o, cap);
            Connection::V5(Client::V5(client), Box::new(V5Session(eventloop)))
        }
    })
}

/// How the reader ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ReaderExit {
    /// The DISCONNECT was written after the pipeline's last acks.
    Disconnected,
    /// The connection failed while draining; unacked messages will be redelivered.
    ConnectionLost,
    /// Before the first successful connection, an error retrying cannot fix.
    Fatal(String),
}

/// The filters to (re)subscribe on every connect; the pipeline updates them on reload.
pub type Subscriptions = Arc<Mutex<Vec<(String, u8)>>>;

pub struct Reader<S> {
    session: S,
    client: Client,
    host: String,
    subscriptions: Subscriptions,
    reconnect_min: Duration,
    reconnect_max: Duration,
    metrics: Arc<Metrics>,
    /// QoS 2 packet ids we sent PUBREC for and the broker has not yet released. rumqttc forgets
    /// them on reconnect and then treats the broker's re-sent PUBREL as a protocol error, which
    /// would reconnect forever; see `remember_owed_pubrels`.
    owed_pubcomp: BTreeSet<u16>,
    ever_connected: bool,
}

impl<S: Session> Reader<S> {
    pub fn new(
        session: S,
        client: Client,
        cfg: &MqttConfig,
        subscriptions: Subscriptions,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            session,
            client,
            host: format!("{}:{}", cfg.host, cfg.port),
            subscriptions,
            reconnect_min: Duration::from_millis(cfg.reconnect_min_ms),
            reconnect_max: Duration::from_millis(cfg.reconnect_max_ms),
            metrics,
            owed_pubcomp: BTreeSet::new(),
            ever_connected: false,
        }
    }

    /// Reads until the pipeline closes its end of `to_pipeline`, then keeps the connection
    /// going only to flush the last acks and the DISCONNECT the pipeline queued.
    pub async fn run(mut self, to_pipeline: mpsc::Sender<Message>) -> ReaderExit {
        let mut failures: u32 = 0;
        loop {
            let Ok(permit) = to_pipeline.reserve().await else {
                return self.drain().await;
            };
            match self.session.poll().await {
                Ok(SessionEvent::Publish(message)) => {
                    self.metrics.received[usize::from(message.qos.min(2))].inc();
                    permit.send(message);
                }
                Ok(event) => {
                    drop(permit);
                    if self.on_event(event) {
                        failures = 0;
                    }
                }
                Err(e) => {
                    drop(permit);
                    if let Some(fatal) = self.on_connection_error(&e) {
                        return ReaderExit::Fatal(fatal);
                    }
                    failures = failures.saturating_add(1);
                    // A PUBREL we could not answer: reconnect at once, now that we know its id.
                    if !matches!(e, SessionError::UnsolicitedPubRel(_)) {
                        tokio::time::sleep(backoff(
                            self.reconnect_min,
                            self.reconnect_max,
                            failures,
                        ))
                        .await;
                    }
                }
            }
        }
    }

    async fn drain(mut self) -> ReaderExit {
        loop {
            match self.session.poll().await {
                Ok(SessionEvent::DisconnectSent) => {
                    self.metrics.set_mqtt_connected(false);
                    self.linger().await;
                    info!("mqtt disconnected cleanly");
                    return ReaderExit::Disconnected;
                }
                // Not handed to the pipeline and never acked: the broker redelivers it.
                Ok(SessionEvent::Publish(_)) => {}
                Ok(event) => {
                    self.on_event(event);
                }
                Err(e) => {
                    self.metrics.set_mqtt_connected(false);
                    warn!(error = %e, "mqtt connection lost while draining; unacknowledged messages will be redelivered");
                    return ReaderExit::ConnectionLost;
                }
            }
        }
    }

    /// Keeps reading (and discarding) after the DISCONNECT was written, until the broker closes
    /// the connection. Closing a socket with unread PUBLISHes in its receive buffer makes the
    /// kernel send a reset, and a reset makes the broker's kernel discard what it had not read
    /// yet: our last acks and the DISCONNECT itself. Measured before this: ~1.5k–2.5k of 20k
    /// messages replayed after a clean SIGTERM.
    async fn linger(&mut self) {
        let closed = tokio::time::timeout(LINGER_BOUND, async {
            while self.session.poll().await.is_ok() {}
        })
        .await;
        if closed.is_err() {
            debug!("mqtt broker did not close the connection after DISCONNECT");
        }
    }

    /// Returns true when the event shows a working connection (resets the backoff).
    fn on_event(&mut self, event: SessionEvent) -> bool {
        match event {
            SessionEvent::ConnAck { session_present } => {
                self.ever_connected = true;
                self.metrics.set_mqtt_connected(true);
                info!(session_present, broker = %self.host, "mqtt connected");
                // Subscribing again on every connect is harmless with a resumed session and
                // required without one.
                let subs = self.current_subscriptions();
                if let Err(e) = self.client.try_subscribe(&subs) {
                    error!(error = %e, "cannot queue mqtt subscribe");
                }
                true
            }
            SessionEvent::SubAck(granted) => {
                self.metrics.set_mqtt_subscribed();
                let subs = self.current_subscriptions();
                // A SUBACK answers the full list sent on connect, or the filters a reload added.
                let names: Vec<&str> = if granted.len() == subs.len() {
                    subs.iter().map(|(f, _)| f.as_str()).collect()
                } else {
                    Vec::new()
                };
                for (i, ok) in granted.iter().enumerate() {
                    let filter = names.get(i).copied().unwrap_or("(added by a reload)");
                    if *ok {
                        debug!(filter, "subscribed");
                    } else {
                        error!(
                            filter,
                            "mqtt broker refused the subscription (check its ACL)"
                        );
                        self.metrics
                            .mqtt_error(format!("broker refused the subscription to {filter:?}"));
                    }
                }
                true
            }
            SessionEvent::PubRecSent(pkid) => {
                self.owed_pubcomp.insert(pkid);
                false
            }
            SessionEvent::PubCompSent(pkid) => {
                self.owed_pubcomp.remove(&pkid);
                false
            }
            SessionEvent::Publish(_) | SessionEvent::DisconnectSent | SessionEvent::Other => false,
        }
    }

    fn current_subscriptions(&self) -> Vec<(String, u8)> {
        self.subscriptions
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    /// Logs and records the error; returns the reason when the forwarder should stop.
    fn on_connection_error(&mut self, e: &SessionError) -> Option<String> {
        let was_connected = self.metrics.health.mqtt_connected();
        self.metrics.set_mqtt_connected(false);
        match e {
            SessionError::UnsolicitedPubRel(pkid) => {
                self.owed_pubcomp.insert(*pkid);
                debug!(
                    pkid,
                    "pubrel for a qos 2 message received before a restart; answering it after reconnect"
                );
            }
            SessionError::Certificate(_) | SessionError::Refused(_) if !self.ever_connected => {
                let reason = format!("mqtt broker {}: {e}", self.host);
                error!(error = %e, broker = %self.host, "cannot connect to the mqtt broker, and retrying will not help");
                self.metrics.mqtt_error(reason.clone());
                return Some(reason);
            }
            SessionError::Refused(_) | SessionError::Certificate(_) => {
                error!(error = %e, broker = %self.host, "mqtt broker refused the connection");
                self.metrics.mqtt_error(e.to_string());
            }
            _ if was_connected => {
                warn!(error = %e, broker = %self.host, "mqtt connection lost; reconnecting");
                self.metrics.mqtt_error(e.to_string());
            }
            _ => {
                debug!(error = %e, broker = %self.host, "mqtt connect failed; retrying");
                self.metrics.mqtt_error(e.to_string());
            }
        }
        self.remember_owed_pubrels();
        None
    }

    /// Re-teaches rumqttc (after it cleared its state on the error) the QoS 2 ids whose PUBREL
    /// the broker will send again, so it answers with PUBCOMP as MQTT §4.3.3 requires.
    fn remember_owed_pubrels(&mut self) {
        for &pkid in &self.owed_pubcomp {
            self.session.expect_pubrel(pkid);
        }
    }
}

/// Exponential backoff with jitter: between half and all of min·2^(n-1), capped at max.
pub fn backoff(min: Duration, max: Duration, failures: u32) -> Duration {
    let exp = min.saturating_mul(1u32 << failures.saturating_sub(1).min(20));
    let cap = exp.min(max);
    let half = cap / 2;
    half + rand::rng().random_range(Duration::ZERO..=half)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(10));
        for _ in 0..100 {
            let first = backoff(min, max, 1);
            assert!(first >= Duration::from_millis(50) && first <= min);
            let later = backoff(min, max, 30);
            assert!(later >= Duration::from_secs(5) && later <= max);
        }
        let samples: BTreeSet<_> = (0..50).map(|_| backoff(min, max, 5)).collect();
        assert!(samples.len() > 1, "jitter");
    }
}
