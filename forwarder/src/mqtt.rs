//! The MQTT side: our own connection driver over rumqttc's packet codec (MQTT 3.1.1 or 5). One
//! task owns the connection: it hands PUBLISHes to the pipeline and writes what the pipeline
//! sends back (`Outbound`). Acks are written as soon as they arrive, every queued one in one
//! write and flush.
//!
//! The window: at most `max_inflight` messages are read and not yet acknowledged on the wire.
//! The driver takes a slot before it decodes a PUBLISH (QoS 0 too) and frees it when the
//! message's `Complete` has been written and flushed (or dropped as stale). While the window is
//! full it decodes no PUBLISH and reads at most `READ_AHEAD` bytes ahead (enough to notice the
//! broker closing the connection), so the broker holds the messages; it still writes acks and
//! PINGREQs, and does not judge the connection by its silence. MQTT 5 also announces the window
//! as Receive Maximum.
//!
//! The window is bounded in bytes too (`max_inflight_bytes`): a PUBLISH whose size would pass
//! it waits, like one without a slot, unless the window is empty. A PUBLISH over
//! `max_message_bytes` is never held whole: the driver keeps its topic and properties, skips
//! its payload as it arrives, and hands the message over marked unread, to fail on its rules.
//!
//! Connection epochs: every CONNACK starts a new epoch, and each message carries the epoch it
//! arrived on. A completion from an earlier epoch is never written: its packet id belonged to a
//! connection that is gone (a resumed session redelivers the message under the same id; a new
//! session may give the id to another message).

mod conn;
mod wire;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use ferry_api::config::{MqttConfig, SubscriptionPlan};
use rand::Rng as _;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use self::conn::Conn;
pub use self::conn::ConnError;
pub use self::wire::WireError;
use self::wire::{Codec, ConnectFields, Head, Incoming};
use crate::handover;
use crate::metrics::Metrics;
use crate::tls::{self, TlsSetupError};

/// How long to wait, after DISCONNECT, for the broker to close the connection.
const LINGER_BOUND: Duration = Duration::from_secs(2);
/// From opening the socket to the CONNACK.
const CONNECT_BOUND: Duration = Duration::from_secs(10);
/// How much the driver reads ahead of what it decodes while the window is full.
const READ_AHEAD: usize = 256 * 1024;
/// Most `Outbound` items taken off the channel for one write.
const BATCH: usize = 4096;
/// Most filters in one SUBSCRIBE or UNSUBSCRIBE. A broker that handles a packet whole on one
/// thread (Mosquitto) would hold every client's messages while it took thousands of filters;
/// packets of a hundred let it serve the others in between.
const FILTERS_PER_PACKET: usize = 100;

/// One PUBLISH as the pipeline sees it, whatever the protocol version.
#[derive(Debug, Clone)]
pub struct Message {
    pub topic: String,
    pub payload: Bytes,
    pub qos: u8,
    pub pkid: u16,
    pub retain: bool,
    /// The broker sent it before, on an earlier connection, and saw no acknowledgement.
    pub dup: bool,
    /// MQTT 5 only.
    pub content_type: Option<String>,
    /// MQTT 5 only.
    pub user_properties: Vec<(String, String)>,
    /// The connection (counted from 1) it arrived on; its ack is only written on that one.
    pub epoch: u64,
    /// MQTT 5: the identifiers of the subscriptions it was delivered for
    /// ([`subscription_id`]); empty from MQTT 3.1.1 or a broker without them.
    pub subscription_ids: Vec<u32>,
    /// What it counts against `mqtt.max_inflight_bytes`, in bytes: its PUBLISH after the
    /// fixed header (only what was kept of an unread one). Its `Complete` gives it back.
    pub size: usize,
    /// Over `mqtt.max_message_bytes`: the size of its PUBLISH after the fixed header. Its
    /// payload was skipped on the wire, never held (`payload` is empty).
    pub unread: Option<usize>,
}

impl Message {
    /// A QoS 1 message as first delivered on connection 1, without MQTT 5 properties: what
    /// tests and benchmarks start from.
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>) -> Message {
        Message {
            topic: topic.into(),
            payload: payload.into(),
            qos: 1,
            pkid: 1,
            retain: false,
            dup: false,
            content_type: None,
            user_properties: Vec::new(),
            epoch: 1,
            subscription_ids: Vec::new(),
            size: 0,
            unread: None,
        }
    }
}

