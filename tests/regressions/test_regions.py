"""Eager regions equal eager on every path (issue 51), on both backends: what a region returns reaches the next
piece whatever it aliases, or the replay refuses it by name; a tensor a region keeps to itself and a piece reads is
refused at capture; a region's exception propagates as itself and poisons nothing unless a recorded switch could not
be restored; a region may use the state outside a switch; a second Ctrl-C reaches a hung region; a compiled forward
splits at its regions. Each test is the code a user writes; each failed before issue 51."""
from __future__ import annotations

import signal
import time

import pytest
import torch

import graphctl
from graphctl import CaptureError, ReplayError
from support.graphs import Toy
from support.regions import WHERE, contents, region_of, regioned, unchanged

H = 6


def test_a_region_that_returned_its_argument_at_capture_refuses_a_new_tensor(backend, device, gen):
    # Regression: issue 51, an early "nothing to do" return at capture marked the result "written in place": a replay
    # that took the other branch dropped the new tensor and returned 499.5 where eager gives 249.5.
    @graphctl.eager
    def maybe(h):
        return h * 0.5 if (h > 100).any() else h

    def fwd(x):
        return maybe(x * 10) - 0.5

    run = graphctl.graphed(fwd, buckets=[2], backend=backend, progress=False)
    run.capture_all(torch.rand(2, H, generator=gen).to(device))  # small values: maybe returns its argument
    big = (torch.rand(2, H, generator=gen) + 50).to(device)
    with pytest.raises(ReplayError, match="aliases other memory than at capture") as err:
        run(big)
    assert err.value.buffer.endswith("maybe") and "argument 0" in err.value.expected and "clone" in err.value.fix
    small = torch.rand(2, H, generator=gen).to(device)
    torch.testing.assert_close(run(small).clone(), fwd(small.clone()))  # the refused call broke nothing

    @graphctl.eager
    def fixed(h):  # the fix the error names: a new tensor in the branch that does nothing
        return h * 0.5 if (h > 100).any() else h.clone()

    def fwd2(x):
        return fixed(x * 10) - 0.5

    run2 = graphctl.graphed(fwd2, buckets=[2], backend=backend, progress=False)
    run2.capture_all(torch.rand(2, H, generator=gen).to(device))
    for x in (big, small):
        torch.testing.assert_close(run2(x).clone(), fwd2(x.clone()))


def test_a_region_that_returned_a_new_tensor_at_capture_may_return_its_argument(backend, device, gen):
    # Regression: issue 51, the converse branch: a new tensor at capture is the static storage the next piece reads,
    # and a replay whose result is the argument itself must copy it there.
    @graphctl.eager
    def maybe(h):
        return h if (h > 100).any() else h * 0.5

    def fwd(x):
        return maybe(x * 10) - 0.5

    run = graphctl.graphed(fwd, buckets=[2], backend=backend, progress=False)
    run.capture_all(torch.rand(2, H, generator=gen).to(device))
    for x in (torch.rand(2, H, generator=gen) + 50, torch.rand(2, H, generator=gen)):
        x = x.to(device)
        torch.testing.assert_close(run(x).clone(), fwd(x.clone()))


def test_a_copied_result_that_a_later_piece_writes_in_place_is_refused_when_it_aliases(backend, device, gen):
    # Regression: issue 51, a copy would hide an in-place write through the alias (eager: the argument changes too).
    @graphctl.eager
    def maybe(h):
        return h if (h > 100).any() else h * 0.5

    def fwd(x):
        h = x * 10
        out = maybe(h)
        out.add_(1)  # in place: where out is h, h changes as well
        return out + h

    run = graphctl.graphed(fwd, buckets=[2], backend=backend, progress=False)
    run.capture_all(torch.rand(2, H, generator=gen).to(device))
    x = torch.rand(2, H, generator=gen).to(device)
    torch.testing.assert_close(run(x).clone(), fwd(x.clone()))
    with pytest.raises(ReplayError, match="aliases memory a later piece writes") as err:
        run((torch.rand(2, H, generator=gen) + 50).to(device))
    assert err.value.buffer.endswith("maybe") and "clone" in err.value.fix


def test_a_region_that_returned_one_tensor_twice_refuses_two(backend, device, gen):
    # Regression: issue 51, both outputs shared one static tensor: the second overwrote the first (33 for eager's 23).
    two = {"on": False}

    @graphctl.eager
    def pair(h):
        a = h + 1
        return (a, h + 2) if two["on"] else (a, a)

    def fwd(x):
        a, b = pair(x * 1)
        return a * 10 + b

    run = graphctl.graphed(fwd, buckets=[2], backend=backend, progress=False)
    run.capture_all(torch.rand(2, H, generator=gen).to(device))
    two["on"] = True
    with pytest.raises(ReplayError, match="aliases other memory") as err:
        run(torch.rand(2, H, generator=gen).to(device))
    assert "output 1" in err.value.expected and "result 0" in err.value.expected and "distinct" in err.value.fix


