"""The CUDA backend's readers: a captured graph's node handles, each node's parameters through
the driver API (the runtime cannot read kernels that libtorch's own cudart registered), DOT
export, and the caching allocator's segments. What they produce is the pure data of
``graphctl/graphs/analysis/nodes.py``; what the nodes mean is documented there.
"""
from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from graphctl import bindings
from graphctl.graphs.analysis.nodes import Node, Ref, Region, is_library_kernel, short_name

__all__ = ["graph_nodes", "capturing_nodes", "read_cuda_nodes", "register_bodies", "dot_print", "allocator_regions",
           "kernel_patches", "apply_patches"]

_WORD = 8
_MAX_PARAMS = 4096


def graph_nodes(raw_graph: int) -> list[int] | None:
    """The node handles of a ``cudaGraph_t``, as ints (None without cuda-bindings or on error)."""
    rt = bindings.runtime()
    if rt is None:
        return None
    err, _, n = rt.cudaGraphGetNodes(raw_graph, 0)
    if int(err) != 0:
        return None
    err, nodes, n = rt.cudaGraphGetNodes(raw_graph, n)
    return [int(x) for x in nodes[:int(n)]] if int(err) == 0 else None


def capturing_nodes(stream: torch.cuda.Stream) -> list[int] | None:
    """The node handles recorded so far by the capture running on ``stream``."""
    rt = bindings.runtime()
    if rt is None:
        return None
    err, status, _id, graph, *_ = rt.cudaStreamGetCaptureInfo(stream.cuda_stream)
    if int(err) != 0 or graph is None:
        return None
    return graph_nodes(int(graph))


def _ok(r: Any) -> tuple[bool, tuple]:
    err, *out = r
    return int(err) == 0, tuple(out)


def _int(v: Any) -> int:
    try:
        return int(v)
    except TypeError:  # pointer wrappers without __int__
        return int(v.getPtr())


def _candidates(data: bytes) -> Iterator[tuple[int, int]]:
    """``(offset, value)`` of every 8-byte word of ``data`` that may be a device address."""
    for off in range(0, len(data) - _WORD + 1, _WORD):
        v = int.from_bytes(data[off:off + _WORD], "little")
        if v >= 1 << 16:  # small integers are sizes and flags, never device addresses
            yield off, v


def _words(data: bytes, where: str, exact: bool) -> list[Ref]:
    """Candidate addresses of one parameter (or ``extra`` buffer); ``exact`` only where the
    parameter is one 8-byte word (see ``Ref.exact``)."""
    exact = exact and len(data) == _WORD
    return [Ref(v, "touch", f"{where}+{off}" + ("" if exact else f" of {len(data)} B"), exact=exact)
            for off, v in _candidates(data)]


def _kernel(drv: Any, node: Any, index: int) -> Node:
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
                refs += _words(ctypes.string_at(ptr, size), f"param {i}", True)
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
            refs += _words(ctypes.string_at(buf, size), "extra", False)
        else:
            note = "extra launch without a readable argument buffer"
    short = short_name(symbol) if symbol else "?"
    return Node(index, "kernel", short, symbol, launch, tuple(sizes),
                library=(bool(extra) and not kp) or is_library_kernel(short), refs=tuple(refs), note=note)


def _memcpy(drv: Any, node: Any, index: int) -> Node:
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


def _memset(drv: Any, node: Any, index: int) -> Node:
    ok, out = _ok(drv.cuGraphMemsetNodeGetParams(node))
    if not ok:
        return Node(index, "memset", "memset", note="cuGraphMemsetNodeGetParams failed")
    p = out[0]
    nbytes = int(p.elementSize) * int(p.width) * max(1, int(p.height))
    return Node(index, "memset", "memset", launch=f"{nbytes} B value {int(p.value):#x}",
                refs=(Ref(_int(p.dst), "write", "dst", nbytes),))


def _kind(drv: Any, node: Any) -> str:
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


def _bodies(drv: Any, node: Any, h: int, kind: str) -> tuple[list[int], str]:
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
    drv = bindings.driver()
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
            body = [x for g in graphs for x in read_cuda_nodes(graph_nodes(g) or [])]
            n = dataclasses.replace(n, body=tuple(body), note=note)
        nodes.append(n)
    return nodes