/// The largest MQTT 5 Subscription Identifier.
const SUBSCRIPTION_ID_MAX: u32 = 268_435_455;

/// The MQTT 5 Subscription Identifier of a subscribed filter: derived from its text (FNV-1a),
/// so that it is the same across reloads and restarts, and a message the broker queued for
/// the session before either still names the filter it was delivered for.
pub fn subscription_id(filter: &str) -> u32 {
    let hash = filter.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    hash % SUBSCRIPTION_ID_MAX + 1
}

/// What the pipeline sends back, in the order messages arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outbound {
    /// The message is done (in Kafka, or given up): ack it if qos > 0 and `epoch` is current;
    /// always frees its window slot and its `size` in bytes.
    Complete {
        epoch: u64,
        qos: u8,
        pkid: u16,
        bytes: usize,
    },
    Subscribe(Vec<(String, u8)>),
    Unsubscribe(Vec<String>),
}

/// The pipeline's end of the driver. Closing or dropping it means "finish": write what is
/// queued, DISCONNECT, linger until the broker closes, return.
#[derive(Debug)]
pub struct Link {
    pub outbound: mpsc::UnboundedSender<Outbound>,
}

/// How the driver ended.
#[derive(Debug)]
pub enum ReaderExit {
    /// The DISCONNECT was written after the pipeline's last acks.
    Disconnected,
    /// The connection failed (or was not up) at the end; unacked messages will be redelivered.
    ConnectionLost,
    /// Before the first successful connection, an error retrying cannot fix.
    Permanent(PermanentError),
}

/// A connect failure retrying cannot fix ([`ConnError::is_permanent`]), met before the first
/// successful connection: the forwarder stops with it.
#[derive(Debug, thiserror::Error)]
#[error("mqtt broker {broker}: {source}")]
pub struct PermanentError {
    /// `host:port`.
    pub broker: String,
    pub source: ConnError,
}

/// The filters to (re)subscribe on every connect, and those a resumed session must lose; the
/// pipeline updates them on reload.
pub type Subscriptions = Arc<Mutex<SubscriptionPlan>>;

/// Spawns the driver on the current Tokio runtime. `to_pipeline` should have room for
/// `cfg.max_inflight` messages (the window bounds what is in it); with less, the driver waits
/// for room without decoding more.
pub fn start(
    cfg: &MqttConfig,
    subscriptions: Subscriptions,
    metrics: Arc<Metrics>,
    to_pipeline: mpsc::Sender<Message>,
) -> Result<(Link, tokio::task::JoinHandle<ReaderExit>), TlsSetupError> {
    let tls = match &cfg.tls {
        Some(t) => Some(Arc::new(tls::client_config("mqtt.tls", t)?)),
        None => None,
    };
    let (outbound, from_pipeline) = mpsc::unbounded_channel();
    let driver = Driver {
        settings: Arc::new(Settings::new(cfg, tls)),
        subscriptions,
        metrics,
        to_pipeline,
        outbound: from_pipeline,
        taken: 0,
        taken_bytes: 0,
        next_size: None,
        skipping: 0,
        stalled: None,
        epoch: 0,
        ever_connected: false,
        unsubscribe_later: Vec::new(),
        reading: false,
        batch: Vec::new(),
    };
    Ok((Link { outbound }, tokio::spawn(driver.run())))
}

/// What every connection attempt needs.
struct Settings {
    host: String,
    port: u16,
    /// `host:port`, for logs and errors.
    addr: String,
    tls: Option<Arc<rustls::ClientConfig>>,
    codec: Codec,
    /// Holds the password: never logged (no Debug).
    connect: ConnectFields,
    keep_alive: Option<Duration>,
    window: usize,
    /// `max_inflight_bytes`.
    window_bytes: usize,
    /// `max_message_bytes`.
    max_message: usize,
    reconnect_min: Duration,
    reconnect_max: Duration,
}

