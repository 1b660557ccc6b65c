"""Multi-process scenarios for tensor-parallel capture (tests/distributed on gloo in CI;
tests/cuda on NCCL where two GPUs are lent). One spawn runs every scenario on every rank and
saves what each rank saw; the tests assert on all ranks' results."""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import graphctl
from graphctl import StaticInput


def _bitwise(state) -> dict[str, torch.Tensor]:
    return {n: state.tensor(n).detach().clone() for n in state.addresses()}


def scenario_bucket_agreement(rank: int, backend: str, device: str) -> dict:
    """Rank 0 has 3 requests, rank 1 has 6: both must replay bucket 8, whose all-reduce needs
    equal shapes on every rank."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4, 4, generator=g).to(device)

    def fwd(x):
        y = x @ w
        dist.all_reduce(y)
        return y

    f = graphctl.graphed(fwd, buckets=[1, 2, 4, 8], backend=backend, progress=False, inputs=["x"],
                         group=dist.group.WORLD)
    n = 3 if rank == 0 else 6
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + rank)).to(device)
    f.capture_all(x, )
    got = f(x[:n]).clone()
    padded = torch.zeros_like(x)
    padded[:n] = x[:n]
    want = fwd(padded)[:n]  # eager, every rank at 8 rows
    replays = {b.bucket: b.replays for b in f.report().buckets}
    return {"equal": bool(torch.allclose(got, want, atol=1e-5)), "replays": replays, "n": n}


def scenario_fallback_agreement(rank: int, backend: str, device: str) -> dict:
    """Rank 1's batch is larger than every bucket: both ranks run eagerly, each says why."""
    f = graphctl.graphed(lambda x: x * 2, buckets=[2, 4, 8], backend=backend, progress=False, inputs=["x"],
                         fallback="eager", group=dist.group.WORLD)
    f.capture_all(torch.ones(8, 3, device=device))
    n = 2 if rank == 0 else 12
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    out = f(x)
    return {"equal": bool(torch.equal(out, x * 2)), "fallbacks": dict(f.report().fallbacks),
            "replays": sum(b.replays for b in f.report().buckets)}


def scenario_refresh_fails_on_one_rank(rank: int, backend: str, device: str) -> dict:
    """The draft twin's refresh source is broken on rank 1 only: every rank restores and raises,
    no rank replays; with the source fixed, the next call replays on both."""
    from support.graphs import Toy

    toy = Toy(device, torch.Generator().manual_seed(5), backend=backend)
    f = graphctl.graphed(
        toy._forward,
        buckets=[4, 8],
        state=toy.state,
        backend=backend,
        progress=False,
        inputs=[StaticInput("tokens", per_item=toy.k + 1), StaticInput("positions", per_item=toy.k + 1)],
        group=dist.group.WORLD,
    )
    tokens, positions = toy.batch(3)
    f.capture_all(tokens, positions, toy.meta)
    mgr = toy.meta.draft_kv_cache_manager
    good = mgr.pool_indices
    if rank == 1:
        mgr.pool_indices = good[:, :1]  # a refresh source of the wrong shape
    before = _bitwise(toy.state)
    replays_before = sum(b.replays for b in f.report().buckets)
    try:
        f(tokens, positions, toy.meta)
        raised = ""
    except graphctl.SwitchError as exc:
        raised = str(exc)
    after = _bitwise(toy.state)
    restored = all(torch.equal(before[n], after[n]) for n in before)
    mgr.pool_indices = good
    replays_mid = sum(b.replays for b in f.report().buckets)
    out = f(tokens, positions, toy.meta)
    return {"raised": raised, "restored": restored, "replayed_while_failing": replays_mid - replays_before,
            "recovered": bool(torch.isfinite(out[0]).all()),
            "poisoned": toy.state.poisoned}


