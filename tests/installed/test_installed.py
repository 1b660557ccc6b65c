"""A short test that CI runs against the installed wheel, from outside the checkout (issue 16):
the compiled extension loads and matches its pure-PyTorch references, the shipped machines and
profiles import, and a forward graphs, replays and restores through the installed package."""
from __future__ import annotations

import torch

import graphctl
from graphctl.ops import reference as ref


def test_the_installed_extension_loads_and_matches_the_references():
    # Issue 16: nothing checked that a built wheel carries a working graphctl._C.
    st = graphctl.ops.extension_status()
    assert st.loaded, st.error
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        static = [torch.randn(7, 3, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)]
        arena = [torch.randn(7, 3, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)]
        src = [torch.randn(7, 3, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)]
        want_static, want_arena = [t.clone() for t in static], [t.clone() for t in arena]
        ref.swap_through_(want_static, want_arena, [t.clone() for t in src])
        graphctl.ops.swap_through_(static, arena, src)
        for a, b in zip(static + arena, want_static + want_arena):
            assert torch.equal(a, b)


def test_the_installed_package_graphs_a_forward_with_a_side_effect_and_restores_it():
    # Issue 16: the wheel's machines, profiles and runner must work without the checkout.
    from hypothesis import settings

    import graphctl.testing  # noqa: F401 - hypothesis is a dependency of the package

    settings.get_profile("graphctl-ci")
    counter = torch.zeros(1)

    @graphctl.graphed(buckets=[2, 4], inputs=["x"], backend="emulated", progress=False)
    def step(x):
        counter.add_(1)
        return x * 2 + counter

    x = torch.randn(3, 5)
    step.capture_all(x)
    assert counter.item() == 0, "capture_all moved state it does not own"
    got = step(x).clone()
    assert torch.equal(got, x * 2 + 1) and counter.item() == 1
