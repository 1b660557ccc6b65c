"""Every bad input graphctl refuses, as data: one row per error of docs/errors.md.

``PYTHONPATH=tests python -m support.errors`` prints the table (with the message each case produces);
``tests/unit/test_errors.py`` raises every case and checks the table is current."""
from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable

import torch

from graphctl import (
    BindError,
    CaptureError,
    ConcurrentUseError,
    CopyInPlace,
    CorruptedStateError,
    DeclarationError,
    NestedSwitchError,
    OpCall,
    Pad,
    Persistent,
    Recompute,
    Registry,
    ReplayError,
    RepointError,
    SamplingError,
    Stable,
    StaleBufferError,
    StateSpec,
    StaticInput,
    Swap,
    SwitchError,
    bind,
    graphed,
)
from graphctl.state import seams
from support.mini import MiniMetadata, make_registry

G = lambda: torch.Generator().manual_seed(1234)  # noqa: E731  (fixed: the table shows real messages)
noop = lambda out, *xs: None  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    exc: type
    when: str  # "declaration", "bind", "use"
    trigger: str  # what the user did, for the table
    run: Callable[[], object]
    needs_cuda: bool = False  # raised only where CUDA exists; the table then shows `cuda_message`


PINNED_MESSAGE = ("[h] _Obj.h: host buffer is not pinned: expected pinned memory, found pageable memory. "
                  "Fix: allocate with pin_memory=True so copies are asynchronous")


def _repoint_engine(max_seqs: int):
    from graphctl.graphs import StaticInput
    from graphctl.models.mtp import EngineConfig, MTPEngine

    eng = MTPEngine(EngineConfig(max_seqs=max_seqs, layers=1), device="cpu")
    eng.meta.prepare(eng.state, torch.full((2,), 4, dtype=torch.int32), torch.full((2,), 9, dtype=torch.int32))
    f = graphed(eng.step, buckets=[2], inputs=[StaticInput("input_ids", per_item=4)], backend="emulated",
                progress=False, state=eng.state)
    f.capture_all(torch.arange(8) % eng.cfg.vocab, eng.meta)
    return eng, f


def _verify_bad_writes():
    f = graphed(lambda x: x * 2, buckets=[2], inputs=["x"], backend="emulated", progress=False)
    f.capture_all(torch.ones(2, 3))
    f.verify(writes="strict")


def _repoint_other_layout():
    _, f = _repoint_engine(4)
    other, _ = _repoint_engine(2)
    f.repoint(other.state)


def _repoint_without_state():
    m, st = _mini()
    f = graphed(lambda x: x * 2, buckets=[2], backend="emulated", progress=False)  # a forward with no state
    f.capture_all(torch.ones(2, 3))
    f.repoint(st)


def _spec(*decls):
    s = StateSpec("t")
    for kind, name, kw in decls:
        getattr(s, kind)(name, **kw)
    return s


def _register(spec, cls=None):
    return Registry().register(cls or type("M", (), {}), spec)


class _Obj:
    pass


def _bind(spec, **attrs):
    o = _Obj()
    for k, v in attrs.items():
        setattr(o, k, v)
    reg = Registry()
    reg.register(_Obj, spec)
    return bind(o, registry=reg)


def _mini():
    m = MiniMetadata(G())
    return m, bind(m, registry=make_registry())


def _enter(st, phase="eager"):
    return st.switch("draft", phase).__enter__()


def _nested():
    m, st = _mini()
    with st.switch("draft", "eager"):
        _enter(st)


def _poisoned():
    m, st = _mini()
    seams.install(st, fault=lambda stage, step, when: (
        (_ for _ in ()).throw(RuntimeError("fault")) if stage == "restore" else None
    ))
    try:
        with st.switch("draft", "eager"):
            pass
    except CorruptedStateError:
        pass
    st.write("seq_lens", m.seq_lens.clone())


def _write_inside(name, value):
    m, st = _mini()
    with st.switch("draft", "eager"):
        st.write(name, value(m))


def _stale():
    m, st = _mini()
    m.seq_lens[0] += 1
    st.check()


def _rebound():
    m, st = _mini()
    m.seq_lens = m.seq_lens.clone()
    _enter(st)


def _bad_source():
    m, st = _mini()
    m.draft_kv_cache_manager.pool_indices = m.draft_kv_cache_manager.pool_indices[:2]
    _enter(st)


def _source_changed_in_place():
    m, st = _mini()
    with st.switch("draft", "eager"):
        pass
    m.draft_positions.data = m.draft_positions.float()  # the same object, now float32
    _enter(st)


def _lens_spec(**lens):
    return _spec(("buffer", "lens", {"dtype": I32, "mutable": True, **lens}),
                 ("buffer", "dlens", {"dtype": I32, "mutable": True}),
                 ("buffer", "token_map", {"dtype": I32, "derive": Recompute(
                     ["lens"], OpCall("token_to_request_", ("out", "in0", "out.numel", -1)))}))


def _lens_state(**lens):
    return _bind(_lens_spec(**lens), lens=torch.tensor([1, 2, 0, 3], dtype=I32),
                 dlens=torch.tensor([2, 2, 2, 2], dtype=I32), token_map=T(8, dtype=I32))


def _negative_length():
    from graphctl import knobs

    st = _lens_state()
    with knobs.scope(check_lengths=True):
        st.write("lens", torch.tensor([2, -1, 3, 1], dtype=I32))


def _one_storage_two_values():
    st = _lens_state(draft=Swap("dlens"))
    _enter(st)
    st.write_many({"lens": torch.tensor([1, 1, 1, 1], dtype=I32),
                   "dlens": torch.tensor([2, 2, 2, 2], dtype=I32)})


def _restore_fails():
    m, st = _mini()
    seams.install(st, fault=lambda stage, step, when: (_ for _ in ()).throw(RuntimeError("device lost"))
                  if stage == "restore" and step.startswith("snapshot") else None)
    with st.switch("draft", "eager"):
        pass


def _reentrant():
    m, st = _mini()
    seams.install(st, user=lambda label: st.switch("draft", "eager").__enter__())  # a Recompute fn calling back
    st.write("seq_lens", m.seq_lens.clone())


def _other_thread():
    import threading

    m, st = _mini()
    err: list[BaseException] = []
    with st.switch("draft", "eager"):
        t = threading.Thread(target=lambda: _catch(err, lambda: st.write("seq_lens", m.seq_lens.clone())))
        t.start()
        t.join()
    raise err[0]


