"""Paged attention that reads the KV cache's pages in place: ``torch.ops.graphctl.paged_attention``.

``paged_attention(q, k_cache, v_cache, block_table, req_idx, positions, scale)``:

- ``q`` ``[T, H, D]``: the step's query tokens, packed (any number a request: 1 in decode, k+1 in
  a target verify, a whole prompt in prefill);
- ``k_cache``, ``v_cache`` ``[P, BS, KVH * D]``: one layer's pools, ``P`` pages of ``BS`` slots
  (the ``paged`` family's ``KVCacheManager.k[layer]``), dense; ``H`` a multiple of ``KVH``
  (grouped-query heads: query head ``h`` reads KV head ``h // (H // KVH)``);
- ``block_table`` ``[R, B]`` int: row ``r``'s pages, in key order;
- ``req_idx`` ``[T]`` int: each token's row; a token whose row is outside ``[0, R)`` belongs to no
  request and its output is zeros;
- ``positions`` ``[T]`` int: each token attends its row's keys ``0 .. positions[t]`` (clamped to
  ``[0, B * BS - 1]``), which is causality inside a query block too: the keys of the step's own
  tokens are in the cache already (written before the call), each at its position.

Returns ``[T, H, D]`` in ``q``'s dtype (softmax and accumulation in float32). Registered with
``torch.library``: a fake kernel (``torch.compile`` traces the op, shapes only), the pure-PyTorch
reference :func:`reference` as the CPU kernel and the fallback everywhere, and on CUDA a Triton
kernel (:mod:`graphctl.ops.attention_triton`; ``GRAPHCTL_PAGED_ATTENTION`` picks). Nothing
allocates but the output, nothing reads a device value on the host, and the Triton grid is
``(T, KVH)``: fixed for a fixed ``T``, so the op records into a CUDA graph and replays with the
lengths and tables the step wrote.

The step's K/V writes have a kernel too, :func:`write_kv` (reference :func:`write_reference`),
for the eager path: where nothing must see the ops (:func:`direct`: no ``torch.compile`` trace,
no dispatch mode such as graphctl's write tracker, no CUDA-graph capture), the HF attention
function launches both kernels directly, skipping the dispatcher and a dozen small PyTorch ops a
layer; everywhere else the ops run as ever (the tracker journals the writes by rows, a capture
records kernels its warmups built).
"""
from __future__ import annotations

import torch

from graphctl.knobs import knobs
from graphctl.ops.triton_pick import TritonPick

