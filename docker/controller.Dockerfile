# kvgrid controller: the cluster-wide lookup/controller service. Slim: it never imports torch.
# Build from the repository root:
#   docker build -f docker/controller.Dockerfile -t kvgrid/controller:dev .
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvgrid
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
# The base distribution has no torch: the controller never needs it (the agent extra adds it).
RUN /opt/kvgrid/bin/pip install --no-cache-dir /src

FROM ${BASE}
COPY --from=build /opt/kvgrid /opt/kvgrid
ENV PATH=/opt/kvgrid/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 65532:65532
# 50061: ControllerService gRPC; 9400: Prometheus /metrics when enabled; 50071: plaintext gRPC health
# for kubelet probes when the service port needs mTLS (--health-port; the chart sets it with TLS on).
EXPOSE 50061 9400 50071
ENTRYPOINT ["kvgrid"]
# Loopback unless TLS is configured (the chart passes its own args): plaintext on a network address
# is refused without --insecure-plaintext-on-network (docs/security.md).
CMD ["controller", "--listen=127.0.0.1:50061"]
