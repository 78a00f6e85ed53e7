//! JSON to Protobuf without a message tree: the message descriptor compiled once into a plan
//! (each field's tag, kind and shape, enums as name tables), then the JSON text walked with it,
//! each value written in the wire format as it is read.
//!
//! This path only ever says yes: it accepts what prost-reflect's JSON mapping (the reflection
//! path in `protobuf.rs`) accepts, as the same message, and gives up on anything else. The
//! reflection path then decides, so a refusal and its words are the same as without this one.
//! It gives up, besides on what the reflection path refuses, where being exact would cost more
//! than the case is worth: a field given twice, a second member of a oneof, an extension,
//! an integer map key not written as the number prints.
//!
//! Fields are written in the JSON's order, not by number: a decoder makes the same message.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr as _;

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use prost_reflect::{EnumDescriptor, FieldDescriptor, Kind, MessageDescriptor};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

type MessageId = usize;
type EnumId = usize;

/// The most fields a planned message has: which are set is kept in a `u128`.
const MAX_FIELDS: usize = 128;

/// Below this many names a table is searched in order (faster than hashing short keys).
const FEW_NAMES: usize = 16;

/// A message type compiled for the wire path.
pub(super) struct WirePlan {
    messages: Vec<MessagePlan>,
    enums: Vec<EnumPlan>,
    root: MessageId,
}

/// Why a message type is left to the reflection path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Unplanned(pub(super) String);

impl fmt::Display for Unplanned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

struct MessagePlan {
    fields: Vec<FieldPlan>,
    /// Both names of every field; a JSON name wins over another field's proto name, as in
    /// prost-reflect.
    names: Names<usize>,
    /// The bits of the proto2 `required` fields.
    required: u128,
}

struct FieldPlan {
    json_name: Box<str>,
    tag: Tag,
    shape: Shape,
    /// This field's bit and those of the other members of its oneof: a value for it while one
    /// of these is set is left to the reflection path (a duplicate, or a oneof conflict).
    exclusive: u128,
}

enum Shape {
    /// `presence`: written even when it is the default (else a default is not written).
    Single {
        kind: ValueKind,
        presence: bool,
    },
    Repeated {
        kind: ValueKind,
        packed: bool,
    },
    Map(MapPlan),
}

struct MapPlan {
    key: ValueKind,
    value: ValueKind,
    key_tag: Tag,
    value_tag: Tag,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueKind {
    Double,
    Float,
    Int32,
    Int64,
    Uint32,
    Uint64,
    Sint32,
    Sint64,
    Fixed32,
    Fixed64,
    Sfixed32,
    Sfixed64,
    Bool,
    String,
    Bytes,
    Enum(EnumId),
    Message(MessageId),
}

#[derive(Clone, Copy)]
enum WireType {
    Varint = 0,
    I64 = 1,
    Len = 2,
    I32 = 5,
}

impl ValueKind {
    fn wire_type(self) -> WireType {
        match self {
            ValueKind::Int32
            | ValueKind::Int64
            | ValueKind::Uint32
            | ValueKind::Uint64
            | ValueKind::Sint32
            | ValueKind::Sint64
            | ValueKind::Bool
            | ValueKind::Enum(_) => WireType::Varint,
            ValueKind::Fixed64 | ValueKind::Sfixed64 | ValueKind::Double => WireType::I64,
            ValueKind::String | ValueKind::Bytes | ValueKind::Message(_) => WireType::Len,
            ValueKind::Fixed32 | ValueKind::Sfixed32 | ValueKind::Float => WireType::I32,
        }
    }

    fn is_integer(self) -> bool {
        matches!(
            self,
            ValueKind::Int32
                | ValueKind::Int64
                | ValueKind::Uint32
                | ValueKind::Uint64
                | ValueKind::Sint32
                | ValueKind::Sint64
                | ValueKind::Fixed32
                | ValueKind::Fixed64
                | ValueKind::Sfixed32
                | ValueKind::Sfixed64
        )
    }
}

/// A field's key (number and wire type) as a varint, written before each of its values.
#[derive(Clone, Copy)]
struct Tag {
    bytes: [u8; 5],
    len: u8,
}

impl Tag {
    fn new(number: u32, wire: WireType) -> Tag {
        let mut bytes = [0; 5];
        let mut n = (number << 3) | wire as u32;
        let mut len = 0;
        while n >= 0x80 {
            bytes[len] = (n as u8) | 0x80;
            n >>= 7;
            len += 1;
        }
        bytes[len] = n as u8;
        Tag {
            bytes,
            len: len as u8 + 1,
        }
    }

    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.bytes[..usize::from(self.len)]);
    }
}

struct EnumPlan {
    numbers: Names<i32>,
    /// The first value's number: what a field without presence leaves unwritten.
    default: i32,
}

/// Names to values: few are compared in order, many hashed.
enum Names<T> {
    Few(Vec<(Box<str>, T)>),
    Many(HashMap<Box<str>, T>),
}

impl<T: Copy> Names<T> {
    /// Earlier entries win over later ones of the same name.
    fn new(entries: Vec<(Box<str>, T)>) -> Names<T> {
        let mut unique: Vec<(Box<str>, T)> = Vec::with_capacity(entries.len());
        for (name, value) in entries {
            if !unique.iter().any(|(n, _)| *n == name) {
                unique.push((name, value));
            }
        }
        if unique.len() <= FEW_NAMES {
            Names::Few(unique)
        } else {
            Names::Many(unique.into_iter().collect())
        }
    }

    fn get(&self, name: &str) -> Option<T> {
        match self {
            Names::Few(entries) => entries.iter().find(|(n, _)| **n == *name).map(|e| e.1),
            Names::Many(map) => map.get(name).copied(),
        }
    }
}

impl WirePlan {
    pub(super) fn compile(message: &MessageDescriptor) -> Result<WirePlan, Unplanned> {
        let mut builder = Builder::default();
        let root = builder.message(message)?;
        Ok(WirePlan {
            messages: builder.messages,
            enums: builder.enums,
            root,
        })
    }

    /// Appends the message `json` holds in the wire format. An error means only that this
    /// path gives the payload up (what it appended is left for the caller to cut off).
    pub(super) fn encode(&self, json: &[u8], out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        let mut de = serde_json::Deserializer::from_slice(json);
        let root = RootSeed {
            plan: self,
            id: self.root,
            out,
        };
        root.deserialize(&mut de)?;
        de.end()
    }
}

