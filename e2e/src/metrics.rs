//! A `/metrics` page read as Prometheus reads it, and checked against what docs/metrics.md
//! documents: alerts and dashboards are written from there, so a served name or label
//! value it does not list is a bug.

use std::collections::BTreeSet;

use anyhow::{Result, bail};
pub use prometheus_parse::{Sample, Value};

/// The sum of the samples of the family `name` in a `/metrics` page whose line contains every
/// one of `labels` (e.g. `rule="a"`); 0 when there are none.
pub fn sum(body: &str, name: &str, labels: &[&str]) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The samples of one scrape of `http://127.0.0.1:<port>/metrics`.
pub struct Scrape {
    pub samples: Vec<Sample>,
    pub text: String,
}

impl Scrape {
    pub fn get(port: u16) -> Result<Scrape> {
        let (code, text) = crate::http::http_get(port, "/metrics")?;
        if code != 200 {
            bail!("GET /metrics on port {port}: {code}\n{text}");
        }
        let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))?;
        Ok(Scrape {
            samples: parsed.samples,
            text,
        })
    }

    /// Every value `label` has on the samples of `metric`.
    pub fn label_values(&self, metric: &str, label: &str) -> BTreeSet<String> {
        self.samples
            .iter()
            .filter(|s| s.metric == metric)
            .filter_map(|s| s.labels.get(label).map(str::to_owned))
            .collect()
    }

    /// The value of the sample of `metric` with exactly these `labels`, if served.
    pub fn value(&self, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .filter(|s| s.metric == metric && s.labels.len() == labels.len())
            .find(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .and_then(|s| match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
                _ => None,
            })
    }

    /// Checks the standard `process_*` metrics of a process started in the last 10 minutes:
    /// CPU used, a plausible resident size within the virtual one, open fds within the limit,
    /// a thread, and the start time. Names the first one that is missing or off.
    pub fn check_process_metrics(&self) -> Result<()> {
        let get = |name: &str| {
            self.value(name, &[])
                .ok_or_else(|| anyhow::anyhow!("{name} is not served"))
        };
        let rss = get("process_resident_memory_bytes")?;
        let fds = get("process_open_fds")?;
        let started = get("process_start_time_seconds")?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64();
        for (ok, what) in [
            (get("process_cpu_seconds_total")? > 0.0, "CPU seconds > 0"),
            (
                (1e6..1e9).contains(&rss),
                "resident memory between 1 MB and 1 GB",
            ),
            (
                get("process_virtual_memory_bytes")? >= rss,
                "virtual memory >= resident",
            ),
            (
                fds >= 3.0 && get("process_max_fds")? >= fds,
                "3 <= open fds <= max fds",
            ),
            (get("process_threads")? >= 1.0, "at least one thread"),
            (
                (now - 600.0..=now + 1.0).contains(&started),
                "started in the last 10 minutes",
            ),
        ] {
            if !ok {
                bail!(
                    "process metrics: want {what}; rss {rss}, fds {fds}, started {started} (now {now})"
                );
            }
        }
        Ok(())
    }

    /// What this page serves that `doc` does not document: a metric with no row of its own
    /// in a Markdown table, or a label value that row does not list (as `` `value` ``). Labels
    /// in `free` take any value (rule names, versions); `le` is the histograms' own.
    pub fn undocumented(&self, doc: &str, free: &[&str]) -> Vec<String> {
        let rows: Vec<&str> = doc
            .lines()
            .filter(|l| l.trim_start().starts_with('|'))
            .collect();
        let mut missing = BTreeSet::new();
        for sample in &self.samples {
            let row = documented_name(&sample.metric)
                .into_iter()
                .find_map(|name| rows.iter().find(|r| r.contains(&format!("`{name}`"))));
            let Some(row) = row else {
                missing.insert(format!("metric {}", sample.metric));
                continue;
            };
            for (label, value) in sample.labels.iter() {
                if label == "le" || free.contains(&label.as_str()) {
                    continue;
                }
                if !row.contains(&format!("`{label}`")) || !row.contains(&format!("`{value}`")) {
                    missing.insert(format!("{}{{{label}=\"{value}\"}}", sample.metric));
                }
            }
        }
        missing.into_iter().collect()
    }
}

/// The values `doc`'s metrics table lists for `label` of `metric` (the snake_case code
/// spans after `` `label`: `` in its row, up to the next `;`), to compare with the code's own vocabulary.
pub fn documented(doc: &str, metric: &str, label: &str) -> BTreeSet<String> {
    let Some(row) = doc
        .lines()
        .find(|l| l.trim_start().starts_with('|') && l.contains(&format!("`{metric}`")))
    else {
        return BTreeSet::new();
    };
    let Some((_, values)) = row.split_once(&format!("`{label}`:")) else {
        return BTreeSet::new();
    };
    // A row separates its labels with ';'.
    let values = values.split(';').next().unwrap_or_default();
    values
        .split('`')
        .skip(1)
        .step_by(2)
        // Label values are snake_case words; the row's other code spans are settings.
        .filter(|v| {
            v.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_owned)
        .collect()
}

/// The names a sample may be documented under: its own, or its histogram's (`_sum`, `_count`).
fn documented_name(metric: &str) -> Vec<&str> {
    let mut names = vec![metric];
    for suffix in ["_sum", "_count", "_bucket"] {
        if let Some(base) = metric.strip_suffix(suffix) {
            names.push(base);
        }
    }
    names
}
