//! JSON to Avro binary, walking the JSON text with the schema (no intermediate JSON tree but
//! for objects inside unions). The schema is parsed by `apache-avro`, then compiled into a flat
//! table of nodes in which named types are indexes, so a type used twice or recursively is one
//! node.
//!
//! Conventions (docs/configuration.md has the user's version):
//! - Record fields may come in any order; fields the schema does not have are ignored; a
//!   missing field takes the schema's default, else null if its type allows it, else is an
//!   error naming it.
//! - `int`/`long` take JSON integers in range (or numbers with no fraction); `float`/`double`
//!   any number.
//! - `bytes` and `fixed` take a string whose characters are the bytes (U+0000..U+00FF, as in
//!   Avro's JSON encoding and the schema's defaults).
//! - A union takes a plain JSON value, encoded as the first branch it fits; or Avro's JSON
//!   encoding of a union, `{"<branch>": value}`, when that cannot be read as a plain value.
//! - Logical types are their underlying type (`date` an int, `timestamp-millis` a long, `uuid`
//!   a string); a `decimal` takes a number or a string of its digits; `duration` is refused at
//!   compile time.

use std::collections::HashMap;
use std::fmt;

use apache_avro::Schema;
use apache_avro::schema::{InnerDecimalSchema, Name, RecordSchema, UnionSchema, UuidSchema};
use serde::Deserialize as _;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::{EncodeError, SchemaError, excerpt, push_pointer_segment, put_zigzag};

type NodeId = usize;

#[derive(Debug)]
enum Node {
    Null,
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Bytes,
    String,
    Fixed {
        size: usize,
    },
    /// The unscaled value, two's complement big-endian: in as few bytes as it takes, or in
    /// `size` (a fixed).
    Decimal {
        precision: usize,
        scale: usize,
        size: Option<usize>,
    },
    Enum {
        symbols: Vec<String>,
    },
    Array(NodeId),
    Map(NodeId),
    Record(Record),
    Union(Union),
}

#[derive(Debug)]
struct Record {
    fields: Vec<Field>,
}

#[derive(Debug)]
struct Field {
    name: String,
    node: NodeId,
    /// The schema's default, encoded.
    default: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Union {
    branches: Vec<Branch>,
    /// A map branch reads any object, so `{"<branch>": value}` is never a wrapped value.
    has_map: bool,
}

#[derive(Debug)]
struct Branch {
    node: NodeId,
    /// The name Avro's JSON encoding wraps this branch's values in: the type's name for
    /// primitives, `array`, `map`, the full name of named types.
    name: String,
    /// The name of a named type without its namespace.
    short_name: Option<String>,
}

pub(super) struct AvroEncoder {
    nodes: Vec<Node>,
    root: NodeId,
}

impl AvroEncoder {
    pub(super) fn compile(text: &str) -> Result<AvroEncoder, SchemaError> {
        let schema = Schema::parse_str(text).map_err(|e| SchemaError::AvroParse(Box::new(e)))?;
        let mut builder = Builder::default();
        let root = builder.node(&schema, None, "")?;
        let mut encoder = AvroEncoder {
            nodes: builder.nodes,
            root,
        };
        for pending in builder.defaults {
            let bytes = encoder.encode_default(&pending)?;
            if let Node::Record(record) = &mut encoder.nodes[pending.record] {
                record.fields[pending.field].default = Some(bytes);
            }
        }
        Ok(encoder)
    }

    pub(super) fn encode(&self, json: &[u8], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let mut cx = Cx::new(&self.nodes);
        let mut de = serde_json::Deserializer::from_slice(json);
        let seed = Seed {
            cx: &mut cx,
            out,
            node: self.root,
        };
        match seed.deserialize(&mut de).and_then(|()| de.end()) {
            Ok(()) => Ok(()),
            Err(e) => Err(cx.finish(&e)),
        }
    }

    /// A field's default, encoded: a union's default is of its first branch (the spec's rule),
    /// else of the first branch it fits.
    fn encode_default(&self, pending: &PendingDefault) -> Result<Vec<u8>, SchemaError> {
        let node = match &self.nodes[pending.record] {
            Node::Record(record) => record.fields[pending.field].node,
            _ => self.root,
        };
        let mut out = Vec::new();
        if let Node::Union(union) = &self.nodes[node]
            && let Some(first) = union.branches.first()
        {
            put_zigzag(&mut out, 0);
            if self
                .encode_value(first.node, &pending.value, &mut out)
                .is_ok()
            {
                return Ok(out);
            }
            out.clear();
        }
        match self.encode_value(node, &pending.value, &mut out) {
            Ok(()) => Ok(out),
            Err(e) => Err(SchemaError::AvroDefault {
                path: pending.path.clone(),
                reason: e.to_string(),
            }),
        }
    }

