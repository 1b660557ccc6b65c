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
