"""One runner face (issue 52), as a property: a variant runner over ``k in (2, 3)`` and two plain runners (one per
``k``) driven through the same operations (calls at random sizes, verify, audit, coverage, measure, reset and capture
again) answer alike: each variant's report rows, findings, verify results, audit findings and coverage equal the plain
runner's of the same ``k``."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphctl

H = 3
STEPS = torch.zeros(1)  # a module-level tensor the forward advances: a side effect both must find and undo
BUCKETS = [2, 4]


def _body(x: torch.Tensor, k: int) -> torch.Tensor:
    # a draw from the default generator at k == 3 only: a finding one variant makes and the other does not
    return torch.tanh(x * k) + (torch.rand_like(x) * 0 if k == 3 else 0)


def fwd(x: torch.Tensor, k: int) -> torch.Tensor:
    STEPS.add_(1)  # named here: a global the runner reaches (the plain forwards name it too)
    return _body(x, k)


def _plain(k: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        STEPS.add_(1)
        return _body(x, k)
    return graphctl.graphed(forward, buckets=BUCKETS, backend="emulated", progress=False, inputs=["x"])


def _rows(report, variant: str) -> list[tuple]:
    return [(b.bucket, b.nodes, b.replays, b.eager_runs, b.pieces, b.replay_us is None)
            for b in report.buckets if b.variant == variant]


def _records(report) -> set[tuple]:
    """Each finding, without the line that made it (the plain forwards' lines are their own)."""
    return {(r.kind, *sorted((k, repr(v)) for k, v in r.to_dict().items() if k != "where")) for r in report.records}


OPS = st.lists(st.one_of(st.tuples(st.just("call"), st.integers(1, 4), st.sampled_from((2, 3))),
                         st.sampled_from([("verify",), ("audit",), ("coverage",), ("measure",), ("recapture",)])),
               max_size=6)


@settings(deadline=None)
@given(ops=OPS, seed=st.integers(0, 2**31 - 1))
def test_a_variant_runner_answers_as_its_plain_runners_do(ops, seed):
    gen = torch.Generator().manual_seed(seed)
    example = torch.randn(4, H, generator=gen)
    vr = graphctl.graphed(fwd, buckets=BUCKETS, backend="emulated", progress=False, inputs=["x"],
                          variants={"k": (2, 3)})
    plain = {2: _plain(2), 3: _plain(3)}
    start = STEPS.item()
    vr.capture_all(example, 2)
    for r in plain.values():
        r.capture_all(example)
    calls = 0
    for op in ops:
        if op[0] == "call":
            _, n, k = op
            x = torch.randn(n, H, generator=gen)
            torch.testing.assert_close(vr(x, k).clone(), plain[k](x).clone())
            calls += 1
        elif op[0] == "verify":
            got = {(r.variant, r.bucket, r.n <= r.bucket, r.ok)
                   for r in vr.verify(gen=torch.Generator().manual_seed(1))}
            want = {(f"k={k}", r.bucket, r.n <= r.bucket, r.ok) for k, p in plain.items()
                    for r in p.verify(gen=torch.Generator().manual_seed(1))}
            assert got == want
        elif op[0] == "audit":
            got = {key: sorted(str(f) for f in a.findings) for key, a in vr.audit().items()}
            for k, p in plain.items():
                for b, a in p.audit().items():
                    assert got[(f"k={k}", b)] == sorted(str(f) for f in a.findings), (k, b)
        elif op[0] == "coverage":
            got = vr.coverage(range(1, 5))
            for k, p in plain.items():
                assert {n: s for (v, n), s in got.items() if v == f"k={k}"} == dict(p.coverage(range(1, 5)))
        elif op[0] == "measure":
            vr.measure(iters=1)
            for p in plain.values():
                p.measure(iters=1)
        else:
            vr.reset()
            vr.capture_all(example, 3)
            for p in plain.values():
                p.reset()
                p.capture_all(example)
        rep = vr.report()
        for k, p in plain.items():
            assert _rows(rep, f"k={k}") == _rows(p.report(), ""), (op, k)
        assert _records(rep) == _records(plain[2].report()) | _records(plain[3].report()), op
        # every run graphctl made (warmups, captures, verify, coverage, measure) undone alike: the calls alone count
        assert rep.fallbacks == {} and STEPS.item() == start + 2 * calls, (op, STEPS.item(), start, calls)
    assert {f for f in _records(vr.report()) if f[0] == "side_effects"} == \
        {f for f in _records(plain[2].report()) if f[0] == "side_effects"} != set()