    fn encode_value(
        &self,
        node: NodeId,
        value: &Value,
        out: &mut Vec<u8>,
    ) -> Result<(), EncodeError> {
        let mut cx = Cx::new(&self.nodes);
        let seed = Seed {
            cx: &mut cx,
            out,
            node,
        };
        seed.deserialize(value).map_err(|e| cx.finish(&e))
    }
}

struct PendingDefault {
    record: NodeId,
    field: usize,
    value: Value,
    path: String,
}

/// Turns the parsed schema into nodes.
#[derive(Default)]
struct Builder {
    nodes: Vec<Node>,
    /// Named types by full name.
    named: HashMap<String, NodeId>,
    defaults: Vec<PendingDefault>,
}

impl Builder {
    fn push(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Registers a named type before its children are built, so they can refer to it.
    fn name(&mut self, name: &Name, namespace: Option<&str>) -> (NodeId, Option<String>) {
        let full = name.fully_qualified_name(namespace);
        let id = self.push(Node::Null);
        self.named.insert(full.fullname(None), id);
        (id, full.namespace().map(str::to_owned))
    }

    fn node(
        &mut self,
        schema: &Schema,
        ns: Option<&str>,
        path: &str,
    ) -> Result<NodeId, SchemaError> {
        let unsupported = |construct: &str| SchemaError::AvroUnsupported {
            path: shown(path),
            construct: construct.to_owned(),
        };
        let node =
            match schema {
                Schema::Null => Node::Null,
                Schema::Boolean => Node::Boolean,
                Schema::Int | Schema::Date | Schema::TimeMillis => Node::Int,
                Schema::Long
                | Schema::TimeMicros
                | Schema::TimestampMillis
                | Schema::TimestampMicros
                | Schema::TimestampNanos
                | Schema::LocalTimestampMillis
                | Schema::LocalTimestampMicros
                | Schema::LocalTimestampNanos => Node::Long,
                Schema::Float => Node::Float,
                Schema::Double => Node::Double,
                Schema::Bytes => Node::Bytes,
                Schema::String | Schema::Uuid(UuidSchema::String) => Node::String,
                Schema::Uuid(UuidSchema::Bytes) => Node::Bytes,
                Schema::Uuid(UuidSchema::Fixed(fixed)) | Schema::Fixed(fixed) => {
                    let (id, _) = self.name(&fixed.name, ns);
                    self.nodes[id] = Node::Fixed { size: fixed.size };
                    return Ok(id);
                }
                Schema::Enum(e) => {
                    let (id, _) = self.name(&e.name, ns);
                    self.nodes[id] = Node::Enum {
                        symbols: e.symbols.clone(),
                    };
                    return Ok(id);
                }
                Schema::Array(array) => {
                    let items = self.node(&array.items, ns, &format!("{path}[]"))?;
                    Node::Array(items)
                }
                Schema::Map(map) => {
                    let values = self.node(&map.types, ns, &format!("{path}{{}}"))?;
                    Node::Map(values)
                }
                Schema::Record(record) => return self.record(record, ns, path),
                Schema::Union(union) => Node::Union(self.union(union, ns, path)?),
                Schema::Ref { name } => {
                    let full = name.fully_qualified_name(ns).fullname(None);
                    return self.named.get(&full).copied().ok_or_else(|| {
                        SchemaError::AvroUnresolved {
                            path: shown(path),
                            name: full,
                        }
                    });
                }
                Schema::Decimal(d) => {
                    if d.precision > MAX_PRECISION {
                        return Err(unsupported(&format!(
                            "a decimal of precision {} (at most {MAX_PRECISION})",
                            d.precision
                        )));
                    }
                    let decimal = |size| Node::Decimal {
                        precision: d.precision,
                        scale: d.scale,
                        size,
                    };
                    match &d.inner {
                        InnerDecimalSchema::Bytes => decimal(None),
                        InnerDecimalSchema::Fixed(fixed) => {
                            let (id, _) = self.name(&fixed.name, ns);
                            self.nodes[id] = decimal(Some(fixed.size));
                            return Ok(id);
                        }
                    }
                }
                Schema::BigDecimal => return Err(unsupported("the big-decimal logical type")),
                Schema::Duration(_) => return Err(unsupported("the duration logical type")),
            };
        Ok(self.push(node))
    }

    fn record(
        &mut self,
        record: &RecordSchema,
        ns: Option<&str>,
        path: &str,
    ) -> Result<NodeId, SchemaError> {
        let (id, inner_ns) = self.name(&record.name, ns);
        let mut fields = Vec::with_capacity(record.fields.len());
        for (i, field) in record.fields.iter().enumerate() {
            let field_path = if path.is_empty() {
                field.name.clone()
            } else {
                format!("{path}.{}", field.name)
            };
            let node = self.node(&field.schema, inner_ns.as_deref(), &field_path)?;
            // A field that may be null is null when missing, as in Confluent's Python serializer
            // (fastavro): what a device leaving out an optional reading means.
            let default = field
                .default
                .clone()
                .or_else(|| self.nullable(node).then_some(Value::Null));
            if let Some(value) = default {
                self.defaults.push(PendingDefault {
                    record: id,
                    field: i,
                    value,
                    path: field_path,
                });
            }
            fields.push(Field {
                name: field.name.clone(),
                node,
                default: None,
            });
        }
        self.nodes[id] = Node::Record(Record { fields });
        Ok(id)
    }

    fn union(
        &mut self,
        union: &UnionSchema,
        ns: Option<&str>,
        path: &str,
    ) -> Result<Union, SchemaError> {
        let mut branches = Vec::with_capacity(union.variants().len());
        for variant in union.variants() {
            let node = self.node(variant, ns, path)?;
            let (name, short_name) = match variant {
                Schema::Record(RecordSchema { name, .. })
                | Schema::Enum(apache_avro::schema::EnumSchema { name, .. })
                | Schema::Fixed(apache_avro::schema::FixedSchema { name, .. })
                | Schema::Ref { name } => (
                    name.fully_qualified_name(ns).fullname(None),
                    Some(name.name().to_owned()),
                ),
                _ => (self.type_name(node).to_owned(), None),
            };
            branches.push(Branch {
                node,
                name,
                short_name,
            });
        }
        let has_map = branches
            .iter()
            .any(|b| matches!(self.nodes[b.node], Node::Map(_)));
        Ok(Union { branches, has_map })
    }

    fn nullable(&self, node: NodeId) -> bool {
        match &self.nodes[node] {
            Node::Union(union) => union
                .branches
                .iter()
                .any(|b| matches!(self.nodes[b.node], Node::Null)),
            _ => false,
        }
    }

    fn type_name(&self, node: NodeId) -> &'static str {
        match &self.nodes[node] {
            Node::Null => "null",
            Node::Boolean => "boolean",
            Node::Int => "int",
            Node::Long => "long",
            Node::Float => "float",
            Node::Double => "double",
            Node::Bytes | Node::Decimal { size: None, .. } => "bytes",
            Node::String => "string",
            Node::Array(_) => "array",
            Node::Map(_) => "map",
            Node::Fixed { .. }
            | Node::Decimal { size: Some(_), .. }
            | Node::Enum { .. }
            | Node::Record(_)
            | Node::Union(_) => "",
        }
    }
}

fn shown(path: &str) -> String {
    if path.is_empty() {
        "the root".to_owned()
    } else {
        path.to_owned()
    }
}

/// The state of one encoding: the error that stopped it, with its path built on the way out.
struct Cx<'e> {
    nodes: &'e [Node],
    error: Option<Failure>,
}

struct Failure {
    reason: String,
    /// Innermost first.
    segments: Vec<String>,
}

impl<'e> Cx<'e> {
    fn new(nodes: &'e [Node]) -> Self {
        Cx { nodes, error: None }
    }

    /// Records why the value does not fit; the path is added on the way out.
    fn fail<E: de::Error>(&mut self, reason: String) -> E {
        self.error = Some(Failure {
            reason,
            segments: Vec::new(),
        });
        E::custom("the value does not fit the schema")
    }

    /// Adds `segment` to the path of the error `e` passing out through it; an error of the
    /// JSON itself is recorded at its first segment.
    fn locate<E: de::Error>(&mut self, segment: impl FnOnce() -> String, e: E) -> E {
        self.error
            .get_or_insert_with(|| Failure {
                reason: format!("not valid JSON: {e}"),
                segments: Vec::new(),
            })
            .segments
            .push(segment());
        e
    }

    fn finish(&mut self, e: &dyn fmt::Display) -> EncodeError {
        match self.error.take() {
            Some(failure) => {
                let mut path = String::new();
                for segment in failure.segments.iter().rev() {
                    push_pointer_segment(&mut path, segment);
                }
                EncodeError {
                    path,
                    reason: failure.reason,
                }
            }
            None => EncodeError {
                path: String::new(),
                reason: format!("not valid JSON: {e}"),
            },
        }
    }
}

/// Encodes the JSON value it is given as `node`.
struct Seed<'a, 'e> {
    cx: &'a mut Cx<'e>,
    out: &'a mut Vec<u8>,
    node: NodeId,
}

impl<'de> DeserializeSeed<'de> for Seed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// A JSON scalar as found.
#[derive(Clone, Copy)]
enum Scalar<'s> {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(&'s str),
}

impl fmt::Display for Scalar<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Null => f.write_str("null"),
            Scalar::Bool(b) => write!(f, "{b}"),
            Scalar::Int(i) => write!(f, "{i}"),
            Scalar::Uint(u) => write!(f, "{u}"),
            Scalar::Float(x) => write!(f, "{x}"),
            Scalar::Str(s) => write!(f, "string {}", excerpt(s)),
        }
    }
}

impl Scalar<'_> {
    fn as_i64(self) -> Option<i64> {
        match self {
            Scalar::Int(i) => Some(i),
            Scalar::Uint(u) => i64::try_from(u).ok(),
            // -2^63 and 2^63 are exact in f64; integral values between convert exactly.
            Scalar::Float(x)
                if x.fract() == 0.0 && (i64::MIN as f64..-(i64::MIN as f64)).contains(&x) =>
            {
                Some(x as i64)
            }
            _ => None,
        }
    }

    fn as_f64(self) -> Option<f64> {
        match self {
            Scalar::Int(i) => Some(i as f64),
            Scalar::Uint(u) => Some(u as f64),
            Scalar::Float(x) => Some(x),
            _ => None,
        }
    }
}

