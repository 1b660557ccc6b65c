"""The one face every runner shows: each operation defined once, over the runner's units.

A runner is one or more *units*: a :class:`~graphctl.graphs.runner.GraphRunner` per combination
of variant values (``graphs/variants.py``); a plain runner is the one-unit case, its label ``""``.
What a capture holds is keyed by :class:`Key` ``(variant, bucket)``. Every operation a user
runs on a runner is defined here, once, over the units: ``capture_all``, ``report`` (one
:class:`~graphctl.graphs.analysis.report.Report`, its findings merged over every unit),
``verify``, ``audit`` (and ``confirm``), ``coverage``, ``measure`` and ``repoint`` (every unit
checked before any is rewritten). So a capture form that is a set of units gets every check by
construction, and a plain and a variant runner answer alike.

A :class:`Key` of the plain runner equals its bucket (``audit()[8]``); a variant key equals the
tuple ``("k=3", 8)``; both unpack as ``variant, bucket``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from graphctl.errors import CaptureError, RepointError
from graphctl.graphs.analysis.audit import Audit
from graphctl.graphs.analysis.confirm import audit_runner
from graphctl.graphs.analysis.report import Report
from graphctl.graphs.analysis.verify import VerifyResult
from graphctl.graphs.analysis.verify import verify as _verify
from graphctl.graphs.capture.calls import name_of
from graphctl.graphs.replay import measure as _measure
from graphctl.graphs.replay.repoint import plan_repoint
from graphctl.state.interrupts import deferred

__all__ = ["Key", "Unit", "RunnerFace", "timed"]


@contextlib.contextmanager
def timed(runner: Any, phase: str) -> Iterator[None]:
    """Seconds spent in ``phase`` (capture, verify, audit, coverage, measure) added to the runner's
    ``phase_s``: ``report().phases`` (issue 54: a person waits through each, the report says how long)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        runner.phase_s[phase] = runner.phase_s.get(phase, 0.0) + time.perf_counter() - t0


def _replay_bucket(runner: Any, cap: Any, bucket: int) -> None:
    runner._replay(cap.graphs[bucket], cap)


class Key(NamedTuple):
    """One graph of a runner: its variant's label (``""`` for a plain runner) and its bucket (or,
    in ``coverage()``, the batch size). A plain runner's key equals the bare int."""

    variant: str
    bucket: int

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int) and not isinstance(other, bool):
            return self.variant == "" and self.bucket == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.bucket) if self.variant == "" else tuple.__hash__(self)

    def __str__(self) -> str:
        return f"{self.variant} bucket {self.bucket}" if self.variant else f"bucket {self.bucket}"


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    """One combination of variant values and the runner holding its graphs."""

    values: tuple[tuple[str, Any], ...]  # (argument, value), in declared order; () for a plain runner
    runner: Any  # a GraphRunner

    @property
    def label(self) -> str:  # "k=3" or "k=3, first=True": report rows, verify results, keys
        return ", ".join(f"{n}={v!r}" for n, v in self.values)


class RunnerFace:
    """The operations every runner has, defined once over :meth:`units` (see the module docstring)."""

    fn: Any
    phase_s: dict[str, float]  # seconds in each phase so far (timed), set empty by each runner's __init__

    def units(self) -> tuple[Unit, ...]:
        """Every unit, in declared order (a plain runner: itself, unlabelled)."""
        raise NotImplementedError

    def _own_fallbacks(self) -> dict[str, int]:
        """Fallbacks the runner counts itself, beside its units' (a variant runner: unlisted values)."""
        return {}

    @property
    def keys(self) -> tuple[Key, ...]:
        """Every captured graph's key, units in declared order, buckets smallest first."""
        return tuple(Key(u.label, b) for u in self.units() for b in u.runner._buckets_captured())

    def report(self) -> Report:
        """One report: a row per (variant, bucket), every unit's findings merged, each listed once."""
        parts = [(u.label, u.runner._unit_report()) for u in self.units()]
        return dataclasses.replace(Report.merge(name_of(self.fn), parts, self.fallbacks), phases=dict(self.phase_s))

    def verify(self, **options: Any) -> tuple[VerifyResult, ...]:
        """Eager against replay per (variant, bucket), outputs and padding poisoned
        (``analysis/verify.py``: gen, rtol, atol, writes, inside)."""
        out = []
        with timed(self, "verify"):
            for u in self.units():
                u.runner._captured_or_raise("verify()")
                out += [dataclasses.replace(r, variant=u.label) for r in _verify(u.runner, **options)]
        return tuple(out)

    def audit(self, params: Any = None, confirm: bool = False) -> dict[Key, Audit]:
        """Per (variant, bucket), the pointer and segment audits (``graphs/analysis/audit.py``).
        ``params``: the model tensors the forward reads (module, mapping or iterable; default
        ``params=`` or a decorated method's module). ``confirm``: replay with each possible finding's
        freed block poisoned (``analysis/confirm.py``); the caller's state is put back."""
        out: dict[Key, Audit] = {}
        with timed(self, "audit"):
            for u in self.units():
                r = u.runner
                cap = r._captured_or_raise("audit()")
                found = audit_runner(r, params, confirm, replay=functools.partial(_replay_bucket, r, cap))
                out.update({Key(u.label, b): a for b, a in found.items()})
        return out

    def coverage(self, sizes: Iterable[int] | None = None) -> dict[Key, str]:
        """Per (variant, batch size ``n``) (default 1 .. the largest bucket, capped at the example's
        items), what served a call on the example's first ``n`` items: ``"bucket B"``,
        ``"eager: <reason>"`` or ``"error: <message>"``."""
        out: dict[Key, str] = {}
        with timed(self, "coverage"):
            for u in self.units():
                u.runner._captured_or_raise("coverage()")
                out.update({Key(u.label, n): s for n, s in _measure.coverage(u.runner, sizes).items()})
        return out

    def measure(self, iters: int = 20) -> Any:
        """Median µs of the graphed call and of the eager forward, per (variant, bucket), into the
        report's rows (``graphs/replay/measure.py``)."""
        with timed(self, "measure"):
            for u in self.units():
                u.runner._captured_or_raise("measure()")
                _measure.measure(u.runner, iters)
        return self

    def repoint(self, state: Any) -> dict[Key, int]:
        """Re-point every graph at ``state``, bound again after buffers moved (``graphs/replay/repoint.py``):
        every unit checked before any is rewritten; per key, the nodes (CUDA) or recorded tensors
        (emulated) rewritten."""
        units = self.units()
        if not any(u.runner.captured for u in units):
            raise CaptureError("nothing captured yet", expected="capture_all() or a call first", found="no graphs",
                               fix="call capture_all(*example) before repoint()")
        plans = [(u, plan_repoint(u.runner, state)) for u in units]  # RepointError here: nothing changed
        done: dict[Key, int] = {}
        with deferred():  # every unit rewritten, or every graph dropped
            try:
                for u, apply in plans:
                    done.update({Key(u.label, b): n for b, n in apply().items()})
            except BaseException as exc:
                for u in units:
                    u.runner.reset()
                    u.runner.state = state
                if not isinstance(exc, RepointError):
                    exc.add_note("graphctl: re-pointing failed partway; every captured graph was dropped (the next "
                                 "call captures again, against the new state)")
                raise
        return done

    @property
    def fallbacks(self) -> dict[str, int]:
        """Eager fallbacks so far, by reason (a copy; a variant's own labelled with it)."""
        out = self._own_fallbacks()
        for u in self.units():
            out.update({(f"{u.label}: {r}" if u.label else r): c for r, c in u.runner._fallbacks.items()})
        return out
