"""graphctl ops: the fused kernels of ``graphctl._C`` when loaded, else their references.

Every op here is in-place on preallocated buffers (except ``fingerprint``), launches on the
current stream, never synchronizes and never allocates outside torch's caching allocator, so
it is legal inside a CUDA-graph capture. Buffers must be dense (contiguous) and, within one
call, on one device.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphctl.knobs import knobs
from graphctl.ops import reference
from graphctl.ops._load import STATUS, ExtensionStatus

__all__ = ["swap_through_", "copy_", "fingerprint", "token_to_request_", "loop_condition_", "switch_table", "all_bound",
           "paths_hold", "tensors_hold", "handed_checks", "caller_fn",
           "RECOMPUTE_OPS", "OpArg",
           "extension_status",
           "uses_extension", "reference"]


def extension_status() -> ExtensionStatus:
    return STATUS


_LOADED = STATUS.loaded


@dataclasses.dataclass(frozen=True)
class OpArg:
    """One argument of a recompute op's schema (``csrc/registration.cpp``; a test holds the two equal)."""

    name: str
    kind: str  # "tensor", "int", "float" or "bool"
    writes: bool = False
    lengths: bool = False  # read as lengths: GRAPHCTL_CHECK_LENGTHS refuses a negative one at write()


# ops an OpCall may name (graphctl.state.spec): in place, fixed arguments, one written tensor
RECOMPUTE_OPS: dict[str, tuple[OpArg, ...]] = {
    "token_to_request_": (OpArg("out", "tensor", writes=True), OpArg("seq_lens", "tensor", lengths=True),
                          OpArg("num_tokens", "int"), OpArg("pad_value", "int")),
}
_KNOBS = knobs.live()  # a plain dict lookup: this runs twice per switch


def uses_extension() -> bool:
    """True when calls go to ``graphctl._C`` (loaded and not disabled by a knob scope)."""
    return _LOADED and not _KNOBS["no_extension"]


def swap_through_(static: Sequence[torch.Tensor], arena: Sequence[torch.Tensor],
                  source: Sequence[torch.Tensor], *, validate: bool = True) -> None:
    """Snapshot and apply in one pass: ``arena[i] = static[i]; static[i] = source[i]``.

    An entry whose ``source`` is its ``static`` buffer is a snapshot only. ``validate=False``
    skips the Python-side argument checks (the state layer checked everything at bind; the C++
    kernels still check)."""
    if not static:  # an empty call has no tensor to dispatch on; nothing to do
        return
    if validate:
        reference.check_pair("swap_through_", static, "static", arena, "arena")
        reference.check_pair("swap_through_", static, "static", source, "source")
    if uses_extension():
        torch.ops.graphctl.swap_through_(static, arena, source)
    else:
        reference.swap_through_(static, arena, source)


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, validate: bool = True) -> None:
    """Restore direction: ``dst[i] = src[i]`` bytewise, all buffers in one call."""
    if not dst:
        return
    if validate:
        reference.check_pair("copy_", dst, "dst", src, "src")
    if uses_extension():
        torch.ops.graphctl.copy_(dst, src)
    else:
        reference.copy_(dst, src)


