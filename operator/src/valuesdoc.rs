//! The values table of `charts/ferry/README.md`, generated from `charts/ferry/values.yaml` so
//! the two cannot drift apart (a test compares them; `make chart-docs` rewrites the table).
//!
//! The convention is helm-docs': a comment block starting `# -- ` right above a key documents
//! it (following `#` lines continue the text), and `# @default -- text` replaces the default
//! shown. A documented key is one row, whatever its value holds; an undocumented key holding a
//! mapping is a section whose keys are documented one by one; any other undocumented value is
//! an error, so a new value cannot be added without its documentation.

use serde_json::Value;

/// The line before the table in the README.
pub const BEGIN: &str =
    "<!-- values table: generated from values.yaml by `make chart-docs`; do not edit -->";
/// The line after it.
pub const END: &str = "<!-- end of the values table -->";

/// One documented value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documented {
    /// Dotted path, e.g. `image.tag`.
    pub key: String,
    pub description: String,
    /// The `# @default --` text, shown instead of the value itself.
    pub default_text: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("values.yaml does not parse: {0}")]
    Yaml(String),
    #[error("values.yaml: `{0}` has no `# --` comment documenting it")]
    Undocumented(String),
    #[error("values.yaml: `{0}` is documented but is not a value (a key this parser misread?)")]
    NotAValue(String),
    #[error(
        "the README lacks a pair of generated-section markers (`{BEGIN}` … `{END}`, or `{ARGOCD_BEGIN}` … `{ARGOCD_END}`)"
    )]
    NoMarkers,
}

/// A doc comment being read: its lines and its `@default` text.
#[derive(Default)]
struct Pending {
    lines: Vec<String>,
    default_text: Option<String>,
}

/// The documented keys of `values_yaml`, in file order.
pub fn documented(values_yaml: &str) -> Vec<Documented> {
    let mut out = Vec::new();
    // The enclosing keys of the current line: (indent, key).
    let mut sections: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<Pending> = None;
    // Inside a documented key's value: lines indented deeper than this belong to it.
    let mut inside: Option<usize> = None;
    for line in values_yaml.lines() {
        let text = line.trim_start();
        let indent = line.len() - text.len();
        if text.is_empty() {
            // A doc comment must sit right above its key.
            pending = None;
            continue;
        }
        match inside {
            Some(limit) if indent > limit => continue,
            _ => inside = None,
        }
        if let Some(comment) = text.strip_prefix('#') {
            read_comment(comment.strip_prefix(' ').unwrap_or(comment), &mut pending);
            continue;
        }
        // A list item or a continuation line of an undocumented value: the check against the
        // parsed YAML in `table` reports it.
        let Some((key, _)) = text.split_once(':').filter(|_| !text.starts_with('-')) else {
            continue;
        };
        while sections.last().is_some_and(|(i, _)| *i >= indent) {
            sections.pop();
        }
        let path = sections
            .iter()
            .map(|(_, k)| k.as_str())
            .chain([key.trim()])
            .collect::<Vec<_>>()
            .join(".");
        match pending.take() {
            Some(doc) => {
                out.push(Documented {
                    key: path,
                    description: doc.lines.join(" ").trim().to_owned(),
                    default_text: doc.default_text,
                });
                inside = Some(indent);
            }
            None => sections.push((indent, key.trim().to_owned())),
        }
    }
    out
}

/// One comment line (without `# `): starts, continues or ends a doc comment.
fn read_comment(comment: &str, pending: &mut Option<Pending>) {
    if let Some(text) = comment.strip_prefix("@default --") {
        pending.get_or_insert_with(Pending::default).default_text = Some(text.trim().to_owned());
    } else if let Some(text) = comment.strip_prefix("-- ") {
        *pending = Some(Pending {
            lines: vec![text.trim().to_owned()],
            default_text: None,
        });
    } else if let Some(doc) = pending.as_mut() {
        doc.lines.push(comment.trim().to_owned());
    }
}

/// The markdown table of every value of `values_yaml`: key, default, description. Fails on a
/// value without documentation.
pub fn table(values_yaml: &str) -> Result<String, Error> {
    let values: Value =
        serde_saphyr::from_str(values_yaml).map_err(|e| Error::Yaml(e.to_string()))?;
    let docs = documented(values_yaml);
    check_covered(&values, "", &docs)?;
    let mut out = String::from("| value | default | meaning |\n| --- | --- | --- |\n");
    for doc in &docs {
        let value = lookup(&values, &doc.key).ok_or_else(|| Error::NotAValue(doc.key.clone()))?;
        let default = match &doc.default_text {
            Some(text) => text.clone(),
            None => format!("`{}`", flow(value)),
        };
        out.push_str(&format!(
            "| `{}` | {} | {} |\n",
            doc.key,
            default.replace('|', "\\|"),
            doc.description.replace('|', "\\|")
        ));
    }
    Ok(out)
}

