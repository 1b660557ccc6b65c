"""``@graphed``: the decorator users meet first.

::

    @graphctl.graphed(buckets=[1, 2, 4, 8], state=metadata, inputs=("input_ids", "positions"))
    def forward(input_ids, positions, metadata):
        h = target(input_ids, positions, metadata)
        with graphctl.bind(metadata).switch("draft"):   # or the state passed as state=
            draft_tokens = draft_loop(h, metadata)
        return h, draft_tokens

    forward.capture_all(ids, pos, metadata)   # optional: the first call captures too
    out = forward(ids, pos, metadata)         # pick bucket, copy inputs, pad, check, replay
    print(forward.report())

Bare ``@graphed`` uses the default buckets (1 to 256, powers of two) and makes every tensor
argument a static input with its batch on dim 0. The result is a :class:`GraphRunner`; every
option and constraint is documented there. With ``variants={"k": (1, 3, 7)}`` it is a
:class:`~graphctl.graphs.variants.VariantRunner`: a graph set per value of the named host
arguments, in one pool (``graphs/variants.py``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphctl.graphs.options import Options
from graphctl.graphs.runner import GraphRunner
from graphctl.graphs.variants import VariantRunner

__all__ = ["graphed"]


def graphed(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Wrap ``fn`` in a :class:`GraphRunner` (a :class:`VariantRunner` with ``variants=``); usable
    as ``@graphed`` and ``@graphed(...)``."""
    opts = Options.of(**Options.named("graphed", options))  # checked here: the error names what the user called
    make: Callable[[Callable[..., Any]], Any] = (lambda f: VariantRunner(f, opts)) if opts.variants else \
        (lambda f: GraphRunner(f, opts))
    return make if fn is None else make(fn)