/// Turns descriptors into plans; a message or enum used twice (or recursively) is one plan.
#[derive(Default)]
struct Builder {
    messages: Vec<MessagePlan>,
    enums: Vec<EnumPlan>,
    message_ids: HashMap<String, MessageId>,
    enum_ids: HashMap<String, EnumId>,
}

impl Builder {
    fn message(&mut self, desc: &MessageDescriptor) -> Result<MessageId, Unplanned> {
        if let Some(&id) = self.message_ids.get(desc.full_name()) {
            return Ok(id);
        }
        let unplanned = |what: &str| Err(Unplanned(format!("{} {what}", desc.full_name())));
        // Their JSON forms are not objects of their fields.
        if desc.full_name().starts_with("google.protobuf.") {
            return unplanned("is a well-known type");
        }
        let descriptors: Vec<FieldDescriptor> = desc.fields().collect();
        if descriptors.len() > MAX_FIELDS {
            return unplanned("has too many fields");
        }
        let mut json_names: Vec<&str> = descriptors.iter().map(|f| f.json_name()).collect();
        json_names.sort_unstable();
        if json_names.windows(2).any(|w| w[0] == w[1]) {
            return unplanned("has two fields of one JSON name");
        }
        // Registered before its fields are planned, so a field can refer back to it.
        let id = self.messages.len();
        self.messages.push(MessagePlan {
            fields: Vec::new(),
            names: Names::Few(Vec::new()),
            required: 0,
        });
        self.message_ids.insert(desc.full_name().to_owned(), id);
        let mut fields = Vec::with_capacity(descriptors.len());
        let mut required = 0u128;
        for (i, field) in descriptors.iter().enumerate() {
            fields.push(self.field(field, &descriptors)?);
            if field.is_required() {
                required |= 1 << i;
            }
        }
        let by_json = descriptors
            .iter()
            .enumerate()
            .map(|(i, f)| (f.json_name().into(), i));
        let by_name = descriptors
            .iter()
            .enumerate()
            .map(|(i, f)| (f.name().into(), i));
        self.messages[id] = MessagePlan {
            fields,
            names: Names::new(by_json.chain(by_name).collect()),
            required,
        };
        Ok(id)
    }

    fn field(
        &mut self,
        field: &FieldDescriptor,
        siblings: &[FieldDescriptor],
    ) -> Result<FieldPlan, Unplanned> {
        let unplanned = |what: &str| Err(Unplanned(format!("{} {what}", field.full_name())));
        if field.is_group() {
            return unplanned("is a group");
        }
        let (shape, wire) = if field.is_map() {
            let Kind::Message(entry) = field.kind() else {
                return unplanned("is a map without an entry type");
            };
            let key = self.kind(&entry.map_entry_key_field().kind())?;
            let value = self.kind(&entry.map_entry_value_field().kind())?;
            let map = MapPlan {
                key,
                value,
                key_tag: Tag::new(1, key.wire_type()),
                value_tag: Tag::new(2, value.wire_type()),
            };
            (Shape::Map(map), WireType::Len)
        } else if field.is_list() {
            let kind = self.kind(&field.kind())?;
            let packed = field.is_packed() && !matches!(kind.wire_type(), WireType::Len);
            let wire = if packed {
                WireType::Len
            } else {
                kind.wire_type()
            };
            (Shape::Repeated { kind, packed }, wire)
        } else {
            let kind = self.kind(&field.kind())?;
            let presence = field.supports_presence();
            // Without presence only the kind's default goes unwritten, as prost-reflect does.
            if !presence && field.default_value() != field.kind().default_value() {
                return unplanned("has a default of its own but no presence");
            }
            (Shape::Single { kind, presence }, kind.wire_type())
        };
        let bit = |f: &FieldDescriptor| {
            let i = siblings.iter().position(|s| s.number() == f.number());
            i.map_or(0, |i| 1u128 << i)
        };
        let mut exclusive = bit(field);
        if let Some(oneof) = field.containing_oneof() {
            exclusive |= oneof.fields().map(|f| bit(&f)).fold(0, |a, b| a | b);
        }
        Ok(FieldPlan {
            json_name: field.json_name().into(),
            tag: Tag::new(field.number(), wire),
            shape,
            exclusive,
        })
    }

    fn kind(&mut self, kind: &Kind) -> Result<ValueKind, Unplanned> {
        Ok(match kind {
            Kind::Double => ValueKind::Double,
            Kind::Float => ValueKind::Float,
            Kind::Int32 => ValueKind::Int32,
            Kind::Int64 => ValueKind::Int64,
            Kind::Uint32 => ValueKind::Uint32,
            Kind::Uint64 => ValueKind::Uint64,
            Kind::Sint32 => ValueKind::Sint32,
            Kind::Sint64 => ValueKind::Sint64,
            Kind::Fixed32 => ValueKind::Fixed32,
            Kind::Fixed64 => ValueKind::Fixed64,
            Kind::Sfixed32 => ValueKind::Sfixed32,
            Kind::Sfixed64 => ValueKind::Sfixed64,
            Kind::Bool => ValueKind::Bool,
            Kind::String => ValueKind::String,
            Kind::Bytes => ValueKind::Bytes,
            Kind::Enum(e) => ValueKind::Enum(self.enumeration(e)?),
            Kind::Message(m) => ValueKind::Message(self.message(m)?),
        })
    }

    fn enumeration(&mut self, desc: &EnumDescriptor) -> Result<EnumId, Unplanned> {
        if let Some(&id) = self.enum_ids.get(desc.full_name()) {
            return Ok(id);
        }
        // Its JSON form is null, which elsewhere means "not set".
        if desc.full_name() == "google.protobuf.NullValue" {
            return Err(Unplanned(format!(
                "{} is a well-known type",
                desc.full_name()
            )));
        }
        let id = self.enums.len();
        self.enums.push(EnumPlan {
            numbers: Names::new(
                desc.values()
                    .map(|v| (v.name().into(), v.number()))
                    .collect(),
            ),
            default: desc.default_value().number(),
        });
        self.enum_ids.insert(desc.full_name().to_owned(), id);
        Ok(id)
    }
}

/// Why this path gives a payload up; the reflection path words the real error.
fn give_up<E: de::Error>(why: &str) -> E {
    E::custom(why)
}

