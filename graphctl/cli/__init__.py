"""The ``graphctl`` command: ``capture`` (the main job), ``info`` and ``bench``. Every option is
explained in ``--help`` with an example; docs/cli.md is the reference."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from graphctl.errors import did_you_mean

__all__ = ["main"]

_CAPTURE = """\
Capture a forward as CUDA graphs (or emulated graphs on a machine without a GPU) at every
bucket, time replay against eager, optionally verify and audit every graph, and print one
table. With no TARGET, the built-in reference engine: one MTP decode step (target forward,
greedy acceptance, k draft steps behind a transactional draft switch).

TARGET is module:factory or path/to/file.py:factory; the factory is called with keyword
options device=, max_batch=, draft_len= and returns a graphctl.CaptureTarget (docs/cli.md).

examples:
  graphctl capture                                  # the built-in engine, buckets 1..64, k=3
  graphctl capture --verify --audit --json out.json
  graphctl capture --max-batch 32 --draft-len 7 --plot latency.png --dot dots/
  graphctl capture mypkg.engine:make_target --buckets 1,2,4,8 --hard-fail-on-fallback

exit codes: 0 clean; 1 verify mismatch, audit error or a forward that raised at any stage
(capture, timing, verify, audit, coverage: one line naming the stage, bucket and cause;
--traceback for the full one); 2 bad options, TARGET, target fields or output path (one
line); 3 a batch size no graph served (with --hard-fail-on-fallback); 130 interrupted."""

_BENCH = """\
Run the benchmarks in bench/ (all, or the ones named), print their tables and write one JSON
per benchmark into --out. They need a CUDA device: on a machine without one each is listed as
skipped, with the reason. Results worth keeping go to bench/RESULTS.md by hand, with date,
GPU, torch version and command.

examples:
  graphctl bench --list
  graphctl bench                       # dispatch, draft_loop, switch_cost
  graphctl bench draft_loop --out /tmp/bench -- --sizes 1 8 --reps 20"""


def _buckets(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers like 1,2,4,8, got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers like 1,2,4,8, got {text!r}")
    return out


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


class _Parser(argparse.ArgumentParser):
    """argparse, with a did-you-mean for a misspelled command, and its commands' parsers by name."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        if "invalid choice: " in message:
            wrong = message.split("invalid choice: ", 1)[1].split("'")[1]
            message += did_you_mean(wrong, ("capture", "info", "bench"))
        super().error(message)


def _unknown(parser: _Parser, command: str, unknown: list[str]) -> NoReturn:
    """Unrecognized arguments, reported by the command's own parser (its usage, not the top level's),
    with the closest option of that command."""
    sub = parser.commands[command]
    flags = [o for a in sub._actions for o in a.option_strings]  # argparse lists a parser's options nowhere public
    hints = "".join(h for h in (did_you_mean(u.split("=", 1)[0], flags) for u in unknown if u.startswith("-")) if h)
    if command == "bench" and not hints:
        hints = f" (a benchmark's own options go after --: graphctl bench NAME -- {' '.join(unknown)})"
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{hints}")


