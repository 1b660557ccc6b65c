"""The native switch (graphctl/state/native.py, csrc/switch_table.cpp) against its reference,
the Python steps: same buffers, same attributes, same errors, same restores, on the CPU and
(``-m cuda``) on the GPU."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import graphctl
from graphctl import CopyInPlace, CorruptedStateError, Recompute, StateSpec, Swap, SwitchError, bind, ops
from support.mini import MiniMetadata, make_registry

pytestmark = pytest.mark.skipif(not ops.uses_extension(), reason="the native switch needs graphctl._C")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _state(seed: int, device: str):
    meta = MiniMetadata(torch.Generator().manual_seed(seed), device=device)
    return meta, bind(meta, registry=make_registry())


def _look(meta, st) -> dict:
    """Every declared buffer's bytes and what every declared attribute is bound to."""
    out = {n: st.tensor(n).clone() for n in st.plan.buffers}
    out.update({"@" + n: id(getattr(meta, n)) for n in ("block_offsets", "kv_cache_manager", "kv_lens_runtime")})
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k.startswith("@"):
            continue  # ids of two different objects; compared within one run below
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


def _run(native: bool, seed: int, device: str, phase: str, inside) -> tuple[dict, dict, list[str]]:
    meta, st = _state(seed, device)
    with graphctl.knobs.scope(native_switch=native):
        with st.switch("draft", phase) as sw:
            during = _look(meta, st)
            inside(meta, st, sw)
        steps = [s.name for s in st._steps(phase)]
    return during, _look(meta, st), steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("phase", ["eager", "replay", "refresh"])
def test_native_switch_equals_the_python_steps(gen, device, phase):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    lens = torch.randint(1, 9, (5,), generator=gen, dtype=torch.int32)

    def inside(meta, st, sw):  # a write and the forward's own writes, restored by both
        if phase != "refresh":
            st.write("seq_lens", lens.to(device))
        meta.spec_positions.add_(7)
        meta.topk_scratch.fill_(3)

    d_py, a_py, s_py = _run(False, seed, device, phase, inside)
    d_nat, a_nat, s_nat = _run(True, seed, device, phase, inside)
    assert s_nat == [f"native[{phase}]"] and not any(s.startswith("native") for s in s_py)
    _same(d_py, d_nat)  # inside the switch: same swaps, copies and recomputes
    _same(a_py, a_nat)  # after it: everything restored alike (Stable scratch left as the forward wrote it)
    meta, st = _state(seed, device)
    before = _look(meta, st)
    with st.switch("draft", phase):
        if phase == "eager":  # only eager (and capture) swap
            assert meta.block_offsets is st.tensor("draft_block_offsets")
            assert meta.kv_cache_manager is meta.draft_kv_cache_manager
        meta.spec_positions.add_(7)
    after = _look(meta, st)
    assert {k: v for k, v in before.items() if k.startswith("@")} == {k: v for k, v in after.items()
                                                                       if k.startswith("@")}
    for n in st.restorable_names() if phase != "refresh" else ():  # refresh keeps what the body wrote
        assert torch.equal(before[n], after[n]), n


class _Boom(Exception):
    pass


