//! Build, for a whole connection: from what the dereference step read (its rules, the Secrets
//! it references) to every group's children and every rule's fate, without touching the API.
//! The reconciler then applies all of it, prunes, and writes the status once.

use std::collections::{BTreeMap, BTreeSet};

use ferry_api::config::MAX_RULES;
use ferry_api::crd::{BrokerConnection, ForwardingRule, GroupReplicas, MAX_STALL_BUDGET_SECONDS};
use ferry_api::{Problem, ProblemKind};
use k8s_openapi::ByteString;
use kube::ResourceExt;

use crate::children::{self, CONFIG_FILE, Children};
use crate::handover::{self, observe::Observed};
use crate::image::ForwarderImage;
use crate::render::{Group, RenderError, Rendered, render, workload_name};
use crate::sessions::client_id;
use crate::status::{RuleOutcome, Workload};
use crate::validate::{self, MissingSecret, Secrets};

/// What reconciling a connection should make of it.
#[derive(Debug)]
pub struct ConnectionPlan<'a> {
    /// One entry per group that has rules, in name order: the children to apply.
    pub groups: Vec<GroupPlan>,
    /// The referenced Secrets and keys that do not resolve. When any is missing, nothing is
    /// applied (what runs keeps the credentials it has) and `groups` is empty.
    pub missing_secrets: Vec<MissingSecret>,
    /// The credentials and certificates copied from the referenced Secrets, when they resolve.
    pub secret_data: Option<BTreeMap<String, ByteString>>,
    /// Every rule of the connection, in the order they were listed, with its fate.
    pub rules: Vec<(&'a ForwardingRule, RulePlan)>,
    /// Rules on their way to another group, by name.
    pub moves: BTreeMap<String, handover::Move>,
}

/// One group's forwarder workload.
#[derive(Debug)]
pub struct GroupPlan {
    pub name: String,
    pub children: Children,
    /// What the hand-over decided for its workload (replicas, `drain`, `retiring`, what it
    /// waits for, and whether the group is retiring).
    pub scale: handover::Step,
}

/// A rule's fate before anything is applied.
#[derive(Debug, Clone, PartialEq)]
pub enum RulePlan {
    /// Not rendered, for this reason.
    Refused(RuleOutcome),
    /// Rendered into this group's config (paused rules too: they stay listed, unsubscribed);
    /// `moving` while workloads of other groups still list it.
    Served {
        group: String,
        moving: Option<handover::Move>,
    },
}

impl RulePlan {
    /// The outcome once the groups' StatefulSets are applied (`workloads` by group name), or
    /// refused because another owner holds their names (`taken`: group → why).
    pub fn outcome(
        &self,
        rule: &ForwardingRule,
        workloads: &BTreeMap<String, Workload>,
        taken: &BTreeMap<String, String>,
    ) -> RuleOutcome {
        match self {
            RulePlan::Refused(outcome) => outcome.clone(),
            RulePlan::Served { group, .. } => match (workloads.get(group), taken.get(group)) {
                (Some(workload), _) => RuleOutcome::Rendered {
                    workload: workload.clone(),
                    paused: rule.spec.paused,
                },
                (None, Some(why)) => RuleOutcome::NameTaken(format!("group {group:?}: {why}")),
                // Only if the caller skipped a group of the plan.
                (None, None) => {
                    RuleOutcome::GroupNotApplied(format!("group {group:?} was not applied"))
                }
            },
        }
    }
}

/// What the hand-over needs of the spec: each group that has rules (its workload; zero
/// replicas when every rule of it is paused, which keeps its sessions), and the group of each
/// rule that should run.
pub fn handover_spec(connection: &BrokerConnection, rules: &[&ForwardingRule]) -> handover::Spec {
    let mut spec = handover::Spec::default();
    let name = connection.name_any();
    for r in rules {
        let group = r.spec.group.as_str();
        let running = !r.spec.paused;
        let replicas = match connection.spec.forwarder.replicas_of(group) {
            GroupReplicas::Fixed(n) => handover::Replicas::Fixed(n),
            GroupReplicas::Autoscaled => handover::Replicas::Autoscaled,
        };
        let entry = spec
            .groups
            .entry(group.to_owned())
            .or_insert_with(|| handover::GroupSpec {
                workload: workload_name(&name, group),
                replicas: handover::Replicas::Fixed(0),
            });
        if running {
            entry.replicas = replicas;
            spec.targets.insert(r.name_any(), group.to_owned());
        }
    }
    spec
}

/// The plan for `connection` and its `rules` (those whose `connectionRef` names it), with the
/// data of the Secrets it references, the forwarder image it runs, and what runs (`observed`,
/// for the hand-over: see [`crate::handover`]).
pub fn connection<'a>(
    connection: &'a BrokerConnection,
    rules: &[&'a ForwardingRule],
    secrets: &Secrets,
    image: &ForwarderImage,
    observed: &Observed,
) -> Result<ConnectionPlan<'a>, RenderError> {
    let secret_data = match validate::resolve_secrets(connection, secrets) {
        Ok(data) => data,
        Err(missing) => return Ok(unresolved(connection, rules, missing)),
    };
    let decision = handover::decide(&handover_spec(connection, rules), &observed.workloads);
    let by_name: BTreeMap<String, &ForwardingRule> =
        rules.iter().map(|r| (r.name_any(), *r)).collect();
    let mut fates: BTreeMap<String, RulePlan> = BTreeMap::new();
    let mut groups = Vec::new();
    for (workload, step) in &decision.workloads {
        if step.retirement == Some(handover::Retirement::Done) {
            continue;
        }
        let group = step.group.as_str();
        // Its own rules (paused ones too, for their status), and those it keeps serving.
        let members: Vec<&ForwardingRule> = rules
            .iter()
            .copied()
            .filter(|r| r.spec.group == group || step.rules.contains(&r.name_any()))
            .collect();
        let (rendered, refused) = render_group(connection, group, &members)?;
        let applied = observed.configs.get(workload);
        let rendered = with_handover(rendered, step, applied, &by_name)?;
        let mut children =
            children::build(connection, group, &rendered, secret_data.clone(), image);
        let replicas = if rendered.config.rules.is_empty() {
            // Every rule paused or refused: no pod can run (a forwarder refuses a config
            // without rules); the sessions keep their messages until a rule is back.
            Some(0)
        } else {
            step.replicas
        };
        if let Some(replicas) = replicas {
            children::set_replicas(&mut children, replicas);
        }
        groups.push(GroupPlan {
            name: group.to_owned(),
            children,
            scale: step.clone(),
        });
        for r in members.iter().filter(|r| r.spec.group == group) {
            let fate = match refused.get(&r.name_any()) {
                Some(outcome) => RulePlan::Refused(outcome.clone()),
                None => RulePlan::Served {
                    group: group.to_owned(),
                    moving: decision.moves.get(&r.name_any()).cloned(),
                },
            };
            fates.insert(r.name_any(), fate);
        }
    }
    // A rule whose group has no workload of the decision's (none can: every spec group has
    // one) would otherwise vanish from the status.
    Ok(ConnectionPlan {
        groups,
        missing_secrets: Vec::new(),
        secret_data: Some(secret_data),
        rules: rules
            .iter()
            .filter_map(|r| Some((*r, fates.remove(&r.name_any())?)))
            .collect(),
        moves: decision.moves,
    })
}

