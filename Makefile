# One command sets up a fresh machine and runs the tests: `make test`.
# It tests both ends of the declared torch range (pyproject.toml; vefsdp_optim/_torch_compat.py), each in its own venv, with exact pins (an unpinned
# `torch` resolves to a newer release with several GB of CUDA packages on these machines):
#   test-lo: .venv-torch-lo, torch 2.11.0 (a CUDA build, run on the CPU, with the triton
#            it pins, 3.6), the suite without the slow cases
#   test-hi: .venv-torch-hi, torch 2.15.0 (a CUDA build, run on the CPU, with the triton
#            it pins, 3.9), the whole suite
# test-hi installs torch with PIP_CONSTRAINT=/dev/null: a machine's pip constraints may
# cap torch below 2.15 (at the releases kept on its disk). The dev venv .venv (torch
# 2.13.0, the CPU wheel, triton 3.9) is what lint, test-fast, toy and the benchmarks use.
# Each venv is set up once (wheels on disk or in pip's cache); run times:
# docs/performance.md.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP   = $(VENV)/.deps-stamp
VENV_LO ?= .venv-torch-lo
PY_LO    = $(VENV_LO)/bin/python
TORCH_LO_PIN ?= torch==2.11.0
STAMP_LO = $(VENV_LO)/.deps-stamp
VENV_HI ?= .venv-torch-hi
PY_HI    = $(VENV_HI)/bin/python
TORCH_HI_PIN ?= torch==2.15.0
STAMP_HI = $(VENV_HI)/.deps-stamp
# pyproject.toml's hf extra, installed with torch (outside the editable installs' flock)
HF_DEPS  = "transformers>=5.0,<6" "accelerate>=1.10"

# The two test venvs are set up side by side (each pip is one busy core, a minute of
# unpacking torch): their editable installs of this checkout, which write its build/ and
# egg-info, take turns under flock; without flock they are set up one after the other.
EDITABLE   = $(shell command -v flock >/dev/null 2>&1 && echo "flock $(CURDIR)/.pip-editable.lock")
SETUP_JOBS = $(if $(EDITABLE),-j2,)

.PHONY: venv venv-lo venv-hi test test-lo test-hi test-fast lint lint-csrc toy bench bench-full gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23" "setuptools>=70" wheel
	$(PY) -m pip install -q "$(TORCH_PIN)" $(HF_DEPS)
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[dev,triton,hf]"
	touch $(STAMP)

venv: $(STAMP)

$(STAMP_LO): pyproject.toml Makefile
	test -x $(PY_LO) || $(PYTHON) -m venv $(VENV_LO)
	$(PY_LO) -m pip install -q --upgrade "pip>=23" "setuptools>=70" wheel
	$(PY_LO) -m pip install -q "$(TORCH_LO_PIN)" $(HF_DEPS)
	$(EDITABLE) $(PY_LO) -m pip install -q "$(TORCH_LO_PIN)" -e ".[dev,triton,hf]"
	touch $(STAMP_LO)

venv-lo: $(STAMP_LO)

$(STAMP_HI): pyproject.toml Makefile
	test -x $(PY_HI) || $(PYTHON) -m venv $(VENV_HI)
	$(PY_HI) -m pip install -q --upgrade "pip>=23" "setuptools>=70" wheel
	PIP_CONSTRAINT=/dev/null $(PY_HI) -m pip install -q "$(TORCH_HI_PIN)" $(HF_DEPS)
	PIP_CONSTRAINT=/dev/null $(EDITABLE) $(PY_HI) -m pip install -q "$(TORCH_HI_PIN)" -e ".[dev,triton,hf]"
	touch $(STAMP_HI)

venv-hi: $(STAMP_HI)

