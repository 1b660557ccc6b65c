"""Time to first token: the HF engine's prefill against transformers' (issue 32's target: TTFT of 8
prompts of 128 tokens <= transformers' eager prefill of the same prompts).

Model: ``llama-1b`` (``graphctl/integrations/hf/configs.py``), bf16, random weights, one set of
weights for every path; ``--prompts`` prompts of ``--tokens`` tokens. Side by side in one process,
each the median of ``--reps`` synchronized wall times:

  eager     ``HFEngine.prefill``: one ragged pass of every prompt through the target and the draft,
            their K/V into both paged caches (what ``generate`` runs by default), each layer's
            K/V write and attention two Triton launches called directly;
  eager_ops the same pass through the ops (``GRAPHCTL_EAGER_KERNELS=0``:
            ``torch.ops.graphctl.paged_attention`` and the manager's indexed writes): what the
            eager pass ran before, and what a tracked warmup and a compiled model still run;
  graphed   the same pass graphed at its token bucket (``eng.graphed_prefill([tokens])``);
  hf        transformers' eager forward of the target over the padded batch (SDPA,
            ``logits_to_keep=1``), the draft's the same, and ``generate(max_new_tokens=1)``.

Also the host time to enqueue the eager prefill (wall time before the device is waited for: equal
to the wall time when the pass is host-bound). ``--profile`` prints the profiler's costliest ops of
one eager prefill by host and by device time.

    python bench/prefill.py [--prompts 8] [--tokens 128] [--reps 7] [--profile] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from hf_speculative import _hf_models  # bench/ is this script's directory: on sys.path when run

from graphctl import knobs
from graphctl.integrations.hf import HFEngine
from graphctl.integrations.hf.configs import hf_config


def _wall_ms(fn, reps: int, wait: bool = True) -> float:
    """Median ms of ``fn()``; ``wait=False``: until it returns, the device not waited for."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if wait:
            torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    return statistics.median(out)


def _through_ops(fn):
    """``fn`` with the direct kernels off (``GRAPHCTL_EAGER_KERNELS=0``): every layer through the ops."""
    def call() -> None:
        with knobs.scope(eager_kernels=False):
            fn()
    return call


def run(a: argparse.Namespace) -> dict:
    eng = HFEngine.build(hf_config(a.config), draft_len=3, max_seqs=a.prompts, max_context=a.tokens + 64,
                         block_size=16, device="cuda", dtype=torch.bfloat16, seed=0)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, eng.cfg.vocab, (a.tokens,), generator=g) for _ in range(a.prompts)]
    tgt, drf = _hf_models(eng, a.config, "cuda")  # transformers' models with the engine's weights
    batch = torch.stack(ps).cuda()
    ones = torch.ones_like(batch)

    def forward(model):
        def call() -> None:
            with torch.no_grad():
                model(input_ids=batch, attention_mask=ones, logits_to_keep=1)
        return call

    def generate() -> None:
        with torch.no_grad():
            tgt.generate(batch, attention_mask=ones, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                         pad_token_id=0)

    pre = eng.graphed_prefill([min(a.prompts * a.tokens, eng.meta.max_tokens)], backend="cuda")
    paths = {"eager": lambda: eng.prefill(ps), "eager_ops": _through_ops(lambda: eng.prefill(ps)),
             "graphed": lambda: eng.prefill(ps, forward=pre),
             "hf_target": forward(tgt), "hf_draft": forward(drf), "hf_generate": generate}
    for fn in paths.values():  # warm up (and capture the graphed pass)
        fn()
        fn()
    ms = {k: _wall_ms(fn, a.reps) for k, fn in paths.items()}
    row = {f"{k}_ms": v for k, v in ms.items()}
    row["eager_host_ms"] = _wall_ms(paths["eager"], a.reps, wait=False)
    row["eager_ops_host_ms"] = _wall_ms(paths["eager_ops"], a.reps, wait=False)
    for k in ("eager", "eager_ops", "graphed"):
        row[f"{k}_over_hf_generate"] = ms[k] / ms["hf_generate"]
        row[f"{k}_over_hf_both"] = ms[k] / (ms["hf_target"] + ms["hf_draft"])
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            paths["eager"]()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
        print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=50))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-1b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/prefill.py needs a CUDA device", file=sys.stderr)
        return 2
    row = run(a)
    print(json.dumps({k: round(v, 3) for k, v in row.items()}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, config=a.config,
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), row=row), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
