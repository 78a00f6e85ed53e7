//! The MQTT driver (`ferry_forwarder::mqtt::start`) against a real Mosquitto, without Kafka: the
//! test plays the pipeline. Covers the window, prompt acks, keep-alive under backpressure,
//! connection epochs (stale acks never written) and QoS 2. A recording TCP proxy between the
//! driver and the broker shows which packets went over which connection.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use ferry_api::config::{MqttConfig, MqttProtocol, Secret, Tls};
use ferry_e2e::{KeyType, Mosquitto, MosquittoOptions, Pki, TlsListener, wait_until_async};
use ferry_forwarder::metrics::Metrics;
use ferry_forwarder::mqtt::{self, Link, Message, Outbound, ReaderExit};
use rumqttc::QoS;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const PUBACK: u8 = 4;
const PUBREC: u8 = 5;
const PUBREL: u8 = 6;
const PUBCOMP: u8 = 7;
const SUBSCRIBE: u8 = 8;
const PINGREQ: u8 = 12;
const DISCONNECT: u8 = 14;

const BOTH: [MqttProtocol; 2] = [MqttProtocol::V311, MqttProtocol::V5];

/// How often the tests look at a driver in process: its states change within milliseconds.
const DRIVER_POLL: Duration = Duration::from_millis(10);

fn config(
    port: u16,
    client_id: &str,
    protocol: MqttProtocol,
    window: u16,
    keep_alive_secs: u16,
) -> MqttConfig {
    MqttConfig {
        host: "127.0.0.1".into(),
        port,
        protocol,
        client_id: client_id.into(),
        clean_session: false,
        session_expiry_secs: None,
        shared_group: None,
        subscribe_shared: true,
        keep_alive_secs,
        max_inflight: window,
        max_inflight_bytes: ferry_api::defaults::MAX_INFLIGHT_BYTES,
        max_message_bytes: ferry_api::defaults::MAX_MESSAGE_BYTES,
        username: None,
        username_file: None,
        password: None,
        password_file: None,
        tls: None,
        reconnect_min_ms: 50,
        reconnect_max_ms: 500,
        allow_weaker_delivery: false,
    }
}

/// The driver with the test as its pipeline.
struct Driver {
    link: Link,
    task: tokio::task::JoinHandle<ReaderExit>,
    inbound: mpsc::Receiver<Message>,
    metrics: Arc<Metrics>,
}

impl Driver {
    fn start(cfg: &MqttConfig, filter: &str, qos: u8) -> Result<Self> {
        Self::start_with(cfg, &[filter], qos)
    }

    fn start_with(cfg: &MqttConfig, filters: &[&str], qos: u8) -> Result<Self> {
        let metrics = Arc::new(Metrics::new());
        let subscriptions = Arc::new(Mutex::new(ferry_api::config::SubscriptionPlan {
            subscribe: filters.iter().map(|f| ((*f).to_owned(), qos)).collect(),
            unsubscribe_on_connect: Vec::new(),
        }));
        let (to_pipeline, inbound) = mpsc::channel(usize::from(cfg.max_inflight));
        let (link, task) = mqtt::start(cfg, subscriptions, Arc::clone(&metrics), to_pipeline)?;
        Ok(Self {
            link,
            task,
            inbound,
            metrics,
        })
    }

    fn complete(&self, m: &Message) {
        let _ = self.link.outbound.send(Outbound::Complete {
            epoch: m.epoch,
            qos: m.qos,
            pkid: m.pkid,
            bytes: m.size,
        });
    }

    /// Exactly `n` messages, or an error.
    async fn recv(&mut self, n: usize, within: Duration) -> Result<Vec<Message>> {
        let deadline = tokio::time::Instant::now() + within;
        let mut got = Vec::with_capacity(n);
        while got.len() < n {
            match tokio::time::timeout_at(deadline, self.inbound.recv()).await {
                Ok(Some(m)) => got.push(m),
                Ok(None) => bail!("driver ended after {} of {n} messages", got.len()),
                Err(_) => bail!("{} of {n} messages within {within:?}", got.len()),
            }
        }
        Ok(got)
    }

    async fn wait_subscribed(&self, within: Duration) -> Result<()> {
        wait_until_async("subscribed", within, DRIVER_POLL, || {
            self.metrics.health.mqtt_subscribed()
        })
        .await
    }

    /// Drops the link (the pipeline's "finish") and returns how the driver ended.
    async fn finish(self) -> Result<ReaderExit> {
        drop(self.link);
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .context("driver did not finish")?
            .context("driver task")
    }
}

fn numbered(topic: &str, range: std::ops::Range<usize>) -> Vec<(String, Vec<u8>)> {
    range
        .map(|i| (topic.to_owned(), i.to_string().into_bytes()))
        .collect()
}

fn seq(m: &Message) -> Result<usize> {
    std::str::from_utf8(&m.payload)?
        .parse()
        .with_context(|| format!("payload {:?}", m.payload))
}

/// Resumes `client_id`'s session with a fresh driver and returns the payloads the broker still
/// held for it: everything it delivers before a marker published once the driver subscribed.
async fn held_for(
    port: u16,
    client_id: &str,
    protocol: MqttProtocol,
    topic: &str,
) -> Result<Vec<String>> {
    let filter = format!("{topic}/#");
    let mut d = Driver::start(&config(port, client_id, protocol, 1000, 30), &filter, 2)?;
    let (mut held, mut marker_sent) = (Vec::new(), false);
    let start = Instant::now();
    loop {
        if !marker_sent && d.metrics.health.mqtt_subscribed() {
            let marker = vec![(format!("{topic}/marker"), b"marker".to_vec())];
            ferry_e2e::publish(
                port,
                format!("{client_id}-marker"),
                QoS::AtLeastOnce,
                marker,
            )
            .await?;
            marker_sent = true;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(60),
            "marker not seen within 60 s"
        );
        let Ok(next) = tokio::time::timeout(Duration::from_millis(50), d.inbound.recv()).await
        else {
            continue;
        };
        let m = next.context("driver ended")?;
        d.complete(&m);
        if m.topic.ends_with("/marker") {
            break;
        }
        held.push(String::from_utf8_lossy(&m.payload).into_owned());
    }
    ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
    Ok(held)
}

