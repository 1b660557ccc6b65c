"""One runner with ``variants={"k": (1, 3, 7)}`` against a runner per k (issue 33), side by side in
one run, over the reference engine's speculative step (``graphed_step(eng, draft_lens=...)`` vs
``graphed_step`` on one engine per k sharing the weights and caches).

Measured, each a median of ``--repeats``:
  - call time: one graphed step per k, the variant runner and the per-k runner timed round robin
    (host clock around a synchronized call: the dispatch difference is host work);
  - capture time: ``capture_all`` of the variant runner against the sum over the per-k runners;
  - pool memory: the variant runner's one pool against the per-k runners' pools (CUDA: reserved
    bytes the captures added; emulated: what the graphs hold).
Targets: call time <= 1.02x, capture time and pool memory <= 1.0x. The two captures alternate which
goes first per repeat. The variant runner collects garbage once for all its captures (a runner
per k once each).

    python bench/variants.py [--device cuda|cpu] [--buckets 1 2 4 8] [--repeats 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch

from graphctl.models import EngineConfig, MTPEngine, graphed_step

KS = (1, 3, 7)


def _sync(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _pool_bytes(dev: torch.device, capture) -> tuple[float, int]:
    """(seconds, pool bytes) of ``capture()``: on CUDA the reserved memory it added."""
    gc.collect()
    before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    t0 = _sync(dev)
    runner = capture()
    t1 = _sync(dev)
    if dev.type == "cuda":
        return t1 - t0, torch.cuda.memory_reserved(dev) - before
    return t1 - t0, sum(b.pool_bytes for b in runner.report().buckets)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="calls a repeat times, per k and runner")
    ap.add_argument("--hidden", type=int, default=None, help="default 256 on CUDA, 64 on the CPU (host cost shows)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    backend = "cuda" if dev.type == "cuda" else "emulated"
    n = max(a.buckets)
    hidden = a.hidden or (256 if dev.type == "cuda" else 64)
    cfg = EngineConfig(draft_len=max(KS), max_seqs=n, max_context=256, hidden=hidden, vocab=512,
                       dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    eng = MTPEngine(cfg, device=dev)
    g = torch.Generator().manual_seed(0)
    ids = {k: torch.randint(0, cfg.vocab, (n * (k + 1),), generator=g).to(dev) for k in KS}
    ctx = torch.full((n,), 64, dtype=torch.int32)

    def prepare(k: int) -> None:
        eng.meta.prepare(eng.state, torch.full((n,), k + 1, dtype=torch.int32), ctx + k + 1)

    caps: dict[str, list[float]] = {"variants": [], "per_k": []}
    pools: dict[str, list[float]] = {"variants": [], "per_k": []}
    calls: dict[str, list[float]] = {"variants": [], "per_k": []}

    def one_round(variants_first: bool) -> None:
        # the per-k runners, each on its own engine view (same weights and caches; its own k as draft_len)
        per_k: dict[int, Any] = {}
        var: Any = None

        def variant_runner() -> None:
            nonlocal var
            prepare(max(KS))
            var = graphed_step(eng, draft_lens=KS, buckets=a.buckets, backend=backend)
            t, b = _pool_bytes(dev, lambda: var.capture_all(ids[max(KS)], eng.meta, max(KS)))
            caps["variants"].append(t)
            pools["variants"].append(b)

        if variants_first:  # alternated between rounds: whichever captures second meets a warmer process
            variant_runner()
        t_sum, b_sum = 0.0, 0
        for k in KS:
            prepare(k)
            view = MTPEngine.__new__(MTPEngine)
            view.__dict__.update(eng.__dict__)
            view.k = k
            r = graphed_step(view, buckets=a.buckets, backend=backend)
            t, b = _pool_bytes(dev, lambda r=r, k=k: r.capture_all(ids[k], eng.meta))
            per_k[k] = r
            t_sum, b_sum = t_sum + t, b_sum + b
        caps["per_k"].append(t_sum)
        pools["per_k"].append(b_sum)
        if not variants_first:
            variant_runner()
        for k in KS:  # round robin: drift reaches both alike
            prepare(k)
            fns = (("variants", lambda k=k: var(ids[k], eng.meta, k)),
                   ("per_k", lambda k=k: per_k[k](ids[k], eng.meta)))
            for name, fn in fns:
                fn()
                t0 = _sync(dev)
                for _ in range(a.calls):
                    fn()
                calls[name].append((_sync(dev) - t0) / a.calls * 1e6)

    for i in range(a.repeats):
        one_round(variants_first=bool(i % 2))  # its runners die on return: the next round starts from a clean pool
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    med = {key: {name: statistics.median(v) for name, v in d.items()} for key, d in
           (("call_us", calls), ("capture_s", caps), ("pool_bytes", pools))}
    ratio = {key: med[key]["variants"] / med[key]["per_k"] if med[key]["per_k"] else None for key in med}
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (emulated graphs)",
            "torch": torch.__version__, "hidden": hidden, "buckets": a.buckets, "ks": KS, "repeats": a.repeats,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(info))
    for key in med:
        r = ratio[key]
        print(f"{key:>10}: variants {med[key]['variants']:.4g}  per-k runners {med[key]['per_k']:.4g}  "
              f"ratio {'-' if r is None else f'{r:.3f}'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "median": med, "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
