//! Whose an object is, decided before the operator writes or deletes it: the operator applies
//! only names that are free or that its connection controls (owner reference by UID, not by
//! name), and prunes only objects its connection controls. Another owner's object with a
//! group's name refuses that group, and nothing else. Pure; the I/O is in [`crate::apply`].

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::children::LABEL_GROUP;

/// Who holds the object at a name a group would write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// No object: the name is free.
    Absent,
    /// Controlled by this connection (its UID): the operator's to update.
    Ours,
    /// Anything else, described for a human (never its data).
    Other(String),
}

/// Who holds `existing` (`None`: no object of that name) for the connection with UID `uid`.
pub fn holder(existing: Option<&ObjectMeta>, uid: &str) -> Holder {
    let Some(meta) = existing else {
        return Holder::Absent;
    };
    let owners = meta.owner_references.as_deref().unwrap_or_default();
    match owners.iter().find(|o| o.controller == Some(true)) {
        Some(o) if o.uid == uid => Holder::Ours,
        Some(o) => Holder::Other(format!(
            "controlled by {} {:?} (uid {})",
            o.kind, o.name, o.uid
        )),
        None if owners.iter().any(|o| o.uid == uid) => {
            Holder::Other("owned by this connection but not as its controller".to_owned())
        }
        None => Holder::Other("not created by the operator for this connection".to_owned()),
    }
}

/// Why a group cannot be applied, from who holds each of its children's names (`(kind, name,
/// holder)`): `None` when every one is free or ours.
pub fn taken(children: &[(&str, &str, Holder)]) -> Option<String> {
    let others: Vec<String> = children
        .iter()
        .filter_map(|(kind, name, h)| match h {
            Holder::Other(why) => Some(format!("{kind} {name:?} exists, {why}")),
            Holder::Absent | Holder::Ours => None,
        })
        .collect();
    (!others.is_empty()).then(|| {
        format!(
            "the group's forwarder objects cannot be created: {}; the operator never takes over \
             another owner's object: rename the group, or remove that object",
            others.join("; ")
        )
    })
}

/// What a connection serves now, by group name, for pruning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serving {
    /// Applied under this workload name; `settled` once all its wanted pods are ready (or it
    /// wants none), when what an earlier name ran may go.
    Applied { workload: String, settled: bool },
    /// Refused (its name is another owner's): what runs under an earlier name keeps running.
    Refused,
}

/// Whether to delete an object found by the connection's label: only one its connection
/// (`uid`) controls, and only when its group is no longer served, or it is an earlier name of
/// a group (a Ferry upgrade that renamed it) whose new workload has all its pods ready, so the
/// new forwarders subscribe before the old ones leave.
pub fn prunable(meta: &ObjectMeta, uid: &str, serving: &BTreeMap<String, Serving>) -> bool {
    if holder(Some(meta), uid) != Holder::Ours {
        return false;
    }
    let group = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_GROUP))
        .map(String::as_str)
        .unwrap_or_default();
    match serving.get(group) {
        None => true,
        Some(Serving::Refused) => false,
        Some(Serving::Applied { workload, settled }) => {
            meta.name.as_deref() != Some(workload.as_str()) && *settled
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    const UID: &str = "3f1c2d9e-0000-4000-8000-000000000001";

    fn meta(name: &str, group: &str, owner: Option<(&str, &str, bool)>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(LABEL_GROUP.to_owned(), group.to_owned())])),
            owner_references: owner.map(|(name, uid, controller)| {
                vec![OwnerReference {
                    api_version: "ferry.dev/v1alpha1".to_owned(),
                    kind: "BrokerConnection".to_owned(),
                    name: name.to_owned(),
                    uid: uid.to_owned(),
                    controller: Some(controller),
                    block_owner_deletion: Some(true),
                }]
            }),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn only_an_object_controlled_by_this_connections_uid_is_ours() {
        assert_eq!(holder(None, UID), Holder::Absent);
        assert_eq!(
            holder(
                Some(&meta(
                    "plant-default",
                    "default",
                    Some(("plant", UID, true))
                )),
                UID
            ),
            Holder::Ours
        );
        // The other connection whose name reads the same, and a deleted then recreated
        // connection of the same name (its old children are the garbage collector's).
        let other = holder(
            Some(&meta(
                "plant-east-bulk",
                "bulk",
                Some(("plant-east", "u-2", true)),
            )),
            UID,
        );
        assert_eq!(
            other,
            Holder::Other("controlled by BrokerConnection \"plant-east\" (uid u-2)".to_owned())
        );
        let same_name = holder(
            Some(&meta(
                "plant-default",
                "default",
                Some(("plant", "u-old", true)),
            )),
            UID,
        );
        assert!(matches!(same_name, Holder::Other(m) if m.contains("u-old")));
        assert!(matches!(
            holder(Some(&meta("plant-default", "default", None)), UID),
            Holder::Other(m) if m.contains("not created by the operator")
        ));
        assert!(matches!(
            holder(Some(&meta("plant-default", "default", Some(("plant", UID, false)))), UID),
            Holder::Other(m) if m.contains("not as its controller")
        ));
    }

    #[test]
    fn a_group_is_refused_when_any_of_its_names_is_anothers_and_the_message_says_which() {
        assert_eq!(
            taken(&[
                ("ConfigMap", "plant-default", Holder::Ours),
                ("StatefulSet", "plant-default", Holder::Absent),
            ]),
            None
        );
        let m = taken(&[
            ("ConfigMap", "plant-east-bulk", Holder::Absent),
            (
                "StatefulSet",
                "plant-east-bulk",
                Holder::Other("controlled by BrokerConnection \"plant-east\" (uid u-2)".into()),
            ),
        ])
        .expect("refused");
        assert!(
            m.contains("StatefulSet \"plant-east-bulk\" exists, controlled by BrokerConnection \"plant-east\"")
                && !m.contains("ConfigMap"),
            "{m}"
        );
    }

    #[test]
    fn pruning_deletes_only_what_this_connection_controls_and_no_longer_serves() {
        let serving = BTreeMap::from([
            (
                "default".to_owned(),
                Serving::Applied {
                    workload: "plant-default".to_owned(),
                    settled: true,
                },
            ),
            (
                "east-bulk".to_owned(),
                Serving::Applied {
                    workload: "plant-east-bulk--5".to_owned(),
                    settled: false,
                },
            ),
            ("taken".to_owned(), Serving::Refused),
        ]);
        let ours = Some(("plant", UID, true));
        let prune = |name, group, owner| prunable(&meta(name, group, owner), UID, &serving);
        assert!(!prune("plant-default", "default", ours), "served");
        assert!(prune("plant-gone", "gone", ours), "its group has no rules");
        assert!(
            !prune("plant-gone", "gone", Some(("plant", "u-old", true))),
            "another object's, whatever its labels say"
        );
        assert!(
            !prune("plant-gone", "gone", None),
            "nobody's: not ours to delete"
        );
        assert!(
            !prune("plant-east-bulk", "east-bulk", ours),
            "an earlier name runs until the new workload is ready"
        );
        assert!(
            !prune("plant-taken", "taken", ours),
            "a refused group keeps what runs"
        );
        let settled = BTreeMap::from([(
            "east-bulk".to_owned(),
            Serving::Applied {
                workload: "plant-east-bulk--5".to_owned(),
                settled: true,
            },
        )]);
        assert!(prunable(
            &meta("plant-east-bulk", "east-bulk", ours),
            UID,
            &settled
        ));
    }
}
