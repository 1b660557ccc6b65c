"""Three ways to capture the engine's draft loop (``graphed_step(engine, mode=...)``):

- ``unrolled`` (the default): target forward, acceptance and all k draft steps recorded into
  one graph per bucket, the draft switch and every recompute in-graph. What TensorRT-LLM and
  SGLang do; the draft length is fixed at capture.
- ``per_step``: one graph for the target forward and acceptance, one for the draft head's
  prefill of the step's tokens, one for a single draft step; the draft step is replayed k times
  inside a host-side ``state.switch("draft")``, with the layout written between steps
  (``state.write("kv_lens", ...)``: the derived maps are recomputed eagerly each time, and the
  switch restores everything, on any exception too). What vLLM does.
- ``device_loop``: one graph whose draft steps run as the body of a CUDA conditional WHILE node
  (:class:`~graphctl.graphs.capture.conditional.DeviceLoop`). A device-side predicate
  (``graphctl.ops.loop_condition_``) stops the loop once every request's last draft token had a
  probability below ``threshold``, or after k steps; a per-request mask keeps finished requests
  from writing (their tokens, proposals and ``kv_lens`` stay as they were). Proposals past a
  request's stop are 0; ``DynamicDraft.counter`` holds the steps taken. CUDA only.

With ``threshold=0`` every mode proposes the same tokens (``tests/engine``, ``tests/cuda``).
"""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import CaptureError, DeclarationError, SamplingError
from graphctl.graphs import GraphRunner, StaticInput, graphed, select_backend
from graphctl.graphs.capture.conditional import DeviceLoop
from graphctl.models.mtp import MTPEngine, StepOutput
from graphctl.models.sampled import Sampling, accept_sampled, draft_draw

__all__ = [
    "MODES",
    "graphed_step",
    "dynamic_of",
    "DynamicDraft",
    "PerStepLoop",
    "draft_confidences",
    "expected_dynamic",
]

MODES = ("unrolled", "per_step", "device_loop")


