//! Connections never collide, and the operator never takes over, nor deletes, an object another
//! owner holds: against a real kube-apiserver + controller-manager (garbage collector), the
//! operator as a process.

use std::time::Duration;

use common::{Operator, Scene, WAIT};
use ferry_e2e::manifests::{Connection, Rule};
use serde_json::json;

mod common;

const NS: &str = "ferry";
/// The garbage collector may wait for its discovery resync (30 s) to learn a CRD that was
/// installed moments before.
const GC_WAIT: Duration = Duration::from_secs(120);

fn connection(name: &str) -> String {
    Connection::svc(name, NS).namespace(NS).yaml()
}

/// Rule `name` of `connection` in `group`: `<topic>/#` to Kafka topic `topic`.
fn rule(name: &str, connection: &str, group: &str, topic: &str) -> Rule {
    Rule::new(name, connection)
        .namespace(NS)
        .group(group)
        .topics(&[&format!("{topic}/#")])
        .kafka_topic(topic)
}

/// What these tests ask of the objects besides [`Scene`]'s.
trait OwnershipScene {
    fn uid(&self, kind: &str, name: &str) -> String;
    fn controller(&self, kind: &str, name: &str) -> (String, String);
    fn accepted(&self, rules: &[&str]) -> bool;
}

impl OwnershipScene for Scene<'_> {
    fn uid(&self, kind: &str, name: &str) -> String {
        let uid = self.get(kind, name, "{.metadata.uid}");
        assert!(!uid.is_empty(), "{kind} {name} exists");
        uid
    }

    /// The controller owner's name and UID of an object.
    fn controller(&self, kind: &str, name: &str) -> (String, String) {
        let get = |field: &str| {
            self.get(
                kind,
                name,
                &format!("{{.metadata.ownerReferences[?(@.controller==true)].{field}}}"),
            )
        };
        (get("name"), get("uid"))
    }

    fn accepted(&self, rules: &[&str]) -> bool {
        rules
            .iter()
            .all(|r| self.cond("fr", r, "Accepted").0 == "True")
    }
}

const KINDS: [&str; 5] = [
    "configmap",
    "secret",
    "service",
    "poddisruptionbudget",
    "statefulset",
];

#[test]
fn connections_never_collide_and_never_take_over_or_delete_what_they_do_not_own() {
    let cp = common::control_plane_with_crds(NS);
    let op = Operator::start(&cp, "operator", &[]);
    let s = Scene::new(&cp, &op, NS);
    let uids = names_that_read_alike_get_their_own_children(&s);
    let stale = a_name_another_owner_holds_refuses_that_group_only(&s);
    deleting_a_connection_leaves_the_others_children(&s, &uids, &stale);
}

/// The pair: `plant` + `east-bulk` and `plant-east` + `bulk` read `plant-east-bulk` once
/// joined by `-`. Both get their own children, controlled by their own connection, and every
/// rule is accepted. Returns the UIDs of `plant-east`'s children.
fn names_that_read_alike_get_their_own_children(s: &Scene) -> Vec<(&'static str, String)> {
    s.apply(&connection("plant"));
    s.apply(&connection("plant-east"));
    s.apply(&rule("plant-east-bulk", "plant", "east-bulk", "a").yaml());
    s.apply(&rule("plant-default", "plant", "default", "b").yaml());
    s.apply(&rule("east-bulk", "plant-east", "bulk", "c").yaml());
    s.op.wait_for("every rule of both connections accepted", WAIT, || {
        s.accepted(&["plant-east-bulk", "plant-default", "east-bulk"])
    });
    assert_eq!(
        s.get("fr", "plant-east-bulk", "{.status.workload}"),
        "plant-east-bulk--5"
    );
    assert_eq!(
        s.get("fr", "east-bulk", "{.status.workload}"),
        "plant-east-bulk"
    );
    assert_eq!(
        s.get("fr", "plant-default", "{.status.workload}"),
        "plant-default"
    );
    let plant = s.uid("bc", "plant");
    let plant_east = s.uid("bc", "plant-east");
    for kind in KINDS {
        assert_eq!(
            s.controller(kind, "plant-east-bulk--5"),
            ("plant".to_owned(), plant.clone()),
            "{kind}"
        );
        assert_eq!(
            s.controller(kind, "plant-east-bulk"),
            ("plant-east".to_owned(), plant_east.clone()),
            "{kind}"
        );
    }
    let config = |name| s.get("configmap", name, "{.data.config\\.yaml}");
    assert!(config("plant-east-bulk--5").contains("a/#"));
    assert!(
        config("plant-east-bulk").contains("c/#") && !config("plant-east-bulk").contains("a/#")
    );
    assert_eq!(s.cond("bc", "plant", "Ready").1, "ForwardersNotReady");
    KINDS
        .iter()
        .map(|kind| (*kind, s.uid(kind, "plant-east-bulk")))
        .collect()
}

