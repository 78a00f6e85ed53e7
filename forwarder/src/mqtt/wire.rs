//! MQTT 3.1.1 and 5 on the wire, through rumqttc's packet codec: what the driver sends and the
//! few shapes of what it receives, whatever the protocol version.

use bytes::{Buf as _, BufMut as _, BytesMut};
use ferry_api::config::MqttProtocol;
use rumqttc::mqttbytes::{self as mb, v4};
use rumqttc::v5::mqttbytes::{self as mb5, v5};

use super::Message;

/// MQTT's own maximum packet size: never refuse to read a message (an oversize message would
/// otherwise drop the connection, be redelivered, and wedge the session); Kafka's size limit is
/// handled as a permanent produce failure instead.
pub const MAX_PACKET_SIZE: usize = 268_435_455;

/// MQTT 5 properties of an unread message are kept up to this size (its subscription
/// identifiers route it); larger ones are skipped with its payload.
const UNREAD_PROPERTIES_MAX: usize = 64 * 1024;

/// The fixed header of the next packet, read before the packet is whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    byte1: u8,
    /// Bytes of the fixed header.
    len: usize,
    /// Bytes after the fixed header: variable header and payload.
    pub remaining: usize,
}

impl Head {
    /// Reads the fixed header at the front of `buf` (None: not all of it has arrived).
    pub fn read(buf: &[u8]) -> Result<Option<Self>, WireError> {
        let Some(&byte1) = buf.first() else {
            return Ok(None);
        };
        match varint(&buf[1..])? {
            Some((n, remaining)) => Ok(Some(Self {
                byte1,
                len: 1 + n,
                remaining,
            })),
            None => Ok(None),
        }
    }

    pub fn is_publish(&self) -> bool {
        self.byte1 >> 4 == 3
    }

    fn qos(&self) -> u8 {
        (self.byte1 >> 1) & 0b11
    }

    fn frame(&self) -> usize {
        self.len + self.remaining
    }
}

/// MQTT's variable byte integer at the front of `buf`: (its length, its value); None when it
/// has not all arrived.
fn varint(buf: &[u8]) -> Result<Option<(usize, usize)>, WireError> {
    let mut value = 0usize;
    for (i, &b) in buf.iter().take(4).enumerate() {
        value |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some((i + 1, value)));
        }
    }
    if buf.len() >= 4 {
        return Err(WireError("malformed variable byte integer".into()));
    }
    Ok(None)
}

fn put_varint(mut value: usize, out: &mut BytesMut) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.put_u8(byte);
            return;
        }
        out.put_u8(byte | 0x80);
    }
}

/// A packet the broker sent that could not be framed or decoded.
#[derive(Debug, thiserror::Error)]
#[error("malformed packet from the broker: {0}")]
pub struct WireError(String);

/// The CONNECT the driver sends on every connection.
pub struct ConnectFields {
    pub client_id: String,
    pub keep_alive_secs: u16,
    pub clean_session: bool,
    pub login: Option<(String, String)>,
    /// MQTT 5 only.
    pub session_expiry_secs: u32,
    /// MQTT 5 only: announced as Receive Maximum.
    pub receive_maximum: u16,
}

/// What the driver handles of the packets a broker sends a subscriber.
pub enum Incoming {
    ConnAck {
        session_present: bool,
        /// The return code when the broker refused the connection.
        refused: Option<String>,
        /// MQTT 5: the broker's Server Keep Alive, which replaces ours.
        server_keep_alive: Option<u16>,
        /// MQTT 5, unless the broker says it has none: subscriptions carry identifiers.
        subscription_ids: bool,
    },
    /// Its `epoch` is the driver's to set.
    Publish(Message),
    PubRel(u16),
    /// Per filter, in subscribe order: the QoS the broker granted, or why it refused.
    SubAck {
        pkid: u16,
        granted: Vec<Result<u8, &'static str>>,
    },
    UnsubAck(u16),
    PingResp,
    /// MQTT 5: the broker ends the connection, with its reason.
    Disconnect(String),
    /// Packets a subscriber that never publishes has no use for (PUBACK, AUTH, ...).
    Ignored(&'static str),
}

#[derive(Clone, Copy)]
pub struct Codec {
    v5: bool,
}

impl Codec {
    pub fn new(protocol: MqttProtocol) -> Self {
        Self {
            v5: matches!(protocol, MqttProtocol::V5),
        }
    }

