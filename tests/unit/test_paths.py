"""Specs that name nested state by path (issue 15): ``"target.offsets"``, ``"layers[*].keys"``."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import BindError, Pad, Recompute, Registry, StateSpec, Swap, SwitchError, bind


class Pool:
    def __init__(self, gen, n=6):
        self.offsets = torch.randint(0, 100, (n,), generator=gen, dtype=torch.int32)


class Layer:
    def __init__(self, gen):
        self.length = torch.randint(0, 9, (), generator=gen, dtype=torch.int64)
        self.keys = torch.randn(4, 3, generator=gen)


class Nested:
    def __init__(self, gen, layers=3):
        self.target, self.draft = Pool(gen), Pool(gen)
        self.layers = [Layer(gen) for _ in range(layers)]
        self.total = torch.empty((), dtype=torch.int64)


def _registry():
    spec = StateSpec("nested")
    spec.buffer("target.offsets", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.clamp(0),
                draft=Swap(twin="draft.offsets"))
    spec.buffer("draft.offsets", shape=("S",), dtype=torch.int32, readers={"draft"})
    spec.buffer("layers[*].length", shape=(), dtype=torch.int64, mutable=True)
    spec.buffer("layers[*].keys", shape=(4, 3), dtype=torch.float32, mutable=True)
    spec.buffer("total", shape=(), dtype=torch.int64,
                derive=Recompute(["layers[0].length"], lambda out, a: out.copy_(a * 10)))
    reg = Registry()
    reg.register(Nested, spec)
    return reg


def test_nested_paths_bind_swap_write_and_restore(gen):
    # Issue 15: users needed a shim class copying references to nested state (stale once the library rebinds).
    m = Nested(gen)
    st = bind(m, registry=_registry())
    assert "layers[2].keys" in st.plan.buffers and "layers[0].length" in st.plan.buffers
    assert int(m.total) == int(m.layers[0].length) * 10  # derived at bind, through a path
    before = {n: st.tensor(n).clone() for n in st.restorable_names()}
    target, draft = m.target.offsets, m.draft.offsets
    with st.switch("draft", "eager"):
        assert m.target.offsets is draft  # the nested attribute was rebound
        st.write("layers[0].length", torch.tensor(7))
        assert int(m.total) == 70
        m.layers[1].keys.mul_(3)  # the forward writes nested state
    assert m.target.offsets is target
    for n, t in before.items():
        assert torch.equal(st.tensor(n), t), n
    st.pad({"seq": 2})
    assert (m.target.offsets[2:] >= 0).all()


def test_errors_name_the_full_path(gen):
    # Issue 15: errors must name the full path of nested state.
    m = Nested(gen)
    m.layers[1].length = m.layers[1].length.to(torch.int32)
    with pytest.raises(BindError, match=r"Nested\.layers\[1\]\.length") as ei:
        bind(m, registry=_registry())
    assert ei.value.buffer == "layers[1].length"
    m = Nested(gen)
    st = bind(m, registry=_registry())
    m.layers[2].keys = m.layers[2].keys.clone()  # the library rebinds: graphctl says so, never goes stale
    with pytest.raises(SwitchError, match="rebound") as ei:
        st.switch("draft", "eager").__enter__()
    assert ei.value.buffer == "layers[2].keys"
    m = Nested(gen)
    m.layers = 3
    with pytest.raises(BindError, match="without a length"):
        bind(m, registry=_registry())


def test_a_graphed_forward_over_nested_state_restores_it(gen):
    # Issue 15: declared nested state is snapshotted around warmups and capture like flat buffers.
    m = Nested(gen)
    st = bind(m, registry=_registry())

    def fwd(x, meta):
        for layer in meta.layers:
            layer.length.add_(1)
        return x * meta.layers[0].keys.sum()

    f = graphctl.graphed(fwd, buckets=[2, 4], state=st, inputs=["x"], backend="emulated", progress=False)
    lengths = [int(layer.length) for layer in m.layers]
    f.capture_all(torch.randn(4, 2, generator=gen), m)
    assert [int(layer.length) for layer in m.layers] == lengths
    assert f.side_effects == ()  # declared state is graphctl's own, not a side effect
