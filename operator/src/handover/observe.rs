//! What runs, read once per reconcile for the hand-over: the connection's StatefulSets, its
//! pods (one list), its ConfigMaps (the configs as applied), and the `/status` of the pods of
//! the workloads whose hand-over depends on them (one read each, from pods their group's
//! StatefulSet owns). A workload at rest costs no `/status` read. A pod is heard only when it
//! runs the config its ConfigMap holds (the digest it reports): one that runs an older
//! version may still read another in between (the kubelet writes the volume, the forwarder
//! reads it later), so what it says could be undone.

use std::collections::{BTreeMap, BTreeSet};

use ferry_api::ForwarderConfig;
use ferry_api::crd::BrokerConnection;
use ferry_api::status::{ForwarderStatus, config_digest};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use super::machine::{Applied, PodSeen, Report, Seen, Spec};
use crate::children::{self, LABEL_CONNECTION, LABEL_GROUP};
use crate::context::{At, Error, Step};
use crate::podstatus::{owned_by, pod_status};
use crate::sessions::{SessionPrefix, client_id, started, workload_of};

/// `/status` reads in flight at once.
const CONCURRENT_READS: usize = 16;

/// What runs for one connection.
#[derive(Debug, Default)]
pub struct Observed {
    /// By workload name.
    pub workloads: BTreeMap<String, Seen>,
    /// The configs as applied, by workload name: where a rule that no object describes any
    /// more (deleted while some workload still lists it) is rendered from.
    pub configs: BTreeMap<String, ForwarderConfig>,
}

/// The connection's objects as they run: everything but the pods' `/status`.
struct Objects {
    sets: Vec<StatefulSet>,
    pods: Vec<Pod>,
    maps: Vec<ConfigMap>,
}

/// Reads what runs for `connection` (`recorded`: the client ids its status records as having
/// run), asking for the `/status` of the pods of the workloads that `spec` makes depend on
/// them (see [`needs_reports`]).
pub async fn observe(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
    recorded: &[String],
    spec: &Spec,
) -> Result<Observed, Error> {
    let objects = list(client, ns, connection).await?;
    let sessions = SessionPrefix::of(connection);
    let mut out = Observed::default();
    // Each config's digest: a pod is heard only when it runs the version the ConfigMap holds.
    let mut digests: BTreeMap<String, String> = BTreeMap::new();
    for map in &objects.maps {
        let Some(text) = map.data.as_ref().and_then(|d| d.get(children::CONFIG_FILE)) else {
            continue;
        };
        if let Ok(config) = serde_saphyr::from_str::<ForwarderConfig>(text) {
            out.configs.insert(map.name_any(), config);
            digests.insert(map.name_any(), config_digest(text));
        }
    }
    for set in &objects.sets {
        let name = set.name_any();
        // A group's StatefulSet under an earlier name (a Ferry upgrade renamed it) runs until
        // the new one is settled, then is pruned (see `ownership::prunable`): not a hand-over.
        let group = set.labels().get(LABEL_GROUP).map(String::as_str);
        if group
            .and_then(|g| spec.groups.get(g))
            .is_some_and(|g| g.workload != name)
        {
            continue;
        }
        let seen = seen(
            &sessions,
            set,
            &objects.pods,
            out.configs.get(&name),
            recorded,
        );
        out.workloads.insert(name, seen);
    }
    let asked: BTreeSet<String> = needs_reports(spec, &out.workloads);
    let uids: BTreeMap<String, String> = objects
        .sets
        .iter()
        .filter(|s| asked.contains(&s.name_any()))
        .filter_map(|s| Some((s.name_any(), s.uid()?)))
        .collect();
    // Owned: a stream of futures that borrow trips the reconcile future's `Send` bound.
    let targets: Vec<(Pod, String, u32)> = objects
        .pods
        .iter()
        .filter_map(|p| {
            let name = p.name_any();
            let (workload, ordinal) = workload_of(&name)?;
            let uid = uids.get(workload)?;
            owned_by(p, uid).then(|| (p.clone(), workload.to_owned(), ordinal))
        })
        .collect();
    let reports: Vec<(String, u32, Option<ForwarderStatus>)> = futures::stream::iter(targets)
        .map(|(pod, workload, ordinal)| async move { (workload, ordinal, pod_status(&pod).await) })
        .buffer_unordered(CONCURRENT_READS)
        .collect()
        .await;
    for (workload, ordinal, status) in reports {
        let current = digests.get(&workload);
        let seen = out.workloads.get_mut(&workload);
        if let (Some(seen), Some(status)) = (seen, status)
            && let Some(pod) = seen.pods.get_mut(&ordinal)
            && status.config.digest.as_ref() == current
        {
            pod.report = Some(report(&status));
        }
    }
    Ok(out)
}

async fn list(client: &Client, ns: &str, connection: &BrokerConnection) -> Result<Objects, Error> {
    let selector = format!(
        "{},{LABEL_CONNECTION}={}",
        children::SELECTOR,
        connection.name_any()
    );
    let params = ListParams::default().labels(&selector);
    let sets = Api::<StatefulSet>::namespaced(client.clone(), ns)
        .list(&params)
        .await
        .at(Step::Read)?
        .items;
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&params)
        .await
        .at(Step::Read)?
        .items;
    let maps = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&params)
        .await
        .at(Step::Read)?
        .items;
    Ok(Objects { sets, pods, maps })
}

