//! The I/O edge of reconciling a connection: reading the Secrets it references, applying its
//! children with server-side apply (one field manager) and pruning what no group needs.

use std::collections::BTreeMap;

use ferry_api::crd::{BrokerConnection, ForwardingRule, GroupReplicas};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::children::{self, Children, LABEL_CONNECTION, LABEL_GROUP};
use crate::context::{At, Error, Step};
use crate::dataplane::owned_by;
use crate::ownership::{self, Holder, Serving};
use crate::plan::{Move, MovePhase};
use crate::render::workload_name;
use crate::scaledown::{Live, PodReport};
use crate::sessions::{SessionPrefix, client_id, workload_of};
use crate::validate::{ReadSecret, Secrets, referenced_secrets};
use crate::writer::FIELD_MANAGER;

/// Every Secret the connection references that exists: its data only when it carries the
/// mark ([`crate::validate::SECRET_MARK`]); an unmarked Secret's data is never read.
pub(crate) async fn read_secrets(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
) -> Result<Secrets, Error> {
    let mut secrets: Secrets = BTreeMap::new();
    let secret_api = Api::<Secret>::namespaced(client.clone(), ns);
    for s in referenced_secrets(connection) {
        let Some(meta) = secret_api.get_metadata_opt(&s).await.at(Step::Read)? else {
            continue;
        };
        let read = match ReadSecret::new(meta.metadata.labels.as_ref(), None) {
            ReadSecret::Unmarked => ReadSecret::Unmarked,
            // Read again, with the data: the mark is checked on what is used.
            ReadSecret::Marked(_) => match secret_api.get_opt(&s).await.at(Step::Read)? {
                None => continue,
                Some(secret) => ReadSecret::new(secret.metadata.labels.as_ref(), secret.data),
            },
        };
        secrets.insert(s, read);
    }
    Ok(secrets)
}

/// Why a group's children cannot be applied (a name another owner holds, see
/// [`crate::ownership`]), or `None` when each name is free or this connection's.
pub(crate) async fn taken(
    client: &Client,
    ns: &str,
    uid: &str,
    (children, network_policy): (&Children, bool),
) -> Result<Option<String>, Error> {
    let name = children.stateful_set.name_any();
    let policy = if network_policy {
        holder::<NetworkPolicy>(client, ns, &name, uid).await?
    } else {
        Holder::Absent
    };
    let holders = [
        ("NetworkPolicy", policy),
        (
            "ConfigMap",
            holder::<ConfigMap>(client, ns, &name, uid).await?,
        ),
        ("Secret", holder::<Secret>(client, ns, &name, uid).await?),
        ("Service", holder::<Service>(client, ns, &name, uid).await?),
        (
            "PodDisruptionBudget",
            holder::<PodDisruptionBudget>(client, ns, &name, uid).await?,
        ),
        (
            "StatefulSet",
            holder::<StatefulSet>(client, ns, &name, uid).await?,
        ),
    ];
    let named: Vec<(&str, &str, Holder)> = holders
        .into_iter()
        .map(|(kind, h)| (kind, name.as_str(), h))
        .collect();
    Ok(ownership::taken(&named))
}

async fn holder<K>(client: &Client, ns: &str, name: &str, uid: &str) -> Result<Holder, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let existing = Api::<K>::namespaced(client.clone(), ns)
        .get_metadata_opt(name)
        .await
        .at(Step::Read)?;
    Ok(ownership::holder(
        existing.as_ref().map(|o| &o.metadata),
        uid,
    ))
}

pub(crate) async fn apply<K>(client: &Client, ns: &str, object: &K) -> Result<K, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Serialize
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    api.patch(
        &object.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .at(Step::Apply)
}

/// What pruning did.
#[derive(Debug, Default)]
pub(crate) struct Pruned {
    pub(crate) deleted: usize,
    /// StatefulSets of an earlier name kept running until their group's new one is ready
    /// (name → wanted replicas): their pods' sessions are not to be ended yet.
    pub(crate) earlier: BTreeMap<String, i32>,
    /// Workloads no longer served that are kept until their pods drained (name → the pods
    /// waited for).
    pub(crate) retiring: BTreeMap<String, Vec<String>>,
}

