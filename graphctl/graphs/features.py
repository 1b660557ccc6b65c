"""What this torch, cuda-bindings and driver can do for graphctl, detected (never required):
graphctl runs on torch >= 2.11 and uses newer APIs where they exist."""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from graphctl import bindings

__all__ = ["detect"]


@functools.cache
def detect() -> dict[str, Any]:
    """Feature name -> bool (or a version), for ``graphctl info`` and for choosing code paths."""
    f: dict[str, Any] = {}
    f["keep_graph"] = _keep_graph()
    f["torch_while_loop"] = _has_while_loop()
    rt, drv = bindings.runtime(), bindings.driver()
    f["cuda_bindings"] = bindings.version()
    if rt is not None:
        names = set(vars(rt)) | set(vars(drv))
        f["conditional_nodes"] = "cudaGraphConditionalHandleCreate" in names
        f["capture_to_graph"] = "cudaStreamBeginCaptureToGraph" in names
        f["kernel_param_info"] = "cuFuncGetParamInfo" in names
        f["dot_print"] = "cudaGraphDebugDotPrint" in names
        f["bindings_runtime"] = _version_of(rt.cudaRuntimeGetVersion)
        f["driver_cuda"] = _version_of(drv.cuDriverGetVersion)
    return f


def _keep_graph() -> bool:
    # torch/cuda/graphs.py declares ``CUDAGraph.__new__(cls, keep_graph=False)`` (2.5+)
    try:
        return "keep_graph" in inspect.signature(torch.cuda.CUDAGraph.__new__).parameters
    except (TypeError, ValueError):
        return False


def _has_while_loop() -> bool:
    try:
        from torch._higher_order_ops.while_loop import while_loop  # noqa: F401
    except ImportError:
        return False
    return True


def _version_of(call: Any) -> str | None:
    """``"13.0"`` from a cuda-bindings version call; None without a driver (the bindings then
    raise while loading libcuda, not an error code)."""
    try:
        err, v = call()
    except Exception:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}" if int(err) == 0 and v else None
