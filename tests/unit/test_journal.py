"""Warmups undone on declared lasting state by the rows they wrote (``graphctl/graphs/findings/journal.py``,
issue 32: ``capture_all`` copied both whole KV caches first, 2 GiB at llama-1b's 64 x 512 tokens,
where a hand capture copies nothing)."""
from __future__ import annotations

import pytest
import torch

from graphctl.graphs.findings.reach import storage_key
from graphctl.graphs.findings.side_effects import Writes
from graphctl.graphs.findings.stream import OpStream, Track


def _tracked(pool: torch.Tensor, body) -> Writes:
    """``body`` run under a lean op stream whose side-effect watcher journals ``pool``."""
    tracker = Writes(Track({}, set(), None, [], {storage_key(pool): pool}))
    with OpStream([tracker], lean=True):
        body()
    return tracker


def _writes(pool: torch.Tensor, gen: torch.Generator):
    """A forward's writes into a cache pool [blocks, 8, 4]: by index, by indices (a duplicate slot
    included), scatter, a slice, an out= result, each over what the one before wrote."""
    flat = pool.view(-1, 4)
    slots = torch.randperm(flat.shape[0], generator=gen)[:5]
    slots[4] = slots[0]  # two tokens at one slot: both read the same old row

    def body() -> None:
        flat.index_copy_(0, slots[:4], torch.randn(4, 4, generator=gen))
        flat[slots] = torch.randn(5, 4, generator=gen)
        flat.index_put_((slots,), torch.ones(5, 4), accumulate=True)
        pool[1].scatter_add_(0, torch.randint(0, 8, (3, 4), generator=gen), torch.rand(3, 4, generator=gen))
        pool[2, 3:5].copy_(torch.randn(2, 4, generator=gen))
        torch.add(pool[3, 0], 1.0, out=pool[3, 0])
        flat.index_fill_(0, slots[1:3], 7.0)
    return body


def test_a_journal_puts_back_every_kind_of_write_and_keeps_only_the_rows(gen):
    # Regression: issue 32, undoing a warmup's K/V writes needed a copy of the whole pool.
    pool = torch.randn(16, 8, 4, generator=gen)
    before = pool.clone()
    tracker = _tracked(pool, _writes(pool, gen))
    assert not torch.equal(pool, before)  # the writes landed
    kept = tracker.journal.nbytes
    assert 0 < kept < pool.nbytes // 4, kept  # rows, not the pool
    tracker.undo()
    assert torch.equal(pool, before)
    assert tracker.journal.nbytes == 0


def test_past_half_the_storage_a_journal_keeps_the_whole_storage_once(gen):
    pool = torch.randn(4, 8, 4, generator=gen)
    before = pool.clone()

    def body() -> None:
        for _ in range(6):  # each rewrites the whole pool: row pre-images would outgrow it
            pool.mul_(1.5)
        pool[0, 0].fill_(3.0)  # after the whole copy: nothing more kept
    tracker = _tracked(pool, body)
    assert tracker.journal.nbytes <= pool.nbytes * 3 // 2
    tracker.undo()
    assert torch.equal(pool, before)


def test_a_run_that_raises_partway_is_undone_by_rows(gen):
    from graphctl.graphs.findings.ledger import Ledger

    pool = torch.randn(16, 8, 4, generator=gen)
    before = pool.clone()
    body = _writes(pool, gen)

    def run() -> None:
        body()
        raise RuntimeError("boom inside the forward")
    with pytest.raises(RuntimeError, match="boom"):
        Ledger("restore", None).track(run, {}, set(), lambda: None, lean=True,
                                      journaled={storage_key(pool): pool})
    assert torch.equal(pool, before)


def _engine(device: str, seqs: int):
    from graphctl.integrations.hf import HFEngine
    from graphctl.integrations.hf.configs import hf_config

    return HFEngine.build(hf_config("tiny-llama"), draft_len=2, max_seqs=seqs, max_context=512, block_size=16,
                          device=device, dtype=torch.float32, seed=0)


def _pools(eng) -> list[torch.Tensor]:
    return [t for m in (eng.meta.kv_cache_manager, eng.meta.draft_kv_cache_manager) for t in (*m.k, *m.v)]