class _Mapped:
    """A swap, a copy and a recompute whose fn the test makes raise."""

    def __init__(self, gen: torch.Generator, device: str) -> None:
        r = lambda n, hi: torch.randint(1, hi, (n,), generator=gen, dtype=torch.int32).to(device)  # noqa: E731
        self.seq_lens, self.draft_seq_lens = r(4, 5), r(4, 5)
        self.offsets, self.draft_offsets = r(7, 99), r(7, 99)
        self.token_map = torch.empty(20, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exc", [_Boom, KeyboardInterrupt])
def test_a_recompute_that_raises_inside_the_native_apply_is_undone_and_propagates_as_itself(gen, device, exc):
    # Native switch: an exception from a user callable the C++ table calls (a recompute) must undo the snapshot
    # groups and attribute puts it already applied, then reach the caller unchanged.
    calls = []

    def token_map(out, seq_lens):
        calls.append(1)
        if len(calls) > 1:  # bind computes it once; the switch's recompute raises
            raise exc("from the recompute")
        ops.token_to_request_(out, seq_lens, out.numel(), -1)

    spec = StateSpec("native-raise")
    spec.buffer("seq_lens", dtype=torch.int32, draft=CopyInPlace(source="draft_seq_lens"))
    spec.buffer("offsets", dtype=torch.int32, draft=Swap(twin="draft_offsets"))
    spec.buffer("draft_offsets", dtype=torch.int32)
    spec.buffer("token_map", dtype=torch.int32, derive=Recompute(inputs=["seq_lens"], fn=token_map))
    meta = _Mapped(gen, device)
    st = bind(meta, registry=make_registry(_Mapped, spec))
    before = {n: st.tensor(n).clone() for n in st.restorable_names()}
    offsets = meta.offsets
    with pytest.raises(exc, match="from the recompute"):
        with st.switch("draft", "eager"):
            pytest.fail("the body must not run")
    assert [s.name for s in st._steps("eager")] == ["native[eager]"] and len(calls) == 2
    assert meta.offsets is offsets
    for n, t in before.items():
        assert torch.equal(st.tensor(n), t), n
    assert st.poisoned is None and st.active_phase is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_rebound_copy_source_is_checked_before_anything_is_written(gen, device):
    # Native switch: the table compares copy sources by identity and hands a new one to the same check as the
    # Python step; a bad one must be refused with nothing written, a good one must be what is copied.
    meta, st = MiniMetadata(gen, device=device), None
    st = bind(meta, registry=make_registry())
    with st.switch("draft"):
        pass
    before = {n: st.tensor(n).clone() for n in st.restorable_names()}
    meta.draft_positions = torch.zeros(3, dtype=torch.int64, device=device)  # the wrong shape
    with pytest.raises(SwitchError, match="does not match the buffer") as info:
        with st.switch("draft"):
            pass
    assert info.value.buffer == "spec_positions"
    for n, t in before.items():
        assert torch.equal(st.tensor(n), t), n
    fresh = torch.randint(100, 200, (5,), generator=gen, dtype=torch.int64).to(device)
    meta.draft_positions = fresh
    with st.switch("draft"):
        assert torch.equal(meta.spec_positions, fresh)
    assert torch.equal(meta.spec_positions, before["spec_positions"])


class _Guarded:
    """Metadata whose swapped attribute is a property: its setter can refuse (a library's object)."""

    def __init__(self, gen: torch.Generator) -> None:
        self._lens = torch.randint(1, 50, (6,), generator=gen, dtype=torch.int32)
        self.draft_lens = torch.randint(1, 50, (6,), generator=gen, dtype=torch.int32)
        self.pos = torch.randint(1, 50, (6,), generator=gen, dtype=torch.int64)
        self.draft_pos = torch.randint(1, 50, (6,), generator=gen, dtype=torch.int64)
        self.refuse = 0  # the number of the set that raises (0: none)
        self.sets = 0
        self.owner = None  # set to the bound state: a cycle through the native table

    @property
    def lens(self) -> torch.Tensor:
        return self._lens

    @lens.setter
    def lens(self, v: torch.Tensor) -> None:
        self.sets += 1
        if self.sets == self.refuse:
            raise RuntimeError("setter refused")
        self._lens = v


def _guarded(gen):
    spec = StateSpec("guarded")
    spec.buffer("lens", dtype=torch.int32, draft=Swap(twin="draft_lens"))
    spec.buffer("draft_lens", dtype=torch.int32)
    spec.buffer("pos", dtype=torch.int64, draft=CopyInPlace(source="draft_pos"))
    m = _Guarded(gen)
    return m, bind(m, registry=make_registry(_Guarded, spec))


def test_a_put_that_raises_on_restore_poisons_and_names_it(gen):
    # Native switch: a failure inside the table's undo must not stop the other restores, and must poison the
    # state naming the part that failed (the Python steps name their step; the table names its put).
    m, st = _guarded(gen)
    pos = m.pos.clone()
    m.refuse = 2  # the restore of lens (the first set is the swap)
    with pytest.raises(CorruptedStateError) as info:
        with st.switch("draft"):
            m.pos.add_(1)
    assert "swap(lens)" in info.value.failures
    assert torch.equal(m.pos, pos), "the snapshot group must still be restored"
    with pytest.raises(CorruptedStateError):
        with st.switch("draft"):
            pass


def test_a_put_that_raises_on_apply_undoes_the_snapshot(gen):
    # Native switch: the swap that raised counts as applied (it may have half-happened), so its original is put
    # back, and the snapshot group before it is restored.
    m, st = _guarded(gen)
    pos, lens = m.pos.clone(), m.lens
    m.refuse = 1
    with pytest.raises(RuntimeError, match="setter refused"):
        with st.switch("draft"):
            pytest.fail("the body must not run")
    assert m.lens is lens and torch.equal(m.pos, pos) and st.poisoned is None
    with st.switch("draft"):
        assert m.lens is st.tensor("draft_lens")


def test_a_state_held_by_its_own_object_is_collected(gen):
    # Native switch: the C++ table holds the object and the state's bound method while the state holds the
    # table; without the table's GC support that cycle (object -> state -> table -> object) leaked the arenas.
    m, st = _guarded(gen)
    m.owner = st
    with st.switch("draft"):
        pass
    assert st._steps("eager")[0].name == "native[eager]"
    ref = weakref.ref(st)
    del m, st
    gc.collect()
    assert ref() is None


def _op_call_state(gen, fn):
    spec = StateSpec("op-call")
    spec.buffer("seq_lens", dtype=torch.int32, draft=CopyInPlace(source="draft_seq_lens"))
    spec.buffer("offsets", dtype=torch.int32, draft=Swap(twin="draft_offsets"))
    spec.buffer("draft_offsets", dtype=torch.int32)
    spec.buffer("token_map", dtype=torch.int32, derive=Recompute(inputs=["seq_lens"], fn=fn))
    meta = _Mapped(gen, "cpu")
    return meta, bind(meta, registry=make_registry(_Mapped, spec))


def test_an_op_call_recompute_runs_from_cpp_and_equals_its_python_twin(gen):
    # Native switch: an OpCall recompute is launched by the table itself (no Python call); it must write what the
    # same op called from Python writes, inside the switch, and be restored after.
    def python_map(out, seq_lens):
        ops.token_to_request_(out, seq_lens, out.numel(), -1)

    got, seed = {}, int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    for label, fn in (("op", graphctl.OpCall("token_to_request_", ("out", "in0", "out.numel", -1))),
                      ("py", python_map)):
        meta, st = _op_call_state(torch.Generator().manual_seed(seed), fn)
        before = meta.token_map.clone()
        with st.switch("draft"):
            got[label] = meta.token_map.clone()
        assert torch.equal(meta.token_map, before)
    assert torch.equal(got["op"], got["py"])
    ref = torch.empty_like(got["py"])
    ops.reference.token_to_request_(ref, _Mapped(torch.Generator().manual_seed(seed), "cpu").draft_seq_lens, 20, -1)
    assert torch.equal(got["op"], ref)


def test_an_op_call_is_launched_without_calling_python(gen, monkeypatch):
    # Native switch: the point of OpCall is that no Python runs for it; a Python-level wrapper of the op must not
    # be reached (the Python steps do reach it).
    calls = []
    real = ops.token_to_request_
    monkeypatch.setattr(ops, "token_to_request_", lambda *a: (calls.append(1), real(*a)))
    meta, st = _op_call_state(gen, graphctl.OpCall("token_to_request_", ("out", "in0", "out.numel", -1)))
    calls.clear()
    with st.switch("draft"):
        pass
    assert calls == [] and [s.name for s in st._steps("eager")] == ["native[eager]"]
    with graphctl.knobs.scope(native_switch=False), st.switch("draft"):
        pass
    assert calls == [1]


@pytest.mark.parametrize("args,why", [
    (("out", "in0", "out.numel", "later"), "neither a placeholder nor a constant"),
    (("in0", 3), "wrong number of arguments"),
    (("out", "in1", 3, 0), "names an input the Recompute does not have"),
    # Regression: issue 29, an OpCall writing a declared input was accepted because "out" appeared somewhere
    (("in0", "out", "in0.numel", -1), "writes something other than its output"),
    (("out", "in0", "out.numel"), "wrong number of arguments"),  # one short: a C++ assertion at the first switch
    (("out", "in0", "out.numel", -1.0), "does not fit the op's schema"),
    (("out", "in0", True, 0), "does not fit the op's schema"),
    (("out", "in0", "in0", 0), "does not fit the op's schema"),
    (("out", "out", "out.numel", 0), "writes something other than its output"),
])
def test_bad_op_calls_are_refused_at_declaration_naming_the_buffer(args, why):
    spec = StateSpec("bad-op-call")
    spec.buffer("seq_lens", dtype=torch.int32)
    with pytest.raises(graphctl.DeclarationError, match=why) as info:
        spec.buffer("token_map", dtype=torch.int32,
                    derive=Recompute(inputs=["seq_lens"], fn=graphctl.OpCall("token_to_request_", args)))
    assert info.value.buffer == "token_map"
    with pytest.raises(graphctl.DeclarationError, match="names no graphctl recompute op"):
        spec.buffer("other_map", dtype=torch.int32,
                    derive=Recompute(inputs=["seq_lens"], fn=graphctl.OpCall("cumsum", ("out", "in0"))))


def test_a_recompute_fn_of_the_wrong_arity_names_its_buffer():
    # Regression: issue 29, the arity error named `<lambda>(out)` but not the buffer it derives.
    spec = StateSpec("arity")
    spec.buffer("seq_lens", dtype=torch.int32)
    with pytest.raises(graphctl.DeclarationError, match="cannot take") as info:
        spec.buffer("token_map", dtype=torch.int32, derive=Recompute(inputs=["seq_lens"], fn=lambda out: None))
    assert info.value.buffer == "token_map"


@pytest.mark.skipif(not ops.uses_extension(), reason="graphctl._C is not loaded")
@pytest.mark.parametrize("op", sorted(ops.RECOMPUTE_OPS))
def test_recompute_op_schemas_match_the_registered_ops(op):
    # The Python schema OpCall is checked against must be the C++ one: names, kinds and the written argument.
    schema = getattr(torch.ops.graphctl, op).default._schema
    kinds = {"Tensor": "tensor", "int": "int", "float": "float", "bool": "bool"}
    got = tuple((a.name, kinds[str(a.type)], bool(a.alias_info and a.alias_info.is_write)) for a in schema.arguments)
    assert got == tuple((a.name, a.kind, a.writes) for a in ops.RECOMPUTE_OPS[op])
