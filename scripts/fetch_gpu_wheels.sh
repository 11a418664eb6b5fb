#!/usr/bin/env bash
# Download, into .whl/, the wheels scripts/gpu_suite.sh installs on a GPU machine that has torch and
# Triton but not kvgrid's other dependencies (e.g. the lent H200: Python 3.12, nothing reachable).
# The versions are the ones this checkout's .venv runs, so the generated protobuf code matches.
#
#   scripts/fetch_gpu_wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${1:-3.12}"
venv_pip="$root/.venv/bin/python -m pip"
version() { $venv_pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'; }
pkgs=()
for name in protobuf grpcio grpcio-health-checking grpcio-reflection msgspec opentelemetry-api \
    opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-grpc xxhash \
    opentelemetry-exporter-otlp-proto-common opentelemetry-proto opentelemetry-exporter-prometheus \
    googleapis-common-protos; do
    v="$(version "$name")"
    [[ -n "$v" ]] || { echo "$name is not installed in .venv: run make install first" >&2; exit 1; }
    pkgs+=("$name==$v")
done
rm -rf "$root/.whl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$root/.whl" "${pkgs[@]}" importlib_metadata zipp
grep -qx '/.whl/' "$root/.git/info/exclude" 2>/dev/null || echo '/.whl/' >>"$root/.git/info/exclude"
ls "$root/.whl"
