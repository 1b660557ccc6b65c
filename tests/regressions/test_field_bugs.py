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
        del h, d  # views of the graph's outputs: not kept across verify's calls (OutputsHeldWarning otherwise)
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


def test_graphs_captured_then_bypassed_are_reported_and_warned_once(caplog, backend, device):
    # Issue 21 (vLLM #47460: the draft ran eagerly every step for months): a runner whose graphs serve none of its
    # calls said nothing beyond a per-call log line; report() now counts eager runs per bucket and says "bypassed".
    import logging

    import graphctl

    cfg = {"scale": 2.0}

    @graphctl.graphed(buckets=[2, 4], inputs=["x"], backend=backend, fallback="eager", progress=False)
    def step(x, cfg):
        return x * cfg["scale"]

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(device)
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


def test_the_fallback_log_line_never_suggests_the_fallback_already_set(caplog, backend, device):
    # Issue 21: with fallback='eager' already set, every eager call's log line still said "or pass fallback='eager'".
    import logging

    import graphctl

    f = graphctl.graphed(lambda x: x + 1, buckets=[2], inputs=["x"], backend=backend, fallback="eager",
                         progress=False)
    f(torch.randn(2, 3).to(device))
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f(torch.randn(5, 3).to(device))  # past the largest bucket
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs and not any("fallback='eager'" in m for m in msgs), msgs
    strict = graphctl.graphed(lambda x: x + 1, buckets=[2], inputs=["x"], backend=backend, progress=False)
    strict(torch.randn(2, 3).to(device))
    with pytest.raises(graphctl.ReplayError, match="fallback='eager'"):
        strict(torch.randn(5, 3).to(device))


class _Sampler:
    def __init__(self, device: str = "cpu") -> None:
        self.probs_valid = False  # set once real requests have written probs
        self.probs = torch.zeros(1, 3, device=device)


def _sampling_step(sampler):
    def step(x):
        if sampler.probs_valid:  # host branch: the graph bakes whichever the capture run took
            out = x + sampler.probs
        else:
            out = x * 1.0
        sampler.probs_valid = True
        return out

    return step


def test_warmup_flipping_a_host_flag_is_named_at_capture(caplog, backend, device):
    # Issue 21 (TensorRT-LLM #15775): warmup with dummy requests flipped draft_probs_valid, and the first real replay
    # trusted stale per-slot data; nothing said the warmup had changed host state.
    import logging

    import graphctl

    sampler = _Sampler(device)
    f = graphctl.graphed(_sampling_step(sampler), buckets=[2, 4], inputs=["x"], backend=backend, progress=False)
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(4, 3).to(device))
    assert [str(h) for h in f.host_changes] == ["sampler.probs_valid False -> True"]
    assert any("sampler.probs_valid False -> True" in r.getMessage() for r in caplog.records)
    rep = f.report()
    assert rep.host_changes == ({"path": "sampler.probs_valid", "before": False, "after": True, "policy": "warn"},)
    assert "host state changed" in str(rep)


def test_host_state_restore_puts_the_flag_back_and_error_refuses(backend, device):
    # Issue 21: host_state='restore' leaves the caller's flag as it was; 'error' refuses, naming it, flag put back.
    import graphctl

    sampler = _Sampler(device)
    f = graphctl.graphed(_sampling_step(sampler), buckets=[2, 4], inputs=["x"], backend=backend, progress=False,
                         host_state="restore")
    f.capture_all(torch.randn(4, 3).to(device))
    assert sampler.probs_valid is False
    sampler2 = _Sampler(device)
    g = graphctl.graphed(_sampling_step(sampler2), buckets=[2], inputs=["x"], backend=backend, progress=False,
                         host_state="error")
    with pytest.raises(graphctl.CaptureError, match=r"sampler\.probs_valid"):
        g.capture_all(torch.randn(2, 3).to(device))
    assert sampler2.probs_valid is False and not g.captured
    with pytest.raises(graphctl.DeclarationError, match="host_state"):
        graphctl.graphed(lambda x: x, host_state="ignore")


