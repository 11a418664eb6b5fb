"""Shared by the TTFT harness tests."""

from __future__ import annotations

import torch

from kvgrid.ttft.bench import PRESETS


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, PRESETS["tiny"].vocab, (n,), generator=gen).tolist()