def fingerprint(bufs: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 hash per buffer (on the buffers' device with the extension, CPU otherwise)."""
    if not bufs:
        return torch.empty(0, dtype=torch.int64, device="cpu")
    if uses_extension():
        return torch.ops.graphctl.fingerprint(bufs)
    return reference.fingerprint(bufs)


def token_to_request_(out: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, pad_value: int = 0) -> None:
    """Token-to-request map of the cumulative layout of ``seq_lens``, padded past ``num_tokens``
    (a negative length counts as 0; ``GRAPHCTL_CHECK_LENGTHS`` refuses one)."""
    if _KNOBS["check_lengths"] and (bad := reference.first_negative(seq_lens)) is not None:
        raise ValueError(f"graphctl::token_to_request_: seq_lens[{bad[0]}] = {bad[1]} is negative "
                         "(GRAPHCTL_CHECK_LENGTHS is on); write non-negative lengths")
    if uses_extension():
        torch.ops.graphctl.token_to_request_(out, seq_lens, int(num_tokens), int(pad_value))
    else:
        reference.token_to_request_(out, seq_lens, num_tokens, pad_value)


def loop_condition_(flag: torch.Tensor, counter: torch.Tensor, limit: int, active: torch.Tensor,
                    handle: int = 0) -> None:
    """The predicate of a device-side draft loop: ``flag[0] = counter[0] < limit and any(active)``
    (int32 0/1). With a nonzero ``handle`` (a ``cudaGraphConditionalHandle`` as an int) the CUDA
    kernel also sets that WHILE node's condition, so it must then run inside the node's body;
    that needs ``graphctl._C`` with CUDA kernels."""
    reference.check_loop_condition(flag, counter, active)
    if handle:
        if not (uses_extension() and flag.is_cuda):
            raise RuntimeError("graphctl.ops.loop_condition_: setting a conditional handle needs graphctl._C with "
                               "CUDA kernels and CUDA tensors; see `graphctl info`")
        torch.ops.graphctl.loop_condition_(flag, counter, int(limit), active, int(handle))
    elif uses_extension():
        torch.ops.graphctl.loop_condition_(flag, counter, int(limit), active, 0)
    else:
        reference.loop_condition_(flag, counter, limit, active)


_C = importlib.import_module("graphctl._C") if _LOADED else None


def switch_table(obj: Any, groups: list, puts: list, recomputes: list) -> Any:
    """A ``graphctl._C.SwitchTable`` (see ``graphctl.state.native``), or None without the extension:
    a switch then runs its Python steps, the reference of the table."""
    if _C is None or not uses_extension():
        return None
    return _C.SwitchTable(obj, groups, puts, recomputes)


def all_bound(obj: Any, pairs: tuple[tuple[str, Any], ...]) -> bool:
    """True when ``getattr(obj, name) is want`` for every ``(name, want)`` (plain attribute names)."""
    if _C is not None and uses_extension():
        return bool(_C.all_bound(obj, pairs))
    return all(getattr(obj, n, None) is w for n, w in pairs)


def tensors_hold(refs: tuple, ptrs: tuple) -> bool:
    """Whether every weakly referenced tensor of ``refs`` is alive at its address in ``ptrs``, in
    one C call (``graphctl.graphs.replay.rebinding``'s weights); a Python loop without the extension."""
    if _C is not None and uses_extension():
        return bool(_C.tensors_hold(refs, ptrs))
    for ref, ptr in zip(refs, ptrs):
        t = ref()
        if t is None or t.data_ptr() != ptr:
            return False
    return True


def handed_checks() -> tuple[Callable[[tuple], tuple[int, ...]], Callable[[tuple, tuple, tuple, int], bool]]:
    """``(counts, held)`` for ``graphctl.graphs.replay.stale``'s handed-out outputs: ``graphctl._C``'s
    ``handed_counts`` and ``handed_held`` (one C call each, on every call of a graphed function), or
    their Python reference. Taken once by each bucket, so a set's baseline and its checks count alike."""
    if _C is not None and uses_extension():
        return _C.handed_counts, _C.handed_held
    return reference.handed_counts, reference.handed_held


def caller_fn(prefixes: tuple[str, ...], parts: tuple[str, ...], walk: Callable[[], Any]) -> Callable[[], Any]:
    """The innermost Python frame whose file neither starts with one of ``prefixes`` nor contains
    one of ``parts``, as ``(code object, line)`` (``(None, 0)`` if none): a callable taken once,
    ``graphctl._C.caller`` bound to its arguments, or ``walk`` (``graphctl.graphs.findings.frames``'
    Python walk, its reference) without the extension."""
    if _C is not None and uses_extension():
        return functools.partial(_C.caller, prefixes, parts)
    return walk


def paths_hold(program: tuple, args: tuple, kwargs: dict, walk: Any) -> bool:
    """Whether every path of ``program`` (``graphctl.graphs.replay.rebinding``) still leads to its
    capture's tensor, in one C call; ``walk(args, kwargs)`` (the same check in Python, its
    reference) without the extension."""
    if _C is not None and uses_extension():
        return bool(_C.paths_hold(program, args, kwargs))
    return bool(walk(args, kwargs))
