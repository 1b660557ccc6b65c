"""Knobs are parsed once and documented in one table; graphctl imports without _C."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from graphctl import knobs as knobs_mod
from graphctl import ops

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=ROOT)


def test_knob_table_in_docs_is_current():
    doc = (ROOT / "docs" / "knobs.md").read_text()
    assert knobs_mod.markdown_table() in doc, "docs/knobs.md is stale: paste `python -m graphctl.knobs` into it"


def test_invalid_knob_value_fails_naming_the_variable():
    r = _py("import graphctl", GRAPHCTL_CHECK_STALE="maybe")
    assert r.returncode != 0 and "GRAPHCTL_CHECK_STALE" in r.stderr and "maybe" in r.stderr


def test_scope_overrides_and_restores():
    assert knobs_mod.knobs.check_stale is False
    with knobs_mod.scope(check_stale=True):
        assert knobs_mod.knobs.check_stale is True
    assert knobs_mod.knobs.check_stale is False
    with pytest.raises(AttributeError):
        with knobs_mod.scope(no_such_knob=1):
            pass


def test_graphctl_imports_and_falls_back_without_extension():
    code = ("import torch, graphctl, json; from graphctl import ops; s = ops.extension_status();"
            "a = torch.arange(5.); ar = torch.empty(5); src = torch.arange(5.) + 9;"
            "ops.swap_through_([a], [ar], [src]);"
            "print(json.dumps([s.loaded, s.error, a.tolist(), ar.tolist()]))")
    r = _py(code, GRAPHCTL_NO_EXTENSION="1")
    assert r.returncode == 0, r.stderr
    loaded, error, a, ar = json.loads(r.stdout)
    assert not loaded and "GRAPHCTL_NO_EXTENSION" in error
    assert a == [9.0, 10.0, 11.0, 12.0, 13.0] and ar == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_built_extension_loads():
    # A build that wrote _build.json but whose _C does not import would silently run the references.
    st = ops.extension_status()
    if st.build is None:
        pytest.skip("graphctl._C was not built in this environment")
    assert st.loaded, st.detail
    assert st.with_cuda == st.build["with_cuda"]


def test_info_command_runs_and_reports_extension():
    exe = pathlib.Path(sys.executable).with_name("graphctl")  # the console script pip installed
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "graphctl.cli"]
    r = subprocess.run(cmd + ["info", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["runtime"]["torch"] and data["extension"]["loaded"] == ops.extension_status().loaded
    r = _py("from graphctl.cli import main; main(['info'])", GRAPHCTL_NO_EXTENSION="1")
    assert r.returncode == 0 and "not loaded" in r.stdout, r.stdout + r.stderr