/// What `node` expects, for errors.
fn expected(nodes: &[Node], node: NodeId) -> String {
    match &nodes[node] {
        Node::Null => "null".into(),
        Node::Boolean => "a boolean".into(),
        Node::Int => "an int (a 32-bit integer)".into(),
        Node::Long => "a long (a 64-bit integer)".into(),
        Node::Float => "a float (a number)".into(),
        Node::Double => "a double (a number)".into(),
        Node::Bytes => "bytes (a string of characters U+0000..U+00FF)".into(),
        Node::String => "a string".into(),
        Node::Decimal {
            precision, scale, ..
        } => format!(
            "a decimal of at most {precision} digits, {scale} after the point (a number or a string)"
        ),
        Node::Fixed { size } => {
            format!("fixed (a string of {size} characters U+0000..U+00FF)")
        }
        Node::Enum { symbols } => {
            let mut shown: Vec<&str> = symbols.iter().take(8).map(String::as_str).collect();
            if symbols.len() > shown.len() {
                shown.push("…");
            }
            format!("one of the symbols [{}]", shown.join(", "))
        }
        Node::Array(_) => "an array".into(),
        Node::Map(_) => "a map (an object)".into(),
        Node::Record(_) => "a record (an object)".into(),
        Node::Union(union) => {
            let names: Vec<&str> = union.branches.iter().map(|b| b.name.as_str()).collect();
            format!("a value of the union [{}]", names.join(", "))
        }
    }
}

/// Appends `scalar` as `node` if it fits, else says why not (and appends nothing).
fn put_scalar(
    nodes: &[Node],
    node: NodeId,
    scalar: Scalar<'_>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    if put(nodes, node, scalar, out) {
        Ok(())
    } else {
        Err(format!(
            "expected {}, found {scalar}",
            expected(nodes, node)
        ))
    }
}

/// Appends `scalar` as `node` if it fits (else nothing): [`put_scalar`] without the reason, for
/// trying a union's branches.
fn put(nodes: &[Node], node: NodeId, scalar: Scalar<'_>, out: &mut Vec<u8>) -> bool {
    match (&nodes[node], scalar) {
        (Node::Null, Scalar::Null) => true,
        (Node::Boolean, Scalar::Bool(b)) => {
            out.push(u8::from(b));
            true
        }
        (Node::Int, s) => match s.as_i64().and_then(|i| i32::try_from(i).ok()) {
            Some(i) => {
                put_zigzag(out, i64::from(i));
                true
            }
            None => false,
        },
        (Node::Long, s) => match s.as_i64() {
            Some(i) => {
                put_zigzag(out, i);
                true
            }
            None => false,
        },
        (Node::Float, s) => match s.as_f64() {
            Some(x) if !x.is_finite() || x.abs() <= f64::from(f32::MAX) => {
                out.extend_from_slice(&(x as f32).to_le_bytes());
                true
            }
            _ => false,
        },
        (Node::Double, s) => match s.as_f64() {
            Some(x) => {
                out.extend_from_slice(&x.to_le_bytes());
                true
            }
            None => false,
        },
        (Node::String, Scalar::Str(s)) => {
            put_zigzag(out, s.len() as i64);
            out.extend_from_slice(s.as_bytes());
            true
        }
        (Node::Bytes, Scalar::Str(s)) => put_latin1(s, None, out),
        (Node::Fixed { size }, Scalar::Str(s)) => put_latin1(s, Some(*size), out),
        (
            Node::Decimal {
                precision,
                scale,
                size,
            },
            scalar,
        ) => put_decimal(scalar, *precision, *scale, *size, out),
        (Node::Enum { symbols }, Scalar::Str(s)) => match symbols.iter().position(|y| y == s) {
            Some(i) => {
                put_zigzag(out, i as i64);
                true
            }
            None => false,
        },
        (Node::Union(union), scalar) => {
            for (i, branch) in union.branches.iter().enumerate() {
                let start = out.len();
                put_zigzag(out, i as i64);
                if put(nodes, branch.node, scalar, out) {
                    return true;
                }
                out.truncate(start);
            }
            false
        }
        _ => false,
    }
}

/// The largest decimal precision encoded (the digits of an i128).
const MAX_PRECISION: usize = 38;

/// Appends a decimal given as a JSON number or string (`"-12.50"`, `"1.5e3"`): its unscaled
/// value at `scale`, refusing digits beyond the scale (no rounding) or the precision.
fn put_decimal(
    scalar: Scalar<'_>,
    precision: usize,
    scale: usize,
    size: Option<usize>,
    out: &mut Vec<u8>,
) -> bool {
    let text;
    let digits = match scalar {
        Scalar::Str(s) => s,
        Scalar::Int(_) | Scalar::Uint(_) | Scalar::Float(_) => {
            text = scalar.to_string();
            &text
        }
        _ => return false,
    };
    let Some(unscaled) = unscaled(digits, precision, scale) else {
        return false;
    };
    let bytes = unscaled.to_be_bytes();
    // Sign extension: the leading bytes that only repeat the sign can go.
    let fill = if unscaled < 0 { 0xff } else { 0 };
    let mut first = 0;
    while first < bytes.len() - 1
        && bytes[first] == fill
        && (bytes[first + 1] & 0x80) == (fill & 0x80)
    {
        first += 1;
    }
    let minimal = &bytes[first..];
    match size {
        None => {
            put_zigzag(out, minimal.len() as i64);
            out.extend_from_slice(minimal);
        }
        Some(size) if size >= minimal.len() => {
            out.extend(std::iter::repeat_n(fill, size - minimal.len()));
            out.extend_from_slice(minimal);
        }
        Some(_) => return false,
    }
    true
}

/// The unscaled value of decimal text at `scale`, if it has at most `precision` digits and no
/// non-zero digit beyond the scale.
fn unscaled(text: &str, precision: usize, scale: usize) -> Option<i128> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i32>().ok()?),
        None => (rest, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if (whole.is_empty() && fraction.is_empty())
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    // The digits, and the power of ten they are to be multiplied by to be at the scale.
    let shift = i64::from(exponent) - fraction.len() as i64 + scale as i64;
    let mut digits: Vec<u8> = whole
        .bytes()
        .chain(fraction.bytes())
        .map(|b| b - b'0')
        .collect();
    if shift < 0 {
        let cut = digits.len().saturating_sub(usize::try_from(-shift).ok()?);
        if digits[cut..].iter().any(|&d| d != 0) {
            return None;
        }
        digits.truncate(cut);
    } else {
        digits.extend(std::iter::repeat_n(
            0,
            usize::try_from(shift).ok()?.min(precision + 1),
        ));
    }
    let significant: Vec<u8> = digits.into_iter().skip_while(|&d| d == 0).collect();
    if significant.len() > precision {
        return None;
    }
    let mut value: i128 = 0;
    for d in significant {
        value = value.checked_mul(10)?.checked_add(i128::from(d))?;
    }
    Some(if negative { -value } else { value })
}

/// Appends the bytes a string of characters U+0000..U+00FF stands for: with a `size` (fixed)
/// exactly that many, else preceded by their count.
fn put_latin1(s: &str, size: Option<usize>, out: &mut Vec<u8>) -> bool {
    let count = s.chars().count();
    if size.is_some_and(|size| size != count) || s.chars().any(|c| u32::from(c) > 0xff) {
        return false;
    }
    if size.is_none() {
        put_zigzag(out, count as i64);
    }
    if s.is_ascii() {
        out.extend_from_slice(s.as_bytes());
    } else {
        out.extend(s.chars().map(|c| u32::from(c) as u8));
    }
    true
}