/// One MQTT packet the proxy saw: on which connection (from 1), which way, its type and id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    conn: usize,
    to_broker: bool,
    kind: u8,
    pkid: Option<u16>,
    at: Instant,
    /// Swallowed rather than passed on to the driver.
    swallowed: bool,
}

/// A TCP proxy between the driver and Mosquitto: records the packets each way, can cut every
/// connection, can swallow what the broker sends (as if lost with the connection), and can
/// send the driver packets of its own as if from the broker.
struct Proxy {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    pumps: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    /// The connection (counted from 1) whose broker-to-driver bytes are swallowed; 0: none.
    swallow: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    /// Per connection (index 0 = connection 1): bytes to send the driver.
    injectors: Arc<Mutex<Vec<mpsc::UnboundedSender<Vec<u8>>>>>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: u16) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let pumps: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let swallow = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let injectors: Arc<Mutex<Vec<mpsc::UnboundedSender<Vec<u8>>>>> = Arc::default();
        let (s, p, w, a, i) = (
            Arc::clone(&seen),
            Arc::clone(&pumps),
            Arc::clone(&swallow),
            Arc::clone(&accepted),
            Arc::clone(&injectors),
        );
        let acceptor = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let conn = a.fetch_add(1, Ordering::SeqCst) + 1;
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let (inject, injected) = mpsc::unbounded_channel();
                i.lock().unwrap_or_else(|e| e.into_inner()).push(inject);
                let (_, nothing) = mpsc::unbounded_channel();
                let (up_log, down_log) =
                    ((conn, true, Arc::clone(&s)), (conn, false, Arc::clone(&s)));
                let up = tokio::spawn(pump(cr, sw, up_log, Arc::clone(&w), nothing));
                let down = tokio::spawn(pump(sr, cw, down_log, Arc::clone(&w), injected));
                let mut handles = p.lock().unwrap_or_else(|e| e.into_inner());
                handles.extend([up.abort_handle(), down.abort_handle()]);
            }
        });
        Ok(Self {
            port,
            seen,
            pumps,
            swallow,
            accepted,
            injectors,
            acceptor,
        })
    }

    /// Sends `bytes` to the driver on connection `conn`, as if from the broker.
    fn inject(&self, conn: usize, bytes: &[u8]) -> Result<()> {
        let injectors = self.injectors.lock().unwrap_or_else(|e| e.into_inner());
        let inject = injectors.get(conn - 1).context("no such connection")?;
        inject
            .send(bytes.to_vec())
            .ok()
            .context("connection closed")
    }

    /// Closes every connection at once, both ways.
    fn cut(&self) {
        self.swallow.store(0, Ordering::SeqCst);
        for pump in self
            .pumps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            pump.abort();
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn count(&self, conn: usize, to_broker: bool, kind: u8) -> usize {
        self.seen()
            .iter()
            .filter(|s| s.conn == conn && s.to_broker == to_broker && s.kind == kind)
            .count()
    }

    async fn wait_count(&self, conn: usize, to_broker: bool, kind: u8, n: usize) -> Result<()> {
        let what = format!("{n} packets of type {kind} on connection {conn}");
        wait_until_async(&what, Duration::from_secs(15), DRIVER_POLL, || {
            self.count(conn, to_broker, kind) >= n
        })
        .await
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.cut();
    }
}

/// Copies `from` to `to`, logging each packet as (connection, direction) in `log`; writes
/// what comes over `inject` too.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    (conn, to_broker, seen): (usize, bool, Arc<Mutex<Vec<Seen>>>),
    swallow: Arc<AtomicUsize>,
    mut inject: mpsc::UnboundedReceiver<Vec<u8>>,
) {
    let mut chunk = vec![0u8; 64 * 1024];
    let mut pending = Vec::new();
    loop {
        let n = tokio::select! {
            read = from.read(&mut chunk) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            Some(bytes) = inject.recv() => {
                if to.write_all(&bytes).await.is_err() {
                    return;
                }
                continue;
            }
        };
        pending.extend_from_slice(&chunk[..n]);
        let swallowed = !to_broker && swallow.load(Ordering::SeqCst) == conn;
        let mut at = 0;
        while let Some((kind, pkid, len)) = frame(&pending[at..]) {
            let s = Seen {
                conn,
                to_broker,
                kind,
                pkid,
                at: Instant::now(),
                swallowed,
            };
            seen.lock().unwrap_or_else(|e| e.into_inner()).push(s);
            at += len;
        }
        pending.drain(..at);
        if swallowed {
            continue;
        }
        if to.write_all(&chunk[..n]).await.is_err() {
            return;
        }
    }
}

