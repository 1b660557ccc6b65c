"""A tour of the declarations and the switch (the main job is `graphctl capture`): declare a
DSA-class buffer set, bind it, and run one-model MTP decode steps (target forward over k+1 tokens per request, then k
draft steps at 1 token per request) with the target->draft switch done by graphctl.

Prints the declared buffers, per phase what one switch moves and costs, then graphs the
decode step with ``@graphed`` (CUDA graphs on a GPU, the emulated recorder on a CPU), checks
replay against eager at several batch sizes and prints the capture report; finally checks
that every buffer is bitwise restored. Runs on CUDA when available, else the CPU.

    python examples/draft_switch.py [--seqs 128] [--blocks 73] [--draft-len 3] [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import graphctl
from graphctl import CopyInPlace, Pad, Recompute, Stable, StateSpec, Swap, ops


class DraftKVManager:
    def __init__(self, seqs: int, blocks: int, device) -> None:
        self.pool_indices = torch.randint(0, 4096, (seqs, blocks), dtype=torch.int32, device=device)


def req_map(out, seq_lens):
    ops.token_to_request_(out, seq_lens, out.numel(), 0)


def slot_map(out, offsets, kv_lens):
    out.copy_(offsets[:, 0]).mul_(64).add_(kv_lens)


SPEC = StateSpec("dsa-example")
SPEC.object("kv_cache_manager", draft=Swap(twin="draft_kv_cache_manager"))
SPEC.object("draft_kv_cache_manager")
SPEC.buffer("seq_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True)
SPEC.buffer("kv_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True)
SPEC.buffer("indexer_k_cache_block_offsets", shape=("S", "B"), dtype=torch.int32, axis="seq", pad=Pad.clamp(0),
            readers={"target"}, draft=Swap(twin="draft_indexer_k_cache_block_offsets"))
SPEC.buffer("draft_indexer_k_cache_block_offsets", shape=("S", "B"), dtype=torch.int32, readers={"draft"},
            refresh=CopyInPlace(source=lambda m: m.draft_kv_cache_manager.pool_indices))
SPEC.buffer("block_table", shape=("S", "B"), dtype=torch.int32, readers={"target"},
            draft=Swap(twin="draft_block_table"))
SPEC.buffer("draft_block_table", shape=("S", "B"), dtype=torch.int32, readers={"draft"})
SPEC.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32, derive=Recompute(["seq_lens"], req_map))
SPEC.buffer("slot_mapping", shape=("S",), dtype=torch.int64,
            derive=Recompute(["indexer_k_cache_block_offsets", "kv_lens"], slot_map))
SPEC.buffer("topk_indices", shape=("T", "K"), dtype=torch.int32, draft=Stable())


class DSAExampleMetadata:
    def __init__(self, S: int, B: int, k: int, device) -> None:
        T, r = S * (k + 1), lambda *s: torch.randint(0, 4096, s, dtype=torch.int32, device=device)  # noqa: E731
        self.kv_cache_manager = DraftKVManager(S, B, device)
        self.draft_kv_cache_manager = DraftKVManager(S, B, device)
        self.seq_lens = torch.full((S,), k + 1, dtype=torch.int32, device=device)
        self.kv_lens = torch.randint(100, 4000, (S,), dtype=torch.int32, device=device)
        self.indexer_k_cache_block_offsets, self.draft_indexer_k_cache_block_offsets = r(S, B), r(S, B)
        self.block_table, self.draft_block_table = r(S, B), r(S, B)
        self.req_idx_per_token = torch.empty(T, dtype=torch.int32, device=device)
        self.slot_mapping = torch.empty(S, dtype=torch.int64, device=device)
        self.topk_indices = r(T, 64)
        req_map(self.req_idx_per_token, self.seq_lens)
        slot_map(self.slot_mapping, self.indexer_k_cache_block_offsets, self.kv_lens)


graphctl.register(DSAExampleMetadata, SPEC)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_decode_step(state, meta, k: int):
    """Target forward over k+1 tokens per request, then k draft steps at 1 token per request.
    Stands in for a model: every value it returns is read through the declared buffers."""

    def decode_step(positions, meta):
        n = positions.shape[0] // (k + 1)
        req = meta.req_idx_per_token[: n * (k + 1)].view(n, k + 1)[:, 0].long()
        target = positions.view(n, k + 1).sum(1) + meta.indexer_k_cache_block_offsets[:n, 0].long() + req
        drafts = []
        with state.switch("draft"):  # "capture" while graphed, "eager" otherwise
            state.write("seq_lens", torch.ones(n, dtype=torch.int32, device=positions.device))  # (k+1) -> 1
            for _ in range(k):
                state.write("kv_lens", meta.kv_lens[:n] + 1)  # slot mapping follows, from the draft offsets
                drafts.append(meta.slot_mapping[:n] + meta.block_table[:n, 0].long() + target)
        return target, torch.stack(drafts, 1)

    return decode_step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=73)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    con = Console()
    meta = DSAExampleMetadata(args.seqs, args.blocks, args.draft_len, device)
    state = graphctl.bind(meta)
    st = ops.extension_status()
    con.print(f"[bold]graphctl {graphctl.__version__}[/] on {device} "
              f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'no GPU'}), torch {torch.__version__}, "
              f"graphctl._C {'loaded' if st.loaded else 'not loaded: ' + str(st.error)}; dims {state.dims}")

    decl = Table(title=f"declared buffers of {type(meta).__name__}")
    for col in ("entry", "shape", "readers", "draft action", "derived from"):
        decl.add_column(col)
    for name, d in SPEC.entries.items():
        if d.kind == "object":
            decl.add_row(name, "object", "-", type(d.draft).__name__ if d.draft else "-", "-")
            continue
        decl.add_row(name, str(tuple(state.tensor(name).shape)), ",".join(sorted(d.readers)),
                     type(d.draft).__name__ if d.draft else ("CopyInPlace (refresh)" if d.refresh else "-"),
                     ",".join(d.derive.inputs) if d.derive else "-")
    con.print(decl)

    before = {n: state.tensor(n).clone() for n in state.plan.buffers}
    # On CUDA the capture phase is only legal under a stream capture (graphctl checks); the graphs
    # layer times it there. Host-timed here: eager and replay (and capture on a CPU).
    times = {p: [] for p in (("eager", "replay") if device.type == "cuda" else ("eager", "capture", "replay"))}
    for _ in range(args.steps):
        for phase in times:
            sync(device)
            t0 = time.perf_counter()
            with state.switch("draft", phase):
                pass
            sync(device)
            times[phase].append((time.perf_counter() - t0) * 1e6)
    # Switches must leave every buffer bitwise as found. (The graphed calls below pad the tails
    # [n:S] of the batch-axis buffers by policy, which is their job, so check before them.)
    changed = [n for n in state.plan.buffers if not torch.equal(state.tensor(n), before[n])]
    k, S = args.draft_len, args.seqs
    step = make_decode_step(state, meta, k)
    buckets = sorted({b for b in (1, 8, 32, S) if b <= S})
    graphed = graphctl.graphed(step, buckets=buckets, state=state,
                               inputs=[graphctl.StaticInput("positions", per_item=k + 1)])
    g = torch.Generator().manual_seed(0)
    ok = True
    for n in sorted({1, 5, max(1, S // 3), S}):
        positions = torch.randint(0, 4096, (n * (k + 1),), generator=g).to(device)
        state.write("seq_lens", torch.full((n,), k + 1, dtype=torch.int32, device=device))
        want = [t.clone() for t in step(positions, meta)]
        got = [t.clone() for t in graphed(positions, meta)]
        ok &= all(torch.equal(a, b) for a, b in zip(want, got))
    state.write("seq_lens", torch.full((S,), k + 1, dtype=torch.int32, device=device))
    graphed.measure(iters=args.steps)
    con.print(graphed.report().table())
    if graphed.report().backend == "emulated":
        con.print("(emulated graphs re-execute the recorded ops on the CPU: replay vs eager speed means "
                  "nothing here; on a GPU this table shows CUDA graphs)")
    con.print(("[green]" if ok else "[red]") + f"graph replay {'equals' if ok else 'DIFFERS FROM'} eager "
              f"at batch sizes {sorted({1, 5, max(1, S // 3), S})}")

    res = Table(title=f"one switch (apply + restore), median of {args.steps}")
    for col in ("phase", "buffers snapshotted", "bytes", "median us"):
        res.add_column(col, justify="right")
    for phase, ts in times.items():
        res.add_row(phase, str(len(state.snapshot_names(phase))), f"{state.snapshot_bytes(phase):,}",
                    f"{statistics.median(ts):.1f}")
    con.print(res)
    if changed or not ok:
        con.print(f"[red]NOT restored: {changed}")
        return 1
    con.print(f"[green]all {len(before)} declared buffers bitwise restored after {args.steps * 4} switches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
