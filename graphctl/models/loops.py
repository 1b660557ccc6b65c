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
  (:class:`~graphctl.graphs.conditional.DeviceLoop`). A device-side predicate
  (``graphctl.ops.loop_condition_``) stops the loop once every request's last draft token had a
  probability below ``threshold``, or after k steps; a per-request mask keeps finished requests
  from writing (their tokens, proposals and ``kv_lens`` stay as they were). Proposals past a
  request's stop are 0; ``DynamicDraft.counter`` holds the steps taken. CUDA only.

With ``threshold=0`` every mode proposes the same tokens (``tests/engine``, ``tests/cuda``).
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import CaptureError, DeclarationError
from graphctl.graphs import GraphRunner, StaticInput, graphed, select_backend
from graphctl.graphs.conditional import DeviceLoop
from graphctl.models.mtp import MTPEngine, StepOutput

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

    def __init__(self, eng: MTPEngine, threshold: float = 0.0) -> None:
        S, k, dev = eng.cfg.max_seqs, eng.k, eng.device
        self.eng = eng
        self.counter = torch.zeros(1, dtype=torch.int64, device=dev)
        self.active = torch.zeros(S, dtype=torch.bool, device=dev)
        self.token = torch.zeros(S, dtype=torch.int64, device=dev)
        self.proposals = torch.zeros(S, k, dtype=torch.int64, device=dev)
        self.base = torch.zeros(S, dtype=eng.meta.kv_lens.dtype, device=dev)
        self.threshold = torch.full((1,), float(threshold), device=dev)
        self.loop = DeviceLoop(dev)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The loop's own buffers by name (for the audit's ``params``)."""
        return {"loop.counter": self.counter, "loop.active": self.active, "loop.token": self.token,
                "loop.proposals": self.proposals, "loop.base": self.base, "loop.threshold": self.threshold,
                "loop.flag": self.loop.flag}

    def set_threshold(self, value: float) -> None:
        self.threshold.fill_(float(value))

    def step(self, input_ids: torch.Tensor, meta: Any) -> StepOutput:
        """One decode step whose draft loop the device ends (a forward for ``@graphed``)."""
        eng, st = self.eng, self.eng.state
        accepted, bonus = eng.target_and_accept(input_ids)
        n = accepted.shape[0]
        active, token, base, props = self.active[:n], self.token[:n], self.base[:n], self.proposals[:n]
        with st.switch("draft"):
            base.copy_(eng.draft_begin(input_ids, accepted, st.write))
            token.copy_(bonus)
            props.zero_()
            torch.gt(base, 0, out=active)  # padded requests (base 0) are done at once: they never extend the loop
            self.counter.zero_()

            def body() -> None:
                # finished requests keep their kv_lens
                kv = torch.where(active, eng.draft_kv_lens(base, self.counter), meta.kv_lens[:n])
                logits = eng.draft_step(token, kv, st.write)
                new = logits.argmax(-1)
                conf = torch.softmax(logits.float(), -1).amax(-1)
                token.copy_(torch.where(active, new, token))
                props.index_copy_(1, self.counter, torch.where(active, new, 0)[:, None])
                active.logical_and_(conf >= self.threshold)
                self.counter.add_(1)

            def predicate(flag: torch.Tensor, handle: int) -> None:
                ops.loop_condition_(flag, self.counter, eng.k, active, handle)

            self.loop.run(body, predicate, eng.k)
            drafts = props.clone()
        return StepOutput(accepted, bonus, drafts)


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
    """``per_step`` mode: call it like ``engine.step`` (see the module docstring). Graphs are
    captured at the first call, from its inputs, like ``@graphed``."""

    def __init__(self, eng: MTPEngine, buckets: Sequence[int], backend: str = "auto") -> None:
        self.eng, k1 = eng, eng.k + 1
        self.head = GraphRunner(self._target, buckets=buckets, state=eng.state, backend=backend,
                                inputs=[StaticInput("input_ids", per_item=k1)], progress=False)
        self.backend_name = backend
        S = eng.cfg.max_seqs
        self.token = torch.zeros(S, dtype=torch.int64, device=eng.device)
        self.proposals = torch.zeros(S, eng.k, dtype=torch.int64, device=eng.device)
        self._graphs: dict[int, tuple[Any, Any]] = {}  # bucket -> (prefill graph, step graph)
        self._be: Any = None

    def _target(self, input_ids: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.eng.target_and_accept(input_ids)  # meta: frozen, so a call with another object is refused

    def _draft_graphs(self, b: int) -> tuple[Any, Any]:
        """Capture the draft prefill and one draft step for bucket ``b``, in the draft role (the
        caller holds the switch): they record the draft KV cache and the swapped tables."""
        eng, be = self.eng, self._be
        ids = self.head.static_input("input_ids")[: b * (eng.k + 1)]
        token = self.token[:b]

        def prefill(_mark=None) -> None:
            eng.run_layers(ids, eng.draft_layers, eng.k + 1)

        def step(_mark=None) -> None:
            token.copy_(eng.run_layers(token, eng.draft_layers).argmax(-1))

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

    def capture_all(self, input_ids: torch.Tensor, meta: Any) -> PerStepLoop:
        eng, st = self.eng, self.eng.state
        self.head.capture_all(input_ids, meta)
        self._be = select_backend(self.backend_name, eng.device)
        self._pool = self._be.new_pool()
        n = input_ids.shape[0] // (eng.k + 1)
        for b in sorted(self.head.captured, reverse=True):
            m = min(n, b)
            self.head(input_ids[: m * (eng.k + 1)], meta)  # loads the bucket's inputs, pads the state
            with st.switch("draft"):
                self._graphs[b] = self._draft_graphs(b)
        return self

    def __call__(self, input_ids: torch.Tensor, meta: Any) -> StepOutput:
        st, k = self.eng.state, self.eng.k
        if not self._graphs:
            self.capture_all(input_ids, meta)
        accepted, bonus = self.head(input_ids, meta)
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
                st.write("kv_lens", self.eng.draft_kv_lens(base, i))
                step.replay()
                self.proposals[:b, i].copy_(self.token[:b])
        return StepOutput(accepted, bonus, self.proposals[:n])


def graphed_step(eng: MTPEngine, mode: str = "unrolled", *, buckets: Sequence[int] = (1, 2, 4, 8),
                 backend: str = "auto", threshold: float = 0.0, draft_lens: Sequence[int] | None = None,
                 sampling: Any = None) -> Any:
    """A callable like ``eng.step`` (``(input_ids, meta) -> StepOutput``) graphed in ``mode``;
    ``threshold`` is the device loop's confidence threshold (``device_loop`` only; the returned
    runner's ``dynamic`` is its :class:`DynamicDraft`, whose ``set_threshold`` changes it without
    recapture). The engine's weights and caches (and the loop's buffers) are the audit's params.
    ``draft_lens`` (``unrolled`` only): one runner serving every listed draft length ``k`` (each
    at most the engine's ``draft_len``) from its own graphs in one pool, called
    ``(input_ids, meta, k)`` (a :class:`~graphctl.graphs.variants.VariantRunner`). ``sampling``
    (a :class:`~graphctl.models.sampled.Sampling`, ``unrolled`` only): the sampled step
    ``eng.sample_step(input_ids, draft_probs, meta, sampling[, k])``; the settings are baked in."""
    if mode not in MODES:
        raise DeclarationError("unknown draft-loop mode", expected=" / ".join(MODES), found=mode,
                               fix="unrolled (one graph), per_step (one graph per step) or device_loop (WHILE node)")
    if sampling is not None:
        if mode != "unrolled":
            raise DeclarationError("sampling needs mode='unrolled'", expected="unrolled", found=mode,
                                   fix="graph the sampled step unrolled; per_step and device_loop draft greedily")
        if draft_lens is not None:  # a graph set per k: rows per request follow k
            ins = [StaticInput("input_ids", per_item_of=lambda k: k + 1),
                   StaticInput("draft_probs", per_item_of=lambda k: k)]
        else:
            ins = [StaticInput("input_ids", per_item=eng.k + 1), StaticInput("draft_probs", per_item=eng.k)]
        return graphed(eng.sample_step, buckets=list(buckets), state=eng.state, backend=backend, progress=False,
                       inputs=ins, params=eng.named_tensors(),
                       variants=None if draft_lens is None else {"k": tuple(draft_lens)})
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
        return graphed(eng.step, buckets=list(buckets), state=eng.state, backend=backend, progress=False,
                       inputs=[StaticInput("input_ids", per_item_of=lambda k: k + 1)], params=eng.named_tensors(),
                       variants={"k": tuple(draft_lens)})
    inputs = [StaticInput("input_ids", per_item=eng.k + 1)]
    if mode == "unrolled":
        return graphed(eng.step, buckets=list(buckets), state=eng.state, backend=backend, inputs=inputs,
                       progress=False, params=eng.named_tensors())
    if mode == "per_step":
        return PerStepLoop(eng, buckets, backend)
    if eng.device.type != "cuda" or backend == "emulated":
        raise CaptureError("device_loop needs CUDA", expected="a CUDA engine and backend 'cuda' or 'auto'",
                           found=f"engine on {eng.device}, backend {backend!r}",
                           fix="run on a GPU, or use mode='unrolled' or 'per_step' (both run on the emulated backend)")
    dyn = DynamicDraft(eng, threshold)
    return graphed(dyn.step, buckets=list(buckets), state=eng.state, backend=backend, inputs=inputs,
                   progress=False, params={**eng.named_tensors(), **dyn.named_tensors()})


def dynamic_of(runner: Any) -> DynamicDraft:
    """The :class:`DynamicDraft` behind a ``device_loop`` runner of :func:`graphed_step` (its
    threshold and step counter live on the device: set one, read the other, no recapture)."""
    if not (inspect.ismethod(runner.fn) and isinstance(runner.fn.__self__, DynamicDraft)):
        raise TypeError(f"not a device_loop runner of graphed_step: its forward is {runner.fn!r}")
    return runner.fn.__self__