impl Settings {
    fn new(cfg: &MqttConfig, tls: Option<Arc<rustls::ClientConfig>>) -> Self {
        let login = cfg.username.as_ref().map(|user| {
            let password = cfg.password.as_ref().map(|p| p.expose().to_owned());
            (user.clone(), password.unwrap_or_default())
        });
        Self {
            host: cfg.host.clone(),
            port: cfg.port,
            addr: format!("{}:{}", cfg.host, cfg.port),
            tls,
            codec: Codec::new(cfg.protocol),
            connect: ConnectFields {
                client_id: cfg.client_id.clone(),
                keep_alive_secs: cfg.keep_alive_secs,
                clean_session: cfg.clean_session,
                login,
                session_expiry_secs: cfg.session_expiry_secs.unwrap_or(if cfg.clean_session {
                    0
                } else {
                    u32::MAX
                }),
                receive_maximum: cfg.max_inflight,
            },
            keep_alive: seconds(cfg.keep_alive_secs),
            window: usize::from(cfg.max_inflight.max(1)),
            window_bytes: usize::try_from(cfg.max_inflight_bytes).unwrap_or(usize::MAX),
            max_message: cfg.max_message_bytes as usize,
            reconnect_min: Duration::from_millis(cfg.reconnect_min_ms),
            reconnect_max: Duration::from_millis(cfg.reconnect_max_ms),
        }
    }
}

fn seconds(secs: u16) -> Option<Duration> {
    (secs > 0).then(|| Duration::from_secs(u64::from(secs)))
}

struct Driver {
    settings: Arc<Settings>,
    subscriptions: Subscriptions,
    metrics: Arc<Metrics>,
    to_pipeline: mpsc::Sender<Message>,
    outbound: mpsc::UnboundedReceiver<Outbound>,
    /// Messages decoded whose `Complete` has not been processed yet: the used window.
    taken: usize,
    /// Their sizes: the used window in bytes.
    taken_bytes: usize,
    /// The size of the PUBLISH at the front of the read buffer while it does not fit the
    /// window's bytes.
    next_size: Option<usize>,
    /// Bytes of an unread PUBLISH still to be skipped as they arrive.
    skipping: usize,
    /// A decoded message the pipeline channel had no room for yet.
    stalled: Option<Message>,
    /// Counts CONNACKs; 0 before the first.
    epoch: u64,
    ever_connected: bool,
    /// Filters the pipeline dropped while no connection was up; unsubscribed on the next one
    /// (a resumed session still has them).
    unsubscribe_later: Vec<String>,
    /// Whether it took messages at the last turn of its loop, as the hand-over was told.
    reading: bool,
    batch: Vec<Outbound>,
}

/// How a connection ended.
enum End {
    Finished(ReaderExit),
    Lost(ConnError),
}

/// The state of the connection that is up.
struct Session {
    conn: Conn,
    keep_alive: Option<Duration>,
    next_ping: Option<Instant>,
    /// Since when the driver has been reading without receiving anything; None while it does
    /// not read (window full): a silent broker then proves nothing.
    silent_since: Option<Instant>,
    last_pkid: u16,
    /// SUBSCRIBE packet ids awaiting their SUBACK, with the filters they asked for.
    pending_subs: HashMap<u16, Vec<String>>,
    /// Filters the broker granted on this connection.
    granted: BTreeSet<String>,
    /// Filters the broker refused on this connection, with its reason.
    refused: BTreeMap<String, &'static str>,
    /// MQTT 5 with a broker that has them: each filter is subscribed with its
    /// [`subscription_id`], so a message says which subscription it was delivered for.
    subscription_ids: bool,
}

/// What the broker's CONNACK said.
struct Accepted {
    session_present: bool,
    /// MQTT 5: its Server Keep Alive.
    server_keep_alive: Option<u16>,
    subscription_ids: bool,
}

impl Driver {
    async fn run(mut self) -> ReaderExit {
        let mut failures: u32 = 0;
        loop {
            let attempt = connect(Arc::clone(&self.settings));
            let Some(connected) = self.offline(attempt).await else {
                return ReaderExit::ConnectionLost;
            };
            match connected {
                Ok((conn, accepted)) => {
                    let up_since = Instant::now();
                    let end = match self.on_connected(conn, accepted) {
                        Ok(session) => self.session(session).await,
                        Err(e) => End::Lost(e),
                    };
                    match end {
                        End::Finished(exit) => return exit,
                        End::Lost(e) => self.on_lost(&e),
                    }
                    // Only a connection that outlived the longest pause resets the backoff: one
                    // the broker drops at once (another client with our id, say) is a failure.
                    if up_since.elapsed() >= self.settings.reconnect_max {
                        failures = 0;
                    }
                }
                Err(e) => {
                    if let Some(permanent) = self.on_connect_error(e) {
                        return ReaderExit::Permanent(permanent);
                    }
                }
            }
            failures = failures.saturating_add(1);
            let s = &self.settings;
            let pause = backoff(s.reconnect_min, s.reconnect_max, failures);
            if self.offline(tokio::time::sleep(pause)).await.is_none() {
                return ReaderExit::ConnectionLost;
            }
        }
    }

