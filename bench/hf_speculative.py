"""Hugging Face models on graphctl's paged backend, plain and speculative decode, against what a
transformers user has today (issue 18). H200, bf16, random weights (nothing is downloaded).

Target: ``llama-1b`` (``graphctl/integrations/hf/configs.py``: hidden 2048, 16 layers, 32 heads,
8 KV heads) with the output projections of layers 2.. zeroed (they still run and read their
weights, adding zero), so its 2-layer oracle draft (its embedding, first two layers, norm and
head) proposes exactly what it would choose: every draft is accepted at full cost. Prompts of
``--prompt`` tokens, ``--new`` new tokens, greedy. Side by side in one run, per batch size:

  (a) transformers eager ``generate`` (dynamic cache; left-padded batch);
  (b) transformers ``generate(assistant_model=draft)``, its speculative decoding (bs 1 only);
  (c) transformers ``generate(cache_implementation="static")``, which on CUDA compiles the
      forward itself with ``mode="reduce-overhead"``: its CUDA-graph path (an error is recorded,
      not hidden; ``c_cudagraph_skips`` counts inductor's refusals to graph);
  (d) graphctl graphed decode (``HFEngine`` with ``draft_len`` 0, ``@graphed`` buckets);
  (e) graphctl speculative decode, ``draft_len`` 3 and 7, ``graphed_step(mode="unrolled")``;
  (f) the step of (e) captured by hand with ``torch.cuda.graph`` (same host work: the ids copy,
      the draft-table refresh), timed round robin with (e), for graphctl's own overhead.

Where the time goes: the graphed step of (e) under the profiler (a graph's kernels are reported
one by one), device time by kernel kind (switch, attention, GEMMs, gathers, other), kernels a
step and the ten costliest, next to the eager step's wall time. ``--compile`` compiles both
models (inductor, no cudagraphs) before graphctl captures them; ``--emulate-casts`` with it rounds
Inductor's bf16 intermediates as eager does, so the oracle's target and draft logits stay equal
(fused, the 16- and 2-layer graphs round differently and near-ties go the other way);
``--freezing`` with it lets Inductor fold the weights as constants (``freezing``), which concatenates the
GEMMs that share an input (q/k/v, gate/up) into one each: fewer launches a layer, at the cost of a copy of
those weights held by the compiled graphs.
``--device cpu`` is a smoke run of every path but (c) and (f) (use a ``tiny-*`` config). Decode
tokens/s excludes prefill (graphctl: ``generate``'s own decode timing; transformers: a run of
``--new`` tokens minus a run of 1), median of ``--reps`` runs.
Targets: (d) >= (c); (e, oracle) >= 3 x (b) at bs 1; (e) per step <= 1.05 x (f). Also per row: the
time to first token against transformers' eager prefill (``ttft_over_a``: the target's; ``ttft_over_a_both``:
target and draft, the work graphctl's prefill does), the host gap per step, the prefill graphed at
the batch's token bucket (whole and piecewise), and (e) through the sampled step of per-request
settings (issue 53: one graph, ``graphed_step(eng, sampling=True)``), every request at temperature
0.8, top-p 0.9 (``e{k}_sampled_overhead``: its ms a step over the greedy step's) and a mixed batch,
every other request greedy (``e{k}_mixed_overhead``); target <= 1.03 each; with PyTorch's filtering
(``GRAPHCTL_SAMPLING=reference``) and, ``_triton``, the Triton kernels (``auto``, the default).

    python bench/hf_speculative.py [--sizes 1 8 32] [--k 3 7] [--prompt 128] [--new 256] [--reps 5]
        [--paths graphctl a b c] [--compile [--emulate-casts] [--freezing]] [--json out.json]
    python bench/hf_speculative.py --device cpu --config tiny-llama --sizes 2 --prompt 8 --new 6 --reps 1
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

import graphctl
from graphctl import StaticInput
from graphctl.integrations.hf import HFEngine
from graphctl.integrations.hf.configs import hf_config
from graphctl.models import graphed_step


def _sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _hf_models(eng: HFEngine, name: str, device: str):
    """transformers' own models with the engine's weights: target (sdpa) and its 2-layer draft."""
    from transformers import AutoModelForCausalLM

    dtype = eng.target_layers.dtype
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="sdpa", dtype=dtype)
        dcfg = hf_config(name)
        dcfg.num_hidden_layers = 2
        draft = AutoModelForCausalLM.from_config(dcfg, attn_implementation="sdpa", dtype=dtype)
    target.load_state_dict(eng.target_layers.state_dict())
    draft.load_state_dict(eng.draft_layers.state_dict())
    return target.eval(), draft.eval()


def _hf_decode_tps(fn, bs: int, new: int, reps: int) -> tuple[float, float]:
    """(decode tokens/s, prefill ms) of a transformers generate call ``fn(max_new_tokens)``: a run
    of ``new`` tokens minus a run of 1 (the prefill, whose time is the second value), medians of
    ``reps``."""
    fn(2)
    samples, first = [], []
    for _ in range(reps):
        t0 = _sync()
        fn(1)
        t1 = _sync()
        fn(new)
        t2 = _sync()
        samples.append((t2 - t1) - (t1 - t0))
        first.append(1e3 * (t1 - t0))
    return bs * (new - 1) / statistics.median(samples), statistics.median(first)


def _graphctl_tps(eng: HFEngine, ps, new: int, forward, reps: int, **kw) -> tuple[float, float, float, float]:
    """(decode tokens/s, ms a step, mean accepted, prefill ms) of ``eng.generate`` through
    ``forward`` (``kw``: its sampling settings), from its own timing (decode excludes the
    prefill), medians of ``reps`` runs."""
    eng.generate(ps, min(new, 8), forward=forward, **kw)  # capture and warm up
    runs = [eng.generate(ps, new, forward=forward, **kw) for _ in range(reps)]
    res = sorted(runs, key=lambda r: r.decode_s)[len(runs) // 2]
    toks = sum(len(t) for t in res.tokens) - len(ps)  # the prefill's first token is not decode's
    prefill = 1e3 * statistics.median(r.prefill_s for r in runs)
    return toks / res.decode_s, 1e3 * res.decode_s / max(res.steps, 1), res.mean_accepted, prefill


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


def _step_ms(fns: dict, reps: int = 30) -> dict[str, float]:
    """Median ms of one call of each of ``fns`` (name -> zero-argument callable), in a fresh random
    order each repeat (issue 54: a fixed round-robin order hands one variant the slot after the
    other every time, the confound ``hf_decode`` had), so drift of the host or clocks and the
    position after another variant reach every variant alike."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for _ in range(reps):
        _RNG.shuffle(order)
        for name in order:
            t0 = _sync()
            fns[name]()
            ts[name].append(1e3 * (_sync() - t0))
    return {k: statistics.median(v) for k, v in ts.items()}


