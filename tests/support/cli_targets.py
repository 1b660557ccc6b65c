"""Capture targets for the CLI tests (``graphctl capture tests/support/cli_targets.py:<factory>``):
each factory follows the CaptureTarget protocol; two plant a bug the command must report."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support.*

from graphctl import CaptureTarget, StaticInput  # noqa: E402


def small(*, device: str, max_batch: int, **_) -> CaptureTarget:
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(device)
    x = torch.randn(max_batch, 8, generator=torch.Generator().manual_seed(1)).to(device)
    return CaptureTarget(forward=lambda x: torch.tanh(x @ w), example=(x,), inputs=["x"], params={"w": w},
                         name="small")


def baked_host_value(*, device: str, max_batch: int, **_) -> CaptureTarget:
    """The forward reads a Python counter: the graph keeps the capture-time value, eager does not."""
    calls = [0]

    def fwd(x):
        calls[0] += 1
        return x * float(calls[0])

    x = torch.randn(max_batch, 4, generator=torch.Generator().manual_seed(2)).to(device)
    return CaptureTarget(forward=fwd, example=(x,), inputs=["x"], name="baked_host_value")


def target_reads_refreshed(*, device: str, max_batch: int, **_) -> CaptureTarget:
    """The target reads the draft twin that is refreshed in place before replay (TensorRT-LLM #16887)."""
    from support.graphs import Toy

    toy = Toy(device, torch.Generator().manual_seed(3), backend="emulated")
    st = toy.state

    def fwd(tokens, positions, meta):
        bad = meta.draft_block_offsets[: tokens.shape[0] // 3, 0].float() * 2
        with st.switch("draft"):
            d = meta.block_offsets[: tokens.shape[0] // 3, 0].float() * 3
        return bad + d

    tokens, positions = toy.batch(min(max_batch, toy.S))
    return CaptureTarget(forward=fwd, example=(tokens, positions, toy.meta), state=st,
                         inputs=[StaticInput("tokens", per_item=3), StaticInput("positions", per_item=3)],
                         name="target_reads_refreshed")


def not_a_target(**_):
    return {"forward": None}


def raises_in_factory(*, device: str, max_batch: int, **_) -> CaptureTarget:
    raise RuntimeError("the factory could not build its model")


def wrong_signature(device):  # no max_batch/draft_len keywords
    raise AssertionError("never called")


def forward_raises(*, device: str, max_batch: int, **_) -> CaptureTarget:
    """The forward raises while a bucket is being captured."""
    from graphctl.state.phase import is_recording

    def fwd(x):
        if is_recording() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            raise ValueError("shape mismatch in layer 3")
        return x * 2

    x = torch.randn(max_batch, 4, generator=torch.Generator().manual_seed(2)).to(device)
    return CaptureTarget(forward=fwd, example=(x,), inputs=["x"], name="forward_raises")


def interrupted(*, device: str, max_batch: int, **_) -> CaptureTarget:
    """Ctrl-C during the capture."""
    from graphctl.state.phase import is_recording

    def fwd(x):
        if is_recording() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            raise KeyboardInterrupt
        return x * 2

    x = torch.randn(max_batch, 4, generator=torch.Generator().manual_seed(2)).to(device)
    return CaptureTarget(forward=fwd, example=(x,), inputs=["x"], name="interrupted")


def _like_small(device: str, max_batch: int, **change) -> CaptureTarget:
    import dataclasses

    return dataclasses.replace(small(device=device, max_batch=max_batch), **change)


def forward_none(*, device: str, max_batch: int, **_) -> CaptureTarget:
    return _like_small(device, max_batch, forward=None)


def bare_tensor_example(*, device: str, max_batch: int, **_) -> CaptureTarget:
    return _like_small(device, max_batch, example=torch.randn(max_batch, 8).to(device))


def object_state(*, device: str, max_batch: int, **_) -> CaptureTarget:
    return _like_small(device, max_batch, state=object())


def unknown_input(*, device: str, max_batch: int, **_) -> CaptureTarget:
    return _like_small(device, max_batch, inputs=["nope"])


def example_missing_an_argument(*, device: str, max_batch: int, **_) -> CaptureTarget:
    x = torch.randn(max_batch, 8).to(device)
    return CaptureTarget(forward=lambda x, scale: x * scale, example=(x,), inputs=["x"], name="two_args")


def exits_3(**_):
    raise SystemExit(3)  # graphctl's own --hard-fail-on-fallback code: must not pass for it


def raises_while_timed(*, device: str, max_batch: int, **_) -> CaptureTarget:
    """The forward works through capture and verify, then fails on an eager call while timed."""
    from graphctl.state.phase import is_recording

    calls = [0]

    def fwd(x):
        if not is_recording() and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            calls[0] += 1
            if calls[0] > 6:
                raise RuntimeError("device lost")
        return x * 2

    x = torch.randn(max_batch, 4, generator=torch.Generator().manual_seed(2)).to(device)
    return CaptureTarget(forward=fwd, example=(x,), inputs=["x"], name="raises_while_timed")