    /// Whether the next whole packet in `buf` is a PUBLISH (None: no whole packet yet). Lets the
    /// driver take a window slot before it decodes a PUBLISH, and read past control packets.
    pub fn next_is_publish(&self, buf: &BytesMut) -> Result<Option<bool>, WireError> {
        // The fixed header is the same in 3.1.1 and 5.
        match mb::check(buf.iter(), MAX_PACKET_SIZE) {
            Ok(header) => Ok(Some(matches!(
                header.packet_type(),
                Ok(mb::PacketType::Publish)
            ))),
            Err(mb::Error::InsufficientBytes(_)) => Ok(None),
            Err(e) => Err(WireError(e.to_string())),
        }
    }

    /// Takes the front of the PUBLISH at the front of `buf` (`head`) without its payload: the
    /// message as it would decode with an empty payload, marked unread, and how many bytes of
    /// the packet are still to be skipped past what was taken off `buf`. None: its variable
    /// header has not all arrived. Never waits for (or keeps) the payload.
    pub fn unread_publish(
        &self,
        buf: &mut BytesMut,
        head: Head,
    ) -> Result<Option<(Message, usize)>, WireError> {
        let start = head.len;
        let Some(topic_len) = buf.get(start..start + 2) else {
            return Ok(None);
        };
        let topic_len = usize::from(u16::from_be_bytes([topic_len[0], topic_len[1]]));
        let fixed_end = start + 2 + topic_len + if head.qos() > 0 { 2 } else { 0 };
        // The properties to keep (MQTT 5), as written: their length and the properties.
        let mut properties: &[u8] = &[];
        let mut kept_end = fixed_end;
        if self.v5 {
            let Some((n, len)) = buf.get(fixed_end..).map(varint).transpose()?.flatten() else {
                return Ok(None);
            };
            if len <= UNREAD_PROPERTIES_MAX {
                kept_end = fixed_end + n + len;
                let Some(kept) = buf.get(fixed_end..kept_end) else {
                    return Ok(None);
                };
                properties = kept;
            }
        }
        if kept_end > head.frame() {
            return Err(WireError(
                "a PUBLISH's variable header is longer than the packet".into(),
            ));
        }
        let Some(variable) = buf.get(start..fixed_end) else {
            return Ok(None);
        };
        let mut front = BytesMut::with_capacity(kept_end + 5);
        front.put_u8(head.byte1);
        let front_len = variable.len() + if self.v5 { properties.len().max(1) } else { 0 };
        put_varint(front_len, &mut front);
        front.extend_from_slice(variable);
        if self.v5 {
            if properties.is_empty() {
                front.put_u8(0);
            } else {
                front.extend_from_slice(properties);
            }
        }
        let Some(Incoming::Publish(mut message)) = self.decode(&mut front)? else {
            return Err(WireError(
                "a PUBLISH's variable header does not decode".into(),
            ));
        };
        message.size = front_len;
        message.unread = Some(head.remaining);
        let taken = head.frame().min(buf.len());
        buf.advance(taken);
        Ok(Some((message, head.frame() - taken)))
    }

    /// Decodes the next whole packet off the front of `buf` (None: not whole yet).
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Incoming>, WireError> {
        if self.next_is_publish(buf)?.is_none() {
            return Ok(None);
        }
        if self.v5 {
            if let Some(reason) = short_v5_disconnect(buf) {
                return Ok(Some(Incoming::Disconnect(reason)));
            }
            let packet = v5::Packet::read(buf, Some(MAX_PACKET_SIZE as u32))
                .map_err(|e| WireError(e.to_string()))?;
            Ok(Some(from_v5(packet)))
        } else {
            let packet =
                v4::Packet::read(buf, MAX_PACKET_SIZE).map_err(|e| WireError(e.to_string()))?;
            Ok(Some(from_v4(packet)))
        }
    }

    pub fn connect(&self, c: &ConnectFields, out: &mut BytesMut) -> Result<(), WireError> {
        if self.v5 {
            let mut props = v5::ConnectProperties::new();
            props.session_expiry_interval = Some(c.session_expiry_secs);
            props.receive_maximum = Some(c.receive_maximum);
            props.max_packet_size = Some(MAX_PACKET_SIZE as u32);
            let connect = v5::Connect {
                keep_alive: c.keep_alive_secs,
                client_id: c.client_id.clone(),
                clean_start: c.clean_session,
                properties: Some(props),
            };
            let login = c.login.as_ref().map(|(u, p)| v5::Login::new(u, p));
            self.write5(v5::Packet::Connect(connect, None, login), out)
        } else {
            let mut connect = v4::Connect::new(c.client_id.clone());
            connect.keep_alive = c.keep_alive_secs;
            connect.clean_session = c.clean_session;
            if let Some((user, password)) = &c.login {
                connect.set_login(user, password);
            }
            self.write4(v4::Packet::Connect(connect), out)
        }
    }

