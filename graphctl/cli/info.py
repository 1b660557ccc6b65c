"""``graphctl info``: what was built against what is running, and why ``_C`` did not load."""
from __future__ import annotations

import json
import platform
from typing import Any

import torch

import graphctl
from graphctl.graphs.features import detect
from graphctl.knobs import knobs
from graphctl.ops import extension_status


def gpus() -> list[dict[str, Any]] | str:
    try:
        import pynvml
    except ImportError as exc:
        return f"nvidia-ml-py not importable ({exc})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no NVIDIA driver ({exc})"
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append({
                "index": i,
                "name": pynvml.nvmlDeviceGetName(h),
                "compute_capability": ".".join(map(str, pynvml.nvmlDeviceGetCudaComputeCapability(h))),
                "memory_gib": round(mem.total / 2**30, 1),
                "sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "sm_clock_now_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "driver": pynvml.nvmlSystemGetDriverVersion(),
            })
        return out
    finally:
        pynvml.nvmlShutdown()


def collect() -> dict[str, Any]:
    st = extension_status()
    build = st.build or {}
    return {
        "graphctl": graphctl.__version__,
        "python": platform.python_version(),
        "runtime": {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                    "cuda_available": torch.cuda.is_available()},
        "build": build or None,
        "extension": {"loaded": st.loaded, "with_cuda": st.with_cuda, "error": st.error},
        "features": detect(),
        "knobs": knobs.as_dict(),
        "gpus": gpus(),
    }


def run_info(as_json: bool = False) -> int:
    data = collect()
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"graphctl {data['graphctl']}", show_lines=False)
    t.add_column("")
    t.add_column("built with")
    t.add_column("running")
    b, r = data["build"] or {}, data["runtime"]
    t.add_row("python", str(b.get("python", "-")), data["python"])
    t.add_row("torch", str(b.get("torch", "-")), r["torch"])
    t.add_row("torch CUDA", str(b.get("torch_cuda", "-")), str(r["torch_cuda"]))
    feats = data["features"]
    t.add_row("CUDA driver", "-", str(feats.get("driver_cuda") or "no driver"))
    t.add_row("cuda-bindings", "-", str(feats.get("cuda_bindings") or "not installed"))
    t.add_row("bindings runtime", "-", str(feats.get("bindings_runtime") or "-"))
    t.add_row("nvcc", str(b.get("nvcc", "-")), "-")
    t.add_row("CUDA toolkit", str(b.get("cuda_home") or "-"), "-")
    why = f" ({b['why_no_cuda']})" if b.get("why_no_cuda") else ""
    t.add_row("CUDA kernels", f"{b.get('with_cuda', '-')}{why}", str(data["extension"]["with_cuda"]))
    t.add_row("arch list", str(b.get("arch_list", "-")), "-")
    ext = data["extension"]
    t.add_row(
        "graphctl._C", "built" if b else "not built", "loaded" if ext["loaded"] else f"[red]not loaded: {ext['error']}"
    )
    con.print(t)
    gpus = data["gpus"]
    if isinstance(gpus, str):
        con.print(f"GPUs: {gpus}")
    else:
        g = Table(title="GPUs")
        for col in ("index", "name", "compute_capability", "memory_gib", "sm_clock_mhz", "driver"):
            g.add_column(col)
        for row in gpus:
            g.add_row(*(str(row[c]) for c in ("index", "name", "compute_capability", "memory_gib", "sm_clock_mhz",
                                               "driver")))
        con.print(g)
    con.print("features: " + ", ".join(f"{k}={v}" for k, v in feats.items()
                                       if k not in ("cuda_bindings", "bindings_runtime", "driver_cuda")))
    con.print("knobs: " + ", ".join(f"{k}={v}" for k, v in data["knobs"].items()))
    return 0
