//! The operator's preflight of a rule's literal Kafka topics, against a real kube-apiserver and
//! a real Kafka: a rule not yet served whose topic is missing is refused alone (`Accepted`
//! False, `TopicMissing`, naming the topic) and not rendered, while its neighbour is; once the
//! topic is created the rule is accepted and rendered within the check interval, untouched.

use std::time::Duration;

use ferry_e2e::Kafka;
use ferry_e2e::manifests::{Connection, Rule};

use common::{Operator, Scene};

mod common;

const NS: &str = "ferry";
/// The operator's `--topic-check-interval-seconds` here.
const INTERVAL_SECS: u64 = 3;

fn rule(name: &str, filter: &str, topic: &str) -> Rule {
    Rule::new(name, "depot")
        .namespace(NS)
        .topics(&[filter])
        .kafka_topic(topic)
}

#[test]
fn a_rule_whose_topic_is_missing_is_refused_alone_until_the_topic_exists() {
    let cp = common::control_plane_with_crds(NS);
    let kafka = Kafka::start().expect("kafka");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(kafka.create_topic("present", 1))
        .expect("topic");
    let interval = INTERVAL_SECS.to_string();
    let op = Operator::start(
        &cp,
        "operator",
        &["--topic-check-interval-seconds", &interval],
    );
    let scene = Scene::new(&cp, &op, NS);
    let connection = Connection::new("depot", "127.0.0.1", &[&kafka.bootstrap()])
        .namespace(NS)
        .replicas(1)
        .yaml();
    scene.apply(
        &[
            connection,
            rule("present", "present/#", "present").yaml(),
            rule("absent", "absent/#", "absent").yaml(),
        ]
        .concat(),
    );
    scene.wait_accepted("present", "True");
    scene.wait_accepted("absent", "False");
    let (_, reason, message) = scene.cond("fr", "absent", "Accepted");
    assert_eq!(reason, "TopicMissing", "{message}");
    assert!(
        message.contains("its Kafka topic \"absent\" (spec.kafka.topic) does not exist"),
        "{message}"
    );
    let config = || scene.get("configmap", "depot-default", "{.data.config\\.yaml}");
    let listed = |config: &str, rule: &str| config.contains(&format!("name: {rule}\n"));
    let rendered = config();
    assert!(listed(&rendered, "present"), "{rendered}");
    assert!(!listed(&rendered, "absent"), "{rendered}");
    op.wait_for("a TopicMissing Event on the rule", common::WAIT, || {
        scene.events("absent").contains("TopicMissing")
    });

    rt.block_on(kafka.create_topic("absent", 1)).expect("topic");
    // Within the check interval, and the time Kafka takes to list a new topic.
    let within = Duration::from_secs(INTERVAL_SECS * 2 + 10);
    op.wait_for("the rule accepted once its topic exists", within, || {
        scene.cond("fr", "absent", "Accepted").0 == "True"
    });
    let rendered = config();
    assert!(listed(&rendered, "absent"), "{rendered}");
    assert!(listed(&rendered, "present"), "{rendered}");
}
