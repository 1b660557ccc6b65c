# Two entry points for a fresh machine (see README.md):
#   make demo   - create .venv, build graphctl (with CUDA kernels when possible), run the main job:
#                 graphctl capture --verify --audit on the built-in reference engine
#   make test   - create .venv, build graphctl, run the test suite
#   make lint   - the linters CI runs (ruff, mypy on state/ and ops/, clang-format on csrc/)
# Everything is installed from pyproject.toml, the one list of dependencies: first its build
# requirements (torch among them), then graphctl itself, editable, with the dev extra, built
# against that torch (no build isolation). setup.py finds the CUDA toolkit itself.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
export MAX_JOBS ?= 2
# pip's notices (a newer pip exists, running as root) are not what a newcomer came to read
export PIP_DISABLE_PIP_VERSION_CHECK = 1
export PIP_ROOT_USER_ACTION = ignore

.PHONY: demo example test test-cuda lint build venv info clean

$(VENV)/.deps: pyproject.toml scripts/build-requires.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $$($(PYTHON) scripts/build-requires.py)
	touch $@

venv: $(VENV)/.deps

$(VENV)/.built: $(VENV)/.deps setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
	@# setuptools' editable-install notice (a warning, whatever the mode) is not for a newcomer to read
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install -q --no-build-isolation -e '.[dev]'
	touch $@

build: $(VENV)/.built

info: build
	$(VENV)/bin/graphctl info

demo: build
	$(VENV)/bin/graphctl capture --verify --audit

example: build
	$(PY) examples/draft_switch.py

# pytest exits 5 when it collected nothing; that must not pass silently, so say so and fail.
test: build
	$(PY) -m pytest tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# ruff (pyflakes, pycodestyle, bugbear, isort, pyupgrade), mypy on state/ and ops/, clang-format on csrc/
lint: build
	$(VENV)/bin/ruff check graphctl tests bench examples scripts setup.py
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run --Werror csrc/*.cpp csrc/*.h csrc/cuda/*.cu

test-cuda: build
	$(PY) -m pytest tests/cuda -v

clean:
	rm -rf $(VENV) build graphctl/_C*.so graphctl/_build.json *.egg-info
