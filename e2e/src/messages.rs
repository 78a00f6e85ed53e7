//! The messages the tests send and read back: MQTT publishing and session probes, and the
//! Kafka [`Record`]s they read.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};

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

/// [`publish`] with a user name and password, for a [`crate::Mosquitto`] started with
/// [`crate::MosquittoOptions::users`] (use its plaintext [`crate::Mosquitto::port`]). Fails if
/// the broker refuses the connection.
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