def test_host_state_restore_names_what_it_could_not_put_back(backend, device, caplog):
    # Regression: issue 31, put_back's list of values it could not write back was dropped and "(put back)" logged.
    import dataclasses
    import logging

    import graphctl

    @dataclasses.dataclass(frozen=True)
    class Counters:
        calls: int = 0

    counters = Counters()

    def step(x):
        object.__setattr__(counters, "calls", counters.calls + 1)  # what a library's cached config does
        return x * 2

    f = graphctl.graphed(step, buckets=[2], inputs=["x"], backend=backend, progress=False, host_state="restore")
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(2, 3).to(device))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "put back, except counters.calls (FrozenInstanceError" in said, said
    assert counters.calls > 0  # not put back, and the log says so


def test_cumulative_offsets_pad_as_empty_requests_with_edge_and_fixed_width_with_arange(backend, device):
    # Issue 21 (xLLM #1939, SGLang #36913, vLLM #25251): padded requests must be empty sequences, so cumulative
    # offsets repeat the last live value (or continue at a fixed width); Pad had zero, fill, clamp and keep only, and a
    # zero tail made every padded request's length negative.
    import graphctl
    from graphctl import Pad, StaticInput

    def lengths(cu):  # per-request token counts from offsets, as attention kernels read them
        return cu[1:] - cu[:-1]

    f = graphctl.graphed(lengths, buckets=[8], backend=backend, progress=False,
                         inputs=[StaticInput("cu", pad=Pad.edge())])
    f.capture_all(torch.arange(8, dtype=torch.int32).to(device))
    got = f(torch.tensor([0, 3, 5, 9, 9], dtype=torch.int32).to(device))  # 4 requests (the last one empty): 5 offsets
    assert f.static_input("cu")[5:].tolist() == [9, 9, 9]  # padded rows repeat the last live offset
    assert got.tolist() == [3, 2, 4, 0, 0, 0, 0]  # padded requests are empty (a zero tail gave -9)
    g = graphctl.graphed(lambda starts: starts * 1, buckets=[6], backend=backend, progress=False,
                         inputs=[StaticInput("starts", pad=Pad.arange(4))])
    g.capture_all(torch.arange(6, dtype=torch.int64).to(device) * 4)
    g(torch.tensor([0, 4, 8], dtype=torch.int64).to(device))
    assert g.static_input("starts").tolist() == [0, 4, 8, 12, 16, 20]  # fixed-width padded requests
    with pytest.raises(graphctl.DeclarationError, match="arange"):
        Pad.arange("4")


def test_state_buffers_pad_with_edge_and_arange_all_or_nothing():
    # Issue 21: the new policies work on declared state buffers too (state.pad and a short write), row-wise.
    import graphctl
    from graphctl import Pad, Registry, StateSpec

    class Meta:
        def __init__(self):
            self.cu = torch.tensor([0, 2, 5, 7, 11, 13], dtype=torch.int64)
            self.starts = torch.tensor([[0, 1], [8, 9], [16, 17], [24, 25]], dtype=torch.int32)

    spec = StateSpec("pads")
    spec.buffer("cu", shape=("S1",), dtype=torch.int64, axis="seq", pad=Pad.edge())
    spec.buffer("starts", shape=("S", 2), dtype=torch.int32, axis="seq", pad=Pad.arange(8))
    reg = Registry()
    reg.register(Meta, spec)
    m = Meta()
    st = graphctl.bind(m, registry=reg)
    st.pad({"seq": 3})
    assert m.cu.tolist() == [0, 2, 5, 5, 5, 5]
    assert m.starts.tolist() == [[0, 1], [8, 9], [16, 17], [24, 25]]  # 4 rows, 3 live: row 3 = row 2 + 8
    st.write("starts", torch.tensor([[100, 101]], dtype=torch.int32))
    assert m.starts.tolist() == [[100, 101], [108, 109], [116, 117], [124, 125]]


