"""The Triton kernels of sampling's filtering: temperature and top-p to probabilities, one program a
row (semantics and reference: ``graphctl.ops.sampling.probs_from_logits``).

The reference sorts each row and scans it (a dozen PyTorch kernels over the vocabulary, the sort the
dearest); here a program finds the top-p boundary by bisection instead of a sort: the kept set is
every token whose probability is at least ``v``, for the largest ``v`` at which the mass of those
tokens still reaches ``top_p`` (the same set as the reference's: the smallest prefix of most likely
tokens reaching ``top_p``, ties with its least likely token kept). ``v`` is searched over float32 bit
patterns, which order non-negative floats as their values, so the bisection lands on it exactly.
Two ways to hold a row (:class:`Plan`):

- *streamed* (any vocabulary): one pass for the row's maximum, one writing each token's unnormalised
  ``exp`` into the output row, then search passes over that row (it stays in L1/L2: the program's
  own 4 bytes a token), each summing the mass above ``ways`` thresholds at once (a k-ary search:
  about 30 / log2(ways + 1) passes), and a last pass normalising the kept tokens in place.
- *resident* (vocabularies up to ``MAX_RESIDENT``): the row in registers, 31 halvings, one read of
  the logits and one write.

Sums are taken in a tree, not the reference's running order, so a row whose running mass comes within
float32 rounding of ``top_p`` may keep one token more or less than the reference.

``TRITON_INTERPRET=1`` runs them on CPU tensors (the CPU tests compare them with the reference so).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["probs", "Plan", "DEFAULT", "MAX_RESIDENT"]

MAX_RESIDENT = 32768  # a row of float32 in the registers of 16 warps: 64 values a thread


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a program holds its row: ``streamed`` (chunks of ``block`` tokens re-read from the output
    row each search pass, ``ways`` thresholds a pass) or resident in registers (31 halvings);
    ``warps`` a program (0: by the vocabulary)."""

    streamed: bool = True
    block: int = 2048
    warps: int = 8
    ways: int = 8  # streamed: thresholds a pass (a power of 2): log2(ways + 1) bits of the boundary a pass


DEFAULT = Plan()


@functools.cache
def _resident() -> Any:
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


@functools.cache
def _streamed() -> Any:
    @triton.jit
    def graphctl_top_p_streamed(X, OUT, V, sx, so, temperature, top_p, BLOCK: tl.constexpr, FILTER: tl.constexpr,
                                WAYS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        xr = X + r * sx
        orow = OUT + r * so
        offs = tl.arange(0, BLOCK)
        top = tl.full((BLOCK,), float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(xr + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            top = tl.maximum(top, tl.math.div_rn(x, temperature))
        m = tl.max(top, 0)
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):  # each token's exp(x / t - max), unnormalised, into its output slot
            inside = start + offs < V
            x = tl.load(xr + start + offs, mask=inside, other=float("-inf")).to(tl.float32)
            e = tl.exp(tl.math.div_rn(x, temperature) - m)
            tl.store(orow + start + offs, e, mask=inside)
            acc += e
        total = tl.sum(acc, 0)
        tl.debug_barrier()  # every thread's exps written before any thread reads another's back
        kept = total
        if FILTER:
            # largest v with mass(e >= v) >= top_p * total: lo holds it (0 keeps all), hi never does (the
            # largest e is exp(0) = 1). Each pass sums the mass at WAYS thresholds splitting [lo, hi) evenly
            # (mass falls as v rises: the ones that hold are a prefix); stop once [lo, hi) is one pattern.
            goal = top_p * total
            lo = tl.full((), 0, tl.int32)
            hi = tl.full((), 1.0, tl.float32).to(tl.int32, bitcast=True) + 1
            ways = tl.arange(0, WAYS)
            while hi - lo > 1:
                t = (lo.to(tl.int64) + ((hi - lo).to(tl.int64) * (ways + 1)) // (WAYS + 1)).to(tl.int32)
                v = t.to(tl.float32, bitcast=True)
                acc2 = tl.zeros((BLOCK, WAYS), tl.float32)
                for start in range(0, V, BLOCK):
                    e = tl.load(orow + start + offs, mask=start + offs < V, other=0.0)
                    acc2 += tl.where(e[:, None] >= v[None, :], e[:, None], 0.0)
                mass = tl.sum(acc2, 0)
                ok = mass >= goal
                kept = tl.where(tl.sum(ok.to(tl.int32), 0) > 0, tl.min(tl.where(ok, mass, float("inf")), 0), kept)
                lo = tl.maximum(lo, tl.max(tl.where(ok, t, lo), 0))
                hi = tl.minimum(hi, tl.min(tl.where(ok, hi, t), 0))
            floor = lo.to(tl.float32, bitcast=True)
        else:
            floor = 0.0
        for start in range(0, V, BLOCK):  # each thread rewrites only the slots it read: no barrier needed
            inside = start + offs < V
            e = tl.load(orow + start + offs, mask=inside, other=0.0)
            tl.store(orow + start + offs, tl.where(e >= floor, tl.math.div_rn(e, kept), 0.0), mask=inside)

    return graphctl_top_p_streamed


def probs(logits: torch.Tensor, temperature: float, top_p: float, plan: Plan | None = None) -> torch.Tensor | None:
    """[rows, vocab] logits (any float dtype) -> float32 probabilities at ``temperature`` (> 0) with
    top-p ``top_p`` (1.0: off); None where the plan cannot hold a row (resident, vocab over
    ``MAX_RESIDENT``). ``plan``: :data:`DEFAULT` unless given (``bench/sampling.py --sweep``)."""
    plan = plan or DEFAULT
    rows, vocab = logits.shape
    if not plan.streamed and vocab > MAX_RESIDENT:
        return None
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0 or vocab == 0:
        return out
    if plan.streamed:
        block = max(16, min(plan.block, triton.next_power_of_2(vocab)))
        kernel, warps = _streamed(), plan.warps or 8
    else:
        block = max(triton.next_power_of_2(vocab), 16)
        kernel, warps = _resident(), plan.warps or max(1, min(16, block // 2048))  # up to 64 values a thread
    extra = {"WAYS": plan.ways} if plan.streamed else {}
    kernel[(rows,)](x, out, vocab, x.stride(0), out.stride(0), float(temperature), float(top_p), BLOCK=block,
                    FILTER=top_p < 1.0, num_warps=warps, **extra)
    return out