/// Every rule refused, nothing applied: the referenced Secrets do not resolve.
fn unresolved<'a>(
    connection: &BrokerConnection,
    rules: &[&'a ForwardingRule],
    missing: Vec<MissingSecret>,
) -> ConnectionPlan<'a> {
    let text: Vec<String> = missing.iter().map(ToString::to_string).collect();
    let message = format!(
        "BrokerConnection {:?} cannot be rendered: {}",
        connection.name_any(),
        text.join("; ")
    );
    ConnectionPlan {
        groups: Vec::new(),
        missing_secrets: missing,
        secret_data: None,
        rules: rules
            .iter()
            .map(|r| {
                let outcome = RuleOutcome::SecretMissing(message.clone());
                (*r, RulePlan::Refused(outcome))
            })
            .collect(),
        moves: BTreeMap::new(),
    }
}

/// One group's config from its `members`, and the members it refuses (conflicts first, then
/// what the forwarder would refuse, then what does not fit), by name.
fn render_group(
    connection: &BrokerConnection,
    group: &str,
    members: &[&ForwardingRule],
) -> Result<(Rendered, BTreeMap<String, RuleOutcome>), RenderError> {
    let mut refused = refused_in_group(connection, group, members)?;
    let accepted: Vec<&ForwardingRule> = members
        .iter()
        .copied()
        .filter(|r| !refused.contains_key(&r.name_any()))
        .collect();
    let (fitting, full) = fit_group(connection, group, accepted)?;
    refused.extend(full);
    let rendered = render(&Group {
        connection,
        name: group,
        rules: fitting,
    })?;
    Ok((rendered, refused))
}

/// `rendered` with what the hand-over decided for its workload (`step`): the pods listed in
/// `drain`, the rules listed in `retiring`, the subscription's form. A retiring rule that no
/// object describes any more (deleted, or paused) keeps the form it has in the config as
/// applied (`applied`), so its pods still forward what their sessions hold for it.
fn with_handover(
    mut rendered: Rendered,
    step: &handover::Step,
    applied: Option<&ferry_api::ForwarderConfig>,
    rules: &BTreeMap<String, &ForwardingRule>,
) -> Result<Rendered, RenderError> {
    let gone = |name: &String| rules.get(name).is_none_or(|r| r.spec.paused);
    for name in step.retiring.iter().filter(|n| gone(n)) {
        let kept = applied.and_then(|c| c.rules.iter().find(|r| &r.name == name));
        if let Some(rule) = kept {
            rendered.config.rules.push(rule.clone());
        }
    }
    rendered.config.rules.sort_by(|a, b| a.name.cmp(&b.name));
    let listed: BTreeSet<&str> = rendered
        .config
        .rules
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    let drain = step
        .drain
        .iter()
        .map(|o| {
            client_id(
                &rendered.session_prefix,
                &format!("{}-{o}", rendered.workload),
            )
        })
        .collect();
    let retiring = step
        .retiring
        .iter()
        .filter(|r| listed.contains(r.as_str()))
        .cloned()
        .collect();
    let rendered = rendered.handing_over(drain, retiring, step.shared)?;
    rendered.revised(applied)
}

/// The rules of one group that are not rendered, by name: conflicts first (the older rule
/// keeps the topic), then what the forwarder would refuse of a rule alone.
fn refused_in_group(
    connection: &BrokerConnection,
    group: &str,
    members: &[&ForwardingRule],
) -> Result<BTreeMap<String, RuleOutcome>, RenderError> {
    let mut refused: BTreeMap<String, RuleOutcome> = validate::conflicts(members)
        .into_iter()
        .map(|(rule, reason)| (rule, RuleOutcome::Conflict(reason)))
        .collect();
    for r in members {
        if refused.contains_key(&r.name_any()) {
            continue;
        }
        if let Some(outcome) = forwarder_refuses(connection, group, r)? {
            refused.insert(r.name_any(), outcome);
        }
    }
    Ok(refused)
}

/// Kubernetes refuses a ConfigMap whose keys and values together take more than 1 MiB.
pub const CONFIG_MAP_MAX_BYTES: usize = 1024 * 1024;

/// What a group's forwarder and its ConfigMap can hold of its `rules`, and the others refused
/// (`GroupFull`, by name). Rules are admitted oldest first (creation, then name), so a new rule
/// never pushes out a running one: the first that would take the group past
/// [`MAX_RULES`] rules or its ConfigMap past [`CONFIG_MAP_MAX_BYTES`], and every newer one,
/// are refused. Paused rules are not in the config: they always fit.
fn fit_group<'a>(
    connection: &BrokerConnection,
    group: &str,
    rules: Vec<&'a ForwardingRule>,
) -> Result<(Vec<&'a ForwardingRule>, BTreeMap<String, RuleOutcome>), RenderError> {
    fit_group_within(connection, group, rules, MAX_RULES)
}

/// [`fit_group`] with a forwarder that serves at most `max_rules` rules: tests use a small
/// one, since the ConfigMap's 1 MiB holds fewer than [`MAX_RULES`] even of the smallest rules.
fn fit_group_within<'a>(
    connection: &BrokerConnection,
    group: &str,
    rules: Vec<&'a ForwardingRule>,
    max_rules: usize,
) -> Result<(Vec<&'a ForwardingRule>, BTreeMap<String, RuleOutcome>), RenderError> {
    let (mut fitting, mut running): (Vec<_>, Vec<_>) =
        rules.into_iter().partition(|r| r.spec.paused);
    running.sort_by_key(|r| (r.creation_timestamp(), r.name_any()));
    let mut refused = BTreeMap::new();
    if running.len() > max_rules {
        for r in running.drain(max_rules..) {
            refused.insert(
                r.name_any(),
                RuleOutcome::GroupFull(format!(
                    "group {group:?} already has {max_rules} older rules, the most one forwarder serves; move this rule to another group (spec.group)"
                )),
            );
        }
    }
    let bytes = |n: usize| -> Result<usize, RenderError> {
        let rendered = render(&Group {
            connection,
            name: group,
            rules: running[..n].to_vec(),
        })?;
        Ok(CONFIG_FILE.len() + rendered.config_yaml.len())
    };
    if bytes(running.len())? > CONFIG_MAP_MAX_BYTES {
        // The config grows with every rule: the longest prefix that fits, by bisection.
        let (mut fits, mut over) = (0, running.len());
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            if bytes(mid)? <= CONFIG_MAP_MAX_BYTES {
                fits = mid;
            } else {
                over = mid;
            }
        }
        let used = bytes(fits)?;
        for r in running.drain(fits..) {
            refused.insert(
                r.name_any(),
                RuleOutcome::GroupFull(format!(
                    "group {group:?}'s config would not fit its ConfigMap: its {fits} older rules take {used} of the {CONFIG_MAP_MAX_BYTES} bytes Kubernetes allows, and rules are admitted oldest first; move this rule to another group (spec.group) or make it smaller"
                )),
            );
        }
    }
    fitting.extend(running);
    Ok((fitting, refused))
}

/// What the forwarder would say about the connection's own settings (what CEL cannot judge,
/// such as a value librdkafka or Rust's address parser refuses), each named by its spec field.
/// What already runs keeps running: nothing is rendered from a refused spec.
pub fn connection_refused(connection: &BrokerConnection) -> Result<Option<String>, RenderError> {
    let alone = render(&Group {
        connection,
        name: "default",
        rules: Vec::new(),
    })?;
    let mut config = alone.config;
    // Rendered only into groups whose rules encode: judged here for all of them.
    config.schema_registry = connection
        .spec
        .schema_registry
        .as_ref()
        .map(crate::render::schema_registry);
    let mut problems = config.validate();
    problems.retain(|p| {
        [
            "mqtt.",
            "kafka.",
            "schema_registry.",
            "dead_letter",
            "stall_budget_secs",
        ]
        .iter()
        .any(|at| p.path.starts_with(at))
    });
    if problems.is_empty() {
        // What librdkafka refuses, as the forwarder asks it at start: the same library, so
        // a pod never exits on a setting this let through.
        problems.extend(ferry_kafka_settings::config_problem(&config.kafka));
    }
    let mut problems: Vec<String> = problems
        .iter()
        .map(|p| {
            let message = in_spec_terms(&p.message, &connection.name_any());
            format!("{}: {message}", spec_field(&p.path))
        })
        .collect();
    problems.extend(stall_budget_problem(connection.spec.stall_budget_seconds));
    Ok((!problems.is_empty()).then(|| {
        format!(
            "the forwarder would refuse this connection: {}",
            problems.join("; ")
        )
    }))
}

