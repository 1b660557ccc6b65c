"""Decode at a long context: graphctl's paged step against the hand-captured ``StaticCache`` step
(issue 32's target: at bs 32 and 2,048 tokens of context a request, graphctl's decode >= 1.3x the
static-cache step, which attends over the whole ``max_cache_len``).

Model: ``llama-1b`` (``graphctl/integrations/hf/configs.py``), bf16, random weights, one set of
weights for both. Side by side in one run, per batch size:

  graphctl  ``HFEngine`` (``draft_len`` 0) prefills ``--context``-token prompts, then its decode step
            under ``@graphed`` (paged attention reading each request's pages in place, up to its
            length): the step's device time replayed alone, and ``generate``'s ms a step (host
            work included);
  static    transformers' ``LlamaForCausalLM`` (SDPA) with a ``StaticCache`` of ``max_cache_len`` =
            the engine's ``max_context``, its decode step at cache position ``--context`` captured by
            hand with ``torch.cuda.graph`` and replayed (the attention masks positions past the
            context but reads the whole cache: what a static cache costs). Its cache holds zeros,
            not a prefill: the work of a step does not depend on the values.

Each step time is the median of ``--reps`` CUDA-graph replays timed round robin with the other.
Reported: both step times, their ratio (static / graphctl, target >= 1.3), the KV bytes a step
reads and the read-once floor at the measured copy bandwidth.

    python bench/long_context.py [--sizes 32] [--context 2048] [--new 32] [--reps 30] [--json out.json]
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch

import graphctl
from graphctl import StaticInput
from graphctl.integrations.hf import HFEngine
from graphctl.integrations.hf.configs import hf_config


def _copy_gbps() -> float:
    """Device copy bandwidth (read + write) of a 1 GiB buffer, GB/s."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(5):
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ms.append(s.elapsed_time(e))
    return 2 * a.numel() / statistics.median(ms) / 1e6


def _graph(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _replay_ms(fns: dict, reps: int) -> dict[str, float]:
    """Median device ms of one call of each zero-argument callable, round robin."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        for k, fn in fns.items():
            s.record()
            fn()
            e.record()
            e.synchronize()
            out[k].append(s.elapsed_time(e))
    return {k: statistics.median(v) for k, v in out.items()}


def run(args) -> list[dict]:
    cfg = hf_config("llama-1b")
    rows = []
    for bs in args.sizes:
        rows.append(_one(args, cfg, bs))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def _one(args, cfg, bs: int) -> dict:
    ctx = args.context + args.new + 16
    eng = HFEngine.build(cfg, draft_len=0, max_seqs=bs, max_context=ctx, device="cuda", dtype=torch.bfloat16,
                         seed=0)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, cfg.vocab_size, (args.context,), generator=g) for _ in range(bs)]
    fwd = graphctl.graphed(eng.decode_step, buckets=[bs], state=eng.state, inputs=[StaticInput("input_ids")],
                           progress=False, params=eng.named_tensors())
    eng.generate(ps, 4, forward=fwd)  # capture and warm up
    res = [eng.generate(ps, args.new, forward=fwd) for _ in range(3)]
    gen_ms = statistics.median(1e3 * r.decode_s / max(r.steps, 1) for r in res)
    ids = torch.randint(0, cfg.vocab_size, (bs,), generator=g).cuda()
    # the layout of the step after the prompts: one token a request at position context
    eng.meta.prepare(eng.state, torch.ones(bs, dtype=torch.int32), torch.full((bs,), args.context + 1,
                                                                               dtype=torch.int32))
    hf = _static_step(eng, cfg, bs, ctx, args.context)
    ms = _replay_ms({"graphctl": lambda: fwd(ids, eng.meta), "static": hf}, args.reps)
    kv = 2 * cfg.num_hidden_layers * bs * (args.context + 1) * cfg.num_key_value_heads * \
        (cfg.hidden_size // cfg.num_attention_heads) * 2
    gbps = _copy_gbps()
    row = dict(bs=bs, context=args.context, max_context=ctx, graphctl_step_ms=ms["graphctl"],
               static_step_ms=ms["static"], static_over_graphctl=ms["static"] / ms["graphctl"],
               graphctl_generate_ms_per_step=gen_ms, kv_mib_read=kv / 2**20, copy_gbps=gbps,
               kv_read_once_ms=kv / gbps / 1e6)
    return row


def _static_step(eng: HFEngine, cfg, bs: int, max_len: int, position: int):
    """transformers' decode step on a StaticCache at ``position``, captured by hand: a replay callable."""
    from transformers import AutoModelForCausalLM, StaticCache

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.load_state_dict(eng.target_layers.state_dict())
    model.eval()
    kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    tok = torch.randint(0, cfg.vocab_size, (bs, 1), device="cuda")
    pos = torch.full((1,), position, dtype=torch.int64, device="cuda")

    def step():
        with torch.no_grad():
            return model(tok, **{kw: cache}, cache_position=pos, use_cache=True).logits

    step()  # the cache's tensors are allocated lazily, on the first call
    g = _graph(step)
    return g.replay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/long_context.py needs a CUDA device", file=sys.stderr)
        return 2
    rows = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