def test_verify_flags_padded_lanes_that_write_live_memory(backend, device):
    # Issue 21 (rvllm #32, SGLang #25529 "padded lanes write to reserved slot 0"): a slot-mapping input padded with
    # zero (a valid index) makes the replay write the padded lanes' K/V into slot 0 of a live request; verify()
    # compared outputs only, so it passed.
    import graphctl
    from graphctl import StaticInput

    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(64, 4, generator=gen).to(device)  # slot 0 holds a live request's K/V

    def write_kv(k, slots):
        kv_cache.index_copy_(0, slots, k)  # the paged cache write of a decode step
        return k.sum(-1)

    f = graphctl.graphed(write_kv, buckets=[4, 8], backend=backend, progress=False,
                         inputs=[StaticInput("k"), StaticInput("slots")])  # slots pad with zero: the bug
    f.capture_all(torch.randn(8, 4, generator=gen).to(device), torch.arange(8, 16).to(device))
    # named at capture already: the zero-padded slots index the cache write
    assert [(z["input"], z["op"], z["target"]) for z in f.report().padding_hazards] == [
        ("slots", "aten::index_copy_", "kv_cache")]
    warned = f.verify(gen=torch.Generator().manual_seed(0))  # default: a warning on the result, ok unaffected
    assert all(r.ok for r in warned) and any(r.write is not None for r in warned)
    assert "warning: write kv_cache" in " ".join(map(str, warned))
    results = f.verify(gen=torch.Generator().manual_seed(0), writes="error")
    bad = [r for r in results if not r.ok]
    assert bad and all(r.n < r.bucket for r in bad), [str(r) for r in results]  # only where padding is live
    text = str(bad[0])
    assert "write kv_cache" in text and "aten::index_copy_" in text and "test_field_bugs.py" in text, text

    def write_kv_skipping_padding(k, slots):  # the fix: a sentinel slot the write skips
        live = slots >= 0
        at = slots.clamp(min=0)
        kv_cache.index_copy_(0, at, torch.where(live[:, None], k, kv_cache.index_select(0, at)))
        return k.sum(-1)

    fixed = graphctl.graphed(write_kv_skipping_padding, buckets=[4, 8], backend=backend, progress=False,
                             inputs=[StaticInput("k"), StaticInput("slots", pad=graphctl.Pad.fill(-1))])
    fixed.capture_all(torch.randn(8, 4, generator=gen).to(device), torch.arange(8, 16).to(device))
    assert fixed.report().padding_hazards == ()  # a negative sentinel: no hazard
    assert all(r.ok and r.write is None for r in fixed.verify(gen=torch.Generator().manual_seed(0), writes="error"))


def test_an_output_read_after_the_next_call_overwrote_it_raises_under_the_knob(backend, device):
    # Issue 21 (PyTorch #122192): outputs are views of the static outputs; reading one after the next call of the
    # same bucket silently gave the new call's values.
    import graphctl

    f = graphctl.graphed(lambda x: x * 2, buckets=[4], inputs=["x"], backend=backend, progress=False)
    a, b = torch.randn(4, 3).to(device), torch.randn(4, 3).to(device)
    with graphctl.knobs.scope(check_outputs=True):
        first = f(a)
        kept = first + 0  # read before the next call: fine
        assert torch.equal(kept, a * 2)
        for _ in range(3):  # the common loop keeps the old name alive until the assignment: no alarm
            out = f(b)
            out = out.sum()
        second = f(b)
        with pytest.raises(graphctl.ReplayError, match="read after a later call overwrote it") as ei:
            first.sum()
        assert "test_field_bugs.py" in str(ei.value)
        assert torch.equal(second * 1, b * 2)  # the latest output reads fine
    without = f(a)
    f(b)
    with pytest.raises(RuntimeError, match="overwritten since by the call at"):  # knob off: the default check
        without.sum()


def test_a_view_of_an_output_stays_watched_under_the_knob(backend, device):
    # Regression: issue 30, keep = out[0][1:] taken before the next call read that call's values with no error.
    import graphctl

    f = graphctl.graphed(lambda x: (x * 2, x + 1), buckets=[4], inputs=["x"], backend=backend, progress=False)
    a, b = torch.randn(4, 3).to(device), torch.randn(4, 3).to(device)
    with graphctl.knobs.scope(check_outputs=True):
        out = f(a)
        keep, flat, summed = out[0][1:], out[1].view(-1), out[0].sum()  # two views; a reduction owns its memory
        assert torch.equal(keep * 1, (a * 2)[1:])  # read before the next call: fine
        f(b)
        for view in (keep, flat):
            with pytest.raises(graphctl.ReplayError, match="read after a later call overwrote it"):
                view + 0
        assert torch.allclose(summed, (a * 2).sum())  # not a view: its own memory, still right


