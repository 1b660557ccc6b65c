"""Sampling in the engines' steps (issues 34, 53): per-request settings on the device, draws keyed by
each request's seed and position, speculative sampling on the device.

Settings are per request and live in the metadata's declared buffers (``temperature``, ``top_k``,
``top_p``, ``seed``: ``families/paged.py``), written once a batch by :meth:`RequestSettings.write`
and read by the step at every replay, so one captured step serves all-greedy, all-sampled and mixed
batches; a row at temperature 0 (or below :data:`~graphctl.ops.sampling.TEMPERATURE_FLOOR`) is
exactly greedy inside any batch, as is every padded row.

Draws are counter-based (``ops/draws.py``): a request's numbers are a hash of its seed and the
position of the token they decide, never of its batch, its bucket, the loop mode or eager versus
graphed. A sampled step (:func:`sample_step`) takes the drafted tokens and the draft's
probabilities they were drawn from, accepts each with probability ``min(1, p/q)``, resamples the
first rejected position from the residual (or draws the bonus token), then drafts ``k`` tokens by
sampling the draft head: the emitted tokens follow the target's distribution per request
(``graphctl.ops.sampling``), whatever the draft.

A step is called ``(input_ids, draft_probs, meta, None[, k])``: the settings are the metadata's. A
:class:`Sampling` in place of ``None`` (the form before issue 53) applies one host setting to every
row, baked into the graph (a frozen argument: one graph set per value); the seeds are still the
metadata's.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from graphctl.errors import SamplingError
from graphctl.ops import draws
from graphctl.ops.sampling import TEMPERATURE_FLOOR, check_settings, probs_from_logits, sample, speculative_accept

__all__ = ["check_forward", "check_seed", "takes_sampled_call", "Sampling", "RequestSettings", "laws",
           "accept_sampled", "draft_draw", "sample_step", "sample_tokens"]

_SEED_LIMIT = 2**63 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """One host setting for every request: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1
    are off. Passed to :meth:`RequestSettings.of` (or to ``generate``'s keywords) it is every
    request's; passed to a step in place of ``None`` it is baked into that step's graphs."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_settings(self.temperature, self.top_k, self.top_p)  # SamplingError naming a bad one

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)


def _per_request(name: str, value: Any, n: int) -> list[Any]:
    """``value`` as ``n`` values: a scalar for every request, or a sequence of exactly ``n``."""
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.dim() else value.item()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return [value] * n
    if len(value) != n:
        raise SamplingError(f"one {name} a prompt", buffer=name, expected=f"a scalar or {n} values (one a prompt)",
                            found=f"{len(value)} values", fix=f"pass {name}=[...] with {n} entries, or one value")
    return list(value)


