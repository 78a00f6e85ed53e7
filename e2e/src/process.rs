//! Processes the fixtures start: free ports, tied children that die with the test, waiting for
//! a listener, and where a broker runs ([`Placement`]).

use std::fs;
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use crate::logs::tail;

pub fn cache_dir() -> PathBuf {
    std::env::var_os("FERRY_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
                .join(".cache/ferry")
        })
}

/// A free TCP port on 127.0.0.1 for a broker or server a test starts.
///
/// Taken below the kernel's ephemeral range: a port from that range, bound and released, can be
/// handed to any outgoing connection (a client of the Kafka started a moment before) before the
/// server binds it ("Address already in use"). Below the range only other `free_port` calls compete:
/// a process-wide counter keeps this process's ports distinct, and the start is spread by pid.
pub fn free_port() -> Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (low, high) = listen_port_range();
    let span = u32::from(high - low);
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let port = low + ((start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        // One at a time: a listener on 127.0.0.1 would make the wildcard bind fail.
        let free = |ip: Ipv4Addr| TcpListener::bind((ip, port)).is_ok();
        if free(Ipv4Addr::LOCALHOST) && free(Ipv4Addr::UNSPECIFIED) {
            return Ok(port);
        }
    }
    bail!("no free TCP port in {low}..{high}")
}

/// Ports for listeners: 12000..30000, clear of the kubelet's and control plane's fixed ports
/// (10248–10259), Kubernetes' NodePort range (30000–32767) and, unless the kernel was set
/// otherwise, the ephemeral range (32768 up).
fn listen_port_range() -> (u16, u16) {
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    (12_000, ephemeral_low.clamp(20_000, 30_000))
}

pub(crate) fn wait_for_port(
    port: u16,
    timeout: Duration,
    child: &mut Child,
    what: &str,
    log: &Path,
) -> Result<()> {
    wait_for_addr(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        port,
        timeout,
        child,
        what,
        log,
    )
}

/// [`wait_for_port`] on `host` instead of 127.0.0.1.
pub(crate) fn wait_for_addr(
    host: IpAddr,
    port: u16,
    timeout: Duration,
    child: &mut Child,
    what: &str,
    log: &Path,
) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if TcpStream::connect((host, port)).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "{what} exited with {status} before listening; log {}:\n{}",
                log.display(),
                tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "{what} did not listen on {host}:{port} within {timeout:?}; log {}:\n{}",
        log.display(),
        tail(log)
    )
}

/// Starts `cmd` so that it dies with the process that started it. Its output is appended to
/// `log`, so a restarted broker's log keeps what happened before the restart.
pub(crate) fn spawn_tied(cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = fs::OpenOptions::new().create(true).append(true).open(log)?;
    cmd.stdout(out.try_clone()?)
        .stderr(out)
        .stdin(Stdio::null());
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().with_context(|| format!("cannot start {cmd:?}"))
}

/// Runs `cmd` to its end with its output in `log`, killing it after `timeout`; fails unless it
/// exits 0, with the output. Returns the output.
pub(crate) fn run_logged(
    cmd: &mut Command,
    what: &str,
    log: &Path,
    timeout: Duration,
) -> Result<String> {
    let out = fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    let mut child = cmd.spawn().with_context(|| format!("cannot run {what}"))?;
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{what} did not finish within {timeout:?}; output:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = fs::read_to_string(log).unwrap_or_default();
    if !status.success() {
        bail!("{what} failed ({status}):\n{output}");
    }
    Ok(output)
}

pub(crate) fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let start = Instant::now();
    while start.elapsed() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Where a broker runs and listens. `Placement::default()` is what `start`/`start_with` do:
/// in this process's network namespace, on 127.0.0.1.
///
/// With `netns` and `bind`, a broker can serve the pods of the single-node cluster of
/// `e2e/cluster/up.sh`: started inside the cluster's namespace and bound to the node address,
/// pods reach it at that address, and so does this process (through the veth), so the helpers
/// ([`crate::Kafka::read_all`], [`crate::Kafka::create_topic`], …) keep working.
///
/// As with every start here, the broker gets `PR_SET_PDEATHSIG`, which fires when the *thread*
/// that started it ends: start brokers from the test's own thread, not a short-lived one.
#[derive(Debug, Default, Clone)]
pub struct Placement {
    /// A named network namespace (`/var/run/netns/<name>`): the broker is started with
    /// `nsenter --net=/var/run/netns/<name> <command>` (needs root).
    pub netns: Option<String>,
    /// The address every listener binds to (and Kafka advertises) instead of 127.0.0.1. This
    /// process must be able to connect to it (the start waits until the broker listens).
    pub bind: Option<IpAddr>,
}

impl Placement {
    pub(crate) fn host(&self) -> IpAddr {
        self.bind.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// `program` as a command, run inside the namespace when there is one.
    pub(crate) fn command(&self, program: &Path) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut cmd = Command::new("nsenter");
                cmd.arg(format!("--net=/var/run/netns/{ns}")).arg(program);
                cmd
            }
            None => Command::new(program),
        }
    }
}

pub(crate) fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/bin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
