"""Counter-based random numbers: every draw a pure function of (seed, position, stream, index).

A sampled step must draw what the same request draws alone, in any batch, at any bucket, in every
loop mode, eager or replayed (issue 53). A generator stream shared by the batch cannot give that:
row ``i``'s numbers depend on how many rows drew before it, and a CUDA graph replays fixed
offsets of it. Here a request's numbers are a hash of its ``seed``, the ``position`` of the token
the draw is for, the ``stream`` (what the draw decides: :data:`TARGET`, :data:`ACCEPT`,
:data:`DRAFT`) and the vocabulary index: no state, nothing to restore around warmups, capture or
verify, the same value wherever and whenever it is computed.

The hash is 32-bit (murmur3's finalizer, ``fmix32``) over values held in int64 tensors, so the
PyTorch reference, the Triton kernel (``ops/sampling_triton.py``, ``GRAPHCTL_SAMPLING``) and the
test's own arithmetic agree bit for bit on the integer part:

- a row key ``r = row_keys(seed, position, stream)`` (a few ops on ``[n]`` values);
- element ``j``: ``h = fmix32((r + (j + 1) * 0x9E3779B9) mod 2^32)`` (a bijection of ``j`` for a
  given row: no two vocabulary entries of a row share a hash; of the 23 bits kept, a few may);
- a uniform ``u = (2 * (h >> 9) + 1) / 2^24`` in ``(0, 1)``, exact in float32 (23 random bits);
  :func:`noise` is ``-log(u)``, ``Exp(1)`` for :func:`~graphctl.ops.sampling.race`.

23 bits bound what the race can resolve: a token is drawn with probability within about ``2^-23``
(relative) of its own; torch's float32 ``exponential_`` is bounded alike.
"""
from __future__ import annotations

import torch

from graphctl.ops.triton_pick import TritonPick

__all__ = ["TARGET", "ACCEPT", "DRAFT", "STREAMS", "row_keys", "uniform", "noise", "fmix32"]

#: what a draw decides, part of its key: the target's token (resample, bonus, a decode or prefill
#: token), a drafted token's acceptance, a draft step's token
TARGET, ACCEPT, DRAFT = 1, 2, 3
STREAMS = {"target": TARGET, "accept": ACCEPT, "draft": DRAFT}

_M32 = 0xFFFFFFFF
_GOLDEN, _C1, _C2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding values in ``[0, 2^32)`` (products wrap
    past 2^63; the mask keeps their low 32 bits, which two's complement leaves exact)."""
    h = h ^ (h >> 16)
    h = (h * _C1) & _M32
    h = h ^ (h >> 13)
    h = (h * _C2) & _M32
    return h ^ (h >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """int64 keys in ``[0, 2^32)`` of ``seed`` and ``position`` (broadcast together; any int dtype,
    negative positions of padded rows included) for ``stream``."""
    seed, position = seed.long(), position.long()
    a = fmix32(((seed >> 32) & _M32) ^ ((stream * _GOLDEN) & _M32))
    b = fmix32((seed & _M32) ^ a)
    return fmix32(b ^ (((position & _M32) * _C1) & _M32))


def _bits(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return fmix32((keys + (index + 1) * _GOLDEN) & _M32)


def _unit(h: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1), float32, exactly ``(2 * (h >> 9) + 1) / 2^24``."""
    return ((h >> 9) * 2 + 1).to(torch.float32) * (2.0 ** -24)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """One uniform in (0, 1) per element of ``seed`` broadcast with ``position`` (float32): the
    acceptance draws, ``[n, k]`` for ``seed[:, None]`` and each drafted token's position."""
    return _unit(_bits(row_keys(seed, position, stream), torch.zeros((), dtype=torch.int64, device=seed.device)))


def noise(seed: torch.Tensor, position: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """``Exp(1)`` noise ``[n, vocab]`` (float32) for ``n`` requests' ``seed`` and ``position``
    ``[n]``: what a race for the token at ``position`` draws with. On CUDA one Triton launch
    (``GRAPHCTL_SAMPLING``), the same integers and the same ``-log``."""
    keys = row_keys(seed.reshape(-1), position.reshape(-1), stream)
    kernel = NOISE.kernel(keys.device)
    fast = None if kernel is None else NOISE.run(kernel, _reference, keys, vocab)
    return fast if fast is not None else _reference(keys, vocab)


def _reference(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    index = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    return -torch.log(_unit(_bits(keys[:, None], index[None, :])))


NOISE = TritonPick("sampling", "graphctl.ops.sampling_triton", "keyed_noise")
