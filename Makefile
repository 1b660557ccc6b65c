# Two entry points for a fresh machine (see README.md):
#   make demo   - create .venv, build graphctl (with CUDA kernels when possible), run the main job:
#                 graphctl capture --verify --audit on the built-in reference engine
#   make test   - create .venv, build graphctl, run the test suite
# Everything is installed from this repository's own files into .venv.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch finds the toolkit through CUDA_HOME; an nvcc copied to /usr/local/bin would make it
# guess /usr/local, which has no libcudart, so prefer the toolkit directory itself.
NVCC   := $(shell command -v nvcc 2>/dev/null)
export CUDA_HOME ?= $(if $(NVCC),$(or $(wildcard /usr/local/cuda),$(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))),)
export MAX_JOBS ?= 2

.PHONY: demo example test test-cuda build venv info clean

$(VENV)/.deps: pyproject.toml requirements/venv.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -r requirements/venv.txt
	touch $@

venv: $(VENV)/.deps

$(VENV)/.built: $(VENV)/.deps setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
	$(PIP) install -q --no-build-isolation --no-deps -e .
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

test-cuda: build
	$(PY) -m pytest tests/cuda -v

clean:
	rm -rf $(VENV) build graphctl/_C*.so graphctl/_build.json *.egg-info
