# syntax=docker/dockerfile:1
# The pagekeeper image: the supervisor as the container's main process (under tini), running the engine as its
# child with the process launcher, which holds the listening socket across engine restarts.
#
#   docker build --target cpu  -t pagekeeper:0.1.0-cpu  .     # slim CPU image (the embedded model serves as is)
#   docker build --target cuda -t pagekeeper:0.1.0-cuda .     # CUDA runtime base, torch's CUDA build
#   docker run --rm -p 8000:8000 -p 9400:9400 pagekeeper:0.1.0-cpu
#
# No secrets are baked in: the API and admin keys come from the environment at run time (PAGEKEEPER_API_KEY,
# PAGEKEEPER_ADMIN_KEY; the Helm chart reads them from a Secret).  The base images are arguments, so that a
# mirror or a locally built base can stand in for them.

ARG PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm
ARG CUDA_IMAGE=docker.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04
# What pip installs for torch: a requirement, or a wheel file (an air-gapped build mounts a wheel directory).
ARG TORCH_SPEC=torch==2.13.0

# ---- CUDA: NVIDIA's runtime base; torch from PyPI is its CUDA build ------------------------------------------------
FROM ${CUDA_IMAGE} AS cuda
ARG TORCH_SPEC
ARG TORCH_INDEX_URL=https://pypi.org/simple
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# DL3008: tini and the CA certificates come from the base release's suite, whose security updates replace any
# exact version; the base image's tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 pagekeeper \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/pagekeeper pagekeeper \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /opt/pagekeeper
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY opsctl ./opsctl
COPY systemd ./systemd
# DL3013: torch is pinned by TORCH_SPEC; "." is this repository, whose dependencies pyproject.toml bounds.
# hadolint ignore=DL3013
RUN pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" \
 && pip install . \
 && install -d -o 10001 -g 10001 -m 0700 /run/pagekeeper /var/cache/pagekeeper
COPY deploy/container/pagekeeper.toml /etc/pagekeeper/pagekeeper.toml
ENV PAGEKEEPER_CONFIG=/etc/pagekeeper/pagekeeper.toml PAGEKEEPER_RUNTIME_DIR=/run/pagekeeper/runtime \
    XDG_CACHE_HOME=/var/cache/pagekeeper
USER 10001:10001
EXPOSE 8000 9400
# Docker's own check (Kubernetes ignores it and uses the chart's probes): the supervisor is alive and has not given up.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/livez', timeout=4)"]
ENTRYPOINT ["/usr/bin/tini", "-s", "--"]
CMD ["opsctl", "start", "--foreground"]

# ---- CPU (the default target): Debian slim with CPython; torch's CPU build -----------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_SPEC
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# DL3008: tini and the CA certificates come from the base release's suite, whose security updates replace any
# exact version; the base image's tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini ca-certificates g++ \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 pagekeeper \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/pagekeeper pagekeeper \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/pagekeeper
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY opsctl ./opsctl
COPY systemd ./systemd
# DL3013: torch is pinned by TORCH_SPEC; "." is this repository, whose dependencies pyproject.toml bounds.
# hadolint ignore=DL3013
RUN pip install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple "$TORCH_SPEC" \
 && pip install . \
 && install -d -o 10001 -g 10001 -m 0700 /run/pagekeeper /var/cache/pagekeeper
COPY deploy/container/pagekeeper.toml /etc/pagekeeper/pagekeeper.toml
ENV PAGEKEEPER_CONFIG=/etc/pagekeeper/pagekeeper.toml PAGEKEEPER_RUNTIME_DIR=/run/pagekeeper/runtime \
    XDG_CACHE_HOME=/var/cache/pagekeeper
USER 10001:10001
# The CPU attention extension, built for the build host's CPU (g++ stays in the image: a node whose CPU differs
# builds its own copy into the cache at the first start, in seconds; kernels/cpu_ext.py says why -march=native).
RUN python3 -m kernels.cpu_ext
EXPOSE 8000 9400
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/livez', timeout=4)"]
ENTRYPOINT ["/usr/bin/tini", "-s", "--"]
CMD ["opsctl", "start", "--foreground"]
