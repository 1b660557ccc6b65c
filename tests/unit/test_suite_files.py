"""The test tree itself: pytest's default ``rootdir``-relative import mode needs each test module's basename to be
unique across the tree (no ``__init__.py`` in the test folders), or collection stops with "import file mismatch"."""
from __future__ import annotations

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique():
    # CI of stop 56: tests/property/test_runner_face.py and tests/regressions/test_runner_face.py stopped collection.
    seen = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