def _patched(data: bytes, lookup: Callable[[int], int | None]) -> bytes | None:
    """``data`` with every 8-byte word that is an old address rewritten, or None if none is."""
    out, hit = bytearray(data), False
    for off, v in _candidates(data):
        new = lookup(v)
        if new is not None:
            out[off:off + _WORD] = new.to_bytes(_WORD, "little")
            hit = True
    return bytes(out) if hit else None


def _moved(address: int, nbytes: int, lookup: Callable[[int], int | None]) -> int | None:
    """How far ``[address, address + nbytes)`` moved, None if not at all; a range only partly
    inside a move (or across two moving apart) is ``-1``: not patchable."""
    first = lookup(address)
    last = lookup(address + max(nbytes, 1) - 1)
    if first is None and last is None:
        return None
    if first is None or last is None or first - address != last - (address + max(nbytes, 1) - 1):
        return -1
    return first - address


def _copy_patch(drv: Any, node: Any, kind: str, lookup: Callable[[int], int | None]) -> tuple[Any, str] | None:
    """The memcpy or memset node's parameters with moved device addresses rewritten; None when
    none moved; ``(None, why)`` when one cannot be rewritten (host memory, a partial overlap)."""
    if kind == "memset":
        ok, out = _ok(drv.cuGraphMemsetNodeGetParams(node))
        if not ok:
            return None, "memset parameters not readable"
        p = out[0]
        nbytes = int(p.elementSize) * int(p.width) * max(1, int(p.height))
        d = _moved(_int(p.dst), nbytes, lookup)
        if d is None:
            return None
        if d == -1:
            return None, "a memset straddles a moved buffer"
        p.dst = drv.CUdeviceptr(_int(p.dst) + d)
        return p, ""
    ok, out = _ok(drv.cuGraphMemcpyNodeGetParams(node))
    if not ok:
        return None, "memcpy parameters not readable"
    p = out[0]
    nbytes = int(p.WidthInBytes) * max(1, int(p.Height)) * max(1, int(p.Depth))
    changed = False
    for side in ("src", "dst"):
        base = _int(getattr(p, f"{side}Device"))
        start = base + int(getattr(p, f"{side}XInBytes")) + int(getattr(p, f"{side}Pitch")) * (
            int(getattr(p, f"{side}Y")) + int(getattr(p, f"{side}Height")) * int(getattr(p, f"{side}Z")))
        d = _moved(start, nbytes, lookup) if int(getattr(p, f"{side}MemoryType")) != 1 else None  # 1: host
        if d == -1:
            return None, f"a memcpy {side} straddles a moved buffer"
        if d:
            setattr(p, f"{side}Device", drv.CUdeviceptr(base + d))
            changed = True
    return (p, "") if changed else None


def kernel_patches(order: Sequence[int], lookup: Callable[[int], int | None]) -> tuple[list[tuple[Any, ...]], str]:
    """For re-pointing (``graphs/replay/repoint.py``): the nodes of ``order`` holding an address
    ``lookup`` maps, each as ``(kind, node, new parameters, buffers to keep alive)`` (kernel
    arguments, memcpy and memset device addresses rewritten); or ``([], why)`` naming the first
    address that cannot be rewritten safely (a library kernel's opaque ``extra`` buffer, a
    conditional body or child graph, a copy straddling a moved buffer, an unreadable node).
    Only reads: nothing is changed."""
    drv = bindings.driver()
    patches: list[tuple[Any, ...]] = []
    for i, h in enumerate(order):
        node = drv.CUgraphNode(init_value=h)
        kind = _kind(drv, node)
        if kind in ("memcpy", "memset"):
            got = _copy_patch(drv, node, kind, lookup)
            if got is not None and got[0] is None:
                return [], f"node {i} ({kind}): {got[1]}"
            if got is not None:
                patches.append((kind, node, got[0], None))
            continue
        if kind in ("conditional", "graph"):  # bodies are not patched: any old address in one refuses
            graphs, note = _bodies(drv, node, h, kind)
            if note:
                return [], f"node {i} ({kind}): {note}"
            for x in (x for g in graphs for x in read_cuda_nodes(graph_nodes(g) or [])):
                hit = next((r for r in x.refs if lookup(r.address) is not None), None)
                if hit is not None:
                    return [], f"node {i} ({kind}), in its body, holds {hit.address:#x}"
            continue
        if kind != "kernel":  # events, waits, allocations: no argument addresses
            continue
        ok, out = _ok(drv.cuGraphKernelNodeGetParams(node))
        if not ok:
            return [], f"node {i}: kernel parameters not readable"
        p = out[0]
        kp, extra = _int(p.kernelParams), _int(p.extra)
        if not kp:
            refs = _kernel(drv, node, i).refs
            if any(lookup(r.address) is not None for r in refs) or not extra:
                return [], f"node {i}: an address inside a library kernel's opaque argument buffer"
            continue
        func = p.func
        params, changed = [], False
        for k in range(_MAX_PARAMS):
            ok, info = _ok(drv.cuFuncGetParamInfo(func, k)) if _int(func) else _ok(drv.cuKernelGetParamInfo(p.kern, k))
            if not ok:
                break
            ptr = ctypes.c_uint64.from_address(kp + _WORD * k).value
            data = ctypes.string_at(ptr, int(info[1])) if ptr else b""
            new = _patched(data, lookup)
            changed |= new is not None
            params.append(new if new is not None else data)
        if changed:
            bufs = [ctypes.create_string_buffer(d, max(len(d), 1)) for d in params]
            table = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
            p.kernelParams = ctypes.addressof(table)
            patches.append(("kernel", node, p, (bufs, table)))
    return patches, ""


