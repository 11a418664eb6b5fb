"""Benchmarks of the transfer kernels, apart from the kernels themselves (nothing under
``kvgrid_kernels`` outside this package imports it).

- ``transfer``: ``kvgrid bench transfer``, store/retrieve GB/s per geometry against the pinned-memcpy
  limit measured in the same run.
- ``interference``: how much an engine's step slows down while KV moves (``--interference``).
- ``lmcache_ref``: LMCache's transfer kernel as a reference row (``--lmcache-wheel``).
"""