/// One workload as it runs, without its pods' reports.
fn seen(
    sessions: &SessionPrefix,
    set: &StatefulSet,
    pods: &[Pod],
    config: Option<&ForwarderConfig>,
    recorded: &[String],
) -> Seen {
    let name = set.name_any();
    let replicas = set.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let mut out = Seen {
        group: set.labels().get(LABEL_GROUP).cloned().unwrap_or_default(),
        replicas,
        applied: config.map(|c| applied(sessions, &name, c)),
        pods: BTreeMap::new(),
    };
    for ordinal in 0..replicas.max(0).unsigned_abs() {
        out.pods.insert(ordinal, PodSeen::default());
    }
    let prefix = format!("{name}-");
    for id in recorded {
        let ordinal = id
            .strip_prefix(&client_id(sessions, &prefix))
            .and_then(|o| o.parse::<u32>().ok());
        if let Some(o) = ordinal {
            out.pods.entry(o).or_default().session = true;
        }
    }
    for pod in pods {
        let pod_name = pod.name_any();
        let Some((workload, ordinal)) = workload_of(&pod_name) else {
            continue;
        };
        if workload != name {
            continue;
        }
        let seen = out.pods.entry(ordinal).or_default();
        seen.exists = true;
        seen.terminating = pod.metadata.deletion_timestamp.is_some();
        seen.session |= started(pod);
    }
    out
}

/// What the hand-over reads of a config as applied.
fn applied(sessions: &SessionPrefix, workload: &str, config: &ForwarderConfig) -> Applied {
    let prefix = client_id(sessions, &format!("{workload}-"));
    Applied {
        rules: config.rules.iter().map(|r| r.name.clone()).collect(),
        retiring: config.retiring.iter().cloned().collect(),
        drain: config
            .drain
            .iter()
            .filter_map(|id| id.strip_prefix(&prefix)?.parse().ok())
            .collect(),
        shared: config.mqtt.subscribe_shared,
    }
}

/// What the hand-over reads of a pod's `/status`.
fn report(status: &ForwarderStatus) -> Report {
    let connected = status.mqtt.connected && status.mqtt.subscribed;
    Report {
        subscribed: status
            .rules
            .iter()
            .filter(|r| r.subscribed)
            .map(|r| r.name.clone())
            .collect(),
        handed_over: status
            .rules
            .iter()
            .filter(|r| r.retiring.is_some_and(|d| d.drained))
            .map(|r| r.name.clone())
            .collect(),
        drained: status.drain.is_some_and(|d| d.drained),
        plain: connected && !status.mqtt.shared,
        shared: connected && status.mqtt.shared,
    }
}

/// The workloads whose pods' reports the decision may read: one not at rest (its replicas
/// or pods differ from what the spec asks, or its config lists `drain` or `retiring`), one
/// the spec no longer has, and those on either side of a rule listed outside its group.
pub fn needs_reports(spec: &Spec, seen: &BTreeMap<String, Seen>) -> BTreeSet<String> {
    let home: BTreeMap<&str, &str> = spec
        .targets
        .iter()
        .filter_map(|(rule, group)| {
            Some((rule.as_str(), spec.groups.get(group)?.workload.as_str()))
        })
        .collect();
    let wanted: BTreeMap<&str, Option<i32>> = spec
        .groups
        .values()
        .map(|g| {
            let n = match g.replicas {
                super::Replicas::Fixed(n) => Some(n.max(0)),
                super::Replicas::Autoscaled => None,
            };
            (g.workload.as_str(), n)
        })
        .collect();
    let mut out = BTreeSet::new();
    for (workload, s) in seen {
        let extra_pods = s
            .pods
            .iter()
            .any(|(o, p)| p.exists && i64::from(*o) >= i64::from(s.replicas));
        // A workload the spec no longer has is never at rest.
        let resting = wanted
            .get(workload.as_str())
            .is_some_and(|n| n.is_none_or(|n| n == s.replicas))
            && !extra_pods;
        let applied = s.applied.as_ref();
        let handing = applied.is_some_and(|a| !a.drain.is_empty() || !a.retiring.is_empty());
        if !resting || handing {
            out.insert(workload.clone());
        }
        for rule in applied.map(|a| &a.rules).into_iter().flatten() {
            match home.get(rule.as_str()) {
                Some(h) if *h == workload => {}
                Some(h) => {
                    out.insert(workload.clone());
                    out.insert((*h).to_owned());
                }
                None => {
                    out.insert(workload.clone());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handover::machine::tests::{seen, spec, workloads};

    #[test]
    fn pods_are_asked_only_where_a_hand_over_depends_on_them() {
        let spec = spec(
            &[("east", 1), ("west", 2), ("idle", 1)],
            &[("moved", "east"), ("kw", "west"), ("ki", "idle")],
        );
        let seen = |group, replicas, rules, retiring| seen(group, replicas, rules, retiring, &[]);
        // A removed group still lists a rule of east: both sides are asked; west scales
        // from 1 to 2; idle is at rest.
        let asked = needs_reports(
            &spec,
            &workloads(vec![
                seen("gone", 1, &["moved"], &[]),
                seen("east", 1, &["moved"], &[]),
                seen("west", 1, &["kw"], &[]),
                seen("idle", 1, &["ki"], &[]),
            ]),
        );
        let names: Vec<&str> = asked.iter().map(String::as_str).collect();
        assert_eq!(names, ["w-east", "w-gone", "w-west"]);
        // A rule retiring where it was: that workload is asked, the others rest.
        let asked = needs_reports(
            &spec,
            &workloads(vec![
                seen("east", 1, &["moved"], &[]),
                seen("west", 2, &["kw", "old"], &["old"]),
                seen("idle", 1, &["ki"], &[]),
            ]),
        );
        let names: Vec<&str> = asked.iter().map(String::as_str).collect();
        assert_eq!(names, ["w-west"]);
    }
}
