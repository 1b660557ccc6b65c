"""Compiled forwards under @graphed (issue 28): the compiled artifact runs in the warmups (counted by a backend that
counts its calls; a CUDA capture records its kernels: tests/cuda), the replay equals eager, side effects are undone,
and the user's function still runs compiled afterwards; Inductor's own CUDA graphs are refused; frames dynamo must
convert during a CUDA capture are counted and reported. Each test failed before graphctl learned about torch.compile
(the tracker's dispatch mode made dynamo run the forward uncompiled, and the reach stopped at the compile wrapper).
The emulated backend records a compiled callable as the code it compiles (issue 51: what a CUDA capture holds, host
syncs refused at their line, host values baked), so its replay calls no compiled artifact."""
from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

import graphctl
from graphctl import DeclarationError

BACKENDS = ["aot_eager", "inductor"]


def counting(name: str) -> tuple:
    """A torch.compile backend that compiles with ``name`` and counts the calls of what it compiled."""
    calls = {"n": 0}
    inner = torch._dynamo.lookup_backend(name)

    def backend(gm, example_inputs):
        artifact = inner(gm, example_inputs)

        def run(*args):
            calls["n"] += 1
            return artifact(*args)
        return run
    return backend, calls


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


STEPS = torch.zeros(1)  # a module-level tensor the forward advances: a side effect graphctl must undo


def _forward(x, w):
    STEPS.add_(1)
    return torch.tanh(x @ w) * 2 + 1


@pytest.mark.parametrize("name", BACKENDS)
def test_compiled_function_runs_compiled_in_warmup_and_capture_and_stays_compiled(name, gen):
    # Regression: issue 28, a compiled forward ran uncompiled under @graphed and its side effect (7 instead of 1).
    backend, calls = counting(name)
    cf = torch.compile(_forward, backend=backend, dynamic=False)
    w = torch.randn(6, 5, generator=gen)
    f = graphctl.graphed(cf, buckets=[2, 4], backend="emulated", inputs=["x"], progress=False)
    x = torch.randn(4, 6, generator=gen)
    STEPS.zero_()
    f.capture_all(x, w)
    ran = calls["n"]
    assert ran >= 2, ran  # one compiled warmup per bucket, at least
    assert STEPS.item() == 0  # every warmup and capture undone
    names = {n.name for n in f.nodes(4)}
    assert {"aten::tanh", "aten::mm", "aten::add_.Tensor"} <= names, names  # the compiled code's ops, one by one
    x2 = torch.randn(3, 6, generator=gen)
    out = f(x2, w).clone()
    assert STEPS.item() == 1 and calls["n"] == ran  # the replay ran the recorded ops, as a graph would
    torch.testing.assert_close(out, torch.tanh(x2 @ w) * 2 + 1)
    rep = f.report()
    assert rep.compiled == ("forward",) and rep.uncompiled == 0 and all(
        st["warmup_graphs"] >= 0 for st in rep.compile.values()), rep.compile
    frames = counters["frames"]["total"]
    cf(torch.randn(4, 6, generator=gen), w)  # called directly afterwards: compiled, nothing recompiled
    assert calls["n"] == ran + 1 and counters["frames"]["total"] == frames


class Block(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(6, 6, generator=gen))
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x):
        self.seen.add_(1)  # a buffer the compiled module writes: reached through the OptimizedModule
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("name", BACKENDS)
def test_plain_code_calling_a_compiled_module(name, gen):
    backend, calls = counting(name)
    block = Block(gen)
    cm = torch.compile(block, backend=backend, dynamic=False)
    head = torch.randn(6, 3, generator=gen)

    def fwd(x):
        return cm(x * 2) @ head

    f = graphctl.graphed(fwd, buckets=[2, 4], backend="emulated", progress=False)
    f.capture_all(torch.randn(4, 6, generator=gen))
    assert calls["n"] >= 2 and block.seen.item() == 0, (calls, block.seen)
    assert "forward" not in vars(cm) or vars(cm)["forward"].__name__ != "call"  # the capture's rerouting undone
    x = torch.randn(2, 6, generator=gen)
    with torch.no_grad():
        want = torch.relu(block.lin(x * 2)) @ head
    got = f(x).clone()
    torch.testing.assert_close(got, want)
    assert block.seen.item() == 1 and f.report().compiled == ("cm",), f.report().compiled
    assert [e.path for e in f.side_effects] == ["cm.seen"] or [e.path for e in f.side_effects][0].endswith("seen")


def test_inductor_cuda_graphs_are_refused(gen):
    cf = torch.compile(_forward, mode="reduce-overhead")
    f = graphctl.graphed(cf, buckets=[2], backend="emulated", inputs=["x"], progress=False)
    with pytest.raises(DeclarationError, match="reduce-overhead") as ei:
        f.capture_all(torch.randn(2, 6, generator=gen), torch.randn(6, 5, generator=gen))
    assert "max-autotune-no-cudagraphs" in ei.value.fix


