//! JSON to Protobuf: the schema text compiled in process by `protox` (proto2 and proto3, the
//! google/protobuf well-known types importable), the JSON read by the Protobuf JSON mapping.
//! JSON members the message has no field for are ignored, as in the Avro encoder; an enum value
//! the schema does not define is an error.
//!
//! Two paths: the wire path (`protobuf_wire.rs`) writes the wire format as it reads the JSON,
//! for messages without well-known types or groups; it gives up on anything it does not
//! accept. The reflection path, which reads the JSON into a `prost-reflect` message and encodes
//! that, then decides: it is the reference, and it alone words the errors.

use prost::Message as _;
use prost_reflect::{
    Cardinality, DeserializeOptions, DynamicMessage, Kind, MapKey, MessageDescriptor,
    ReflectMessage as _, Value,
};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};

use super::protobuf_wire::WirePlan;
use super::{EncodeError, SchemaError, push_pointer_segment, put_zigzag, shortened};

/// The name the registered schema is compiled under (imports name other files).
const SCHEMA_FILE: &str = "ferry-registered-schema.proto";

pub(super) struct ProtobufEncoder {
    message: MessageDescriptor,
    /// Confluent's message-index array of `message`, encoded.
    indexes: Vec<u8>,
    options: DeserializeOptions,
    /// The message compiled for the wire path; `None` when it holds what only the reflection
    /// path encodes.
    wire: Option<WirePlan>,
}

/// Serves the registered schema; its imports come from the next resolver.
struct Registered(String);

impl FileResolver for Registered {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        if name == SCHEMA_FILE {
            File::from_source(name, &self.0)
        } else {
            Err(protox::Error::file_not_found(name))
        }
    }
}

/// The imports of a schema that are not well-known types (registry references).
fn references(text: &str) -> Vec<String> {
    let google = GoogleFileResolver::new();
    protox_parse::parse(SCHEMA_FILE, text)
        .map(|file| {
            file.dependency
                .into_iter()
                .filter(|import| google.open_file(import).is_err())
                .collect()
        })
        .unwrap_or_default()
}

impl ProtobufEncoder {
    pub(super) fn compile(
        text: &str,
        message: Option<&str>,
    ) -> Result<ProtobufEncoder, SchemaError> {
        if let Some(import) = references(text).into_iter().next() {
            return Err(SchemaError::ProtobufReference { import });
        }
        let mut resolver = ChainFileResolver::new();
        resolver.add(Registered(text.to_owned()));
        resolver.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler
            .open_file(SCHEMA_FILE)
            .map_err(|e| SchemaError::ProtobufCompile(Box::new(e)))?;
        let pool = compiler.descriptor_pool();
        let file = pool
            .get_file_by_name(SCHEMA_FILE)
            .ok_or(SchemaError::ProtobufNoMessage)?;
        let descriptor = match message {
            None => file
                .messages()
                .next()
                .ok_or(SchemaError::ProtobufNoMessage)?,
            Some(name) => pool
                .get_message_by_name(name.trim_start_matches('.'))
                .filter(|m| m.parent_file().name() == SCHEMA_FILE)
                .ok_or_else(|| SchemaError::ProtobufUnknownMessage {
                    name: name.to_owned(),
                    defined: defined_messages(&file),
                })?,
        };
        let indexes = message_indexes(&descriptor);
        let wire = match WirePlan::compile(&descriptor) {
            Ok(plan) => Some(plan),
            Err(why) => {
                tracing::debug!(
                    message_type = descriptor.full_name(),
                    %why,
                    "Protobuf messages of this type go the slower reflection path"
                );
                None
            }
        };
        Ok(ProtobufEncoder {
            message: descriptor,
            indexes,
            options: DeserializeOptions::new(),
            wire,
        })
    }

    pub(super) fn encode(&self, json: &[u8], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if let Some(wire) = &self.wire {
            let start = out.len();
            out.extend_from_slice(&self.indexes);
            if wire.encode(json, out).is_ok() {
                return Ok(());
            }
            // Refused, or a case the wire path leaves alone: the reflection path decides.
            out.truncate(start);
        }
        self.encode_by_reflection(json, out)
    }

