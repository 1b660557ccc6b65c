"""The pytest plugin graphctl installs (entry point ``pytest11``): registers graphctl's
Hypothesis profiles in every pytest run, and loads the one ``GRAPHCTL_HYPOTHESIS_PROFILE``
names when it is set (unset: the run's own Hypothesis settings stay)."""
from __future__ import annotations

from graphctl.knobs import knobs
from graphctl.testing.profiles import load, register


def pytest_configure(config) -> None:  # noqa: ARG001 - pytest's hook signature
    if knobs.given("hypothesis_profile"):
        load()
    else:
        register()


def pytest_report_header(config) -> str | None:  # noqa: ARG001
    if knobs.given("hypothesis_profile"):
        return f"graphctl: hypothesis profile graphctl-{knobs.hypothesis_profile}"
    return None
