"""What ``import graphctl`` costs next to ``import torch`` (issue 54): every CLI call pays it, ``--help`` too.

Side by side in one run, each a fresh interpreter (``python -X importtime`` off: wall time of the whole
process, what a person waits), ``--repeats`` rounds in a fresh random order each round, medians:

  torch     ``python -c "import torch"``
  graphctl  ``python -c "import graphctl"`` (torch included)
  help      ``python -m graphctl.cli --help``

Target: graphctl / torch <= 1.3.

    python bench/import_cost.py [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "torch": [sys.executable, "-c", "import torch"],
    "graphctl": [sys.executable, "-c", "import graphctl"],
    "help": [sys.executable, "-m", "graphctl.cli", "--help"],
}


def _once(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    for cmd in VARIANTS.values():  # page the files in once: the first run of each reads them from disk
        _once(cmd)
    runs: dict[str, list[float]] = {n: [] for n in VARIANTS}
    rng = random.Random()
    for _ in range(a.repeats):
        order = list(VARIANTS)
        rng.shuffle(order)
        for n in order:
            runs[n].append(_once(VARIANTS[n]))
    med = {n: statistics.median(v) for n, v in runs.items()}
    import torch

    row = {f"{n}_s": round(v, 3) for n, v in med.items()}
    row.update(graphctl_over_torch=round(med["graphctl"] / med["torch"], 3),
               help_over_torch=round(med["help"] / med["torch"], 3), repeats=a.repeats, torch=torch.__version__,
               python=platform.python_version(), machine=platform.processor() or platform.machine(),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(row))
    print(f"target graphctl/torch <= 1.30: {row['graphctl_over_torch']:.2f} -> "
          f"{'MET' if row['graphctl_over_torch'] <= 1.3 else 'MISSED'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
