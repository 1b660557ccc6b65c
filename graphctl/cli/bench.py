"""``graphctl bench``: run the benchmarks in the checkout's ``bench/`` folder, each in its own
process (a benchmark owns the GPU while it runs), print their output and keep their JSON."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch

__all__ = ["run_bench", "bench_dir", "available", "first_sentence"]


def bench_dir() -> pathlib.Path:
    """``bench/`` next to the ``graphctl`` package: benchmarks ship with the source checkout."""
    return pathlib.Path(__file__).resolve().parents[2] / "bench"


def available() -> dict[str, pathlib.Path]:
    d = bench_dir()
    return {p.stem: p for p in sorted(d.glob("*.py"))} if d.is_dir() else {}


def first_sentence(source: str) -> str:
    """The first sentence of a module's docstring, whole (its lines joined), without markup."""
    parts = source.split('"""')
    text = " ".join(parts[1].split("\n\n")[0].split()) if len(parts) > 1 else ""
    end = next((i + 1 for i, c in enumerate(text) if c == "." and (i + 1 == len(text) or text[i + 1] == " ")),
               len(text))
    return text[:end].replace("``", "").replace("*", "").removesuffix(":") + ("." if text[:end].endswith(":") else "")


def run_bench(args) -> int:
    from rich.console import Console

    con = Console()
    benches = available()
    if not benches:
        con.print(f"[red]graphctl bench: no benchmarks in {bench_dir()}: they ship with the source checkout, not "
                  "the wheel; run graphctl bench from a clone of the repository (make build)")
        return 2
    if args.list:
        for name, path in benches.items():
            con.print(f"{name:14s} {first_sentence(path.read_text())}", highlight=False, soft_wrap=True)
        return 0
    unknown = [n for n in args.names if n not in benches]
    if unknown:
        con.print(f"[red]graphctl bench: unknown benchmark {unknown}; choose from {sorted(benches)}")
        return 2
    names = args.names or list(benches)
    extra = list(args.extra)
    if not torch.cuda.is_available():
        for n in names:
            con.print(f"{n}: skipped: needs a CUDA device (torch.cuda.is_available() is False on this machine)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    rc = 0
    for n in names:
        out = os.path.join(args.out, f"{n}.json")
        con.rule(n)
        r = subprocess.run([sys.executable, str(benches[n]), "--json", out, *extra])
        if r.returncode:
            con.print(f"[red]{n}: exit code {r.returncode}")
            rc = 1
        elif os.path.exists(out):
            con.print(f"{n}: JSON in {out}")
        else:
            con.print(f"{n}: no JSON (the benchmark did not run; its output says why)")
    return rc
