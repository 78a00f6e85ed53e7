//! The single-node cluster of `e2e/cluster/up.sh` is real and `e2e/cluster/down.sh` leaves
//! nothing behind. With a private state dir, network namespace and subnets (so it can run next to
//! a developer's `ferry` cluster): `up.sh` brings the cluster up (and a second `up.sh` only says
//! it is up), the node is Ready, a pod on the CNI bridge runs with an IP of the pod subnet and
//! connects to a server listening on the namespace's address (the server sees the pod's own IP:
//! no NAT), then `down.sh` — also run by a drop guard when the test fails — stops everything, and
//! the netns, the veth, every mount and process under the state dir and the state dir are gone.
//!
//! Needs root (network namespaces, mounts) and, the first time, a few minutes to install Debian
//! packages and build the kubelet and kube-scheduler (cached in `$FERRY_CACHE`).

use std::fs::{self, File};
use std::io::{BufRead as _, BufReader, Read as _};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use ferry_e2e::cluster::{CLUSTER_POLL, Cluster};
use ferry_e2e::wait_until_some;

/// A TCP listener bound to `addr` inside the network namespace `nspath` (a thread enters the
/// namespace to create the socket; the socket stays in it).
fn listen_in_netns(nspath: &Path, addr: String) -> Result<TcpListener> {
    let ns = File::open(nspath).with_context(|| format!("open {}", nspath.display()))?;
    std::thread::spawn(move || -> Result<TcpListener> {
        // SAFETY: setns on this (short-lived) thread only changes its own network namespace.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        TcpListener::bind(&addr).with_context(|| format!("bind {addr} in the netns"))
    })
    .join()
    .map_err(|_| anyhow!("the netns thread panicked"))?
}

/// Accepts one connection within `timeout` and returns the peer IP and the first line it sent.
fn accept_line(listener: &TcpListener, timeout: Duration) -> Result<(String, String)> {
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    let (stream, peer): (TcpStream, _) = loop {
        match listener.accept() {
            Ok(conn) => break conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                ensure!(
                    start.elapsed() < timeout,
                    "no connection from the pod within {timeout:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e.into()),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut line = String::new();
    BufReader::new(stream.take(4096)).read_line(&mut line)?;
    Ok((peer.ip().to_string(), line.trim().to_owned()))
}

/// Mount points at or under `dir` (from /proc/self/mountinfo; escapes left as they are).
fn mounts_under(dir: &Path) -> Result<Vec<String>> {
    let root = dir.to_string_lossy().into_owned();
    let prefix = format!("{root}/");
    Ok(fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| *m == root || m.starts_with(&prefix))
        .map(str::to_owned)
        .collect())
}

/// PIDs (other than this one) whose command line contains `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let me = std::process::id().to_string();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().into_owned();
            if !pid.bytes().all(|b| b.is_ascii_digit()) || pid == me {
                return None;
            }
            let cmdline = fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline
                .contains(needle)
                .then(|| format!("{pid}: {}", cmdline.trim()))
        })
        .collect()
}

fn cluster_env(dir: &Path, key: &str) -> Result<String> {
    let env = fs::read_to_string(dir.join("cluster.env"))?;
    env.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("{key} not in cluster.env:\n{env}"))
}