def _parser() -> _Parser:
    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="graphctl", description="CUDA-graph capture orchestration for draft forwards. "
                                "Commands: capture (the main job), info, bench; graphctl COMMAND --help for each.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("capture", help="capture a forward at every bucket; report, verify, audit",
                       description=_CAPTURE, formatter_class=raw)
    c.add_argument("target", nargs="?", metavar="TARGET",
                   help="module:factory or file.py:factory returning a CaptureTarget (default: the built-in engine, "
                        "graphctl.cli.builtin:capture_target)")
    c.add_argument("--hf-config", metavar="NAME", default=None,
                   help="capture a Hugging Face model's speculative decode step on graphctl's paged cache instead: "
                        "a named config with random weights (tiny-llama, tiny-qwen2, tiny-qwen3, llama-1b) or a "
                        "config JSON path, e.g. --hf-config tiny-qwen3 (needs graphctl[transformers])")
    c.add_argument("--compile", action="store_true",
                   help="with --hf-config: compile both models with torch.compile (Inductor, no CUDA graphs of its "
                        "own) before capture, so the graphs hold the fused kernels "
                        "(e.g. --hf-config llama-1b --compile)")
    c.add_argument("--compile-mode", choices=("static", "dynamic"), default="static",
                   help="with --compile: static compiles a graph per bucket; dynamic one graph a model for every "
                        "bucket of 2 or more, bucket 1 its own (e.g. --compile --compile-mode dynamic)")
    c.add_argument("--buckets", type=_buckets, metavar="LIST",
                   help="batch sizes (requests) to capture, e.g. --buckets 1,2,4,8 (default: derived from "
                        "--max-batch: powers of two and the maximum)")
    c.add_argument("--max-batch", "--max-seqs", dest="max_batch", type=_positive, default=None, metavar="N",
                   help="largest batch in requests (the engines' max_seqs): the buckets when --buckets is not "
                        "given, and the batch sizes the coverage pass checks (1..N), e.g. --max-batch 32 (default: "
                        "the largest bucket, or 64)")
    c.add_argument("--draft-len", type=_positive, nargs="+", default=[3], metavar="K",
                   help="draft tokens per request; a bucket of B requests holds B*(K+1) tokens, e.g. --draft-len 7 "
                        "(default 3; passed to the factory). Several values capture one runner with a graph set per "
                        "draft length in one pool (variants), e.g. --draft-len 1 3 7: the factory gets draft_len=7 "
                        "and draft_lens=(1, 3, 7)")
    c.add_argument("--backend", choices=("auto", "cuda", "emulated"), default="auto",
                   help="cuda graphs, the emulated recorder (any machine), or auto: cuda when a GPU is present "
                        "(e.g. --backend emulated)")
    c.add_argument("--verify", action="store_true",
                   help="run eager and replay on fresh random inputs per bucket, outputs and padding poisoned; "
                        "a mismatch makes the exit code 1 (e.g. graphctl capture --verify)")
    c.add_argument("--audit", nargs="?", const="report", choices=("report", "confirm"), default=None,
                   help="pointer and segment audit of every graph (docs/debugging.md); an error makes the exit "
                        "code 1, a possible finding (a struct word pointing into freed memory) does not; "
                        "--audit=confirm replays each graph with every such block poisoned and turns each possible "
                        "finding into an error or drops it (e.g. graphctl capture --audit=confirm)")
    c.add_argument("--json", metavar="FILE", help="write the report, verify, audit and coverage as JSON "
                   "(schema graphctl.capture/1), e.g. --json report.json")
    c.add_argument("--dot", metavar="DIR", help="write one Graphviz DOT file per bucket into DIR "
                   "(cudaGraphDebugDotPrint on CUDA, the op chain by segment when emulated), e.g. --dot dots/")
    c.add_argument("--plot", metavar="FILE", help="write a PNG: replay vs eager latency per bucket and pool "
                   "memory per bucket (needs matplotlib), e.g. --plot latency.png")
    c.add_argument("--hard-fail-on-fallback", action="store_true",
                   help="exit 3 when any batch size from 1 to --max-batch fell back to eager, or a compiled frame "
                        "ran uncompiled in a capture (e.g. in CI: graphctl capture --hard-fail-on-fallback)")
    c.add_argument("--time", action=argparse.BooleanOptionalAction, default=None,
                   help="time replay against eager per bucket (default: on CUDA only; emulated timings mean nothing "
                        "and cost most of a CPU run), e.g. --time on the CPU, --no-time on a GPU")
    c.add_argument("--iters", type=_positive, default=20, metavar="N",
                   help="timed calls per bucket for the medians, e.g. --iters 50 (default 20)")
    c.add_argument("--seed", type=int, default=0, help="seed of --verify's random inputs, e.g. --seed 7 (default 0)")
    c.add_argument("--traceback", action="store_true",
                   help="print the full traceback when the target or the forward fails at any stage (default: one "
                        "line naming the stage and bucket)")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar during capture, e.g. --no-progress in logs (default: when stderr is a terminal)")

    info = sub.add_parser("info", help="versions, extension build vs runtime, features, devices",
                          description="Print graphctl, torch, CUDA runtime and driver, cuda-bindings and Python "
                                      "versions, how graphctl._C was built next to what is running (and the load "
                                      "error if _C did not load), detected features and the GPUs.\n\nexample:\n  "
                                      "graphctl info --json", formatter_class=raw)
    info.add_argument("--json", action="store_true", help="print one JSON object instead of tables "
                      "(e.g. graphctl info --json)")

    b = sub.add_parser("bench", help="run the bench/ suite or named parts", description=_BENCH, formatter_class=raw)
    b.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (file names in bench/ without .py), "
                   "e.g. graphctl bench draft_loop; default all")
    b.add_argument("--out", metavar="DIR", default="bench/out",
                   help="where each benchmark's JSON goes, e.g. --out /tmp/bench (default bench/out)")
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit (e.g. graphctl bench --list)")
    b.epilog = "arguments after -- go to every benchmark, e.g. graphctl bench draft_loop -- --reps 20"
    p.commands = {"capture": c, "info": info, "bench": b}
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # graphctl restored every state on the way out; a traceback would only bury that line
        print("graphctl: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:  # everything after -- belongs to the benchmarks (graphctl bench ... -- --reps 20)
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unknown(parser, args.command, unknown)
    if extra and args.command != "bench":
        parser.error(f"arguments after -- are for graphctl bench only, found {extra}")
    args.extra = extra
    if args.command == "capture":
        from graphctl.cli.capture import run_capture

        return run_capture(args)
    if args.command == "bench":
        from graphctl.cli.bench import run_bench

        return run_bench(args)
    from graphctl.cli.info import run_info

    return run_info(as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
