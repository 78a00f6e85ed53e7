//! PNG plots: throughput against the in-flight window, and the latency CDFs.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::report::{Drain, Latency};

/// DejaVu Sans from Debian's fonts-dejavu-core (e2e/install.sh installs it), registered once:
/// plotters' ab_glyph text needs the font bytes, and no fontconfig is involved.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn font() -> Result<()> {
    static REGISTERED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = std::fs::read(FONT)
                .map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core)"))?;
            // plotters keeps a &'static: the font lives as long as the process, once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{FONT} is not a usable TrueType font"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plot: {e:?}")
}

pub fn throughput_vs_window(path: &Path, runs: &[Drain]) -> Result<()> {
    if runs.is_empty() {
        return Ok(());
    }
    font()?;
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max_rate = runs.iter().map(|d| d.msgs_per_sec).fold(0.0, f64::max) * 1.15;
    let max_window = runs.iter().map(|d| d.window).max().unwrap_or(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "ferry-forwarder: drain throughput vs in-flight window (QoS 1, 300 B)",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(75)
        .build_cartesian_2d((5f64..max_window * 1.5).log_scale(), 0f64..max_rate)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("max_inflight (messages, log scale)")
        .y_desc("messages / s")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{:.0}k", v / 1000.0))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    let points: Vec<(f64, f64)> = runs
        .iter()
        .map(|d| (d.window as f64, d.msgs_per_sec))
        .collect();
    chart
        .draw_series(LineSeries::new(points.clone(), BLUE.stroke_width(2)))
        .map_err(err)?;
    chart
        .draw_series(points.iter().map(|p| Circle::new(*p, 4, BLUE.filled())))
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

pub fn latency_cdf(path: &Path, runs: &[Latency]) -> Result<()> {
    if runs.is_empty() {
        return Ok(());
    }
    font()?;
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max_ms = runs
        .iter()
        .map(|l| l.max_ms)
        .filter(|m| m.is_finite())
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "End-to-end latency CDF (MQTT publish → Kafka read, QoS 1, 300 B)",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((0.1f64..max_ms * 1.2).log_scale(), 0f64..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("latency (ms, log scale)")
        .y_desc("fraction of messages")
        .x_label_formatter(&|v| format!("{v}"))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    let colors = [BLUE, RED, GREEN, MAGENTA];
    for (i, run) in runs.iter().enumerate() {
        let color = colors[i % colors.len()];
        let n = run.sorted_ms.len().max(1) as f64;
        // At most ~2000 points per curve: enough for a smooth line.
        let step = (run.sorted_ms.len() / 2000).max(1);
        let points: Vec<(f64, f64)> = run
            .sorted_ms
            .iter()
            .enumerate()
            .step_by(step)
            .map(|(k, ms)| (ms.max(0.1), (k + 1) as f64 / n))
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(format!(
                "{} msg/s: p50 {:.1} ms, p99 {:.1} ms",
                run.target_rate, run.p50_ms, run.p99_ms
            ))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
