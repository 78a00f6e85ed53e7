"""Protobuf message classes built at run time from schemas fetched from a schema registry.

confluent-kafka's ProtobufSerializer and ProtobufDeserializer take a generated message class;
the tests have only the `.proto` text registered in the registry. This compiles that text (and
the schemas it references, fetched the same way) with protoc from grpcio-tools into descriptors,
and makes the classes with protobuf's message_factory. Used by confluent_consume.py and
confluent_produce.py.
"""

import os
import tempfile

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_tools import protoc

try:
    from importlib.resources import files as _resource_files
except ImportError:  # pragma: no cover
    _resource_files = None


def _well_known_include():
    """The directory of google/protobuf/*.proto shipped with grpcio-tools."""
    return str(_resource_files("grpc_tools").joinpath("_proto"))


def _write_with_references(registry, schema, name, root, seen):
    """Writes `schema` (a confluent_kafka Schema) as `root/name`, and its references under the
    names they are imported by."""
    if name in seen:
        return
    seen.add(name)
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(schema.schema_str)
    for ref in schema.references or []:
        registered = registry.get_version(ref.subject, ref.version)
        _write_with_references(registry, registered.schema, ref.name, root, seen)


def file_descriptor(registry, schema_id):
    """The FileDescriptor of the Protobuf schema `schema_id` in `registry` (a
    SchemaRegistryClient), in a pool of its own."""
    schema = registry.get_schema(schema_id)
    if schema.schema_type != "PROTOBUF":
        raise ValueError(f"schema {schema_id} is {schema.schema_type}, not PROTOBUF")
    name = f"registry_schema_{schema_id}.proto"
    with tempfile.TemporaryDirectory(prefix="ferry-proto-") as root:
        _write_with_references(registry, schema, name, root, set())
        out = os.path.join(root, "descriptors.pb")
        args = [
            "protoc",
            f"-I{root}",
            f"-I{_well_known_include()}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            os.path.join(root, name),
        ]
        if protoc.main(args) != 0:
            raise ValueError(f"protoc could not compile schema {schema_id}:\n{schema.schema_str}")
        with open(out, "rb") as f:
            descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fdp in descriptor_set.file:
        pool.Add(fdp)
    return pool.FindFileByName(name)


def message_class(file_desc, indexes):
    """The class of the message at `indexes` in `file_desc`: the Confluent wire format's message
    index path ([0] is the file's first message; [1, 0] the first nested message of the
    second), walked in declaration order."""
    fdp = descriptor_pb2.FileDescriptorProto()
    file_desc.CopyToProto(fdp)
    msg = fdp.message_type[indexes[0]]
    names = [msg.name]
    for i in indexes[1:]:
        msg = msg.nested_type[i]
        names.append(msg.name)
    full_name = ".".join(([fdp.package] if fdp.package else []) + names)
    return message_class_by_name(file_desc, full_name)


def message_class_by_name(file_desc, full_name):
    """The class of the message named `full_name` (package included) in `file_desc`."""
    return message_factory.GetMessageClass(file_desc.pool.FindMessageTypeByName(full_name))


def read_varint(data, pos):
    """An unsigned varint at data[pos:]: (value, next position)."""
    shift = value = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def read_zigzag(data, pos):
    value, pos = read_varint(data, pos)
    return (value >> 1) ^ -(value & 1), pos


def message_indexes(payload):
    """The message index path after the 5-byte header of a Confluent Protobuf record: a zigzag
    varint count then that many zigzag varints; a count of 0 means [0]."""
    count, pos = read_zigzag(payload, 5)
    if count == 0:
        return [0]
    indexes = []
    for _ in range(count):
        index, pos = read_zigzag(payload, pos)
        indexes.append(index)
    return indexes
