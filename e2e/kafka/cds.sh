#!/usr/bin/env bash
# Makes the class-data sharing archive of the tests' Kafka: the classes a broker loads at start,
# parsed and verified once and mapped by every later JVM (-XX:SharedArchiveFile, which
# e2e/src/kafka_node.rs passes when the archive is there). A broker then starts on about a third
# of the CPU (measured in docs/development.md#how-long-things-take), and the test suite starts
# about a hundred of them, side by side on two cores.
#
# Usage: e2e/kafka/cds.sh LIBS ARCHIVE
# Idempotent: the archive is made again only when the JVM or the jars change (its stamp). A JVM
# that cannot use the archive (another version) ignores it and starts as without it.
set -euo pipefail
libs=$1
archive=$2
stamp="$(java -version 2>&1 | tr '\n' ' ') $(find "$libs" -maxdepth 1 -printf '%f %s %T@\n' | sort | sha256sum | cut -c1-16)"
[ -f "$archive" ] && [ "$(cat "$archive.stamp" 2>/dev/null)" = "$stamp" ] && exit 0

echo "ferry: making the Kafka class-data sharing archive $archive (once, about 15 s)"
work=$(mktemp -d)
broker=0
trap '[ "$broker" = 0 ] || kill "$broker" 2>/dev/null || true; rm -rf "$work"' EXIT
ports=$(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')
read -r port cport <<<"$ports"
cat >"$work/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
controller.listener.names=CONTROLLER
log.dirs=$work/data
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
PROPS
cp=("-cp" "$libs/*")
java -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC "${cp[@]}" kafka.tools.StorageTool \
  format -t "$(python3 -c 'import base64, os; print(base64.urlsafe_b64encode(b"\x00" + os.urandom(15)).decode().rstrip("="))')" \
  -c "$work/server.properties" >"$work/format.log" 2>&1 || { cat "$work/format.log" >&2; exit 1; }
mkdir -p "$(dirname "$archive")"
# The flags the tests' brokers run with (kafka_node.rs BROKER_JVM): an archive is only used by
# a JVM whose GC and heap settings fit it.
java -Xms256m -Xmx1g -XX:+UseSerialGC -XX:ArchiveClassesAtExit="$archive.tmp" \
  -Djava.awt.headless=true "${cp[@]}" kafka.Kafka "$work/server.properties" >"$work/kafka.log" 2>&1 &
broker=$!
for _ in $(seq 300); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  kill -0 "$broker" 2>/dev/null || { cat "$work/kafka.log" >&2; exit 1; }
  sleep 0.1
done
# Past the port: the controller and the broker's first metadata, as a test's first request.
sleep 3
kill "$broker"
wait "$broker" || true
broker=0
[ -s "$archive.tmp" ] || { echo "ferry: no archive written; the broker's log:" >&2; cat "$work/kafka.log" >&2; exit 1; }
mv -f "$archive.tmp" "$archive"
printf '%s\n' "$stamp" >"$archive.stamp"
