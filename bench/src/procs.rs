//! Processes under measurement: the forwarder binary, and what `/proc` says of any process.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use ferry_e2e::{free_port, http_get};

/// CPU seconds (user + system) and peak resident memory of a process, from `/proc`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub peak_rss_mib: f64,
    /// Resident now (`VmRSS`).
    pub rss_mib: f64,
}

pub fn usage(pid: u32) -> Result<Usage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may contain spaces; the fields after it are space-separated.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("/proc/PID/stat without ')'")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); `after` starts at field 3.
    let ticks: u64 = fields
        .get(11..13)
        .context("short /proc/PID/stat")?
        .iter()
        .map(|f| f.parse::<u64>().unwrap_or(0))
        .sum();
    // SAFETY: sysconf(3) has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |field: &str| -> Result<f64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no {field} in /proc/PID/status"))
    };
    Ok(Usage {
        cpu_seconds: ticks as f64 / hz,
        peak_rss_mib: kib("VmHWM:")? / 1024.0,
        rss_mib: kib("VmRSS:")? / 1024.0,
    })
}

/// What the scheduler says of a process: CPU time with nanosecond precision (the ticks of
/// `/proc/PID/stat` are 10 ms, too coarse for an idle process) and how many times its threads
/// were put on a CPU (each one a wakeup), summed over its threads.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sched {
    pub cpu_seconds: f64,
    pub wakeups: u64,
}

/// [`Sched`] of `pid` from `/proc/PID/task/*/schedstat` ("run ns, wait ns, timeslices"). Only
/// threads alive now count: the forwarder's are long-lived.
pub fn sched(pid: u32) -> Result<Sched> {
    let mut total = Sched::default();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("no process {pid}"))?;
    for task in tasks {
        let path = task?.path().join("schedstat");
        // A thread may end between the listing and the read.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("{}: {text:?}", path.display()))?;
        let [run_ns, _, slices] = fields[..] else {
            bail!("{}: not 3 fields: {text:?}", path.display());
        };
        total.cpu_seconds += run_ns as f64 / 1e9;
        total.wakeups += slices;
    }
    Ok(total)
}

/// One `ferry-forwarder` process on a config written to its own directory.
pub struct Forwarder {
    child: Option<Child>,
    pub http_port: u16,
    config: PathBuf,
    log: PathBuf,
}

fn with_listen(config: &str, http_port: u16) -> String {
    format!("{config}http:\n  listen: 127.0.0.1:{http_port}\n")
}

impl Forwarder {
    /// Starts it; `config` gets `http.listen` on a free port appended.
    pub fn start(bin: &Path, dir: &Path, name: &str, config: &str) -> Result<Self> {
        Self::spawn(bin, dir, name, config, false)
    }

    /// [`Forwarder::start`], watching its config file: [`Forwarder::rewrite_config`] reloads it.
    pub fn start_reloading(bin: &Path, dir: &Path, name: &str, config: &str) -> Result<Self> {
        Self::spawn(bin, dir, name, config, true)
    }

    fn spawn(bin: &Path, dir: &Path, name: &str, config: &str, reload: bool) -> Result<Self> {
        let http_port = free_port()?;
        let path = dir.join(format!("{name}.yaml"));
        std::fs::write(&path, with_listen(config, http_port))?;
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let mut command = Command::new(bin);
        command.arg("--config").arg(&path);
        if !reload {
            command.arg("--no-reload");
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        Ok(Self {
            child: Some(child),
            http_port,
            config: path,
            log,
        })
    }

    /// Replaces its config file at once (a rename, as Kubernetes swaps a ConfigMap's files).
    pub fn rewrite_config(&self, config: &str) -> Result<()> {
        let next = self.config.with_extension("next");
        std::fs::write(&next, with_listen(config, self.http_port))?;
        std::fs::rename(&next, &self.config)?;
        Ok(())
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// Waits until `/readyz` answers 200: connected and subscribed, Kafka reachable.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Ok((200, _)) = http_get(self.http_port, "/readyz") {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                bail!("forwarder exited with {status}: {}", self.log_tail());
            }
            if start.elapsed() > timeout {
                bail!("forwarder not ready after {timeout:?}: {}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The sum of a metric's samples (every label set), or `None` when `/metrics` does not answer.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics_sum(&[name])
    }

    /// The sum of several metrics' samples from one scrape (one request: polling costs the
    /// forwarder it measures).
    pub fn metrics_sum(&self, names: &[&str]) -> Option<f64> {
        self.metrics_each(names).map(|each| each.iter().sum())
    }

    /// Each of the `names`' sums over their labels, from one scrape.
    pub fn metrics_each(&self, names: &[&str]) -> Option<Vec<f64>> {
        match http_get(self.http_port, "/metrics").ok()? {
            (200, body) => Some(
                names
                    .iter()
                    .map(|name| ferry_e2e::metrics::sum(&body, name, &[]))
                    .collect(),
            ),
            _ => None,
        }
    }

    pub fn usage(&self) -> Result<Usage> {
        usage(self.pid())
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL and wait: nothing drained, acked or disconnected.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().context("SIGKILL the forwarder")?;
            child.wait()?;
        }
        Ok(())
    }

    /// SIGTERM (drain, ack, disconnect) and wait.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let status = child.wait()?;
        if !status.success() {
            bail!("forwarder exited with {status}: {}", self.log_tail());
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