def test_a_region_returning_a_buffer_of_its_module_never_writes_into_it(backend, device, gen):
    # Regression: issue 51, a region returning a pre-existing tensor at capture and another one later: the replay
    # copied the new result into the first tensor, overwriting the caller's buffer.
    tables = {"a": torch.randn(2, H, generator=gen).to(device), "b": torch.randn(2, H, generator=gen).to(device)}
    pick = {"which": "a"}

    @graphctl.eager
    def lookup(h):
        return tables[pick["which"]]

    def fwd(x):
        return lookup(x) * x

    run = graphctl.graphed(fwd, buckets=[2], backend=backend, progress=False)
    run.capture_all(torch.randn(2, H, generator=gen).to(device))
    x = torch.randn(2, H, generator=gen).to(device)
    torch.testing.assert_close(run(x).clone(), fwd(x.clone()))
    a = tables["a"].clone()
    pick["which"] = "b"
    with pytest.raises(ReplayError, match="aliases other memory") as err:
        run(x)
    assert "existed before the capture" in err.value.expected and torch.equal(tables["a"], a)


def test_a_region_publishing_a_tensor_a_later_piece_reads_is_refused_at_capture(backend, device, gen):
    # Regression: issue 51, `box.cache = h * 2` in a region, read by the next piece: every replay read the capture's
    # tensor (5 where eager gives 9), and report().reach showed nothing unchecked.
    class Box:
        cache = torch.zeros(2, H)

    box = Box()

    @graphctl.eager
    def publish(h):
        box.cache = h * 2
        return h + 0

    def fwd(x):
        return publish(x * 1) + box.cache

    run = graphctl.graphed(fwd, buckets=[2], backend=backend, progress=False)
    with pytest.raises(CaptureError, match="publishes a tensor a later piece reads") as err:
        run.capture_all(torch.randn(2, H, generator=gen).to(device))
    assert err.value.buffer.endswith("publish") and "return the tensor" in err.value.fix and run.capture is None

    @graphctl.eager
    def consume(h, cached):  # the same tensor passed on to a later region: its argument is baked at capture
        return h + cached

    def fwd2(x):
        h = publish(x * 1)
        return consume(h * 2, box.cache)

    with pytest.raises(CaptureError, match="publishes") as err:
        graphctl.graphed(fwd2, buckets=[2], backend=backend, progress=False).capture_all(
            torch.randn(2, H, generator=gen).to(device))
    assert "an argument of eager region" in err.value.found

    @graphctl.eager
    def fixed(h):  # the fix the error names: return it
        c = h * 2
        box.cache = c
        return h + 0, c

    def fwd3(x):
        h, c = fixed(x * 1)
        return h + c

    run3 = graphctl.graphed(fwd3, buckets=[2], backend=backend, progress=False)
    run3.capture_all(torch.randn(2, H, generator=gen).to(device))
    x = torch.randn(2, H, generator=gen).to(device)
    torch.testing.assert_close(run3(x).clone(), fwd3(x.clone()))


