"""Sampling's Triton kernels (semantics and references: ``graphctl.ops.sampling``).

**Filtering** (``probs``, reference ``probs_from_logits``): temperature and top-p to probabilities,
one program a row. The reference sorts each row and scans it (a dozen PyTorch kernels over the
vocabulary, the sort the dearest); here a program holds its whole row in registers (vocabularies up
to ``MAX_VOCAB``) and finds the top-p boundary by bisection instead of a sort: the kept set is every
token whose probability is at least ``v``, for the largest ``v`` at which the mass of those tokens
still reaches ``top_p`` (the same set as the reference's: the smallest prefix of most likely tokens
reaching ``top_p``, ties with its least likely token kept). ``v`` is searched over float32 bit
patterns, which order non-negative floats as their values, each step one masked sum over the row in
registers. The search starts at ``(1 - top_p) / 2V``, not 0 (tokens below it hold under
``(1 - top_p) / 2`` of the mass, so the boundary is above it), and stops as soon as no probability
lies strictly inside the interval left (a count every ``CHECK`` steps): the kept set cannot change
after that, so it is the set the full 31 halvings give, in about half the steps on real rows. One
read of the logits, one write of the probabilities; with noise given, the race of
``ops.sampling.race`` (``argmax(p / e)``) on the same registers, the token written too. Sums are
taken in a tree, not the reference's running order, so a row whose running mass comes within
float32 rounding of ``top_p`` may keep one token more or less than the reference.

**Acceptance** (``accept``, reference ``speculative_accept``): one program a request reads its drafts'
target and draft probabilities and its uniforms, counts the leading accepted drafts, then races the
residual law (or the target's, for the bonus) against its noise in one pass over the vocabulary:
the dozen small kernels of the reference in one launch, the same tokens (the same float32
arithmetic, IEEE division, first index among ties).

``TRITON_INTERPRET=1`` runs both on CPU tensors (the CPU tests compare them with the references so).
"""
from __future__ import annotations

import functools
import struct
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["probs", "accept", "MAX_VOCAB"]

MAX_VOCAB = 32768  # a row of float32 in the registers of 16 warps: 64 values a thread
CHECK = 4  # bisection steps between the filtering's early-exit counts (bench/sampling.py --sweep-check)
_FLOOR_TOP_P = 0.9999  # above it the start bound's margin, (1 - top_p) / 2, nears the sums' rounding: start at 0