/// The type, packet id and length of the whole packet at the start of `buf`, if there is one.
fn frame(buf: &[u8]) -> Option<(u8, Option<u16>, usize)> {
    let first = *buf.first()?;
    let (mut remaining, mut shift, mut i) = (0usize, 0, 1);
    loop {
        let b = *buf.get(i)?;
        remaining |= usize::from(b & 0x7f) << shift;
        i += 1;
        shift += 7;
        if b & 0x80 == 0 {
            break;
        }
    }
    let total = i + remaining;
    let body = buf.get(i..total)?;
    let id = |at: usize| Some(u16::from_be_bytes([*body.get(at)?, *body.get(at + 1)?]));
    let kind = first >> 4;
    let pkid = match kind {
        3 if (first >> 1) & 3 > 0 => {
            let topic_len = usize::from(id(0)?);
            id(2 + topic_len)
        }
        4..=11 => id(0),
        _ => None,
    };
    Some((kind, pkid, total))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeps_the_connection_while_backpressured_for_4x_keep_alive_then_acks_everything()
-> Result<()> {
    for protocol in BOTH {
        let broker = Mosquitto::start_with(MosquittoOptions {
            log_connections: true,
            ..MosquittoOptions::default()
        })?;
        let proxy = Proxy::start(broker.port()).await?;
        let (window, keep_alive, total) = (50usize, 5u16, 500);
        let id = format!("ka-{protocol:?}");
        let cfg = config(proxy.port, &id, protocol, window as u16, keep_alive);
        let mut d = Driver::start(&cfg, "ka/#", 1)?;
        d.wait_subscribed(Duration::from_secs(10)).await?;
        ferry_e2e::publish(
            broker.port(),
            "ka-pub",
            QoS::AtLeastOnce,
            numbered("ka/t", 0..total),
        )
        .await?;

        // The pipeline takes the window's worth and completes nothing for 20 s: 4 keep-alives,
        // well past the broker's limit of 1.5 keep-alives without a packet from us.
        let mut held = d.recv(window, Duration::from_secs(10)).await?;
        let hold = Instant::now();
        while hold.elapsed() < Duration::from_secs(20) {
            ensure!(
                d.metrics.health.mqtt_connected(),
                "{protocol:?}: disconnected after {:?}",
                hold.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        ensure!(
            d.inbound.try_recv().is_err(),
            "{protocol:?}: a message beyond the window was handed over"
        );
        let pings = proxy.count(1, true, PINGREQ);
        ensure!(
            pings >= 3,
            "{protocol:?}: {pings} PINGREQs in 20 s with keep-alive {keep_alive} s"
        );

        for m in &held {
            d.complete(m);
        }
        while held.len() < total {
            let more = d.recv(1, Duration::from_secs(10)).await?;
            d.complete(&more[0]);
            held.extend(more);
        }
        let got: Vec<usize> = held.iter().map(seq).collect::<Result<_>>()?;
        ensure!(
            got == (0..total).collect::<Vec<_>>(),
            "{protocol:?}: in order, once each"
        );
        proxy.wait_count(1, true, PUBACK, total).await?;
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));

        let log = std::fs::read_to_string(broker.dir().join("mosquitto.log"))?;
        let connects = log
            .lines()
            .filter(|l| l.contains("New client connected") && l.contains(&format!(" as {id} ")))
            .count();
        ensure!(
            connects == 1 && !log.contains("exceeded timeout"),
            "{protocol:?}: {connects} connections:\n{log}"
        );
        ensure!(proxy.accepted.load(Ordering::SeqCst) == 1);
        let again = held_for(broker.port(), &id, protocol, "ka").await?;
        ensure!(
            again.is_empty(),
            "{protocol:?}: the broker redelivered {} messages",
            again.len()
        );
        eprintln!(
            "{protocol:?}: held a full window for 20 s on one connection ({pings} PINGREQs), then acked all {total}"
        );
    }
    Ok(())
}

/// How the messages reach the broker in `kill_mid_stream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    /// Published while the driver runs, by this many publishers at once (200 in flight each).
    Live(usize),
    /// All queued for the session before the driver connects.
    Backlog,
}

/// What `kill_mid_stream` measured.
#[derive(Debug)]
struct Kill {
    /// Messages the driver decoded before it was killed.
    decoded: usize,
    /// Acks it had written and flushed.
    acked: u64,
    /// Decoded messages the broker delivered again to the resumed session.
    replayed: usize,
}