class Knob:
    calls = 0


def test_a_frame_dynamo_converts_during_capture_is_counted_and_warned(backend, device, gen, caplog):
    knob = Knob()

    def fwd(x):
        knob.calls += 1  # host state the compiled code guards on: every call misses the cache
        return x * knob.calls

    cf = torch.compile(fwd, backend="aot_eager", dynamic=False)
    f = graphctl.graphed(cf, buckets=[2], backend=backend, progress=False, host_state="restore")
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(2, 3, generator=gen).to(device))
    rep = f.report()
    assert "changed host state" in caplog.text and "knob.calls" in caplog.text, caplog.text  # either way: reported
    if backend == "cuda":  # dynamo is asked during a CUDA capture, and cannot compile there
        assert rep.uncompiled >= 1 and "compiled frames run uncompiled: " in str(rep), str(rep)
        assert any("during the capture" in r.getMessage() for r in caplog.records), caplog.text
    else:  # the emulated capture records the code dynamo compiles: dynamo is not asked, the value is baked
        assert rep.uncompiled == 0, str(rep)


def test_a_compiled_function_dynamo_skips_for_good_is_counted(gen, caplog):
    # Regression: issue 28 on the H200 (torch 2.11), a compiled forward run once under a dispatch mode elsewhere was
    # skipped by dynamo at every later call, and no frame conversion showed it; graphctl reported 0 uncompiled.
    w = torch.randn(6, 5, generator=gen)

    def fwd(x):
        return torch.tanh(x @ w)

    cf = torch.compile(fwd, backend="aot_eager", dynamic=False)
    torch._dynamo.eval_frame.skip_code(fwd.__code__)  # what torch 2.11 does to a frame met under a dispatch mode
    f = graphctl.graphed(cf, buckets=[2], backend="emulated", progress=False)
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        f.capture_all(torch.randn(2, 6, generator=gen))
    assert f.report().uncompiled == 1 and "no compiled code after the warmups" in caplog.text, caplog.text


_WARM = r"""
import json, sys, torch, graphctl
torch.manual_seed(0)
w = torch.randn(16, 16)

def fwd(x):
    return torch.nn.functional.gelu(x @ w) * 2 + 1

f = graphctl.graphed(torch.compile(fwd, backend="inductor"), buckets=[2, 4], backend="emulated", progress=False)
f.capture_all(torch.randn(4, 16))
st = f.report().compile
hits, misses = (sum(s[k] for s in st.values()) for k in ("cache_hits", "cache_misses"))
print(json.dumps({"hits": hits, "misses": misses, "summary": f.report().compile_summary}))
"""


def test_a_second_process_finds_the_compiled_graphs_in_the_cache_and_the_report_says_so(tmp_path):
    # Regression: issue 54, a second `graphctl capture --compile` recompiled every bucket (16 s of a 94 s cold start
    # came back only through torch's default cache, unreported): GRAPHCTL_COMPILE_CACHE names the directory, and the
    # report counts the graphs that came from it.
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "GRAPHCTL_COMPILE_CACHE": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _WARM], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["misses"] > 0 and cold["hits"] == 0, cold
    assert warm["hits"] == cold["misses"] and warm["misses"] == 0, (cold, warm)
    assert "from torch's compile cache: " in warm["summary"], warm
    assert any((tmp_path / "cache").iterdir())  # the artifacts are where the knob said


def test_a_compiled_forward_that_registers_modules_compiles_once_beside_graphctl_s_hooks(gen):
    # Regression: issue 54, graphctl's module-registration hooks (the path check's walk trigger) counted into a global
    # inside traced code: transformers slices its ModuleList of layers at every call (a new ModuleList registers its
    # children), dynamo guarded on the count, and every call compiled again (5 graphs a bucket for the HF step).
    from graphctl.graphs.capture.compiled import Counters
    from graphctl.graphs.replay import rebinding

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[:2]:  # a fresh ModuleList each call, as transformers' models do
                x = layer(x)
            return x

    rebinding._hook_registrations()  # what the first capture with module paths installs
    torch._dynamo.reset()
    m = Stack()
    f = torch.compile(m.forward, backend="eager")
    before = Counters.now()
    x = torch.randn(4, 8, generator=gen)
    for _ in range(4):
        torch.testing.assert_close(f(x), m.layers[1](m.layers[0](x)))
    assert Counters.now().since(before).frames == 1  # one conversion, no recompile
    count = rebinding._REGISTRATIONS[0]
    m.layers.append(torch.nn.Linear(8, 8))  # eager code changing the model is still counted
    assert rebinding._REGISTRATIONS[0] > count
    torch._dynamo.reset()
