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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};

use super::{cache_dir, free_port, http_get, spawn_tied, tail, terminate, wait_for_port, which};

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
pub const SERVICE_CLUSTER_IP_RANGE: &str = "10.0.0.0/24";
/// The service-account token issuer (`--service-account-issuer`).
pub const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// The user name of [`ControlPlane::token`]; it is in the `system:masters` group.
pub const ADMIN_USER: &str = "ferry-admin";

/// etcd + kube-apiserver + kube-controller-manager on free loopback ports. See the module docs.
pub struct ControlPlane {
    etcd: Option<Child>,
    apiserver: Option<Child>,
    controller_manager: Option<Child>,
    dir: Option<tempfile::TempDir>,
    port: u16,
    token: String,
    kubeconfig: PathBuf,
    ca_pem: Option<String>,
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
            port: 0,
            token: random_hex(16)?,
            kubeconfig: dir.path().join("kubeconfig"),
            ca_pem: None,
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

    fn boot(&mut self, bin: &Path) -> Result<String> {
        let dir = self.dir().to_path_buf();
        let path = |name: &str| dir.join(name);

        // etcd
        let t = Instant::now();
        let etcd_port = free_port()?;
        let peer_port = free_port()?;
        let etcd_log = path("etcd.log");
        let mut etcd = spawn_tied(
            Command::new(bin.join("etcd"))
                .arg("--name=ferry")
                .arg(format!("--data-dir={}", path("etcd-data").display()))
                .arg(format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"))
                .arg(format!(
                    "--advertise-client-urls=http://127.0.0.1:{etcd_port}"
                ))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"
                ))
                .arg(format!(
                    "--initial-cluster=ferry=http://127.0.0.1:{peer_port}"
                ))
                .arg("--unsafe-no-fsync")
                .arg("--log-level=warn"),
            &etcd_log,
        )?;
        let ready = wait_for_port(
            etcd_port,
            Duration::from_secs(30),
            &mut etcd,
            "etcd",
            &etcd_log,
        );
        self.etcd = Some(etcd);
        ready?;
        self.wait(Duration::from_secs(30), "etcd /health", &etcd_log, |cp| {
            cp.check_alive()?;
            Ok(http_get(etcd_port, "/health")
                .is_some_and(|(status, body)| status == 200 && body.contains("\"true\"")))
        })?;
        let etcd_time = t.elapsed();

        // kube-apiserver
        let t = Instant::now();
        let sa_key = path("service-account.key");
        openssl(&["genrsa", "-out", &sa_key.to_string_lossy(), "2048"])?;
        let tokens = path("tokens.csv");
        fs::write(
            &tokens,
            format!(
                "{},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n",
                self.token
            ),
        )?;
        let cert_dir = path("apiserver-certs");
        self.port = free_port()?;
        let api_log = path("kube-apiserver.log");
        let mut apiserver = spawn_tied(
            Command::new(bin.join("kube-apiserver"))
                .arg(format!("--etcd-servers=http://127.0.0.1:{etcd_port}"))
                .arg("--bind-address=127.0.0.1")
                .arg("--advertise-address=127.0.0.1")
                .arg(format!("--secure-port={}", self.port))
                .arg(format!("--cert-dir={}", cert_dir.display()))
                .arg(format!("--token-auth-file={}", tokens.display()))
                .arg("--authorization-mode=Node,RBAC")
                .arg(format!("--service-account-key-file={}", sa_key.display()))
                .arg(format!(
                    "--service-account-signing-key-file={}",
                    sa_key.display()
                ))
                .arg(format!("--service-account-issuer={SERVICE_ACCOUNT_ISSUER}"))
                .arg(format!(
                    "--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"
                ))
                .arg("--kubelet-preferred-address-types=InternalIP")
                .arg("--profiling=false"),
            &api_log,
        )?;
        let ready = wait_for_port(
            self.port,
            Duration::from_secs(60),
            &mut apiserver,
            "kube-apiserver",
            &api_log,
        );
        self.apiserver = Some(apiserver);
        ready?;
        // The serving cert it generated is "leaf, then its CA"; trust that CA.
        self.ca_pem = fs::read_to_string(cert_dir.join("apiserver.crt"))
            .ok()
            .and_then(|bundle| pem_blocks(&bundle).into_iter().nth(1));
        if let Some(ca) = &self.ca_pem {
            fs::write(path("ca.pem"), ca)?;
        }
        fs::write(&self.kubeconfig, self.kubeconfig_yaml())?;
        self.wait(
            Duration::from_secs(90),
            "kube-apiserver /readyz",
            &api_log,
            |cp| {
                cp.check_alive()?;
                Ok(cp.get_raw(None, "/readyz").is_ok_and(|body| body == "ok"))
            },
        )
        .map_err(|e| match self.get_raw(None, "/readyz?verbose") {
            Ok(v) | Err(v) => e.context(format!("last /readyz?verbose:\n{v}")),
        })?;
        let api_time = t.elapsed();

