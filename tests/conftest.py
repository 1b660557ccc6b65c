"""Shared test configuration: the hypothesis profile (graphctl/testing/profiles.py, selected
by GRAPHCTL_HYPOTHESIS_PROFILE, see docs/knobs.md) and the CUDA skip for tests/cuda."""
from __future__ import annotations

import pytest
import torch

from graphctl.testing.profiles import load

# this repository's runs always use a graphctl profile (ci unless GRAPHCTL_HYPOTHESIS_PROFILE says)
load()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tests/cuda on the GPU machine: scripts/device-check)")
    for item in items:
        if "tests/cuda" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed per test (printed on failure through the test's locals)."""
    seed = torch.seed() % 2**31
    return torch.Generator().manual_seed(seed)