/// The top-level message: its fields with no tag or length before them.
struct RootSeed<'a> {
    plan: &'a WirePlan,
    id: MessageId,
    out: &'a mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for RootSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RootSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        encode_fields(self.plan, self.id, map, self.out)
    }
}

fn encode_fields<'de, A: MapAccess<'de>>(
    plan: &WirePlan,
    id: MessageId,
    mut map: A,
    out: &mut Vec<u8>,
) -> Result<(), A::Error> {
    let Some(message) = plan.messages.get(id) else {
        return Err(give_up("no plan for the message"));
    };
    let mut set = 0u128;
    let mut hint = 0;
    while let Some(found) = map.next_key_seed(FieldName { message, hint })? {
        let Some(index) = found else {
            map.next_value::<IgnoredAny>()?;
            continue;
        };
        let Some(field) = message.fields.get(index) else {
            return Err(give_up("no plan for the field"));
        };
        if set & field.exclusive != 0 {
            return Err(give_up("a field or a oneof given twice"));
        }
        let value = FieldSeed {
            plan,
            field,
            out: &mut *out,
        };
        if map.next_value_seed(value)? {
            set |= 1 << index;
        }
        hint = index + 1;
    }
    if set & message.required != message.required {
        return Err(give_up("a required field is missing"));
    }
    Ok(())
}

/// Finds the field a member names: first the field after the last one found (JSON written in
/// the schema's order), else by either of its names. `None`: a member to ignore.
struct FieldName<'a> {
    message: &'a MessagePlan,
    hint: usize,
}

impl<'de> DeserializeSeed<'de> for FieldName<'_> {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<usize>, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for FieldName<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<usize>, E> {
        let fields = &self.message.fields;
        if fields.get(self.hint).is_some_and(|f| *f.json_name == *v) {
            return Ok(Some(self.hint));
        }
        match self.message.names.get(v) {
            Some(i) => Ok(Some(i)),
            // An extension's name, or refused as an unknown one.
            None if v.starts_with('[') => Err(give_up("an extension")),
            None => Ok(None),
        }
    }
}

