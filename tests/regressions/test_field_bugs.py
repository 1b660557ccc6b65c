"""Bug classes peers shipped (issue 21), each as the natural code a user would write: graphctl
must be right or loud."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from support.graphs import Toy


def _snapshot(state) -> dict[str, torch.Tensor]:
    return {n: state.tensor(n).clone() for n in state.restorable_names()}


def _capture_verify_audit_switch(toy: Toy, defaults) -> None:
    tokens, positions = toy.batch(5)  # the user's inputs, made before the defaults change
    want_h, want_d = toy.eager(tokens, positions)
    with defaults():
        toy.forward.capture_all(tokens, positions, toy.meta)
        h, d = toy.forward(tokens, positions, toy.meta)
        torch.testing.assert_close(h.clone(), want_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d.clone(), want_d, rtol=1e-5, atol=1e-5)
        results = toy.forward.verify()
        assert results and all(r.ok for r in results), [str(r) for r in results]
        assert not [f for a in toy.forward.audit().values() for f in a.errors]
        before = _snapshot(toy.state)
        with toy.state.switch("draft"):
            toy.state.write("kv_lens", toy.meta.kv_lens + 1)
        after = _snapshot(toy.state)
        assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_float64_default_dtype_changes_nothing_graphctl_makes(gen):
    # Issue 21 (global defaults), the dtype half: tensors graphctl makes must take their dtype from what they belong
    # to, never from torch.set_default_dtype (this half held already; it guards verify's explicit dtypes).
    toy = Toy("cpu", gen)

    @contextlib.contextmanager
    def float64():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(old)

    _capture_verify_audit_switch(toy, float64)


@pytest.mark.cuda
def test_a_cuda_default_device_changes_nothing_graphctl_makes(gen):
    # Issue 21 (global defaults): under torch.set_default_device("cuda") verify() crashed on the H200 ("Expected a
    # 'cuda' device type for generator but found 'cpu'", from its random inputs).
    toy = Toy("cuda", gen, backend="cuda")
    _capture_verify_audit_switch(toy, lambda: torch.device("cuda"))


def test_a_plain_hf_forward_records_on_the_emulated_backend_as_it_captures_on_cuda():
    # Issue 21 (the emulated recorder looks like a capture): transformers' is_tracing() asks
    # torch.cuda.is_current_stream_capturing(); under the recorder it said no, so a packed-sequence host check
    # (masking_utils.py) ran and the record failed with CaptureError, while the same forward captures on an H200.
    transformers = pytest.importorskip("transformers")
    import graphctl

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()

    @graphctl.graphed(buckets=[2], inputs=["ids"], backend="emulated", progress=False)
    def forward(ids):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return model(ids, use_cache=False).logits

    gen = torch.Generator().manual_seed(1)
    query = torch.cuda.is_current_stream_capturing
    forward.capture_all(torch.randint(0, 128, (2, 32), generator=gen))
    assert torch.cuda.is_current_stream_capturing is query, "the capture query was not put back after recording"
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 32), generator=gen)
        with torch.no_grad():
            want = model(ids, use_cache=False).logits
        assert torch.equal(forward(ids).clone(), want)


def test_the_capture_query_answers_yes_only_in_the_recording_thread():
    # Issue 21: the answer must be scoped to the recording (and its thread): a second thread asking while the first
    # records must hear the truth.
    import threading

    from graphctl.graphs.backends.emulated import EmulatedBackend

    seen: dict[str, bool] = {}

    def ask() -> bool:  # as transformers asks: a machine without a CUDA driver raises, which means no
        try:
            return torch.cuda.is_current_stream_capturing()
        except Exception:
            return False

    def body(mark):
        seen["inside"] = ask()
        t = threading.Thread(target=lambda: seen.__setitem__("other", ask()))
        t.start()
        t.join()
        return torch.ones(2) * 2

    query = torch.cuda.is_current_stream_capturing
    EmulatedBackend(torch.device("cpu")).capture(body, None, 1)
    assert seen == {"inside": True, "other": False}
    assert torch.cuda.is_current_stream_capturing is query and torch.cuda.graphs.is_current_stream_capturing is query


def test_graphs_captured_then_bypassed_are_reported_and_warned_once(caplog):
    # Issue 21 (vLLM #47460: the draft ran eagerly every step for months): a runner whose graphs serve none of its
    # calls said nothing beyond a per-call log line; report() now counts eager runs per bucket and says "bypassed".
    import logging

    import graphctl

    cfg = {"scale": 2.0}

    @graphctl.graphed(buckets=[2, 4], inputs=["x"], backend="emulated", fallback="eager", progress=False)
    def step(x, cfg):
        return x * cfg["scale"]

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    step(x, cfg)  # captures, replays bucket 4
    assert not step.report().bypassed
    cfg["scale"] = 3.0  # the natural bug: a setting changed in place; every later call falls back
    with graphctl.knobs.scope(bypass_window=5), caplog.at_level(logging.WARNING, logger="graphctl"):
        for _ in range(7):
            assert torch.equal(step(x, cfg), x * 3.0)
        rep = step.report()
    assert rep.bypassed and rep.eager_streak == 7, rep
    assert {b.bucket: b.eager_runs for b in rep.buckets} == {2: 0, 4: 7}
    warned = [r for r in caplog.records if "serve nothing" in r.getMessage()]
    assert len(warned) == 1 and "cfg['scale']" in warned[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert "bypassed" in str(rep)
    cfg["scale"] = 2.0  # back as captured: the next call replays and the streak ends
    step(x, cfg)
    assert not step.report().bypassed and step.report().eager_streak == 0


def test_the_fallback_log_line_never_suggests_the_fallback_already_set(caplog):
    # Issue 21: with fallback='eager' already set, every eager call's log line still said "or pass fallback='eager'".
    import logging

    import graphctl

    f = graphctl.graphed(lambda x: x + 1, buckets=[2], inputs=["x"], backend="emulated", fallback="eager",
                         progress=False)
    f(torch.randn(2, 3))
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f(torch.randn(5, 3))  # past the largest bucket
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs and not any("fallback='eager'" in m for m in msgs), msgs
    strict = graphctl.graphed(lambda x: x + 1, buckets=[2], inputs=["x"], backend="emulated", progress=False)
    strict(torch.randn(2, 3))
    with pytest.raises(graphctl.ReplayError, match="fallback='eager'"):
        strict(torch.randn(5, 3))


class _Sampler:
    def __init__(self) -> None:
        self.probs_valid = False  # set once real requests have written probs
        self.probs = torch.zeros(1, 3)


def _sampling_step(sampler):
    def step(x):
        if sampler.probs_valid:  # host branch: the graph bakes whichever the capture run took
            out = x + sampler.probs
        else:
            out = x * 1.0
        sampler.probs_valid = True
        return out

    return step


def test_warmup_flipping_a_host_flag_is_named_at_capture(caplog):
    # Issue 21 (TensorRT-LLM #15775): warmup with dummy requests flipped draft_probs_valid, and the first real replay
    # trusted stale per-slot data; nothing said the warmup had changed host state.
    import logging

    import graphctl

    sampler = _Sampler()
    f = graphctl.graphed(_sampling_step(sampler), buckets=[2, 4], inputs=["x"], backend="emulated", progress=False)
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(4, 3))
    assert [str(h) for h in f.host_changes] == ["sampler.probs_valid False -> True"]
    assert any("sampler.probs_valid False -> True" in r.getMessage() for r in caplog.records)
    rep = f.report()
    assert rep.host_changes == ({"path": "sampler.probs_valid", "before": False, "after": True, "policy": "warn"},)
    assert "host state changed" in str(rep)


def test_host_state_restore_puts_the_flag_back_and_error_refuses():
    # Issue 21: host_state='restore' leaves the caller's flag as it was; 'error' refuses, naming it, flag put back.
    import graphctl

    sampler = _Sampler()
    f = graphctl.graphed(_sampling_step(sampler), buckets=[2, 4], inputs=["x"], backend="emulated", progress=False,
                         host_state="restore")
    f.capture_all(torch.randn(4, 3))
    assert sampler.probs_valid is False
    sampler2 = _Sampler()
    g = graphctl.graphed(_sampling_step(sampler2), buckets=[2], inputs=["x"], backend="emulated", progress=False,
                         host_state="error")
    with pytest.raises(graphctl.CaptureError, match=r"sampler\.probs_valid"):
        g.capture_all(torch.randn(2, 3))
    assert sampler2.probs_valid is False and not g.captured
    with pytest.raises(graphctl.DeclarationError, match="host_state"):
        graphctl.graphed(lambda x: x, host_state="ignore")
