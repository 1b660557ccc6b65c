"""Pure-PyTorch reference of every graphctl op: the fallback when ``graphctl._C`` is not
loaded, and the oracle the C++/CUDA kernels are tested against.

Written for clarity, not speed: one Python loop per buffer, temporaries allowed. The fused
kernels must be bit-identical to these on every input.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["swap_through_", "copy_", "fingerprint", "token_to_request_", "handed_counts", "handed_held"]

_MASK64 = (1 << 64) - 1


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a dense tensor's bytes (no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, found sizes {tuple(t.shape)} strides {t.stride()}")
    return t.reshape(-1).view(torch.uint8)


def check_pair(op: str, a: Sequence[torch.Tensor], an: str, b: Sequence[torch.Tensor], bn: str) -> None:
    """The checks every backend of ``op`` makes, raised as ``ValueError`` naming the entry:
    equal list lengths, equal byte sizes, dense tensors, one device per call."""
    if len(a) != len(b):
        raise ValueError(f"graphctl::{op}: {an} has {len(a)} tensors but {bn} has {len(b)}")
    dev = a[0].device if a else None
    for i, (x, y) in enumerate(zip(a, b)):
        nx, ny = x.numel() * x.element_size(), y.numel() * y.element_size()
        if nx != ny:
            raise ValueError(f"graphctl::{op}: {an}[{i}] has {nx} bytes but {bn}[{i}] has {ny} bytes")
        if not (x.is_contiguous() and y.is_contiguous()):
            raise ValueError(f"graphctl::{op}: {an}[{i}] and {bn}[{i}] must be contiguous")
        if x.device != dev or y.device != dev:
            raise ValueError(f"graphctl::{op}: all tensors must be on one device ({an}[0] is on {dev}, "
                             f"{an}[{i}] on {x.device}, {bn}[{i}] on {y.device}); call once per device")


def swap_through_(static: Sequence[torch.Tensor], arena: Sequence[torch.Tensor],
                  source: Sequence[torch.Tensor]) -> None:
    """For every i: ``arena[i] = static[i]`` then ``static[i] = source[i]``, bytewise."""
    check_pair("swap_through_", static, "static", arena, "arena")
    check_pair("swap_through_", static, "static", source, "source")
    for s, a, src in zip(static, arena, source):
        if s.numel() == 0:
            continue
        _bytes(a).copy_(_bytes(s))
        if src.data_ptr() != s.data_ptr():
            _bytes(s).copy_(_bytes(src))


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """For every i: ``dst[i] = src[i]``, bytewise, any dtypes of equal byte size."""
    check_pair("copy_", dst, "dst", src, "src")
    for d, s in zip(dst, src):
        if d.numel() and d.data_ptr() != s.data_ptr():
            _bytes(d).copy_(_bytes(s))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    # Logical right shift on int64 (torch's >> is arithmetic).
    return (x >> k) & ((1 << (64 - k)) - 1)


def _i64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= (1 << 63) else v


_C0, _C1, _C2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors with wrap-around arithmetic (see csrc/graphctl.h)."""
    z = x + _C0
    z = (z ^ _shr(z, 30)) * _C1
    z = (z ^ _shr(z, 27)) * _C2
    return z ^ _shr(z, 31)


def _mix64_int(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def fingerprint(bufs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 64-bit hash per buffer (int64 on the CPU): ``mix64(nbytes) + sum_i term(i, w_i)``
    over the buffer's little-endian 8-byte words, the last one zero-padded."""
    out = []
    for t in bufs:
        raw = _bytes(t).cpu()
        n = raw.numel()
        h = _mix64_int(n)
        if n:
            pad = (-n) % 8
            words = torch.cat([raw, raw.new_zeros(pad)]).view(torch.int64)
            idx = torch.arange(1, words.numel() + 1, dtype=torch.int64, device="cpu")
            terms = _mix64(words ^ _mix64(idx))
            h = (h + sum(int(v) & _MASK64 for v in terms.tolist())) & _MASK64
        out.append(_i64(h))
    return torch.tensor(out, dtype=torch.int64, device="cpu")


def first_negative(t: torch.Tensor) -> tuple[int, int] | None:
    """(flat index, value) of the first negative element of ``t``, or None (a host sync on a GPU)."""
    flat = t.reshape(-1)
    neg = (flat < 0).nonzero()
    if not neg.numel():
        return None
    i = int(neg[0])
    return i, int(flat[i])


def token_to_request_(out: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, pad_value: int) -> None:
    """``out[t] = searchsorted(cumsum(seq_lens), t, right=True)`` for ``t < num_tokens``
    (the request that owns token ``t``; ``len(seq_lens)`` past the last token), and
    ``out[num_tokens:] = pad_value``. A negative length counts as 0 (a request with no tokens),
    in every kernel alike; ``GRAPHCTL_CHECK_LENGTHS`` refuses one at ``write()``."""
    if not 0 <= num_tokens <= out.numel():
        raise ValueError(f"graphctl::token_to_request_: num_tokens={num_tokens} must be in [0, {out.numel()}]")
    flat = out.view(-1)
    if num_tokens:
        cum = torch.cumsum(seq_lens.reshape(-1).to(torch.int64).clamp(min=0), 0)
        t = torch.arange(num_tokens, device=out.device, dtype=torch.int64)
        flat[:num_tokens].copy_(torch.searchsorted(cum, t, right=True))
    flat[num_tokens:].fill_(pad_value)


def check_loop_condition(flag: torch.Tensor, counter: torch.Tensor, active: torch.Tensor) -> None:
    if not (flag.device == counter.device == active.device):
        raise ValueError(f"graphctl::loop_condition_: flag, counter and active must be on one device (found "
                         f"{flag.device}, {counter.device}, {active.device})")
    if flag.numel() != 1 or flag.dtype != torch.int32:
        raise ValueError(
            f"graphctl::loop_condition_: flag must be one int32 element, found {flag.numel()} of {flag.dtype}"
        )
    if counter.numel() != 1 or counter.dtype != torch.int64:
        raise ValueError(f"graphctl::loop_condition_: counter must be one int64 element, found {counter.numel()} of "
                         f"{counter.dtype}")
    if active.dtype != torch.bool or not active.is_contiguous():
        raise ValueError(f"graphctl::loop_condition_: active must be a contiguous bool mask, found {active.dtype}")


def loop_condition_(flag: torch.Tensor, counter: torch.Tensor, limit: int, active: torch.Tensor) -> None:
    """``flag[0] = counter[0] < limit and any(active)``, as int32, without a host read."""
    flag.view(-1).copy_(((counter.view(-1)[:1] < limit) & active.reshape(-1).any().view(1)).to(torch.int32))


def handed_counts(objs: tuple) -> tuple[int, ...]:
    """Each object's reference count, as :func:`handed_held` counts it (``graphs/replay/stale.py``)."""
    return tuple(map(sys.getrefcount, objs))


def handed_held(objs: tuple, counts: tuple[int, ...], cdatas: tuple[int, ...], own: int) -> bool:
    """Whether a handed-out set of outputs is referenced beyond graphctl: an object's count
    differs from ``counts`` (its :func:`handed_counts` when graphctl alone held it), or the users
    of the storages at ``cdatas`` (``StorageImpl`` addresses) sum to other than ``own``."""
    return tuple(map(sys.getrefcount, objs)) != counts or sum(map(torch._C._storage_Use_Count, cdatas)) != own
