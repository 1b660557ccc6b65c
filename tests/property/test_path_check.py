"""The per-replay path check in C (``graphctl._C.paths_hold``) against its Python reference (the
straight-line walk of ``graphctl.graphs.replay.rebinding``) and against the plain walk that names the
moved path: on random object trees (attributes, lists, dicts, a closure, a global, an argument)
after a random rebinding, all three must agree."""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphctl
from graphctl import ops
from graphctl.graphs.findings import reach
from graphctl.graphs.findings.reach import storage_key
from graphctl.graphs.replay.rebinding import collect, first_moved

pytestmark = pytest.mark.skipif(not ops.uses_extension(), reason="graphctl._C is not loaded")


class Node:
    def __init__(self) -> None:
        self.kids: list = []


GLOBAL_NODE = Node()  # a root the forward reaches by a global name


def _tree(draw, depth: int) -> object:
    kind = draw(st.sampled_from(["tensor", "node", "list", "dict"] if depth < 3 else ["tensor"]))
    if kind == "tensor":
        return torch.randn(draw(st.integers(1, 4)))
    if kind == "node":
        n = Node()
        for i in range(draw(st.integers(1, 3))):
            setattr(n, f"a{i}", _tree(draw, depth + 1))
        n.kids = [_tree(draw, depth + 1) for _ in range(draw(st.integers(0, 2)))]
        return n
    if kind == "list":
        return [_tree(draw, depth + 1) for _ in range(draw(st.integers(1, 3)))]
    return {f"k{i}": _tree(draw, depth + 1) for i in range(draw(st.integers(1, 3)))}


def _slots(obj: object, out: list) -> list:
    """(container, key or attribute name, is_attr) of every slot in the tree, in walk order."""
    if isinstance(obj, Node):
        for k, v in vars(obj).items():
            out.append((obj, k, True))
            _slots(v, out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i, False))
            _slots(v, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k, False))
            _slots(v, out)
    return out


MUTATIONS = ["none", "rebind_fresh", "rebind_same", "set_data", "delete", "non_tensor", "swap_container"]


@given(data=st.data())
def test_native_path_check_agrees_with_its_python_reference(data):
    closed = _tree(data.draw, 0)
    GLOBAL_NODE.kids = [_tree(data.draw, 1)]
    arg = Node()
    arg.a0 = _tree(data.draw, 1)

    def fwd(x):
        return closed, GLOBAL_NODE, x

    roots = {"x": arg}
    found = reach.walk(reach.roots(fwd, roots, None, lambda a, k, n: a[0]))
    paths, unchecked = collect(found, set(found.tensors), set())
    assert not unchecked
    args = (arg,)
    assert ops.paths_hold(paths.program, args, {}, paths.walk) and paths.walk(args, {})
    slots = _slots(closed, []) + _slots(GLOBAL_NODE, []) + _slots(arg, [])
    what = data.draw(st.sampled_from(MUTATIONS))
    if slots and what != "none":
        box, key, is_attr = data.draw(st.sampled_from(slots))
        old = getattr(box, key) if is_attr else box[key]
        if what == "rebind_fresh":
            new = old.clone() if isinstance(old, torch.Tensor) else _tree(data.draw, 2)
        elif what == "rebind_same":
            new = old
        elif what == "set_data" and isinstance(old, torch.Tensor):
            old.data = torch.randn(3)  # the same object at a new address
            new = old
        elif what == "non_tensor":
            new = 7
        elif what == "swap_container":
            new = types.SimpleNamespace(**vars(old)) if isinstance(old, Node) else old
        else:
            new = None
        if what == "delete":
            if is_attr:
                delattr(box, key)
            else:
                del box[key]
        elif is_attr:
            setattr(box, key, new)
        else:
            box[key] = new
    native = ops.paths_hold(paths.program, args, {}, paths.walk)
    with graphctl.knobs.scope(no_extension=True):
        python = ops.paths_hold(paths.program, args, {}, paths.walk)
    named = first_moved(list(paths), args, {})  # the plain walk (address and shape), which names the path
    assert native == python, (what, native, python)
    assert (named is None) == native, (what, named)


class Holder:
    interrupt = False

    def __getattribute__(self, name):
        if name == "inner" and type(self).interrupt:
            raise KeyboardInterrupt  # a Ctrl-C landing inside the walk (a property, a __getattr__)
        return super().__getattribute__(name)


def test_an_interrupt_inside_the_walk_propagates_from_both_checks():
    # Regression: a lookup error means "moved"; anything else (a Ctrl-C inside a property) must reach the caller.
    holder = Holder()
    holder.inner = types.SimpleNamespace(t=torch.randn(2))
    paths, _ = collect(reach.walk(reach.roots(lambda: holder, {})), {storage_key(holder.inner.t)}, set())
    assert len(paths) == 1 and paths.fast((), {})
    Holder.interrupt = True
    try:
        with pytest.raises(KeyboardInterrupt):
            ops.paths_hold(paths.program, (), {}, paths.walk)
        with pytest.raises(KeyboardInterrupt):
            paths.walk((), {})
    finally:
        Holder.interrupt = False