/// The label selector of `connection`'s children.
fn selector(connection: &BrokerConnection) -> String {
    format!(
        "{},{LABEL_CONNECTION}={}",
        children::SELECTOR,
        connection.name_any()
    )
}

/// Workloads of groups no longer served (removed, renamed, or an earlier name) that still run
/// pods: once every served group is settled (its pods ready, so subscribed), each is told to
/// drain (its ConfigMap lists all its pods in `drain`), and kept until all its pods report
/// drained. Its pods thus hand over what the broker holds for their sessions before those
/// sessions end. A pod that does not answer is waited for, visibly.
async fn retire(
    client: &Client,
    ns: &str,
    selector: &str,
    uid: &str,
    serving: &BTreeMap<String, Serving>,
    (recorded, prefix): (&[String], &SessionPrefix),
) -> Result<BTreeMap<String, Vec<String>>, Error> {
    let sets = Api::<StatefulSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(selector))
        .await
        .at(Step::Prune)?
        .items;
    // Only the pods a StatefulSet controls (by its uid) are asked for their `/status`.
    let uids: BTreeMap<String, String> = sets
        .iter()
        .filter_map(|s| Some((s.name_any(), s.uid()?)))
        .collect();
    let retired: Vec<(String, i32)> = sets
        .iter()
        .filter(|s| ownership::prunable(s.meta(), uid, serving))
        .map(|s| {
            let replicas = s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            (s.name_any(), replicas)
        })
        .filter(|(_, replicas)| *replicas > 0)
        .collect();
    if retired.is_empty() {
        return Ok(BTreeMap::new());
    }
    let objects = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(selector))
        .await
        .at(Step::Prune)?;
    let holds = |pod: &str| {
        let object = objects.items.iter().find(|p| p.name_any() == pod);
        may_hold_session(prefix, recorded, pod, object)
    };
    let retired: Vec<(String, Vec<String>)> = retired
        .into_iter()
        .map(|(workload, replicas)| {
            let pods = (0..replicas)
                .map(|o| format!("{workload}-{o}"))
                .filter(|p| holds(p))
                .collect();
            (workload, pods)
        })
        .collect();
    if retired.iter().all(|(_, pods)| pods.is_empty()) {
        return Ok(BTreeMap::new());
    }
    let settled = serving
        .values()
        .all(|s| !matches!(s, Serving::Applied { settled: false, .. }))
        && serving_runs_its_rules(client, ns, (&objects.items, &uids), serving).await?;
    let mut out = BTreeMap::new();
    for (workload, pods) in retired.into_iter().filter(|(_, pods)| !pods.is_empty()) {
        if !settled {
            out.insert(workload, pods);
            continue;
        }
        list_in_drain(client, ns, (&workload, prefix), &pods).await?;
        let set_uid = uids.get(&workload);
        let asked =
            |pod: &Pod, w: &str, _| w == workload && set_uid.is_some_and(|u| owned_by(pod, u));
        let reports = pod_reports(&objects.items, asked).await;
        let waiting: Vec<String> = pods
            .into_iter()
            .filter(|p| {
                !workload_of(p)
                    .and_then(|(_, o)| reports.get(&(workload.clone(), o)))
                    .is_some_and(|r| r.drained)
            })
            .collect();
        if !waiting.is_empty() {
            out.insert(workload, waiting);
        }
    }
    Ok(out)
}

