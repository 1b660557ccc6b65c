"""Decode-step latency of the reference MTP engine with tensor parallelism (TP = number of GPUs,
at least 2): eager against the ``@graphed`` step, whose CUDA graph holds the NCCL all-reduces of
the row-parallel MLP; the ranks agree on the bucket before each replay (one small all-reduce).

Each rank times its own calls (host clock around the call and a synchronize, median of
``--reps``); rank 0 prints and writes the table. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
With fewer than two GPUs it says so and exits 0 (``graphctl bench`` lists it as not run).

    python bench/tp_decode.py [--reps 50] [--sizes 1 8 64] [--draft-lens 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch


def _worker(rank: int, world: int, init: str, a: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    import graphctl
    from graphctl import StaticInput
    from graphctl.models import EngineConfig, MTPEngine

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    for k in a.draft_lens:
        for bs in a.sizes:
            eng = MTPEngine(EngineConfig(draft_len=k, max_seqs=bs, max_context=64 + 2 * k, hidden=256),
                            device=f"cuda:{rank}", tp_group=dist.group.WORLD)
            g = torch.Generator().manual_seed(bs + k)
            ctx = torch.randint(8, 40, (bs,), generator=g, dtype=torch.int32)
            eng.meta.prepare(eng.state, torch.full((bs,), k + 1, dtype=torch.int32), ctx + k + 1)
            ids = torch.randint(0, eng.cfg.vocab, (bs * (k + 1),), generator=g).cuda()
            f = graphctl.graphed(eng.step, buckets=[bs], state=eng.state, backend="cuda", progress=False,
                                 inputs=[StaticInput("input_ids", per_item=k + 1)], group=dist.group.WORLD)
            f.capture_all(ids, eng.meta)
            same = torch.equal(f(ids, eng.meta).drafts, eng.step(ids, eng.meta).drafts)
            samples = {"eager": [], "graph": []}
            for _ in range(a.reps):
                for name, fn in (("eager", lambda: eng.step(ids, eng.meta)), ("graph", lambda: f(ids, eng.meta))):
                    dist.barrier()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    samples[name].append((time.perf_counter() - t0) * 1e6)
            e, gr = statistics.median(samples["eager"]), statistics.median(samples["graph"])
            rows.append(dict(k=k, bs=bs, eager_us=e, graph_us=gr, speedup=e / gr, drafts_equal=same))
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--draft-lens", type=int, nargs="+", default=[3])
    ap.add_argument("--json")
    a = ap.parse_args()
    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world < 2:
        print(f"bench/tp_decode.py: not run: needs at least two GPUs, found {world}")
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), a, out), nprocs=world, join=True)
        rows = json.load(open(out))
    info = dict(gpu=torch.cuda.get_device_name(0), gpus=world, torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    print(f"tp_decode: TP={world} on {info['gpu']}, torch {info['torch']}; median latency per decode step, us")
    for r in rows:
        print(f"k={r['k']} bs={r['bs']:>3}: eager {r['eager_us']:.0f} us, graph {r['graph_us']:.0f} us, "
              f"{r['speedup']:.2f}x, drafts equal {r['drafts_equal']}")
    if a.json:
        json.dump(dict(info=info, rows=rows), open(a.json, "w"), indent=1)
    return 0 if all(r["drafts_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
