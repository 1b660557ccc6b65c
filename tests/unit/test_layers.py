"""The layers point one way (issue 17): every import in ``graphctl/`` (module level, inside
functions, under ``TYPE_CHECKING``) is an edge; the graph has no cycle, and no layer imports one
above it (``cli -> graphs -> state -> ops``, ``docs/architecture.md``)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "graphctl"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the graphctl modules it imports, anywhere in its body."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere_in_graphctl():
    # Issue 17: graphs/{runner, backends, cuda, ...} and state/{bound, transaction} formed cycles through lazy
    # and TYPE_CHECKING imports while docs/architecture.md said imports point down only.
    cycles = _cycles(import_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_walker_sees_imports_inside_functions_and_type_checking(tmp_path):
    # Issue 17: a cycle test that only read module-level imports would pass on the cycles it exists to catch.
    graph = import_graph()
    assert graph, "no modules found"
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\ndef f():\n    from a import c\n"
    tree = ast.parse(src)
    seen = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(seen) == 3  # ast.walk reaches the nested ones the graph is built from
    assert _cycles({"x": {"y"}, "y": {"x"}, "z": set()}) == [["x", "y"]]


# top to bottom; "graphctl" is the root package alone (the public surface re-exports what is below
# it), and the base modules (errors, knobs, toolkit, bindings) import nothing of graphctl
_LAYERS = ["graphctl.cli", "graphctl", "graphctl.testing", "graphctl.integrations", "graphctl.models",
           "graphctl.graphs", "graphctl.families", "graphctl.state", "graphctl.ops", "base"]
_BASE = ("graphctl.errors", "graphctl.knobs", "graphctl.toolkit", "graphctl.bindings")


def _layer(m: str) -> str | None:
    if m == "graphctl":
        return m
    if m in _BASE:
        return "base"
    return next((lay for lay in _LAYERS if lay != "graphctl" and (m == lay or m.startswith(lay + "."))), None)


def test_layers_point_down_only():
    # Issue 17: state must never import graphs, graphs never cli or models, families never graphs, ops nothing above.
    rank = {layer: i for i, layer in enumerate(_LAYERS)}
    bad = [(m, t) for m, ts in import_graph().items() for t in ts
           if _layer(m) and _layer(t) and rank[_layer(t)] < rank[_layer(m)]]
    assert bad == [], bad


def test_every_module_has_a_layer_and_the_root_package_imports_no_cli():
    # Regression: issue 31, graphctl/__init__.py imported cli/target.py, an arrow up that the layer test did not rank.
    unranked = sorted(m for m in import_graph() if _layer(m) is None)
    assert unranked == [], unranked
    assert not [t for t in import_graph()["graphctl"] if t.startswith("graphctl.cli")]


def test_no_module_over_450_lines():
    # Issue 17: runner.py and bound.py had grown past 450 lines.
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}, long


def test_graphs_holds_a_few_modules_and_its_stages_as_subpackages():
    # Issue 52: graphs/ was 37 flat modules; by stage it is a few modules and the capture, findings, replay, analysis
    # and backends subpackages.
    top = sorted(p.name for p in (PKG / "graphs").glob("*.py"))
    assert len(top) <= 12, top
    assert {"capture", "findings", "replay", "analysis", "backends"} <= {p.name for p in (PKG / "graphs").iterdir()
                                                                         if p.is_dir() and p.name != "__pycache__"}


def test_each_finding_kind_is_one_record_defined_with_its_watcher():
    # Issue 52: each finding kind was threaded by hand through six files to the report; now a record type per kind,
    # defined in one module with the watcher that finds it, listed once (findings.KINDS).
    import inspect

    from graphctl.graphs import findings

    modules = {}
    for kind in findings.KINDS:
        assert kind.kind and kind.line is not findings.Finding.line, kind
        modules[kind] = inspect.getmodule(kind).__name__
        if kind.watcher is not None:
            assert inspect.getmodule(kind.watcher).__name__ == modules[kind], (kind, kind.watcher)
    assert len(set(modules.values())) == len(findings.KINDS), modules  # one module a kind
    assert len({k.kind for k in findings.KINDS}) == len(findings.KINDS)


def test_import_graphctl_loads_no_compiler_kernel_library_or_cli():
    # Regression: issue 54, `import graphctl` took 3.5 s against torch's 1.8 s (every CLI call, --help too): dynamo
    # (2 s of it, with sympy and Triton behind it) was imported for two isinstance checks. Heavy imports wait for use.
    import subprocess
    import sys

    heavy = ("torch._dynamo", "torch._inductor", "triton", "transformers", "rich", "hypothesis", "graphctl.cli",
             "graphctl.integrations.hf")
    code = ("import sys, graphctl, graphctl.models; "  # graphctl.testing is Hypothesis' surface: it imports it
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"imported by `import graphctl`: {out.stdout.strip()}"
