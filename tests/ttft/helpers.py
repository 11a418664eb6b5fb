"""Shared by the TTFT harness tests."""

from __future__ import annotations

import torch

from kvgrid.bench.ttft.bench import PRESETS


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, PRESETS["tiny"].vocab, (n,), generator=gen).tolist()


# A hit's logits against its miss's: the hit runs the tail's few rows through the projections, the
# MLP and the attention (with an explicit mask instead of the causal flag), the miss every row of
# the prompt. Kernels that pick their blocking by the row count (oneDNN's AMX bf16 GEMMs on Intel
# Xeon, the GPU's) then sum the same products in another order, and a bf16 rounding of an
# activation may flip: the logits move by a unit or two of bf16 at their magnitude (the tiny model's
# stay below 8, where a unit is at most 2**-5; 0.015625 seen on an AMX Xeon, and here when the GEMMs
# sum K in four blocks). Bit for bit only what runs the same kernels on the same shapes is compared:
# the hit against a tail prefill over the same KV, the miss against a full prefill.
CROSS_SHAPE_ATOL = 2**-4


def assert_cross_shape_close(hit: torch.Tensor, miss: torch.Tensor) -> None:
    """``hit`` (a tail's logits) within :data:`CROSS_SHAPE_ATOL` of ``miss`` (the whole prompt's)."""
    assert torch.isfinite(hit).all() and torch.isfinite(miss).all()
    diff = float((hit - miss).abs().max())
    assert diff <= CROSS_SHAPE_ATOL, f"hit against miss: {diff} > {CROSS_SHAPE_ATOL}"
