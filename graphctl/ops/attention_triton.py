"""The Triton kernel of ``graphctl::paged_attention`` (semantics: ``graphctl/ops/attention.py``).

One program per (query token, KV head): it reads the token's row and position from device memory,
walks that row's pages through ``block_table`` ``BLOCK_N`` keys at a time (pages read in place: no
gathered copy), and keeps an online softmax (running max, running sum, float32 accumulator) for the
``H // KVH`` query heads that share the KV head, so each key and value is loaded once for the group.
Loads are in the cache's dtype. By default (``Launch.lowp``) products stay in a 16-bit cache's
dtype where the query shares it, with float32 accumulation and the softmax weights rounded to it for
the second product, as FlashAttention does: the loads feed the tensor cores with no conversion
between (0.62-0.94x the float32-operand kernel's time at the engine's shapes on an H100,
bench/RESULTS.md). Otherwise products are in float32 (TF32 tensor cores for 16-bit caches, whose
values TF32 holds exactly; IEEE for float32 queries). A token of no request, or past its row's
keys, loads nothing and writes zeros. The grid ``(T, KVH)`` depends on shapes only: one launch
records into a CUDA graph.

Split-K: where ``T x KVH`` programs would leave SMs idle (small batches, long contexts), each
(token, KV head) pair's keys are split over more programs (:func:`splits_for`, from shapes only,
so a graph's launch is fixed), each writing its unnormalised sum with its running max and sum,
combined afterwards by a second kernel with the weights ``exp(m_s - max m)``.

:func:`write_kv` is the eager path's K/V write (``graphctl.ops.attention.direct``): one program a
token copies its keys and values from the layer's strided ``[T, KVH, D]`` views into its slot (a
padded lane, or a slot past the pool, writes nothing), strides unspecialised so one build serves
every token count.

Importing this module imports Triton (``graphctl.ops.attention`` imports it lazily, and falls back
to the reference where Triton is missing). ``TRITON_INTERPRET=1`` (Triton's own variable, read when
the kernel is first built) runs it on CPU tensors through Triton's interpreter: the CPU tests
compare it with the reference that way.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention", "write_kv", "Launch", "splits_for"]


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, built on first use (so ``TRITON_INTERPRET`` set by then applies)."""

    @triton.jit
    def graphctl_paged_attention(Q, K, V, BT, REQ, POS, OUT, M, L, scale, rows, n_pages, chunk,
                                 sq_t, sq_h, sbt_r, so_t, so_h, so_s,
                                 KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                                 IEEE: tl.constexpr, SPLIT: tl.constexpr, LOWP: tl.constexpr):
        t = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        r = tl.load(REQ + t).to(tl.int64)
        live = (r >= 0) & (r < rows)
        last = tl.minimum(tl.maximum(tl.load(POS + t).to(tl.int64), 0), n_pages * BS - 1)
        n_keys = tl.where(live, last + 1, 0)
        lo = sp * chunk  # this program's keys: [lo, hi) of the row's first n_keys
        hi = tl.minimum(lo + chunk, n_keys)
        r = tl.where(live, r, 0)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < G
        mask_d = offs_d < D
        heads = kh * G + offs_g
        q = tl.load(Q + t * sq_t + heads[:, None] * sq_h + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        if not LOWP:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        row_stride = KVH * D  # one slot of one layer's pool: every KV head's D values
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            page = tl.load(BT + r * sbt_r + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
            slot = page * BS + offs_n % BS
            kv_off = slot[:, None] * row_stride + kh * D + offs_d[None, :]
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if not LOWP:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            if LOWP:  # the weights rounded to the cache's 16-bit dtype, as FlashAttention does
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            elif IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        out_off = t * so_t + heads[:, None] * so_h + sp * so_s + offs_d[None, :]
        if SPLIT:  # partial results: the unnormalised sum, its running max and sum (combined by the caller)
            tl.store(OUT + out_off, acc, mask=mask_g[:, None] & mask_d[None, :])
            ml_off = (t * KVH * G + heads) * tl.num_programs(2) + sp
            tl.store(M + ml_off, m_i, mask=mask_g)
            tl.store(L + ml_off, l_i, mask=mask_g)
        else:
            out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            tl.store(OUT + out_off, out.to(OUT.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])

    @triton.jit
    def graphctl_paged_attention_combine(PART, M, L, OUT, S, D: tl.constexpr, BLOCK_S: tl.constexpr,
                                         BLOCK_D: tl.constexpr):
        # one program per (token, head): its S partial sums weighted by exp(m_s - max m), over the weighted sums
        th = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < S
        m = tl.load(M + th * S + offs_s, mask=mask_s, other=float("-inf"))
        lse = tl.load(L + th * S + offs_s, mask=mask_s, other=0.0)
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: every weight is 0
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        total = tl.sum(w * lse, 0)
        part = tl.load(PART + (th * S + offs_s[:, None]) * D + offs_d[None, :],
                       mask=mask_s[:, None] & (offs_d[None, :] < D), other=0.0)
        acc = tl.sum(w[:, None] * part, 0)
        out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
        tl.store(OUT + th * D + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < D)

    return graphctl_paged_attention, graphctl_paged_attention_combine


@functools.cache
def _write_kernel() -> Any:
    """The K/V write's jitted kernel (see :func:`write_kv`), built on first use."""

    # strides and counts unspecialised: one build serves every token count (a prompt's and a step's)
    @triton.jit(do_not_specialize=["sk_t", "sk_h", "sv_t", "sv_h", "n_slots"])
    def graphctl_kv_write(K, V, KC, VC, SLOTS, sk_t, sk_h, sv_t, sv_h, n_slots, KVH: tl.constexpr,
                          D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(SLOTS + t).to(tl.int64)
        ok = (slot >= 0) & (slot < n_slots)  # a padded lane (or a slot past the pool) writes nothing
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < D) & ok
        dst = tl.where(ok, slot, 0) * (KVH * D) + offs_h[:, None] * D + offs_d[None, :]
        k = tl.load(K + t * sk_t + offs_h[:, None] * sk_h + offs_d[None, :], mask=mask)
        tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)
        v = tl.load(V + t * sv_t + offs_h[:, None] * sv_h + offs_d[None, :], mask=mask)
        tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)

    return graphctl_kv_write


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """One launch writing token ``t``'s ``k[t]`` / ``v[t]`` (``[T, KVH, D]``, any strides but the
    last) into slot ``slots[t]`` of the ``[P, BS, KVH * D]`` caches (``graphctl.ops.attention.
    write_reference``'s semantics): one program a token; no reshaped copy of the keys, no
    gather of the spare slot, no separate lanes."""
    T, kvh, D = k.shape
    if T == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kernel()[(T,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          k_cache.shape[0] * k_cache.shape[1], KVH=kvh, D=D,
                          BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(D))


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the kernel is launched (shapes only: fixed for a graph). ``waves``: split-K aims at
    ``waves`` programs an SM (:func:`splits_for`); ``block_n``: keys a loop iteration (0: 128 for
    head dims up to 64, 64 up to 128, 32 above: a loop iteration's keys and values stay near 32
    KiB of shared memory a stage); ``num_warps`` / ``num_stages``: Triton's. ``lowp``: 16-bit
    products where query and cache share a 16-bit dtype (the module docstring); False: float32
    operands. The defaults are the fastest launch at the engine's shapes on an H100 (bench/RESULTS.md,
    issue 32); the H200's ``bench/paged_attention.py --sweep`` also put 128 keys and 2 stages first."""

    waves: int = 2
    block_n: int = 0
    num_warps: int = 4
    num_stages: int = 2
    lowp: bool = True


