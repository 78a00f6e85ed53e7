//! What the tests read in the logs of the processes they start.

use std::fs;
use std::path::Path;

use anyhow::{Context as _, Result, bail};

pub(crate) fn tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// `lines` of a JSON log, parsed: each must be one flat object (a top-level `message`, every
/// value a scalar), which is what log collectors index. Fails naming the first line that is not.
pub fn flat_json_log<'a>(
    lines: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<serde_json::Value>> {
    lines
        .into_iter()
        .map(|line| {
            let value: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("not JSON: {line}"))?;
            let flat = value.as_object().is_some_and(|o| {
                o.get("message").is_some_and(serde_json::Value::is_string)
                    && o.values().all(|v| !v.is_object() && !v.is_array())
            });
            if !flat {
                bail!("not one flat object with a message: {line}");
            }
            Ok(value)
        })
        .collect()
}
