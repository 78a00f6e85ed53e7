//! The MQTT side: one task owns rumqttc's event loop and hands PUBLISHes to the pipeline through
//! a bounded channel. Acks travel back through rumqttc's request channel (`try_ack` from the
//! pipeline task), never from this task, so neither side can wait on the other in a cycle.
//!
//! Backpressure: this task takes a channel permit *before* it polls for the next packet. While
//! the pipeline is full it stops reading the socket, and the broker holds the messages.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry_api::config::MqttConfig;
use rand::Rng as _;
use rumqttc::{
    AsyncClient, ConnectionError, Event, EventLoop, Incoming, MqttOptions, Outgoing, Packet,
    Publish, QoS, StateError, SubscribeFilter, SubscribeReasonCode,
};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::metrics::Metrics;

/// MQTT's own maximum packet size: never refuse to read a message (an oversize message would
/// otherwise drop the connection, be redelivered, and wedge the session); Kafka's size limit is
/// handled as a permanent produce failure instead.
const MAX_PACKET_SIZE: usize = 268_435_455;
/// How long to wait, after DISCONNECT, for the broker to close the connection.
const LINGER_BOUND: Duration = Duration::from_secs(2);

pub fn qos(level: u8) -> QoS {
    match level {
        0 => QoS::AtMostOnce,
        1 => QoS::AtLeastOnce,
        _ => QoS::ExactlyOnce,
    }
}

/// `unacked_bound` is the most messages that can be read and not yet acknowledged (window plus
/// hand-over); the request channel gets room for all their acks plus control requests, so the
/// pipeline's `try_ack` never finds it full.
pub fn client(cfg: &MqttConfig, unacked_bound: usize) -> (AsyncClient, EventLoop) {
    let mut o = MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
    o.set_keep_alive(Duration::from_secs(u64::from(cfg.keep_alive_secs)))
        .set_clean_session(cfg.clean_session)
        .set_manual_acks(true)
        .set_max_packet_size(MAX_PACKET_SIZE, MAX_PACKET_SIZE);
    if let Some(user) = &cfg.username {
        o.set_credentials(
            user.clone(),
            cfg.password
                .as_ref()
                .map(|p| p.expose().to_owned())
                .unwrap_or_default(),
        );
    }
    AsyncClient::new(o, unacked_bound + 64)
}

/// How the reader ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ReaderExit {
    /// The DISCONNECT was written after the pipeline's last acks.
    Disconnected,
    /// The connection failed while draining; unacked messages will be redelivered.
    ConnectionLost,
}

pub struct Reader {
    pub eventloop: EventLoop,
    pub client: AsyncClient,
    pub subscriptions: Vec<(String, u8)>,
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    pub metrics: Arc<Metrics>,
    /// QoS 2 packet ids we sent PUBREC for and the broker has not yet released. rumqttc forgets
    /// them on reconnect and then treats the broker's re-sent PUBREL as a protocol error, which
    /// would reconnect forever; see `remember_owed_pubrels`.
    owed_pubcomp: BTreeSet<u16>,
    /// Set when `run` returns, for the pipeline to stop waiting on the request channel.
    pub gone: Arc<AtomicBool>,
}