/// The BrokerConnection field a forwarder config path comes from.
fn spec_field(path: &str) -> String {
    const FIELDS: &[(&str, &str)] = &[
        ("mqtt.session_expiry_secs", "spec.mqtt.sessionExpirySeconds"),
        ("mqtt.max_inflight", "spec.mqtt.maxInflight"),
        ("mqtt.max_inflight_bytes", "spec.mqtt.maxInflightBytes"),
        ("mqtt.max_message_bytes", "spec.mqtt.maxMessageBytes"),
        ("kafka.bootstrap_servers", "spec.kafka.bootstrapServers"),
        ("stall_budget_secs", "spec.stallBudgetSeconds"),
        ("dead_letter", "spec.deadLetter"),
        ("dead_letter.topic", "spec.deadLetter.topic"),
        ("schema_registry.url", "spec.schemaRegistry.url"),
        ("schema_registry.tls", "spec.schemaRegistry.tls"),
        (
            "schema_registry.basic_auth",
            "spec.schemaRegistry.credentialsSecretRef",
        ),
        (
            "schema_registry.basic_auth.username",
            "spec.schemaRegistry.credentialsSecretRef",
        ),
        (
            "schema_registry.basic_auth.password",
            "spec.schemaRegistry.credentialsSecretRef",
        ),
        (
            "kafka.allow_weaker_delivery",
            "spec.kafka.allowWeakerDelivery",
        ),
        (
            "mqtt.allow_weaker_delivery",
            "spec.mqtt.allowWeakerDelivery",
        ),
    ];
    FIELDS
        .iter()
        .find(|(from, _)| path == *from)
        .map(|(_, to)| (*to).to_owned())
        .unwrap_or_else(|| format!("spec.{path}"))
}

/// A forwarder problem's message with the config's field names as the spec names them.
/// `connection`: the BrokerConnection's name (a rule's limit is judged against its
/// connection's).
fn in_spec_terms(message: &str, connection: &str) -> String {
    message
        .replace(
            "the connection's mqtt.max_message_bytes",
            &format!("BrokerConnection {connection:?}'s spec.mqtt.maxMessageBytes"),
        )
        .replace("mqtt.max_message_bytes", "spec.mqtt.maxMessageBytes")
        .replace("mqtt.max_inflight_bytes", "spec.mqtt.maxInflightBytes")
        .replace(
            "kafka.allow_weaker_delivery",
            "spec.kafka.allowWeakerDelivery",
        )
        .replace(
            "mqtt.allow_weaker_delivery",
            "spec.mqtt.allowWeakerDelivery",
        )
        .replace(
            "the top-level dead_letter",
            &format!("BrokerConnection {connection:?}'s spec.deadLetter"),
        )
        .replace("on_unwritable: drop", "spec.onUnwritable: Drop")
        .replace("when kafka.value is set", "when spec.kafka.value is set")
}

/// A `stallBudgetSeconds` out of the CRD's bounds (only past CEL), which the operator does not
/// render: the forwarder would hold records for as long as a wrapped-around number says.
fn stall_budget_problem(seconds: i32) -> Option<String> {
    (!(0..=MAX_STALL_BUDGET_SECONDS).contains(&seconds)).then(|| {
        format!(
            "spec.stallBudgetSeconds: {seconds} is outside 0 (as long as it takes) to {MAX_STALL_BUDGET_SECONDS} (a week)"
        )
    })
}

/// The ForwardingRule field of a forwarder problem at one of its rule's paths, where the spec
/// names it otherwise (`rules[0].mqtt.max_message_bytes` → `spec.mqtt.maxMessageBytes`).
fn rule_field(path: &str) -> Option<&'static str> {
    let (_, field) = path.split_once("].")?;
    match field {
        "mqtt.max_message_bytes" => Some("spec.mqtt.maxMessageBytes"),
        "dead_letter" => Some("spec.deadLetter"),
        "dead_letter.topic" => Some("spec.deadLetter.topic"),
        "on_unwritable" => Some("spec.onUnwritable"),
        "stall_budget_secs" => Some("spec.stallBudgetSeconds"),
        _ => None,
    }
}

/// What the forwarder would say about this rule alone (a problem CEL cannot see, such as a
/// template level deeper than the rule's filters, or an expression that does not compile), so
/// one bad rule cannot take its group down. `InvalidExpression` when any problem is an
/// expression's, `Invalid` otherwise.
fn forwarder_refuses(
    connection: &BrokerConnection,
    group: &str,
    rule: &ForwardingRule,
) -> Result<Option<RuleOutcome>, RenderError> {
    if rule.spec.paused {
        return Ok(None);
    }
    // Rendered without an encoding, it would forward unencoded values: refused instead.
    if let Some(Err(why)) = rule.spec.kafka.value_subject() {
        return Ok(Some(RuleOutcome::Invalid(format!(
            "spec.kafka.value: {why}"
        ))));
    }
    if let Some(problem) = rule
        .spec
        .stall_budget_seconds
        .and_then(stall_budget_problem)
    {
        return Ok(Some(RuleOutcome::Invalid(problem)));
    }
    let alone = render(&Group {
        connection,
        name: group,
        rules: vec![rule],
    })?;
    let mut any_expression = false;
    let problems: Vec<String> = alone
        .config
        .validate()
        .iter()
        // The connection's own settings (`dead_letter`, ...) are judged on the connection.
        .filter(|p| p.path.starts_with("rules"))
        .map(|p| {
            let message = in_spec_terms(&p.message, &connection.name_any());
            match expression_field(p) {
                Some(field) => {
                    any_expression = true;
                    format!("{field} {message}")
                }
                None => format!(
                    "the forwarder refuses it: {}: {message}",
                    rule_field(&p.path).unwrap_or(&p.path)
                ),
            }
        })
        .collect();
    if problems.is_empty() {
        return Ok(None);
    }
    let message = problems.join("; ");
    Ok(Some(if any_expression {
        RuleOutcome::InvalidExpression(message)
    } else {
        RuleOutcome::Invalid(message)
    }))
}