    /// Waits for `work` (a connect attempt, a pause) while no connection is up. Completions
    /// cannot be written then, and are stale by the next CONNACK: they are dropped, freeing
    /// their window slots. None: the pipeline closed the link.
    async fn offline<T>(&mut self, work: impl Future<Output = T>) -> Option<T> {
        tokio::pin!(work);
        loop {
            tokio::select! {
                out = &mut work => return Some(out),
                n = self.outbound.recv_many(&mut self.batch, BATCH) => {
                    if n == 0 {
                        return None;
                    }
                    let (mut dropped, mut bytes) = (0, 0);
                    for item in self.batch.drain(..) {
                        match item {
                            Outbound::Complete { bytes: size, .. } => {
                                dropped += 1;
                                bytes += size;
                            }
                            // The next connection subscribes to the current list anyway.
                            Outbound::Subscribe(_) => {}
                            Outbound::Unsubscribe(f) => self.unsubscribe_later.extend(f),
                        }
                    }
                    self.release(dropped, bytes);
                }
            }
        }
    }

    /// Starts a new epoch and (re)subscribes.
    fn on_connected(&mut self, conn: Conn, accepted: Accepted) -> Result<Session, ConnError> {
        let Accepted {
            session_present,
            server_keep_alive,
            subscription_ids,
        } = accepted;
        self.epoch += 1;
        self.ever_connected = true;
        // What the last connection's read buffer held is gone with it: a payload being
        // skipped, and the size of a PUBLISH that waited for room.
        self.skipping = 0;
        self.next_size = None;
        // Before `connected`: `/status` must never pair it with the last connection's state.
        let reading = self.has_room();
        self.metrics
            .handover(|h| h.connected(reading, std::time::Instant::now()));
        self.reading = reading;
        self.metrics.set_mqtt_connected(true);
        info!(session_present, epoch = self.epoch, broker = %self.settings.addr, "mqtt connected");
        let keep_alive = match server_keep_alive {
            Some(secs) => seconds(secs),
            None => self.settings.keep_alive,
        };
        let mut session = Session {
            conn,
            keep_alive,
            next_ping: keep_alive.map(|k| Instant::now() + k),
            silent_since: None,
            last_pkid: 0,
            pending_subs: HashMap::new(),
            granted: BTreeSet::new(),
            // Until the broker answers again: a refusal keeps its `since` across reconnects.
            refused: self.metrics.mqtt_refused(),
            subscription_ids,
        };
        let codec = self.settings.codec;
        // Subscribing again on every connect is harmless with a resumed session and required
        // without one.
        let plan = self.current_subscriptions();
        let subs = &plan.subscribe;
        session.subscribe(codec, subs)?;
        if subs.is_empty() {
            // Draining: subscribed to all it should be.
            self.metrics.set_mqtt_subscriptions(true, &BTreeMap::new());
        }
        let later = std::mem::take(&mut self.unsubscribe_later);
        let gone = handover::unsubscribe_on_connect(&plan, later, session_present);
        self.unsubscribe(&mut session, &gone)?;
        Ok(session)
    }

