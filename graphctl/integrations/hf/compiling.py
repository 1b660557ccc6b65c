"""How :class:`~graphctl.integrations.hf.engine.HFEngine` compiles its two models (issue 54).

``static`` (the default, what the H100/H200 numbers in bench/RESULTS.md measured): one Inductor graph
per model and batch layout, ``dynamic=False``: a speculative step calls the target at one layout and
the draft at two per bucket, so every bucket compiles both models again (22-25 s a bucket for
llama-1b on an H100).

``dynamic``: the batch dimension symbolic from the first call (``dynamic=True``), so one graph per
model serves every bucket of 2 or more; bucket 1 compiles its own (dynamo specializes sizes 0 and 1).
Duck sizing is turned off process-wide (``torch.fx.experimental._config.use_duck_shape``): with it,
a bucket equal to the block size made dynamo assume the two sizes equal and compile again at the
next bucket. Measured on the CPU (tiny-llama, buckets 1-8, ``tests/unit/test_hf_paged.py``); its
replay cost against the static graphs on a GPU is not measured yet, so it is not the default.
"""
from __future__ import annotations

from typing import Any

import torch

from graphctl.graphs.capture.compiled import is_compiled, use_compile_cache

__all__ = ["MODES", "check_mode", "compile_models"]

MODES = ("static", "dynamic")


def check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"compile_mode={mode!r}: expected one of {', '.join(map(repr, MODES))} "
                         "(static: a graph per bucket; dynamic: one for every bucket of 2 or more)")


def compile_models(*models: Any, backend: str, mode: str = "static") -> None:
    """Each model's forward compiled with ``backend`` (graphctl owns the CUDA graphs: no
    ``reduce-overhead``) in ``mode`` (see the module docstring); ``GRAPHCTL_COMPILE_CACHE`` applied
    first. Dynamo's global recompile limit is raised to 64 so that every bucket's graphs fit (a
    lower limit would leave the rest uncompiled, which graphctl counts)."""
    check_mode(mode)
    use_compile_cache()  # before anything compiles (a prefill may, before any capture)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    if mode == "dynamic":
        torch.fx.experimental._config.use_duck_shape = False
    for m in models:
        if not is_compiled(vars(m).get("forward")):
            m.forward = torch.compile(m.forward, backend=backend, dynamic=mode == "dynamic")
