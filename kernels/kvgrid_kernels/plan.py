"""The transfer plan: store (gather paged KV blocks into chunk buffers) and retrieve (scatter them
back) for every layer of every kernel group, on CPU with torch indexing and on CUDA with one Triton
launch per kernel group and piece.

CUDA modes (``TransferPlan(mode=...)``):

``staged`` (default for pinned host chunks)
    The kernel gathers into a GPU staging slot, a DMA (``cudaMemcpyAsync``) moves the slot to the
    chunk buffer; pieces (whole layers, at most ``pipeline_bytes``) alternate between
    ``staging_slots`` slots so the next gather (or the previous scatter) runs while the DMA engine
    moves bytes. A store starts with a ``lead_bytes`` piece so the first DMA starts early; a
    retrieve ends with one so little scatter work is left after the last DMA. The SMs are busy
    only for the short device-to-device part (on a high-priority stream), so the engine's kernels
    barely notice a transfer.
``direct``
    The kernel reads/writes the chunk buffers in place: GPU chunk buffers, or pinned host memory
    through unified addressing ("zero-copy"; SMs drive PCIe for the whole transfer).
``torch``
    ``index_select``/``index_copy_`` per layer (the correctness reference; the baseline in
    ``kvgrid bench transfer``).

All CUDA work runs on the plan's own streams, never on the caller's current stream: the plan's
streams first wait for ``wait_event`` (or an event recorded on the caller's current stream), and
the returned :class:`TransferHandle` carries an event that completes with the transfer.

``staged`` and ``direct`` transfers of a shape seen before replay a CUDA graph of the same device
work (``graph_launch``; ``graphs=False`` turns it off): the host cost of queueing drops from ~20
torch/CUDA calls to a few driver calls.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from . import torch_copy
from .pages import ChunkLayout, KernelGroupPages, alignment

if TYPE_CHECKING:
    from .graph_launch import GraphRunner

Mode = Literal["auto", "staged", "direct", "torch"]
BlockIds = Sequence[int] | np.ndarray | torch.Tensor

# Measured on an H200 (docs/kernels.md, "Why `staged`"): each extra DMA costs ~4 us, the gather
# ~0.7 us/MiB, so the pipeline starts with a small lead piece (store; the small piece is last on
# retrieve) and moves the rest in pieces as large as possible.
DEFAULT_PIPELINE_BYTES = 32 << 20
DEFAULT_LEAD_BYTES = 2 << 20
DEFAULT_STAGING_SLOTS = 2
_UPLOAD_RING = 4  # pinned upload buffers per plan: calls queued back to back rarely find all busy
_UPLOAD_MIN_WORDS = 4096


class TransferHandle:
    """A transfer in flight. ``event`` is None when the transfer already finished (CPU path)."""

    def __init__(self, event: torch.cuda.Event | None = None, keepalive: tuple[Any, ...] = ()) -> None:
        self.event = event
        self._keepalive: tuple[Any, ...] | None = keepalive

    def done(self) -> bool:
        finished = self.event is None or bool(self.event.query())
        if finished:
            self._keepalive = None
        return finished

    def wait(self) -> None:
        """Block the calling thread until the transfer finished."""
        if self.event is not None:
            self.event.synchronize()
        self._keepalive = None

    def wait_stream(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` (e.g. the engine's) wait for the transfer without blocking the host."""
        if self.event is not None:
            stream.wait_event(self.event)


@dataclass(frozen=True)
class PreparedRetrieve:
    """A retrieve from chunk buffers on the GPU whose device tables (chunk offsets, block ids) are
    already uploaded (:meth:`TransferPlan.prepare_retrieve`); :meth:`TransferPlan.launch_prepared`
    then queues kernels only -- no host-to-device copy, so nothing of it waits behind a DMA on the
    copy engine."""

    chunks: list[torch.Tensor]
    tables: list[torch.Tensor]  # per group: chunk word offsets, block ids (views of one upload)
    aligns: tuple[int, ...]
    host: torch.Tensor  # the pinned source of the upload (kept until the upload ran)


@dataclass(frozen=True)
class _Piece:
    chunk: int
    group: int
    layer_start: int
    layer_end: int
    offset: int  # bytes from the chunk buffer start
    nbytes: int