/// Whether every running pod of every served workload reports each rule of its workload's
/// config (the kubelet syncs a mounted ConfigMap up to a minute late): only then does it
/// subscribe what a retiring workload stops subscribing. `uids`: the StatefulSets' uids, by
/// name, whose pods alone are asked.
async fn serving_runs_its_rules(
    client: &Client,
    ns: &str,
    (pods, uids): (&[Pod], &BTreeMap<String, String>),
    serving: &BTreeMap<String, Serving>,
) -> Result<bool, Error> {
    let maps = Api::<ConfigMap>::namespaced(client.clone(), ns);
    for served in serving.values() {
        let Serving::Applied { workload, .. } = served else {
            continue;
        };
        let rules: Vec<String> = maps
            .get_opt(workload)
            .await
            .at(Step::Prune)?
            .and_then(|m| m.data?.remove(children::CONFIG_FILE))
            .and_then(|text| serde_saphyr::from_str::<ferry_api::ForwarderConfig>(&text).ok())
            .map(|c| c.rules.into_iter().map(|r| r.name).collect())
            .unwrap_or_default();
        let uid = uids.get(workload).map(String::as_str);
        for status in reports_of(pods, workload, uid).await {
            let Some(status) = status else {
                return Ok(false);
            };
            if !rules
                .iter()
                .all(|r| status.rules.iter().any(|s| &s.name == r))
            {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Lists `pods` in the `drain` of `workload`'s config, as its pods read it.
async fn list_in_drain(
    client: &Client,
    ns: &str,
    (workload, prefix): (&str, &SessionPrefix),
    pods: &[String],
) -> Result<(), Error> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let Some(mut map) = api.get_opt(workload).await.at(Step::Prune)? else {
        return Ok(());
    };
    let Some(text) = map.data.as_ref().and_then(|d| d.get(children::CONFIG_FILE)) else {
        return Ok(());
    };
    // A config this operator rendered; one it cannot read is left as it is (the workload
    // then waits, visibly, rather than losing its sessions' messages).
    let Ok(mut config) = serde_saphyr::from_str::<ferry_api::ForwarderConfig>(text) else {
        return Ok(());
    };
    let ids: Vec<String> = pods.iter().map(|p| client_id(prefix, p)).collect();
    if config.drain == ids {
        return Ok(());
    }
    config.drain = ids;
    let Ok(yaml) = serde_saphyr::to_string(&config) else {
        return Ok(());
    };
    map.data = Some(BTreeMap::from([(children::CONFIG_FILE.to_owned(), yaml)]));
    map.metadata.managed_fields = None;
    map.metadata.resource_version = None;
    apply(client, ns, &map).await.map(drop)
}

/// Deletes the children of `connection` that [`ownership::prunable`] says may go: found by
/// its labels, deleted only when its UID controls them, each delete conditioned on the UID
/// of the object read (a replacement of the same name is left alone). With `retire` (the
/// client ids recorded as having run), a workload whose pods may hold sessions is drained
/// first (see [`retire`]); without (the connection is being deleted), it goes at once.
/// NetworkPolicies only with `network_policies` (the operator renders them and may list them).
pub(crate) async fn prune(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
    (serving, network_policies): (&BTreeMap<String, Serving>, bool),
    retire: Option<&[String]>,
) -> Result<Pruned, Error> {
    let selector = selector(connection);
    let uid = connection.uid().unwrap_or_default();
    let mut out = Pruned::default();
    if let Some(recorded) = retire {
        let sessions = (recorded, &SessionPrefix::of(connection));
        out.retiring = self::retire(client, ns, &selector, &uid, serving, sessions).await?;
    }
    let only = Only {
        uid: &uid,
        serving,
        retiring: &out.retiring,
    };
    let sets = prune_kind::<StatefulSet>(client, ns, &selector, &only).await?;
    out.deleted += sets.deleted;
    out.earlier = sets
        .kept
        .iter()
        .filter(|s| !is_current(*s, serving))
        .map(|s| {
            let wanted = s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            (s.name_any(), wanted)
        })
        .collect();
    out.deleted += prune_kind::<ConfigMap>(client, ns, &selector, &only)
        .await?
        .deleted;
    out.deleted += prune_kind::<Secret>(client, ns, &selector, &only)
        .await?
        .deleted;
    out.deleted += prune_kind::<Service>(client, ns, &selector, &only)
        .await?
        .deleted;
    out.deleted += prune_kind::<PodDisruptionBudget>(client, ns, &selector, &only)
        .await?
        .deleted;
    if network_policies {
        out.deleted += prune_kind::<NetworkPolicy>(client, ns, &selector, &only)
            .await?
            .deleted;
    }
    Ok(out)
}

/// Whether `object` is its group's workload under the name the plan gives it now.
fn is_current<K: Resource>(object: &K, serving: &BTreeMap<String, Serving>) -> bool {
    serving.values().any(|s| {
        matches!(s, Serving::Applied { workload, .. } if object.meta().name.as_deref() == Some(workload.as_str()))
    })
}

struct KindPruned<K> {
    deleted: usize,
    /// This connection's objects left in place.
    kept: Vec<K>,
}

/// What [`prune_kind`] may delete: what [`ownership::prunable`] allows, except the retiring
/// workloads' objects (named as their workload).
struct Only<'a> {
    uid: &'a str,
    serving: &'a BTreeMap<String, Serving>,
    retiring: &'a BTreeMap<String, Vec<String>>,
}

impl Only<'_> {
    fn prunable(&self, meta: &ObjectMeta) -> bool {
        ownership::prunable(meta, self.uid, self.serving)
            && !meta
                .name
                .as_ref()
                .is_some_and(|n| self.retiring.contains_key(n))
    }
}

async fn prune_kind<K>(
    client: &Client,
    ns: &str,
    selector: &str,
    only: &Only<'_>,
) -> Result<KindPruned<K>, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + DeserializeOwned
        + Clone
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    let mut out = KindPruned {
        deleted: 0,
        kept: Vec::new(),
    };
    for object in api
        .list(&ListParams::default().labels(selector))
        .await
        .at(Step::Prune)?
        .items
    {
        if only.prunable(object.meta()) {
            let only_this = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: object.meta().uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&object.name_any(), &only_this).await {
                Ok(_) => out.deleted += 1,
                // Gone meanwhile, or replaced by another object of that name: not ours to
                // delete any more.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => return Err(e).at(Step::Prune),
            }
        } else if ownership::holder(Some(object.meta()), only.uid) == Holder::Ours {
            out.kept.push(object);
        }
    }
    Ok(out)
}

