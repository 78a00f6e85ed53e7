//! What people and their tools read off the operator, against a real kube-apiserver: the
//! table `kubectl get` prints, and `/metrics` as Prometheus reads it (every name and label
//! value documented in docs/metrics.md, where alerts are written from).

use std::collections::BTreeSet;
use std::time::Duration;

use common::{Operator, jsonpath};
use ferry_e2e::kube::ControlPlane;
use ferry_e2e::manifests::{Connection, Rule};
use ferry_e2e::metrics::Scrape;

mod common;

const NS: &str = "ferry";
const WAIT: Duration = Duration::from_secs(60);
const METRICS_DOC: &str = include_str!("../../docs/metrics.md");

/// A connection with two Kafka brokers, two groups, and a rule with two MQTT filters: every
/// list a column shows has more than one item.
fn objects() -> String {
    [
        Connection::new(
            "plant",
            "mqtt.example",
            &["k0.example:9092", "k1.example:9092"],
        )
        .namespace(NS)
        .yaml(),
        temps("temps", "plant").yaml(),
        Rule::new("audit", "plant")
            .namespace(NS)
            .group("analytics")
            .topics(&["plant/#"])
            .kafka_topic("audit")
            .yaml(),
    ]
    .concat()
}

/// Rule `name` of `connection` in group `default`: two MQTT filters to Kafka topic `temps`.
fn temps(name: &str, connection: &str) -> Rule {
    Rule::new(name, connection)
        .namespace(NS)
        .group("default")
        .topics(&["plant/+/temp", "plant/+/alarm"])
        .kafka_topic("temps")
}

/// `kubectl get <plural>` as the API server serves it: the Table kubectl prints.
fn table(cp: &ControlPlane, plural: &str) -> serde_json::Value {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let kubeconfig =
            kube::config::Kubeconfig::read_from(cp.kubeconfig_path()).expect("kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("config");
        let client = kube::Client::try_from(config).expect("client");
        let request =
            axum::http::Request::get(format!("/apis/ferry.dev/v1alpha1/namespaces/{NS}/{plural}"))
                .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
                .body(Vec::new())
                .expect("request");
        let text = client.request_text(request).await.expect("table");
        serde_json::from_str(&text).expect("table JSON")
    })
}

/// (column name → cell) per row.
fn rows(table: &serde_json::Value) -> Vec<Vec<(String, serde_json::Value)>> {
    let names: Vec<String> = table["columnDefinitions"]
        .as_array()
        .expect("columns")
        .iter()
        .map(|c| c["name"].as_str().expect("name").to_owned())
        .collect();
    table["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            let cells = r["cells"].as_array().expect("cells");
            names.iter().cloned().zip(cells.iter().cloned()).collect()
        })
        .collect()
}

#[test]
fn kubectl_get_prints_every_column_as_plain_text() {
    let cp = common::control_plane_with_crds(NS);
    let op = Operator::start(&cp, "operator", &[]);
    common::apply(&cp, &objects());
    op.wait_for("the columns' status fields", WAIT, || {
        !jsonpath(&cp, NS, "bc", "plant", "{.status.groupNames}").is_empty()
            && !jsonpath(&cp, NS, "fr", "temps", "{.status.mqttTopics}").is_empty()
            && !jsonpath(&cp, NS, "fr", "audit", "{.status.mqttTopics}").is_empty()
    });
    eprintln!(
        "{}",
        cp.run_kubectl(["get", "bc,fr", "-n", NS]).expect("get")
    );

    let mut seen = BTreeSet::new();
    for plural in ["brokerconnections", "forwardingrules"] {
        for row in rows(&table(&cp, plural)) {
            for (column, cell) in &row {
                let plain = match cell {
                    serde_json::Value::String(s) => !s.starts_with(['[', '{']),
                    serde_json::Value::Array(_) | serde_json::Value::Object(_) => false,
                    _ => true,
                };
                assert!(plain, "{plural} column {column:?} is not plain: {cell}");
                if let Some(s) = cell.as_str() {
                    seen.insert((column.clone(), s.to_owned()));
                }
            }
        }
    }
    for (column, value) in [
        ("Kafka", "k0.example:9092,k1.example:9092"),
        ("Groups", "analytics,default"),
        ("MQTT Topics", "plant/+/temp,plant/+/alarm"),
        ("MQTT Topics", "plant/#"),
        ("MQTT", "mqtt.example"),
        ("Kafka Topic", "temps"),
    ] {
        assert!(
            seen.contains(&(column.to_owned(), value.to_owned())),
            "{column} = {value:?} in {seen:?}"
        );
    }
}

