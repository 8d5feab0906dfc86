# One command sets up a fresh machine and runs the tests: `make test`.
# The environment pins torch to 2.13.0: an unpinned `torch` resolves to a newer
# release with several GB of CUDA packages on these machines.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP   = $(VENV)/.deps-stamp

.PHONY: venv test test-fast lint toy bench bench-full clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23" "setuptools>=70" wheel
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VENV)/bin/pytest -q tests

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check vefsdp_optim sharding comm tests examples benchmarks

toy: $(STAMP)
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[plot]"
	$(PY) -m vefsdp_optim.toy

bench: $(STAMP)
	$(PY) -m benchmarks.run --quick

bench-full: $(STAMP)
	$(PY) -m benchmarks.run --full

clean:
	rm -rf $(VENV) build dist *.egg-info