/// The connection's StatefulSets as they run, with the `/status` of the pods a scale-down
/// waits for (see [`crate::scaledown`]): those at or above the wanted replicas, and pod 0 when
/// going to zero. Only StatefulSets running more pods than wanted cost more than the LIST.
pub(crate) async fn live_scale(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
    recorded: &[String],
) -> Result<BTreeMap<String, Live>, Error> {
    let selector = selector(connection);
    // What each StatefulSet should run: its group's fixed replicas, or (an autoscaler's) what
    // it runs, so no scale-down waits there.
    let mut wanted_of: BTreeMap<String, i32> = BTreeMap::new();
    let mut live: BTreeMap<String, Live> = Api::<StatefulSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .at(Step::Read)?
        .items
        .iter()
        .map(|s| {
            let replicas = s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let group = s.labels().get(LABEL_GROUP).map_or("", String::as_str);
            let wanted = match connection.spec.forwarder.replicas_of(group) {
                GroupReplicas::Fixed(n) => n.max(0),
                GroupReplicas::Autoscaled => replicas,
            };
            wanted_of.insert(s.name_any(), wanted);
            let live = Live {
                group: group.to_owned(),
                uid: s.uid().unwrap_or_default(),
                replicas,
                ..Live::default()
            };
            (s.name_any(), live)
        })
        .collect();
    let wanted = |workload: &str| wanted_of.get(workload).copied().unwrap_or(0);
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .at(Step::Read)?;
    let mut by_name: BTreeMap<String, &Pod> = BTreeMap::new();
    for pod in &pods.items {
        let name = pod.name_any();
        if let Some((workload, ordinal)) = workload_of(&name)
            && let Some(l) = live.get_mut(workload)
        {
            l.pods.insert(ordinal);
        }
        by_name.insert(name, pod);
    }
    if live.iter().all(|(w, l)| l.replicas <= wanted(w)) {
        return Ok(live);
    }
    let stays = |workload: &str| wanted(workload).max(1).unsigned_abs();
    let prefix = SessionPrefix::of(connection);
    let asked = |pod: &Pod, workload: &str, ordinal: u32| {
        let wanted = wanted(workload);
        live.get(workload).is_some_and(|l| {
            l.replicas > wanted
                && (ordinal >= stays(workload) || wanted == 0)
                && owned_by(pod, &l.uid)
        })
    };
    let reports = pod_reports(&pods.items, asked).await;
    for ((workload, ordinal), report) in reports {
        if let Some(l) = live.get_mut(&workload) {
            l.reports.insert(ordinal, report);
        }
    }
    // A pod that never ran left no session: nothing to drain, nothing to keep.
    for (workload, l) in live.iter_mut().filter(|(w, l)| l.replicas > wanted(w)) {
        let first = if wanted(workload) == 0 {
            0
        } else {
            stays(workload)
        };
        for ordinal in first..l.replicas.unsigned_abs() {
            let pod = format!("{workload}-{ordinal}");
            if !may_hold_session(&prefix, recorded, &pod, by_name.get(&pod).copied()) {
                l.reports.entry(ordinal).or_insert(PodReport {
                    drained: true,
                    plain: true,
                });
            }
        }
    }
    Ok(live)
}

