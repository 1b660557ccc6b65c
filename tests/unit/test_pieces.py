"""Piecewise graphs (issue 33): a graphed forward calling an ``@graphctl.eager`` function is captured
as pieces around it. A host sync and a data-dependent shape inside the region, replay equal to
eager at every n inside every bucket, boundary tensors static and audited, a switch across a
boundary refused, bad region results loud, variants selecting a full or a piecewise graph. Both
backends (the emulated recorder here, CUDA graphs under ``-m cuda``)."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import CaptureError, ReplayError, StaticInput
from graphctl.models import EngineConfig, MTPEngine

H = 8


def _dev(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _forward(dev: str, gen: torch.Generator):
    w1, w2 = (torch.randn(H, H, generator=gen).to(dev) for _ in range(2))
    seen = []

    @graphctl.eager
    def route(h: torch.Tensor) -> torch.Tensor:
        seen.append(h.shape[0])
        top = int(h.abs().sum(1).argmax())  # a host sync: illegal in any graph
        keep = (h[:, 0] > 0).nonzero()[:, 0]  # a data-dependent shape
        out = h.clone()
        out[keep] *= 2
        return out + top * 0.01

    def fwd(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w1)
        h = route(h)
        return torch.relu(h @ w2)

    return fwd, seen


def test_a_forward_with_a_host_sync_in_an_eager_region_equals_eager_at_every_n(backend, gen):
    # Regression: issue 33, a forward with one host sync could not be graphed at all (CaptureError at capture).
    dev = _dev(backend)
    fwd, seen = _forward(dev, gen)
    run = graphctl.graphed(fwd, buckets=[1, 2, 4, 8], backend=backend, progress=False)
    run.capture_all(torch.randn(8, H, generator=gen).to(dev))
    for n in range(1, 9):
        x = torch.randn(n, H, generator=gen).to(dev)
        want = fwd(x.clone()).clone()
        b = run.buckets.pick(n)
        for t in run.outputs(b):
            t.fill_(float("nan"))  # poisoned: a piece that did not run cannot pass
        run.static_input("x")[n:].fill_(float("nan")) if n < b else None
        seen.clear()
        got = run(x).clone()
        torch.testing.assert_close(got, want)
        assert seen == [b], seen  # the region ran once, eagerly, on the bucket's rows
    rep = run.report()
    assert all(r.pieces == 2 and r.eager_regions[0]["name"].endswith("route") for r in rep.buckets), rep
    assert all(r.ok for r in run.verify())
    assert "2 pieces" in str(rep)


def test_boundary_tensors_are_static_and_named_by_the_audit(backend, gen):
    # Regression: issue 33, the region's outputs cross into the next piece: static storage the audit names.
    dev = _dev(backend)
    fwd, _ = _forward(dev, gen)
    run = graphctl.graphed(fwd, buckets=[4], backend=backend, progress=False)
    run.capture_all(torch.randn(4, H, generator=gen).to(dev))
    regions = run.graph(4).regions
    assert len(regions) == 1 and len(regions[0].outputs) == 1
    static = regions[0].outputs[0]
    ptr = static.data_ptr()
    x = torch.randn(4, H, generator=gen).to(dev)
    run(x)
    run(torch.randn(4, H, generator=gen).to(dev))
    assert regions[0].outputs[0].data_ptr() == ptr and regions[0].calls == 2
    kinds = {(k, n) for k, n, _ in run.known_tensors(4)}
    assert ("boundary", f"eager:{regions[0].name} output[0]") in kinds
    assert not run.audit()[4].errors


def test_a_switch_open_across_a_region_is_refused_at_capture(backend, gen):
    # Regression: issue 33, a draft switch open around an eager call: the region would see target objects at replay.
    dev = _dev(backend)
    eng = MTPEngine(EngineConfig(max_seqs=2), device=dev)

    @graphctl.eager
    def sync(t):
        return t * int(t.numel() > 0)

    def step(input_ids, meta):
        with eng.state.switch("draft"):
            return sync(eng.run_layers(input_ids, eng.draft_layers))

    def inside(input_ids, meta):  # the switch inside one piece, the region after it: fine
        with eng.state.switch("draft"):
            h = eng.run_layers(input_ids, eng.draft_layers)
        return sync(h)

    ids = torch.randint(0, eng.cfg.vocab, (2,), generator=gen).to(dev)
    eng.meta.prepare(eng.state, torch.ones(2, dtype=torch.int32), torch.full((2,), 5, dtype=torch.int32))
    run = graphctl.graphed(step, buckets=[2], state=eng.state, backend=backend, inputs=["input_ids"], progress=False,
                           params=eng.named_tensors())
    with pytest.raises(CaptureError, match="open across an eager region") as err:
        run.capture_all(ids, eng.meta)
    assert "sync" in str(err.value.buffer) and "'draft'" in str(err.value.found)
    assert eng.state.active_switch is None and run.capture is None  # restored, nothing kept
    ok = graphctl.graphed(inside, buckets=[2], state=eng.state, backend=backend, inputs=["input_ids"],
                          progress=False, params=eng.named_tensors())
    ok.capture_all(ids, eng.meta)
    want = inside(ids, eng.meta).clone()
    torch.testing.assert_close(ok(ids, eng.meta).clone(), want)

    # the other choice, declared: a region reading the state only through its arguments may sit inside the switch
    @graphctl.eager(in_switch=True)
    def scaled(t, w):
        return t * float(w.abs().sum() > -1)  # a host read of a draft-role tensor passed in

    def across(input_ids, meta):
        with eng.state.switch("draft"):
            h = scaled(eng.run_layers(input_ids, eng.draft_layers), meta.block_table)
        return h

    run2 = graphctl.graphed(across, buckets=[2], state=eng.state, backend=backend, inputs=["input_ids"],
                            progress=False, params=eng.named_tensors())
    run2.capture_all(ids, eng.meta)
    want = across(ids, eng.meta).clone()
    torch.testing.assert_close(run2(ids, eng.meta).clone(), want)
    assert eng.state.active_switch is None and len(run2.graph(2).regions) == 1


def test_a_region_whose_results_change_shape_or_host_value_is_a_replay_error(gen):
    # Regression: issue 33, a region's output must fit the static storage the next piece reads (never broadcast).
    rows = {"n": 4, "flag": 1}

    @graphctl.eager
    def ragged(h):
        return h[: rows["n"]].clone(), rows["flag"]

    def fwd(x):
        h, flag = ragged(x * 2)
        return h.sum(0) * flag

    run = graphctl.graphed(fwd, buckets=[4], backend="emulated", progress=False)
    run.capture_all(torch.randn(4, 3, generator=gen))
    rows["n"] = 3
    with pytest.raises(ReplayError, match="does not fit its static storage") as err:
        run(torch.randn(4, 3, generator=gen))
    assert "ragged" in err.value.buffer and "(4, 3)" in err.value.expected
    rows["n"], rows["flag"] = 4, 2
    with pytest.raises(ReplayError, match="another host value"):
        run(torch.randn(4, 3, generator=gen))
    rows["flag"] = 1
    x = torch.randn(4, 3, generator=gen)
    torch.testing.assert_close(run(x).clone(), fwd(x.clone()))


def test_a_region_writing_its_argument_in_place_and_a_nested_eager_call(backend, gen):
    # Regression: issue 33, an in-place region needs no copy; an @eager call inside a region is a plain call.
    dev = _dev(backend)

    @graphctl.eager
    def inner(t):
        return t.add_(1)

    @graphctl.eager
    def outer(t):
        assert int(t.sum()) == int(t.sum())  # a host read, fine here
        inner(t)
        return t

    def fwd(x):
        h = x * 3
        outer(h)
        return h - 1

    run = graphctl.graphed(fwd, buckets=[2, 4], backend=backend, progress=False)
    run.capture_all(torch.randn(4, 5, generator=gen).to(dev))
    assert [len(run.graph(b).regions) for b in (2, 4)] == [1, 1]
    assert [k[1] for k in run.graph(4).regions[0].kinds] == ["alias"]  # its argument, written in place
    for n in (1, 3, 4):
        x = torch.randn(n, 5, generator=gen).to(dev)
        torch.testing.assert_close(run(x).clone(), fwd(x.clone()))


def test_a_variant_selects_a_full_or_a_piecewise_graph(backend, gen):
    # Regression: issue 33, vLLM's `uniform` key: one forward, full graphs for uniform decode, pieces for the rest.
    dev = _dev(backend)

    @graphctl.eager
    def mixed(h):
        return h * float(h.abs().max() > -1)  # a host read only the mixed path makes

    def fwd(x, uniform):
        h = x * 2
        if not uniform:
            h = mixed(h)
        return h + 1

    run = graphctl.graphed(fwd, buckets=[2, 4], backend=backend, progress=False, variants={"uniform": (True, False)})
    run.capture_all(torch.randn(4, 3, generator=gen).to(dev), True)
    assert run.runner(uniform=True).graph(4).regions == () and len(run.runner(uniform=False).graph(4).regions) == 1
    for uniform in (True, False):
        x = torch.randn(3, 3, generator=gen).to(dev)
        torch.testing.assert_close(run(x, uniform).clone(), fwd(x.clone(), uniform))
    rows = {(b.variant, b.pieces) for b in run.report().buckets}
    assert rows == {("uniform=True", 1), ("uniform=False", 2)}


def test_eager_outside_a_capture_is_a_plain_call():
    # Regression: issue 33, @graphctl.eager must cost nothing and change nothing outside a capture.
    @graphctl.eager
    def f(a, b=2):
        """doc"""
        return a * b

    assert f(3) == 6 and f(3, b=4) == 12 and f.__doc__ == "doc" and f.__name__ == "f"
    from graphctl.graphs.capture.pieces import is_eager

    assert is_eager(f) and not is_eager(lambda: 0)


def test_an_interrupt_inside_a_region_at_capture_drops_every_piece(backend, gen, monkeypatch):
    # Regression: issue 33, a Ctrl-C in a region during capture: no piece kept, it propagates as itself, and the
    # next capture works.
    dev = _dev(backend)

    @graphctl.eager
    def region(h):
        return h + 1

    def fwd(x):
        return region(x * 2) * 3

    import graphctl.graphs.capture.pieces as pieces

    def interrupted(fn, args, kwargs, *more):
        raise KeyboardInterrupt

    run = graphctl.graphed(fwd, buckets=[2], backend=backend, progress=False)
    x = torch.randn(2, 3, generator=gen).to(dev)
    with monkeypatch.context() as m:
        m.setattr(pieces, "run_region", interrupted)  # only capture calls it: the warmups run the region plainly
        with pytest.raises(KeyboardInterrupt):
            run.capture_all(x)
    assert run.capture is None
    if backend == "cuda":
        assert not torch.cuda.is_current_stream_capturing()
    run.capture_all(x)
    torch.testing.assert_close(run(x).clone(), fwd(x.clone()))


def test_static_input_declared_and_region_sees_padding_rows(gen):
    # Regression: issue 33, the region runs on the bucket's rows (padding included), as the pieces do.
    seen = []

    @graphctl.eager
    def look(h):
        seen.append(tuple(h.shape))
        return h.clone()

    def fwd(x):
        return look(x + 1) * 2

    run = graphctl.graphed(fwd, buckets=[4], backend="emulated", progress=False, inputs=[StaticInput("x")])
    run.capture_all(torch.randn(4, 2, generator=gen))
    seen.clear()
    x = torch.randn(3, 2, generator=gen)
    torch.testing.assert_close(run(x).clone(), fwd(x.clone()))
    assert seen[0] == (4, 2)
