"""A switch recorded in a graph, left open by a replay that stopped inside it.

A captured switch is device work in the graph: the snapshot (``swap_through_`` into the
``capture`` phase's arena slots) at its start and the restore (``copy_`` back) at its end. A replay
that stops between the two (an op raising on the emulated backend, an eager region raising or
interrupted between CUDA pieces) leaves draft contents in the declared buffers, and no
with-statement is there to restore them: the host side of a recorded switch is not replayed.
:func:`recover` puts back what the recorded snapshot saved, or poisons the state where it cannot
(the snapshot itself stopped partway, or the copy back raised), naming the switch.
"""
from __future__ import annotations

from graphctl import ops
from graphctl.state.core import StateCore
from graphctl.state.interrupts import deferred

__all__ = ["recover"]


def recover(st: StateCore, where: str, cause: BaseException, partial: bool, device_type: str | None) -> None:
    """Restore the buffers a switch recorded in a graph snapshotted, from the ``capture`` phase's
    arena slots (one ``copy_`` per device group; ``device_type``: only the groups the graph
    recorded, e.g. ``"cuda"`` for a CUDA graph, whose host mirrors were copied at capture
    only; None: every group). ``partial``: the snapshot op itself stopped, so the slots hold no
    whole snapshot: poisoned. Raises ``CorruptedStateError`` (from ``cause``) when poisoned;
    returns when restored (the caller re-raises ``cause``)."""
    if partial:
        raise st._poison([(f"{where}: its recorded snapshot stopped partway, so nothing can restore it",
                           cause)]) from cause
    try:
        with deferred():  # all groups or a poisoned state, never an interrupt between two of them
            for g in st.binding.groups["capture"]:
                if device_type is None or g.device.type == device_type:
                    ops.copy_(list(g.statics), list(g.arenas), validate=False)
    except BaseException as err:
        raise st._poison([(f"{where}: restoring its recorded snapshot raised {type(err).__name__}: {err}",
                           cause)]) from cause