/// A member's value for `field`; true if it sets the field (it is not null).
struct FieldSeed<'a> {
    plan: &'a WirePlan,
    field: &'a FieldPlan,
    out: &'a mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for FieldSeed<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value of the field")
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_none<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<bool, E> {
        self.single(Scalar::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<bool, E> {
        self.single(Scalar::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<bool, E> {
        self.single(Scalar::Uint(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<bool, E> {
        self.single(Scalar::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        self.single(Scalar::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<bool, A::Error> {
        let Shape::Repeated { kind, packed } = self.field.shape else {
            return Err(give_up("an array for a field that is not repeated"));
        };
        let list = List {
            plan: self.plan,
            tag: self.field.tag,
            kind,
        };
        if packed {
            list.packed(seq, self.out)?;
        } else {
            list.unpacked(seq, self.out)?;
        }
        Ok(true)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<bool, A::Error> {
        match &self.field.shape {
            Shape::Single {
                kind: ValueKind::Message(id),
                ..
            } => {
                self.field.tag.put(self.out);
                let body = open_len(self.out);
                encode_fields(self.plan, *id, map, self.out)?;
                close_len(self.out, body);
            }
            Shape::Map(entries) => encode_map(self.plan, self.field.tag, entries, map, self.out)?,
            _ => {
                return Err(give_up(
                    "an object for a field that is not a message or map",
                ));
            }
        }
        Ok(true)
    }
}

impl FieldSeed<'_> {
    fn single<E: de::Error>(self, scalar: Scalar<'_>) -> Result<bool, E> {
        let Shape::Single { kind, presence } = self.field.shape else {
            return Err(give_up("a scalar for a repeated or map field"));
        };
        let start = self.out.len();
        self.field.tag.put(self.out);
        let default = put_scalar(self.plan, kind, scalar, self.out).map_err(give_up)?;
        if default && !presence {
            self.out.truncate(start);
        }
        Ok(true)
    }
}

/// A repeated field's array: packed (one tag and length, then the values) or a tag per value.
struct List<'a> {
    plan: &'a WirePlan,
    tag: Tag,
    kind: ValueKind,
}

impl List<'_> {
    fn packed<'de, A: SeqAccess<'de>>(
        &self,
        mut seq: A,
        out: &mut Vec<u8>,
    ) -> Result<(), A::Error> {
        let start = out.len();
        self.tag.put(out);
        let body = open_len(out);
        while seq.next_element_seed(self.element(out))?.is_some() {}
        if out.len() == body {
            // An empty list is not written.
            out.truncate(start);
        } else {
            close_len(out, body);
        }
        Ok(())
    }

    fn unpacked<'de, A: SeqAccess<'de>>(
        &self,
        mut seq: A,
        out: &mut Vec<u8>,
    ) -> Result<(), A::Error> {
        loop {
            // The tag goes first, taken back when the array has no more values.
            let start = out.len();
            self.tag.put(out);
            if seq.next_element_seed(self.element(out))?.is_none() {
                out.truncate(start);
                return Ok(());
            }
        }
    }

    fn element<'o>(&self, out: &'o mut Vec<u8>) -> ValueSeed<'_, 'o> {
        ValueSeed {
            plan: self.plan,
            kind: self.kind,
            out,
        }
    }
}

/// A protobuf map: an entry message (key 1, value 2) per member.
fn encode_map<'de, A: MapAccess<'de>>(
    plan: &WirePlan,
    tag: Tag,
    entries: &MapPlan,
    mut map: A,
    out: &mut Vec<u8>,
) -> Result<(), A::Error> {
    loop {
        let start = out.len();
        tag.put(out);
        let body = open_len(out);
        let key = MapKey {
            plan,
            entries,
            out: &mut *out,
        };
        if map.next_key_seed(key)?.is_none() {
            out.truncate(start);
            return Ok(());
        }
        entries.value_tag.put(out);
        map.next_value_seed(ValueSeed {
            plan,
            kind: entries.value,
            out: &mut *out,
        })?;
        close_len(out, body);
    }
}

/// Writes a map member's name as the entry's key field.
struct MapKey<'a> {
    plan: &'a WirePlan,
    entries: &'a MapPlan,
    out: &'a mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for MapKey<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MapKey<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        let kind = self.entries.key;
        // Two spellings of one number ("1", "01") would be one key whose value the reflection
        // path picks by its own member order, not the JSON's.
        if kind.is_integer() && !canonical_integer(v) {
            return Err(give_up("an integer map key not in its plain form"));
        }
        let scalar = match kind {
            ValueKind::Bool => {
                Scalar::Bool(bool::from_str(v).map_err(|_| give_up("not a boolean"))?)
            }
            _ => Scalar::Str(v),
        };
        self.entries.key_tag.put(self.out);
        put_scalar(self.plan, kind, scalar, self.out).map_err(give_up)?;
        Ok(())
    }
}

/// Whether `s` is an integer as it prints: no sign but a minus, no leading zero, not "-0".
fn canonical_integer(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    let leading_zero = digits.starts_with('0') && (digits.len() > 1 || s.len() > 1);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && !leading_zero
}

/// A value whose tag is written: an element of a list or a map entry's value. Null is not one.
struct ValueSeed<'a, 'o> {
    plan: &'a WirePlan,
    kind: ValueKind,
    out: &'o mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value")
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

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let ValueKind::Message(id) = self.kind else {
            return Err(give_up("an object for a value that is not a message"));
        };
        let body = open_len(self.out);
        encode_fields(self.plan, id, map, self.out)?;
        close_len(self.out, body);
        Ok(())
    }
}

impl ValueSeed<'_, '_> {
    fn scalar<E: de::Error>(self, scalar: Scalar<'_>) -> Result<(), E> {
        put_scalar(self.plan, self.kind, scalar, self.out)
            .map(|_| ())
            .map_err(give_up)
    }
}

/// Reserves the byte of a length that usually fits in one; returns where the body starts.
fn open_len(out: &mut Vec<u8>) -> usize {
    out.push(0);
    out.len()
}

/// Writes the length of what follows `body` into the byte reserved before it, moving the body
/// when the length takes more than one byte.
fn close_len(out: &mut Vec<u8>, body: usize) {
    let len = out.len() - body;
    if len < 0x80 {
        if let Some(slot) = out.get_mut(body - 1) {
            *slot = len as u8;
        }
        return;
    }
    let mut varint = [0u8; 10];
    let mut n = len as u64;
    let mut size = 0;
    while n >= 0x80 {
        varint[size] = (n as u8) | 0x80;
        n >>= 7;
        size += 1;
    }
    varint[size] = n as u8;
    size += 1;
    out.resize(out.len() + size - 1, 0);
    out.copy_within(body..body + len, body + size - 1);
    out[body - 1..body - 1 + size].copy_from_slice(&varint[..size]);
}

fn put_varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A JSON scalar as serde_json reads it (null is handled where it is allowed).
#[derive(Clone, Copy)]
enum Scalar<'s> {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(&'s str),
}

/// Appends `scalar` as a `kind` value (no tag), converted as prost-reflect's JSON mapping
/// converts it; returns whether it is the kind's default.
fn put_scalar(
    plan: &WirePlan,
    kind: ValueKind,
    scalar: Scalar<'_>,
    out: &mut Vec<u8>,
) -> Result<bool, &'static str> {
    match (kind, scalar) {
        (ValueKind::Double, _) => {
            let v = to_f64(scalar).ok_or(MISMATCH)?;
            out.extend_from_slice(&v.to_le_bytes());
            Ok(v == 0.0)
        }
        (ValueKind::Float, _) => {
            let v = to_f32(scalar).ok_or(MISMATCH)?;
            out.extend_from_slice(&v.to_le_bytes());
            Ok(v == 0.0)
        }
        (ValueKind::Bool, Scalar::Bool(b)) => {
            out.push(u8::from(b));
            Ok(!b)
        }
        (ValueKind::String, Scalar::Str(s)) => {
            put_varint(out, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
            Ok(s.is_empty())
        }
        (ValueKind::Bytes, Scalar::Str(s)) => put_base64(s, out).ok_or("not base64"),
        (ValueKind::Enum(id), _) => {
            let e = plan.enums.get(id).ok_or("no plan for the enum")?;
            let v = match scalar {
                Scalar::Str(s) => e.numbers.get(s).ok_or("an enum value not defined")?,
                Scalar::Int(i) => i32::try_from(i).map_err(|_| MISMATCH)?,
                Scalar::Uint(u) => i32::try_from(u).map_err(|_| MISMATCH)?,
                Scalar::Float(_) | Scalar::Bool(_) => return Err(MISMATCH),
            };
            put_varint(out, i64::from(v) as u64);
            Ok(v == e.default)
        }
        (kind, scalar) if kind.is_integer() => put_integer(kind, scalar, out),
        _ => Err(MISMATCH),
    }
}

const MISMATCH: &str = "a value of another type";

/// [`put_scalar`] for the integer kinds: varint, zigzag varint or little-endian fixed width.
fn put_integer(
    kind: ValueKind,
    scalar: Scalar<'_>,
    out: &mut Vec<u8>,
) -> Result<bool, &'static str> {
    match kind {
        ValueKind::Int32 | ValueKind::Sint32 | ValueKind::Sfixed32 => {
            let v = to_i32(scalar).ok_or(MISMATCH)?;
            match kind {
                ValueKind::Int32 => put_varint(out, i64::from(v) as u64),
                ValueKind::Sint32 => put_varint(out, u64::from(((v << 1) ^ (v >> 31)) as u32)),
                _ => out.extend_from_slice(&v.to_le_bytes()),
            }
            Ok(v == 0)
        }
        ValueKind::Int64 | ValueKind::Sint64 | ValueKind::Sfixed64 => {
            let v = to_i64(scalar).ok_or(MISMATCH)?;
            match kind {
                ValueKind::Int64 => put_varint(out, v as u64),
                ValueKind::Sint64 => put_varint(out, ((v << 1) ^ (v >> 63)) as u64),
                _ => out.extend_from_slice(&v.to_le_bytes()),
            }
            Ok(v == 0)
        }
        ValueKind::Uint32 | ValueKind::Fixed32 => {
            let v = to_u32(scalar).ok_or(MISMATCH)?;
            match kind {
                ValueKind::Uint32 => put_varint(out, u64::from(v)),
                _ => out.extend_from_slice(&v.to_le_bytes()),
            }
            Ok(v == 0)
        }
        ValueKind::Uint64 | ValueKind::Fixed64 => {
            let v = to_u64(scalar).ok_or(MISMATCH)?;
            match kind {
                ValueKind::Uint64 => put_varint(out, v),
                _ => out.extend_from_slice(&v.to_le_bytes()),
            }
            Ok(v == 0)
        }
        _ => Err(MISMATCH),
    }
}