def apply_patches(raw_exec: int, patches: list[tuple[Any, ...]]) -> None:
    """Write ``kernel_patches``' new parameters into the instantiated graph and its template."""
    drv = bindings.driver()
    exe = drv.CUgraphExec(init_value=raw_exec)
    ok, ctx = _ok(drv.cuCtxGetCurrent())
    for kind, node, p, _keep in patches:
        if kind == "kernel":
            calls = (lambda: drv.cuGraphExecKernelNodeSetParams(exe, node, p),
                     lambda: drv.cuGraphKernelNodeSetParams(node, p))
        elif kind == "memcpy":
            calls = (lambda: drv.cuGraphExecMemcpyNodeSetParams(exe, node, p, ctx[0]),
                     lambda: drv.cuGraphMemcpyNodeSetParams(node, p))
        else:
            calls = (lambda: drv.cuGraphExecMemsetNodeSetParams(exe, node, p, ctx[0]),
                     lambda: drv.cuGraphMemsetNodeSetParams(node, p))
        for call in calls:
            r = call()
            if int(r[0]) != 0:
                raise RuntimeError(f"re-pointing a {kind} node failed: {r[0]}")


def dot_print(raw_graph: int, path: str, verbose: bool = True) -> None:
    """Write the graph as Graphviz DOT (``cudaGraphDebugDotPrint``) with kernel and copy
    parameters; raises RuntimeError when the runtime refuses."""
    rt = bindings.runtime()
    if rt is None:
        raise RuntimeError("DOT export needs cuda-bindings (pip install cuda-bindings)")
    F = rt.cudaGraphDebugDotFlags
    flags = int(F.cudaGraphDebugDotFlagsVerbose) if verbose else (
        int(F.cudaGraphDebugDotFlagsKernelNodeParams) | int(F.cudaGraphDebugDotFlagsMemcpyNodeParams) |
        int(F.cudaGraphDebugDotFlagsMemsetNodeParams))
    err, = rt.cudaGraphDebugDotPrint(raw_graph, path.encode(), flags)
    if int(err) != 0:
        raise RuntimeError(f"cudaGraphDebugDotPrint failed: {err}")


def allocator_regions(device: torch.device, pool: Any) -> list[Region]:
    """The caching allocator's segments on ``device``: every private pool's segments as ``pool``
    regions (``pool``'s own, or another graph's, such as a device loop body's pool), every block
    of the default pool as ``live`` or ``freed``."""
    regions = []
    pool_id = tuple(pool) if pool is not None else None
    for seg in torch.cuda.memory_snapshot():
        if seg["device"] != device.index:
            continue
        start = int(seg["address"])
        sid = tuple(seg.get("segment_pool_id") or (0, 0))
        if sid != (0, 0):
            name = "graph pool" if sid == pool_id else f"private pool {sid}"
            regions.append(Region(name, "pool", start, start + int(seg["total_size"])))
            continue
        at = start
        for blk in seg["blocks"]:
            addr = int(blk.get("address", at))
            size = int(blk["size"])
            kind = "live" if blk["state"].startswith("active") else "freed"
            regions.append(Region(f"{kind} block of {size} B", kind, addr, addr + size))
            at = addr + size
    return regions
