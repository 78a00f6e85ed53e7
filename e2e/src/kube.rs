//! A real Kubernetes control plane for integration tests: etcd, kube-apiserver and
//! kube-controller-manager, built from source by `e2e/k8s/build.sh` (version pinned in
//! `e2e/k8s/VERSION`, binaries cached in `$FERRY_CACHE/k8s-<version>/bin`).
//!
//! There is no kubelet, so Pods are created and scheduled-for but never run; everything the
//! API server and the controllers do (validation, RBAC, ownerReferences and garbage
//! collection, Deployments → ReplicaSets → Pods, ServiceAccounts, Leases) is real.
//!
//! Every process listens on free 127.0.0.1 ports, keeps its data and log in the control plane's
//! temp dir, is stopped when the [`ControlPlane`] is dropped and, through `PR_SET_PDEATHSIG`,
//! when the *thread* that started it ends — so start one per test (in the test's own thread),
//! not in a static shared between test threads.

use std::ffi::OsStr;
use std::fs;
use std::io::{Read as _, Write as _};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::http::http_get;
use crate::logs::tail;
use crate::process::{cache_dir, free_port, spawn_tied, terminate, wait_for_port, which};

/// The Kubernetes version `e2e/k8s/build.sh` builds (the content of `e2e/k8s/VERSION`), e.g. `v1.34.4`.
pub fn k8s_version() -> &'static str {
    include_str!("../k8s/VERSION").trim()
}

/// Where `e2e/k8s/build.sh` puts `etcd`, `kube-apiserver` and `kube-controller-manager`.
pub fn k8s_bin_dir() -> PathBuf {
    cache_dir()
        .join(format!("k8s-{}", k8s_version()))
        .join("bin")
}

const BINARIES: [&str; 3] = ["etcd", "kube-apiserver", "kube-controller-manager"];

/// The cluster IP range given to the API server (and the controller manager).
const SERVICE_CIDR: &str = "10.0.0.0/24";
/// How every component is started (flags, keys, certificates): shared with `e2e/cluster/up.sh`.
const CONTROL_PLANE_SH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/k8s/control-plane.sh");

/// The loopback ports of the components other than the API server.
struct Ports {
    etcd: u16,
    etcd_peer: u16,
    kcm: u16,
}
/// The user name of [`ControlPlane::token`]; it is in the `system:masters` group.
pub const ADMIN_USER: &str = "ferry-admin";

/// etcd + kube-apiserver + kube-controller-manager on free loopback ports. See the module docs.
pub struct ControlPlane {
    etcd: Option<Child>,
    apiserver: Option<Child>,
    controller_manager: Option<Child>,
    dir: Option<tempfile::TempDir>,
    port: u16,
    ports: Ports,
    token: String,
    kubeconfig: PathBuf,
    ca_pem: String,
    kubectl: PathBuf,
    keep: bool,
}