impl Reader {
    pub fn new(
        eventloop: EventLoop,
        client: AsyncClient,
        cfg: &MqttConfig,
        subscriptions: Vec<(String, u8)>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            eventloop,
            client,
            subscriptions,
            reconnect_min: Duration::from_millis(cfg.reconnect_min_ms),
            reconnect_max: Duration::from_millis(cfg.reconnect_max_ms),
            metrics,
            owed_pubcomp: BTreeSet::new(),
            gone: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Reads until the pipeline closes its end of `to_pipeline`, then keeps the connection
    /// going only to flush the last acks and the DISCONNECT the pipeline queued.
    pub async fn run(self, to_pipeline: mpsc::Sender<Publish>) -> ReaderExit {
        let gone = Arc::clone(&self.gone);
        let exit = self.read(to_pipeline).await;
        gone.store(true, Ordering::Relaxed);
        exit
    }

    async fn read(mut self, to_pipeline: mpsc::Sender<Publish>) -> ReaderExit {
        let mut failures: u32 = 0;
        loop {
            let Ok(permit) = to_pipeline.reserve().await else {
                return self.drain().await;
            };
            match self.eventloop.poll().await {
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    self.metrics.received[publish.qos as usize].inc();
                    permit.send(publish);
                }
                Ok(event) => {
                    drop(permit);
                    if self.on_event(event) {
                        failures = 0;
                    }
                }
                Err(e) => {
                    drop(permit);
                    self.on_connection_error(&e);
                    failures = failures.saturating_add(1);
                    // A PUBREL we could not answer: reconnect at once, now that we know its id.
                    if !matches!(e, ConnectionError::MqttState(StateError::Unsolicited(_))) {
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
            match self.eventloop.poll().await {
                Ok(Event::Outgoing(Outgoing::Disconnect)) => {
                    self.metrics.set_mqtt_connected(false);
                    self.linger().await;
                    info!("mqtt disconnected cleanly");
                    return ReaderExit::Disconnected;
                }
                // Not handed to the pipeline and never acked: the broker redelivers it.
                Ok(Event::Incoming(Packet::Publish(_))) => {}
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
            loop {
                if self.eventloop.poll().await.is_err() {
                    return;
                }
            }
        })
        .await;
        if closed.is_err() {
            debug!("mqtt broker did not close the connection after DISCONNECT");
        }
    }

    /// Returns true when the event shows a working connection (resets the backoff).
    fn on_event(&mut self, event: Event) -> bool {
        match event {
            Event::Incoming(Incoming::ConnAck(ack)) => {
                self.metrics.set_mqtt_connected(true);
                info!(session_present = ack.session_present, "mqtt connected");
                // Subscribing again on every connect is harmless with a resumed session and
                // required without one.
                let filters = self
                    .subscriptions
                    .iter()
                    .map(|(f, q)| SubscribeFilter::new(f.clone(), qos(*q)));
                if let Err(e) = self.client.try_subscribe_many(filters) {
                    error!(error = %e, "cannot queue mqtt subscribe");
                }
                true
            }
            Event::Incoming(Incoming::SubAck(ack)) => {
                self.metrics.set_mqtt_subscribed();
                for (code, (filter, _)) in ack.return_codes.iter().zip(&self.subscriptions) {
                    match code {
                        SubscribeReasonCode::Failure => {
                            error!(filter = %filter, "mqtt broker refused the subscription (check its ACL)")
                        }
                        SubscribeReasonCode::Success(granted) => {
                            debug!(filter = %filter, ?granted, "subscribed")
                        }
                    }
                }
                true
            }
            Event::Outgoing(Outgoing::PubRec(pkid)) => {
                self.owed_pubcomp.insert(pkid);
                false
            }
            Event::Outgoing(Outgoing::PubComp(pkid)) => {
                self.owed_pubcomp.remove(&pkid);
                false
            }
            _ => false,
        }
    }

    fn on_connection_error(&mut self, e: &ConnectionError) {
        let was_connected = self.metrics.health.mqtt_connected();
        self.metrics.set_mqtt_connected(false);
        match e {
            ConnectionError::MqttState(StateError::Unsolicited(pkid)) => {
                self.owed_pubcomp.insert(*pkid);
                debug!(
                    pkid,
                    "pubrel for a qos 2 message received before a restart; answering it after reconnect"
                );
            }
            ConnectionError::ConnectionRefused(code) => {
                error!(?code, "mqtt broker refused the connection")
            }
            _ if was_connected => warn!(error = %e, "mqtt connection lost; reconnecting"),
            _ => debug!(error = %e, "mqtt connect failed; retrying"),
        }
        self.remember_owed_pubrels();
    }

    /// Re-teaches rumqttc (after it cleared its state on the error) the QoS 2 ids whose PUBREL
    /// the broker will send again, so it answers with PUBCOMP as MQTT §4.3.3 requires. Done by
    /// replaying an incoming QoS 2 PUBLISH into its state and discarding the event this makes.
    fn remember_owed_pubrels(&mut self) {
        for &pkid in &self.owed_pubcomp {
            let mut marker = Publish::new("", QoS::ExactlyOnce, Vec::new());
            marker.pkid = pkid;
            if self
                .eventloop
                .state
                .handle_incoming_packet(Incoming::Publish(marker))
                .is_ok()
            {
                self.eventloop.state.events.pop_back();
            }
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
