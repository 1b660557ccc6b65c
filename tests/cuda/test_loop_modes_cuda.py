"""Draft-loop modes on CUDA graphs (H200/H100): unrolled, per_step and device_loop propose the
same tokens with the oracle's acceptance; the device loop (a WHILE node in the graph) stops at
the step its reference says for planted thresholds, changed between replays without
recapture; body restrictions are refused by name."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import CaptureError
from graphctl.graphs.capture.conditional import DeviceLoop
from graphctl.models import draft_confidences, dynamic_of, expected_dynamic, graphed_step
from support.engine import acceptance, dynamic_setup, thresholds, trace

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("k,bs", [(1, 3), (3, 8), (7, 5)])
def test_three_modes_propose_the_same_tokens_cuda(k, bs, gen):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    want_h, want_d = trace("eager", k=k, bs=bs, seed=seed, device="cuda", backend="cuda")
    for mode in ("unrolled", "per_step", "device_loop"):
        h, d = trace(mode, k=k, bs=bs, seed=seed, device="cuda", backend="cuda")
        assert [x.tolist() for x in h] == [x.tolist() for x in want_h], mode
        assert all(torch.equal(a, b) for a, b in zip(d, want_d)), mode
        assert acceptance(h) == k + 1, mode


def test_device_loop_graph_stops_where_its_reference_says(gen):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    k, bs = 5, 6
    eng, ids = dynamic_setup(k=k, bs=bs, seed=seed, device="cuda")
    drafts, conf = draft_confidences(eng, ids.cuda())
    f = graphed_step(eng, "device_loop", buckets=(8,), backend="cuda")
    dyn = dynamic_of(f)
    f(ids.cuda(), eng.meta)  # capture at threshold 0
    census = f.census(8)
    assert census["types"].get("conditional") == 1, census
    # the loop body is read too: its draft-step kernels and the predicate are in the census
    assert any("loop_condition" in name for name in census["kernels"]), census["kernels"]
    loop = next(n for n in f.nodes(8) if n.kind == "conditional")
    assert len(loop.body) > 10 and not loop.note, loop
    audit = f.audit()[8]
    assert not audit.findings, str(audit)
    assert "kv_lens" in audit.usage["draft"], str(audit)  # written inside the body, attributed to draft
    seen = set()
    for t in thresholds(conf):
        dyn.set_threshold(t)  # a device scalar: the same graph, no recapture
        out = f(ids.cuda(), eng.meta)
        steps, props = expected_dynamic(drafts, conf, t)
        assert int(dyn.counter) == steps, (t, conf)
        assert torch.equal(out.drafts.cpu(), props), (t, out.drafts, props)
        seen.add(steps)
    assert {1, k} <= seen
    assert len(f.captured) == 1 and f.graph(8).node_count > 0


def _loop_forward(body_extra):
    loop = DeviceLoop(torch.device("cuda"))
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    active = torch.ones(4, dtype=torch.bool, device="cuda")

    def fwd(x):
        counter.zero_()

        def body():
            x.add_(1)
            body_extra(x)
            counter.add_(1)

        loop.run(body, lambda flag, h: graphctl.ops.loop_condition_(flag, counter, 3, active, h), 3)
        return x * 2

    return fwd


def test_device_loop_runs_the_body_the_device_decides():
    f = graphctl.graphed(_loop_forward(lambda x: None), buckets=[4], backend="cuda", progress=False, inputs=["x"])
    x = torch.zeros(4, 2, device="cuda")
    out = f(x)
    assert torch.equal(out, torch.full((4, 2), 6.0, device="cuda"))  # three iterations of +1, then *2
    out = f(x)
    assert torch.equal(out, torch.full((4, 2), 6.0, device="cuda"))  # the static input is reloaded per call


def test_rng_in_the_loop_body_is_refused():
    f = graphctl.graphed(_loop_forward(lambda x: x.add_(torch.rand_like(x))), buckets=[4], backend="cuda",
                         progress=False, inputs=["x"], warmup_iters=1)
    with pytest.raises(CaptureError) as e:
        f(torch.zeros(4, 2, device="cuda"))
    assert "random numbers inside a device-loop body" in str(e.value) + str(e.value.__cause__)


def test_a_side_stream_inside_the_loop_body_joins_the_body():
    # A side stream that forks from and joins the body stream becomes a branch of the body graph
    # (no event nodes), which a conditional body may hold: the loop still runs three times.
    side = torch.cuda.Stream()

    def extra(x):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul_(1)
        torch.cuda.current_stream().wait_stream(side)

    f = graphctl.graphed(_loop_forward(extra), buckets=[4], backend="cuda", progress=False, inputs=["x"],
                         warmup_iters=1)
    assert torch.equal(f(torch.zeros(4, 2, device="cuda")), torch.full((4, 2), 6.0, device="cuda"))


def test_an_event_node_in_the_loop_body_is_refused_by_name():
    # External events are recorded as event nodes (what NCCL and cross-graph sync produce), which
    # a conditional body cannot hold; graphctl names the node type instead of failing at launch.
    ev = torch.cuda.Event(external=True)
    f = graphctl.graphed(_loop_forward(lambda x: ev.record()), buckets=[4], backend="cuda", progress=False,
                         inputs=["x"], warmup_iters=1)
    with pytest.raises(CaptureError) as e:
        f(torch.zeros(4, 2, device="cuda"))
    msg = str(e.value) + str(e.value.__cause__)
    assert ("conditional body cannot" in msg and "EventRecord" in msg) or "event nodes" in msg, msg
