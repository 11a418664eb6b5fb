#!/usr/bin/env bash
# Download, into .whl/, the wheels scripts/gpu_suite.sh installs on a GPU machine that has torch and
# Triton but not kvgrid's other dependencies (e.g. the lent H200: Python 3.12, nothing reachable).
# The versions are the ones this checkout's .venv runs, so the generated protobuf code matches.
#
#   scripts/fetch_gpu_wheels.sh [--lmcache] [PYTHON_VERSION]   (default 3.12)
#
# --lmcache also fetches LMCache 0.5.2 into .whl-lmcache/ (not installed: `kvgrid bench transfer
# --lmcache-wheel` loads its kernel extension as a reference row; 0.5.4+ do not import under torch 2.11).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lmcache=0
if [[ "${1:-}" == "--lmcache" ]]; then lmcache=1; shift; fi
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
if ((lmcache)); then
    rm -rf "$root/.whl-lmcache"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$root/.whl-lmcache" lmcache==0.5.2
    grep -qx '/.whl-lmcache/' "$root/.git/info/exclude" || echo '/.whl-lmcache/' >>"$root/.git/info/exclude"
fi
ls "$root/.whl"