__all__ = ["paged_attention", "reference", "kernel_for", "direct", "unwatched", "write_kv",
           "write_reference", "attend"]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           req_idx: torch.Tensor, positions: torch.Tensor) -> tuple[int, int, int]:
    """``(KVH, BS, C)`` of a well-formed call; ``ValueError`` naming what is not."""
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [T, H, D], got shape {tuple(q.shape)}; pack the step's "
                         f"tokens first (q.view(tokens, heads, head_dim))")
    T, H, D = q.shape
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[-1] % D:
        raise ValueError(f"paged_attention: k_cache and v_cache must be one [P, BS, KVH * {D}] shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}; pass one layer's pools "
                         f"(KVCacheManager.k[layer], .v[layer]) with q's head dim {D}")
    kvh = k_cache.shape[-1] // D
    if H % kvh:
        raise ValueError(f"paged_attention: {H} query heads are not a multiple of {kvh} KV heads; the caches' "
                         f"last dim must be KV heads x head dim of the model's config")
    if block_table.dim() != 2 or req_idx.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"paged_attention: block_table must be [R, B], req_idx and positions [{T}]; got "
                         f"{tuple(block_table.shape)}, {tuple(req_idx.shape)}, {tuple(positions.shape)}; pass "
                         f"one row and one position per packed query token")
    for name, t in (("block_table", block_table), ("req_idx", req_idx), ("positions", positions)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"paged_attention: {name} must be an integer tensor, got {t.dtype}; pass it "
                             f"as torch.int32 (or int64)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: the caches must be contiguous (pages read in place); pass the "
                         "pools themselves, not a slice or transpose (or .contiguous() them once, outside "
                         "the step)")
    bs = k_cache.shape[1]
    return kvh, bs, block_table.shape[1] * bs


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              req_idx: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The op in plain PyTorch (the module docstring's semantics): every token's row of pages
    gathered into ``[T, C, KVH, D]`` and attended under the mask ``key <= position``."""
    kvh, bs, C = _check(q, k_cache, v_cache, block_table, req_idx, positions)
    T, H, D = q.shape
    R = block_table.shape[0]
    r = req_idx.long()
    live = (r >= 0) & (r < R)
    rc = r.clamp(0, max(R - 1, 0))
    j = torch.arange(C, device=q.device)
    slots = block_table.long()[rc][:, j // bs] * bs + j % bs  # [T, C]
    k = k_cache.reshape(-1, kvh, D)[slots].float()  # [T, C, KVH, D]
    v = v_cache.reshape(-1, kvh, D)[slots].float()
    g = H // kvh
    qf = q.float().view(T, kvh, g, D)
    scores = torch.einsum("tkgd,tckd->tkgc", qf, k) * scale
    last = positions.long().clamp(0, C - 1)
    mask = (j[None, :] <= last[:, None]) & live[:, None]  # [T, C]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a dead token's row is all -inf: zeros
    out = torch.einsum("tkgc,tckd->tkgd", p, v).reshape(T, H, D)
    return out.to(q.dtype)


@torch.library.custom_op("graphctl::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    req_idx: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """See the module docstring. Runs :func:`reference` on every device but CUDA."""
    return reference(q, k_cache, v_cache, block_table, req_idx, positions, scale)


@paged_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
      req_idx: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    _check(q, k_cache, v_cache, block_table, req_idx, positions)
    return q.new_empty(q.shape)


@paged_attention.register_kernel("cuda")
def cuda_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                req_idx: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The op on CUDA: the kernel ``kernel_for`` picks; under ``auto``, a Triton that fails to build
    it on its first launch leaves the reference for good (said once in the log)."""
    return attend(q, k_cache, v_cache, block_table, req_idx, positions, scale)


# GRAPHCTL_PAGED_ATTENTION's choice (ops/triton_pick.py), for both kernels
PICK = TritonPick("paged_attention", "graphctl.ops.attention_triton", "paged_attention")
WRITE = TritonPick("paged_attention", "graphctl.ops.attention_triton", "write_kv")


def kernel_for(q: torch.Tensor):  # noqa: ANN201 - one of two callables of the op's signature
    """The implementation ``GRAPHCTL_PAGED_ATTENTION`` picks for ``q``'s device: ``auto`` and
    ``triton`` use the Triton kernel where Triton imports (``triton`` raises where it does not),
    ``reference`` the pure-PyTorch one."""
    return PICK.kernel(q.device) or reference


# --------------------------------------------------------------------------- the eager path


def write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """Token ``t``'s ``k[t]``, ``v[t]`` (``[T, KVH, D]``) into slot ``slots[t]`` of the ``[P, BS,
    KVH * D]`` caches, in the caches' dtype; a slot outside ``[0, P * BS)`` (``PAD_SLOT``) writes
    nothing. No two live tokens may share a slot. Reads which lanes are live on the host (a
    reference: never in a capture)."""
    W = k_cache.shape[-1]
    s = slots.long()
    live = (s >= 0) & (s < k_cache.shape[0] * k_cache.shape[1])
    at = s[live]
    k_cache.view(-1, W)[at] = k.reshape(-1, W)[live].to(k_cache.dtype)
    v_cache.view(-1, W)[at] = v.reshape(-1, W)[live].to(v_cache.dtype)


def direct(t: torch.Tensor) -> bool:
    """Whether :func:`write_kv` and :func:`attend` may launch their Triton kernels on ``t``'s
    device directly: a plain CUDA tensor, ``GRAPHCTL_EAGER_KERNELS`` on, Triton picked, and
    nothing that must see the ops: no ``torch.compile`` trace (dynamo traces the op), no dispatch
    mode (graphctl's write tracker journals writes by rows, the emulated recorder records ops), no
    CUDA-graph capture (a kernel variant built there would load a module, which a capture refuses;
    captures record the ops, whose kernels the warmups built)."""
    return (type(t) is torch.Tensor and t.device.type == "cuda" and knobs.eager_kernels and unwatched()
            and not torch.cuda.is_current_stream_capturing()
            and PICK.kernel(t.device) is not None and WRITE.kernel(t.device) is not None)


def unwatched() -> bool:
    """No ``torch.compile`` trace and no dispatch mode on this thread (:func:`direct`'s device-free half)."""
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0  # no public spelling


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """:func:`write_reference`'s write in one Triton launch, for callers that checked :func:`direct`
    (once a forward: it holds for all its layers); under ``auto``, a Triton that cannot build the
    kernel leaves the reference for good."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape \
            or k.dim() != 3 or k.shape != v.shape or k.shape[1] * k.shape[2] != k_cache.shape[-1] \
            or slots.shape != (k.shape[0],):
        raise ValueError(f"write_kv: k and v must be one [T, KVH, D] shape with KVH * D = the contiguous caches' "
                         f"last dim, slots [T]; got k {tuple(k.shape)}, v {tuple(v.shape)}, caches "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}, slots {tuple(slots.shape)}; view "
                         f"k and v as [tokens, kv_heads, head_dim] with one slot a token, into one layer's "
                         f"pools")
    kernel = WRITE.kernel(k.device)
    if kernel is None:
        write_reference(k_cache, v_cache, slots, k, v)
    else:
        WRITE.run(kernel, write_reference, k_cache, v_cache, slots, k, v)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           req_idx: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The op's CUDA path (what :func:`cuda_kernel` runs behind the dispatcher), callable without
    it by callers that checked :func:`direct`."""
    _check(q, k_cache, v_cache, block_table, req_idx, positions)
    kernel = kernel_for(q)
    if kernel is reference:
        return reference(q, k_cache, v_cache, block_table, req_idx, positions, scale)
    return PICK.run(kernel, reference, q, k_cache, v_cache, block_table, req_idx, positions, scale)
