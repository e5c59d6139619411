# lmforge: two commands do everything on a fresh machine.
#   make demo   create .venv, install, run the main job
#   make test   create .venv, install with test extras, run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
# torch==2.13.0 is pinned so that pip picks the CPU wheel available locally instead of a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test install install-test bench clean

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

test: install-test
	$(BIN)/python -m pytest -q

# bench_llamacpp.py (lmforge vs llama.cpp) runs when llama-bench is built (`python benchmarks/bench_llamacpp.py
# --build`, or LLAMA_BENCH=/path/to/llama-bench); without it, it prints how to get it and the rest go on.
bench: $(VENV)/.base
	$(PIP) install -q --no-build-isolation -e ".[test,bench]"
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf build $(VENV) *.egg-info