/// The spellings of the special values a JSON number cannot hold.
fn special_f64(s: &str) -> Option<f64> {
    match s {
        "Infinity" => Some(f64::INFINITY),
        "-Infinity" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => None,
    }
}

fn to_f64(scalar: Scalar<'_>) -> Option<f64> {
    match scalar {
        Scalar::Int(i) => Some(i as f64),
        Scalar::Uint(u) => Some(u as f64),
        Scalar::Float(v) => Some(v),
        Scalar::Str(s) => f64::from_str(s).ok().or_else(|| special_f64(s)),
        Scalar::Bool(_) => None,
    }
}

fn to_f32(scalar: Scalar<'_>) -> Option<f32> {
    match scalar {
        Scalar::Int(i) => Some(i as f32),
        Scalar::Uint(u) => Some(u as f32),
        Scalar::Float(v) if v < f64::from(f32::MIN) || v > f64::from(f32::MAX) => None,
        Scalar::Float(v) => Some(v as f32),
        Scalar::Str(s) => f32::from_str(s)
            .ok()
            .or_else(|| special_f64(s).map(|v| v as f32)),
        Scalar::Bool(_) => None,
    }
}

/// `v` if it is a whole number within `min..=max` (a JSON number with a fraction or exponent).
fn whole(v: f64, min: f64, max: f64) -> Option<f64> {
    (v.fract() == 0.0 && !(v < min || v > max)).then_some(v)
}

fn to_i32(scalar: Scalar<'_>) -> Option<i32> {
    match scalar {
        Scalar::Str(s) => s.parse().ok(),
        Scalar::Int(i) => i.try_into().ok(),
        Scalar::Uint(u) => u.try_into().ok(),
        Scalar::Float(v) => whole(v, f64::from(i32::MIN), f64::from(i32::MAX)).map(|v| v as i32),
        Scalar::Bool(_) => None,
    }
}

fn to_i64(scalar: Scalar<'_>) -> Option<i64> {
    match scalar {
        Scalar::Str(s) => s.parse().ok(),
        Scalar::Int(i) => Some(i),
        Scalar::Uint(u) => u.try_into().ok(),
        Scalar::Float(v) => whole(v, i64::MIN as f64, i64::MAX as f64).map(|v| v as i64),
        Scalar::Bool(_) => None,
    }
}

fn to_u32(scalar: Scalar<'_>) -> Option<u32> {
    match scalar {
        Scalar::Str(s) => s.parse().ok(),
        Scalar::Int(i) => i.try_into().ok(),
        Scalar::Uint(u) => u.try_into().ok(),
        Scalar::Float(v) => whole(v, 0.0, f64::from(u32::MAX)).map(|v| v as u32),
        Scalar::Bool(_) => None,
    }
}

fn to_u64(scalar: Scalar<'_>) -> Option<u64> {
    match scalar {
        Scalar::Str(s) => s.parse().ok(),
        Scalar::Int(i) => i.try_into().ok(),
        Scalar::Uint(u) => Some(u),
        Scalar::Float(v) => whole(v, 0.0, u64::MAX as f64).map(|v| v as u64),
        Scalar::Bool(_) => None,
    }
}

/// Padding optional and trailing bits allowed, as prost-reflect reads base64.
const BASE64_CONFIG: GeneralPurposeConfig = GeneralPurposeConfig::new()
    .with_decode_allow_trailing_bits(true)
    .with_decode_padding_mode(DecodePaddingMode::Indifferent);
const BASE64_STANDARD: GeneralPurpose =
    GeneralPurpose::new(&base64::alphabet::STANDARD, BASE64_CONFIG);
const BASE64_URL_SAFE: GeneralPurpose =
    GeneralPurpose::new(&base64::alphabet::URL_SAFE, BASE64_CONFIG);

