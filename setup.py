"""Builds the one extension, ``graphctl._C``, from ``csrc/``.

The CPU kernels are always compiled. The CUDA kernels (``csrc/cuda/*.cu``) are compiled
when torch was built with CUDA and nvcc is found (``GRAPHCTL_BUILD_CUDA=auto``), always
(``=1``, failing loudly if impossible) or never (``=0``). The versions this build used are
written to ``graphctl/_build.json`` so ``graphctl info`` can show them next to the runtime.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_knobs():
    # By path: importing the package here would try to load the extension being built.
    spec = importlib.util.spec_from_file_location("_graphctl_debug", os.path.join(ROOT, "graphctl", "debug.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses needs the module registered
    spec.loader.exec_module(mod)
    return mod.knobs


def _nvcc_version(cuda_home: str | None) -> str | None:
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    for token in out.replace(",", " ").split():
        if token.startswith("V") and token[1:2].isdigit():
            return token[1:]
    return out.strip().splitlines()[-1] if out.strip() else None


def _extensions():
    import torch
    from torch.utils import cpp_extension

    knobs = _load_knobs()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", knobs.arch_list)
    cuda_home = cpp_extension.CUDA_HOME
    nvcc = _nvcc_version(cuda_home)
    can_cuda = torch.version.cuda is not None and nvcc is not None
    if knobs.build_cuda == "1" and not can_cuda:
        raise RuntimeError(
            f"GRAPHCTL_BUILD_CUDA=1 but CUDA kernels cannot be built: torch.version.cuda="
            f"{torch.version.cuda!r}, nvcc={'found ' + nvcc if nvcc else 'not found'} "
            f"(CUDA_HOME={cuda_home!r}). Install a CUDA build of torch and the CUDA toolkit, "
            f"or set GRAPHCTL_BUILD_CUDA=auto."
        )
    with_cuda = can_cuda and knobs.build_cuda != "0"

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx = ["-O3"]  # torch picks the C++ standard it needs (C++17 up to 2.13, C++20 from 2.14)
    define_macros = []
    if with_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        define_macros.append(("GRAPHCTL_WITH_CUDA", "1"))
        ext = cpp_extension.CUDAExtension(
            "graphctl._C", sources, define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        )
    else:
        ext = cpp_extension.CppExtension("graphctl._C", sources, define_macros=define_macros,
                                         extra_compile_args={"cxx": cxx})

    build = {
        "graphctl_c": True,
        "with_cuda": with_cuda,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": nvcc,
        "cuda_home": cuda_home,
        "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    with open(os.path.join(ROOT, "graphctl", "_build.json"), "w") as f:
        json.dump(build, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"graphctl build: {'CUDA + CPU' if with_cuda else 'CPU only'} kernels "
          f"(torch {torch.__version__}, torch CUDA {torch.version.cuda}, nvcc {nvcc})")
    return [ext], cpp_extension.BuildExtension


exts, build_ext = _extensions()
setup(ext_modules=exts, cmdclass={"build_ext": build_ext.with_options(use_ninja=bool(shutil.which("ninja")))})
