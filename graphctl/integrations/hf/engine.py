"""Unchanged Hugging Face causal LMs on graphctl's paged backend: plain and speculative decode.

:class:`HFEngine` is the reference MTP engine's step (``graphctl.models.mtp``: target forward
over ``k + 1`` tokens a request, greedy acceptance on the device, ``state.switch("draft")``, the
layout written from ``k + 1`` tokens a request to 1, ``k`` draft steps) with its two models
replaced by transformers models: a target and a draft, each with its own paged KV cache and
manager, attending through :mod:`graphctl.integrations.hf.attention`. The metadata is the
``paged`` family's, declared, bound, padded and audited as for the reference engine, so
``graphed_step(engine, mode=...)`` captures it in every loop mode.

:func:`oracle_draft` builds the draft that makes acceptance an exact check: the target with the
output projections of its layers past the first ``layers`` zeroed (they still run and read
their weights, adding exactly zero), and a draft made of the target's embedding, first layers,
final norm and head; both then produce the same logits, so every draft token is accepted.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphctl.families.paged import KVCacheManager, PagedMetadata, paged_spec
from graphctl.graphs.capture.compiled import is_compiled
from graphctl.integrations.hf.attention import ATTENTION, PagedBatch, register
from graphctl.integrations.hf.compiling import check_mode, compile_models
from graphctl.models.mtp import EngineConfig, MTPEngine
from graphctl.models.sampled import RequestSettings, Sampling, check_forward, laws, takes_sampled_call
from graphctl.ops.sampling import sample
from graphctl.state import Registry, StateSpec, bind

__all__ = ["HFEngine", "GenerateResult", "oracle_draft", "uses_paged_attention"]


def uses_paged_attention(model: Any) -> bool:
    return model.config._attn_implementation == ATTENTION


def oracle_draft(target: Any, layers: int = 2) -> Any:
    """Zero the output projections (``o_proj``, ``down_proj``) of ``target``'s layers from
    ``layers`` on, in place, and return a ``layers``-layer draft sharing its embedding, first
    layers, final norm and LM head: target and draft logits are then equal."""
    decoder = target.model.layers
    if layers >= len(decoder):
        raise ValueError(f"an oracle draft of {layers} layers needs a target with more (it has {len(decoder)})")
    with torch.no_grad():
        for layer in list(decoder)[layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None) is not None:  # configs that list a type per layer
        cfg.layer_types = cfg.layer_types[:layers]
    draft = type(target)(cfg)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(list(decoder)[:layers])
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    return draft.to(target.device).eval()


@dataclasses.dataclass
class GenerateResult:
    tokens: list[torch.Tensor]  # per request: the generated tokens (EOS included when hit)
    # per step: accepted length of each request (1..k+1), on the host; a speculative run's first step verifies
    # placeholder drafts (no draft has run before it), so accepted[0] says nothing about the draft
    accepted: list[torch.Tensor]
    steps: int
    prefill_s: float = 0.0  # wall seconds of the prefill, device work included (synchronized)
    decode_s: float = 0.0  # wall seconds of the decode/speculative steps, device work included
    placeholder_steps: int = 0  # leading steps of accepted whose drafts were placeholders (1 when speculative)

    @property
    def mean_accepted(self) -> float:
        """Mean accepted length a request a step, over the steps whose drafts a draft proposed."""
        real = self.accepted[self.placeholder_steps:]
        return float(torch.stack(real).float().mean()) if real else 0.0


class HFEngine(MTPEngine):
    """A target and a draft transformers model on two paged KV caches and one bound metadata.

    Both models must be built with ``attn_implementation="graphctl_paged"`` (:func:`register`
    first; :meth:`build` does both). ``draft_len`` 0 is plain decode (:meth:`decode_step`).
    ``compile=True`` compiles both models' forwards with Inductor (no Inductor CUDA graphs): graphed,
    the captured graphs hold the fused kernels; a string names another ``torch.compile`` backend
    (``"aot_eager"``: quick on a CPU); ``compile_mode`` ``"static"`` (a graph per bucket) or
    ``"dynamic"`` (one for every bucket of 2 or more: ``integrations/hf/compiling.py``). ``prefill_tokens``: the
    most tokens one prefill forward carries (every prompt in one ragged pass below it; chunked
    above it), which also sizes the metadata's token buffers (never fewer than a step's
    ``max_seqs * (draft_len + 1)``). ``max_seqs`` is the largest batch, in requests (the CLI's
    ``--max-batch``, which ``--max-seqs`` also names)."""

    target_layers: Any  # the transformers models (the reference engine's are lists of its own layers)
    draft_layers: Any

    def __init__(self, target: Any, draft: Any, *, draft_len: int = 3, block_size: int = 16, max_seqs: int = 8,
                 max_context: int = 256, spec: StateSpec | None = None, compile: bool | str = False,
                 compile_mode: str = "static", prefill_tokens: int = 2048) -> None:
        check_mode(compile_mode)
        if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) or prefill_tokens < 1:
            raise ValueError(f"prefill_tokens: expected a positive int (tokens a prefill pass), found "
                             f"{prefill_tokens!r}")
        for role, m in (("target", target), ("draft", draft)):
            if not uses_paged_attention(m):
                raise ValueError(f"the {role} model runs attention {m.config._attn_implementation!r}; build it with "
                                 f"attn_implementation={ATTENTION!r} (HFEngine.build does)")
            if getattr(m.config, "use_sliding_window", False):
                raise ValueError(f"the {role} model uses sliding-window attention, which graphctl_paged does not "
                                 "implement; set use_sliding_window=False")
        tcfg = target.config
        dtype, dev = target.dtype, target.device
        self.cfg = EngineConfig(vocab=tcfg.vocab_size, hidden=tcfg.hidden_size, layers=tcfg.num_hidden_layers,
                                block_size=block_size, max_seqs=max_seqs, max_context=max_context,
                                draft_len=draft_len, dtype=dtype)
        self.device, self.k, self.tp_group = dev, draft_len, None
        self.target_layers, self.draft_layers = target.eval(), draft.eval()
        if compile:
            compile_models(target, draft, backend="inductor" if compile is True else compile, mode=compile_mode)
        blocks = -(-max_context // block_size)

        def manager(name: str, model: Any, seed: int) -> KVCacheManager:
            c = model.config
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            return KVCacheManager(name, layers=c.num_hidden_layers, seqs=max_seqs, blocks=blocks,
                                  block_size=block_size, head_dim=c.num_key_value_heads * head_dim, dtype=dtype,
                                  device=dev, seed=seed)

        self.meta = PagedMetadata(seqs=max_seqs, blocks=blocks, draft_len=max(draft_len, 0),
                                  kv_cache_manager=manager("target", target, 1),
                                  draft_kv_cache_manager=manager("draft", draft, 2), device=dev,
                                  max_tokens=min(prefill_tokens, max_seqs * max_context))
        self.registry = Registry()
        self.registry.register(PagedMetadata, spec or paged_spec(block_size=block_size))
        self.state = bind(self.meta, registry=self.registry)

    @classmethod
    def build(cls, config: Any, *, draft_layers: int = 2, device: Any = "cpu", dtype: torch.dtype = torch.float32,
              seed: int = 0, **kw: Any) -> HFEngine:
        """A target of ``config`` with random weights and its :func:`oracle_draft`."""
        from transformers import AutoModelForCausalLM

        register()
        torch.manual_seed(seed)
        with torch.device(device):  # weights made where they run: a 1B model's init on the host takes seconds
            target = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION, dtype=dtype)
        target = target.eval()
        return cls(target, oracle_draft(target, draft_layers), **kw)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Both models' weights and both KV caches by name (the audit's ``params``)."""
        out = {f"target.{n}": p for n, p in self.target_layers.named_parameters()}
        out.update({f"target.{n}": b for n, b in self.target_layers.named_buffers()})
        out.update({f"draft.{n}": p for n, p in self.draft_layers.named_parameters()})
        out.update({f"draft.{n}": b for n, b in self.draft_layers.named_buffers()})
        for mgr in (self.meta.kv_cache_manager, self.meta.draft_kv_cache_manager):
            out.update({f"{mgr.name}.k[{i}]": t for i, t in enumerate(mgr.k)})
            out.update({f"{mgr.name}.v[{i}]": t for i, t in enumerate(mgr.v)})
            out[f"{mgr.name}.block_ids"] = mgr.block_ids
        return out

    # ----------------------------------------------------------------------- the models

    def run_layers(self, tokens: torch.Tensor, model: Any, per_request: int = 1, rows: int = 0,
                   keep: torch.Tensor | None = None, eager_attention: bool = False) -> torch.Tensor:
        """Logits [T, vocab] of ``model`` for ``tokens`` laid out by the metadata now, at most
        ``per_request`` tokens a request in ``rows`` request rows (0: ``T / per_request``, a
        step's uniform layout); writes their K/V into the bound manager's cache. ``keep``: the
        token indices to compute logits for (transformers' ``logits_to_keep``; [len(keep), vocab]).
        ``eager_attention``: attention as ``@graphctl.eager`` regions (piecewise graphs)."""
        T, q = tokens.shape[0], per_request
        batch = PagedBatch.build(self.meta, T, q, rows or -(-T // q), eager=eager_attention,
                                 lanes=not is_compiled(vars(model).get("forward")))
        pos = self.meta.token_positions[:T].clamp(min=0)
        with torch.no_grad():
            out = model(input_ids=tokens[None], position_ids=pos[None], use_cache=False, graphctl_batch=batch,
                        logits_to_keep=0 if keep is None else keep)
        return out.logits[0]

    def prefill_step(self, tokens: torch.Tensor, meta: PagedMetadata, eager_attention: bool = False) -> torch.Tensor:
        """One prefill pass as laid out by ``meta.prepare`` (``seq_lens``: tokens a request in the
        pass; ``kv_lens``: its length after it): both models over the packed ``tokens``, their K/V
        into both caches; returns the target's logits after each request row's last token of the
        pass ([max_seqs, vocab]; rows past the batch, or with no token in the pass, hold garbage).
        Logits are computed for those rows only. Graphable at token buckets
        (:meth:`graphed_prefill`): shapes follow the token count, lengths are read on the device."""
        S, T = self.cfg.max_seqs, tokens.shape[0]
        ends = (meta.cu_seq_lens[1:S + 1] - 1).clamp(min=0, max=T - 1)
        logits = self.run_layers(tokens, self.target_layers, T, rows=S, keep=ends, eager_attention=eager_attention)
        with self.state.switch("draft"):
            self.run_layers(tokens, self.draft_layers, T, rows=S, keep=ends[:1], eager_attention=eager_attention)
        return logits

    def graphed_prefill(self, buckets: Sequence[int] | None = None, *, backend: str = "auto",
                        piecewise: bool = False) -> Any:
        """:meth:`prefill_step` graphed at token buckets (default powers of two from 16 up to the
        metadata's ``max_tokens``, and it), for ``prefill(prompts, forward=...)`` and
        ``generate(..., prefill=...)``. ``piecewise``: every layer's attention is an eager region
        between captured pieces (``graphs/capture/pieces.py``; a compiled model is compiled as the pieces
        between its attention calls, each captured as a graph); by default attention is in the
        graph (the paged attention op reads lengths from the device buffers)."""
        from graphctl.graphs import StaticInput, graphed

        top = self.meta.max_tokens
        if buckets is None:
            buckets, b = [], 16
            while b < top:
                buckets.append(b)
                b *= 2
            buckets.append(top)
        fn = self._prefill_pieces if piecewise else self.prefill_step
        # batch items are tokens; request rows (the "seq" axis) are the caller's prepare, never padded here
        return graphed(fn, buckets=list(buckets), state=self.state, backend=backend, progress=False,
                       inputs=[StaticInput("tokens")], pad_axes={"token": 1}, params=self.named_tensors())

    def _prefill_pieces(self, tokens: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        return self.prefill_step(tokens, meta, eager_attention=True)

    def decode_step(self, input_ids: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Plain decode: the target's greedy next token for one token a request."""
        return self.run_layers(input_ids, self.target_layers).argmax(-1)

    # ------------------------------------------------------------------- host-side loop

    def check_prompts(self, prompts: Sequence[torch.Tensor]) -> None:
        """TypeError/ValueError naming the prompt that cannot run: 1-D integer token ids in
        ``[0, vocab)``, at least one, at most ``max_seqs`` prompts."""
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or not prompts:
            raise TypeError(f"prompts: expected a non-empty list of 1-D token-id tensors, found "
                            f"{type(prompts).__name__}; pass [ids_0, ids_1, ...] (ragged lengths are fine)")
        if len(prompts) > self.cfg.max_seqs:
            raise ValueError(f"{len(prompts)} prompts but the engine holds max_seqs={self.cfg.max_seqs}; build it "
                             f"with max_seqs>={len(prompts)} or split the batch")
        for i, p in enumerate(prompts):
            if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype.is_floating_point or p.dtype == torch.bool:
                raise TypeError(f"prompt {i}: expected a 1-D integer tensor of token ids, found "
                                f"{type(p).__name__}{tuple(p.shape) if isinstance(p, torch.Tensor) else ''}"
                                f"{' ' + str(p.dtype) if isinstance(p, torch.Tensor) else ''}")
            if p.numel() == 0:
                raise ValueError(f"prompt {i} is empty: every request needs at least one token")
        # every prompt's bounds in one host read a device: a read per prompt waits for the GPU 2n times
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(prompts):
            by_device.setdefault(p.device, []).append(i)
        for rows in by_device.values():
            bounds = torch.stack([torch.stack(torch.aminmax(prompts[i])) for i in rows]).tolist()
            for i, (lo, hi) in zip(rows, bounds):
                if lo < 0 or hi >= self.cfg.vocab:
                    raise ValueError(f"prompt {i}: token ids must be in [0, {self.cfg.vocab}), found [{lo}, {hi}]")

    def sample_decode_step(self, input_ids: torch.Tensor, meta: PagedMetadata,
                           sampling: Sampling | None = None) -> torch.Tensor:
        """Plain decode, sampled: the target's next token for one token a request, each request at
        its settings in ``meta`` (``sampling``: one baked host setting), its draw keyed by its seed
        and the token's position (``kv_lens``): the same token eager, graphed, alone or batched."""
        n = input_ids.shape[0]
        q = laws(self.run_layers(input_ids, self.target_layers), meta, n, 1, sampling)
        return sample(q, meta.seed[:n], meta.kv_lens[:n])

    def prefill(self, prompts: Sequence[torch.Tensor], forward: Any = None,
                sampling: Sampling | bool | None = None) -> torch.Tensor:
        """Every prompt's K/V into both caches and each request's first new token: one ragged
        forward of all prompts (tokens packed by request, each attending its own request's keys
        up to its position), chunked into passes of at most ``prefill_tokens`` (the metadata's
        token buffers) only above that: a pass takes each request's next tokens in order until
        the budget is spent. ``forward``: :meth:`prefill_step` or its graphed form
        (:meth:`graphed_prefill`). ``sampling``: the first token drawn (greedy by default): True at
        each request's settings in the metadata, a :class:`Sampling` at one host setting."""
        self.check_prompts(prompts)
        n, m = len(prompts), self.meta
        lens = [len(p) for p in prompts]
        done = [0] * n
        first = torch.zeros(n, dtype=torch.int64, device=self.device)
        while any(d < ln for d, ln in zip(done, lens)):
            left, take = m.max_tokens, []
            for d, ln in zip(done, lens):
                take.append(min(ln - d, left))
                left -= take[-1]
            tokens = torch.cat([p[d:d + t] for p, d, t in zip(prompts, done, take) if t]).to(self.device)
            done = [d + t for d, t in zip(done, take)]
            m.prepare(self.state, torch.tensor(take, dtype=torch.int32), torch.tensor(done, dtype=torch.int32))
            logits = (forward or self.prefill_step)(tokens, m)
            if sampling is None or sampling is False:
                best = logits.argmax(-1)
            else:  # keyed by the position after the pass: a finished prompt's length, its first token's place
                S = logits.shape[0]
                best = sample(laws(logits, m, S, 1, sampling if isinstance(sampling, Sampling) else None),
                              m.seed[:S], m.kv_lens[:S])
            finished = [r for r in range(n) if take[r] and done[r] == lens[r]]
            if len(finished) == n:  # one pass held every prompt's end: no index to copy to the device
                first.copy_(best[:n])
            elif finished:  # the requests whose last prompt token was in this pass
                idx = torch.tensor(finished, device=self.device)
                first[idx] = best[idx]
        return first

    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,  # type: ignore[override]
                 forward: Any = None, *, eos_token_id: int | None = None, progress: bool = False,
                 k: int | None = None, prefill: Any = None, temperature: Any = 0.0, top_k: Any = 0,
                 top_p: Any = 1.0, seed: Any = None) -> GenerateResult:
        """Generation: prefill, then decode (``draft_len`` 0) or speculative steps through
        ``forward`` (``self.step``/``self.decode_step`` by default, or their ``@graphed``
        wrappers), until every request has ``max_new_tokens`` tokens or its EOS. ``k``: drafts a
        step, ``1 <= k <= draft_len`` (default ``draft_len``), passed to ``forward`` when given
        (a runner with ``variants={"k": ...}`` serves each value from its own graphs). ``prefill``:
        the prefill pass (:meth:`prefill_step` by default, or :meth:`graphed_prefill`'s runner).
        ``temperature``, ``top_k``, ``top_p``, ``seed``: one value for all prompts or one a prompt.
        Temperature 0 is greedy; above it a request's tokens are sampled on the device, speculative
        steps keeping the target's distribution (``models/sampled.py``). A sampled ``forward`` is
        ``sample_step`` / ``sample_decode_step`` or their graphed forms (``graphed_step(eng,
        sampling=True)``: one graph for greedy, sampled and mixed batches). ``seed``: an int ``s``
        gives prompt ``i`` the seed ``s + i``; None draws seeds from torch's default generator. A
        request's draws depend on its seed and positions only (docs/transformers.md, "Sampling")."""
        # every argument checked before anything changes: a refused call writes and draws nothing
        self.check_prompts(prompts)
        settings = RequestSettings.of(len(prompts), temperature, top_k, top_p, seed)  # checked even when greedy
        extra = () if k is None else (k,)  # a forward of (ids, meta) keeps working without k
        sampled = settings.sampled or takes_sampled_call(forward, self.draft_len(k), len(extra))
        sampling = True if sampled else None
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, found {max_new_tokens!r}")
        n, k, m = len(prompts), self.draft_len(k), self.meta
        context = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
        need = int(context.max()) + max_new_tokens + 3 * k + 3  # the step past the last one runs too
        if need > self.cfg.max_context:
            raise ValueError(f"max_context={self.cfg.max_context} too small: prompts up to {int(context.max())} "
                             f"tokens + {max_new_tokens} new + {3 * k + 3} of speculation need {need}")
        check_forward(forward, sampling is not None, k, len(extra))
        if sampling:
            settings.write(m, self.state)
        t0 = self._clock()
        token = self.prefill(prompts, prefill, sampling)
        t1 = self._clock()
        out_tokens: list[list[int]] = [[int(t)] for t in token.tolist()]
        done = [eos_token_id is not None and t[0] == eos_token_id for t in out_tokens]
        history: list[torch.Tensor] = []
        bar = _progress(progress, max_new_tokens)
        # The bookkeeping stays on the device: lengths advance by the accepted counts there, and each
        # step's results (accepted, drafts, bonus) go to pinned host memory with one asynchronous copy,
        # read one step later, while the next step runs. The step after the last one needed runs too
        # and is dropped (max_context holds its tokens).
        context = context.to(self.device)
        seq = torch.full((n,), k + 1, dtype=torch.int32, device=self.device)
        drafts = token[:, None].repeat(1, k)
        # sampled: the laws the drafts were drawn from; the placeholders' is one-hot (kept with probability p)
        qs = torch.nn.functional.one_hot(drafts.reshape(-1), self.cfg.vocab).float() if sampling and k else None
        pending: tuple[torch.Tensor, Any] | None = None
        while True:
            m.prepare(self.state, seq, context + k + 1)
            if k == 0 and sampling is not None:
                token = (forward or self.sample_decode_step)(token, m, None).clone()
                accepted = torch.ones_like(token)
                packed = torch.stack([accepted, token], 1)
            elif k == 0:
                token = (forward or self.decode_step)(token, m).clone()
                accepted = torch.ones_like(token)
                packed = torch.stack([accepted, token], 1)
            else:
                ids = torch.cat([token[:, None], drafts], 1).reshape(-1)
                if sampling is None:
                    out = (forward or self.step)(ids, m, *extra)
                else:
                    assert qs is not None  # made above for every sampled speculative run
                    out = (forward or self.sample_step)(ids, qs, m, None, *extra)
                    assert out.draft_probs is not None  # a sampled step returns the laws of its drafts
                    qs = out.draft_probs.clone()
                token, drafts, accepted = out.bonus.clone(), out.drafts.clone(), out.accepted
                packed = torch.cat([accepted[:, None].to(ids.dtype), ids.view(n, k + 1)[:, 1:], token[:, None]], 1)
            context = context + accepted.to(torch.int32)
            host = _to_host(packed)
            if pending is not None:
                _emit(*pending, k, out_tokens, done, history, max_new_tokens, eos_token_id)
                if bar is not None:
                    bar(min(len(t) for t in out_tokens))
            pending = host
            if all(d or len(t) >= max_new_tokens for d, t in zip(done, out_tokens)):
                break
        t2 = self._clock()
        return GenerateResult([torch.tensor(t) for t in out_tokens], history, len(history), t1 - t0, t2 - t1,
                              placeholder_steps=1 if k else 0)

    def _clock(self) -> float:
        """Wall time once the device has finished what was queued (per-step latency for users)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _to_host(packed: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``packed`` copied to (pinned) host memory without waiting, and the event that says it landed."""
    if packed.device.type != "cuda":
        return packed.cpu(), None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _emit(host: torch.Tensor, event: Any, k: int, out_tokens: list[list[int]], done: list[bool],
          history: list[torch.Tensor], max_new: int, eos: int | None) -> None:
    """One step's results into each request's tokens: its accepted drafts and the bonus token
    (plain decode: the token), up to ``max_new`` and through its EOS; done requests take none."""
    if event is not None:
        event.synchronize()  # recorded a step ago: usually long done
    accepted = host[:, 0].clone()
    history.append(accepted)
    # row r emits tokens[r, :accepted[r]]: the accepted drafts, then the bonus moved next to them
    a = accepted.long()
    tokens = host[:, 1:]  # plain decode: [token]; speculative: [k drafts, bonus]
    if k:
        tokens = tokens.clone()
        tokens.scatter_(1, (a - 1)[:, None], host[:, -1:])
    for r, (row, n_new) in enumerate(zip(tokens.tolist(), a.tolist())):
        for t in row[:n_new]:
            if done[r] or len(out_tokens[r]) >= max_new:
                break
            out_tokens[r].append(t)
            done[r] = eos is not None and t == eos


def _progress(on: bool, total: int) -> Callable[[int], None] | None:
    """A rich progress bar updated to ``done`` tokens (the slowest request); None when off."""
    if not on:
        return None
    from rich.progress import Progress

    p = Progress(transient=True)
    task = p.add_task("generating", total=total)
    p.start()

    def update(done: int) -> None:
        p.update(task, completed=done)
        if done >= total:
            p.stop()

    return update
