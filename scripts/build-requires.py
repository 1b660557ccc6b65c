"""Print pyproject.toml's [build-system] requires, one per line, for `pip install` before a
build without isolation (the Makefile's first step): pyproject.toml stays the one list."""
from __future__ import annotations

import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as fh:
    sys.stdout.write("\n".join(tomllib.load(fh)["build-system"]["requires"]) + "\n")
