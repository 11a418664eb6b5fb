#!/usr/bin/env bash
# A kvgrid command on a GPU machine with torch + Triton but no vLLM (e.g. `kvgrid bench serve`): carry
# .whl and .whl-vllm from scripts/fetch_gpu_wheels.sh --vllm; their wheels go into a private folder
# (kept in /tmp/kvgrid-site for the next command on the same machine), never over the machine's torch.
#
#   scripts/gpu_bench.sh bench serve --device cuda --out OUTDIR [flags...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
site=/tmp/kvgrid-site
if [[ ! -d "$site/vllm" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$root"/.whl/*.whl "$root"/.whl-vllm/*.whl
    tar -xzf "$root/.whl-vllm/vllm-py.tgz" -C "$site"
fi
export PYTHONPATH="$root/services:$root/kernels:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
exec python3 -m kvgrid.cli "$@"
