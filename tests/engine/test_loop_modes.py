"""Draft-loop capture modes on the reference engine (CPU, emulated backend): unrolled and
per_step propose the same tokens as the eager step, with the oracle's acceptance; the device
loop's early stop matches its reference for planted thresholds (run eagerly: its graph is
CUDA's, tests/cuda covers it); device_loop on the emulated backend says it needs CUDA."""
from __future__ import annotations

import pytest
import torch

from graphctl import CaptureError, DeclarationError
from graphctl.models import DynamicDraft, draft_confidences, expected_dynamic, graphed_step
from support.engine import acceptance, dynamic_setup, thresholds, trace


@pytest.mark.parametrize("k,bs", [(1, 3), (3, 5), (7, 8)])
def test_unrolled_and_per_step_propose_what_eager_proposes(k, bs, gen):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    want_h, want_d = trace("eager", k=k, bs=bs, seed=seed)
    for mode in ("unrolled", "per_step"):
        h, d = trace(mode, k=k, bs=bs, seed=seed)
        assert [x.tolist() for x in h] == [x.tolist() for x in want_h], mode
        assert all(torch.equal(a, b) for a, b in zip(d, want_d)), mode
        assert acceptance(h) == k + 1, mode  # the oracle: a draft head equal to the target is always accepted


def test_device_loop_stops_where_its_reference_says(gen):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    eng, ids = dynamic_setup(k=5, bs=6, seed=seed)
    drafts, conf = draft_confidences(eng, ids)
    dyn = DynamicDraft(eng)
    candidates = thresholds(conf)
    seen_steps = set()
    for t in candidates:
        dyn.set_threshold(t)
        out = dyn.step(ids, eng.meta)
        steps, props = expected_dynamic(drafts, conf, t)
        assert int(dyn.counter) == steps, (t, conf)
        assert torch.equal(out.drafts.cpu(), props), (t, out.drafts, props)
        seen_steps.add(steps)
    assert 1 in seen_steps and 5 in seen_steps  # thresholds 1.01 and 0


def test_device_loop_needs_cuda():
    from graphctl.models import EngineConfig, MTPEngine

    eng = MTPEngine(EngineConfig(draft_len=2, max_seqs=4))
    with pytest.raises(CaptureError, match="device_loop needs CUDA"):
        graphed_step(eng, "device_loop", backend="emulated")


def test_device_loop_refuses_the_emulated_recorder(gen):
    # The loop itself refuses to be recorded (a forward that runs it under backend="emulated").
    import graphctl
    from graphctl import StaticInput

    eng, ids = dynamic_setup(k=2, bs=2, seed=1, max_seqs=4)
    dyn = DynamicDraft(eng)
    f = graphctl.graphed(dyn.step, buckets=[2], state=eng.state, backend="emulated", progress=False,
                         inputs=[StaticInput("input_ids", per_item=3)])
    with pytest.raises(CaptureError, match="a device-side loop needs a CUDA graph"):
        f(ids, eng.meta)


def test_unknown_mode_is_refused():
    from graphctl.models import EngineConfig, MTPEngine

    with pytest.raises(DeclarationError, match="unknown draft-loop mode"):
        graphed_step(MTPEngine(EngineConfig(draft_len=2, max_seqs=4)), "sideways")


def test_per_step_reports_no_host_change_of_graphctls_own_runner(gen, caplog):
    # Regression (issue 18): per_step's head forward is a bound method of the loop, so the host-state walk reached
    # its GraphRunner's side-effect ledger and reported graphctl's own bookkeeping as "host state changed by
    # warmup" (one line per cache tensor); graphctl's runners and states are not user state.
    from graphctl.models import MTPEngine
    from graphctl.models.mtp import EngineConfig

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    eng = MTPEngine(EngineConfig(draft_len=3, max_seqs=8, seed=seed))
    loop = graphed_step(eng, "per_step", buckets=(1, 4), backend="emulated")
    eng.generate(eng.prompts(3, torch.Generator().manual_seed(seed)), 2, forward=loop)
    assert not loop.head.report().host_changes, loop.head.report().host_changes
    assert "_ledger" not in caplog.text
