"""Sampling on the device, graph-safe: no host sync, shapes fixed by the inputs, randomness a
pure function of each request's seed and position (``ops/draws.py``, issue 53).

- :func:`probs_from_logits`: temperature, top-k and top-p (nucleus) filtering to probabilities,
  in float32; temperature 0 gives the greedy one-hot (argmax), so one code path serves both.
  Settings are host numbers (baked into a captured graph: one graph set per setting, a variant)
  or per-row device tensors (changed between replays without recapture).
- :func:`sample`: one draw per row by the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``
  keyed by the row's seed and the token's position, ``ops/draws.py``): an exact draw from ``p``
  with no random state and no host work; a zero-probability token is never drawn.
- :func:`speculative_accept`: speculative sampling (Leviathan et al., Chen et al.): drafted token
  ``d_i`` accepted with probability ``min(1, p(d_i) / q(d_i))``, the first rejected position
  resampled from ``normalize(max(0, p - q))``, and with every draft accepted a bonus token drawn
  from the target's next distribution. The emitted tokens are distributed as sampling from the
  target alone, whatever the draft (``tests/unit/test_sampling.py`` checks it statistically).
  With one-hot (greedy) ``p`` and ``q`` it is greedy verification exactly.

The PyTorch code here is the reference: it runs on every device and records into CUDA graphs and
the emulated recorder alike. On CUDA, Triton kernels (``ops/sampling_triton.py``, chosen by
``GRAPHCTL_SAMPLING``) take the filtering with host settings, the race and the acceptance: one
launch each, the same tokens from the same keys (the acceptance draws its uniforms and noise here
and hands them to the kernel).
"""
from __future__ import annotations

import math
import numbers

import torch

from graphctl.errors import SamplingError
from graphctl.ops import draws
from graphctl.ops.triton_pick import TritonPick

__all__ = ["TEMPERATURE_FLOOR", "check_settings", "probs_from_logits", "sample", "race", "speculative_accept"]

_Setting = float | int | torch.Tensor


def _column(v: _Setting, rows: int, like: torch.Tensor) -> torch.Tensor:
    """A setting as a [rows, 1] float32 column on ``like``'s device (a host number broadcast)."""
    if isinstance(v, torch.Tensor):
        return v.to(like.device, torch.float32).reshape(-1, 1).expand(rows, 1)
    return torch.full((rows, 1), float(v), device=like.device, dtype=torch.float32)


# Below this temperature a row is greedy: logits / t overflow float32 as t nears its normal range (1e-39 made every
# row NaN and drew token 0); vLLM draws the same line (its sampling epsilon).
TEMPERATURE_FLOOR = 1e-5


