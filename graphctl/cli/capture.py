"""``graphctl capture [TARGET]``: capture a forward at every bucket and say, at a glance, what
each graph costs, whether it equals eager, and whether its addresses and segments are sound.

Exit codes: 0 clean; 1 a verify mismatch or an audit error; 3 a batch size that no graph
served under ``--hard-fail-on-fallback``; 2 bad options or a TARGET that cannot be loaded
(argparse's own code for usage errors).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

import graphctl
from graphctl.cli import render
from graphctl.cli.target import load_target
from graphctl.errors import CaptureError, GraphctlError, did_you_mean
from graphctl.graphs.analysis.audit import Audit
from graphctl.graphs.analysis.report import Report
from graphctl.graphs.analysis.verify import VerifyResult
from graphctl.graphs.face import Key
from graphctl.graphs.target import CaptureTarget

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
def _stage(run: Run, phase: str, name: str, rc: int) -> Iterator[None]:
    """A stage, timed into ``run.phases[phase]`` and, with progress on, said on stderr as it starts
    and, past 2 s, as it ends (verify, audit and coverage were silent for up to 30 s, issue 54).
    Any ``Exception`` inside becomes one line naming the stage (and the bucket, where the error
    knows it); ``KeyboardInterrupt`` and ``SystemExit`` propagate as themselves."""
    said = _shows_progress(run.args)
    if said:
        print(f"graphctl: {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
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
    finally:
        run.phases[phase] = run.phases.get(phase, 0.0) + time.perf_counter() - t0
    if said and run.phases[phase] > 2.0:
        print(f"graphctl: {name}: {run.phases[phase]:.1f} s", file=sys.stderr, flush=True)


def _shows_progress(args: argparse.Namespace) -> bool:
    """``--progress`` / ``--no-progress``, else whether stderr is a terminal (the runner's own rule)."""
    return args.progress if args.progress is not None else sys.stderr.isatty()


def run_capture(args) -> int:
    from rich.console import Console

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
    if args.compile_mode != "static" and not args.compile:
        raise _Stop(2, f"--compile-mode {args.compile_mode} applies with --compile (e.g. --hf-config llama-1b "
                       f"--compile --compile-mode {args.compile_mode})")
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


@dataclasses.dataclass
class Run:
    """What ``graphctl capture``'s stages make, in order: each stage reads the fields the ones
    before it filled and fills its own (``_run`` lists them)."""

    args: argparse.Namespace
    con: Any  # the rich Console
    use_cuda: bool
    max_batch: int  # the example's items: every batch size up to it must be served
    buckets: list[int]
    name: str = ""
    head: dict[str, Any] = dataclasses.field(default_factory=dict)
    target: CaptureTarget | None = None
    runner: Any = None  # a GraphRunner or a VariantRunner: one face (graphs/face.py)
    timed: bool = False
    verify: dict[tuple[str, int], list[VerifyResult]] = dataclasses.field(default_factory=dict)
    audits: dict[Key, Audit] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # coverage, a row per served range
    report: Report | None = None
    rc: int = 0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds a stage: load, setup, capture, ...

    @property
    def units(self) -> list[tuple[str, Any]]:  # (variant label, unit runner); a plain runner's one is unlabelled
        return [(u.label, u.runner) for u in self.runner.units()]


def escape(text: str) -> str:
    """rich's markup escape, imported when a command prints (``graphctl --help`` loads no rich)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _plan(con: Any, args: argparse.Namespace) -> Run:
    _check_options(args)
    use_cuda = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    max_batch = args.max_batch or (max(args.buckets) if args.buckets else 64)
    return Run(args, con, use_cuda, max_batch, args.buckets or derive_buckets(max_batch))


def _load(run: Run) -> None:
    args = run.args
    spec, extra = ((HF_TARGET, {"hf_config": args.hf_config, "compile": args.compile,
                                "compile_mode": args.compile_mode}) if args.hf_config
                   else (args.target or BUILTIN, {}))
    ks = sorted(set(args.draft_len))  # several: the factory's variants, one runner (draft_lens=)
    with _stage(run, "load", "loading the target", 2):
        try:
            if len(ks) > 1:
                extra["draft_lens"] = tuple(ks)
            run.target = load_target(spec, device="cuda" if run.use_cuda else "cpu", max_batch=run.max_batch,
                                     draft_len=ks[-1], **extra)
        except GraphctlError as exc:
            raise _Stop(2, " ".join(str(exc).split())) from None
    if len(ks) > 1 and not run.target.variants:
        raise _Stop(2, f"--draft-len {' '.join(map(str, ks))}: the target returned no variants (CaptureTarget."
                       "variants={'k': draft_lens}); give one --draft-len, or make its factory use draft_lens")
    run.name = run.target.name or args.target or BUILTIN
    run.head = render.device_header("cuda" if run.use_cuda else "emulated")
    run.con.print(render.header_text(run.head))
    run.con.print(escape(f"target: {run.name}; buckets {run.buckets}"))


def _build(run: Run) -> None:
    t = run.target
    assert t is not None
    with _stage(run, "setup", "setting up the runner (the target's state, inputs or params)", 2):
        try:
            inspect.signature(t.forward).bind(*t.example)
        except TypeError as exc:  # the example does not fit the forward: the target's fault, before any run
            raise _Stop(2, f"the example does not fit {run.name}: {exc}; fix CaptureTarget.example") from None
        except ValueError:  # no signature to check: the capture says
            pass
        run.runner = graphctl.graphed(t.forward, buckets=run.buckets, state=t.state, inputs=t.inputs,
                                      backend="cuda" if run.use_cuda else "emulated", fallback="eager",
                                      params=t.params, progress=run.args.progress, variants=t.variants,
                                      prepare=t.prepare)


def _capture(run: Run) -> None:
    assert run.target is not None
    with _stage(run, "capture", "capture (warmup and capture of every bucket)", 1):
        run.runner.capture_all(*run.target.example)


def _measure(run: Run) -> None:
    # emulated graphs re-run every op from Python: their timings mean nothing, so they cost nothing unless asked
    run.timed = run.args.time if run.args.time is not None else run.use_cuda
    if run.timed:
        with _stage(run, "timing", "timing replay against eager", 1):
            run.runner.measure(iters=run.args.iters)


def _verify(run: Run) -> None:
    if run.args.verify:
        with _stage(run, "verify", "verify", 1):
            for r in run.runner.verify(gen=torch.Generator().manual_seed(run.args.seed)):
                run.verify.setdefault((r.variant, r.bucket), []).append(r)


def _audit(run: Run) -> None:
    if run.args.audit:
        with _stage(run, "audit", "audit", 1):
            run.audits = dict(run.runner.audit(confirm=run.args.audit == "confirm"))


def _coverage(run: Run) -> None:
    with _stage(run, "coverage", "coverage", 1):
        served = run.runner.coverage(range(1, run.max_batch + 1))
        for label, r in run.units:
            run.rows += coverage_rows({k.bucket: s for k, s in served.items() if k.variant == label},
                                      r.inputs[0].per_item, label)
    run.report = run.runner.report()


def _show(run: Run) -> None:
    con, report = run.con, run.report
    assert report is not None
    con.print(render.table(run.name, report, run.verify, run.audits, {label: r.inputs[0].per_item
                                                                    for label, r in run.units}))
    if not run.use_cuda and run.timed:
        con.print("emulated graphs re-run every recorded op from Python: replay is not faster than eager here; "
                  "the timing columns mean something on CUDA")
    elif not run.timed:
        con.print("not timed: emulated graphs re-run every op from Python, so replay vs eager means nothing here "
                  "(--time times them anyway)")
    con.print("warmup ms (eager runs before each capture, device work included): " +
              ", ".join(f"{b.variant + ' ' if b.variant else ''}bucket {b.bucket} {b.warmup_ms:.1f}"
                        for b in report.buckets))
    con.print(render.coverage_table(run.rows))
    con.print("phases (s): " + ", ".join(f"{p} {t:.1f}" for p, t in run.phases.items()))
    if report.compiled:
        con.print(escape(report.compile_summary))
        line = f"compiled frames run uncompiled: {report.uncompiled}"
        con.print(f"[red]{line}" if report.uncompiled else line)
    if report.bypassed:
        con.print(f"[yellow]the last {report.eager_streak} calls all ran eagerly: the graphs are bypassed")
    for line in report.findings():  # every finding record, a line each (graphs/findings/)
        con.print(escape(line))
    for rs in run.verify.values():
        for r in rs:
            if not r.ok:
                con.print(f"[red]verify: {escape(str(r))}")
            elif r.write is not None:  # a write that differs from eager: a padded lane, unless it is scratch
                con.print(f"[yellow]verify: {escape(str(r))}")
    for key, a in run.audits.items():
        for f in a.findings:
            line = escape(f"audit: {key}: {f}")
            con.print({"error": f"[red]{line}", "possible": f"[yellow]{line}"}.get(f.severity, line))
        for f in a.dropped:
            con.print(escape(f"audit: {key}: dropped {f}"))
    possible = sum(len(a.possible) for a in run.audits.values())
    if possible:
        con.print(f"[yellow]audit: {possible} possible findings: words inside struct parameters that point into freed "
                  "memory, not errors; --audit=confirm settles each by replaying with the block poisoned")
    if run.args.audit == "confirm":
        dropped = sum(len(a.dropped) for a in run.audits.values())
        confirmed = sum(1 for a in run.audits.values() for f in a.errors if f.evidence.startswith("confirmed"))
        con.print(f"audit confirm: {confirmed} confirmed, {dropped} dropped, {possible} undecided")


def _decide(run: Run) -> None:
    assert run.report is not None
    unserved = sorted({n for r in run.rows if not r["served_by"].startswith("bucket")
                       for n in range(r["lo"], r["hi"] + 1)})
    if any(not r.ok for rs in run.verify.values() for r in rs) or any(a.errors for a in run.audits.values()):
        run.rc = 1
    elif unserved and run.args.hard_fail_on_fallback:
        run.con.print(f"[red]{escape(f'batch sizes no graph served: {unserved} (--hard-fail-on-fallback)')}")
        run.rc = 3
    elif run.report.uncompiled and run.args.hard_fail_on_fallback:
        run.con.print("[red]compiled frames ran uncompiled in a capture (--hard-fail-on-fallback)")
        run.rc = 3


def _write(run: Run) -> None:
    args, con, report = run.args, run.con, run.report
    assert report is not None
    if args.dot:
        os.makedirs(args.dot, exist_ok=True)
        files = 0
        for label, r in run.units:
            for b in r.captured:  # a variant's files are named by its values: k3_bucket_8.dot
                stem = "".join(c for c in label if c.isalnum() or c in "_-,").replace(",", "_")
                path = os.path.join(args.dot, f"{stem + '_' if stem else ''}bucket_{b}.dot")
                if run.use_cuda:
                    r.dot(b, path)
                else:
                    with open(path, "w") as fh:
                        fh.write(render.dot_of_nodes(r.nodes(b), r.segments(b)))
                files += 1
        con.print(f"DOT: {files} files in {args.dot}")
    if args.plot:
        render.plot(args.plot, report)
        con.print(f"plot: {args.plot}")
    if args.json:
        doc = {"schema": SCHEMA, "header": run.head, "target": run.name, "report": report.to_dict(),
               "verify": [dataclasses.asdict(r) | {"ok": r.ok} for rs in run.verify.values() for r in rs],
               "audit": {f"{label} {b}".strip(): a.to_dict() for (label, b), a in run.audits.items()},
               "coverage": [{k: r[k] for k in ("batch", "served_by", "tokens", "padding", "variant")}
                            for r in run.rows],
               "phases_s": run.phases, "exit_code": run.rc}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2, default=str)
        con.print(f"JSON: {args.json}")


_STAGES: tuple[Callable[[Run], None], ...] = (_load, _build, _capture, _measure, _verify, _audit, _coverage, _show,
                                              _decide, _write)


def _run(con: Any, args: argparse.Namespace) -> int:
    """The stages in order (``_STAGES``), over one :class:`Run`; the exit code the last one left."""
    run = _plan(con, args)
    for stage in _STAGES:
        stage(run)
    con.print("result: " + {0: "clean", 1: "FAILED (verify mismatch or audit error)",
                            3: "FAILED (eager fallback)"}[run.rc])
    sys.stdout.flush()
    return run.rc
