"""graphctl's Hypothesis profiles, for this repository's tests and for users' own runs of the
machines (``graphctl.testing``).

Registered under ``graphctl-ci``, ``graphctl-thorough`` and ``graphctl-dev`` (prefixed: a
user's own ``ci`` profile is never replaced). ``GRAPHCTL_HYPOTHESIS_PROFILE`` (see
``docs/knobs.md``) picks one: the pytest plugin (``graphctl/testing/plugin.py``, an entry point
every pytest run in an environment with graphctl loads) loads it when the variable is set, and
leaves the user's settings alone otherwise.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings

from graphctl.knobs import knobs

__all__ = ["PROFILES", "register", "load"]

# name -> (max_examples, stateful_step_count)
PROFILES: dict[str, tuple[int, int]] = {"ci": (200, 30), "thorough": (2000, 60), "dev": (20, 10)}

# The machines build tensors and graphs per step: a slow example is expected, never a failure.
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def register() -> None:
    """Register every graphctl profile (idempotent)."""
    for name, (examples, steps) in PROFILES.items():
        settings.register_profile(f"graphctl-{name}", max_examples=examples, stateful_step_count=steps,
                                  deadline=None, suppress_health_check=_SUPPRESS)


def load(name: str | None = None) -> str:
    """Register the profiles and load ``name`` (default: ``GRAPHCTL_HYPOTHESIS_PROFILE``, else
    ``ci``). Returns the Hypothesis profile name loaded."""
    register()
    full = f"graphctl-{name or knobs.hypothesis_profile}"
    settings.load_profile(full)
    return full
