//! Ferry's custom resources as the tests apply them: a [`Connection`] (BrokerConnection) and a
//! [`Rule`] (ForwardingRule), built field by field and rendered for `kubectl apply -f -`.
//!
//! ```
//! use ferry_e2e::manifests::{Connection, Rule};
//! let yaml = [
//!     Connection::new("plant", "mqtt.example", &["kafka.example:9092"]).namespace("ferry").yaml(),
//!     Rule::new("temps", "plant").namespace("ferry").group("default")
//!         .topics(&["plant/+/temp"]).kafka_topic("temps").yaml(),
//! ]
//! .concat();
//! assert_eq!(yaml.matches("---\n").count(), 2);
//! ```

use serde_json::{Map, Value, json};

/// The API version of Ferry's kinds.
pub const API_VERSION: &str = "ferry.dev/v1alpha1";

/// What every kind has: its namespace, any field by JSON pointer, and its rendering.
macro_rules! object_methods {
    ($kind:ident) => {
        impl $kind {
            /// `metadata.namespace` (without it, kubectl's `-n` or its default namespace).
            pub fn namespace(self, namespace: &str) -> Self {
                self.set("/metadata/namespace", json!(namespace))
            }

            /// Any other field, by its JSON pointer (`/spec/kafka/config`); see [`set_pointer`].
            pub fn set(mut self, pointer: &str, value: Value) -> Self {
                set_pointer(&mut self.0, pointer, value);
                self
            }

            /// The object as JSON.
            pub fn json(&self) -> &Value {
                &self.0
            }

            /// The object for `kubectl apply -f -`; see [`document`].
            pub fn yaml(&self) -> String {
                document(&self.0)
            }
        }
    };
}

object_methods!(Connection);
object_methods!(Rule);

/// A BrokerConnection: an MQTT broker and a Kafka cluster, and the forwarders between them.
#[derive(Debug, Clone)]
pub struct Connection(Value);

impl Connection {
    /// Connection `name` to the MQTT broker at `mqtt_host` and the Kafka at `bootstrap_servers`.
    pub fn new(name: &str, mqtt_host: &str, bootstrap_servers: &[&str]) -> Self {
        Self(json!({
            "apiVersion": API_VERSION,
            "kind": "BrokerConnection",
            "metadata": { "name": name },
            "spec": {
                "mqtt": { "host": mqtt_host },
                "kafka": { "bootstrapServers": bootstrap_servers },
            },
        }))
    }

    /// Connection `name` to the brokers' Services in `ns`, `mqtt.<ns>.svc` and
    /// `kafka.<ns>.svc:9092`, for tests of what the operator makes of it (nothing connects).
    pub fn svc(name: &str, ns: &str) -> Self {
        Self::new(
            name,
            &format!("mqtt.{ns}.svc"),
            &[&format!("kafka.{ns}.svc:9092")],
        )
    }

    /// `spec.mqtt.port`.
    pub fn mqtt_port(self, port: u16) -> Self {
        self.set("/spec/mqtt/port", json!(port))
    }

    /// `spec.mqtt.protocol`: `"3.1.1"` or `"5"`.
    pub fn mqtt_protocol(self, protocol: &str) -> Self {
        self.set("/spec/mqtt/protocol", json!(protocol))
    }

    /// `spec.mqtt.credentialsSecretRef`: the Secret with the MQTT user name and password.
    pub fn credentials_secret(self, secret: &str) -> Self {
        self.set("/spec/mqtt/credentialsSecretRef", json!({ "name": secret }))
    }

    /// `spec.forwarder.replicas`: the forwarder pods of each group.
    pub fn replicas(self, replicas: u32) -> Self {
        self.set("/spec/forwarder/replicas", json!(replicas))
    }
}

/// A ForwardingRule: MQTT topic filters of a connection, forwarded to a Kafka topic.
#[derive(Debug, Clone)]
pub struct Rule(Value);

impl Rule {
    /// Rule `name` of connection `connection`; give it [`Rule::topics`] and
    /// [`Rule::kafka_topic`].
    pub fn new(name: &str, connection: &str) -> Self {
        Self(json!({
            "apiVersion": API_VERSION,
            "kind": "ForwardingRule",
            "metadata": { "name": name },
            "spec": { "connectionRef": { "name": connection } },
        }))
    }

    /// `spec.group`: the forwarder workload that serves it.
    pub fn group(self, group: &str) -> Self {
        self.set("/spec/group", json!(group))
    }