/// Appends the bytes base64 text stands for, length first; the URL-safe alphabet is tried
/// when the standard one meets its characters. Returns whether there are none.
fn put_base64(s: &str, out: &mut Vec<u8>) -> Option<bool> {
    let body = open_len(out);
    match BASE64_STANDARD.decode_vec(s, out) {
        Ok(()) => {}
        Err(base64::DecodeError::InvalidByte(_, b'-' | b'_')) => {
            out.truncate(body);
            BASE64_URL_SAFE.decode_vec(s, out).ok()?;
        }
        Err(_) => return None,
    }
    let empty = out.len() == body;
    close_len(out, body);
    Some(empty)
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    use base64::Engine as _;
    use proptest::prelude::*;
    use prost_reflect::DynamicMessage;
    use serde_json::{Map, Value, json};

    use super::super::protobuf::ProtobufEncoder;

    const READINGS: &str = r#"
        syntax = "proto3";
        package test.v1;
        message Reading {
          string device_id = 1;
          int64 seq = 2;
          double temp = 3;
          optional float humidity = 4;
          Status status = 5;
          repeated string tags = 6;
          map<string, sint64> counters = 7;
          Location location = 8;
          bytes raw = 9;
          repeated int32 samples = 10;
          repeated Location path = 11;
          uint64 uptime = 12;
          fixed32 flags = 13;
          bool ok = 14;
          map<int32, Location> zones = 15;
          oneof source { string gateway = 16; uint32 line = 17; }
          repeated Status history = 18;
          message Location { double lat = 1; double lon = 2; sfixed64 alt_m = 3; }
        }
        enum Status { STATUS_UNSPECIFIED = 0; OK = 1; DEGRADED = 2; }
    "#;

    const PROTO2: &str = r#"
        syntax = "proto2";
        package test.v2;
        message Outer {
          required int32 id = 1;
          optional Inner inner = 2;
          repeated Inner more = 3;
          repeated int32 packed_ints = 4 [packed = true];
          repeated sint32 plain_ints = 5;
          optional string name = 6 [default = "x"];
          optional Color color = 7;
          map<int64, bool> flags = 8;
          map<bool, string> named = 9;
          optional Outer next = 10;
          extensions 100 to 200;
        }
        message Inner { required int32 must = 1; optional int32 may = 2; }
        enum Color { RED = 1; GREEN = 2; }
        extend Outer { optional int32 ext = 100; }
    "#;

    static READING: LazyLock<ProtobufEncoder> = LazyLock::new(|| compiled(READINGS));
    static OUTER: LazyLock<ProtobufEncoder> = LazyLock::new(|| compiled(PROTO2));

    fn compiled(text: &str) -> ProtobufEncoder {
        ProtobufEncoder::compile(text, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// What the two paths made of one payload.
    struct Outcome {
        wire_accepted: bool,
        reflection_accepted: bool,
    }

    /// Runs the wire path alone, the encoder (wire path, else reflection) and the reflection
    /// path alone on `json`: where the wire path accepts, the reflection path accepts the same
    /// message; the encoder accepts what the reflection path accepts, refuses with its error.
    fn check(e: &ProtobufEncoder, json: &[u8]) -> Result<Outcome, TestCaseError> {
        let shown = String::from_utf8_lossy(json);
        let plan = e
            .wire()
            .ok_or_else(|| TestCaseError::fail("no wire plan"))?;
        let mut wire = Vec::new();
        let wire_accepted = plan.encode(json, &mut wire).is_ok();
        let mut either = Vec::new();
        let by_encoder = e.encode(json, &mut either);
        let mut reference = Vec::new();
        let by_reflection = e.encode_by_reflection(json, &mut reference);
        let header = e.indexes().len();
        match (&by_encoder, &by_reflection) {
            (Ok(()), Ok(())) => {
                prop_assert!(
                    same_message(e, &either[header..], &reference[header..]),
                    "{shown}"
                );
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b, "{}", shown),
            _ => prop_assert!(false, "{shown}: {by_encoder:?} but {by_reflection:?}"),
        }
        if wire_accepted {
            prop_assert!(by_reflection.is_ok(), "{shown}: {by_reflection:?}");
            prop_assert_eq!(&either[header..], &wire[..], "{}", shown);
        }
        Ok(Outcome {
            wire_accepted,
            reflection_accepted: by_reflection.is_ok(),
        })
    }

    /// Decoded by prost-reflect, the same message (NaN is not equal to itself: then compared
    /// in the JSON mapping, which spells it).
    fn same_message(e: &ProtobufEncoder, a: &[u8], b: &[u8]) -> bool {
        let decode = |bytes: &[u8]| DynamicMessage::decode(e.descriptor().clone(), bytes);
        match (decode(a), decode(b)) {
            (Ok(a), Ok(b)) => {
                a == b
                    || serde_json::to_value(&a)
                        .ok()
                        .is_some_and(|x| serde_json::to_value(&b).ok().is_some_and(|y| x == y))
            }
            _ => false,
        }
    }

    fn accepted_by_both(e: &ProtobufEncoder, json: &str) {
        let outcome = check(e, json.as_bytes()).unwrap_or_else(|f| panic!("{f}"));
        assert!(outcome.wire_accepted, "the wire path gave up on {json}");
    }

    fn refused_by_both(e: &ProtobufEncoder, json: &str) {
        let outcome = check(e, json.as_bytes()).unwrap_or_else(|f| panic!("{f}"));
        assert!(!outcome.reflection_accepted, "accepted: {json}");
    }

    /// Accepted, by the reflection path only: cases the wire path leaves alone.
    fn left_to_reflection(e: &ProtobufEncoder, json: &str) {
        let outcome = check(e, json.as_bytes()).unwrap_or_else(|f| panic!("{f}"));
        assert!(
            !outcome.wire_accepted && outcome.reflection_accepted,
            "{json}"
        );
    }

    #[test]
    fn which_messages_the_wire_path_plans() {
        assert!(READING.wire().is_some());
        assert!(OUTER.wire().is_some());
        let with_timestamp = r#"syntax = "proto3"; import "google/protobuf/timestamp.proto";
            message M { int32 a = 1; N n = 2; } message N { google.protobuf.Timestamp at = 1; }"#;
        assert!(compiled(with_timestamp).wire().is_none());
        let with_group = r#"syntax = "proto2";
            message M { optional group G = 1 { optional int32 g = 2; } }"#;
        assert!(compiled(with_group).wire().is_none());
        let recursive =
            r#"syntax = "proto3"; message Tree { int32 v = 1; repeated Tree kids = 2; }"#;
        let tree = compiled(recursive);
        assert!(tree.wire().is_some());
        accepted_by_both(
            &tree,
            r#"{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {}]}"#,
        );
    }

    #[test]
    fn the_wire_path_takes_the_json_mapping() {
        for json in [
            r#"{}"#,
            r#"{"device_id": null, "deviceId": "a", "seq": "-12", "temp": "NaN", "humidity": "Infinity"}"#,
            r#"{"seq": 3.0, "temp": 1e300, "humidity": -3.4e38, "uptime": "18446744073709551615"}"#,
            r#"{"seq": "+7", "samples": ["1", -2, 3e2], "flags": 4294967295, "ok": false}"#,
            r#"{"temp": -0.0, "seq": 0, "status": 0, "raw": "", "tags": [], "counters": {}}"#,
            r#"{"humidity": 0, "line": 0, "status": "DEGRADED", "history": ["OK", 7, -1]}"#,
            r#"{"raw": "AQL+/w==", "location": {"lat": 1, "altM": "-5", "x": [1, {"y": 2}]}}"#,
            r#"{"raw": "AQL-_w", "path": [{}, {"alt_m": 1}], "zones": {"-3": {"lat": 2}, "0": {}}}"#,
            r#"{"counters": {"a": "-9223372036854775808", "": 1}, "line": null, "gateway": "gw"}"#,
            r#"{"unknown": {"deviceId": 5}, "tags": ["x", "y"], "samples": [], "status": null}"#,
            r#"{"location": {"lat": 1}, "location2": null, "device_id": "é\"\\u00e9"}"#,
        ] {
            accepted_by_both(&READING, json);
        }
        // A length of two bytes: the body moves when its length is known.
        let long = format!(
            r#"{{"location": {{"lat": 1}}, "path": [{{"lat": 2}}], "tags": ["{}"]}}"#,
            "t".repeat(300)
        );
        accepted_by_both(&READING, &long);
        let nested = format!(
            r#"{{"path": [{}]}}"#,
            vec![r#"{"lat": 1.5, "lon": 2.5, "altM": 3}"#; 20].join(",")
        );
        accepted_by_both(&READING, &nested);
    }

    #[test]
    fn what_the_reflection_path_refuses_the_wire_path_gives_up() {
        for json in [
            "[]",
            "null",
            r#"{"seq": 1.5}"#,
            r#"{"seq": "9223372036854775808"}"#,
            r#"{"humidity": 1e39}"#,
            r#"{"status": "ON_FIRE"}"#,
            r#"{"status": 1.0}"#,
            r#"{"history": [null]}"#,
            r#"{"raw": "!!"}"#,
            r#"{"ok": "true"}"#,
            r#"{"tags": "a"}"#,
            r#"{"counters": {"a": null}}"#,
            r#"{"zones": {"x": {}}}"#,
            r#"{"location": 5}"#,
            r#"{"gateway": "g", "line": 1}"#,
            r#"{"uptime": -1}"#,
            r#"{"flags": -1}"#,
            r#"{"samples": [3000000000]}"#,
            r#"{"[test.v1.ext]": 1}"#,
            r#"{"unknown": 1, "status": "ON_FIRE"}"#,
            r#"{"seq": 1} x"#,
            r#"{"seq": 1"#,
        ] {
            refused_by_both(&READING, json);
        }
    }

    #[test]
    fn cases_the_wire_path_leaves_to_reflection() {
        for json in [
            r#"{"seq": 1, "seq": 2}"#,
            r#"{"seq": 1, "unknown": 0, "seq": 2}"#,
            r#"{"gateway": "g", "line": null}"#,
            r#"{"zones": {"01": {}, "1": {"lat": 1}}}"#,
            r#"{"zones": {"+1": {}}}"#,
        ] {
            left_to_reflection(&READING, json);
        }
        // Both refuse a oneof given twice when no member the message lacks comes first.
        refused_by_both(&READING, r#"{"humidity": 1, "humidity": 2}"#);
    }

    #[test]
    fn proto2_required_packed_defaults_and_extensions() {
        for json in [
            r#"{"id": 1}"#,
            r#"{"id": 0, "inner": {"must": 0}, "more": [{"must": 1, "may": 2}]}"#,
            r#"{"id": 1, "packed_ints": [1, -1], "plainInts": [-1, 1], "name": "", "color": "RED"}"#,
            r#"{"id": 1, "flags": {"-5": true, "9223372036854775807": false}, "named": {"true": "t"}}"#,
            r#"{"id": 1, "color": 1, "next": {"id": 2, "next": {"id": 3}}}"#,
        ] {
            accepted_by_both(&OUTER, json);
        }
        for json in [
            r#"{}"#,
            r#"{"id": null}"#,
            r#"{"id": 1, "inner": {"may": 1}}"#,
            r#"{"id": 1, "more": [{"must": 1}, {}]}"#,
            r#"{"id": 1, "next": {}}"#,
            r#"{"id": 1, "named": {"yes": "t"}}"#,
            r#"{"id": 1, "color": "BLUE"}"#,
            r#"{"id": 1, "[test.v2.nope]": 1}"#,
        ] {
            refused_by_both(&OUTER, json);
        }
        left_to_reflection(&OUTER, r#"{"id": 1, "[test.v2.ext]": 5}"#);
    }

    #[test]
    fn the_bench_reading_takes_the_wire_path() {
        let schema = r#"syntax = "proto3";
            package plant;
            message Reading {
              string device = 1; int64 seq = 2; double temp = 3; optional double humidity = 4;
              double pressure = 5; float battery = 6; int64 ts = 7; Status status = 8;
              string firmware = 9; string site = 10; Location location = 11;
              repeated string tags = 12; string gateway = 13;
              enum Status { ok = 0; degraded = 1; failed = 2; }
              message Location { double lat = 1; double lon = 2; }
            }"#;
        let reading = r#"{"device":"plant-7/line-3/sensor-12","seq":5,"temp":15.05,"humidity":30.5,"pressure":1013.25,"battery":0.87,"ts":1732600000128,"status":"degraded","firmware":"2.4.1-rc3","site":"munich-north","gateway":"gw-munich-north-02","location":{"lat":48.13513,"lon":11.58198},"tags":["calibrated","outdoor","phase-b"]}"#;
        accepted_by_both(&compiled(schema), reading);
    }

    fn number<T: Into<Value>>(v: T) -> Value {
        v.into()
    }

    fn text(s: &str) -> BoxedStrategy<Value> {
        Just(Value::from(s)).boxed()
    }

    fn int64() -> BoxedStrategy<Value> {
        prop_oneof![
            any::<i64>().prop_map(number),
            any::<i64>().prop_map(|n| Value::from(n.to_string())),
            (-1000i64..1000).prop_map(|n| number(n as f64)),
            Just(number(0)),
            text("+7"),
        ]
        .boxed()
    }

    fn int64_wrong() -> BoxedStrategy<Value> {
        prop_oneof![
            Just(number(1.5)),
            text("x"),
            Just(json!(true)),
            Just(number(u64::MAX)),
            text("9223372036854775808"),
            Just(number(1e19)),
        ]
        .boxed()
    }

    fn double() -> BoxedStrategy<Value> {
        prop_oneof![
            any::<f64>()
                .prop_filter("finite", |x| x.is_finite())
                .prop_map(number),
            (-1e3f64..1e3).prop_map(number),
            text("NaN"),
            text("Infinity"),
            text("-Infinity"),
            text("1e5"),
            Just(number(-0.0)),
            any::<i64>().prop_map(number),
        ]
        .boxed()
    }

    fn status() -> BoxedStrategy<Value> {
        prop_oneof![
            text("OK"),
            text("DEGRADED"),
            text("STATUS_UNSPECIFIED"),
            (-2i64..5).prop_map(number),
        ]
        .boxed()
    }

    fn string() -> BoxedStrategy<Value> {
        "[a-z0-9/é]{0,8}".prop_map(Value::from).boxed()
    }

    fn location() -> BoxedStrategy<Value> {
        (
            proptest::option::of(double()),
            proptest::option::of(double()),
            proptest::option::of(int64()),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(lat, lon, alt, proto_name, extra)| {
                let mut m = Map::new();
                let alt_name = if proto_name { "alt_m" } else { "altM" };
                for (name, value) in [("lat", lat), ("lon", lon), (alt_name, alt)] {
                    if let Some(value) = value {
                        m.insert(name.into(), value);
                    }
                }
                if extra {
                    m.insert("elevation".into(), json!({"m": [1, 2]}));
                }
                Value::Object(m)
            })
            .boxed()
    }

    fn array(items: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
        proptest::collection::vec(items, 0..4)
            .prop_map(Value::Array)
            .boxed()
    }

    fn object(keys: BoxedStrategy<String>, values: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
        proptest::collection::btree_map(keys, values, 0..3)
            .prop_map(|m| Value::Object(m.into_iter().collect()))
            .boxed()
    }

    fn base64_bytes() -> BoxedStrategy<Value> {
        (proptest::collection::vec(any::<u8>(), 0..12), any::<bool>())
            .prop_map(|(bytes, url)| {
                let text = if url {
                    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
                } else {
                    base64::engine::general_purpose::STANDARD.encode(bytes)
                };
                Value::from(text)
            })
            .boxed()
    }

    /// Each field of `Reading`: its JSON and proto names, values it takes, values it refuses.
    fn reading_fields() -> Vec<(
        &'static str,
        &'static str,
        BoxedStrategy<Value>,
        BoxedStrategy<Value>,
    )> {
        let wrong = |values: Vec<Value>| proptest::sample::select(values).boxed();
        vec![
            (
                "deviceId",
                "device_id",
                string(),
                wrong(vec![json!(5), json!(true)]),
            ),
            ("seq", "seq", int64(), int64_wrong()),
            (
                "temp",
                "temp",
                double(),
                wrong(vec![json!("abc"), json!(true), json!([1])]),
            ),
            (
                "humidity",
                "humidity",
                prop_oneof![
                    (-1e6f64..1e6).prop_map(number),
                    Just(number(3.4e38)),
                    text("NaN"),
                    Just(number(0))
                ]
                .boxed(),
                wrong(vec![json!(1e39), json!("hot")]),
            ),
            (
                "status",
                "status",
                status(),
                wrong(vec![json!("ON_FIRE"), json!(1.0), json!(3_000_000_000u64)]),
            ),
            (
                "tags",
                "tags",
                array(string()),
                wrong(vec![json!([null]), json!("a"), json!([1])]),
            ),
            (
                "counters",
                "counters",
                object("[a-z]{0,4}".boxed(), int64()),
                wrong(vec![json!({"a": null}), json!([]), json!({"a": 1.5})]),
            ),
            (
                "location",
                "location",
                location(),
                wrong(vec![json!("here"), json!([]), json!({"lat": "north"})]),
            ),
            (
                "raw",
                "raw",
                base64_bytes(),
                wrong(vec![json!("!!"), json!(5)]),
            ),
            (
                "samples",
                "samples",
                array(
                    prop_oneof![
                        any::<i32>().prop_map(number),
                        any::<i32>().prop_map(|n| Value::from(n.to_string()))
                    ]
                    .boxed(),
                ),
                wrong(vec![json!([1.5]), json!([null]), json!([3_000_000_000u64])]),
            ),
            (
                "path",
                "path",
                array(location()),
                wrong(vec![json!([null]), json!({})]),
            ),
            (
                "uptime",
                "uptime",
                prop_oneof![
                    any::<u64>().prop_map(number),
                    any::<u64>().prop_map(|n| Value::from(n.to_string()))
                ]
                .boxed(),
                wrong(vec![json!(-1), json!("-1")]),
            ),
            (
                "flags",
                "flags",
                any::<u32>().prop_map(number).boxed(),
                wrong(vec![json!(-1), json!(4_294_967_296u64)]),
            ),
            (
                "ok",
                "ok",
                any::<bool>().prop_map(Value::from).boxed(),
                wrong(vec![json!("true"), json!(1)]),
            ),
            (
                "zones",
                "zones",
                object(any::<i32>().prop_map(|k| k.to_string()).boxed(), location()),
                wrong(vec![json!({"x": {}}), json!({"1": null})]),
            ),
            (
                "history",
                "history",
                array(status()),
                wrong(vec![json!(["NOPE"]), json!([null])]),
            ),
        ]
    }

    /// A reading: each field absent, null, usually a value it takes, rarely one it refuses;
    /// by either of its names; sometimes with members the message lacks, sometimes two
    /// members of its oneof.
    fn reading() -> impl Strategy<Value = Value> {
        let members: Vec<BoxedStrategy<Option<(String, Value)>>> = reading_fields()
            .into_iter()
            .map(|(json_name, proto_name, valid, wrong)| {
                let value = prop_oneof![
                    3 => Just(None),
                    1 => Just(Some(Value::Null)),
                    24 => valid.prop_map(Some),
                    // Rare enough that most readings are valid.
                    1 => wrong.prop_map(Some),
                ];
                (any::<bool>(), value)
                    .prop_map(move |(proto, value)| {
                        let name = if proto { proto_name } else { json_name };
                        value.map(|v| (name.to_owned(), v))
                    })
                    .boxed()
            })
            .collect();
        let source = prop_oneof![
            4 => Just(Vec::<(&str, Value)>::new()),
            2 => string().prop_map(|g| vec![("gateway", g)]),
            2 => any::<u32>().prop_map(|l| vec![("line", number(l))]),
            1 => Just(vec![("gateway", json!("g")), ("line", json!(1))]),
        ];
        let unknown =
            proptest::option::of(prop_oneof![Just(json!(1)), Just(json!({"deviceId": []}))]);
        (members, source, unknown).prop_map(|(members, source, unknown)| {
            let mut m: Map<String, Value> = members.into_iter().flatten().collect();
            m.extend(source.into_iter().map(|(k, v)| (k.to_owned(), v)));
            if let Some(unknown) = unknown {
                m.insert("firmware".into(), unknown);
            }
            Value::Object(m)
        })
    }

    proptest! {
        #[test]
        fn wire_bytes_decode_as_reflections(json in reading()) {
            let outcome = check(&READING, json.to_string().as_bytes())?;
            // No duplicate members nor unplain map keys here: nothing for the wire path to
            // leave alone.
            prop_assert_eq!(outcome.wire_accepted, outcome.reflection_accepted, "{}", json);
        }

        #[test]
        fn wire_path_and_reflection_agree_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            check(&READING, &bytes)?;
        }
    }
}
