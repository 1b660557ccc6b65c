"""Compiled forwards in real CUDA graphs (issue 28): Inductor's Triton kernels are what the captured graph holds, the
replay equals the compiled eager step, the function stays compiled afterwards, and the compiled HF engine captures."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import graphctl

pytestmark = pytest.mark.cuda


def _triton(census: dict) -> int:
    return sum(c for k, c in census["kernels"].items() if k.startswith("triton"))


def test_compiled_forward_graph_holds_triton_kernels(gen):
    # Regression: issue 28, a compiled forward under @graphed captured 0 Triton kernels (it ran uncompiled).
    torch._dynamo.reset()
    w = torch.randn(256, 256, generator=gen).cuda()
    steps = torch.zeros(1, device="cuda")

    def fwd(x):
        steps.add_(1)
        return torch.nn.functional.gelu(x @ w) * 2 + x.sin()

    cf = torch.compile(fwd, dynamic=False)
    f = graphctl.graphed(cf, buckets=[8, 16], backend="cuda", progress=False, params={"w": w})
    f.capture_all(torch.randn(16, 256, generator=gen).cuda())
    assert steps.item() == 0 and f.report().uncompiled == 0
    assert _triton(f.census(16)) >= 1, f.census(16)
    x = torch.randn(12, 256, generator=gen).cuda()
    got = f(x).clone()
    torch.testing.assert_close(got, torch.nn.functional.gelu(x @ w) * 2 + x.sin(), rtol=1e-4, atol=1e-4)
    frames = counters["frames"]["total"]
    cf(torch.randn(16, 256, generator=gen).cuda())
    assert counters["frames"]["total"] == frames  # still compiled, nothing recompiled
    assert not f.audit()[16].errors


@pytest.mark.parametrize("mode", ["unrolled", "per_step", "device_loop"])
def test_compiled_hf_engine_captures_fused_kernels(mode, gen):
    pytest.importorskip("transformers")
    from graphctl.integrations.hf import HFEngine
    from graphctl.integrations.hf.configs import hf_config
    from graphctl.models import graphed_step

    torch._dynamo.reset()
    eng = HFEngine.build(hf_config("tiny-llama"), draft_len=3, max_seqs=4, device="cuda", dtype=torch.float32,
                         compile=True)
    prompts = [torch.randint(3, eng.cfg.vocab, (n,), generator=gen) for n in (5, 9, 7)]
    want = HFEngine.build(hf_config("tiny-llama"), draft_len=3, max_seqs=4, device="cuda",
                          dtype=torch.float32).generate(prompts, 8)
    step = graphed_step(eng, mode=mode, buckets=[1, 2, 4])
    got = eng.generate(prompts, 8, forward=step)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    if mode != "per_step":  # one runner: its graphs hold Inductor's kernels, nothing ran uncompiled
        assert _triton(step.census(4)) >= 1 and step.report().uncompiled == 0, step.report()


def test_compiled_piecewise_prefill_holds_fused_pieces(gen):
    # Regression: issue 51, a compiled model's piecewise prefill was refused (dynamo traced through the regions); now
    # each attention call is a graph break: the pieces between hold Inductor's kernels, the tokens are eager's.
    pytest.importorskip("transformers")
    from graphctl.integrations.hf import HFEngine
    from graphctl.integrations.hf.configs import hf_config

    torch._dynamo.reset()
    eng = HFEngine.build(hf_config("tiny-llama"), draft_len=1, max_seqs=4, device="cuda", dtype=torch.float32,
                         compile=True, prefill_tokens=32)
    prompts = [torch.randint(3, eng.cfg.vocab, (n,), generator=gen) for n in (5, 9, 7)]
    want = eng.generate(prompts, 4)
    pre = eng.graphed_prefill(buckets=[16, 32], piecewise=True)
    got = eng.generate(prompts, 4, prefill=pre)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    rep = pre.report()
    layers = eng.target_layers.config.num_hidden_layers + eng.draft_layers.config.num_hidden_layers
    assert rep.uncompiled == 0 and {b.pieces for b in rep.buckets} == {layers + 1}, str(rep)
    assert _triton(pre.census(32)) >= layers, pre.census(32)
    torch._dynamo.reset()
