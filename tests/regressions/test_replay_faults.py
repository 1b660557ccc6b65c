"""A replay stopped at any op is restored or poisoned (issue 51): the Toy step, whole and with an eager region
before, inside and after its recorded draft switch, replayed with a fault injected at every op the call dispatches
(input copies, the refresh switch's entry and exit, every recorded op on the emulated backend, the region's own ops),
as an exception and as an interrupt-like BaseException. Afterwards every declared buffer holds its pre-call contents
and the next call equals eager, or the state is poisoned and says which switch could not be restored."""
from __future__ import annotations

import pytest
import torch

from graphctl import CorruptedStateError
from graphctl.testing.faults import InjectedFault, InjectedInterrupt, fault_at_op
from support.graphs import Toy
from support.regions import contents, region_of, regioned, unchanged

FORMS = ("whole", "before", "inside", "after")


def _toy(form: str, backend: str, device: str, gen: torch.Generator) -> Toy:
    toy = Toy(device, gen, S=8, buckets=(4,), backend=backend)
    if form != "whole":
        regioned(toy, form, region_of(form, lambda t: t * 0.5 + 0.25), buckets=(4,))
    toy.forward.capture_all(*toy.batch(4), toy.meta)
    return toy


@pytest.mark.parametrize("form", FORMS)
def test_a_replay_stopped_at_any_op_is_restored_or_poisoned(form, backend, device, gen):
    # Regression: issue 51, an emulated replay interrupted inside the recorded switch's exit section left a CopyInPlace
    # buffer holding draft values with the state usable, and a failure after the switch had completed poisoned it.
    toy = _toy(form, backend, device, gen)
    with fault_at_op(10**9, InjectedFault, [], "count") as seen:
        toy.forward(*toy.batch(4), toy.meta)
    total = len(seen)
    assert total > (20 if backend == "emulated" else 5), seen
    outcomes = {"restored": 0, "poisoned": 0}
    for kind in (InjectedFault, InjectedInterrupt):
        for k in range(total):
            args = toy.batch(4)  # n = bucket: no padding is written, every declared buffer must come back as is
            before = contents(toy)
            fired: list[str] = []
            try:
                with fault_at_op(k, kind, fired, "replay") as seen:
                    toy.forward(*args, toy.meta)
            except (kind, CorruptedStateError) as exc:
                raised: BaseException = exc
            else:
                assert not fired, (k, seen)
                break  # a later call dispatches fewer ops than the first (output views built once): swept them all
            where = f"{kind.__name__} at op {k} ({seen[k]}) of {form}"
            if toy.state.poisoned is not None:
                outcomes["poisoned"] += 1
                # raised as CorruptedStateError, or (a switch's own entry) as the fault with the poisoning noted
                said = str(raised) + " ".join(getattr(raised, "__notes__", []))
                assert "poisoned" in said and ("switch" in said or "snapshot" in said), (where, said)
                with pytest.raises(CorruptedStateError):
                    toy.forward(*toy.batch(4), toy.meta)
                toy = _toy(form, backend, device, gen)
                continue
            outcomes["restored"] += 1
            assert isinstance(raised, kind), (where, repr(raised))  # the fault itself, never a false poison
            assert toy.state.active_switch is None, where
            assert unchanged(toy, before) == [], where
            args = toy.batch(4)
            want = toy.eager(*args)
            got = [t.clone() for t in toy.forward(*args, toy.meta)]
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, msg=where)
    assert outcomes["restored"] > outcomes["poisoned"], outcomes