    /// PUBACK (QoS 1) or PUBREC (QoS 2).
    pub fn ack(&self, qos: u8, pkid: u16, out: &mut BytesMut) -> Result<(), WireError> {
        match (self.v5, qos) {
            (_, 0) => Ok(()),
            (false, 1) => self.write4(v4::Packet::PubAck(v4::PubAck::new(pkid)), out),
            (false, _) => self.write4(v4::Packet::PubRec(v4::PubRec::new(pkid)), out),
            (true, 1) => self.write5(v5::Packet::PubAck(v5::PubAck::new(pkid, None)), out),
            (true, _) => self.write5(v5::Packet::PubRec(v5::PubRec::new(pkid, None)), out),
        }
    }

    pub fn pubcomp(&self, pkid: u16, out: &mut BytesMut) -> Result<(), WireError> {
        if self.v5 {
            self.write5(v5::Packet::PubComp(v5::PubComp::new(pkid, None)), out)
        } else {
            self.write4(v4::Packet::PubComp(v4::PubComp::new(pkid)), out)
        }
    }

    /// One SUBSCRIBE; MQTT 5 with `id`, which the broker puts on every message it delivers for
    /// these filters (one identifier per packet: a filter per packet to tell them apart).
    pub fn subscribe(
        &self,
        pkid: u16,
        filters: &[(String, u8)],
        id: Option<u32>,
        out: &mut BytesMut,
    ) -> Result<(), WireError> {
        if self.v5 {
            let properties = id.map(|id| v5::SubscribeProperties {
                id: Some(id as usize),
                user_properties: Vec::new(),
            });
            let mut s = v5::Subscribe::new_many(
                filters.iter().map(|(f, q)| v5::Filter::new(f, qos5(*q))),
                properties,
            );
            s.pkid = pkid;
            self.write5(v5::Packet::Subscribe(s), out)
        } else {
            let mut s = v4::Subscribe::new_many(
                filters
                    .iter()
                    .map(|(f, q)| v4::SubscribeFilter::new(f.clone(), qos4(*q))),
            );
            s.pkid = pkid;
            self.write4(v4::Packet::Subscribe(s), out)
        }
    }

    pub fn unsubscribe(
        &self,
        pkid: u16,
        filters: &[String],
        out: &mut BytesMut,
    ) -> Result<(), WireError> {
        if self.v5 {
            let u = v5::Unsubscribe {
                pkid,
                filters: filters.to_vec(),
                properties: None,
            };
            self.write5(v5::Packet::Unsubscribe(u), out)
        } else {
            let u = v4::Unsubscribe {
                pkid,
                topics: filters.to_vec(),
            };
            self.write4(v4::Packet::Unsubscribe(u), out)
        }
    }

    pub fn pingreq(&self, out: &mut BytesMut) -> Result<(), WireError> {
        if self.v5 {
            self.write5(v5::Packet::PingReq(v5::PingReq), out)
        } else {
            self.write4(v4::Packet::PingReq, out)
        }
    }

    pub fn disconnect(&self, out: &mut BytesMut) -> Result<(), WireError> {
        if self.v5 {
            let d = v5::Disconnect::new(v5::DisconnectReasonCode::NormalDisconnection);
            self.write5(v5::Packet::Disconnect(d), out)
        } else {
            self.write4(v4::Packet::Disconnect, out)
        }
    }

    fn write4(&self, packet: v4::Packet, out: &mut BytesMut) -> Result<(), WireError> {
        packet
            .write(out, MAX_PACKET_SIZE)
            .map(drop)
            .map_err(|e| WireError(format!("cannot encode: {e}")))
    }

