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
use tokio::sync::mpsc;
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

pub async fn watch(
    source: ConfigSource,
    started_with: ValidConfig,
    metrics: Arc<Metrics>,
    to_pipeline: mpsc::Sender<Reload>,
) {
    let path = source.path.display().to_string();
    let mut last_text = tokio::fs::read_to_string(&source.path).await.ok();
    let mut running = started_with.clone();
    loop {
        tokio::time::sleep(POLL_INTERVAL).await;
        let text = match tokio::fs::read_to_string(&source.path).await {
            Ok(t) => t,
            // Mid-swap or briefly missing: look again next time; the running config stays.
            Err(_) => continue,
        };
        if last_text.as_deref() == Some(text.as_str()) {
            continue;
        }
        last_text = Some(text.clone());
        let new = match source.load(&text) {
            Ok(c) => c,
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
        let reload = Reload::new(&new, &metrics);
        if to_pipeline.send(reload).await.is_err() {
            return; // Shutting down.
        }
        info!(config = %path, rules = new.rules.len(), "config reloaded");
        metrics.config_applied(restart);
        running = new;
    }
}