impl ControlPlane {
    /// Starts etcd, then kube-apiserver, then kube-controller-manager, and returns once the API
    /// server's `/readyz` and the controller manager's `/healthz` answer `ok` (a few seconds).
    ///
    /// Fails, telling to run `e2e/k8s/build.sh`, if the binaries are not built; fails with the
    /// log path and its last lines if a process exits or does not get ready in time (the temp
    /// dir is then kept so the logs can be read).
    pub fn start() -> Result<Self> {
        let started = Instant::now();
        let bin = k8s_bin_dir();
        let missing: Vec<&str> = BINARIES
            .iter()
            .copied()
            .filter(|b| !bin.join(b).is_file())
            .collect();
        if !missing.is_empty() || !bin.join(".complete").is_file() {
            bail!(
                "the Kubernetes {} control plane is not built ({} missing in {}): run \
                 `e2e/k8s/build.sh` (builds from the Go module proxy, ~9 min once, then cached; \
                 `make test` runs it)",
                k8s_version(),
                if missing.is_empty() {
                    ".complete marker".to_owned()
                } else {
                    missing.join(", ")
                },
                bin.display()
            );
        }
        let kubectl = which("kubectl")
            .ok_or_else(|| anyhow!("kubectl not found on PATH (it drives the control plane)"))?;
        let dir = tempfile::Builder::new().prefix("ferry-k8s-").tempdir()?;
        let mut cp = Self {
            etcd: None,
            apiserver: None,
            controller_manager: None,
            port: free_port()?,
            ports: Ports {
                etcd: free_port()?,
                etcd_peer: free_port()?,
                kcm: free_port()?,
            },
            token: random_hex(16)?,
            kubeconfig: dir.path().join("kubeconfig"),
            ca_pem: String::new(),
            kubectl,
            keep: false,
            dir: Some(dir),
        };
        match cp.boot(&bin) {
            Ok(timings) => {
                eprintln!(
                    "ferry: kubernetes {} control plane ready in {:.1?} ({timings}); \
                     kubeconfig {}",
                    k8s_version(),
                    started.elapsed(),
                    cp.kubeconfig.display()
                );
                Ok(cp)
            }
            Err(e) => {
                cp.stop();
                let dir = cp.keep_dir();
                Err(e.context(format!(
                    "starting the Kubernetes control plane failed; logs kept in {}: {}",
                    dir.display(),
                    log_list(&dir)
                )))
            }
        }
    }

