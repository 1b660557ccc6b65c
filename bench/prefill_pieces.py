"""A compiled model's piecewise prefill (issue 51's targets), side by side in one process.

Model: ``--config`` (default ``llama-1b``, ``graphctl/integrations/hf/configs.py``), bf16, random weights,
built once and compiled (``HFEngine(compile=True)``: Inductor, unless ``--no-compile``); ``--prompts`` prompts of
``--tokens`` tokens, one ragged prefill pass of both models at the token bucket. Paths:

  eager      ``eng.prefill(ps)``: the compiled models run eagerly;
  whole      ``eng.prefill(ps, forward=eng.graphed_prefill([T]))``: the pass one graph (attention inside it);
  piecewise  ``eng.prefill(ps, forward=eng.graphed_prefill([T], piecewise=True))``: each layer's attention an eager
             region (a dynamo graph break), the compiled pieces between them captured as graphs.

Targets (issue 51): piecewise >= 2.5x eager (eager ms / piecewise ms) and piecewise <= 1.10x whole. Each repeat
times every path in a fresh random order (``--calls`` synchronized calls, median); the numbers reported are the
medians over ``--repeats`` repeats, with each path's spread (min, max of the per-repeat medians).

    python bench/prefill_pieces.py [--config llama-1b] [--prompts 8] [--tokens 128] [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from graphctl.integrations.hf import HFEngine
from graphctl.integrations.hf.configs import hf_config


def _ms(fn, calls: int) -> float:
    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def run(a: argparse.Namespace) -> dict:
    torch._dynamo.reset()
    t0 = time.perf_counter()
    eng = HFEngine.build(hf_config(a.config), draft_len=1, max_seqs=a.prompts, max_context=a.tokens + 64,
                         block_size=16, device="cuda", dtype=torch.bfloat16, seed=0, compile=not a.no_compile,
                         prefill_tokens=a.prompts * a.tokens)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, eng.cfg.vocab, (a.tokens,), generator=g) for _ in range(a.prompts)]
    T = min(a.prompts * a.tokens, eng.meta.max_tokens)
    row: dict = {"build_s": time.perf_counter() - t0}
    paths = {"eager": lambda: eng.prefill(ps)}
    t0 = time.perf_counter()
    paths["eager"]()
    paths["eager"]()
    row["eager_warm_s"] = time.perf_counter() - t0
    firsts = {}
    for name, pw in (("whole", False), ("piecewise", True)):
        pre = eng.graphed_prefill([T], piecewise=pw)
        t0 = time.perf_counter()
        first = eng.prefill(ps, forward=pre)  # warmups and capture
        row[f"{name}_capture_s"] = time.perf_counter() - t0
        rep = pre.report()
        row[f"{name}_pieces"] = rep.buckets[0].pieces
        row[f"{name}_uncompiled"] = rep.uncompiled
        row[f"{name}_graph_breaks"] = rep.compile.get(T, {}).get("breaks", 0)
        firsts[name] = first
        paths[name] = (lambda p: lambda: eng.prefill(ps, forward=p))(pre)
    # the three paths agree on the first tokens (one bf16 pass: the same argmax, or within the tolerance policy)
    want = eng.prefill(ps)
    row["first_tokens_equal"] = {k: bool(torch.equal(torch.as_tensor(v), torch.as_tensor(want)))
                                 for k, v in firsts.items()}
    per: dict[str, list[float]] = {k: [] for k in paths}
    order = list(paths)
    for _ in range(a.repeats):
        random.shuffle(order)
        for k in order:
            per[k].append(_ms(paths[k], a.calls))
    for k, v in per.items():
        row[f"{k}_ms"] = statistics.median(v)
        row[f"{k}_ms_spread"] = [min(v), max(v)]
    row["piecewise_over_eager_speedup"] = row["eager_ms"] / row["piecewise_ms"]  # target >= 2.5
    row["piecewise_over_whole"] = row["piecewise_ms"] / row["whole_ms"]  # target <= 1.10
    row["whole_over_eager_speedup"] = row["eager_ms"] / row["whole_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-1b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/prefill_pieces.py needs a CUDA device", file=sys.stderr)
        return 2
    row = run(a)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, config=a.config,
                           compiled=not a.no_compile, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           args=vars(a), row=row), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
