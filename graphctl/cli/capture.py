"""``graphctl capture [TARGET]``: capture a forward at every bucket and say, at a glance, what
each graph costs, whether it equals eager, and whether its addresses and segments are sound.

Exit codes: 0 clean; 1 a verify mismatch or an audit error; 3 a batch size that no graph
served under ``--hard-fail-on-fallback``; 2 bad options or a TARGET that cannot be loaded
(argparse's own code for usage errors).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from typing import Any

import torch

import graphctl
from graphctl.cli.target import load_target
from graphctl.errors import CaptureError, GraphctlError

__all__ = ["run_capture", "derive_buckets", "coverage_rows", "SCHEMA"]

SCHEMA = "graphctl.capture/1"
BUILTIN = "graphctl.cli.builtin:capture_target"
HF_TARGET = "graphctl.cli.hf_target:capture_target"  # --hf-config


def derive_buckets(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch``, and ``max_batch`` itself: batch items (requests); the
    token rows of each bucket are ``bucket * (1 + k)``, so every bucket is a whole number of
    draft-step layouts."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def coverage_rows(served: dict[int, str], per_item: int) -> list[dict[str, Any]]:
    """Consecutive batch sizes served alike, as ``{"batch": "3-4", "served_by": ..., "tokens":
    ..., "padding": worst fraction of padded rows}`` rows."""
    rows: list[dict[str, Any]] = []
    for n in sorted(served):
        how = served[n]
        if rows and rows[-1]["served_by"] == how and rows[-1]["hi"] == n - 1:
            rows[-1]["hi"] = n
            continue
        rows.append({"lo": n, "hi": n, "served_by": how})
    for r in rows:
        r["batch"] = str(r["lo"]) if r["lo"] == r["hi"] else f"{r['lo']}-{r['hi']}"
        bucket = int(r["served_by"].split()[1]) if r["served_by"].startswith("bucket ") else None
        r["tokens"] = bucket * per_item if bucket else None
        r["padding"] = 1 - r["lo"] / bucket if bucket else None
    return rows


def _device_header(backend: str) -> dict[str, Any]:
    from graphctl.cli.info import gpus

    head: dict[str, Any] = {"graphctl": graphctl.__version__, "python": platform.python_version(),
                            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "backend": backend}
    g = gpus()
    if torch.cuda.is_available() and isinstance(g, list) and g:
        idx = torch.cuda.current_device()
        head["device"] = g[idx] if idx < len(g) else g[0]
    else:
        head["device"] = {"name": "no CUDA device: emulated graphs on the CPU",
                          "detail": g if isinstance(g, str) else "torch.cuda.is_available() is False"}
    return head


def _header_text(head: dict[str, Any]) -> str:
    d = head["device"]
    if "compute_capability" in d:
        dev = (f"{d['name']} (sm {d['compute_capability']}, {d['memory_gib']} GiB, SM clock {d.get('sm_clock_now_mhz')}"
               f"/{d['sm_clock_mhz']} MHz, driver {d['driver']})")
    else:
        dev = f"{d['name']} ({d['detail']})"
    return (f"device: {dev}\ntorch {head['torch']} (CUDA {head['torch_cuda']}), python {head['python']}, "
            f"graphctl {head['graphctl']}, backend {head['backend']}")


def _table(report, verify: dict[int, list], audits: dict[int, Any], per_item: int):
    from rich.table import Table

    t = Table(title=f"{report.function}: {report.backend} graphs")
    for col in ("bucket", "tokens", "capture ms", "pool MiB", "nodes", "replay us", "eager us", "speedup", "verify",
                "audit"):
        t.add_column(col, justify="right")
    for b in report.buckets:
        speed = f"{b.eager_us / b.replay_us:.2f}x" if b.replay_us and b.eager_us else "-"
        vs = verify.get(b.bucket)
        v = "-" if vs is None else ("ok" if all(r.ok for r in vs) else "[red]MISMATCH")
        a = audits.get(b.bucket)
        au = "-" if a is None else (f"[red]{len(a.errors)} err[/] {len(a.warnings)} warn" if a.errors else
                                    f"[yellow]{len(a.possible)} possible[/]" if a.possible else
                                    "clean" if not a.warnings else f"{len(a.warnings)} warn")
        t.add_row(str(b.bucket), str(b.bucket * per_item), f"{b.capture_ms:.1f}", f"{b.pool_bytes / 2**20:.2f}",
                  str(b.nodes), _num(b.replay_us), _num(b.eager_us), speed, v, au)
    return t


def _coverage_table(rows: list[dict[str, Any]]):
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="coverage: which batch sizes each bucket serves")
    for col in ("batch", "served by", "tokens", "worst padding"):
        t.add_column(col, justify="right")
    for r in rows:
        pad = "-" if r["padding"] is None else f"{100 * r['padding']:.0f}%"
        how = r["served_by"] if r["served_by"].startswith("bucket") else f"[red]{escape(r['served_by'])}"
        t.add_row(r["batch"], how, "-" if r["tokens"] is None else str(r["tokens"]), pad)
    return t


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _dot_of_nodes(nodes, segments) -> str:
    """A DOT chain of an emulated graph's ops, one cluster per segment (CUDA graphs use
    ``cudaGraphDebugDotPrint`` instead)."""
    lines = ["digraph graphctl {", "  rankdir=TB; node [shape=box, fontsize=10];"]
    for s in segments:
        lines.append(f'  subgraph "cluster_{s.name}" {{ label="{s.name}";')
        lines += [f'    n{i} [label="{i}: {nodes[i].name}"];' for i in range(s.start, min(s.end, len(nodes)))]
        lines.append("  }")
    lines += [f"  n{i} -> n{i + 1};" for i in range(len(nodes) - 1)]
    return "\n".join(lines + ["}"]) + "\n"


def _plot(path: str, report) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [b.bucket for b in report.buckets]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(bs, [b.replay_us or float("nan") for b in report.buckets], "o-", label="graph replay")
    ax1.plot(bs, [b.eager_us or float("nan") for b in report.buckets], "s--", label="eager")
    ax1.set(xscale="log", yscale="log", xlabel="bucket (batch items)", ylabel="median latency (us)",
            title="latency per bucket")
    ax1.set_xticks(bs, [str(b) for b in bs])
    ax1.legend()
    ax2.bar([str(b) for b in bs], [b.pool_bytes / 2**20 for b in report.buckets])
    ax2.set(xlabel="bucket (batch items)", ylabel="MiB", title="pool memory added by each capture")
    fig.suptitle(f"{report.function} ({report.backend}, {report.device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _unwritable(args) -> str | None:
    """Why an output path cannot be written, checked before any work starts (capturing a large
    engine and then failing at the last step on a typo'd directory costs minutes)."""
    for opt, path, is_dir in (("--json", args.json, False), ("--plot", args.plot, False), ("--dot", args.dot, True)):
        if not path:
            continue
        if is_dir:
            if os.path.exists(path) and not os.path.isdir(path):
                return f"{opt} {path}: exists and is not a directory"
            parent = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        else:
            if os.path.isdir(path):
                return f"{opt} {path}: is a directory, expected a file path"
            parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return f"{opt} {path}: directory {parent} does not exist"
        if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            return f"{opt} {path}: not writable"
    return None


def run_capture(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    con = Console(width=max(100, Console().width), soft_wrap=True)  # findings stay on one line: grep-able
    backend = args.backend
    if backend == "cuda" and not torch.cuda.is_available():
        con.print("[red]graphctl capture: --backend cuda needs a CUDA device; use --backend emulated or auto")
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            con.print(
                f"[red]graphctl capture: --plot needs matplotlib ({exc}): pip install 'graphctl[plot]', or drop --plot"
            )
            return 2
    bad = _unwritable(args)
    if bad:
        con.print(f"[red]graphctl capture: {escape(bad)}")
        return 2
    use_cuda = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    device = "cuda" if use_cuda else "cpu"
    # The factory's example holds max_batch items: every batch size up to it must be served.
    max_batch = args.max_batch or (max(args.buckets) if args.buckets else 64)
    buckets = args.buckets or derive_buckets(max_batch)
    if args.hf_config and args.target:
        con.print("[red]graphctl capture: give a TARGET or --hf-config, not both")
        return 2
    if args.compile and not args.hf_config:
        con.print("[red]graphctl capture: --compile applies to --hf-config models; compile your own TARGET's "
                  "forward in its factory (torch.compile, mode='default')")
        return 2
    spec, extra = ((HF_TARGET, {"hf_config": args.hf_config, "compile": args.compile}) if args.hf_config
                   else (args.target or BUILTIN, {}))
    try:
        target = load_target(spec, device=device, max_batch=max_batch, draft_len=args.draft_len, **extra)
    except GraphctlError as exc:
        con.print(f"[red]graphctl capture: {escape(str(exc))}")
        return 2
    head = _device_header("cuda" if use_cuda else "emulated")
    con.print(_header_text(head))
    con.print(escape(f"target: {target.name or args.target or BUILTIN}; buckets {buckets}"))
    runner = graphctl.GraphRunner(target.forward, buckets=buckets, state=target.state, inputs=target.inputs,
                                  backend="cuda" if use_cuda else "emulated", fallback="eager", params=target.params,
                                  progress=args.progress)
    try:
        runner.capture_all(*target.example)
    except CaptureError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        bucket = getattr(exc, "bucket", None)
        where = f"bucket {bucket}" if bucket is not None else "capture"
        con.print(f"[red]graphctl capture: {escape(where)} failed: {escape(f'{type(cause).__name__}: {cause}')}"
                  + ("" if args.traceback else " (--traceback for the full one)"))
        if args.traceback:
            con.print_exception()
        return 1
    runner.measure(iters=args.iters)
    verify: dict[int, list] = {}
    if args.verify:
        for r in runner.verify(gen=torch.Generator().manual_seed(args.seed)):
            verify.setdefault(r.bucket, []).append(r)
    audits = runner.audit(confirm=args.audit == "confirm") if args.audit else {}
    served = runner.coverage(range(1, max_batch + 1))
    rows = coverage_rows(served, target.per_item)
    report = runner.report()
    con.print(_table(report, verify, audits, target.per_item))
    if not use_cuda:
        con.print("emulated graphs re-run every recorded op from Python: replay is not faster than eager here; "
                  "the timing columns mean something on CUDA")
    con.print(_coverage_table(rows))
    for z in report.padding_hazards:  # padded input rows indexing a write into lasting state
        con.print(escape(f"padding hazard: padded rows of input '{z['input']}' index {z['op']} into {z['target']} "
                         f"at {z['where']}: pad with a sentinel the write skips, or a scratch slot"))
    for u in report.unreached:  # read from before the forward ran, through no path graphctl checks
        con.print(escape(f"reached by no path: a {u['dtype']} tensor {list(u['shape'])} on {u['device']} read by "
                         f"{u['op']} at {u['where']}: declare it or keep it where the forward's arguments reach"))
    for h in report.host_changes:  # host values the warmups and capture changed (graphs/hoststate.py)
        con.print(escape(f"host state changed by warmup/capture ({h['policy']}): {h['path']} {h['before']!r} -> "
                         f"{h['after']!r}"))
    if report.compiled:
        con.print(escape(report.compile_summary))
        line = f"compiled frames run uncompiled: {report.uncompiled}"
        con.print(f"[red]{line}" if report.uncompiled else line)
    if report.bypassed:
        con.print(f"[yellow]the last {report.eager_streak} calls all ran eagerly: the graphs are bypassed")
    for e in report.side_effects:  # what the forward writes that graphctl does not own
        con.print(escape(f"side effect ({e['policy']}): {e['path']} ({e['nbytes']:,} B) written by {e['op']} "
                         f"at {e['where']}"))
    for rs in verify.values():
        for r in rs:
            if not r.ok:
                con.print(f"[red]verify: {escape(str(r))}")
            elif r.write is not None:  # a write that differs from eager: a padded lane, unless it is scratch
                con.print(f"[yellow]verify: {escape(str(r))}")
    for a in audits.values():
        for f in a.findings:
            line = escape(f"audit: bucket {a.bucket}: {f}")
            con.print({"error": f"[red]{line}", "possible": f"[yellow]{line}"}.get(f.severity, line))
        for f in a.dropped:
            con.print(escape(f"audit: bucket {a.bucket}: dropped {f}"))
    possible = sum(len(a.possible) for a in audits.values())
    if possible:
        con.print(f"[yellow]audit: {possible} possible findings: words inside struct parameters that point into freed "
                  "memory, not errors; --audit=confirm settles each by replaying with the block poisoned")
    if args.audit == "confirm":
        dropped = sum(len(a.dropped) for a in audits.values())
        confirmed = sum(1 for a in audits.values() for f in a.errors if f.evidence.startswith("confirmed"))
        con.print(f"audit confirm: {confirmed} confirmed, {dropped} dropped, {possible} undecided")
    unserved = [n for n, how in served.items() if not how.startswith("bucket")]
    rc = 0
    if any(not r.ok for rs in verify.values() for r in rs) or any(a.errors for a in audits.values()):
        rc = 1
    elif unserved and args.hard_fail_on_fallback:
        con.print(f"[red]{escape(f'batch sizes no graph served: {unserved} (--hard-fail-on-fallback)')}")
        rc = 3
    elif report.uncompiled and args.hard_fail_on_fallback:
        con.print("[red]compiled frames ran uncompiled in a capture (--hard-fail-on-fallback)")
        rc = 3
    if args.dot:
        os.makedirs(args.dot, exist_ok=True)
        for b in runner.captured:
            path = os.path.join(args.dot, f"bucket_{b}.dot")
            if use_cuda:
                runner.dot(b, path)
            else:
                with open(path, "w") as fh:
                    fh.write(_dot_of_nodes(runner.nodes(b), runner.segments(b)))
        con.print(f"DOT: {len(runner.captured)} files in {args.dot}")
    if args.plot:
        _plot(args.plot, report)
        con.print(f"plot: {args.plot}")
    if args.json:
        doc = {"schema": SCHEMA, "header": head, "target": target.name or args.target or BUILTIN,
               "report": report.to_dict(),
               "verify": [dataclasses.asdict(r) | {"ok": r.ok} for rs in verify.values() for r in rs],
               "audit": {str(b): a.to_dict() for b, a in audits.items()},
               "coverage": [{k: r[k] for k in ("batch", "served_by", "tokens", "padding")} for r in rows],
               "exit_code": rc}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2, default=str)
        con.print(f"JSON: {args.json}")
    con.print("result: " + {0: "clean", 1: "FAILED (verify mismatch or audit error)",
                            3: "FAILED (eager fallback)"}[rc])
    sys.stdout.flush()
    return rc
