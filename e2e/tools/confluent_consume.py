#!/usr/bin/env python3
"""Reads records from a Kafka topic and decodes each with confluent-kafka's own deserializers
against a schema registry: the independent check of what Ferry writes in the Confluent wire
format (magic byte 0, 4-byte big-endian schema id, payload).

    confluent_consume.py BOOTSTRAP TOPIC COUNT {avro,protobuf,json} REGISTRY_URL
        [--registry-user USER --registry-password PASSWORD] [--registry-ca CA_PEM]
        [--timeout SECONDS]

Prints one JSON object per record, in partition/offset order as consumed:
{"partition": P, "offset": O, "key": "…" or null, "schema_id": ID, "value": <decoded value>}.
Avro uses AvroDeserializer with the writer schema from the registry; JSON Schema uses
JSONDeserializer validating against the registered schema; Protobuf uses ProtobufDeserializer
with a message class built from the registered `.proto` (see confluent_proto.py), the message
picked by the record's message index. Exits non-zero, saying why, when a record does not decode
or fewer than COUNT records arrive within the timeout. Run with the venv e2e/install.sh makes
($FERRY_CACHE/python-confluent-*/bin/python).
"""

import argparse
import base64
import json
import struct
import sys
import time
import uuid

from confluent_kafka import Consumer, KafkaError
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import json_format

import confluent_proto


def registry_client(args):
    conf = {"url": args.registry_url}
    if args.registry_user is not None:
        conf["basic.auth.user.info"] = f"{args.registry_user}:{args.registry_password}"
    if args.registry_ca is not None:
        conf["ssl.ca.location"] = args.registry_ca
    return SchemaRegistryClient(conf)


def wire_schema_id(payload):
    if payload is None or len(payload) < 5 or payload[0] != 0:
        raise ValueError(f"not in the Confluent wire format: {payload[:16]!r}")
    return struct.unpack(">I", payload[1:5])[0]


def to_json(value):
    """bytes (Avro bytes/fixed) as base64; everything else as the deserializer gave it."""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class Decoder:
    def __init__(self, fmt, registry):
        self.fmt = fmt
        self.registry = registry
        self.avro = AvroDeserializer(registry) if fmt == "avro" else None
        # The writer schema from the registry (schema_str None), validated against.
        self.json = JSONDeserializer(None, schema_registry_client=registry) if fmt == "json" else None
        self.proto_files = {}
        self.proto_deserializers = {}

    def decode(self, payload, ctx):
        if self.fmt == "avro":
            return self.avro(payload, ctx)
        if self.fmt == "json":
            return self.json(payload, ctx)
        schema_id = wire_schema_id(payload)
        if schema_id not in self.proto_files:
            self.proto_files[schema_id] = confluent_proto.file_descriptor(self.registry, schema_id)
        indexes = tuple(confluent_proto.message_indexes(payload))
        key = (schema_id, indexes)
        if key not in self.proto_deserializers:
            cls = confluent_proto.message_class(self.proto_files[schema_id], list(indexes))
            self.proto_deserializers[key] = ProtobufDeserializer(cls, {"use.deprecated.format": False})
        message = self.proto_deserializers[key](payload, ctx)
        return json_format.MessageToDict(message, preserving_proto_field_name=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bootstrap")
    parser.add_argument("topic")
    parser.add_argument("count", type=int)
    parser.add_argument("format", choices=["avro", "protobuf", "json"])
    parser.add_argument("registry_url")
    parser.add_argument("--registry-user")
    parser.add_argument("--registry-password")
    parser.add_argument("--registry-ca")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()

    decoder = Decoder(args.format, registry_client(args))
    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": f"ferry-confluent-consume-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([args.topic])
    deadline = time.monotonic() + args.timeout
    seen = 0
    try:
        while seen < args.count:
            if time.monotonic() > deadline:
                sys.exit(f"{seen} of {args.count} records from {args.topic} within {args.timeout} s")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    continue
                sys.exit(f"consume {args.topic}: {msg.error()}")
            payload = msg.value()
            ctx = SerializationContext(msg.topic(), MessageField.VALUE, msg.headers())
            try:
                schema_id = wire_schema_id(payload)
                value = decoder.decode(payload, ctx)
            except Exception as e:  # noqa: BLE001 - any decoding failure ends the run
                sys.exit(
                    f"record {msg.partition()}/{msg.offset()} of {args.topic} does not decode as "
                    f"{args.format}: {type(e).__name__}: {e}"
                )
            key = msg.key()
            print(
                json.dumps(
                    {
                        "partition": msg.partition(),
                        "offset": msg.offset(),
                        "key": key.decode("utf-8", "replace") if key is not None else None,
                        "schema_id": schema_id,
                        "value": value,
                    },
                    default=to_json,
                ),
                flush=True,
            )
            seen += 1
    finally:
        consumer.close()


if __name__ == "__main__":
    main()
