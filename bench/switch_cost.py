"""Cost of one target->draft switch (apply + restore) for a DSA-class buffer set, side by side:

  (a) hand-written hooks, TensorRT-LLM style: clone each buffer, copy draft values in, clamp,
      rebuild req_idx_per_token with torch ops, copy every clone back;
  (b) torch._foreach_copy_ into a preallocated snapshot (one call per dtype group and direction);
  (c) the graphctl switch, eager (one native SwitchTable call per direction), next to the same
      switch through its Python steps (GRAPHCTL_NATIVE_SWITCH=0) and the floor: the op calls any
      switch must issue (snapshot, token map, restore) with no bookkeeping at all;
  (d) the graphctl switch recorded inside a CUDA graph (replay time), next to (b) recorded in a graph.

Plus large-buffer bandwidth: swap_through_ against a plain copy_ of the bytes it must move.
Sizes from shared/reference/trtllm.md §4. Run on the GPU machine:

    python bench/switch_cost.py [--reps 200] [--json out.json]

Eager variants are timed interleaved, in 5 rounds, with one synchronize a call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import graphctl
from graphctl import CopyInPlace, OpCall, Pad, Recompute, Registry, StateSpec, ops

CONFIGS = {"S128-B73-T8448-D3": (128, 73, 8448, 3), "S256-B2048-T16384-D3": (256, 2048, 16384, 3)}

# name -> (shape in terms of S, B, T, D; dtype; host mirror)
BUFFERS = {
    "indexer_k_cache_block_offsets": (lambda S, B, T, D: (S, B), torch.int32, False),
    "host_indexer_k_cache_block_offsets": (lambda S, B, T, D: (S, B), torch.int32, True),
    "slot_mapping_fp8": (lambda S, B, T, D: (T,), torch.int64, False),
    "slot_mapping_scale": (lambda S, B, T, D: (T,), torch.int64, False),
    "block_table": (lambda S, B, T, D: (S, B), torch.int32, False),
    "block_table_expanded": (lambda S, B, T, D: (S * (1 + D), B), torch.int32, False),
    "host_block_table_expanded": (lambda S, B, T, D: (S * (1 + D), B), torch.int32, True),
    "seq_lens": (lambda S, B, T, D: (S,), torch.int32, False),
    "host_req_idx_per_token": (lambda S, B, T, D: (T,), torch.int32, True),
}


def token_map(out, seq_lens):
    ops.token_to_request_(out, seq_lens, out.numel(), 0)


class DSABench:
    def __init__(self, S, B, T, D, dev):
        g = torch.Generator().manual_seed(0)
        for name, (shape, dtype, host) in BUFFERS.items():
            sh = shape(S, B, T, D)
            t = torch.randint(0, 1000, sh, generator=g, dtype=dtype)
            src = torch.randint(-5, 1000, sh, generator=g, dtype=dtype).clamp_(min=0)  # draft values, valid
            pin = host and dev.type == "cuda"
            setattr(self, name, t.pin_memory() if pin else t.to(dev))
            setattr(self, "draft_src_" + name, src.pin_memory() if pin else src.to(dev))
        self.seq_lens.fill_(1 + D)
        self.draft_src_seq_lens.fill_(1)
        self.req_idx_per_token = torch.empty(T, dtype=torch.int32, device=dev)
        token_map(self.req_idx_per_token, self.seq_lens)


def make_spec():
    spec = StateSpec("bench-dsa")
    for name, (_, dtype, host) in BUFFERS.items():
        axis = {"axis": "seq", "pad": Pad.zero()} if name == "seq_lens" else {}
        spec.buffer(name, dtype=dtype, host=host, draft=CopyInPlace(source="draft_src_" + name), **axis)
    # the token map as one op call (OpCall): the native switch launches it from C++, no Python
    spec.buffer("req_idx_per_token", dtype=torch.int32,
                derive=Recompute(["seq_lens"], OpCall("token_to_request_", ("out", "in0", "out.numel", 0))))
    return spec


def hand_written(m, names):
    """TensorRT-LLM-style prepare/restore: clones, copies, clamps, host-side map rebuild, copy back."""
    saved = {n: getattr(m, n).clone() for n in names + ["req_idx_per_token"]}
    for n in names:
        buf = getattr(m, n)
        buf.copy_(getattr(m, "draft_src_" + n), non_blocking=True)
        buf.clamp_(min=0)
    cum = torch.cumsum(m.seq_lens.to(torch.int64), 0)
    t = torch.arange(m.req_idx_per_token.numel(), device=m.seq_lens.device)
    m.req_idx_per_token.copy_(torch.searchsorted(cum, t, right=True))
    for n, v in saved.items():
        getattr(m, n).copy_(v, non_blocking=True)


class ForeachBaseline:
    """Preallocated snapshot with torch._foreach_copy_, grouped by (device, dtype)."""

    def __init__(self, m, names):
        self.m = m
        groups = {}
        for n in names + ["req_idx_per_token"]:
            t = getattr(m, n)
            groups.setdefault((t.device, t.dtype), []).append(n)
        self.groups = []
        for _, ns in groups.items():
            statics = [getattr(m, n) for n in ns]
            snaps = [torch.empty_like(t) for t in statics]
            srcs = [getattr(m, "draft_src_" + n) if n != "req_idx_per_token" else getattr(m, n) for n in ns]
            self.groups.append((statics, snaps, srcs))

    def __call__(self):
        for statics, snaps, srcs in self.groups:
            torch._foreach_copy_(snaps, statics)
            torch._foreach_copy_(statics, srcs)
        token_map(self.m.req_idx_per_token, self.m.seq_lens)
        for statics, snaps, _ in self.groups:
            torch._foreach_copy_(statics, snaps)


def time_interleaved(fns, reps, rounds=5, dev=torch.device("cuda")):
    """Median µs per variant, the variants run in turn in ``rounds`` blocks of reps // rounds calls:
    a drift of the host's speed during the run hits every variant alike."""
    samples = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    sync(dev)
    for _ in range(rounds):
        for k, fn in fns.items():
            for _ in range(max(1, reps // rounds)):
                t0 = time.perf_counter()
                fn()
                sync(dev)
                samples[k].append((time.perf_counter() - t0) * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def capture(fn):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=s):
        fn()
    torch.cuda.synchronize()
    return g


def time_graph(g, reps, warmup=20):
    for _ in range(warmup):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def count_launches(fn):
    """(kernels, memcpys, allocations) for one call, from the profiler and allocator stats."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    a0 = torch.cuda.memory_stats()["allocation.all.allocated"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    a1 = torch.cuda.memory_stats()["allocation.all.allocated"]
    kernels = memcpys = 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in ev.name.lower() or "memset" in ev.name.lower():
            memcpys += 1
        else:
            kernels += 1
    return kernels, memcpys, a1 - a0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_config(label, S, B, T, D, reps, dev=torch.device("cuda")):
    m = DSABench(S, B, T, D, dev)
    reg = Registry()
    reg.register(DSABench, make_spec())
    st = graphctl.bind(m, registry=reg)
    names = list(BUFFERS)
    before = {n: getattr(m, n).clone() for n in names + ["req_idx_per_token"]}
    nbytes = st.snapshot_bytes("eager")

    def gc_switch():
        with st.switch("draft", "eager"):
            pass

    def gc_capture_switch():  # eager while capture() warms up, then recorded
        with st.switch("draft", "capture" if torch.cuda.is_current_stream_capturing() else "eager"):
            pass

    fe = ForeachBaseline(m, names)
    # device-only variants for graphs (host copies are not recorded by a graph)
    dev_names = [n for n in names if not BUFFERS[n][2]]
    fe_dev = ForeachBaseline(m, dev_names)

    def gc_python_steps():  # the same switch through the Python steps (the native table's reference)
        with graphctl.knobs.scope(native_switch=False):
            gc_switch()

    groups = st._groups["eager"]
    srcs = [[getattr(m, "draft_src_" + n) if n in BUFFERS else t for n, t in zip(g.names, g.statics)]
            for g in groups]

    def floor():  # the device and host work every switch must issue, as bare op calls, no bookkeeping
        for g, src in zip(groups, srcs):
            torch.ops.graphctl.swap_through_(list(g.statics), list(g.arenas), src)
        token_map(m.req_idx_per_token, m.seq_lens)
        for g in groups:
            torch.ops.graphctl.copy_(list(g.statics), list(g.arenas))

    row = {"config": label, "snapshot_bytes": nbytes}
    med = time_interleaved({"a": lambda: hand_written(m, names), "b": fe, "c": gc_switch, "c_py": gc_python_steps,
                            "floor": floor}, reps, dev=dev)
    row["a_handwritten_us"], row["b_foreach_us"], row["c_graphctl_eager_us"] = med["a"], med["b"], med["c"]
    row["c_python_steps_us"], row["floor_ops_us"] = med["c_py"], med["floor"]
    row["a_over_floor"] = med["a"] / med["floor"]
    row["a_over_c"] = row["a_handwritten_us"] / row["c_graphctl_eager_us"]
    sync(dev)
    for n, v in before.items():  # the floor's restore put every buffer back
        assert torch.equal(getattr(m, n), v), f"{label}: {n} not restored by the floor variant"
    if dev.type != "cuda":  # host overhead only: no launches to count, no graphs
        return row
    for key, fn in (("a", lambda: hand_written(m, names)), ("b", fe), ("c", gc_switch)):
        k, c, a = count_launches(fn)
        row[f"{key}_kernels"], row[f"{key}_memcpys"], row[f"{key}_allocs"] = k, c, a
    g_gc = capture(gc_capture_switch)
    g_fe = capture(fe_dev)
    row["d_graphctl_graph_us"] = time_graph(g_gc, reps)
    row["b_foreach_graph_us"] = time_graph(g_fe, reps)
    for n, v in before.items():
        assert torch.equal(getattr(m, n), v), f"{label}: {n} not restored"
    row["bgraph_over_d"] = row["b_foreach_graph_us"] / row["d_graphctl_graph_us"]
    return row


def bandwidth(reps, total_mib=512, nbuf=16):
    n = total_mib * 2**20 // nbuf // 4
    statics = [torch.randint(0, 2**30, (n,), dtype=torch.int32, device="cuda") for _ in range(nbuf)]
    arenas = [torch.empty_like(t) for t in statics]
    sources = [torch.randint(0, 2**30, (n,), dtype=torch.int32, device="cuda") for _ in range(nbuf)]
    flat_src = torch.randint(0, 2**30, (nbuf * n,), dtype=torch.int32, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn):
        for _ in range(5):
            fn()
        ts = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
        return statistics.median(ts)

    data = nbuf * n * 4
    t_swap = timed(lambda: ops.swap_through_(statics, arenas, sources))  # reads 2x, writes 2x
    t_copy = timed(lambda: flat_dst.copy_(flat_src))  # reads 1x, writes 1x
    t_gcopy = timed(lambda: ops.copy_(arenas, sources))  # graphctl's restore direction, same bytes as copy_
    bw_swap = 4 * data / t_swap / 1e9
    bw_copy = 2 * data / t_copy / 1e9
    return {"total_mib": total_mib, "buffers": nbuf, "swap_through_GBps": bw_swap, "copy_GBps": bw_copy,
            "graphctl_copy_GBps": 2 * data / t_gcopy / 1e9, "ratio": bw_swap / bw_copy}


def main_cpu(args):
    import platform

    from rich.console import Console
    from rich.table import Table

    dev = torch.device("cpu")
    rows = [run_config(k, *v, reps=args.reps, dev=dev) for k, v in CONFIGS.items()]
    con = Console(width=200)
    con.print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, graphctl._C: {ops.uses_extension()}")
    t = Table(title="one switch (apply + restore), every buffer on the CPU, median us")
    cols = ["config", "snapshot_bytes", "a_handwritten_us", "b_foreach_us", "c_graphctl_eager_us", "a_over_c",
            "c_python_steps_us", "floor_ops_us", "a_over_floor"]
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    for r in rows:
        t.add_row(*(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    con.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": "cpu", "torch": torch.__version__, "rows": rows}, f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the eager columns only, every buffer on the host (host overhead, no GPU)")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    if args.device == "cpu":
        return main_cpu(args)

    props = torch.cuda.get_device_properties(0)
    hw = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
          "extension": ops.extension_status().loaded and ops.extension_status().with_cuda}
    rows = [run_config(k, *v, reps=args.reps) for k, v in CONFIGS.items()]
    bw = bandwidth(max(20, args.reps // 10))
    con = Console(width=200)
    con.print(f"{hw['gpu']}, torch {hw['torch']} (CUDA {hw['cuda']}), graphctl._C CUDA: {hw['extension']}")
    t = Table(title="one switch (apply + restore), median us")
    cols = ["config", "snapshot_bytes", "a_handwritten_us", "b_foreach_us", "c_graphctl_eager_us", "a_over_c",
            "c_python_steps_us", "floor_ops_us", "a_over_floor",
            "b_foreach_graph_us", "d_graphctl_graph_us", "bgraph_over_d", "a_kernels", "a_memcpys", "a_allocs",
            "b_kernels", "b_memcpys", "b_allocs", "c_kernels", "c_memcpys", "c_allocs"]
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    for r in rows:
        t.add_row(*(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    con.print(t)
    con.print(
        f"bandwidth, {bw['total_mib']} MiB in {bw['buffers']} buffers: swap_through_ {bw['swap_through_GBps']:.0f} "
        f"GB/s vs copy_ {bw['copy_GBps']:.0f} GB/s (graphctl copy_ {bw['graphctl_copy_GBps']:.0f} GB/s) "
        f"(ratio {bw['ratio']:.3f}; bytes counted: reads + writes)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hw, "rows": rows, "bandwidth": bw}, f, indent=2)


if __name__ == "__main__":
    main()