def check_settings(temperature: _Setting, top_k: _Setting, top_p: _Setting) -> None:
    """Host settings in range and of the right type (:class:`~graphctl.errors.SamplingError`);
    per-row device tensors are checked by whoever fills them (a check here would sync)."""
    if not isinstance(temperature, torch.Tensor) and (
            isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature) or temperature < 0):
        raise SamplingError("a sampling temperature must be a finite number >= 0", buffer="temperature",
                            expected=f"0 (greedy) or a finite float > 0 (below {TEMPERATURE_FLOOR}: greedy)",
                            found=repr(temperature), fix="pass temperature=0.0 for greedy, or e.g. 0.8")
    if not isinstance(top_k, torch.Tensor) and (
            isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0):
        whole = int(top_k) if isinstance(top_k, float) and math.isfinite(top_k) and top_k >= 0 else 0
        raise SamplingError("top_k must be an int >= 0 (0: off)", buffer="top_k", expected="an int >= 0",
                            found=repr(top_k), fix=f"pass an int: top_k={whole}")
    if not isinstance(top_p, torch.Tensor) and (
            isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise SamplingError("top_p must be in (0, 1] (1: off)", buffer="top_p", expected="0 < top_p <= 1",
                            found=repr(top_p), fix="pass e.g. top_p=0.9, or 1.0 for no nucleus filtering")


def probs_from_logits(logits: torch.Tensor, temperature: _Setting = 1.0, top_k: _Setting = 0,
                      top_p: _Setting = 1.0) -> torch.Tensor:
    """[rows, vocab] logits -> float32 probabilities after temperature, top-k (0: off) and top-p
    (1.0: off). A row at temperature 0 is the one-hot of its argmax (greedy). Top-p keeps the
    smallest set of most likely tokens whose mass reaches ``top_p``, with every token tied with
    the least likely one kept (ties never split by sort order: the same set on every device)."""
    check_settings(temperature, top_k, top_p)
    rows, vocab = logits.shape
    if not isinstance(temperature, torch.Tensor) and temperature < TEMPERATURE_FLOOR:  # greedy: nothing else matters
        return _onehot(logits)
    if not isinstance(temperature, torch.Tensor) and not isinstance(top_p, torch.Tensor) and \
            not isinstance(top_k, torch.Tensor) and (not top_k or top_k >= vocab):
        kernel = PICK.kernel(logits.device)  # CUDA: one Triton program a row (GRAPHCTL_SAMPLING)
        fast = None if kernel is None else PICK.run(kernel, _not_filtered, logits, float(temperature), float(top_p))
        if fast is not None:
            return fast
    settings = (temperature, top_k, top_p)
    if all(isinstance(v, torch.Tensor) and v.numel() == rows for v in settings):
        kernel = ROWS.kernel(logits.device)  # CUDA: one Triton program a row, each at its own settings
        fast = None if kernel is None else ROWS.run(kernel, _not_filtered, logits, *settings, TEMPERATURE_FLOOR)
        if fast is not None:
            return fast
    x = logits.float()
    x = x / _scale(temperature, rows, x)
    xs = None  # the scaled logits sorted descending, where top-k sorted them already
    if isinstance(top_k, torch.Tensor):
        k = _column(top_k, rows, x).long().clamp(min=0, max=vocab)
        k = torch.where(k == 0, torch.full_like(k, vocab), k)  # 0: off
        # one sort serves top-k and top-p: of the raw logits where they are 16-bit (half the bytes; dividing by
        # a row's temperature keeps its order, and the sorted values are divided as x was)
        xs = (logits if logits.element_size() < 4 else x).sort(-1, descending=True).values
        xs = xs.float() / _scale(temperature, rows, x) if logits.element_size() < 4 else xs
        kth = xs.gather(-1, k - 1)  # the k-th largest logit of each row
        x = x.masked_fill(x < kth, float("-inf"))
        xs = xs.masked_fill(xs < kth, float("-inf"))
    elif top_k and top_k < vocab:  # a host k: a selection, no sort of the vocabulary
        xs = x.topk(int(top_k), -1).values  # sorted: the candidates top-p chooses from
        x = x.masked_fill(x < xs[:, -1:], float("-inf"))
    p = torch.softmax(x, -1)
    if isinstance(top_p, torch.Tensor) or top_p < 1.0:
        # The order of p is the order of the logits (temperature and top-k are monotone per row), so
        # the logits are sorted (16-bit ones: half the bytes of p's float32) and p in that order is
        # exp(xs - max) / Z, with 1 / Z = max p: no gather of p by index. Kept: every token whose
        # more likely tokens hold less than top_p (those with running mass below it and the first
        # to reach it), and every token with a logit tied with the last one kept.
        if xs is None and logits.element_size() < 4 and not isinstance(top_k, torch.Tensor):
            xs = logits.sort(-1, descending=True).values.float() / _scale(temperature, rows, x)
        elif xs is None:
            xs = x.sort(-1, descending=True).values
        cum = (torch.exp(xs - xs[:, :1]) * p.amax(-1, keepdim=True)).cumsum(-1)
        tp = _column(top_p, rows, x)
        keep = ((cum < tp).sum(-1, keepdim=True) + 1).clamp(max=xs.shape[-1])
        if isinstance(top_p, torch.Tensor):  # rows at 1 keep everything (a float32 running sum may reach 1 early)
            keep = torch.where(tp >= 1.0, xs.shape[-1], keep)
        p = torch.where(x >= xs.gather(-1, keep - 1), p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if isinstance(temperature, torch.Tensor):
        p = torch.where(_column(temperature, rows, x) < TEMPERATURE_FLOOR, _onehot(logits), p)
    return p


# GRAPHCTL_SAMPLING's choice (ops/triton_pick.py): the kernels of probs_from_logits' host-settings and per-row
# cases, of race and of speculative_accept
PICK = TritonPick("sampling", "graphctl.ops.sampling_triton", "probs")
ROWS = TritonPick("sampling", "graphctl.ops.sampling_triton", "probs_rows")
ACCEPT = TritonPick("sampling", "graphctl.ops.sampling_triton", "accept")
RACE = TritonPick("sampling", "graphctl.ops.sampling_triton", "race")


def _not_filtered(*args: object) -> None:
    """A Triton kernel's stand-in where it cannot build: None, so the PyTorch code runs."""
    return None


def _scale(temperature: _Setting, rows: int, like: torch.Tensor) -> torch.Tensor | float:
    """What the logits are divided by: the temperature, 1 in greedy rows (their one-hot replaces them)."""
    if not isinstance(temperature, torch.Tensor):
        return float(temperature)
    t = _column(temperature, rows, like)
    return torch.where(t < TEMPERATURE_FLOOR, torch.ones_like(t), t)


def _onehot(logits: torch.Tensor) -> torch.Tensor:
    """The float32 one-hot of each row's argmax: greedy as a distribution."""
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
        -1, logits.argmax(-1, keepdim=True), 1.0)


def race(probs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [n, vocab] from the noise ``e`` [>= n, vocab]
    (``ops.draws.noise``): ``argmax(p / e)``, an exact draw from ``p`` (on CUDA one Triton launch:
    ``GRAPHCTL_SAMPLING``)."""
    if e.device != probs.device:
        raise ValueError(f"race: noise on {e.device} for probabilities on {probs.device}: draw it on the same device "
                         f"(ops.draws.noise(seed, position, stream, vocab) with seed on probs' device)")
    if e.dim() != 2 or e.shape[0] < probs.shape[0] or e.shape[-1] != probs.shape[-1]:
        raise ValueError(f"race: noise of shape {tuple(e.shape)} for probabilities of shape {tuple(probs.shape)}: "
                         f"expected [>= {probs.shape[0]}, {probs.shape[-1]}] (ops.draws.noise of one key a row)")
    kernel = RACE.kernel(probs.device)
    fast = None if kernel is None or probs.dim() != 2 else RACE.run(kernel, _not_filtered, probs.float(), e)
    if fast is not None:
        return fast
    return (probs.float() / e[: probs.shape[0]]).argmax(-1)


def sample(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, stream: int = draws.TARGET) -> torch.Tensor:
    """One token per row of ``probs`` [n, vocab] (int64 [n]): row ``i`` raced with the noise of
    ``(seed[i], position[i], stream)`` (``ops.draws``), the position of the token drawn. A row's
    token depends on its law and its key alone: not on the batch, its bucket or the loop mode."""
    return race(probs, draws.noise(seed, position, stream, probs.shape[-1]))


def speculative_accept(target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, seed: torch.Tensor,
                       position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over ``k`` drafted tokens a row.

    ``target`` [n, k + 1, V]: the target's probabilities at each drafted position and after the
    last; ``draft`` [n, k, V]: the draft's probabilities the drafts were drawn from; ``drafts``
    [n, k] int64. Returns ``(accepted [n] int64 in 1..k+1, token [n] int64)``: ``accepted - 1``
    drafts kept, then ``token`` (the resample at the first rejection, or the bonus token).
    ``seed``, ``position`` [n]: each request's seed and the position of its first drafted token.
    Drafted token ``i``'s acceptance draws the uniform of ``(seed, position + i, ACCEPT)``; the
    emitted token races the noise of ``(seed, position, TARGET)`` (``ops.draws``): a step's
    target draws are keyed by the first position it can emit at, which only grows from step to
    step, so no two emitted tokens share noise, and the draws never depend on the batch."""
    n, k1, vocab = target.shape
    k = k1 - 1
    t, q = target.float(), draft.float()
    if k == 0:
        return torch.ones(n, dtype=torch.int64, device=target.device), sample(t[:, 0], seed, position)
    idx = drafts.long().unsqueeze(-1)
    p_d = t[:, :k].gather(-1, idx).squeeze(-1)  # target probability of each drafted token
    q_d = q.gather(-1, idx).squeeze(-1)
    seed, position = seed.reshape(n, 1), position.reshape(n, 1)
    u = draws.uniform(seed, position + torch.arange(k, device=position.device), draws.ACCEPT)
    e = draws.noise(seed, position, draws.TARGET, vocab)
    kernel = ACCEPT.kernel(target.device)  # CUDA: one Triton program a request (GRAPHCTL_SAMPLING)
    fast = None if kernel is None else ACCEPT.run(kernel, _not_filtered, t, q, drafts, u, e)
    if fast is not None:
        return fast
    # accept with probability min(1, p/q): u * q < p (q > 0 where the draft drew the token)
    ok = (u * q_d < p_d).long()
    accepted = 1 + ok.cumprod(1).sum(1)  # drafts kept before the first rejection, plus the emitted token
    # The one position each row draws at: its first rejection (resampled from max(0, p - q)) or k
    # (the bonus, from p). Only that row of the residual is formed; race needs no normalising.
    at = (accepted - 1).view(n, 1, 1).expand(n, 1, vocab)
    p_at = t.gather(1, at).squeeze(1)
    q_at = q.gather(1, at.clamp(max=k - 1)).squeeze(1) * (accepted <= k).unsqueeze(1)
    residual = (p_at - q_at).clamp(min=0)
    # a zero residual (p == q there, so that position never rejects) falls back to p: never drawn from
    law = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return accepted, race(law, e)
