#!/usr/bin/env bash
# A kvgrid command on a GPU machine with torch + Triton but no vLLM (e.g. `kvgrid bench serve`): carry
# .whl and .whl-vllm from scripts/fetch_gpu_wheels.sh --vllm (.whl alone for commands without vLLM,
# e.g. `bench p2p`); their wheels go into a private folder (kept in /tmp/kvgrid-site for the next
# command on the same machine), never over the machine's torch.
#
#   scripts/gpu_bench.sh bench serve --device cuda --out OUTDIR [flags...]
#   scripts/gpu_bench.sh bench p2p --streams 4 --security none,mac,aead,tls
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
site=/tmp/kvgrid-site
if [[ ! -f "$site/.kvgrid-wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$root"/.whl/*.whl
    touch "$site/.kvgrid-wheels"
fi
# vLLM's sources, for the commands that use them (bench serve, bench ttft); bench p2p needs none.
if [[ ! -d "$site/vllm" && -f "$root/.whl-vllm/vllm-py.tgz" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$root"/.whl-vllm/*.whl
    tar -xzf "$root/.whl-vllm/vllm-py.tgz" -C "$site"
fi
export PYTHONPATH="$root/services:$root/kernels:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
exec python3 -m kvgrid.cli "$@"
