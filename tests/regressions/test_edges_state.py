"""Regression tests for the switch's edges (issue 14): interrupts, re-entrancy, threads, writes
inside a switch, phase slots, forward-written buffers, padding dtypes, copies, views."""
from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

import graphctl
from graphctl import (
    BindError,
    ConcurrentUseError,
    CopyInPlace,
    DeclarationError,
    NestedSwitchError,
    Pad,
    Recompute,
    Registry,
    StateSpec,
    Swap,
    SwitchError,
    bind,
    ops,
)
from graphctl.testing.interrupts import interrupt_sweep
from support.mini import MiniMetadata, make_registry, make_spec


def _contents(st) -> dict[str, torch.Tensor]:
    return {n: st.tensor(n).clone() for n in st.restorable_names()}


def _assert_same(st, before) -> None:
    for n, t in before.items():
        assert torch.equal(st.tensor(n), t), f"{n} not restored"


def _sweep_setup(op_kind: str, phase: str = "eager"):
    def setup():
        meta = MiniMetadata(torch.Generator().manual_seed(11))
        st = bind(meta, registry=make_registry())
        if op_kind == "switch":
            def op():
                with st.switch("draft", phase):
                    st.write("seq_lens", torch.ones(5, dtype=torch.int32))
                    meta.block_offsets.add_(3)  # the forward writes the draft twin
                    meta.spec_positions.add_(1)  # and a declared, non-mutable buffer
        elif op_kind == "write":
            def op():
                st.write("kv_lens", torch.arange(1, 4, dtype=torch.int32))
        elif op_kind == "write_many":
            def op():
                st.write_many({"seq_lens": torch.ones(5, dtype=torch.int32),
                               "kv_lens": torch.arange(1, 4, dtype=torch.int32)})
        else:
            def op():
                st.pad({"seq": 2})
        return st, op
    return setup


@pytest.mark.parametrize("kind,phase,native", [("switch", "eager", True), ("switch", "eager", False),
                                               ("switch", "replay", True), ("switch", "replay", False),
                                               ("write", None, True), ("write_many", None, True),
                                               ("pad", None, True)])
def test_ctrl_c_at_every_line_is_never_silent_never_stuck(kind, phase, native):
    # Issue 14.1: a KeyboardInterrupt between bytecodes (e.g. after swap_through_ returned, before the switch
    # recorded it) left draft contents unpoisoned (28 of 229 points) or the switch stuck active (3 points).
    # Both switch implementations: the native table (its recompute and source callables run Python lines too)
    # and the Python steps.
    if native and kind == "switch" and not graphctl.ops.uses_extension():
        pytest.skip("the native switch needs graphctl._C")
    with graphctl.knobs.scope(native_switch=native):
        report = interrupt_sweep(_sweep_setup(kind, phase or "eager"))
    assert report.points > 50, report
    assert report.silent == () and report.stuck == () and report.swallowed == (), (str(report), report.silent,
                                                                                  report.stuck, report.swallowed)


def test_switch_from_inside_a_recompute_fn_is_refused_and_loses_nothing(gen):
    # Issue 14.2: a switch issued from a Recompute fn overwrote the outer switch's snapshot slots.
    holder: dict = {}

    def token_map_that_switches(out, seq_lens):
        if "st" in holder:
            with holder["st"].switch("draft", "eager"):
                pass
        out.fill_(1)

    spec = make_spec("reentrant")
    spec2 = StateSpec("reentrant2", extends=spec)
    spec2.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32, override=True,
                 derive=Recompute(inputs=["seq_lens"], fn=token_map_that_switches))
    m = MiniMetadata(gen)
    st = holder["st"] = bind(m, registry=make_registry(spec=spec2))
    before = _contents(st)
    with pytest.raises(NestedSwitchError, match="token_map_that_switches"):
        st.write("seq_lens", torch.ones(5, dtype=torch.int32))
    _assert_same(st, before)
    assert st.poisoned is None and st.active_phase is None


