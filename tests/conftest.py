"""Shared pytest setup. Helpers: append your fixtures below; keep this file import-light."""

from __future__ import annotations

import os

# vLLM picks its platform at import time; the test machines have no GPU (vllm.md §6).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
