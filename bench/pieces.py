"""Host cost of an eager region in a piecewise graph (issue 33), side by side in one run.

One forward, an MLP block of ``--layers`` layers around one region ``r(h)``, three ways:
  (a) full: ``r`` a plain function, the whole forward one graph;
  (b) piecewise: ``r`` decorated ``@graphctl.eager``: two pieces with ``r`` run eagerly between;
  (c) the region's own work: ``r(h)`` called eagerly on the same tensor.
Per-region host cost = (b) - (a) - (c): what graphctl adds per region (the end of one piece and
the launch of the next, the region's call through its record, the copy of its result into the
static output). Target: <= 10 us. Medians of ``--repeats`` rounds of ``--calls`` calls, timed
round robin, each call synchronized.

    python bench/pieces.py [--device cuda|cpu] [--bucket 8] [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import graphctl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--bucket", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    backend = "cuda" if dev.type == "cuda" else "emulated"
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(a.hidden, a.hidden, generator=g) * a.hidden ** -0.5).to(dev) for _ in range(2 * a.layers)]

    def region(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(h, h.shape[-1:])  # a stand-in for an attention call

    def make(r):
        def fwd(x: torch.Tensor) -> torch.Tensor:
            h = x
            for w in ws[: a.layers]:
                h = torch.relu(h @ w)
            h = r(h)
            for w in ws[a.layers:]:
                h = torch.relu(h @ w)
            return h
        return fwd

    x = torch.randn(a.bucket, a.hidden, generator=g).to(dev)
    full = graphctl.graphed(make(region), buckets=[a.bucket], backend=backend, progress=False)
    piecewise = graphctl.graphed(make(graphctl.eager(region)), buckets=[a.bucket], backend=backend, progress=False)
    full.capture_all(x)
    piecewise.capture_all(x)
    assert len(piecewise.graph(a.bucket).regions) == 1 and not full.graph(a.bucket).regions
    torch.testing.assert_close(piecewise(x).clone(), full(x).clone(), rtol=1e-3, atol=1e-3)
    h = torch.randn(a.bucket, a.hidden, generator=g).to(dev)

    def sync() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    fns = {"full": lambda: full(x), "piecewise": lambda: piecewise(x), "region": lambda: region(h)}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.repeats):
        for name, fn in fns.items():
            fn()
            per = []
            for _ in range(a.calls):
                t0 = sync()
                fn()
                per.append((sync() - t0) * 1e6)
            samples[name].append(statistics.median(per))
    med = {k: statistics.median(v) for k, v in samples.items()}
    cost = med["piecewise"] - med["full"] - med["region"]
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (emulated graphs)",
            "torch": torch.__version__, "bucket": a.bucket, "hidden": a.hidden, "layers": 2 * a.layers,
            "repeats": a.repeats, "calls": a.calls, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(info))
    print(f"full graph {med['full']:.1f} us, piecewise {med['piecewise']:.1f} us, the region alone "
          f"{med['region']:.1f} us: host cost per region {cost:.1f} us (target <= 10)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "median_us": med, "region_cost_us": cost, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
