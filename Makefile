# Ferry: the two commands a newcomer needs are `make demo` and `make test`.
# Builds and downloads are cached outside the repo (FERRY_CACHE, default ~/.cache/ferry).
# How long each target takes, cold and warm: docs/development.md#how-long-things-take.
SHELL := /bin/bash
FERRY_CACHE ?= $(HOME)/.cache/ferry
export FERRY_CACHE
# Compiled dependencies are shared by every checkout (cargo's build dir); the binaries, images
# and test reports a checkout builds are its own (its target dir, named after its path), so a
# test or an image never picks up another checkout's build.
export CARGO_BUILD_BUILD_DIR ?= $(FERRY_CACHE)/target
CHECKOUT := $(notdir $(CURDIR))-$(shell printf '%s' '$(CURDIR)' | sha256sum | cut -c1-12)
export CARGO_TARGET_DIR ?= $(FERRY_CACHE)/checkouts/$(CHECKOUT)
export FERRY_IMAGES_DIR ?= $(CARGO_TARGET_DIR)/images

.PHONY: all deps k8s tools helm nextest build release images cost test check lint docs-check unit demo demo-local bench soak crds chart-docs chart-docs-check clean-cache

NEXTEST := $(FERRY_CACHE)/tools/bin/cargo-nextest nextest
# The tests that need no brokers: unit, property and model tests, and the command-line tests
# (nextest runs no doc tests: `cargo test --doc` does).
NO_BROKERS := -E 'kind(lib) | binary(cli)'

all: build

# Debian packages (mosquitto, build tools) and Apache Kafka's jars; idempotent.
deps:
	@bash e2e/install.sh

# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubelet built from the Go
# module proxy (once, then cached by version); idempotent.
k8s:
	@bash e2e/k8s/build.sh

# What `make lint` and `make test` run: helm, kubeconform and actionlint from the Go module proxy,
# kubeconform's Kubernetes JSON schemas generated offline, lychee (the docs' link checker) and
# cargo-nextest (the test runner) from crates.io. Built once, then cached; idempotent. Times:
# docs/development.md#how-long-things-take.
tools:
	@bash e2e/tools/build.sh

# Only helm (all that `make demo` needs of the tools), or only the test runner (`make check`).
helm:
	@bash e2e/tools/build.sh helm

nextest:
	@bash e2e/tools/build.sh nextest

build: deps
	cargo build --workspace --all-targets

# The release binaries: what the images pack, the benchmarks and the demos run. Always this one
# set of packages, so cargo resolves the same features and never rebuilds what another target
# built.
release: deps
	cargo build --release -p ferry-forwarder -p ferry-operator -p ferry-bench -p ferry-e2e

# OCI image tarballs of ferry-operator and ferry-forwarder, built without Docker.
images: release
	@FERRY_IMAGES_SKIP_BUILD=1 bash e2e/images/build.sh

# Formatting, clippy, go vet, and the docs' relative links and #anchors (lychee, offline: README.md,
# docs/, the chart's README, CHANGELOG.md, SECURITY.md).
lint: deps tools
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	bash e2e/tools/vet.sh
	bash e2e/tools/linkcheck.sh

# Only the docs' link check (needs `make tools` once for lychee).
docs-check:
	@bash e2e/tools/linkcheck.sh

# Unit tests plus every integration test against real Mosquitto, Kafka and Kubernetes. Each test
# starts its own brokers on free ports, so cargo-nextest runs several at once
# (.config/nextest.toml); passing tests' output is in target/nextest/default/junit.xml (nextest's
# store, in the checkout).
test: deps k8s tools lint images cost
	cargo test --workspace --doc
	$(NEXTEST) run --workspace

# The per-message path's cost in instructions (callgrind, through gungraun): plain, CEL, Avro and Protobuf
# rules against the budget in bench/src/cost/budget.rs; fails with the figures when a count
# passes it. Part of `make test`. The runner is found on PATH (`make tools` builds it).
cost: release tools
	PATH="$(FERRY_CACHE)/tools/bin:$$PATH" $(CARGO_TARGET_DIR)/release/ferry-cost --bench

# The inner loop: formatting, clippy, and the tests that need no brokers.
check: deps nextest
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(NEXTEST) run --workspace $(NO_BROKERS)
	cargo test --workspace --doc

# Only the tests that need no brokers.
unit: nextest
	$(NEXTEST) run --workspace $(NO_BROKERS)

# Regenerates crds/ and charts/ferry/crd-files/ from api/src/crd.rs (tests fail when they differ).
crds:
	cargo run -q -p ferry-operator --bin crdgen

# Regenerates the values table of charts/ferry/README.md from the `# --` comments of
# charts/ferry/values.yaml (a test fails when they differ); `chart-docs-check` only compares.
chart-docs:
	cargo run -q -p ferry-operator --bin valuesdoc

chart-docs-check:
	cargo run -q -p ferry-operator --bin valuesdoc -- --check

# Benchmarks (release build): the forwarder against its brokers' and client libraries' limits,
# and the operator at 1,000 rules. Writes bench/results/ (markdown, JSON, PNG plots).
# BENCH_ARGS=--quick for a short check of the tool itself.
bench: deps k8s release
	$(CARGO_TARGET_DIR)/release/ferry-bench $(BENCH_ARGS)

# The soak (release build): 1,000,000 QoS 1 messages over 100 MQTT topics through one forwarder
# while a fault hits every 20 s, each kind in turn (Kafka partition, forwarder SIGKILL, MQTT
# partition, Mosquitto restart, Kafka leader SIGKILL). Prints lost/replayed/reordered and the time
# to catch up per fault, writes bench/results/soak.md and soak.json, and fails on any loss or
# reordering. SOAK_ARGS=--soak-messages=N etc. to vary it.
soak: deps release
	$(CARGO_TARGET_DIR)/release/ferry-bench --soak $(SOAK_ARGS)

# Ferry's whole path on a real single-node Kubernetes cluster, narrated (needs root). It builds
# only what it runs: the release binaries and images, the cluster's binaries and helm. From a
# terminal it keeps the cluster up until you press Enter; otherwise it tears down at once.
demo: deps k8s helm images
	$(CARGO_TARGET_DIR)/release/demo-cluster

# The forwarder alone (no Kubernetes): brokers on loopback and examples/forwarder.yaml.
demo-local: release
	$(CARGO_TARGET_DIR)/release/demo-local

# Go makes its module cache read-only; make it writable so it can be removed.
clean-cache:
	chmod -R u+w "$(FERRY_CACHE)" 2>/dev/null || true
	rm -rf "$(FERRY_CACHE)"
