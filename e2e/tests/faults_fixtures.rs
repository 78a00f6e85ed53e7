//! The fault-injection fixtures work: the TCP fault proxy passes, holds (a partition that heals
//! on the same connection with nothing lost) and resets connections; a Kafka behind the proxy
//! stalls and recovers with it; ACLs granted and revoked take effect on a SCRAM producer; and
//! a 3-node Kafka cluster keeps every acknowledged record when its leader is SIGKILLed.
//! Each test starts its own processes on 127.0.0.1 and stops them on drop.

use std::io::{ErrorKind, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use ferry_e2e::{
    ClusterOptions, FaultProxy, Kafka, KafkaCluster, KafkaOptions, KeyType, Pki, ProxyMode, SaslSsl,
};
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

// ---------------------------------------------------------------------------------------------
// The proxy against plain sockets.

/// An echo server on a free loopback port, counting the bytes it received; stops on drop.
struct Echo {
    addr: SocketAddr,
    received: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Echo {
    fn start() -> Echo {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind echo");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (received.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let r = r.clone();
                        // Ends when the proxy closes its side.
                        std::thread::spawn(move || echo(conn, &r));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Echo {
            addr,
            received,
            stop,
            thread: Some(thread),
        }
    }
}

fn echo(mut conn: TcpStream, received: &AtomicUsize) {
    let _ = conn.set_nonblocking(false);
    let mut buf = [0u8; 16 * 1024];
    while let Ok(n @ 1..) = conn.read(&mut buf) {
        received.fetch_add(n, Ordering::Relaxed);
        if conn.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Accepts a connection on `listener` (non-blocking) within `timeout`.
fn accept_within(listener: &TcpListener, timeout: Duration) -> Option<TcpStream> {
    listener.set_nonblocking(true).expect("nonblocking");
    let start = Instant::now();
    while start.elapsed() < timeout {
        if let Ok((s, _)) = listener.accept() {
            s.set_nonblocking(false).expect("blocking");
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// Reads exactly `n` bytes within 10 s.
fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).expect("read");
    buf
}

/// `len` bytes of a pattern that shows reordering and loss.
fn pattern(len: usize) -> Vec<u8> {
    let block: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        out.extend_from_slice(&block[..block.len().min(len - out.len())]);
    }
    out
}

/// Writes `data` to `s` without blocking until the kernel refuses more (TCP flow control);
/// returns how much it took. Fails if all of it fit.
fn write_until_blocked(s: &mut TcpStream, data: &[u8]) -> usize {
    s.set_nonblocking(true).expect("nonblocking");
    let mut written = 0;
    while written < data.len() {
        match s.write(&data[written..]) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("write: {e}"),
        }
    }
    assert!(
        written < data.len(),
        "{} bytes fit in the kernel buffers",
        data.len()
    );
    s.set_nonblocking(false).expect("blocking");
    written
}

/// Asserts that nothing arrives on `s` for `wait`.
fn assert_silent(s: &mut TcpStream, wait: Duration, what: &str) {
    s.set_read_timeout(Some(wait)).expect("timeout");
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("{what}: expected nothing for {wait:?}, got {other:?}"),
    }
}

/// Asserts that reading `s` fails with a connection reset within 5 s.
fn assert_reset(s: &mut TcpStream, what: &str) {
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let got = s.read(&mut [0u8; 8]);
    assert!(
        matches!(&got, Err(e) if e.kind() == ErrorKind::ConnectionReset),
        "{what}: expected a reset, got {got:?}"
    );
}

/// A client connected through the proxy and the upstream end of its connection.
fn pair(proxy: &FaultProxy, upstream: &TcpListener) -> (TcpStream, TcpStream) {
    let client = TcpStream::connect(proxy.addr()).expect("connect to proxy");
    let server = accept_within(upstream, Duration::from_secs(5)).expect("proxied connection");
    (client, server)
}

/// A proxy toward a listener of the test's, and a connection through it that carried a byte.
fn proxied_connection() -> (TcpListener, FaultProxy, TcpStream, TcpStream) {
    let upstream = TcpListener::bind("127.0.0.1:0").expect("bind");
    let proxy = FaultProxy::start(upstream.local_addr().expect("addr")).expect("proxy");
    let (mut client, mut server) = pair(&proxy, &upstream);
    client.write_all(b"a").expect("write");
    assert_eq!(read_n(&mut server, 1), b"a");
    (upstream, proxy, client, server)
}

#[test]
fn proxy_passes_bytes_to_an_echo_server() {
    let echo = Echo::start();
    let proxy = FaultProxy::start(echo.addr).expect("proxy");
    assert_eq!(proxy.mode(), ProxyMode::Pass);
    for i in 0..3 {
        let mut c = TcpStream::connect(proxy.addr()).expect("connect");
        let msg = format!("hello {i}");
        c.write_all(msg.as_bytes()).expect("write");
        assert_eq!(read_n(&mut c, msg.len()), msg.as_bytes());
        // A clean close passes on as a FIN: the echo server ends and so does the proxy's side.
        c.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).expect("EOF");
        assert!(rest.is_empty());
    }
    assert_eq!(proxy.accepted(), 3);
    assert_eq!(echo.received.load(Ordering::Relaxed), "hello 0".len() * 3);
    let start = Instant::now();
    while proxy.open() > 0 && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(proxy.open(), 0, "closed connections are released");
}

#[test]
fn proxy_blackhole_holds_bytes_and_heals_the_same_connection() {
    let (upstream, proxy, mut client, mut server) = proxied_connection();

    proxy.set_mode(ProxyMode::Blackhole);
    client.write_all(b"up").expect("write during blackhole");
    server.write_all(b"down").expect("write during blackhole");
    // The client writes until the kernel buffers are full and TCP flow control stops it.
    let bulk = pattern(40 << 20);
    let held = write_until_blocked(&mut client, &bulk);
    println!(
        "  {} KiB held in kernel buffers when the writer blocked",
        held >> 10
    );
    assert_silent(
        &mut server,
        Duration::from_millis(500),
        "upstream in blackhole",
    );
    assert_silent(
        &mut client,
        Duration::from_millis(300),
        "client in blackhole",
    );
    // A connection opened now is accepted, then held: nothing reaches the upstream.
    let mut late = TcpStream::connect(proxy.addr()).expect("connect during blackhole");
    late.write_all(b"late").expect("write");
    assert!(accept_within(&upstream, Duration::from_millis(300)).is_none());
    assert_eq!(proxy.accepted(), 2);

    let healed = Instant::now();
    proxy.set_mode(ProxyMode::Pass);
    let mut writer = client.try_clone().expect("clone");
    let rest = bulk[held..].to_vec();
    let writing = std::thread::spawn(move || writer.write_all(&rest));
    assert_eq!(read_n(&mut client, 4), b"down");
    assert_eq!(read_n(&mut server, 2), b"up");
    let got = read_n(&mut server, bulk.len());
    assert!(got == bulk, "the bulk arrived altered");
    writing.join().expect("writer").expect("bulk write");
    println!(
        "  40 MiB (the held bytes first) delivered {:?} after healing",
        healed.elapsed()
    );
    // The late connection is forwarded now, its early bytes with it.
    let mut late_server =
        accept_within(&upstream, Duration::from_secs(5)).expect("late connection forwarded");
    assert_eq!(read_n(&mut late_server, 4), b"late");
    // Both old connections still work, both ways.
    server.write_all(b"again").expect("write");
    assert_eq!(read_n(&mut client, 5), b"again");
    late.write_all(b"!").expect("write");
    assert_eq!(read_n(&mut late_server, 1), b"!");
    assert_eq!(proxy.accepted(), 2, "no reconnection happened");
}

#[test]
fn proxy_reset_sends_rst_and_refuses_until_pass() {
    let (upstream, proxy, mut client, mut server) = proxied_connection();

    proxy.set_mode(ProxyMode::Reset);
    assert_reset(&mut client, "client");
    assert_reset(&mut server, "upstream");
    // New connections: the kernel completes the handshake, the proxy resets it at once.
    let mut refused = TcpStream::connect(proxy.addr()).expect("connect");
    assert_reset(&mut refused, "new connection in Reset");
    assert!(accept_within(&upstream, Duration::from_millis(200)).is_none());

    // Reset then Pass at once: the connections opened before are reset all the same.
    proxy.set_mode(ProxyMode::Pass);
    let (mut client, server) = pair(&proxy, &upstream);
    proxy.set_mode(ProxyMode::Reset);
    proxy.set_mode(ProxyMode::Pass);
    assert_reset(&mut client, "a reset flipped back at once");
    drop(server);
    let (mut client, mut server) = pair(&proxy, &upstream);
    client.write_all(b"ok").expect("write");
    assert_eq!(read_n(&mut server, 2), b"ok");
    server.write_all(b"ok").expect("write");
    assert_eq!(read_n(&mut client, 2), b"ok");
    assert_eq!(proxy.accepted(), 4);
}

// ---------------------------------------------------------------------------------------------
// Kafka behind the proxy.

fn producer(mut cc: ClientConfig, message_timeout: Duration) -> FutureProducer {
    cc.set("acks", "all")
        .set("linger.ms", "5")
        .set(
            "message.timeout.ms",
            message_timeout.as_millis().to_string(),
        )
        .create()
        .expect("producer")
}

/// Produces one record and waits for its delivery report.
async fn produce(p: &FutureProducer, topic: &str, value: &str) -> Result<(), KafkaError> {
    p.send(
        FutureRecord::<(), _>::to(topic).payload(value),
        Duration::from_secs(5),
    )
    .await
    .map(|_| ())
    .map_err(|(e, _)| e)
}

/// The values of a topic, in order, once `n` arrived and 0.5 s passed without more.
fn read_values(kafka: &Kafka, topic: &str, n: usize) -> Result<Vec<String>> {
    let settle = Duration::from_millis(500);
    let records = kafka.read_all(topic, n, settle, Duration::from_secs(20))?;
    Ok(records.iter().map(|r| r.value_str().to_owned()).collect())
}

#[test]
fn kafka_behind_the_proxy_stalls_in_a_blackhole_and_recovers() -> Result<()> {
    let start = Instant::now();
    let proxy = FaultProxy::start_without_upstream()?;
    let kafka = Kafka::start_with(KafkaOptions {
        proxy: Some(&proxy),
        ..Default::default()
    })?;
    println!(
        "  kafka behind proxy :{} started in {:?}",
        proxy.port(),
        start.elapsed()
    );
    let rt = runtime();
    rt.block_on(kafka.create_topic("proxied", 1))?;
    let p = producer(kafka.proxied_client_config()?, Duration::from_secs(60));
    rt.block_on(async {
        produce(&p, "proxied", "before").await?;
        let before = proxy.accepted();
        assert!(before >= 1, "the producer went through the proxy");

        proxy.set_mode(ProxyMode::Blackhole);
        let held = produce(&p, "proxied", "held");
        tokio::pin!(held);
        if tokio::time::timeout(Duration::from_secs(3), &mut held)
            .await
            .is_ok()
        {
            bail!("a record was delivered through a blackhole");
        }
        let healed = Instant::now();
        proxy.set_mode(ProxyMode::Pass);
        tokio::time::timeout(Duration::from_secs(20), held)
            .await
            .context("no delivery after healing")??;
        println!(
            "  held record delivered {:?} after healing; connections {before} -> {}",
            healed.elapsed(),
            proxy.accepted()
        );

        // Reset: the producer reconnects, through the proxy again (the advertised address).
        proxy.set_mode(ProxyMode::Reset);
        let retried = produce(&p, "proxied", "after reset");
        tokio::pin!(retried);
        let _ = tokio::time::timeout(Duration::from_secs(1), &mut retried).await;
        let accepted = proxy.accepted();
        proxy.set_mode(ProxyMode::Pass);
        tokio::time::timeout(Duration::from_secs(20), retried)
            .await
            .context("no delivery after the reset")??;
        assert!(proxy.accepted() > accepted, "reconnected through the proxy");
        anyhow::Ok(())
    })?;
    assert_eq!(
        read_values(&kafka, "proxied", 3)?,
        ["before", "held", "after reset"]
    );
    println!("  done in {:?}", start.elapsed());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// ACLs.

fn is_denied(r: &Result<(), KafkaError>) -> bool {
    matches!(
        r,
        Err(KafkaError::MessageProduction(
            RDKafkaErrorCode::TopicAuthorizationFailed
        ))
    )
}

/// Produces until a record is delivered (at most 10 s), as a forwarder retrying would: after a
/// `TOPIC_AUTHORIZATION_FAILED`, librdkafka fails new records to that topic at once, without
/// asking the broker, until its next metadata refresh of the topic. Returns the attempts and
/// the time it took.
async fn produce_until_ok(p: &FutureProducer, topic: &str, value: &str) -> Result<(u32, Duration)> {
    let start = Instant::now();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let r = produce(p, topic, value).await;
        match r {
            Ok(()) => return Ok((attempt, start.elapsed())),
            Err(_) if is_denied(&r) && start.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => bail!(
                "produce to {topic} (attempt {attempt}, {:?}): {e}",
                start.elapsed()
            ),
        }
    }
}

#[test]
fn kafka_acls_grant_revoke_grant() -> Result<()> {
    let start = Instant::now();
    let pki = Pki::generate(KeyType::Ecdsa)?;
    let kafka = Kafka::start_with(KafkaOptions {
        sasl_ssl: Some(SaslSsl {
            pki: &pki,
            scram_sha512_users: vec![("ferry".into(), "ferry-pw".into())],
            plain_users: vec![],
            require_client_cert: false,
        }),
        acls: true,
        ..Default::default()
    })?;
    println!("  kafka with ACLs started in {:?}", start.elapsed());
    let rt = runtime();
    // The test's admin is ANONYMOUS on PLAINTEXT, a super user.
    rt.block_on(kafka.create_topic("guarded", 1))?;
    let scram = || {
        producer(
            kafka.sasl_ssl_client_config("SCRAM-SHA-512", "ferry", "ferry-pw"),
            Duration::from_secs(10),
        )
    };
    let p = scram();
    let denied = rt.block_on(produce(&p, "guarded", "no grant yet"));
    assert!(is_denied(&denied), "without a grant: {denied:?}");

    let t = Instant::now();
    kafka.grant_produce("ferry", "guarded")?;
    println!("  grant took {:?}", t.elapsed());
    // The grant is in force when it returns: a new client succeeds at once.
    rt.block_on(produce(&scram(), "guarded", "granted"))?;
    let (attempts, took) = rt.block_on(produce_until_ok(&p, "guarded", "granted, same client"))?;
    println!("  the denied client produced after the grant: attempt {attempts}, {took:?}");

    let t = Instant::now();
    kafka.revoke_produce("ferry", "guarded")?;
    println!("  revoke took {:?}", t.elapsed());
    let denied = rt.block_on(produce(&p, "guarded", "revoked"));
    assert!(is_denied(&denied), "after the revoke: {denied:?}");

    kafka.grant_produce("ferry", "guarded")?;
    let (attempts, took) = rt.block_on(produce_until_ok(&p, "guarded", "granted again"))?;
    println!("  produced again after the new grant: attempt {attempts}, {took:?}");

    assert_eq!(
        read_values(&kafka, "guarded", 3)?,
        ["granted", "granted, same client", "granted again"]
    );
    println!("  done in {:?}", start.elapsed());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The 3-node cluster.

#[test]
fn cluster_keeps_acknowledged_records_when_the_leader_is_killed() -> Result<()> {
    let start = Instant::now();
    let mut cluster = KafkaCluster::start_with(3, ClusterOptions { proxies: true })?;
    println!(
        "  3-node cluster {} started in {:?}",
        cluster.bootstrap(),
        start.elapsed()
    );
    let rt = runtime();
    rt.block_on(cluster.create_topic("failover", 1))?;
    let leader = cluster.leader_of("failover", 0)?;
    let mut isr = cluster.isr_of("failover", 0)?;
    isr.sort();
    assert_eq!(isr, [1, 2, 3]);
    // Through the proxies: the nodes' proxied listeners and their advertised addresses work.
    let mut cc = cluster.proxied_client_config()?;
    cc.set("enable.idempotence", "true");
    let p = producer(cc, Duration::from_secs(60));
    let t = Instant::now();
    rt.block_on(produce_numbers(&p, 0..100, Duration::ZERO))?;
    println!(
        "  100 records with acks=all in {:?}; leader {leader}",
        t.elapsed()
    );

    // Cut the client off from the leader only: its record waits, the cluster stays whole.
    let proxy = cluster.proxy(leader)?;
    proxy.set_mode(ProxyMode::Blackhole);
    rt.block_on(async {
        let held = produce_numbers(&p, 100..101, Duration::ZERO);
        tokio::pin!(held);
        if tokio::time::timeout(Duration::from_secs(2), &mut held)
            .await
            .is_ok()
        {
            bail!("delivered through the leader's blackholed proxy");
        }
        assert_eq!(cluster.isr_of("failover", 0)?.len(), 3);
        proxy.set_mode(ProxyMode::Pass);
        tokio::time::timeout(Duration::from_secs(20), held).await?
    })?;

    let killed = Instant::now();
    cluster.kill(leader)?;
    // Keep producing while the cluster elects a new leader: every record is delivered.
    rt.block_on(produce_numbers(&p, 101..300, Duration::from_millis(20)))?;
    println!(
        "  199 more delivered {:?} after the SIGKILL",
        killed.elapsed()
    );
    let new_leader = cluster.wait_for_new_leader("failover", 0, leader, Duration::from_secs(30))?;
    assert_ne!(new_leader, leader);

    let settle = Duration::from_secs(1);
    let records = cluster.read_all("failover", 300, settle, Duration::from_secs(30))?;
    let mut values: Vec<u32> = records
        .iter()
        .map(|r| r.value_str().parse().expect("number"))
        .collect();
    values.sort();
    assert_eq!(values, (0..300).collect::<Vec<_>>(), "every record once");

    let t = Instant::now();
    cluster.restart(leader)?;
    println!("  node {leader} restarted in {:?}", t.elapsed());
    assert!(cluster.is_running(leader));
    cluster.wait_for_full_isr("failover", Duration::from_secs(60))?;
    println!("  and back in sync {:?} after the restart", t.elapsed());
    println!("  done in {:?}", start.elapsed());
    Ok(())
}

/// Produces the numbers of `range` to topic `failover`, one every `every` (all at once with
/// zero), concurrently, and waits for every delivery.
async fn produce_numbers(
    p: &FutureProducer,
    range: std::ops::Range<u32>,
    every: Duration,
) -> Result<()> {
    let first = range.start;
    let sends: Vec<_> = range
        .map(|i| {
            let p = p.clone();
            tokio::spawn(async move {
                tokio::time::sleep(every * (i - first)).await;
                produce(&p, "failover", &i.to_string()).await
            })
        })
        .collect();
    for send in sends {
        send.await??;
    }
    Ok(())
}
