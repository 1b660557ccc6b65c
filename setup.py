"""Builds the one extension, ``graphctl._C``, from ``csrc/``.

The CPU kernels are always compiled. The CUDA kernels (``csrc/cuda/*.cu``) are compiled when
they can be and can run here (``GRAPHCTL_BUILD_CUDA=auto``): torch was built with CUDA, the
machine has an NVIDIA driver or GPU, and a CUDA toolkit is found whose nvcc, ``cuda_runtime.h``
and ``libcudart`` are all there and whose major version is torch's (compiling them for two
architectures takes minutes; on a machine that cannot run them it was most of a first set-up).
Otherwise the build says why in one line and compiles the CPU kernels only.
``GRAPHCTL_BUILD_CUDA=1`` turns that line into an error (CI sets it); ``=0`` never builds CUDA.

The toolkit is searched by ``graphctl/toolkit.py`` rather than left to torch, whose guess from
an ``nvcc`` wrapper in ``/usr/local/bin`` is ``/usr/local`` (no ``libcudart``: the link fails
minutes into the build).

What the build used is written to ``graphctl/_build.json`` beside the built extension (in
the wheel, or in the source tree for in-place and editable builds) after a successful build
only, so ``graphctl info`` can show it next to the runtime. A failed build removes the
``build/`` and ``*.egg-info`` folders it created in the source tree.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _by_path(name: str):
    # By path: importing the package here would try to load the extension being built.
    spec = importlib.util.spec_from_file_location(f"_graphctl_{name}", os.path.join(ROOT, "graphctl", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses needs the module registered
    spec.loader.exec_module(mod)
    return mod


def _load_knobs():
    return _by_path("knobs").knobs


NO_DRIVER = "this machine has no NVIDIA driver or GPU to run them"


def _plan():
    """Decide what to build before torch's build helpers are imported (they read CUDA_HOME once)."""
    import torch

    knobs = _load_knobs()
    if knobs.build_cuda == "0":
        return None, None, "GRAPHCTL_BUILD_CUDA=0"
    toolkit = _by_path("toolkit")
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    else:
        # The toolkit is looked at first: a broken one is worth naming even where there is no GPU.
        home, why = toolkit.find(knobs.cuda_home)
        if home is not None:
            nvcc = toolkit.nvcc_version(home)
            if nvcc is None:
                why = f"{home}/bin/nvcc does not run"
            elif nvcc.split(".")[0] != torch.version.cuda.split(".")[0]:
                why = f"nvcc {nvcc} in {home} and torch's CUDA {torch.version.cuda} differ in major version"
            elif knobs.build_cuda == "auto" and toolkit.driver() is None:
                why = NO_DRIVER
            else:
                return home, nvcc, why
    if knobs.build_cuda == "1":
        raise SystemExit(f"graphctl build: GRAPHCTL_BUILD_CUDA=1 but the CUDA kernels cannot be built: {why}. "
                         f"Install a CUDA build of torch and the matching CUDA toolkit (or point CUDA_HOME at it), "
                         f"or set GRAPHCTL_BUILD_CUDA=auto.")
    return None, None, why


def _extensions():
    import torch

    home, nvcc, why = _plan()
    if home is not None:
        os.environ["CUDA_HOME"] = home  # before cpp_extension is imported: it reads it once
    from torch.utils import cpp_extension

    knobs = _load_knobs()
    with_cuda = home is not None
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", knobs.arch_list)
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx = ["-O3"]  # torch picks the C++ standard it needs (C++17 up to 2.13, C++20 from 2.14)
    if with_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        ext = cpp_extension.CUDAExtension(
            "graphctl._C", sources, define_macros=[("GRAPHCTL_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        )
        print(f"graphctl build: CUDA + CPU kernels (torch {torch.__version__}, CUDA toolkit {why}, nvcc {nvcc}, "
              f"arch {os.environ['TORCH_CUDA_ARCH_LIST']})")
    else:
        ext = cpp_extension.CppExtension("graphctl._C", sources, extra_compile_args={"cxx": cxx})
        hint = "builds them anyway" if why == NO_DRIVER else "makes this an error"
        hint = f"GRAPHCTL_BUILD_CUDA=1 {hint}"
        print(f"graphctl build: CPU kernels only, because {why} ({hint})")

    record = {
        "graphctl_c": True,
        "with_cuda": with_cuda,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": nvcc,
        "cuda_home": home,
        "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else None,
        "why_no_cuda": None if with_cuda else why,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }

    class BuildExt(cpp_extension.BuildExtension):
        """torch's build_ext, then the build record beside the extension it built."""

        def run(self) -> None:
            super().run()
            base = ROOT if self.inplace else self.build_lib
            path = os.path.join(base, "graphctl", "_build.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=2, sort_keys=True)
                f.write("\n")

    return [ext], BuildExt.with_options(use_ninja=bool(shutil.which("ninja")))


def _main() -> None:
    made = (os.path.join(ROOT, "build"), *glob.glob(os.path.join(ROOT, "*.egg-info")))
    existed = {p for p in made if os.path.exists(p)}
    try:
        exts, build_ext = _extensions()
        setup(ext_modules=exts, cmdclass={"build_ext": build_ext})
    except BaseException:
        # A failed build leaves the source tree as it found it (what was there before stays).
        for p in (os.path.join(ROOT, "build"), *glob.glob(os.path.join(ROOT, "*.egg-info"))):
            if p not in existed:
                shutil.rmtree(p, ignore_errors=True)
        raise


_main()