/// Whether forwarder pod `pod` may have a session at the broker: its client id is recorded,
/// or the pod has started (its phase is past `Pending`).
fn may_hold_session(
    prefix: &SessionPrefix,
    recorded: &[String],
    pod: &str,
    object: Option<&Pod>,
) -> bool {
    object.is_some_and(crate::sessions::started) || recorded.contains(&client_id(prefix, pod))
}

/// The `/status` of the `pods` (the connection's) that `asked` names (by the pod, its
/// workload and ordinal), as far as a scale-down or retirement needs it; pods that do not
/// answer are left out.
async fn pod_reports(
    pods: &[Pod],
    asked: impl Fn(&Pod, &str, u32) -> bool,
) -> BTreeMap<(String, u32), PodReport> {
    let mut out = BTreeMap::new();
    for pod in pods {
        let name = pod.name_any();
        let Some((workload, ordinal)) = workload_of(&name) else {
            continue;
        };
        if !asked(pod, workload, ordinal) {
            continue;
        }
        if let Some(status) = crate::dataplane::pod_status(pod).await {
            let report = PodReport {
                drained: status.drain.is_some_and(|d| d.drained),
                plain: status.mqtt.subscribed && !status.mqtt.shared,
            };
            out.insert((workload.to_owned(), ordinal), report);
        }
    }
    out
}

/// Rules on their way to another group, and whether a pod's `/status` is what they wait for.
#[derive(Debug, Default)]
pub(crate) struct Moves {
    /// By rule name.
    pub pending: BTreeMap<String, Move>,
    /// Some move waits on pods that run (their configs synced, then their reports), which no
    /// watch event announces: look again soon. A move into a group with no replicas waits for
    /// its StatefulSet to scale, which is watched.
    pub poll: bool,
}

