"""What a captured graph holds, node by node: type, kernel name, launch shape, and every device
address found in its arguments (``../shared/reference/apis.md`` §2).

Both backends describe their graphs as a list of :class:`Node`: the CUDA backend reads the kept
template through the driver API (``cuda.bindings.driver``; the runtime cannot read kernels that
libtorch's own cudart registered), the emulated backend turns each recorded op into one node
whose references are its tensors' addresses. The pointer and segment audits
(:mod:`graphctl.graphs.audit`) work on nodes only, so they are the same on both backends.

Where addresses come from, on CUDA:

- kernel nodes launched with ``kernelParams``: each parameter's bytes (sizes walked with
  ``cuFuncGetParamInfo`` until it fails; ``cuFuncGetParamCount`` is missing on driver 580);
- kernel nodes launched with ``extra`` (cuBLAS's ``nvjet`` kernels): the one packed argument
  buffer. Such nodes are marked ``library``: their buffer also holds workspace pointers and TMA
  descriptors, so an unregistered live allocation in them is the library's own workspace;
- memcpy nodes (source read, destination written) and memset nodes (destination written).

Every 8-byte-aligned word of a kernel's arguments is a candidate address; the audit keeps the
ones that fall into known memory. A kernel's arguments do not say what it reads and what it
writes, so kernel references have access ``touch``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import re
from typing import Sequence

__all__ = ["Ref", "Node", "Region", "flatten", "register_bodies", "is_library_kernel", "LIBRARY_KERNEL_PREFIXES", "read_cuda_nodes", "census", "dot_print", "short_name", "driver"]

_WORD = 8
_MAX_PARAMS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """A device address found in a node: ``where`` in its arguments, and how it is used."""

    address: int
    access: str  # "read", "write" or "touch" (a kernel argument: either)
    where: str  # "param 2+8", "extra+64", "src", "dst", "arg 0"
    nbytes: int = 0  # known extent (copies, memsets, emulated tensors), 0 when unknown


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """One node of a captured graph (CUDA) or one recorded op (emulated)."""

    index: int
    kind: str  # "kernel", "memcpy", "memset", "empty", ... ; "op" on the emulated backend
    name: str  # short kernel or op name ("at::native::vectorized_elementwise_kernel", "aten::add.Tensor")
    symbol: str = ""  # the mangled kernel symbol, when there is one
    launch: str = ""  # "grid 4x1x1 block 128x1x1 smem 0", "1024 B", ...
    param_sizes: tuple[int, ...] = ()
    library: bool = False  # a CUDA library's kernel: arguments packed in ``extra``, or a library name
    refs: tuple[Ref, ...] = ()
    note: str = ""  # why something could not be read
    body: tuple["Node", ...] = ()  # the nodes of a conditional's body or a child graph (indices within it)

    @property
    def graphctl(self) -> bool:
        """A node of graphctl's own switch machinery (declared, not audited as user work)."""
        return self.name.startswith("graphctl::")


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """A named range of device (or, emulated, host) memory ``[start, end)``. ``kind``:
    ``buffer`` (a declared state buffer or twin), ``arena`` (graphctl's snapshot slots),
    ``input`` / ``output`` (the runner's static tensors), ``argument`` (a frozen tensor
    argument), ``param`` (a model parameter or buffer the caller registered), ``pool`` (the
    graph's private memory pool), ``live`` / ``freed`` (caching-allocator blocks outside the
    pool, allocated or free)."""

    name: str
    kind: str
    start: int
    end: int


