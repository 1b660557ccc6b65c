"""The ``graphctl`` command. Subcommands: ``info`` (this issue); ``capture`` and ``bench``
arrive with the graphs and CLI issues."""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphctl", description="CUDA-graph capture orchestration for draft forwards.")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, extension build vs runtime, devices",
                          description="Print graphctl, torch, CUDA and Python versions, how graphctl._C was "
                                      "built next to what is running, the load error if _C did not load, and the "
                                      "GPUs. Example: graphctl info --json")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        from graphctl.cli.info import run_info

        return run_info(as_json=args.json)
    return 2  # argparse already rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
