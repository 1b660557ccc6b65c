"""Sampling's Triton kernels (semantics and references: ``graphctl.ops.sampling``).

**Filtering** (``probs``, reference ``probs_from_logits``): temperature and top-p to probabilities,
one program a row. The reference sorts each row and scans it (a dozen PyTorch kernels over the
vocabulary, the sort the dearest); here a program holds its whole row in registers (vocabularies up
to ``MAX_VOCAB``) and finds the top-p boundary by bisection instead of a sort: the kept set is every
token whose probability is at least ``v``, for the largest ``v`` at which the mass of those tokens
still reaches ``top_p`` (the same set as the reference's: the smallest prefix of most likely tokens
reaching ``top_p``, ties with its least likely token kept). Each step is one masked sum over the row
in registers, and what is searched is the fewest candidates that hold ``v``: 16-bit logits' 65,536
bit patterns (16 steps; a logit ``L`` stands for ``p(L)``, the probability a token of logit ``L`` gets
by the same float32 ops, and ``p`` is monotone in ``L``), else float32 probabilities' bit patterns,
which order non-negative floats as their values, from ``(1 - top_p) / 2V`` up (tokens below it hold
under ``(1 - top_p) / 2`` of the mass; about 27 steps). Both find the ``v`` of the full 31-step
search over probabilities, bit for bit. One read of the logits, one write of the probabilities.
Sums are taken in a tree, not the reference's running order, so a row whose running mass comes
within float32 rounding of ``top_p`` may keep one token more or less than the reference. Fusing a
draft step's race in was tried: the noise spilled the row's registers and cost 30 us a launch.

**Per-row filtering** (``probs_rows``, reference ``probs_from_logits`` with per-row tensors): each row
its own temperature, top-k and top-p, read from the device (a mixed batch in one launch, issue 53). A
row below the temperature floor is the one-hot of its argmax; top-k keeps the tokens whose probability
is at least the ``k``-th largest's (bisection over float32 probabilities' bit patterns on the count),
then top-p bisects the same patterns on the mass of the renormalized kept set. Tokens whose float32
probabilities round equal to the k-th's are kept with it (the reference compares logits): a law within
rounding of the reference's, like the host-settings kernel at the top-p boundary.

**Acceptance** (``accept``, reference ``speculative_accept``; with no drafts it is ``race``): one
program a request reads its drafts' target and draft probabilities and its uniforms, counts the
leading accepted drafts, then races the residual law (or the target's, for the bonus) against its
noise in one pass over the vocabulary: the dozen small kernels of the reference in one launch, the
same tokens (the same float32 arithmetic, IEEE division, first index among ties).

**Keyed noise** (``keyed_noise``, reference ``ops.draws``): the counter-based ``Exp(1)`` noise of a
row key, one program a block of a row: the hash's integer steps as the reference takes them (int64
values masked to 32 bits), then ``-log``.

``TRITON_INTERPRET=1`` runs them on CPU tensors (the CPU tests compare them with the references so).
"""
from __future__ import annotations

import functools
import struct
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["probs", "probs_rows", "race", "accept", "keyed_noise", "MAX_VOCAB"]

MAX_VOCAB = 32768  # a row of float32 in the registers of 16 warps: 64 values a thread
KEYED = True  # 16-bit logits: search their bit patterns (16 steps), not float32 probabilities' (bench: False)
IEEE_DIV = False  # the filtering's probabilities by IEEE division, not a reciprocal's multiply (bench only)
_FLOOR_TOP_P = 0.9999  # above it the start bound's margin, (1 - top_p) / 2, nears the sums' rounding: start at 0


@triton.jit
def _threshold(p, lo, need, MASS: tl.constexpr):
    """The largest ``v`` (float32) whose tokens at ``p >= v`` hold at least ``need``: of the mass where
    ``MASS``, else of the count. Bisection over float32 bit patterns, which order non-negative floats
    as their values; ``lo`` (an int32 bit pattern) holds it from the start, ``hi`` (above max p) never."""
    hi = tl.max(p, 0).to(tl.int32, bitcast=True) + 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        at = p >= mid.to(tl.float32, bitcast=True)
        ok = tl.sum(tl.where(at, p if MASS else 1.0, 0.0), 0) >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo.to(tl.float32, bitcast=True)