def test_write_from_inside_a_copy_source_is_refused(gen):
    # Issue 14.2: a write issued from a CopyInPlace source was accepted in the middle of a switch.
    holder: dict = {}

    def source(m):
        holder["st"].write("kv_lens", torch.ones(5, dtype=torch.int32))
        return m.draft_positions

    spec = StateSpec("reentrant-src", extends=make_spec())
    spec.buffer("spec_positions", shape=("S",), dtype=torch.int64, draft=CopyInPlace(source=source), override=True)
    m = MiniMetadata(gen)
    st = holder["st"] = bind(m, registry=make_registry(spec=spec))
    before = _contents(st)
    with pytest.raises(NestedSwitchError, match="CopyInPlace source"):
        with st.switch("draft", "eager"):
            pass
    _assert_same(st, before)
    assert m.block_offsets is st.tensor("block_offsets") and st.poisoned is None


def test_a_second_thread_gets_a_typed_error_never_corruption(gen):
    # Issue 14.3: two threads switching one state left draft contents in 25 of 30 trials, with no error.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    before = _contents(st)
    errors: list[BaseException] = []
    inside = threading.Event()
    go_on = threading.Event()

    def owner():
        with st.switch("draft", "eager"):
            st.write("seq_lens", torch.ones(5, dtype=torch.int32))
            inside.set()
            go_on.wait(10)

    def intruder():
        inside.wait(10)
        for attempt in (lambda: st.switch("draft", "eager").__enter__(),
                        lambda: st.write("kv_lens", torch.ones(5, dtype=torch.int32)),
                        lambda: st.pad({"seq": 1})):
            try:
                attempt()
            except BaseException as exc:  # noqa: BLE001 - recorded and checked below
                errors.append(exc)
        go_on.set()

    threads = [threading.Thread(target=owner), threading.Thread(target=intruder)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(errors) == 3 and all(isinstance(e, ConcurrentUseError) for e in errors), errors
    _assert_same(st, before)
    assert st.poisoned is None and st.active_phase is None
    # and many racing threads never corrupt: each either switches or is refused
    refused = []

    def racer():
        for _ in range(20):
            try:
                with st.switch("draft", "eager"):
                    st.write("seq_lens", torch.ones(5, dtype=torch.int32))
            except ConcurrentUseError:
                refused.append(1)

    pool = [threading.Thread(target=racer) for _ in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    _assert_same(st, before)
    assert st.poisoned is None


def _twin_spec() -> StateSpec:
    spec = StateSpec("twin-derived")
    spec.buffer("lens", shape=("S",), dtype=torch.int32, mutable=True, draft=Swap(twin="draft_lens"))
    spec.buffer("draft_lens", shape=("S",), dtype=torch.int32, mutable=True, readers={"draft"})
    spec.buffer("from_lens", shape=("S",), dtype=torch.int32, derive=Recompute(["lens"], lambda o, a: o.copy_(a * 2)))
    spec.buffer("from_twin", shape=("S",), dtype=torch.int32,
                derive=Recompute(["draft_lens"], lambda o, a: o.copy_(a + 7)))
    return spec


class _TwinMeta:
    def __init__(self, gen):
        self.lens = torch.randint(1, 50, (6,), generator=gen, dtype=torch.int32)
        self.draft_lens = torch.randint(1, 50, (6,), generator=gen, dtype=torch.int32)
        self.from_lens = torch.empty(6, dtype=torch.int32)
        self.from_twin = torch.empty(6, dtype=torch.int32)


def test_write_inside_a_switch_recomputes_everything_derived_from_the_written_storage(gen):
    # Issue 14.4 (TensorRT-LLM #16925's class): write("lens") inside a switch landed in the twin but left buffers
    # derived from the twin stale, and check() blamed "a write behind graphctl's back".
    reg = Registry()
    reg.register(_TwinMeta, _twin_spec())
    m = _TwinMeta(gen)
    st = bind(m, registry=reg)
    before = _contents(st)
    v = torch.randint(60, 90, (6,), generator=gen, dtype=torch.int32)
    with st.switch("draft", "eager"):
        st.write("lens", v)
        assert torch.equal(m.draft_lens, v) and torch.equal(m.from_twin, v + 7) and torch.equal(m.from_lens, v * 2)
        st.check()
        st.write("draft_lens", v + 1)
        assert torch.equal(m.from_lens, (v + 1) * 2) and torch.equal(m.from_twin, v + 8)
        st.check()
    _assert_same(st, before)
    st.check()


def test_forward_writes_to_declared_non_mutable_buffers_are_restored(gen):
    # Issue 14.6: a declared buffer not marked mutable, written by the forward's kernels inside a switch, was
    # neither restored nor flagged, while the guide promised a bitwise restore of every declared buffer.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    before = _contents(st)
    for phase in ("eager", "replay"):
        with st.switch("draft", phase):
            m.spec_positions.add_(5)
            m.block_offsets.mul_(3)  # the twin inside eager, the original inside replay
            m.req_idx_per_token.fill_(-9)
        _assert_same(st, before)


def test_pad_values_are_checked_against_the_dtype_at_bind(gen):
    # Issue 14.9: Pad.clamp(-3) on uint8 padded with 253; Pad.fill(300) on int8 raised a raw RuntimeError halfway.
    for dtype, pad in ((torch.uint8, Pad.clamp(-3)), (torch.int8, Pad.fill(300)), (torch.int32, Pad.fill(0.5))):
        spec = StateSpec(f"pad-{dtype}")
        spec.buffer("x", shape=("S",), dtype=dtype, axis="seq", pad=pad)

        class M:
            def __init__(self):
                self.x = torch.ones(4, dtype=dtype)

        reg = Registry()
        reg.register(M, spec)
        with pytest.raises(BindError, match="padding policy does not fit") as ei:
            bind(M(), registry=reg)
        assert ei.value.buffer == "x"


def test_a_recompute_that_raises_rolls_the_write_back(gen):
    # Issue 14.9: a write that failed after writing half left derived buffers stale and the state unpoisoned.
    calls = {"n": 0}

    def flaky(out, lens):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("recompute failed")
        out.copy_(lens)

    spec = StateSpec("flaky")
    spec.buffer("lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True)
    spec.buffer("copy", shape=("S",), dtype=torch.int32, derive=Recompute(["lens"], flaky))

    class M:
        def __init__(self):
            self.lens = torch.randint(1, 9, (5,), generator=gen, dtype=torch.int32)
            self.copy = torch.empty(5, dtype=torch.int32)

    reg = Registry()
    reg.register(M, spec)
    m = M()
    st = bind(m, registry=reg)  # computes 'copy' (call 1)
    before = _contents(st)
    for op in (lambda: st.write("lens", torch.full((3,), 77, dtype=torch.int32)), lambda: st.pad({"seq": 1})):
        with pytest.raises(RuntimeError, match="recompute failed"):
            op()
        _assert_same(st, before)
        assert st.poisoned is None


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_bound_state_refuses_to_be_copied(gen, how):
    # Issue 14.10: copy.copy shared snapshot slots but not the active flag; deepcopy after a switch applied
    # switches to the original object; pickling after a switch failed with AttributeError.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    with st.switch("draft", "eager"):
        pass
    do = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(SwitchError, match="cannot be"):
        do(st)


def test_a_view_at_the_same_address_with_other_strides_is_not_the_bound_buffer(gen):
    # Issue 14.11: an expand or a transpose at the same address passed the rebinding check, and derived buffers
    # were computed from it.
    m = MiniMetadata(gen, S=4, B=4)
    st = bind(m, registry=make_registry())
    bound = m.block_offsets
    m.block_offsets = bound.t()  # same address, same shape (4x4), other strides
    with pytest.raises(SwitchError, match="rebound") as ei:
        st.write("kv_lens", torch.ones(4, dtype=torch.int32))  # slot_mapping reads block_offsets
    assert ei.value.buffer == "block_offsets"
    with pytest.raises(SwitchError, match="rebound"):
        st.switch("draft", "eager").__enter__()
    m.block_offsets = bound
    m.kv_lens = m.kv_lens[:1].expand(4)  # same first address, stride 0
    with pytest.raises(SwitchError, match="rebound"):
        st.write("seq_lens", torch.ones(4, dtype=torch.int32))


def test_deleting_a_declared_attribute_is_a_typed_error(gen):
    # Issue 14 (errors): `del` of a declared attribute gave a raw AttributeError from a padding recompute.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    del m.kv_lens
    with pytest.raises(SwitchError, match="deleted"):
        st.pad({"seq": 2})


def test_recompute_fn_of_the_wrong_arity_is_refused_at_declaration():
    # Issue 14 (errors): a Recompute fn of the wrong arity gave a raw TypeError at the first switch.
    spec = StateSpec("arity")
    spec.buffer("a", dtype=torch.int32)
    spec.buffer("b", dtype=torch.int32)
    with pytest.raises(DeclarationError, match="cannot take"):
        spec.buffer("d", dtype=torch.int32, derive=Recompute(inputs=["a", "b"], fn=lambda out, a: None))
    spec.buffer("d", dtype=torch.int32, derive=Recompute(inputs=["a", "b"], fn=lambda out, *ins: None))  # variadic


def test_write_of_a_value_that_requires_grad_keeps_no_history(gen):
    # Issue 14 (errors): write() of a requires-grad value left the buffer with autograd history and every later
    # switch failed with a raw RuntimeError.
    spec = StateSpec("grad")
    spec.buffer("w", shape=("S",), dtype=torch.float32, mutable=True)

    class M:
        def __init__(self):
            self.w = torch.randn(3, generator=gen)

    reg = Registry()
    reg.register(M, spec)
    m = M()
    st = bind(m, registry=reg)
    st.write("w", torch.randn(3, generator=gen, requires_grad=True) * 2)
    assert m.w.grad_fn is None and not m.w.requires_grad
    with st.switch("draft", "eager"):
        st.write("w", torch.randn(3, generator=gen, requires_grad=True))
    assert m.w.grad_fn is None


def test_bind_computes_derived_buffers(gen):
    # Issue 14 (also wrong): bind() did not compute derived buffers, so a fresh state failed check() blaming the
    # user.
    m = MiniMetadata(gen)
    m.req_idx_per_token.fill_(-5)
    m.slot_mapping.fill_(-5)
    st = bind(m, registry=make_registry())
    st.check()


def test_interrupted_exit_is_restored_at_the_next_use(gen):
    # Issue 14.1: an interrupt delivered as __exit__ starts (before its first line) skips the restore; the
    # state's next use in the thread restores the orphaned switch instead of refusing every later switch.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    before = _contents(st)

    def leave_without_exit():
        sw = st.switch("draft", "eager")
        sw.__enter__()
        sw.frame = __import__("sys")._getframe(0)  # as if a with-statement in this frame had entered it

    leave_without_exit()
    assert st.active_phase is None  # recovered
    _assert_same(st, before)
    assert m.kv_cache_manager is st.binding.objects["kv_cache_manager"]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("change", ["dtype", "resize", "strided"])
def test_a_copy_source_changed_in_place_is_checked_again(native, change):
    # Regression: issue 29, a CopyInPlace source changed in place (same object, now float32) was copied as bits.
    spec = StateSpec("in-place-source")
    spec.buffer("pos", dtype=torch.int32, draft=CopyInPlace("dpos"))
    spec.buffer("dpos", dtype=torch.int32)

    class M:
        def __init__(self):
            self.pos = torch.randint(0, 100, (6,), dtype=torch.int32)
            self.dpos = torch.randint(100, 200, (6,), dtype=torch.int32)

    m = M()
    with graphctl.knobs.scope(native_switch=native):
        reg = Registry()
        reg.register(M, spec)
        st = bind(m, registry=reg)
        before = m.pos.clone()
        with st.switch("draft"):
            assert torch.equal(m.pos, m.dpos)
        if change == "dtype":
            m.dpos.data = torch.full((6,), 2.5)
        elif change == "resize":
            m.dpos.resize_(3)  # a raw C++ size error used to poison the state though nothing was written
        else:
            m.dpos.set_(torch.randint(0, 9, (12,), dtype=torch.int32).untyped_storage(), 0, (6,), (2,))
        with pytest.raises(SwitchError, match="source 'dpos' does not match") as info:
            with st.switch("draft"):
                pass
        assert info.value.buffer == "pos" and torch.equal(m.pos, before)
        st.check_usable()  # nothing was written: the state stays usable
        fresh = torch.randint(300, 400, (6,), dtype=torch.int32)
        m.dpos.data = fresh  # back to a fitting tensor, still the same object
        with st.switch("draft"):
            assert torch.equal(m.pos, fresh)
        assert torch.equal(m.pos, before)


class _Lens:
    """lens [1, 2, 0, 3], its twin dlens, and the token map derived from lens."""

    def __init__(self):
        self.lens = torch.tensor([1, 2, 0, 3], dtype=torch.int32)
        self.dlens = torch.tensor([2, 2, 2, 2], dtype=torch.int32)
        self.token_map = torch.zeros(8, dtype=torch.int32)


def _bind_lens(spec):
    """A fresh ``_Lens`` bound under ``spec`` (its own registry)."""
    reg = Registry()
    reg.register(_Lens, spec)
    m = _Lens()
    return m, bind(m, registry=reg)


def _lens_state(draft=None):
    spec = StateSpec("lens")
    spec.buffer("lens", dtype=torch.int32, mutable=True, **({"draft": draft} if draft else {}))
    spec.buffer("dlens", dtype=torch.int32, mutable=True)
    spec.buffer("token_map", dtype=torch.int32,
                derive=Recompute(["lens"], graphctl.OpCall("token_to_request_", ("out", "in0", "out.numel", -1))))
    return _bind_lens(spec)


@pytest.mark.parametrize("native", [True, False])
def test_a_negative_length_is_refused_under_the_knob_and_counts_as_zero_without(native):
    # Regression: issue 29, write("lens", [2, -1, 3, 1]) fed a token map whose C++ and Python results differed.
    with graphctl.knobs.scope(native_switch=native):
        m, st = _lens_state()
        before = (m.lens.clone(), m.token_map.clone())
        with graphctl.knobs.scope(check_lengths=True), pytest.raises(SwitchError, match="negative length") as info:
            st.write("lens", torch.tensor([2, -1, 3, 1], dtype=torch.int32))
        assert info.value.buffer == "lens" and "-1 at index 1" in str(info.value)
        assert torch.equal(m.lens, before[0]) and torch.equal(m.token_map, before[1])  # nothing written
        st.write("lens", torch.tensor([2, -1, 3, 1], dtype=torch.int32))
        assert m.token_map.tolist() == [0, 0, 2, 2, 2, 3, 4, 4]  # -1 counts as 0, in every kernel


@pytest.mark.parametrize("native", [True, False])
def test_write_many_refuses_two_values_for_one_storage(native):
    # Regression: issue 29, inside a switch write_many({"lens": a, "dlens": b}) with lens swapped to dlens dropped
    # one value, the outcome depending on dict order.
    with graphctl.knobs.scope(native_switch=native):
        m, st = _lens_state(draft=Swap("dlens"))
        with st.switch("draft"):
            before = m.dlens.clone()
            with pytest.raises(SwitchError, match="two values") as info:
                st.write_many({"lens": torch.ones(4, dtype=torch.int32),
                               "dlens": torch.full((4,), 2, dtype=torch.int32)})
            assert "'lens' and 'dlens'" in str(info.value) and torch.equal(m.dlens, before)
            st.write_many({"lens": torch.ones(4, dtype=torch.int32)})  # one of them is fine
            assert m.lens.tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("call", ["write", "pad"])
def test_another_thread_during_a_recompute_fn_gets_concurrent_use_not_nesting(call):
    # Regression: issue 29, thread B's write() while thread A ran a Recompute fn got NestedSwitchError (the
    # in-user flag was state-wide); B is concurrent, not nested.
    inside, release, armed = threading.Event(), threading.Event(), threading.Event()

    def slow_map(out, lens):
        if armed.is_set():  # not at bind()
            inside.set()
            release.wait(5)
        ops.token_to_request_(out, lens, out.numel(), -1)

    spec = StateSpec("threads")
    spec.buffer("lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True,
                draft=Swap("dlens"))
    spec.buffer("dlens", shape=("S",), dtype=torch.int32, mutable=True)
    spec.buffer("token_map", dtype=torch.int32, derive=Recompute(["lens"], slow_map))
    m, st = _bind_lens(spec)
    armed.set()
    errors = []

    def a():
        try:
            with st.switch("draft"):
                pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=a)
    t.start()
    assert inside.wait(5)
    try:
        with pytest.raises(ConcurrentUseError):
            if call == "write":
                st.write("dlens", torch.ones(4, dtype=torch.int32))
            else:
                st.pad({"seq": 2})
    finally:
        release.set()
        t.join(5)
    assert not errors and m.lens.tolist() == [1, 2, 0, 3]


@pytest.mark.parametrize("native", [True, False])
def test_a_write_of_a_view_of_the_buffer_itself_is_correct(native):
    # Regression: issue 29, state.write("lens", m.lens[1:]) (a shifted view of the buffer) raised an untyped
    # torch RuntimeError about overlapping memory.
    spec = StateSpec("shift")
    spec.buffer("lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True)

    class M:
        def __init__(self):
            self.lens = torch.tensor([5, 1, 2, 3], dtype=torch.int32)

    reg = Registry()
    reg.register(M, spec)
    m = M()
    with graphctl.knobs.scope(native_switch=native):
        st = bind(m, registry=reg)
        st.write("lens", m.lens[1:])
        assert m.lens.tolist() == [1, 2, 3, 0]
        st.write("lens", m.lens.as_strided((4,), (0,), 1))  # every element reads one the write overwrites
        assert m.lens.tolist() == [2, 2, 2, 2]


def test_near_misses_say_did_you_mean():
    # Regression: issue 29, a misspelled name got "Fix: set TinyMeta.seq_len before bind" with no hint.
    spec = StateSpec("near")
    spec.buffer("seq_len", dtype=torch.int32)

    class TinyMeta:
        def __init__(self):
            self.seq_lens = torch.zeros(4, dtype=torch.int32)

    reg = Registry()
    reg.register(TinyMeta, spec)
    with pytest.raises(BindError, match="did you mean 'seq_lens'"):
        bind(TinyMeta(), registry=reg)
    spec2 = StateSpec("near2")
    spec2.buffer("block_table", dtype=torch.int32, draft=Swap(twin="draft_blok_table"))
    spec2.buffer("draft_block_table", dtype=torch.int32)
    with pytest.raises(DeclarationError, match="did you mean 'draft_block_table'"):
        Registry().register(type("M", (), {}), spec2)
    m, st = _lens_state()
    with pytest.raises(SwitchError, match="did you mean 'lens'"):
        st.write("len", torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"graphed\(\) got an unexpected keyword argument 'bucket' \(did you mean "
                                        r"'buckets'\?\)"):
        graphctl.graphed(lambda x: x, bucket=[1])


@pytest.mark.parametrize("native", [True, False])
def test_an_input_written_in_place_inside_a_switch_is_caught_at_its_exit(native):
    # Regression: issue 29, meta.seq_lens.fill_(1) inside a switch left the token map stale for the forward's
    # reads, and GRAPHCTL_CHECK_STALE (checked on entry only) said nothing: the restore hid it.
    m, st = _lens_state()
    with graphctl.knobs.scope(native_switch=native, check_stale=True):
        with pytest.raises(graphctl.StaleBufferError, match="token_map") as info:
            with st.switch("draft"):
                m.lens.fill_(1)
        assert "before its restore" in str(info.value.__notes__)
        assert m.lens.tolist() == [1, 2, 0, 3]  # mutable, so snapshotted: restored cleanly, the state usable
        st.check_usable()
        with st.switch("draft"):
            pass  # consistent again: nothing raised


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_a_second_ctrl_c_gets_through_a_recompute_fn_that_hangs():
    # Regression: issue 29, a Recompute fn that never returned inside write() held SIGINT for good: only SIGKILL
    # stopped it. The first Ctrl-C is held as ever; a second one is delivered at once, and the write rolls back.
    import signal
    import time

    calls = []

    def hangs(out, lens):
        calls.append(1)
        if len(calls) == 1:  # bind() recomputes once
            ops.token_to_request_(out, lens, out.numel(), -1)
            return
        signal.raise_signal(signal.SIGINT)  # held: the write is in its section
        signal.raise_signal(signal.SIGINT)  # the second gets through
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # "hangs": only the interrupt ends it
            time.sleep(0.01)

    spec = StateSpec("hang")
    spec.buffer("lens", dtype=torch.int32, mutable=True)
    spec.buffer("token_map", dtype=torch.int32, derive=Recompute(["lens"], hangs))
    m, st = _bind_lens(spec)
    before = (m.lens.clone(), m.token_map.clone())
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        st.write("lens", torch.tensor([4, 0, 0, 0], dtype=torch.int32))
    assert time.monotonic() - t0 < 4
    assert torch.equal(m.lens, before[0]) and torch.equal(m.token_map, before[1])  # rolled back
    st.check_usable()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.parametrize("handler_does", ["sets a flag", "raises SystemExit"])
def test_a_second_ctrl_c_goes_to_the_program_s_own_handler(handler_does):
    # Regression: issue 55, the second Ctrl-C raised KeyboardInterrupt even where the program had installed its own
    # SIGINT handler (a graceful shutdown), which then never heard either signal.
    import signal
    import time

    heard = []

    def shutdown(signum, frame):
        heard.append(signum)
        if handler_does == "raises SystemExit" and len(heard) == 2:
            raise SystemExit(3)

    calls = []

    def hangs(out, lens):
        calls.append(1)
        if len(calls) == 2:  # bind() recomputes once; the write is the second call
            signal.raise_signal(signal.SIGINT)  # held: the write is in its section
            signal.raise_signal(signal.SIGINT)  # the second: to the program's handler, at once
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and handler_does == "raises SystemExit":
                time.sleep(0.01)  # "hangs" until the handler's SystemExit ends it
        ops.token_to_request_(out, lens, out.numel(), -1)

    spec = StateSpec("own-handler")
    spec.buffer("lens", dtype=torch.int32, mutable=True)
    spec.buffer("token_map", dtype=torch.int32, derive=Recompute(["lens"], hangs))
    m, st = _bind_lens(spec)
    before = (m.lens.clone(), m.token_map.clone())
    old = signal.signal(signal.SIGINT, shutdown)
    try:
        if handler_does == "sets a flag":
            st.write("lens", torch.tensor([4, 0, 0, 0], dtype=torch.int32))  # the handler only took note: done
            assert heard == [signal.SIGINT, signal.SIGINT]
            assert m.lens.tolist() == [4, 0, 0, 0] and m.token_map[:4].tolist() == [0, 0, 0, 0]
        else:
            with pytest.raises(SystemExit) as ei:
                st.write("lens", torch.tensor([4, 0, 0, 0], dtype=torch.int32))
            assert ei.value.code == 3 and heard == [signal.SIGINT, signal.SIGINT]
            assert torch.equal(m.lens, before[0]) and torch.equal(m.token_map, before[1])  # rolled back
        assert signal.getsignal(signal.SIGINT) is shutdown  # the program's handler is back in place
        st.check_usable()
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("native", [True, False])
def test_a_ctrl_c_at_the_first_line_of_exit_is_restored_before_the_handler_runs(gen, native):
    # Regression: issue 29, a Ctrl-C delivered at the first line of Switch.__exit__ left every swapped attribute on
    # its twin and the draft contents in place until the state's next use: an `except KeyboardInterrupt:` handler
    # (a checkpoint save) read draft state.
    from graphctl.state.transaction import Switch
    from graphctl.testing.interrupts import call_interrupted

    m = MiniMetadata(gen)
    with graphctl.knobs.scope(native_switch=native):
        st = bind(m, registry=make_registry())
        before = _contents(st)
        seen = {}

        def op():
            try:
                with st.switch("draft", "eager"):
                    st.write("seq_lens", torch.ones(5, dtype=torch.int32))
            except KeyboardInterrupt:
                # what the user's handler reads, before any later use of the state
                seen["manager"] = m.kv_cache_manager is st.binding.objects["kv_cache_manager"]
                seen["contents"] = all(torch.equal(getattr(m, n), t) for n, t in before.items())
                raise

        out, where = call_interrupted(op, 1, files=(Switch.__exit__.__code__,))
        assert isinstance(out, KeyboardInterrupt) and where, (out, where)
        assert seen == {"manager": True, "contents": True}, seen
        assert st._active is None
        with st.switch("draft", "eager"):
            pass


def test_a_guard_left_by_a_switch_never_exited_holds_no_other_switchs_ctrl_c(gen):
    # Regression: issue 29, the exit guard of a switch entered and never exited stayed the process's SIGINT handler
    # and held the Ctrl-C of every later switch's exit for good (the full suite's sweeps swallowed 2-3 points).
    import signal

    from graphctl.state.transaction import Switch
    from graphctl.testing.interrupts import call_interrupted

    found = signal.getsignal(signal.SIGINT)  # the default, or a guard an earlier test's stray switch left
    left = bind(MiniMetadata(gen), registry=make_registry())
    stray = left.switch("draft", "eager")
    stray.__enter__()  # never exited by its with-statement: its guard stays installed
    try:
        st = bind(MiniMetadata(gen), registry=make_registry())

        def op():
            with st.switch("draft", "eager"):
                pass

        for at in (1, 2, 3):  # __exit__'s lines: before, at and after its restore (its own guard removed by then)
            out, where = call_interrupted(op, at, files=(Switch.__exit__.__code__,))
            assert isinstance(out, KeyboardInterrupt) and where, (at, out, where)
            assert st._active is None
    finally:
        stray.__exit__(None, None, None)
    assert signal.getsignal(signal.SIGINT) is found  # the stray's exit put back what it found


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("where", ["a write", "the switch's entry"])
def test_a_recompute_fn_returning_its_result_is_refused_and_the_switch_restores(gen, native, where):
    # Regression: issue 55, fn=lambda out, lens: lens.cumsum(0) left the derived buffer stale with no error.
    mode = {"return": False}

    def token_map(out, seq_lens):
        got = torch.repeat_interleave(torch.arange(seq_lens.numel(), dtype=torch.int32), seq_lens.clamp(min=0).long())
        got = torch.nn.functional.pad(got, (0, out.numel() - got.numel()), value=seq_lens.numel())[: out.numel()]
        if mode["return"] and where == "a write":
            return got  # the mistake: computed, never written
        out.copy_(got)
        return None

    def slots(out, offsets, kv_lens):  # recomputed when the draft switch swaps block_offsets in
        got = offsets[:, 0].to(out.dtype) * 64 + kv_lens
        if mode["return"] and where == "the switch's entry":
            return got
        out.copy_(got)
        return None

    spec = StateSpec("returns", extends=make_spec("returns-base"))
    spec.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32, override=True,
                derive=Recompute(inputs=["seq_lens"], fn=token_map))
    spec.buffer("slot_mapping", shape=("S",), dtype=torch.int64, override=True,
                derive=Recompute(inputs=["block_offsets", "kv_lens"], fn=slots))
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry(spec=spec))
    before = _contents(st)
    name = "req_idx_per_token" if where == "a write" else "slot_mapping"
    with graphctl.knobs.scope(native_switch=native):
        mode["return"] = True
        with pytest.raises(DeclarationError, match=rf"{name}.*returned its result.*out.copy_"):
            with st.switch("draft", "eager"):
                st.write("seq_lens", torch.ones(5, dtype=torch.int32))
        _assert_same(st, before)  # the switch restored every buffer: nothing half-switched
        assert st.poisoned is None and st.active_phase is None
        mode["return"] = False  # fixed: the same state switches and derives again
        with st.switch("draft", "eager"):
            st.write("seq_lens", torch.ones(5, dtype=torch.int32))
            assert m.req_idx_per_token[:5].tolist() == [0, 1, 2, 3, 4]
            assert torch.equal(m.slot_mapping, m.block_offsets[:, 0].long() * 64 + m.kv_lens)
    _assert_same(st, before)


def test_a_guard_left_by_a_dead_switch_never_claims_a_new_switch_at_its_address(gen):
    # Regression: issue 55's loaded run, a flake of the interrupt sweep: an ExitGuard knew its switch by id(); left
    # installed after that switch was collected, it took a new switch allocated at the same address for its own and
    # held that switch's Ctrl-C (at the last line of its __exit__) without ever delivering it.
    import signal
    import types

    from graphctl.state.interrupts import ExitGuard
    from graphctl.state.transaction import _EXIT_CODES, Switch

    st = bind(MiniMetadata(gen), registry=make_registry())
    dead = Switch(st, "draft", "eager", {})
    guard = ExitGuard(_EXIT_CODES, dead)
    guard.saved, guard.active = signal.default_int_handler, True  # as install() leaves it, without touching SIGINT
    address = id(dead)
    del dead  # freed here (no cycle): its block is the allocator's next one of that size
    new = None
    for _ in range(1000):  # CPython hands a freed block of the same size back at once: the address comes back
        candidate = Switch(st, "draft", "eager", {})
        if id(candidate) == address:
            new = candidate
            break
    if new is None:
        pytest.skip("the allocator did not reuse the address (the condition this test needs)")
    frame = types.SimpleNamespace(f_code=Switch.__exit__.__code__, f_locals={"self": new})
    with pytest.raises(KeyboardInterrupt):  # forwarded to the handler it saved: not held as its own
        guard._handle(signal.SIGINT, frame)
    assert guard.pending == []