class DynamicDraft:
    """The device loop's state, allocated once at ``max_seqs`` rows (every bucket uses a prefix,
    so addresses stay put): step counter, per-request active mask, current token, proposals,
    first-step ``kv_lens``, and the confidence threshold as a device scalar (changed without
    recapture through :meth:`set_threshold`)."""

    def __init__(self, eng: MTPEngine, threshold: float = 0.0, sampled: bool = False) -> None:
        S, k, dev = eng.cfg.max_seqs, eng.k, eng.device
        self.eng = eng
        self.counter = torch.zeros(1, dtype=torch.int64, device=dev)
        self.active = torch.zeros(S, dtype=torch.bool, device=dev)
        self.token = torch.zeros(S, dtype=torch.int64, device=dev)
        self.proposals = torch.zeros(S, k, dtype=torch.int64, device=dev)
        self.base = torch.zeros(S, dtype=eng.meta.kv_lens.dtype, device=dev)
        self.threshold = torch.full((1,), float(threshold), device=dev)
        # sampled: each step's law (past a request's stop the one-hot of token 0, the proposal there)
        self.laws = torch.zeros(S if sampled else 0, k, eng.cfg.vocab, device=dev)
        self.loop = DeviceLoop(dev)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The loop's own buffers by name (for the audit's ``params``)."""
        return {"loop.counter": self.counter, "loop.active": self.active, "loop.token": self.token,
                "loop.proposals": self.proposals, "loop.base": self.base, "loop.threshold": self.threshold,
                "loop.laws": self.laws, "loop.flag": self.loop.flag}

    def set_threshold(self, value: float) -> None:
        self.threshold.fill_(float(value))

    def step(self, input_ids: torch.Tensor, meta: Any) -> StepOutput:
        """One decode step whose draft loop the device ends (a forward for ``@graphed``)."""
        accepted, bonus = self.eng.target_and_accept(input_ids)
        return StepOutput(accepted, bonus, self._draft(input_ids, accepted, bonus, meta, False, None))

    def sample_step(self, input_ids: torch.Tensor, draft_probs: torch.Tensor, meta: Any,
                    sampling: Sampling | None = None) -> StepOutput:
        """The sampled step (``models/sampled.py``) with the device ending its draft loop. The
        body's draws are keyed by each request's position (``kv_lens``, which the counter moves):
        a WHILE body replays the same kernels each iteration, and keyed draws differ as they must."""
        if self.laws.shape[0] == 0:
            raise DeclarationError("this device loop was built greedy", expected="DynamicDraft(..., sampled=True)",
                                   found="sampled=False", fix="graphed_step(eng, 'device_loop', sampling=True)")
        accepted, token = accept_sampled(self.eng, input_ids, draft_probs, sampling)
        n = accepted.shape[0]
        drafts = self._draft(input_ids, accepted, token, meta, True, sampling)
        return StepOutput(accepted, token, drafts, self.laws[:n].reshape(n * self.eng.k, -1).clone())

    def _draft(self, input_ids: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, meta: Any,
               sampled: bool, fixed: Sampling | None) -> torch.Tensor:
        eng, st = self.eng, self.eng.state
        n = accepted.shape[0]
        active, token, base, props = self.active[:n], self.token[:n], self.base[:n], self.proposals[:n]
        with st.switch("draft"):
            base.copy_(eng.draft_begin(input_ids, accepted, st.write))
            token.copy_(bonus)
            props.zero_()
            torch.gt(base, 0, out=active)  # padded requests (base 0) are done at once: they never extend the loop
            self.counter.zero_()
            if sampled:
                laws = self.laws[:n]
                laws.zero_()
                laws[:, :, 0] = 1.0

            def body() -> None:
                # finished requests keep their kv_lens
                kv = torch.where(active, eng.draft_kv_lens(base, self.counter), meta.kv_lens[:n])
                logits = eng.draft_step(token, kv, st.write)
                if not sampled:
                    new = logits.argmax(-1)
                else:
                    q, new = draft_draw(eng, logits, kv, fixed)
                    now = laws.index_select(1, self.counter)  # [n, 1, V]: one-hot 0 until written
                    laws.index_copy_(1, self.counter, torch.where(active[:, None, None], q[:, None], now))
                conf = torch.softmax(logits.float(), -1).amax(-1)
                token.copy_(torch.where(active, new, token))
                props.index_copy_(1, self.counter, torch.where(active, new, 0)[:, None])
                active.logical_and_(conf >= self.threshold)
                self.counter.add_(1)

            def predicate(flag: torch.Tensor, handle: int) -> None:
                ops.loop_condition_(flag, self.counter, eng.k, active, handle)

            self.loop.run(body, predicate, eng.k)
            return props.clone()


def draft_confidences(eng: MTPEngine, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The device loop's reference: the draft loop run eagerly at full length; each step's
    draft token and its probability, ``[n, k]`` each, on the CPU."""
    accepted, bonus = eng.target_and_accept(ids)
    st = eng.state
    with st.switch("draft"):
        base = eng.draft_begin(ids, accepted, st.write)
        token, ds, cs = bonus, [], []
        for i in range(eng.k):
            logits = eng.draft_step(token, eng.draft_kv_lens(base, i), st.write)
            token = logits.argmax(-1)
            ds.append(token)
            cs.append(torch.softmax(logits.float(), -1).amax(-1))
    return torch.stack(ds, 1).cpu(), torch.stack(cs, 1).cpu()


def expected_dynamic(drafts: torch.Tensor, conf: torch.Tensor, threshold: float) -> tuple[int, torch.Tensor]:
    """What a device loop with ``threshold`` must do: the steps it takes (it stops once no
    request is active, at most k) and its proposals (0 past each request's last active step)."""
    k = drafts.shape[1]
    lead = (conf >= threshold).long().cumprod(1).sum(1)  # leading steps above the threshold
    steps = int(min(k, 1 + int(lead.max())))
    valid = torch.clamp(1 + lead, max=steps)
    return steps, torch.where(torch.arange(k)[None, :] < valid[:, None], drafts, torch.zeros_like(drafts))


