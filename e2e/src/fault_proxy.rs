//! A TCP proxy on loopback whose links a test can break and heal at any moment: the network
//! faults a forwarder meets between itself and a broker, without root or network namespaces.
//!
//! [`ProxyMode::Blackhole`] is a partition, not a disconnect. On a real network the packets are
//! lost, TCP keeps retransmitting, and once the partition heals the same connection goes on
//! with nothing lost. The proxy gets the same effect by no longer *reading* either side: the
//! bytes pile up in the kernel's socket buffers, TCP flow control stops the senders once the
//! buffers are full, and on [`ProxyMode::Pass`] everything held is delivered on the same
//! connections. Discarding bytes instead would corrupt the streams, which no real partition
//! does (TCP would retransmit them).
//!
//! What differs from a real partition: TCP keep-alive probes are answered by the proxy's
//! kernel, so only application-level timeouts (Kafka's request timeout, MQTT's keep-alive)
//! notice it; and a connection opened during a blackhole completes its handshake at once (the
//! kernel accepts it; on a real network the connect would hang), then is held: nothing is
//! forwarded, and on `Pass` it is connected upstream and carries on with what it sent.
//!
//! The upstream is connected when a connection first reaches `Pass`; if it refuses, the
//! client's connection is reset, as close to a refused connect as a proxy can get.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context as _, Result};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What a [`FaultProxy`] does with its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Bytes flow both ways.
    Pass,
    /// A partition: nothing gets through in either direction, no RST, no FIN. Bytes are held
    /// (in kernel buffers), not dropped, and are delivered on the same connection on `Pass`.
    /// New connections are accepted and held unconnected until `Pass`.
    Blackhole,
    /// Every open connection is closed with an RST (`SO_LINGER` 0), on both sides; new
    /// connections are accepted and reset at once, until the mode changes.
    Reset,
}

/// The state every connection watches. `resets` counts the switches to [`ProxyMode::Reset`],
/// so a connection opened before one is reset even when the mode went back to `Pass` before it
/// saw the `Reset`.
#[derive(Debug, Clone, Copy)]
struct State {
    mode: ProxyMode,
    resets: u64,
    upstream: Option<SocketAddr>,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    open: AtomicUsize,
}

/// A TCP proxy on a free 127.0.0.1 port toward one upstream address, with a [`ProxyMode`] a test
/// switches at any time ([`FaultProxy::set_mode`]). It runs on a thread of its own (a
/// single-threaded Tokio runtime), so synchronous tests can use it; dropping it stops the
/// thread and closes every connection.
pub struct FaultProxy {
    port: u16,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = *self.state.borrow();
        f.debug_struct("FaultProxy")
            .field("port", &self.port)
            .field("mode", &state.mode)
            .field("upstream", &state.upstream)
            .finish_non_exhaustive()
    }
}

impl FaultProxy {
    /// A proxy in [`ProxyMode::Pass`] toward `upstream`.
    pub fn start(upstream: SocketAddr) -> Result<Self> {
        Self::launch(Some(upstream))
    }

    /// A proxy without an upstream yet, for a server that must know the proxy's port before
    /// it starts (a Kafka advertising it). Until [`FaultProxy::set_upstream`], connections
    /// that reach `Pass` are reset.
    pub fn start_without_upstream() -> Result<Self> {
        Self::launch(None)
    }