/// Objects of `plant`'s names, not its own: a ConfigMap nobody owns at the name of a new group
/// (`plant-taken`), and one controlled by `plant-east` though labelled as a `plant` child of a
/// group `plant` does not serve (`plant-stale`). The group is refused on its rule (`NameTaken`,
/// naming the object) with an Event on the connection; the objects are left as they were;
/// `plant`'s other groups keep being reconciled; once the first object is removed, the group is
/// applied. Returns the UID of `plant-stale`.
fn a_name_another_owner_holds_refuses_that_group_only(s: &Scene) -> String {
    let plant_east = s.uid("bc", "plant-east");
    s.apply(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {{ name: plant-taken, namespace: {NS} }}\ndata: {{ mine: \"yes\" }}\n"
    ));
    s.apply(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: plant-stale\n  namespace: {NS}\n  labels:\n    \
         app.kubernetes.io/name: ferry-forwarder\n    ferry.dev/connection: plant\n    ferry.dev/group: stale\n  \
         ownerReferences:\n  - {{ apiVersion: ferry.dev/v1alpha1, kind: BrokerConnection, name: plant-east, uid: {plant_east}, controller: true }}\n\
         data: {{ mine: \"yes\" }}\n"
    ));
    let foreign = [
        s.uid("configmap", "plant-taken"),
        s.uid("configmap", "plant-stale"),
    ];
    s.apply(&rule("plant-taken", "plant", "taken", "d").yaml());
    s.op.wait_for("the rule of the taken name refused", WAIT, || {
        s.cond("fr", "plant-taken", "Accepted").1 == "NameTaken"
    });
    let (status, _, message) = s.cond("fr", "plant-taken", "Accepted");
    assert_eq!(status, "False");
    assert!(
        message.contains("ConfigMap \"plant-taken\" exists")
            && message.contains("not created by the operator for this connection"),
        "says which object and why: {message}"
    );
    assert_eq!(s.cond("fr", "plant-taken", "Ready").1, "NotAccepted");
    s.op.wait_for("a NameTaken Event on the connection", WAIT, || {
        s.events("plant").contains("Warning NameTaken")
    });
    for kind in KINDS.iter().filter(|k| **k != "configmap") {
        assert!(
            !s.exists(kind, "plant-taken"),
            "no {kind} for a refused group"
        );
    }
    // The connection's other groups keep working: a new rule of group default is rendered.
    s.apply(&rule("plant-more", "plant", "default", "e").yaml());
    s.op.wait_for("a new rule of another group accepted", WAIT, || {
        s.accepted(&["plant-more"])
            && s.get("configmap", "plant-default", "{.data.config\\.yaml}")
                .contains("e/#")
    });
    // Emptying a group of `plant` prunes: its own children go, the other owner's stay.
    s.cp.run_kubectl(["delete", "fr", "plant-more", "plant-default", "-n", NS])
        .expect("delete rules");
    s.op.wait_for("plant's emptied group pruned", WAIT, || {
        !s.exists("statefulset", "plant-default") && !s.exists("configmap", "plant-default")
    });
    for (name, uid) in ["plant-taken", "plant-stale"].iter().zip(&foreign) {
        assert_eq!(&s.uid("configmap", name), uid, "{name} left in place");
        assert_eq!(s.get("configmap", name, "{.data.mine}"), "yes");
        let managers = s.get("configmap", name, "{.metadata.managedFields[*].manager}");
        assert!(
            !managers.contains("ferry-operator"),
            "{name} written by the operator: {managers}"
        );
    }
    assert_eq!(
        s.get("configmap", "plant-taken", "{.metadata.ownerReferences}"),
        ""
    );
    // Its owner removes it: the group is applied at the next look (every 30 s while refused).
    s.cp.run_kubectl(["delete", "configmap", "plant-taken", "-n", NS])
        .expect("delete the foreign ConfigMap");
    s.op.wait_for("the group applied once the name is free", WAIT, || {
        s.accepted(&["plant-taken"]) && s.exists("statefulset", "plant-taken")
    });
    assert_eq!(
        s.controller("configmap", "plant-taken").1,
        s.uid("bc", "plant")
    );
    foreign[1].clone()
}

/// Deleting `plant` removes its children only: `plant-east`'s, with the name `plant` would have
/// had under `<connection>-<group>`, keep their UIDs and its rule stays accepted; the other
/// owners' ConfigMaps stay.
fn deleting_a_connection_leaves_the_others_children(
    s: &Scene,
    uids: &[(&str, String)],
    stale: &str,
) {
    s.cp.run_kubectl(["delete", "bc", "plant", "-n", NS, "--wait=false"])
        .expect("delete connection");
    s.op.wait_for("plant and its children gone", GC_WAIT, || {
        !s.exists("bc", "plant")
            && KINDS
                .iter()
                .all(|k| !s.exists(k, "plant-east-bulk--5") && !s.exists(k, "plant-taken"))
    });
    for (kind, uid) in uids {
        assert_eq!(&s.uid(kind, "plant-east-bulk"), uid, "{kind} of plant-east");
    }
    assert_eq!(s.uid("configmap", "plant-stale"), stale);
    assert!(s.accepted(&["east-bulk"]));
    assert_eq!(s.cond("bc", "plant-east", "SecretsResolved").0, "True");
}

/// An upgrade from the `<connection>-<group>` names: children under the earlier name (made
/// here as the earlier operator made them) keep running until the group's new workload has
/// its pods ready, so the new forwarders subscribe before the old ones leave, then they are
/// pruned. Without a kubelet no pod gets ready; pausing the group's rule (no pods wanted)
/// settles it.
#[test]
fn an_earlier_name_is_pruned_once_the_new_workload_is_settled() {
    let cp = common::control_plane_with_crds(NS);
    let op = Operator::start(&cp, "operator", &[]);
    let s = Scene::new(&cp, &op, NS);
    // The group has a rule from the start: a group without rules is pruned, whatever its name.
    s.apply(&rule("north", "line", "north-bulk", "n").yaml());
    s.apply(&connection("line"));
    let line = s.uid("bc", "line");
    let labels = "app.kubernetes.io/name: ferry-forwarder, ferry.dev/connection: line, \
                  ferry.dev/group: north-bulk";
    let meta = format!(
        "name: line-north-bulk\n  namespace: {NS}\n  labels: {{ {labels} }}\n  ownerReferences:\n  - \
         {{ apiVersion: ferry.dev/v1alpha1, kind: BrokerConnection, name: line, uid: {line}, controller: true, blockOwnerDeletion: true }}"
    );
    s.apply(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  {meta}\ndata: {{ config.yaml: \"{{}}\" }}\n---\n\
         apiVersion: apps/v1\nkind: StatefulSet\nmetadata:\n  {meta}\nspec:\n  replicas: 1\n  serviceName: line-north-bulk\n  \
         selector: {{ matchLabels: {{ {labels} }} }}\n  template:\n    metadata: {{ labels: {{ {labels} }} }}\n    \
         spec: {{ containers: [{{ name: forwarder, image: ferry-forwarder:old }}] }}\n"
    ));
    s.op.wait_for("the rule served under the new name", WAIT, || {
        s.accepted(&["north"]) && s.exists("statefulset", "line-north-bulk--4")
    });
    assert_eq!(
        s.get("fr", "north", "{.status.workload}"),
        "line-north-bulk--4"
    );
    // Reconciled again (a new rule): the earlier workload still runs, its pods not ready.
    s.apply(&rule("north-2", "line", "north-bulk", "n2").yaml());
    s.op.wait_for("the second rule rendered", WAIT, || {
        s.get("configmap", "line-north-bulk--4", "{.data.config\\.yaml}")
            .contains("n2/#")
    });
    assert!(s.exists("statefulset", "line-north-bulk"));
    assert!(s.exists("configmap", "line-north-bulk"));
    for (r, topic) in [("north", "n"), ("north-2", "n2")] {
        s.apply(
            &rule(r, "line", "north-bulk", topic)
                .set("/spec/paused", json!(true))
                .yaml(),
        );
    }
    s.op.wait_for("the earlier name pruned", WAIT, || {
        !s.exists("statefulset", "line-north-bulk") && !s.exists("configmap", "line-north-bulk")
    });
    assert_eq!(
        s.get("statefulset", "line-north-bulk--4", "{.spec.replicas}"),
        "0"
    );
}
