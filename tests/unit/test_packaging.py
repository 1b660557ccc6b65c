"""Packaging (issue 16): the CUDA toolkit search setup.py uses, the extension refused when it was
built for another torch, the Hypothesis profiles the package registers, one list of dependencies."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from graphctl import toolkit


def _toolkit(root, version="13.0", lib=True, header=True, nvcc=True):
    os.makedirs(os.path.join(root, "bin"))
    if nvcc:
        path = os.path.join(root, "bin", "nvcc")
        with open(path, "w") as fh:
            fh.write(f"#!/bin/sh\necho 'Cuda compilation tools, release {version}, V{version}.1'\n")
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    if header:
        os.makedirs(os.path.join(root, "include"))
        open(os.path.join(root, "include", "cuda_runtime.h"), "w").close()
    if lib:
        os.makedirs(os.path.join(root, "targets", "x86_64-linux", "lib"))
        open(os.path.join(root, "targets", "x86_64-linux", "lib", "libcudart.so"), "w").close()
    return root


def test_an_nvcc_wrapper_on_path_does_not_make_its_folder_the_toolkit(tmp_path, monkeypatch):
    # Issue 16: torch guessed CUDA_HOME=/usr/local from a wrapper /usr/local/bin/nvcc, and the link failed
    # (cannot find -lcudart) minutes into `pip install .`.
    prefix = tmp_path / "usr-local"
    (prefix / "bin").mkdir(parents=True)
    wrapper = prefix / "bin" / "nvcc"
    wrapper.write_text("#!/bin/sh\nexec true\n")
    wrapper.chmod(0o755)
    real = _toolkit(str(prefix / "cuda-13.0"))
    monkeypatch.setenv("PATH", str(prefix / "bin"))
    home, why = toolkit.find("", prefix=str(prefix))
    assert home == real, why
    assert toolkit.nvcc_version(home) == "13.0.1"


def test_newest_toolkit_wins_by_version_not_by_spelling(tmp_path, monkeypatch):
    # Issue 16: a lexicographic sort puts cuda-9.2 above cuda-13.0.
    monkeypatch.setenv("PATH", "")
    _toolkit(str(tmp_path / "cuda-9.2"), "9.2")
    newest = _toolkit(str(tmp_path / "cuda-13.0"))
    assert toolkit.find("", prefix=str(tmp_path))[0] == newest


def test_a_cuda_home_set_on_purpose_is_the_only_candidate_and_what_it_lacks_is_named(tmp_path, monkeypatch):
    # Issue 16: a CUDA_HOME without libcudart must not be swapped for another toolkit behind the user's back.
    monkeypatch.setenv("PATH", "")
    _toolkit(str(tmp_path / "cuda-13.0"))
    broken = _toolkit(str(tmp_path / "mine"), lib=False)
    home, why = toolkit.find(broken, prefix=str(tmp_path))
    assert home is None and "no libcudart" in why and "mine" in why
    assert toolkit.missing(_toolkit(str(tmp_path / "nohdr"), header=False)) == "no include/cuda_runtime.h"


def test_an_extension_built_for_another_torch_is_never_loaded_and_says_why(monkeypatch):
    # Issue 16: an isolated build against another torch release loads into the running one (a symbol error at
    # best, misread tensors at worst).
    from graphctl.ops import _load

    monkeypatch.setattr(_load, "_read_build", lambda: {"torch": "2.0.0+other", "with_cuda": False})
    with pytest.warns(RuntimeWarning, match="built for torch 2.0.0\\+other"):
        status = _load.load()
    assert not status.loaded and "running torch" in status.error


def test_profiles_are_registered_by_the_package_and_loaded_by_the_plugin_when_asked(tmp_path):
    # Issue 16: GRAPHCTL_HYPOTHESIS_PROFILE worked only inside this repository's conftest.
    test = tmp_path / "test_user.py"
    test.write_text("from hypothesis import settings\n"
                    "def test_profile():\n"
                    "    assert settings().max_examples == 2000, settings._current_profile\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["GRAPHCTL_HYPOTHESIS_PROFILE"] = "thorough"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env.pop("GRAPHCTL_HYPOTHESIS_PROFILE")
    test.write_text("from hypothesis import settings\n"
                    "def test_profile():\n"
                    "    assert settings().max_examples == 100\n"  # hypothesis' default: the user's own
                    "    settings.get_profile('graphctl-dev')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dependencies_live_in_pyproject_only():
    # Issue 16: requirements/venv.txt and pyproject.toml disagreed (cuda-bindings, numpy, hypothesis).
    tomllib = pytest.importorskip("tomllib")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    names = {d.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert {"torch", "cuda-bindings", "nvidia-ml-py", "hypothesis", "numpy", "rich"} <= names
    assert "matplotlib>=3.7" in project["optional-dependencies"]["plot"]
    assert not os.path.exists(os.path.join(root, "requirements"))


def _setup_py(tmp_path, *args, broken_source=False, **env):
    """Run a copy of setup.py (with the two stdlib modules it loads and csrc/) in ``tmp_path``."""
    import shutil

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    shutil.copy(os.path.join(root, "setup.py"), tmp_path)
    (tmp_path / "graphctl").mkdir()
    for name in ("knobs.py", "toolkit.py"):
        shutil.copy(os.path.join(root, "graphctl", name), tmp_path / "graphctl")
    (tmp_path / "csrc").mkdir()
    if broken_source:
        (tmp_path / "csrc" / "broken.cpp").write_text("this is not C++;\n")
    e = {**os.environ, **env}
    return subprocess.run([sys.executable, "setup.py", *args], cwd=tmp_path, env=e, capture_output=True, text=True,
                          timeout=600)


def test_without_a_usable_toolkit_the_build_says_why_in_one_line_and_builds_cpu_kernels(tmp_path):
    # Issue 16: `pip install .` failed minutes in on `cannot find -lcudart` instead of saying why it cannot build CUDA.
    broken = tmp_path / "toolkit"
    _toolkit(str(broken), lib=False)
    work = tmp_path / "src"
    work.mkdir()
    r = _setup_py(work, "--name", CUDA_HOME=str(broken), GRAPHCTL_BUILD_CUDA="auto")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("graphctl build:")]
    assert len(lines) == 1 and "CPU kernels only, because" in lines[0], r.stdout
    import torch

    if torch.version.cuda is not None:
        assert "no libcudart" in lines[0] and str(broken) in lines[0], lines[0]


def test_build_cuda_1_without_a_toolkit_fails_at_once_saying_why(tmp_path):
    # Issue 16: CI demands the CUDA kernels; a missing toolkit must fail the build before any compile, naming it.
    broken = tmp_path / "toolkit"
    _toolkit(str(broken), header=False)
    work = tmp_path / "src"
    work.mkdir()
    r = _setup_py(work, "--name", CUDA_HOME=str(broken), GRAPHCTL_BUILD_CUDA="1")
    assert r.returncode != 0
    assert "GRAPHCTL_BUILD_CUDA=1 but the CUDA kernels cannot be built" in r.stderr + r.stdout


def test_a_failed_build_leaves_no_build_folder_or_build_record_behind(tmp_path):
    # Issue 16: a failed build left build/, graphctl.egg-info and graphctl/_build.json in the source tree.
    r = _setup_py(tmp_path, "build_ext", broken_source=True, GRAPHCTL_BUILD_CUDA="0")
    assert r.returncode != 0
    assert not (tmp_path / "build").exists(), os.listdir(tmp_path)
    assert not (tmp_path / "graphctl" / "_build.json").exists()


def test_the_build_shows_its_progress_and_a_failure_s_last_lines(tmp_path):
    # Regression: issue 55, `make demo` on a fresh clone showed nothing for the minutes the extension compiled
    # (pip -q); scripts/build-progress.py turns pip -v into a line per compiled source and keeps the exit code.
    import subprocess
    import sys

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    fake = tmp_path / "fake_build.py"
    fake.write_text("print('graphctl build: CPU kernels only, because no GPU')\n"
                    "print('graphctl build: CPU kernels only, because no GPU')\n"
                    "print('noise ' * 20)\n"
                    "print('[1/2] c++ -MMD -c /src/graphctl/csrc/checks.cpp -o checks.o')\n"
                    "print('[2/2] c++ -MMD -c /src/graphctl/csrc/switch_table.cpp -o s.o')\n"
                    "print('error: something broke')\n"
                    "raise SystemExit(3)\n")
    res = subprocess.run([sys.executable, str(root / "scripts" / "build-progress.py"), sys.executable, str(fake)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3
    assert res.stdout.count("graphctl build: CPU kernels only") == 1, res.stdout
    assert "compiling 1/2: checks.cpp" in res.stdout and "compiling 2/2: switch_table.cpp" in res.stdout
    assert "noise" not in res.stdout
    assert "the build failed (exit 3)" in res.stderr and "error: something broke" in res.stderr