@pytest.mark.parametrize("where", WHERE)
def test_a_transient_error_in_a_region_propagates_as_itself_and_poisons_nothing(where, backend, device, gen):
    # Regression: issue 51, a region raising after the graph's draft switch came back as CorruptedStateError
    # ("restore after the switch failed", false) and poisoned the state for good; inside an in_switch region the
    # recorded switch's restore never ran.
    toy = Toy(device, gen, S=8, buckets=(2, 4), backend=backend)
    boom = {"on": False}

    def body(t):
        if boom["on"]:
            raise ConnectionError("a transient failure in the region")
        return t * 1.5

    regioned(toy, where, region_of(where, body))
    toy.forward.capture_all(*toy.batch(4), toy.meta)
    args = toy.batch(4)
    before = contents(toy)
    boom["on"] = True
    with pytest.raises(ConnectionError, match="transient"):  # an `except ConnectionError` of the caller's catches it
        toy.forward(*args, toy.meta)
    assert toy.state.poisoned is None and toy.state.active_switch is None
    assert unchanged(toy, before) == []  # the recorded switch restored where it was open
    boom["on"] = False
    want = toy.eager(*args)
    got = [t.clone() for t in toy.forward(*args, toy.meta)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def test_a_region_may_open_its_own_switch_or_write_the_state(backend, device, gen):
    # Regression: issue 51, the fix the region-switch-open error recommends (open the switch inside the region) and
    # a state.write inside a region captured fine, then poisoned the state at every replay: the runner's refresh
    # switch was open around the whole replay.
    toy = Toy(device, gen, S=8, buckets=(2, 4), backend=backend)

    @graphctl.eager
    def draft_again(t):
        n = t.shape[0]
        with toy.state.switch("draft"):  # eager inside the region: the draft's block offsets
            return t + toy.meta.block_offsets[:n, :1].float() * 0.002

    @graphctl.eager
    def bump(t):
        n = t.shape[0]
        toy.state.write("kv_lens", toy.meta.kv_lens[:n] + 3)  # a write through the state, outside any switch
        return t * 1

    def fwd(tokens, positions, meta):
        h, d = inner(tokens, positions, meta)
        d = bump(draft_again(d))
        return h, d + meta.kv_lens[: d.shape[0], None].float() * 1e-3

    inner = regioned(toy, "after", graphctl.eager(lambda t: t * 1)).fn
    run = graphctl.graphed(fwd, buckets=[2, 4], state=toy.state, backend=backend, progress=False,
                           inputs=[graphctl.StaticInput("tokens", per_item=toy.k + 1),
                                   graphctl.StaticInput("positions", per_item=toy.k + 1)])
    run.capture_all(*toy.batch(4), toy.meta)
    assert run.record(4).draft and len(run.graph(4).regions) == 3
    for n in (4, 3):
        args = toy.batch(n)
        kv = toy.meta.kv_lens.clone()
        with torch.no_grad():
            want = [t.clone() for t in fwd(*args, toy.meta)]
        after_eager = toy.meta.kv_lens.clone()
        toy.meta.kv_lens.copy_(kv)
        got = [t.clone() for t in run(*args, toy.meta)]
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w)
        assert toy.state.poisoned is None and torch.equal(toy.meta.kv_lens[:n], after_eager[:n])