/// The ForwardingRule field of a forwarder problem that is an expression not compiling
/// (`rules[0].payload.transform` → `spec.payloadTransform`); `None` for any other problem,
/// such as a header name with a control character.
fn expression_field(p: &Problem) -> Option<String> {
    if p.kind != ProblemKind::Expression {
        return None;
    }
    // The rendered config has this one rule: `rules[0].<field>`.
    let (_, field) = p.path.split_once("].")?;
    let spec = match field {
        "filter" => "spec.filter",
        "kafka.topic_expression" => "spec.kafka.topicExpression",
        "kafka.key.expression" => "spec.kafka.key.expression",
        "payload.transform" => "spec.payloadTransform",
        _ => {
            let name = field.strip_prefix("kafka.headers.expressions.")?;
            return Some(format!("spec.kafka.headers.expressions.{name}"));
        }
    };
    Some(spec.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::keys;
    use crate::validate::ReadSecret;
    use ferry_api::crd;

    fn connection(host: &str, servers: &str, config: &str) -> BrokerConnection {
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: BrokerConnection\nmetadata: {{ name: c, namespace: n }}\n\
             spec:\n  mqtt: {{ host: {host}, credentialsSecretRef: {{ name: creds }} }}\n  kafka: {{ bootstrapServers: {servers}, config: {config} }}\n"
        ))
        .expect("connection")
    }

    fn rule(name: &str, group: &str, filter: &str, topic: &str, created: &str) -> ForwardingRule {
        serde_saphyr::from_str(&format!(
            "apiVersion: ferry.dev/v1alpha1\nkind: ForwardingRule\n\
             metadata: {{ name: {name}, namespace: n, creationTimestamp: \"{created}\" }}\n\
             spec:\n  connectionRef: {{ name: c }}\n  group: {group}\n  mqtt: {{ topics: [\"{filter}\"] }}\n  kafka: {{ topic: \"{topic}\" }}\n"
        ))
        .expect("rule")
    }

    fn secrets() -> Secrets {
        let data = |v: &str| ByteString(v.as_bytes().to_vec());
        BTreeMap::from([(
            "creds".to_owned(),
            ReadSecret::Marked(BTreeMap::from([
                ("username".to_owned(), data("ferry")),
                ("password".to_owned(), data("pw")),
            ])),
        )])
    }

    fn fate<'a>(plan: &'a ConnectionPlan<'_>, name: &str) -> &'a RulePlan {
        &plan
            .rules
            .iter()
            .find(|(r, _)| r.name_any() == name)
            .expect("every rule has a fate")
            .1
    }

    #[test]
    fn every_group_gets_its_children_and_every_rule_its_fate() {
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let rules = [
            rule(
                "temps",
                "default",
                "plant/+/temp",
                "temps",
                "2026-01-01T00:00:00Z",
            ),
            // Same topic from an overlapping filter, created later: refused, the older keeps it.
            rule(
                "late",
                "default",
                "plant/#",
                "temps",
                "2026-01-02T00:00:00Z",
            ),
            // A template level deeper than the filter: the forwarder would refuse it.
            rule(
                "deep",
                "default",
                "plant/+",
                "t.{5}",
                "2026-01-01T00:00:00Z",
            ),
            rule("bulk", "bulk", "bulk/#", "bulk", "2026-01-01T00:00:00Z"),
        ];
        let refs: Vec<&ForwardingRule> = rules.iter().collect();
        let plan = connection_plan(&conn, &refs);
        let names: Vec<&str> = plan.groups.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["bulk", "default"]);
        assert!(plan.missing_secrets.is_empty());
        let secret = plan.secret_data.as_ref().expect("resolved");
        assert_eq!(
            secret.get(keys::MQTT_PASSWORD),
            Some(&ByteString(b"pw".to_vec()))
        );
        let config = |group: &str| {
            let g = plan.groups.iter().find(|g| g.name == group).expect("group");
            g.children
                .config_map
                .data
                .as_ref()
                .and_then(|d| d.values().next().cloned())
                .unwrap_or_default()
        };
        assert!(config("default").contains("name: temps"));
        assert!(
            !config("default").contains("name: late") && !config("default").contains("name: deep")
        );
        assert!(config("bulk").contains("name: bulk"));
        assert_eq!(
            fate(&plan, "temps"),
            &RulePlan::Served {
                group: "default".into(),
                moving: None,
            }
        );
        assert!(
            matches!(fate(&plan, "late"), RulePlan::Refused(RuleOutcome::Conflict(m)) if m.contains("temps"))
        );
        assert!(
            matches!(fate(&plan, "deep"), RulePlan::Refused(RuleOutcome::Invalid(m)) if m.contains("kafka.topic"))
        );
        assert_eq!(plan.rules.len(), rules.len(), "in the order listed");
        assert_eq!(plan.rules[0].0.name_any(), "temps");
    }

    fn connection_plan<'a>(
        conn: &'a BrokerConnection,
        rules: &[&'a ForwardingRule],
    ) -> ConnectionPlan<'a> {
        super::connection(
            conn,
            rules,
            &secrets(),
            &ForwarderImage::default(),
            &Observed::default(),
        )
        .expect("plan")
    }

    /// The config a group's ConfigMap holds, loaded as its pods load it (as written, their own
    /// client id): the forwarder accepts every group the plan renders.
    fn served_config(plan: &ConnectionPlan<'_>, group: &str) -> ferry_api::ValidConfig {
        let g = plan.groups.iter().find(|g| g.name == group).expect("group");
        let text = g
            .children
            .config_map
            .data
            .as_ref()
            .and_then(|d| d.get(CONFIG_FILE))
            .expect("config");
        let options = ferry_api::LoadOptions {
            variables: None,
            mqtt_client_id: Some("ferry.n.c-0".into()),
        };
        ferry_api::load_with(text, &options, |_| Ok(b"x".to_vec()))
            .unwrap_or_else(|e| panic!("the forwarder refuses group {group}: {e}"))
            .config
    }

    fn config_map_bytes(plan: &ConnectionPlan<'_>, group: &str) -> usize {
        let g = plan.groups.iter().find(|g| g.name == group).expect("group");
        g.children
            .config_map
            .data
            .iter()
            .flatten()
            .map(|(k, v)| k.len() + v.len())
            .sum()
    }

    /// What runs, for the hand-over: `workloads` of the connection `conn` by group, each
    /// listing rules (`retiring` of them) with one pod reporting `report`.
    fn observed(
        conn: &BrokerConnection,
        workloads: &[(&str, &[&str], &[&str], handover::Report)],
    ) -> Observed {
        let mut out = Observed::default();
        for (group, rules, retiring, report) in workloads {
            let set = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect();
            let pod = handover::PodSeen {
                exists: true,
                terminating: false,
                session: true,
                report: Some(report.clone()),
            };
            let seen = handover::Seen {
                group: (*group).to_owned(),
                replicas: 1,
                applied: Some(handover::Applied {
                    rules: set(rules),
                    retiring: set(retiring),
                    ..handover::Applied::default()
                }),
                pods: BTreeMap::from([(0, pod)]),
            };
            out.workloads
                .insert(workload_name(&conn.name_any(), group), seen);
        }
        out
    }

    fn report(subscribed: &[&str], handed_over: &[&str]) -> handover::Report {
        handover::Report {
            subscribed: subscribed.iter().map(|s| (*s).to_owned()).collect(),
            handed_over: handed_over.iter().map(|s| (*s).to_owned()).collect(),
            plain: true,
            ..handover::Report::default()
        }
    }

    fn served(group: &str, moving: Option<(&str, handover::MovePhase)>) -> RulePlan {
        RulePlan::Served {
            group: group.into(),
            moving: moving.map(|(from, phase)| handover::Move {
                to: group.into(),
                from: BTreeSet::from([from.to_owned()]),
                phase,
            }),
        }
    }

    /// A rule moved from group `east` to `west`: both groups' configs hold it until `west`
    /// runs it, then `east` lists it in `retiring` until its pods handed it over; its status
    /// names its group throughout, with the move and how far it is.
    #[test]
    fn a_moving_rule_stays_in_its_old_group_until_the_new_one_runs_it() {
        use handover::MovePhase::{HandingOver, Subscribing};
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let moved = rule("moved", "west", "m/#", "m", "2026-01-01T00:00:00Z");
        let stays = rule("stays", "east", "s/#", "s", "2026-01-01T00:00:00Z");
        let anchor = rule("anchor", "west", "a/#", "a", "2026-01-01T00:00:00Z");
        let rules = [&moved, &stays, &anchor];
        let plan_with = |observed: &Observed| {
            super::connection(
                &conn,
                &rules,
                &secrets(),
                &ForwarderImage::default(),
                observed,
            )
            .expect("plan")
        };
        let names = |plan: &ConnectionPlan<'_>, group: &str| -> Vec<String> {
            served_config(plan, group)
                .rules
                .iter()
                .map(|r| r.name.clone())
                .collect()
        };
        let east_runs = report(&["moved", "stays"], &[]);
        let plan = plan_with(&observed(
            &conn,
            &[
                ("east", &["moved", "stays"], &[], east_runs.clone()),
                ("west", &["anchor"], &[], report(&["anchor"], &[])),
            ],
        ));
        assert_eq!(names(&plan, "east"), ["moved", "stays"]);
        assert_eq!(names(&plan, "west"), ["anchor", "moved"]);
        assert_eq!(
            fate(&plan, "moved"),
            &served("west", Some(("east", Subscribing)))
        );
        assert_eq!(fate(&plan, "stays"), &served("east", None));
        assert!(served_config(&plan, "east").retiring.is_empty());
        // Once the new group runs it, the old group's pods hand over what their sessions hold
        // for it: still in their config, listed in `retiring` there only.
        let west_runs = (
            "west",
            &["anchor", "moved"][..],
            &[][..],
            report(&["anchor", "moved"], &[]),
        );
        let plan = plan_with(&observed(
            &conn,
            &[
                ("east", &["moved", "stays"], &[], east_runs),
                west_runs.clone(),
            ],
        ));
        assert_eq!(names(&plan, "east"), ["moved", "stays"]);
        assert_eq!(served_config(&plan, "east").retiring, ["moved"]);
        assert!(served_config(&plan, "west").retiring.is_empty());
        assert_eq!(
            fate(&plan, "moved"),
            &served("west", Some(("east", HandingOver)))
        );
        // Once they have, only in the new group.
        let handed_over = report(&["stays"], &["moved"]);
        let plan = plan_with(&observed(
            &conn,
            &[
                ("east", &["moved", "stays"], &["moved"], handed_over),
                west_runs,
            ],
        ));
        assert_eq!(names(&plan, "east"), ["stays"]);
        assert_eq!(fate(&plan, "moved"), &served("west", None));
    }

    /// A rule moved into a group where another rule already writes its topic from an
    /// overlapping filter is refused there, naming that rule; its old group goes on serving it
    /// (its new group never runs it), so nothing published for it is lost meanwhile. Every
    /// other rule of both groups is served as before.
    #[test]
    fn a_rule_moved_into_a_conflict_is_refused_and_its_old_group_keeps_serving_it() {
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let moved = rule("moved", "west", "m/#", "shared", "2026-01-02T00:00:00Z");
        let stays = rule("stays", "east", "s/#", "s", "2026-01-01T00:00:00Z");
        let owner = rule("owner", "west", "m/+", "shared", "2026-01-01T00:00:00Z");
        let rules = [&moved, &stays, &owner];
        let observed = observed(
            &conn,
            &[
                (
                    "east",
                    &["moved", "stays"],
                    &[],
                    report(&["moved", "stays"], &[]),
                ),
                ("west", &["owner"], &[], report(&["owner"], &[])),
            ],
        );
        let plan = super::connection(
            &conn,
            &rules,
            &secrets(),
            &ForwarderImage::default(),
            &observed,
        )
        .expect("plan");
        assert!(
            matches!(fate(&plan, "moved"), RulePlan::Refused(RuleOutcome::Conflict(m)) if m.contains("owner")),
            "{:?}",
            fate(&plan, "moved")
        );
        let names = |group: &str| -> Vec<String> {
            served_config(&plan, group)
                .rules
                .iter()
                .map(|r| r.name.clone())
                .collect()
        };
        assert_eq!(names("west"), ["owner"]);
        assert_eq!(names("east"), ["moved", "stays"]);
        for (rule, group) in [("stays", "east"), ("owner", "west")] {
            assert_eq!(fate(&plan, rule), &served(group, None));
        }
    }

    #[test]
    fn dollar_braces_in_a_rule_are_rendered_as_written() {
        let mut r = rule(
            "home",
            "default",
            "c/${HOME}/x",
            "t",
            "2026-01-01T00:00:00Z",
        );
        r.spec.kafka.headers.prefix = Some("${TENANT_X}.".into());
        r.spec.kafka.headers.metadata = true;
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let plan = connection_plan(&conn, &[&r]);
        assert_eq!(
            fate(&plan, "home"),
            &RulePlan::Served {
                group: "default".into(),
                moving: None,
            }
        );
        let config = served_config(&plan, "default");
        assert_eq!(config.rules[0].mqtt.topics, ["c/${HOME}/x"]);
        assert_eq!(config.rules[0].kafka.headers.prefix, "${TENANT_X}.");
        assert!(
            !config.mqtt.client_id.contains("${"),
            "the rendered config is no template: {}",
            config.mqtt.client_id
        );
    }

    #[test]
    fn rules_past_the_forwarders_limit_are_refused_newest_first() {
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let limit = 3;
        // One more than the limit, each older than the next; names in the reverse order, so
        // age decides, not the name.
        let rules: Vec<ForwardingRule> = (0..=limit)
            .map(|i| {
                let at =
                    jiff::Timestamp::from_second(1_767_225_600 + i64::try_from(i).expect("small"))
                        .expect("time");
                rule(
                    &format!("r{:05}", limit - i),
                    "default",
                    &format!("t/{i}"),
                    &format!("t{i}"),
                    &at.to_string(),
                )
            })
            .collect();
        let newest = rules.last().expect("rules").name_any();
        let mut refs: Vec<&ForwardingRule> = rules.iter().collect();
        refs.reverse();
        let (fitting, refused) = fit_group_within(&conn, "default", refs, limit).expect("renders");
        let refused: Vec<(&String, &RuleOutcome)> = refused.iter().collect();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, &newest);
        assert!(
            matches!(refused[0].1, RuleOutcome::GroupFull(m) if m.contains("3 older rules") && m.contains("spec.group")),
            "{:?}",
            refused[0].1
        );
        assert_eq!(fitting.len(), limit);
    }

    /// A rule whose expressions are all at the CRD's maximum length (4,096 characters): four
    /// fields and 25 headers, about 119 KB rendered, so 8 fit a 1 MiB ConfigMap and a 9th does not.
    pub(crate) fn maximum_size_rule(name: &str, group: &str, created: &str) -> ForwardingRule {
        let literal = |fill: char, rest: &str| {
            let pad = ferry_api::expr::MAX_LEN - rest.len() - 2;
            format!("'{}'{rest}", fill.to_string().repeat(pad))
        };
        let mut r = rule(name, group, &format!("{name}/#"), name, created);
        r.spec.filter = Some(literal('f', " != topic"));
        r.spec.kafka.topic = None;
        r.spec.kafka.topic_expression = Some(literal('t', " + topic"));
        r.spec.kafka.key.strategy = ferry_api::crd::KeyStrategy::Expression;
        r.spec.kafka.key.expression = Some(literal('k', " + topic"));
        r.spec.payload_transform = Some(literal('p', " + topic"));
        r.spec.kafka.headers.expressions = (0..25)
            .map(|i| (format!("h{i:02}"), literal('h', " + topic")))
            .collect();
        r
    }

    #[test]
    fn rules_past_the_configmaps_bytes_are_refused_and_the_other_groups_are_rendered() {
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let mut rules: Vec<ForwardingRule> = (1..=9)
            .map(|i| {
                maximum_size_rule(
                    &format!("big{i}"),
                    "big",
                    &format!("2026-01-0{i}T00:00:00Z"),
                )
            })
            .collect();
        rules.push(rule("small", "small", "s/#", "s", "2026-02-01T00:00:00Z"));
        let refs: Vec<&ForwardingRule> = rules.iter().rev().collect();
        let plan = connection_plan(&conn, &refs);
        for i in 1..=8 {
            assert_eq!(
                fate(&plan, &format!("big{i}")),
                &RulePlan::Served {
                    group: "big".into(),
                    moving: None,
                }
            );
        }
        assert!(
            matches!(fate(&plan, "big9"), RulePlan::Refused(RuleOutcome::GroupFull(m))
                if m.contains("its 8 older rules take") && m.contains("1048576 bytes")),
            "{:?}",
            fate(&plan, "big9")
        );
        let bytes = config_map_bytes(&plan, "big");
        assert!(
            bytes <= CONFIG_MAP_MAX_BYTES && bytes > CONFIG_MAP_MAX_BYTES * 8 / 9,
            "{bytes}"
        );
        assert_eq!(served_config(&plan, "big").rules.len(), 8);
        assert_eq!(
            fate(&plan, "small"),
            &RulePlan::Served {
                group: "small".into(),
                moving: None,
            }
        );
        assert_eq!(served_config(&plan, "small").rules.len(), 1);
    }

    #[test]
    fn a_missing_secret_renders_nothing_and_names_it_on_every_rule() {
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let rules = [rule(
            "temps",
            "default",
            "a/#",
            "temps",
            "2026-01-01T00:00:00Z",
        )];
        let refs: Vec<&ForwardingRule> = rules.iter().collect();
        let plan = super::connection(
            &conn,
            &refs,
            &BTreeMap::new(),
            &ForwarderImage::default(),
            &Observed::default(),
        )
        .expect("plan");
        assert!(plan.groups.is_empty() && plan.secret_data.is_none());
        assert_eq!(plan.missing_secrets.len(), 1);
        assert!(
            matches!(fate(&plan, "temps"), RulePlan::Refused(RuleOutcome::SecretMissing(m)) if m.contains("creds"))
        );
    }

    #[test]
    fn a_served_rule_takes_its_groups_workload_once_applied() {
        let r = rule("temps", "default", "a/#", "temps", "2026-01-01T00:00:00Z");
        let workload = Workload {
            name: "c-default".into(),
            wanted: 2,
            ready: 1,
        };
        let workloads = BTreeMap::from([("default".to_owned(), workload.clone())]);
        let served = RulePlan::Served {
            group: "default".into(),
            moving: None,
        };
        assert_eq!(
            served.outcome(&r, &workloads, &BTreeMap::new()),
            RuleOutcome::Rendered {
                workload,
                paused: false
            }
        );
        let taken = BTreeMap::from([(
            "default".to_owned(),
            "StatefulSet \"c-default\" exists, controlled by BrokerConnection \"c\" (uid u-2)"
                .to_owned(),
        )]);
        assert!(matches!(
            served.outcome(&r, &BTreeMap::new(), &taken),
            RuleOutcome::NameTaken(m) if m.starts_with("group \"default\": StatefulSet")
        ));
    }

    /// The fate of rule `r` alone in its connection's plan.
    fn alone(r: &ForwardingRule) -> RulePlan {
        let conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let plan = connection_plan(&conn, &[r]);
        fate(&plan, &r.name_any()).clone()
    }

    fn refused_expression(r: &ForwardingRule) -> String {
        match alone(r) {
            RulePlan::Refused(RuleOutcome::InvalidExpression(m)) => m,
            other => panic!("expected InvalidExpression, got {other:?}"),
        }
    }

    fn with_filter(filter: &str) -> ForwardingRule {
        let mut r = rule("hot", "default", "plant/+", "hot", "2026-01-01T00:00:00Z");
        r.spec.filter = Some(filter.into());
        r
    }

    /// Issue 21: an expression over its cost budget is refused on its rule, with the estimate
    /// and the budget, by the same validation the forwarder runs.
    #[test]
    fn an_expression_over_its_cost_budget_is_refused_with_the_estimate() {
        let nested = (0..9).fold("topic != ''".to_owned(), |e, i| {
            format!("[0,1,2,3,4,5,6,7,8,9].all(v{i}, {e})")
        });
        let m = refused_expression(&with_filter(&nested));
        let budget = ferry_api::expr::COST_BUDGET;
        assert!(
            m.starts_with("spec.filter does not compile: one evaluation may cost an estimated")
                && m.contains(&format!("over the budget of {budget}")),
            "{m}"
        );
    }

    #[test]
    fn an_expression_that_does_not_compile_is_refused_naming_the_field_and_position() {
        let m = refused_expression(&with_filter("json.a +"));
        assert!(
            m.starts_with("spec.filter does not compile:") && m.contains("line 1, column 9"),
            "{m}"
        );
        let m = refused_expression(&with_filter("json.a == 1 && jsn.b == 2"));
        assert!(
            m.contains("spec.filter")
                && m.contains("undeclared reference \"jsn\"")
                && m.contains("line 1, column 16"),
            "{m}"
        );
        assert_eq!(
            alone(&with_filter("json.a > 1 && levels[1] == 'north'")),
            RulePlan::Served {
                group: "default".into(),
                moving: None,
            }
        );
    }

    #[test]
    fn each_expression_field_is_named_as_in_the_spec() {
        let base = || rule("r", "default", "plant/+", "t", "2026-01-01T00:00:00Z");
        let mut topic = base();
        topic.spec.kafka.topic = None;
        topic.spec.kafka.topic_expression = Some("'t.' +".into());
        let mut key = base();
        key.spec.kafka.key.strategy = ferry_api::crd::KeyStrategy::Expression;
        key.spec.kafka.key.expression = Some("jsn".into());
        let mut header = base();
        header.spec.kafka.headers.expressions =
            BTreeMap::from([("site".to_owned(), "levels[".to_owned())]);
        let mut transform = base();
        transform.spec.payload_transform = Some("{'a': }".into());
        for (r, field) in [
            (topic, "spec.kafka.topicExpression does not compile"),
            (key, "spec.kafka.key.expression does not compile"),
            (
                header,
                "spec.kafka.headers.expressions.site does not compile",
            ),
            (transform, "spec.payloadTransform does not compile"),
        ] {
            let m = refused_expression(&r);
            assert!(
                m.contains(field) && m.contains("(at line 1, column "),
                "{m}"
            );
        }
    }

    #[test]
    fn a_rule_encoding_through_a_registry_its_connection_lacks_is_refused_alone() {
        let mut conn = connection("mqtt", "[\"k:9092\"]", "{}");
        let plain = rule("plain", "default", "a/+", "a", "2026-01-01T00:00:00Z");
        let mut encoded = rule("encoded", "default", "b/+", "b", "2026-01-01T00:00:00Z");
        encoded.spec.kafka.value = Some(avro());
        encoded.spec.dead_letter = Some(crd::DeadLetter {
            topic: "b.dlq".into(),
        });
        let plan = connection_plan(&conn, &[&plain, &encoded]);
        assert!(matches!(fate(&plan, "plain"), RulePlan::Served { .. }));
        assert!(
            matches!(fate(&plan, "encoded"), RulePlan::Refused(RuleOutcome::Invalid(m)) if m.contains("spec.schemaRegistry")),
            "{:?}",
            fate(&plan, "encoded")
        );
        conn.spec.schema_registry = Some(crd::SchemaRegistryEndpoint {
            url: "http://registry:8081".into(),
            tls: None,
            credentials_secret_ref: None,
        });
        let plan = connection_plan(&conn, &[&plain, &encoded]);
        assert!(matches!(fate(&plan, "encoded"), RulePlan::Served { .. }));
        // Served encoded, with the subject of its topic: never as unencoded values.
        let config = served_config(&plan, "default");
        let value = config.rules.iter().find_map(|r| r.kafka.value.as_ref());
        assert_eq!(value.map(|v| v.subject.as_str()), Some("b-value"));
        // Only a group whose rules encode gets the registry.
        let other = rule("other", "plain", "c/+", "c", "2026-01-01T00:00:00Z");
        let plan = connection_plan(&conn, &[&plain, &encoded, &other]);
        assert!(served_config(&plan, "default").schema_registry.is_some());
        assert!(served_config(&plan, "plain").schema_registry.is_none());
        // What CEL refuses where the CRDs are current, the connection check refuses too.
        let mut clear = conn.clone();
        clear.spec.schema_registry = Some(crd::SchemaRegistryEndpoint {
            url: "http://registry:8081".into(),
            tls: None,
            credentials_secret_ref: Some(crd::CredentialsRef {
                name: "r".into(),
                username: None,
                username_key: "username".into(),
                password_key: "password".into(),
            }),
        });
        let refused = connection_refused(&clear)
            .expect("renders")
            .unwrap_or_default();
        assert!(
            refused.contains(
                "spec.schemaRegistry.credentialsSecretRef: sends the password in clear text"
            ),
            "{refused}"
        );
        // A subject the strategy cannot derive (CEL refuses it where the CRDs are current).
        encoded.spec.kafka.topic = Some("b.{1}".into());
        let plan = connection_plan(&conn, &[&plain, &encoded]);
        assert!(
            matches!(fate(&plan, "encoded"), RulePlan::Refused(RuleOutcome::Invalid(m)) if m.contains("set value.subject")),
        );
        assert!(matches!(fate(&plan, "plain"), RulePlan::Served { .. }));
    }

    fn avro() -> crd::ValueFormat {
        crd::ValueFormat {
            format: crd::ValueFormatKind::Avro,
            subject: None,
            subject_name_strategy: crd::SubjectNameStrategy::TopicName,
            record_name: None,
            version: None,
            message: None,
        }
    }

    /// A value that does not fit its schema fails for good: without a dead-letter topic (the
    /// rule's own or its connection's) or `onUnwritable: Drop`, it would hold every rule of its
    /// group. CEL on the rule cannot see the connection, so the operator refuses such a rule
    /// alone, through the forwarder's own check, in the spec's terms.
    #[test]
    fn an_encoding_rule_needs_a_dead_letter_topic_its_own_or_its_connections() {
        let mut conn = connection("mqtt", "[\"k:9092\"]", "{}");
        conn.spec.schema_registry = Some(crd::SchemaRegistryEndpoint {
            url: "http://registry:8081".into(),
            tls: None,
            credentials_secret_ref: None,
        });
        let plain = rule("plain", "default", "a/+", "a", "2026-01-01T00:00:00Z");
        let mut encoded = rule("encoded", "default", "b/+", "b", "2026-01-01T00:00:00Z");
        encoded.spec.kafka.value = Some(avro());
        let plan = connection_plan(&conn, &[&plain, &encoded]);
        match fate(&plan, "encoded") {
            RulePlan::Refused(RuleOutcome::Invalid(m)) => assert_eq!(
                m,
                "the forwarder refuses it: spec.deadLetter: must be set (or BrokerConnection \"c\"'s spec.deadLetter, or spec.onUnwritable: Drop) when spec.kafka.value is set: a message whose value does not fit the schema would otherwise hold every rule of the forwarder"
            ),
            other => panic!("expected Invalid, got {other:?}"),
        }
        // The group's other rules are rendered.
        assert!(matches!(fate(&plan, "plain"), RulePlan::Served { .. }));
        let names: Vec<String> = served_config(&plan, "default")
            .rules
            .iter()
            .map(|r| r.name.clone())
            .collect();
        assert_eq!(names, ["plain"]);
        // Each way out: its own dead-letter topic, onUnwritable: Drop, its connection's topic.
        let mut own = encoded.clone();
        own.spec.dead_letter = Some(crd::DeadLetter {
            topic: "b.dlq".into(),
        });
        let mut dropping = encoded.clone();
        dropping.spec.on_unwritable = crd::OnUnwritable::Drop;
        for r in [&own, &dropping] {
            let plan = connection_plan(&conn, &[&plain, r]);
            assert!(
                matches!(fate(&plan, "encoded"), RulePlan::Served { .. }),
                "{:?}",
                fate(&plan, "encoded")
            );
        }
        conn.spec.dead_letter = Some(crd::DeadLetter {
            topic: "ferry.dead-letters".into(),
        });
        let plan = connection_plan(&conn, &[&plain, &encoded]);
        assert!(matches!(fate(&plan, "encoded"), RulePlan::Served { .. }));
        let config = served_config(&plan, "default");
        assert_eq!(
            config.dead_letter.as_ref().map(|d| d.topic.as_str()),
            Some("ferry.dead-letters")
        );
        let of = |name: &str| config.rules.iter().find(|r| r.name == name).cloned();
        let served = of("encoded").expect("served");
        assert_eq!(served.dead_letter, None, "the connection's, not a copy");
        assert_eq!(
            config.dead_letter_of(&served).map(|d| d.topic.as_str()),
            Some("ferry.dead-letters")
        );
    }

    /// The connection's dead-letter topic and stall budget are the connection's settings: what
    /// CEL let through is refused on it, by spec field, not on each of its rules; a rule's own
    /// budget out of bounds is refused on that rule alone.
    #[test]
    fn dead_letter_topics_and_stall_budgets_out_of_bounds_are_refused_by_spec_field() {
        let mut conn = connection("mqtt", "[\"k:9092\"]", "{}");
        conn.spec.dead_letter = Some(crd::DeadLetter {
            topic: "dead letters".into(),
        });
        conn.spec.stall_budget_seconds = -1;
        let message = connection_refused(&conn)
            .expect("renders")
            .expect("refused");
        for expected in [
            "spec.deadLetter.topic: \"dead letters\" is not a valid Kafka topic name",
            "spec.stallBudgetSeconds: -1 is outside 0 (as long as it takes) to 604800 (a week)",
        ] {
            assert!(message.contains(expected), "{expected:?} in {message}");
        }
        conn.spec.dead_letter = Some(crd::DeadLetter {
            topic: "ferry.dead-letters".into(),
        });
        for bound in [0, MAX_STALL_BUDGET_SECONDS] {
            conn.spec.stall_budget_seconds = bound;
            assert_eq!(connection_refused(&conn).expect("renders"), None, "{bound}");
        }
        let mut r = rule("r", "default", "a/+", "a", "2026-01-01T00:00:00Z");
        r.spec.stall_budget_seconds = Some(MAX_STALL_BUDGET_SECONDS + 1);
        assert_eq!(
            alone(&r),
            RulePlan::Refused(RuleOutcome::Invalid(
                "spec.stallBudgetSeconds: 604801 is outside 0 (as long as it takes) to 604800 (a week)".into()
            ))
        );
        r.spec.stall_budget_seconds = Some(0);
        assert_eq!(
            alone(&r),
            RulePlan::Served {
                group: "default".into(),
                moving: None,
            }
        );
    }

    /// Issue 34: a rule may take smaller messages than its connection, never larger ones (the
    /// forwarder never reads those): such a rule is refused alone, naming both limits.
    #[test]
    fn a_rule_over_its_connections_message_size_is_refused_alone() {
        let mut conn = connection("mqtt", "[\"k:9092\"]", "{}");
        conn.spec.mqtt.max_message_bytes = 2048;
        let sized = |name: &str, bytes: Option<i32>| {
            let mut r = rule(
                name,
                "default",
                &format!("{name}/#"),
                name,
                "2026-01-01T00:00:00Z",
            );
            r.spec.mqtt.max_message_bytes = bytes;
            r
        };
        let (plain, small, big) = (
            sized("plain", None),
            sized("small", Some(1024)),
            sized("big", Some(4096)),
        );
        let plan = connection_plan(&conn, &[&plain, &small, &big]);
        match fate(&plan, "big") {
            RulePlan::Refused(RuleOutcome::Invalid(m)) => assert_eq!(
                m,
                "the forwarder refuses it: spec.mqtt.maxMessageBytes: 4096 is over BrokerConnection \"c\"'s spec.mqtt.maxMessageBytes (2048): larger messages are never read; raise that instead"
            ),
            other => panic!("expected Invalid, got {other:?}"),
        }
        for name in ["plain", "small"] {
            assert_eq!(
                fate(&plan, name),
                &RulePlan::Served {
                    group: "default".into(),
                    moving: None,
                }
            );
        }
        let config = served_config(&plan, "default");
        assert_eq!(config.mqtt.max_message_bytes, 2048);
        let sizes: Vec<(&str, Option<u32>)> = config
            .rules
            .iter()
            .map(|r| (r.name.as_str(), r.mqtt.max_message_bytes))
            .collect();
        assert_eq!(sizes, [("plain", None), ("small", Some(1024))]);
        // Below the smallest accepted (CEL refuses it where the CRDs are current).
        let tiny = sized("tiny", Some(100));
        assert!(
            matches!(alone(&tiny), RulePlan::Refused(RuleOutcome::Invalid(m))
                if m.starts_with("the forwarder refuses it: spec.mqtt.maxMessageBytes: 100 is below")),
            "{:?}",
            alone(&tiny)
        );
    }

    /// A transform over the cost budget for payloads of any size (about 400 bytes, from issue
    /// 34) is accepted on a rule that declares payloads of at most 2 KiB.
    #[test]
    fn a_rule_declaring_small_payloads_may_have_a_costlier_transform() {
        const TRANSFORM: &str = "{'id': json.id, 'room': levels[3], 'labels': json.tags.map(x, x + '!'), 'big': json.vals.filter(v, v > 10), 'doubled': json.vals.map(v, v > 10, v * 2), 'sum_flags': json.flags.exists(f, f == 'alarm'), 'all_ok': json.vals.all(v, v < 1000), 'names': json.items.map(i, i.name), 'first': json.items.map(i, i.ok, i.id), 'count': size(json.vals)}";
        let mut r = rule(
            "rooms",
            "default",
            "plant/+/+/rooms",
            "rooms",
            "2026-01-01T00:00:00Z",
        );
        r.spec.payload_transform = Some(TRANSFORM.into());
        let m = refused_expression(&r);
        assert!(
            m.starts_with("spec.payloadTransform does not compile: one evaluation may cost")
                && m.contains("declare smaller payloads (the rule's spec.mqtt.maxMessageBytes)"),
            "{m}"
        );
        r.spec.mqtt.max_message_bytes = Some(2048);
        assert_eq!(
            alone(&r),
            RulePlan::Served {
                group: "default".into(),
                moving: None,
            }
        );
    }

    #[test]
    fn a_problem_other_than_an_expressions_stays_invalid() {
        // A header name CEL would refuse: at an expression's path, but not a compile error.
        let mut r = rule("r", "default", "plant/+", "t", "2026-01-01T00:00:00Z");
        r.spec.kafka.headers.expressions =
            BTreeMap::from([("a\u{7}".to_owned(), "topic".to_owned())]);
        assert!(
            matches!(alone(&r), RulePlan::Refused(RuleOutcome::Invalid(m)) if m.contains("header name")),
        );
    }

    #[test]
    fn what_cel_let_through_is_refused_naming_the_spec_fields() {
        // An apiserver still serving older CRDs admits these.
        let bad = connection("\"mqtt://b\"", "[\"k:0\"]", "{ acks: \"1\" }");
        let message = connection_refused(&bad).expect("renders").expect("refused");
        for expected in [
            "spec.mqtt.host: \"mqtt://b\" is not a host name",
            "spec.kafka.bootstrapServers: \"k:0\" has a port outside 1-65535",
            "spec.kafka.config.acks: \"1\" weakens the delivery guarantee",
        ] {
            assert!(message.contains(expected), "{expected:?} in {message}");
        }
        let good = connection("mqtt", "[\"k:9092\"]", "{ acks: all }");
        assert_eq!(connection_refused(&good).expect("renders"), None);
        // Message sizes, as stored before the CRD checked them.
        let mut sizes = good.clone();
        sizes.spec.mqtt.max_message_bytes = 100;
        sizes.spec.mqtt.max_inflight_bytes = 50;
        let message = connection_refused(&sizes)
            .expect("renders")
            .expect("refused");
        for expected in [
            "spec.mqtt.maxMessageBytes: 100 is below the smallest accepted (1024)",
            "spec.mqtt.maxInflightBytes: 50 is smaller than spec.mqtt.maxMessageBytes (100)",
        ] {
            assert!(message.contains(expected), "{expected:?} in {message}");
        }
        sizes.spec.mqtt.max_message_bytes = 8192;
        sizes.spec.mqtt.max_inflight_bytes = 8192;
        assert_eq!(connection_refused(&sizes).expect("renders"), None);
        let small_queue = connection(
            "mqtt",
            "[\"k:9092\"]",
            "{ queue.buffering.max.kbytes: \"512\" }",
        );
        let message = connection_refused(&small_queue)
            .expect("renders")
            .expect("refused");
        assert!(
            message.contains("spec.kafka.config.queue.buffering.max.kbytes: 512 KiB cannot hold the largest message (spec.mqtt.maxMessageBytes, 1048576 bytes)")
                && message.contains("(Ferry sets it from spec.mqtt.maxInflightBytes)"),
            "{message}"
        );
    }

    #[test]
    fn what_librdkafka_refuses_is_refused_on_the_connection_naming_the_property() {
        for (config, field) in [
            (
                "{ max.in.flight.requests.per.connection: \"6\" }",
                "spec.kafka.config.max.in.flight.requests.per.connection: librdkafka refuses to create a producer with it",
            ),
            (
                "{ retries: \"0\" }",
                "spec.kafka.config.retries: librdkafka refuses to create a producer with it",
            ),
            (
                "{ queue.buffering.backpressure.threshold: \"2\" }",
                "spec.kafka.config.queue.buffering.backpressure.threshold: librdkafka refuses to create a producer with it",
            ),
            (
                "{ lingr.ms: \"5\" }",
                "spec.kafka.config.lingr.ms: librdkafka refuses it: No such configuration property",
            ),
            (
                "{ client.rack: \"${TENANT_X}\", linger.ms: \"${LINGER}\" }",
                "spec.kafka.config.linger.ms: librdkafka refuses it",
            ),
        ] {
            let message = connection_refused(&connection("mqtt", "[\"k:9092\"]", config))
                .expect("renders")
                .unwrap_or_else(|| panic!("{config} is refused"));
            assert!(message.contains(field), "{field:?} in {message}");
        }
    }
}