def test_copy_outputs_returns_fresh_tensors(backend, device):
    # Issue 21: copy_outputs=True for callers that keep outputs across calls.
    import graphctl

    f = graphctl.graphed(lambda x: x * 2, buckets=[4], inputs=["x"], backend=backend, progress=False,
                         copy_outputs=True)
    a, b = torch.randn(4, 3).to(device), torch.randn(4, 3).to(device)
    first = f(a)
    f(b)
    assert torch.equal(first, a * 2)


def test_an_output_kept_past_the_next_call_raises_at_its_read_by_default(backend, device):
    # Regression: issue 55, `a = f(x1); f(x2); a` read the second call's values with no error (only a warning later).
    import graphctl

    f = graphctl.graphed(lambda x: (x * 2, x + 1), buckets=[4, 8], inputs=["x"], backend=backend, progress=False)
    x1, x2 = torch.randn(3, 3).to(device), torch.randn(3, 3).to(device)
    a = f(x1)
    a_sum = a[0].sum().item()  # read before the next call: fine
    f(x2)
    for t in a:  # every output of the overwritten call
        with pytest.raises(RuntimeError) as ei:
            t.sum()
        msg = str(ei.value)
        assert "bucket 4" in msg and "copy_outputs=True" in msg and "clone" in msg, msg
        assert msg.count("test_field_bugs.py:") == 2, msg  # the call that returned it and the one that overwrote it
    assert a_sum == pytest.approx((x1 * 2).sum().item(), rel=1e-5)
    b = f(torch.randn(6, 3).to(device))  # another bucket's replay does not touch bucket 4's memory
    assert torch.isfinite(b[0]).all()


def test_a_view_of_an_output_kept_past_the_next_call_raises_at_its_read_by_default(backend, device):
    # Regression: issue 55, views kept across calls (kept.append(out[:, 1]), last = logits[:, -1]) read newer values.
    import graphctl

    f = graphctl.graphed(lambda x: x * 2, buckets=[4], inputs=["x"], backend=backend, progress=False)
    x = torch.randn(4, 3).to(device)
    last = f(x)[:, -1]  # the output itself dropped, one view kept
    assert torch.equal(last * 1, (x * 2)[:, -1])
    f(torch.randn(4, 3).to(device))
    with pytest.raises(RuntimeError, match="overwritten since by the call at"):
        last.sum()
    kept = [f(torch.randn(4, 3).to(device))[:, 1] for _ in range(3)]
    with pytest.raises(RuntimeError, match="overwritten"):
        kept[0].sum()
    assert torch.isfinite(kept[-1]).all()  # the newest call's view reads fine


def test_a_kept_output_is_marked_by_any_replay_of_its_bucket_verify_included(backend, device):
    # Regression: issue 55, verify() replays every bucket: outputs kept across it read verify's values silently.
    import graphctl

    f = graphctl.graphed(lambda x: x * 2, buckets=[4], inputs=["x"], backend=backend, progress=False)
    kept = f(torch.randn(4, 3).to(device))
    assert all(r.ok for r in f.verify())
    with pytest.raises(RuntimeError, match=r"overwritten since by the call at .*test_field_bugs.py"):
        kept.sum()
    again = f(torch.randn(4, 3).to(device))  # and the runner goes on serving fresh, readable outputs
    assert torch.isfinite(again).all()


@pytest.mark.parametrize("how", ["loop", "loop with a view", "copy_outputs", "sizes and buckets vary",
                                 "torch without the clear"])
