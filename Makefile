# fcp quick start: `make demo` runs the main job, `make test` the whole test suite, `make docs`
# builds the documentation site into site/.
# Each creates .venv on first use (Python 3.11, CPU torch 2.13.0) and installs fcp into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fcp-installed
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: demo test docs bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the local CPU wheel; the project's range then installs nothing more.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench,docs]'
	# NeMo AutoModel is the seed adapters' test oracle; its dependency tree is heavy and its cp
	# modules need only torch and FLA, so it comes without dependencies.
	$(PY) -m pip install --quiet --no-deps 'nemo-automodel==0.7.0'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) -m benchmarks

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .cache .hypothesis site
