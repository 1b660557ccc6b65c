"""Random state as declared state (issue 34): a generator declared in the spec (per role: the draft
draws from its own stream), restored around every warmup, capture and verify run, replayed from the
same state as eager draws; torch's default and undeclared generators found, reported and restored.
Emulated backend here; CUDA graphs (the generator registered with each graph) under ``-m cuda``."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import Registry, StateSpec, Swap


class Sampler:
    """Metadata holding one buffer and a generator per role."""

    def __init__(self, device: str, seed: int) -> None:
        self.scale = torch.ones(4, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.draft_generator = torch.Generator(device=device).manual_seed(seed + 1)


def _state(device: str, seed: int):
    spec = StateSpec("sampler")
    spec.buffer("scale", shape=(4,), dtype=torch.float32)
    spec.object("generator", draft=Swap(twin="draft_generator"))
    spec.object("draft_generator")
    reg = Registry()
    reg.register(Sampler, spec)
    meta = Sampler(device, seed)
    return meta, graphctl.bind(meta, registry=reg)


def _dev(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def test_a_declared_generator_per_role_is_restored_and_replays_like_eager(backend, gen):
    # Regression: issue 34, warmups and capture advanced the forward's generators (the first replay then drew what
    # eager's fifth call would), and the draft drew from the target's stream.
    dev = _dev(backend)
    seed = int(torch.randint(0, 2**30, (1,), generator=gen))
    meta, st = _state(dev, seed)

    def step(x, meta):
        a = x + torch.rand(x.shape, generator=meta.generator, device=x.device)
        with st.switch("draft"):
            b = a * torch.rand(x.shape, generator=meta.generator, device=x.device)  # the draft's stream
        return a, b

    run = graphctl.graphed(step, buckets=[2, 4], state=st, inputs=["x"], backend=backend, progress=False)
    x = torch.randn(4, 4, generator=gen).to(dev)
    before = (meta.generator.get_state(), meta.draft_generator.get_state())
    run.capture_all(x, meta)
    assert torch.equal(meta.generator.get_state(), before[0]) and torch.equal(meta.draft_generator.get_state(),
                                                                                before[1])
    assert run.report().random_state == ()  # declared: nothing to report
    eager = [tuple(t.clone() for t in step(x, meta)) for _ in range(3)]
    meta.generator.set_state(before[0])
    meta.draft_generator.set_state(before[1])
    graphed = [tuple(t.clone() for t in run(x, meta)) for _ in range(3)]
    for (ea, eb), (ga, gb) in zip(eager, graphed):
        torch.testing.assert_close(ga, ea)
        torch.testing.assert_close(gb, eb)
    assert not torch.equal(eager[0][0], eager[1][0])  # the stream advances call to call
    # the draft drew from its own stream: the target's stream alone reproduces a, not b's factor
    meta.generator.set_state(before[0])
    solo = x + torch.rand(x.shape, generator=meta.generator, device=x.device)
    torch.testing.assert_close(eager[0][0], solo)
    assert all(r.ok for r in run.verify())


def test_a_failed_capture_leaves_every_generator_as_it_was(gen):
    # Regression: issue 34, a capture that raised left the generators advanced by its warmups.
    meta, st = _state("cpu", 3)
    calls = {"n": 0}

    def step(x, meta):
        calls["n"] += 1
        y = x + torch.rand(x.shape, generator=meta.generator) + torch.rand(x.shape)
        if calls["n"] > 2:
            raise RuntimeError("boom at capture")
        return y

    torch.manual_seed(11)
    default_before = torch.default_generator.get_state()
    before = meta.generator.get_state()
    run = graphctl.graphed(step, buckets=[2], state=st, inputs=["x"], backend="emulated", progress=False)
    with pytest.raises(graphctl.CaptureError, match="boom"):
        run.capture_all(torch.ones(2, 4), meta)
    assert torch.equal(meta.generator.get_state(), before)
    assert torch.equal(torch.default_generator.get_state(), default_before)


def test_default_and_undeclared_generators_are_reported_and_never_advanced(gen):
    # Regression: issue 34, a forward drawing from torch's default generator or an undeclared one: warmups advanced
    # the user's stream silently, and verify compared two different draws.
    other = torch.Generator().manual_seed(5)

    def fwd(x):
        return x + torch.rand(x.shape) + torch.randn(x.shape, generator=other)

    run = graphctl.graphed(fwd, buckets=[2, 4], backend="emulated", progress=False)
    torch.manual_seed(123)
    want_default = torch.rand(5)
    want_other = torch.randn(5, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(123)
    run.capture_all(torch.ones(4, 3))
    assert torch.equal(torch.rand(5), want_default) and torch.equal(torch.randn(5, generator=other), want_other)
    found = {r["generator"]: r for r in run.report().random_state}
    assert set(found) == {"the default cpu generator", "an undeclared torch.Generator on cpu"}, found
    assert found["the default cpu generator"]["op"] == "aten::rand" and "test_random_state.py" in \
        found["the default cpu generator"]["where"]
    assert any(line.startswith("random state: the default cpu generator") for line in run.report().findings())
    assert all(r.ok for r in run.verify())  # eager and replay drew from the same restored states