class PerStepLoop:
    """``per_step`` mode: call it like ``engine.step`` (see the module docstring), or, sampled,
    like ``engine.sample_step`` (``(input_ids, draft_probs, meta, sampling)``: the target's half
    samples its acceptance, each replay of the step graph samples one token, its draw keyed by
    the ``kv_lens`` written before it). ``sampling``: True reads each request's settings from the
    metadata (``sampling`` is then None at every call); a :class:`Sampling` bakes one setting (the
    calls pass that value). Graphs are captured at the first call, from its inputs, like ``@graphed``."""

    def __init__(self, eng: MTPEngine, buckets: Sequence[int], backend: str = "auto",
                 sampling: Sampling | bool | None = None) -> None:
        self.eng, k, k1 = eng, eng.k, eng.k + 1
        self.sampled = sampling is not None and sampling is not False
        self.fixed = sampling if isinstance(sampling, Sampling) else None
        # what inspect.signature reports: the call _args accepts (generate checks a forward against it)
        pos = inspect.Parameter.POSITIONAL_OR_KEYWORD
        self.__signature__ = inspect.Signature([inspect.Parameter(n, pos) for n in
                                                ("input_ids",) + (("draft_probs", "meta", "sampling") if self.sampled
                                                                  else ("meta",))])
        ins = [StaticInput("input_ids", per_item=k1)]
        if self.sampled:
            ins.append(StaticInput("draft_probs", per_item=k))
        self.head = GraphRunner(self._target_sampled if self.sampled else self._target, buckets=buckets,
                                state=eng.state, backend=backend, inputs=ins, progress=False)
        self.backend_name = backend
        S, V, dev = eng.cfg.max_seqs, eng.cfg.vocab, eng.device
        self.token = torch.zeros(S, dtype=torch.int64, device=dev)
        self.proposals = torch.zeros(S, k, dtype=torch.int64, device=dev)
        if self.sampled:  # the draft's law at the step replayed, every step's law
            self.law = torch.zeros(S, V, dtype=torch.float32, device=dev)
            self.laws = torch.zeros(S, k, V, dtype=torch.float32, device=dev)
        self._graphs: dict[int, tuple[Any, Any]] = {}  # bucket -> (prefill graph, step graph)
        self._be: Any = None

    def _target(self, input_ids: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.eng.target_and_accept(input_ids)  # meta: frozen, so a call with another object is refused

    def _target_sampled(self, input_ids: torch.Tensor, draft_probs: torch.Tensor, meta: Any,
                        sampling: Sampling | None) -> tuple[torch.Tensor, torch.Tensor]:
        return accept_sampled(self.eng, input_ids, draft_probs, sampling)  # sampling: frozen (by value)

    def _draft_graphs(self, b: int) -> tuple[Any, Any]:
        """Capture the draft prefill and one draft step for bucket ``b``, in the draft role (the
        caller holds the switch): they record the draft KV cache and the swapped tables (and,
        sampled, each request's draw keyed by the ``kv_lens`` written before the replay)."""
        eng, be = self.eng, self._be
        ids = self.head.static_input("input_ids")[: b * (eng.k + 1)]
        token = self.token[:b]

        def prefill(_mark=None) -> None:
            eng.run_layers(ids, eng.draft_layers, eng.k + 1)

        def step(_mark=None) -> None:
            logits = eng.run_layers(token, eng.draft_layers)
            if not self.sampled:
                token.copy_(logits.argmax(-1))
                return
            q, new = draft_draw(eng, logits, eng.meta.kv_lens[:b], self.fixed)
            self.law[:b].copy_(q)
            token.copy_(new)

        be.warmup(prefill)
        p, _ = be.capture(prefill, self._pool, b)
        self._layout(b)
        be.warmup(step)
        s, _ = be.capture(step, self._pool, b)
        return p, s

    def _layout(self, b: int) -> torch.Tensor:
        """Eagerly, in the draft role: one token a request; the first step's ``kv_lens``."""
        accepted = self.head.outputs(b)[0]  # the bucket's static acceptance (padding rows included)
        return self.eng.draft_layout(accepted, self.eng.state.write)

    def _args(self, args: tuple) -> tuple:
        want = ("draft_probs", "meta", "sampling") if self.sampled else ("meta",)
        if len(args) != len(want):
            raise TypeError(f"a per_step loop{' with sampling' if self.sampled else ''} is called "
                            f"(input_ids, {', '.join(want)}); found {1 + len(args)} arguments")
        if self.sampled and args[2] != self.fixed:  # its draft graphs read the settings it was built for
            raise SamplingError("a per_step loop's draft graphs read the settings it was built for", buffer="sampling",
                                expected=repr(self.fixed), found=repr(args[2]),
                                fix="pass None to a loop of per-request settings (graphed_step(eng, 'per_step', "
                                    "sampling=True)) and write the settings to the metadata")
        return args

    def capture_all(self, input_ids: torch.Tensor, *args: Any) -> PerStepLoop:
        eng, st = self.eng, self.eng.state
        args = self._args(args)
        self.head.capture_all(input_ids, *args)
        self._be = select_backend(self.backend_name, eng.device)
        self._pool = self._be.new_pool()
        n = input_ids.shape[0] // (eng.k + 1)
        for b in sorted(self.head.captured, reverse=True):
            m = min(n, b)
            rows = [a[: m * eng.k] if i == 0 and self.sampled else a for i, a in enumerate(args)]
            self.head(input_ids[: m * (eng.k + 1)], *rows)  # loads the bucket's inputs, pads the state
            with st.switch("draft"):
                self._graphs[b] = self._draft_graphs(b)
        return self

    def __call__(self, input_ids: torch.Tensor, *args: Any) -> StepOutput:
        eng, st, k = self.eng, self.eng.state, self.eng.k
        args = self._args(args)
        if not self._graphs:
            self.capture_all(input_ids, *args)
        accepted, bonus = self.head(input_ids, *args)
        n = accepted.shape[0]
        b = self.head.buckets.pick(n)
        if b not in self._graphs:
            raise CaptureError(
                "per_step has no draft graphs for this batch",
                expected=f"a bucket of {sorted(self._graphs)}",
                found=f"n={n}",
                fix="capture with a larger bucket",
            )
        prefill, step = self._graphs[b]
        _, bonus_b = self.head.outputs(b)
        with st.switch("draft"):
            prefill.replay()
            base = self._layout(b)
            self.token[:b].copy_(bonus_b)
            for i in range(k):
                # the refresh between steps: derived maps follow, eagerly
                st.write("kv_lens", eng.draft_kv_lens(base, i))
                step.replay()
                self.proposals[:b, i].copy_(self.token[:b])
                if self.sampled:
                    self.laws[:b, i].copy_(self.law[:b])
        if not self.sampled:
            return StepOutput(accepted, bonus, self.proposals[:n])
        return StepOutput(accepted, bonus, self.proposals[:n], self.laws[:n].reshape(n * k, eng.cfg.vocab))


def graphed_step(eng: MTPEngine, mode: str = "unrolled", *, buckets: Sequence[int] = (1, 2, 4, 8),
                 backend: str = "auto", threshold: float = 0.0, draft_lens: Sequence[int] | None = None,
                 sampling: bool | Sampling | None = None) -> Any:
    """A callable like ``eng.step`` (``(input_ids, meta) -> StepOutput``) graphed in ``mode``;
    ``threshold`` is the device loop's confidence threshold (``device_loop`` only; the returned
    runner's ``dynamic`` is its :class:`DynamicDraft`, whose ``set_threshold`` changes it without
    recapture). The engine's weights and caches (and the loop's buffers) are the audit's params.
    ``draft_lens`` (``unrolled`` only): one runner serving every listed draft length ``k`` (each
    at most the engine's ``draft_len``) from its own graphs in one pool, called
    ``(input_ids, meta, k)`` (a :class:`~graphctl.graphs.variants.VariantRunner`).

    ``sampling=True`` (every mode): the sampled step, called like ``eng.sample_step(input_ids,
    draft_probs, meta, None[, k])``, each request at its own settings and seed from the metadata
    (``RequestSettings.write``; ``generate(temperature=..., seed=...)`` writes them): one graph set
    serves greedy, sampled and mixed batches, and a request draws the same tokens in every mode,
    bucket and batch. A :class:`~graphctl.models.sampled.Sampling` instead (deprecated, the form
    before issue 53) bakes one setting; the calls then pass that value in place of None."""
    if mode not in MODES:
        raise DeclarationError("unknown draft-loop mode", expected=" / ".join(MODES), found=mode,
                               fix="unrolled (one graph), per_step (one graph per step) or device_loop (WHILE node)")
    if sampling is not None and sampling is not True and sampling is not False and not isinstance(sampling, Sampling):
        raise DeclarationError("sampling of the wrong type", buffer="sampling",
                               expected="True (per-request settings) or None", found=repr(sampling),
                               fix="graphed_step(eng, sampling=True), then generate(..., temperature=0.8)")
    if isinstance(sampling, Sampling):
        warnings.warn("graphed_step(sampling=Sampling(...)) bakes one setting into the graphs; settings are per "
                      "request now: graphed_step(eng, sampling=True) and generate(..., temperature=..., top_p=...) "
                      "(one graph for greedy, sampled and mixed batches)", DeprecationWarning, stacklevel=2)
    sampled = sampling is not None and sampling is not False
    if draft_lens is not None:
        if mode != "unrolled":
            raise DeclarationError("draft_lens needs mode='unrolled'", expected="unrolled", found=mode,
                                   fix="capture one runner per draft length in this mode")
        for k in draft_lens:
            try:
                eng.draft_len(k)
            except ValueError as exc:
                raise DeclarationError("a draft length the engine cannot hold", buffer="k",
                                       expected=f"1 <= k <= {eng.k}", found=repr(k), fix=str(exc)) from None
        # a graph set per k: rows per request follow k
        ins = [StaticInput("input_ids", per_item_of=lambda k: k + 1)]
        ins += [StaticInput("draft_probs", per_item_of=lambda k: k)] if sampled else []
    else:
        ins = [StaticInput("input_ids", per_item=eng.k + 1)]
        ins += [StaticInput("draft_probs", per_item=eng.k)] if sampled else []
    variants = None if draft_lens is None else {"k": tuple(draft_lens)}
    if mode == "unrolled":  # with variants, verify lays the metadata out for each k (MTPEngine.prepare_for)
        return graphed(eng.sample_step if sampled else eng.step, buckets=list(buckets), state=eng.state,
                       backend=backend, inputs=ins, progress=False, params=eng.named_tensors(), variants=variants,
                       prepare=None if variants is None else eng.prepare_for)
    if mode == "per_step":
        return PerStepLoop(eng, buckets, backend, sampling if sampled else None)
    if eng.device.type != "cuda" or backend == "emulated":
        raise CaptureError("device_loop needs CUDA", expected="a CUDA engine and backend 'cuda' or 'auto'",
                           found=f"engine on {eng.device}, backend {backend!r}",
                           fix="run on a GPU, or use mode='unrolled' or 'per_step' (both run on the emulated backend)")
    dyn = DynamicDraft(eng, threshold, sampled=sampled)
    return graphed(dyn.sample_step if sampled else dyn.step, buckets=list(buckets), state=eng.state,
                   backend=backend, inputs=ins, progress=False, params={**eng.named_tensors(), **dyn.named_tensors()})


def dynamic_of(runner: Any) -> DynamicDraft:
    """The :class:`DynamicDraft` behind a ``device_loop`` runner of :func:`graphed_step` (its
    threshold and step counter live on the device: set one, read the other, no recapture)."""
    if not (inspect.ismethod(runner.fn) and isinstance(runner.fn.__self__, DynamicDraft)):
        raise TypeError(f"not a device_loop runner of graphed_step: its forward is {runner.fn!r}")
    return runner.fn.__self__
