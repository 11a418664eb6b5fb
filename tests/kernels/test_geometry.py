"""kvgrid_kernels.geometry and the kernels' independence: one descriptor computes every chunk size,
and the kernels distribution imports nothing of kvgrid."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvgrid_kernels import KernelGroupGeometry, KernelGroupPages, alignment


def test_chunk_arithmetic_of_a_compressed_group() -> None:
    # MLA-like: 64 slots of 576 bf16 each per block, 4 tokens per slot.
    g = KernelGroupGeometry(1, 3, 10, 64, 1, 576, torch.bfloat16, tokens_per_block=256)
    assert (g.element_size, g.slots_per_block, g.compression) == (2, 64, 4)
    assert g.bytes_per_block == 64 * 576 * 2
    assert g.blocks_per_chunk(512) == 2 and g.slots_per_chunk(512) == 128
    assert g.bytes_per_chunk(512) == 3 * 2 * 64 * 576 * 2
    with pytest.raises(ValueError, match="multiple of tokens_per_block=256"):
        g.blocks_per_chunk(100)
    with pytest.raises(ValueError, match="compression 256/64"):
        g.slots_per_chunk(6)


def test_tokens_per_block_defaults_to_slots_and_is_validated() -> None:
    assert KernelGroupGeometry(2, 1, 4, 16, 8, 128, torch.float16).tokens_per_block == 16
    with pytest.raises(ValueError, match="tokens_per_block=24 must be a multiple of slots_per_block=16"):
        KernelGroupGeometry(2, 1, 4, 16, 8, 128, torch.float16, tokens_per_block=24)
    with pytest.raises(ValueError, match="'num_heads': 0"):
        KernelGroupGeometry(2, 1, 4, 16, 0, 128, torch.float16)
    with pytest.raises(ValueError, match="kv_size=3"):
        KernelGroupGeometry(3, 1, 4, 16, 8, 128, torch.float16)


def test_pages_must_hold_the_geometrys_bytes() -> None:
    views = (torch.zeros(2, 4, 16 * 8 * 128 * 2, dtype=torch.uint8),)  # K and V planes of one layer
    geo = KernelGroupGeometry(2, 1, 4, 16, 8, 128, torch.float16)
    assert KernelGroupPages(views, geo).geometry.bytes_per_block == 2 * views[0].shape[2]
    with pytest.raises(ValueError, match="expects 1 x 4 x 65536"):
        KernelGroupPages((torch.zeros(1, 4, 100, dtype=torch.uint8),), geo, name="padded")
    with pytest.raises(ValueError, match="expects 2 x 4"):
        KernelGroupPages(views, KernelGroupGeometry(2, 2, 4, 16, 8, 128, torch.float16))


def test_alignment_is_the_largest_power_of_two_up_to_16_dividing_everything() -> None:
    assert alignment() == 16
    assert alignment(64, 4096, 1 << 40) == 16
    assert alignment(64, 24) == 8
    assert alignment(64, 6) == 2
    assert alignment(7, 64) == 1


def test_kernels_import_nothing_of_kvgrid() -> None:
    code = (
        "import sys, kvgrid_kernels, kvgrid_kernels.bench.transfer, kvgrid_kernels.torch_copy; "
        "bad = sorted(m for m in sys.modules if m == 'kvgrid' or m.startswith('kvgrid.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
