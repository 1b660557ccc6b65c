"""graphctl capture on real CUDA graphs (H200/H100): the built-in engine verified and audited
clean, DOT files from cudaGraphDebugDotPrint, the device header from NVML."""
from __future__ import annotations

import json
import os

import pytest

from graphctl.cli import main

pytestmark = pytest.mark.cuda


def test_capture_builtin_engine_on_cuda_is_clean(capsys, tmp_path):
    j, dots = tmp_path / "r.json", tmp_path / "dots"
    rc = main(["capture", "--backend", "cuda", "--max-batch", "8", "--verify", "--audit", "--iters", "5",
               "--no-progress", "--json", str(j), "--dot", str(dots)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(j.read_text())
    assert doc["report"]["backend"] == "cuda" and doc["exit_code"] == 0
    assert "compute_capability" in doc["header"]["device"], doc["header"]
    for b in doc["report"]["buckets"]:
        assert b["nodes"] > 0 and b["replay_us"] > 0 and b["eager_us"] > b["replay_us"], b
    assert all(a["errors"] == 0 and a["warnings"] == 0 for a in doc["audit"].values()), doc["audit"]
    assert all(v["ok"] and v["write"] is None for v in doc["verify"]) and "warning" not in out, out  # issue 21
    assert doc["report"]["padding_hazards"] == doc["report"]["host_changes"] == doc["report"]["unreached"] == []
    assert sorted(os.listdir(dots)) == [f"bucket_{b}.dot" for b in (1, 2, 4, 8)]
    assert (dots / "bucket_8.dot").read_text().startswith("digraph")


README_MAIN_JOB = ["capture", "--verify", "--audit"]  # README.md's `make demo`, and with --hf-config NAME


@pytest.mark.parametrize("hf_config", [None, "tiny-llama", "tiny-qwen3", "llama-1b"])
def test_readme_main_job_is_clean_three_runs_in_a_row(hf_config, tmp_path):
    # Regression: issue 35, the main job said FAILED on the H200 (audit "dangling" findings on struct words that no
    # replay dereferences, moving from run to run) while tests/cuda passed: the test runs what the CLI user runs.
    import subprocess
    import sys

    extra = ["--hf-config", hf_config] if hf_config else []
    for run in range(3):
        j = tmp_path / f"run{run}.json"
        proc = subprocess.run([sys.executable, "-m", "graphctl.cli", *README_MAIN_JOB, *extra, "--no-progress",
                               "--json", str(j)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0 and "result: clean" in proc.stdout, (run, proc.stdout[-6000:], proc.stderr[-3000:])
        doc = json.loads(j.read_text())
        assert all(a["errors"] == 0 for a in doc["audit"].values()), doc["audit"]