impl<'de> Visitor<'de> for Seed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&expected(self.cx.nodes, self.node))
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.scalar(Scalar::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.scalar(Scalar::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.scalar(Scalar::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.scalar(Scalar::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.scalar(Scalar::Uint(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.scalar(Scalar::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.scalar(Scalar::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, seq: A) -> Result<(), A::Error> {
        let nodes = self.cx.nodes;
        match &nodes[self.node] {
            Node::Array(items) => array(self.cx, self.out, *items, seq),
            Node::Union(union) => {
                let Some(i) = union
                    .branches
                    .iter()
                    .position(|b| matches!(nodes[b.node], Node::Array(_)))
                else {
                    return Err(self.mismatch("an array"));
                };
                put_zigzag(self.out, i as i64);
                self.node = union.branches[i].node;
                self.visit_seq(seq)
            }
            _ => Err(self.mismatch("an array")),
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        match &self.cx.nodes[self.node] {
            Node::Record(record) => encode_record(self.cx, self.out, record, map),
            Node::Map(values) => encode_map(self.cx, self.out, *values, map),
            Node::Union(union) => {
                let object = Value::deserialize(de::value::MapAccessDeserializer::new(map))?;
                union_object(self.cx, self.out, union, &object).map_err(|e| {
                    // The failure is recorded in the context; only its kind crosses over.
                    de::Error::custom(e)
                })
            }
            _ => Err(self.mismatch("an object")),
        }
    }
}

impl Seed<'_, '_> {
    fn scalar<E: de::Error>(self, scalar: Scalar<'_>) -> Result<(), E> {
        put_scalar(self.cx.nodes, self.node, scalar, self.out)
            .map_err(|reason| self.cx.fail(reason))
    }

    fn mismatch<E: de::Error>(self, found: &str) -> E {
        let reason = format!(
            "expected {}, found {found}",
            expected(self.cx.nodes, self.node)
        );
        self.cx.fail(reason)
    }
}

/// Avro arrays and maps are blocks: a count, the items, and 0. The count is written before the
/// items once they are counted.
fn close_block(out: &mut Vec<u8>, start: usize, count: i64) {
    if count > 0 {
        // The count's varint is at most 10 bytes: written at the end, then rotated into place.
        let end = out.len();
        put_zigzag(out, count);
        let prefix = out.len() - end;
        out[start..].rotate_right(prefix);
    }
    out.push(0);
}

fn array<'de, A: SeqAccess<'de>>(
    cx: &mut Cx<'_>,
    out: &mut Vec<u8>,
    items: NodeId,
    mut seq: A,
) -> Result<(), A::Error> {
    let start = out.len();
    let mut count = 0i64;
    loop {
        let item = Seed {
            cx: &mut *cx,
            out: &mut *out,
            node: items,
        };
        match seq.next_element_seed(item) {
            Ok(Some(())) => count += 1,
            Ok(None) => break,
            Err(e) => return Err(cx.locate(|| count.to_string(), e)),
        }
    }
    close_block(out, start, count);
    Ok(())
}

/// Writes a map key as an Avro string.
struct KeySeed<'a>(&'a mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for KeySeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        put_zigzag(self.0, v.len() as i64);
        self.0.extend_from_slice(v.as_bytes());
        Ok(())
    }
}

/// The key of a map entry written at `at` (its length, then its bytes), for an error's path.
fn written_key(out: &[u8], at: usize) -> String {
    let mut len = 0u64;
    let mut shift = 0;
    let mut i = at;
    while let Some(&b) = out.get(i) {
        len |= u64::from(b & 0x7f) << shift;
        shift += 7;
        i += 1;
        if b < 0x80 || shift > 63 {
            break;
        }
    }
    let len = usize::try_from(len >> 1).unwrap_or(0);
    let bytes = out.get(i..i.saturating_add(len)).unwrap_or_default();
    String::from_utf8_lossy(bytes).into_owned()
}

fn encode_map<'de, A: MapAccess<'de>>(
    cx: &mut Cx<'_>,
    out: &mut Vec<u8>,
    values: NodeId,
    mut map: A,
) -> Result<(), A::Error> {
    let start = out.len();
    let mut count = 0i64;
    loop {
        let key_at = out.len();
        match map.next_key_seed(KeySeed(&mut *out)) {
            Ok(Some(())) => {}
            Ok(None) => break,
            Err(e) => return Err(cx.locate(String::new, e)),
        }
        let value = Seed {
            cx: &mut *cx,
            out: &mut *out,
            node: values,
        };
        if let Err(e) = map.next_value_seed(value) {
            let key = written_key(out, key_at);
            return Err(cx.locate(|| key, e));
        }
        count += 1;
    }
    close_block(out, start, count);
    Ok(())
}

/// Finds a record's field by name, looking first where the next field in order would be.
struct FieldSeed<'a> {
    fields: &'a [Field],
    hint: usize,
}

impl<'de> DeserializeSeed<'de> for FieldSeed<'_> {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<usize>, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<usize>, E> {
        if self.fields.get(self.hint).is_some_and(|f| f.name == v) {
            return Ok(Some(self.hint));
        }
        Ok(self.fields.iter().position(|f| f.name == v))
    }
}

/// Writes the fields in the schema's order: a field that comes in order goes straight to `out`,
/// one that comes early waits in `parked` until those before it are written.
fn encode_record<'de, A: MapAccess<'de>>(
    cx: &mut Cx<'_>,
    out: &mut Vec<u8>,
    record: &Record,
    mut map: A,
) -> Result<(), A::Error> {
    let fields = &record.fields;
    let mut next = 0;
    let mut scratch = Vec::new();
    // Ranges of `scratch`, by field; allocated when a field first comes early.
    let mut parked: Vec<Option<(usize, usize)>> = Vec::new();
    loop {
        let found = map.next_key_seed(FieldSeed { fields, hint: next });
        let k = match found {
            Ok(Some(Some(k))) => k,
            Ok(Some(None)) => {
                map.next_value::<IgnoredAny>()
                    .map_err(|e| cx.locate(String::new, e))?;
                continue;
            }
            Ok(None) => break,
            Err(e) => return Err(cx.locate(String::new, e)),
        };
        let field = &fields[k];
        if k < next || parked.get(k).is_some_and(Option::is_some) {
            let e = cx.fail("the field appears more than once".to_owned());
            return Err(cx.locate(|| field.name.clone(), e));
        }
        let (target, parking) = if k == next {
            (&mut *out, false)
        } else {
            (&mut scratch, true)
        };
        let at = target.len();
        let value = Seed {
            cx: &mut *cx,
            out: target,
            node: field.node,
        };
        if let Err(e) = map.next_value_seed(value) {
            return Err(cx.locate(|| field.name.clone(), e));
        }
        if parking {
            if parked.is_empty() {
                parked.resize(fields.len(), None);
            }
            parked[k] = Some((at, scratch.len()));
            continue;
        }
        next += 1;
        while let Some(Some((from, to))) = parked.get(next) {
            out.extend_from_slice(&scratch[*from..*to]);
            next += 1;
        }
    }
    for (k, field) in fields.iter().enumerate().skip(next) {
        match (parked.get(k).copied().flatten(), &field.default) {
            (Some((from, to)), _) => out.extend_from_slice(&scratch[from..to]),
            (None, Some(default)) => out.extend_from_slice(default),
            (None, None) => {
                let e = cx.fail(format!(
                    "missing (the field has no default): expected {}",
                    expected(cx.nodes, field.node)
                ));
                return Err(cx.locate(|| field.name.clone(), e));
            }
        }
    }
    Ok(())
}

/// An object for a union: Avro's JSON encoding `{"<branch>": value}` when it cannot be a plain
/// value; else the first record or map branch it fits.
fn union_object(
    cx: &mut Cx<'_>,
    out: &mut Vec<u8>,
    union: &Union,
    object: &Value,
) -> Result<(), serde_json::Error> {
    let nodes = cx.nodes;
    if let Some((i, inner)) = wrapped_branch(nodes, union, object) {
        put_zigzag(out, i as i64);
        let seed = Seed {
            cx: &mut *cx,
            out,
            node: union.branches[i].node,
        };
        let name = union.branches[i].name.clone();
        return seed.deserialize(inner).map_err(|e| cx.locate(|| name, e));
    }
    let candidates: Vec<usize> = (0..union.branches.len())
        .filter(|&i| {
            matches!(
                nodes[union.branches[i].node],
                Node::Record(_) | Node::Map(_)
            )
        })
        .collect();
    let start = out.len();
    for &i in &candidates {
        put_zigzag(out, i as i64);
        let seed = Seed {
            cx: &mut *cx,
            out: &mut *out,
            node: union.branches[i].node,
        };
        match seed.deserialize(object) {
            Ok(()) => return Ok(()),
            // The only branch an object can be: its error is the precise one.
            Err(e) if candidates.len() == 1 => return Err(e),
            Err(_) => {
                cx.error = None;
                out.truncate(start);
            }
        }
    }
    let names: Vec<&str> = union.branches.iter().map(|b| b.name.as_str()).collect();
    let reason = if candidates.is_empty() {
        format!(
            "expected a value of the union [{}], found an object",
            names.join(", ")
        )
    } else {
        format!(
            "the object fits no branch of the union [{}] (a record branch needs its fields without defaults)",
            names.join(", ")
        )
    };
    Err(cx.fail(reason))
}

/// The branch and value of `{"<branch name>": value}`, Avro's JSON encoding of a union value:
/// only when the union has no map branch and no record branch with a field of that name, for
/// which the object would be a plain value.
fn wrapped_branch<'v>(
    nodes: &[Node],
    union: &Union,
    object: &'v Value,
) -> Option<(usize, &'v Value)> {
    let Value::Object(members) = object else {
        return None;
    };
    if members.len() != 1 || union.has_map {
        return None;
    }
    let (key, inner) = members.iter().next()?;
    let a_field = union.branches.iter().any(|b| match &nodes[b.node] {
        Node::Record(r) => r.fields.iter().any(|f| &f.name == key),
        _ => false,
    });
    if a_field {
        return None;
    }
    if let Some(i) = union.branches.iter().position(|b| &b.name == key) {
        return Some((i, inner));
    }
    let mut by_short = union
        .branches
        .iter()
        .enumerate()
        .filter(|(_, b)| b.short_name.as_ref() == Some(key));
    match (by_short.next(), by_short.next()) {
        (Some((i, _)), None) => Some((i, inner)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use apache_avro::types::Value as Avro;
    #[allow(deprecated)]
    use apache_avro::{Schema, from_avro_datum, to_avro_datum};
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use crate::encode::{EncodeError, Encoder, RegisteredSchema, SchemaError, SchemaKind};

    const READING: &str = r#"{
      "type": "record", "name": "Reading", "namespace": "plant",
      "fields": [
        {"name": "device", "type": "string"},
        {"name": "temp", "type": "double"},
        {"name": "humidity", "type": ["null", "double"], "default": null},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["ok", "degraded", "failed"]}},
        {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []},
        {"name": "counters", "type": {"type": "map", "values": "long"}, "default": {}},
        {"name": "raw", "type": "bytes", "default": "\u00ff"},
        {"name": "mac", "type": {"type": "fixed", "name": "Mac", "size": 4}},
        {"name": "ok", "type": "boolean", "default": true},
        {"name": "battery", "type": "float", "default": 1.0},
        {"name": "line", "type": "int", "default": 0},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}, "default": 0},
        {"name": "id", "type": {"type": "string", "logicalType": "uuid"}, "default": "00000000-0000-0000-0000-000000000000"}
      ]
    }"#;

    /// A record type used twice, a union of records, a recursive type.
    const SHAPES: &str = r#"{
      "type": "record", "name": "Shapes", "namespace": "geo",
      "fields": [
        {"name": "from", "type": {"type": "record", "name": "Point", "fields": [
          {"name": "x", "type": "double"}, {"name": "y", "type": "double"}]}},
        {"name": "to", "type": "Point"},
        {"name": "via", "type": ["null", "Point"], "default": null},
        {"name": "label", "type": ["null", "string", "long", "boolean"], "default": null},
        {"name": "events", "type": {"type": "array", "items": {"type": "record", "name": "Event", "fields": [
          {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["start", "stop"]}},
          {"name": "at", "type": "long"}]}}, "default": []},
        {"name": "chain", "type": ["null", {"type": "record", "name": "Link", "fields": [
          {"name": "value", "type": "int"}, {"name": "next", "type": ["null", "Link"]}]}], "default": null}
      ]
    }"#;

    fn encoder(text: &str) -> Encoder {
        let schema = RegisteredSchema {
            id: 7,
            kind: SchemaKind::Avro,
            text: text.to_owned(),
        };
        match Encoder::compile(&schema, None) {
            Ok(e) => e,
            Err(e) => panic!("{e}"),
        }
    }

    fn encode(text: &str, json: &str) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        encoder(text)
            .encode(json.as_bytes(), &mut out)
            .map(|()| out)
    }

    #[allow(deprecated)] // GenericDatumReader's builder says the same at more length.
    fn from_datum(schema: &Schema, body: &mut &[u8]) -> Avro {
        from_avro_datum(schema, body, None).unwrap()
    }

    #[allow(deprecated)]
    fn to_datum(schema: &Schema, value: Avro) -> Vec<u8> {
        to_avro_datum(schema, value).unwrap()
    }

    /// Decodes a record with apache-avro, checking the header and that nothing trails.
    fn decode(text: &str, record: &[u8]) -> Avro {
        assert_eq!(record[..5], [0, 0, 0, 0, 7], "magic byte and schema id");
        let schema = Schema::parse_str(text).unwrap();
        let mut body = &record[5..];
        let value = from_datum(&schema, &mut body);
        assert!(body.is_empty(), "{} bytes trail the datum", body.len());
        value
    }

    fn roundtrip(text: &str, json: &str) -> Avro {
        match encode(text, json) {
            Ok(record) => decode(text, &record),
            Err(e) => panic!("{json}: {e}"),
        }
    }

    fn field<'v>(value: &'v Avro, name: &str) -> &'v Avro {
        match value {
            Avro::Record(fields) => &fields.iter().find(|(n, _)| n == name).unwrap().1,
            other => panic!("not a record: {other:?}"),
        }
    }

    fn error(text: &str, json: &str) -> EncodeError {
        match encode(text, json) {
            Err(e) => e,
            Ok(_) => panic!("{json} encoded"),
        }
    }

    #[test]
    fn a_reading_roundtrips_through_apache_avro_byte_for_byte() {
        // Fields out of order, one unknown, the defaults omitted.
        let json = r#"{"ts": 1732600000123, "status": "degraded", "extra": {"ignored": [1, 2]},
            "temp": 21.37, "device": "plant-7/line-3/sensor-12", "humidity": 48.2,
            "tags": ["a", "b"], "counters": {"resets": 3}, "mac": "\u0001\u0002\u00fe\u00ff",
            "battery": 0.5, "line": -3, "day": 20000}"#;
        let record = encode(READING, json).unwrap();
        let expected = Avro::Record(vec![
            (
                "device".into(),
                Avro::String("plant-7/line-3/sensor-12".into()),
            ),
            ("temp".into(), Avro::Double(21.37)),
            (
                "humidity".into(),
                Avro::Union(1, Box::new(Avro::Double(48.2))),
            ),
            ("ts".into(), Avro::TimestampMillis(1_732_600_000_123)),
            ("status".into(), Avro::Enum(1, "degraded".into())),
            (
                "tags".into(),
                Avro::Array(vec![Avro::String("a".into()), Avro::String("b".into())]),
            ),
            (
                "counters".into(),
                Avro::Map(HashMap::from([("resets".into(), Avro::Long(3))])),
            ),
            ("raw".into(), Avro::Bytes(vec![0xff])),
            ("mac".into(), Avro::Fixed(4, vec![1, 2, 0xfe, 0xff])),
            ("ok".into(), Avro::Boolean(true)),
            ("battery".into(), Avro::Float(0.5)),
            ("line".into(), Avro::Int(-3)),
            ("day".into(), Avro::Date(20000)),
            (
                "id".into(),
                Avro::Uuid("00000000-0000-0000-0000-000000000000".parse().unwrap()),
            ),
        ]);
        assert_eq!(decode(READING, &record), expected);
        let schema = Schema::parse_str(READING).unwrap();
        assert_eq!(record[5..], to_datum(&schema, expected)[..]);
    }

    #[test]
    fn named_types_are_shared_and_may_recurse() {
        let json = r#"{"from": {"x": 1, "y": 2}, "to": {"y": 4.5, "x": 3},
            "via": {"x": 0, "y": 0}, "events": [{"kind": "start", "at": 1}, {"at": 2, "kind": "stop"}],
            "chain": {"value": 1, "next": {"value": 2, "next": {"value": 3, "next": null}}}}"#;
        let v = roundtrip(SHAPES, json);
        let point = |x, y| {
            Avro::Record(vec![
                ("x".into(), Avro::Double(x)),
                ("y".into(), Avro::Double(y)),
            ])
        };
        assert_eq!(field(&v, "from"), &point(1.0, 2.0));
        assert_eq!(field(&v, "to"), &point(3.0, 4.5));
        assert_eq!(field(&v, "via"), &Avro::Union(1, Box::new(point(0.0, 0.0))));
        assert_eq!(field(&v, "label"), &Avro::Union(0, Box::new(Avro::Null)));
        let Avro::Union(1, chain) = field(&v, "chain") else {
            panic!("no chain")
        };
        let Avro::Union(1, next) = field(chain, "next") else {
            panic!("no second link")
        };
        assert_eq!(field(next, "value"), &Avro::Int(2));
    }

    #[test]
    fn a_plain_value_takes_the_first_branch_it_fits() {
        let union = |label: &str| {
            let json = format!(
                r#"{{"from": {{"x": 0, "y": 0}}, "to": {{"x": 0, "y": 0}}, "label": {label}}}"#
            );
            field(&roundtrip(SHAPES, &json), "label").clone()
        };
        assert_eq!(union("null"), Avro::Union(0, Box::new(Avro::Null)));
        assert_eq!(
            union(r#""x""#),
            Avro::Union(1, Box::new(Avro::String("x".into())))
        );
        assert_eq!(union("42"), Avro::Union(2, Box::new(Avro::Long(42))));
        assert_eq!(union("true"), Avro::Union(3, Box::new(Avro::Boolean(true))));
        // Avro's JSON encoding of a union names the branch.
        assert_eq!(
            union(r#"{"long": 42}"#),
            Avro::Union(2, Box::new(Avro::Long(42)))
        );
        assert_eq!(
            union(r#"{"string": "42"}"#),
            Avro::Union(1, Box::new(Avro::String("42".into())))
        );
        let e = error(
            SHAPES,
            r#"{"from": {"x": 0, "y": 0}, "to": {"x": 0, "y": 0}, "label": 1.5}"#,
        );
        assert_eq!(e.path, "/label");
        assert!(e.reason.contains("[null, string, long, boolean]"), "{e}");
        assert!(e.reason.contains("found 1.5"), "{e}");
    }

    #[test]
    fn a_wrapped_value_names_the_branch_by_its_full_or_short_name() {
        let doubles = r#"["null", "double", {"type": "record", "name": "P", "namespace": "n", "fields": [{"name": "v", "type": "double"}]}]"#;
        assert_eq!(
            roundtrip(doubles, r#"{"double": 1.5}"#),
            Avro::Union(1, Box::new(Avro::Double(1.5)))
        );
        let p = Avro::Union(
            2,
            Box::new(Avro::Record(vec![("v".into(), Avro::Double(2.0))])),
        );
        assert_eq!(roundtrip(doubles, r#"{"n.P": {"v": 2}}"#), p);
        assert_eq!(roundtrip(doubles, r#"{"P": {"v": 2}}"#), p);
        // A plain object is the record it fits.
        assert_eq!(roundtrip(doubles, r#"{"v": 2}"#), p);
        // With a map branch, a one-member object is a map, not a wrapped value.
        let map = r#"["null", "double", {"type": "map", "values": "double"}]"#;
        assert_eq!(
            roundtrip(map, r#"{"double": 1.5}"#),
            Avro::Union(
                2,
                Box::new(Avro::Map(HashMap::from([(
                    "double".into(),
                    Avro::Double(1.5)
                )])))
            )
        );
        // A record with a field of the branch's name: the plain value.
        let field_named_long = r#"["long", {"type": "record", "name": "R", "fields": [{"name": "long", "type": "long"}]}]"#;
        assert_eq!(
            roundtrip(field_named_long, r#"{"long": 5}"#),
            Avro::Union(
                1,
                Box::new(Avro::Record(vec![("long".into(), Avro::Long(5))]))
            )
        );
    }

    #[test]
    fn a_missing_field_takes_its_default_or_null() {
        let text = r#"{"type": "record", "name": "R", "fields": [
            {"name": "a", "type": ["null", "double"]},
            {"name": "b", "type": ["string", "null"]},
            {"name": "c", "type": ["string", "null"], "default": "c"},
            {"name": "d", "type": "long", "default": 7},
            {"name": "e", "type": "long"}
        ]}"#;
        assert_eq!(
            roundtrip(text, r#"{"e": 1}"#),
            Avro::Record(vec![
                ("a".into(), Avro::Union(0, Box::new(Avro::Null))),
                ("b".into(), Avro::Union(1, Box::new(Avro::Null))),
                (
                    "c".into(),
                    Avro::Union(0, Box::new(Avro::String("c".into())))
                ),
                ("d".into(), Avro::Long(7)),
                ("e".into(), Avro::Long(1)),
            ])
        );
        // Given, a field's value is not replaced by its default.
        let e = error(text, r#"{"e": 1, "d": null}"#);
        assert_eq!(
            (e.path.as_str(), e.reason.as_str()),
            ("/d", "expected a long (a 64-bit integer), found null")
        );
        let e = error(text, r#"{"a": 1}"#);
        assert_eq!(e.path, "/e");
        assert!(
            e.reason.starts_with("missing (the field has no default)"),
            "{e}"
        );
    }

    #[test]
    fn records_in_a_union_are_told_apart_by_their_fields() {
        let text = r#"["null",
            {"type": "record", "name": "A", "fields": [{"name": "a", "type": "long"}]},
            {"type": "record", "name": "B", "fields": [{"name": "b", "type": "string"}]}]"#;
        assert_eq!(
            roundtrip(text, r#"{"b": "x"}"#),
            Avro::Union(
                2,
                Box::new(Avro::Record(vec![("b".into(), Avro::String("x".into()))]))
            )
        );
        let e = error(text, r#"{"c": 1}"#);
        assert_eq!(e.path, "");
        assert!(e.reason.contains("fits no branch"), "{e}");
        // The only record branch: its own error, with its path.
        let one = r#"["null", {"type": "record", "name": "A", "fields": [{"name": "a", "type": "long"}]}]"#;
        let e = error(one, r#"{"a": "x"}"#);
        assert_eq!(e.path, "/a");
        assert!(e.reason.contains("expected a long"), "{e}");
    }

    #[test]
    fn errors_name_the_field_and_what_was_expected() {
        let base = [
            ("device", r#""d""#),
            ("temp", "1"),
            ("ts", "1"),
            ("status", r#""ok""#),
            ("mac", r#""abcd""#),
        ];
        let cases = [
            (
                "temp",
                r#""warm""#,
                "/temp",
                "expected a double (a number), found string \"warm\"",
            ),
            (
                "ts",
                "1.5",
                "/ts",
                "expected a long (a 64-bit integer), found 1.5",
            ),
            (
                "ts",
                "9223372036854775808",
                "/ts",
                "found 9223372036854775808",
            ),
            (
                "line",
                "2147483648",
                "/line",
                "expected an int (a 32-bit integer)",
            ),
            (
                "status",
                r#""on fire""#,
                "/status",
                "one of the symbols [ok, degraded, failed]",
            ),
            ("mac", r#""abc""#, "/mac", "fixed (a string of 4 characters"),
            ("raw", r#""\u0100""#, "/raw", "expected bytes"),
            (
                "tags",
                r#"["a", 2]"#,
                "/tags/1",
                "expected a string, found 2",
            ),
            (
                "counters",
                r#"{"a/b": 1, "c~d": "x"}"#,
                "/counters/c~0d",
                "expected a long",
            ),
            (
                "humidity",
                r#""wet""#,
                "/humidity",
                "a value of the union [null, double]",
            ),
            (
                "tags",
                r#""a""#,
                "/tags",
                "expected an array, found string \"a\"",
            ),
            ("battery", "1e300", "/battery", "expected a float"),
        ];
        for (key, value, path, reason) in cases {
            let members: Vec<String> = base
                .iter()
                .filter(|(k, _)| *k != key)
                .chain([&(key, value)])
                .map(|(k, v)| format!("{k:?}: {v}"))
                .collect();
            let json = format!("{{{}}}", members.join(", "));
            let e = error(READING, &json);
            assert_eq!(e.path, path, "{json}: {e}");
            assert!(e.reason.contains(reason), "{json}: {e}");
        }
        let e = error(
            READING,
            r#"{"device": "d", "temp": 1, "ts": 1, "status": "ok", "mac": "abcd", "device": "e"}"#,
        );
        assert_eq!(
            (e.path.as_str(), e.reason.as_str()),
            ("/device", "the field appears more than once")
        );
        let e = error(
            READING,
            r#"{"device": "d", "temp": 1, "status": "ok", "mac": "abcd"}"#,
        );
        assert_eq!(e.path, "/ts");
        assert!(e.reason.starts_with("missing"), "{e}");
        let e = error(READING, r#"[1, 2]"#);
        assert_eq!(
            (e.path.as_str(), e.reason.as_str()),
            ("", "expected a record (an object), found an array")
        );
        let e = error(SHAPES, r#"{"from": {"x": 0, "y": 0}, "to": {"x": 0}}"#);
        assert_eq!(e.path, "/to/y");
        let e = error(
            SHAPES,
            r#"{"from": {"x": 0, "y": 0}, "to": {"x": 0, "y": 0}, "events": [{"kind": "start", "at": 1}, {"kind": "pause", "at": 2}]}"#,
        );
        assert_eq!(e.path, "/events/1/kind");
    }

    #[test]
    fn a_long_string_is_quoted_short() {
        let e = error(
            READING,
            &format!(r#"{{"device": "d", "temp": "{}"}}"#, "x".repeat(10_000)),
        );
        assert!(e.reason.len() < 120, "{e}");
    }

    #[test]
    fn malformed_json_is_an_error_at_where_it_broke() {
        let e = error(READING, r#"{"device": "d", "temp": 1"#);
        assert!(e.reason.starts_with("not valid JSON"), "{e}");
        let e = error(READING, r#"{"device": "d", "temp": tru}"#);
        assert_eq!(e.path, "/temp");
        assert!(e.reason.starts_with("not valid JSON"), "{e}");
        let e = error("\"long\"", "1 2");
        assert_eq!(e.path, "");
        assert!(e.reason.contains("trailing characters"), "{e}");
    }

    #[test]
    fn a_failed_encoding_leaves_the_buffer_as_it_was() {
        let mut out = b"earlier".to_vec();
        let result = encoder(READING).encode(br#"{"device": "d", "temp": 1, "ts": "x"}"#, &mut out);
        assert!(result.is_err());
        assert_eq!(out, b"earlier");
    }

    #[test]
    fn unusable_schemas_are_refused_when_compiled() {
        let compile = |text: &str| {
            let schema = RegisteredSchema {
                id: 1,
                kind: SchemaKind::Avro,
                text: text.into(),
            };
            Encoder::compile(&schema, None)
        };
        let duration = r#"{"type": "record", "name": "R", "fields": [{"name": "took",
            "type": {"type": "fixed", "name": "D", "size": 12, "logicalType": "duration"}}]}"#;
        match compile(duration) {
            Err(SchemaError::AvroUnsupported { path, construct }) => {
                assert_eq!(path, "took");
                assert!(construct.contains("duration"), "{construct}");
            }
            other => panic!("{other:?}"),
        }
        let wide = r#"{"type": "record", "name": "R", "fields": [{"name": "n",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 40, "scale": 0}}]}"#;
        assert!(matches!(
            compile(wide),
            Err(SchemaError::AvroUnsupported { .. })
        ));
        let bad = r#"{"type": "record", "name": "R", "fields": [{"name": "a", "type": "nope"}]}"#;
        assert!(matches!(compile(bad), Err(SchemaError::AvroParse(_))));
    }

    #[test]
    fn decimals_are_their_unscaled_value_in_twos_complement() {
        let text = r#"{"type": "record", "name": "R", "fields": [
            {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 6, "scale": 2}},
            {"name": "total", "type": ["null", {"type": "fixed", "name": "F", "size": 4, "logicalType": "decimal", "precision": 9, "scale": 3}]}
        ]}"#;
        let unscaled = |v: &Avro| -> Vec<u8> {
            match v {
                Avro::Decimal(d) => Vec::<u8>::try_from(d).unwrap(),
                Avro::Union(_, inner) => match &**inner {
                    Avro::Decimal(d) => Vec::<u8>::try_from(d).unwrap(),
                    other => panic!("{other:?}"),
                },
                other => panic!("{other:?}"),
            }
        };
        let cases: [(&str, &[u8], &str, &[u8]); 5] = [
            (
                r#""12.34""#,
                &[0x04, 0xd2],
                "-1.5",
                &[0xff, 0xff, 0xfa, 0x24],
            ),
            ("12.3", &[0x04, 0xce], r#""0""#, &[0, 0, 0, 0]),
            (
                r#""-0.01""#,
                &[0xff],
                r#""1.5e3""#,
                &[0x00, 0x16, 0xe3, 0x60],
            ),
            ("1", &[0x64], "128.000", &[0x00, 0x01, 0xf4, 0x00]),
            (
                r#""9999.99""#,
                &[0x0f, 0x42, 0x3f],
                r#""+0.128""#,
                &[0, 0, 0, 0x80],
            ),
        ];
        for (price, price_bytes, total, total_bytes) in cases {
            let json = format!(r#"{{"price": {price}, "total": {total}}}"#);
            let v = roundtrip(text, &json);
            assert_eq!(unscaled(field(&v, "price")), price_bytes, "{json}");
            assert_eq!(unscaled(field(&v, "total")), total_bytes, "{json}");
        }
        for (price, why) in [
            (r#""12.345""#, "more decimals than the scale"),
            (r#""10000.00""#, "more digits than the precision"),
            (r#""12,3""#, "not a number"),
            ("true", "not a number"),
        ] {
            let e = error(text, &format!(r#"{{"price": {price}, "total": null}}"#));
            assert_eq!(e.path, "/price", "{why}");
            assert!(
                e.reason
                    .starts_with("expected a decimal of at most 6 digits, 2 after the point"),
                "{e}"
            );
        }
    }

    #[test]
    fn header_is_magic_byte_and_big_endian_id() {
        let schema = RegisteredSchema {
            id: 0x0102_0304,
            kind: SchemaKind::Avro,
            text: "\"long\"".into(),
        };
        let mut out = Vec::new();
        Encoder::compile(&schema, None)
            .unwrap()
            .encode(b"-1", &mut out)
            .unwrap();
        assert_eq!(out, [0, 1, 2, 3, 4, 1]);
    }

    /// A random value of `schema`: the JSON a device would send (fields shuffled, an unknown
    /// one added) and the Avro value apache-avro must decode from its encoding.
    fn value_of(
        schema: &Schema,
        names: &HashMap<String, Schema>,
        depth: u32,
    ) -> BoxedStrategy<(Value, Avro)> {
        match schema {
            Schema::Null => Just((Value::Null, Avro::Null)).boxed(),
            Schema::Boolean => any::<bool>()
                .prop_map(|b| (json!(b), Avro::Boolean(b)))
                .boxed(),
            Schema::Int => any::<i32>().prop_map(|i| (json!(i), Avro::Int(i))).boxed(),
            Schema::Date => any::<i32>().prop_map(|i| (json!(i), Avro::Date(i))).boxed(),
            Schema::Long => any::<i64>().prop_map(|i| (json!(i), Avro::Long(i))).boxed(),
            Schema::TimestampMillis => any::<i64>()
                .prop_map(|i| (json!(i), Avro::TimestampMillis(i)))
                .boxed(),
            Schema::Float => any::<f32>()
                .prop_filter("finite", |x| x.is_finite())
                .prop_map(|x| (json!(f64::from(x)), Avro::Float(x)))
                .boxed(),
            Schema::Double => any::<f64>()
                .prop_filter("finite", |x| x.is_finite())
                .prop_map(|x| (json!(x), Avro::Double(x)))
                .boxed(),
            Schema::String => ".{0,12}".prop_map(|s| (json!(s), Avro::String(s))).boxed(),
            Schema::Bytes => proptest::collection::vec(any::<u8>(), 0..8)
                .prop_map(|b| (json!(latin1(&b)), Avro::Bytes(b)))
                .boxed(),
            Schema::Fixed(f) => {
                let size = f.size;
                proptest::collection::vec(any::<u8>(), size)
                    .prop_map(move |b| (json!(latin1(&b)), Avro::Fixed(size, b)))
                    .boxed()
            }
            Schema::Enum(e) => {
                let symbols = e.symbols.clone();
                (0..symbols.len())
                    .prop_map(move |i| {
                        (json!(symbols[i]), Avro::Enum(i as u32, symbols[i].clone()))
                    })
                    .boxed()
            }
            Schema::Array(a) => proptest::collection::vec(value_of(&a.items, names, depth), 0..4)
                .prop_map(|items| {
                    let (json, avro): (Vec<_>, Vec<_>) = items.into_iter().unzip();
                    (Value::Array(json), Avro::Array(avro))
                })
                .boxed(),
            Schema::Map(m) => {
                proptest::collection::hash_map(".{0,6}", value_of(&m.types, names, depth), 0..4)
                    .prop_map(|entries| {
                        let json = entries
                            .iter()
                            .map(|(k, (j, _))| (k.clone(), j.clone()))
                            .collect();
                        let avro = entries.into_iter().map(|(k, (_, a))| (k, a)).collect();
                        (Value::Object(json), Avro::Map(avro))
                    })
                    .boxed()
            }
            Schema::Record(r) => {
                let fields: Vec<_> = r
                    .fields
                    .iter()
                    .map(|f| {
                        let name = f.name.clone();
                        value_of(&f.schema, names, depth).prop_map(move |v| (name.clone(), v))
                    })
                    .collect();
                (fields, any::<bool>())
                    .prop_flat_map(|(fields, extra)| {
                        let avro = Avro::Record(
                            fields
                                .iter()
                                .map(|(n, (_, a))| (n.clone(), a.clone()))
                                .collect(),
                        );
                        let mut members: Vec<(String, Value)> =
                            fields.into_iter().map(|(n, (j, _))| (n, j)).collect();
                        if extra {
                            members.push(("unknown-to-the-schema".into(), json!({"a": [1, "b"]})));
                        }
                        Just(members).prop_shuffle().prop_map(move |members| {
                            (Value::Object(members.into_iter().collect()), avro.clone())
                        })
                    })
                    .boxed()
            }
            Schema::Union(u) => {
                let branches: Vec<_> = u
                    .variants()
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| {
                        depth > 0 || !matches!(b, Schema::Ref { .. } | Schema::Record(_))
                    })
                    .map(|(i, b)| {
                        let wrapper = match b {
                            Schema::Null => "null",
                            Schema::Double => "double",
                            Schema::String => "string",
                            Schema::Long => "long",
                            Schema::Boolean => "boolean",
                            _ => "",
                        };
                        (value_of(b, names, depth.saturating_sub(1)), any::<bool>())
                            .prop_map(move |((json, avro), wrap)| {
                                let json = if wrap && !wrapper.is_empty() {
                                    json!({ wrapper: json })
                                } else {
                                    json
                                };
                                (json, Avro::Union(i as u32, Box::new(avro)))
                            })
                            .boxed()
                    })
                    .collect();
                proptest::strategy::Union::new(branches).boxed()
            }
            Schema::Ref { name } => value_of(&names[&name.fullname(None)], names, depth),
            other => panic!("no generator for {other:?}"),
        }
    }

    fn latin1(bytes: &[u8]) -> String {
        bytes.iter().map(|&b| char::from(b)).collect()
    }

    /// The named types of `schema` by full name (the test schemas give full names).
    fn named(schema: &Schema, names: &mut HashMap<String, Schema>) {
        match schema {
            Schema::Record(r) => {
                names.insert(r.name.fullname(None), schema.clone());
                for f in &r.fields {
                    named(&f.schema, names);
                }
            }
            Schema::Array(a) => named(&a.items, names),
            Schema::Map(m) => named(&m.types, names),
            Schema::Union(u) => u.variants().iter().for_each(|v| named(v, names)),
            _ => {}
        }
    }

    /// The fixed schemas the property tests draw values from: every type Ferry encodes, unions
    /// whose branches a plain JSON value tells apart, a recursive type.
    const PROPERTY_SCHEMAS: [&str; 2] = [
        r#"{"type": "record", "name": "p.Reading", "fields": [
            {"name": "device", "type": "string"}, {"name": "temp", "type": "double"},
            {"name": "humidity", "type": ["null", "double"]},
            {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "day", "type": {"type": "int", "logicalType": "date"}},
            {"name": "status", "type": {"type": "enum", "name": "p.Status", "symbols": ["ok", "degraded"]}},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
            {"name": "counters", "type": {"type": "map", "values": ["null", "long", "string"]}},
            {"name": "raw", "type": "bytes"}, {"name": "mac", "type": {"type": "fixed", "name": "p.Mac", "size": 3}},
            {"name": "ok", "type": "boolean"}, {"name": "battery", "type": "float"}, {"name": "line", "type": "int"}
        ]}"#,
        r#"{"type": "record", "name": "q.Link", "fields": [
            {"name": "value", "type": "long"},
            {"name": "at", "type": {"type": "record", "name": "q.Point", "fields": [{"name": "x", "type": "double"}]}},
            {"name": "also", "type": "q.Point"},
            {"name": "next", "type": ["null", "q.Link"]},
            {"name": "label", "type": ["null", "string", "boolean"]}
        ]}"#,
    ];

    fn property_case() -> impl Strategy<Value = (usize, Value, Avro)> {
        let strategies: Vec<_> = PROPERTY_SCHEMAS
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let schema = Schema::parse_str(text).unwrap();
                let mut names = HashMap::new();
                named(&schema, &mut names);
                value_of(&schema, &names, 3).prop_map(move |(json, avro)| (i, json, avro))
            })
            .collect();
        proptest::strategy::Union::new(strategies)
    }

    proptest! {
        #[test]
        fn random_values_roundtrip_through_apache_avro((schema, json, expected) in property_case()) {
            let text = PROPERTY_SCHEMAS[schema];
            let record = encode(text, &json.to_string()).map_err(|e| TestCaseError::fail(format!("{json}: {e}")))?;
            prop_assert_eq!(decode(text, &record), expected);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            for text in PROPERTY_SCHEMAS.iter().chain([&READING, &SHAPES]) {
                let mut out = Vec::new();
                if encoder(text).encode(&bytes, &mut out).is_err() {
                    prop_assert!(out.is_empty());
                }
            }
        }

        #[test]
        fn mangled_readings_never_panic(cut in 0usize..400, byte in any::<u8>()) {
            let mut json = br#"{"device": "d", "temp": 1.5, "humidity": null, "ts": 1, "day": 2, "status": "ok",
                "tags": ["a"], "counters": {"a": 1}, "raw": "", "mac": "abc", "ok": true, "battery": 1, "line": 3}"#.to_vec();
            let at = cut % json.len();
            json[at] = byte;
            let mut out = Vec::new();
            let _ = encoder(PROPERTY_SCHEMAS[0]).encode(&json, &mut out);
        }
    }
}
