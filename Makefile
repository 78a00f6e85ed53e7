# Ferry: the two commands a newcomer needs are `make demo` and `make test`.
# Builds and downloads are cached outside the repo (FERRY_CACHE, default ~/.cache/ferry).
SHELL := /bin/bash
FERRY_CACHE ?= $(HOME)/.cache/ferry
export FERRY_CACHE
export CARGO_TARGET_DIR ?= $(FERRY_CACHE)/target

.PHONY: all deps k8s build test lint unit demo crds clean-cache

all: build

# Debian packages (mosquitto, build tools) and Apache Kafka's jars; idempotent.
deps:
	@bash e2e/install.sh

# etcd, kube-apiserver and kube-controller-manager built from the Go module proxy (about 5 min
# once, then cached by version); idempotent.
k8s:
	@bash e2e/k8s/build.sh

build: deps
	cargo build --workspace --all-targets

lint: deps
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

# Unit tests plus every integration test against real Mosquitto and Kafka. The broker tests
# each start their own brokers; they run one at a time so timings stay meaningful on 2 cores.
test: deps k8s lint
	cargo test --workspace -- --test-threads=1 --nocapture

# Only the tests that need no brokers.
unit:
	cargo test --workspace --lib --test cli

# Regenerates crds/ from api/src/crd.rs (a test fails when they differ).
crds:
	cargo run -q -p ferry-operator --bin crdgen

demo: deps
	cargo build -p ferry-forwarder -p ferry-e2e --bin ferry-forwarder --bin demo-local
	$(CARGO_TARGET_DIR)/debug/demo-local

clean-cache:
	rm -rf "$(FERRY_CACHE)"
