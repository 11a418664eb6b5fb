#!/usr/bin/env bash
# The GPU half of the test suite and the GPU benchmarks, on a machine with an NVIDIA GPU and a CUDA
# torch + Triton already installed (CI has no GPU; run this by hand and record the results in
# docs/benchmarks.md).
#
#   scripts/gpu_suite.sh [OUTDIR]
#
# Carry .whl (and .whl-lmcache for the LMCache reference row, .whl-vllm for the TTFT harness). Missing dependencies can be pre-downloaded as wheels into .whl/ (scripts/fetch_gpu_wheels.sh);
# they are installed into a private folder, never over the machine's torch. Both source roots
# (services/ for kvgrid, kernels/ for kvgrid_kernels) go on PYTHONPATH as they are, so nothing is
# built or installed into the system.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/build/gpu-suite}"
mkdir -p "$out"
site="$(mktemp -d)"
if compgen -G "$root/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$root"/.whl/*.whl
fi
# vLLM's Python sources for the TTFT harness (scripts/fetch_gpu_wheels.sh --vllm): no vLLM kernel runs.
ttft=0
if [[ -f "$root/.whl-vllm/vllm-py.tgz" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$root"/.whl-vllm/*.whl
    tar -xzf "$root/.whl-vllm/vllm-py.tgz" -C "$site"
    ttft=1
fi
export PYTHONPATH="$root/services:$root/kernels:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/kernels tests/agent/test_gpu.py tests/agent/test_engine_copies.py \
    2>&1 | tee "$out/pytest-gpu.log"
# LMCache's kernel joins the transfer table when its wheel was fetched (fetch_gpu_wheels.sh --lmcache)
lmcache=()
for w in "$root"/.whl-lmcache/lmcache-*.whl; do [[ -f "$w" ]] && lmcache=(--lmcache-wheel "$w"); done
python3 -m kvgrid.cli bench transfer --device cuda ${lmcache[@]+"${lmcache[@]}"} --out "$out/bench-transfer.json"
for n in 1 32; do
    python3 -m kvgrid.cli bench agent --device cuda --chunks "$n" --iters 10
done 2>&1 | tee "$out/bench-agent.txt"
if ((ttft)); then
    # tests/ttft/test_tp.py's 2-GPU test runs here too; it skips itself on a host with fewer GPUs.
    NCCL_NVLS_ENABLE=0 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/ttft 2>&1 | tee "$out/pytest-ttft.log"
    for copies in engine agent; do
        python3 -m kvgrid.cli bench ttft --device cuda --copies "$copies"
    done 2>&1 | tee "$out/bench-ttft.txt"
    # Tensor parallelism 2: one rank process per GPU, NCCL with NVLink multicast off, one agent per rank.
    if (($(nvidia-smi -L | wc -l) >= 2)); then
        NCCL_NVLS_ENABLE=0 python3 -m kvgrid.cli bench ttft --device cuda --tp 2 --prompts 8192 2>&1 \
            | tee "$out/bench-ttft-tp2.txt"
    fi
fi
