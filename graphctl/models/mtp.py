"""The reference one-model MTP engine: a small transformer target with paged attention over
the paged backend, and a draft head with its own KV cache and manager.

One decode step, capturable as one graph with ``@graphed`` and runnable eagerly:

1. target forward over ``k + 1`` tokens a request (the last accepted token and ``k`` drafts);
2. greedy acceptance on the device: the accepted length ``a`` (1 to ``k + 1``) and the bonus
   token, the target's choice after the last accepted token;
3. inside ``state.switch("draft")`` (block table and KV manager swapped to the draft's): one
   draft forward at the ``k + 1`` layout (it writes the draft KV of the step's tokens), then the
   layout goes to 1 token a request through ``state.write("seq_lens", ...)`` and ``k`` draft
   steps each write ``kv_lens`` (positions and slot mappings follow) and propose a token.

With ``oracle=True`` the draft head is the target's own layers (same weights, separate KV
cache), so it reproduces the target exactly: every draft is accepted, acceptance length
``k + 1`` at every batch size. A stale derived map shows up as acceptance falling with batch
size (TensorRT-LLM #16925).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from graphctl.families.paged import KVCacheManager, PagedMetadata, paged_spec
from graphctl.models.sampled import RequestSettings, Sampling, sample_step, sample_tokens
from graphctl.state import BoundState, Registry, StateSpec, bind

__all__ = ["EngineConfig", "MTPEngine", "StepOutput"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    vocab: int = 96
    hidden: int = 64
    layers: int = 2
    block_size: int = 8
    max_seqs: int = 64
    max_context: int = 96  # tokens a sequence may hold: prompt + generated
    draft_len: int = 3
    dtype: torch.dtype = torch.float32
    seed: int = 0


class StepOutput(NamedTuple):  # a NamedTuple: @graphed slices its fields to the batch
    accepted: torch.Tensor  # [n] int64: accepted length a, 1..k+1 (the bonus token counted)
    bonus: torch.Tensor  # [n] int64: the target's token after the last accepted one
    drafts: torch.Tensor  # [n, k] int64: the draft head's proposals for the next step
    draft_probs: torch.Tensor | None = None  # sampled steps: [n * k, vocab] the laws the drafts were drawn from


class _Layer:
    def __init__(self, H: int, g: torch.Generator, dtype, device) -> None:
        r = lambda *s, scale: (torch.randn(*s, generator=g) * scale).to(device, dtype)  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = (r(H, H, scale=H ** -0.5) for _ in range(4))
        self.w1, self.w2 = r(H, 4 * H, scale=H ** -0.5), r(4 * H, H, scale=(4 * H) ** -0.5)


class MTPEngine:
    """The reference engine. ``spec`` overrides the paged spec (regression tests declare a
    broken one); ``oracle`` makes the draft head the target's own layers."""

    def __init__(self, cfg: EngineConfig = EngineConfig(), *, device="cpu", oracle: bool = True,
                 spec: StateSpec | None = None, tp_group: Any = None) -> None:
        self.cfg, self.device, self.k = cfg, torch.device(device), cfg.draft_len
        H, dev = cfg.hidden, self.device
        g = torch.Generator().manual_seed(cfg.seed)
        self.emb = (torch.randn(cfg.vocab, H, generator=g)).to(dev, cfg.dtype)
        self.lm_head = (torch.randn(H, cfg.vocab, generator=g) * 4 * H ** -0.5).to(dev, cfg.dtype)  # wide margins
        self.target_layers = [_Layer(H, g, cfg.dtype, dev) for _ in range(cfg.layers)]
        self.draft_layers = self.target_layers if oracle else [_Layer(H, g, cfg.dtype, dev) for _ in range(cfg.layers)]
        self.tp_group = tp_group
        if tp_group is not None:  # every rank drew the same full weights: keep this rank's shard of the MLP
            self._shard_mlp(tp_group)
        blocks = -(-cfg.max_context // cfg.block_size)
        mk = lambda name, seed: KVCacheManager(name, layers=cfg.layers, seqs=cfg.max_seqs, blocks=blocks,  # noqa: E731
                                               block_size=cfg.block_size, head_dim=H, dtype=cfg.dtype, device=dev,
                                               seed=seed)
        self.meta = PagedMetadata(seqs=cfg.max_seqs, blocks=blocks, draft_len=self.k,
                                  kv_cache_manager=mk("target", cfg.seed + 1),
                                  draft_kv_cache_manager=mk("draft", cfg.seed + 2), device=dev)
        self.registry = Registry()
        self.registry.register(PagedMetadata, spec or paged_spec(block_size=cfg.block_size))
        self.state: BoundState = bind(self.meta, registry=self.registry)
        C = blocks * cfg.block_size
        self._j = torch.arange(C, device=dev)

    def _shard_mlp(self, group: Any) -> None:
        """Tensor parallelism of the MLP: ``w1`` column-parallel, ``w2`` row-parallel, an
        all-reduce after ``w2`` (in ``run_layers``). Attention and the KV caches are replicated."""
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        layers = {id(L): L for L in self.target_layers + self.draft_layers}.values()
        for L in layers:
            c = L.w1.shape[1] // world
            if c * world != L.w1.shape[1]:
                raise ValueError(f"MLP width {L.w1.shape[1]} does not split over {world} ranks")
            L.w1 = L.w1[:, rank * c:(rank + 1) * c].contiguous()
            L.w2 = L.w2[rank * c:(rank + 1) * c].contiguous()

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The model's weights and both KV caches by name: what the audit classifies as
        ``param`` (``runner.audit(params=engine.named_tensors())``)."""
        out = {"emb": self.emb, "lm_head": self.lm_head, "positions_j": self._j}
        for role, layers in (("target", self.target_layers), ("draft", self.draft_layers)):
            for i, L in enumerate(layers):
                out.update({f"{role}.{i}.{w}": t for w, t in vars(L).items() if isinstance(t, torch.Tensor)})
        for mgr in (self.meta.kv_cache_manager, self.meta.draft_kv_cache_manager):
            out.update({f"{mgr.name}.k[{i}]": t for i, t in enumerate(mgr.k)})
            out.update({f"{mgr.name}.v[{i}]": t for i, t in enumerate(mgr.v)})
            out[f"{mgr.name}.block_ids"] = mgr.block_ids
        return out

    # ----------------------------------------------------------------------- the model

    def run_layers(self, tokens: torch.Tensor, layers: Sequence[_Layer], per_request: int = 1) -> torch.Tensor:
        """Logits for ``tokens`` laid out by the metadata's current maps; writes their K/V into
        the cache of the *bound* ``kv_cache_manager`` (the draft's inside a draft switch).
        ``per_request``: tokens a request at most (this engine attends per token and ignores it;
        an engine whose attention batches by request, such as the HF one, needs it)."""
        m, bs = self.meta, self.cfg.block_size
        T, S = tokens.shape[0], m.seq_lens.numel()
        req = m.req_idx_per_token[:T].long().clamp(max=S - 1)
        pos = m.token_positions[:T]
        slots = m.slot_mapping[:T]
        mgr = m.kv_cache_manager
        lanes = mgr.lanes(slots)
        key_slots = (m.block_table.long()[:, self._j // bs] * bs + self._j % bs)[req]  # [T, C]
        masked = self._j[None, :] > pos.clamp(min=0)[:, None]  # a padded request's -1: no row all -inf
        x = self.emb[tokens]
        for i, L in enumerate(layers):
            h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
            q, k, v = h @ L.wq, h @ L.wk, h @ L.wv
            mgr.write(i, slots, k, v, lanes)  # padded lanes (PAD_SLOT) write nothing live
            kc, vc = mgr.k[i].view(-1, k.shape[-1]), mgr.v[i].view(-1, v.shape[-1])
            K, V = kc[key_slots], vc[key_slots]  # [T, C, H]
            scores = torch.einsum("th,tch->tc", q, K) / math.sqrt(q.shape[-1])
            att = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
            x = x + torch.einsum("tc,tch->th", att, V) @ L.wo
            h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
            y = torch.nn.functional.gelu(h @ L.w1) @ L.w2
            if self.tp_group is not None:  # row-parallel w2: partial sums from every rank
                torch.distributed.all_reduce(y, group=self.tp_group)
            x = x + y
        return torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.lm_head

    def prepare_for(self, n: int, k: int | None = None) -> None:
        """The metadata for a step of ``n`` requests of ``k + 1`` tokens each (``k``: the engine's
        draft length by default), their context lengths as they stand: how a runner's verify
        describes a batch of ``n`` to a step of another ``k`` (``graphed(..., prepare=...)``)."""
        k1 = self.draft_len(k) + 1
        self.meta.prepare(self.state, torch.full((n,), k1, dtype=torch.int32), self.meta.kv_lens[:n].clone())

    def draft_len(self, k: int | None) -> int:
        """``k`` checked against the engine's buffers (``None``: the engine's own draft length).
        Any ``1 <= k <= draft_len`` fits them; a graphed step makes ``k`` a variant."""
        if k is None:
            return self.k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.k:
            raise ValueError(f"draft length k={k!r}: this engine's buffers hold 1 <= k <= {self.k} "
                             f"(build it with a larger draft_len for more)")
        return k

    def step(self, input_ids: torch.Tensor, meta: PagedMetadata, k: int | None = None) -> StepOutput:
        """One decode step for ``n = len(input_ids) / (k + 1)`` requests (see the module doc);
        ``k`` drafts a request (default: the engine's ``draft_len``, the most its buffers hold)."""
        k = self.draft_len(k)
        accepted, bonus = self.target_and_accept(input_ids, k)
        with self.state.switch("draft"):
            drafts = self.draft_loop(input_ids, accepted, bonus, self.state.write, k)
        return StepOutput(accepted, bonus, drafts)

    def sample_step(self, input_ids: torch.Tensor, draft_probs: torch.Tensor, meta: PagedMetadata,
                    sampling: Sampling | None = None, k: int | None = None) -> StepOutput:
        """One sampled speculative step (``models/sampled.py``): ``draft_probs`` [n * k, vocab]
        the laws the drafts in ``input_ids`` were drawn from; returns them for the next drafts.
        Each request samples at its settings in ``meta`` (``sampling``: one baked host setting)."""
        return StepOutput(*sample_step(self, input_ids, draft_probs, meta, sampling, k))

    def sample(self, prompts: Sequence[torch.Tensor], steps: int, sampling: Sampling | RequestSettings,
               forward: Any = None, k: int | None = None, seed: Any = None) -> list[torch.Tensor]:
        """Each request's emitted tokens after ``steps`` sampled steps (``models/sampled.py``)."""
        return sample_tokens(self, prompts, steps, sampling, forward, k, seed)

    def target_and_accept(self, input_ids: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward and greedy acceptance: accepted lengths and bonus tokens, on the device."""
        k = self.draft_len(k)
        n = input_ids.shape[0] // (k + 1)
        best = self.run_layers(input_ids, self.target_layers, k + 1).argmax(-1).view(n, k + 1)
        drafts_in = input_ids.view(n, k + 1)[:, 1:]
        accepted = 1 + (drafts_in == best[:, :-1]).long().cumprod(1).sum(1)
        return accepted, best.gather(1, (accepted - 1)[:, None])[:, 0]

    def draft_loop(self, input_ids: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor,
                   write: Callable[[str, torch.Tensor], None], k: int | None = None) -> torch.Tensor:
        """The draft loop, run in the draft role: ``write(name, value)`` changes the layout
        (``state.write`` here; a hand-written switch passes its own)."""
        k = self.draft_len(k)
        base = self.draft_begin(input_ids, accepted, write, k)
        token, proposals = bonus, []
        for i in range(k):
            token = self.draft_step(token, self.draft_kv_lens(base, i), write).argmax(-1)
            proposals.append(token)
        return torch.stack(proposals, 1)

    def draft_begin(self, input_ids: torch.Tensor, accepted: torch.Tensor,
                    write: Callable[[str, torch.Tensor], None], k: int | None = None) -> torch.Tensor:
        """The step's k+1 tokens into the draft KV cache, then the layout of one token a
        request; returns each request's ``kv_lens`` for the first draft step (the bonus token
        sits at context + accepted)."""
        k = self.draft_len(k)
        self.run_layers(input_ids, self.draft_layers, k + 1)
        return self.draft_layout(accepted, write, k)

    def draft_layout(self, accepted: torch.Tensor, write: Callable[[str, torch.Tensor], None],
                     k: int | None = None) -> torch.Tensor:
        """One token a request from here on; returns the first draft step's ``kv_lens``."""
        k, meta = self.draft_len(k), self.meta
        n = accepted.shape[0]
        kv = meta.kv_lens[:n]
        base = torch.where(kv > 0, kv - (k + 1) + accepted + 1, 0)  # a padded request (kv_lens 0) stays empty
        write("seq_lens", torch.ones_like(meta.seq_lens[:n]))
        return base.to(meta.kv_lens.dtype)

    @staticmethod
    def draft_kv_lens(base: torch.Tensor, i: torch.Tensor | int) -> torch.Tensor:
        """``kv_lens`` of draft step ``i``: ``base + i``, and 0 for a padded request (its slot
        mapping stays PAD_SLOT, so its cache writes are skipped)."""
        return torch.where(base > 0, base + i, 0)

    def draft_step(self, token: torch.Tensor, kv_lens: torch.Tensor,
                   write: Callable[[str, torch.Tensor], None]) -> torch.Tensor:
        """One draft step at one token a request: the draft head's logits for ``token``."""
        write("kv_lens", kv_lens.to(self.meta.kv_lens.dtype))
        return self.run_layers(token, self.draft_layers)

    # ------------------------------------------------------------------- host-side loop

    def prefill(self, prompts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Write every prompt's K/V into both caches (one token a request per pass, eagerly) and
        return each request's first generated token (greedy)."""
        return self.prefill_logits(prompts).argmax(-1)

    def prefill_logits(self, prompts: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`prefill`, returning the target's logits [n, vocab] after each prompt's last token."""
        n, m = len(prompts), self.meta
        lens = torch.tensor([len(p) for p in prompts])
        first = torch.zeros(n, self.cfg.vocab, dtype=torch.float32, device=self.device)
        for i in range(int(lens.max())):
            active = (lens > i).nonzero()[:, 0]
            tokens = torch.stack([prompts[r][i] for r in active.tolist()]).to(self.device)
            seq = (lens > i).to(torch.int32)
            kv = torch.minimum(lens, torch.full_like(lens, i + 1)).to(torch.int32)
            m.prepare(self.state, seq, kv)
            logits = self.run_layers(tokens, self.target_layers)
            with self.state.switch("draft"):
                self.run_layers(tokens, self.draft_layers)
            last = (lens[active] == i + 1).to(self.device)
            first[active.to(self.device)[last]] = logits[last].float()
        return first

    def prompts(self, n: int, gen: torch.Generator, lo: int = 3, hi: int = 17) -> list[torch.Tensor]:
        """Random prompts of uneven lengths in ``[lo, hi)``."""
        lens = torch.randint(lo, hi, (n,), generator=gen)
        return [torch.randint(0, self.cfg.vocab, (int(L),), generator=gen) for L in lens]

    def generate(self, prompts: Sequence[torch.Tensor], steps: int, forward=None,
                 k: int | None = None) -> list[torch.Tensor]:
        """Run ``steps`` decode steps after prefill with ``forward`` (``self.step`` by default,
        or a ``@graphed`` wrapper of it); return each step's accepted lengths (host tensors).
        The first step's drafts are placeholders, so its acceptance is not the draft's. ``k``:
        drafts a step (default the engine's ``draft_len``), passed to ``forward`` when given
        (a runner with ``variants={"k": ...}`` serves each value from its own graphs)."""
        forward = forward or self.step
        n, m = len(prompts), self.meta
        extra = () if k is None else (k,)  # a forward of (ids, meta) keeps working without k
        k = self.draft_len(k)
        context = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
        token = self.prefill(prompts)
        drafts = token[:, None].repeat(1, k)
        history = []
        for _ in range(steps):
            if int(context.max()) + 2 * k + 2 > self.cfg.max_context:
                raise ValueError(f"max_context={self.cfg.max_context} too small for {steps} steps")
            ids = torch.cat([token[:, None], drafts], 1).reshape(-1)
            m.prepare(self.state, torch.full((n,), k + 1, dtype=torch.int32), context + k + 1)
            out = forward(ids, m, *extra)
            accepted = out.accepted.to("cpu", copy=True)  # graphed outputs are reused views: copy
            history.append(accepted)
            context = context + accepted.to(torch.int32)
            token, drafts = out.bonus.clone(), out.drafts.clone()
        return history