def scenario_tp_engine(rank: int, backend: str, device: str) -> dict:
    """TP=2 reference engine (column/row-parallel MLP, an all-reduce per layer inside the graph):
    drafts and acceptance equal the single-process engine's; the audit is clean per rank."""
    from graphctl.models import EngineConfig, MTPEngine
    from support.engine import STEPS

    cfg = EngineConfig(draft_len=3, max_seqs=8, seed=21)
    prompts_seed = 4

    def run(eng, fwd):
        drafts = []

        def step(ids, m):
            out = fwd(ids, m)
            drafts.append(out.drafts.to("cpu", copy=True))
            return out

        hist = eng.generate(eng.prompts(5, torch.Generator().manual_seed(prompts_seed)), STEPS, forward=step)
        return hist, drafts

    tp = MTPEngine(cfg, device=device, tp_group=dist.group.WORLD)
    f = graphctl.graphed(tp.step, buckets=[2, 4, 8], state=tp.state, backend=backend, progress=False,
                         inputs=[StaticInput("input_ids", per_item=4)], group=dist.group.WORLD,
                         params=tp.named_tensors())
    hist, drafts = run(tp, f)
    solo = MTPEngine(cfg, device=device)
    want_hist, want_drafts = run(solo, solo.step)
    audits = f.audit()
    return {"acceptance": [h.tolist() for h in hist], "same_as_solo": [h.tolist() for h in hist] ==
            [h.tolist() for h in want_hist] and all(torch.equal(a, b) for a, b in zip(drafts, want_drafts)),
            "audit_errors": [str(x) for a in audits.values() for x in a.errors],
            "w1_cols": tp.target_layers[0].w1.shape[1], "per_step": _per_step_ok(cfg, device, backend)}


def _per_step_ok(cfg, device, backend) -> bool:
    from graphctl.models import MTPEngine, graphed_step

    eng = MTPEngine(cfg, device=device, tp_group=dist.group.WORLD)
    fwd = graphed_step(eng, "per_step", buckets=(8,), backend=backend)
    hist = eng.generate(eng.prompts(5, torch.Generator().manual_seed(4)), 3, forward=fwd)
    return all(bool((h == cfg.draft_len + 1).all()) for h in hist[1:])


SCENARIOS = {"bucket_agreement": scenario_bucket_agreement, "fallback_agreement": scenario_fallback_agreement,
             "refresh_fails_on_one_rank": scenario_refresh_fails_on_one_rank, "tp_engine": scenario_tp_engine}


def worker(rank: int, world: int, init_file: str, out_dir: str, dist_backend: str, graph_backend: str,
           timeout_s: float) -> None:
    device = "cpu"
    if dist_backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    out = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(dist_backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the test skips, naming why this rank could not join
        torch.save({"cannot_start": f"rank {rank}: {type(exc).__name__}: {exc}"}, out)
        return
    results = {}
    try:
        for name, fn in SCENARIOS.items():
            try:
                results[name] = fn(rank, graph_backend, device)
            except Exception as exc:  # keep going: the test names the scenario that failed
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            dist.barrier()
    finally:
        torch.save(results, out)
    dist.barrier()  # every rank saved: nothing is in flight when the group goes
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: under load a gloo thread still winding down when static
    # destructors run aborted the rank ("terminate called without an active exception", SIGABRT) after
    # its results were saved, and the spawn's join turned that into ~100 lines of error.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RanksFailed(RuntimeError):
    """The ranks did not all finish: the reason in a line or two, not the spawn's tracebacks."""


def _last_lines(exc: BaseException, n: int = 3) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


def run_all(world: int = 2, dist_backend: str = "gloo", graph_backend: str = "emulated",
            timeout_s: float = 300.0) -> list[dict]:
    """Spawn ``world`` ranks, run every scenario, return each rank's results. A rank that cannot
    join the group returns ``{"cannot_start": why}``; ranks that raise, die or outlive
    ``timeout_s`` raise :class:`RanksFailed` with the reason in a line (the survivors killed)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        ctx = mp.spawn(worker, args=(world, init, d, dist_backend, graph_backend, timeout_s), nprocs=world,
                       join=False)
        deadline = time.monotonic() + timeout_s
        problem = None
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    problem = f"the ranks were still running after {timeout_s:.0f} s"
                    break
        except mp.ProcessException as exc:  # a rank raised or died (a signal)
            problem = _last_lines(exc)
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        paths = [os.path.join(d, f"rank{r}.pt") for r in range(world)]
        got = [torch.load(pth) if os.path.exists(pth) else None for pth in paths]
        if all(g is not None for g in got):
            return got  # every rank saved what it saw (a rank dying after that lost nothing)
        raise RanksFailed(f"{dist_backend} ranks: {problem or 'a rank exited without results'}; "
                          f"results from ranks {[r for r, g in enumerate(got) if g is not None]}")
