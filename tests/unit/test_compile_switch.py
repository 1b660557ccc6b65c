"""A forward that switches the state and writes through it, compiled whole (issue 19)."""
from __future__ import annotations

import pytest
import torch

import graphctl
from support.mini import MiniMetadata, make_registry


def _setup(seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    m = MiniMetadata(g, device=device)
    return m, graphctl.bind(m, registry=make_registry())


def _forward(m, st):
    def f(x):
        with st.switch("draft"):
            st.write("kv_lens", m.kv_lens[:3] + 1)  # mutable: padded, slot_mapping recomputed from it
            y = x * m.slot_mapping[:3].float() + m.block_offsets[:3, 0].float() + m.spec_positions[:3].float()
        return y + m.slot_mapping[:3].float()  # restored: the target's maps again

    return f


def _state(m, st) -> dict[str, torch.Tensor]:
    return {n: st.tensor(n).clone() for n in st.restorable_names()}


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_switching_forward_compiles_fullgraph_and_equals_eager_with_the_state_restored(compiler, device, gen):
    # Issue 19: torch.compile(fullgraph=True) of a function entering state.switch("draft") failed ("Unsupported":
    # the switch's lock, signal hold and frame record); now the plan is traced as plain tensor code.
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    m, st = _setup(seed, device)
    ref_m, ref_st = _setup(seed, device)
    x = torch.randn(3, generator=gen).to(device)
    want = _forward(ref_m, ref_st)(x)
    before, attrs = _state(m, st), {n: getattr(m, n) for n in ("block_offsets", "kv_cache_manager")}
    compiled = torch.compile(_forward(m, st), fullgraph=True, backend=compiler)
    for _ in range(2):  # the second call runs the compiled code alone
        got = compiled(x)
        torch.testing.assert_close(got, want)
        after = _state(m, st)
        assert all(torch.equal(before[n], after[n]) for n in before), [n for n in before
                                                                       if not torch.equal(before[n], after[n])]
        assert all(getattr(m, n) is v for n, v in attrs.items())
    with st.switch("draft"):  # the eager switch still works on the same state afterwards
        assert m.block_offsets is st.tensor("draft_block_offsets")


def test_a_compiled_write_to_a_buffer_not_mutable_is_refused_at_trace_time():
    # Issue 19: the traced write keeps the eager write's refusals (here: not mutable inside a switch); Dynamo
    # cannot carry the typed error out of a fullgraph trace, so the compile stops as Unsupported naming the line.
    m, st = _setup(1)

    def f(x):
        with st.switch("draft"):
            st.write("seq_lens", m.seq_lens + 1)  # mutable: fine
            st.write("spec_positions", m.spec_positions + 1)  # not mutable: refused, as eagerly
        return x

    with pytest.raises(torch._dynamo.exc.Unsupported, match="spec_positions"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.randn(2))
    assert st._traced is None  # the trace raised: Dynamo applied none of its side effects
    with st.switch("draft"):  # and the eager switch works
        assert m.block_offsets is st.tensor("draft_block_offsets")


def test_the_reference_engine_step_compiles_whole(device, gen):
    # Issue 19: the engine's decode step (target, acceptance, the draft switch, layout writes, k draft steps) as one
    # fullgraph compile equals the eager step, and leaves the state as the eager step leaves it.
    from graphctl.models.mtp import EngineConfig, MTPEngine

    seed = int(torch.randint(0, 1000, (1,), generator=gen))
    engines = [MTPEngine(EngineConfig(max_seqs=8, seed=seed), device=device) for _ in range(2)]
    k1, n = engines[0].k + 1, 5
    kv = torch.randint(k1 + 1, 60, (n,), generator=gen, dtype=torch.int32)
    ids = torch.randint(0, engines[0].cfg.vocab, (n * k1,), generator=gen).to(device)
    for eng in engines:
        eng.meta.prepare(eng.state, torch.full((n,), k1, dtype=torch.int32), kv)
    ref, eng = engines
    want = ref.step(ids, ref.meta)
    got = torch.compile(eng.step, fullgraph=True, backend="aot_eager")(ids, eng.meta)
    assert torch.equal(got.accepted, want.accepted) and torch.equal(got.drafts, want.drafts)
    assert torch.equal(got.bonus, want.bonus)
    for name in eng.state.restorable_names():
        assert torch.equal(eng.state.tensor(name), ref.state.tensor(name)), name
    for mine, theirs in ((eng.meta.kv_cache_manager, ref.meta.kv_cache_manager),
                         (eng.meta.draft_kv_cache_manager, ref.meta.draft_kv_cache_manager)):
        assert all(torch.equal(a, b) for a, b in zip(mine.k + mine.v, theirs.k + theirs.v))
    assert eng.meta.kv_cache_manager is eng.state.binding.objects["kv_cache_manager"]