    /// Runs one connection until it is lost or the pipeline closes the link.
    async fn session(&mut self, mut s: Session) -> End {
        loop {
            if let Err(e) = self.take_buffered(&mut s) {
                return End::Lost(e);
            }
            // PUBCOMPs (and the SUBSCRIBE after a connect) queued by the packets just handled.
            if let Err(e) = s.conn.flush().await {
                return End::Lost(e);
            }
            let reading = self.has_room();
            s.note_reading(reading);
            if reading != self.reading {
                self.reading = reading;
                self.metrics
                    .handover(|h| h.set_reading(reading, std::time::Instant::now()));
            }
            // Without room, bytes are still read ahead (never decoded into messages) so that the
            // broker closing the connection is noticed while the window is full.
            let read_ahead = reading || s.conn.read_buf.len() < READ_AHEAD;
            let silence_limit = s.silence_limit();
            let ping_at = s.next_ping;
            tokio::select! {
                biased;
                n = self.outbound.recv_many(&mut self.batch, BATCH) => {
                    if n == 0 {
                        return End::Finished(self.finish(s).await);
                    }
                    if let Err(e) = self.write_outbound(&mut s).await {
                        return End::Lost(e);
                    }
                }
                // Owned: a borrowed permit would keep `self` borrowed in every branch.
                permit = self.to_pipeline.clone().reserve_owned(), if self.stalled.is_some() => {
                    match (permit, self.stalled.take()) {
                        (Ok(permit), Some(message)) => drop(permit.send(message)),
                        // The pipeline is shutting down: never acked, so it is redelivered.
                        (_, stalled) => self.release(1, stalled.map_or(0, |m| m.size)),
                    }
                }
                () = tokio::time::sleep_until(ping_at.unwrap_or_else(Instant::now)), if ping_at.is_some() => {
                    if let Err(e) = self.ping(&mut s).await {
                        return End::Lost(e);
                    }
                }
                read = s.conn.read(), if read_ahead => match read {
                    Ok(()) => s.silent_since = s.silent_since.map(|_| Instant::now()),
                    Err(e) => return End::Lost(e),
                },
                () = tokio::time::sleep_until(silence_limit.unwrap_or_else(Instant::now)), if silence_limit.is_some() => {
                    return End::Lost(ConnError::Silent {
                        keep_alive: s.keep_alive.unwrap_or_default(),
                    });
                }
            }
        }
    }

    /// Whether the driver may take another message: a free window slot, room in bytes for
    /// the next PUBLISH when it is known not to fit, and a pipeline that takes messages.
    fn has_room(&self) -> bool {
        self.taken < self.settings.window
            && self.next_size.is_none_or(|size| self.fits(size))
            && self.stalled.is_none()
            && !self.to_pipeline.is_closed()
    }

    /// Whether a message of `size` bytes fits the window's bytes (any fits an empty window).
    fn fits(&self, size: usize) -> bool {
        self.taken == 0 || self.taken_bytes.saturating_add(size) <= self.settings.window_bytes
    }

    /// `slots` messages are done: acknowledged, or given up (their connection is gone, or the
    /// pipeline is).
    fn release(&mut self, slots: usize, bytes: usize) {
        self.taken = self.taken.saturating_sub(slots);
        self.taken_bytes = self.taken_bytes.saturating_sub(bytes);
        if slots > 0 {
            self.metrics
                .handover(|h| h.completed(slots, std::time::Instant::now()));
        }
    }

    /// Handles the whole packets in the read buffer, up to the first PUBLISH there is no room
    /// for; skips what arrived of an unread PUBLISH's payload.
    fn take_buffered(&mut self, s: &mut Session) -> Result<(), ConnError> {
        let codec = self.settings.codec;
        loop {
            let buf = &mut s.conn.read_buf;
            if self.skipping > 0 {
                let n = self.skipping.min(buf.len());
                buf.advance(n);
                self.skipping -= n;
                if self.skipping > 0 {
                    return Ok(());
                }
            }
            let Some(head) = Head::read(buf)? else {
                return Ok(());
            };
            if head.is_publish() {
                if !self.has_room() {
                    return Ok(());
                }
                if head.remaining > self.settings.max_message {
                    let Some((message, skip)) = codec.unread_publish(buf, head)? else {
                        return Ok(());
                    };
                    self.skipping = skip;
                    self.hand_over(message);
                    continue;
                }
                if !self.fits(head.remaining) {
                    self.next_size = Some(head.remaining);
                    return Ok(());
                }
                self.next_size = None;
            }
            let Some(packet) = codec.decode(buf)? else {
                return Ok(());
            };
            self.on_packet(packet, head.remaining, s)?;
        }
    }