/// Rules moved to another group (`spec.group` changed) whose old group's workload still runs,
/// with how far each hand-over is ([`MovePhase::of`]): until the new group's pods all run the
/// rule, and then until the old group's pods report it handed over (they forwarded what their
/// sessions still held for it). The plan keeps such a rule in its old group, so some group is
/// subscribed to its filters throughout the move and nothing the old sessions hold for it is
/// acknowledged unmatched. Pods are read only while a move is under way.
pub(crate) async fn moves_pending(
    client: &Client,
    ns: &str,
    connection: &BrokerConnection,
    rules: &[&ForwardingRule],
    live: &BTreeMap<String, Live>,
) -> Result<Moves, Error> {
    let name = connection.name_any();
    let moved: Vec<(String, &str, &Live, String)> = rules
        .iter()
        .filter(|r| !r.spec.paused)
        .filter_map(|r| {
            let old = r.status.as_ref()?.workload.as_deref()?;
            let old_live = live.get(old)?;
            (old_live.group != r.spec.group).then(|| {
                (
                    r.name_any(),
                    old,
                    old_live,
                    workload_name(&name, &r.spec.group),
                )
            })
        })
        .collect();
    if moved.is_empty() {
        return Ok(Moves::default());
    }
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector(connection)))
        .await
        .at(Step::Read)?;
    let mut moves = Moves::default();
    // Each workload's pods are asked once, however many of its rules move.
    let mut reports: BTreeMap<String, Reports> = BTreeMap::new();
    let uid = |workload: &str| live.get(workload).map(|l| l.uid.as_str());
    for (rule, old, old_live, new) in moved {
        let new_reports = reports_cached(&mut reports, &pods.items, &new, uid(&new)).await;
        let runs = runs_rule(new_reports, &rule);
        // Asked only once the new group runs it (before, the old group still serves it).
        let handed_over = runs
            && handed_over(
                reports_cached(&mut reports, &pods.items, old, uid(old)).await,
                old_live.replicas,
                &rule,
            );
        let Some(phase) = MovePhase::of(runs, handed_over) else {
            continue;
        };
        let waits_on = match phase {
            MovePhase::Subscribing => live.get(&new).map_or(0, |l| l.replicas),
            MovePhase::HandingOver => old_live.replicas,
        };
        moves.poll |= waits_on > 0;
        let from = old_live.group.clone();
        moves.pending.insert(rule, Move { from, phase });
    }
    Ok(moves)
}

/// The `/status` of each pod of a workload that is not terminating (see [`reports_of`]).
type Reports = Vec<Option<ferry_api::status::ForwarderStatus>>;

/// [`reports_of`] `workload` (whose StatefulSet's uid is `uid`), asked once per `cache`.
async fn reports_cached<'c>(
    cache: &'c mut BTreeMap<String, Reports>,
    pods: &[Pod],
    workload: &str,
    uid: Option<&str>,
) -> &'c Reports {
    if !cache.contains_key(workload) {
        let reports = reports_of(pods, workload, uid).await;
        cache.insert(workload.to_owned(), reports);
    }
    cache.entry(workload.to_owned()).or_default()
}

/// Whether every pod of a workload of `replicas` (its `reports`) reports `rule` handed over
/// (listed in its config's `retiring`, its session holding nothing more for it) or gone. A pod
/// that does not answer is waited for, and so is a workload of `replicas` > 0 without pods
/// (they come back); one scaled to zero runs nothing that could hand over.
fn handed_over(reports: &Reports, replicas: i32, rule: &str) -> bool {
    if reports.is_empty() {
        return replicas <= 0;
    }
    reports.iter().all(|status| {
        status.as_ref().is_some_and(|s| {
            s.rules
                .iter()
                .find(|r| r.name == rule)
                .is_none_or(|r| r.retiring.is_some_and(|h| h.drained))
        })
    })
}

/// Whether a workload has a pod and each of its pods (its `reports`) is connected to the
/// broker, subscribed, and runs `rule` with none of its subscriptions refused.
fn runs_rule(reports: &Reports, rule: &str) -> bool {
    !reports.is_empty()
        && reports.iter().all(|status| {
            status.as_ref().is_some_and(|s| {
                s.mqtt.connected
                    && s.mqtt.subscribed
                    && s.rules
                        .iter()
                        .any(|r| r.name == rule && r.subscription_refused.is_none())
            })
        })
}

/// The `/status` of each pod of `workload` in `pods` that its StatefulSet (of uid `uid`; none:
/// not running) controls and that is not terminating; `None` for one that does not answer.
async fn reports_of(pods: &[Pod], workload: &str, uid: Option<&str>) -> Reports {
    let mut out = Vec::new();
    for pod in pods {
        if workload_of(&pod.name_any()).is_none_or(|(w, _)| w != workload)
            || pod.metadata.deletion_timestamp.is_some()
            || uid.is_none_or(|uid| !owned_by(pod, uid))
        {
            continue;
        }
        out.push(crate::dataplane::pod_status(pod).await);
    }
    out
}