def _catch(into, fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
        into.append(exc)


def _partial_snapshot():
    from torch.utils._python_dispatch import TorchDispatchMode

    m, st = _mini()

    class Half(TorchDispatchMode):  # the fused op writes its first buffer, then the device fails
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.graphctl.swap_through_.default:
                statics, arenas, sources = args
                func(statics[:1], arenas[:1], sources[:1])
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return func(*args, **(kwargs or {}))

    try:
        with Half(), st.switch("draft", "eager"):
            pass
    except RuntimeError:
        pass
    st.check()


def _view_rebound():
    m = MiniMetadata(G(), S=4, B=4)
    st = bind(m, registry=make_registry())
    m.block_offsets = m.block_offsets.t()
    st.write("kv_lens", torch.ones(4, dtype=torch.int32))


def _deleted():
    m, st = _mini()
    del m.kv_lens
    st.pad({"seq": 1})


def _frozen_changed():
    r = graphed(lambda x, cfg: x * cfg["scale"], buckets=[2], inputs=["x"], backend="emulated", progress=False)
    cfg = {"scale": 2.0}
    r.capture_all(torch.ones(2, 3), cfg)
    cfg["scale"] = 3.0
    r(torch.ones(2, 3), cfg)


def _side_effect_forward():
    ring = torch.zeros(4)

    def fwd(x):
        ring.add_(1)  # state the forward keeps, undeclared
        return x + ring.sum()
    return fwd


def _host_flag_forward():
    class Sampler:
        probs_valid = False

    sampler = Sampler()

    def fwd(x):
        sampler.probs_valid = True  # host state the warmup flips
        return x * 2

    return fwd


def _path_rebound():
    class Engine:
        def __init__(self):
            self.sched = torch.arange(3.0)

        def forward(self, x):
            return x * self.sched

    eng = Engine()
    f = graphed(eng.forward, buckets=[2], inputs=["x"], backend="emulated", progress=False)
    x = torch.ones(2, 3)
    f.capture_all(x)
    eng.sched = torch.arange(3.0)  # a fresh tensor: the graph would read the old one
    f(x)


def _stale_output():
    from graphctl import knobs

    f = graphed(lambda x: x * 2, buckets=[2], inputs=["x"], backend="emulated", progress=False)
    x = torch.ones(2, 3)
    with knobs.scope(check_outputs=True):
        first = f(x)
        f(x)
        first.sum()


def _starred_not_a_sequence():
    class Holder:
        def __init__(self):
            self.layers = 3

    spec = StateSpec("starred")
    spec.buffer("layers[*].keys", shape=(2,))
    reg = Registry()
    reg.register(Holder, spec)
    bind(Holder(), registry=reg)


def _runner(fn=None, capture=True, **kw):
    """A small emulated runner over the mini metadata: x is the static input, meta frozen."""
    m, st = _mini()
    fn = fn or (lambda x, meta: x * 2 + meta.kv_lens[: x.shape[0], None].float())
    opts = dict(buckets=[2, 4], state=st, inputs=["x"], backend="emulated", progress=False)
    opts.update(kw)
    r = graphed(fn, **opts)
    x = torch.rand(3, 4, generator=G()) + 0.5
    if capture:
        r.capture_all(x, m)
    return r, m, x


def _graphed_call_inside_its_switch():
    r, m, x = _runner(fn=lambda x, meta: x * 2 + meta.block_offsets[: x.shape[0], :1].float())
    with r.state.switch("draft"):
        r(x, m)


def _small_engine():
    from graphctl.models import EngineConfig, MTPEngine

    return MTPEngine(EngineConfig(draft_len=2, max_seqs=2, layers=1, hidden=8))


def _unknown_loop_mode():
    from graphctl.models import graphed_step

    graphed_step(_small_engine(), "sideways")


def _loop_on_cpu():
    from graphctl.models import graphed_step

    graphed_step(_small_engine(), "device_loop", backend="emulated")


def _loop_recorded():
    from graphctl.graphs.capture.conditional import DeviceLoop

    loop = DeviceLoop(torch.device("cpu"))
    flag = torch.zeros(1, dtype=torch.int32)
    graphed(lambda x: loop.run(lambda: x.add_(1), lambda f, h: None, 2) or x, backend="emulated", buckets=[2],
            progress=False, warmup_iters=0)(torch.ones(2, 2))
    return flag


def _agreed_switch_fails():
    import tempfile

    import torch.distributed as dist

    from graphctl.graphs.replay.distributed import Agreement, agreed_switch

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            m, st = _mini()
            m.draft_kv_cache_manager.pool_indices = m.draft_kv_cache_manager.pool_indices[:2]
            with agreed_switch(st, "draft", Agreement(dist.group.WORLD), phase="eager"):
                pass
        finally:
            dist.destroy_process_group()


def _illegal_item():
    def fn(x, meta):
        if x.sum().item() > 0:  # a host read of a device value: illegal under capture
            return x * 2
        return x

    _runner(fn)


def _body_raises():
    armed = [False]

    def fn(x, meta):
        if armed[0]:
            raise ValueError("the forward's own error")
        return x * 2

    r, m, x = _runner(fn, capture=False)
    armed[0] = True  # warmups passed; only the capture raises
    r.options = dataclasses.replace(r.options, warmup_iters=0)
    r.capture_all(x, m)


def _moved():
    r, m, x = _runner()
    m.kv_lens = m.kv_lens.clone()  # rebound, not written in place: the graph still reads the old one
    r(x, m)


def _object_replaced():
    class Meta:
        def __init__(self) -> None:
            self.generator = torch.Generator().manual_seed(1)

    spec = StateSpec("errors_gen")
    spec.object("generator")
    reg = Registry()
    reg.register(Meta, spec)
    m = Meta()
    st = bind(m, registry=reg)
    f = graphed(lambda x, meta: x + torch.rand(x.shape, generator=meta.generator), buckets=[2], state=st,
                inputs=["x"], backend="emulated", progress=False)
    f.capture_all(torch.zeros(2, 3), m)
    m.generator = torch.Generator().manual_seed(42)
    f(torch.zeros(2, 3), m)


def _lin_runner():
    lin = torch.nn.Linear(3, 3)
    f = graphed(lin, buckets=[2], backend="emulated", progress=False)
    with torch.no_grad():
        f.capture_all(torch.ones(2, 3))
    return lin, f


def _weight_rebound():
    lin, f = _lin_runner()
    lin.weight = torch.nn.Parameter(torch.zeros(3, 3))
    with torch.no_grad():
        f(torch.ones(2, 3))


def _module_replaced():
    class Holder:
        def __init__(self) -> None:
            self.lin = torch.nn.Linear(3, 3)

    h = Holder()
    f = graphed(lambda x: h.lin(x), buckets=[2], backend="emulated", progress=False)
    with torch.no_grad():
        f.capture_all(torch.ones(2, 3))
        h.lin = torch.nn.Linear(3, 3)
        f(torch.ones(2, 3))


def _state_not_given():
    m, st = _mini()

    def fwd(x, meta):
        with st.switch("draft"):
            return x * 2

    graphed(fwd, buckets=[2], inputs=["x"], backend="emulated", progress=False).capture_all(torch.ones(2, 3), m)


def _write_refresh():
    m, st = _mini()
    with st.switch("draft", "refresh"):
        st.write("seq_lens", T(5, dtype=I32))


T = torch.zeros
I32 = torch.int32
def _sampling_not_settings():
    from graphctl.models import graphed_step

    graphed_step(_small_engine(), "per_step", sampling=0.8)


def _variant_runner(**kw):
    r = graphed(lambda x, k: x * k, buckets=[2], backend="emulated", progress=False, variants={"k": (1, 3)}, **kw)
    return r.capture_all(torch.ones(2, 3), 1)


def _switch_across_region():
    import graphctl

    m, st = _mini()

    @graphctl.eager
    def region(t):
        return t + 1

    def fwd(x, meta):
        with st.switch("draft"):
            return region(x * 2)

    graphed(fwd, buckets=[2], state=st, inputs=["x"], backend="emulated", progress=False).capture_all(
        torch.ones(2, 3), m)


def _region_result(bad: str):
    import graphctl

    rows = {"n": 2, "flag": 1}

    @graphctl.eager
    def ragged(h):
        return h[: rows["n"]].clone(), rows["flag"]

    def fwd(x):
        h, flag = ragged(x * 2)
        return h * flag

    r = graphed(fwd, buckets=[2], backend="emulated", progress=False)
    r.capture_all(torch.ones(2, 3))
    rows["n" if bad == "shape" else "flag"] = 1 if bad == "shape" else 5
    r(torch.ones(2, 3))


def _region_alias(bad: str):
    import graphctl

    shared = {"two": False}

    @graphctl.eager
    def maybe(h):  # an early "nothing to do" return at capture
        return h * 0.5 if (h > 100).any() else h

    @graphctl.eager
    def pair(h):
        a = h + 1
        return (a, h + 2) if shared["two"] else (a, a)

    def fwd(x):
        if bad == "argument":
            return maybe(x * 10) - 1
        a, b = pair(x * 1)
        return a * 10 + b

    r = graphed(fwd, buckets=[2], backend="emulated", progress=False)
    r.capture_all(torch.ones(2, 3))
    shared["two"] = True
    r(torch.full((2, 3), 50.0))


def _region_publishes():
    import graphctl

    class Box:
        cache = torch.zeros(2, 3)

    box = Box()

    @graphctl.eager
    def publish(h):
        box.cache = h * 2  # a tensor made here, read by the next piece, not returned
        return h + 0

    def fwd(x):
        return publish(x * 1) + box.cache

    graphed(fwd, buckets=[2], backend="emulated", progress=False).capture_all(torch.ones(2, 3))


def _region_uses_state_in_switch():
    import graphctl

    m, st = _mini()

    @graphctl.eager(in_switch=True)
    def region(t):
        st.write("kv_lens", m.kv_lens[:1] + 1)  # the state's own API inside the recorded switch
        return t + 1

    def fwd(x, meta):
        with st.switch("draft"):
            return region(x * 2)

    graphed(fwd, buckets=[2], state=st, inputs=["x"], backend="emulated", progress=False).capture_all(
        torch.ones(2, 3), m)


def _region_fullgraph():
    import graphctl

    @graphctl.eager
    def region(h):
        return h * 2

    def fwd(x):
        return region(x + 1) - 1

    torch._dynamo.reset()
    cf = torch.compile(fwd, backend="eager", fullgraph=True)
    graphed(cf, buckets=[2], backend="emulated", progress=False).capture_all(torch.ones(2, 3))


def _probs(**settings):
    from graphctl.ops.sampling import probs_from_logits

    return probs_from_logits(torch.rand(2, 5, generator=G()), **settings)


def _check_seed(seed):
    from graphctl.models.sampled import check_seed

    check_seed(seed)


def _request_settings(n, **kw):
    from graphctl.models import RequestSettings

    RequestSettings.of(n, **kw)


def _check_forward_greedy_sampled():
    from graphctl.models.sampled import check_forward

    def step(input_ids, meta, k=None):
        return input_ids

    check_forward(step, True, 3, 0)



CASES: list[Case] = [
    # ---- declaration errors (StateSpec / register)
    Case(
        "decl-opcall",
        DeclarationError,
        "declaration",
        "an `OpCall` recompute naming an op graphctl cannot launch natively, an argument that is neither a "
        "placeholder nor a constant, or an input the `Recompute` does not list",
        lambda: _spec(("buffer", "a", {}),
                      ("buffer", "d", {"derive": Recompute(["a"], OpCall("cumsum", ("out", "in0")))})),
    ),
    Case(
        "decl-opcall-schema",
        DeclarationError,
        "declaration",
        "an `OpCall` that does not fit its op's schema: the wrong number of arguments, a float or bool where an int "
        "goes, or a written argument other than `\"out\"` (a recompute must never write a declared input)",
        lambda: _spec(("buffer", "a", {}), ("buffer", "d", {"derive": Recompute(
            ["a"], OpCall("token_to_request_", ("in0", "out", "in0.numel", -1)))})),
    ),
    Case(
        "decl-duplicate",
        DeclarationError,
        "declaration",
        "the same name declared twice",
        lambda: _spec(("buffer", "a", {}), ("buffer", "a", {})),
    ),
    Case(
        "decl-override",
        DeclarationError,
        "declaration",
        "redeclaring a parent entry without override=True",
        lambda: StateSpec("c", extends=_spec(("buffer", "a", {}))).buffer("a"),
    ),
    Case(
        "decl-frozen",
        DeclarationError,
        "declaration",
        "adding to a registered spec",
        lambda: _register(_spec(("buffer", "a", {}))).buffer("b"),
    ),
    Case(
        "decl-axis",
        DeclarationError,
        "declaration",
        "unknown axis name",
        lambda: _spec(("buffer", "a", {"axis": "batch", "pad": Pad.zero()})),
    ),
    Case(
        "decl-axis-no-pad",
        DeclarationError,
        "declaration",
        "an axis without a padding policy",
        lambda: _spec(("buffer", "a", {"axis": "seq"})),
    ),
    Case(
        "decl-pad-no-axis",
        DeclarationError,
        "declaration",
        "a padding policy without an axis",
        lambda: _spec(("buffer", "a", {"pad": Pad.zero()})),
    ),
    Case("decl-pad-bounds", DeclarationError, "declaration", "Pad.clamp with lo > hi", lambda: Pad.clamp(5, 1)),
    Case("decl-pad-kind", DeclarationError, "declaration", "an unknown padding kind", lambda: Pad("wrap")),
    Case(
        "decl-axis-dim",
        DeclarationError,
        "declaration",
        "axis_dim outside the declared shape",
        lambda: _spec(("buffer", "a", {"shape": ("S",), "axis": "seq", "axis_dim": 1, "pad": Pad.zero()})),
    ),
    Case(
        "decl-readers",
        DeclarationError,
        "declaration",
        "readers naming an unknown segment",
        lambda: _spec(("buffer", "a", {"readers": {"prefill"}})),
    ),
    Case(
        "decl-swap-missing-twin",
        DeclarationError,
        "declaration",
        "Swap to an undeclared twin",
        lambda: _register(_spec(("buffer", "a", {"draft": Swap("b")}))),
    ),
    Case(
        "decl-swap-kind",
        DeclarationError,
        "declaration",
        "Swap of a buffer to an object entry",
        lambda: _register(_spec(("object", "b", {}), ("buffer", "a", {"draft": Swap("b")}))),
    ),
    Case(
        "decl-swap-shape",
        DeclarationError,
        "declaration",
        "a twin declared with another shape or dtype",
        lambda: _register(
            _spec(("buffer", "b", {"shape": ("S", "B2")}), ("buffer", "a", {"shape": ("S", "B"), "draft": Swap("b")}))
        ),
    ),
    Case(
        "decl-swap-self",
        DeclarationError,
        "declaration",
        "Swap to itself",
        lambda: _register(_spec(("buffer", "a", {"draft": Swap("a")}))),
    ),
    Case(
        "decl-swap-chain",
        DeclarationError,
        "declaration",
        "a twin that is itself swapped",
        lambda: _register(
            _spec(("buffer", "c", {}), ("buffer", "b", {"draft": Swap("c")}), ("buffer", "a", {"draft": Swap("b")}))
        ),
    ),
    Case(
        "decl-swap-shared-twin",
        DeclarationError,
        "declaration",
        "two bases swapping to one twin",
        lambda: _register(
            _spec(("buffer", "t", {}), ("buffer", "a", {"draft": Swap("t")}), ("buffer", "b", {"draft": Swap("t")}))
        ),
    ),
    Case(
        "decl-swap-refresh",
        DeclarationError,
        "declaration",
        "refresh= on a swapped buffer",
        lambda: _spec(("buffer", "a", {"draft": Swap("b"), "refresh": CopyInPlace("s")})),
    ),
    Case(
        "decl-recompute-arity",
        DeclarationError,
        "declaration",
        "a Recompute fn that cannot take (out, *inputs)",
        lambda: _spec(("buffer", "a", {}), ("buffer", "b", {}),
                      ("buffer", "d", {"derive": Recompute(["a", "b"], lambda out, a: None)})),
    ),
    Case(
        "bind-recompute-returned",
        DeclarationError,
        "bind",
        "a Recompute fn that returns its result instead of writing it into out",
        lambda: _bind(_spec(("buffer", "lens", {"mutable": True}),
                            ("buffer", "cum", {"derive": Recompute(["lens"], lambda out, lens: lens.cumsum(0))})),
                      lens=torch.tensor([2, 3, 1]), cum=torch.zeros(3, dtype=torch.int64)),
    ),
    Case(
        "decl-recompute-input",
        DeclarationError,
        "declaration",
        "Recompute of an undeclared input",
        lambda: _register(_spec(("buffer", "d", {"derive": Recompute(["x"], noop)}))),
    ),
    Case(
        "decl-cycle",
        DeclarationError,
        "declaration",
        "Recompute inputs forming a cycle",
        lambda: _register(
            _spec(
                ("buffer", "a", {"derive": Recompute(["b"], noop)}), ("buffer", "b", {"derive": Recompute(["a"], noop)})
            )
        ),
    ),
    Case(
        "decl-refresh-target-reader",
        DeclarationError,
        "declaration",
        "refresh= (CopyInPlace around replay) on a buffer the target segment reads",
        lambda: _register(_spec(("buffer", "a", {"refresh": CopyInPlace("s")}))),
    ),
    Case(
        "decl-refresh-dependent-reader",
        DeclarationError,
        "declaration",
        "a derived buffer read by the target but recomputed from a replay refresh",
        lambda: _register(
            _spec(
                ("buffer", "t", {"readers": {"draft"}, "refresh": CopyInPlace("s")}),
                ("buffer", "d", {"derive": Recompute(["t"], noop)}),
            )
        ),
    ),
    Case(
        "decl-derived-copy",
        DeclarationError,
        "declaration",
        "a derived buffer also copied in place",
        lambda: _spec(("buffer", "d", {"derive": Recompute(["x"], noop), "draft": CopyInPlace("s")})),
    ),
    Case(
        "decl-derived-mutable",
        DeclarationError,
        "declaration",
        "a derived buffer declared mutable",
        lambda: _spec(("buffer", "d", {"derive": Recompute(["x"], noop), "mutable": True})),
    ),
    Case(
        "decl-stable-mutable",
        DeclarationError,
        "declaration",
        "a Stable buffer declared mutable",
        lambda: _spec(("buffer", "a", {"draft": Stable(), "mutable": True})),
    ),
    Case(
        "decl-persistent-mutable",
        DeclarationError,
        "declaration",
        "a Persistent buffer (the forward's lasting state) declared mutable",
        lambda: _spec(("buffer", "a", {"draft": Persistent(), "mutable": True})),
    ),
    Case(
        "decl-alias-entry",
        DeclarationError,
        "declaration",
        "an alias that is also declared as an entry",
        lambda: _register(_spec(("buffer", "v", {}), ("buffer", "a", {"aliases": ("v",)}))),
    ),
    Case(
        "decl-alias-two-bases",
        DeclarationError,
        "declaration",
        "one alias declared for two bases",
        lambda: _register(_spec(("buffer", "a", {"aliases": ("v",)}), ("buffer", "b", {"aliases": ("v",)}))),
    ),
    Case(
        "decl-copy-chain",
        DeclarationError,
        "declaration",
        "CopyInPlace reading a buffer that is copied in place",
        lambda: _register(
            _spec(("buffer", "s", {"draft": CopyInPlace("x")}), ("buffer", "a", {"draft": CopyInPlace("s")}))
        ),
    ),
    Case(
        "decl-object-action",
        DeclarationError,
        "declaration",
        "CopyInPlace on an object entry",
        lambda: _spec(("object", "m", {"draft": CopyInPlace("x")})),
    ),
    Case(
        "decl-bad-recompute", DeclarationError, "declaration", "Recompute with no inputs", lambda: Recompute([], noop)
    ),
    Case(
        "decl-register-twice",
        DeclarationError,
        "declaration",
        "registering one type twice",
        lambda: [r := Registry(), r.register(_Obj, _spec()), r.register(_Obj, _spec())],
    ),
    Case(
        "decl-register-not-type",
        DeclarationError,
        "declaration",
        "registering an instance instead of a type",
        lambda: Registry().register(_Obj(), _spec()),
    ),
    # ---- bind errors
    Case(
        "bind-unregistered",
        BindError,
        "bind",
        "binding an object whose type has no spec",
        lambda: bind(_Obj(), registry=Registry()),
    ),
    Case(
        "bind-missing",
        BindError,
        "bind",
        "a declared attribute missing on the object",
        lambda: _bind(_spec(("buffer", "a", {}))),
    ),
    Case(
        "bind-not-tensor",
        BindError,
        "bind",
        "a declared buffer holding a non-tensor",
        lambda: _bind(_spec(("buffer", "a", {})), a=[1, 2]),
    ),
    Case(
        "bind-dtype",
        BindError,
        "bind",
        "dtype differing from the declaration",
        lambda: _bind(_spec(("buffer", "a", {"dtype": torch.int32})), a=T(3, dtype=torch.int64)),
    ),
    Case(
        "bind-rank",
        BindError,
        "bind",
        "rank differing from the declared shape",
        lambda: _bind(_spec(("buffer", "a", {"shape": ("S", "B")})), a=T(3)),
    ),
    Case(
        "bind-dim",
        BindError,
        "bind",
        "two buffers disagreeing on one dimension name",
        lambda: _bind(_spec(("buffer", "a", {"shape": ("S",)}), ("buffer", "b", {"shape": ("S",)})), a=T(3), b=T(4)),
    ),
    Case(
        "bind-host-device",
        BindError,
        "bind",
        "host=True buffer not on the CPU",
        lambda: _bind(_spec(("buffer", "a", {"host": True})), a=T(3, device="meta")),
    ),
    Case(
        "bind-devices",
        BindError,
        "bind",
        "device buffers on two devices",
        lambda: _bind(_spec(("buffer", "a", {}), ("buffer", "b", {})), a=T(3), b=T(3, device="meta")),
    ),
    Case(
        "bind-contiguous",
        BindError,
        "bind",
        "a strided (non-contiguous) buffer",
        lambda: _bind(_spec(("buffer", "a", {})), a=T(4, 2)[:, 0]),
    ),
    Case(
        "bind-overlap",
        BindError,
        "bind",
        "two buffers sharing bytes",
        lambda: (lambda base: _bind(_spec(("buffer", "a", {}), ("buffer", "b", {})), a=base[:6], b=base[4:]))(T(10)),
    ),
    Case(
        "bind-twin-shape",
        BindError,
        "bind",
        "a twin allocated at another shape",
        lambda: _bind(_spec(("buffer", "t", {}), ("buffer", "a", {"draft": Swap("t")})), a=T(4), t=T(5)),
    ),
    Case(
        "bind-twin-same-object",
        BindError,
        "bind",
        "an object swapped to the very same object",
        lambda: (lambda o: _bind(_spec(("object", "t", {}), ("object", "m", {"draft": Swap("t")})), m=o, t=o))(_Obj()),
    ),
    Case(
        "bind-alias",
        BindError,
        "bind",
        "a declared alias that is not a view of its base",
        lambda: _bind(_spec(("buffer", "a", {"aliases": ("v",)})), a=T(4), v=T(2)),
    ),
    Case(
        "bind-undeclared-view",
        BindError,
        "bind",
        "a live view of a swapped buffer not declared as alias",
        lambda: (
            lambda a: _bind(
                _spec(("buffer", "t", {}), ("buffer", "a", {"draft": Swap("t")})), a=a, t=T(4), runtime=a[:2]
            )
        )(T(4)),
    ),
    Case(
        "bind-source",
        BindError,
        "bind",
        "a CopyInPlace source attribute of another shape",
        lambda: _bind(_spec(("buffer", "a", {"draft": CopyInPlace("s")})), a=T(4), s=T(3)),
    ),
    Case(
        "bind-pad-dtype",
        BindError,
        "bind",
        "a padding value the buffer's dtype cannot hold (Pad.clamp(-3) on uint8)",
        lambda: _bind(_spec(("buffer", "a", {"axis": "seq", "pad": Pad.clamp(-3)})), a=T(4, dtype=torch.uint8)),
    ),
    Case("bind-starred", BindError, "bind", "a `[*]` path over something without a length", _starred_not_a_sequence),
    Case(
        "bind-host-pinned",
        BindError,
        "bind",
        "a host buffer in pageable memory on a CUDA state (GPU only)",
        lambda: _bind(_spec(("buffer", "a", {}), ("buffer", "h", {"host": True})), a=T(3, device="cuda"), h=T(3)),
        needs_cuda=True,
    ),
    # ---- use errors
    Case("use-role", SwitchError, "use", "switch() to an unknown role", lambda: _mini()[1].switch("target")),
    Case(
        "use-phase", SwitchError, "use", "switch() with an unknown phase", lambda: _mini()[1].switch("draft", "warmup")
    ),
    Case("use-nested", NestedSwitchError, "use", "a switch inside an active switch on the same state", _nested),
    Case(
        "use-reentrant",
        NestedSwitchError,
        "use",
        "a switch issued from inside a Recompute fn or CopyInPlace source",
        _reentrant,
    ),
    Case(
        "use-thread",
        ConcurrentUseError,
        "use",
        "a write from a second thread while a switch owns the state",
        _other_thread,
    ),
    Case(
        "use-partial-snapshot",
        CorruptedStateError,
        "use",
        "the fused snapshot raising partway (then any use)",
        _partial_snapshot,
    ),
    Case(
        "use-copy",
        SwitchError,
        "use",
        "copy.copy, deepcopy or pickle of a bound state",
        lambda: __import__("copy").copy(_mini()[1]),
    ),
    Case(
        "use-view-rebound",
        SwitchError,
        "use",
        "a buffer attribute rebound to a view at the same address (a transpose)",
        _view_rebound,
    ),
    Case("use-deleted", SwitchError, "use", "`del` of a declared attribute", _deleted),
    Case("use-poisoned", CorruptedStateError, "use", "any use after a failed restore", _poisoned),
    Case("use-restore-failed", CorruptedStateError, "use", "a restore step failing at switch exit", _restore_fails),
    Case(
        "use-write-unknown", SwitchError, "use", "write() to an undeclared name", lambda: _mini()[1].write("nope", T(1))
    ),
    Case(
        "use-write-object",
        SwitchError,
        "use",
        "write() to an object entry",
        lambda: _mini()[1].write("kv_cache_manager", T(1)),
    ),
    Case(
        "use-write-derived",
        SwitchError,
        "use",
        "write() to a derived buffer",
        lambda: (lambda m, s: s.write("req_idx_per_token", m.req_idx_per_token.clone()))(*_mini()),
    ),
    Case("use-write-not-tensor", SwitchError, "use", "write() of a list", lambda: _mini()[1].write("seq_lens", [1])),
    Case(
        "use-write-dtype",
        SwitchError,
        "use",
        "write() of another dtype",
        lambda: _mini()[1].write("seq_lens", T(5, dtype=torch.int64)),
    ),
    Case(
        "use-write-device",
        SwitchError,
        "use",
        "write() from another device",
        lambda: _mini()[1].write("seq_lens", T(5, dtype=I32, device="meta")),
    ),
    Case(
        "use-write-shape",
        SwitchError,
        "use",
        "write() longer than the buffer",
        lambda: _mini()[1].write("seq_lens", T(6, dtype=I32)),
    ),
    Case(
        "use-write-not-mutable",
        SwitchError,
        "use",
        "write() inside a switch to a buffer not declared mutable",
        lambda: _write_inside("spec_positions", lambda m: m.spec_positions.clone()),
    ),
    Case(
        "use-write-many",
        SwitchError,
        "use",
        "write_many() of something other than a non-empty dict",
        lambda: _mini()[1].write_many([("seq_lens", T(5, dtype=I32))]),
    ),
    Case("use-rebound", SwitchError, "use", "a buffer attribute reallocated after bind()", _rebound),
    Case("use-source", SwitchError, "use", "a callable CopyInPlace source returning the wrong shape", _bad_source),
    Case("use-source-changed", SwitchError, "use",
         "a CopyInPlace source changed in place since the last switch (`.data =`, `resize_`, `set_`)",
         _source_changed_in_place),
    Case("use-negative-length", SwitchError, "use",
         "write() of a negative length an `OpCall` token map reads, under `GRAPHCTL_CHECK_LENGTHS=1`",
         _negative_length),
    Case("use-write-many-one-storage", SwitchError, "use",
         "write_many() giving a swapped buffer and its twin (one tensor inside the switch) two values",
         _one_storage_two_values),
    Case(
        "use-pad-inside",
        SwitchError,
        "use",
        "pad() inside a switch",
        lambda: [st := _mini()[1], _enter(st), st.pad({"seq": 1})],
    ),
    Case(
        "use-pad-count", SwitchError, "use", "pad() with a count beyond the buffer", lambda: _mini()[1].pad({"seq": 99})
    ),
    Case("use-stale", StaleBufferError, "use", "an input written behind graphctl's back (debug check)", _stale),
    Case("use-write-refresh", SwitchError, "use", "write() inside the runner's refresh switch", _write_refresh),
    # ---- sampling settings (ops/sampling.py, models/sampled.py)
    Case(
        "sampling-temperature",
        SamplingError,
        "use",
        "a temperature that is not a finite number >= 0 (inf, nan, -1)",
        lambda: _probs(temperature=float("inf"), top_k=2),
    ),
    Case(
        "sampling-top-k",
        SamplingError,
        "use",
        "top_k that is not an int >= 0 (2.7)",
        lambda: _probs(top_k=2.7),
    ),
    Case(
        "sampling-top-p",
        SamplingError,
        "use",
        "top_p outside (0, 1]",
        lambda: _probs(top_p=0.0),
    ),
    Case(
        "sampling-seed",
        SamplingError,
        "use",
        "a seed that is not an int >= 0",
        lambda: _check_seed(-1),
    ),
    Case(
        "sampling-per-prompt",
        SamplingError,
        "use",
        "a per-prompt setting list of the wrong length (generate(3 prompts, temperature=[0.5, 0.7]))",
        lambda: _request_settings(3, temperature=[0.5, 0.7]),
    ),
    Case(
        "sampling-request",
        SamplingError,
        "use",
        "one bad value in a per-prompt list (temperature=[0.8, -1.0, 0.8]): the request named",
        lambda: _request_settings(3, temperature=[0.8, -1.0, 0.8]),
    ),
    Case(
        "sampling-forward",
        SamplingError,
        "use",
        "a sampled generate through a greedy step (generate(..., graphed_step(eng), temperature=0.8))",
        lambda: _check_forward_greedy_sampled(),
    ),
    # ---- graph errors (@graphed / GraphRunner)
    Case(
        "graph-buckets",
        DeclarationError,
        "declaration",
        "buckets that are not positive ints",
        lambda: graphed(lambda x: x, buckets=[0, 2]),
    ),
    Case(
        "graph-buckets-int",
        DeclarationError,
        "declaration",
        "buckets=8 (one int, not a list)",
        lambda: graphed(lambda x: x, buckets=8),
    ),
    Case(
        "graph-inputs-default-differ",
        DeclarationError,
        "declaration",
        "weights passed beside the batch without inputs= (every tensor argument is batched by default)",
        lambda: graphed(lambda x, w: x @ w, buckets=[2, 4], backend="emulated", progress=False)(
            torch.rand(3, 4, generator=G()), torch.rand(4, 4, generator=G())
        ),
    ),
    Case(
        "graph-input-list",
        DeclarationError,
        "declaration",
        "a Python list passed as a static input",
        lambda: graphed(lambda x, y: x, buckets=[2], inputs=["x", "y"], backend="emulated", progress=False)(
            torch.rand(2, 3, generator=G()), [1, 2]
        ),
    ),
    Case(
        "graph-fallback",
        DeclarationError,
        "declaration",
        "an unknown fallback policy",
        lambda: graphed(lambda x: x, fallback="silent"),
    ),
    Case(
        "graph-input-name",
        DeclarationError,
        "declaration",
        "inputs= naming no parameter of the forward",
        lambda: graphed(lambda x: x, inputs=["ids"]),
    ),
    Case(
        "graph-per-item",
        DeclarationError,
        "declaration",
        "StaticInput with per_item < 1",
        lambda: StaticInput("ids", per_item=0),
    ),
    Case(
        "graph-state-attr",
        DeclarationError,
        "declaration",
        "state='attr' on a plain function (not a method)",
        lambda: graphed(lambda x: x, state="meta", backend="emulated", progress=False)(torch.rand(2, 3, generator=G())),
    ),
    Case(
        "graph-no-input",
        DeclarationError,
        "declaration",
        "a forward with no tensor argument",
        lambda: graphed(lambda n: n, backend="emulated", progress=False)(3),
    ),
    Case(
        "graph-input-not-tensor",
        DeclarationError,
        "declaration",
        "inputs= naming a non-tensor argument",
        lambda: graphed(lambda x, n: x, inputs=["n"], backend="emulated", progress=False)(
            torch.rand(2, generator=G()), 3
        ),
    ),
    Case(
        "graph-input-rank",
        DeclarationError,
        "declaration",
        "a static input without its batch dimension",
        lambda: graphed(lambda x: x, inputs=[StaticInput("x", dim=1)], backend="emulated", progress=False)(
            torch.rand(2, generator=G())
        ),
    ),
    Case(
        "graph-bucket-too-large",
        DeclarationError,
        "declaration",
        "a bucket larger than the bound state's padded buffers (buckets up to 8, a state of 5 sequences)",
        lambda: (lambda m, st: graphed(lambda x, meta: x * 2, buckets=[2, 8], state=st, backend="emulated",
                                      progress=False)(torch.rand(2, 3, generator=G()), m))(*_mini()),
    ),
    Case("graph-backend", DeclarationError, "declaration", "an unknown backend name",
         lambda: graphed(lambda x: x, backend="tpu")),
    Case("graph-host-state-policy", DeclarationError, "declaration", "an unknown host_state policy",
         lambda: graphed(lambda x: x, host_state="fix")),
    Case("graph-warmup-iters", DeclarationError, "declaration", "warmup_iters below 0 or not an int",
         lambda: graphed(lambda x: x, warmup_iters=-1)),
    Case("graph-side-effect-cap", DeclarationError, "declaration", "max_side_effect_bytes not a byte count",
         lambda: graphed(lambda x: x, max_side_effect_bytes="1GB")),
    Case("graph-pad-axes", DeclarationError, "declaration", "pad_axes with a non-positive rows-per-item",
         lambda: graphed(lambda x: x, pad_axes={"seq": 0})),
    Case(
        "graph-backend-cuda",
        CaptureError,
        "capture",
        "backend='cuda' for inputs on the CPU",
        lambda: _runner(backend="cuda"),
    ),
    Case("capture-illegal", CaptureError, "capture", "`.item()` in the forward (emulated backend)", _illegal_item),
    Case("capture-raised", CaptureError, "capture", "the forward raising during capture (cause chained)", _body_raises),
    Case(
        "graph-side-effects-policy",
        DeclarationError,
        "declaration",
        "an unknown side_effects policy",
        lambda: graphed(lambda x: x, side_effects="undo"),
    ),
    Case(
        "graph-inductor-cudagraphs",
        DeclarationError,
        "declaration",
        "a forward compiled with mode='reduce-overhead' (Inductor's own CUDA graphs inside graphctl's capture)",
        lambda: graphed(torch.compile(lambda x: x * 2, mode="reduce-overhead"), buckets=[2], backend="emulated",
                        progress=False).capture_all(torch.ones(2, 3)),
    ),
    Case(
        "capture-side-effects",
        CaptureError,
        "capture",
        "side_effects='error' and a forward writing state graphctl does not own",
        lambda: graphed(
            _side_effect_forward(), buckets=[2], inputs=["x"], backend="emulated", progress=False, side_effects="error"
        ).capture_all(torch.ones(2, 3)),
    ),
    Case(
        "capture-side-effects-cap",
        CaptureError,
        "capture",
        "side effects larger than max_side_effect_bytes",
        lambda: graphed(
            _side_effect_forward(),
            buckets=[2],
            inputs=["x"],
            backend="emulated",
            progress=False,
            max_side_effect_bytes=8,
        ).capture_all(torch.ones(2, 3)),
    ),
    Case(
        "capture-twice",
        CaptureError,
        "capture",
        "capture_all() on a runner that holds graphs",
        lambda: (lambda r, m, x: r.capture_all(x, m))(*_runner()),
    ),
    Case(
        "measure-early",
        CaptureError,
        "capture",
        "measure() before any capture",
        lambda: _runner(capture=False)[0].measure(),
    ),
    Case(
        "verify-early",
        CaptureError,
        "capture",
        "verify() before any capture",
        lambda: _runner(capture=False)[0].verify(),
    ),
    Case(
        "replay-inside-switch",
        ReplayError,
        "replay",
        "a graphed call made inside an open switch of its own state",
        _graphed_call_inside_its_switch,
    ),
    Case(
        "replay-too-large",
        ReplayError,
        "replay",
        "a batch larger than the largest bucket",
        lambda: (lambda r, m, x: r(torch.ones(5, 4), m))(*_runner()),
    ),
    Case(
        "replay-batch",
        ReplayError,
        "replay",
        "a first input whose rows are not whole batch items",
        lambda: graphed(lambda x: x, inputs=[StaticInput("x", per_item=4)], backend="emulated", progress=False)(
            torch.rand(6, generator=G())
        ),
    ),
    Case(
        "replay-fit",
        ReplayError,
        "replay",
        "a live input of another dtype or shape",
        lambda: (lambda r, m, x: r(torch.ones(3, 5), m))(*_runner()),
    ),
    Case(
        "replay-frozen",
        ReplayError,
        "replay",
        "another object for a frozen (non-input) argument",
        lambda: (lambda r, m, x: r(x, _mini()[0]))(*_runner()),
    ),
    Case(
        "replay-frozen-changed",
        ReplayError,
        "replay",
        "a dict passed as a frozen argument, changed in place",
        _frozen_changed,
    ),
    Case("replay-moved", ReplayError, "replay", "a declared buffer rebound after capture (the per-replay check of the "
         "state's entries)", _moved),
    Case("replay-object-replaced", ReplayError, "replay", "a declared object entry (a generator) replaced after "
         "capture", _object_replaced),
    Case("replay-weight-rebound", ReplayError, "replay", "a weight rebound after capture (lin.weight = Parameter(...) "
         "or .data = ...)", _weight_rebound),
    Case("replay-module-replaced", ReplayError, "replay", "a model held by a plain object replaced after capture",
         _module_replaced),
    Case("capture-state-not-given", CaptureError, "capture", "a forward switching a bound state the runner was not "
         "given (state= left out)", _state_not_given),
    Case("replay-path-rebound", ReplayError, "replay", "a tensor reached through self rebound after capture",
         _path_rebound),
    Case("replay-stale-output", ReplayError, "replay", "an output read after the next call (GRAPHCTL_CHECK_OUTPUTS=1)",
         _stale_output),
    Case("capture-host-state", CaptureError, "capture", "host_state='error' and a warmup flipping a host flag",
         lambda: graphed(_host_flag_forward(), buckets=[2], inputs=["x"], backend="emulated", progress=False,
                         host_state="error").capture_all(torch.ones(2, 3))),
    Case("repoint-layout", RepointError, "repoint", "runner.repoint(state) with a state of other buffer sizes",
         _repoint_other_layout),
    Case("repoint-no-state", RepointError, "repoint", "runner.repoint(state) on a runner built without state=",
         _repoint_without_state),
    Case("check-paths-option", DeclarationError, "declaration", "check_paths= given a non-bool",
         lambda: graphed(lambda x: x, check_paths="yes")),
    Case("verify-writes-option", DeclarationError, "declaration", "verify(writes=...) given an unknown mode",
         _verify_bad_writes),
    Case("loop-mode", DeclarationError, "capture", "an unknown draft-loop mode", _unknown_loop_mode),
    Case("loop-needs-cuda", CaptureError, "capture", "mode='device_loop' on the emulated backend", _loop_on_cpu),
    Case("loop-recorded", CaptureError, "capture", "a device loop run under the emulated recorder", _loop_recorded),
    Case(
        "agreed-switch",
        SwitchError,
        "replay",
        "a refresh failing on one rank of a group (here a group of one)",
        _agreed_switch_fails,
    ),
    Case(
        "dot-emulated",
        ReplayError,
        "inspect",
        "DOT export of an emulated graph",
        lambda: (lambda r, m, x: r.dot(2, "/tmp/graphctl-never.dot"))(*_runner()),
    ),
    Case("variant-value", DeclarationError, "declaration", "variants= listing a value that is not a host value",
         lambda: graphed(lambda x, k: x, variants={"k": ([1, 2],)})),
    Case("variant-name", DeclarationError, "declaration", "variants= naming no argument of the forward",
         lambda: graphed(lambda x, k: x, variants={"j": (1, 2)})),
    Case("per-item-of", DeclarationError, "declaration", "StaticInput(per_item_of=...) on a runner without variants",
         lambda: graphed(lambda x: x, inputs=[StaticInput("x", per_item_of=lambda k: k + 1)])),
    Case("variant-unlisted", ReplayError, "replay", "a call with a variant value no graph was captured for",
         lambda: _variant_runner()(torch.ones(2, 3), 7)),
    Case("region-switch-open", CaptureError, "capture", "a state.switch open across an @graphctl.eager call",
         _switch_across_region),
    Case("region-output-shape", ReplayError, "replay", "an eager region returning another shape than at capture",
         lambda: _region_result("shape")),
    Case("region-host-value", ReplayError, "replay", "an eager region returning another host value than at capture",
         lambda: _region_result("flag")),
    Case("region-alias-argument", ReplayError, "replay", "an eager region that returned its argument at capture "
         "returning a new tensor at a replay", lambda: _region_alias("argument")),
    Case("region-alias-result", ReplayError, "replay", "an eager region that returned one tensor twice at capture "
         "returning two at a replay", lambda: _region_alias("result")),
    Case("region-publishes", CaptureError, "capture", "an eager region storing a tensor it made where the next "
         "piece reads it, instead of returning it", _region_publishes),
    Case("region-uses-state-in-switch", CaptureError, "capture", "an in_switch eager region calling state.write "
         "(or switch, pad) inside the open switch", _region_uses_state_in_switch),
    Case("region-fullgraph", CaptureError, "capture", "an eager region inside a torch.compile(fullgraph=True) "
         "forward", _region_fullgraph),
    Case("sampling-type", DeclarationError, "declaration", "graphed_step(eng, sampling=0.8): not True or a Sampling",
         _sampling_not_settings),
]


def message(case: Case) -> str:
    if case.needs_cuda and not torch.cuda.is_available():
        return PINNED_MESSAGE
    try:
        case.run()
    except case.exc as e:
        return str(e)
    raise AssertionError(f"{case.id}: {case.exc.__name__} not raised")


def table() -> str:
    lines = ["# graphctl errors", "",
             "Every bad input graphctl refuses, with the exception and the message it produces (generated by "
             "`PYTHONPATH=tests python -m support.errors`; `tests/unit/test_errors.py` raises each row and fails "
             "if this table is out of date). Declaration errors come from `StateSpec`/`register`, bind errors "
             "from `bind`, use errors from `switch`, `write`, `pad` and `check`; graph declaration errors from "
             "`@graphed`/`StaticInput`, capture errors from `capture_all` (or the first call), replay errors "
             "from a call of a "
             "graphed function. Every error has the fields `buffer`, `expected`, `found` and `fix`.", "",
             "| id | when | exception | trigger | message |", "|---|---|---|---|---|"]
    for c in CASES:
        msg = re.sub(r"0x[0-9a-f]+", "0x…", message(c)).replace("|", "\\|").replace("\n", " ")  # addresses vary
        lines.append(f"| `{c.id}` | {c.when} | `{c.exc.__name__}` | {c.trigger} | {msg} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