DEFAULT = Launch()
# dtypes whose products Launch.lowp keeps in the dtype, by device: Triton's interpreter (CPU tensors, TRITON_INTERPRET)
# multiplies bfloat16 wrongly (numpy has no bfloat16), so there bfloat16 products take float32 operands
_LOWP = {"cuda": (torch.float16, torch.bfloat16), "cpu": (torch.float16,)}

# keys a split program covers at least: below this the partial results cost more than they save
_MIN_KEYS_A_SPLIT = 256


def splits_for(T: int, kvh: int, keys: int, sms: int, waves: int = DEFAULT.waves) -> int:
    """Programs a (token, KV head) pair's keys are split over: enough to give every SM ``waves``
    programs, none covering fewer than ``_MIN_KEYS_A_SPLIT`` keys. Shapes only: fixed for a graph."""
    want = -(-waves * sms // max(T * kvh, 1))
    return max(1, min(want, keys // _MIN_KEYS_A_SPLIT))


@functools.cache
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA: the interpreter), asked once."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    req_idx: torch.Tensor, positions: torch.Tensor, scale: float,
                    splits: int | None = None, launch: Launch = DEFAULT) -> torch.Tensor:
    """Launch the kernel (arguments as ``graphctl.ops.attention.paged_attention``'s, checked there);
    ``splits``: programs a token's keys are split over (default :func:`splits_for` this device)."""
    T, H, D = q.shape
    kvh, bs = k_cache.shape[-1] // D, k_cache.shape[1]
    g = H // kvh
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    keys = bt.shape[1] * bs
    if splits is None:
        splits = splits_for(T, kvh, keys, _sms(q.device), launch.waves)
    # tl.dot needs every dimension >= 16; fewer keys a block as the head dim grows (Launch's docstring)
    block_g, block_d = max(16, triton.next_power_of_2(g)), max(16, triton.next_power_of_2(D))
    block_n = launch.block_n or (128 if block_d <= 64 else 64 if block_d <= 128 else 32)
    chunk = -(-keys // splits)
    chunk = -(-chunk // block_n) * block_n  # whole key blocks a split
    splits = -(-keys // chunk)
    meta = dict(KVH=kvh, G=g, D=D, BS=bs, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
                IEEE=q.dtype == torch.float32, SPLIT=splits > 1, num_warps=launch.num_warps,
                LOWP=launch.lowp and q.dtype == k_cache.dtype == v_cache.dtype
                and q.dtype in _LOWP.get(q.device.type, ()),
                num_stages=launch.num_stages)
    attend, combine = _kernel()
    if splits == 1:
        attend[(T, kvh, 1)](q, k_cache, v_cache, bt, req_idx, positions, out, out, out, float(scale), bt.shape[0],
                            bt.shape[1], chunk, q.stride(0), q.stride(1), bt.stride(0), out.stride(0),
                            out.stride(1), 0, **meta)
        return out
    part = torch.empty((T, H, splits, D), dtype=torch.float32, device=q.device)
    m = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    attend[(T, kvh, splits)](q, k_cache, v_cache, bt, req_idx, positions, part, m, lse, float(scale),
                             bt.shape[0], bt.shape[1], chunk, q.stride(0), q.stride(1), bt.stride(0),
                             part.stride(0), part.stride(1), part.stride(2), **meta)
    # the splits combined in one more launch (eight PyTorch ops before: launches a graph replays too)
    combine[(T * H,)](part, m, lse, out, splits, D=D, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out
