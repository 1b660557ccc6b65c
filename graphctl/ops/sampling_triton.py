"""The Triton kernel of sampling's filtering: temperature and top-p to probabilities, one program a row
(semantics and reference: ``graphctl.ops.sampling.probs_from_logits``).

The reference sorts each row and scans it (a dozen PyTorch kernels over the vocabulary, the sort the
dearest); here a program holds its whole row in registers (vocabularies up to ``MAX_VOCAB``) and
finds the top-p boundary by bisection instead of a sort: the kept set is every token whose
probability is at least ``v``, for the largest ``v`` at which the mass of those tokens still reaches
``top_p`` (the same set as the reference's: the smallest prefix of most likely tokens reaching
``top_p``, ties with its least likely token kept). ``v`` is searched over float32 bit patterns, which
order non-negative floats as their values: 31 halvings of ``[0, bits(max p)]`` land on it exactly,
each one masked sum over the row in registers. One read of the logits, one write of the
probabilities. Sums are taken in a tree, not the reference's running order, so a row whose running
mass comes within float32 rounding of ``top_p`` may keep one token more or less than the reference.

``TRITON_INTERPRET=1`` runs it on CPU tensors (the CPU tests compare it with the reference so).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["probs", "MAX_VOCAB"]

MAX_VOCAB = 32768  # a row of float32 in the registers of 16 warps: 64 values a thread


@functools.cache
def _kernel() -> Any:
    @triton.jit
    def graphctl_top_p(X, OUT, V, sx, so, temperature, top_p, BLOCK: tl.constexpr, FILTER: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(X + r * sx + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(x, temperature)  # as the reference divides (not a multiply by 1 / t)
        e = tl.exp(x - tl.max(x, 0))
        p = tl.math.div_rn(e, tl.sum(e, 0))
        if FILTER:
            # largest v with mass(p >= v) >= top_p; lo holds it, hi never does (it is above max p)
            lo = tl.full((), 0, tl.int32)
            hi = tl.max(p, 0).to(tl.int32, bitcast=True) + 1
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                mass = tl.sum(tl.where(p >= mid.to(tl.float32, bitcast=True), p, 0.0), 0)
                ok = mass >= top_p
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            p = tl.where(p >= lo.to(tl.float32, bitcast=True), p, 0.0)
            p = tl.math.div_rn(p, tl.sum(p, 0))
        tl.store(OUT + r * so + offs, p, mask=mask)

    return graphctl_top_p


def probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor | None:
    """[rows, vocab] logits (any float dtype) -> float32 probabilities at ``temperature`` (> 0) with
    top-p ``top_p`` (1.0: off); None where a row does not fit (vocab over ``MAX_VOCAB``)."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB:
        return None
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    block = max(triton.next_power_of_2(vocab), 16)
    warps = max(1, min(16, block // 2048))  # up to 64 values a thread
    _kernel()[(rows,)](x, out, vocab, x.stride(0), out.stride(0), float(temperature), float(top_p), BLOCK=block,
                       FILTER=top_p < 1.0, num_warps=warps)
    return out
