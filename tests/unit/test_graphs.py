"""The graphs layer on the emulated backend (CPU): replay equals eager at every bucket, padding
never leaks, frozen addresses and arguments are checked, capture failures leave nothing
behind, capture-illegal operations are named with their line, and the emulated recorder
keeps CUDA-graph semantics (frozen rebinds, frozen host scalars, fresh tensors unseen)."""
from __future__ import annotations

import json
import logging

import pytest
import torch

import graphctl
from graphctl import CaptureError, ReplayError, StaticInput
from graphctl.graphs import SCHEMA
from support.graphs import Toy, check_capture_failure_restores, check_replay_matches_eager


@pytest.fixture
def toy(gen):
    return Toy("cpu", gen)


@pytest.fixture
def any_toy(backend, device, gen):
    """The toy step on each graph backend (CUDA: a larger one, buckets to 64)."""
    if backend == "cuda":
        return Toy(device, gen, S=64, k=3, H=32, buckets=(1, 2, 4, 8, 16, 32, 64), backend="cuda")
    return Toy(device, gen)


def test_replay_equals_eager_at_every_bucket(any_toy, backend, gen):
    # Replay must equal eager at every bucket and inside it (padding live), on each backend.
    top = any_toy.forward.buckets.largest
    sizes = [int(torch.randint(1, top + 1, (1,), generator=gen)) for _ in range(6)]
    sizes += list(any_toy.forward.buckets.sizes)
    check_replay_matches_eager(any_toy, sizes + [3, 5])
    assert any_toy.forward.captured == tuple(any_toy.forward.buckets.sizes)
    assert any_toy.forward.report().backend == backend
    assert sum(b.replays for b in any_toy.forward.report().buckets) == len(sizes) + 2


