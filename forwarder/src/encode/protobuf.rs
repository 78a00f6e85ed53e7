//! JSON to Protobuf: the schema text compiled in process by `protox` (proto2 and proto3, the
//! google/protobuf well-known types importable), the JSON read by `prost-reflect` by the
//! Protobuf JSON mapping, then encoded. JSON members the message has no field for are ignored,
//! as in the Avro encoder.

use prost::Message as _;
use prost_reflect::{DeserializeOptions, DynamicMessage, MessageDescriptor};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};

use super::{EncodeError, SchemaError, push_pointer_segment, put_zigzag, shortened};

/// The name the registered schema is compiled under (imports name other files).
const SCHEMA_FILE: &str = "ferry-registered-schema.proto";

pub(super) struct ProtobufEncoder {
    message: MessageDescriptor,
    /// Confluent's message-index array of `message`, encoded.
    indexes: Vec<u8>,
    options: DeserializeOptions,
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
        Ok(ProtobufEncoder {
            message: descriptor,
            indexes,
            options: DeserializeOptions::new().deny_unknown_fields(false),
        })
    }

    pub(super) fn encode(&self, json: &[u8], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let mut de = serde_json::Deserializer::from_slice(json);
        let mut track = serde_path_to_error::Track::new();
        let read = DynamicMessage::deserialize_with_options(
            self.message.clone(),
            serde_path_to_error::Deserializer::new(&mut de, &mut track),
            &self.options,
        );
        let message = match read {
            Ok(m) => m,
            Err(e) => {
                return Err(EncodeError {
                    path: pointer(&track.path()),
                    reason: shortened(&e.to_string()),
                });
            }
        };
        de.end().map_err(|e| EncodeError {
            path: String::new(),
            reason: format!("not valid JSON: {e}"),
        })?;
        out.extend_from_slice(&self.indexes);
        message.encode(out).map_err(|e| EncodeError {
            path: String::new(),
            reason: format!("cannot encode the message: {e}"),
        })
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
            Some(p) => p.child_messages().position(|m| m == current),
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