def driver():
    """``cuda.bindings.driver``, or None when cuda-bindings is not installed."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return None
    return drv


def _ok(r) -> tuple[bool, tuple]:
    err, *out = r
    return int(err) == 0, tuple(out)


def _int(v) -> int:
    try:
        return int(v)
    except TypeError:  # pointer wrappers without __int__
        return int(v.getPtr())


_NESTED = re.compile(r"(\d+)")

# Kernels of the CUDA libraries torch calls (cuBLAS, cuBLASLt, cuDNN, CUTLASS-based GEMMs): their
# arguments also carry the library's own workspace, which torch allocates once through its
# caching allocator, outside any graph pool, possibly before the runner's warmup. Seen on an H100:
# cuBLASLt's split-K reduction (``cublasLt::splitKreduce_kernel``) takes it as a plain argument.
LIBRARY_KERNEL_PREFIXES = ("cublas", "nvjet", "cutlass", "cudnn", "xmma", "sm80_", "sm90_", "sm100_", "gemv",
                           "gemmk", "gemmSN", "ampere_", "hopper_")


def is_library_kernel(short: str) -> bool:
    """Whether a kernel's short name is one of a CUDA library's (see ``LIBRARY_KERNEL_PREFIXES``)."""
    return short.startswith(LIBRARY_KERNEL_PREFIXES)


def short_name(symbol: str) -> str:
    """``_ZN2at6native18elementwise_kernelILi128ELi4EZ...`` -> ``at::native::elementwise_kernel``:
    the qualified name of an Itanium-mangled symbol, without template arguments; anything
    else unchanged. Enough to recognise a kernel; the full symbol is kept next to it."""
    if not symbol.startswith("_Z"):
        return symbol
    s = symbol[2:]
    if s.startswith("N"):
        s = s[1:]
        while s[:1] in ("K", "V", "L"):
            s = s[1:]
    parts = []
    while s and s[0].isdigit():
        m = _NESTED.match(s)
        n, s = int(m.group(1)), s[m.end():]
        parts.append(s[:n])
        s = s[n:]
        if s[:1] == "I":  # template arguments: the name is complete
            break
    return "::".join(parts) if parts else symbol


def _words(data: bytes, where: str, base_off: int = 0) -> list[Ref]:
    out = []
    for off in range(0, len(data) - _WORD + 1, _WORD):
        v = int.from_bytes(data[off:off + _WORD], "little")
        if v >= 1 << 16:  # small integers are sizes and flags, never device addresses
            out.append(Ref(v, "touch", f"{where}+{base_off + off}"))
    return out


def _kernel(drv, node, index: int) -> Node:
    ok, out = _ok(drv.cuGraphKernelNodeGetParams(node))
    if not ok:
        return Node(index, "kernel", "?", note="cuGraphKernelNodeGetParams failed")
    p = out[0]
    func = p.func
    symbol = ""
    if _int(func):
        ok, name = _ok(drv.cuFuncGetName(func))
    else:  # launched as a CUkernel (library-managed); name it through the kernel handle
        ok, name = _ok(drv.cuKernelGetName(p.kern))
    if ok:
        symbol = name[0].decode() if isinstance(name[0], bytes) else str(name[0])
    launch = (f"grid {p.gridDimX}x{p.gridDimY}x{p.gridDimZ} block {p.blockDimX}x{p.blockDimY}x{p.blockDimZ} "
              f"smem {p.sharedMemBytes}")
    kp, extra = _int(p.kernelParams), _int(p.extra)
    refs: list[Ref] = []
    sizes: list[int] = []
    note = ""
    if kp:
        for i in range(_MAX_PARAMS):
            ok, info = _ok(drv.cuFuncGetParamInfo(func, i)) if _int(func) else _ok(drv.cuKernelGetParamInfo(p.kern, i))
            if not ok:
                break
            size = int(info[1])
            sizes.append(size)
            ptr = ctypes.c_uint64.from_address(kp + _WORD * i).value
            if ptr:
                refs += _words(ctypes.string_at(ptr, size), f"param {i}")
    elif extra:
        buf, size = 0, 0
        for j in range(0, 32, 2):  # {key, value}* END: BUFFER_POINTER=1, BUFFER_SIZE=2 (a size_t*), END=0
            key = ctypes.c_uint64.from_address(extra + _WORD * j).value
            if key == 0:
                break
            val = ctypes.c_uint64.from_address(extra + _WORD * (j + 1)).value
            if key == 1:
                buf = val
            elif key == 2 and val:
                size = ctypes.c_uint64.from_address(val).value
        if buf and size:
            sizes.append(size)
            refs += _words(ctypes.string_at(buf, size), "extra")
        else:
            note = "extra launch without a readable argument buffer"
    short = short_name(symbol) if symbol else "?"
    return Node(index, "kernel", short, symbol, launch, tuple(sizes),
                library=(bool(extra) and not kp) or is_library_kernel(short), refs=tuple(refs), note=note)


def _memcpy(drv, node, index: int) -> Node:
    ok, out = _ok(drv.cuGraphMemcpyNodeGetParams(node))
    if not ok:
        return Node(index, "memcpy", "memcpy", note="cuGraphMemcpyNodeGetParams failed")
    p = out[0]
    nbytes = int(p.WidthInBytes) * max(1, int(p.Height)) * max(1, int(p.Depth))

    def end(side: str) -> int:
        mt = int(getattr(p, f"{side}MemoryType"))
        base = _int(getattr(p, f"{side}Host")) if mt == 1 else _int(getattr(p, f"{side}Device"))  # 1 = host
        pitch, height = int(getattr(p, f"{side}Pitch")), int(getattr(p, f"{side}Height"))
        return base + int(getattr(p, f"{side}XInBytes")) + pitch * (int(getattr(p, f"{side}Y")) +
                                                                    height * int(getattr(p, f"{side}Z")))

    src, dst = end("src"), end("dst")
    return Node(index, "memcpy", "memcpy", launch=f"{nbytes} B",
                refs=(Ref(src, "read", "src", nbytes), Ref(dst, "write", "dst", nbytes)))


def _memset(drv, node, index: int) -> Node:
    ok, out = _ok(drv.cuGraphMemsetNodeGetParams(node))
    if not ok:
        return Node(index, "memset", "memset", note="cuGraphMemsetNodeGetParams failed")
    p = out[0]
    nbytes = int(p.elementSize) * int(p.width) * max(1, int(p.height))
    return Node(index, "memset", "memset", launch=f"{nbytes} B value {int(p.value):#x}",
                refs=(Ref(_int(p.dst), "write", "dst", nbytes),))


def _kind(drv, node) -> str:
    ok, out = _ok(drv.cuGraphNodeGetType(node))
    if not ok:
        return "?"
    return out[0].name.removeprefix("CU_GRAPH_NODE_TYPE_").lower()


_READERS = {"kernel": _kernel, "memcpy": _memcpy, "memset": _memset}


# Body graphs of conditional nodes graphctl spliced itself (DeviceLoop registers them): the
# driver's generic cuGraphNodeGetParams, which would return them, needs a newer driver than 580.
_BODIES: dict[int, tuple[int, ...]] = {}


def register_bodies(node: int, graphs: Sequence[int]) -> None:
    """Remember the body graphs of conditional node ``node`` (handles as ints)."""
    _BODIES[int(node)] = tuple(int(g) for g in graphs)


def _bodies(drv, node, h: int, kind: str) -> tuple[list[int], str]:
    if kind == "graph":
        ok, out = _ok(drv.cuGraphChildGraphNodeGetGraph(node))
        return ([_int(out[0])], "") if ok else ([], "child graph not readable")
    if h in _BODIES:
        return list(_BODIES[h]), ""
    try:
        ok, out = _ok(drv.cuGraphNodeGetParams(node))
    except Exception:  # missing from older bindings
        ok = False
    if ok:
        return [_int(g) for g in out[0].conditional.phGraph_out[: int(out[0].conditional.size)]], ""
    return [], "conditional body not readable on this driver (and not spliced by graphctl)"


def read_cuda_nodes(order: Sequence[int]) -> list[Node]:
    """The nodes ``order`` names (``CUgraphNode`` handles as ints, in capture order); the
    nodes of conditional bodies and child graphs come as each node's ``body``."""
    drv = driver()
    if drv is None:
        return []
    nodes = []
    for i, h in enumerate(order):
        node = drv.CUgraphNode(init_value=h)
        kind = _kind(drv, node)
        read = _READERS.get(kind)
        n = read(drv, node, i) if read else Node(i, kind, kind)
        if kind in ("conditional", "graph"):
            graphs, note = _bodies(drv, node, h, kind)
            from graphctl.graphs.cuda import graph_nodes  # the one lister of a graph's node handles

            body = [x for g in graphs for x in read_cuda_nodes(graph_nodes(g) or [])]
            n = dataclasses.replace(n, body=tuple(body), note=note)
        nodes.append(n)
    return nodes