    /// The reference: the JSON read into a `DynamicMessage`, checked, then encoded.
    pub(super) fn encode_by_reflection(
        &self,
        json: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        // Most payloads name only the message's fields: read straight from the text, strictly.
        let mut de = serde_json::Deserializer::from_slice(json);
        let message = match self.read(&mut de).and_then(|m| {
            de.end().map_err(|e| EncodeError {
                path: String::new(),
                reason: format!("not valid JSON: {e}"),
            })?;
            Ok(m)
        }) {
            Ok(m) => m,
            // prost-reflect's words for a member the message has no field for.
            Err(e) if e.reason.starts_with("unrecognized field name") => {
                self.read_known_members(json)?
            }
            Err(e) => return Err(e),
        };
        if let Some(path) = missing_required(&message) {
            return Err(EncodeError {
                path,
                reason: "missing (a required field)".to_owned(),
            });
        }
        out.extend_from_slice(&self.indexes);
        message.encode(out).map_err(|e| EncodeError {
            path: String::new(),
            reason: format!("cannot encode the message: {e}"),
        })
    }
}

#[cfg(test)]
impl ProtobufEncoder {
    pub(super) fn wire(&self) -> Option<&WirePlan> {
        self.wire.as_ref()
    }

    pub(super) fn descriptor(&self) -> &MessageDescriptor {
        &self.message
    }

    pub(super) fn indexes(&self) -> &[u8] {
        &self.indexes
    }
}

impl ProtobufEncoder {
    fn read<'de, D: serde::Deserializer<'de>>(&self, de: D) -> Result<DynamicMessage, EncodeError>
    where
        D::Error: std::fmt::Display,
    {
        let mut track = serde_path_to_error::Track::new();
        DynamicMessage::deserialize_with_options(
            self.message.clone(),
            serde_path_to_error::Deserializer::new(de, &mut track),
            &self.options,
        )
        .map_err(|e| EncodeError {
            path: pointer(&track.path()),
            reason: shortened(&e.to_string()),
        })
    }

    /// Reads the members that name a field. They are dropped here rather than by
    /// prost-reflect, whose lenient mode also drops enum values it does not know, silently.
    fn read_known_members(&self, json: &[u8]) -> Result<DynamicMessage, EncodeError> {
        let mut value: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| EncodeError {
                path: String::new(),
                reason: format!("not valid JSON: {e}"),
            })?;
        drop_unknown_members(&self.message, &mut value);
        self.read(&value)
    }
}

