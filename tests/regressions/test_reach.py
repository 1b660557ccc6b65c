"""What graphctl reaches behind a forward (issue 31): one walk, no silent caps, writes seen on
every warmup and wherever the tensor lives."""
from __future__ import annotations

import logging
import types

import pytest
import torch

import graphctl


class _Meta:
    pass


class _Engine:
    def __init__(self, device: str, n: int) -> None:
        self.a = _Meta()
        self.a.b = [torch.rand(4).to(device)]  # metadata three steps deep
        self.many = [torch.rand(4).to(device) for _ in range(n)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.a.b[0]
        for t in self.many:
            y = y + t
        return y


@pytest.mark.parametrize("which", ["deep", "last"])
def test_a_rebind_past_the_path_cap_or_deep_is_named_not_replayed_stale(backend, device, which):
    # Issue 31: with 300 tensors in a list, the path check kept the 256 shortest paths and walked lists to item 255:
    # rebinding self.a.b[0] or self.many[299] after capture replayed the old tensor silently.
    eng = _Engine(device, 300)
    f = graphctl.graphed(eng.forward, buckets=[2], inputs=["x"], backend=backend, progress=False)
    x = torch.randn(2, 4).to(device)
    f.capture_all(x)
    assert torch.allclose(f(x).clone(), eng.forward(x))
    if which == "deep":
        eng.a.b[0] = torch.rand(4).to(device)
        where = "self.a.b[0]"
    else:
        eng.many[299] = torch.rand(4).to(device)
        where = "self.many[299]"
    with pytest.raises(graphctl.ReplayError, match="rebound since the capture") as ei:
        f(x)
    assert where in str(ei.value)
    assert f.report().reach["paths_checked"] == 301 and f.report().reach["paths_unchecked"] == 0


def test_a_path_cap_that_bites_is_reported_with_its_count_and_drops_module_buffers_first(backend, device,
                                                                                          monkeypatch, caplog):
    # Issue 31: the path cap dropped paths by length and said nothing; now it drops by role and says how many.
    from graphctl.graphs.replay import rebinding

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(3):
                self.register_buffer(f"buf{i}", torch.rand(4))
            self.meta = [torch.rand(4, device=device) for _ in range(3)]  # a plain list: .to() leaves it

        def forward(self, x):
            return x + self.buf0 + self.buf1 + self.buf2 + self.meta[0] + self.meta[1] + self.meta[2]

    model = Model().to(device)
    monkeypatch.setattr(rebinding, "MAX_PATHS", 4)
    f = graphctl.graphed(model.forward, buckets=[2], inputs=["x"], backend=backend, progress=False)
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(2, 4).to(device))
    assert any("2 paths past the 4 checked per replay (2 buffer)" in r.getMessage() for r in caplog.records)
    rep = f.report()
    assert rep.reach["paths_checked"] == 4 and rep.reach["paths_unchecked"] == 2
    model.meta[2] = torch.rand(4).to(device)  # every metadata path is kept: its rebinding is named
    with pytest.raises(graphctl.ReplayError, match=r"self\.meta\[2\]"):
        f(torch.randn(2, 4).to(device))


