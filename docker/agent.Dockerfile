# kvgrid agent: the per-GPU sidecar (L1 pinned cache, transfer kernels, AgentService).
# Build from the repository root:
#   docker build -f docker/agent.Dockerfile -t kvgrid/agent:dev .
# BASE is any CUDA image whose driver requirement the nodes meet; torch brings its own CUDA
# libraries, so the base only needs the driver hooks and a Python. TORCH_INDEX_URL picks a torch
# build (e.g. https://download.pytorch.org/whl/cu128); empty = PyPI's default CUDA build.
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${BASE} AS build
ARG TORCH_INDEX_URL=""
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Versions follow BASE (its distribution picks them), so they are not pinned here.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvgrid
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
RUN /opt/kvgrid/bin/pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
    /src/kernels "/src[agent]"

FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive
# gcc, libc headers and Python headers: Triton compiles its small CUDA launcher at first use.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvgrid /opt/kvgrid
ENV PATH=/opt/kvgrid/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton
USER 65532:65532
# 50062: AgentService over TCP (peers, controller); 9401: Prometheus /metrics when enabled.
EXPOSE 50062 9401
ENTRYPOINT ["kvgrid"]
CMD ["agent"]