@dataclasses.dataclass(frozen=True)
class RequestSettings:
    """Each request's sampling settings and seed, checked (:meth:`of`), written to the metadata's
    buffers by :meth:`write`."""

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    seed: tuple[int, ...]

    @classmethod
    def of(cls, n: int, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0, seed: Any = None) -> RequestSettings:
        """Settings for ``n`` requests: each argument a scalar (every request's) or one value a
        request. ``seed``: None draws the seeds at :meth:`write` from torch's default CPU
        generator (``torch.manual_seed`` makes a run repeatable); an int ``s`` gives request ``i``
        the seed ``s + i`` (run alone with ``seed=s + i`` it draws the same); a list gives each its own.
        :class:`~graphctl.errors.SamplingError` naming the request of a bad value; nothing is
        drawn from any generator before every value passed."""
        ts, ks, ps = (_per_request(nm, v, n) for nm, v in (("temperature", temperature), ("top_k", top_k),
                                                            ("top_p", top_p)))
        for i, (t, k, p) in enumerate(zip(ts, ks, ps)):
            try:
                check_settings(t, k, p)
            except SamplingError as exc:
                raise SamplingError(f"request {i}: {exc.what}", buffer=exc.buffer, expected=exc.expected,
                                    found=exc.found, fix=exc.fix) from None
            if t == math.inf and k:
                raise SamplingError(f"request {i}: temperature inf makes every token equally likely, so top_k "
                                    "cannot pick", buffer="temperature", expected="a finite temperature with top_k",
                                    found=f"temperature=inf, top_k={k}", fix="pass a finite temperature")
        if seed is None:
            seeds: list[Any] = []  # drawn at write(), after every other check of the caller
        elif isinstance(seed, numbers.Integral):
            check_seed(seed)
            if int(seed) + n > _SEED_LIMIT:
                raise SamplingError("a seed too large for its batch", buffer="seed", found=repr(seed),
                                    expected=f"seed + {n} requests < 2**63 - 1", fix="pass a smaller seed")
            seeds = [int(seed) + i for i in range(n)]
        else:
            seeds = _per_request("seed", seed, n)
            for i, s in enumerate(seeds):
                if s is None:
                    raise SamplingError(f"request {i}: a seed list holds ints", buffer="seed",
                                        expected="an int >= 0 for each request", found="None",
                                        fix="pass seed=None for drawn seeds, or an int for every request")
                check_seed(s)
        return cls(tuple(float(t) for t in ts), tuple(int(k) for k in ks), tuple(float(p) for p in ps),
                   tuple(int(s) for s in seeds))

    @property
    def sampled(self) -> bool:
        """Whether any request samples (a temperature at or above the floor)."""
        return any(t >= TEMPERATURE_FLOOR for t in self.temperature)

    def write(self, meta: Any, state: Any) -> None:
        """Into ``meta``'s per-request buffers through ``state`` (rows past the batch: greedy). Seeds
        left to draw (``seed=None``) are drawn here from torch's default CPU generator, where any
        request samples (a greedy run leaves that generator alone)."""
        n = len(self.temperature)
        seeds = list(self.seed)
        if not seeds:
            base = int(torch.randint(0, _SEED_LIMIT - n, (1,))) if self.sampled else 0
            seeds = [base + i for i in range(n)]
        meta.set_sampling(state, torch.tensor(self.temperature, dtype=torch.float32),
                          torch.tensor(self.top_k, dtype=torch.int32), torch.tensor(self.top_p, dtype=torch.float32),
                          torch.tensor(seeds, dtype=torch.int64))


def laws(logits: torch.Tensor, meta: Any, n: int, per_request: int = 1, fixed: Sampling | None = None) -> torch.Tensor:
    """The sampling laws (float32 probabilities) of ``logits`` [n * per_request, V]: each request's
    rows at its own settings from ``meta`` (``fixed``: one host setting for all)."""
    if fixed is not None:
        return fixed.probs(logits)
    t, k, p = meta.temperature[:n], meta.top_k[:n], meta.top_p[:n]
    if per_request > 1:
        t, k, p = (x.repeat_interleave(per_request) for x in (t, k, p))
    return probs_from_logits(logits, t, k, p)


def accept_sampled(eng: Any, input_ids: torch.Tensor, draft_probs: torch.Tensor, fixed: Sampling | None = None,
                   k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's half of a sampled step: its forward over ``input_ids`` (``k + 1`` tokens a
    request, laid out by the metadata: ``kv_lens`` ends after them) and speculative acceptance of
    the ``k`` drafts drawn from ``draft_probs`` [n * k, vocab]; ``(accepted, token)``. The draws are
    keyed by each request's seed and its first drafted token's position, ``kv_lens - k``."""
    k = eng.draft_len(k)
    meta, n, vocab = eng.meta, input_ids.shape[0] // (k + 1), eng.cfg.vocab
    p = laws(eng.run_layers(input_ids, eng.target_layers, k + 1), meta, n, k + 1, fixed).view(n, k + 1, vocab)
    return speculative_accept(p, draft_probs.view(n, k, vocab), input_ids.view(n, k + 1)[:, 1:], meta.seed[:n],
                              meta.kv_lens[:n] - k)


def draft_draw(eng: Any, logits: torch.Tensor, kv_lens: torch.Tensor, fixed: Sampling | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft step's law and token for ``n`` requests: ``logits`` [n, V] of the draft head,
    ``kv_lens`` [n] the step's lengths (the drawn token's position), raced with the draft stream's
    noise of each request's key: the same draw in every loop mode."""
    n = logits.shape[0]
    q = laws(logits, eng.meta, n, 1, fixed)
    return q, sample(q, eng.meta.seed[:n], kv_lens, draws.DRAFT)


