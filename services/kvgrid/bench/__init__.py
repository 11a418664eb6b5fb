"""Benchmarks, demos and test harnesses: code that runs kvgrid rather than being part of it.

The runtime packages (``common``, ``agent``, ``controller``, ``connector``, ``router``) never
import this package; only ``kvgrid.cli`` names its modules, imported when their command runs
(``kvgrid bench NAME``, ``kvgrid demo``, ``kvgrid chaos``).

- ``kvgrid bench``: ``agent`` (with ``agent_tp``, ``agent_procs``), ``hotpath``, ``p2p``, ``tier``,
  ``checksum``, ``hashing``, ``lookup`` (with ``lookup_workload``, ``lookup_clients``,
  ``lookup_peers``), ``routing`` (with ``routing_sim``), ``ttft/`` (``ttft`` and ``serve``);
  ``transfer`` lives with the kernels (``kvgrid_kernels.bench.transfer``).
- ``demo``, ``demo_vllm``: ``kvgrid demo``.
- ``chaos/``: ``kvgrid chaos``, the demo's workload under random faults.
"""