_RNG = random.Random()  # the timing order's: fresh each run (not the model's or the prompts' seed)


_KINDS = (("switch", ("swap_copy", "token_to_request", "loop_condition")),
          ("attention", ("flash", "fmha", "attention", "softmax", "sdpa")),
          ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet")),
          ("gather/scatter", ("index", "gather", "scatter")))


def breakdown(step, eager, calls: int = 3) -> dict:
    """Where one step's device time goes: the graphed ``step()`` under the profiler (the graph's
    kernels are reported one by one), µs a call by kernel kind, the ten costliest kernels, and
    the wall time of one ``eager()`` step for comparison (the same kernels, launched from Python)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    eager()
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = _sync()
    eager()
    eager_wall = _sync() - t0
    with profile(activities=acts) as prof:
        for _ in range(calls):
            step()
        _sync()
    out: dict = {k: 0.0 for k, _ in _KINDS}
    out["other"] = 0.0
    by_name = []
    for ev in prof.key_averages():
        dev = ev.self_device_time_total / calls
        if dev <= 0:
            continue
        name = ev.key.lower()
        kind = next((k for k, words in _KINDS if any(w in name for w in words)), "other")
        out[kind] += dev
        by_name.append((dev, ev.count // calls, ev.key[:90]))
    out["device_total"] = sum(out.values())
    out["kernels_per_step"] = sum(c for _, c, _ in by_name)
    out["eager_wall"] = eager_wall * 1e6
    out["top"] = [f"{dev:.0f} us x{c}: {name}" for dev, c, name in sorted(by_name, reverse=True)[:10]]
    return out


def _row(rows: list[dict], row: dict, path: str | None, head: dict) -> None:
    """Print a finished row and rewrite the JSON, so a run cut short keeps what it measured."""
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump({"hardware": head, "rows": rows}, f, indent=2)


def _graphctl_variant(row: dict, eng: HFEngine, ps, buckets, args, g: torch.Generator) -> None:
    """(d) for ``draft_len`` 0, else (e) and (f) with the breakdown, into ``row``."""
    k, bs, cuda = eng.k, len(ps), args.device == "cuda"
    if args.compile:  # compile every shape of the buckets eagerly, before graphctl captures
        for warm in (ps, ps[:1]):
            eng.generate(warm, 2)
    if k == 0:
        fwd = graphctl.graphed(eng.decode_step, buckets=buckets, state=eng.state, inputs=[StaticInput(
            "input_ids")], progress=False, params=eng.named_tensors())
        tps, ms, _, row["ttft_ms"] = _graphctl_tps(eng, ps, args.new, fwd, args.reps)
        row["d_graphctl_decode_tps"], row["d_ms_per_step"] = tps, ms
        row["d_uncompiled"] = fwd.report().uncompiled  # compiled frames that ran uncompiled in a capture
        ids = torch.randint(0, eng.cfg.vocab, (bs,), generator=g).to(eng.device)
        eng.meta.prepare(eng.state, torch.ones(bs, dtype=torch.int32),
                         torch.full((bs,), args.prompt + 1, dtype=torch.int32))
        row["d_graphed_step_ms"] = _step_ms({"graphctl": lambda: fwd(ids, eng.meta)})["graphctl"]
        # the decode step's kernels (the k = 0 target: GEMMs against the weight read, and the gaps)
        row["d_breakdown_us"] = breakdown(lambda: fwd(ids, eng.meta), lambda: eng.decode_step(ids, eng.meta))
        # what generate adds between two graphed steps: its host work while the device idles
        row["d_host_gap_ms"] = ms - row["d_graphed_step_ms"]
        # the prefill graphed at the batch's token bucket (issue 33): attention in the graph, and piecewise
        # (each layer's attention an eager region) against the eager prefill (ttft_ms above)
        tokens = min(sum(len(p) for p in ps), eng.meta.max_tokens)
        for name, pw in (("graphed", False), ("piecewise", True)):
            try:
                pre = eng.graphed_prefill([tokens], backend="cuda" if cuda else "emulated", piecewise=pw)
                eng.generate(ps, 2, prefill=pre)  # capture
                row[f"prefill_{name}_ms"] = 1e3 * statistics.median(
                    eng.generate(ps, 1, prefill=pre).prefill_s for _ in range(args.reps))
                row[f"prefill_{name}_speedup"] = row["ttft_ms"] / row[f"prefill_{name}_ms"]
                del pre
            except Exception as exc:  # recorded, not hidden
                row[f"prefill_{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return
    fwd = graphed_step(eng, "unrolled", buckets=buckets)
    tps, ms, acc, _ = _graphctl_tps(eng, ps, args.new, fwd, args.reps)
    row[f"e{k}_graphctl_spec_tps"], row[f"e{k}_ms_per_step"], row[f"e{k}_mean_accepted"] = tps, ms, acc
    # issue 53: the sampled step, one graph for every setting (per-request settings on the metadata), all requests
    # at temperature 0.8, top-p 0.9 (the oracle draft still matches the target), and a mixed batch (every other
    # request greedy); with PyTorch's filtering and with the Triton kernels (GRAPHCTL_SAMPLING=auto, the default)
    mixed = [0.8 if i % 2 else 0.0 for i in range(bs)]
    for tag, choice in (("", "reference"), ("_triton", "auto")):
        with graphctl.knobs.scope(sampling=choice):
            sampled = graphed_step(eng, "unrolled", buckets=buckets, sampling=True)
            for name, temps in (("sampled", 0.8), ("mixed", mixed)):
                _, ms_s, acc_s, _ = _graphctl_tps(eng, ps, args.new, sampled, args.reps, temperature=temps,
                                                  top_p=0.9, seed=0)
                row[f"e{k}_{name}{tag}_ms_per_step"], row[f"e{k}_{name}{tag}_mean_accepted"] = ms_s, acc_s
                row[f"e{k}_{name}{tag}_overhead"] = ms_s / ms  # target <= 1.03
        del sampled
    row[f"e{k}_uncompiled"] = fwd.report().uncompiled
    ids = torch.randint(0, eng.cfg.vocab, (bs * (k + 1),), generator=g).to(eng.device)
    eng.meta.prepare(eng.state, torch.full((bs,), k + 1, dtype=torch.int32),
                     torch.full((bs,), args.prompt + k + 1, dtype=torch.int32))
    fns = {"graphctl": lambda: fwd(ids, eng.meta)}
    if cuda:
        hand = _hand_step(eng, bs)
        fns["hand"] = lambda: hand(ids)
    ms_by = _step_ms(fns)
    row[f"e{k}_graphctl_step_ms"] = ms_by["graphctl"]
    row[f"e{k}_host_gap_ms"] = ms - ms_by["graphctl"]
    if cuda:
        row[f"f{k}_hand_step_ms"] = ms_by["hand"]
        row[f"e{k}_over_hand"] = ms_by["graphctl"] / ms_by["hand"]
    row[f"e{k}_breakdown_us"] = breakdown(lambda: fwd(ids, eng.meta), lambda: eng.step(ids, eng.meta))
    if args.compile:
        from torch._dynamo.utils import counters

        row["compile_unique_graphs"] = counters["stats"].get("unique_graphs", 0)
        row["compile_graph_breaks"] = sum(counters["graph_break"].values())
        # every Inductor pattern rewrite, freezing's GEMM concatenations among them (compare runs with and without)
        row["compile_pattern_matches"] = counters["inductor"].get("pattern_matcher_count", 0)


def run(args, head: dict) -> list[dict]:
    dev, cuda = args.device, args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows: list[dict] = []
    g = torch.Generator().manual_seed(0)
    ctx = args.prompt + args.new + 2 * 8 + 2
    base = HFEngine.build(hf_config(args.config), draft_len=0, max_seqs=1, max_context=ctx, device=dev,
                          dtype=dtype, seed=0)
    target, draft = base.target_layers, base.draft_layers  # one set of weights for every engine
    tgt, drf = _hf_models(base, args.config, dev)
    if args.compile:  # inductor-fused kernels inside graphctl's graphs (no cudagraphs of its own)
        # the oracle's contract is bitwise-equal target and draft logits; fused, Inductor keeps bf16
        # intermediates in float32 where eager rounds them, differently in the 16- and 2-layer graphs
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = args.emulate_casts
        inductor_config.freezing = args.freezing  # read before per-compile options apply: global here
        for m in (target, draft):
            m.forward = torch.compile(m.forward, dynamic=False)
    vocab = target.config.vocab_size
    for bs in args.sizes:
        ps = [torch.randint(0, vocab, (args.prompt,), generator=g) for _ in range(bs)]
        row: dict = {"bs": bs}
        rows.append(row)
        buckets = sorted({1, bs})
        for k in (0, *args.k) if "graphctl" in args.paths else ():
            eng = HFEngine(target, draft, draft_len=k, max_seqs=bs, max_context=ctx, block_size=16)
            try:
                _graphctl_variant(row, eng, ps, buckets, args, g)
            except Exception as exc:  # recorded, not hidden (a compiled model under capture, say)
                row[f"k{k}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            del eng
            if cuda:
                torch.cuda.empty_cache()
        batch = torch.stack(ps).to(dev)

        def hf(n_new, **kw):
            with torch.no_grad():
                tgt.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, pad_token_id=0, **kw)

        if "a" in args.paths:
            row["a_hf_eager_tps"], row["a_hf_prefill_ms"] = _hf_decode_tps(hf, bs, args.new, args.reps)
            if "ttft_ms" in row:  # time to first token: graphctl's one ragged pass vs transformers' eager
                row["ttft_over_a"] = row["ttft_ms"] / row["a_hf_prefill_ms"]

                def draft_prefill() -> None:  # the same prompts through the draft: what speculation prefills too
                    with torch.no_grad():
                        drf(input_ids=batch, attention_mask=torch.ones_like(batch), logits_to_keep=1)

                draft_prefill()
                row["a_hf_draft_prefill_ms"] = _step_ms({"draft": draft_prefill}, args.reps)["draft"]
                # graphctl's prefill fills both caches: against transformers' prefill of both models
                row["ttft_over_a_both"] = row["ttft_ms"] / (row["a_hf_prefill_ms"] + row["a_hf_draft_prefill_ms"])
        if bs == 1 and "b" in args.paths:
            try:
                row["b_hf_assisted_tps"], _ = _hf_decode_tps(lambda n: hf(n, assistant_model=drf), bs, args.new,
                                                             args.reps)
            except Exception as exc:  # recorded, not hidden
                row["b_hf_assisted_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if cuda and "c" in args.paths:
            # transformers' own CUDA-graph path: with a static cache on CUDA, generate compiles the
            # forward itself (CompileConfig: mode="reduce-overhead"). Compiling model.forward by hand
            # on top of that crashed in the first H200 run (recorded in bench/RESULTS.md).
            from torch._dynamo.utils import counters

            skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
            try:
                t0 = time.perf_counter()
                hf(2, cache_implementation="static")
                row["c_first_call_s"] = time.perf_counter() - t0  # compiles and captures
                row["c_hf_static_compiled_tps"], _ = _hf_decode_tps(
                    lambda n: hf(n, cache_implementation="static"), bs, args.new, args.reps)
            except Exception as exc:
                row["c_hf_static_compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["c_cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0) - skips
        for key, over in (("d_over_c", ("d_graphctl_decode_tps", "c_hf_static_compiled_tps")),
                          *((f"e{k}_over_b", (f"e{k}_graphctl_spec_tps", "b_hf_assisted_tps")) for k in args.k)):
            if over[0] in row and over[1] in row:
                row[key] = row[over[0]] / row[over[1]]
        _row(rows, row, args.json, head)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[3, 7], help="draft lengths of (e)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5, help="repeats of each tokens/s reading (median)")
    ap.add_argument("--config", default="llama-1b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke run of every path but (c) and (f), which need CUDA graphs")
    ap.add_argument("--paths", nargs="+", default=["graphctl", "a", "b", "c"], choices=["graphctl", "a", "b", "c"],
                    help="which to run: graphctl's (d, e, f), transformers' eager (a), assisted (b), compiled (c)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile (inductor, no cudagraphs) both models before graphctl captures them")
    ap.add_argument("--emulate-casts", action="store_true",
                    help="with --compile: Inductor rounds bf16 intermediates as eager does "
                         "(emulate_precision_casts), so the oracle draft's logits stay the target's")
    ap.add_argument("--freezing", action="store_true",
                    help="with --compile: Inductor folds the weights (freezing): q/k/v and gate/up GEMMs concatenated")
    ap.add_argument("--json")
    args = ap.parse_args()
    import transformers

    torch._dynamo.config.cache_size_limit = 64  # (c) recompiles per batch size and cache shape
    gpu = torch.cuda.get_device_properties(0).name if args.device == "cuda" else "cpu"
    head = {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "config": args.config, "prompt": args.prompt, "new": args.new, "reps": args.reps, "compile": args.compile,
            "emulate_casts": args.emulate_casts, "freezing": args.freezing,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(head), flush=True)
    run(args, head)


if __name__ == "__main__":
    main()