    fn write5(&self, packet: v5::Packet, out: &mut BytesMut) -> Result<(), WireError> {
        packet
            .write(out, Some(MAX_PACKET_SIZE as u32))
            .map(drop)
            .map_err(|e| WireError(format!("cannot encode: {e}")))
    }
}

/// A whole MQTT 5 DISCONNECT without properties, taken off `buf`: rumqttc refuses one without
/// a reason code or without a property length, which MQTT 5 allows (§3.14.2.1, §3.14.2.2).
fn short_v5_disconnect(buf: &mut BytesMut) -> Option<String> {
    let remaining = match buf[..] {
        [0xE0, 0, ..] => 0,
        [0xE0, 1, _, ..] => 1,
        _ => return None,
    };
    let frame = buf.split_to(2 + remaining);
    Some(match frame.get(2) {
        None => "NormalDisconnection".into(),
        Some(&code) => match v5::DisconnectReasonCode::try_from(code) {
            Ok(reason) => format!("{reason:?}"),
            Err(_) => format!("reason code {code:#04x}"),
        },
    })
}

fn from_v4(packet: v4::Packet) -> Incoming {
    use v4::Packet as P;
    match packet {
        P::ConnAck(a) => Incoming::ConnAck {
            session_present: a.session_present,
            refused: (a.code != v4::ConnectReturnCode::Success).then(|| format!("{:?}", a.code)),
            server_keep_alive: None,
            subscription_ids: false,
        },
        P::Publish(p) => Incoming::Publish(Message {
            topic: p.topic,
            payload: p.payload,
            qos: p.qos as u8,
            pkid: p.pkid,
            retain: p.retain,
            dup: p.dup,
            content_type: None,
            user_properties: Vec::new(),
            epoch: 0,
            subscription_ids: Vec::new(),
            size: 0,
            unread: None,
        }),
        P::PubRel(r) => Incoming::PubRel(r.pkid),
        P::SubAck(a) => Incoming::SubAck {
            pkid: a.pkid,
            granted: a
                .return_codes
                .iter()
                .map(|c| match c {
                    v4::SubscribeReasonCode::Success(qos) => Ok(*qos as u8),
                    v4::SubscribeReasonCode::Failure => Err("failure (0x80)"),
                })
                .collect(),
        },
        P::UnsubAck(a) => Incoming::UnsubAck(a.pkid),
        P::PingResp => Incoming::PingResp,
        P::Disconnect => Incoming::Disconnect("DISCONNECT".into()),
        P::PubAck(_) => Incoming::Ignored("PUBACK"),
        P::PubRec(_) => Incoming::Ignored("PUBREC"),
        P::PubComp(_) => Incoming::Ignored("PUBCOMP"),
        P::Connect(_) | P::Subscribe(_) | P::Unsubscribe(_) | P::PingReq => {
            Incoming::Ignored("a client-to-server packet")
        }
    }
}

fn from_v5(packet: v5::Packet) -> Incoming {
    use v5::Packet as P;
    match packet {
        P::ConnAck(a) => Incoming::ConnAck {
            session_present: a.session_present,
            refused: (a.code != v5::ConnectReturnCode::Success).then(|| format!("{:?}", a.code)),
            server_keep_alive: a.properties.as_ref().and_then(|p| p.server_keep_alive),
            subscription_ids: a
                .properties
                .and_then(|p| p.subscription_identifiers_available)
                != Some(0),
        },
        P::Publish(p) => {
            let props = p.properties.unwrap_or_default();
            Incoming::Publish(Message {
                // MQTT requires UTF-8 topics; rumqttc hands them over as bytes.
                topic: String::from_utf8_lossy(&p.topic).into_owned(),
                payload: p.payload,
                qos: p.qos as u8,
                pkid: p.pkid,
                retain: p.retain,
                dup: p.dup,
                content_type: props.content_type,
                user_properties: props.user_properties,
                epoch: 0,
                subscription_ids: props
                    .subscription_identifiers
                    .iter()
                    .filter_map(|id| u32::try_from(*id).ok())
                    .collect(),
                size: 0,
                unread: None,
            })
        }
        P::PubRel(r) => Incoming::PubRel(r.pkid),
        P::SubAck(a) => Incoming::SubAck {
            pkid: a.pkid,
            granted: a.return_codes.iter().map(|c| suback5(*c)).collect(),
        },
        P::UnsubAck(a) => Incoming::UnsubAck(a.pkid),
        P::PingResp(_) => Incoming::PingResp,
        P::Disconnect(d) => {
            Incoming::Disconnect(match d.properties.and_then(|p| p.reason_string) {
                Some(why) => format!("{:?}: {why}", d.reason_code),
                None => format!("{:?}", d.reason_code),
            })
        }
        P::PubAck(_) => Incoming::Ignored("PUBACK"),
        P::PubRec(_) => Incoming::Ignored("PUBREC"),
        P::PubComp(_) => Incoming::Ignored("PUBCOMP"),
        P::Auth(_) => Incoming::Ignored("AUTH"),
        P::Connect(..) | P::Subscribe(_) | P::Unsubscribe(_) | P::PingReq(_) => {
            Incoming::Ignored("a client-to-server packet")
        }
    }
}

fn qos4(level: u8) -> mb::QoS {
    match level {
        0 => mb::QoS::AtMostOnce,
        1 => mb::QoS::AtLeastOnce,
        _ => mb::QoS::ExactlyOnce,
    }
}

fn qos5(level: u8) -> mb5::QoS {
    match level {
        0 => mb5::QoS::AtMostOnce,
        1 => mb5::QoS::AtLeastOnce,
        _ => mb5::QoS::ExactlyOnce,
    }
}

/// An MQTT 5 SUBACK reason code: the granted QoS, or the refusal in words with its code.
fn suback5(code: v5::SubscribeReasonCode) -> Result<u8, &'static str> {
    use v5::SubscribeReasonCode as C;
    Err(match code {
        C::Success(qos) => return Ok(qos as u8),
        C::Failure | C::Unspecified => "unspecified error (0x80)",
        C::ImplementationSpecific => "implementation specific error (0x83)",
        C::NotAuthorized => "not authorized (0x87)",
        C::TopicFilterInvalid => "topic filter invalid (0x8F)",
        C::PkidInUse => "packet identifier in use (0x91)",
        C::QuotaExceeded => "quota exceeded (0x97)",
        C::SharedSubscriptionsNotSupported => "shared subscriptions not supported (0x9E)",
        C::SubscriptionIdNotSupported => "subscription identifiers not supported (0xA1)",
        C::WildcardSubscriptionsNotSupported => "wildcard subscriptions not supported (0xA2)",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish_bytes(protocol: MqttProtocol) -> BytesMut {
        let mut buf = BytesMut::new();
        if matches!(protocol, MqttProtocol::V5) {
            let mut p = v5::Publish::new("t/1", mb5::QoS::AtLeastOnce, "x", None);
            p.pkid = 7;
            v5::Packet::Publish(p)
                .write(&mut buf, None)
                .expect("encode");
        } else {
            let mut p = v4::Publish::new("t/1", mb::QoS::AtLeastOnce, "x");
            p.pkid = 7;
            v4::Packet::Publish(p).write(&mut buf, 100).expect("encode");
        }
        buf
    }

    /// A PUBLISH of `payload` bytes on `t/big`, followed by a small one on `t/next`; MQTT 5
    /// with a subscription identifier and a user property, which an unread message keeps.
    fn big_then_small(protocol: MqttProtocol, payload: usize) -> BytesMut {
        let mut buf = BytesMut::new();
        if matches!(protocol, MqttProtocol::V5) {
            let props = v5::PublishProperties {
                subscription_identifiers: vec![42],
                user_properties: vec![("k".into(), "v".into())],
                ..Default::default()
            };
            let mut big = v5::Publish::new(
                "t/big",
                mb5::QoS::AtLeastOnce,
                vec![7u8; payload],
                Some(props),
            );
            big.pkid = 9;
            v5::Packet::Publish(big)
                .write(&mut buf, None)
                .expect("encode");
            let mut small = v5::Publish::new("t/next", mb5::QoS::AtLeastOnce, "s", None);
            small.pkid = 10;
            v5::Packet::Publish(small)
                .write(&mut buf, None)
                .expect("encode");
        } else {
            let mut big = v4::Publish::new("t/big", mb::QoS::AtLeastOnce, vec![7u8; payload]);
            big.pkid = 9;
            v4::Packet::Publish(big)
                .write(&mut buf, usize::MAX)
                .expect("encode");
            let mut small = v4::Publish::new("t/next", mb::QoS::AtLeastOnce, "s");
            small.pkid = 10;
            v4::Packet::Publish(small)
                .write(&mut buf, 100)
                .expect("encode");
        }
        buf
    }

    /// Fed a byte at a time, as the socket may deliver it: the unread message is known as soon
    /// as its variable header is in, the buffer never holds more than that plus one read, and
    /// the packet after it decodes whole.
    #[test]
    fn an_unread_publish_keeps_its_topic_and_properties_and_skips_its_payload() {
        for protocol in [MqttProtocol::V311, MqttProtocol::V5] {
            let codec = Codec::new(protocol);
            let wire = big_then_small(protocol, 300_000);
            let mut buf = BytesMut::new();
            let mut fed = 0;
            let (message, skip) = loop {
                buf.extend_from_slice(&wire[fed..fed + 1]);
                fed += 1;
                let head = Head::read(&buf).expect("head");
                let Some(head) = head else { continue };
                assert!(head.is_publish() && head.remaining > 300_000);
                if let Some(unread) = codec.unread_publish(&mut buf, head).expect("decodes") {
                    break unread;
                }
            };
            assert!(
                fed < 100,
                "{protocol:?}: took {fed} bytes before the payload"
            );
            assert!(buf.is_empty());
            assert_eq!(
                (message.topic.as_str(), message.pkid, message.qos),
                ("t/big", 9, 1)
            );
            assert!(message.payload.is_empty());
            assert_eq!(message.unread.map(|n| n > 300_000), Some(true));
            assert!(message.size < 100);
            if matches!(protocol, MqttProtocol::V5) {
                assert_eq!(message.subscription_ids, [42]);
                assert_eq!(message.user_properties, [("k".to_owned(), "v".to_owned())]);
            }
            // The rest of the packet is skipped as it arrives: what follows is the next one.
            buf.extend_from_slice(&wire[fed + skip..]);
            match codec.decode(&mut buf) {
                Ok(Some(Incoming::Publish(p))) => {
                    assert_eq!(
                        (p.topic.as_str(), p.pkid, &p.payload[..]),
                        ("t/next", 10, &b"s"[..])
                    );
                }
                _ => panic!("{protocol:?}: the next packet does not decode"),
            }
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn a_publish_is_recognised_before_it_is_decoded_and_only_when_whole() {
        for protocol in [MqttProtocol::V311, MqttProtocol::V5] {
            let codec = Codec::new(protocol);
            let mut whole = publish_bytes(protocol);
            let rest = whole.split_off(whole.len() - 1);
            assert!(matches!(codec.next_is_publish(&whole), Ok(None)));
            assert!(matches!(codec.decode(&mut whole), Ok(None)));
            whole.unsplit(rest);
            assert!(matches!(codec.next_is_publish(&whole), Ok(Some(true))));
            match codec.decode(&mut whole) {
                Ok(Some(Incoming::Publish(p))) => {
                    assert_eq!((p.topic.as_str(), p.pkid, p.qos), ("t/1", 7, 1));
                }
                _ => panic!("{protocol:?}: not a publish"),
            }
            assert!(whole.is_empty());
        }
    }

    #[test]
    fn a_v5_disconnect_without_properties_is_a_disconnect_with_its_reason() {
        let codec = Codec::new(MqttProtocol::V5);
        for (bytes, reason) in [
            (&[0xE0u8, 0x00, 0xD0][..], "NormalDisconnection"),
            (&[0xE0u8, 0x01, 0x8B, 0xD0][..], "ServerShuttingDown"),
            (&[0xE0u8, 0x02, 0x8E, 0x00, 0xD0][..], "SessionTakenOver"),
        ] {
            let mut buf = BytesMut::from(bytes);
            assert!(matches!(codec.next_is_publish(&buf), Ok(Some(false))));
            match codec.decode(&mut buf) {
                Ok(Some(Incoming::Disconnect(r))) => assert_eq!(r, reason),
                _ => panic!("{bytes:?}: not a disconnect"),
            }
            assert_eq!(&buf[..], &[0xD0], "exactly the packet taken");
        }
    }

    #[test]
    fn acks_and_pubcomp_encode_for_both_versions() {
        for protocol in [MqttProtocol::V311, MqttProtocol::V5] {
            let codec = Codec::new(protocol);
            for (qos, first) in [(1u8, 0x40u8), (2, 0x50)] {
                let mut out = BytesMut::new();
                codec.ack(qos, 513, &mut out).expect("ack");
                assert_eq!(&out[..], &[first, 2, 2, 1]);
            }
            let mut out = BytesMut::new();
            codec.ack(0, 1, &mut out).expect("no ack");
            assert!(out.is_empty(), "QoS 0 has no ack");
            codec.pubcomp(9, &mut out).expect("pubcomp");
            assert_eq!(&out[..], &[0x70, 2, 0, 9]);
        }
    }
}