fn defined_messages(file: &prost_reflect::FileDescriptor) -> String {
    let mut names = Vec::new();
    let mut stack: Vec<MessageDescriptor> = file.messages().collect();
    while let Some(m) = stack.pop() {
        if !m.is_map_entry() {
            names.push(m.full_name().to_owned());
        }
        stack.extend(m.child_messages());
    }
    names.sort();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// Confluent's message indexes: the path of `message` from the file's top-level messages
/// through nested ones, each the position among its siblings; `[0]` encoded as a single 0,
/// else the count and the indexes as zigzag varints.
fn message_indexes(message: &MessageDescriptor) -> Vec<u8> {
    let mut path = Vec::new();
    let mut current = message.clone();
    loop {
        let parent = current.parent_message();
        let index = match &parent {
            Some(p) => p
                .child_messages()
                .filter(|m| written_in_source(p, m))
                .position(|m| m == current),
            None => current.parent_file().messages().position(|m| m == current),
        };
        path.push(index.unwrap_or(0) as i64);
        match parent {
            Some(p) => current = p,
            None => break,
        }
    }
    path.reverse();
    let mut out = Vec::new();
    if path == [0] {
        out.push(0);
        return out;
    }
    put_zigzag(&mut out, path.len() as i64);
    for index in path {
        put_zigzag(&mut out, index);
    }
    out
}

/// Removes the members of `value` that name no field of `message` (nor an extension), in it
/// and in the messages it holds. The well-known types keep theirs: their JSON forms are not
/// objects of fields (`Struct` holds any members).
fn drop_unknown_members(message: &MessageDescriptor, value: &mut serde_json::Value) {
    let serde_json::Value::Object(members) = value else {
        return;
    };
    if message.full_name().starts_with("google.protobuf.") {
        return;
    }
    let field = |key: &str| {
        message
            .get_field_by_json_name(key)
            .or_else(|| message.get_field_by_name(key))
    };
    members.retain(|key, _| key.starts_with('[') || field(key).is_some());
    for (key, member) in members.iter_mut() {
        let Some(field) = field(key) else { continue };
        let Kind::Message(inner) = field.kind() else {
            continue;
        };
        match member {
            serde_json::Value::Array(items) if field.is_list() => {
                items
                    .iter_mut()
                    .for_each(|item| drop_unknown_members(&inner, item));
            }
            serde_json::Value::Object(entries) if field.is_map() => {
                if let Kind::Message(values) = inner.map_entry_value_field().kind() {
                    for entry in entries.values_mut() {
                        drop_unknown_members(&values, entry);
                    }
                }
            }
            member => drop_unknown_members(&inner, member),
        }
    }
}

/// Whether `child` is a message declared in `parent`'s source, as Confluent counts them: not the
/// entry type of a map field nor the type of a proto2 group, which the compiler adds.
fn written_in_source(parent: &MessageDescriptor, child: &MessageDescriptor) -> bool {
    !child.is_map_entry()
        && !parent
            .fields()
            .any(|f| f.is_group() && f.kind().as_message() == Some(child))
}

/// The path of the first proto2 `required` field left unset (the JSON mapping does not check
/// them; a Protobuf decoder refuses such a message).
fn missing_required(message: &DynamicMessage) -> Option<String> {
    for field in message.descriptor().fields() {
        if field.cardinality() == Cardinality::Required && !message.has_field(&field) {
            let mut path = String::new();
            push_pointer_segment(&mut path, field.json_name());
            return Some(path);
        }
    }
    for (field, value) in message.fields() {
        let nested: Box<dyn Iterator<Item = (String, &DynamicMessage)>> = match value {
            Value::Message(m) => Box::new(std::iter::once((String::new(), m))),
            Value::List(items) => Box::new(
                items
                    .iter()
                    .enumerate()
                    .filter_map(|(i, v)| v.as_message().map(|m| (i.to_string(), m))),
            ),
            Value::Map(entries) => Box::new(
                entries
                    .iter()
                    .filter_map(|(k, v)| v.as_message().map(|m| (map_key(k), m))),
            ),
            _ => continue,
        };
        for (segment, m) in nested {
            if let Some(inner) = missing_required(m) {
                let mut path = String::new();
                push_pointer_segment(&mut path, field.json_name());
                if !matches!(value, Value::Message(_)) {
                    push_pointer_segment(&mut path, &segment);
                }
                return Some(path + &inner);
            }
        }
    }
    None
}

fn map_key(key: &MapKey) -> String {
    match key {
        MapKey::Bool(b) => b.to_string(),
        MapKey::I32(i) => i.to_string(),
        MapKey::I64(i) => i.to_string(),
        MapKey::U32(u) => u.to_string(),
        MapKey::U64(u) => u.to_string(),
        MapKey::String(s) => s.clone(),
    }
}

fn pointer(path: &serde_path_to_error::Path) -> String {
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            serde_path_to_error::Segment::Seq { index } => {
                push_pointer_segment(&mut out, &index.to_string());
            }
            serde_path_to_error::Segment::Map { key } => push_pointer_segment(&mut out, key),
            serde_path_to_error::Segment::Enum { variant } => {
                push_pointer_segment(&mut out, variant)
            }
            serde_path_to_error::Segment::Unknown => push_pointer_segment(&mut out, "?"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use prost_reflect::{DescriptorPool, DynamicMessage};
    use serde_json::{Value, json};

    use crate::encode::{EncodeError, Encoder, RegisteredSchema, SchemaError, SchemaKind};

    const READINGS: &str = r#"
        syntax = "proto3";
        package plant.v1;
        import "google/protobuf/timestamp.proto";

        message Reading {
          string device = 1;
          double temp = 2;
          optional double humidity = 3;
          google.protobuf.Timestamp at = 4;
          Status status = 5;
          repeated string tags = 6;
          map<string, int64> counters = 7;
          Location location = 8;
          bytes raw = 9;
          oneof source { string gateway = 10; int32 line = 11; }
          message Location { double lat = 1; double lon = 2; }
          message Calibration { float offset = 1; }
        }
        enum Status { STATUS_UNSPECIFIED = 0; OK = 1; DEGRADED = 2; }
        message Batch { repeated Reading readings = 1; }
    "#;

    fn compile(text: &str, message: Option<&str>) -> Result<Encoder, SchemaError> {
        let schema = RegisteredSchema {
            id: 9,
            kind: SchemaKind::Protobuf,
            text: text.to_owned(),
        };
        Encoder::compile(&schema, message)
    }

    fn encoder(text: &str, message: Option<&str>) -> Encoder {
        compile(text, message).unwrap_or_else(|e| panic!("{e}"))
    }

    fn encode(encoder: &Encoder, json: &str) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        encoder.encode(json.as_bytes(), &mut out).map(|()| out)
    }

    /// Decodes the payload after `header` with prost-reflect and returns it in the JSON mapping.
    fn decode(text: &str, message: &str, header: &[u8], record: &[u8]) -> Value {
        assert_eq!(&record[..header.len()], header, "header");
        let pool = compile_pool(text);
        let desc = pool.get_message_by_name(message).unwrap();
        let decoded = DynamicMessage::decode(desc, &record[header.len()..]).unwrap();
        serde_json::to_value(&decoded).unwrap()
    }

    fn compile_pool(text: &str) -> DescriptorPool {
        let mut resolver = protox::file::ChainFileResolver::new();
        resolver.add(super::Registered(text.to_owned()));
        resolver.add(protox::file::GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler.open_file(super::SCHEMA_FILE).unwrap();
        compiler.descriptor_pool()
    }

    #[test]
    fn a_reading_roundtrips_through_prost_reflect() {
        let e = encoder(READINGS, None);
        let json = r#"{"device": "plant-7/line-3/sensor-12", "temp": 21.37, "humidity": 48.2,
            "at": "2024-11-26T10:00:00.123Z", "status": "DEGRADED", "tags": ["a", "b"],
            "counters": {"resets": "3"}, "location": {"lat": 48.1, "lon": 11.5, "alt": 520},
            "raw": "AQL+", "line": 3, "notInTheSchema": {"x": 1}}"#;
        let record = encode(&e, json).unwrap();
        let decoded = decode(READINGS, "plant.v1.Reading", &[0, 0, 0, 0, 9, 0], &record);
        assert_eq!(
            decoded,
            json!({"device": "plant-7/line-3/sensor-12", "temp": 21.37, "humidity": 48.2,
                "at": "2024-11-26T10:00:00.123Z", "status": "DEGRADED", "tags": ["a", "b"],
                "counters": {"resets": "3"}, "location": {"lat": 48.1, "lon": 11.5},
                "raw": "AQL+", "line": 3})
        );
    }

    #[test]
    fn the_payload_is_the_protobuf_encoding() {
        // The protobuf documentation's example: field 1 = 150 is 08 96 01.
        let e = encoder(
            "syntax = \"proto2\"; message Test1 { optional int32 a = 1; }",
            None,
        );
        assert_eq!(
            encode(&e, r#"{"a": 150}"#).unwrap(),
            [0, 0, 0, 0, 9, 0, 0x08, 0x96, 0x01]
        );
    }

    #[test]
    fn message_indexes_follow_confluent() {
        // Map entries and groups are messages to the compiler, not in the source: not counted.
        let text = r#"
            syntax = "proto2";
            message A { optional int32 a = 1; }
            enum E { X = 0; }
            message B {
              map<string, int32> m = 1;
              optional group G = 2 { optional int32 g = 3; }
              message C { optional int32 c = 1; }
              message D { message F { optional int32 f = 1; } optional int32 d = 1; }
            }
        "#;
        let header = |message: &str| {
            let record = encode(&encoder(text, Some(message)), "{}").unwrap();
            record[5..].to_vec()
        };
        assert_eq!(header("A"), [0]);
        assert_eq!(header("B"), [2, 2]);
        assert_eq!(header("B.C"), [4, 2, 0]);
        assert_eq!(header("B.D"), [4, 2, 2]);
        assert_eq!(header(".B.D.F"), [6, 2, 2, 0]);
        let e = encoder(text, Some("B.D.F"));
        let record = encode(&e, r#"{"f": 1}"#).unwrap();
        assert_eq!(
            decode(text, "B.D.F", &[0, 0, 0, 0, 9, 6, 2, 2, 0], &record),
            json!({"f": 1})
        );
    }

    #[test]
    fn errors_name_the_field() {
        let e = encoder(READINGS, Some("plant.v1.Batch"));
        let err = encode(
            &e,
            r#"{"readings": [{"temp": 1}, {"location": {"lat": "north"}}]}"#,
        )
        .unwrap_err();
        assert_eq!(err.path, "/readings/1/location/lat");
        // With and without members the message has no field for (read in two ways).
        for json in [
            r#"{"readings": [{"status": "ON_FIRE"}]}"#,
            r#"{"readings": [{"status": "ON_FIRE", "unknown": 1}]}"#,
        ] {
            let err = encode(&e, json).unwrap_err();
            assert_eq!(err.path, "/readings/0/status");
            assert!(err.reason.contains("ON_FIRE"), "{err}");
        }
        let err = encode(&e, r#"{"readings": [{"gateway": "g", "line": 1}]}"#).unwrap_err();
        assert_eq!(err.path, "/readings/0", "{err}");
        assert!(err.reason.contains("oneof 'source'"), "{err}");
        let err = encode(
            &e,
            &format!(r#"{{"readings": [{{"temp": "{}"}}]}}"#, "x".repeat(10_000)),
        )
        .unwrap_err();
        assert!(err.reason.len() < 300, "{err}");
        let err = encode(&e, r#"{"readings": []} x"#).unwrap_err();
        assert_eq!(err.path, "");
        assert!(err.reason.starts_with("not valid JSON"), "{err}");
    }

    #[test]
    fn a_proto2_required_field_must_be_set() {
        let text = r#"syntax = "proto2";
            message Outer { optional Inner inner = 1; repeated Inner more = 2; }
            message Inner { required int32 must = 1; optional int32 may = 2; }"#;
        let e = encoder(text, None);
        assert!(encode(&e, r#"{"inner": {"must": 1}, "more": [{"must": 2}]}"#).is_ok());
        let err = encode(&e, r#"{"inner": {"may": 1}}"#).unwrap_err();
        assert_eq!(
            (err.path.as_str(), err.reason.as_str()),
            ("/inner/must", "missing (a required field)")
        );
        let err = encode(&e, r#"{"more": [{"must": 1}, {}]}"#).unwrap_err();
        assert_eq!(err.path, "/more/1/must");
    }

    #[test]
    fn unusable_schemas_say_why() {
        assert!(matches!(
            compile("syntax = \"proto3\"; import \"other/thing.proto\"; message M { int32 a = 1; }", None),
            Err(SchemaError::ProtobufReference { import }) if import == "other/thing.proto"
        ));
        assert!(matches!(
            compile("syntax = \"proto3\"; message M { int32 a = 1 }", None),
            Err(SchemaError::ProtobufCompile(_))
        ));
        assert!(matches!(
            compile("syntax = \"proto3\"; enum E { X = 0; }", None),
            Err(SchemaError::ProtobufNoMessage)
        ));
        match compile(READINGS, Some("plant.v1.Nope")) {
            Err(SchemaError::ProtobufUnknownMessage { name, defined }) => {
                assert_eq!(name, "plant.v1.Nope");
                assert!(defined.contains("plant.v1.Reading.Location"), "{defined}");
                assert!(!defined.contains("Entry"), "{defined}");
            }
            other => panic!("{other:?}"),
        }
        // A well-known type is in the pool, but not the registered schema's to encode.
        assert!(matches!(
            compile(READINGS, Some("google.protobuf.Timestamp")),
            Err(SchemaError::ProtobufUnknownMessage { .. })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut out = Vec::new();
            if encoder(READINGS, None).encode(&bytes, &mut out).is_err() {
                prop_assert!(out.is_empty());
            }
        }

        #[test]
        fn readings_roundtrip(temp in -1e6f64..1e6, line in any::<i32>(), tags in proptest::collection::vec("[a-z]{0,5}", 0..4)) {
            let e = encoder(READINGS, None);
            let json = json!({"temp": temp, "line": line, "tags": tags, "status": "OK"});
            let record = encode(&e, &json.to_string()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let decoded = decode(READINGS, "plant.v1.Reading", &[0, 0, 0, 0, 9, 0], &record);
            let mut expected = json!({"line": line, "status": "OK"});
            if temp != 0.0 { expected["temp"] = json!(temp); }
            if !tags.is_empty() { expected["tags"] = json!(tags); }
            prop_assert_eq!(decoded, expected);
        }
    }
}
