//! Live reload: the config file is read again every second, and a changed, valid config
//! applies its rules without dropping the MQTT session. Polling the content (not inotify) sees
//! every way a file changes, including Kubernetes swapping the `..data` symlink of a mounted
//! ConfigMap. An invalid new config keeps the old one running and is reported on `/status`,
//! in `ferry_config_reloads_total{result="rejected"}` and in the log.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::config::MqttConfig;
use ferry_api::{ForwarderConfig, ValidConfig};
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

use crate::load::{LoadSettings, load};
use crate::metrics::Metrics;
use crate::pipeline::Reload;

const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Applies a new log filter; returns why it could not.
pub type LogLevelSetter = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Where the running config came from, so it can be read again.
#[derive(Clone)]
pub struct ConfigSource {
    pub path: PathBuf,
    /// The file's text the forwarder started with: changes are looked for from there.
    pub started_text: String,
    /// How every version of the file is read: as at start.
    pub settings: LoadSettings,
    pub set_log_level: Option<LogLevelSetter>,
}

impl ConfigSource {
    fn load(&self, text: &str) -> Result<ValidConfig, String> {
        load(text, &self.settings)
            .map(|loaded| loaded.config)
            .map_err(|e| e.to_string())
    }
}

/// Settings a running forwarder cannot change without reconnecting or restarting.
/// `mqtt.shared_group`, `mqtt.subscribe_shared` and `drain` are not: they only change what is
/// subscribed, and a reload subscribes the filters in their new form before it unsubscribes
/// the old.
pub fn restart_required(running: &ForwarderConfig, new: &ForwarderConfig) -> Vec<String> {
    let mut changed = Vec::new();
    let connection = |c: &ForwarderConfig| MqttConfig {
        shared_group: None,
        subscribe_shared: true,
        ..c.mqtt.clone()
    };
    if connection(running) != connection(new) {
        changed.push("mqtt".to_owned());
    }
    if running.kafka != new.kafka {
        changed.push("kafka".to_owned());
    }
    if running.http != new.http {
        changed.push("http".to_owned());
    }
    if running.shutdown_timeout_secs != new.shutdown_timeout_secs {
        changed.push("shutdown_timeout_secs".to_owned());
    }
    if running.log.format != new.log.format {
        changed.push("log.format".to_owned());
    }
    changed
}

/// Polls the config file and sends each changed, valid version to the pipeline. Once `leave`
/// fires (the forwarder stops and drains first), the running config and every later one are
/// applied with this forwarder listed in `drain`.
pub async fn watch(
    source: ConfigSource,
    started_with: ValidConfig,
    metrics: Arc<Metrics>,
    to_pipeline: mpsc::Sender<Reload>,
    mut leave: oneshot::Receiver<()>,
) {
    let path = source.path.display().to_string();
    metrics.config_started(&source.started_text);
    let mut last_text = Some(source.started_text.clone());
    let mut running = started_with.clone();
    // Whether `leave` may still fire, and whether it has.
    let (mut listening, mut leaving) = (true, false);
    loop {
        tokio::select! {
            () = tokio::time::sleep(POLL_INTERVAL) => {}
            fired = &mut leave, if listening => {
                listening = false;
                if fired.is_err() {
                    continue; // Not draining on shutdown: only the file matters.
                }
                leaving = true;
                running = running.with_self_draining();
                if send_draining(&running, &metrics, &to_pipeline).await.is_err() {
                    return;
                }
                continue;
            }
        }
        let text = match tokio::fs::read_to_string(&source.path).await {
            Ok(t) => t,
            // Mid-swap or briefly missing: look again next time; the running config stays.
            Err(_) => continue,
        };
        if last_text.as_deref() == Some(text.as_str()) {
            continue;
        }
        last_text = Some(text.clone());
        let (new, reload) = match prepare(&source, text.clone(), leaving, &metrics).await {
            Ok(prepared) => prepared,
            Err(e) => {
                error!(config = %path, error = %e, "config file changed but is invalid; keeping the running config");
                metrics.config_rejected(e);
                continue;
            }
        };
        if new.log.level != running.log.level
            && let Some(set) = &source.set_log_level
            && let Err(e) = set(&new.log.level)
        {
            warn!(error = %e, level = %new.log.level, "log.level not applied");
        }
        let restart = restart_required(&started_with, &new);
        if !restart.is_empty() {
            warn!(config = %path, settings = ?restart, "changed settings take effect after a restart; rules apply now");
        }
        if to_pipeline.send(reload).await.is_err() {
            return; // Shutting down.
        }
        info!(config = %path, rules = new.rules.len(), "config reloaded");
        metrics.config_applied(restart, &text);
        running = new;
    }
}

/// Reads and validates a new version of the file and builds its routing table, on a blocking
/// thread: with thousands of rules that takes long enough to delay the acks and the MQTT
/// keep-alive if it ran on the runtime's thread.
async fn prepare(
    source: &ConfigSource,
    text: String,
    leaving: bool,
    metrics: &Arc<Metrics>,
) -> Result<(ValidConfig, Reload), String> {
    let source = source.clone();
    let metrics = Arc::clone(metrics);
    tokio::task::spawn_blocking(move || {
        let mut new = source.load(&text)?;
        if leaving {
            new = new.with_self_draining();
        }
        let reload = Reload::new(&new, &metrics);
        Ok((new, reload))
    })
    .await
    .map_err(|e| format!("building the new rules failed: {e}"))?
}

/// Without a config file to watch: once `leave` fires, applies the config with this forwarder
/// listed in `drain`.
pub async fn drain_when_leaving(
    config: ValidConfig,
    metrics: Arc<Metrics>,
    to_pipeline: mpsc::Sender<Reload>,
    leave: oneshot::Receiver<()>,
) {
    if leave.await.is_ok() {
        let _ = send_draining(&config.with_self_draining(), &metrics, &to_pipeline).await;
    }
}

/// Sends `config` (this forwarder listed in `drain`) to the pipeline, its routing table built
/// on a blocking thread as for any reload. Err when the pipeline is gone.
async fn send_draining(
    config: &ValidConfig,
    metrics: &Arc<Metrics>,
    to_pipeline: &mpsc::Sender<Reload>,
) -> Result<(), ()> {
    let (config, built_for) = (config.clone(), Arc::clone(metrics));
    let reload = tokio::task::spawn_blocking(move || Reload::new(&config, &built_for))
        .await
        .map_err(|e| error!(error = %e, "building the draining rules failed"))?;
    to_pipeline.send(reload).await.map_err(|_| ())?;
    info!("draining: unsubscribed, forwarding what the session still holds");
    Ok(())
}
