"""A write's derived-buffer recompute replayed from one CUDA graph instead of launched op by op.

Every ``write``/``write_many`` outside a capture recomputes the buffers derived from what it wrote
(``plan.closure``): on the paged family five functions, about forty small kernels, each paying
Python's and the launcher's host time. Between two decode steps that is most of the host's work
while the device idles (issue 32). The chain's inputs and outputs are declared buffers whose
addresses hold still, so the second time a chain runs over the same tensors it is captured once
as a CUDA graph (a private pool for its temporaries) and every later write replays it: one launch.

Sound because a chain's graph is keyed by everything it bakes: the state's phase, the derived
names in order, and every tensor it reads or writes by address, shape, strides and dtype. A chain
with an input that is not a tensor (an object whose attributes a fn may read, which a graph would
bake without seeing) always runs eagerly, as does every chain while a capture is recording (it is
recorded into that graph as before), under a dispatch mode (the emulated backend's recorder and the
side-effect tracker must see each op; a replay is none), on other devices, and under
``GRAPHCTL_GRAPHED_RECOMPUTE=0``.
A fn that cannot be captured (it syncs with the host, say) is captured once, fails, and its chain
runs eagerly from then on, said once in the log. Errors a fn raises eagerly it raises while being
captured (same Python, same checks); a replay runs device code only.

Graphs live as long as their state (a weak map), at most ``MAX_CHAINS`` a state, oldest dropped.
"""
from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Any

import torch

from graphctl.knobs import knobs
from graphctl.state import paths
from graphctl.state.core import StateCore

__all__ = ["recompute", "MAX_CHAINS", "graphs_of"]

log = logging.getLogger("graphctl")

MAX_CHAINS = 16
_EAGER = "eager"  # a chain that failed to capture: eager for good
_STATES: weakref.WeakKeyDictionary[Any, OrderedDict] = weakref.WeakKeyDictionary()
_KNOBS = knobs.live()


def graphs_of(st: StateCore) -> dict[tuple, Any]:
    """The chains ``st`` holds: key -> CUDA graph, ``"eager"``, or None (seen once, not yet captured)."""
    return dict(_STATES.get(st, {}))


def recompute(st: StateCore, deps: tuple[str, ...]) -> None:
    """Recompute ``deps`` (dependency order) as ``st._recompute`` each would, through a replayed
    CUDA graph where that is sound (module docstring)."""
    key = _key(st, deps) if deps and _KNOBS["graphed_recompute"] else None
    chains = _STATES.setdefault(st, OrderedDict()) if key is not None else None
    if chains is not None and key in chains:
        got = chains[key]
        if got is None:  # the second time: captured now, replayed below
            got = chains[key] = _capture(st, deps)
        if got is not _EAGER:
            chains.move_to_end(key)
            got.replay()
            return
    elif chains is not None:  # the first time: eager (it is the warmup a capture needs)
        chains[key] = None
        while len(chains) > MAX_CHAINS:
            chains.popitem(last=False)
    for dep in deps:
        st._recompute(dep)


def _key(st: StateCore, deps: tuple[str, ...]) -> tuple | None:
    """What a chain's graph bakes, or None where the chain must run eagerly."""
    if torch._C._len_torch_dispatch_stack():  # a recorder or tracker (a dispatch mode) must see every op
        return None
    parts: list[Any] = [st._active.phase if st._active is not None else None, deps]
    device = None
    for dep in deps:
        rc = st.plan.buffers[dep].derive
        assert rc is not None
        for name in (dep, *rc.inputs):
            t = paths.get(st.obj, name)
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or device not in (None, t.device):
                return None
            device = t.device
            parts.append((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))
    # asked only once the tensors are CUDA ones (a machine without a driver raises here)
    return None if torch.cuda.is_current_stream_capturing() else tuple(parts)


def _capture(st: StateCore, deps: tuple[str, ...]) -> Any:
    """The chain as a CUDA graph (not run: the caller replays it), or ``"eager"`` where it cannot be."""
    graph = torch.cuda.CUDAGraph()
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream(device=cur.device)
    side.wait_stream(cur)  # the inputs just written on the current stream
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for dep in deps:
                    st._recompute(dep)
            finally:
                graph.capture_end()
    except Exception as exc:  # a fn that cannot be captured (or raises): eager from now on, which raises it again
        log.warning("graphctl: the recompute of %s cannot be captured as a CUDA graph (%s: %s); it runs op by op",
                    ", ".join(deps), type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return _EAGER
    finally:
        cur.wait_stream(side)
    return graph