        // kube-controller-manager
        let t = Instant::now();
        let kcm_port = free_port()?;
        let kcm_log = path("kube-controller-manager.log");
        let mut kcm = Command::new(bin.join("kube-controller-manager"));
        // No --authentication-kubeconfig: the delegated authentication would wait forever
        // for the kube-system/extension-apiserver-authentication ConfigMap, which this API
        // server (no client CA) never writes, and fill the log with errors. /healthz is then
        // served to anonymous requests (it is in --authorization-always-allow-paths).
        kcm.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={kcm_port}"))
            .arg(format!("--cert-dir={}", path("kcm-certs").display()))
            .arg("--controllers=*")
            .arg("--use-service-account-credentials=false")
            .arg("--leader-elect=false")
            .arg(format!(
                "--service-account-private-key-file={}",
                sa_key.display()
            ))
            .arg(format!(
                "--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"
            ))
            .arg("--profiling=false");
        if self.ca_pem.is_some() {
            kcm.arg(format!("--root-ca-file={}", path("ca.pem").display()));
        }
        let mut kcm = spawn_tied(&mut kcm, &kcm_log)?;
        let ready = wait_for_port(
            kcm_port,
            Duration::from_secs(60),
            &mut kcm,
            "kube-controller-manager",
            &kcm_log,
        );
        self.controller_manager = Some(kcm);
        ready?;
        self.wait(
            Duration::from_secs(60),
            "kube-controller-manager /healthz",
            &kcm_log,
            |cp| {
                cp.check_alive()?;
                Ok(cp
                    .get_raw(Some(kcm_port), "/healthz")
                    .is_ok_and(|body| body == "ok"))
            },
        )?;
        Ok(format!(
            "etcd {etcd_time:.1?}, kube-apiserver {api_time:.1?}, \
             kube-controller-manager {:.1?}",
            t.elapsed()
        ))
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
    /// the file `ca.pem` of [`ControlPlane::dir`]. `None` only if the API server did not write
    /// the usual self-signed bundle; the kubeconfig then uses `insecure-skip-tls-verify`.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// A kubeconfig file (cluster, user and context `ferry`, namespace `default`): the server
    /// URL, the CA and the admin token.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The control plane's temp dir: the kubeconfig, the service-account key, the token file,
    /// etcd's data, the generated certificates and the logs `etcd.log`,
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
        let mut wait = vec![
            "wait".to_owned(),
            "--for=condition=Established".to_owned(),
            "--timeout=30s".to_owned(),
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

    fn kubeconfig_yaml(&self) -> String {
        let tls = match &self.ca_pem {
            Some(ca) => format!("certificate-authority-data: {}", base64(ca.as_bytes())),
            None => "insecure-skip-tls-verify: true".to_owned(),
        };
        format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: ferry\n  \
               cluster:\n    \
                 server: {server}\n    \
                 {tls}\n\
             users:\n\
             - name: {ADMIN_USER}\n  \
               user:\n    \
                 token: {token}\n\
             contexts:\n\
             - name: ferry\n  \
               context:\n    \
                 cluster: ferry\n    \
                 user: {ADMIN_USER}\n    \
                 namespace: default\n\
             current-context: ferry\n",
            server = self.server_url(),
            token = self.token
        )
    }

    /// Keeps the temp dir (logs, config) past the drop, minus etcd's data (a preallocated
    /// 64 MB WAL); returns its path.
    fn keep_dir(&mut self) -> PathBuf {
        match self.dir.take() {
            Some(d) => {
                let path = d.keep();
                let _ = fs::remove_dir_all(path.join("etcd-data"));
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

fn openssl(args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("cannot run openssl (package openssl; run e2e/install.sh)")?;
    if !out.status.success() {
        bail!(
            "openssl {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The PEM blocks of `text`, each with its BEGIN and END lines.
fn pem_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if line.starts_with("-----BEGIN ") {
            current = Some(String::new());
        }
        if let Some(block) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
            if line.starts_with("-----END ") {
                blocks.extend(current.take());
            }
        }
    }
    blocks
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), expected);
        }
    }

    #[test]
    fn pem_blocks_splits_a_bundle() {
        let bundle = "-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----\n\
                      junk\n-----BEGIN CERTIFICATE-----\nBBB\n-----END CERTIFICATE-----\n";
        let blocks = pem_blocks(bundle);
        assert_eq!(blocks.len(), 2);
        assert!(blocks[1].contains("BBB"));
        assert!(blocks[1].ends_with("-----END CERTIFICATE-----\n"));
    }

    #[test]
    fn version_is_pinned() {
        assert!(k8s_version().starts_with("v1."), "{}", k8s_version());
    }
}