@functools.cache
def _filter() -> Any:
    @triton.jit
    def graphctl_top_p(X, OUT, V, sx, so, temperature, top_p, floor, BLOCK: tl.constexpr, FILTER: tl.constexpr,
                       KEYED: tl.constexpr, IEEE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < V
        raw = tl.load(X + r * sx + offs, mask=mask, other=float("-inf"))
        x = tl.math.div_rn(raw.to(tl.float32), temperature)  # as the reference divides (not a multiply by 1 / t)
        top = tl.max(x, 0)
        e = tl.exp(x - top)
        total = tl.sum(e, 0)
        # a multiply by 1 / total, not a division a token: IEEE division is a dozen instructions with a
        # slow path, and the probabilities need not be the reference's bits (the tests allow 2e-6)
        inv = tl.math.div_rn(1.0, total)
        if IEEE:
            p = tl.math.div_rn(e, total)
        else:
            p = e * inv
        if FILTER:
            if KEYED:
                # 16-bit logits: search their 65,536 patterns, ordered as values by the key k(b) (sign set:
                # b ^ 0xFFFF; clear: b | 0x8000). A logit L stands for the probability p(L) a token of
                # logit L gets, computed by the ops that made p: {p >= p(L)} is the threshold set at L.
                bits = raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                key = tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
                lo = tl.min(tl.where(mask, key, 0xFFFF), 0)  # the least logit: everything, mass 1
                hi = tl.max(tl.where(mask, key, 0), 0) + 1
                while hi - lo > 1:
                    mid = lo + (hi - lo) // 2
                    b = tl.where(mid >= 0x8000, mid & 0x7FFF, mid ^ 0xFFFF).to(tl.int16)
                    v = tl.exp(tl.math.div_rn(b.to(raw.dtype, bitcast=True).to(tl.float32), temperature) - top)
                    v = tl.math.div_rn(v, total) if IEEE else v * inv  # p(L) by the very ops p was made with
                    ok = tl.sum(tl.where(p >= v, p, 0.0), 0) >= top_p
                    lo = tl.where(ok, mid, lo)
                    hi = tl.where(ok, hi, mid)
                b = tl.where(lo >= 0x8000, lo & 0x7FFF, lo ^ 0xFFFF).to(tl.int16)
                v = tl.exp(tl.math.div_rn(b.to(raw.dtype, bitcast=True).to(tl.float32), temperature) - top)
                v = tl.math.div_rn(v, total) if IEEE else v * inv
            else:
                # the largest v with mass(p >= v) >= top_p, searched from the start bound (or 0)
                v = _threshold(p, tl.full((), 0, tl.int32) + floor, top_p, True)
            p = tl.where(p >= v, p, 0.0)
            kept = tl.sum(p, 0)
            p = tl.math.div_rn(p, kept) if IEEE else p * tl.math.div_rn(1.0, kept)
        tl.store(OUT + r * so + offs, p, mask=mask)

    return graphctl_top_p


@functools.cache
def _filter_rows() -> Any:
    @triton.jit
    def graphctl_filter_rows(X, OUT, T, K, P, V, sx, so, floor_t, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < V
        raw = tl.load(X + r * sx + offs, mask=mask, other=float("-inf")).to(tl.float32)
        t = tl.load(T + r)
        k = tl.load(K + r)
        top_p = tl.load(P + r)
        greedy = t < floor_t
        x = tl.math.div_rn(raw, tl.where(greedy, 1.0, t))
        top = tl.max(x, 0)
        e = tl.exp(x - top)
        p = e * tl.math.div_rn(1.0, tl.sum(e, 0))
        if (k > 0) & (k < V):  # the largest v with at least k tokens at p >= v
            p = tl.where(p >= _threshold(p, tl.full((), 0, tl.int32), k.to(tl.float32), False), p, 0.0)
            p = p * tl.math.div_rn(1.0, tl.sum(p, 0))
        if top_p < 1.0:  # the largest v whose tokens at p >= v hold at least top_p
            p = tl.where(p >= _threshold(p, tl.full((), 0, tl.int32), top_p, True), p, 0.0)
            p = p * tl.math.div_rn(1.0, tl.sum(p, 0))
        _, best = tl.reduce((tl.where(mask, raw, float("-inf")), offs), 0, _first_max)
        p = tl.where(greedy, tl.where(offs == best, 1.0, 0.0), p)
        tl.store(OUT + r * so + offs, p, mask=mask)

    return graphctl_filter_rows


def probs_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               floor: float) -> torch.Tensor | None:
    """[rows, vocab] logits -> float32 probabilities, row ``i`` at ``temperature[i]`` (below ``floor``:
    the one-hot of its argmax), ``top_k[i]`` (0: off) and ``top_p[i]`` (1: off), all device tensors
    of ``rows`` values; None where a row does not fit (vocab over ``MAX_VOCAB``)."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB:
        return None
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    t, k, p = (v.reshape(-1).to(logits.device, dt).contiguous() for v, dt in
               ((temperature, torch.float32), (top_k, torch.int32), (top_p, torch.float32)))
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows:
        block = max(triton.next_power_of_2(vocab), 16)
        _filter_rows()[(rows,)](x, out, t, k, p, vocab, x.stride(0), out.stride(0), float(floor), BLOCK=block,
                                num_warps=max(1, min(16, block // 2048)))
    return out


def _bits(x: float) -> int:
    """The float32 bit pattern of ``x`` rounded down (a lower bound that is still below ``x``)."""
    return max(struct.unpack("<i", struct.pack("<f", x))[0] - 1, 0)


def probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor | None:
    """[rows, vocab] logits (any float dtype) -> float32 probabilities at ``temperature`` (> 0) with
    top-p ``top_p`` (1.0: off); None where a row does not fit (vocab over ``MAX_VOCAB``)."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB:
        return None
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows:
        block = max(triton.next_power_of_2(vocab), 16)
        warps = max(1, min(16, block // 2048))  # up to 64 values a thread
        floor = _bits(0.5 * (1.0 - top_p) / vocab) if top_p <= _FLOOR_TOP_P else 0
        _filter()[(rows,)](x, out, vocab, x.stride(0), out.stride(0), float(temperature), float(top_p), floor,
                           BLOCK=block, FILTER=top_p < 1.0, KEYED=KEYED and x.element_size() == 2, IEEE=IEEE_DIV,
                           num_warps=warps)
    return out


def race(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``ops.sampling.race``: ``argmax(p / e)`` a row of float32 ``p`` [n, V] with noise ``e`` [>= n, V],
    in one launch (the acceptance kernel with no drafts: the bonus token's race)."""
    rows = p.unsqueeze(1)  # [n, 1, V]: a target row each, no drafts (any strides: accept() copies if it must)
    none = torch.empty((p.shape[0], 0), dtype=torch.int64, device=p.device)
    return accept(rows, rows[:, :0], none, none, e)[1]


@triton.jit
def _first_max(v1, i1, v2, i2):
    """The larger value, the smaller index among equal ones (torch's argmax: the first maximum)."""
    first = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(first, v1, v2), tl.where(first, i1, i2)


@triton.jit
def _race_row(prow, qrow, has_q, erow, V, BLOCK: tl.constexpr):
    """(best value, its index) of ``max(0, p - q) / e`` over a row (q = 0 where not ``has_q``): each
    lane keeps its best over the chunks, one reduction at the end (a reduction a chunk cost more than
    the arithmetic)."""
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, tl.float32)
    arg = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        m = start + offs < V
        p = tl.load(prow + start + offs, mask=m, other=0.0)
        q = tl.load(qrow + start + offs, mask=m & has_q, other=0.0)
        noise = tl.load(erow + start + offs, mask=m, other=1.0)
        val = tl.where(m, tl.math.div_rn(tl.maximum(p - q, 0.0), noise), -1.0)
        upd = val > best  # strict: a lane's earlier index on ties
        best = tl.where(upd, val, best)
        arg = tl.where(upd, start + offs, arg)
    return tl.reduce((best, arg), 0, _first_max)


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
        # race max(0, p - q) at the first rejection (q = 0 past the last draft: the bonus, from p), and p
        # itself where that residual is zero everywhere (p == q there: never drawn from in practice)
        has_q = at < K
        prow = T + r * st0 + at * st1
        qrow = Q + r * sq0 + tl.minimum(at, K - 1) * sq1
        top, idx = _race_row(prow, qrow, has_q, E + r * se, V, BLOCK)
        if top <= 0.0:
            top, idx = _race_row(prow, qrow, False, E + r * se, V, BLOCK)
        tl.store(ACC + r, (at + 1).to(tl.int64))
        tl.store(TOK + r, idx.to(tl.int64))

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


@functools.cache
def _noise() -> Any:
    @triton.jit
    def graphctl_keyed_noise(KEYS, OUT, V, so, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < V
        mask32 = 0xFFFFFFFF
        h = (tl.load(KEYS + r) + (offs + 1) * 0x9E3779B9) & mask32
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & mask32
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & mask32
        h = h ^ (h >> 16)
        u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
        tl.store(OUT + r * so + offs, -tl.log(u), mask=m)

    return graphctl_keyed_noise


def keyed_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``ops.draws.noise`` from its row keys (int64 [n]): float32 [n, vocab] in one launch."""
    keys = keys.contiguous()
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    if keys.shape[0] and vocab:
        block = min(max(triton.next_power_of_2(vocab), 16), 4096)
        _noise()[(keys.shape[0], triton.cdiv(vocab, block))](keys, out, vocab, out.stride(0), BLOCK=block,
                                                              num_warps=4)
    return out
