"""Sampling in the reference engine's step (issue 34): temperature / top-k / top-p, speculative
sampling on the device, random state declared per role.

The engine's spec declares two generators (:func:`with_generators`): ``generator`` for the target,
swapped to ``draft_generator`` inside ``state.switch("draft")``, so the draft draws from a stream
of its own and graphctl restores both around every warmup, capture and verify run. A sampled step
(:func:`sample_step`, ``MTPEngine.sample_step``) takes the drafted tokens and the draft's
probabilities they were drawn from, accepts each with probability ``min(1, p/q)``, resamples the
first rejected position from the residual (or draws the bonus token), then drafts ``k`` tokens by
sampling the draft head: the emitted tokens follow the target's distribution
(``graphctl.ops.sampling``). Temperature 0 is greedy through the same code. Every draw takes
noise for all ``max_seqs`` rows, so one seed gives the same tokens eager and graphed at a padded
bucket (row i's noise does not depend on the batch size). ``Sampling`` is a
frozen host value: a graph bakes it (a setting per runner, or a variant per setting).
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Any

import torch

from graphctl.errors import SamplingError
from graphctl.ops.sampling import noise, probs_from_logits, race, sample, speculative_accept
from graphctl.state import StateSpec, Swap

__all__ = ["check_forward", "check_seed", "Sampling", "with_generators", "attach_generators", "sample_step",
           "sample_tokens", "accept_sampled", "draft_noise"]


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings (host values): ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1
    are off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        probs_from_logits(torch.zeros(1, 2), self.temperature, self.top_k, self.top_p)  # ValueError naming a bad one

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, logits: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft step's law and its token raced with the noise ``e``."""
        p = self.probs(logits)
        return p, race(p, e)


def with_generators(spec: StateSpec) -> StateSpec:
    """``spec`` with the engine's random state: ``generator``, swapped for ``draft_generator`` in
    the draft role."""
    spec.object("generator", draft=Swap(twin="draft_generator"))
    spec.object("draft_generator")
    return spec


def attach_generators(meta: Any, device: torch.device, seed: int) -> None:
    """One generator per role on ``meta``, on the engine's device (seeds ``seed`` and ``seed + 1``)."""
    meta.generator = torch.Generator(device=device).manual_seed(seed)
    meta.draft_generator = torch.Generator(device=device).manual_seed(seed + 1)


def accept_sampled(eng: Any, input_ids: torch.Tensor, draft_probs: torch.Tensor, sampling: Sampling,
                   k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's half of a sampled step: its forward over ``input_ids`` (``k + 1`` tokens a
    request) and speculative acceptance of the ``k`` drafts drawn from ``draft_probs``
    [n * k, vocab], from the target's generator; ``(accepted, token)``."""
    k = eng.draft_len(k)
    n, vocab = input_ids.shape[0] // (k + 1), eng.cfg.vocab
    p = sampling.probs(eng.run_layers(input_ids, eng.target_layers, k + 1)).view(n, k + 1, vocab)
    # noise for every row the engine holds: eager at n and a padded graph draw alike
    return speculative_accept(p, draft_probs.view(n, k, vocab), input_ids.view(n, k + 1)[:, 1:],
                              eng.meta.generator, eng.cfg.max_seqs)


def draft_noise(eng: Any, k: int) -> torch.Tensor:
    """The noise of all ``k`` draft steps, ``[k, max_seqs, vocab]``, in one draw from the bound
    ``meta.generator`` (the draft's stream inside ``state.switch("draft")``): step ``i`` races
    with ``[i]``, in every loop mode (a device loop indexes it by its counter)."""
    return noise((k, eng.cfg.max_seqs, eng.cfg.vocab), eng.meta.generator, eng.device)