def test_the_common_decode_loop_never_warns_about_held_outputs(backend, device, how, monkeypatch):
    # Regression: issue 30, the held-output check must stay silent for `logits = step(x)`, every engine's loop; and
    # issue 53's GPU run: torch 2.11 has no _clear_storage_data_ptr_access_error_msg (import graphctl failed there).
    import warnings

    import graphctl
    from graphctl.graphs.replay import stale

    if how == "torch without the clear":
        monkeypatch.setattr(stale, "_CLEAR", None)

    f = graphctl.graphed(lambda x: (x * 2, x.sum(-1)), buckets=[2, 4, 8], inputs=["x"], backend=backend,
                         progress=False, copy_outputs=how == "copy_outputs")
    sizes = [1, 3, 8, 2, 4, 7, 3, 3, 1, 8] if how == "sizes and buckets vary" else [3] * 10
    history = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in sizes:
            x = torch.randn(n, 3).to(device)
            logits = f(x)
            last = logits[0][:, -1] if how != "loop" else logits[1]
            assert torch.allclose(last, (x * 2)[:, -1] if how != "loop" else x.sum(-1))
            history.append(last.sum().item())  # a Python number: no tensor kept
            if how == "copy_outputs":
                history.append(logits)  # fresh tensors: keeping them is fine
    assert len(history) >= len(sizes)
    if how == "torch without the clear":  # a kept output is still caught, and fresh ones still read fine
        kept = f(torch.randn(3, 3).to(device))
        f(torch.randn(3, 3).to(device))
        with pytest.raises(RuntimeError, match="overwritten"):
            kept[1].sum()
        assert torch.isfinite(f(torch.randn(3, 3).to(device))[1]).all()


def test_a_tensor_rebound_behind_an_argument_is_named_before_the_replay(backend, device):
    # Issue 21 (vLLM #36611 stale tile-scheduler metadata, vLLM #37639): the engine computes a metadata tensor outside
    # the graph and rebinds it on an object the forward reads; the graph kept reading the capture-time tensor.
    import graphctl

    class Engine:
        def __init__(self):
            self.sched = torch.arange(4.0).to(device)  # computed outside the graph each step

        def forward(self, x):
            return x * self.sched

    eng = Engine()
    f = graphctl.graphed(eng.forward, buckets=[2], inputs=["x"], backend=backend, progress=False)
    x = torch.randn(2, 4).to(device)
    f.capture_all(x)
    eng.sched.copy_(torch.full((4,), 2.0).to(device))  # written in place: the graph reads it, fine
    assert torch.equal(f(x), x * 2.0)
    eng.sched = torch.full((4,), 3.0).to(device)  # the natural bug: a fresh tensor each step
    with pytest.raises(graphctl.ReplayError, match="rebound since the capture") as ei:
        f(x)
    assert "self.sched" in str(ei.value)
    with graphctl.knobs.scope(check_paths=False):
        assert torch.equal(f(x), x * 2.0)  # unchecked: the capture-time tensor, silently (documented)
    eng.sched = torch.full((4,), 3.0).to(device)
    unchecked = graphctl.graphed(eng.forward, buckets=[2], inputs=["x"], backend=backend, progress=False,
                                 check_paths=False)  # the option, over the knob
    unchecked.capture_all(x)
    eng.sched = torch.full((4,), 4.0).to(device)
    assert torch.equal(unchecked(x), x * 3.0)
    with graphctl.knobs.scope(check_paths=False), pytest.raises(graphctl.DeclarationError, match="check_paths"):
        graphctl.graphed(eng.forward, check_paths="yes")
    lenient = graphctl.graphed(eng.forward, buckets=[2], inputs=["x"], backend=backend, progress=False,
                               fallback="eager")
    lenient.capture_all(x)
    eng.sched = torch.full((4,), 5.0).to(device)
    assert torch.equal(lenient(x), x * 5.0)  # falls back to eager, which reads the new tensor; logged


