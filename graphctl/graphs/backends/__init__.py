"""The graph backends, declared as data: what each needs, and why it cannot run here.

``backend="auto"`` (or the ``GRAPHCTL_BACKEND`` knob) picks ``cuda`` when the forward's inputs
live on a CUDA device and torch can capture there, else ``emulated``. Asking for a backend
that cannot run raises :class:`~graphctl.errors.CaptureError` with every reason."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from graphctl.errors import CaptureError
from graphctl.graphs.analysis.nodes import Node, Region
from graphctl.graphs.backends.cuda import CudaBackend
from graphctl.graphs.backends.emulated import EmulatedBackend
from graphctl.graphs.backends.hooks import ReplayHooks
from graphctl.knobs import knobs

__all__ = ["BackendDecl", "BACKENDS", "CapturedGraph", "GraphBackend", "select_backend", "unsupported_reasons"]


class CapturedGraph(Protocol):
    """One captured bucket, as a backend hands it back."""

    regions: tuple[Any, ...]  # eager regions between its pieces (graphs/capture/pieces.py); () for a whole graph

    @property
    def node_count(self) -> int: ...
    @property
    def pool_bytes(self) -> int: ...
    def replay(self, hooks: ReplayHooks | None = None) -> None: ...  # hooks: graphs/backends/hooks.py
    def dot(self, path: str) -> None: ...  # Graphviz DOT (CUDA); the emulated graph says it has none
    def nodes(self) -> list[Node]: ...  # capture order, bodies nested (graphs/analysis/nodes.py)
    def memory_regions(self) -> list[Region]: ...  # pools and allocator blocks, for the audit
    def repoint(self, moves: list[Any]) -> Callable[[], int]: ...  # checks now; the call rewrites (replay/repoint.py)


class GraphBackend(Protocol):
    """What the runner needs of a graph backend (``cuda`` and ``emulated`` implement it).

    ``warmup(body)`` runs ``body()`` eagerly as the capture will see it (CUDA: on the capture
    stream); ``capture(body, pool, bucket)`` records ``body(mark)`` into a graph sharing ``pool``
    (``mark()`` returns the number of nodes recorded so far: segment boundaries) and returns the
    graph and ``body``'s output, or raises ``CaptureError`` having left nothing behind (compiled
    code: the CUDA backend captures its kernels, the emulated one records the code it compiles);
    ``live_blocks()`` is the set of live allocator blocks ``(address, size)`` (workspaces that a
    warmup allocated and kept show up as the difference); ``new_pool()`` a memory pool for
    ``capture``; ``synchronize()`` waits for the device."""

    name: str
    device: torch.device
    capture_executes: bool  # whether a capture runs the forward's ops (and so changes the state it writes)

    def warmup(self, body: Callable[[], Any]) -> Any: ...
    def capture(self, body: Callable[[Callable[[], int]], Any], pool: Any, bucket: int,
                generators: Sequence[Any] = ()) -> tuple[CapturedGraph, Any]: ...
    def live_blocks(self) -> set[tuple[int, int]]: ...
    def new_pool(self) -> Any: ...
    def synchronize(self) -> None: ...


def _cuda_reasons(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return [f"the forward's inputs live on {device}, and a CUDA graph only captures CUDA work"]
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"]
    return []


@dataclasses.dataclass(frozen=True, slots=True)
class BackendDecl:
    name: str
    make: Callable[[torch.device], GraphBackend]
    reasons: Callable[[torch.device], list[str]]
    doc: str


BACKENDS: dict[str, BackendDecl] = {b.name: b for b in (
    BackendDecl("cuda", CudaBackend, _cuda_reasons,
                "torch.cuda.CUDAGraph with the template kept; exception-safe capture, one shared pool"),
    BackendDecl("emulated", EmulatedBackend, lambda device: [],
                "TorchDispatchMode recorder; replays the recorded ops onto the same storages, on any device"),
)}


def unsupported_reasons(name: str, device: torch.device) -> list[str]:
    """Why backend ``name`` cannot capture work on ``device`` (empty when it can)."""
    return BACKENDS[name].reasons(device)


def select_backend(name: str, device: torch.device) -> GraphBackend:
    if name == "auto":
        name = knobs.graph_backend
    if name == "auto":
        name = "cuda" if not unsupported_reasons("cuda", device) else "emulated"
    if name not in BACKENDS:
        raise CaptureError("unknown graph backend", expected="auto, cuda or emulated", found=name,
                           fix="pass backend='auto' (CUDA when possible, else emulated)")
    reasons = unsupported_reasons(name, device)
    if reasons:
        raise CaptureError(f"backend '{name}' cannot run here", expected="a supported backend",
                           found="; ".join(reasons), fix="use backend='auto' or 'emulated'")
    return BACKENDS[name].make(device)