def sample_step(eng: Any, input_ids: torch.Tensor, draft_probs: torch.Tensor, meta: Any,
                sampling: Sampling, k: int | None = None) -> tuple[torch.Tensor, ...]:
    """One sampled speculative step for ``n = len(input_ids) / (k + 1)`` requests: ``input_ids``
    the last emitted token and ``k`` drafts a request, ``draft_probs`` [n * k, vocab] the draft's
    probabilities they were drawn from (``eng``: an ``MTPEngine``). Returns ``(accepted, token,
    drafts, draft_probs)``: ``token`` the resampled or bonus token, the next drafts and their laws."""
    k = eng.draft_len(k)
    n, vocab = input_ids.shape[0] // (k + 1), eng.cfg.vocab
    accepted, token = accept_sampled(eng, input_ids, draft_probs, sampling, k)
    st = eng.state
    with st.switch("draft"):  # meta.generator is the draft's stream in here
        base = eng.draft_begin(input_ids, accepted, st.write, k)
        e = draft_noise(eng, k)
        tok, drafts, laws = token, [], []
        for i in range(k):
            q, tok = sampling.draw(eng.draft_step(tok, eng.draft_kv_lens(base, i), st.write), e[i])
            drafts.append(tok)
            laws.append(q)
    return accepted, token, torch.stack(drafts, 1), torch.stack(laws, 1).reshape(n * k, vocab)


def sample_tokens(eng: Any, prompts: Any, steps: int, sampling: Sampling, forward: Any = None,
                  k: int | None = None, seed: int | None = None) -> list[torch.Tensor]:
    """``steps`` sampled speculative steps after prefill (its first token sampled too), through
    ``forward`` (``eng.sample_step`` or a ``@graphed`` wrapper of it); each request's emitted
    tokens (host, int64). ``seed`` reseeds both generators first (``seed``, ``seed + 1``)."""
    m = eng.meta
    check_seed(seed)  # before anything changes: a refused call reseeds nothing
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected an int >= 0, found {steps!r}")
    if seed is not None:
        m.generator.manual_seed(seed)
        m.draft_generator.manual_seed(seed + 1)
    forward = forward or eng.sample_step
    extra = () if k is None else (k,)
    k = eng.draft_len(k)
    n, vocab = len(prompts), eng.cfg.vocab
    context = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    token = sample(sampling.probs(eng.prefill_logits(prompts)), m.generator, eng.cfg.max_seqs)
    drafts = token[:, None].repeat(1, k)
    # the placeholder drafts, "drawn" from a one-hot law: accepted with probability p(token)
    laws = torch.nn.functional.one_hot(drafts.reshape(-1), vocab).float()
    out_tokens = [[int(t)] for t in token.tolist()]
    for _ in range(steps):
        if int(context.max()) + 2 * k + 2 > eng.cfg.max_context:
            raise ValueError(f"max_context={eng.cfg.max_context} too small for {steps} steps")
        ids = torch.cat([token[:, None], drafts], 1).reshape(-1)
        m.prepare(eng.state, torch.full((n,), k + 1, dtype=torch.int32), context + k + 1)
        out = forward(ids, laws, m, sampling, *extra)
        acc = out.accepted.to("cpu", copy=True)
        kept = ids.view(n, k + 1)[:, 1:].cpu()
        last = out.bonus.to("cpu", copy=True)
        for r in range(n):
            out_tokens[r] += kept[r, : int(acc[r]) - 1].tolist() + [int(last[r])]
        context = context + acc.to(torch.int32)
        token, drafts, laws = out.bonus.clone(), out.drafts.clone(), out.draft_probs.clone()
    return [torch.tensor(t) for t in out_tokens]


def check_seed(seed: Any) -> None:
    """``seed`` is None or an int a generator takes (:class:`~graphctl.errors.SamplingError`)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= int(seed) < 2**63 - 1):
        raise SamplingError("a seed must be an int >= 0", buffer="seed", expected="None or an int in [0, 2**63 - 1)",
                            found=repr(seed), fix="pass e.g. seed=3")


def check_forward(forward: Any, sampled: bool, k: int, extra: int) -> None:
    """A ``generate`` forward takes the call generation makes: ``(ids, meta)`` greedy, ``(ids,
    draft_probs, meta, sampling)`` sampled (``(token, meta, sampling)`` at k 0), then ``extra``
    (the draft length). Refused before anything ran (a greedy graphed step given a temperature
    failed with ``TypeError: too many positional arguments`` after the prefill had drawn)."""
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
            found=f"{name}{sig}", fix="pass forward=graphed_step(eng, sampling=Sampling(temperature, top_k, "
                                       "top_p)), or forward=None (eager), or temperature=0 for this greedy step")
    raise SamplingError("a greedy generate needs a greedy step", buffer="forward",
                        expected="forward(input_ids, meta[, k]) (step or its graphed form)", found=f"{name}{sig}",
                        fix="pass the temperature the step was captured with, or forward=graphed_step(eng)")