#[test]
fn cluster_up_runs_a_bridged_pod_and_down_leaves_nothing() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "this test needs root (network namespaces, mounts); run it as root"
    );
    // Subnets of their own, so that this test can run next to the full-path test.
    let mut cluster = Cluster::private("ferry-cluster-test", "t")?.with_subnets("10.79", "10.80");
    let nspath = Path::new("/var/run/netns").join(cluster.netns());
    println!(
        "cluster: state {}, netns {}, node {}, pods {}.0/24",
        cluster.dir().display(),
        cluster.netns(),
        cluster.node_ip(),
        cluster.pod_net()
    );

    // up, then up again (idempotent, fast).
    let t = Instant::now();
    cluster.up()?;
    let up_time = t.elapsed();
    let t = Instant::now();
    let out = cluster.cluster_script("up.sh", &[], Duration::from_secs(120))?;
    let second_up = t.elapsed();
    ensure!(out.contains("already up"), "second up.sh:\n{out}");
    ensure!(
        second_up < Duration::from_secs(20),
        "second up.sh took {second_up:?}"
    );

    // The node is Ready.
    let node = cluster_env(cluster.dir(), "node_name")?;
    let ready = cluster.kubectl(&[
        "get",
        "node",
        &node,
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
    ])?;
    assert_eq!(ready, "True", "node {node} Ready condition");

    // A pod on the bridge connects to a server listening on the namespace's address.
    let busybox = cluster_env(cluster.dir(), "busybox_image")?;
    let listener = listen_in_netns(&nspath, format!("{}:0", cluster.node_ip()))?;
    let port = listener.local_addr()?.port();
    // A command line no other process has, to check that down.sh stops the container.
    let sleep_marker = format!("sleep {}", 900_000 + std::process::id() % 99_999);
    let pod = format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: probe
  namespace: default
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: probe
    image: {busybox}
    imagePullPolicy: Never
    command: ["sh", "-c", "echo hello-from-$(hostname) | nc {ip} {port}; exec {sleep_marker}"]
"#,
        ip = cluster.node_ip()
    );
    cluster.kubectl_in(&["apply", "-f", "-"], Some(&pod))?;
    let (peer, line) = accept_line(&listener, Duration::from_secs(120))?;
    drop(listener);
    wait_until_some(
        "pod probe Running",
        Duration::from_secs(60),
        CLUSTER_POLL,
        || {
            Ok(
                (cluster.kubectl(&["get", "pod", "probe", "-o", "jsonpath={.status.phase}"])?
                    == "Running")
                    .then_some(()),
            )
        },
    )?;
    let pod_ip = cluster.kubectl(&["get", "pod", "probe", "-o", "jsonpath={.status.podIP}"])?;
    println!("pod probe Running at {pod_ip}; the server in the netns got {line:?} from {peer}");
    wait_until_some(
        "the probe container's process",
        Duration::from_secs(30),
        CLUSTER_POLL,
        || Ok((!processes_mentioning(&sleep_marker).is_empty()).then_some(())),
    )?;
    assert!(
        pod_ip.starts_with(&format!("{}.", cluster.pod_net())),
        "pod IP {pod_ip} is not in {}.0/24",
        cluster.pod_net()
    );
    assert_eq!(line, "hello-from-probe");
    assert_eq!(
        peer, pod_ip,
        "the server should see the pod's own IP (no NAT)"
    );

    // down (with the pod still running), then down again.
    let t = Instant::now();
    cluster.down(None)?;
    let down_time = t.elapsed();
    assert!(!nspath.exists(), "{} still exists", nspath.display());
    let netns_list = Command::new("ip").args(["netns", "list"]).output()?;
    let netns_list = String::from_utf8_lossy(&netns_list.stdout);
    assert!(
        !netns_list
            .lines()
            .any(|l| l.split_whitespace().next() == Some(cluster.netns())),
        "ip netns list still shows {}:\n{netns_list}",
        cluster.netns()
    );
    assert_eq!(
        mounts_under(cluster.dir())?,
        Vec::<String>::new(),
        "mounts left under {}",
        cluster.dir().display()
    );
    assert_eq!(
        processes_mentioning(&cluster.dir().to_string_lossy()),
        Vec::<String>::new(),
        "processes mentioning the state dir left"
    );
    assert_eq!(
        processes_mentioning(&sleep_marker),
        Vec::<String>::new(),
        "the probe container's process is left"
    );
    assert!(
        !cluster.dir().exists(),
        "{} still exists",
        cluster.dir().display()
    );
    let out = cluster.cluster_script("down.sh", &[], Duration::from_secs(60))?;
    ensure!(out.contains("nothing to do"), "second down.sh:\n{out}");
    println!("cluster test: up {up_time:.1?}, second up {second_up:.1?}, down {down_time:.1?}");
    Ok(())
}