def flatten(nodes: Sequence[Node]) -> list[tuple[Node, str]]:
    """Every node with its bodies' nodes after it, each with where it sits (``"12"``,
    ``"12/3"`` for node 3 of node 12's body)."""
    out: list[tuple[Node, str]] = []

    def walk(ns: Sequence[Node], prefix: str) -> None:
        for n in ns:
            at = f"{prefix}{n.index}"
            out.append((n, at))
            walk(n.body, at + "/")

    walk(nodes, "")
    return out


def census(nodes: Sequence[Node]) -> dict[str, dict[str, int]]:
    """``{"types": {kind: count}, "kernels": {name: count}}``, most frequent first (bodies of
    conditional nodes and child graphs included)."""
    types: dict[str, int] = {}
    kernels: dict[str, int] = {}
    for n, _ in flatten(nodes):
        types[n.kind] = types.get(n.kind, 0) + 1
        if n.kind in ("kernel", "op"):
            kernels[n.name] = kernels.get(n.name, 0) + 1
    order = lambda d: dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))  # noqa: E731
    return {"types": order(types), "kernels": order(kernels)}


def dot_print(raw_graph: int, path: str, verbose: bool = True) -> None:
    """Write the graph as Graphviz DOT (``cudaGraphDebugDotPrint``) with kernel and copy
    parameters; raises RuntimeError when the runtime refuses."""
    from cuda.bindings import runtime as rt

    F = rt.cudaGraphDebugDotFlags
    flags = int(F.cudaGraphDebugDotFlagsVerbose) if verbose else (
        int(F.cudaGraphDebugDotFlagsKernelNodeParams) | int(F.cudaGraphDebugDotFlagsMemcpyNodeParams) |
        int(F.cudaGraphDebugDotFlagsMemsetNodeParams))
    err, = rt.cudaGraphDebugDotPrint(raw_graph, path.encode(), flags)
    if int(err) != 0:
        raise RuntimeError(f"cudaGraphDebugDotPrint failed: {err}")
