//! The operator at scale: how long until N ForwardingRules are Accepted and rendered, how
//! many reconciles it runs per minute afterwards, and its peak memory.
//!
//! No kubelet runs here (issue 5 brings one), so "Ready" in the pod sense cannot be reached:
//! the figure is the time until every rule is `Accepted` and rendered into its group's
//! forwarder config, which is all the operator itself does before the pods start.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use ferry_e2e::kube::ControlPlane;
use ferry_e2e::{free_port, http_get};

use crate::report::OperatorFigures;

const NS: &str = "bench";
const GROUPS: usize = 10;

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn metric(port: u16, name: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics")?;
    Some(
        body.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

pub fn measure(bin: &Path, rules: usize, steady_seconds: u64) -> Result<OperatorFigures> {
    let cp = ControlPlane::start().context("control plane (run e2e/k8s/build.sh once)")?;
    cp.install_crds(
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/")),
        &["forwardingrules.ferry.dev", "brokerconnections.ferry.dev"],
    )?;
    cp.run_kubectl(["create", "namespace", NS])?;
    let port = free_port()?;
    let log = std::fs::File::create(cp.dir().join("operator.log"))?;
    let child = Command::new(bin)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--leader-elect", "false", "--log-format", "json"])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("FERRY_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let operator = Operator(child);
    let pid = operator.0.id();
    let start = Instant::now();
    while metric(port, "ferry_operator_reconciles_total").is_none() {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the operator never served /metrics");
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    cp.run_kubectl_with_stdin(
        ["create", "-f", "-"],
        &format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: BrokerConnection\nmetadata: {{ name: plant, namespace: {NS} }}\n\
             spec:\n  mqtt: {{ host: mqtt.example }}\n  kafka: {{ bootstrapServers: [\"kafka.example:9092\"] }}\n"
        ),
    )?;
    // One manifest per group, created by as many kubectl processes at once: kubectl sends one
    // request per object, and one process alone would measure kubectl, not the operator.
    let manifests: Vec<String> = (0..GROUPS)
        .map(|g| {
            (0..rules)
                .filter(|i| i % GROUPS == g)
                .map(|i| {
                    format!(
                        "---\napiVersion: ferry.dev/v1alpha1\nkind: ForwardingRule\nmetadata: {{ name: rule-{i}, namespace: {NS} }}\n\
                         spec:\n  connectionRef: {{ name: plant }}\n  group: g{g}\n  mqtt: {{ topics: [\"plant/{i}/#\"] }}\n  kafka: {{ topic: t{i} }}\n"
                    )
                })
                .collect()
        })
        .collect();
    let applied = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let creates: Vec<_> = manifests
            .iter()
            .map(|yaml| s.spawn(|| cp.run_kubectl_with_stdin(["create", "-f", "-"], yaml)))
            .collect();
        for c in creates {
            c.join()
                .map_err(|_| anyhow::anyhow!("a kubectl thread panicked"))??;
        }
        Ok(())
    })?;
    let apply_seconds = applied.elapsed().as_secs_f64();
    let accepted = || -> Result<usize> {
        let out = cp.run_kubectl([
            "get",
            "fr",
            "-n",
            NS,
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type==\"Accepted\")].status}{\"\\n\"}{end}",
        ])?;
        Ok(out.lines().filter(|l| *l == "True").count())
    };
    let deadline = Duration::from_secs(300);
    loop {
        let n = accepted()?;
        if n >= rules {
            break;
        }
        if applied.elapsed() > deadline {
            bail!("only {n} of {rules} rules Accepted after {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let all_accepted_seconds = applied.elapsed().as_secs_f64();
    let after_last_create_seconds = all_accepted_seconds - apply_seconds;
    // Rendered too: every group's config holds its rules.
    let configs = cp.run_kubectl([
        "get",
        "configmaps",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/name=ferry-forwarder",
        "-o",
        "jsonpath={range .items[*]}{.data.config\\.yaml}{end}",
    ])?;
    let rendered = configs.matches("- name: rule-").count();
    if rendered != rules {
        bail!("{rendered} of {rules} rules rendered into forwarder configs");
    }

    // Let the last triggers settle (the data-plane poller writes each new rule's first
    // `Forwarding` once, 1,000 writes spread over its next polls), then count what happens
    // when nothing changes.
    let settle = Instant::now();
    let mut last = metric(port, "ferry_operator_status_writes_total");
    loop {
        std::thread::sleep(Duration::from_secs(12));
        let now = metric(port, "ferry_operator_status_writes_total");
        if now == last || settle.elapsed() > Duration::from_secs(120) {
            break;
        }
        last = now;
    }
    let r0 = metric(port, "ferry_operator_reconciles_total").unwrap_or(f64::NAN);
    let w0 = metric(port, "ferry_operator_status_writes_total").unwrap_or(f64::NAN);
    std::thread::sleep(Duration::from_secs(steady_seconds));
    let r1 = metric(port, "ferry_operator_reconciles_total").unwrap_or(f64::NAN);
    let w1 = metric(port, "ferry_operator_status_writes_total").unwrap_or(f64::NAN);
    let usage = crate::procs::usage(pid)?;
    Ok(OperatorFigures {
        rules,
        groups: GROUPS,
        apply_seconds,
        all_accepted_seconds,
        after_last_create_seconds,
        steady_seconds,
        steady_reconciles: r1 - r0,
        steady_status_writes: w1 - w0,
        peak_rss_mib: usage.peak_rss_mib,
    })
}