@pytest.mark.parametrize("where", WHERE)
def test_a_second_ctrl_c_reaches_a_hung_region_and_the_next_call_is_right(where, backend, device, gen):
    # Regression: issue 51, a replay ran its regions inside the held section without marking them user code: a hung
    # region ignored every Ctrl-C (only SIGKILL ended it).
    toy = Toy(device, gen, S=8, buckets=(2, 4), backend=backend)
    hang = {"on": False, "reached": False}

    def body(t):
        if hang["on"]:
            signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: held until the replay ends
            try:
                for i in range(400):  # hangs
                    time.sleep(0.005)
                    if i == 20:
                        signal.raise_signal(signal.SIGINT)  # the second: delivered inside the region
            except KeyboardInterrupt:
                hang["reached"] = True
                raise
            raise RuntimeError("the second Ctrl-C never reached the region")
        return t * 0.5

    regioned(toy, where, region_of(where, body))
    toy.forward.capture_all(*toy.batch(4), toy.meta)
    args = toy.batch(4)
    before = contents(toy)
    hang["on"] = True
    with pytest.raises(KeyboardInterrupt):
        toy.forward(*args, toy.meta)
    assert hang["reached"] and toy.state.poisoned is None and unchanged(toy, before) == []
    hang["on"] = False
    want = toy.eager(*args)
    got = [t.clone() for t in toy.forward(*args, toy.meta)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def test_a_single_ctrl_c_in_a_region_is_raised_after_the_replay(backend, device, gen):
    # Regression: issue 51, a first Ctrl-C waits for the replay's end (outputs whole, state consistent), as for a graph.
    toy = Toy(device, gen, S=8, buckets=(2, 4), backend=backend)
    once = {"on": False}

    @graphctl.eager(in_switch=True)
    def region(t):
        if once["on"]:
            once["on"] = False
            signal.raise_signal(signal.SIGINT)
        return t * 0.5

    regioned(toy, "inside", region)
    toy.forward.capture_all(*toy.batch(4), toy.meta)
    args = toy.batch(4)
    before = contents(toy)
    want = toy.eager(*args)
    once["on"] = True
    with pytest.raises(KeyboardInterrupt):
        toy.forward(*args, toy.meta)
    assert toy.state.poisoned is None and unchanged(toy, before) == []
    torch.testing.assert_close(toy.forward.outputs(4)[1].clone(), want[1])  # the replay ran whole


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_compiled_forward_splits_at_its_regions(compiler, backend, device, gen):
    # Regression: issue 51, a region inside a torch.compile'd forward failed with graphctl's internal "trying to pop
    # from empty mode stack" (emulated); dynamo traced through it (CUDA): no pieces, the region's host sync captured.
    torch._dynamo.reset()
    w1, w2 = torch.randn(H, H, generator=gen).to(device), torch.randn(H, H, generator=gen).to(device)
    seen = []

    @graphctl.eager
    def route(h):
        seen.append(h.shape[0])
        top = int(h.abs().sum(1).argmax())  # a host sync: legal only in a region
        return h * (1 + top % 3)

    def fwd(x):
        h = torch.tanh(x @ w1)
        return torch.relu(route(h) @ w2)

    cf = torch.compile(fwd, backend=compiler, dynamic=False)
    run = graphctl.graphed(cf, buckets=[2, 4], backend=backend, progress=False)
    run.capture_all(torch.randn(4, H, generator=gen).to(device))
    assert [len(run.graph(b).regions) for b in (2, 4)] == [1, 1]
    for n in (1, 3, 4):
        x = torch.randn(n, H, generator=gen).to(device)
        want = fwd(x.clone()).clone()
        for t in run.outputs(run.buckets.pick(n)):
            t.fill_(float("nan"))
        seen.clear()
        torch.testing.assert_close(run(x).clone(), want, rtol=1e-4, atol=1e-5)
        assert seen == [run.buckets.pick(n)]
    rep = run.report()
    assert rep.uncompiled == 0 and all(r.pieces == 2 for r in rep.buckets), str(rep)
    assert all(st["breaks"] >= 1 for st in rep.compile.values()), rep.compile  # the region's graph break
    assert all(r.ok for r in run.verify())
    torch._dynamo.reset()


def test_a_host_sync_inside_a_compiled_callable_is_refused_at_its_line(gen):
    # Regression: issue 51, the emulated backend ran compiled callables opaquely: an `.item()` in one passed on the
    # CPU and failed on the GPU (a CUDA capture cannot hold it).
    torch._dynamo.reset()

    def scale(h):
        return h * float(h.abs().max())  # a host read of a device value, inside compiled code

    cs = torch.compile(scale, backend="aot_eager", dynamic=False)

    def fwd(x):
        return cs(x + 1) - 1

    run = graphctl.graphed(fwd, buckets=[2], backend="emulated", progress=False)
    with pytest.raises(CaptureError, match="illegal under graph capture") as err:
        run.capture_all(torch.randn(2, H, generator=gen))
    assert "test_regions.py" in err.value.where, err.value.where
    torch._dynamo.reset()


def test_a_host_value_a_compiled_callable_reads_is_baked_as_a_cuda_graph_bakes_it(backend, device, gen):
    # Regression: issue 51, an emulated replay re-ran compiled code, re-reading a host value a CUDA graph had baked:
    # CPU CI saw the new value where the GPU keeps the capture's.
    torch._dynamo.reset()

    class Cfg:
        factor = 2.0

    cfg = Cfg()
    cf = torch.compile(lambda x: x * cfg.factor, backend="aot_eager", dynamic=False)
    run = graphctl.graphed(lambda x: cf(x) + 0, buckets=[2], backend=backend, progress=False)
    run.capture_all(torch.randn(2, H, generator=gen).to(device))
    cfg.factor = 3.0
    x = torch.randn(2, H, generator=gen).to(device)
    torch.testing.assert_close(run(x).clone(), x * 2.0)  # the capture's value, on either backend
    torch._dynamo.reset()


def test_a_region_returning_another_structure_is_refused(gen):
    # Regression: issue 51, only the number of results was compared: a dict with other keys (or a list for a tuple)
    # was matched by position, its values reaching the wrong pieces.
    keys = {"names": ("a", "b")}

    @graphctl.eager
    def named(h):
        return {k: h * (i + 1) for i, k in enumerate(keys["names"])}

    def fwd(x):
        out = named(x * 1)
        return out["a"] - out["b"] if "a" in out else x

    run = graphctl.graphed(fwd, buckets=[2], backend="emulated", progress=False)
    run.capture_all(torch.randn(2, H, generator=gen))
    x = torch.randn(2, H, generator=gen)
    torch.testing.assert_close(run(x).clone(), fwd(x.clone()))
    for names in (("a", "c"), ("b", "a")):  # another key, or the same keys in another order (matched by position)
        keys["names"] = names
        with pytest.raises(ReplayError, match="another structure") as err:
            run(x)
        assert err.value.buffer.endswith("named") and f"'{names[0]}', '{names[1]}'" in err.value.found