    /// `size`: the packet's, after its fixed header.
    fn on_packet(
        &mut self,
        packet: Incoming,
        size: usize,
        s: &mut Session,
    ) -> Result<(), ConnError> {
        match packet {
            Incoming::Publish(mut p) => {
                p.size = size;
                self.hand_over(p);
            }
            // MQTT allows a PUBCOMP for any PUBREL (3.1.1 §4.3.3, 5 §4.3.3): the message went
            // to the pipeline before its PUBREC, so there is nothing left to release. This also
            // answers a PUBREL the broker re-sends after a reconnect.
            Incoming::PubRel(pkid) => self.settings.codec.pubcomp(pkid, &mut s.conn.write_buf)?,
            Incoming::SubAck { pkid, granted } => {
                let filters = s.pending_subs.remove(&pkid);
                self.on_suback(s, filters, &granted);
            }
            Incoming::UnsubAck(pkid) => {
                debug!(pkid, "unsubscribed");
                self.metrics
                    .handover(|h| h.unsubscribe_answered(std::time::Instant::now()));
            }
            Incoming::PingResp => {}
            Incoming::Ignored(what) => debug!(packet = what, "ignored a packet from the broker"),
            Incoming::ConnAck { .. } => return Err(ConnError::SecondConnAck),
            Incoming::Disconnect(reason) => return Err(ConnError::Disconnected(reason)),
        }
        Ok(())
    }

    fn hand_over(&mut self, mut message: Message) {
        self.taken += 1;
        self.taken_bytes += message.size;
        if let Some(size) = message.unread {
            self.metrics.unread.inc();
            warn!(
                topic = %message.topic,
                size,
                max_message_bytes = self.settings.max_message,
                "a message over mqtt.max_message_bytes: its payload was skipped unread; it fails on its rules"
            );
        }
        self.metrics
            .handover(|h| h.delivered(std::time::Instant::now()));
        self.metrics.received[usize::from(message.qos.min(2))].inc();
        if message.dup {
            self.metrics.redelivered.inc();
        }
        message.epoch = self.epoch;
        match self.to_pipeline.try_send(message) {
            Ok(()) => {}
            Err(TrySendError::Full(message)) => self.stalled = Some(message),
            // The pipeline is shutting down: never acked, so the broker redelivers it.
            Err(TrySendError::Closed(message)) => self.release(1, message.size),
        }
    }

