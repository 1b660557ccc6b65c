"""Decode-step latency of the three draft-loop capture modes on the reference MTP engine.

For each draft length k and batch size, side by side in one run, on the same engine and state:

  unrolled     one graph: target, acceptance, the draft switch and k draft steps;
  per_step     a target graph, a draft-prefill graph and a one-step graph replayed k times inside
               a host-side draft switch, the layout written between steps (vLLM's shape);
  device_loop  one graph whose draft steps are the body of a CUDA WHILE node, the predicate on
               the device (threshold 0 here: all k steps, same tokens as the others).

Then the dynamic-length case: the device loop with a confidence threshold picked from the
step's own draft probabilities so that it stops early, against the same graph at threshold 0
(the threshold is a device scalar: one graph serves both): steps taken and latency.

Latency per call: host clock around the call and a synchronize, median of ``--reps`` rounds,
the variants interleaved in each round. Every mode's drafts are checked equal to eager first.

    python bench/loop_modes.py [--reps 50] [--sizes 1 8 64] [--draft-lens 3 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from draft_loop import latencies_us  # noqa: E402  (the interleaved timer both benchmarks share)

from graphctl.models import (  # noqa: E402
    MODES,
    EngineConfig,
    MTPEngine,
    draft_confidences,
    dynamic_of,
    expected_dynamic,
    graphed_step,
)


def expected_steps(conf: torch.Tensor, t: float) -> int:
    return expected_dynamic(torch.zeros(conf.shape, dtype=torch.int64), conf, t)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--draft-lens", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/loop_modes.py needs a CUDA device", file=sys.stderr)
        return 2
    x = torch.randn(4096, 4096, device="cuda")  # clocks up from idle before the first size
    t_end = time.perf_counter() + 5
    while time.perf_counter() < t_end:
        x = torch.tanh(x @ x.T * 1e-3)
    torch.cuda.synchronize()
    rows, ok = [], True
    for k in a.draft_lens:
        for bs in a.sizes:
            eng = MTPEngine(EngineConfig(draft_len=k, max_seqs=bs, max_context=64 + 2 * k, seed=bs + k), device="cuda")
            g = torch.Generator().manual_seed(bs * 31 + k)
            ctx = torch.randint(8, 40, (bs,), generator=g, dtype=torch.int32)
            eng.meta.prepare(eng.state, torch.full((bs,), k + 1, dtype=torch.int32), ctx + k + 1)
            ids = torch.randint(0, eng.cfg.vocab, (bs * (k + 1),), generator=g).cuda()
            want = eng.step(ids, eng.meta).drafts.clone()
            fns = {mode: graphed_step(eng, mode, buckets=(bs,), backend="cuda") for mode in MODES}
            same = {mode: torch.equal(f(ids, eng.meta).drafts, want) for mode, f in fns.items()}
            ok &= all(same.values())
            t = latencies_us({m: (lambda f=f: f(ids, eng.meta)) for m, f in fns.items()}, a.reps)
            # dynamic length: the threshold whose expected stop is closest to half of k (rounded up)
            conf = draft_confidences(eng, ids)[1]
            vals = sorted(set(conf.flatten().tolist()))  # midpoints: a threshold equal to a probability could flip
            cands = [(x + y) / 2 for x, y in zip(vals, vals[1:]) if y - x > 2e-3] or [0.0]
            thr = min(cands, key=lambda c: (abs(expected_steps(conf, c) - (k + 1) // 2), c))
            dyn = dynamic_of(fns["device_loop"])
            dyn.set_threshold(thr)
            fns["device_loop"](ids, eng.meta)
            steps = int(dyn.counter)
            t_dyn = latencies_us({"dynamic": lambda: fns["device_loop"](ids, eng.meta)}, a.reps)["dynamic"]
            dyn.set_threshold(0.0)
            best = min(MODES, key=lambda m: t[m])
            rows.append(dict(k=k, bs=bs, **{f"{m}_us": t[m] for m in MODES}, winner=best, drafts_equal=same,
                             dyn_threshold=thr, dyn_steps=steps, dyn_expected=expected_steps(conf, thr), dyn_us=t_dyn,
                             dyn_vs_fixed=t_dyn / t["device_loop"]))
            print(f"k={k} bs={bs}: " + ", ".join(f"{m} {t[m]:.0f} us" for m in MODES) +
                  f"; dynamic {steps}/{k} steps {t_dyn:.0f} us; equal={same}", flush=True)
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda, reps=a.reps,
                date=time.strftime("%Y-%m-%d"))
    print(f"loop_modes: {info['gpu']}, torch {info['torch']}; median latency per decode step, us")
    print(f"{'k':>2} {'bs':>4} {'unrolled':>9} {'per_step':>9} {'dev_loop':>9} {'winner':>12} {'dyn steps':>10} "
          f"{'dyn us':>8} {'dyn/fixed':>9}")
    for r in rows:
        print(f"{r['k']:>2} {r['bs']:>4} {r['unrolled_us']:>9.1f} {r['per_step_us']:>9.1f} {r['device_loop_us']:>9.1f} "
              f"{r['winner']:>12} {r['dyn_steps']:>4}/{r['k']:<5} {r['dyn_us']:>8.1f} {r['dyn_vs_fixed']:>8.2f}x")
    bad = [r for r in rows if r["dyn_steps"] != r["dyn_expected"]]
    print(f"drafts equal to eager in every mode: {ok}; dynamic stops where expected: {not bad}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)
    return 0 if ok and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
