"""Re-pointing captured graphs at moved buffers vs capturing them again (issue 19).

The reference MTP engine (``graphctl capture``'s built-in target) graphed at buckets 1..64;
every declared buffer of its metadata is reallocated (same layout and values, as a grown pool
or a reallocated block table is) and the object bound again. Side by side in one run, median
of ``--repeats``: (a) ``runner.repoint(new_state)``, rewriting the addresses in every graph;
(b) ``runner.reset()`` and ``capture_all`` again (what peers do). After (a) the replay equals
eager and the audit is clean, checked once.

    python bench/repoint.py [--repeats 5] [--max-batch 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import graphctl
from graphctl.graphs import StaticInput
from graphctl.models.mtp import EngineConfig, MTPEngine


def _moved_state(eng) -> graphctl.BoundState:
    m = eng.meta
    for name in list(eng.state.plan.buffers):
        old = getattr(m, name, None)
        if isinstance(old, torch.Tensor):
            fresh = torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device=old.device,
                                        pin_memory=old.is_pinned() if old.device.type == "cpu" else False)
            setattr(m, name, fresh.copy_(old))
    m.kv_lens_runtime = m.kv_lens[: m.kv_lens.numel()]
    return graphctl.bind(m, registry=eng.registry)


def run(repeats: int, max_batch: int, device: str) -> dict:
    eng = MTPEngine(EngineConfig(max_seqs=max_batch), device=device)
    k1 = eng.k + 1
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max_batch]
    g = torch.Generator().manual_seed(0)
    eng.meta.prepare(eng.state, torch.full((max_batch,), k1, dtype=torch.int32),
                     torch.randint(k1 + 1, eng.cfg.max_context - 2 * k1, (max_batch,), generator=g, dtype=torch.int32))
    ids = torch.randint(0, eng.cfg.vocab, (max_batch * k1,), generator=g).to(device)
    step = graphctl.graphed(eng.step, buckets=buckets, inputs=[StaticInput("input_ids", per_item=k1)],
                            state=eng.state, params=eng.named_tensors(), progress=False)
    step.capture_all(ids, eng.meta)
    times: dict[str, list[float]] = {"repoint": [], "recapture": []}
    nodes, findings = 0, None
    for _ in range(repeats):
        new = _moved_state(eng)
        eng.state = new
        torch.cuda.synchronize() if device == "cuda" else None
        t0 = time.perf_counter()
        done = step.repoint(new)
        times["repoint"].append(time.perf_counter() - t0)
        nodes = sum(done.values())
        got = step(ids, eng.meta)
        want = eng.step(ids, eng.meta)
        assert torch.equal(got.drafts, want.drafts) and torch.equal(got.accepted, want.accepted)
        if findings is None:  # the audit of the re-pointed graphs (no old address left, nothing dangling)
            findings = [str(f) for a in step.audit().values() for f in a.findings]
        t0 = time.perf_counter()
        step.reset()
        step.capture_all(ids, eng.meta)
        times["recapture"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "buckets": buckets, "repoint_s": med["repoint"], "recapture_s": med["recapture"],
            "speedup": med["recapture"] / med["repoint"], "rewritten": nodes, "audit_findings": findings,
            "all": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    r = run(args.repeats, args.max_batch, device)
    print(f"repoint: {r['device']}, torch {r['torch']}, reference engine, buckets {r['buckets']}, "
          f"median of {args.repeats}")
    print(f"re-point all buckets {r['repoint_s'] * 1e3:.1f} ms ({r['rewritten']} nodes/tensors rewritten); "
          f"reset + capture_all {r['recapture_s'] * 1e3:.1f} ms; recapture / re-point {r['speedup']:.1f}x; "
          f"audit after re-point: {len(r['audit_findings'])} findings")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(r, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