    /// The broker's answer to a SUBSCRIBE: the connection counts as subscribed while the broker
    /// granted at least one filter; the refused ones fail their rules (see
    /// [`Metrics::set_mqtt_subscriptions`]).
    fn on_suback(
        &self,
        s: &mut Session,
        filters: Option<Vec<String>>,
        granted: &[Result<u8, &'static str>],
    ) {
        let filters = filters.unwrap_or_default();
        for (i, filter) in filters.into_iter().enumerate() {
            // A SUBACK with fewer codes than filters answered none of the rest.
            match granted
                .get(i)
                .copied()
                .unwrap_or(Err("no answer in the SUBACK"))
            {
                Ok(qos) => {
                    debug!(filter, qos, "subscribed");
                    self.metrics.set_mqtt_granted(&filter, true);
                    s.refused.remove(&filter);
                    s.granted.insert(filter);
                }
                Err(reason) => {
                    error!(
                        filter,
                        reason, "mqtt broker refused the subscription (check its ACL)"
                    );
                    self.metrics.mqtt_error(format!(
                        "broker refused the subscription to {filter:?}: {reason}"
                    ));
                    self.metrics.set_mqtt_granted(&filter, false);
                    s.granted.remove(&filter);
                    s.refused.insert(filter, reason);
                }
            }
        }
        self.metrics
            .set_mqtt_subscriptions(!s.granted.is_empty(), &s.refused);
    }

    /// Encodes everything the pipeline queued and writes it with one write and flush; only then
    /// frees the completed messages' window slots.
    async fn write_outbound(&mut self, s: &mut Session) -> Result<(), ConnError> {
        let codec = self.settings.codec;
        let mut batch = std::mem::take(&mut self.batch);
        let (mut completed, mut acks, mut stale) = (0usize, 0u64, 0usize);
        let mut freed = 0usize;
        let mut encoded = Ok(());
        for item in batch.drain(..) {
            let step = match item {
                Outbound::Complete {
                    epoch,
                    qos,
                    pkid,
                    bytes,
                } => {
                    completed += 1;
                    freed += bytes;
                    if epoch != self.epoch {
                        stale += 1;
                        Ok(())
                    } else if qos > 0 {
                        acks += 1;
                        codec
                            .ack(qos, pkid, &mut s.conn.write_buf)
                            .map_err(ConnError::from)
                    } else {
                        Ok(())
                    }
                }
                Outbound::Subscribe(filters) => s.subscribe(codec, &filters),
                Outbound::Unsubscribe(filters) => {
                    let step = self.unsubscribe(s, &filters);
                    // A refusal of a filter no rule has any more says nothing.
                    self.metrics.set_mqtt_refused(&s.refused);
                    step
                }
            };
            if encoded.is_ok() {
                encoded = step;
            }
        }
        self.batch = batch;
        if stale > 0 {
            debug!(
                stale,
                epoch = self.epoch,
                "dropped acks for messages from an earlier connection"
            );
        }
        let written = match encoded {
            Ok(()) => s.conn.flush().await,
            Err(e) => Err(e),
        };
        // Written, or the connection is gone and these ids with it: either way the slots are free.
        self.release(completed, freed);
        if written.is_ok() {
            self.metrics.acked.inc_by(acks);
        }
        written
    }

    async fn ping(&mut self, s: &mut Session) -> Result<(), ConnError> {
        self.settings.codec.pingreq(&mut s.conn.write_buf)?;
        s.next_ping = s.keep_alive.map(|k| Instant::now() + k);
        s.conn.flush().await
    }

    /// Everything the pipeline queued has been written: DISCONNECT, then wait for the broker to
    /// close the connection.
    async fn finish(&mut self, mut s: Session) -> ReaderExit {
        // Never handed over, so never acked: the broker redelivers it.
        self.stalled = None;
        let sent = match self.settings.codec.disconnect(&mut s.conn.write_buf) {
            Ok(()) => s.conn.flush().await,
            Err(e) => Err(e.into()),
        };
        self.metrics.set_mqtt_connected(false);
        self.metrics.handover(|h| h.disconnected());
        if let Err(e) = sent {
            warn!(error = %e, broker = %self.settings.addr, "mqtt connection lost while disconnecting; unacknowledged messages will be redelivered");
            return ReaderExit::ConnectionLost;
        }
        linger(&mut s.conn).await;
        info!("mqtt disconnected cleanly");
        ReaderExit::Disconnected
    }

    /// Unsubscribes `filters` (if any), counted until the broker answers (see
    /// [`crate::handover::Handover`]).
    fn unsubscribe(&self, s: &mut Session, filters: &[String]) -> Result<(), ConnError> {
        if filters.is_empty() {
            return Ok(());
        }
        for f in filters {
            self.metrics.set_mqtt_granted(f, false);
        }
        let packets = s.unsubscribe(self.settings.codec, filters)?;
        self.metrics.handover(|h| h.unsubscribe_sent(packets));
        Ok(())
    }

    fn current_subscriptions(&self) -> SubscriptionPlan {
        self.subscriptions
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    fn on_lost(&mut self, e: &ConnError) {
        // At once, so /status and /readyz tell the truth during the backoff.
        self.metrics.set_mqtt_connected(false);
        self.metrics.handover(|h| h.disconnected());
        warn!(error = %e, broker = %self.settings.addr, "mqtt connection lost; reconnecting");
        self.metrics.mqtt_error(e.to_string());
    }

    /// Logs and records a failed connect; returns it when the forwarder should stop: a
    /// permanent error before the first successful connection. Once connected, the broker
    /// accepted this configuration before, so even a permanent error is retried.
    fn on_connect_error(&self, e: ConnError) -> Option<PermanentError> {
        let broker = &self.settings.addr;
        self.metrics.mqtt_error(e.to_string());
        if !e.is_permanent() {
            debug!(error = %e, broker = %broker, "mqtt connect failed; retrying");
            return None;
        }
        if self.ever_connected {
            error!(error = %e, broker = %broker, "mqtt broker refused the connection");
            return None;
        }
        error!(error = %e, broker = %broker, "cannot connect to the mqtt broker, and retrying will not help");
        let permanent = PermanentError {
            broker: broker.clone(),
            source: e,
        };
        self.metrics.mqtt_error(permanent.to_string());
        Some(permanent)
    }
}

/// Opens the connection and sends CONNECT; returns it with what the CONNACK said. Owns what
/// it needs, so it can run while the driver drops completions.
async fn connect(s: Arc<Settings>) -> Result<(Conn, Accepted), ConnError> {
    let attempt = async {
        let mut conn = Conn::open(&s.host, s.port, s.tls.as_ref()).await?;
        s.codec.connect(&s.connect, &mut conn.write_buf)?;
        conn.flush().await?;
        // PUBLISHes right behind the CONNACK stay in the read buffer for the session.
        match conn.read_packet(s.codec).await? {
            Incoming::ConnAck {
                refused: Some(code),
                ..
            } => Err(ConnError::Refused { code }),
            Incoming::ConnAck {
                session_present,
                server_keep_alive,
                subscription_ids,
                ..
            } => Ok((
                conn,
                Accepted {
                    session_present,
                    server_keep_alive,
                    subscription_ids,
                },
            )),
            _ => Err(ConnError::NotConnAck),
        }
    };
    tokio::time::timeout(CONNECT_BOUND, attempt)
        .await
        .unwrap_or_else(|_| Err(ConnError::NoConnAck(CONNECT_BOUND)))
}

/// Keeps reading (and discarding) after the DISCONNECT was written, until the broker closes the
/// connection. Closing a socket with unread PUBLISHes in its receive buffer makes the kernel send
/// a reset, and a reset makes the broker's kernel discard what it had not read yet: our last
/// acks and the DISCONNECT itself. The broker closing it is the expected end, not a loss.
async fn linger(conn: &mut Conn) {
    let closed = tokio::time::timeout(LINGER_BOUND, async {
        loop {
            conn.read_buf.clear();
            if let Err(e) = conn.read().await {
                return e;
            }
        }
    })
    .await;
    match closed {
        Ok(how) => debug!(%how, "mqtt connection closed after DISCONNECT"),
        Err(_) => debug!("mqtt broker did not close the connection after DISCONNECT"),
    }
}

impl Session {
    fn next_pkid(&mut self) -> u16 {
        self.last_pkid = self.last_pkid.checked_add(1).unwrap_or(1);
        self.last_pkid
    }

    fn subscribe(&mut self, codec: Codec, filters: &[(String, u8)]) -> Result<(), ConnError> {
        if filters.is_empty() {
            return Ok(());
        }
        if self.subscription_ids {
            for one in filters.chunks(1) {
                let id = one.first().map(|(f, _)| subscription_id(f));
                self.subscribe_packet(codec, one, id)?;
            }
            return Ok(());
        }
        for chunk in filters.chunks(FILTERS_PER_PACKET) {
            self.subscribe_packet(codec, chunk, None)?;
        }
        Ok(())
    }

    fn subscribe_packet(
        &mut self,
        codec: Codec,
        filters: &[(String, u8)],
        id: Option<u32>,
    ) -> Result<(), ConnError> {
        let pkid = self.next_pkid();
        codec.subscribe(pkid, filters, id, &mut self.conn.write_buf)?;
        self.pending_subs
            .insert(pkid, filters.iter().map(|(f, _)| f.clone()).collect());
        Ok(())
    }

    /// Unsubscribes `filters`; how many UNSUBSCRIBE packets that took.
    fn unsubscribe(&mut self, codec: Codec, filters: &[String]) -> Result<usize, ConnError> {
        for f in filters {
            self.granted.remove(f);
            self.refused.remove(f);
        }
        let mut packets = 0;
        for chunk in filters.chunks(FILTERS_PER_PACKET) {
            let pkid = self.next_pkid();
            codec.unsubscribe(pkid, chunk, &mut self.conn.write_buf)?;
            packets += 1;
        }
        Ok(packets)
    }

    /// Starts the silence clock when the driver starts reading, stops it when it stops.
    fn note_reading(&mut self, reading: bool) {
        match (reading, self.silent_since) {
            (true, None) => self.silent_since = Some(Instant::now()),
            (false, Some(_)) => self.silent_since = None,
            _ => {}
        }
    }

    /// When the connection counts as dead if nothing arrives: 1.5 × keep-alive of reading in
    /// silence. A PINGREQ goes out every keep-alive, so its PINGRESP is at least half a
    /// keep-alive overdue by then.
    fn silence_limit(&self) -> Option<Instant> {
        let k = self.keep_alive?;
        Some(self.silent_since? + k + k / 2)
    }
}

/// Exponential backoff with jitter: between half and all of min·2^(n-1), capped at max.
pub fn backoff(min: Duration, max: Duration, failures: u32) -> Duration {
    let cap = crate::window::capped_exponential(min, max, failures);
    let half = cap / 2;
    half + rand::rng().random_range(Duration::ZERO..=half)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

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