#[test]
fn metrics_serve_exactly_the_documented_names_and_label_values() {
    let cp = common::control_plane_with_crds(NS);
    let op = Operator::start(
        &cp,
        "operator",
        &["--status-interval-seconds", "1", "--log-format", "json"],
    );
    common::apply(&cp, &objects());
    // A rule whose connection does not exist is reconciled on its own (kind forwarding_rule).
    common::apply(&cp, &temps("orphan", "nowhere").yaml());
    // No kubelet here: a pod reported Ready at an address where nothing listens makes the
    // status poller fail (result="error").
    op.wait_for("the StatefulSet's pod", WAIT, || {
        cp.run_kubectl(["get", "pod", "plant-default-0", "-n", NS])
            .is_ok()
    });
    cp.run_kubectl([
        "patch",
        "pod",
        "plant-default-0",
        "-n",
        NS,
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Running","podIP":"127.77.9.9","podIPs":[{"ip":"127.77.9.9"}],"conditions":[{"type":"Ready","status":"True"}]}}"#,
    ])
    .expect("report the pod Ready");
    // Whatever the label values are: the assertions below judge them.
    op.wait_for("a poll and both kinds reconciled", WAIT, || {
        Scrape::get(op.port).is_ok_and(|s| {
            s.label_values("ferry_operator_reconciles_total", "kind")
                .len()
                == 2
                && !s
                    .label_values("ferry_operator_forwarder_status_polls_total", "result")
                    .is_empty()
        })
    });

    let scrape = Scrape::get(op.port).expect("scrape");
    eprintln!("{}", scrape.text);
    assert_eq!(
        scrape.undocumented(METRICS_DOC, &["version", "namespace", "rule", "connection"]),
        Vec::<String>::new(),
        "served but not in docs/metrics.md's metrics tables"
    );
    let kinds = BTreeSet::from(["broker_connection".to_owned(), "forwarding_rule".to_owned()]);
    for metric in [
        "ferry_operator_reconciles_total",
        "ferry_operator_status_writes_total",
    ] {
        assert_eq!(scrape.label_values(metric, "kind"), kinds, "{metric}");
    }
    let polls = scrape.label_values("ferry_operator_forwarder_status_polls_total", "result");
    assert!(polls.contains("error"), "{polls:?}");
    assert_eq!(
        scrape.value(
            "ferry_operator_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0)
    );
    scrape.check_process_metrics().expect("process metrics");

    // One Ready series per object, with the reason its status holds, gone with the object.
    let ready_of = |s: &Scrape, rule: &str| -> Vec<(String, String, Option<f64>)> {
        s.samples
            .iter()
            .filter(|x| x.metric == "ferry_rule_ready")
            .filter(|x| x.labels.get("rule") == Some(rule) && x.labels.get("namespace") == Some(NS))
            .map(|x| {
                let label = |l: &str| x.labels.get(l).unwrap_or_default().to_owned();
                let value = match x.value {
                    ferry_e2e::metrics::Value::Gauge(v) => Some(v),
                    _ => None,
                };
                (label("status"), label("reason"), value)
            })
            .collect()
    };
    let status_of = |rule: &str| {
        let get = |field: &str| {
            let path = format!("{{.status.conditions[?(@.type==\"Ready\")].{field}}}");
            jsonpath(&cp, NS, "fr", rule, &path)
        };
        (get("status"), get("reason"))
    };
    op.wait_for("the orphan rule's Ready series", WAIT, || {
        Scrape::get(op.port).is_ok_and(|s| {
            ready_of(&s, "orphan") == [("False".into(), "NotAccepted".into(), Some(0.0))]
        })
    });
    // The series follows the status as the operator's watch sees it: each rule's one series
    // says what its Ready condition says (compared until both settled).
    let mut last = String::new();
    let agree = |last: &mut String| {
        let Ok(scrape) = Scrape::get(op.port) else {
            return false;
        };
        ["temps", "audit", "orphan"].iter().all(|rule| {
            let (status, reason) = status_of(rule);
            let series = ready_of(&scrape, rule);
            *last = format!("{rule}: status {status}/{reason}, series {series:?}");
            let value = if status == "True" { 1.0 } else { 0.0 };
            !status.is_empty() && series == [(status, reason, Some(value))]
        })
    };
    op.wait_for(
        "each rule's series to say what its status says",
        WAIT,
        || agree(&mut last),
    );
    eprintln!("{last}");
    let scrape = Scrape::get(op.port).expect("scrape");
    assert_eq!(
        scrape.value(
            "ferry_connection_ready",
            &[
                ("namespace", NS),
                ("connection", "plant"),
                ("status", "False"),
                ("reason", "ForwardersNotReady")
            ]
        ),
        Some(0.0),
        "{}",
        scrape.text
    );
    cp.run_kubectl(["delete", "fr", "orphan", "-n", NS])
        .expect("delete the orphan rule");
    op.wait_for("the deleted rule's series to go", WAIT, || {
        Scrape::get(op.port).is_ok_and(|s| ready_of(&s, "orphan").is_empty())
    });

    // The same run's log: every line one flat JSON object with a top-level message.
    let log = op.log();
    let lines = ferry_e2e::flat_json_log(log.lines()).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(lines.iter().any(|l| l["message"] == "reconciled"), "{log}");
}
