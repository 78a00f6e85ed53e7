//! `ferry-forwarder --config config.yaml`: the data plane, in a pod or on its own.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ferry_api::config::{ConfigError, SourceFormat};
use tracing::{error, info, warn};
use tracing_subscriber::EnvFilter;

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
    /// Overrides `http.listen` (e.g. 127.0.0.1:9090).
    #[arg(long, env = "FERRY_HTTP_LISTEN")]
    http_listen: Option<std::net::SocketAddr>,
    /// Log format.
    #[arg(long, env = "FERRY_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

/// Exit codes: 0 stopped cleanly, 1 runtime failure, 2 invalid config.
fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    let path = cli
        .config
        .or_else(|| std::env::var_os("CONFIG_FILE").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("config.yaml"));
    let loaded = std::fs::read_to_string(&path)
        .map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })
        .and_then(|text| ferry_api::load_str(&text, |name| std::env::var(name).ok()));
    let mut loaded = match loaded {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ferry-forwarder: invalid config {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    if let Some(addr) = cli.http_listen {
        loaded.config.http.listen = addr;
    }
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
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(ferry_forwarder::run(loaded.config, shutdown_signal())) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "forwarder failed");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
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