/// Every value under `prefix` is documented, itself or through an enclosing key.
fn check_covered(value: &Value, prefix: &str, docs: &[Documented]) -> Result<(), Error> {
    if !prefix.is_empty() && docs.iter().any(|d| d.key == prefix) {
        return Ok(());
    }
    match value {
        Value::Object(map) if !map.is_empty() => map.iter().try_for_each(|(k, v)| {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            check_covered(v, &path, docs)
        }),
        _ => Err(Error::Undocumented(prefix.to_owned())),
    }
}

/// The value at a dotted path.
pub fn lookup<'a>(values: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.').try_fold(values, |v, k| v.get(k))
}

/// A value as YAML flow text: `2`, `""`, `[443, 6443]`, `{grafana_dashboard: "1"}`.
pub fn flow(value: &Value) -> String {
    match value {
        Value::String(s) if plain(s) => s.clone(),
        // JSON's quoting is valid YAML.
        Value::String(s) => Value::String(s.clone()).to_string(),
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(flow).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{k}: {}", flow(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

/// Whether YAML reads `s` unquoted as that same string.
fn plain(s: &str) -> bool {
    // A leading digit is fine unless YAML could read a number (`30s` is a string, `1e3` not).
    let first_ok = s.chars().next().is_some_and(|c| {
        c.is_ascii_alphabetic() || c == '/' || (c.is_ascii_digit() && s.parse::<f64>().is_err())
    }) && !s.starts_with("0x")
        && !s.starts_with("0o");
    let reserved = ["true", "false", "null", "yes", "no", "on", "off", "~"]
        .contains(&s.to_ascii_lowercase().as_str());
    first_ok
        && !reserved
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./@+".contains(c))
}

/// `readme` with the text between the markers replaced by `table`.
pub fn update_readme(readme: &str, table: &str) -> Result<String, Error> {
    replace_between(readme, BEGIN, END, table)
}

/// The chart's README as it is, and as `make chart-docs` would write it: the values table from
/// `values.yaml` (checked against `values.schema.json`) and the Argo CD health checks from
/// `argocd/`.
pub fn chart_readme(chart: &std::path::Path) -> Result<(String, String), String> {
    let read = |name: &str| {
        std::fs::read_to_string(chart.join(name))
            .map_err(|e| format!("cannot read charts/ferry/{name}: {e}"))
    };
    let values_yaml = read("values.yaml")?;
    let table = table(&values_yaml).map_err(|e| e.to_string())?;
    let values: Value =
        serde_saphyr::from_str(&values_yaml).map_err(|e| format!("values.yaml: {e}"))?;
    let schema: Value = serde_json::from_str(&read("values.schema.json")?)
        .map_err(|e| format!("values.schema.json: {e}"))?;
    let drift = schema_drift(&values, &schema, &documented(&values_yaml));
    if !drift.is_empty() {
        return Err(format!(
            "values.yaml and values.schema.json disagree:\n  {}",
            drift.join("\n  ")
        ));
    }
    let mut checks = Vec::new();
    for kind in ["ForwardingRule", "BrokerConnection"] {
        checks.push((kind, read(&format!("argocd/ferry.dev_{kind}.lua"))?));
    }
    let checks: Vec<(&str, &str)> = checks.iter().map(|(k, l)| (*k, l.as_str())).collect();
    let readme = read("README.md")?;
    let updated = update_readme(&readme, &table)
        .and_then(|r| replace_between(&r, ARGOCD_BEGIN, ARGOCD_END, &argocd_cm(&checks)))
        .map_err(|e| e.to_string())?;
    Ok((readme, updated))
}

/// The line before the Argo CD health checks in the README.
pub const ARGOCD_BEGIN: &str =
    "<!-- argocd-cm: generated from charts/ferry/argocd/ by `make chart-docs`; do not edit -->";
/// The line after them.
pub const ARGOCD_END: &str = "<!-- end of argocd-cm -->";

/// `argocd-cm` with the health check of each kind: `(kind, Lua source)`, as the README shows it.
pub fn argocd_cm(checks: &[(&str, &str)]) -> String {
    let mut out = String::from(
        "```yaml\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\n  namespace: argocd\n  labels:\n    app.kubernetes.io/part-of: argocd\ndata:\n",
    );
    for (kind, lua) in checks {
        out.push_str(&format!(
            "  resource.customizations.health.ferry.dev_{kind}: |\n"
        ));
        for line in lua.lines() {
            if line.is_empty() {
                out.push('\n');
            } else {
                out.push_str(&format!("    {line}\n"));
            }
        }
    }
    out.push_str("```\n");
    out
}

/// `readme` with what lies between the lines `begin` and `end` replaced by `content`.
pub fn replace_between(
    readme: &str,
    begin: &str,
    end: &str,
    content: &str,
) -> Result<String, Error> {
    let start = readme.find(begin).ok_or(Error::NoMarkers)? + begin.len();
    let stop = start + readme[start..].find(end).ok_or(Error::NoMarkers)?;
    Ok(format!(
        "{}\n{}{}",
        &readme[..start],
        content.trim_end_matches('\n').to_owned() + "\n",
        &readme[stop..]
    ))
}

/// Where `values.schema.json` and `values.yaml` disagree on which keys exist: a key of a
/// section the schema does not know, or a schema property (other than Helm's `global`) that
/// values.yaml lacks. A documented value is compared as a whole: the schema may describe more
/// of it (e.g. every field of `resources`) than its default sets.
pub fn schema_drift(values: &Value, schema: &Value, documented: &[Documented]) -> Vec<String> {
    let mut drift = Drift {
        root: schema,
        documented,
        problems: Vec::new(),
    };
    drift.section(schema, "", values);
    drift.problems
}

/// The walk of `schema_drift` over the schema and the values side by side.
struct Drift<'a> {
    root: &'a Value,
    documented: &'a [Documented],
    problems: Vec<String>,
}

impl Drift<'_> {
    /// Compares the keys of the section at `prefix` (nothing below a documented value).
    fn section(&mut self, node: &Value, prefix: &str, values: &Value) {
        if self.documented.iter().any(|d| d.key == prefix) {
            return;
        }
        let node = resolve(self.root, node);
        let Some(props) = node.get("properties").and_then(Value::as_object) else {
            return;
        };
        let Some(map) = values.as_object() else {
            self.problems.push(format!(
                "`{prefix}`: the schema lists keys, values.yaml has none"
            ));
            return;
        };
        let path = |key: &str| {
            if prefix.is_empty() {
                key.to_owned()
            } else {
                format!("{prefix}.{key}")
            }
        };
        for (key, sub) in props {
            match map.get(key) {
                Some(v) => self.section(sub, &path(key), v),
                None if path(key) == "global" => {}
                None => self.problems.push(format!(
                    "`{}`: in values.schema.json, not in values.yaml",
                    path(key)
                )),
            }
        }
        for key in map.keys().filter(|k| !props.contains_key(*k)) {
            self.problems.push(format!(
                "`{}`: in values.yaml, not in values.schema.json",
                path(key)
            ));
        }
    }
}

