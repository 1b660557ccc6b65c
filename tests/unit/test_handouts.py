"""The default stale-output check's native helpers (csrc/handouts.cpp) against their Python
references (graphctl/ops/reference.py, graphs/findings/frames.py's walk), on random handed-out sets."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphctl
from graphctl import ops
from graphctl.graphs.findings import frames
from graphctl.ops import reference

pytestmark = pytest.mark.skipif(not ops.uses_extension(), reason="graphctl._C not loaded")


def _handed(rows: list[int], container: str):
    """A handed-out set as graphs/replay/stale.py builds one: aliases, views of them, a container."""
    from torch.utils.dlpack import from_dlpack, to_dlpack

    statics = [torch.randn(r + 1, 3) for r in rows]
    aliases = [from_dlpack(to_dlpack(t)) for t in statics]
    views = [a[: max(1, a.shape[0] - 1)] for a in aliases]
    out = views[0] if container == "single" else (tuple(views) if container == "tuple" else {"v": list(views)})
    objs = (out, *views) if container != "single" else (out,)
    cdatas = tuple(a.untyped_storage()._cdata for a in aliases)
    return statics, aliases, views, objs, cdatas


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 9), min_size=1, max_size=4), container=st.sampled_from(["single", "tuple", "dict"]),
       hold=st.sampled_from(["nothing", "an object", "a view"]), pick=st.integers(0, 3))
def test_handed_held_matches_its_reference(rows, container, hold, pick):
    if container == "single":
        rows = rows[:1]
    statics, aliases, views, objs, cdatas = _handed(rows, container)
    del views
    own = sum(map(torch._C._storage_Use_Count, cdatas))
    c_counts, r_counts = ops._C.handed_counts(objs), reference.handed_counts(objs)
    assert not ops._C.handed_held(objs, c_counts, cdatas, own)
    assert not reference.handed_held(objs, r_counts, cdatas, own)
    kept = None
    i = pick % len(objs)
    if hold == "an object":
        kept = objs[i]
    elif hold == "a view":
        kept = aliases[pick % len(aliases)][:1]  # a view the caller took: another user of the storage
    want = hold != "nothing"
    assert ops._C.handed_held(objs, c_counts, cdatas, own) is want
    assert reference.handed_held(objs, r_counts, cdatas, own) is want
    del kept
    assert not ops._C.handed_held(objs, c_counts, cdatas, own)


def test_handed_helpers_refuse_wrong_arguments():
    with pytest.raises(TypeError, match="handed_held"):
        ops._C.handed_held((1,), (), (), 0)
    with pytest.raises(TypeError, match="handed_counts"):
        ops._C.handed_counts([1])
    with pytest.raises(TypeError, match="caller"):
        ops._C.caller("x", ())


def _graphctl_machinery(fn):
    """Call ``fn`` from a frame that looks like graphctl's own (its file under graphctl/graphs/)."""
    code = compile("def inner(fn):\n    return fn()\n", frames._INTERNAL_DIRS[0] + "fake_machinery.py", "exec")
    space: dict = {}
    exec(code, space)
    return space["inner"](fn)


def test_the_native_caller_finds_the_frame_the_python_walk_finds():
    native = frames.caller_fn()
    with graphctl.knobs.scope(no_extension=True):
        walk = frames.caller_fn()
    assert walk is frames._walk and native is not walk
    got_native = _graphctl_machinery(native)  # a user line, through one frame of machinery
    got_walk = _graphctl_machinery(walk)
    assert got_native == got_walk
    assert got_native[0] is _graphctl_machinery.__code__  # the innermost frame outside the machinery
    assert frames.shown(got_native).startswith("tests/unit/test_handouts.py:") or "test_handouts.py:" in \
        frames.shown(got_native)


def test_outputs_marked_without_the_extension_raise_the_same_way():
    # The Python references drive the same check: GRAPHCTL_NO_EXTENSION=1 keeps the default guarantee.
    with graphctl.knobs.scope(no_extension=True):
        f = graphctl.graphed(lambda x: x * 3, buckets=[4], inputs=["x"], progress=False)
        kept = f(torch.randn(4, 2))
        f(torch.randn(4, 2))
        with pytest.raises(RuntimeError, match="test_handouts.py"):
            kept.sum()