def test_the_reference_engine_padded_lanes_write_no_kv_of_live_sequences(backend, device, gen):
    # Issue 21: the reference engine's own padded lanes wrote K/V through a slot mapping computed like a live one
    # (a padded request's draft steps landed in its row's blocks); now slot_mapping is PAD_SLOT there and writes skip.
    import graphctl
    from graphctl.families.paged import PAD_SLOT
    from graphctl.graphs import StaticInput
    from graphctl.models.mtp import EngineConfig, MTPEngine

    eng = MTPEngine(EngineConfig(max_seqs=8, seed=int(torch.randint(0, 1000, (1,), generator=gen))), device=device)
    k1, m = eng.k + 1, eng.meta
    caches = [t for mgr in (m.kv_cache_manager, m.draft_kv_cache_manager) for t in mgr.k + mgr.v]
    for t in caches:  # live K/V everywhere: a stray write anywhere shows
        t.copy_(torch.randn(t.shape, generator=gen).to(t))

    def prepare(n: int) -> torch.Tensor:
        kv = torch.randint(k1 + 1, eng.cfg.max_context - 2 * k1, (n,), generator=gen, dtype=torch.int32)
        m.prepare(eng.state, torch.full((n,), k1, dtype=torch.int32), kv)
        return torch.randint(0, eng.cfg.vocab, (n * k1,), generator=gen).to(device)

    step = graphctl.graphed(eng.step, buckets=[4], inputs=[StaticInput("input_ids", per_item=k1)], backend=backend,
                            params=eng.named_tensors(), progress=False, state=eng.state)
    step.capture_all(prepare(4), m)
    ids = prepare(3)  # 3 requests in bucket 4: request 3 is padding
    before = [t.clone() for t in caches]
    want = eng.step(ids, m)
    want_caches = [t.clone() for t in caches]
    for t, b in zip(caches, before):
        t.copy_(b)
    got = step(ids, m)
    # tokens are argmaxes: robust to the last-bit differences below
    assert torch.equal(got.accepted.clone(), want.accepted) and torch.equal(got.drafts.clone(), want.drafts)
    for i, (g, w, b) in enumerate(zip(caches, want_caches, before)):
        # what the name says, bitwise: every value the eager step of the 3 live requests leaves alone (other
        # sequences' blocks, spare blocks) the padded replay leaves alone too
        untouched = w == b
        assert torch.equal(g[untouched], b[untouched]), \
            f"cache {i}: the replay wrote {int((g[untouched] != b[untouched]).sum())} values eager leaves alone"
        # the live rows the step writes: computed at 4 rows here, at 3 eagerly; matmul rounding depends on the row
        # count on some CPUs (an AVX-512 EPYC differed by 3.6e-7), so within a stated tolerance, not bitwise
        torch.testing.assert_close(g[~untouched], w[~untouched], rtol=1e-5, atol=1e-5, msg=f"cache {i}: live rows")
    assert int(m.slot_mapping[3 * k1]) == PAD_SLOT  # past the live tokens: the sentinel


def test_a_tensor_reached_by_no_path_is_listed_at_capture(backend, device, caplog):
    # Issue 21: metadata held where the path walk cannot go (a __slots__ holder, as perf-minded engines write them,
    # handed out by a method) was read by the graph, and a rebinding of it could never be checked; nothing said so.
    import logging

    import graphctl

    class Slots:
        __slots__ = ("sched",)

        def __init__(self) -> None:
            self.sched = torch.arange(1.0, 5.0).to(device)

    holder = Slots()
    table = {"scale": torch.full((4,), 2.0).to(device)}  # reached: a dict the closure names

    def lookup():
        return holder.sched

    def forward(x):
        return x * lookup() + table["scale"] + torch.arange(4.0, device=x.device) * 0.5

    f = graphctl.graphed(forward, buckets=[2], inputs=["x"], backend=backend, progress=False)
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(2, 4).to(device))
    rep = f.report()
    assert [(u["shape"], u["dtype"], u["op"]) for u in rep.unreached] == [((4,), "float32", "aten::mul")], rep
    assert "test_field_bugs.py" in rep.unreached[0]["where"] and "reached by no path" in str(rep)
    assert any("no checked path reaches" in r.getMessage() for r in caplog.records)
    x = torch.randn(2, 4).to(device)
    assert torch.equal(f(x).clone(), forward(x))  # listed, not refused: the replay is right while it stays put
    table["scale"] = table["scale"].clone()  # the reached one is checked (through a dict key): rebound is named
    with pytest.raises(graphctl.ReplayError, match=r"table\['scale'\]"):
        f(x)


def test_an_output_that_is_the_static_input_is_checked_like_any_output(backend, device):
    # Regression: issue 55, an output aliasing graphctl's static input (a forward returning its input) was treated
    # as the caller's own memory and left unchecked: it read the next call's input silently.
    import graphctl

    f = graphctl.graphed(lambda x: (x, x * 2), buckets=[4], inputs=["x"], backend=backend, progress=False)
    first = f(torch.randn(4, 3).to(device))
    f(torch.randn(4, 3).to(device))
    with pytest.raises(RuntimeError, match="overwritten since by the call at"):
        first[0].sum()
