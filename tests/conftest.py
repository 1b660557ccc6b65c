"""Shared test configuration: the hypothesis profile (graphctl/testing/profiles.py, selected
by GRAPHCTL_HYPOTHESIS_PROFILE, see docs/knobs.md), the ``cuda`` marker (skipped without a CUDA
device; every test under tests/cuda carries it) and the ``backend`` fixture (emulated, and CUDA
graphs where a device exists): one scenario, each graph backend."""
from __future__ import annotations

import os
import random
import signal

import pytest
import torch

from graphctl.knobs import knobs
from graphctl.testing.profiles import load

# this repository's runs always use a graphctl profile (ci unless GRAPHCTL_HYPOTHESIS_PROFILE says)
load()

# The Ctrl-C tests deliver SIGINT through Python's handler. A shell's background job starts with
# SIGINT ignored, and Python then installs none: put the default one in, as a foreground run has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    for item in items:  # a test in tests/cuda needs the device whether or not its file says so
        if "tests/cuda" in str(item.fspath).replace("\\", "/") and item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `-m cuda` on the GPU machine: scripts/device-check)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request) -> str:
    """A graph backend: every test taking it runs on the emulated recorder (CPU) and on CUDA graphs."""
    return request.param


@pytest.fixture
def device(backend: str) -> str:
    """The device the ``backend`` fixture's graphs run on."""
    return "cuda" if backend == "cuda" else "cpu"


_SEED = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test's randomness from one seed: GRAPHCTL_TEST_SEED, else a fresh one; torch's and Python's
    global generators are seeded with it too, so a test drawing without ``gen`` replays as well. A
    failure prints the line that reproduces it (``pytest_runtest_makereport`` below)."""
    seed = knobs.test_seed if knobs.test_seed >= 0 else int.from_bytes(os.urandom(4), "little") % 2**31
    request.node.stash[_SEED] = seed
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


@pytest.fixture
def gen(_seeded) -> torch.Generator:
    """A generator seeded with the test's seed (``_seeded``)."""
    return torch.Generator().manual_seed(_seeded)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = item.stash.get(_SEED, None)
    if report.failed and seed is not None:
        report.sections.append(("seed", f"reproduce with: GRAPHCTL_TEST_SEED={seed} pytest '{item.nodeid}'"))