    fn launch(upstream: Option<SocketAddr>) -> Result<Self> {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .context("fault proxy: bind 127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("fault proxy: build its runtime")?;
        // Registered with the runtime's reactor here, so that a failure fails the start.
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(listener).context("fault proxy: register its listener")?
        };
        let (state, _) = watch::channel(State {
            mode: ProxyMode::Pass,
            resets: 0,
            upstream,
        });
        let counters = Arc::new(Counters::default());
        let (shutdown, stopped) = tokio::sync::oneshot::channel();
        let (st, ct) = (state.clone(), counters.clone());
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{port}"))
            .spawn(move || {
                runtime.block_on(serve(listener, st, ct, stopped));
                // Dropping the runtime here drops every connection task and its sockets.
            })
            .context("fault proxy: spawn its thread")?;
        Ok(Self {
            port,
            state,
            counters,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    /// The port clients connect to, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// Where connections are forwarded from now on (open ones keep theirs).
    pub fn set_upstream(&self, upstream: SocketAddr) {
        self.state.send_modify(|s| s.upstream = Some(upstream));
    }

    /// Switches the mode. Connections react within microseconds, on the proxy's thread: a
    /// test that needs a reset to have happened should look at the client's side.
    pub fn set_mode(&self, mode: ProxyMode) {
        self.state.send_modify(|s| {
            s.mode = mode;
            if mode == ProxyMode::Reset {
                s.resets += 1;
            }
        });
    }

    pub fn mode(&self) -> ProxyMode {
        self.state.borrow().mode
    }

    /// How many connections the proxy accepted since it started, whatever happened to them.
    pub fn accepted(&self) -> u64 {
        self.counters.accepted.load(Ordering::Relaxed)
    }

    /// How many accepted connections are still open (held ones included).
    pub fn open(&self) -> usize {
        self.counters.open.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(
    listener: TcpListener,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    loop {
        let client = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(e) => {
                    // EMFILE and the like: wait rather than spin; the test will see the stall.
                    eprintln!("fault proxy: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        counters.open.fetch_add(1, Ordering::Relaxed);
        let (rx, counters) = (state.subscribe(), counters.clone());
        tokio::spawn(async move {
            connection(client, rx).await;
            counters.open.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Why a connection's handling ended.
enum End {
    /// Both directions reached EOF: the sockets are closed normally.
    Closed,
    /// Reset by the mode, an I/O error, or no upstream: both sockets are closed with an RST.
    Abort,
}

async fn connection(client: TcpStream, mut rx: watch::Receiver<State>) {
    let resets = rx.borrow_and_update().resets;
    let mut upstream = None;
    let end = match wait_for_pass(&mut rx, resets).await {
        Gate::Reset | Gate::Pass(None) => End::Abort,
        Gate::Pass(Some(addr)) => match TcpStream::connect(addr).await {
            Ok(u) => {
                let _ = u.set_nodelay(true);
                let _ = client.set_nodelay(true);
                let end = relay(&client, &u, &rx, resets).await;
                upstream = Some(u);
                end
            }
            Err(_) => End::Abort,
        },
    };
    if let End::Abort = end {
        // SO_LINGER 0: the close on drop sends an RST instead of a FIN.
        for s in std::iter::once(&client).chain(upstream.as_ref()) {
            let _ = s.set_zero_linger();
        }
    }
}

/// What a connection may do next.
enum Gate {
    /// Bytes may flow; the upstream to connect to (`None`: none set yet).
    Pass(Option<SocketAddr>),
    /// The connection is to be reset.
    Reset,
}

/// Waits while the mode is `Blackhole`.
async fn wait_for_pass(rx: &mut watch::Receiver<State>, resets: u64) -> Gate {
    loop {
        let s = *rx.borrow_and_update();
        if s.resets != resets || s.mode == ProxyMode::Reset {
            return Gate::Reset;
        }
        if s.mode == ProxyMode::Pass {
            return Gate::Pass(s.upstream);
        }
        if rx.changed().await.is_err() {
            // The sender is gone: the proxy is stopping.
            return Gate::Reset;
        }
    }
}

/// Copies both ways until both directions reached EOF or the connection is to be reset.
async fn relay(
    client: &TcpStream,
    upstream: &TcpStream,
    rx: &watch::Receiver<State>,
    resets: u64,
) -> End {
    let up = pump(client, upstream, rx.clone(), resets);
    let down = pump(upstream, client, rx.clone(), resets);
    tokio::pin!(up, down);
    let (mut up_done, mut down_done) = (false, false);
    while !(up_done && down_done) {
        let end = tokio::select! {
            end = &mut up, if !up_done => { up_done = true; end }
            end = &mut down, if !down_done => { down_done = true; end }
        };
        if let End::Abort = end {
            return End::Abort;
        }
    }
    End::Closed
}

/// One direction: reads `from` and writes `to` while the mode is `Pass`. Reads and writes
/// are raced against mode changes (both are cancel-safe), so a blackhole stops the flow at
/// once, and bytes read but not yet written are kept for later.
async fn pump(
    from: &TcpStream,
    to: &TcpStream,
    mut rx: watch::Receiver<State>,
    resets: u64,
) -> End {
    let mut buf = vec![0u8; 64 * 1024];
    let (mut start, mut end) = (0, 0);
    loop {
        if let Gate::Reset = wait_for_pass(&mut rx, resets).await {
            return End::Abort;
        }
        if start < end {
            tokio::select! {
                _ = rx.changed() => {}
                written = write_some(to, &buf[start..end]) => match written {
                    Ok(n) => start += n,
                    Err(_) => return End::Abort,
                },
            }
        } else {
            tokio::select! {
                _ = rx.changed() => {}
                read = read_some(from, &mut buf) => match read {
                    // EOF: pass the FIN on; the other direction may still carry data.
                    Ok(0) => {
                        let _ = shutdown_write(to);
                        return End::Closed;
                    }
                    Ok(n) => (start, end) = (0, n),
                    Err(_) => return End::Abort,
                },
            }
        }
    }
}

/// `read` on a shared `TcpStream` (both directions share the sockets: one reads, one writes).
async fn read_some(s: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        s.readable().await?;
        match s.try_read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}

async fn write_some(s: &TcpStream, buf: &[u8]) -> std::io::Result<usize> {
    loop {
        s.writable().await?;
        match s.try_write(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}

fn shutdown_write(s: &TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: shutdown(2) on a socket this task owns.
    match unsafe { libc::shutdown(s.as_raw_fd(), libc::SHUT_WR) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}
