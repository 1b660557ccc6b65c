"""The graph backends, declared as data: what each needs, and why it cannot run here.

``backend="auto"`` (or the ``GRAPHCTL_BACKEND`` knob) picks ``cuda`` when the forward's inputs
live on a CUDA device and torch can capture there, else ``emulated``. Asking for a backend
that cannot run raises :class:`~graphctl.errors.CaptureError` with every reason."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from graphctl.debug import knobs
from graphctl.errors import CaptureError
from graphctl.graphs.cuda import CudaBackend
from graphctl.graphs.emulated import EmulatedBackend

__all__ = ["BackendDecl", "BACKENDS", "select_backend", "unsupported_reasons"]


def _cuda_reasons(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return [f"the forward's inputs live on {device}, and a CUDA graph only captures CUDA work"]
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"]
    return []


@dataclasses.dataclass(frozen=True, slots=True)
class BackendDecl:
    name: str
    make: Callable[[torch.device], Any]
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


def select_backend(name: str, device: torch.device) -> Any:
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
