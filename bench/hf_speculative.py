"""Hugging Face models on graphctl's paged backend, plain and speculative decode, against what a
transformers user has today (issue 18). H200, bf16, random weights (nothing is downloaded).

Target: ``llama-1b`` (``graphctl/integrations/hf/configs.py``: hidden 2048, 16 layers, 32 heads,
8 KV heads) with the output projections of layers 2.. zeroed (they still run and read their
weights, adding zero), so its 2-layer oracle draft (its embedding, first two layers, norm and
head) proposes exactly what it would choose: every draft is accepted at full cost. Prompts of
``--prompt`` tokens, ``--new`` new tokens, greedy. Side by side in one run, per batch size:

  (a) transformers eager ``generate`` (dynamic cache; left-padded batch);
  (b) transformers ``generate(assistant_model=draft)``, its speculative decoding (bs 1 only);
  (c) transformers ``generate(cache_implementation="static")`` after
      ``torch.compile(model.forward, mode="reduce-overhead")``, its CUDA-graph path (an error is
      recorded, not hidden);
  (d) graphctl graphed decode (``HFEngine`` with ``draft_len`` 0, ``@graphed`` buckets);
  (e) graphctl speculative decode, ``draft_len`` 3 and 7, ``graphed_step(mode="unrolled")``;
  (f) the step of (e) captured by hand with ``torch.cuda.graph`` (same host work: the ids copy,
      ``prepare``, the draft-table refresh), for graphctl's own overhead.

Where the time goes: one eager step of (e) under the profiler, device time by kernel kind
(switch, attention, GEMMs, gathers, other) next to the eager step's wall time (the graph runs
the same kernels without the host's launches). Decode tokens/s excludes prefill (for
transformers: a run of ``--new`` tokens minus a run of 1).
Targets: (d) >= (c); (e, oracle) >= 3 x (b) at bs 1; (e) per step <= 1.05 x (f).

    python bench/hf_speculative.py [--sizes 1 8 32] [--prompt 128] [--new 256] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import graphctl
from graphctl import StaticInput
from graphctl.integrations.hf import HFEngine
from graphctl.integrations.hf.configs import hf_config
from graphctl.models import graphed_step


def _sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def _hf_models(eng: HFEngine, name: str):
    """transformers' own models with the engine's weights: target (sdpa) and its 2-layer draft."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(name)
    target = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    target.load_state_dict(eng.target_layers.state_dict())
    dcfg = hf_config(name)
    dcfg.num_hidden_layers = 2
    draft = AutoModelForCausalLM.from_config(dcfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    draft.load_state_dict(eng.draft_layers.state_dict())
    return target.cuda().eval(), draft.cuda().eval()


def _hf_decode_tps(fn, bs: int, new: int) -> float:
    """Decode tokens/s of a transformers generate call ``fn(max_new_tokens)``: a run of ``new``
    tokens minus a run of 1 (the prefill), median of 3."""
    fn(2)
    samples = []
    for _ in range(3):
        t0 = _sync()
        fn(1)
        t1 = _sync()
        fn(new)
        t2 = _sync()
        samples.append((t2 - t1) - (t1 - t0))
    return bs * (new - 1) / statistics.median(samples)


def _graphctl_tps(eng: HFEngine, ps, new: int, forward) -> tuple[float, float, float]:
    """(decode tokens/s, median ms a step, mean accepted) of ``eng.generate`` through ``forward``."""
    eng.generate(ps, min(new, 8), forward=forward)  # capture and warm up
    t0 = _sync()
    eng.prefill(ps)
    t1 = _sync()
    res = eng.generate(ps, new, forward=forward)
    t2 = _sync()
    decode = (t2 - t1) - (t1 - t0)  # generate's own prefill is the same work
    toks = sum(len(t) for t in res.tokens) - len(ps)
    return toks / decode, 1e3 * decode / max(res.steps, 1), res.mean_accepted


def _hand_step(eng: HFEngine, n: int):
    """The speculative step captured by hand with torch.cuda.graph, and a replay with the same
    host work graphctl does (ids copy, the draft table's refresh)."""
    k1 = eng.k + 1
    ids = torch.zeros(n * k1, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            eng.step(ids, eng.meta)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = eng.step(ids, eng.meta)
    m = eng.meta

    def replay(new_ids: torch.Tensor):
        ids.copy_(new_ids)
        m.draft_block_table.copy_(m.draft_kv_cache_manager.pool_block_ids())
        g.replay()
        return out

    return replay


def _step_ms(fn, ids, meta, reps: int = 30) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        fn(ids, meta) if meta is not None else fn(ids)
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return statistics.median(ts)


_KINDS = (("switch", ("swap_copy", "token_to_request", "loop_condition")),
          ("attention", ("flash", "fmha", "attention", "softmax", "sdpa")),
          ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet")),
          ("gather/scatter", ("index", "gather", "scatter")))


def breakdown(eng: HFEngine, ids: torch.Tensor) -> dict[str, float]:
    """Where one eager step's device time goes (µs by kernel kind; the graph runs the same
    kernels) next to its host time: the profiler over one step, after a warmup."""
    from torch.profiler import ProfilerActivity, profile

    eng.step(ids, eng.meta)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = _sync()
        eng.step(ids, eng.meta)
        t1 = _sync()
    out = {k: 0.0 for k, _ in _KINDS}
    out["other"] = 0.0
    for ev in prof.key_averages():
        dev = ev.self_device_time_total
        if dev <= 0:
            continue
        name = ev.key.lower()
        kind = next((k for k, words in _KINDS if any(w in name for w in words)), "other")
        out[kind] += dev
    out["device_total"] = sum(out.values())
    out["eager_wall"] = (t1 - t0) * 1e6
    return out


def run(sizes, prompt: int, new: int, name: str) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for bs in sizes:
        ps = [torch.randint(0, 32000, (prompt,), generator=g) for _ in range(bs)]
        ctx = prompt + new + 2 * 8 + 2
        row: dict = {"bs": bs}
        for k in (0, 3, 7):
            eng = HFEngine.build(hf_config(name), draft_len=k, max_seqs=bs, max_context=ctx, block_size=16,
                                 device="cuda", dtype=torch.bfloat16, seed=0)
            buckets = sorted({1, bs})
            if k == 0:
                fwd = graphctl.graphed(eng.decode_step, buckets=buckets, state=eng.state, inputs=[StaticInput(
                    "input_ids")], progress=False, params=eng.named_tensors())
                row["d_graphctl_decode_tps"], row["d_ms_per_step"], _ = _graphctl_tps(eng, ps, new, fwd)
                tgt, drf = _hf_models(eng, name)
                batch = torch.stack(ps).cuda()

                def hf(n_new, model=tgt, **kw):
                    with torch.no_grad():
                        model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n_new,
                                       min_new_tokens=n_new, do_sample=False, pad_token_id=0, **kw)

                row["a_hf_eager_tps"] = _hf_decode_tps(hf, bs, new)
                if bs == 1:
                    try:
                        row["b_hf_assisted_tps"] = _hf_decode_tps(lambda n: hf(n, assistant_model=drf), bs, new)
                    except Exception as exc:  # recorded, not hidden
                        row["b_hf_assisted_error"] = f"{type(exc).__name__}: {exc}"[:300]
                try:
                    tgt.forward = torch.compile(tgt.forward, mode="reduce-overhead")
                    row["c_hf_static_compiled_tps"] = _hf_decode_tps(
                        lambda n: hf(n, cache_implementation="static"), bs, new)
                except Exception as exc:
                    row["c_hf_static_compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
                del tgt, drf
            else:
                fwd = graphed_step(eng, "unrolled", buckets=buckets)
                tps, ms, acc = _graphctl_tps(eng, ps, new, fwd)
                row[f"e{k}_graphctl_spec_tps"], row[f"e{k}_ms_per_step"], row[f"e{k}_mean_accepted"] = tps, ms, acc
                ids = torch.randint(0, 32000, (bs * (k + 1),), generator=g).cuda()
                eng.meta.prepare(eng.state, torch.full((bs,), k + 1, dtype=torch.int32),
                                 torch.full((bs,), prompt + k + 1, dtype=torch.int32))
                row[f"e{k}_graphctl_step_ms"] = _step_ms(fwd, ids, eng.meta)
                row[f"e{k}_breakdown_us"] = breakdown(eng, ids)
                hand = _hand_step(eng, bs)
                row[f"f{k}_hand_step_ms"] = _step_ms(hand, ids, None)
                row[f"e{k}_over_hand"] = row[f"e{k}_graphctl_step_ms"] / row[f"f{k}_hand_step_ms"]
            del eng
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--config", default="llama-1b")
    ap.add_argument("--json")
    args = ap.parse_args()
    p = torch.cuda.get_device_properties(0)
    import transformers

    head = {"gpu": p.name, "torch": torch.__version__, "transformers": transformers.__version__,
            "config": args.config, "prompt": args.prompt, "new": args.new}
    rows = run(args.sizes, args.prompt, args.new, args.config)
    print(json.dumps(head))
    for r in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": head, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