/// Follows a local `$ref` (`#/definitions/name`).
fn resolve<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    match node
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/definitions/"))
    {
        Some(name) => root["definitions"].get(name).unwrap_or(node),
        None => node,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"# Header, not documentation.

# -- Replicas.
replicaCount: 2

image:
  # -- Image tag; empty means
  # the appVersion.
  tag: ""
  # -- Pull policy | case.
  pullPolicy: IfNotPresent

# -- Resources.
# @default -- requests only
resources:
  requests:
    cpu: 50m

# -- Labels.
labels:
  grafana_dashboard: "1"
ports:
  # -- Ports.
  list:
    - 443
    - 6443
"#;

    #[test]
    fn a_row_per_documented_key_with_its_default() {
        let table = table(SAMPLE).expect("table");
        let rows: Vec<&str> = table.lines().skip(2).collect();
        assert_eq!(
            rows,
            [
                "| `replicaCount` | `2` | Replicas. |",
                "| `image.tag` | `\"\"` | Image tag; empty means the appVersion. |",
                "| `image.pullPolicy` | `IfNotPresent` | Pull policy \\| case. |",
                "| `resources` | requests only | Resources. |",
                "| `labels` | `{grafana_dashboard: \"1\"}` | Labels. |",
                "| `ports.list` | `[443, 6443]` | Ports. |",
            ]
        );
    }

    #[test]
    fn an_undocumented_value_is_an_error() {
        let yaml = SAMPLE.replace("  # -- Pull policy | case.\n", "");
        assert_eq!(
            table(&yaml),
            Err(Error::Undocumented("image.pullPolicy".to_owned()))
        );
        // A blank line between the comment and the key: not documentation.
        let yaml = SAMPLE.replace("# -- Replicas.\n", "# -- Replicas.\n\n");
        assert_eq!(
            table(&yaml),
            Err(Error::Undocumented("replicaCount".to_owned()))
        );
    }

    #[test]
    fn the_readme_table_is_replaced_between_the_markers() {
        let readme = format!("# Chart\n\n{BEGIN}\nold table\n{END}\n\nmore\n");
        let new = update_readme(&readme, "| a |\n").expect("markers");
        assert_eq!(new, format!("# Chart\n\n{BEGIN}\n| a |\n{END}\n\nmore\n"));
        assert_eq!(update_readme("no markers", "x"), Err(Error::NoMarkers));
    }

    #[test]
    fn schema_drift_names_keys_on_one_side_only() {
        let values = serde_json::json!({
            "a": 1, "image": { "tag": "" }, "extra": true, "resources": { "limits": {} }
        });
        let schema = serde_json::json!({
            "definitions": { "image": { "properties": { "tag": {}, "digest": {} } } },
            "properties": {
                "global": {}, "a": {}, "image": { "$ref": "#/definitions/image" },
                "resources": { "properties": { "limits": {}, "claims": {} } }
            }
        });
        let documented = [Documented {
            key: "resources".to_owned(),
            description: String::new(),
            default_text: None,
        }];
        assert_eq!(
            schema_drift(&values, &schema, &documented),
            [
                "`image.digest`: in values.schema.json, not in values.yaml",
                "`extra`: in values.yaml, not in values.schema.json",
            ]
        );
    }
}
