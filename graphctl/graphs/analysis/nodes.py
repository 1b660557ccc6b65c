"""What a captured graph holds, node by node: type, kernel name, launch shape, and every device
address found in its arguments.

Both backends describe their graphs as a list of :class:`Node` (this module is pure data): the
CUDA backend reads the kept template through the driver API
(``graphctl/graphs/backends/cuda_nodes.py``), the emulated backend turns each recorded op into
one node whose references are its tensors' addresses. The pointer and segment audits
(:mod:`graphctl.graphs.analysis.audit`) work on nodes only, so they are the same on both backends.

Where addresses come from, on CUDA:

- kernel nodes launched with ``kernelParams``: each parameter's bytes (sizes walked with
  ``cuFuncGetParamInfo`` until it fails; ``cuFuncGetParamCount`` is missing on driver 580);
- kernel nodes launched with ``extra`` (cuBLAS's ``nvjet`` kernels): the one packed argument
  buffer. Such nodes are marked ``library``: their buffer also holds workspace pointers and TMA
  descriptors, so an unregistered live allocation in them is the library's own workspace;
- memcpy nodes (source read, destination written) and memset nodes (destination written).

Every 8-byte-aligned word of a kernel's arguments is a candidate address; the audit keeps the
ones that fall into known memory. A word that is a whole 8-byte parameter is ``exact`` (the
kernel takes a pointer-sized value there); a word inside a larger parameter or an ``extra``
buffer is not: the parameter layout (``cuFuncGetParamInfo``: offset and size) says which bytes
are parameters, not which words of a struct are live pointers. A kernel's arguments do not say what it reads and what it
writes, so kernel references have access ``touch``.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

__all__ = ["Ref", "Node", "Region", "flatten", "is_library_kernel", "LIBRARY_KERNEL_PREFIXES", "census", "short_name"]


_MODEL_OPS = frozenset({"graphctl::paged_attention"})  # graphctl's ops a model calls (graphctl/ops/attention.py)


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """A device address found in a node: ``where`` in its arguments, and how it is used."""

    address: int
    access: str  # "read", "write" or "touch" (a kernel argument: either)
    where: str  # "param 2+8", "extra+64", "src", "dst", "arg 0"
    nbytes: int = 0  # known extent (copies, memsets, emulated tensors), 0 when unknown
    # A whole pointer-sized kernel parameter, a copy's address or a recorded tensor: a pointer
    # the node uses. False for a word inside a larger parameter (a struct: TensorIterator's
    # functors carry fixed-size arrays and padding whose unused words hold whatever the host
    # stack held) or in a library's packed ``extra`` buffer: maybe a pointer, maybe not.
    exact: bool = True


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
    body: tuple[Node, ...] = ()  # the nodes of a conditional's body or a child graph (indices within it)

    @property
    def graphctl(self) -> bool:
        """A node of graphctl's own switch machinery (declared, not audited as user work). The
        model-level ops graphctl also ships (paged attention) are the model's work: audited."""
        return self.name.startswith("graphctl::") and self.name not in _MODEL_OPS


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
        if m is None:  # a digit run _NESTED does not take: not a name we can read
            break
        n, s = int(m.group(1)), s[m.end():]
        parts.append(s[:n])
        s = s[n:]
        if s[:1] == "I":  # template arguments: the name is complete
            break
    return "::".join(parts) if parts else symbol


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
