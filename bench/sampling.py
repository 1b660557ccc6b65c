"""What sampling costs on the device, op by op, against greedy (issue 34).

A speculative step at ``k`` drafts samples over the vocabulary ``(k + 1) * bs`` target rows (the
acceptance) and ``k`` times ``bs`` draft rows. For llama-1b's vocabulary (128,256) and bf16 logits,
side by side in one run, each captured as a CUDA graph of ``--iters`` calls (device time, as the
engine replays it) and timed between CUDA events, median of ``--repeats``:

  greedy     argmax of the target rows and of the draft rows (what a greedy step does);
  probs      ``probs_from_logits`` (temperature 0.8, top-p 0.9) of the target rows and draft rows
             under ``GRAPHCTL_SAMPLING=auto`` (the default): on CUDA the Triton kernel for vocabularies up to 32,768;
  probs_full the Triton kernel searching float32 probabilities in 31 steps (session 43's), not 16-bit logits;
  probs_ref  the same under ``GRAPHCTL_SAMPLING=reference`` (PyTorch: sort and scan);
  sort       sorting those rows' logits alone (top-p's floor with a sort);
  accept     ``speculative_accept`` over the target's and draft's probabilities;
  sampled    probs + the draft rows' races (one Triton launch each) + accept (one):
             what sampling adds to a step, all told (and ``sampled_ref`` with the reference filtering).

    python bench/sampling.py [--sizes 1 8 32] [--k 3] [--vocab 128256] [--device cpu] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from graphctl import knobs
from graphctl.ops import draws
from graphctl.ops.sampling import probs_from_logits, race, speculative_accept

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_attention import graph_calls, replay_ms  # noqa: E402  (the CUDA-graph timer both benchmarks share)


def _timer(fn, iters: int, cuda: bool):
    """A callable timing ``iters`` calls of ``fn`` in ms a call: a CUDA graph replayed on CUDA."""
    if cuda:
        g = graph_calls(fn, iters)
        return lambda: replay_ms(g, iters)
    fn()

    def host() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    return host


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench/sampling.py: no CUDA device (--device cpu times the host)", file=sys.stderr)
        return 2
    dev, k, V = torch.device(a.device), a.k, a.vocab
    rows_out = []
    for bs in a.sizes:
        tl = torch.randn(bs * (k + 1), V, device=dev).mul_(3).to(torch.bfloat16)  # target logits
        dl = torch.randn(k, bs, V, device=dev).mul_(3).to(torch.bfloat16)  # the k draft steps' logits
        drafts = torch.randint(0, V, (bs, k), device=dev)
        seed, pos = torch.arange(bs, device=dev), torch.full((bs,), 200, device=dev)  # each request's draw keys
        tp = probs_from_logits(tl, 0.8, 0, 0.9).view(bs, k + 1, V)
        dp = torch.stack([probs_from_logits(dl[i], 0.8, 0, 0.9) for i in range(k)], 1)

        def greedy() -> None:
            tl.argmax(-1)
            for i in range(k):
                dl[i].argmax(-1)

        def probs() -> None:
            probs_from_logits(tl, 0.8, 0, 0.9)
            for i in range(k):
                probs_from_logits(dl[i], 0.8, 0, 0.9)

        def sort() -> None:
            tl.sort(-1, descending=True)
            for i in range(k):
                dl[i].sort(-1, descending=True)

        def accept() -> None:
            speculative_accept(tp, dp, drafts, seed, pos)

        def sampled() -> None:
            p = probs_from_logits(tl, 0.8, 0, 0.9).view(bs, k + 1, V)
            laws = []
            for i in range(k):
                q = probs_from_logits(dl[i], 0.8, 0, 0.9)
                race(q, draws.noise(seed, pos + i, draws.DRAFT, V))
                laws.append(q)
            speculative_accept(p, torch.stack(laws, 1), drafts, seed, pos)

        with knobs.scope(sampling="auto"):  # the choice is made at capture: the graph keeps it
            timers = {n: _timer(f, a.iters, cuda) for n, f in
                      (("greedy", greedy), ("probs", probs), ("sort", sort), ("accept", accept), ("sampled", sampled))}
        if cuda:
            from graphctl.ops import sampling_triton as st
            saved = st.KEYED, st._FLOOR_TOP_P
            st.KEYED, st._FLOOR_TOP_P = False, -1.0  # the kernel reads them at launch: this graph keeps them
            try:
                with knobs.scope(sampling="auto"):
                    timers["probs_full"] = _timer(probs, a.iters, cuda)
            finally:
                st.KEYED, st._FLOOR_TOP_P = saved
        with knobs.scope(sampling="reference"):
            timers["probs_ref"] = _timer(probs, a.iters, cuda)
            timers["sampled_ref"] = _timer(sampled, a.iters, cuda)
        runs: dict[str, list[float]] = {n: [] for n in timers}
        for _ in range(a.repeats):  # interleaved
            for n, t in timers.items():
                runs[n].append(t())
        med = {n: statistics.median(v) for n, v in runs.items()}
        row = dict(bs=bs, k=k, vocab=V, **{f"{n}_ms": round(v, 4) for n, v in med.items()})
        rows_out.append(row)
        print(json.dumps(row))
        del timers
    info = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), iters=a.iters, repeats=a.repeats,
                rows=rows_out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