@pytest.mark.parametrize("pieced", [False, True], ids=["whole-graph", "eager-region"])
def test_capture_all_leaves_the_kv_caches_bitwise_without_copying_them_whole(backend, device, gen, pieced):
    # Regression: issue 32, capture_all cloned both KV caches whole before its passes (2.5 GiB of reserved growth
    # against a hand capture's 64 MiB on an H100); a capture that executes (emulated, or CUDA with an eager region
    # replaying its pieces) must still leave them as found.
    import graphctl
    from graphctl.models import graphed_step

    eng = _engine(device, seqs=64 if device == "cuda" else 16)
    n, k = 4, 2
    eng.meta.prepare(eng.state, torch.full((n,), k + 1, dtype=torch.int32), torch.full((n,), 40, dtype=torch.int32))
    ids = torch.randint(0, eng.cfg.vocab, (n * (k + 1),), generator=gen).to(device)

    @graphctl.eager
    def region(h):
        return h * float(h.abs().sum() > -1)  # a host read: only an eager region may do it

    def layers(input_ids, meta):
        return region(eng.run_layers(input_ids, eng.target_layers))

    if pieced:
        run = graphctl.graphed(layers, buckets=[n * (k + 1)], state=eng.state, backend=backend,
                               inputs=["input_ids"], progress=False, params=eng.named_tensors())
    else:
        run = graphed_step(eng, "unrolled", buckets=[1, 2, 4], backend=backend)
    (layers(ids, eng.meta) if pieced else eng.step(ids, eng.meta))  # library handles and workspaces made first
    for t in _pools(eng):
        t.copy_(torch.randn(t.shape, generator=gen))  # caches full of live data, never zeros
    before = [t.clone() for t in _pools(eng)]
    held = sum(t.nbytes for t in before)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    run.capture_all(ids, eng.meta)
    for i, (t, b) in enumerate(zip(_pools(eng), before)):
        assert torch.equal(t, b), f"cache tensor {i} changed by capture_all"
    if device == "cuda" and not pieced:
        peak = torch.cuda.max_memory_allocated() - base
        # rows of the warmups' writes, not a copy of the caches (the old guard and snapshot took two); the peak
        # still holds the capture stream's own cuBLAS workspace (32 MiB on a Hopper card), made by its first warmup
        assert peak < held, (peak, held)


def test_op_tensors_finds_what_pytree_finds_in_op_arguments(gen):
    # Regression (session 47): the tracker flattened every op's arguments with pytree's tree_flatten, half of a
    # tracked run's host time; its replacement must find the same tensors, in order, in every argument shape.
    from torch.utils._pytree import tree_flatten

    from graphctl.graphs.findings.journal import op_tensors

    a, b, c, d = (torch.randn(3, generator=gen) for _ in range(4))
    cases = [
        ((a, 1, 2.5, None), {}),  # a tensor among scalars
        ((a, [None, b, c]), {"accumulate": True}),  # Tensor?[] indices (index_put_)
        (([a, b], (c, [d])), {}),  # Tensor[] and nested results
        ((a,), {"out": b, "alpha": 2}),  # out= in kwargs
        ((torch.int64, "mean", [], ()), {"dim": [0, 1]}),  # no tensor at all
        ((), {"values": {"x": a, "y": [b, None]}}),  # a dict's values
    ]
    for args, kwargs in cases:
        want = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        got = op_tensors(args, kwargs)
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), (args, kwargs)


def test_fresh_results_are_the_unaliased_leaves_at_their_pytree_positions(gen):
    # Regression (session 48): the tracker and the emulated recorder each kept a rule for an op's fresh results, and
    # they differed on a tuple holding a Tensor[] (histogramdd's bin edges); the recorder copies replayed results by
    # pytree position, so the one rule must name the leaves, and count them, as tree_flatten does.
    from torch.utils._pytree import tree_flatten

    from graphctl.graphs.findings.journal import fresh_results

    aten = torch.ops.aten
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    out_args = {"max": torch.empty(4), "max_values": torch.empty(4, dtype=torch.long)}
    cases = [
        (aten.add.Tensor, (x, y), {}, True),  # one fresh Tensor
        (aten.add_.Tensor, (x.clone(), y), {}, False),  # in place: the input itself
        (aten.split.Tensor, (x, 2), {}, False),  # Tensor(a)[]: views, aliased as a whole
        (aten.max.dim, (x, 1), {}, True),  # (values, indices): both fresh
        (aten._foreach_add.List, ([x, y], [y, x]), {}, True),  # Tensor[]: fresh as a whole
        (aten.histogramdd.default, (x[:, :2].contiguous(), [3, 4]), {}, True),  # (Tensor, Tensor[])
        (aten.transpose.int, (x, 0, 1), {}, False),  # a view
        (aten.max.dim_max, (x, 1, False), out_args, False),  # out=: aliases its out arguments
    ]
    for op, args, kwargs, fresh in cases:
        out = op(*args, **kwargs)
        got = fresh_results(op, out)
        leaves = tree_flatten(out)[0]
        want = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)] if fresh else []
        assert [i for i, _ in got] == [i for i, _ in want], op
        assert all(g is w for (_, g), (_, w) in zip(got, want)), op
        assert all(leaves[i] is t for i, t in got), op
    assert len(fresh_results(aten.histogramdd.default, aten.histogramdd.default(x[:, :2].contiguous(), [3, 4]))) == 3
