"""The graphctl command through its entry point, on the emulated backend: the capture report,
its JSON schema, the PNG, DOT files, exit codes, clear errors for bad TARGETs and options, info
and bench."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from graphctl.cli import main
from graphctl.cli.capture import SCHEMA, coverage_rows, derive_buckets

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = os.path.join(HERE, "support", "cli_targets.py")


def _capture(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["capture", "--backend", "emulated", "--iters", "2", "--no-progress", *argv])
    return rc, capsys.readouterr().out


def test_builtin_engine_report_json_png_and_dot(capsys, tmp_path):
    j, png, dots = tmp_path / "r.json", tmp_path / "p.png", tmp_path / "dots"
    rc, out = _capture(capsys, "--max-batch", "4", "--verify", "--audit", "--json", str(j), "--plot", str(png),
                       "--dot", str(dots), "--time")
    assert rc == 0, out
    for col in ("bucket", "tokens", "pool MiB", "nodes", "replay us", "eager us", "speedup", "verify", "audit"):
        assert col in out, out
    assert "MTPEngine.step (k=3)" in out and "result: clean" in out and "3-4" in out and "bucket 4" in out
    assert "warmup ms" in out and all(b["warmup_ms"] > 0 for b in json.loads(j.read_text())["report"]["buckets"])
    doc = json.loads(j.read_text())
    assert doc["schema"] == SCHEMA and doc["exit_code"] == 0
    assert [b["bucket"] for b in doc["report"]["buckets"]] == [1, 2, 4]
    assert all(b["nodes"] > 0 and b["replay_us"] > 0 and b["eager_us"] > 0 for b in doc["report"]["buckets"])
    assert len(doc["verify"]) >= 3 and all(v["ok"] for v in doc["verify"])
    # issue 21, no false alarms: padded replays of the engine write nothing eager leaves alone (its padded lanes'
    # slot_mapping is PAD_SLOT, and verify pads the example's state to n), no hazard, host change or bypass
    assert [v for v in doc["verify"] if v["write"] is not None] == [] and "warning" not in out, out
    rep = doc["report"]
    assert rep["padding_hazards"] == rep["host_changes"] == rep["unreached"] == [] and not rep["bypassed"]
    assert set(doc["audit"]) == {"1", "2", "4"} and all(a["errors"] == 0 for a in doc["audit"].values())
    assert [c["batch"] for c in doc["coverage"]] == ["1", "2", "3-4"]
    assert (
        doc["header"]["device"]["name"].startswith("no CUDA device") or "compute_capability" in doc["header"]["device"]
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    files = sorted(os.listdir(dots))
    assert files == ["bucket_1.dot", "bucket_2.dot", "bucket_4.dot"]
    text = (dots / "bucket_4.dot").read_text()
    assert text.startswith("digraph") and "cluster_draft" in text and "cluster_target" in text


def test_verify_mismatch_exits_1(capsys):
    rc, out = _capture(capsys, f"{TARGETS}:baked_host_value", "--buckets", "2,4", "--verify")
    assert rc == 1 and "MISMATCH" in out and "verify: bucket" in out, out


def test_audit_error_exits_1_and_names_the_buffer(capsys):
    rc, out = _capture(capsys, f"{TARGETS}:target_reads_refreshed", "--buckets", "2,4", "--audit")
    assert rc == 1 and "refreshed-in-target" in out and "draft_block_offsets" in out, out


def test_unserved_batch_sizes_exit_3_only_with_hard_fail(capsys):
    rc, out = _capture(capsys, f"{TARGETS}:small", "--buckets", "1,2,4", "--max-batch", "6")
    assert rc == 0 and "5-6" in out and "eager:" in out, out
    rc, out = _capture(capsys, f"{TARGETS}:small", "--buckets", "1,2,4", "--max-batch", "6", "--hard-fail-on-fallback")
    assert rc == 3 and "[5, 6]" in out, out


@pytest.mark.parametrize("target,why", [
    ("no_colon_here", "no ':factory' part"),
    ("graphctl_no_such_module:make", "not importable"),
    ("graphctl.models.mtp:no_such_factory", "has no callable no_such_factory"),
    ("/nonexistent/engine.py:make", "no file"),
    (f"{TARGETS}:not_a_target", "returned dict"),
])
def test_bad_target_is_a_clear_error(capsys, target, why):
    rc, out = _capture(capsys, target)
    assert rc == 2 and "capture target cannot be loaded" in out and why in out and "Fix:" in out, out


@pytest.mark.parametrize("factory,rc,why", [
    ("forward_none", 2, "CaptureTarget.forward is not callable"),
    ("bare_tensor_example", 2, "CaptureTarget.example is not a tuple"),
    ("object_state", 2, "setting up the runner"),
    ("unknown_input", 2, "[nope] static input is not a parameter"),
    ("example_missing_an_argument", 2, "the example does not fit two_args"),
    ("exits_3", 2, "raised SystemExit: 3"),
    ("raises_while_timed", 1, "timing replay against eager failed: RuntimeError: device lost"),
])
def test_a_bad_target_or_failing_forward_is_one_line_never_a_traceback(capsys, factory, rc, why):
    # Regression: issue 30, these exited 1 with a full traceback (a factory's SystemExit(3): exit 3, no output).
    got, out = _capture(capsys, f"{TARGETS}:{factory}", "--max-batch", "2", "--time")
    err = capsys.readouterr().err
    lines = [x for x in out.splitlines() if x.startswith("graphctl capture:")]
    assert got == rc and len(lines) == 1 and why in lines[0], out
    assert "Traceback" not in out + err, out + err
    if rc == 1:
        assert "bucket" in lines[0] and "--traceback" in lines[0], lines


def test_buckets_above_max_batch_are_one_line_exit_2(capsys):
    # Regression: issue 30, an 18-line traceback ending in a DeclarationError, exit 1.
    rc, out = _capture(capsys, "--buckets", "1,2,100", "--max-batch", "4")
    assert rc == 2 and out.strip().startswith("graphctl capture: --buckets 1,2,100 has buckets above") and \
        len(out.strip().splitlines()) == 1, out


def test_a_target_module_in_the_current_directory_is_found(tmp_path, monkeypatch):
    # Regression: issue 30, `graphctl capture my_target:make_target` beside my_target.py: No module named 'my_target'.
    (tmp_path / "my_target_mod.py").write_text(
        "import torch, graphctl\n"
        "def make_target(*, device, max_batch, **_):\n"
        "    x = torch.randn(max_batch, 4).to(device)\n"
        "    return graphctl.CaptureTarget(forward=lambda x: x * 2, example=(x,), inputs=['x'], name='mine')\n")
    exe = os.path.join(os.path.dirname(sys.executable), "graphctl")
    r = subprocess.run([exe, "capture", "my_target_mod:make_target", "--max-batch", "2", "--no-progress"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "mine: emulated graphs" in r.stdout, r.stdout + r.stderr


def test_emulated_runs_are_not_timed_unless_asked(capsys):
    # Regression: issue 30, most of a 69 s CPU run timed replay against eager, numbers the output said meant nothing.
    rc, out = _capture(capsys, f"{TARGETS}:small", "--max-batch", "2")
    assert rc == 0 and "not timed" in out and "--time" in out, out


@pytest.mark.parametrize("argv,why", [
    (["--buckets", "0,2"], "positive integers"),
    (["--buckets", "a,b"], "positive integers"),
    (["--max-batch", "-3"], "positive integer"),
    (["--backend", "tpu"], "invalid choice"),
])
def test_bad_options_are_clear_errors(capsys, argv, why):
    with pytest.raises(SystemExit) as e:
        main(["capture", *argv])
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_every_command_has_help_with_an_example(capsys):
    for cmd in ("capture", "info", "bench"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "example" in capsys.readouterr().out, cmd


def test_info_json_lists_versions_and_features(capsys):
    assert main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"graphctl", "python", "runtime", "build", "extension", "features", "gpus"} <= set(d)
    assert "keep_graph" in d["features"] and "cuda_bindings" in d["features"]


def test_bench_lists_and_refuses_unknown_names(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "draft_loop" in out and "dispatch" in out and "switch_cost" in out
    assert main(["bench", "nope"]) == 2 and "unknown benchmark" in capsys.readouterr().out


def test_bench_arguments_after_double_dash_go_to_the_benchmarks():
    from graphctl.cli import _parser

    a = _parser().parse_args(["bench", "draft_loop", "--out", "/tmp/x"])
    assert a.names == ["draft_loop"] and a.out == "/tmp/x"
    with pytest.raises(SystemExit) as e:
        main(["capture", "--", "--reps", "3"])
    assert e.value.code == 2


def test_bench_without_a_gpu_lists_each_benchmark_as_skipped(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmarks would run")
    assert main(["bench", "draft_loop", "--out", "/tmp/graphctl-bench-test", "--", "--reps", "1"]) == 0
    assert "draft_loop: skipped: needs a CUDA device" in capsys.readouterr().out


def test_console_entry_point_runs_capture(tmp_path):
    # the installed module entry (python -m graphctl.cli) with the built-in engine, as the README runs it
    j = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "graphctl.cli", "capture", "--backend", "emulated", "--max-batch", "2",
                        "--iters", "2", "--json", str(j)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(j.read_text())["schema"] == SCHEMA


def test_derived_buckets_and_coverage_rows():
    assert derive_buckets(1) == [1] and derive_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    rows = coverage_rows({1: "bucket 1", 2: "bucket 2", 3: "bucket 4", 4: "bucket 4", 5: "eager: too large"}, 4)
    assert [(r["batch"], r["tokens"]) for r in rows] == [("1", 4), ("2", 8), ("3-4", 16), ("5", None)]
    assert rows[2]["padding"] == pytest.approx(0.25)


def test_hf_config_target_captures_verifies_and_audits_clean(capsys, tmp_path):
    # Issue 18: graphctl capture --hf-config runs a transformers model's speculative step on the paged cache.
    pytest.importorskip("transformers")
    j = tmp_path / "hf.json"
    rc, out = _capture(capsys, "--hf-config", "tiny-qwen3", "--max-batch", "2", "--verify", "--audit", "--json",
                       str(j))
    assert rc == 0 and "HFEngine.step (tiny-qwen3, Qwen3ForCausalLM, k=3)" in out and "result: clean" in out, out
    doc = json.loads(j.read_text())
    assert all(v["ok"] and v["write"] is None for v in doc["verify"]) and len(doc["verify"]) >= 2
    assert all(a["errors"] == 0 for a in doc["audit"].values())
    assert doc["report"]["host_changes"] == doc["report"]["padding_hazards"] == []


@pytest.mark.parametrize("argv,why", [
    (["--hf-config", "no-such-model"], "unknown --hf-config 'no-such-model'"),
    (["--hf-config", "tiny-llama", "graphctl.cli.builtin:capture_target"], "not both"),
])
def test_bad_hf_config_is_a_clear_error(capsys, argv, why):
    pytest.importorskip("transformers")
    rc, out = _capture(capsys, *argv)
    assert rc == 2 and why in out, out


def test_several_draft_lengths_capture_one_variant_runner(capsys, tmp_path):
    # Regression: issue 33, --draft-len took one value: one runner per k meant one command per k.
    j, dots = tmp_path / "v.json", tmp_path / "dots"
    rc, out = _capture(capsys, "--draft-len", "1", "3", "--max-batch", "2", "--verify", "--audit", "--json", str(j),
                       "--dot", str(dots))
    assert rc == 0 and "k in (1, 3)" in out and "result: clean" in out, out
    doc = json.loads(j.read_text())
    rows = {(b["variant"], b["bucket"]) for b in doc["report"]["buckets"]}
    assert rows == {("k=1", 1), ("k=1", 2), ("k=3", 1), ("k=3", 2)}
    assert {(v["variant"], v["bucket"]) for v in doc["verify"]} == rows and all(v["ok"] for v in doc["verify"])
    assert set(doc["audit"]) == {"k=1 1", "k=1 2", "k=3 1", "k=3 2"}
    assert {(c["variant"], c["batch"], c["tokens"]) for c in doc["coverage"]} == {
        ("k=1", "1", 2), ("k=1", "2", 4), ("k=3", "1", 4), ("k=3", "2", 8)}
    assert sorted(os.listdir(dots)) == ["k1_bucket_1.dot", "k1_bucket_2.dot", "k3_bucket_1.dot", "k3_bucket_2.dot"]


def test_several_draft_lengths_for_a_target_without_variants_is_one_line_exit_2(capsys):
    # Regression: issue 33, a factory that ignores draft_lens would capture one k and report it as several.
    rc, out = _capture(capsys, f"{TARGETS}:small", "--draft-len", "1", "3", "--max-batch", "2")
    assert rc == 2 and "returned no variants" in out, out


@pytest.mark.parametrize("argv, usage, hint", [
    (["capture", "--hf-confg", "tiny"], "usage: graphctl capture", "did you mean '--hf-config'?"),
    (["info", "--jsn"], "usage: graphctl info", "did you mean '--json'?"),
    (["bench", "--reps", "3"], "usage: graphctl bench", "graphctl bench NAME -- --reps"),
    (["captur"], "usage: graphctl ", "did you mean 'capture'?"),
])
def test_a_wrong_flag_gets_its_command_s_usage_and_the_closest_option(capsys, argv, usage, hint):
    # Regression: issue 55, a misspelled flag printed the top-level usage, not the subcommand's, and no suggestion.
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and usage in err and hint in err, err
    assert len(err.splitlines()) <= 12, err  # a usage and one line, not a traceback


def _doc_sample(title: str) -> tuple[list[str], list[str]]:
    """docs/cli.md's sample under ``title``: its command's arguments and the lines it shows."""
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    block = doc.split(title, 1)[1].split("```\n", 1)[1].split("```", 1)[0].splitlines()
    return block[0].removeprefix("$ graphctl ").split(), block[1:]


def _shape(line: str) -> str:
    """A line without what changes run to run: numbers, versions, column widths."""
    import re

    line = re.sub(r"[\s┃│┏┓┗┛┡┩└┘━╇╋┳┻─┬┴┼]+", " ", line)
    return re.sub(r"\d+(\.\d+)*(\+\w+)?", "N", line).strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU sample: the emulated backend's output")
def test_the_cli_doc_s_cpu_sample_is_what_the_cli_prints(capsys):
    # Regression: issue 55, docs/cli.md's samples did not match what the CLI prints (a line missing, old columns).
    argv, shown = _doc_sample("### Sample: CPU (emulated)")
    rc = main([*argv, "--no-progress"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert [_shape(ln) for ln in out] == [_shape(ln) for ln in shown]


def test_the_cli_doc_lists_every_benchmark():
    # Regression: issue 55, docs/cli.md listed 14 of the 16 benchmarks.
    import pathlib
    import re

    from graphctl.cli.bench import available

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    listed = doc.split("first sentence: ", 1)[1].split(";", 1)[0]
    assert set(re.findall(r"`(\w+)`", listed)) == set(available())


def test_max_seqs_names_the_largest_batch_as_the_engines_do(capsys):
    # Regression: issue 55, the engines say max_seqs where the CLI said only --max-batch.
    rc, out = _capture(capsys, "--max-seqs", "2", "--no-progress")
    assert rc == 0 and "buckets [1, 2]" in out, out


def test_every_stage_says_it_started_and_its_time_lands_in_the_output_json_and_report(capsys, tmp_path):
    # Regression: issue 54, verify, audit and the coverage pass printed nothing for up to 30 s after the capture's
    # progress bar ended, and no phase's time was reported anywhere.
    j = tmp_path / "r.json"
    rc = main(["capture", "--backend", "emulated", "--max-batch", "2", "--verify", "--audit", "--time", "--iters", "2",
               "--progress", "--json", str(j)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out
    for name in ("loading the target", "setting up the runner", "capture", "timing", "verify", "audit", "coverage"):
        assert f"graphctl: {name}" in cap.err, (name, cap.err)
    phases = json.loads(j.read_text())["phases_s"]
    assert set(phases) == {"load", "setup", "capture", "timing", "verify", "audit", "coverage"}
    assert all(v >= 0 for v in phases.values())
    assert "phases (s): load " in cap.out
    quiet = main(["capture", "--backend", "emulated", "--max-batch", "2", "--no-progress"])
    assert quiet == 0 and "graphctl: " not in capsys.readouterr().err


@pytest.mark.parametrize("variants", [False, True])
def test_a_runner_s_report_holds_the_seconds_of_each_phase(variants):
    # Regression: issue 54, the report said how long each bucket's warmup and capture took, not verify's, audit's or
    # coverage's; a variant runner has the same phases (one face).
    import graphctl

    fwd = (lambda x, k: x * k) if variants else (lambda x: x * 2)
    f = graphctl.graphed(fwd, buckets=[2, 4], backend="emulated", progress=False, inputs=["x"],
                         variants={"k": (2, 3)} if variants else None)
    args = (torch.randn(4, 3), 2) if variants else (torch.randn(4, 3),)
    f.capture_all(*args)
    assert set(f.report().phases) == {"capture"}
    f.verify()
    f.audit()
    f.coverage()
    f.measure(iters=1)
    phases = f.report().phases
    assert set(phases) == {"capture", "verify", "audit", "coverage", "measure"} and all(v > 0 for v in phases.values())
    assert f.report().to_dict()["phases"] == phases