def test_shrinking_and_growing_batches_never_see_stale_padding(any_toy):
    # A smaller batch after a larger one must never read the larger one's rows as its padding.
    top = any_toy.forward.buckets.largest
    check_replay_matches_eager(any_toy, [top, 3, top // 2 + 1, 1, top, 2, top - 1, 5])


def test_segments_are_target_then_draft(toy):
    check_replay_matches_eager(toy, [4])
    segs = toy.forward.segments(4)
    assert [s.name for s in segs] == ["target", "draft"]
    assert segs[0].start == 0 and segs[0].end == segs[1].start and segs[1].end == toy.forward.graph(4).node_count
    ops = toy.forward.graph(4).op_names()
    if graphctl.ops.uses_extension():  # the fused ops are recorded as single ops, opening and closing the draft
        assert ops[segs[1].start] == "graphctl::swap_through_" and ops[segs[1].end - 1] == "graphctl::copy_", ops
        assert "graphctl::swap_through_" not in ops[: segs[1].start]


def test_draft_twin_refreshed_before_every_replay(toy, gen):
    # The graph baked the draft twin's address; new draft-manager contents reach it only
    # through the runner's refresh switch around replay.
    check_replay_matches_eager(toy, [5])
    pool = toy.meta.draft_kv_cache_manager.pool_indices
    for _ in range(3):
        tokens, positions = toy.batch(5)
        pool.copy_(torch.randint(0, 1000, pool.shape, generator=gen, dtype=torch.int32))
        _, want = toy.eager(tokens, positions)
        _, got = toy.forward(tokens, positions, toy.meta)
        torch.testing.assert_close(got.clone(), want)


def test_mutable_buffers_do_not_accumulate_across_warmup_and_capture(gen):
    # Regression: TensorRT-LLM's kv_lens_cuda += 1 accumulated across warmup and capture runs.
    toy = Toy("cpu", gen)
    st = toy.state

    def step(tokens, positions, meta):
        meta.kv_lens.add_(1)  # the graph mutates a mutable buffer every run
        return tokens * 2

    f = graphctl.graphed(step, buckets=[2, 4, 8], state=st, inputs=[StaticInput("tokens", per_item=3),
                                                                    StaticInput("positions", per_item=3)],
                         backend="emulated", warmup_iters=3, progress=False)
    tokens, positions = toy.batch(3)
    before = toy.meta.kv_lens.clone()
    f.capture_all(tokens, positions, toy.meta)
    assert torch.equal(toy.meta.kv_lens, before), "warmup/capture runs leaked into kv_lens"
    f(tokens, positions, toy.meta)
    assert torch.equal(toy.meta.kv_lens, before + 1), "a replay must keep what the graph writes"


@pytest.mark.parametrize("iters,want", [(2, {8: 3, 4: 2, 2: 2}), (3, {8: 4, 4: 2, 2: 2}), (0, {8: 1, 4: 1, 2: 1})])
def test_warmup_iters_run_at_the_largest_bucket_and_once_at_each_smaller(gen, iters, want):
    # Issue 32: every bucket ran warmup_iters eager runs (tracked): a smaller bucket's second run did nothing its
    # first and the largest bucket's had not, and cost a tracked forward a bucket of capture time.
    toy = Toy("cpu", gen)
    runs: dict[int, int] = {}

    def fwd(tokens, positions, meta):
        runs[tokens.shape[0] // 3] = runs.get(tokens.shape[0] // 3, 0) + 1
        return tokens * 2

    f = graphctl.graphed(fwd, buckets=[2, 4, 8], state=toy.state, warmup_iters=iters, backend="emulated",
                         inputs=[StaticInput("tokens", per_item=3), StaticInput("positions", per_item=3)],
                         progress=False)
    f.capture_all(*toy.batch(5), toy.meta)
    assert runs == want  # warmups and the capture's run (the emulated recorder executes the forward)


def test_each_bucket_is_captured_from_the_callers_state(gen):
    # Regression: a smaller bucket's example padding zeroed live rows that a larger bucket's capture then saw.
    toy = Toy("cpu", gen)
    seen: dict[int, list[torch.Tensor]] = {}

    def fwd(tokens, positions, meta):
        seen.setdefault(tokens.shape[0] // 3, []).append(meta.seq_lens.clone())
        return tokens * 2

    f = graphctl.graphed(fwd, buckets=[2, 4, 8], state=toy.state, warmup_iters=1, backend="emulated",
                         inputs=[StaticInput("tokens", per_item=3), StaticInput("positions", per_item=3)],
                         progress=False)
    tokens, positions = toy.batch(5)
    want = toy.meta.seq_lens.clone()
    f.capture_all(tokens, positions, toy.meta)
    assert sorted(seen) == [2, 4, 8] and all(len(v) == 2 for v in seen.values())  # one warmup, one capture
    for b, snaps in seen.items():
        m = min(5, b)
        for s in snaps:
            # live rows as the caller set them, [m:b] padded, rows past the bucket untouched
            assert torch.equal(s[:m], want[:m]) and not s[m:b].any() and torch.equal(s[b:], want[b:]), (b, s.tolist())
    assert torch.equal(toy.meta.seq_lens, want)


def test_capture_failure_restores_and_keeps_nothing(backend, device, gen):
    # A capture that fails must restore the state, keep no graph, and (CUDA) leave the RNG usable.
    check_capture_failure_restores(lambda: Toy(device, gen, backend=backend), gen)
    if backend == "cuda":
        a = torch.randn(16, device="cuda")
        torch.cuda.synchronize()
        assert torch.isfinite(a).all()


def test_failure_in_a_smaller_bucket_drops_the_larger_ones_too(gen):
    # A capture_all that failed half-way must not leave a runner with holes in its buckets.
    w = torch.randn(4, 4, generator=gen)
    capturing = graphctl.state.phase.capturing

    def fwd(x):
        if x.shape[0] == 2 and capturing(x.device):
            raise RuntimeError("bucket 2 cannot be captured")
        return x @ w

    f = graphctl.graphed(fwd, buckets=[2, 4, 8], backend="emulated", progress=False)
    x = torch.randn(3, 4, generator=gen)
    with pytest.raises(CaptureError, match="bucket 2"):
        f.capture_all(x)
    assert f.captured == ()
    with pytest.raises(CaptureError, match="bucket 2"):  # the next call tries again, from scratch
        f(x)


def test_var_arguments_are_bound_by_name(gen):
    w = torch.randn(4, 4, generator=gen)

    @graphctl.graphed(buckets=[4], inputs=["x"], backend="emulated", progress=False)
    def f(x, *extra, scale=1.0, **opts):
        return x @ w * scale + sum(extra)

    x = torch.randn(3, 4, generator=gen)
    torch.testing.assert_close(f(x, 1.0, 2.0, scale=0.5, tag="a").clone(), x @ w * 0.5 + 3.0)
    with pytest.raises(ReplayError, match="extra"):
        f(x, 1.0, 5.0, scale=0.5, tag="a")


def test_decorated_method_gets_a_runner_per_instance(gen):
    class Model:
        def __init__(self, toy):
            self.toy, self.meta, self.state = toy, toy.meta, toy.state  # a bound state (or an object to bind)

        @graphctl.graphed(buckets=[2, 4], state="state", backend="emulated", progress=False,
                          inputs=[StaticInput("tokens", per_item=3), StaticInput("positions", per_item=3)])
        def forward(self, tokens, positions, meta):
            return self.toy._forward(tokens, positions, meta)

    a, b = Model(Toy("cpu", gen)), Model(Toy("cpu", gen))
    assert a.forward is a.forward and a.forward is not b.forward and a.forward.state.obj is a.meta
    for m in (a, b):
        tokens, positions = m.toy.batch(3)
        want = m.toy.eager(tokens, positions)
        got = [t.clone() for t in m.forward(tokens, positions, m.meta)]
        torch.testing.assert_close(got, list(want))
    with pytest.raises(graphctl.DeclarationError, match="names an attribute"):
        Model.forward(a, *a.toy.batch(1), a.meta)  # through the class: no instance to name the state on


def test_address_change_is_detected_before_first_replay(toy):
    tokens, positions = toy.batch(3)
    toy.forward.capture_all(tokens, positions, toy.meta)
    toy.meta.slot_mapping = toy.meta.slot_mapping.clone()  # rebinding: the graph keeps reading the old storage
    with pytest.raises(ReplayError, match="slot_mapping"):
        toy.forward(tokens, positions, toy.meta)


def test_address_change_after_first_replay_needs_the_debug_knob(toy):
    tokens, positions = toy.batch(3)
    toy.forward(tokens, positions, toy.meta)
    toy.meta.seq_lens = toy.meta.seq_lens.clone()
    with graphctl.knobs.scope(check_manifest=True):
        with pytest.raises(ReplayError, match="seq_lens"):
            toy.forward(tokens, positions, toy.meta)


def test_frozen_argument_checked_every_call(gen):
    w = torch.randn(4, 4, generator=gen)

    @graphctl.graphed(buckets=[2, 4], inputs=["x"], backend="emulated", progress=False)
    def f(x, weight, scale=1.0):
        return x @ weight * scale

    x = torch.randn(3, 4, generator=gen)
    torch.testing.assert_close(f(x, w).clone(), x @ w)
    with pytest.raises(ReplayError, match="weight"):
        f(x, w.clone())  # same values, another address: the graph would read the old one
    with pytest.raises(ReplayError, match="scale"):
        f(x, w, scale=2.0)  # a host scalar is baked into the graph


def test_batch_beyond_largest_bucket_raises_or_falls_back_logged(gen, caplog):
    w = torch.randn(4, 4, generator=gen)
    strict = graphctl.graphed(lambda x: x @ w, buckets=[1, 2], backend="emulated", progress=False)
    loose = graphctl.graphed(lambda x: x @ w, buckets=[1, 2], backend="emulated", fallback="eager", progress=False)
    x = torch.randn(2, 4, generator=gen)
    strict(x), loose(x)
    big = torch.randn(5, 4, generator=gen)
    with pytest.raises(ReplayError, match="n = 5"):
        strict(big)
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        out = loose(big)
    torch.testing.assert_close(out, big @ w)
    assert any("runs eagerly" in r.message and "n = 5" in r.message for r in caplog.records)
    assert sum(loose.report().fallbacks.values()) == 1
    with pytest.raises(ReplayError, match="does not fit"):
        strict(torch.randn(2, 4, generator=gen).double())


def test_bare_decorator_every_tensor_argument_is_an_input(gen):
    w = torch.randn(4, 3, generator=gen)

    @graphctl.graphed
    def f(x, y):
        return torch.relu(x @ w) + y

    for n in (1, 7, 64, 200):
        x, y = torch.randn(n, 4, generator=gen), torch.randn(n, 3, generator=gen)
        torch.testing.assert_close(f(x, y).clone(), torch.relu(x @ w) + y)
    assert f.captured == graphctl.graphs.DEFAULT_BUCKETS and isinstance(f, graphctl.GraphRunner)


@pytest.mark.parametrize("body, op", [
    (lambda x: x * float(x.sum()), "_local_scalar_dense"),
    (lambda x: x[:, : int(x.argmax()) % 2 + 1], "_local_scalar_dense"),
    (lambda x: x * 2 if bool((x > 0).any()) else x, "is_nonzero|_local_scalar_dense"),
    (lambda x: x[torch.nonzero(x > 0)[:, 0]], "nonzero"),
    (lambda x: x * 2 if torch.equal(x, x) else x, "equal"),
], ids=["item", "int", "bool", "nonzero", "equal"])
def test_capture_illegal_operations_are_named_with_their_line(body, op, gen):
    f = graphctl.graphed(body, buckets=[2], backend="emulated", warmup_iters=0, progress=False)
    with pytest.raises(CaptureError, match=op) as ei:
        f(torch.randn(2, 3, generator=gen))
    assert "test_graphs.py:" in ei.value.where, ei.value.where
    assert f.captured == ()


def test_emulated_replay_ignores_python_rebinding_and_fresh_tensors(gen):
    # What a CUDA graph does: it reads the storages recorded at capture, nothing else (with the path check off;
    # on, the rebinding is named before the replay: tests/regressions/test_field_bugs.py).
    holder = {"bias": torch.randn(3, generator=gen)}
    scale = [2.0]

    @graphctl.graphed(buckets=[4], backend="emulated", progress=False)
    def f(x):
        return x * scale[0] + holder["bias"]

    x = torch.randn(4, 3, generator=gen)
    bias0 = holder["bias"].clone()
    torch.testing.assert_close(f(x).clone(), x * 2.0 + bias0)
    holder["bias"] = torch.randn(3, generator=gen)  # a fresh tensor: never seen by the replay
    scale[0] = 5.0  # a host scalar read at capture: frozen
    x2 = torch.randn(4, 3, generator=gen)
    with pytest.raises(ReplayError, match=r"holder\['bias'\]"):
        f(x2)
    with graphctl.knobs.scope(check_paths=False):
        torch.testing.assert_close(f(x2).clone(), x2 * 2.0 + bias0)


def test_in_place_and_view_ops_replay_onto_the_same_storage(gen):
    acc = torch.zeros(4, 3)
    acc.add_(torch.randn(4, 3, generator=gen))

    @graphctl.graphed(buckets=[4], backend="emulated", warmup_iters=0, progress=False)
    def f(x):
        v = acc.view(12)[:6]
        v.mul_(2)
        return (x + acc).t()

    x = torch.randn(4, 3, generator=gen)
    start = acc.clone()
    out = f(x).clone()  # capture ran it once, then the call replayed it: two doublings of the view
    want = start.clone()
    want.view(12)[:6].mul_(4)
    assert torch.equal(acc, want)
    torch.testing.assert_close(out, (x + acc).t())


def test_report_json_schema(toy):
    check_replay_matches_eager(toy, [3])
    toy.forward.measure(iters=3)
    d = json.loads(toy.forward.report().to_json())
    assert d["schema"] == SCHEMA and d["backend"] == "emulated" and d["device"] == "cpu"
    assert d["host_changes"] == [] and d["bypassed"] is False and d["eager_streak"] == 0  # no false alarm
    assert [b["bucket"] for b in d["buckets"]] == [1, 2, 4, 8, 16]
    for b in d["buckets"]:
        assert set(b) == {"bucket", "capture_ms", "pool_bytes", "nodes", "replay_us", "eager_us", "replays",
                          "segments", "eager_runs", "warmup_ms", "variant", "eager_regions"}
        assert b["variant"] == "" and b["eager_regions"] == []  # issue 33: a plain runner, whole graphs
        assert b["nodes"] > 0 and b["replay_us"] > 0 and b["eager_us"] > 0 and b["pool_bytes"] > 0
        assert b["warmup_ms"] > 0  # issue 32: each bucket's warmup cost, next to its capture's
        assert [s["name"] for s in b["segments"]] == ["target", "draft"]
    text = str(toy.forward.report())
    assert "bucket" in text and "emulated" in text and "warmup ms" in text


def test_mutable_state_unchanged_by_measure(toy):
    tokens, positions = toy.batch(3)
    toy.forward(tokens, positions, toy.meta)
    before = {n: toy.state.tensor(n).clone() for n in toy.state.mutable_names()}
    toy.forward.measure(iters=2)
    for n, t in before.items():
        assert torch.equal(toy.state.tensor(n), t), n


def test_verify_passes_on_a_correct_forward_at_every_bucket(toy):
    tokens, positions = toy.batch(3)
    toy.forward.capture_all(tokens, positions, toy.meta)
    results = toy.forward.verify(gen=torch.Generator().manual_seed(7))
    assert {r.bucket for r in results} == {1, 2, 4, 8, 16} and all(r.ok for r in results), [str(r) for r in results]
    assert any(r.n < r.bucket for r in results)  # padding exercised


def test_verify_names_the_output_and_index_a_frozen_host_value_breaks(gen):
    scale = [2.0]
    w = torch.randn(4, 4, generator=gen)

    @graphctl.graphed(buckets=[2, 4], backend="emulated", progress=False)
    def f(x):
        return x @ w, x * scale[0]  # the second output bakes scale at capture

    f.capture_all(torch.randn(3, 4, generator=gen))
    assert all(r.ok for r in f.verify())
    scale[0] = 3.0  # eager sees the new value, the graph replays the old one
    bad = [r for r in f.verify()]
    assert bad and all(not r.ok and r.mismatch.output == "[1]" for r in bad), [str(r) for r in bad]
    assert "output [1] differs first at index" in str(bad[0])


def test_segment_audit_is_clean_on_a_forward_that_honours_its_readers(toy):
    tokens, positions = toy.batch(3)
    toy.forward.capture_all(tokens, positions, toy.meta)
    audits = toy.forward.audit()
    assert set(audits) == set(toy.forward.captured)
    assert not [f for a in audits.values() for f in a.errors], audits


def test_runner_pads_the_state_tails_before_every_replay(toy, gen):
    # Issue 14 (tests that could not fail): the tail the padding test checked was already zero, since
    # batch() writes seq_lens through state.write (which pads); here the tails hold garbage first.
    check_replay_matches_eager(toy, [4])
    for n in (3, 2, 1):
        tokens, positions = toy.batch(n)
        toy.meta.seq_lens[n:].fill_(77)  # behind graphctl's back: only the runner's pad can clean it
        toy.meta.kv_lens[n:].fill_(77)
        toy.forward(tokens, positions, toy.meta)
        b = toy.forward.buckets.pick(n)
        assert torch.equal(toy.meta.seq_lens[n:b], torch.zeros_like(toy.meta.seq_lens[n:b])), n
        assert torch.equal(toy.meta.kv_lens[n:b], torch.zeros_like(toy.meta.kv_lens[n:b])), n
        toy.state.pad({"seq": n})  # leave the state consistent for the next round
        toy.state.check()


def test_verify_poisons_outputs_before_the_replay(gen):
    # Issue 14 (tests that could not fail): nothing failed when verify's output poisoning was removed. A
    # forward whose graph never writes its output (a host flag was False at capture) leaves the static
    # output holding what the eager run just wrote: only poisoning tells the replay did not write it.
    out = torch.zeros(8, 4)
    flag = [False]

    def fwd(x):
        if flag[0]:
            out[: x.shape[0]].copy_(x * 2)
        return out[: x.shape[0]]

    r = graphctl.graphed(fwd, buckets=[4, 8], inputs=["x"], backend="emulated", progress=False)
    r.capture_all(torch.randn(8, 4, generator=gen))
    flag[0] = True
    res = r.verify(gen=torch.Generator().manual_seed(1))
    assert not all(v.ok for v in res), [str(v) for v in res]


def test_every_bucket_is_captured_into_one_shared_pool(gen, monkeypatch):
    # Issue 14 (tests that could not fail): nothing failed when the shared pool became one pool per bucket.
    from graphctl.graphs.backends.emulated import EmulatedBackend

    pools, seen = [], []
    real_capture = EmulatedBackend.capture
    monkeypatch.setattr(EmulatedBackend, "new_pool", lambda self: pools.append(object()) or pools[-1])
    monkeypatch.setattr(EmulatedBackend, "capture",
                        lambda self, body, pool, *rest: seen.append(pool) or real_capture(self, body, pool, *rest))
    toy = Toy("cpu", gen)
    check_replay_matches_eager(toy, [3])
    assert len(pools) == 1 and len(seen) == 5 and all(p is pools[0] for p in seen)


def test_garbage_collection_is_off_during_capture(gen):
    # Issue 14 (tests that could not fail): nothing failed when GC was left on during capture.
    import gc

    states = []

    def fwd(x):
        if graphctl.state.phase.is_recording():
            states.append(gc.isenabled())
        return x + 1

    r = graphctl.graphed(fwd, buckets=[2, 4], inputs=["x"], backend="emulated", progress=False)
    assert gc.isenabled()
    r.capture_all(torch.randn(4, 2, generator=gen))
    assert states == [False, False] and gc.isenabled()
