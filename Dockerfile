# syntax=docker/dockerfile:1
# Ferry's container images, for building with Docker (BuildKit) elsewhere:
#
#   docker build --target operator  -t ferry-operator:0.1.0 .
#   docker build --target forwarder -t ferry-forwarder:0.1.0 .
#
# This mirrors e2e/images/build.sh, which builds the same images without Docker (OCI layout
# tarballs for `ctr images import`). Both lay out the root filesystem with e2e/images/oci.py,
# so both images hold the same files: the binary (debug info stripped) at
# /usr/local/bin/<name>, the dynamic loader and the libraries `ldd` lists, Debian's CA bundle,
# /etc/passwd and /etc/group with the user nonroot (65532), /etc/nsswitch.conf, /tmp (1777) —
# no shell, no package manager. The libraries come from this builder's Debian bookworm, as
# build.sh takes them from a bookworm host. The final stages set the config build.sh writes
# (user, entrypoint, env, workdir, labels); e2e/tests/images.rs checks that they agree, so
# change both together. VERSION must be the workspace version (Cargo.toml).
ARG VERSION=0.1.0

FROM rust:1-bookworm AS build
# cmake, pkg-config, libssl-dev, zlib1g-dev: librdkafka's build and the libraries it links;
# python3 and binutils (objcopy): e2e/images/oci.py.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      binutils ca-certificates cmake libssl-dev pkg-config python3 zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY api api
COPY bench bench
COPY e2e e2e
COPY forwarder forwarder
COPY operator operator
# The patched crates ([patch.crates-io] in Cargo.toml): rdkafka, cel.
COPY third_party third_party
RUN cargo build --release --locked -p ferry-operator -p ferry-forwarder

FROM build AS rootfs-operator
RUN python3 e2e/images/oci.py rootfs --binary target/release/ferry-operator --name ferry-operator --dest /rootfs

FROM build AS rootfs-forwarder
RUN python3 e2e/images/oci.py rootfs --binary target/release/ferry-forwarder --name ferry-forwarder --dest /rootfs

FROM scratch AS operator
ARG VERSION
# COPY --from keeps the owners and modes oci.py set (/home/nonroot is 65532's, /tmp is 1777).
COPY --from=rootfs-operator /rootfs/ /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.opencontainers.image.title="ferry-operator"
LABEL org.opencontainers.image.version="${VERSION}"
LABEL org.opencontainers.image.description="Ferry's Kubernetes operator: renders and reconciles forwarder workloads from BrokerConnection and ForwardingRule resources."
LABEL org.opencontainers.image.licenses="Apache-2.0"
WORKDIR /home/nonroot
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ferry-operator"]

FROM scratch AS forwarder
ARG VERSION
COPY --from=rootfs-forwarder /rootfs/ /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.opencontainers.image.title="ferry-forwarder"
LABEL org.opencontainers.image.version="${VERSION}"
LABEL org.opencontainers.image.description="Ferry's data plane: forwards MQTT messages into Kafka, at least once, in order."
LABEL org.opencontainers.image.licenses="Apache-2.0"
WORKDIR /home/nonroot
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ferry-forwarder"]
