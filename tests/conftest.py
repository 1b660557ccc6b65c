"""Shared test configuration: hypothesis profiles (selected by GRAPHCTL_HYPOTHESIS_PROFILE,
see docs/knobs.md) and the CUDA skip for tests/cuda."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

from graphctl.debug import knobs

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=200, stateful_step_count=30, **_COMMON)
settings.register_profile("thorough", max_examples=2000, stateful_step_count=60, **_COMMON)
settings.register_profile("dev", max_examples=20, stateful_step_count=10, **_COMMON)
settings.load_profile(knobs.hypothesis_profile)


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
