"""The audit's false-alarm rate on the main job: how many *possible* dangling findings a capture
reports, and how many a poisoned replay confirms (issue 35).

For each target (the built-in engine, and ``--hf-config`` models), ``--runs`` fresh processes of
``graphctl capture --verify --audit=confirm --json`` at the default buckets; each possible finding
is settled by replaying with its freed block poisoned 0x00 / 0x00 / 0xFF
(``graphctl/graphs/analysis/confirm.py``). Reported: per target and run, the exact errors, the
possible findings (confirmed + dropped + undecided), and the result line; the false-alarm rate is
1 - confirmed / possible over every run.

    python bench/audit_alarms.py [--runs 3] [--targets builtin tiny-llama tiny-qwen3 llama-1b] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def one_run(target: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "capture.json")
        extra = [] if target == "builtin" else ["--hf-config", target]
        proc = subprocess.run([sys.executable, "-m", "graphctl.cli", "capture", "--verify", "--audit=confirm",
                               *extra, "--no-progress", "--json", path], capture_output=True, text=True,
                              timeout=timeout)
        result = next((ln for ln in proc.stdout.splitlines() if ln.startswith("result: ")), "result: (none)")
        if not os.path.exists(path):
            return {"target": target, "rc": proc.returncode, "result": result, "error": proc.stderr[-2000:]}
        doc = json.load(open(path))
    findings = [f for a in doc["audit"].values() for f in a["findings"]]
    dropped = [f for a in doc["audit"].values() for f in a["dropped"]]
    exact = [f for f in findings if f["severity"] == "error" and not f["evidence"].startswith("confirmed")]
    confirmed = [f for f in findings if f["evidence"].startswith("confirmed")]
    undecided = [f for f in findings if f["severity"] == "possible"]
    return {"target": target, "rc": proc.returncode, "result": result.removeprefix("result: "),
            "exact_errors": len(exact), "confirmed": len(confirmed), "dropped": len(dropped),
            "undecided": len(undecided), "possible": len(confirmed) + len(dropped) + len(undecided),
            "verify_ok": all(v["ok"] for v in doc["verify"]),
            "examples": [f"{f['op']} {f['where']} {f['buffer']}: {f['evidence']}" for f in (confirmed + dropped)[:3]],
            "device": doc["header"]["device"].get("name"), "torch": doc["header"]["torch"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--targets", nargs="+", default=["builtin", "tiny-llama", "tiny-qwen3", "llama-1b"])
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for target in a.targets:
        for run in range(a.runs):
            r = one_run(target, a.timeout)
            r["run"] = run
            rows.append(r)
            print(json.dumps(r), flush=True)
    possible = sum(r.get("possible", 0) for r in rows)
    confirmed = sum(r.get("confirmed", 0) for r in rows)
    print(f"\n{'target':<12} {'run':>3} {'result':<8} {'exact':>5} {'possible':>8} {'confirmed':>9} {'dropped':>7} "
          f"{'undecided':>9}")
    for r in rows:
        print(f"{r['target']:<12} {r['run']:>3} {r['result'][:8]:<8} {r.get('exact_errors', '-'):>5} "
              f"{r.get('possible', '-'):>8} {r.get('confirmed', '-'):>9} {r.get('dropped', '-'):>7} "
              f"{r.get('undecided', '-'):>9}")
    rate = f"{1 - confirmed / possible:.3f}" if possible else "n/a (no possible finding)"
    print(f"possible findings {possible}, confirmed {confirmed}: false-alarm rate {rate}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows, "possible": possible, "confirmed": confirmed}, fh, indent=2)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
