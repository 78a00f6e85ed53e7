//! Records in the Confluent wire format: a JSON value (the MQTT payload or a transform's
//! result) checked against a schema the registry served and encoded as Avro, Protobuf or JSON
//! Schema records. Pure: the registry client fetches the schema, this compiles it once and
//! encodes each message with it.
//!
//! The wire format: magic byte 0, the schema id (4 bytes, big-endian), for Protobuf the
//! message-index array, then the payload.

mod avro;
mod json_schema;
mod protobuf;
mod protobuf_wire;

use std::fmt;

/// The schema's type, as the config names the format (the registry's `schemaType`).
pub use ferry_api::config::SchemaFormat as SchemaKind;

/// A schema as the registry served it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredSchema {
    pub id: u32,
    pub kind: SchemaKind,
    pub text: String,
}

/// Why a value does not fit the schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("at {}: {reason}", where_(.path))]
pub struct EncodeError {
    /// A JSON pointer to the offending value ("" for the root).
    pub path: String,
    /// What was expected and what was found (scalars shortened, nothing larger quoted).
    pub reason: String,
}

fn where_(path: &str) -> &str {
    if path.is_empty() { "the root" } else { path }
}

/// Why a schema cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("the Avro schema does not parse: {0}")]
    AvroParse(#[source] Box<apache_avro::Error>),
    #[error("the Avro schema uses {construct} at {path}, which Ferry does not encode")]
    AvroUnsupported { path: String, construct: String },
    #[error("the Avro schema refers to {name} at {path}, which it does not define")]
    AvroUnresolved { path: String, name: String },
    #[error("the Avro schema's default of {path} does not fit its type: {reason}")]
    AvroDefault { path: String, reason: String },
    #[error("the Protobuf schema does not compile: {0}")]
    ProtobufCompile(#[source] Box<protox::Error>),
    #[error(
        "the Protobuf schema imports {import}: schema references are not supported yet \
         (only the google/protobuf/ well-known types)"
    )]
    ProtobufReference { import: String },
    #[error("the Protobuf schema defines no message")]
    ProtobufNoMessage,
    #[error("the Protobuf schema defines no message {name} (it defines: {defined})")]
    ProtobufUnknownMessage { name: String, defined: String },
    #[error("the JSON Schema is not JSON: {0}")]
    JsonSchemaText(#[source] serde_json::Error),
    #[error("the JSON Schema does not compile: {reason}")]
    JsonSchemaCompile { reason: String },
}

/// Compiled once per (schema, rule), shared across messages.
pub struct Encoder {
    id: u32,
    format: Format,
}

enum Format {
    Avro(avro::AvroEncoder),
    Protobuf(protobuf::ProtobufEncoder),
    JsonSchema(json_schema::JsonSchemaEncoder),
}

impl fmt::Debug for Encoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoder")
            .field("id", &self.id)
            .field("kind", &self.kind())
            .finish_non_exhaustive()
    }
}

const MAGIC: u8 = 0;

impl Encoder {
    /// `message`: for Protobuf, the fully-qualified name of the message to encode (None: the
    /// first message of the file); ignored for the other kinds.
    pub fn compile(
        schema: &RegisteredSchema,
        message: Option<&str>,
    ) -> Result<Encoder, SchemaError> {
        let format = match schema.kind {
            SchemaKind::Avro => Format::Avro(avro::AvroEncoder::compile(&schema.text)?),
            SchemaKind::Protobuf => {
                Format::Protobuf(protobuf::ProtobufEncoder::compile(&schema.text, message)?)
            }
            SchemaKind::JsonSchema => {
                Format::JsonSchema(json_schema::JsonSchemaEncoder::compile(&schema.text)?)
            }
        };
        Ok(Encoder {
            id: schema.id,
            format,
        })
    }

    /// Appends the record to `out`: the header, then `json` encoded. On an error `out` is as
    /// it was.
    pub fn encode(&self, json: &[u8], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let start = out.len();
        out.push(MAGIC);
        out.extend_from_slice(&self.id.to_be_bytes());
        let encoded = match &self.format {
            Format::Avro(avro) => avro.encode(json, out),
            Format::Protobuf(proto) => proto.encode(json, out),
            Format::JsonSchema(schema) => schema.encode(json, out),
        };
        if encoded.is_err() {
            out.truncate(start);
        }
        encoded
    }

    pub fn kind(&self) -> SchemaKind {
        match self.format {
            Format::Avro(_) => SchemaKind::Avro,
            Format::Protobuf(_) => SchemaKind::Protobuf,
            Format::JsonSchema(_) => SchemaKind::JsonSchema,
        }
    }
}

/// At most this many characters of a value appear in an error.
const EXCERPT_CHARS: usize = 32;

/// `s` quoted, shortened to [`EXCERPT_CHARS`] characters.
fn excerpt(s: &str) -> String {
    match s.char_indices().nth(EXCERPT_CHARS) {
        Some((end, _)) => format!("{:?}…", &s[..end]),
        None => format!("{s:?}"),
    }
}

/// A message from a library, which may quote the value, shortened so that it cannot carry
/// much of the payload.
fn shortened(message: &str) -> String {
    const MAX: usize = 200;
    match message.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}…", &message[..end]),
        None => message.to_owned(),
    }
}

/// `segment` escaped for a JSON pointer.
fn push_pointer_segment(pointer: &mut String, segment: &str) {
    pointer.push('/');
    for c in segment.chars() {
        match c {
            '~' => pointer.push_str("~0"),
            '/' => pointer.push_str("~1"),
            c => pointer.push(c),
        }
    }
}

/// Appends `v` zigzag-encoded as a variable-length integer (Avro's `long`, Confluent's
/// message indexes).
fn put_zigzag(out: &mut Vec<u8>, v: i64) {
    let mut n = ((v << 1) ^ (v >> 63)) as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_varints() {
        let enc = |v| {
            let mut out = Vec::new();
            put_zigzag(&mut out, v);
            out
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(-1), [1]);
        assert_eq!(enc(1), [2]);
        assert_eq!(enc(-64), [0x7f]);
        assert_eq!(enc(64), [0x80, 0x01]);
        assert_eq!(
            enc(i64::MIN),
            [0xff; 9].iter().copied().chain([1]).collect::<Vec<_>>()
        );
    }

    #[test]
    fn errors_name_the_path_or_the_root() {
        let e = EncodeError {
            path: String::new(),
            reason: "expected an object".into(),
        };
        assert_eq!(e.to_string(), "at the root: expected an object");
        let mut p = String::new();
        push_pointer_segment(&mut p, "a/b~c");
        assert_eq!(p, "/a~1b~0c");
        assert_eq!(excerpt("short"), "\"short\"");
        assert_eq!(excerpt(&"x".repeat(100)), format!("{:?}…", "x".repeat(32)));
    }

    #[test]
    fn encoders_are_shared_across_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<Encoder>();
    }
}