def test_writes_in_another_modules_dict_and_from_the_second_warmup_on_are_restored(backend, device):
    # Issue 31: a write to a tensor in another module's dict was only an unreached read, and a write that started on
    # the second warmup was never seen (only each bucket's first warmup was tracked): both ended capture advanced.
    other = types.ModuleType("other_library")
    other.RING = {"buf": torch.rand(4).to(device)}

    class Model:
        def __init__(self) -> None:
            self.late = torch.rand(4).to(device)
            self.count = 0

        def forward(self, x):
            other.RING["buf"].add_(2)
            self.count += 1
            if self.count > 1:
                self.late.add_(3)
            return x * 2

    m = Model()
    ring0, late0 = other.RING["buf"].clone(), m.late.clone()
    f = graphctl.graphed(m.forward, buckets=[4, 2], inputs=["x"], backend=backend, progress=False,
                         host_state="restore")
    f.capture_all(torch.randn(4, 3).to(device))
    assert torch.equal(other.RING["buf"], ring0), "the other module's tensor ended capture advanced"
    assert torch.equal(m.late, late0), "the tensor first written on the second warmup ended capture advanced"
    paths = [e.path for e in f.side_effects]
    assert "self.late" in paths
    assert any(p.startswith("(no path) a float32 tensor of shape [4]") for p in paths), paths
    strict = graphctl.graphed(Model().forward, buckets=[2], inputs=["x"], backend=backend, progress=False,
                              side_effects="error")
    with pytest.raises(graphctl.CaptureError, match="writes state graphctl does not own") as ei:
        strict.capture_all(torch.randn(2, 3).to(device))
    assert "(no path)" in str(ei.value)


def test_a_compiled_warmup_writing_what_the_tracked_run_did_not_is_reported_unrestorable(caplog):
    # Issue 31: a compiled forward's compiled warmups run untracked; a write only they make was invisible.
    state = {"n": 0, "late": torch.zeros(4)}

    def body(x):
        if state["n"] >= 1:  # host state: dynamo guards on it, the eager tracked run took the other branch
            state["late"].add_(1)
        return x * 2

    compiled_body = torch.compile(body, backend="eager", dynamic=False)

    def forward(x):
        out = compiled_body(x)
        state["n"] += 1
        return out

    f = graphctl.graphed(forward, buckets=[2], inputs=["x"], backend="emulated", progress=False,
                         host_state="restore")
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(2, 3))
    assert any("compiled warmups wrote state" in r.getMessage() and "late" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert [e.op for e in f.side_effects if e.path == "state['late']"] == \
        ["(a compiled run: untracked, cannot restore)"]


def test_a_capture_walks_the_objects_twice(backend, device, monkeypatch):
    # Issue 31: one capture_all of 9 buckets walked the forward's objects 13 times with four walkers.
    from graphctl.graphs.findings import reach

    calls = []
    real = reach.walk
    monkeypatch.setattr(reach, "walk", lambda *a, **k: calls.append(1) or real(*a, **k))
    eng = _Engine(device, 3)
    f = graphctl.graphed(eng.forward, buckets=[1, 2, 3, 4, 5, 6, 7, 8, 9], inputs=["x"], backend=backend,
                         progress=False)
    f.capture_all(torch.randn(9, 4).to(device))
    assert len(calls) == 2


def test_the_full_tracker_runs_once_per_forward_unless_buckets_hold_padding(backend, device, monkeypatch):
    # Issue 32: every bucket's first warmup ran under the full tracker (reads, taint: ~8x an eager step on an HF
    # model); only buckets with padded rows can differ there, the rest need its writes only.
    from graphctl.graphs.findings import ledger

    full = []
    real = ledger.Track

    def make(*args, **kwargs):  # every tracked run's Track: lean ones have no padded inputs to follow
        track = real(*args, **kwargs)
        full.append(not track.lean)
        return track

    monkeypatch.setattr(ledger, "Track", make)
    eng = _Engine(device, 3)
    f = graphctl.graphed(eng.forward, buckets=[1, 2, 4, 8], inputs=["x"], backend=backend, progress=False)
    f.capture_all(torch.randn(8, 4).to(device))  # 8 items: no bucket is padded
    assert sum(full) == 1 and len(full) == 5, full  # 2 warmups at bucket 8, 1 at each other: tracked, one in full
    full.clear()
    g = graphctl.graphed(eng.forward, buckets=[1, 2, 4, 8], inputs=["x"], backend=backend, progress=False)
    g.capture_all(torch.randn(3, 4).to(device))  # 3 items: buckets 4 and 8 are padded
    assert sum(full) == 2, full