/// Feeds `total` messages to a driver that completes each as it arrives, aborts the driver
/// after `kill_at` (its socket closes with unread data: a reset, as after SIGKILL), then
/// resumes the session and counts what comes again.
async fn kill_mid_stream(
    broker_inflight: u32,
    protocol: MqttProtocol,
    window: u16,
    feed: Feed,
    (total, kill_at): (usize, usize),
) -> Result<Kill> {
    let broker = Mosquitto::start_with(MosquittoOptions {
        max_inflight_messages: Some(broker_inflight),
        ..MosquittoOptions::default()
    })?;
    let id = format!("kill-{protocol:?}-{broker_inflight}");
    let cfg = config(broker.port(), &id, protocol, window, 30);
    let publishers = match feed {
        Feed::Live(n) => n,
        Feed::Backlog => 1,
    };
    let share = total / publishers;
    let publish = |k: usize| {
        ferry_e2e::publish(
            broker.port(),
            format!("{id}-pub-{k}"),
            QoS::AtLeastOnce,
            numbered(&format!("kill/{k}"), k * share..(k + 1) * share),
        )
    };
    if feed == Feed::Backlog {
        let d = Driver::start(&cfg, "kill/#", 1)?;
        d.wait_subscribed(Duration::from_secs(10)).await?;
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
        publish(0).await?;
    }
    let d = Driver::start(&cfg, "kill/#", 1)?;
    let mut publishing = tokio::task::JoinSet::new();
    if let Feed::Live(n) = feed {
        // (With a backlog, the SUBACK comes behind it: nobody is taking messages yet.)
        d.wait_subscribed(Duration::from_secs(10)).await?;
        for k in 0..n {
            publishing.spawn(publish(k));
        }
    }
    let Driver {
        link,
        task,
        mut inbound,
        metrics,
    } = d;
    let abort = task.abort_handle();
    // The pipeline: completes every message at once; pulls the plug after `kill_at`. It ends
    // when the killed driver's end of the channel is gone, having taken all it decoded.
    let consumer = tokio::spawn(async move {
        let mut seen = BTreeSet::new();
        while let Some(m) = inbound.recv().await {
            seen.insert(seq(&m)?);
            let _ = link.outbound.send(Outbound::Complete {
                epoch: m.epoch,
                qos: m.qos,
                pkid: m.pkid,
                bytes: m.size,
            });
            if seen.len() == kill_at {
                abort.abort();
            }
        }
        anyhow::Ok(seen)
    });
    let _ = task.await;
    let acked = metrics.acked.get();
    let seen = tokio::time::timeout(Duration::from_secs(60), consumer)
        .await
        .context("consumer")???;
    ensure!(
        seen.len() >= kill_at,
        "only {} messages before the kill",
        seen.len()
    );
    let published = tokio::time::timeout(Duration::from_secs(120), publishing.join_all())
        .await
        .context("publishers")?;
    published.into_iter().collect::<Result<()>>()?;
    let held = held_for(broker.port(), &id, protocol, "kill").await?;
    let held: BTreeSet<usize> = held.iter().map(|p| p.parse()).collect::<Result<_, _>>()?;
    let missing = (0..total)
        .filter(|i| !seen.contains(i) && !held.contains(i))
        .count();
    ensure!(missing == 0, "{missing} messages lost");
    Ok(Kill {
        decoded: seen.len(),
        acked,
        replayed: seen.intersection(&held).count(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_the_broker_replays_at_most_the_window() -> Result<()> {
    let (window, total, kill_at) = (500u16, 20_000, 10_000);
    let w = u32::from(window);
    let runs = [
        (w, MqttProtocol::V311, Feed::Live(1)),
        (0, MqttProtocol::V311, Feed::Live(1)),
        (0, MqttProtocol::V5, Feed::Live(1)),
        (w, MqttProtocol::V311, Feed::Live(4)),
        (0, MqttProtocol::V311, Feed::Live(4)),
        (0, MqttProtocol::V5, Feed::Live(4)),
        (w, MqttProtocol::V311, Feed::Backlog),
        (0, MqttProtocol::V311, Feed::Backlog),
        (0, MqttProtocol::V5, Feed::Backlog),
    ];
    for (broker_inflight, protocol, feed) in runs {
        let k = kill_mid_stream(broker_inflight, protocol, window, feed, (total, kill_at)).await?;
        eprintln!(
            "{protocol:?}, {feed:?}, broker max_inflight_messages {broker_inflight} (0: unlimited), \
             window {window}: {k:?}"
        );
        // The window, by construction: nothing is decoded without a slot, and a slot comes
        // back only once its ack was written and flushed.
        let unacked = k.decoded as u64 - k.acked.min(k.decoded as u64);
        ensure!(
            unacked <= u64::from(window),
            "{unacked} decoded and not acked on the wire"
        );
        // What the broker replays is that, plus acks it had received but not yet read when the
        // reset discarded them: how late it reads them is the broker's, not a bound of ours.
        // A broker whose max_inflight_messages is the window (as docs/guarantees.md asks) keeps
        // a replay near the window with one publisher, but not within it on a busy machine
        // (584 of a 500 window, once): held to its limit plus the window, as the fault tests
        // hold a forwarder's. Flooding (4 publishers, or a backlog), Mosquitto 2.0.11 exceeds
        // its own max_inflight_messages and Receive Maximum; an unlimited broker reads acks
        // late on a busy machine (664 replayed of a 500 window, once): reported only.
        if feed == Feed::Live(1) && broker_inflight == w {
            ensure!(k.replayed <= 2 * usize::from(window), "{k:?}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_from_an_earlier_connection_is_never_written_and_frees_its_slot() -> Result<()>
{
    for protocol in BOTH {
        let broker = Mosquitto::start()?;
        let proxy = Proxy::start(broker.port()).await?;
        let window = 10;
        let id = format!("stale-{protocol:?}");
        let mut d = Driver::start(
            &config(proxy.port, &id, protocol, window as u16, 30),
            "stale/#",
            1,
        )?;
        d.wait_subscribed(Duration::from_secs(10)).await?;
        ferry_e2e::publish(
            broker.port(),
            "stale-pub",
            QoS::AtLeastOnce,
            numbered("stale/t", 0..window),
        )
        .await?;
        let first = d.recv(window, Duration::from_secs(10)).await?;
        ensure!(first.iter().all(|m| m.epoch == 1));

        proxy.cut();
        proxy.wait_count(2, true, SUBSCRIBE, 1).await?;
        // The window is full of epoch-1 messages: completing them (stale) frees it, and only
        // then does the driver read the redeliveries.
        for m in &first {
            d.complete(m);
        }
        let second = d.recv(window, Duration::from_secs(10)).await?;
        ensure!(
            second.iter().all(|m| m.epoch == 2),
            "{protocol:?}: redeliveries on epoch 2"
        );
        let ids = |ms: &[Message]| ms.iter().map(|m| m.pkid).collect::<BTreeSet<_>>();
        ensure!(
            ids(&first) == ids(&second),
            "{protocol:?}: a resumed session redelivers under the same ids"
        );
        for m in &second {
            d.complete(m);
        }
        // The stale completions were queued first: had any been written, it would show by now.
        proxy.wait_count(2, true, PUBACK, window).await?;
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
        let acks: Vec<Seen> = proxy
            .seen()
            .into_iter()
            .filter(|s| s.to_broker && s.kind == PUBACK)
            .collect();
        ensure!(
            acks.iter().all(|s| s.conn == 2),
            "{protocol:?}: an ack on the first connection: {acks:?}"
        );
        let acked: BTreeSet<u16> = acks.iter().filter_map(|s| s.pkid).collect();
        ensure!(
            acks.len() == window && acked == ids(&second),
            "{protocol:?}: each id acked once: {acks:?}"
        );
        ensure!(
            held_for(broker.port(), &id, protocol, "stale")
                .await?
                .is_empty()
        );
        eprintln!(
            "{protocol:?}: {window} stale completions dropped, {window} acks on the new connection"
        );
    }
    Ok(())
}

/// Waits until the driver wrote `acked` acks in all and stopped taking messages (its window is
/// full), then returns what it handed over: nothing more can come before another completion.
async fn taken_until_full(d: &mut Driver, acked: u64) -> Result<Vec<Message>> {
    let mut got = Vec::new();
    wait_until_async(
        "the window full",
        Duration::from_secs(10),
        DRIVER_POLL,
        || {
            while let Ok(m) = d.inbound.try_recv() {
                got.push(m);
            }
            d.metrics.acked.get() == acked && !d.metrics.mqtt_reading()
        },
    )
    .await
    .with_context(|| {
        let topics: Vec<&str> = got.iter().map(|m| m.topic.as_str()).collect();
        format!(
            "acked {} (waiting for {acked}), reading {}, taken {topics:?}",
            d.metrics.acked.get(),
            d.metrics.mqtt_reading()
        )
    })?;
    while let Ok(m) = d.inbound.try_recv() {
        got.push(m);
    }
    Ok(got)
}

/// The window in bytes, and a message over `max_message_bytes` read without its payload: a
/// 2 MiB message is handed over unread (topic kept, payload empty) on a connection that stays
/// up, and messages of 50 KiB are taken while their bytes fit 128 KiB, then one per freed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_is_bounded_in_bytes_and_an_oversized_message_is_skipped_unread() -> Result<()> {
    const KIB: usize = 1024;
    for protocol in BOTH {
        let broker = Mosquitto::start()?;
        let id = format!("bytes-{protocol:?}");
        let mut cfg = config(broker.port(), &id, protocol, 100, 30);
        cfg.max_message_bytes = 64 * KIB as u32;
        cfg.max_inflight_bytes = 128 * KIB as u64;
        let mut d = Driver::start(&cfg, "size/#", 1)?;
        d.wait_subscribed(Duration::from_secs(10)).await?;
        let mut messages = vec![("size/big".to_owned(), vec![b'x'; 2048 * KIB])];
        messages.extend((0..6u8).map(|i| (format!("size/mid/{i}"), vec![b'0' + i; 50 * KIB])));
        ferry_e2e::publish(broker.port(), "size-pub", QoS::AtLeastOnce, messages).await?;

        // The unread one counts only its topic: with it, two of 50 KiB fit 128 KiB, a third not.
        let first = taken_until_full(&mut d, 0).await?;
        let topics: Vec<&str> = first.iter().map(|m| m.topic.as_str()).collect();
        ensure!(
            topics == ["size/big", "size/mid/0", "size/mid/1"],
            "{protocol:?}: taken before any completion: {topics:?}"
        );
        let big = &first[0];
        ensure!(
            big.payload.is_empty() && big.unread.is_some_and(|n| n > 2048 * KIB) && big.size < KIB,
            "{protocol:?}: the big one unread: {:?} {}",
            big.unread,
            big.size
        );
        ensure!(first[1].payload.len() == 50 * KIB && first[1].unread.is_none());
        // Completing the unread one frees too little for a third 50 KiB message.
        d.complete(big);
        let none = taken_until_full(&mut d, 1).await?;
        ensure!(
            none.is_empty(),
            "{protocol:?}: took {} after freeing the unread one",
            none.len()
        );
        // Each completed 50 KiB message lets exactly one more in (the last one finds the
        // session empty, so the window never fills again).
        let mut seen = first;
        let mut outstanding: Vec<Message> = seen[1..].to_vec();
        for n in 2..6u64 {
            d.complete(&outstanding.remove(0));
            let next = if n < 5 {
                taken_until_full(&mut d, n).await?
            } else {
                d.recv(1, Duration::from_secs(10)).await?
            };
            ensure!(
                next.len() == 1 && next[0].topic == format!("size/mid/{n}"),
                "{protocol:?}: after one completion: {:?}",
                next.iter().map(|m| &m.topic).collect::<Vec<_>>()
            );
            outstanding.extend(next.iter().cloned());
            seen.extend(next);
        }
        for m in &outstanding {
            d.complete(m);
        }
        ensure!(
            seen.iter().all(|m| m.epoch == 1) && d.metrics.unread.get() == 1,
            "{protocol:?}: one unread message, on a connection that stayed up"
        );
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
        ensure!(
            held_for(broker.port(), &id, protocol, "size")
                .await?
                .is_empty()
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos2_is_answered_pubrec_then_pubcomp_even_for_a_pubrel_after_a_reconnect() -> Result<()> {
    for protocol in BOTH {
        let broker = Mosquitto::start()?;
        let proxy = Proxy::start(broker.port()).await?;
        let id = format!("qos2-{protocol:?}");
        let mut d = Driver::start(&config(proxy.port, &id, protocol, 100, 30), "q2/#", 2)?;
        d.wait_subscribed(Duration::from_secs(10)).await?;
        let n = 5;
        ferry_e2e::publish(
            broker.port(),
            "q2-pub",
            QoS::ExactlyOnce,
            numbered("q2/t", 0..n),
        )
        .await?;
        let first = d.recv(n, Duration::from_secs(10)).await?;
        ensure!(first.iter().all(|m| m.qos == 2));
        ensure!(
            proxy.count(1, true, PUBREC) == 0,
            "no PUBREC before the pipeline completes"
        );
        for m in &first {
            d.complete(m);
        }
        proxy.wait_count(1, true, PUBCOMP, n).await?;

        // The broker's PUBRELs for the next ones are lost with the connection: it sends them
        // again on the next one, where the driver has no memory of them.
        ferry_e2e::publish(
            broker.port(),
            "q2-pub",
            QoS::ExactlyOnce,
            numbered("q2/t", n..2 * n),
        )
        .await?;
        let second = d.recv(n, Duration::from_secs(10)).await?;
        proxy.swallow.store(1, Ordering::SeqCst);
        for m in &second {
            d.complete(m);
        }
        proxy.wait_count(1, false, PUBREL, 2 * n).await?;
        proxy.cut();
        proxy.wait_count(2, true, PUBCOMP, n).await?;
        let answered: BTreeSet<u16> = proxy
            .seen()
            .iter()
            .filter(|s| s.conn == 2 && s.to_broker && s.kind == PUBCOMP)
            .filter_map(|s| s.pkid)
            .collect();
        ensure!(
            answered == second.iter().map(|m| m.pkid).collect(),
            "{protocol:?}: PUBCOMP for each re-sent PUBREL"
        );

        // Still the same, healthy connection: one more message goes the whole way.
        ferry_e2e::publish(
            broker.port(),
            "q2-pub",
            QoS::ExactlyOnce,
            numbered("q2/t", 2 * n..2 * n + 1),
        )
        .await?;
        let last = d.recv(1, Duration::from_secs(10)).await?;
        ensure!(last[0].epoch == 2);
        d.complete(&last[0]);
        proxy.wait_count(2, true, PUBCOMP, n + 1).await?;
        ensure!(
            proxy.accepted.load(Ordering::SeqCst) == 2,
            "{protocol:?}: reconnected again"
        );
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
        ensure!(
            held_for(broker.port(), &id, protocol, "q2")
                .await?
                .is_empty()
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_broker_is_judged_dead_after_one_and_a_half_keep_alives_while_reading()
-> Result<()> {
    let broker = Mosquitto::start()?;
    let proxy = Proxy::start(broker.port()).await?;
    let keep_alive = Duration::from_secs(5);
    let cfg = config(proxy.port, "silent", MqttProtocol::V311, 10, 5);
    let d = Driver::start(&cfg, "silent/#", 1)?;
    d.wait_subscribed(Duration::from_secs(10)).await?;
    // The broker still hears our PINGREQs and keeps the connection; we hear nothing back.
    proxy.swallow.store(1, Ordering::SeqCst);
    proxy.wait_count(2, true, SUBSCRIBE, 1).await?;
    let seen = proxy.seen();
    let last_heard = seen
        .iter()
        .filter(|s| s.conn == 1 && !s.to_broker && !s.swallowed)
        .map(|s| s.at)
        .max()
        .context("nothing heard")?;
    let reconnected = seen
        .iter()
        .find(|s| s.conn == 2)
        .map(|s| s.at)
        .context("no second connection")?;
    let silence = reconnected - last_heard;
    let limit = keep_alive * 3 / 2;
    // Up to the backoff (reconnect_max_ms) and a second of scheduling on a busy machine late.
    let latest = limit + Duration::from_millis(cfg.reconnect_max_ms) + Duration::from_secs(1);
    ensure!(
        silence >= limit && silence <= latest,
        "reconnected after {silence:?} of silence (keep-alive {keep_alive:?})"
    );
    ensure!(
        proxy.count(1, true, PINGREQ) >= 1,
        "a PINGREQ went out in the silence"
    );
    d.wait_subscribed(Duration::from_secs(10)).await?;
    ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
    eprintln!("silent broker: reconnected after {silence:?} (keep-alive {keep_alive:?})");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_from_the_broker_means_reconnect_and_a_new_epoch() -> Result<()> {
    let broker = Mosquitto::start()?;
    let proxy = Proxy::start(broker.port()).await?;
    let cfg = config(proxy.port, "told", MqttProtocol::V5, 10, 30);
    let mut d = Driver::start(&cfg, "told/#", 1)?;
    d.wait_subscribed(Duration::from_secs(10)).await?;
    ferry_e2e::publish(
        broker.port(),
        "told-pub",
        QoS::AtLeastOnce,
        numbered("told/t", 0..1),
    )
    .await?;
    let first = d.recv(1, Duration::from_secs(10)).await?;
    // Mosquitto 2.0.11 closes without a DISCONNECT (on shutdown or a session take-over), so the
    // proxy sends one: reason Server shutting down, no properties.
    proxy.inject(1, &[0xE0, 0x01, 0x8B])?;
    proxy.wait_count(2, true, SUBSCRIBE, 1).await?;
    d.complete(&first[0]);
    let again = d.recv(1, Duration::from_secs(10)).await?;
    ensure!(
        again[0].epoch == 2 && again[0].pkid == first[0].pkid,
        "redelivered on epoch 2"
    );
    d.complete(&again[0]);
    proxy.wait_count(2, true, PUBACK, 1).await?;
    ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
    ensure!(proxy.count(1, true, PUBACK) == 0 && proxy.count(2, true, PUBACK) == 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_drivers_with_one_client_id_back_off_instead_of_hammering_the_broker() -> Result<()> {
    let broker = Mosquitto::start()?;
    let proxy = Proxy::start(broker.port()).await?;
    // Each connection takes the session from the other, which the broker then drops.
    let cfg = config(proxy.port, "twin", MqttProtocol::V311, 10, 30);
    let (a, b) = (
        Driver::start(&cfg, "twin/#", 1)?,
        Driver::start(&cfg, "twin/#", 1)?,
    );
    let fight = Duration::from_secs(5);
    tokio::time::sleep(fight).await;
    let connects = proxy.accepted.load(Ordering::SeqCst);
    let _ = (a.finish().await?, b.finish().await?);
    // A connection that does not outlive reconnect_max counts as a failure, so each driver's
    // pause doubles from reconnect_min/2 and, after 5 failures, is never under reconnect_max/2.
    let max = Duration::from_millis(cfg.reconnect_max_ms);
    let per_driver = 5 + (fight.as_millis() / (max / 2).as_millis()) as usize;
    ensure!(
        connects <= 2 * per_driver,
        "{connects} connections in {fight:?}"
    );
    eprintln!("two drivers with one client id: {connects} connections in {fight:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_and_resubscribes_after_the_broker_restarts() -> Result<()> {
    for protocol in BOTH {
        let mut broker = Mosquitto::start()?;
        let proxy = Proxy::start(broker.port()).await?;
        let cfg = config(proxy.port, "restart", protocol, 10, 30);
        let mut d = Driver::start(&cfg, "restart/#", 1)?;
        d.wait_subscribed(Duration::from_secs(10)).await?;
        broker.stop();
        // Told at once (the broker closed the connection), not at the next keep-alive.
        wait_until_async("disconnected", Duration::from_secs(5), DRIVER_POLL, || {
            !d.metrics.health.mqtt_connected()
        })
        .await?;
        broker.resume()?;
        // Sessions are in memory: the new one has no subscription until the driver makes it.
        d.wait_subscribed(Duration::from_secs(15)).await?;
        let one = numbered("restart/t", 0..1);
        ferry_e2e::publish(broker.port(), "restart-pub", QoS::AtLeastOnce, one).await?;
        let m = d.recv(1, Duration::from_secs(10)).await?;
        ensure!(
            m[0].epoch == 2,
            "{protocol:?}: arrived on the second connection"
        );
        d.complete(&m[0]);
        let conns = proxy.accepted.load(Ordering::SeqCst);
        proxy.wait_count(conns, true, PUBACK, 1).await?;
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
        let told = proxy.count(1, false, DISCONNECT) > 0;
        eprintln!(
            "{protocol:?}: reconnected after a broker restart (broker sent DISCONNECT: {told})"
        );
    }
    Ok(())
}

/// Time to take `total` queued QoS 1 messages through the driver, completing each at once.
async fn drain_rate(broker_inflight: u32, window: u16, total: usize) -> Result<f64> {
    let broker = Mosquitto::start_with(MosquittoOptions {
        max_inflight_messages: Some(broker_inflight),
        ..MosquittoOptions::default()
    })?;
    let cfg = config(broker.port(), "drain", MqttProtocol::V311, window, 30);
    let d = Driver::start(&cfg, "drain/#", 1)?;
    d.wait_subscribed(Duration::from_secs(10)).await?;
    ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
    ferry_e2e::publish(
        broker.port(),
        "drain-pub",
        QoS::AtLeastOnce,
        numbered("drain/t", 0..total),
    )
    .await?;
    let mut d = Driver::start(&cfg, "drain/#", 1)?;
    let start = Instant::now();
    for expected in 0..total {
        let Some(m) = tokio::time::timeout(Duration::from_secs(30), d.inbound.recv()).await? else {
            bail!("driver ended after {expected}");
        };
        ensure!(seq(&m)? == expected, "in order, once each");
        d.complete(&m);
    }
    let rate = total as f64 / start.elapsed().as_secs_f64();
    ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
    Ok(rate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drains_100k_queued_qos1_messages() -> Result<()> {
    let window = 1000;
    for broker_inflight in [u32::from(window), 0] {
        let rate = drain_rate(broker_inflight, window, 100_000).await?;
        eprintln!(
            "100k QoS 1 through the driver, window {window}, broker max_inflight_messages {broker_inflight}: {rate:.0} msg/s"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unverifiable_certificate_or_refused_password_is_permanent_naming_the_broker()
-> Result<()> {
    let pki = Pki::generate(KeyType::Ecdsa)?;
    let stranger = Pki::generate(KeyType::Ecdsa)?;
    let broker = Mosquitto::start_with(MosquittoOptions {
        tls: Some(TlsListener {
            pki: &pki,
            require_client_cert: false,
        }),
        users: vec![("ferry".into(), "right-password".into())],
        ..MosquittoOptions::default()
    })?;
    let tls = |ca: &Pki| Tls {
        ca_file: Some(ca.ca_cert().display().to_string()),
        ..Tls::default()
    };
    let with = |ca: &Pki, password: &str| MqttConfig {
        username: Some("ferry".into()),
        password: Some(Secret(password.into())),
        tls: Some(tls(ca)),
        ..config(broker.tls_port(), "tls", MqttProtocol::V311, 10, 30)
    };
    let addr = format!("127.0.0.1:{}", broker.tls_port());
    for (cfg, expected) in [
        (with(&stranger, "right-password"), "certificate"),
        (with(&pki, "wrong-password"), "refused"),
    ] {
        let d = Driver::start(&cfg, "t/#", 1)?;
        let exit = tokio::time::timeout(Duration::from_secs(15), d.task).await??;
        let ReaderExit::Permanent(permanent) = exit else {
            bail!("{expected}: not permanent: {exit:?}");
        };
        let reason = permanent.to_string();
        ensure!(
            reason.contains(&addr) && reason.contains(expected),
            "{reason}"
        );
        ensure!(
            !reason.contains("right-password") && !reason.contains("wrong-password"),
            "a secret in {reason}"
        );
        eprintln!("{reason}");
    }
    let d = Driver::start(&with(&pki, "right-password"), "t/#", 1)?;
    d.wait_subscribed(Duration::from_secs(10)).await?;
    ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
    Ok(())
}

/// A SUBACK refusing a filter (Mosquitto's ACL, dynamic-security plugin): with every filter
/// refused the driver is not subscribed (so never ready) and says why; with some refused, it
/// is subscribed, delivers what the granted filters match, and the refused filter fails the
/// rule that subscribes it, with the broker's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_subscription_fails_its_rule_and_all_refused_is_not_subscribed() -> Result<()> {
    let broker = Mosquitto::start_with(MosquittoOptions {
        deny_subscribe: vec!["secret/#".into()],
        ..MosquittoOptions::default()
    })?;
    for (protocol, reason) in [
        (MqttProtocol::V311, "failure (0x80)"),
        (MqttProtocol::V5, "not authorized (0x87)"),
    ] {
        let cfg = config(
            broker.port(),
            &format!("acl-{protocol:?}"),
            protocol,
            10,
            30,
        );
        let d = Driver::start(&cfg, "secret/a", 1)?;
        let rules = d.metrics.set_rules(&["secret".to_owned()]);
        rules[0].set_subscribed(vec!["secret/a".to_owned()]);
        wait_until_async("the refusal", Duration::from_secs(10), DRIVER_POLL, || {
            d.metrics.status().rules[0].subscription_refused.is_some()
        })
        .await?;
        let status = d.metrics.status();
        ensure!(
            !status.mqtt.subscribed && !d.metrics.health.ready(),
            "{protocol:?}: every filter refused, yet subscribed"
        );
        let refused = status.rules[0].subscription_refused.clone();
        ensure!(
            refused
                .as_ref()
                .map(|r| (r.filters.clone(), r.reason.as_str()))
                == Some((vec!["secret/a".to_owned()], reason)),
            "{protocol:?}: {refused:?}"
        );
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));

        let mut d = Driver::start_with(&cfg, &["open/a", "secret/a"], 1)?;
        let rules = d
            .metrics
            .set_rules(&["open".to_owned(), "secret".to_owned()]);
        rules[0].set_subscribed(vec!["open/a".to_owned()]);
        rules[1].set_subscribed(vec!["secret/a".to_owned()]);
        d.wait_subscribed(Duration::from_secs(10)).await?;
        wait_until_async("the refusal", Duration::from_secs(10), DRIVER_POLL, || {
            d.metrics.status().rules[1].subscription_refused.is_some()
        })
        .await?;
        let status = d.metrics.status();
        ensure!(
            status.mqtt.subscribed
                && status.rules[0].subscription_refused.is_none()
                && status.rules[1]
                    .subscription_refused
                    .as_ref()
                    .is_some_and(|r| r.reason == reason),
            "{protocol:?}: {:?}",
            status.rules
        );
        let one = numbered("open/a", 0..1);
        ferry_e2e::publish(broker.port(), "acl-pub", QoS::AtLeastOnce, one).await?;
        let m = d.recv(1, Duration::from_secs(10)).await?;
        d.complete(&m[0]);
        ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
        eprintln!("{protocol:?}: a refused filter: {reason}");
    }
    Ok(())
}

/// What Mosquitto delivers to one session whose subscriptions overlap (plain and shared):
/// MQTT 3.1.1, one copy per message; MQTT 5, one copy per matching subscription, each
/// carrying the identifier of the subscription it was delivered for, which is how the router
/// gives each rule the message once (`route.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_subscriptions_one_copy_in_3_1_1_one_per_subscription_with_its_id_in_5()
-> Result<()> {
    let broker = Mosquitto::start()?;
    for protocol in BOTH {
        let plain = ["over/#".to_owned(), "over/+/c".to_owned()];
        // A group of its own: Mosquitto gives an offline member (an earlier case's session)
        // its share of the messages.
        let shared = plain.clone().map(|f| format!("$share/{protocol:?}/{f}"));
        for (kind, filters) in [("plain", plain), ("shared", shared)] {
            let filters = filters.each_ref().map(String::as_str);
            // A session of its own: one resumed from another case would keep its filters.
            let id = format!("overlap-{kind}-{protocol:?}");
            let cfg = config(broker.port(), &id, protocol, 10, 30);
            let mut d = Driver::start_with(&cfg, &filters, 1)?;
            d.wait_subscribed(Duration::from_secs(10)).await?;
            // Both SUBACKs (one SUBSCRIBE per filter in MQTT 5).
            tokio::time::sleep(Duration::from_millis(200)).await;
            let one = numbered("over/b/c", 0..1);
            ferry_e2e::publish(broker.port(), "overlap-pub", QoS::AtLeastOnce, one).await?;
            let copies = if protocol == MqttProtocol::V5 { 2 } else { 1 };
            let got = d.recv(copies, Duration::from_secs(10)).await?;
            // Nothing more comes.
            let extra = tokio::time::timeout(Duration::from_millis(500), d.inbound.recv()).await;
            ensure!(
                extra.is_err(),
                "{protocol:?} {filters:?}: more than {copies} copies: {got:?} then {extra:?}"
            );
            let mut ids: Vec<u32> = got
                .iter()
                .flat_map(|m| m.subscription_ids.clone())
                .collect();
            ids.sort_unstable();
            let mut want: Vec<u32> = match protocol {
                MqttProtocol::V5 => filters.iter().map(|f| mqtt::subscription_id(f)).collect(),
                MqttProtocol::V311 => Vec::new(),
            };
            want.sort_unstable();
            ensure!(
                ids == want && got.iter().all(|m| m.subscription_ids.len() <= 1),
                "{protocol:?} {filters:?}: ids {ids:?}, want {want:?}"
            );
            for m in &got {
                d.complete(m);
            }
            ensure!(matches!(d.finish().await?, ReaderExit::Disconnected));
            eprintln!("{protocol:?} {filters:?}: {copies} copies of one message");
        }
    }
    Ok(())
}
