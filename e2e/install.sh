#!/usr/bin/env bash
# Installs what Ferry's tests and demo run on, caching outside the repo:
#   - Debian packages: Mosquitto (the real MQTT broker, mosquitto_passwd), the openssl CLI (test
#     certificates), cmake/openssl headers (librdkafka's build), DejaVu fonts (benchmark plots),
#     Lua 5.4 (runs the chart's Argo CD health checks), shellcheck (lints the workflows' scripts),
#     Debian's docker-registry (the CNCF distribution registry) and skopeo (the full-path test
#     installs from a private registry), valgrind (the cost benchmark counts instructions with
#     callgrind)
#   - Apache Kafka's jars from Maven Central (version pinned in e2e/kafka/pom.xml)
#   - Apicurio Registry, the tests' schema registry (Confluent-compatible API), built from Maven
#     Central with the Quarkus Maven plugin (versions pinned in e2e/registry/pom.xml)
#   - a Python venv with confluent-kafka's schema-registry serdes, the independent decoder of
#     the records Ferry encodes (pinned in e2e/tools/confluent-requirements.txt)
# Idempotent and quiet when everything is already there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${FERRY_CACHE:-$HOME/.cache/ferry}
kafka_version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")
kafka_libs="$cache/kafka-$kafka_version/libs"
registry_pom="$here/registry/pom.xml"
apicurio_version=$(sed -n 's:.*<apicurio.version>\(.*\)</apicurio.version>.*:\1:p' "$registry_pom")
registry_dir="$cache/apicurio-registry-$apicurio_version"
python_req="$here/tools/confluent-requirements.txt"
confluent_version=$(sed -n 's/^confluent-kafka\[.*\]==//p' "$python_req")
python_dir="$cache/python-confluent-kafka-$confluent_version"

need_pkgs=()
for bin_pkg in mosquitto:mosquitto mosquitto_pub:mosquitto-clients openssl:openssl cmake:cmake pkg-config:pkg-config \
               java:openjdk-17-jre-headless mvn:maven g++:g++ make:make lua5.4:lua5.4 \
               shellcheck:shellcheck docker-registry:docker-registry skopeo:skopeo python3:python3 \
               valgrind:valgrind; do
  command -v "${bin_pkg%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${bin_pkg%%:*}" ] || need_pkgs+=("${bin_pkg#*:}")
done
for dev_pkg in libssl-dev zlib1g-dev fonts-dejavu-core; do
  dpkg -s "$dev_pkg" >/dev/null 2>&1 || need_pkgs+=("$dev_pkg")
done
# `python3 -m venv` needs ensurepip, which Debian ships apart.
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need_pkgs+=(python3-venv)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "ferry: installing Debian packages: ${need_pkgs[*]}"
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi
# Debian starts a system-wide mosquitto on :1883 and docker-registry on :5000 after install;
# tests run their own on free ports.
for service in mosquitto docker-registry; do
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$service" 2>/dev/null; then
    systemctl disable --now "$service" >/dev/null 2>&1 || true
  fi
done

if [ ! -f "$kafka_libs/.complete" ]; then
  echo "ferry: fetching Apache Kafka $kafka_version jars from Maven Central into $kafka_libs (~55 MB, once)"
  mkdir -p "$kafka_libs"
  mvn -q -f "$here/kafka/pom.xml" dependency:copy-dependencies -DoutputDirectory="$kafka_libs" \
    -Dmaven.repo.local="$cache/m2"
  touch "$kafka_libs/.complete"
fi
bash "$here/kafka/cds.sh" "$kafka_libs" "$cache/kafka-$kafka_version/cds/kafka.jsa"
# Each build below is keyed by the hash of the file that pins it: editing the file rebuilds.
registry_key=$(sha256sum "$registry_pom" | cut -c1-16)
if [ "$(cat "$registry_dir/.complete" 2>/dev/null)" != "$registry_key" ]; then
  echo "ferry: building Apicurio Registry $apicurio_version (the tests' schema registry) from Maven Central into $registry_dir (~135 MB, once)"
  rm -rf "$registry_dir" "$registry_dir.build"
  mvn -B -q -f "$registry_pom" package -Dferry.build.dir="$registry_dir.build" -Dmaven.repo.local="$cache/m2"
  mkdir -p "$registry_dir"
  # The runner jar finds its dependencies in lib/ beside it (its manifest's Class-Path).
  mv "$registry_dir.build/apicurio-registry-runtime-1-runner.jar" "$registry_dir/registry.jar"
  mv "$registry_dir.build/lib" "$registry_dir/lib"
  rm -rf "$registry_dir.build"
  echo "$registry_key" > "$registry_dir/.complete"
fi

python_key=$(sha256sum "$python_req" | cut -c1-16)
if [ "$(cat "$python_dir/.complete" 2>/dev/null)" != "$python_key" ]; then
  echo "ferry: installing confluent-kafka $confluent_version with its schema-registry serdes from PyPI into $python_dir (~120 MB, once)"
  rm -rf "$python_dir"
  python3 -m venv "$python_dir"
  "$python_dir/bin/pip" install -q --disable-pip-version-check -r "$python_req"
  echo "$python_key" > "$python_dir/.complete"
fi
echo "ferry: brokers ready to run (mosquitto $(mosquitto -h 2>/dev/null | sed -n 's/^mosquitto version //p' | head -1), kafka $kafka_version at $kafka_libs, apicurio-registry $apicurio_version at $registry_dir)"
