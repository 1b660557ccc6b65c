"""The choice between an op's Triton kernel and its pure-PyTorch reference, one per op.

A knob (``auto`` | ``triton`` | ``reference``) picks: ``reference`` and every device but CUDA run
the reference; ``auto`` and ``triton`` import the kernel's module on first use (Triton ships with
torch's CUDA wheels, not its CPU ones), and ``triton`` raises where it does not import. Triton
builds a kernel on its first launch: under ``auto`` a Triton that cannot build it here leaves the
reference for good, said once in the log (a serving process must not go down for a faster
path); under ``triton`` the error propagates.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from graphctl.knobs import env_of, knobs

__all__ = ["TritonPick"]

log = logging.getLogger("graphctl")


class TritonPick:
    """``knob``: the knob's name; ``module`` / ``name``: where the Triton launcher is. ``state``:
    ``"kernel"`` the launcher, or ``"why"`` the reason there is none; ``"ran"`` once it launched."""

    def __init__(self, knob: str, module: str, name: str) -> None:
        self.knob, self.module, self.name = knob, module, name
        self.state: dict[str, Any] = {}

    def kernel(self, device: torch.device) -> Callable[..., Any] | None:
        """The Triton launcher the knob picks for ``device``; None: run the reference."""
        choice = getattr(knobs, self.knob)
        if choice == "reference" or device.type != "cuda":
            return None
        if "kernel" not in self.state and "why" not in self.state:
            try:
                mod = importlib.import_module(self.module)
            except ImportError as exc:  # CPU-only wheels ship no Triton
                self.state["why"] = f"{type(exc).__name__}: {exc}"
            else:
                self.state["kernel"] = getattr(mod, self.name)
        if "kernel" in self.state:
            return self.state["kernel"]
        if choice == "triton":
            env = env_of(self.knob)
            raise RuntimeError(f"{env}=triton, but Triton cannot be imported ({self.state['why']}); install "
                               f"torch's CUDA wheels (they ship Triton) or set {env} to auto or reference")
        return None

    def run(self, kernel: Callable[..., Any], reference: Callable[..., Any], *args: Any) -> Any:
        """``kernel(*args)``; on its first launch, a Triton error under ``auto`` runs
        ``reference(*args)`` instead, and every later call too."""
        if self.state.get("ran"):
            return kernel(*args)
        try:  # the first launch compiles the kernel for this GPU
            out = kernel(*args)
        except Exception as exc:
            if getattr(knobs, self.knob) == "triton" or not type(exc).__module__.startswith("triton"):
                raise
            self.state.pop("kernel", None)
            self.state["why"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("graphctl: the Triton kernel of %s does not build here (%s); using the reference "
                        "(%s=reference says so explicitly)", self.name, self.state["why"], env_of(self.knob))
            return reference(*args)
        self.state["ran"] = True
        return out