def sample_step(eng: Any, input_ids: torch.Tensor, draft_probs: torch.Tensor, meta: Any,
                fixed: Sampling | None = None, k: int | None = None) -> tuple[torch.Tensor, ...]:
    """One sampled speculative step for ``n = len(input_ids) / (k + 1)`` requests: ``input_ids``
    the last emitted token and ``k`` drafts a request, ``draft_probs`` [n * k, vocab] the draft's
    probabilities they were drawn from (``eng``: an ``MTPEngine``). Returns ``(accepted, token,
    drafts, draft_probs)``: ``token`` the resampled or bonus token, the next drafts and their laws."""
    k = eng.draft_len(k)
    n, vocab = input_ids.shape[0] // (k + 1), eng.cfg.vocab
    accepted, token = accept_sampled(eng, input_ids, draft_probs, fixed, k)
    st = eng.state
    with st.switch("draft"):
        base = eng.draft_begin(input_ids, accepted, st.write, k)
        tok, drafts, qs = token, [], []
        for i in range(k):
            kv = eng.draft_kv_lens(base, i)
            q, tok = draft_draw(eng, eng.draft_step(tok, kv, st.write), kv, fixed)
            drafts.append(tok)
            qs.append(q)
    return accepted, token, torch.stack(drafts, 1), torch.stack(qs, 1).reshape(n * k, vocab)


def sample_tokens(eng: Any, prompts: Any, steps: int, sampling: Sampling | RequestSettings, forward: Any = None,
                  k: int | None = None, seed: Any = None) -> list[torch.Tensor]:
    """``steps`` sampled speculative steps after prefill (its first token sampled too), through
    ``forward`` (``eng.sample_step`` or a graphed form of it); each request's emitted tokens
    (host, int64). ``sampling``: a :class:`Sampling` for every request, passed to ``forward`` (baked
    where it is graphed), or :class:`RequestSettings` written to the metadata (``forward`` called
    with ``None``: one graph serves any settings). ``seed`` as for :meth:`RequestSettings.of`
    (ignored with ``RequestSettings``, which hold their seeds)."""
    m, n = eng.meta, len(prompts)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected an int >= 0, found {steps!r}")
    if isinstance(sampling, Sampling):
        settings = RequestSettings.of(n, sampling.temperature, sampling.top_k, sampling.top_p, seed)
        fixed: Sampling | None = sampling
    elif isinstance(sampling, RequestSettings):
        settings, fixed = sampling, None
    else:
        raise SamplingError("sampling settings of the wrong type", buffer="sampling",
                            expected="a Sampling or RequestSettings", found=type(sampling).__name__,
                            fix="pass Sampling(temperature, top_k, top_p) or RequestSettings.of(n, ...)")
    if len(settings.temperature) != n:
        raise SamplingError("settings for another batch", buffer="sampling", expected=f"{n} requests",
                            found=f"{len(settings.temperature)}", fix=f"RequestSettings.of({n}, ...)")
    settings.write(m, eng.state)
    forward = forward or eng.sample_step
    extra = () if k is None else (k,)
    k = eng.draft_len(k)
    vocab = eng.cfg.vocab
    context = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    logits = eng.prefill_logits(prompts)  # leaves kv_lens at each prompt's length: the first token's position
    token = sample(laws(logits, m, n, 1, fixed), m.seed[:n], m.kv_lens[:n])
    drafts = token[:, None].repeat(1, k)
    # the placeholder drafts, "drawn" from a one-hot law: accepted with probability p(token)
    qs = torch.nn.functional.one_hot(drafts.reshape(-1), vocab).float()
    out_tokens = [[int(t)] for t in token.tolist()]
    for _ in range(steps):
        if int(context.max()) + 2 * k + 2 > eng.cfg.max_context:
            raise ValueError(f"max_context={eng.cfg.max_context} too small for {steps} steps")
        ids = torch.cat([token[:, None], drafts], 1).reshape(-1)
        m.prepare(eng.state, torch.full((n,), k + 1, dtype=torch.int32), context + k + 1)
        out = forward(ids, qs, m, fixed, *extra)
        acc = out.accepted.to("cpu", copy=True)
        kept = ids.view(n, k + 1)[:, 1:].cpu()
        last = out.bonus.to("cpu", copy=True)
        for r in range(n):
            out_tokens[r] += kept[r, : int(acc[r]) - 1].tolist() + [int(last[r])]
        context = context + acc.to(torch.int32)
        token, drafts, qs = out.bonus.clone(), out.drafts.clone(), out.draft_probs.clone()
    return [torch.tensor(t) for t in out_tokens]


