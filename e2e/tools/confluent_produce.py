#!/usr/bin/env python3
"""Writes records in the Confluent wire format with confluent-kafka's own serializers: the
reference producer the tests compare Ferry's records with, and a way to put known-good records
on a topic for confluent_consume.py.

    confluent_produce.py BOOTSTRAP TOPIC {avro,protobuf,json} REGISTRY_URL
        [--registry-user USER --registry-password PASSWORD] [--registry-ca CA_PEM]
        [--message FULL_NAME] < values.jsonl

Each stdin line is one record's value as JSON. The schema is the latest version registered
under the topic's subject (`TOPIC-value`, TopicNameStrategy); nothing is registered. Avro and
JSON Schema go through AvroSerializer and JSONSerializer (`use.latest.version`). Protobuf values
are JSON mapped to the message (`--message`, default the file's first) of a class built from
the registered `.proto` (confluent_proto.py); ProtobufSerializer itself cannot be used here: it
asks the registry for the schema as a base64 descriptor (`?format=serialized`), which Apicurio
2.4 does not serve. So the Protobuf record is framed with confluent-kafka's own pieces
(SchemaId with the message's index array, the prefix serializer) around the message's
SerializeToString(). Prints the schema id used.
"""

import argparse
import json
import sys

from confluent_kafka import Producer
from confluent_kafka.schema_registry import prefix_schema_id_serializer
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.common.protobuf import PROTOBUF_TYPE, _create_index_array
from confluent_kafka.schema_registry.common.serde import SchemaId
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import json_format

import confluent_consume
import confluent_proto

CONF = {"auto.register.schemas": False, "use.latest.version": True}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bootstrap")
    parser.add_argument("topic")
    parser.add_argument("format", choices=["avro", "protobuf", "json"])
    parser.add_argument("registry_url")
    parser.add_argument("--registry-user")
    parser.add_argument("--registry-password")
    parser.add_argument("--registry-ca")
    parser.add_argument("--message")
    args = parser.parse_args()

    registry = confluent_consume.registry_client(args)
    subject = f"{args.topic}-value"
    latest = registry.get_latest_version(subject)
    if args.format == "avro":
        serializer = AvroSerializer(registry, None, conf=CONF)
        to_value = lambda obj: obj  # noqa: E731
    elif args.format == "json":
        serializer = JSONSerializer(None, registry, conf=CONF)
        to_value = lambda obj: obj  # noqa: E731
    else:
        file_desc = confluent_proto.file_descriptor(registry, latest.schema_id)
        if args.message:
            cls = confluent_proto.message_class_by_name(file_desc, args.message)
        else:
            cls = confluent_proto.message_class(file_desc, [0])
        schema_id = SchemaId(
            PROTOBUF_TYPE, latest.schema_id, None, _create_index_array(cls.DESCRIPTOR)
        )

        def serializer(message, ctx):
            return prefix_schema_id_serializer(message.SerializeToString(), ctx, schema_id)

        to_value = lambda obj: json_format.ParseDict(obj, cls())  # noqa: E731

    producer = Producer({"bootstrap.servers": args.bootstrap})
    ctx = SerializationContext(args.topic, MessageField.VALUE)
    failures = []
    for line in sys.stdin:
        if not line.strip():
            continue
        payload = serializer(to_value(json.loads(line)), ctx)
        producer.produce(
            args.topic, payload, on_delivery=lambda err, _msg: err and failures.append(err)
        )
    if producer.flush(30) != 0 or failures:
        sys.exit(f"produce to {args.topic}: {failures or 'not delivered within 30 s'}")
    print(latest.schema_id)


if __name__ == "__main__":
    main()
