//! The metrics every Ferry process serves besides its own, named as Prometheus' official
//! client libraries name them so that stock dashboards and alerts work: `process_*` (CPU,
//! memory, file descriptors, threads, start time, read from `/proc` at each scrape) and
//! `<component>_build_info{version}` (always 1).

use procfs::WithCurrentSystemInfo as _;
use procfs::process::{LimitValue, Process};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

/// Registers `process_*` and `<component>_build_info{version="<version>"}` in `registry`,
/// which must be the unprefixed root (the names are fixed by convention).
pub fn register(registry: &mut Registry, component: &str, version: &str) {
    registry.register(
        format!("{component}_build"),
        format!("Always 1; the version of this {component} build as a label"),
        Info::new(vec![("version".to_owned(), version.to_owned())]),
    );
    registry.register_collector(Box::new(ProcessCollector::new()));
}

/// Reads `/proc/self` on each scrape.
#[derive(Debug)]
struct ProcessCollector {
    /// Seconds since the Unix epoch; fixed for the life of the process.
    start_time: Option<f64>,
}

impl ProcessCollector {
    fn new() -> Self {
        let start_time = Process::myself()
            .and_then(|p| p.stat())
            .and_then(|stat| {
                let boot = procfs::boot_time_secs()?;
                Ok(boot as f64 + stat.starttime as f64 / procfs::ticks_per_second() as f64)
            })
            .ok();
        Self { start_time }
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        // Whatever /proc does not answer (another OS, a restricted /proc) is left out of the
        // scrape rather than failing the whole of it.
        let Ok(me) = Process::myself() else {
            return Ok(());
        };
        if let Ok(stat) = me.stat() {
            let cpu = (stat.utime + stat.stime) as f64 / procfs::ticks_per_second() as f64;
            ConstCounter::new(cpu).encode(encoder.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent in seconds",
                Some(&Unit::Seconds),
                MetricType::Counter,
            )?)?;
            let rss = i64::try_from(stat.rss_bytes().get()).unwrap_or(i64::MAX);
            gauge(
                &mut encoder,
                "process_resident_memory",
                "Resident memory size in bytes",
                Some(&Unit::Bytes),
                rss,
            )?;
            let vsize = i64::try_from(stat.vsize).unwrap_or(i64::MAX);
            gauge(
                &mut encoder,
                "process_virtual_memory",
                "Virtual memory size in bytes",
                Some(&Unit::Bytes),
                vsize,
            )?;
            gauge(
                &mut encoder,
                "process_threads",
                "Number of OS threads in the process",
                None,
                stat.num_threads,
            )?;
        }
        if let Ok(fds) = me.fd_count() {
            let fds = i64::try_from(fds).unwrap_or(i64::MAX);
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors",
                None,
                fds,
            )?;
        }
        if let Ok(LimitValue::Value(max)) = me.limits().map(|l| l.max_open_files.soft_limit) {
            let max = i64::try_from(max).unwrap_or(i64::MAX);
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                max,
            )?;
        }
        if let Some(start) = self.start_time {
            ConstGauge::new(start).encode(encoder.encode_descriptor(
                "process_start_time",
                "Start time of the process since the Unix epoch in seconds",
                Some(&Unit::Seconds),
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    value: i64,
) -> std::fmt::Result {
    ConstGauge::new(value).encode(encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_and_build_info_metrics_have_the_conventional_names() {
        let mut registry = Registry::default();
        register(&mut registry, "ferry_test", "1.2.3");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for line in [
            "ferry_test_build_info{version=\"1.2.3\"} 1",
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_virtual_memory_bytes ",
            "process_open_fds ",
            "process_max_fds ",
            "process_threads ",
            "process_start_time_seconds ",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(line)),
                "{line:?} in\n{text}"
            );
        }
    }
}