@functools.cache
def _filter() -> Any:
    @triton.jit
    def graphctl_top_p(X, OUT, E, TOK, V, sx, so, se, temperature, top_p, floor, BLOCK: tl.constexpr,
                       FILTER: tl.constexpr, RACE: tl.constexpr, CHECK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(X + r * sx + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(x, temperature)  # as the reference divides (not a multiply by 1 / t)
        e = tl.exp(x - tl.max(x, 0))
        p = tl.math.div_rn(e, tl.sum(e, 0))
        if FILTER:
            # largest v with mass(p >= v) >= top_p; lo holds it, hi never does (it is above max p)
            lo = tl.full((), 0, tl.int32) + floor
            hi = tl.max(p, 0).to(tl.int32, bitcast=True) + 1
            steps = 0
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                mass = tl.sum(tl.where(p >= mid.to(tl.float32, bitcast=True), p, 0.0), 0)
                ok = mass >= top_p
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
                steps += 1
                if CHECK > 0:
                    if steps % CHECK == 0:
                        # nothing strictly inside (lo, hi): every later mid fails, the kept set is p >= lo
                        inside = (p > lo.to(tl.float32, bitcast=True)) & (p < hi.to(tl.float32, bitcast=True))
                        hi = tl.where(tl.sum(inside.to(tl.int32), 0) == 0, lo + 1, hi)
            p = tl.where(p >= lo.to(tl.float32, bitcast=True), p, 0.0)
            p = tl.math.div_rn(p, tl.sum(p, 0))
        tl.store(OUT + r * so + offs, p, mask=mask)
        if RACE:
            noise = tl.load(E + r * se + offs, mask=mask, other=1.0)
            tl.store(TOK + r, tl.argmax(tl.math.div_rn(p, noise), 0).to(tl.int64))

    return graphctl_top_p


def _bits(x: float) -> int:
    """The float32 bit pattern of ``x`` rounded down (a lower bound that is still below ``x``)."""
    return max(struct.unpack("<i", struct.pack("<f", x))[0] - 1, 0)


def probs(logits: torch.Tensor, temperature: float, top_p: float,
          noise: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """[rows, vocab] logits (any float dtype) -> float32 probabilities at ``temperature`` (> 0) with
    top-p ``top_p`` (1.0: off); with ``noise`` ([>= rows, vocab] float32), ``(probs, tokens)``, the
    tokens raced as ``ops.sampling.race`` does. None where a row does not fit (vocab over ``MAX_VOCAB``)."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB:
        return None
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    tok = torch.empty(rows, dtype=torch.int64, device=logits.device) if noise is not None else out
    e = out if noise is None else (noise if noise.stride(-1) == 1 else noise.contiguous())
    if rows:
        block = max(triton.next_power_of_2(vocab), 16)
        warps = max(1, min(16, block // 2048))  # up to 64 values a thread
        floor = _bits(0.5 * (1.0 - top_p) / vocab) if top_p <= _FLOOR_TOP_P else 0
        _filter()[(rows,)](x, out, e, tok, vocab, x.stride(0), out.stride(0), e.stride(0), float(temperature),
                           float(top_p), floor, BLOCK=block, FILTER=top_p < 1.0, RACE=noise is not None,
                           CHECK=CHECK, num_warps=warps)
    return out if noise is None else (out, tok)


@functools.cache
def _accept() -> Any:
    @triton.jit
    def graphctl_accept(T, Q, D, U, E, ACC, TOK, V, st0, st1, sq0, sq1, sd, su, se, K: tl.constexpr,
                        BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        at = tl.full((), 0, tl.int32)  # drafts kept before the first rejection
        going = tl.full((), 1, tl.int32)
        for j in tl.static_range(K):
            d = tl.load(D + r * sd + j).to(tl.int64)
            pd = tl.load(T + r * st0 + j * st1 + d)
            qd = tl.load(Q + r * sq0 + j * sq1 + d)
            u = tl.load(U + r * su + j)
            going = going * (u * qd < pd).to(tl.int32)
            at += going
        # race max(0, p - q) at the first rejection (q = 0 past the last draft: the bonus, from p),
        # and p itself, for a residual that is zero everywhere
        offs = tl.arange(0, BLOCK)
        has_q = at < K
        prow = T + r * st0 + at * st1
        qrow = Q + r * sq0 + tl.minimum(at, K - 1) * sq1
        best_r = -1.0
        best_p = -1.0
        idx_r = 0
        idx_p = 0
        top = 0.0
        for start in range(0, V, BLOCK):
            m = start + offs < V
            p = tl.load(prow + start + offs, mask=m, other=0.0)
            q = tl.load(qrow + start + offs, mask=m & has_q, other=0.0)
            noise = tl.load(E + r * se + start + offs, mask=m, other=1.0)
            res = tl.maximum(p - q, 0.0)
            top = tl.maximum(top, tl.max(res, 0))
            vr = tl.math.div_rn(res, noise)
            vp = tl.math.div_rn(p, noise)
            cr = tl.max(vr, 0)
            cp = tl.max(vp, 0)
            idx_r = tl.where(cr > best_r, start + tl.argmax(vr, 0), idx_r)  # strict: the first index on ties
            idx_p = tl.where(cp > best_p, start + tl.argmax(vp, 0), idx_p)
            best_r = tl.maximum(best_r, cr)
            best_p = tl.maximum(best_p, cp)
        tl.store(ACC + r, (at + 1).to(tl.int64))
        tl.store(TOK + r, tl.where(top > 0, idx_r, idx_p).to(tl.int64))

    return graphctl_accept


def accept(target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
           e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative acceptance (``ops.sampling.speculative_accept`` with ``k >= 1``), given its draws:
    ``target`` [n, k + 1, V] and ``draft`` [n, k, V] float32 probabilities, ``drafts`` [n, k],
    ``u`` [>= n, k] uniforms, ``e`` [>= n, V] exponential noise. ``(accepted, token)``, int64 [n]."""
    n, k1, vocab = target.shape
    t, q = (a if a.stride(-1) == 1 and a.dtype == torch.float32 else a.float().contiguous() for a in (target, draft))
    d, uu, ee = (a if a.stride(-1) == 1 else a.contiguous() for a in (drafts, u, e))
    acc = torch.empty(n, dtype=torch.int64, device=target.device)
    tok = torch.empty(n, dtype=torch.int64, device=target.device)
    if n:
        block = min(max(triton.next_power_of_2(vocab), 16), 8192)
        _accept()[(n,)](t, q, d, uu, ee, acc, tok, vocab, t.stride(0), t.stride(1), q.stride(0), q.stride(1),
                        d.stride(0), uu.stride(0), ee.stride(0), K=k1 - 1, BLOCK=block,
                        num_warps=max(1, min(16, block // 512)))
    return acc, tok