    /// Runs `e2e/k8s/control-plane.sh ARGS` with this control plane's settings: the one
    /// definition of the components' flags, keys and certificates, shared with the kubelet
    /// cluster's `up.sh`.
    fn control_plane_sh(&self, args: &[&str], token: &str) -> Result<Vec<u8>> {
        let ports = &self.ports;
        let out = Command::new("bash")
            .arg(CONTROL_PLANE_SH)
            .args(args)
            .env("CP_DIR", self.dir())
            .env("CP_ETCD_PORT", ports.etcd.to_string())
            .env("CP_ETCD_PEER_PORT", ports.etcd_peer.to_string())
            .env("CP_API_BIND", "127.0.0.1")
            .env("CP_API_ADVERTISE", "127.0.0.1")
            .env("CP_API_PORT", self.port.to_string())
            .env("CP_SERVICE_CIDR", SERVICE_CIDR)
            .env("CP_KUBECONFIG", &self.kubeconfig)
            .env("CP_KCM_PORT", ports.kcm.to_string())
            .env("CP_TOKEN", token)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("cannot run bash {CONTROL_PLANE_SH}"))?;
        if !out.status.success() {
            bail!(
                "{CONTROL_PLANE_SH} {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(out.stdout)
    }

    /// `program` with the arguments `control-plane.sh args <name>` gives it.
    fn component(&self, bin: &Path, name: &str) -> Result<Command> {
        let args = self.control_plane_sh(&["args", name], "")?;
        let mut cmd = Command::new(bin.join(name));
        for arg in args.split(|b| *b == 0).filter(|a| !a.is_empty()) {
            cmd.arg(OsStr::from_bytes(arg));
        }
        Ok(cmd)
    }

    fn boot(&mut self, bin: &Path) -> Result<String> {
        self.control_plane_sh(&["prepare"], "")?;
        fs::write(
            self.dir().join("pki/tokens.csv"),
            format!(
                "{},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n",
                self.token
            ),
        )?;
        let t = Instant::now();
        self.boot_etcd(bin)?;
        let etcd_time = t.elapsed();
        let t = Instant::now();
        self.boot_apiserver(bin)?;
        let api_time = t.elapsed();
        let t = Instant::now();
        self.boot_controller_manager(bin)?;
        Ok(format!(
            "etcd {etcd_time:.1?}, kube-apiserver {api_time:.1?}, \
             kube-controller-manager {:.1?}",
            t.elapsed()
        ))
    }

    fn boot_etcd(&mut self, bin: &Path) -> Result<()> {
        let log = self.dir().join("etcd.log");
        let mut etcd = spawn_tied(&mut self.component(bin, "etcd")?, &log)?;
        let port = self.ports.etcd;
        let ready = wait_for_port(port, Duration::from_secs(30), &mut etcd, "etcd", &log);
        self.etcd = Some(etcd);
        ready?;
        self.wait(Duration::from_secs(30), "etcd /health", &log, |cp| {
            cp.check_alive()?;
            Ok(http_get(port, "/health")
                .is_ok_and(|(status, body)| status == 200 && body.contains("\"true\"")))
        })
    }

    fn boot_apiserver(&mut self, bin: &Path) -> Result<()> {
        let log = self.dir().join("kube-apiserver.log");
        let mut apiserver = spawn_tied(&mut self.component(bin, "kube-apiserver")?, &log)?;
        let ready = wait_for_port(
            self.port,
            Duration::from_secs(60),
            &mut apiserver,
            "kube-apiserver",
            &log,
        );
        self.apiserver = Some(apiserver);
        ready?;
        // It writes its self-signed certificate before it serves.
        self.control_plane_sh(&["extract-ca"], "")
            .context("the API server wrote no self-signed certificate with its CA")?;
        self.ca_pem = fs::read_to_string(self.ca_file())?;
        self.write_kubeconfig(&self.kubeconfig, ADMIN_USER, &self.token, "default")?;
        self.wait(
            Duration::from_secs(90),
            "kube-apiserver /readyz",
            &log,
            |cp| {
                cp.check_alive()?;
                Ok(cp.get_raw(None, "/readyz").is_ok_and(|body| body == "ok"))
            },
        )
        .map_err(|e| match self.get_raw(None, "/readyz?verbose") {
            Ok(v) | Err(v) => e.context(format!("last /readyz?verbose:\n{v}")),
        })
    }

    fn boot_controller_manager(&mut self, bin: &Path) -> Result<()> {
        let log = self.dir().join("kube-controller-manager.log");
        let mut kcm = spawn_tied(&mut self.component(bin, "kube-controller-manager")?, &log)?;
        let port = self.ports.kcm;
        let ready = wait_for_port(
            port,
            Duration::from_secs(60),
            &mut kcm,
            "kube-controller-manager",
            &log,
        );
        self.controller_manager = Some(kcm);
        ready?;
        self.wait(
            Duration::from_secs(60),
            "kube-controller-manager /healthz",
            &log,
            |cp| {
                cp.check_alive()?;
                Ok(cp
                    .get_raw(Some(port), "/healthz")
                    .is_ok_and(|body| body == "ok"))
            },
        )
    }

    /// Writes a kubeconfig for `user` with its bearer `token` to `path`, trusting the API
    /// server's CA; `namespace` is its context's namespace.
    pub fn write_kubeconfig(
        &self,
        path: &Path,
        user: &str,
        token: &str,
        namespace: &str,
    ) -> Result<()> {
        let file = path.to_string_lossy();
        self.control_plane_sh(&["kubeconfig", &file, "ferry", user, namespace], token)?;
        Ok(())
    }

    /// `https://127.0.0.1:<port>`, the API server.
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The API server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A bearer token of [`ADMIN_USER`], a member of `system:masters` (may do everything).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The PEM certificate of the CA that signed the API server's serving certificate (which
    /// is valid for 127.0.0.1). It is in the kubeconfig as `certificate-authority-data`, and in
    /// the file [`ControlPlane::ca_file`].
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The file holding [`ControlPlane::ca_pem`].
    pub fn ca_file(&self) -> PathBuf {
        self.dir().join("pki/ca.crt")
    }

    /// A kubeconfig file (cluster, user and context `ferry`, namespace `default`): the server
    /// URL, the CA and the admin token.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The control plane's temp dir: the kubeconfig, `pki/` (the service-account key, the token
    /// file, the generated certificates), etcd's data in `etcd/` and the logs `etcd.log`,
    /// `kube-apiserver.log`, `kube-controller-manager.log`.
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .map(|d| d.path())
            .expect("ControlPlane dir is present until drop")
    }

    /// The log file of each process, `(name, path)`.
    pub fn logs(&self) -> Vec<(&'static str, PathBuf)> {
        BINARIES
            .iter()
            .map(|b| (*b, self.dir().join(format!("{b}.log"))))
            .collect()
    }

