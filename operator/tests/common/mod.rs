//! A real control plane with Ferry's CRDs installed, for the operator's tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_e2e::kube::{ControlPlane, Kubectl as _};

/// Starts etcd, kube-apiserver and kube-controller-manager, installs `crds/`, waits until they
/// are established, and creates `namespace`.
pub fn control_plane_with_crds(namespace: &str) -> ControlPlane {
    let cp = ControlPlane::start().expect("control plane (run e2e/k8s/build.sh once)");
    cp.install_crds(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/")),
        &["forwardingrules.ferry.dev", "brokerconnections.ferry.dev"],
    )
    .expect("CRDs install and are established");
    cp.run_kubectl(["create", "namespace", namespace])
        .expect("namespace");
    cp
}

/// `kubectl apply` of `yaml`, retried while discovery has not caught up with new CRDs yet.
pub fn apply(cp: &ControlPlane, yaml: &str) {
    let start = Instant::now();
    while let Err(e) = cp.run_kubectl_with_stdin(["apply", "-f", "-"], yaml) {
        assert!(
            start.elapsed() < Duration::from_secs(20)
                && e.to_string().contains("no matches for kind"),
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The `ferry-operator` binary, its log in the control plane's directory.
pub struct Operator {
    child: Option<Child>,
    log: PathBuf,
    pub port: u16,
}

impl Operator {
    /// Starts it with `args` added to `--listen 127.0.0.1:<free port>`.
    pub fn start(cp: &ControlPlane, name: &str, args: &[&str]) -> Operator {
        let port = ferry_e2e::free_port().expect("port");
        let log = cp.dir().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log");
        let child = Command::new(env!("CARGO_BIN_EXE_ferry-operator"))
            .args(["--listen", &format!("127.0.0.1:{port}"), "--identity", name])
            .args(args)
            .env("KUBECONFIG", cp.kubeconfig_path())
            .env("FERRY_LOG", "info,ferry_operator=debug")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .expect("spawn ferry-operator");
        Operator {
            child: Some(child),
            log,
            port,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The sum of a metric's samples whose line contains `filter` (`None`: not served).
    pub fn metric(&self, name: &str, filter: &str) -> Option<f64> {
        match ferry_e2e::http_get(self.port, "/metrics").ok()? {
            (200, body) => Some(ferry_e2e::metrics::sum(&body, name, &[filter])),
            _ => None,
        }
    }

    /// SIGTERM, then wait; returns the exit code.
    pub fn terminate(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        child.wait().ok()?.code()
    }

    /// SIGKILL: no chance to clean up (a crash).
    pub fn terminate_hard(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        child.kill().ok()?;
        child.wait().ok()
    }

    /// Waits until `cond` holds, or panics with `what` and the operator's log.
    pub fn wait_for(&self, what: &str, timeout: Duration, cond: impl FnMut() -> bool) {
        ferry_e2e::wait_until(what, timeout, ferry_e2e::WAIT_POLL, cond)
            .unwrap_or_else(|e| panic!("{e}\n{}", self.log()));
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- {} ---\n{}", self.log.display(), self.log());
        }
    }
}

/// A condition of an object: (status, reason, message), or `None` while it has none.
pub fn condition(
    cp: &ControlPlane,
    ns: &str,
    kind: &str,
    name: &str,
    type_: &str,
) -> Option<(String, String, String)> {
    let template = format!(
        "{{range .status.conditions[?(@.type==\"{type_}\")]}}{{.status}}|{{.reason}}|{{.message}}{{end}}"
    );
    let out = cp.jsonpath(kind, name, ns, &template).ok()?;
    let mut parts = out.splitn(3, '|');
    Some((
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
        parts.next()?.to_owned(),
    ))
}

/// [`ferry_e2e::kube::Kubectl::jsonpath`] of an object, empty when absent (what most checks compare with).
pub fn jsonpath(cp: &ControlPlane, ns: &str, kind: &str, name: &str, path: &str) -> String {
    cp.jsonpath(kind, name, ns, path).unwrap_or_default()
}

/// The `ferry-forwarder` binary of this build, beside `ferry-operator` in the checkout's target
/// dir (`cargo build -p ferry-forwarder`, or a workspace-wide test run). Not found from the test
/// binary's own path: that can be a build dir that other checkouts share.
pub fn forwarder_binary() -> PathBuf {
    std::path::Path::new(env!("CARGO_BIN_EXE_ferry-operator"))
        .parent()
        .map(|d| d.join("ferry-forwarder"))
        .filter(|p| p.exists())
        .expect("ferry-forwarder beside ferry-operator (cargo build -p ferry-forwarder)")
}

/// The arguments of StatefulSet `workload`'s forwarder container as its pod `pod` gets them
/// (Kubernetes expands `$(POD_NAME)` and `$(POD_NAMESPACE)`), its config file at `config`.
pub fn forwarder_args(
    cp: &ControlPlane,
    ns: &str,
    workload: &str,
    pod: &str,
    config: &std::path::Path,
) -> Vec<String> {
    let args = jsonpath(
        cp,
        ns,
        "statefulset",
        workload,
        "{.spec.template.spec.containers[0].args}",
    );
    let args: Vec<String> = serde_json::from_str(&args)
        .unwrap_or_else(|e| panic!("StatefulSet {workload}'s args {args:?}: {e}"));
    args.iter()
        .map(|a| {
            if a.ends_with("/config.yaml") {
                config.display().to_string()
            } else {
                a.replace("$(POD_NAME)", pod)
                    .replace("$(POD_NAMESPACE)", ns)
            }
        })
        .collect()
}

/// How long a test waits for the operator to act on a change (reconciles take well under a
/// second; the control plane on this machine can take a few).
pub const WAIT: Duration = Duration::from_secs(60);

/// A control plane and the operator serving it, seen from namespace `ns`; what a test asks of
/// its objects.
pub struct Scene<'a> {
    pub cp: &'a ControlPlane,
    pub op: &'a Operator,
    pub ns: &'a str,
}

impl<'a> Scene<'a> {
    pub fn new(cp: &'a ControlPlane, op: &'a Operator, ns: &'a str) -> Self {
        Self { cp, op, ns }
    }

    pub fn apply(&self, yaml: &str) {
        apply(self.cp, yaml);
    }

    /// A condition of an object: (status, reason, message), empty if none.
    pub fn cond(&self, kind: &str, name: &str, type_: &str) -> (String, String, String) {
        condition(self.cp, self.ns, kind, name, type_).unwrap_or_default()
    }

    /// `jsonpath` of an object, empty when absent.
    pub fn get(&self, kind: &str, name: &str, path: &str) -> String {
        jsonpath(self.cp, self.ns, kind, name, path)
    }

    pub fn exists(&self, kind: &str, name: &str) -> bool {
        self.cp
            .run_kubectl(["get", kind, name, "-n", self.ns, "-o", "name"])
            .is_ok()
    }

    /// Waits until rule `rule`'s `Accepted` is `status`.
    pub fn wait_accepted(&self, rule: &str, status: &str) {
        self.op
            .wait_for(&format!("rule {rule} Accepted {status}"), WAIT, || {
                self.cond("fr", rule, "Accepted").0 == status
            });
    }

    /// The Events about objects named `name`: "type reason: message;" each.
    pub fn events(&self, name: &str) -> String {
        self.cp
            .run_kubectl([
                "get",
                "events",
                "-n",
                self.ns,
                "--field-selector",
                &format!("involvedObject.name={name}"),
                "-o",
                "jsonpath={range .items[*]}{.type} {.reason}: {.message};{end}",
            ])
            .expect("events")
    }
}
