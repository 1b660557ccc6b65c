"""``graphctl capture [TARGET]``: capture a forward at every bucket and say, at a glance, what
each graph costs, whether it equals eager, and whether its addresses and segments are sound.

Exit codes: 0 clean; 1 a verify mismatch or an audit error; 3 a batch size that no graph
served under ``--hard-fail-on-fallback``; 2 bad options or a TARGET that cannot be loaded
(argparse's own code for usage errors).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import platform
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch

import graphctl
from graphctl.cli.target import load_target
from graphctl.errors import CaptureError, GraphctlError, did_you_mean
from graphctl.graphs.face import Key

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


def coverage_rows(served: dict[int, str], per_item: int, variant: str = "") -> list[dict[str, Any]]:
    """Consecutive batch sizes served alike, as ``{"batch": "3-4", "served_by": ..., "tokens":
    ..., "padding": worst fraction of padded rows, "variant": "k=3" or ""}`` rows."""
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
        r["variant"] = variant
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


def _table(name: str, report, verify: dict[tuple[str, int], list], audits: dict[tuple[str, int], Any],
           per_item: dict[str, int]):
    from rich.table import Table

    t = Table(title=f"{name}: {report.backend} graphs")
    variants = any(b.variant for b in report.buckets)
    if variants:
        t.add_column("variant", no_wrap=True)
    for col in ("bucket", "tokens", "capture ms", "pool MiB", "nodes", "replay us", "eager us", "speedup", "verify",
                "audit"):
        t.add_column(col, justify="right")
    for b in report.buckets:
        speed = f"{b.eager_us / b.replay_us:.2f}x" if b.replay_us and b.eager_us else "-"
        vs = verify.get((b.variant, b.bucket))
        v = "-" if vs is None else ("ok" if all(r.ok for r in vs) else "[red]MISMATCH")
        a = audits.get(Key(b.variant, b.bucket))
        au = "-" if a is None else (f"[red]{len(a.errors)} err[/] {len(a.warnings)} warn" if a.errors else
                                    f"[yellow]{len(a.possible)} possible[/]" if a.possible else
                                    "clean" if not a.warnings else f"{len(a.warnings)} warn")
        t.add_row(*((b.variant,) if variants else ()), str(b.bucket), str(b.bucket * per_item[b.variant]),
                  f"{b.capture_ms:.1f}", f"{b.pool_bytes / 2**20:.2f}",
                  str(b.nodes), _num(b.replay_us), _num(b.eager_us), speed, v, au)
    return t


def _coverage_table(rows: list[dict[str, Any]]):
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="coverage: which batch sizes each bucket serves")
    variants = any(r["variant"] for r in rows)
    for col in (("variant",) if variants else ()) + ("batch", "served by", "tokens", "worst padding"):
        t.add_column(col, justify="right")
    for r in rows:
        pad = "-" if r["padding"] is None else f"{100 * r['padding']:.0f}%"
        how = r["served_by"] if r["served_by"].startswith("bucket") else f"[red]{escape(r['served_by'])}"
        tokens = "-" if r["tokens"] is None else str(r["tokens"])
        t.add_row(*((r["variant"],) if variants else ()), r["batch"], how, tokens, pad)
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
    import matplotlib.ticker

    bs = [b.bucket for b in report.buckets]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if any(b.replay_us for b in report.buckets):
        ax1.plot(bs, [b.replay_us or float("nan") for b in report.buckets], "o-", label="graph replay")
        ax1.plot(bs, [b.eager_us or float("nan") for b in report.buckets], "s--", label="eager")
        ax1.set(xscale="log", yscale="log", xlabel="bucket (batch items)", ylabel="median latency (us)",
                title="latency per bucket")
        ax1.set_xticks(bs, [str(b) for b in bs])
        # plain numbers on the log latency axis: matplotlib's minor labels read "3x10^0" within one decade
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax1.yaxis.set_major_formatter(plain)
        ax1.yaxis.set_minor_formatter(plain)
        ax1.legend()
    else:
        ax1.set(title="latency per bucket", xticks=[], yticks=[])
        ax1.text(0.5, 0.5, "not timed\n(graphctl capture --time)", ha="center", va="center")
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


class _Stop(Exception):
    """Ends the command with one line and an exit code (2: the options or the target; 1: the
    forward failed at a stage); the cause is kept for ``--traceback``."""

    def __init__(self, rc: int, line: str, cause: BaseException | None = None) -> None:
        super().__init__(line)
        self.rc, self.line, self.cause = rc, line, cause


def _one_line(exc: BaseException) -> str:
    notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith("graphctl")]
    text = " ".join(f"{type(exc).__name__}: {exc}".split())  # a multi-line message on one line
    return text + "".join(f" ({' '.join(n.split())})" for n in notes[:1])


@contextlib.contextmanager
def _stage(name: str, rc: int) -> Iterator[None]:
    """Any ``Exception`` inside becomes one line naming the stage (and the bucket, where the
    error knows it); ``KeyboardInterrupt`` and ``SystemExit`` propagate as themselves."""
    try:
        yield
    except _Stop:
        raise
    except Exception as exc:
        bucket = getattr(exc, "bucket", None)
        where = f" of bucket {bucket}" if bucket is not None else ""
        # a CaptureError wraps the forward's own exception: that one is the news
        shown = exc.__cause__ if isinstance(exc, CaptureError) and exc.__cause__ is not None else exc
        raise _Stop(rc, f"{name}{where} failed: {_one_line(shown)}", exc) from exc


def run_capture(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    con = Console(width=max(100, Console().width), soft_wrap=True)  # findings stay on one line: grep-able
    try:
        return _run(con, args)
    except _Stop as stop:
        more = "" if args.traceback or stop.cause is None else " (--traceback for the full one)"
        con.print(f"[red]graphctl capture: {escape(stop.line)}{more}")
        if args.traceback and stop.cause is not None:
            traceback.print_exception(stop.cause)
        return stop.rc


def _check_options(args) -> None:
    if args.backend == "cuda" and not torch.cuda.is_available():
        raise _Stop(2, "--backend cuda needs a CUDA device; use --backend emulated or auto")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise _Stop(2, f"--plot needs matplotlib ({exc}): pip install 'graphctl[plot]', or drop --plot") from None
    bad = _unwritable(args)
    if bad:
        raise _Stop(2, bad)
    if args.hf_config and args.target:
        raise _Stop(2, "give a TARGET or --hf-config, not both")
    if args.compile and not args.hf_config:
        raise _Stop(2, "--compile applies to --hf-config models; compile your own TARGET's forward in its factory "
                       "(torch.compile, mode='default')")
    if args.buckets and args.max_batch and max(args.buckets) > args.max_batch:
        raise _Stop(2, f"--buckets {','.join(map(str, args.buckets))} has buckets above --max-batch "
                       f"{args.max_batch}: the example holds {args.max_batch} items; raise --max-batch or drop them")
    if args.hf_config:
        try:
            from graphctl.integrations.hf.configs import NAMES
        except ImportError as exc:
            raise _Stop(2, f"--hf-config needs transformers ({exc}): pip install 'graphctl[transformers]'") from None
        if args.hf_config not in NAMES and not os.path.isfile(args.hf_config):
            near = did_you_mean(args.hf_config, NAMES)
            raise _Stop(2, f"unknown --hf-config {args.hf_config!r}{near}: one of {', '.join(NAMES)}, or a path "
                           "to a config JSON")


def _run(con, args) -> int:
    from rich.markup import escape

    _check_options(args)
    backend = args.backend
    use_cuda = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    device = "cuda" if use_cuda else "cpu"
    # The factory's example holds max_batch items: every batch size up to it must be served.
    max_batch = args.max_batch or (max(args.buckets) if args.buckets else 64)
    buckets = args.buckets or derive_buckets(max_batch)
    spec, extra = ((HF_TARGET, {"hf_config": args.hf_config, "compile": args.compile}) if args.hf_config
                   else (args.target or BUILTIN, {}))
    with _stage("loading the target", 2):
        try:
            ks = sorted(set(args.draft_len))  # several: the factory's variants, one runner (draft_lens=)
            if len(ks) > 1:
                extra["draft_lens"] = tuple(ks)
            target = load_target(spec, device=device, max_batch=max_batch, draft_len=ks[-1], **extra)
        except GraphctlError as exc:
            raise _Stop(2, " ".join(str(exc).split())) from None
    if len(ks) > 1 and not target.variants:
        raise _Stop(2, f"--draft-len {' '.join(map(str, ks))}: the target returned no variants (CaptureTarget."
                       "variants={'k': draft_lens}); give one --draft-len, or make its factory use draft_lens")
    name = target.name or args.target or BUILTIN
    head = _device_header("cuda" if use_cuda else "emulated")
    con.print(_header_text(head))
    con.print(escape(f"target: {name}; buckets {buckets}"))
    with _stage("setting up the runner (the target's state, inputs or params)", 2):
        try:
            inspect.signature(target.forward).bind(*target.example)
        except TypeError as exc:  # the example does not fit the forward: the target's fault, before any run
            raise _Stop(2, f"the example does not fit {name}: {exc}; fix CaptureTarget.example") from None
        except ValueError:  # no signature to check: the capture says
            pass
        runner = graphctl.graphed(target.forward, buckets=buckets, state=target.state, inputs=target.inputs,
                                  backend="cuda" if use_cuda else "emulated", fallback="eager",
                                  params=target.params, progress=args.progress, variants=target.variants,
                                  prepare=target.prepare)
    with _stage("capture", 1):
        runner.capture_all(*target.example)
    # every (variant, runner): a plain runner is the one unlabelled unit (graphs/face.py)
    units = [(u.label, u.runner) for u in runner.units()]
    # emulated graphs re-run every op from Python: their timings mean nothing, so they cost nothing unless asked
    timed = args.time if args.time is not None else use_cuda
    if timed:
        with _stage("timing replay against eager", 1):
            runner.measure(iters=args.iters)
    verify: dict[tuple[str, int], list] = {}
    if args.verify:
        with _stage("verify", 1):
            for r in runner.verify(gen=torch.Generator().manual_seed(args.seed)):
                verify.setdefault((r.variant, r.bucket), []).append(r)
    audits: dict[tuple[str, int], Any] = {}
    if args.audit:
        with _stage("audit", 1):
            audits = dict(runner.audit(confirm=args.audit == "confirm"))
    rows: list[dict[str, Any]] = []
    with _stage("coverage", 1):
        served = runner.coverage(range(1, max_batch + 1))
        for label, r in units:
            rows += coverage_rows({k.bucket: s for k, s in served.items() if k.variant == label}, r.inputs[0].per_item,
                                  label)
    report = runner.report()
    con.print(_table(name, report, verify, audits, {label: r.inputs[0].per_item for label, r in units}))
    if not use_cuda and timed:
        con.print("emulated graphs re-run every recorded op from Python: replay is not faster than eager here; "
                  "the timing columns mean something on CUDA")
    elif not timed:
        con.print("not timed: emulated graphs re-run every op from Python, so replay vs eager means nothing here "
                  "(--time times them anyway)")
    con.print("warmup ms (eager runs before each capture, device work included): " +
              ", ".join(f"{b.variant + ' ' if b.variant else ''}bucket {b.bucket} {b.warmup_ms:.1f}"
                        for b in report.buckets))
    con.print(_coverage_table(rows))
    if report.compiled:
        con.print(escape(report.compile_summary))
        line = f"compiled frames run uncompiled: {report.uncompiled}"
        con.print(f"[red]{line}" if report.uncompiled else line)
    if report.bypassed:
        con.print(f"[yellow]the last {report.eager_streak} calls all ran eagerly: the graphs are bypassed")
    for line in report.findings():  # hazards, reach left out, unreached reads, host changes, side effects
        con.print(escape(line))
    for rs in verify.values():
        for r in rs:
            if not r.ok:
                con.print(f"[red]verify: {escape(str(r))}")
            elif r.write is not None:  # a write that differs from eager: a padded lane, unless it is scratch
                con.print(f"[yellow]verify: {escape(str(r))}")
    for (label, _), a in audits.items():
        at = f"{label} bucket {a.bucket}" if label else f"bucket {a.bucket}"
        for f in a.findings:
            line = escape(f"audit: {at}: {f}")
            con.print({"error": f"[red]{line}", "possible": f"[yellow]{line}"}.get(f.severity, line))
        for f in a.dropped:
            con.print(escape(f"audit: {at}: dropped {f}"))
    possible = sum(len(a.possible) for a in audits.values())
    if possible:
        con.print(f"[yellow]audit: {possible} possible findings: words inside struct parameters that point into freed "
                  "memory, not errors; --audit=confirm settles each by replaying with the block poisoned")
    if args.audit == "confirm":
        dropped = sum(len(a.dropped) for a in audits.values())
        confirmed = sum(1 for a in audits.values() for f in a.errors if f.evidence.startswith("confirmed"))
        con.print(f"audit confirm: {confirmed} confirmed, {dropped} dropped, {possible} undecided")
    unserved = sorted({n for r in rows if not r["served_by"].startswith("bucket") for n in range(r["lo"], r["hi"] + 1)})
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
        files = 0
        for label, r in units:
            for b in r.captured:  # a variant's files are named by its values: k3_bucket_8.dot
                stem = "".join(c for c in label if c.isalnum() or c in "_-,").replace(",", "_")
                path = os.path.join(args.dot, f"{stem + '_' if stem else ''}bucket_{b}.dot")
                if use_cuda:
                    r.dot(b, path)
                else:
                    with open(path, "w") as fh:
                        fh.write(_dot_of_nodes(r.nodes(b), r.segments(b)))
                files += 1
        con.print(f"DOT: {files} files in {args.dot}")
    if args.plot:
        _plot(args.plot, report)
        con.print(f"plot: {args.plot}")
    if args.json:
        doc = {"schema": SCHEMA, "header": head, "target": name,
               "report": report.to_dict(),
               "verify": [dataclasses.asdict(r) | {"ok": r.ok} for rs in verify.values() for r in rs],
               "audit": {f"{label} {b}".strip(): a.to_dict() for (label, b), a in audits.items()},
               "coverage": [{k: r[k] for k in ("batch", "served_by", "tokens", "padding", "variant")} for r in rows],
               "exit_code": rc}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2, default=str)
        con.print(f"JSON: {args.json}")
    con.print("result: " + {0: "clean", 1: "FAILED (verify mismatch or audit error)",
                            3: "FAILED (eager fallback)"}[rc])
    sys.stdout.flush()
    return rc
