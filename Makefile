# lmforge: two commands do everything on a fresh machine.
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install with test extras, run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
# torch==2.13.0 is pinned so that pip picks the CPU wheel available locally instead of a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test sanitize install install-test bench gpu-check gpu-check-dry gpu-check-prepare reference clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Build requirements are installed into the venv and the package is built without isolation, so that
# the C++ extension rebuilds incrementally (build/) instead of from scratch on every install.
$(VENV)/.base: $(BIN)/python
	$(PIP) install -q $(TORCH)
	$(PIP) install -q "scikit-build-core>=0.10" "nanobind>=2.4" ninja
	touch $@

install: $(VENV)/.base
	$(PIP) install -q --no-build-isolation -e ".[serve]"

install-test: $(VENV)/.base
	$(PIP) install -q --no-build-isolation -e ".[test,serve]"

demo: install
	$(BIN)/lmforge speedrun

# Two workers (pytest-xdist), one torch thread each; tests marked `serial` (they measure time) run alone.
JOBS ?= 2
test: install-test
	$(BIN)/python -m pytest -q -n $(JOBS)

# The C++ extension built with ASan + UBSan into build/sanitize (the installed one untouched), its two fuzzers and
# the kernel and tokenizer tests against it (tools/sanitize.sh; ~8 min on 2 cores). ARGS go to pytest.
sanitize: install-test
	PYTHON=$(BIN)/python bash tools/sanitize.sh $(ARGS)

# bench_llamacpp.py (lmforge vs llama.cpp) runs when llama-bench is built (`python benchmarks/bench_llamacpp.py
# --build`, or LLAMA_BENCH=/path/to/llama-bench); without it, it prints how to get it and the rest go on.
bench: $(VENV)/.base
	$(PIP) install -q --no-build-isolation -e ".[test,bench]"
	$(BIN)/python benchmarks/run_all.py

# The GPU check (tools/gpu_check.py): on the GPU machine with its own python3 (torch + CUDA there), no network;
# the wheels and corpus it may need come from `make gpu-check-prepare` on a machine with PyPI access (.gpu-check/).
# `make gpu-check-dry` runs every stage on this CPU at tiny shapes (minutes), then the whole --quick dry run's test;
# `make test` runs the probe, generation and serving stages at their smallest (tests/tools/test_gpu_check.py).
GPU_PYTHON ?= python3
gpu-check:
	PYTHON=$(GPU_PYTHON) bash tools/gpu_check.sh $(ARGS)

gpu-check-dry: install-test
	PYTHON=$(BIN)/python bash tools/gpu_check.sh --dry-run $(ARGS)
	LMFORGE_GPU_DRY_RUN=1 $(BIN)/python -m pytest -q tests/tools/test_gpu_check.py

gpu-check-prepare: install-test
	PYTHON=$(BIN)/python bash tools/gpu_check.sh --prepare

# docs/reference/ (every config key and CLI flag) regenerated from the code; tests/test_docs_reference.py
# fails while the committed files differ from what this writes (needs the installed package: make install).
reference:
	$(BIN)/python tools/gen_reference.py

clean:
	rm -rf build $(VENV) *.egg-info