class _UploadSlot:
    """A persistent pinned int64 buffer, its device twin, and the event of its last copy."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.int64, device=device)
        self.free = torch.cuda.Event()
        self.parts: dict[tuple[int, ...], list[torch.Tensor]] = {}


class _GroupTables:
    """Per-group int64 tables on the device, in words of one size, relative to an anchor."""

    def __init__(self, group: KernelGroupPages, anchor: torch.Tensor) -> None:
        word = anchor.element_size()
        base = anchor.data_ptr()
        rows = [
            [(v.data_ptr() - base) // word for v in group.layers],
            [v.stride(0) // word for v in group.layers],
            [v.stride(1) // word for v in group.layers],
        ]
        t = torch.tensor(rows, dtype=torch.int64).to(anchor.device)
        self.layer_off, self.plane_stride, self.block_stride = t[0], t[1], t[2]
        self._slices: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tables of layers ``start:end`` (cached: pieces repeat from call to call)."""
        key = (start, end)
        if key not in self._slices:
            self._slices[key] = (
                self.layer_off[start:end],
                self.plane_stride[start:end],
                self.block_stride[start:end],
            )
        return self._slices[key]


class TransferPlan:
    """Moves chunks between paged KV memory and chunk buffers for a fixed set of kernel groups.

    Chunk buffers are 1-D ``uint8`` tensors of at least :attr:`bytes_per_chunk` bytes (views into the
    L1 pool); their byte layout is :class:`ChunkLayout` (``plan.layout``). ``block_ids_per_info[g]``
    lists, for kernel group ``g`` (the order of ``manager.kernel_groups`` / engine group infos),
    ``num_chunks * blocks_per_chunk[g]`` block ids: chunk 0's blocks first, in token order. Block ids
    may come in any order. A negative id means "no block": retrieve leaves nothing written for it,
    store leaves that page of the chunk unspecified.

    Not thread-safe for concurrent calls on one plan (the agent serialises per plan); the transfers
    themselves overlap with everything else.
    """

    def __init__(
        self,
        groups: Sequence[KernelGroupPages],
        tokens_per_chunk: int = 256,
        *,
        mode: Mode = "auto",
        pipeline_bytes: int = DEFAULT_PIPELINE_BYTES,
        lead_bytes: int = DEFAULT_LEAD_BYTES,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        copy_streams: int = 1,
        graphs: bool = True,
    ) -> None:
        if not groups:
            raise ValueError("TransferPlan needs at least one kernel group, got none")
        devices = {g.device for g in groups}
        if len(devices) != 1:
            raise ValueError(f"all kernel groups must be on one device, got {sorted(map(str, devices))}")
        if mode not in ("auto", "staged", "direct", "torch"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'staged', 'direct' or 'torch'")
        if pipeline_bytes <= 0 or lead_bytes <= 0 or staging_slots < 1 or copy_streams < 1:
            raise ValueError(
                f"pipeline_bytes={pipeline_bytes}, lead_bytes={lead_bytes}, staging_slots={staging_slots}, "
                f"copy_streams={copy_streams}: expected positive values"
            )
        self.groups = tuple(groups)
        self.device = devices.pop()
        self.tokens_per_chunk = tokens_per_chunk
        self.layout = ChunkLayout.of(self.groups, tokens_per_chunk)
        self.mode: Mode = mode
        self.pipeline_bytes = pipeline_bytes
        self.lead_bytes = lead_bytes
        self.staging_slots = staging_slots
        self._lock = threading.Lock()
        self._layers_per_piece = [
            max(1, pipeline_bytes // self.layout.layer_bytes(i)) for i in range(len(self.groups))
        ]
        self._slot_bytes = _round_up(
            max(
                n * self.layout.layer_bytes(i)
                for i, n in enumerate(
                    min(n, g.num_layers) for n, g in zip(self._layers_per_piece, self.groups, strict=True)
                )
            ),
            512,
        )
        self._piece_cache: dict[tuple[Any, ...], list[_Piece]] = {}
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            with torch.cuda.device(self.device):
                # high priority: the short gather/scatter kernels jump ahead of the engine's queue
                self._kernel_stream = torch.cuda.Stream(self.device, priority=-1)
                self._copy_streams = [torch.cuda.Stream(self.device) for _ in range(copy_streams)]
            self._anchors: dict[int, torch.Tensor] = {}
            self._tables: dict[int, list[_GroupTables]] = {}
            self._page_align = [g.page_alignment() for g in self.groups]
            self._words = [_word_bytes_for(a) for a in self._page_align]
            self._staging: torch.Tensor | None = None
            self._slot_free = [torch.cuda.Event() for _ in range(staging_slots)]
            self._slot_ready = [torch.cuda.Event() for _ in range(staging_slots)]
            self._next_slot = 0
            # Host-time caches (queueing sits on every request's path): a reused start event, a ring
            # of pinned upload buffers with their device twins, and per-shape piece plans.
            self._start = torch.cuda.Event()
            self._ring: list[_UploadSlot] = []
            self._next_upload = 0
            self._slot_word_off: dict[tuple[int, int], np.ndarray] = {}
            # Which path last queued work that uses the staging slots ("regular" or "graph").
            self._staging_user = "regular"
            self._start_event_raw = 0
            self._device_index = self.device.index if self.device.index is not None else 0
            self._graphs: GraphRunner | None = None
            if graphs:
                from .graph_launch import GraphRunner

                try:
                    self._graphs = GraphRunner(self)
                except OSError:  # no loadable libcuda.so.1: the regular path only
                    self._graphs = None

    # ------------------------------------------------------------------ construction

    # ------------------------------------------------------------------ properties

    @property
    def kernel_stream(self) -> torch.cuda.Stream:
        """CUDA: the stream this plan's gathers and scatters run on."""
        return self._kernel_stream

    @property
    def bytes_per_chunk(self) -> int:
        return self.layout.bytes_per_chunk

    @property
    def blocks_per_chunk(self) -> tuple[int, ...]:
        return self.layout.blocks_per_chunk

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ public API

    def store(
        self, chunk_buffers: Sequence[torch.Tensor] | torch.Tensor, block_ids_per_info: Sequence[BlockIds]
    ) -> None:
        """Gather the blocks into the chunk buffers and wait for it."""
        self.store_async(chunk_buffers, block_ids_per_info).wait()

    def retrieve(
        self,
        chunk_buffers: Sequence[torch.Tensor] | torch.Tensor,
        block_ids_per_info: Sequence[BlockIds],
        skip_first_n_tokens: int = 0,
    ) -> None:
        """Scatter the chunk buffers into the blocks and wait for it."""
        self.retrieve_async(chunk_buffers, block_ids_per_info, skip_first_n_tokens=skip_first_n_tokens).wait()

    def store_async(
        self,
        chunk_buffers: Sequence[torch.Tensor] | torch.Tensor,
        block_ids_per_info: Sequence[BlockIds],
        *,
        wait_event: torch.cuda.Event | None = None,
    ) -> TransferHandle:
        """Start a store; the KV blocks are read after ``wait_event`` (default: after the work
        queued so far on the caller's current stream)."""
        chunks = self._chunks(chunk_buffers)
        ids, full = self._block_ids(block_ids_per_info, len(chunks), retrieve=False)
        return self._run(chunks, ids, to_chunk=True, wait_event=wait_event, full=full)

    def retrieve_async(
        self,
        chunk_buffers: Sequence[torch.Tensor] | torch.Tensor,
        block_ids_per_info: Sequence[BlockIds],
        *,
        skip_first_n_tokens: int = 0,
        wait_event: torch.cuda.Event | None = None,
    ) -> TransferHandle:
        """Start a retrieve. Blocks wholly inside the first ``skip_first_n_tokens`` tokens (per group:
        ``skip // tokens_per_block`` blocks) are not written: the engine already has them. A block
        only partly covered is written whole (its leading tokens get the same values again)."""
        if skip_first_n_tokens < 0:
            raise ValueError(f"skip_first_n_tokens={skip_first_n_tokens}: expected >= 0")
        chunks = self._chunks(chunk_buffers)
        ids, full = self._block_ids(block_ids_per_info, len(chunks), retrieve=True)
        if skip_first_n_tokens:
            for g, group in enumerate(self.groups):
                skip = min(skip_first_n_tokens // group.tokens_per_block, ids[g].size)
                if skip:
                    ids[g] = ids[g].copy()
                    ids[g][:skip] = -1
                    full = False
        return self._run(chunks, ids, to_chunk=False, wait_event=wait_event, full=full)

    def prepare_retrieve(
        self, chunk_buffers: Sequence[torch.Tensor], block_ids_per_info: Sequence[BlockIds]
    ) -> PreparedRetrieve:
        """Validate a retrieve from chunk buffers on the plan's GPU and upload its tables now, on
        the caller's current stream (the stream that will also write the chunk buffers). The
        launch must wait for an event recorded there after this call (it orders the upload)."""
        chunks = self._chunks(chunk_buffers)
        if not self._cuda or not chunks[0].is_cuda:
            raise ValueError(
                f"prepare_retrieve: expected chunk buffers on the plan's GPU, got {chunks[0].device}"
            )
        ids, _ = self._block_ids(block_ids_per_info, len(chunks), retrieve=True)
        with torch.cuda.device(self.device):
            aligns = self._direct_aligns(chunks)
            tables, host = self._upload_once(self._direct_values(chunks, ids, aligns))
        return PreparedRetrieve(chunks, tables, aligns, host)

    def launch_prepared(self, prepared: PreparedRetrieve, *, wait_event: torch.cuda.Event) -> TransferHandle:
        """Queue a prepared retrieve's kernels on the plan's kernel stream after ``wait_event``. The
        returned handle keeps the chunk buffers alive; a caller that drops it early records them
        on :attr:`kernel_stream` itself (the tables are recorded here)."""
        with self._lock, torch.cuda.device(self.device):
            ks = self._kernel_stream
            ks.wait_event(wait_event)
            if prepared.tables:  # freed early by the caller, the allocator still waits for these kernels
                prepared.tables[0].record_stream(ks)
            caller = torch.cuda.current_stream(self.device)
            torch.cuda.set_stream(ks)  # a first (compiling) launch goes on the current stream
            try:
                self._launch_direct(prepared.chunks, prepared.tables, prepared.aligns, False, ks.cuda_stream)
            finally:
                torch.cuda.set_stream(caller)
            done = torch.cuda.Event(enable_timing=True)  # lets callers time transfers
            done.record(ks)
            return TransferHandle(done, (prepared,))

    # ------------------------------------------------------------------ validation

    def check_retrieve_ids(self, block_ids_per_info: Sequence[BlockIds], num_chunks: int) -> None:
        """ValueError if ``retrieve_async`` would refuse these ids for ``num_chunks`` chunks: for a
        caller that splits one load over several plans and must refuse it before queueing any."""
        self._block_ids(block_ids_per_info, num_chunks, retrieve=True)

    def _chunks(self, chunk_buffers: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        if isinstance(chunk_buffers, torch.Tensor):
            if chunk_buffers.dim() != 2:
                raise ValueError(
                    f"chunk_buffers tensor of shape {tuple(chunk_buffers.shape)}: expected "
                    "[num_chunks, bytes] or a list of 1-D tensors"
                )
            chunk_buffers = list(chunk_buffers.unbind(0))
        if len(chunk_buffers) == 0:
            raise ValueError("chunk_buffers is empty: expected at least one chunk buffer")
        # Hot path (every transfer): cheap checks only -- an int device index instead of device
        # objects, and no slicing of buffers that already have the exact size.
        need = self.bytes_per_chunk
        out = []
        first = chunk_buffers[0]
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"chunk_buffers[0] is {type(first).__name__}: expected a torch.Tensor")
        where = first.get_device()  # -1: host memory
        for i, buf in enumerate(chunk_buffers):
            if not isinstance(buf, torch.Tensor):
                raise TypeError(f"chunk_buffers[{i}] is {type(buf).__name__}: expected a torch.Tensor")
            if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
                raise ValueError(
                    f"chunk_buffers[{i}]: expected a contiguous 1-D uint8 tensor, got dtype {buf.dtype}, "
                    f"shape {tuple(buf.shape)}"
                )
            size = buf.numel()
            if size < need:
                raise ValueError(f"chunk_buffers[{i}] has {size} bytes: expected at least {need}")
            if buf.get_device() != where:
                raise ValueError(
                    f"chunk_buffers[{i}] is on {buf.device}: expected {first.device} like chunk 0"
                )
            out.append(buf if size == need else buf[:need])
        if where >= 0 and first.device != self.device:
            raise ValueError(
                f"chunk buffers on {first.device}: expected host memory or the plan's device {self.device}"
            )
        return out

    def _block_ids(
        self, block_ids_per_info: Sequence[BlockIds], num_chunks: int, *, retrieve: bool
    ) -> tuple[list[np.ndarray], bool]:
        """The validated ids as int64 arrays, and whether none of them is -1."""
        if len(block_ids_per_info) != len(self.groups):
            raise ValueError(
                f"block_ids_per_info has {len(block_ids_per_info)} lists: expected one per kernel group "
                f"({len(self.groups)})"
            )
        out = []
        full = True  # every id names a block (no -1): the piece plan needs no per-chunk masks
        for g, (raw, group) in enumerate(zip(block_ids_per_info, self.groups, strict=True)):
            ids = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise ValueError(
                    f"block_ids_per_info[{g}]: expected a flat list of ints, got {ids.dtype} {ids.shape}"
                )
            ids = ids.astype(np.int64, copy=False)
            want = num_chunks * self.layout.blocks_per_chunk[g]
            if ids.size != want:
                raise ValueError(
                    f"block_ids_per_info[{g}] has {ids.size} block ids: expected {want} "
                    f"({num_chunks} chunks x {self.layout.blocks_per_chunk[g]} blocks of {group.name!r})"
                )
            lo = int(ids.min()) if ids.size else 0
            if ids.size and (lo < -1 or int(ids.max()) >= group.num_blocks):
                bad = ids[(ids >= group.num_blocks) | (ids < -1)][0]
                raise ValueError(
                    f"block_ids_per_info[{g}] holds block id {bad}: "
                    f"expected -1 (none) or 0..{group.num_blocks - 1}"
                )
            if retrieve and _repeats(ids, lo):
                raise ValueError(
                    f"block_ids_per_info[{g}] repeats a block id: a retrieve writes each block once"
                )
            full = full and lo >= 0
            out.append(ids)
        return out, full

    # ------------------------------------------------------------------ execution

    def _sections(self, chunks: list[torch.Tensor], g: int) -> list[torch.Tensor]:
        off, n = self.layout.group_offsets[g], self.layout.group_bytes[g]
        return [c[off : off + n] for c in chunks]

    def _split(self, ids: list[np.ndarray], g: int, num_chunks: int) -> list[np.ndarray]:
        return list(ids[g].reshape(num_chunks, self.layout.blocks_per_chunk[g]))

    def _resolve_mode(self, chunks: list[torch.Tensor]) -> str:
        if not self._cuda or self.mode == "torch":
            return "torch"
        on_device = chunks[0].is_cuda
        if self.mode == "direct" or (self.mode == "auto" and on_device):
            if not on_device and not all(c.is_pinned() for c in chunks):
                raise ValueError("mode 'direct' needs chunk buffers in pinned host memory or on the GPU")
            return "direct"
        return "direct" if on_device else "staged"

    def _run(
        self,
        chunks: list[torch.Tensor],
        ids: list[np.ndarray],
        *,
        to_chunk: bool,
        wait_event: torch.cuda.Event | None,
        full: bool = False,
    ) -> TransferHandle:
        mode = self._resolve_mode(chunks)
        if not self._cuda:
            fn = torch_copy.gather_group if to_chunk else torch_copy.scatter_group
            for g, group in enumerate(self.groups):
                fn(group, self._sections(chunks, g), self._split(ids, g, len(chunks)), self.tokens_per_chunk)
            return TransferHandle()
        with self._lock:
            if self._graphs is not None and mode != "torch":
                handle = self._run_graph(mode, chunks, ids, to_chunk, wait_event, full)
                if handle is not None:
                    return handle
            return self._run_regular(mode, chunks, ids, to_chunk, wait_event)

    def _run_regular(
        self,
        mode: str,
        chunks: list[torch.Tensor],
        ids: list[np.ndarray],
        to_chunk: bool,
        wait_event: torch.cuda.Event | None,
    ) -> TransferHandle:
        with torch.cuda.device(self.device):
            caller = torch.cuda.current_stream(self.device)
            start = wait_event
            if start is None:
                start = self._start  # reused: a wait binds to the record made just before it
                start.record(caller)
            ks = self._kernel_stream
            ks.wait_event(start)
            for cs in self._copy_streams:
                cs.wait_event(start)
            done = torch.cuda.Event(enable_timing=True)  # lets callers time transfers
            keep: tuple[Any, ...] = (chunks,)
            # Kernels and copies queue on the current stream; switching it directly is much
            # cheaper than a ``torch.cuda.stream`` context per piece. Restored before returning.
            torch.cuda.set_stream(ks)
            try:
                if mode == "torch":
                    fn = torch_copy.gather_group if to_chunk else torch_copy.scatter_group
                    for g, group in enumerate(self.groups):
                        fn(
                            group,
                            self._sections(chunks, g),
                            self._split(ids, g, len(chunks)),
                            self.tokens_per_chunk,
                        )
                    done.record(ks)
                elif mode == "direct":
                    keep += self._run_direct(chunks, ids, to_chunk)
                    done.record(ks)
                else:
                    keep += self._run_staged(chunks, ids, to_chunk, done)
            finally:
                torch.cuda.set_stream(caller)
            return TransferHandle(done, keep)

    # ------------------------------------------------------------------ graph replay

    @property
    def graph_launches(self) -> int:
        """Transfers this plan queued as CUDA-graph replays (0 without graphs)."""
        return self._graphs.launches if self._graphs is not None else 0

    @property
    def graph_error(self) -> str | None:
        """Why graph replay was switched off for this plan, if it was."""
        return self._graphs.error if self._graphs is not None else None

    def _run_graph(
        self,
        mode: str,
        chunks: list[torch.Tensor],
        ids: list[np.ndarray],
        to_chunk: bool,
        wait_event: torch.cuda.Event | None,
        full: bool,
    ) -> TransferHandle | None:
        """Queue the transfer as a graph replay (``graph_launch``); None: run the regular path."""
        assert self._graphs is not None
        n = len(chunks)
        if mode == "staged":
            shape, pieces = self._pieces_keyed(ids, n, to_chunk, full)
            if not pieces:
                return None
            return self._graphs.run(("staged", *shape), chunks, ids, to_chunk, wait_event, pieces=pieces)
        aligns = self._direct_aligns(chunks)
        key = ("direct", to_chunk, n, aligns)
        return self._graphs.run(key, chunks, ids, to_chunk, wait_event, aligns=aligns)

    def _caller_raw_stream(self) -> int:
        """The caller's current stream on the plan's device, as a raw handle (one C call)."""
        return int(torch._C._cuda_getCurrentRawStream(self._device_index))

    def _start_raw(self) -> int:
        """A driver event (no timing) the graph path records on the caller's stream."""
        if not self._start_event_raw:
            from .cuda_driver import Driver

            with torch.cuda.device(self.device):
                self._start_event_raw = Driver.get().event_create()
        return self._start_event_raw

    def _use_staging(self, user: str) -> None:
        """Order the staging slots between the regular path (slot events) and graph replays (the
        kernel stream) when the other one used them last. Called on the kernel stream's turn,
        after it waited for the caller."""
        if user == self._staging_user:
            return
        ks = self._kernel_stream
        if user == "graph":
            for ev in self._slot_free:  # the regular path's DMAs and scatters are done
                ks.wait_event(ev)
        else:
            for ev in self._slot_free:  # regular waits on a slot now come after the replays
                ev.record(ks)
        self._staging_user = user

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(
                self.staging_slots * self._slot_bytes, dtype=torch.uint8, device=self.device
            )
        return self._staging

    # ------------------------------------------------------------------ regular path

    def _word_tables(self, word: int) -> tuple[torch.Tensor, list[_GroupTables]]:
        if word not in self._anchors:
            from .triton_copy import WORD_DTYPES

            anchor = torch.empty(16, dtype=WORD_DTYPES[word], device=self.device)
            self._anchors[word] = anchor
            self._tables[word] = [_GroupTables(g, anchor) for g in self.groups]
            # the tables came from pageable memory on the current stream: done before other streams read
            torch.cuda.current_stream(self.device).synchronize()
        return self._anchors[word], self._tables[word]

    def _upload(self, values: list[np.ndarray]) -> tuple[list[torch.Tensor], Any]:
        """One pinned host->device copy (on the current stream, the kernel stream) of several int64
        arrays, through a ring of persistent pinned buffers. A ring slot is reused once its previous
        copy finished (its event); the device twin is only read by kernels on the kernel stream, so
        stream order protects it. If the next slot is still in flight, a one-off buffer is used."""
        sizes = tuple(v.size for v in values)
        n = sum(sizes)
        k = self._next_upload
        if not self._ring:  # all at once: pinned allocations are one-time host syncs
            self._ring = [_UploadSlot(max(n, _UPLOAD_MIN_WORDS), self.device) for _ in range(_UPLOAD_RING)]
        if self._ring[k].capacity < n:
            self._ring[k] = _UploadSlot(max(n, 2 * self._ring[k].capacity), self.device)
        slot = self._ring[k]
        if not slot.free.query():
            return self._upload_once(values)
        self._next_upload = (k + 1) % _UPLOAD_RING
        if n:
            np.concatenate(values, out=slot.host_np[:n])
            slot.dev[:n].copy_(slot.host[:n], non_blocking=True)
        slot.free.record()
        parts = slot.parts.get(sizes)
        if parts is None:
            parts, off = [], 0
            for size in sizes:
                parts.append(slot.dev[off : off + size])
                off += size
            if len(slot.parts) > 64:
                slot.parts.clear()
            slot.parts[sizes] = parts
        return parts, None

    def _upload_once(self, values: list[np.ndarray]) -> tuple[list[torch.Tensor], torch.Tensor]:
        flat = np.concatenate(values) if values else np.zeros(0, np.int64)
        host = torch.from_numpy(flat).pin_memory()
        dev = host.to(self.device, non_blocking=True)
        parts, off = [], 0
        for v in values:
            parts.append(dev[off : off + v.size])
            off += v.size
        return parts, host

    def _direct_aligns(self, chunks: list[torch.Tensor]) -> tuple[int, ...]:
        """Per group: the alignment (bytes) of every page and chunk section address."""
        ptrs = [c.data_ptr() for c in chunks]
        return tuple(
            alignment(self._page_align[g], *(p + self.layout.group_offsets[g] for p in ptrs))
            for g in range(len(self.groups))
        )

    def _direct_values(
        self, chunks: list[torch.Tensor], ids: list[np.ndarray], aligns: tuple[int, ...]
    ) -> list[np.ndarray]:
        """Per group: the chunk sections' word offsets from the anchor, then the block ids."""
        from .triton_copy import word_bytes_for

        values: list[np.ndarray] = []
        for g, align in enumerate(aligns):
            anchor, _ = self._word_tables(word_bytes_for(align))
            word = anchor.element_size()
            base = anchor.data_ptr()
            off = self.layout.group_offsets[g]
            values.append(np.array([(c.data_ptr() + off - base) // word for c in chunks], np.int64))
            values.append(ids[g])
        return values

    def _launch_direct(
        self,
        chunks: list[torch.Tensor],
        parts: list[torch.Tensor],
        aligns: tuple[int, ...],
        to_chunk: bool,
        raw_stream: int,
    ) -> None:
        from .triton_copy import launch, word_bytes_for

        for g, align in enumerate(aligns):
            anchor, tables = self._word_tables(word_bytes_for(align))
            group, t = self.groups[g], tables[g]
            launch(
                anchor=anchor,
                layer_off=t.layer_off,
                plane_stride=t.plane_stride,
                block_stride=t.block_stride,
                chunk_off=parts[2 * g],
                block_ids=parts[2 * g + 1],
                num_chunks=len(chunks),
                num_layers=group.num_layers,
                planes=group.planes,
                bpc=self.layout.blocks_per_chunk[g],
                page_bytes=group.page_bytes,
                align=align,
                to_chunk=to_chunk,
                stream=raw_stream,
            )

    def _run_direct(
        self, chunks: list[torch.Tensor], ids: list[np.ndarray], to_chunk: bool
    ) -> tuple[Any, ...]:
        aligns = self._direct_aligns(chunks)
        parts, host = self._upload(self._direct_values(chunks, ids, aligns))
        self._launch_direct(chunks, parts, aligns, to_chunk, self._kernel_stream.cuda_stream)
        return (host, parts)

    def _pieces(self, ids: list[np.ndarray], num_chunks: int, to_chunk: bool) -> list[_Piece]:
        return self._pieces_keyed(ids, num_chunks, to_chunk)[1]

    def _pieces_keyed(
        self, ids: list[np.ndarray], num_chunks: int, to_chunk: bool, full: bool = False
    ) -> tuple[tuple[Any, ...], list[_Piece]]:
        """Whole-layer pieces of every (chunk, group) section that has a block to move, at most
        ``pipeline_bytes`` each; the first piece of a store (last of a retrieve) is cut to
        ``lead_bytes`` so the DMA engine starts early (or finishes with little left to scatter).
        Also returns the shape key the pieces depend on (cached per key)."""
        if full:  # no -1 anywhere: every section moves, no masks to compute
            key: tuple[Any, ...] = (num_chunks, to_chunk, "all")
            cached = self._piece_cache.get(key)
            if cached is not None:
                return key, cached
            masks: list[Any] = [np.ones(num_chunks, bool) for _ in self.groups]
        else:
            masks = [
                (ids[g].reshape(num_chunks, self.layout.blocks_per_chunk[g]) >= 0).any(axis=1)
                for g in range(len(self.groups))
            ]
            key = (num_chunks, to_chunk, *(m.tobytes() for m in masks))
            cached = self._piece_cache.get(key)
            if cached is not None:
                return key, cached
        spans: list[tuple[int, int, int, int]] = []  # (chunk, group, first layer, end layer)
        for c in range(num_chunks):
            for g, group in enumerate(self.groups):
                if not masks[g][c]:
                    continue  # nothing to move for this chunk and group
                step = self._layers_per_piece[g]
                spans.extend(
                    (c, g, l0, min(l0 + step, group.num_layers)) for l0 in range(0, group.num_layers, step)
                )
        if spans:
            k = 0 if to_chunk else len(spans) - 1
            c, g, l0, l1 = spans[k]
            lead = min(l1 - l0, max(1, self.lead_bytes // self.layout.layer_bytes(g)))
            if lead < l1 - l0:
                split = [(c, g, l0, l0 + lead), (c, g, l0 + lead, l1)]
                if not to_chunk:
                    split = [(c, g, l0, l1 - lead), (c, g, l1 - lead, l1)]
                spans[k : k + 1] = split
        pieces = []
        for c, g, l0, l1 in spans:
            lb = self.layout.layer_bytes(g)
            pieces.append(_Piece(c, g, l0, l1, self.layout.group_offsets[g] + l0 * lb, (l1 - l0) * lb))
        if len(self._piece_cache) > 256:
            self._piece_cache.clear()
        self._piece_cache[key] = pieces
        return key, pieces

    def _staged_values(
        self, pieces: list[_Piece], ids: list[np.ndarray], first_slot: int
    ) -> list[np.ndarray]:
        """Per piece: its staging slot's offset (in the group's words), then its block ids."""
        values: list[np.ndarray] = []
        for k, piece in enumerate(pieces):
            g = piece.group
            bpc = self.layout.blocks_per_chunk[g]
            values.append(self._slot_offset((first_slot + k) % self.staging_slots, self._words[g]))
            values.append(ids[g][piece.chunk * bpc : (piece.chunk + 1) * bpc])
        return values

    def _launch_piece(
        self, piece: _Piece, chunk_off: torch.Tensor, block_ids: torch.Tensor, to_chunk: bool, raw_stream: int
    ) -> None:
        """One gather (scatter) launch between a piece's pages and its staging slot."""
        from .triton_copy import launch

        g = piece.group
        group = self.groups[g]
        anchor, tables = self._word_tables(self._words[g])
        layer_off, plane_stride, block_stride = tables[g].slice(piece.layer_start, piece.layer_end)
        launch(
            anchor=anchor,
            layer_off=layer_off,
            plane_stride=plane_stride,
            block_stride=block_stride,
            chunk_off=chunk_off,
            block_ids=block_ids,
            num_chunks=1,
            num_layers=piece.layer_end - piece.layer_start,
            planes=group.planes,
            bpc=self.layout.blocks_per_chunk[g],
            page_bytes=group.page_bytes,
            align=self._page_align[g],
            to_chunk=to_chunk,
            stream=raw_stream,
        )

    def _run_staged(
        self, chunks: list[torch.Tensor], ids: list[np.ndarray], to_chunk: bool, done: torch.cuda.Event
    ) -> tuple[Any, ...]:
        ks = self._kernel_stream
        raw_ks = ks.cuda_stream
        staging = self._staging_buffer()
        self._use_staging("regular")
        pieces = self._pieces(ids, len(chunks), to_chunk)
        first = self._next_slot
        values = self._staged_values(pieces, ids, first)
        self._next_slot = (first + len(pieces)) % self.staging_slots
        copy_streams = self._copy_streams
        last_copy = copy_streams[(len(pieces) - 1) % len(copy_streams)]
        parts, host = self._upload(values)  # the current stream is the kernel stream
        for k, piece in enumerate(pieces):
            slot = (first + k) % self.staging_slots
            cs = copy_streams[k % len(copy_streams)]
            slot_view = staging[slot * self._slot_bytes : slot * self._slot_bytes + piece.nbytes]
            chunk_view = chunks[piece.chunk][piece.offset : piece.offset + piece.nbytes]
            if to_chunk:
                ks.wait_event(self._slot_free[slot])  # the slot's previous DMA is done
                self._launch_piece(piece, parts[2 * k], parts[2 * k + 1], True, raw_ks)
                self._slot_ready[slot].record(ks)
                cs.wait_event(self._slot_ready[slot])
                torch.cuda.set_stream(cs)
                chunk_view.copy_(slot_view, non_blocking=True)
                torch.cuda.set_stream(ks)
                self._slot_free[slot].record(cs)
            else:
                cs.wait_event(self._slot_free[slot])  # the slot's previous scatter is done
                torch.cuda.set_stream(cs)
                slot_view.copy_(chunk_view, non_blocking=True)
                torch.cuda.set_stream(ks)
                self._slot_ready[slot].record(cs)
                ks.wait_event(self._slot_ready[slot])
                self._launch_piece(piece, parts[2 * k], parts[2 * k + 1], False, raw_ks)
                self._slot_free[slot].record(ks)
        if not to_chunk or not pieces:
            done.record(ks)
        elif len(copy_streams) == 1:
            done.record(last_copy)  # the last DMA ends the store
        else:
            for cs in copy_streams:  # every DMA is done once each copy stream is
                ev = torch.cuda.Event()
                ev.record(cs)
                ks.wait_event(ev)
            done.record(ks)
        return (host, parts)

    def _slot_offset(self, slot: int, word: int) -> np.ndarray:
        """[word offset of staging slot ``slot`` from the ``word``-byte anchor] (constant per plan)."""
        key = (slot, word)
        if key not in self._slot_word_off:
            anchor, _ = self._word_tables(word)
            addr = self._staging_buffer().data_ptr() + slot * self._slot_bytes
            self._slot_word_off[key] = np.array([(addr - anchor.data_ptr()) // word], np.int64)
        return self._slot_word_off[key]


def _repeats(ids: np.ndarray, lo: int) -> bool:
    """Whether a block id (>= 0) occurs twice; ``lo`` is ``ids.min()``."""
    if lo >= 0 and ids.size <= 256:  # the usual retrieve: a set is cheaper than a sort here
        return len(set(ids.tolist())) != ids.size
    valid = np.sort(ids[ids >= 0])
    return valid.size > 1 and bool((valid[1:] == valid[:-1]).any())


def _word_bytes_for(align: int) -> int:
    from .triton_copy import word_bytes_for

    return word_bytes_for(align)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