# make test ends with its own cost, so that a change that leaks or slows shows in the CI log:
# each pytest run prints its ten slowest cases (--durations) and the suite's own cost (wall
# time, the highest load, the most threads one distributed worker held: tests/conftest.py);
# then the whole target's wall time and the user and system CPU time of everything it ran.
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory $(SETUP_JOBS) venv-lo venv-hi && \
	  $(MAKE) --no-print-directory test-lo test-hi; rc=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s wall, the venvs' setup included;" \
	    "CPU time (user, system) of the shell, then of everything it ran:"; times; exit $$rc

test-lo: $(STAMP_LO)
	$(PY_LO) -m pip install -q --no-deps --no-build-isolation -e .
	$(VENV_LO)/bin/pytest -q -m "not slow" --durations=10 tests

test-hi: $(STAMP_HI)
	$(PY_HI) -m pip install -q --no-deps --no-build-isolation -e .
	$(VENV_HI)/bin/pytest -q --durations=10 tests

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow" --durations=10 tests

lint: $(STAMP) lint-csrc
	$(VENV)/bin/ruff check vefsdp_optim sharding comm tests examples benchmarks tools

# The C++ kernel sources (vefsdp_optim/_kernels/csrc): warnings are errors, for the native and
# (on x86-64) the portable, AVX2 and AVX-512 (VBMI) instruction sets, and the files that
# include torch's headers (the operator, the bfloat16 products) against them.
CXX_LINT ?= c++
CSRC      = vefsdp_optim/_kernels/csrc
CXX_WARN  = -fsyntax-only -std=c++20 -Wall -Wextra -Werror -ffp-contract=off
TORCH_INC = $$($(PY) -c "from torch.utils.cpp_extension import include_paths; \
  print(' '.join('-isystem ' + p for p in include_paths()))")
lint-csrc: $(STAMP)
	$(CXX_LINT) $(CXX_WARN) -march=native $(CSRC)/quant8_adam.cpp
	if [ "$$(uname -m)" = x86_64 ]; then $(CXX_LINT) $(CXX_WARN) -mno-avx512f $(CSRC)/quant8_adam.cpp; \
	  $(CXX_LINT) $(CXX_WARN) -march=haswell $(CSRC)/quant8_adam.cpp; \
	  $(CXX_LINT) $(CXX_WARN) -march=icelake-server $(CSRC)/quant8_adam.cpp; fi
	$(CXX_LINT) $(CXX_WARN) -DTORCH_EXTENSION_NAME=lint -I$(CSRC) $(TORCH_INC) $(CSRC)/quant8_adam_op.cpp
	$(CXX_LINT) $(CXX_WARN) -march=native -DTORCH_EXTENSION_NAME=lint $(TORCH_INC) $(CSRC)/bf16_matmul.cpp
	if [ "$$(uname -m)" = x86_64 ]; then \
	  $(CXX_LINT) $(CXX_WARN) -DTORCH_EXTENSION_NAME=lint $(TORCH_INC) $(CSRC)/bf16_matmul.cpp; fi

toy: $(STAMP)
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[plot]"
	$(PY) -m vefsdp_optim.toy

bench: $(STAMP)
	$(PY) -m benchmarks.run --quick

bench-full: $(STAMP)
	$(PY) -m benchmarks.run --full

# On a machine with a CUDA GPU, with its own torch (the first python whose torch sees the
# GPU; GPU_PYTHON=... overrides; nothing is installed): every optimizer on plain
# parameters, FSDP2 and fully_shard with NCCL bit for bit, a DCP round trip, the sync and
# stream checks, the GPU kernel tests and the GPU benchmarks, each part in its own
# process and time limit, in under 8 minutes (tools/gpu_check.py). It writes
# benchmarks/out/gpu/ and the GPU section of benchmarks/REPORT.md. Without a CUDA device it
# says so and exits 0 at once. gpu-check-dry: the same parts with gloo on CPU tensors.
gpu-check:
	$(PYTHON) tools/gpu_check.py

.PHONY: gpu-check-dry
gpu-check-dry: $(STAMP)
	$(PY) tools/gpu_check.py --cpu-dry-run

clean:
	rm -rf $(VENV) $(VENV_LO) $(VENV_HI) build dist *.egg-info
