# vLLM with kvgrid installed, so --kv-transfer-config can load kvgrid.connector.vllm:KVGridConnector.
# Build from the repository root:
#   docker build -f docker/vllm.Dockerfile -t kvgrid/vllm:dev .
ARG BASE=vllm/vllm-openai:v0.32.0
FROM ${BASE}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/kvgrid-src
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
# Keep every package vLLM already has at its version (constraints from pip freeze): kvgrid's other
# dependencies are added, and a version conflict fails the build instead of breaking vLLM.
RUN python3 -m pip freeze --exclude-editable > /tmp/constraints.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/constraints.txt \
       /opt/kvgrid-src/kernels "/opt/kvgrid-src[agent]"
WORKDIR /
