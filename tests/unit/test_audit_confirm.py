"""audit(confirm=True)'s verdicts (issue 35): a possible dangling finding is confirmed when the replay's results or
the freed block change with the poison, dropped when neither does, and left possible when the graph is not
deterministic or the block was reallocated. The graph here keeps its "device memory" in a CPU tensor; the CUDA
backend's poison and peek run on the H200 (tests/cuda/test_audit_cuda.py)."""
from __future__ import annotations

import torch

from graphctl.graphs.analysis.audit import Audit, Finding
from graphctl.graphs.analysis.confirm import confirm
from graphctl.graphs.analysis.nodes import Region

BLOCK = (4096, 4096 + 64)


class Memory:
    """A graph double: ``mem`` is device memory, [BLOCK) a freed allocator block; ``behaviour`` is what the
    replay does with it."""

    can_poison = True

    def __init__(self, behaviour: str, gen: torch.Generator) -> None:
        self.mem = torch.randint(0, 256, (BLOCK[1] + 64,), generator=gen, dtype=torch.uint8)
        self.out = torch.empty(8)
        self.behaviour, self.gen, self.reallocated = behaviour, gen, False
        self.state = torch.randn(8, generator=gen)
        self.calls = 0

    def memory_regions(self):
        kind = "live" if self.reallocated else "freed"
        return [Region("freed block of 64 B", kind, *BLOCK)]

    def poison(self, start, nbytes, byte):
        self.mem[start:start + nbytes] = byte

    def peek(self, start, nbytes):
        return bytes(self.mem[start:start + nbytes].tolist())

    def replay(self):
        self.calls += 1
        block = self.mem[BLOCK[0]:BLOCK[1]].float()
        base = self.state.clone()
        self.state.add_(1)  # the graph writes caller state: confirm must put it back between replays
        if self.behaviour == "reads":
            self.out.copy_(base + block[:8])
        elif self.behaviour == "writes":
            self.mem[BLOCK[0]] = 7
            self.out.copy_(base)
        elif self.behaviour == "noisy":
            self.out.copy_(base + torch.rand(8, generator=self.gen))
        else:
            self.out.copy_(base * 2)


def _audit() -> Audit:
    f = Finding("possible", "dangling", "freed block of 64 B", "target", "at::native::elementwise_kernel", "m", 3,
                "param 1+40 of 336 B", BLOCK)
    exact = Finding("warning", "unregistered", "live block of 8 B", "target", "k", "m", 4, "param 0+0")
    return Audit(8, (f, exact), {}, {}, {})


def _run(g: Memory) -> Audit:
    saved = g.state.clone()
    a = confirm(_audit(), g, replay=g.replay, observed=lambda: [g.out, g.state],
                restore=lambda: g.state.copy_(saved), sync=lambda: None)
    assert torch.equal(g.state, saved)  # the caller's state as it was
    return a


def test_a_replay_reading_the_block_is_confirmed(gen):
    a = _run(Memory("reads", gen))
    assert [(f.severity, f.kind) for f in a.findings] == [("error", "dangling"), ("warning", "unregistered")], str(a)
    assert a.findings[0].evidence.startswith("confirmed: the replay's outputs") and not a.dropped, str(a)


def test_a_replay_writing_the_block_is_confirmed(gen):
    a = _run(Memory("writes", gen))
    assert a.errors and a.errors[0].evidence.startswith("confirmed: the replay writes into the freed block"), str(a)


def test_a_stale_word_never_dereferenced_is_dropped(gen):
    g = Memory("ignores", gen)
    a = _run(g)
    assert not a.errors and not a.possible and [f.kind for f in a.findings] == ["unregistered"], str(a)
    assert len(a.dropped) == 1 and a.dropped[0].evidence.startswith("dropped: outputs and writes bitwise equal"), str(a)
    assert g.calls == 3 and "dropped possible dangling" in str(a)


def test_a_nondeterministic_graph_stays_possible(gen):
    a = _run(Memory("noisy", gen))
    assert [f.severity for f in a.findings][0] == "possible" and "nondeterministic" in a.findings[0].evidence, str(a)


def test_a_block_reallocated_before_poisoning_is_left_alone(gen):
    g = Memory("reads", gen)
    g.reallocated = True
    before = g.mem.clone()
    a = _run(g)
    assert a.possible and "reallocated" in a.possible[0].evidence and g.calls == 0, str(a)
    assert torch.equal(g.mem, before)  # never written: someone's data may live there now