    /// `kubectl --kubeconfig <kubeconfig_path> ARGS...`, ready to run.
    pub fn kubectl<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new(&self.kubectl);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    /// Runs [`ControlPlane::kubectl`] and returns its stdout; fails with stdout and stderr if
    /// it exits unsuccessfully.
    pub fn run_kubectl<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.run_kubectl_with_stdin(args, "")
    }

    /// Sets a pod's status as its kubelet would (no kubelet runs here): `phase` if given,
    /// `ip` as its pod IP if given, and its `Ready` condition.
    pub fn report_pod(
        &self,
        ns: &str,
        pod: &str,
        phase: Option<&str>,
        ip: Option<std::net::IpAddr>,
        ready: bool,
    ) -> Result<()> {
        let mut status = serde_json::json!({
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        });
        if let Some(phase) = phase {
            status["phase"] = phase.into();
        }
        if let Some(ip) = ip {
            status["podIP"] = ip.to_string().into();
            status["podIPs"] = serde_json::json!([{ "ip": ip.to_string() }]);
        }
        let patch = serde_json::json!({ "status": status }).to_string();
        self.run_kubectl([
            "patch",
            "pod",
            pod,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch,
        ])
        .map(drop)
    }

    /// Applies the CRDs in `dir` (server-side) and waits until `names` are established.
    pub fn install_crds(&self, dir: &Path, names: &[&str]) -> Result<()> {
        self.run_kubectl([
            OsStr::new("apply"),
            OsStr::new("--server-side"),
            OsStr::new("-f"),
            dir.as_os_str(),
        ])?;
        // Large CRDs (Argo CD's) on a loaded 2-core machine took over 30 s.
        let mut wait = vec![
            "wait".to_owned(),
            "--for=condition=Established".to_owned(),
            "--timeout=90s".to_owned(),
        ];
        wait.extend(names.iter().map(|n| format!("crd/{n}")));
        // A CRD just created may have no status yet, which `kubectl wait` reports as an error
        // instead of waiting.
        let start = Instant::now();
        loop {
            match self.run_kubectl(&wait) {
                Ok(_) => return Ok(()),
                Err(e)
                    if e.to_string().contains("accessor error")
                        && start.elapsed() < Duration::from_secs(30) =>
                {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// [`ControlPlane::run_kubectl`] with `stdin` fed to kubectl, e.g. for
    /// `run_kubectl_with_stdin(["apply", "-f", "-"], yaml)`.
    pub fn run_kubectl_with_stdin<I, S>(&self, args: I, stdin: &str) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.kubectl(args);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let shown = format!("{cmd:?}");
        let mut child = cmd.spawn().with_context(|| format!("cannot run {shown}"))?;
        let mut pipe = child.stdin.take().expect("piped stdin");
        let input = stdin.as_bytes().to_vec();
        let writer = std::thread::spawn(move || pipe.write_all(&input));
        let out = child.wait_with_output()?;
        writer
            .join()
            .map_err(|_| anyhow!("stdin writer panicked"))?
            .with_context(|| format!("writing stdin of {shown}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "{shown} failed ({}):\n{stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(stdout)
    }

    /// Keeps [`ControlPlane::dir`] (the logs and configuration, without etcd's data) after the
    /// drop, and says so on stderr then. For a test that returns an `Err`: the dir is kept
    /// anyway when the value is dropped during a panic.
    pub fn keep_logs(&mut self) {
        self.keep = true;
    }

    /// Stops the controller manager, the API server and etcd (in that order).
    pub fn stop(&mut self) {
        for (child, grace) in [
            (&mut self.controller_manager, Duration::from_secs(2)),
            (&mut self.apiserver, Duration::from_secs(5)),
            (&mut self.etcd, Duration::from_secs(5)),
        ] {
            if let Some(mut c) = child.take() {
                terminate(&mut c, grace);
            }
        }
    }

    /// `GET path` with the admin token, against the API server or (with `port`) another
    /// component serving on 127.0.0.1 with a self-signed certificate. Ok(body) on 2xx,
    /// Err(message) otherwise.
    fn get_raw(&self, port: Option<u16>, path: &str) -> std::result::Result<String, String> {
        let mut cmd = match port {
            None => self.kubectl(["get", "--raw", path, "--request-timeout=5s"]),
            Some(port) => {
                // Not the kubeconfig: its CA is not the one of this component's self-signed
                // certificate. The token is only there because kubectl without credentials
                // prompts for a user name; the component treats the request as anonymous.
                let mut cmd = Command::new(&self.kubectl);
                cmd.args([
                    "--kubeconfig=/dev/null",
                    &format!("--server=https://127.0.0.1:{port}"),
                    "--insecure-skip-tls-verify=true",
                    &format!("--token={}", self.token),
                    "get",
                    "--raw",
                    path,
                    "--request-timeout=5s",
                ])
                .stdin(Stdio::null());
                cmd
            }
        };
        match cmd.output() {
            Ok(out) if out.status.success() => {
                Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
            }
            Ok(out) => Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    fn wait(
        &mut self,
        timeout: Duration,
        what: &str,
        log: &Path,
        mut ready: impl FnMut(&mut Self) -> Result<bool>,
    ) -> Result<()> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if ready(self)? {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!(
            "{what} not ok within {timeout:?}; log {}:\n{}",
            log.display(),
            tail(log)
        )
    }

    /// Fails with the log of the first process that exited.
    fn check_alive(&mut self) -> Result<()> {
        let dir = self.dir().to_path_buf();
        for (name, child) in [
            ("etcd", &mut self.etcd),
            ("kube-apiserver", &mut self.apiserver),
            ("kube-controller-manager", &mut self.controller_manager),
        ] {
            if let Some(c) = child
                && let Some(status) = c.try_wait()?
            {
                let log = dir.join(format!("{name}.log"));
                bail!(
                    "{name} exited with {status}; log {}:\n{}",
                    log.display(),
                    tail(&log)
                );
            }
        }
        Ok(())
    }

    /// Keeps the temp dir (logs, config) past the drop, minus etcd's data (a preallocated
    /// 64 MB WAL); returns its path.
    fn keep_dir(&mut self) -> PathBuf {
        match self.dir.take() {
            Some(d) => {
                let path = d.keep();
                let _ = fs::remove_dir_all(path.join("etcd"));
                path
            }
            None => PathBuf::new(),
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
        let panicking = std::thread::panicking();
        if (panicking || self.keep) && self.dir.is_some() {
            let dir = self.keep_dir();
            eprintln!(
                "ferry: {}Kubernetes control plane logs kept in {}: {}",
                if panicking { "the test panicked; " } else { "" },
                dir.display(),
                log_list(&dir)
            );
        }
    }
}

fn log_list(dir: &Path) -> String {
    BINARIES
        .iter()
        .map(|b| dir.join(format!("{b}.log")))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// What runs kubectl against a cluster: a [`ControlPlane`] or a [`crate::cluster::Cluster`].
pub trait Kubectl {
    /// kubectl with `args`: its standard output, or an error with its standard error.
    fn run_kubectl(&self, args: &[&str]) -> Result<String>;

    /// `kubectl get KIND NAME -n NS -o jsonpath=TEMPLATE`. TEMPLATE is kubectl's, braces and
    /// all: `{.status.readyReplicas}`, `{range .items[*]}{.metadata.name} {end}`.
    fn jsonpath(&self, kind: &str, name: &str, ns: &str, template: &str) -> Result<String> {
        let output = format!("jsonpath={template}");
        self.run_kubectl(&["get", kind, name, "-n", ns, "-o", &output])
    }
}

impl Kubectl for ControlPlane {
    fn run_kubectl(&self, args: &[&str]) -> Result<String> {
        ControlPlane::run_kubectl(self, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_pinned() {
        assert!(k8s_version().starts_with("v1."), "{}", k8s_version());
    }
}
