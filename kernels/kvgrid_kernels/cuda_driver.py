"""The few CUDA driver API calls the graph launcher needs, through ctypes on ``libcuda.so.1``.

Why not torch: each torch/CUDA call from Python costs 5-17 us of host time on the H200 machine,
while a ctypes call into the driver costs a few us; the launcher queues a whole transfer with
about five of them. Handles are plain ints (torch's raw ``cuda_stream`` / ``cuda_event`` values
are the same driver handles). Every call checks its result and raises :class:`CudaError` naming the
call and the driver's error name; nothing here is used unless CUDA is present.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

CU_GRAPH_NODE_TYPE_KERNEL = 0  # CUgraphNodeType: KERNEL 0, MEMCPY 1, MEMSET 2, ...
CU_GRAPH_NODE_TYPE_MEMCPY = 1
CU_LAUNCH_ATTRIBUTE_PRIORITY = 8
CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = 8
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
CU_MEMORYTYPE_HOST = 1
CU_MEMORYTYPE_DEVICE = 2
CU_MEMORYTYPE_UNIFIED = 4
CU_EVENT_DISABLE_TIMING = 2
CUDA_ERROR_NOT_READY = 600


class CudaError(RuntimeError):
    """A driver call returned an error (the message names the call and the error)."""


class Memcpy3D(ctypes.Structure):
    """``CUDA_MEMCPY3D`` (cuda.h); a 1-D copy uses X offsets and ``WidthInBytes`` only."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcZ", ctypes.c_size_t),
        ("srcLOD", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("reserved0", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("srcHeight", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstZ", ctypes.c_size_t),
        ("dstLOD", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("reserved1", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("dstHeight", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
        ("Depth", ctypes.c_size_t),
    ]

    def address(self, side: str) -> int:
        """The first byte of ``side`` ('src' or 'dst'): pointer field plus its X offset."""
        kind = getattr(self, f"{side}MemoryType")
        base = getattr(self, f"{side}Host") if kind == CU_MEMORYTYPE_HOST else getattr(self, f"{side}Device")
        return int(base or 0) + int(getattr(self, f"{side}XInBytes"))

    def set_address(self, side: str, addr: int) -> None:
        """Point ``side`` at ``addr`` (X offset folded into the pointer)."""
        setattr(self, f"{side}XInBytes", 0)
        if getattr(self, f"{side}MemoryType") == CU_MEMORYTYPE_HOST:
            setattr(self, f"{side}Host", addr)
        else:
            setattr(self, f"{side}Device", addr)


_U64 = ctypes.c_uint64
_SIG: dict[str, tuple[Any, ...]] = {
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuCtxGetCurrent": (ctypes.POINTER(_U64),),
    "cuEventCreate": (ctypes.POINTER(_U64), ctypes.c_uint),
    "cuEventDestroy_v2": (_U64,),
    "cuEventRecord": (_U64, _U64),
    "cuEventQuery": (_U64,),
    "cuStreamWaitEvent": (_U64, _U64, ctypes.c_uint),
    "cuMemcpyAsync": (_U64, _U64, ctypes.c_size_t, _U64),
    "cuStreamBeginCapture_v2": (_U64, ctypes.c_int),
    "cuStreamEndCapture": (_U64, ctypes.POINTER(_U64)),
    "cuGraphInstantiateWithFlags": (ctypes.POINTER(_U64), _U64, ctypes.c_ulonglong),
    "cuGraphGetNodes": (_U64, ctypes.POINTER(_U64), ctypes.POINTER(ctypes.c_size_t)),
    "cuGraphNodeGetType": (_U64, ctypes.POINTER(ctypes.c_int)),
    "cuGraphMemcpyNodeGetParams": (_U64, ctypes.POINTER(Memcpy3D)),
    "cuGraphExecMemcpyNodeSetParams": (_U64, _U64, ctypes.POINTER(Memcpy3D), _U64),
    "cuGraphLaunch": (_U64, _U64),
    "cuStreamGetPriority": (_U64, ctypes.POINTER(ctypes.c_int)),
    "cuGraphKernelNodeSetAttribute": (_U64, ctypes.c_int, ctypes.c_void_p),
    "cuGraphExecDestroy": (_U64,),
    "cuGraphDestroy": (_U64,),
}


class Driver:
    """Bound driver functions; ``Driver.get()`` loads libcuda once per process."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn: dict[str, Any] = {}
        for name, args in _SIG.items():
            fn = getattr(lib, name)
            fn.argtypes = list(args)
            fn.restype = ctypes.c_int
            self._fn[name] = fn
        # The hot calls, bound once (attribute lookups cost host time on every transfer).
        self.raw_event_record = self._fn["cuEventRecord"]
        self.raw_stream_wait_event = self._fn["cuStreamWaitEvent"]
        self.raw_graph_launch = self._fn["cuGraphLaunch"]
        self.raw_event_query = self._fn["cuEventQuery"]
        self.raw_exec_memcpy_set = self._fn["cuGraphExecMemcpyNodeSetParams"]

    @staticmethod
    @functools.cache
    def get() -> Driver:
        return Driver(ctypes.CDLL("libcuda.so.1"))

    def check(self, name: str, rc: int) -> None:
        if rc != 0:
            text = ctypes.c_char_p()
            self._fn["cuGetErrorName"](rc, ctypes.byref(text))
            raise CudaError(f"{name} failed: {(text.value or b'?').decode()} ({rc})")

    def call(self, name: str, *args: Any) -> None:
        self.check(name, self._fn[name](*args))

    def current_context(self) -> int:
        ctx = _U64()
        self.call("cuCtxGetCurrent", ctypes.byref(ctx))
        return ctx.value

    def event_create(self) -> int:
        ev = _U64()
        self.call("cuEventCreate", ctypes.byref(ev), CU_EVENT_DISABLE_TIMING)
        return ev.value

    def event_destroy(self, event: int) -> None:
        self.call("cuEventDestroy_v2", event)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.call("cuMemcpyAsync", dst, src, nbytes, stream)

    def begin_capture(self, stream: int) -> None:
        self.call("cuStreamBeginCapture_v2", stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)

    def end_capture(self, stream: int) -> int:
        graph = _U64()
        self.call("cuStreamEndCapture", stream, ctypes.byref(graph))
        return graph.value

    def instantiate(self, graph: int, node_priority: bool = False) -> int:
        """``node_priority``: kernels run at their nodes' priority, not the launch stream's."""
        exe = _U64()
        flags = CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY if node_priority else 0
        self.call("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, flags)
        return exe.value

    def stream_priority(self, stream: int) -> int:
        prio = ctypes.c_int()
        self.call("cuStreamGetPriority", stream, ctypes.byref(prio))
        return prio.value

    def set_kernel_priorities(self, graph: int, priority: int) -> int:
        """Give every kernel node of ``graph`` ``priority``; returns how many there are."""
        value = (ctypes.c_int * 16)(priority)  # CUlaunchAttributeValue: a 64-byte union, int first
        nodes = self._nodes(graph, CU_GRAPH_NODE_TYPE_KERNEL)
        for node in nodes:
            attr = CU_LAUNCH_ATTRIBUTE_PRIORITY
            self.call("cuGraphKernelNodeSetAttribute", node, attr, ctypes.byref(value))
        return len(nodes)

    def _nodes(self, graph: int, kind: int) -> list[int]:
        n = ctypes.c_size_t()
        self.call("cuGraphGetNodes", graph, None, ctypes.byref(n))
        nodes = (_U64 * n.value)()
        self.call("cuGraphGetNodes", graph, nodes, ctypes.byref(n))
        out = []
        for node in nodes[: n.value]:
            t = ctypes.c_int()
            self.call("cuGraphNodeGetType", node, ctypes.byref(t))
            if t.value == kind:
                out.append(int(node))
        return out

    def memcpy_nodes(self, graph: int) -> list[tuple[int, Memcpy3D]]:
        """Every memcpy node of ``graph`` with its parameters."""
        out = []
        for node in self._nodes(graph, CU_GRAPH_NODE_TYPE_MEMCPY):
            params = Memcpy3D()
            self.call("cuGraphMemcpyNodeGetParams", node, ctypes.byref(params))
            out.append((node, params))
        return out

    def destroy_graph(self, exe: int, graph: int) -> None:
        if exe:
            self.call("cuGraphExecDestroy", exe)
        if graph:
            self.call("cuGraphDestroy", graph)
