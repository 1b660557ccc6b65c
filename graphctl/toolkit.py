"""Where the CUDA toolkit is, for ``setup.py`` (which loads this file by path, before torch's
build helpers are imported) and ``graphctl info``. Standard library only.

torch guesses ``CUDA_HOME`` from the directory above an ``nvcc`` on ``PATH``; a wrapper script
in ``/usr/local/bin`` makes that ``/usr/local``, which has no ``libcudart``, and the link fails
minutes into the build. :func:`find` takes ``CUDA_HOME`` when set (and then only it), else the
real directory of ``nvcc`` on ``PATH``, ``/usr/local/cuda``, then ``/usr/local/cuda-*`` newest
first: the first that has nvcc, ``cuda_runtime.h`` and ``libcudart``.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

__all__ = ["find", "missing", "nvcc_version", "driver"]


def driver() -> str | None:
    """Where this machine shows an NVIDIA driver or GPU (the kernel module's ``/proc`` entry, a
    device node, or the driver library ``libcuda``), or None. Without one, CUDA kernels could
    not run here: ``GRAPHCTL_BUILD_CUDA=auto`` skips their minutes of compiling."""
    for path in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"):
        if os.path.exists(path):
            return path
    import ctypes.util

    lib = ctypes.util.find_library("cuda")
    return f"lib{lib}" if lib and not lib.startswith("lib") else lib


def nvcc_version(home: str) -> str | None:
    nvcc = os.path.join(home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for token in out.replace(",", " ").split():
        if token.startswith("V") and token[1:2].isdigit():
            return token[1:]
    return None


def missing(home: str) -> str | None:
    """What a toolkit directory lacks to build and link the kernels, or None when it has it all."""
    if not os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return "no bin/nvcc"
    roots = [home] + glob.glob(os.path.join(home, "targets", "*"))
    if not any(os.path.isfile(os.path.join(r, "include", "cuda_runtime.h")) for r in roots):
        return "no include/cuda_runtime.h"
    libs = [os.path.join(r, d, n) for r in roots for d in ("lib64", "lib", os.path.join("lib", "x64"))
            for n in ("libcudart.so", "cudart.lib")]
    if not any(os.path.isfile(p) for p in libs):
        return "no libcudart"
    return None


def _version_key(path: str) -> tuple[int, ...]:
    tail = os.path.basename(path).split("-", 1)[-1]
    return tuple(int(p) for p in tail.split(".") if p.isdigit())


def find(cuda_home: str = "", prefix: str = "/usr/local") -> tuple[str | None, str]:
    """(the CUDA toolkit directory to build with, or None; why, in a few words). ``prefix``:
    where ``cuda`` and ``cuda-*`` are looked for."""
    tried = []
    candidates = [("CUDA_HOME", cuda_home)] if cuda_home else []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(("nvcc on PATH", os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))))
    candidates.append(("default", os.path.join(prefix, "cuda")))
    candidates += [("found", d) for d in sorted(glob.glob(os.path.join(prefix, "cuda-*")), key=_version_key,
                                                 reverse=True)]
    for origin, home in candidates:
        if not os.path.isdir(home):
            tried.append(f"{home} ({origin}): not a directory")
            continue
        lack = missing(home)
        if lack is None:
            return home, f"{home} ({origin})"
        tried.append(f"{home} ({origin}): {lack}")
        if origin == "CUDA_HOME":
            break  # set on purpose: never build against another toolkit behind the user's back
    return None, "no usable CUDA toolkit (" + "; ".join(tried) + ")"