    /// `spec.mqtt.topics`: the MQTT topic filters.
    pub fn topics(self, filters: &[&str]) -> Self {
        self.set("/spec/mqtt/topics", json!(filters))
    }

    /// `spec.kafka.topic`.
    pub fn kafka_topic(self, topic: &str) -> Self {
        self.set("/spec/kafka/topic", json!(topic))
    }

    /// `spec.filter`: the CEL expression a message must match.
    pub fn filter(self, expression: &str) -> Self {
        self.set("/spec/filter", json!(expression))
    }
}

/// One document of a YAML stream: `---`, then the object as JSON (which YAML reads as it is,
/// every string quoted, so no value changes type), then a newline. Documents concatenate into
/// a stream, also after YAML ones. The leading `---` matters: kubectl reads a stream that
/// starts with `{` as JSON only, where a later `---` would not parse.
pub fn document(object: &Value) -> String {
    format!("---\n{object}\n")
}

/// Sets the field at JSON `pointer` (`/spec/kafka/topic`; `~1` for a `/` in a key, `~0` for a
/// `~`) to `value`, creating the objects on the way and replacing what is not an object.
pub fn set_pointer(object: &mut Value, pointer: &str, value: Value) {
    let mut at = object;
    for key in pointer.split('/').skip(1) {
        if !at.is_object() {
            *at = Value::Object(Map::new());
        }
        let Value::Object(map) = at else {
            return;
        };
        let key = key.replace("~1", "/").replace("~0", "~");
        at = map.entry(key).or_insert(Value::Null);
    }
    *at = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_has_the_fields_it_was_given() {
        let c = Connection::new("plant", "127.0.0.1", &["127.0.0.1:9"])
            .namespace("ns")
            .mqtt_port(1883)
            .mqtt_protocol("5")
            .replicas(3)
            .credentials_secret("creds")
            .set("/spec/kafka/config", json!({ "linger.ms": "5" }));
        assert_eq!(
            c.json(),
            &json!({
                "apiVersion": "ferry.dev/v1alpha1",
                "kind": "BrokerConnection",
                "metadata": { "name": "plant", "namespace": "ns" },
                "spec": {
                    "mqtt": {
                        "host": "127.0.0.1", "port": 1883, "protocol": "5",
                        "credentialsSecretRef": { "name": "creds" },
                    },
                    "kafka": { "bootstrapServers": ["127.0.0.1:9"], "config": { "linger.ms": "5" } },
                    "forwarder": { "replicas": 3 },
                },
            })
        );
    }

    #[test]
    fn a_rule_has_the_fields_it_was_given() {
        let r = Rule::new("temps", "plant")
            .namespace("ns")
            .group("east")
            .topics(&["plant/+/temp", "plant/+/alarm"])
            .kafka_topic("t.{5}")
            .filter("true")
            .set("/spec/kafka/key", json!("topic"))
            .set("/metadata/labels/a~1b", json!("c"));
        assert_eq!(
            r.json(),
            &json!({
                "apiVersion": "ferry.dev/v1alpha1",
                "kind": "ForwardingRule",
                "metadata": { "name": "temps", "namespace": "ns", "labels": { "a/b": "c" } },
                "spec": {
                    "connectionRef": { "name": "plant" },
                    "group": "east",
                    "mqtt": { "topics": ["plant/+/temp", "plant/+/alarm"] },
                    "kafka": { "topic": "t.{5}", "key": "topic" },
                    "filter": "true",
                },
            })
        );
    }

    #[test]
    fn documents_concatenate_into_a_stream() {
        let rule = Rule::new("r", "c").kafka_topic("yes");
        let yaml = rule.yaml();
        assert!(
            yaml.starts_with("---\n{") && yaml.ends_with("}\n"),
            "{yaml}"
        );
        let back: Value = serde_json::from_str(&yaml["---\n".len()..]).expect("JSON");
        assert_eq!(&back, rule.json());
        assert_eq!(back["spec"]["kafka"]["topic"], "yes", "a string stays one");
    }

    #[test]
    fn a_pointer_replaces_what_is_not_an_object() {
        let mut v = json!({ "spec": "x" });
        set_pointer(&mut v, "/spec/a", json!(1));
        assert_eq!(v, json!({ "spec": { "a": 1 } }));
        set_pointer(&mut v, "", json!(2));
        assert_eq!(v, json!(2));
    }
}
