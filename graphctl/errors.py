"""graphctl's exceptions. Each carries structured fields (``buffer``, ``expected``,
``found``, ``fix``) and a message built from them, so the message always names the buffer,
what was expected, what was found, and how to fix it. All of them pickle.

- :class:`DeclarationError`: a spec contradicts itself (raised by ``StateSpec``/``register``).
- :class:`BindError`: a live object does not match its spec (raised by ``bind``).
- :class:`SwitchError`: a bad use of a bound state (``switch``, ``write``, ``pad``).
- :class:`NestedSwitchError`: a switch entered while another is active on the same state, or a
  switch/write issued from inside a callable graphctl is running (a ``Recompute`` fn, a source).
- :class:`ConcurrentUseError`: a second thread used a state that another thread's switch owns.
- :class:`CorruptedStateError`: a restore failed; the state is poisoned and refuses all use.
- :class:`StaleBufferError`: a derived buffer no longer equals ``fn(inputs)``.
- :class:`CaptureError`: a graph could not be captured; nothing replayable was kept.
- :class:`ReplayError`: a captured graph cannot serve a call (address changed, input does not fit).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["noted", "GraphctlError", "DeclarationError", "BindError", "SwitchError", "NestedSwitchError",
           "ConcurrentUseError", "CorruptedStateError", "StaleBufferError", "CaptureError", "ReplayError",
           "RepointError", "SamplingError", "OutputsHeldWarning", "did_you_mean"]

_MISSING = object()


def did_you_mean(name: str, candidates: Any) -> str:
    """`` (did you mean 'seq_lens'?)`` for the closest of ``candidates`` to a misspelled ``name``, or ""."""
    import difflib

    close = difflib.get_close_matches(name, [c for c in candidates if isinstance(c, str) and c != name], n=1,
                                      cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


@contextlib.contextmanager
def noted(note: str) -> Iterator[None]:
    """Let an ``Exception`` from the block (the user's forward, as itself) through with ``note``
    added: where graphctl was when it came (``graphctl: verify() of bucket 8 at n=3 ...``)."""
    try:
        yield
    except Exception as exc:
        exc.add_note(note)
        raise


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else repr(v)


class GraphctlError(Exception):
    """Base of every graphctl error."""

    def __init__(self, what: str, *, buffer: str | None = None, expected: Any = _MISSING,
                 found: Any = _MISSING, fix: str | None = None, **extra: Any) -> None:
        self.what = what
        self.buffer = buffer
        self.expected = None if expected is _MISSING else expected
        self.found = None if found is _MISSING else found
        self.fix = fix
        self.extra = extra
        for k, v in extra.items():
            setattr(self, k, v)
        parts = [f"[{buffer}] {what}" if buffer else what]
        if expected is not _MISSING or found is not _MISSING:
            parts.append(f": expected {_fmt(self.expected)}, found {_fmt(self.found)}")
        if fix:
            parts.append(f". Fix: {fix}")
        super().__init__("".join(parts))

    def __reduce__(self):
        kwargs = dict(buffer=self.buffer, expected=self.expected, found=self.found, fix=self.fix, **self.extra)
        return (_rebuild, (type(self), self.what, kwargs))


def _rebuild(cls: type, what: str, kwargs: dict[str, Any]) -> GraphctlError:
    return cls(what, **kwargs)


class DeclarationError(GraphctlError):
    """A spec's declarations contradict each other or are malformed."""


class BindError(GraphctlError):
    """A live metadata object does not match the spec registered for its type."""


class SwitchError(GraphctlError):
    """A bound state was used wrongly; nothing was changed."""


class NestedSwitchError(SwitchError):
    """A switch was entered on a state that already has an active switch."""


class ConcurrentUseError(SwitchError):
    """Another thread owns the state (an active switch, a write or a pad); nothing was changed.
    A bound state serves one thread at a time: bind one state per thread, or serialize."""


class CorruptedStateError(GraphctlError):
    """A restore (or an undo after a failed apply) did not complete; the state is poisoned.

    ``failures`` lists ``(step, error)`` pairs: which buffers or attributes could not be
    put back. Every later use of the state raises this error again."""


class StaleBufferError(GraphctlError):
    """A derived buffer differs from a fresh recompute of its inputs (``index`` is the first
    differing flat index)."""


class CaptureError(GraphctlError):
    """A capture failed or would fail. The partial graph was reset and dropped, switches opened
    in the body were restored, and the original exception is ``__cause__``. ``bucket`` names the
    bucket; ``where`` is the user's ``file:line`` for an operation illegal under capture."""

    @classmethod
    def from_body(cls, bucket: int, exc: BaseException) -> CaptureError:
        """The error a capture raises when the forward itself raised (chain ``exc`` as cause)."""
        return cls(f"the forward raised while bucket {bucket} was being captured; the partial graph was dropped "
                   "and every switch opened in it restored", expected="a forward that completes",
                   found=f"{type(exc).__name__}: {exc}", fix="see the chained exception: it is the forward's own",
                   bucket=bucket)


class ReplayError(GraphctlError):
    """A call cannot be served by its captured graph: a static buffer or frozen argument moved
    since capture, or the live inputs do not fit the static input buffers."""


class RepointError(ReplayError):
    """Captured graphs cannot be re-pointed at a new state's buffers (``runner.repoint``): the
    layouts differ, or an old address sits where it cannot be rewritten safely. Nothing changed."""


class SamplingError(GraphctlError, ValueError):
    """A sampling setting out of its range or of the wrong type (``temperature``, ``top_k``,
    ``top_p``, a seed, a per-prompt list of the wrong length). Raised before anything changed:
    no generator reseeded, no state written. A ``ValueError`` too."""


class OutputsHeldWarning(UserWarning):
    """Kept for code that filters it; graphctl no longer warns with it. An output read after a
    later replay of its bucket overwrote it now raises ``RuntimeError`` at the read, by default
    (``graphs/replay/stale.py``)."""
