# Two entry points for a fresh machine (see README.md):
#   make demo   - create .venv, build graphctl (with CUDA kernels when possible), run the main job:
#                 graphctl capture --verify --audit on the built-in reference engine
#   make test   - create .venv, build graphctl, run the test suite
#   make lint   - the linters CI runs (ruff, mypy on all of graphctl/, clang-format on csrc/)
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
	@echo "graphctl setup 1/3: $(VENV) with torch and the build requirements (first time: 2-5 min, a 3 GB download)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $$($(PYTHON) scripts/build-requires.py)
	touch $@

venv: $(VENV)/.deps

$(VENV)/.built: $(VENV)/.deps setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
	@echo "graphctl setup 2/3: compiling graphctl._C, installing graphctl and its dev tools (CPU kernels: 2-3 min; with CUDA kernels, on a GPU machine: 5-7 min)"
	@# setuptools' editable-install notice (a warning, whatever the mode) is not for a newcomer to read
	@# pip -v, shown as a line per compiled source (scripts/build-progress.py): -q showed nothing for minutes
	PYTHONWARNINGS="ignore:Editable installation" $(PY) scripts/build-progress.py $(PIP) install -v --no-build-isolation -e '.[dev]'
	touch $@

build: $(VENV)/.built

info: build
	$(VENV)/bin/graphctl info

demo: build
	@echo "graphctl 3/3: the main job, graphctl capture --verify --audit (CPU: under a minute; GPU: about a minute)"
	$(VENV)/bin/graphctl capture --verify --audit

example: build
	$(PY) examples/draft_switch.py

# pytest exits 5 when it collected nothing; that must not pass silently, so say so and fail.
test: build
	@echo "graphctl 3/3: the test suite (CPU: 10-15 min on 2 cores)"
	$(PY) -m pytest tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# ruff (pyflakes, pycodestyle, bugbear, isort, pyupgrade), mypy on all of graphctl/, clang-format on csrc/
lint: build
	$(VENV)/bin/ruff check graphctl tests bench examples scripts setup.py
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run --Werror csrc/*.cpp csrc/*.h csrc/cuda/*.cu

test-cuda: build
	$(PY) -m pytest tests/cuda -v

clean:
	rm -rf $(VENV) build graphctl/_C*.so graphctl/_build.json *.egg-info