def check_seed(seed: Any) -> None:
    """``seed`` is None or an int in ``[0, 2**63 - 1)`` (:class:`~graphctl.errors.SamplingError`)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= int(seed) < _SEED_LIMIT):
        raise SamplingError("a seed must be an int >= 0", buffer="seed", expected="None or an int in [0, 2**63 - 1)",
                            found=repr(seed), fix="pass e.g. seed=3")


def takes_sampled_call(forward: Any, k: int, extra: int) -> bool:
    """Whether ``forward`` takes ``generate``'s sampled call (``(ids, draft_probs, meta, None[, k])``,
    ``(token, meta, None)`` at k 0): a sampled step then serves an all-greedy batch too, its rows
    exactly greedy, rather than being refused as "not a greedy step"."""
    if forward is None:
        return False
    try:
        inspect.signature(forward).bind(*([None] * ((4 if k else 3) + extra)))
    except (TypeError, ValueError):
        return False
    return True


def check_forward(forward: Any, sampled: bool, k: int, extra: int) -> None:
    """A ``generate`` forward takes the call generation makes: ``(ids, meta)`` greedy, ``(ids,
    draft_probs, meta, None)`` sampled (``(token, meta, None)`` at k 0), then ``extra`` (the
    draft length). Refused before anything ran (a greedy graphed step given a temperature failed
    with ``TypeError: too many positional arguments`` after the prefill had drawn)."""
    if forward is None:
        return
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):  # a builtin without a signature: its own call says
        return
    n = (4 if k else 3) + extra if sampled else 2 + extra
    try:
        sig.bind(*([None] * n))
        return
    except TypeError:
        pass
    name = forward.__name__ if inspect.isroutine(forward) else type(forward).__name__
    if sampled:
        raise SamplingError(
            "a sampled generate needs a sampled step", buffer="forward",
            expected="forward(input_ids, draft_probs, meta, sampling[, k]) (sample_step or its graphed form)",
            found=f"{name}{sig}", fix="pass forward=graphed_step(eng, sampling=True) (one graph for greedy, sampled "
                                       "and mixed batches), or forward=None (eager), or temperature=0 for this "
                                       "greedy step")
    raise SamplingError("a greedy generate needs a greedy step", buffer="forward",
                        expected="forward(input_ids, meta[, k]) (step or its graphed form)", found=f"{name}{sig}",
                        fix="pass forward=graphed_step(eng) for a greedy run, or give a sampled step's run a "
                            "temperature")
