"""Test seams of a bound state: where fault injection and re-entry tests reach inside a switch.

:func:`hooks` installs, for the length of a with-block, a ``fault(stage, step, when)`` callable
that runs at every step boundary of a switch (``stage``: apply, undo or restore; ``when``:
before or after; raise there to inject a fault) and a ``user(label)`` callable that runs as a
user callable (a recompute fn, a copy source) starts (call back into the state there to test
re-entry). By default hooks make the switch run its Python steps (one per declared action, the
native table's reference) so a fault can land between any two; ``native=True`` keeps the native
table and fires the hooks around its one step. :func:`install` does the same for the state's
lifetime (a Hypothesis machine that owns the state). ``graphctl.testing`` and the tests use
these, never the state's private attributes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from graphctl.state.bound import BoundState
from graphctl.state.transaction import FaultHook

__all__ = ["hooks", "install"]


def install(state: BoundState, *, fault: FaultHook | None = None, user: Callable[[str], None] | None = None,
            native: bool = False) -> None:
    """Set (or, with None, clear) the state's fault and user hooks until changed again."""
    state._fault_hook, state._user_hook, state._hooked_native = fault, user, native


@contextlib.contextmanager
def hooks(state: BoundState, *, fault: FaultHook | None = None, user: Callable[[str], None] | None = None,
          native: bool | None = None) -> Iterator[BoundState]:
    """The hooks given for the with-block (a hook not given keeps the one installed); the previous
    ones put back on exit, however the block ends."""
    saved = state._fault_hook, state._user_hook, state._hooked_native
    install(state, fault=fault if fault is not None else saved[0], user=user if user is not None else saved[1],
            native=saved[2] if native is None else native)
    try:
        yield state
    finally:
        install(state, fault=saved[0], user=saved[1], native=saved[2])
