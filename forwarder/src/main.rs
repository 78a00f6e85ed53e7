//! `ferry-forwarder --config config.yaml`: the data plane, in a pod or on its own.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use std::sync::Arc;

use ferry_api::config::{ConfigError, LogConfig, LogFormat};
use ferry_api::{SourceFormat, ValidConfig};
use ferry_forwarder::load::{LoadSettings, load};
use ferry_forwarder::reload::{ConfigSource, LogLevelSetter};
use tracing::{error, info, warn};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, reload};

/// Forwards MQTT messages into Kafka, at least once and in order.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Config file (Ferry format or the replaced forwarder's). Default: $CONFIG_FILE, else ./config.yaml.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Only load and validate the config, then exit (0 valid, 2 invalid).
    #[arg(long)]
    check: bool,
    /// Leave `${VAR}` in the config file as written instead of substituting the environment
    /// (the operator's pods: their config is rendered from user data, not a template).
    #[arg(long)]
    no_env_substitution: bool,
    /// Overrides `mqtt.client_id` (the operator's pods: one config, one id per pod).
    #[arg(long, env = "FERRY_MQTT_CLIENT_ID")]
    mqtt_client_id: Option<String>,
    /// Overrides `http.listen` (e.g. 127.0.0.1:9090).
    #[arg(long, env = "FERRY_HTTP_LISTEN")]
    http_listen: Option<std::net::SocketAddr>,
    /// Log format; overrides `log.format`.
    #[arg(long, env = "FERRY_LOG_FORMAT", value_parser = ["text", "json"])]
    log_format: Option<String>,
    /// Log filter (`info`, `debug`, `info,ferry_forwarder=debug`); overrides `log.level`.
    #[arg(long, env = "FERRY_LOG")]
    log_level: Option<String>,
    /// Do not watch the config file for changes.
    #[arg(long)]
    no_reload: bool,
}

/// Exit codes: 0 stopped cleanly, 1 runtime failure, 2 invalid config.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let path = cli
        .config
        .clone()
        .or_else(|| std::env::var_os("CONFIG_FILE").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("config.yaml"));
    let settings = LoadSettings {
        substitute_env: !cli.no_env_substitution,
        mqtt_client_id: cli.mqtt_client_id.clone(),
        http_listen: cli.http_listen,
    };
    let loaded = std::fs::read_to_string(&path)
        .map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })
        .and_then(|text| Ok((load(&text, &settings)?, text)));
    let (loaded, text) = match loaded {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ferry-forwarder: invalid config {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let level_overridden = cli.log_level.is_some();
    let Some(set_log_level) = start_logging(&cli, &loaded.config.log, &path) else {
        return ExitCode::from(2);
    };
    for w in &loaded.warnings {
        warn!(config = %path.display(), "{w}");
    }
    if loaded.format == SourceFormat::Legacy {
        info!(config = %path.display(), "read a config in the replaced forwarder's format");
    }
    if cli.check {
        println!(
            "{}: valid ({} rules)",
            path.display(),
            loaded.config.rules.len()
        );
        return ExitCode::SUCCESS;
    }
    let source = (!cli.no_reload).then(|| ConfigSource {
        path: path.clone(),
        started_text: text,
        settings,
        // A level given on the command line or in the environment wins over the file's.
        set_log_level: (!level_overridden).then_some(set_log_level),
    });
    forward(loaded.config, source)
}

/// Starts logging as the command line, else the config, says; returns the setter that changes
/// the level while running. None (after saying why): the level is not a log filter, which is
/// an invalid config.
fn start_logging(cli: &Cli, log: &LogConfig, path: &Path) -> Option<LogLevelSetter> {
    let json = match cli.log_format.as_deref() {
        Some(f) => f == "json",
        None => log.format == LogFormat::Json,
    };
    let level = cli.log_level.clone().unwrap_or_else(|| log.level.clone());
    match init_logging(&level, json) {
        Ok(setter) => Some(setter),
        Err(e) => {
            let field = if cli.log_level.is_some() {
                "FERRY_LOG"
            } else {
                "log.level"
            };
            eprintln!(
                "ferry-forwarder: invalid config {}: {field}: {level:?} is not a log filter: {e}",
                path.display()
            );
            None
        }
    }
}

/// Runs the forwarder until a signal (or a permanent error) stops it: exit 0, or 1 on failure.
fn forward(config: ValidConfig, source: Option<ConfigSource>) -> ExitCode {
    // One thread: the pipeline and the MQTT driver hand each message to each other, and on a
    // multi-thread runtime each hand-off can wake another thread, which costs more CPU per
    // message than the work itself (docs/performance.md has the figures). The
    // heavy lifting (compression, the network to Kafka) is on librdkafka's own threads anyway.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(ferry_forwarder::run(config, source, shutdown_signal()));
    // The Kafka probe's blocking metadata call may still run; it must not delay the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "forwarder failed");
            eprintln!("ferry-forwarder: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Installs the subscriber; returns a setter that changes the filter while running.
fn init_logging(level: &str, json: bool) -> Result<LogLevelSetter, String> {
    let filter = EnvFilter::try_new(level).map_err(|e| e.to_string())?;
    let (filter, handle) = reload::Layer::new(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        // One flat object per line (`message` and the event's fields at the top level), as log
        // pipelines index them; the code logs its context as fields, not spans.
        let fmt = fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false);
        registry.with(fmt).init();
    } else {
        registry.with(fmt).init();
    }
    Ok(Arc::new(move |level: &str| {
        let filter = EnvFilter::try_new(level).map_err(|e| e.to_string())?;
        handle.reload(filter).map_err(|e| e.to_string())
    }))
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => info!("SIGTERM received"),
                _ = int.recv() => info!("SIGINT received"),
            }
        }
        _ => {
            error!("cannot install signal handlers; stopping only when killed");
            std::future::pending::<()>().await;
        }
    }
}
